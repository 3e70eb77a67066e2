"""CPU-bound throughput with every core busy: torch vs raydl with its workers at the driver's niceness vs at Ray's +15.

    python -m benchmarks.bench_niceness                  # 3 repetitions, about 4 minutes on 2 cores
    python -m benchmarks.bench_niceness --reps 5 --batches 60

Every measurement is a fresh Python process (`--child MODE`), so each raydl run starts its own
local Ray with the niceness setting under test:
  * torch: torch's DataLoader, workers forked at the driver's niceness;
  * raydl: raydl's default for the Ray it starts itself: workers at the driver's niceness
    (NOTE [ raydl worker niceness ] in raydl/cluster/connect.py);
  * raydl-nice15: the same with RAY_worker_niceness=15 (Ray's own default: workers 15 below).
Workload: the CPU-bound samples of bench_throughput.py (~1 ms of NumPy/Python each, 3x64x64 f32,
batch 64) with as many workers as cores, while the driver runs a CPU-bound "training step" per
batch (`--step-ms` of single-threaded work): every core is busy. Other processes on the machine
compete too, which is what niceness decides. samples/s is measured after a warm-up epoch, over
`--batches` batches. Medians of the repetitions, modes in rotated order; per-run ratios vs the
torch run of the same repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common.processes import REPO, child_result, script_command, with_retries  # no torch, no Ray
from benchmarks.common.results import printed_report

MODES = ("torch", "raydl", "raydl-nice15")


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        x += 1


def child(mode: str, batches: int, step_ms: float, workers: int) -> None:
    from benchmarks.common.workloads import Workload, WorkloadDataset, register_by_value

    wl = Workload("cpu", "CPU-bound", 64 * (batches + 4), 64, "cpu", cpu_iters=C_ITERS)
    if mode == "torch":
        from torch.utils.data import DataLoader

        kwargs = {}
    else:
        import raydl

        register_by_value()
        DataLoader = raydl.DataLoader
        kwargs = {}
    loader = DataLoader(WorkloadDataset(wl), batch_size=64, num_workers=workers, persistent_workers=True, **kwargs)
    for _ in loader:  # warm-up epoch: start-up excluded
        _busy(step_ms)
    start = time.perf_counter()
    n = 0
    for batch in loader:
        _busy(step_ms)
        n += len(batch[1])
    elapsed = time.perf_counter() - start
    nice = None
    if mode != "torch":
        import ray

        nice = ray.get(
            loader._iterator._pool.actors[0].__ray_call__.remote(lambda self: os.getpriority(os.PRIO_PROCESS, 0))
        )
        loader.shutdown()
    print(
        "RESULT "
        + json.dumps(
            {
                "mode": mode,
                "samples_per_s": round(n / elapsed, 1),
                "worker_niceness": nice,
                "driver_niceness": os.getpriority(os.PRIO_PROCESS, 0),
            }
        ),
        flush=True,
    )


C_ITERS = 60  # ~1 ms per sample on this project's 2-core VM (bench_throughput's calibration order of magnitude)


def _run_child_once(mode: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_worker_niceness")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    if mode == "raydl-nice15":
        env["RAY_worker_niceness"] = "15"
    cmd = [
        *script_command("bench_niceness"),
        "--child",
        mode,
        "--batches",
        str(args.batches),
        "--step-ms",
        str(args.step_ms),
        "--workers",
        str(args.workers),
    ]
    load0 = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    rec = child_result(proc, mode)
    rec["loadavg_1m"] = round((load0 + os.getloadavg()[0]) / 2, 1)
    return rec


def run_child(*args, **kwargs) -> dict:
    """One measurement in a child process, retried when the child fails (see processes.with_retries)."""
    return with_retries(_run_child_once, *args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=MODES)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.batches, args.step_ms, args.workers)
        return
    runs: dict = {m: [] for m in MODES}
    ratios: dict = {m: [] for m in MODES if m != "torch"}
    for rep in range(args.reps):
        order = MODES[rep % 3 :] + MODES[: rep % 3]
        this = {}
        for mode in order:
            rec = run_child(mode, args)
            rec["rep"] = rep
            print(json.dumps(rec), flush=True)
            runs[mode].append(rec)
            this[mode] = rec["samples_per_s"]
        for mode in ratios:
            ratios[mode].append(this[mode] / this["torch"])
    med = statistics.median
    print(f"\nCPU-bound, {args.workers} workers, {args.step_ms:g} ms driver step per batch, median of {args.reps}\n")
    print("| loader | worker niceness (driver 0) | samples/s | vs torch (paired) | load avg (1 min) |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        recs = runs[mode]
        nice = recs[0]["worker_niceness"]
        ratio = "1.00×" if mode == "torch" else f"{med(ratios[mode]):.2f}×"
        print(
            f"| {mode} | {'same' if nice is None else nice} | {med(r['samples_per_s'] for r in recs):,.0f} | {ratio} | "
            f"{med(r['loadavg_1m'] for r in recs):.1f} |"
        )


if __name__ == "__main__":
    with printed_report("bench_niceness", quick="--quick" in sys.argv, enabled="--child" not in sys.argv):
        main()
