"""4 MiB batches from two worker nodes to the driver over a real (virtual) network: the namespace cluster
(cluster/netns_testbed.py, each node its own network namespace and address, links capped with `tc tbf`), the
driver in the head's namespace. MB/s of batches handed to the loop for TCP lanes, TCP lanes with TLS (a cluster
started with Ray's TLS) and Ray's transfer (`ray_lane=False`, with and without TLS), against the head's link cap
(every batch enters the driver's node through its one link).

    .venv/bin/python -m benchmarks.bench_netns [--rate 10gbit] [--mb 512] [--reps 3]

Needs root (network namespaces). Starts and removes two clusters (one plain, one TLS) of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.common.clusters import run_in_netns_head
from benchmarks.common.results import printed_report

BATCH_MB = 4


def _driver(mb: int, reps: int, modes: list) -> dict:
    """In the head's namespace: per mode, `reps` timed epochs of `mb` MiB (after a warm-up epoch that starts the
    workers and opens their lanes); MB/s of each."""
    import ray
    import torch
    from torch.utils.data import Dataset

    import raydl

    class Blocks(Dataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i):
            return torch.full((BATCH_MB << 20,), i % 251, dtype=torch.uint8)

    ray.init()
    n = mb // BATCH_MB
    out: dict = {}
    for mode in modes:
        loader = raydl.DataLoader(
            Blocks(n),
            batch_size=None,  # each item is one 4 MiB batch
            num_workers=2,  # raydl's placement: one on each worker node
            persistent_workers=True,
            timeout=120,
            ray_startup_timeout_s=240,
            ray_lane=mode == "lanes",
        )
        for _ in loader:  # warm-up: workers started, lanes open
            pass
        runs, lane_share = [], []
        for _ in range(reps):
            it = iter(loader)
            t0 = time.perf_counter()
            got = sum(b.numel() for b in it)
            runs.append(got / 1e6 / (time.perf_counter() - t0))  # MB (10^6 bytes) per second
            lane_share.append(it._calls.lane_calls / max(1, it._sched.calls_sent))
            ips = sorted(r.node_ip for r in it.worker_records)
            del it
        loader.shutdown()
        out[mode] = {"mb_s": runs, "lane_share": lane_share, "worker_ips": ips}
    ray.shutdown()
    return out


def _run_cluster(tls: bool, rate: str, mb: int, reps: int, modes: list) -> dict:
    from cluster import netns_testbed

    cluster = netns_testbed.NetnsCluster(workers=2, tag=f"b{os.getpid()}{'t' if tls else ''}", rate=rate, tls=tls)
    with cluster:
        return run_in_netns_head(
            cluster, "bench_netns", "--driver", ",".join(modes), "--mb", str(mb), "--reps", str(reps)
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="10gbit")
    ap.add_argument("--mb", type=int, default=512, help="MiB per timed epoch")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.driver:
        print("RESULT " + json.dumps(_driver(a.mb, a.reps, a.driver.split(","))), flush=True)
        return
    results = {}
    for tls in (False, True):
        for mode, res in _run_cluster(tls, a.rate, a.mb, a.reps, ["lanes", "ray"]).items():
            results[("TCP lanes" if mode == "lanes" else "Ray's transfer") + (" + TLS" if tls else "")] = res
    from cluster.netns_testbed import _rate_bits

    cap = _rate_bits(a.rate) / 8 / 1e6
    print(f"\n{BATCH_MB} MiB batches, 2 worker nodes -> driver, links {a.rate} (head's link: {cap:.0f} MB/s), ")
    print(f"{a.mb} MiB per epoch, median of {a.reps} epochs (all runs in brackets)\n")
    print("| path | MB/s | of the head's link | runs | calls over lanes |")
    print("|---|---|---|---|---|")
    for name, res in results.items():
        med = statistics.median(res["mb_s"])
        runs = ", ".join(f"{x:.0f}" for x in res["mb_s"])
        share = statistics.median(res["lane_share"])
        print(f"| {name} | {med:.0f} | {med / cap:.0%} | {runs} | {share:.0%} |")
    print("\nworker nodes:", {k: v["worker_ips"] for k, v in results.items()})


if __name__ == "__main__":
    with printed_report("bench_netns", quick="--quick" in sys.argv, enabled="--driver" not in sys.argv):
        main()
