#!/usr/bin/env python3
"""The trainer's CPU per batch against the size of the pool: 4, 16, 32 and 64 workers over cluster_utils nodes.

    python -m benchmarks.bench_pool_cpu                       # 4, 16, 32, 64 workers, 5 stretches each (~10 min)
    python -m benchmarks.bench_pool_cpu --sizes 4 64 --reps 3 # a quicker look
    python -m benchmarks.bench_pool_cpu --profile 4 64        # also a cProfile of one more stretch at 4 and 64

A `ray.cluster_utils.Cluster` (every raylet on 127.0.0.1): a head with the driver (resource "trainer", no
worker goes there) and 8 data nodes of 2 CPUs each. Each pool size has a resource of its own on the nodes
it spreads over, 8 workers a node: 4 workers on 1 node, 16 on 2, 32 on 4, 64 on 8. Every worker is on
another node than the driver, so its batches come over a TCP lane once it opened (NOTE [ raydl lane,
driver ]), each read by a thread of the driver, as on a real cluster.

A batch is 64 trivial samples (16 float32 each): making it costs the workers next to nothing, so what is
measured is the trainer's own per-batch machinery. Each pool size gets one persistent loader, started
and warmed up (a whole epoch: start-up, lanes opening, every worker timed), then an epoch is left
running past its priming. The first size (4) is the baseline: its pool stays up while each larger
pool in turn is started, measured and ended (`ray_reuse_workers=False`: 116 idle workers importing
torch do not fit this host's memory at once), and their `--reps` stretches of `--batches` batches
alternate, so the ratio to the baseline is paired, measured in the same minutes on a shared host.
Per stretch: the driver process's CPU seconds (`time.process_time()`: every thread of this process,
Ray's own and the lane readers included) divided by its batches, its wall time, and the actor calls
it sent (NOTE [ raydl calls ]: on a loaded host the workers' batches take longer and fewer go in a
call, which the driver pays per call; so each adaptive stretch is followed by one with every call
carrying `--fixed-k` batches, the driver's cost with the grouping held fixed). Also reported: the
trainer's Python threads for each size (the process's own ones and that pool's lane readers), the
process's OS threads, and its CPU per second of wall time while idle with the baseline pool up.

64 workers importing torch on a 2-core host take minutes to start: the loaders run with
`ray_startup_timeout_s=--startup-timeout-s` (600 s by default; raydl's default, 60 s, is too short).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.metadata
import io
import os
import pstats
import re
import sys
import threading
import time
from collections import Counter
from typing import Optional

import numpy as np
import psutil
from torch.utils.data import Dataset

import raydl
from benchmarks.common.machine import describe_machine, machine_info
from benchmarks.common.results import RESULTS_DIR, Results, log, md_table, median

NODES = 8
WORKERS_PER_NODE = 8
BATCH = 64


class TrivialDataset(Dataset):
    """16 float32 per sample: nothing to make, so a batch costs its worker almost nothing."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full((16,), i, dtype=np.float32)


def base_threads() -> Counter:
    """This process's Python threads by name (numbers folded), lane readers left out: what any pool size runs."""
    return Counter(re.sub(r"\d+", "N", t.name) for t in threading.enumerate() if not t.name.startswith("raydl-lane-"))


def idle_cpu_per_s(seconds: float) -> float:
    """The driver's CPU seconds per wall second while it does nothing (Ray's background threads)."""
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.perf_counter() - t0)


