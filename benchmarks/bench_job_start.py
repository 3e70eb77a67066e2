"""A new job pool's first batch: how long a rank waits for it, and the CPU its coordinator spends starting.

    python -m benchmarks.bench_job_start             # 4 repetitions (~1 min)
    python -m benchmarks.bench_job_start --reps 8

One process, Ray already up (a local Ray started first, 2 CPUs: the time to start Ray is not counted),
a 64-sample tensor dataset, batch 8, 2 workers, `ray_reuse_workers=False` (no warm worker to take).
Repetitions alternate two loaders, each new: a private pool (`ray_job=None`) and a one-rank job pool
(`ray_job="..."`, a new name each time: a new coordinator actor). Measured from `iter()` to the first
batch in hand; for the job, also the CPU time of its coordinator process (read from /proc while it runs,
Linux only). A job's first batch waits for the coordinator's start-up and then the workers', which the
coordinator creates: NOTE [ raydl worker shell ] keeps torch out of the coordinator.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time

from benchmarks.common.results import printed_report

_TICK = os.sysconf("SC_CLK_TCK")


def _coordinator_cpu_s() -> float:
    """The CPU seconds of the live processes titled `ray::_Coordinator...` (0 when none)."""
    total = 0.0
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(d + "/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::_Coordinator"):
                    continue
            with open(d + "/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    import torch
    from torch.utils.data import TensorDataset

    import raydl

    ray.init(address="local", include_dashboard=False, num_cpus=2)
    dataset = TensorDataset(torch.arange(64.0))
    rows = {"private pool": [], "job pool": [], "job coordinator CPU": []}
    for rep in range(args.reps):
        for kind in ("private pool", "job pool"):
            job = f"bench-job-start-{os.getpid()}-{rep}" if kind == "job pool" else None
            loader = raydl.DataLoader(dataset, batch_size=8, num_workers=2, ray_job=job, ray_reuse_workers=False)
            t0 = time.perf_counter()
            it = iter(loader)
            next(it)
            rows[kind].append(time.perf_counter() - t0)
            if job is not None:
                rows["job coordinator CPU"].append(_coordinator_cpu_s())
            print({"rep": rep, "kind": kind, "first_batch_s": round(rows[kind][-1], 3)}, flush=True)
            del it, loader
            time.sleep(2.0)  # the pool's actors end before the next loader starts
    ray.shutdown()
    print("\n| what | median | min | max |\n|---|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} (s) | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    with printed_report("bench_job_start", quick="--quick" in sys.argv):
        main()
