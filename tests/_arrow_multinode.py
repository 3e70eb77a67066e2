"""Memory-mapped tables whose files are missing where the workers run: a scenario of tests/_multinode_main.py's
cluster (read by tests/test_multinode.py).

The driver builds a Hugging Face dataset and an ArrowDataset over cache / IPC files in a temp folder, records
torch's batches, then renames the folder: the files are now missing on every node (the driver's own maps stay
valid, as mapped files do on Linux), which is what a worker on a node without the driver's local disk sees. Workers
are placed on the data nodes (`ray_remote_args`). Returns facts for the test to check.
"""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

N = 40


def files_missing_facts(remote_args: dict, worker_nodes: set, driver_node: str) -> dict:
    """Both datasets' batches with their files gone, from workers placed by `remote_args` (on `worker_nodes`)."""
    import datasets
    import pyarrow as pa
    import pyarrow.feather as feather
    import torch

    import raydl
    from tests import _arrow_helpers as H
    from tests._parity import assert_batches_equal

    facts: dict = {}
    folder = tempfile.mkdtemp(prefix="raydl_arrow_mn_")
    gone = folder + ".gone"
    try:
        datasets.Dataset.from_dict(H.metadata_columns(N)).save_to_disk(os.path.join(folder, "hf"))
        hf = datasets.load_from_disk(os.path.join(folder, "hf"))
        feather.write_feather(
            pa.table(H.metadata_columns(N)), os.path.join(folder, "t.arrow"), compression="uncompressed"
        )
        ads = raydl.ArrowDataset(os.path.join(folder, "t.arrow"))
        facts["ipc_mapped"] = ads.is_memory_mapped
        expected = {
            name: list(torch.utils.data.DataLoader(ds, batch_size=5)) for name, ds in (("hf", hf), ("ipc", ads))
        }

        os.rename(folder, gone)  # missing on every node from here on
        for name, ds in (("hf", hf), ("ipc", ads)):
            loader = raydl.DataLoader(
                ds, batch_size=5, num_workers=2, timeout=60, ray_remote_args=remote_args, persistent_workers=True
            )
            got = list(loader)
            same = len(got) == len(expected[name])
            for a, b in zip(expected[name], got):
                try:
                    assert_batches_equal(a, b)
                except AssertionError:
                    same = False
            facts[f"{name}_same_as_torch"] = same
            facts[f"{name}_worker_nodes"] = sorted({r.node_id in worker_nodes for r in loader.worker_records})
            facts[f"{name}_driver_node_used"] = any(r.node_id == driver_node for r in loader.worker_records)
            loader.shutdown()
            probe = raydl.DataLoader(
                H.MemoryProbe(ds, n=1),
                batch_size=None,
                num_workers=1,
                collate_fn=H.identity,
                timeout=60,
                ray_remote_args=remote_args,
            )
            facts[f"{name}_places"] = list(probe)[0]["places"]
    finally:
        for path in (folder, gone):
            shutil.rmtree(path, ignore_errors=True)
    return facts
