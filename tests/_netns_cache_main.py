"""Run by tests/test_netns.py (tests/_netns.py's `run_driver(..., module=...)`) in the head's namespace of a
namespace cluster started with `private=True` (cluster/netns_testbed.py: each worker node its own tmpfs at
`private_dir`): a driver that joins it and prints one `FACTS {json}` line.

Scenario `cache`: moto's S3 server and a byte-counting proxy in this process's namespace, the proxy listening on the
head's bridge address (the worker nodes reach it across the bridge, each from its own address); a small Parquet
corpus uploaded; a `raydl.ParquetDataset("s3://...", cache_dir=private_dir)` read by a loader with one worker on each
worker node, two epochs, against torch's DataLoader over the same files in a local folder with the same generator
(and the 2 node slots the run settles).
The facts: the batches, and the GET bytes the proxy relayed to each client address (per epoch).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import numpy as np
import ray
import torch

import raydl
from tests._netns_driver import main, state_cluster
from tests._s3 import FaultProxy, MotoServer, s3fs, upload_folder

FILES, GROUPS, ROWS, PAYLOAD = 8, 4, 150, 256  # 32 row groups of 150 rows, ~40 KB each (incompressible payload)
BATCH, SEED, EPOCHS = 64, 11, 2


def _write_corpus(
    folder: str, files: int = FILES, groups: int = GROUPS, rows: int = ROWS, payload: int = PAYLOAD
) -> None:
    """`files` Parquet files of `groups` row groups of `rows` rows: an id and `payload` incompressible bytes
    (benchmarks/bench_across_nodes.py writes its corpus with it too)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    for f in range(files):
        ids = np.arange(f * groups * rows, (f + 1) * groups * rows)
        table = pa.table({"id": ids, "payload": [rng.bytes(payload) for _ in ids]})
        pq.write_table(table, os.path.join(folder, f"part-{f:03d}.parquet"), row_group_size=rows)


def _batches(loader) -> list:
    return [(b["id"].tolist(), list(b["payload"])) for b in loader]


def cache(facts: dict) -> None:
    cluster = state_cluster()
    head = cluster.ip(0)
    ip_of = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    corpus = tempfile.mkdtemp(prefix="raydl-netns-corpus-")
    moto = proxy = None
    try:
        _write_corpus(corpus)
        # moto on the head's bridge address, the proxy in front of it on the same address: the endpoint the workers
        # are given, reached across the bridge from their nodes' own addresses
        moto = MotoServer(host=head)
        fs = moto.filesystem()
        fs.create_dir("corpus")
        upload_folder(corpus, fs, "corpus/data")
        proxy = FaultProxy(moto.port, host=head, upstream_host=head)
        facts["endpoint"] = f"{head}:{proxy.port}"

        corpus_bytes = int(raydl.ParquetDataset(corpus).nbytes)  # the row groups' bytes: one reading of the corpus
        facts["corpus_bytes"] = corpus_bytes
        limit = corpus_bytes // 4  # (the shuffle window follows it: the reference has the same)
        # the reference reads through a node cache of the head's in a folder of its own, ended before the run's
        local = raydl.ParquetDataset(corpus, cache_dir=os.path.join(corpus, "cache"), cache_limit=limit)
        g = torch.Generator().manual_seed(SEED)
        # the run's workers are on the 2 worker nodes: its order is that of 2 slots, one a node (NOTE [ raydl node slots ])
        sampler = raydl.ParquetShuffleSampler(local, g, batch_size=BATCH, node_slots=2)
        reference = torch.utils.data.DataLoader(local, batch_size=BATCH, sampler=sampler, generator=g)
        expected = [_batches(reference) for _ in range(EPOCHS)]
        facts["reference_caches_released"] = raydl.release_node_caches()

        ds = raydl.ParquetDataset(
            "s3://corpus/data/",
            filesystem=s3fs(proxy.port, attempts=3, host=head),
            cache_dir=cluster.private_dir,
            cache_limit=limit,
        )
        facts["footer_bytes_by_ip"] = dict(proxy.get_bytes_by_client)  # the driver read the footers
        loader = raydl.DataLoader(
            ds,
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            generator=torch.Generator().manual_seed(SEED),
            persistent_workers=False,  # each epoch draws its base seed as torch's reference does (warm workers reused)
            timeout=60,
            ray_startup_timeout_s=240,
        )
        facts["epochs"] = []
        for epoch in range(EPOCHS):
            proxy.reset_counts()
            it = iter(loader)
            got = _batches(it)
            cache = loader.stats().cache
            per_node = cache["per_node"]
            facts["epochs"].append(
                {
                    "same_as_torch": got == expected[epoch],
                    "rows_once": sorted(i for ids, _ in got for i in ids) == list(range(len(local))),
                    "get_bytes_by_ip": dict(proxy.get_bytes_by_client),
                    "get_bytes": proxy.get_bytes,
                    "cache_fetched_by_ip": {ip_of.get(n, n): st.get("bytes_fetched") for n, st in per_node.items()},
                    "from_peers_by_ip": {ip_of.get(n, n): st.get("bytes_from_peers") for n, st in per_node.items()},
                    "peer_fallbacks": sum(st.get("peer_fallbacks", 0) for st in per_node.values()),
                    "placement": cache.get("placement", {}).get("mode"),
                    "worker_ips": sorted(r.node_ip for r in it.worker_records),
                }
            )
            del it
        facts["caches_released"] = raydl.release_node_caches()
    finally:
        if proxy is not None:
            proxy.stop()
        if moto is not None:
            moto.stop()  # its process, by its handle (pid)
        shutil.rmtree(corpus, ignore_errors=True)
    facts["endpoints_closed"] = [_refused(head, p.port) for p in (proxy, moto) if p is not None]


def _refused(host: str, port: int) -> bool:
    """Nothing listens on host:port any more."""
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


if __name__ == "__main__":
    main({"cache": cache})
