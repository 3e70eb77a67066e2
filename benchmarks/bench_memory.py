#!/usr/bin/env python3
"""Memory of a metadata dataset under torch's DataLoader and raydl: Python objects vs raydl.ArrowDataset.

    python -m benchmarks.bench_memory            # full run: 5 M rows, 8 workers, batch 256, 2 epochs
    python -m benchmarks.bench_memory --quick    # smoke run: 200 k rows, 4 workers
    python -m benchmarks.bench_memory --rows 2000000

The dataset: `rows` rows of (path "images/00001234.jpg", int label, a short caption), about
200 bytes a row as Python objects, about 60 as Arrow. Each loader runs in its own fresh
subprocess (so no loader inherits another's memory), iterates two epochs of shuffled batches
(persistent workers, so the workers are alive at the end) and then measures, at the end of the
second epoch:
  * the PSS (psutil `memory_full_info().pss`: private pages plus a 1/n share of each page n
    processes map) of the driver and of every worker: torch's forked worker processes, or the
    Ray worker processes of raydl's actors. Pages of Ray's object store are left out of the PSS
    (each process's mapping of the store, from /proc/PID/smaps, is subtracted) and counted once
    instead, as
  * the object store's used bytes on the node (`ray memory --stats-only`'s figure);
  * total = driver + workers + object store. Ray's own processes (raylet, GCS, dashboard) are
    reported beside it, not in it.
Loaders: torch over a Python-list dataset (copy-on-read: pytorch/pytorch#13246), raydl over the
same list dataset (each actor unpickles a copy), raydl over ArrowDataset (one copy in the object
store), torch over ArrowDataset (forked workers share the driver's buffers), and raydl over an
ArrowDataset memory-mapped from an Arrow IPC file (the page cache is the copy). Idle workers (a
tiny dataset) give the fixed cost per worker. Separately: the time to read a batch through
`ArrowDataset.__getitems__` (one take) vs indexing the same table row by row.
Goal (issue 12): raydl + ArrowDataset total <= 1.3 x (one copy of the table + the driver's and
workers' fixed cost). The machine is shared (other processes' memory and CPU vary): the report
records free memory and the load average.
Outputs: a Markdown report on stdout (and .md), JSON lines and a PNG in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import tempfile
import time
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.utils.data

import raydl
from benchmarks.common import REPO
from benchmarks.common.machine import describe_machine, machine_info, object_store_stats
from benchmarks.common.processes import script_command
from benchmarks.common.results import Results, log, md_table

LOADERS = ("torch-list", "raydl-list", "raydl-arrow", "torch-arrow", "raydl-arrow-mmap")
# Idle workers: a 64-row dataset; "-arrow" holds a 64-row ArrowDataset (the worker imports pyarrow).
IDLE = ("torch-idle", "raydl-idle", "raydl-idle-arrow")
MB = 2**20
# Measured: a row as Python objects (tuple, two str, an int) takes about 260 bytes in a process.
PY_BYTES_PER_ROW = 260
_ADJ = ["red", "small", "old", "shiny", "wooden", "blue", "tall"]
_NOUN = ["cat", "house", "car", "tree", "boat", "lamp", "chair", "dog", "bridge", "cup", "kite"]


# --------------------------------------------------------------------------- the data


def arrow_table(rows: int) -> pa.Table:
    """The metadata table, built column-wise (no Python object per row ever exists)."""
    i = pa.array(np.arange(rows, dtype=np.int64))
    digits = pc.utf8_lpad(pc.cast(i, pa.string()), 8, "0")
    path = pc.binary_join_element_wise("images/", digits, ".jpg", "")
    adj = pc.take(pa.array(_ADJ), pa.array(np.arange(rows) % len(_ADJ)))
    noun = pc.take(pa.array(_NOUN), pa.array(np.arange(rows) % len(_NOUN)))
    caption = pc.binary_join_element_wise("a photo of a ", adj, " ", noun, " no. ", pc.cast(i, pa.string()), "")
    label = pa.array((np.arange(rows) * 7919 % 1000).astype(np.int64))
    return pa.table({"path": path, "label": label, "caption": caption})


def python_rows(rows: int) -> list:
    """The same rows as Python objects: a list of (str, int, str) tuples."""
    return [
        (f"images/{i:08d}.jpg", i * 7919 % 1000, f"a photo of a {_ADJ[i % len(_ADJ)]} {_NOUN[i % len(_NOUN)]} no. {i}")
        for i in range(rows)
    ]


class ListDataset(torch.utils.data.Dataset):
    """The classic metadata dataset: a Python list of rows, indexed per sample."""

    def __init__(self, rows: list) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        path, label, caption = self.rows[i]
        return {"path": path, "label": label, "caption": caption}


class TinyDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return {"path": f"images/{i:08d}.jpg", "label": i, "caption": "x"}


# --------------------------------------------------------------------------- measuring


def _plasma_pss(proc: psutil.Process) -> int:
    return sum(m.pss for m in proc.memory_maps(grouped=True) if "plasma" in m.path)


def pss(pid: int) -> dict:
    """PSS and USS of one process, with its share of Ray's object store mapping taken out of the PSS."""
    p = psutil.Process(pid)
    full = p.memory_full_info()
    plasma = _plasma_pss(p)
    return {"pss": full.pss - plasma, "uss": full.uss, "plasma_pss": plasma}


