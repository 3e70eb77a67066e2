#!/usr/bin/env python3
"""The cost of raydl's stats (`ray_stats=True` vs `False`), and the README's timeline picture.

    python -m benchmarks.bench_stats                 # 8 alternating repetitions per workload (~10 min on 2 cores)
    python -m benchmarks.bench_stats --quick         # smoke run (~2 min)
    python -m benchmarks.bench_stats --picture       # only the picture: benchmarks/figures/bench_stats.png

Throughput is measured exactly as bench_throughput.py measures it (a new persistent loader per
repetition, 1 + --epochs epochs, samples/s over the epochs after the first), on its overhead-floor
workload (16-float samples, batch 64: the driver's per-batch machinery is all there is, so any
per-batch cost of stats shows here first) and its CPU-bound one (~1 ms/sample). The two variants
alternate, in rotated order; the ratio is paired per repetition (stats on / stats off).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import sys
import time

import raydl
from benchmarks import bench_throughput as T
from benchmarks.common.machine import QuietGate, describe_machine, machine_info
from benchmarks.common.results import Results, figure_path, log, md_table, median
from benchmarks.common.workloads import Workload, WorkloadDataset, calibrate_cpu_iters, register_by_value

VARIANTS = ("raydl", "raydl-nostats")


def measure(args: argparse.Namespace, res: Results) -> tuple[list, dict]:
    b = T.Bench(args)
    b.retry_s = 0.0
    b.gate = QuietGate(args.quiet_wait_s, 90.0)
    q = 0.3 if args.quick else 1.0
    iters = calibrate_cpu_iters()
    workloads = [
        Workload("trivial", "overhead floor: 16-float sample, batch 64", int(64 * 160 * q) // 64 * 64, 64, "trivial"),
        Workload(
            "cpu", "CPU-bound ~1 ms/sample, 3×64×64 f32, batch 64", max(384, int(2048 * q) // 64 * 64), 64, "cpu", iters
        ),
    ]
    register_by_value()
    T.consume(b.make("raydl", workloads[0], n=64 * 8), time.perf_counter())  # start Ray and warm workers: not measured
    out: dict = {}
    for wl in workloads:
        log(f"{wl.name}: {wl.n} samples/epoch, {args.reps} reps of {VARIANTS}")
        for rep in range(args.reps):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            for v in order:
                rec = T.measure_throughput(b, res, wl, v, rep)
                out.setdefault((wl.name, v), []).append(rec)
                log(
                    f"  rep {rep} {v:14s} {rec['samples_per_s']:9.0f} samples/s  foreign load {rec['foreign_cores']:.2f}"
                )
    return workloads, out


def micro(n: int = 20000) -> dict:
    """CPU time per batch of the stats hooks themselves (robust to a busy machine, unlike throughput).

    Driver: `batch_made` + one `next()` wrapped by `next_call` + the per-epoch snapshot/metrics
    flush spread over the epoch, on a StatsRecorder fed synthetic BatchMetas (160 batches an epoch,
    as the overhead-floor workload). Worker: what `Worker.fetch` adds with stats on
    (`process_time` twice, `batch_nbytes` of an encoded overhead-floor batch, one Ray histogram
    observation).
    """
    import torch

    from raydl._measures import batch_nbytes, observe_batch_time
    from raydl.driver.stats.recorder import StatsRecorder
    from raydl.worker.actor import BatchMeta
    from raydl.worker.transfer import encode

    rec = StatsRecorder("micro")
    rec._refresh_pool = lambda: None
    metas = [BatchMeta(k % 2, k, 0.0, 0.001, 64, 4096, 0.001) for k in range(160)]
    t0 = time.process_time()
    for _ in range(n // 160):
        rec.begin_epoch()
        for m in metas:
            rec.batch_made(m)
            with rec.next_call():
                pass
        rec.end_epoch()
    driver_us = (time.process_time() - t0) / (n // 160 * 160) * 1e6
    t0 = time.process_time()
    for _ in range(n // 160 * 160):
        with contextlib.nullcontext():
            pass
    baseline_us = (time.process_time() - t0) / (n // 160 * 160) * 1e6
    batch = encode((torch.zeros(64, 16), torch.arange(64)))
    t0 = time.process_time()
    for k in range(n):
        c0 = time.process_time()
        batch_nbytes(batch)
        observe_batch_time("micro", k % 2, 0.001)
        time.process_time() - c0
    worker_us = (time.process_time() - t0) / n * 1e6
    return {"driver_us_per_batch": driver_us - baseline_us, "worker_us_per_batch": worker_us}


def report(info: dict, args: argparse.Namespace, workloads: list, out: dict, mic: dict) -> str:
    lines = ["## raydl stats overhead (`benchmarks/bench_stats.py`)", "", describe_machine(info), ""]
    rows = []
    for wl in workloads:
        on = {r["rep"]: r["samples_per_s"] for r in out[(wl.name, "raydl")]}
        off = {r["rep"]: r["samples_per_s"] for r in out[(wl.name, "raydl-nostats")]}
        ratios = [on[k] / off[k] for k in on if k in off]
        foreign = [r["foreign_cores"] for v in VARIANTS for r in out[(wl.name, v)]]
        rows.append(
            [
                wl.description,
                T.fmt_rate(list(off.values())),
                T.fmt_rate(list(on.values())),
                f"{median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})",
                f"{median(foreign):.2f}",
            ]
        )
    lines.append(
        md_table(
            [
                "workload",
                "ray_stats=False samples/s",
                "ray_stats=True samples/s",
                "on / off (paired median, min–max)",
                "foreign load (cores)",
            ],
            rows,
        )
    )
    floor = median([r["samples_per_s"] for r in out[(workloads[0].name, "raydl-nostats")]]) / workloads[0].batch_size
    lines.append("")
    lines.append(
        f"CPU time of the stats hooks themselves (`micro()`): {mic['driver_us_per_batch']:.1f} µs per batch in "
        f"the driver, {mic['worker_us_per_batch']:.1f} µs per batch in a worker; at this run's overhead-floor "
        f"rate without stats ({floor:,.0f} batches/s, {1e6 / floor:,.0f} µs per batch) the driver's part is "
        f"{100 * mic['driver_us_per_batch'] * floor / 1e6:.2f}% of its time per batch."
    )
    lines.append("")
    lines.append(
        f"{args.num_workers} workers; {args.reps} repetitions alternating the two variants; each a new "
        f"persistent loader run for 1 + {args.epochs} epochs, samples/s over the epochs after the first."
    )
    return "\n".join(lines)


def picture(path: str) -> None:
    """An epoch worth looking at: 3 workers on an I/O-like dataset, one of them on a slow 'disk', a fast loop."""
    wl = Workload("io", "I/O-like", 16 * 18, 16, "io")
    register_by_value()
    loader = raydl.DataLoader(
        WorkloadDataset(wl), batch_size=16, num_workers=3, persistent_workers=True, ray_name="picture"
    )
    with loader:
        for _ in loader:  # epoch 0: start-up
            pass
        for _ in loader:
            time.sleep(0.015)  # the training step
        stats = loader.stats()
        print(stats)
        json_path = path[:-4] + ".json" if path.endswith(".png") else path + ".json"
        written = stats.timeline(json_path)
        os.remove(json_path)  # the trace is not committed; the PNG is
        print("wrote", written[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=None, help="repetitions per variant (default 8; quick 2)")
    p.add_argument("--epochs", type=int, default=None, help="measured epochs after the first (default 3; quick 1)")
    p.add_argument("--quiet-wait-s", type=float, default=5.0)
    p.add_argument("--micro", action="store_true", help="only the CPU time per batch of the stats hooks")
    p.add_argument(
        "--picture",
        nargs="?",
        default="",
        const=figure_path("bench_stats"),
        help="only draw the timeline picture, to benchmarks/figures/bench_stats.png or this .png path",
    )
    args = p.parse_args()
    if args.picture:
        picture(args.picture)
        return 0
    if args.micro:
        import ray

        ray.init(address="local", num_cpus=1, include_dashboard=False)
        print(micro())
        return 0
    args.reps = args.reps or (2 if args.quick else 8)
    args.epochs = args.epochs or (1 if args.quick else 3)
    args.max_retries, args.retry_budget_s = 1, 120.0
    info = {**machine_info(ray_version=importlib.metadata.version("ray")), "num_workers": args.num_workers}
    res = Results("bench_stats", args.quick)
    res.write({"section": "machine", **info, "argv": sys.argv[1:]})
    try:
        workloads, out = measure(args, res)
        mic = micro()
    finally:
        raydl.release_idle_workers()
    res.write({"section": "micro", **mic})
    text = report(info, args, workloads, out, mic)
    print(text)
    md = res.write_text(".md", text + "\n")
    res.close()
    print(f"\nresults: {res.jsonl_path}\n         {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
