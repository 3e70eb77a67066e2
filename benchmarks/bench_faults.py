"""What a lost worker costs the training loop on a real (virtual) network: the namespace cluster
(cluster/netns_testbed.py: a head and two worker nodes, each its own network namespace and address, links capped
with `tc tbf`), the driver in the head's namespace, workers on TCP lanes (the defaults). Faults, mid-epoch, on the
node of worker 1:
  * process: worker 1's process SIGKILLed (its lane ends with a reset at once);
  * node: every process of its node SIGKILLed (a raylet gone; Ray has not declared the node dead yet);
  * silent: its node's link set down (no RST, no FIN: a frozen VM, a dead switch port), then up once the loop has
    its next batch (NOTE [ raydl silent node ]).
with 1 and 2 workers per worker node; `--lane off`: the loader with `ray_lane=False` (Ray's calls: the silence is
told by a probe of the node's raylet port). Reported: the stall (the longest wait for a batch after the fault, against
the median before it), when the loss was noticed (the recovery's log line), the restarts, where the replacements
run. A fresh cluster per case.

    .venv/bin/python -m benchmarks.bench_faults [--rate 10gbit] [--cases process,node,silent] [--per-node 1,2]
        [--lane on|off]

Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

from benchmarks.common.clusters import run_in_netns_head
from benchmarks.common.results import md_table, printed_report

ITEM_CPU_S = 0.01  # each sample spins this long on the worker's CPU (time.thread_time)
BATCH = 2


def _driver(fault: str, per_node: int, seed: str, lane: bool) -> dict:
    """In the head's namespace: an epoch of 400 samples; the fault once every worker has its lane (with lanes) and 20
    batches are in; the waits for every batch."""
    import ray
    import torch
    from torch.utils.data import Dataset

    import raydl
    from cluster import netns_testbed

    class Spin(Dataset):
        def __len__(self) -> int:
            return 400

        def __getitem__(self, i):
            end = time.thread_time() + ITEM_CPU_S
            while time.thread_time() < end:
                pass
            return torch.tensor([i])

    said: list[tuple[float, str]] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append((time.monotonic(), record.getMessage()))

    logging.getLogger("raydl").addHandler(Said(logging.WARNING))
    ray.init()
    cluster = netns_testbed.from_state(os.environ["RAYDL_NETNS_TAG"])
    ips = [cluster.ip(n) for n in cluster.nodes]
    loader = raydl.DataLoader(
        Spin(),
        batch_size=BATCH,
        num_workers=2 * per_node,
        timeout=300,
        ray_startup_timeout_s=240,
        ray_seed=seed,
        ray_lane=lane,
    )
    it = iter(loader)
    out, waits = [], []
    last = time.monotonic()
    while len(out) < 20 or (
        lane and (it._calls._lanes is None or not all(it._calls._lanes.has_lane(w) for w in range(2 * per_node)))
    ):
        out += next(it).flatten().tolist()
        now = time.monotonic()
        waits.append(now - last)
        last = now
    before = waits[5:]
    victim_ip = it.worker_records[1].node_ip
    victim = ips.index(victim_ip)
    t0 = time.monotonic()
    if fault == "process":
        os.kill(it.worker_records[1].pid, 9)
    elif fault == "node":
        cluster.kill_node(victim)
    else:
        cluster.link_down(victim)
    after, first_after = [], None
    last = t0
    try:
        for batch in it:
            out += batch.flatten().tolist()
            now = time.monotonic()
            after.append(now - last)
            last = now
            if fault == "silent" and sum(it._pool.restarts) and first_after is None:
                first_after = now
                cluster.link_up(victim)  # late replies of the silent node may come now: dropped
    finally:
        if fault == "silent" and first_after is None:
            cluster.link_up(victim)
    noticed = [t - t0 for t, line in said if "died" in line or "silent" in line]
    facts = {
        "fault": fault,
        "per_node": per_node,
        "seed": seed,
        "lane": lane,
        "every_batch_once_in_order": out == list(range(400)),
        "median_wait_before_s": statistics.median(before),
        "stall_s": max(after),
        "noticed_s": noticed[0] if noticed else None,
        "restarts": list(it._pool.restarts),
        "victim_ip": victim_ip,
        "worker_ips": [r.node_ip for r in it.worker_records],
        "said": [line[:300] for _, line in said],
    }
    del it
    loader.shutdown()
    ray.shutdown()
    return facts


def _run_case(fault: str, per_node: int, rate: str, seed: str, lane: str) -> dict:
    from cluster import netns_testbed

    tag = f"f{os.getpid() % 100000}"
    cluster = netns_testbed.NetnsCluster(workers=2, tag=tag, rate=rate)
    with cluster:
        return run_in_netns_head(
            cluster, "bench_faults", "--driver", fault, str(per_node), seed, lane, RAYDL_NETNS_TAG=tag
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="10gbit")
    ap.add_argument("--cases", default="process,node,silent")
    ap.add_argument("--per-node", default="1,2")
    ap.add_argument("--seed", default="worker", help="ray_seed of the loader")
    ap.add_argument("--lane", choices=["on", "off"], default="on", help="off: ray_lane=False (Ray's calls)")
    ap.add_argument("--driver", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.driver:
        fault, per_node, seed, lane = a.driver
        print("RESULT " + json.dumps(_driver(fault, int(per_node), seed, lane == "on")), flush=True)
        return
    rows, raw = [], []
    for fault in a.cases.split(","):
        for per_node in map(int, a.per_node.split(",")):
            r = _run_case(fault, per_node, a.rate, a.seed, a.lane)
            raw.append(r)
            rows.append(
                [
                    fault,
                    per_node,
                    f"{r['stall_s']:.1f}",
                    "-" if r["noticed_s"] is None else f"{r['noticed_s']:.1f}",
                    f"{r['median_wait_before_s'] * 1000:.0f}",
                    r["restarts"],
                    "yes" if r["every_batch_once_in_order"] else "NO",
                    sorted(set(r["worker_ips"])),
                ]
            )
            print(json.dumps(r), flush=True)
    print(
        f"\nlinks {a.rate}; workers on the two worker nodes; {BATCH} samples of {ITEM_CPU_S * 1000:.0f} ms CPU a batch;"
        f" {'TCP lanes' if a.lane == 'on' else 'ray_lane=False'}"
    )
    print("fault on worker 1's node mid-epoch; stall: the longest wait for a batch after it\n")
    header = ["fault", "workers/node", "stall s", "noticed s", "median wait before ms", "restarts", "once, in order"]
    print(md_table([*header, "workers' nodes after"], rows))


if __name__ == "__main__":
    with printed_report("bench_faults", quick="--quick" in sys.argv, enabled="--driver" not in sys.argv):
        main()