def ray_system_pids() -> list:
    """raylet, GCS, dashboard and other Ray processes that are not worker processes of actors."""
    out = []
    me = psutil.Process()
    for child in me.children(recursive=True):
        try:
            name = " ".join(child.cmdline()[:3])
        except psutil.Error:
            continue
        if "default_worker.py" not in name and "ray::" not in name:
            out.append(child.pid)
    return out


def run_one(kind: str, rows: int, workers: int, batch_size: int, epochs: int, ipc_path: str) -> dict:
    """One loader in this (fresh) process; returns its memory at the end of the last epoch."""
    uses_ray = kind.startswith("raydl")
    if uses_ray:
        import ray

        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=int(max(512 * MB, min(6 * 2**30, rows * 400))),
        )
        # A tiny loader first: Ray's and raydl's own driver-side state exists before the baseline.
        list(raydl.DataLoader(TinyDataset(), batch_size=16, num_workers=1, ray_reuse_workers=False))
    gc.collect()
    driver_base = pss(os.getpid())["pss"]
    t0 = time.perf_counter()
    table_bytes = None
    if kind.endswith("list"):
        dataset: Any = ListDataset(python_rows(rows))
    elif kind.endswith("idle"):
        dataset = TinyDataset()
    elif kind.endswith("idle-arrow"):
        dataset = raydl.ArrowDataset(arrow_table(64))
    elif kind.endswith("mmap"):
        dataset = raydl.ArrowDataset(ipc_path)
        table_bytes = dataset.table.nbytes
    else:
        dataset = raydl.ArrowDataset(arrow_table(rows))
        table_bytes = dataset.table.nbytes
    build_s = time.perf_counter() - t0
    gc.collect()
    driver_with_data = pss(os.getpid())["pss"]
    generator = torch.Generator().manual_seed(0)
    common = dict(
        batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=True, generator=generator
    )
    if uses_ray:
        # Unpickling a big list dataset in 8 actors on a busy 2-core machine takes minutes.
        loader = raydl.DataLoader(dataset, timeout=600, ray_reuse_workers=False, ray_startup_timeout_s=900, **common)
    else:
        loader = torch.utils.data.DataLoader(dataset, timeout=600, multiprocessing_context="fork", **common)
    t0 = time.perf_counter()
    batches = 0
    epoch_s = []
    for _ in range(epochs):
        te = time.perf_counter()
        for batch in loader:
            batches += 1
        epoch_s.append(time.perf_counter() - te)
    gc.collect()
    if uses_ray:
        worker_pids = [r.pid for r in loader.worker_records]
        store = object_store_stats().get("used_bytes", 0)
        system = sum(pss(p)["pss"] for p in ray_system_pids() if psutil.pid_exists(p))
    else:
        worker_pids = [c.pid for c in psutil.Process().children()]
        store, system = 0, 0
    driver = pss(os.getpid())
    per_worker = [pss(p) for p in worker_pids]
    record = {
        "kind": kind,
        "rows": rows,
        "workers": workers,
        "table_bytes": table_bytes,
        "driver_base_pss": driver_base,
        "driver_with_data_pss": driver_with_data,
        "driver_pss": driver["pss"],
        "workers_pss": sum(w["pss"] for w in per_worker),
        "worker_pss_each": [w["pss"] for w in per_worker],
        "worker_uss_each": [w["uss"] for w in per_worker],
        "object_store_bytes": store,
        "ray_system_pss": system,
        "build_s": build_s,
        "epoch_s": epoch_s,
        "batches": batches,
    }
    record["total"] = record["driver_pss"] + record["workers_pss"] + record["object_store_bytes"]
    if uses_ray:
        loader.shutdown()
        import ray

        ray.shutdown()
    else:
        del loader
    return record


def getitems_speed(rows: int, batch_size: int, batches: int) -> dict:
    """Seconds per batch: ArrowDataset.__getitems__ (one take) vs indexing the same table row by row."""
    ds = raydl.ArrowDataset(arrow_table(rows))
    rng = np.random.default_rng(0)
    picks = [rng.integers(0, rows, batch_size).tolist() for _ in range(batches)]
    ds.__getitems__(picks[0])
    t0 = time.perf_counter()
    for idx in picks:
        ds.__getitems__(idx)
    batch_s = (time.perf_counter() - t0) / batches
    t0 = time.perf_counter()
    for idx in picks:
        [ds[i] for i in idx]
    row_s = (time.perf_counter() - t0) / batches
    return {"getitems_ms": batch_s * 1e3, "row_by_row_ms": row_s * 1e3, "speedup": row_s / batch_s}