class Pool:
    """One pool size: its persistent loader, an epoch running, the stretches measured on it."""

    def __init__(self, size: int, args: argparse.Namespace) -> None:
        self.size = size
        # one epoch covers every stretch (the baseline's: one per stretch of every other size) and the profile
        n_batches = args.batches * (2 * args.reps * len(args.sizes) + 2) + 4 * size + 64
        self.loader = raydl.DataLoader(
            TrivialDataset(n_batches * BATCH),
            batch_size=BATCH,
            num_workers=size,
            persistent_workers=True,
            ray_startup_timeout_s=args.startup_timeout_s,
            ray_batches_per_call=args.batches_per_call,
            ray_reuse_workers=False,  # ended with its loader: no warm pool holding its workers' memory
            ray_remote_args={"num_cpus": 0, "resources": {f"pool{size}": 1}},
        )
        t0 = time.perf_counter()
        it = iter(self.loader)
        for _ in range(2 * size + 16):  # start-up and the first calls (lanes are asked for here)
            next(it)
        for _ in it:  # the warm-up epoch: every lane open, every worker timed
            pass
        self.start_s = time.perf_counter() - t0
        self.it = iter(self.loader)
        for _ in range(2 * size + 16):  # past the priming of the epoch
            next(self.it)
        self.cpu_us: list[float] = []
        self.wall_us: list[float] = []
        self.calls: list[float] = []
        self.fetch_ms: list[float] = []
        self.cpu_us_fixed: list[float] = []

    def stretch(self, n: int, k: Optional[int] = None) -> float:
        """`n` batches, timed: the driver's CPU and wall time per batch, actor calls per batch; with `k`, calls of `k`
        batches (`ray_batches_per_call=k` for the stretch: the driver's cost with the grouping held fixed), kept
        apart. Returns the CPU µs per batch."""
        gc.collect()
        sched = self.it._sched
        adaptive, sched._fixed_k = sched._fixed_k, k if k is not None else sched._fixed_k
        calls0 = sched.calls_sent
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            next(self.it)
        cpu_us = (time.process_time() - c0) / n * 1e6
        sched._fixed_k = adaptive
        if k is not None:
            self.cpu_us_fixed.append(cpu_us)
            return cpu_us
        self.cpu_us.append(cpu_us)
        self.wall_us.append((time.perf_counter() - w0) / n * 1e6)
        self.calls.append((sched.calls_sent - calls0) / n)
        fetch = sched._fetch_s.values()  # each worker's moving average of its batch time: the call sizes
        self.fetch_ms.append(median([x * 1e3 for x in fetch]))
        return cpu_us

    def profile(self, n: int, profile_dir: str) -> None:
        """One more stretch under cProfile (its overhead is in no figure), sorted by cumulative and by own time."""
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            next(self.it)
        prof.disable()
        for key in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(40)
            path = os.path.join(profile_dir, f"pool_cpu_{self.size}_{key}.txt")
            with open(path, "w") as f:
                f.write(out.getvalue())
            log(f"  profile ({key}) written to {path}")

    def record(self) -> dict:
        lanes = self.it._calls._lanes
        remote = sum(1 for lane in lanes._lanes.values() if lane.remote) if lanes is not None else 0
        base = base_threads()
        names = dict(base, **({"raydl-lane-N": remote} if remote else {}))
        return {
            "workers": self.size,
            "nodes": len({r.node_id for r in self.loader.worker_records}),
            "remote_lanes": remote,
            "cpu_us_per_batch": self.cpu_us,
            "wall_us_per_batch": self.wall_us,
            "calls_per_batch": self.calls,
            "worker_batch_ms": self.fetch_ms,
            "cpu_us_per_batch_fixed_k": self.cpu_us_fixed,
            "py_threads": sum(base.values()) + remote,
            "thread_names": ", ".join(f"{k} ×{v}" for k, v in names.items()),
            "start_s": self.start_s,
        }

    def close(self) -> None:
        del self.it
        self.loader.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 32, 64])
    p.add_argument("--batches", type=int, default=1000, help="batches per measured stretch")
    p.add_argument("--reps", type=int, default=5, help="measured stretches per pool size (the median is reported)")
    p.add_argument("--idle-s", type=float, default=2.0, help="seconds of idle driver CPU to measure, every pool up")
    p.add_argument(
        "--batches-per-call", type=int, default=None, help="ray_batches_per_call (default: adaptive, raydl's default)"
    )
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--fixed-k",
        type=int,
        default=2,
        help="also a stretch with every call carrying this many batches after each adaptive one (0: none)",
    )
    p.add_argument("--profile", type=int, nargs="*", default=[], help="pool sizes to profile (cProfile)")
    p.add_argument("--profile-dir", default=RESULTS_DIR)
    p.add_argument("--quick", action="store_true", help="4 and 64 workers, 1 stretch")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.reps = [4, 64], 1
    assert all(0 < s <= NODES * WORKERS_PER_NODE for s in args.sizes), args.sizes
    os.makedirs(args.profile_dir, exist_ok=True)
    start = time.perf_counter()

    import ray
    from ray.cluster_utils import Cluster

    from tests._session import patient_clusters

    info = machine_info(ray_version=importlib.metadata.version("ray"))
    res = Results("bench_pool_cpu", args.quick)
    res.write({"section": "machine", **info, "argv": sys.argv[1:]})
    log(describe_machine(info))
    patient_clusters()
    t0 = time.perf_counter()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "node_ip_address": "127.0.0.1",
            "resources": {"trainer": 1},
            "include_dashboard": False,
        },
    )
    results: list = []
    idle, os_threads = 0.0, 0
    try:
        for i in range(NODES):
            resources = {
                f"pool{s}": WORKERS_PER_NODE for s in args.sizes if i < -(-s // WORKERS_PER_NODE)
            }  # each size on the first ceil(size / 8) nodes
            cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1", resources=resources)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        cluster_start_s = time.perf_counter() - t0
        log(f"cluster up in {cluster_start_s:.1f} s: head + {NODES} nodes")
        # The first size is the baseline: its pool stays up while each other size's pool is started, measured in
        # stretches alternating with it, and ended (its workers killed: 116 idle workers importing torch do not
        # fit this host's memory at once), so every ratio is paired with the baseline measured in the same minutes.
        base = Pool(args.sizes[0], args)
        log(f"{base.size:3d} workers started and warmed up in {base.start_s:.0f} s")
        idle = idle_cpu_per_s(args.idle_s)
        ratios: dict[int, list[float]] = {base.size: [1.0] * args.reps}
        fixed: dict[int, list[float]] = {base.size: [1.0] * args.reps if args.fixed_k else []}
        others: list[Pool] = []
        for size in args.sizes[1:]:
            pool = Pool(size, args)
            log(f"{size:3d} workers started and warmed up in {pool.start_s:.0f} s")
            os_threads = max(os_threads, psutil.Process().num_threads())
            ratios[size], fixed[size] = [], []
            for rep in range(args.reps):
                pair = (base, pool) if rep % 2 == 0 else (pool, base)
                for p in pair:
                    p.stretch(args.batches)
                ratios[size].append(pool.cpu_us[-1] / base.cpu_us[-1])
                if args.fixed_k:
                    for p in pair:
                        p.stretch(args.batches, args.fixed_k)
                    fixed[size].append(pool.cpu_us_fixed[-1] / base.cpu_us_fixed[-1])
                log(
                    f"rep {rep}: {base.size}: {base.cpu_us[-1]:.0f} us ({base.calls[-1]:.2f} calls)/batch, "
                    f"{size}: {pool.cpu_us[-1]:.0f} us ({pool.calls[-1]:.2f} calls)/batch"
                )
            if size in args.profile:
                pool.profile(args.batches, args.profile_dir)
            others.append(pool.record())
            pool.close()
        if base.size in args.profile:
            base.profile(args.batches, args.profile_dir)
        for rec in [base.record(), *others]:
            rec["paired_ratio"] = ratios[rec["workers"]]
            rec["paired_ratio_fixed_k"] = fixed[rec["workers"]]
            res.write({"section": "pool_cpu", **rec, "idle_cpu_ms_per_s": idle * 1e3, "process_os_threads": os_threads})
            results.append(rec)
            log(
                f"{rec['workers']:3d} workers on {rec['nodes']} nodes: {median(rec['cpu_us_per_batch']):6.1f} us "
                f"CPU/batch {[round(x, 1) for x in rec['cpu_us_per_batch']]}, paired ratio "
                f"{median(rec['paired_ratio']):.2f}, wall {median(rec['wall_us_per_batch']):6.1f} us/batch, "
                f"{median(rec['calls_per_batch']):.2f} calls/batch (workers' batch {median(rec['worker_batch_ms']):.2f} ms), threads {rec['py_threads']} Python "
                f"({rec['thread_names']})"
            )
        base.close()
    finally:
        ray.shutdown()
        cluster.shutdown()

    rows = [
        [
            r["workers"],
            r["nodes"],
            f"{median(r['cpu_us_per_batch']):.0f} ({min(r['cpu_us_per_batch']):.0f}-{max(r['cpu_us_per_batch']):.0f})",
            f"{median(r['paired_ratio']):.2f}× ({min(r['paired_ratio']):.2f}-{max(r['paired_ratio']):.2f})",
            f"{median(r['calls_per_batch']):.2f}",
            f"{median(r['worker_batch_ms']):.2f}",
            f"{median(r['wall_us_per_batch']):.0f}",
            (
                f"{median(r['cpu_us_per_batch_fixed_k']):.0f}, {median(r['paired_ratio_fixed_k']):.2f}×"
                if r["cpu_us_per_batch_fixed_k"]
                else "-"
            ),
            f"{r['py_threads']} ({r['remote_lanes']} lane readers)",
        ]
        for r in results
    ]
    lines = [
        f"## raydl trainer CPU per batch against pool size ({'quick' if args.quick else 'full'} run)",
        "",
        describe_machine(info),
        "",
        f"ray.cluster_utils: head (driver) + {NODES} nodes of 2 CPUs, {WORKERS_PER_NODE} workers a node, all on "
        f"127.0.0.1; batch of {BATCH} trivial samples; driver process CPU (time.process_time) per batch over "
        f"{args.batches} batches, median of {args.reps} stretches (min-max); each size's stretches alternate with "
        f"the {results[0]['workers'] if results else '-'}-worker pool's, kept up all along, and the ratio is paired; "
        f"ray_batches_per_call={args.batches_per_call or 'auto'}. Idle driver with every pool up: {idle * 1e3:.1f} ms "
        f"CPU/s; at most {os_threads} OS threads in the process (Ray's included).",
        "",
        md_table(
            [
                "workers",
                "nodes",
                "driver CPU µs/batch",
                f"vs {results[0]['workers'] if results else '-'} (paired)",
                "calls/batch",
                "workers' batch ms",
                "wall µs/batch",
                f"calls of {args.fixed_k}: CPU µs/batch, vs {results[0]['workers'] if results else '-'}",
                "trainer's Python threads",
            ],
            rows,
        ),
        "",
        "Python threads: " + "; ".join(f"{r['workers']}: {r['thread_names']}" for r in results),
    ]
    res.finish_cluster_report(lines, cluster_start_s, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
