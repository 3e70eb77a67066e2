#!/usr/bin/env python3
"""A job pool (`ray_job`) against private pools per rank: a straggler worker, balanced load, sample seeding.

    python -m benchmarks.bench_job            # ~3 min
    python -m benchmarks.bench_job --quick    # ~1 min

Two DDP ranks are two loaders in this process stepping in lockstep, as DDP's ranks do (a step
waits for every rank's batch), each with `DistributedSampler(num_replicas=2, rank=r)` and
`num_workers` workers per rank; with `ray_job` the four workers are one pool. A sample costs
`--sample-ms` of CPU spun on `time.thread_time()` (a wall-clock spin would finish early on a
shared core); in the straggler case worker 0 (of rank 0's private pool, or of the job's pool)
spins 3x as long per sample. Per repetition, configurations run in rotated order, each on a
fresh loader for 1 warm-up epoch + `--epochs` measured epochs; the figure is job steps/s (one
step = both ranks' batches), and ratios are paired within a repetition.

Also: `ray_seed="sample"` against `"batch"` on the overhead floor (a 16-float sample, batch 64,
one rank, 2 workers): samples/s, paired.

    python -m benchmarks.bench_job --autoscale   # ~4 min: the job's autoscaler (NOTE [ raydl job elastic ])

Two lockstep ranks on an I/O-bound dataset (`--io-ms` of sleep per sample: a remote read), one
long epoch: a job pool fixed at 1 worker per rank, one fixed at `--max-per-rank`, and one with
`num_workers=1, ray_max_workers=--max-per-rank` that the coordinator grows on both ranks'
windows. Reported: job steps/s over the epoch's second half (settled), the job's size at the end,
the step of its last decision, and the decisions.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from benchmarks.common.machine import describe_machine, machine_info
from benchmarks.common.results import Results, log, md_table, median


class Spin(Dataset):
    """Sample i: `sample_s` of this thread's CPU (3x on worker `slow_worker`), then a small tensor."""

    def __init__(self, n: int, sample_s: float, slow_worker: int | None) -> None:
        self.n, self.sample_s, self.slow_worker = n, sample_s, slow_worker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        cost = self.sample_s * (3 if info is not None and info.id == self.slow_worker else 1)
        end = time.thread_time() + cost
        while time.thread_time() < end:
            pass
        return torch.full((16,), float(i))


class Floor(Dataset):
    def __len__(self) -> int:
        return 64 * 200

    def __getitem__(self, i: int):
        return np.full(16, i, dtype=np.float32)


def job_steps_per_s(args, job: bool, straggler: bool, rep: int) -> float:
    import raydl

    n = 2 * args.batch * args.steps
    loaders = []
    for rank in range(2):
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
        slow = 0 if straggler and (job or rank == 0) else None
        ds = Spin(n, args.sample_ms / 1000, slow)
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=rep)
        loaders.append(
            raydl.DataLoader(
                ds,
                batch_size=args.batch,
                sampler=sampler,
                num_workers=args.num_workers,
                persistent_workers=True,
                ray_job=f"bench-{rep}-{straggler}" if job else None,
                ray_seed="batch",
                timeout=120,
            )
        )
    rates = []
    try:
        for epoch in range(1 + args.epochs):
            t0 = time.perf_counter()
            its = [iter(loader) for loader in loaders]
            steps = 0
            for _ in zip(*its):
                steps += 1
            for it in its:  # each rank to its StopIteration (equal steps under DistributedSampler)
                for _ in it:
                    pass
            if epoch > 0:
                rates.append(steps / (time.perf_counter() - t0))
    finally:
        for loader in loaders:
            loader.shutdown()
    return median(rates)


class Sleepy(Dataset):
    """Sample i after `io_s` of sleep (a remote read: I/O, not CPU)."""

    def __init__(self, n: int, io_s: float) -> None:
        self.n, self.io_s = n, io_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.io_s)
        return torch.full((16,), float(i))


