#!/usr/bin/env python3
"""The trainer's core per batch: driver CPU and samples/s at the overhead floor, by batches per actor call.

    python -m benchmarks.bench_calls            # ~3 min on 2 cores
    python -m benchmarks.bench_calls --quick    # ~1 min
    python -m benchmarks.bench_calls --unordered  # every loader with in_order=False

Overhead floor: a 16-float sample, batch 64, 2 workers, default prefetch_factor (2), the loop does nothing
with a batch. For torch's DataLoader; raydl with every call through Ray (`ray_lane=False`), one call per
batch (`ray_batches_per_call=1`, the shape before NOTE [ raydl calls ]) and several (`"auto"`); and raydl's
default (lanes: NOTE [ raydl lane ]), in rotated order, per repetition:
  * driver CPU per batch: this process's CPU time (`time.process_time()`: every thread, Ray's own included)
    over the measured epochs, divided by their batches (torch's figure leaves out its worker processes,
    raydl's its actors);
  * samples/s over the same epoch, and the ratio to torch's in the same repetition.
Each loader runs one unmeasured epoch first (start-up, warm-up), then `--epochs` measured ones.
Prints a Markdown table (median and range over repetitions); writes JSON lines to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.utils.data

import raydl
from benchmarks.common.results import Results
from benchmarks.common.workloads import Workload, WorkloadDataset

WORKLOAD = Workload("trivial", "overhead floor: 16-float sample, batch 64", 64 * 400, 64, "trivial")
NAMES = ("torch", "raydl Ray calls, k=1", "raydl Ray calls, auto", "raydl default (lanes)")


def make(name: str, ds: torch.utils.data.Dataset, prefetch_factor: int, in_order: bool = True):
    kw = dict(batch_size=64, num_workers=2, persistent_workers=True, prefetch_factor=prefetch_factor, in_order=in_order)
    if name == "torch":
        return torch.utils.data.DataLoader(ds, **kw)
    if name == "raydl default (lanes)":
        return raydl.DataLoader(ds, **kw)
    return raydl.DataLoader(ds, **kw, ray_lane=False, ray_batches_per_call=1 if name.endswith("k=1") else "auto")


def measure(name: str, epochs: int, n: int, prefetch_factor: int, in_order: bool = True) -> dict:
    """One loader: a warm-up epoch, then `epochs` measured ones (driver CPU us per batch, samples/s)."""
    loader = make(name, WorkloadDataset(WORKLOAD, n), prefetch_factor, in_order)
    for _ in loader:  # start-up and warm-up
        pass
    it = getattr(loader, "_iterator", None)
    sched = getattr(it, "_sched", None)
    calls0 = sched.calls_sent if sched is not None else 0
    lane0 = it._calls.lane_calls if sched is not None else 0
    batches = samples = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(epochs):
        for x, _y in loader:
            batches += 1
            samples += len(x)
    c1, t1 = time.process_time(), time.perf_counter()
    calls = (sched.calls_sent - calls0) if sched is not None else None
    lane_calls = (it._calls.lane_calls - lane0) if sched is not None else None
    if hasattr(loader, "shutdown"):
        loader.shutdown()
    del loader
    cpu_s = c1 - c0
    return {
        "loader": name,
        "driver_cpu_us_per_batch": cpu_s / batches * 1e6,
        "samples_per_s": samples / (t1 - t0),
        "batches_per_call": batches / calls if calls else None,
        "lane_share": lane_calls / calls if calls else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5; quick 2)")
    p.add_argument("--epochs", type=int, default=None, help="measured epochs per repetition (default 3; quick 1)")
    p.add_argument("--prefetch-factor", type=int, default=2, help="every loader's prefetch_factor (torch's default 2)")
    p.add_argument("--unordered", action="store_true", help="every loader with in_order=False (torch's too)")
    args = p.parse_args()
    reps = args.reps or (2 if args.quick else 5)
    epochs = args.epochs or (1 if args.quick else 3)
    n = WORKLOAD.n // (4 if args.quick else 1)
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows: dict[str, list[dict]] = {k: [] for k in NAMES}
    names = list(NAMES)
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        got = {name: measure(name, epochs, n, args.prefetch_factor, not args.unordered) for name in order}
        for name in names:
            got[name]["ratio_to_torch"] = got[name]["samples_per_s"] / got["torch"]["samples_per_s"]
            got[name]["rep"] = rep
            rows[name].append(got[name])
        print(
            f"rep {rep}: " + ", ".join(f"{k} {v['driver_cpu_us_per_batch']:.0f} us" for k, v in got.items()), flush=True
        )
    ray.shutdown()

    def fmt(values: list[float], spec: str) -> str:
        return f"{statistics.median(values):{spec}} ({min(values):{spec}}–{max(values):{spec}})"

    lines = [
        f"{WORKLOAD.description}, 2 workers, prefetch_factor {args.prefetch_factor}"
        f"{', in_order=False' if args.unordered else ''}; "
        f"{reps} repetitions x {epochs} epochs of {n} samples",
        "",
        "| loader | driver CPU per batch (µs) | samples/s | ratio to torch | batches per call | calls over lanes |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        r = rows[name]
        per_call = [x["batches_per_call"] for x in r if x["batches_per_call"]]
        lanes = [x["lane_share"] for x in r if x["lane_share"] is not None]
        lines.append(
            f"| {name} | {fmt([x['driver_cpu_us_per_batch'] for x in r], '.0f')} | "
            f"{fmt([x['samples_per_s'] for x in r], ',.0f')} | {fmt([x['ratio_to_torch'] for x in r], '.2f')} | "
            f"{fmt(per_call, '.2f') if per_call else '-'} | {fmt([100 * x for x in lanes], '.0f') + ' %' if lanes else '-'} |"
        )
    report = "\n".join(lines)
    print("\n" + report)
    res = Results("bench_calls", args.quick)
    for name in names:
        for x in rows[name]:
            res.write(
                {"time": time.time(), "prefetch_factor": args.prefetch_factor, "in_order": not args.unordered, **x}
            )
    md = res.write_text(".md", report + "\n")
    res.close()
    print(f"\nresults: {res.jsonl_path}\n         {md}")


if __name__ == "__main__":
    main()
