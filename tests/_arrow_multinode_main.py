"""Run in a subprocess by tests/test_arrow.py: memory-mapped tables on a two-node loopback cluster.

The driver builds a Hugging Face dataset and an ArrowDataset over cache / IPC files in a temp
folder, records torch's batches, then renames the folder: the files are now missing on every
node (the driver's own maps stay valid, as mapped files do on Linux), which is what a worker on
a node without the driver's local disk sees. Workers are placed on the second node (resource
"other"). Prints one JSON line of facts for the test to check.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback only
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.feather as feather  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import raydl  # noqa: E402
from tests import _arrow_helpers as H  # noqa: E402
from tests._parity import assert_batches_equal  # noqa: E402
from tests._session import patient_clusters  # noqa: E402

N = 40


def main() -> None:
    facts: dict = {}
    patient_clusters()  # node start-up bounds sized for a loaded machine
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    other = cluster.add_node(num_cpus=1, resources={"other": 4}, node_ip_address="127.0.0.1")
    folder = tempfile.mkdtemp(prefix="raydl_arrow_mn_")
    gone = folder + ".gone"
    try:
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        facts["nodes"] = len([n for n in ray.nodes() if n["Alive"]])
        driver_node = ray.get_runtime_context().get_node_id()
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
        remote_args = {"num_cpus": 0, "resources": {"other": 1}}
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
            facts[f"{name}_worker_nodes"] = sorted({r.node_id == other.node_id for r in loader.worker_records})
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
        ray.shutdown()
        cluster.shutdown()
        for path in (folder, gone):
            shutil.rmtree(path, ignore_errors=True)
    print("FACTS " + json.dumps(facts))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
