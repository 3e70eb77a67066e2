"""Idle memory per worker (PSS) for 1, 4 and 16 workers: raydl's Ray actors next to torch's forked processes.

    python -m benchmarks.bench_worker_memory                       # 1, 4, 16 workers, 3 repetitions
    python -m benchmarks.bench_worker_memory --workers 1,4 --reps 1

Each configuration runs in a fresh Python process (`--child`): a loader with persistent workers
iterates one epoch of a small map-style dataset of tensors (so every worker has imported torch,
unpickled the dataset and collated batches), waits 2 s idle, then the PSS (proportional set size:
private pages plus each shared page divided by the processes sharing it, from
/proc/PID/smaps_rollup) of each worker process is read. For raydl the other processes of the
local Ray it started (GCS, raylet, dashboard/API server, agents, monitors, Ray's idle prestarted
workers) are reported as one fixed cost, and so is the driver. torch's workers are forked from the
driver and share its pages copy-on-write; Ray's workers are separate interpreters (each imports
torch itself), so PSS is the fair comparison (RSS would count shared library pages once per
process). Medians of the repetitions; one JSON line per run, then a markdown table.
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

MIB = 2**20


def _pss(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).memory_full_info().pss / MIB
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0


def _pre_fix_imports(worker_id: int) -> None:
    """What a worker imported before raydl's names became lazy: the driver's modules and pyarrow."""
    import raydl.data.arrow  # noqa: F401
    import raydl.driver.patch  # noqa: F401
    import raydl.loader  # noqa: F401


def child(loader_kind: str, num_workers: int) -> None:
    import psutil
    import torch

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64 * num_workers

        def __getitem__(self, i: int):
            return torch.full((3, 32, 32), float(i))

    if loader_kind == "torch":
        from torch.utils.data import DataLoader

        kwargs = {}
    else:
        import raydl

        DataLoader = raydl.DataLoader
        kwargs = {
            "ray_reuse_workers": False,
            "ray_startup_timeout_s": 900.0,  # 16 starts on a busy 2-core host are slow
            # every batch in a worker: a cold start would make this small epoch in the driver (NOTE [ raydl cold start ])
            "ray_cold_start": False,
        }
        if loader_kind == "raydl-pre-fix-imports":
            kwargs["worker_init_fn"] = _pre_fix_imports
    loader = DataLoader(Samples(), batch_size=16, num_workers=num_workers, persistent_workers=True, **kwargs)
    for _ in loader:
        pass
    time.sleep(2.0)
    me = psutil.Process()
    if loader_kind == "torch":
        workers = [w.pid for w in loader._iterator._workers]
    else:
        workers = [r.pid for r in loader.worker_records]
    descendants = [p.pid for p in me.children(recursive=True)]
    others = [pid for pid in descendants if pid not in set(workers)]
    rec = {
        "loader": loader_kind,
        "num_workers": num_workers,
        "worker_pss_mib": [round(_pss(pid), 1) for pid in workers],
        "driver_pss_mib": round(_pss(me.pid), 1),
        "other_processes": len(others),
        "other_pss_mib": round(sum(_pss(pid) for pid in others), 1),
    }
    print("RESULT " + json.dumps(rec), flush=True)
    if loader_kind != "torch":
        loader.shutdown()


def _run_child_once(loader_kind: str, num_workers: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    cmd = script_command("bench_worker_memory", "--child", loader_kind, "--workers", str(num_workers))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return child_result(proc, "")


def run_child(*args, **kwargs) -> dict:
    """One measurement in a child process, retried when the child fails (see processes.with_retries)."""
    return with_retries(_run_child_once, *args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=("torch", "raydl", "raydl-pre-fix-imports"))
    ap.add_argument("--kinds", default="torch,raydl", help="also: raydl-pre-fix-imports")
    ap.add_argument("--workers", default="1,4,16")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.child:
        child(args.child, int(args.workers))
        return
    counts = [int(n) for n in args.workers.split(",")]
    runs: dict = {}
    for rep in range(args.reps):
        for n in counts:
            kinds = args.kinds.split(",")
            for kind in kinds if rep % 2 == 0 else kinds[::-1]:
                rec = run_child(kind, n)
                rec["rep"] = rep
                rec["loadavg_1m"] = round(os.getloadavg()[0], 1)
                print(json.dumps(rec), flush=True)
                runs.setdefault((kind, n), []).append(rec)
    print(f"\nIdle PSS per worker (MiB), median of {args.reps} (per run: mean over its workers)\n")
    print(
        "| workers | torch per worker | raydl per worker | raydl/torch | torch driver | raydl driver | "
        "raydl's other Ray processes (count, total) |"
    )
    print("|---|---|---|---|---|---|---|")
    med = statistics.median
    for n in counts:
        if ("torch", n) not in runs or ("raydl", n) not in runs:
            continue
        t, r = runs[("torch", n)], runs[("raydl", n)]
        tw = med(statistics.mean(x["worker_pss_mib"]) for x in t)
        rw = med(statistics.mean(x["worker_pss_mib"]) for x in r)
        print(
            f"| {n} | {tw:.0f} | {rw:.0f} | {rw / tw:.1f}× | {med(x['driver_pss_mib'] for x in t):.0f} | "
            f"{med(x['driver_pss_mib'] for x in r):.0f} | {med(x['other_processes'] for x in r):.0f}, "
            f"{med(x['other_pss_mib'] for x in r):.0f} |"
        )
    for (kind, n), recs in sorted(runs.items()):
        if kind == "raydl-pre-fix-imports":
            print(
                f"\n{n} workers importing what raydl's workers imported before the lazy public names: "
                f"{med(statistics.mean(x['worker_pss_mib']) for x in recs):.0f} MiB per worker"
            )


if __name__ == "__main__":
    with printed_report("bench_worker_memory", quick="--quick" in sys.argv, enabled="--child" not in sys.argv):
        main()
