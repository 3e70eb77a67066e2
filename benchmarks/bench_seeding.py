#!/usr/bin/env python3
"""Per-batch cost of `ray_seed="batch"` and per-sample cost of `ray_seed="sample"` (raydl/worker/seeding.py).

    python -m benchmarks.bench_seeding            # ~20 s
    python -m benchmarks.bench_seeding --quick    # ~5 s

Measures, in this process (no Ray), what a worker does before each batch under `ray_seed="batch"`:
  * `seed_batch`: SeedSequence(base_seed, spawn_key=(epoch, idx)) + seeding random, torch and NumPy
    (the whole per-batch cost in a worker), and its parts;
  * the in-process path (num_workers=0): the same plus saving and restoring the caller's generators;
  * `seed_sample`: what a worker does before each sample under `ray_seed="sample"` (NOTE [ raydl
    sample seeding ]: a splitmix64 chain, then random, torch and NumPy seeded), and its parts;
  * for reference, `torch.manual_seed` (which raydl does not call per batch: its lazy CUDA seeding
    records a stack trace per call).
Each figure is the median over repetitions of the mean time per call in a block of calls, in µs,
with min–max: wall time, and the CPU time of the calling thread (`time.thread_time`), which a busy
machine inflates far less than wall time (waiting for a core is not counted; cache and frequency
effects still are). The load average is printed beside them: the machine is shared.
One JSON line per measurement on stdout, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common.results import printed_report
from raydl.worker.seeding import _SavedRNG, batch_seed_words, sample_seed, seed_batch, seed_sample  # noqa: E402


def timed_us(fn, calls: int, reps: int) -> tuple[list[float], list[float]]:
    """Per-call wall time and CPU time of this thread (µs), one figure per block of `calls` calls."""
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(calls):
            fn(i)
        wall.append((time.perf_counter() - t0) / calls * 1e6)
        cpu.append((time.thread_time() - c0) / calls * 1e6)
    return wall, cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--calls", type=int, default=None, help="calls per block (default 2000; quick 500)")
    p.add_argument("--reps", type=int, default=None, help="blocks (default 15; quick 5)")
    args = p.parse_args()
    calls = args.calls or (500 if args.quick else 2000)
    reps = args.reps or (5 if args.quick else 15)
    torch.set_num_threads(1)
    base = 0x1234_5678_9ABC_DEF  # any 63-bit base seed
    words = batch_seed_words(base, 0, 0)
    seed64 = int(words[0]) | (int(words[1]) << 32)

    def in_process(i: int) -> None:
        saved = _SavedRNG()
        seed_batch(base, 0, i)
        saved.restore()

    cases = [
        ("seed_batch (worker, per batch)", lambda i: seed_batch(base, 0, i)),
        ("  SeedSequence + 4 words", lambda i: batch_seed_words(base, 0, i)),
        ("  random.seed", lambda i: random.seed(seed64)),
        ("  torch CPU generator", lambda i: torch.default_generator.manual_seed(seed64)),
        ("  np.random.seed(4 words)", lambda i: np.random.seed(words)),
        ("in-process (num_workers=0): save + seed_batch + restore", in_process),
        ("seed_sample (worker, per sample)", lambda i: seed_sample(base, 0, i)),
        ("  splitmix64 chain", lambda i: sample_seed(base, 0, i)),
        ("  np.random.seed(32-bit int)", lambda i: np.random.seed(i)),
        ("reference: torch.manual_seed (not used)", lambda i: torch.manual_seed(seed64)),
    ]
    rows = []
    for name, fn in cases:
        fn(0)  # warm-up
        load_before = os.getloadavg()[0]
        us, cpu = timed_us(fn, calls, reps)
        rec = {
            "case": name.strip(),
            "median_us": statistics.median(us),
            "min_us": min(us),
            "max_us": max(us),
            "cpu_median_us": statistics.median(cpu),
            "cpu_min_us": min(cpu),
            "cpu_max_us": max(cpu),
            "calls": calls,
            "reps": reps,
            "loadavg_1min": load_before,
        }
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    print()
    print(
        f"raydl batch and sample seeding, per call (µs): median of {reps} blocks of {calls} calls (min–max); "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, numpy {np.__version__}"
    )
    print()
    print("| case | wall µs/call, median (min–max) | CPU µs/call, median (min–max) | load avg (1 min) |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['median_us']:.1f} ({r['min_us']:.1f}–{r['max_us']:.1f}) | "
            f"{r['cpu_median_us']:.1f} ({r['cpu_min_us']:.1f}–{r['cpu_max_us']:.1f}) | {r['loadavg_1min']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    with printed_report("bench_seeding", quick="--quick" in sys.argv):
        sys.exit(main())