def autoscale_run(args, mode: str, rep: int) -> dict:
    """One epoch of two lockstep ranks on a job pool: fixed at 1 or `max_per_rank` workers per rank, or autoscaled."""
    import raydl

    n = 2 * args.batch * args.autoscale_steps
    loaders = []
    for rank in range(2):
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
        ds = Sleepy(n, args.io_ms / 1000)
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=rep)
        loaders.append(
            raydl.DataLoader(
                ds,
                batch_size=args.batch,
                sampler=sampler,
                num_workers=args.max_per_rank if mode == "fixed-max" else 1,
                ray_max_workers=args.max_per_rank if mode == "auto" else None,
                ray_job=f"bench-as-{mode}-{rep}",
                ray_seed="batch",
                timeout=120,
            )
        )
    try:
        its = [iter(loader) for loader in loaders]
        stamps, sizes = [], []
        for _ in zip(*its):
            stamps.append(time.perf_counter())
            sizes.append(len(its[0]._sched.active))
        decisions = list(its[0]._elastic.decisions)
    finally:
        for loader in loaders:
            loader.shutdown()
    half = len(stamps) // 2
    changes = [k for k in range(1, len(sizes)) if sizes[k] != sizes[k - 1]]
    return {
        "mode": mode,
        "rep": rep,
        "steps": len(stamps),
        "settled_steps_per_s": (len(stamps) - 1 - half) / (stamps[-1] - stamps[half]),
        "final_size": sizes[-1],
        "last_change_step": changes[-1] if changes else 0,
        "decisions": [
            f"{d.action} {d.workers_before}->{d.workers_after} (waited {d.wait_fraction:.0%}, busy "
            f"{d.busy_fraction:.0%})"
            for d in decisions
        ],
    }


def autoscale_report(args, runs: list) -> list:
    by = {m: [r for r in runs if r["mode"] == m] for m in ("fixed-1", "fixed-max", "auto")}
    auto_vs_max = [a["settled_steps_per_s"] / f["settled_steps_per_s"] for a, f in zip(by["auto"], by["fixed-max"])]
    auto_vs_one = [a["settled_steps_per_s"] / f["settled_steps_per_s"] for a, f in zip(by["auto"], by["fixed-1"])]
    rows = []
    for mode, label in (
        ("fixed-1", "job pool, 1 worker per rank"),
        ("fixed-max", f"job pool, {args.max_per_rank} workers per rank"),
        ("auto", f"job pool, num_workers=1, ray_max_workers={args.max_per_rank}"),
    ):
        rs = by[mode]
        rows.append(
            [
                label,
                f"{median([r['settled_steps_per_s'] for r in rs]):.1f}",
                ", ".join(str(r["final_size"]) for r in rs),
                ", ".join(str(r["last_change_step"]) for r in rs),
            ]
        )
    return [
        f"Job autoscaler: 2 ranks in lockstep, batch {args.batch} per rank, {args.io_ms} ms of sleep per sample "
        f"(I/O), {args.autoscale_steps} steps, {args.reps} repetition(s); steps/s over the second half",
        "",
        md_table(["pool", "job steps/s, settled", "job workers at the end", "step of the last change"], rows),
        "",
        f"autoscaled / fixed at {args.max_per_rank} per rank (paired): {median(auto_vs_max):.2f}x "
        f"({min(auto_vs_max):.2f}-{max(auto_vs_max):.2f}); autoscaled / fixed at 1: {median(auto_vs_one):.2f}x "
        f"({min(auto_vs_one):.2f}-{max(auto_vs_one):.2f})",
        "",
        "Decisions (first repetition): " + "; ".join(by["auto"][0]["decisions"]),
    ]


