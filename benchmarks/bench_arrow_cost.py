"""Where the core time of bench_arrow's raydl run goes: rows per second and CPU milliseconds per batch of the trainer
and of each worker process, per epoch.

    python -m benchmarks.bench_arrow_cost                   # 200,000 rows, batch 1024, 2 workers, 4 epochs
    python -m benchmarks.bench_arrow_cost --batch-transform # the batches in the table's own dtypes

The same table and loader as bench_arrow.py's "raydl-columnar" (its defaults: shuffle=True, persistent workers).
The CPU of every process on the machine is read from /proc before and after each epoch (Linux only), so a
process's share includes its threads (Ray's among them); the loop does nothing with the batches. Issue 38's
target of half the one-process ceiling allows 2 cores x 2 / ceiling of core time per batch on this 2-core host:
this prints what raydl spends against that.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

from benchmarks.bench_arrow import keep_columns, make_table
from benchmarks.common.results import printed_report

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_by_pid() -> dict:
    """{pid: (command, CPU seconds so far)} for every process /proc shows."""
    out = {}
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(d + "/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(d + "/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(d[6:])] = (cmd[:40], (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-transform", action="store_true", help="the identity batch transform (Arrow's dtypes)")
    args = ap.parse_args()
    import ray

    import raydl

    ray.init(address="local", include_dashboard=False, num_cpus=max(2, args.workers))
    table = make_table(args.rows)
    ds = raydl.ArrowDataset(table, batch_transform=keep_columns if args.batch_transform else None)
    loader = raydl.DataLoader(
        ds, batch_size=args.batch, shuffle=True, num_workers=args.workers, persistent_workers=True
    )
    me = os.getpid()
    for epoch in range(args.epochs):
        before, t0, batches = _cpu_by_pid(), time.perf_counter(), 0
        for _ in loader:
            batches += 1
        wall, after = time.perf_counter() - t0, _cpu_by_pid()
        used = {pid: after[pid][1] - before.get(pid, ("", 0.0))[1] for pid in after}
        workers = sorted(
            (round(c / batches * 1e3, 3) for pid, c in used.items() if after[pid][0].startswith("ray::Worker")),
            reverse=True,
        )
        print(
            json.dumps(
                {
                    "epoch": epoch,
                    "rows_per_s": round(batches * args.batch / wall),
                    "wall_ms_per_batch": round(wall / batches * 1e3, 3),
                    "core_ms_per_batch_all": round(sum(used.values()) / batches * 1e3, 3),
                    "trainer_ms_per_batch": round(used.get(me, 0.0) / batches * 1e3, 3),
                    "worker_ms_per_batch": workers,
                }
            ),
            flush=True,
        )
    ray.shutdown()


if __name__ == "__main__":
    with printed_report("bench_arrow_cost", quick="--quick" in sys.argv):
        main()