# --------------------------------------------------------------------------- orchestration


def _child(kind: str, args: argparse.Namespace, ipc_path: str) -> dict:
    cmd = [
        *script_command("bench_memory"),
        "--one",
        kind,
        "--rows",
        str(args.rows),
        "--workers",
        str(args.workers),
        "--batch-size",
        str(args.batch_size),
        "--epochs",
        str(args.epochs),
        "--ipc",
        ipc_path,
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"kind": kind, "error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(lines[-1][len("RESULT ") :])


def _idle_for(kind: str, idle: dict) -> str:
    """The idle worker whose memory is a loader's fixed cost per worker."""
    if not kind.startswith("raydl"):
        return "torch-idle"
    if "arrow" in kind and "error" not in idle.get("raydl-idle-arrow", {"error": 1}):
        return "raydl-idle-arrow"
    return "raydl-idle"


def _mb(x: float | None) -> str:
    return "–" if x is None else f"{x / MB:,.0f}"


def _chart(records: dict, idle: dict, table_bytes: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in LOADERS if "error" not in records.get(k, {"error": 1})]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    bottom = np.zeros(len(kinds))
    for part, color in (("driver_pss", "#4c72b0"), ("workers_pss", "#dd8452"), ("object_store_bytes", "#55a868")):
        vals = np.array([records[k][part] / MB for k in kinds])
        ax.bar(
            kinds,
            vals,
            bottom=bottom,
            label=part.replace("_pss", "").replace("_bytes", "").replace("_", " "),
            color=color,
        )
        bottom += vals
    ax.axhline(table_bytes / MB, color="k", ls="--", lw=1, label="one copy of the Arrow table")
    ax.set_ylabel("MiB (PSS; object store counted once)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    names = [k for k in IDLE if "error" not in idle.get(k, {"error": 1})]
    ax2.bar(names, [np.mean(idle[k]["worker_pss_each"]) / MB for k in names], color="#8172b3", label="PSS")
    ax2.bar(names, [np.mean(idle[k]["worker_uss_each"]) / MB for k in names], color="#c44e52", width=0.4, label="USS")
    ax2.set_title("idle worker (fixed cost)", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 k rows, 4 workers")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--speed-batches", type=int, default=200)
    ap.add_argument("--timeout-s", type=int, default=1800, help="per loader subprocess")
    ap.add_argument("--only", default=None, help="comma-separated loaders to run (default: all)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ipc", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rows = args.rows or (200_000 if args.quick else 5_000_000)
    args.workers = args.workers or (4 if args.quick else 8)
    if args.one:
        record = run_one(args.one, args.rows, args.workers, args.batch_size, args.epochs, args.ipc)
        print("RESULT " + json.dumps(record))
        return

    info = machine_info()
    results = Results("bench_memory", args.quick)
    start = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="raydl_bench_memory_")
    ipc_path = os.path.join(folder, "metadata.arrow")
    table = arrow_table(args.rows)
    table_bytes = table.nbytes
    import pyarrow.feather as feather

    feather.write_feather(table, ipc_path, compression="uncompressed")
    del table
    speed = getitems_speed(min(args.rows, 1_000_000), args.batch_size, args.speed_batches)
    results.write({"speed": speed, **info})
    log(
        f"__getitems__ {speed['getitems_ms']:.2f} ms/batch vs row by row {speed['row_by_row_ms']:.2f} ms: {speed['speedup']:.1f}x"
    )
    idle = {}
    for kind in IDLE:
        idle[kind] = _child(kind, argparse.Namespace(**{**vars(args), "rows": 64}), ipc_path)
        results.write(idle[kind])
        log(f"{kind}: {idle[kind].get('error') or [round(x / MB) for x in idle[kind]['worker_pss_each']]}")
    records = {}
    only = args.only.split(",") if args.only else LOADERS
    free_at_start = psutil.virtual_memory().available
    for kind in LOADERS:
        if kind not in only:
            continue
        need = (args.workers + 2) * args.rows * PY_BYTES_PER_ROW if kind.endswith("list") else 0
        if need > psutil.virtual_memory().available - 3 * 2**30:
            records[kind] = {
                "kind": kind,
                "error": f"skipped: would need about {need / 2**30:.1f} GiB, "
                f"{psutil.virtual_memory().available / 2**30:.1f} GiB available (use fewer --rows)",
            }
            log(records[kind]["error"])
            continue
        log(f"{kind}: running ({psutil.virtual_memory().available / 2**30:.1f} GiB available)")
        records[kind] = _child(kind, args, ipc_path)
        records[kind]["available_before"] = psutil.virtual_memory().available
        results.write(records[kind])
        r = records[kind]
        log(
            f"{kind}: "
            + (
                r["error"][-300:]
                if "error" in r
                else f"total {_mb(r['total'])} MiB, epochs {[round(s, 1) for s in r['epoch_s']]} s"
            )
        )
    os.remove(ipc_path)
    os.rmdir(folder)

    def fixed(kind_idle: str, base: float) -> float:
        each = idle.get(kind_idle, {}).get("worker_pss_each") or [0]
        return base + args.workers * float(np.mean(each))

    lines = [
        f"# bench_memory: {args.rows:,} rows, {args.workers} workers, batch {args.batch_size}, {args.epochs} epochs (shuffled)",
        "",
        describe_machine(info),
        f"Memory available at start: {free_at_start / 2**30:.1f} GiB of {psutil.virtual_memory().total / 2**30:.1f} (a shared machine).",
        f"One copy of the Arrow table: {_mb(table_bytes)} MiB.",
        "",
    ]
    header = [
        "loader",
        "driver (MiB)",
        "workers (MiB)",
        "object store (MiB)",
        "total (MiB)",
        "total / Arrow table",
        "(total − fixed) / table",
        "per worker (MiB)",
        "epoch times (s)",
        "Ray's own processes (MiB)",
    ]
    rows = []
    for kind in LOADERS:
        r = records.get(kind)
        if r is None:
            continue
        if "error" in r:
            rows.append([kind, "failed: " + r["error"].splitlines()[-1][:120]] + [""] * 8)
            continue
        fx = fixed(_idle_for(kind, idle), r["driver_base_pss"])
        rows.append(
            [
                kind,
                _mb(r["driver_pss"]),
                _mb(r["workers_pss"]),
                _mb(r["object_store_bytes"]),
                _mb(r["total"]),
                f"{r['total'] / table_bytes:.2f}×",
                f"{(r['total'] - fx) / table_bytes:.2f}×",
                f"{_mb(min(r['worker_pss_each']))}–{_mb(max(r['worker_pss_each']))}",
                " / ".join(f"{s:.0f}" for s in r["epoch_s"]),
                _mb(r["ray_system_pss"]) if kind.startswith("raydl") else "–",
            ]
        )
    lines += [md_table(header, rows), ""]
    lines += [
        "fixed = the driver's PSS before the dataset existed + workers × an idle worker's PSS (below; for raydl over "
        "Arrow, an idle worker holding a 64-row ArrowDataset, i.e. with pyarrow imported).",
        "",
    ]
    idle_rows = []
    for kind in IDLE:
        r = idle.get(kind, {})
        if "error" in r:
            idle_rows.append([kind, "failed", ""])
            continue
        idle_rows.append(
            [kind, f"{np.mean(r['worker_pss_each']) / MB:.0f}", f"{np.mean(r['worker_uss_each']) / MB:.0f}"]
        )
    lines += [
        "Idle worker (a 64-row dataset), mean over the workers:",
        "",
        md_table(["worker", "PSS (MiB)", "USS (MiB)"], idle_rows),
        "",
    ]
    ra = records.get("raydl-arrow")
    if ra and "error" not in ra:
        fx = fixed(_idle_for("raydl-arrow", idle), ra["driver_base_pss"])
        goal = ra["total"] / (table_bytes + fx)
        lines.append(
            f"Goal: raydl + ArrowDataset total / (one table + fixed cost) = {goal:.2f} (goal ≤ 1.3): "
            f"{'met' if goal <= 1.3 else 'NOT met'}."
        )
    lines.append(
        f"Reading a batch of {args.batch_size}: `__getitems__` {speed['getitems_ms']:.2f} ms, row by row "
        f"{speed['row_by_row_ms']:.2f} ms: {speed['speedup']:.1f}× faster (goal ≥ 5×: "
        f"{'met' if speed['speedup'] >= 5 else 'NOT met'})."
    )
    lines += [
        "",
        f"Run took {(time.perf_counter() - start) / 60:.1f} min; load average at end "
        f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}.",
    ]
    png = results.figure_path()
    try:
        _chart(
            records,
            idle,
            table_bytes,
            png,
            f"{args.rows:,} rows, {args.workers} workers: memory at the end of epoch {args.epochs}",
        )
        lines.append(f"Chart: {os.path.relpath(png, REPO)}")
    except Exception as e:  # matplotlib missing: the table is the result
        lines.append(f"(no chart: {e})")
    report = "\n".join(lines)
    print(report)
    md = results.write_text(".md", report + "\n")
    results.close()
    print(f"\nresults: {results.jsonl_path}\n         {md}")


if __name__ == "__main__":
    main()
