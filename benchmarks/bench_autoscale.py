#!/usr/bin/env python3
"""The autoscaler (`ray_max_workers`, NOTE [ raydl elastic pool ] in raydl/cluster/elastic.py) against fixed pools.

    python -m benchmarks.bench_autoscale            # ~2-3 min on an idle 2-core machine
    python -m benchmarks.bench_autoscale --quick    # shorter windows

Two targets of issue 11, in one run, on a local Ray this script starts:
  1. I/O-bound dataset (4 ms sleep per sample, 3x64x64 float32, batch 16), a loop that takes
     nothing: settled samples/s of `num_workers=1, ray_max_workers=8` against fixed raydl pools of
     1 and 8 workers (goal: >= 80 % of the 8-worker pool, >= 4x the 1-worker one), and how many
     batches (and seconds) the autoscaler took to settle. Settled = the pool's size, its joining
     workers and the decisions have not changed for `--measure-s` seconds; samples/s is measured
     over that stretch, after its first second. Fixed pools are measured over the same duration
     after their first 20 batches. By default every loader finds 8 started, idle workers in the
     warm pool (NOTE [ raydl warm pool ]), so an addition costs a configure() and the settling
     time is the autoscaler's rule, not process start-up on a busy machine; `--cold` starts every
     worker as a new process instead.
  2. A loop slower than its data (40 ms per step, 1 worker makes a batch of 4 in 16 ms): the
     autoscaler must add no worker over the run.
Each line of stdout is one JSON record; a Markdown table follows. `foreign_cores` is the CPU
other processes used during the measurement (the machine may be shared: numbers from a busy
machine are noisy).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings

import raydl
from benchmarks.common.machine import LoadMonitor, describe_machine, machine_info
from benchmarks.common.results import md_table, printed_report
from benchmarks.common.workloads import Workload, WorkloadDataset, batch_samples, register_by_value

IO = Workload("io", "4 ms sleep per sample", n=400_000, batch_size=16, kind="io")
SLOW_LOOP_STEP_S = 0.040


COLD = False  # --cold: every worker a new process


def _loader(num_workers: int, max_workers=None, batch_size: int = IO.batch_size) -> raydl.DataLoader:
    return raydl.DataLoader(
        WorkloadDataset(IO),
        batch_size=batch_size,
        num_workers=num_workers,
        timeout=300,
        ray_max_workers=max_workers,
        ray_reuse_workers=not COLD,
        ray_startup_timeout_s=600,  # a busy shared machine can take minutes to start processes
    )


def _prepare(n: int) -> None:
    """Idle workers for the next loader: none (--cold), else `n` started ones in the warm pool."""
    raydl.release_idle_workers()
    if not COLD:
        warm = raydl.DataLoader(range(n), num_workers=n, timeout=300, ray_startup_timeout_s=600)
        assert len(list(warm)) == n


def fixed(num_workers: int, measure_s: float, warm_workers: int) -> dict:
    _prepare(warm_workers)
    it = iter(_loader(num_workers))
    for _ in range(20):
        next(it)
    samples = 0
    with LoadMonitor() as mon:
        t0 = time.perf_counter()
        for batch in it:
            samples += batch_samples(batch)
            if time.perf_counter() - t0 >= measure_s:
                break
        wall = time.perf_counter() - t0
    it.shutdown()
    return {
        "config": f"fixed {num_workers}",
        "samples_per_s": samples / wall,
        "foreign_cores": round(mon.foreign_cores, 2),
    }


def autoscaled(max_workers: int, measure_s: float, cap_s: float) -> dict:
    _prepare(max_workers)
    it = iter(_loader(1, max_workers))
    t_start = time.perf_counter()
    last_state, change_k, t_change = None, 0, t_start
    window: list[tuple[float, int]] = []  # (time, samples) since the last change
    k = 0
    with LoadMonitor() as mon:
        for k, batch in enumerate(it):
            now = time.perf_counter()
            state = (tuple(it._sched.active), tuple(it._pool.joining), len(it._elastic.decisions))
            if state != last_state:
                last_state, change_k, t_change, window = state, k, now, []
                continue
            window.append((now, batch_samples(batch)))
            if now - t_change >= measure_s + 1.0 or now - t_start >= cap_s:
                break
    settled = [(t, n) for t, n in window if t >= t_change + 1.0]
    rate = sum(n for _, n in settled[1:]) / (settled[-1][0] - settled[0][0]) if len(settled) > 2 else float("nan")
    decisions = [
        {"action": d.action, "to": d.workers_after, "at_batch": d.batch_number, "wait": round(d.wait_fraction, 3)}
        for d in it._elastic.decisions
    ]
    out = {
        "config": f"autoscale 1..{max_workers}",
        "samples_per_s": rate,
        "workers_settled": len(it._sched.active),
        "batches_to_settle": change_k,
        "seconds_to_settle": round(t_change - t_start, 1),
        "settled_before_cap": now - t_start < cap_s,
        "decisions": decisions,
        "foreign_cores": round(mon.foreign_cores, 2),
    }
    it.shutdown()
    return out


def slow_loop(max_workers: int, batches: int) -> dict:
    _prepare(max_workers)
    it = iter(_loader(1, max_workers, batch_size=4))
    t0 = time.perf_counter()
    with LoadMonitor() as mon:
        for k, _ in enumerate(it):
            time.sleep(SLOW_LOOP_STEP_S)  # the training step
            if k + 1 >= batches:
                break
    out = {
        "config": f"slow loop ({SLOW_LOOP_STEP_S * 1e3:.0f} ms/step, data 16 ms/batch), autoscale 1..{max_workers}",
        "batches": batches,
        "seconds": round(time.perf_counter() - t0, 1),
        "workers_added": sum(d.action == "add" for d in it._elastic.decisions),
        "workers_at_end": len(it._sched.active) + len(it._pool.joining),
        "foreign_cores": round(mon.foreign_cores, 2),
    }
    it.shutdown()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--max-workers", type=int, default=8)
    p.add_argument("--measure-s", type=float, default=None, help="settled stretch measured (default 8 s; quick 4 s)")
    p.add_argument("--cap-s", type=float, default=150.0, help="bound on the autoscaler's run")
    p.add_argument("--cold", action="store_true", help="no warm workers: every worker starts as a new process")
    args = p.parse_args()
    global COLD
    COLD = args.cold
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 8 workers on 2 cores: sleeping ones
    measure_s = args.measure_s or (4.0 if args.quick else 8.0)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("raydl.cluster.elastic").setLevel(logging.INFO)  # the autoscaler's decisions, with figures

    import ray

    register_by_value()
    ray.init(address="local", include_dashboard=False)
    info = machine_info()
    print(json.dumps({"machine": info, "cold": COLD}), flush=True)
    records = [
        autoscaled(args.max_workers, measure_s, args.cap_s),
        fixed(args.max_workers, measure_s, args.max_workers),
        fixed(1, measure_s, args.max_workers),
        slow_loop(
            args.max_workers, batches=int(12 / SLOW_LOOP_STEP_S) if not args.quick else int(6 / SLOW_LOOP_STEP_S)
        ),
    ]
    for r in records:
        print(json.dumps(r), flush=True)
    auto, many, one, slow = records
    print()
    print(describe_machine(info))
    print(
        md_table(
            ["config", "samples/s", "vs fixed 8", "vs fixed 1", "settled at", "foreign cores"],
            [
                [
                    auto["config"],
                    f"{auto['samples_per_s']:.0f}",
                    f"{auto['samples_per_s'] / many['samples_per_s']:.0%}",
                    f"{auto['samples_per_s'] / one['samples_per_s']:.2f}x",
                    f"{auto['workers_settled']} workers after {auto['batches_to_settle']} batches ({auto['seconds_to_settle']} s)",
                    auto["foreign_cores"],
                ],
                [
                    many["config"],
                    f"{many['samples_per_s']:.0f}",
                    "100%",
                    f"{many['samples_per_s'] / one['samples_per_s']:.2f}x",
                    "",
                    many["foreign_cores"],
                ],
                [
                    one["config"],
                    f"{one['samples_per_s']:.0f}",
                    f"{one['samples_per_s'] / many['samples_per_s']:.0%}",
                    "1.00x",
                    "",
                    one["foreign_cores"],
                ],
            ],
        )
    )
    print(
        f"\n{slow['config']}: {slow['workers_added']} worker(s) added over {slow['batches']} batches ({slow['seconds']} s)"
    )
    ray.shutdown()
    return 0


if __name__ == "__main__":
    with printed_report("bench_autoscale", quick="--quick" in sys.argv):
        sys.exit(main())