def seeding_samples_per_s(mode: str, epochs: int) -> float:
    import raydl

    loader = raydl.DataLoader(
        Floor(), batch_size=64, num_workers=2, persistent_workers=True, ray_seed=mode, timeout=120
    )
    rates = []
    try:
        for epoch in range(1 + epochs):
            t0 = time.perf_counter()
            count = sum(len(b) for b in loader)
            if epoch > 0:
                rates.append(count / (time.perf_counter() - t0))
    finally:
        loader.shutdown()
    return median(rates)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; quick 1)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="job steps per epoch (default 40; quick 20)")
    p.add_argument("--batch", type=int, default=8, help="per-rank batch size")
    p.add_argument("--num-workers", type=int, default=2, help="workers per rank")
    p.add_argument("--sample-ms", type=float, default=2.0, help="CPU per sample, ms")
    p.add_argument("--autoscale", action="store_true", help="measure the job's autoscaler instead")
    p.add_argument("--io-ms", type=float, default=4.0, help="--autoscale: sleep per sample, ms")
    p.add_argument("--max-per-rank", type=int, default=4, help="--autoscale: ray_max_workers (per rank)")
    p.add_argument("--autoscale-steps", type=int, default=None, help="--autoscale: job steps (default 1500; quick 300)")
    args = p.parse_args()
    args.reps = args.reps or (1 if args.quick else 3)
    args.steps = args.steps or (20 if args.quick else 40)
    import ray

    info = machine_info(ray.__version__)
    ray.init(address="local", include_dashboard=False)
    results = Results("bench_job", args.quick)
    results.write({"machine": info, "args": vars(args)})
    if args.autoscale:
        args.autoscale_steps = args.autoscale_steps or (300 if args.quick else 1500)
        args.reps = min(args.reps, 2)
        runs = []
        try:
            modes = ["fixed-1", "fixed-max", "auto"]
            for rep in range(args.reps):
                for mode in modes[rep % 3 :] + modes[: rep % 3]:
                    run = autoscale_run(args, mode, rep)
                    runs.append(run)
                    results.write(run)
                    log(
                        f"rep {rep}: {mode:9s} {run['settled_steps_per_s']:.1f} steps/s settled, "
                        f"{run['final_size']} workers at the end, last change at step {run['last_change_step']}"
                    )
        finally:
            ray.shutdown()
        report = "\n".join([describe_machine(info), ""] + autoscale_report(args, runs))
        print(report)
        results.write_text(".md", report + "\n")
        results.close()
        return 0
    configs = [("private", False, True), ("job", True, True), ("private", False, False), ("job", True, False)]
    rows: dict[tuple, list[float]] = {}
    seeding: dict[str, list[float]] = {"batch": [], "sample": []}
    try:
        for rep in range(args.reps):
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            for name, job, straggler in order:
                rate = job_steps_per_s(args, job, straggler, rep)
                rows.setdefault((name, straggler), []).append(rate)
                results.write({"case": name, "straggler": straggler, "rep": rep, "steps_per_s": rate})
                log(f"rep {rep}: {name:7s} straggler={straggler}: {rate:.1f} steps/s")
            for mode in ["batch", "sample"] if rep % 2 == 0 else ["sample", "batch"]:
                rate = seeding_samples_per_s(mode, args.epochs)
                seeding[mode].append(rate)
                results.write({"case": f"seed-{mode}", "rep": rep, "samples_per_s": rate})
                log(f"rep {rep}: ray_seed={mode}: {rate:.0f} samples/s")
    finally:
        ray.shutdown()

    def ratio(a, b):
        return [x / y for x, y in zip(rows[a], rows[b])]

    strag, bal = ratio(("job", True), ("private", True)), ratio(("job", False), ("private", False))
    seed_ratio = [s / b for s, b in zip(seeding["sample"], seeding["batch"])]
    lines = [
        describe_machine(info),
        "",
        f"2 ranks x {args.num_workers} workers, batch {args.batch} per rank, {args.sample_ms} ms CPU per sample, "
        f"{args.steps} steps per epoch, {args.reps} repetition(s), median of {args.epochs} epochs each",
        "",
        md_table(
            ["case", "private pools, steps/s", "job pool, steps/s", "job / private (paired), median (min-max)"],
            [
                [
                    "one worker 3x slower",
                    f"{median(rows[('private', True)]):.1f}",
                    f"{median(rows[('job', True)]):.1f}",
                    f"**{median(strag):.2f}x** ({min(strag):.2f}-{max(strag):.2f})",
                ],
                [
                    "balanced",
                    f"{median(rows[('private', False)]):.1f}",
                    f"{median(rows[('job', False)]):.1f}",
                    f"**{median(bal):.2f}x** ({min(bal):.2f}-{max(bal):.2f})",
                ],
            ],
        ),
        "",
        md_table(
            ["overhead floor, 1 rank, 2 workers", "samples/s", "vs batch (paired)"],
            [
                ["ray_seed='batch'", f"{median(seeding['batch']):.0f}", "1.00x"],
                [
                    "ray_seed='sample'",
                    f"{median(seeding['sample']):.0f}",
                    f"{median(seed_ratio):.2f}x ({min(seed_ratio):.2f}-{max(seed_ratio):.2f})",
                ],
            ],
        ),
    ]
    report = "\n".join(lines)
    print(report)
    results.write_text(".md", report + "\n")
    results.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
