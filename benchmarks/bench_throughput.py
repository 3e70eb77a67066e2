#!/usr/bin/env python3
"""raydl.DataLoader vs torch's DataLoader vs Ray Data, in one process, on one machine.

    python -m benchmarks.bench_throughput            # full run (about 6-10 minutes on 2 cores)
    python -m benchmarks.bench_throughput --quick    # smoke run (about 1-2 minutes)

What it measures (see benchmarks/README.md for what each number means):
  (e) start-up: time to first batch, cold (first loader of the process: for raydl Ray's start
      and the actors' start are included), warm (a new loader while Ray is up: raydl's warm
      pool; also raydl with ray_reuse_workers=False) and the next epoch with persistent workers;
  (a)-(d) steady-state throughput in samples/s (epochs 2.. of a loader; its first epoch, with
      start-up, excluded) for a CPU-bound, a trivial (overhead floor), a large-sample and an
      I/O-latency-bound workload, the loaders' repetitions alternating (rotated order) so slow
      drifts of the machine hit all of them;
  (f) driver RSS, object-store use and batches held over 20 epochs.
Outputs: a Markdown report on stdout (and .md), JSON lines and a PNG chart in benchmarks/results/.
Every measurement records how many cores processes other than this one's used meanwhile
("foreign load"); a throughput measurement above the threshold is repeated (--max-retries).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import inspect
import os
import sys
import threading
import time
from typing import Any, Callable

import psutil
import torch
import torch.utils.data

import raydl  # (does not import ray: raydl imports it on first iteration)
from benchmarks.common.machine import (
    DISTURBED_FOREIGN_CORES,
    LoadMonitor,
    QuietGate,
    describe_machine,
    machine_info,
    object_store_stats,
)
from benchmarks.common.results import Results, log, md_table, median
from benchmarks.common.workloads import (
    IO_SLEEP_S,
    RayDataMap,
    Workload,
    WorkloadDataset,
    batch_samples,
    calibrate_cpu_iters,
    register_by_value,
    sample_cost_s,
)

LOADERS = ("torch", "raydl", "raydata")


# --------------------------------------------------------------------------- loaders


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.W = args.num_workers
        self.has_threads = "ray_threads_per_worker" in inspect.signature(raydl.DataLoader.__init__).parameters

    def make(self, loader: str, wl: Workload, n: int | None = None, **kw: Any) -> Any:
        """An iterable over one epoch of workload `wl` for `loader` (construction only)."""
        ds = WorkloadDataset(wl, n)
        if loader == "torch":
            return torch.utils.data.DataLoader(ds, batch_size=wl.batch_size, num_workers=self.W, **kw)
        if loader.startswith("raydl"):
            if loader == "raydl-threads8":
                kw = dict(kw, ray_threads_per_worker=8)
            if loader == "raydl-nostats":  # the cost of ray_stats (the retired bench_stats measured it)
                kw = dict(kw, ray_stats=False)
            return raydl.DataLoader(ds, batch_size=wl.batch_size, num_workers=self.W, **kw)
        if loader == "raydata":
            return RayDataEpochs(wl, ds.n, self.W)
        raise ValueError(loader)


class RayDataEpochs:
    """`ray.data.range(N).map_batches(same per-sample work, concurrency=W).iter_torch_batches(...)`.

    Iterating it again re-executes the dataset (Ray Data's epoch), like a new loader epoch.
    """

    reservation = False

    def __init__(self, wl: Workload, n: int, num_workers: int) -> None:
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        # Ray Data reserves part of the cluster's CPUs for each operator (read, map); on a 2-CPU
        # machine that leaves the map operator 1 task at a time, half the requested concurrency.
        # Off by default here so Ray Data really runs `num_workers` map tasks, like the others.
        ctx.op_resource_reservation_enabled = RayDataEpochs.reservation
        # one read block per 4 batches: enough blocks for W tasks to stream, few enough to stay cheap
        blocks = max(num_workers, n // (wl.batch_size * 4))
        self.ds = ray.data.range(n, override_num_blocks=blocks).map_batches(
            RayDataMap(wl), batch_size=wl.batch_size, batch_format="numpy", concurrency=num_workers
        )
        self.batch_size = wl.batch_size

    def __iter__(self):
        return iter(self.ds.iter_torch_batches(batch_size=self.batch_size))


def consume(iterable: Any, t0: float, probe: Callable[[Any, int], None] | None = None) -> dict:
    """Iterate one epoch; per batch, the time it arrived and its size."""
    it = iter(iterable)
    times, counts = [], []
    for k, batch in enumerate(it):
        times.append(time.perf_counter())
        counts.append(batch_samples(batch))
        if probe is not None:
            probe(it, k)
        del batch
    del it
    return {"ttfb_s": times[0] - t0, "times": times, "counts": counts, "total_s": times[-1] - t0}


# --------------------------------------------------------------------------- sections


def section_cold(b: Bench, res: Results) -> dict:
    """(e) cold: the first loader of each kind in this process. torch first (before any Ray exists)."""
    wl = b.startup_wl
    out: dict = {}
    log("cold start: torch's first loader")
    t0 = time.perf_counter()
    r = consume(b.make("torch", wl), t0)
    out["torch"] = r["ttfb_s"]
    res.write({"section": "startup", "case": "cold", "loader": "torch", "ttfb_s": r["ttfb_s"]})

    log("cold start: raydl's first loader (imports ray, starts a local Ray, starts the actors)")
    t0 = time.perf_counter()
    import ray  # noqa: F401  (timed: a user pays it on raydl's first iteration)

    t_import = time.perf_counter() - t0
    register_by_value()  # the workload classes travel by value to Ray's workers
    ray_up: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # when raydl's ray.init returns: splits Ray's start from the actors' start
        while not stop.is_set():
            if ray.is_initialized():
                ray_up.append(time.perf_counter())
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t1 = time.perf_counter()
    r = consume(b.make("raydl", wl), t1)
    stop.set()
    watcher.join()
    out["raydl"] = t_import + r["ttfb_s"]
    out["raydl_import_ray_s"] = t_import
    out["raydl_ray_init_s"] = (ray_up[0] - t1) if ray_up else float("nan")
    res.write(
        {
            "section": "startup",
            "case": "cold",
            "loader": "raydl",
            "ttfb_s": out["raydl"],
            "import_ray_s": t_import,
            "ray_init_s": out["raydl_ray_init_s"],
            "ray_start_workers_first_batch_s": r["ttfb_s"],
        }
    )

    log("cold start: Ray Data's first dataset (Ray already up)")
    t0 = time.perf_counter()
    import ray.data  # noqa: F401

    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    r = consume(b.make("raydata", wl), t1)
    out["raydata"] = t_import + r["ttfb_s"]
    out["raydata_import_s"] = t_import
    res.write(
        {
            "section": "startup",
            "case": "cold",
            "loader": "raydata",
            "ttfb_s": out["raydata"],
            "import_ray_data_s": t_import,
            "first_batch_s": r["ttfb_s"],
        }
    )
    return out


def section_warm(b: Bench, res: Results) -> dict:
    """(e) warm: new loaders while Ray is up; next epoch of a persistent loader."""
    wl = b.startup_wl
    reps = b.args.startup_reps
    out: dict = {}
    variants = [
        ("torch", "new loader", {}),
        ("raydl", "new loader", {}),
        ("raydl (ray_reuse_workers=False)", "new loader", {"ray_reuse_workers": False}),
        ("raydata", "new loader", {}),
    ]
    for name, case, kw in variants:
        loader = name.split(" ")[0]
        ts = []
        for rep in range(reps):
            gc.collect()
            t0 = time.perf_counter()
            r = consume(b.make(loader, wl, **kw), t0)
            ts.append(r["ttfb_s"])
            res.write({"section": "startup", "case": "warm", "loader": name, "rep": rep, "ttfb_s": r["ttfb_s"]})
        out[(name, "warm")] = ts
        log(f"warm start {name}: median {median(ts) * 1e3:.0f} ms")
    for name in ("torch", "raydl", "raydata"):
        kw = {} if name == "raydata" else {"persistent_workers": True}
        loader = b.make(name, wl, **kw)
        consume(loader, time.perf_counter())  # epoch 1 (start-up)
        ts = []
        for rep in range(reps):
            t0 = time.perf_counter()
            r = consume(loader, t0)
            ts.append(r["ttfb_s"])
            res.write({"section": "startup", "case": "next_epoch", "loader": name, "rep": rep, "ttfb_s": r["ttfb_s"]})
        if hasattr(loader, "shutdown"):
            loader.shutdown()
        del loader
        out[(name, "next_epoch")] = ts
        log(f"next epoch {name}: median {median(ts) * 1e3:.0f} ms")
    return out


def measure_throughput(b: Bench, res: Results, wl: Workload, loader: str, rep: int) -> dict:
    """`1 + --epochs` epochs of one new loader; steady state = the epochs after the first.

    torch and raydl run with persistent_workers=True (the usual multi-epoch setting); Ray Data
    re-executes its dataset for each epoch. No loader can work ahead across an epoch boundary
    (each epoch starts when the consumer calls iter()), so the samples of epochs 2.. divided by
    the time from the end of epoch 1 to the end of the last epoch is a rate no start-up and no
    read-ahead can inflate. Repeated (at most --max-retries times, within --retry-budget-s) when
    processes other than ours used more than the threshold meanwhile; the least disturbed
    attempt is kept.
    """
    best = None
    for attempt in range(b.args.max_retries + 1):
        gc.collect()
        kw = {} if loader == "raydata" else {"persistent_workers": True}
        b.gate.wait()
        with LoadMonitor() as mon:
            t0 = time.perf_counter()
            obj = b.make(loader, wl, **kw)
            first = consume(obj, t0)
            t1 = time.perf_counter()
            n, ttfb_next = 0, []
            for _ in range(b.args.epochs):
                te = time.perf_counter()
                r = consume(obj, te)
                n += sum(r["counts"])
                ttfb_next.append(r["ttfb_s"])
            t2 = time.perf_counter()
        if hasattr(obj, "shutdown"):
            obj.shutdown()
        del obj
        assert sum(first["counts"]) == wl.n and n == wl.n * b.args.epochs, (loader, wl.name, n)
        rec = {
            "section": "throughput",
            "workload": wl.name,
            "loader": loader,
            "rep": rep,
            "attempt": attempt,
            "num_workers": b.W,
            "batch_size": wl.batch_size,
            "samples_per_epoch": wl.n,
            "measured_epochs": b.args.epochs,
            "samples_per_s": n / (t2 - t1),
            "first_epoch_samples_per_s": wl.n / first["total_s"],
            "ttfb_s": first["ttfb_s"],
            "next_epoch_ttfb_s": median(ttfb_next),
            "foreign_cores": round(mon.foreign_cores, 3),
            "our_cores": round(mon.ours_cores, 3),
            "loadavg1": round(os.getloadavg()[0], 2),
        }
        res.write(rec)
        if best is None or rec["foreign_cores"] < best["foreign_cores"]:
            best = rec
        if not mon.disturbed:
            break
        b.retry_s += mon.wall_s
        again = attempt < b.args.max_retries and b.retry_s < b.args.retry_budget_s
        log(
            f"  {wl.name}/{loader} rep {rep}: other processes used {mon.foreign_cores:.2f} cores: "
            f"{'rerunning' if again else 'keeping the least disturbed attempt'}"
        )
        if not again:
            break
    best = dict(best, retries=best["attempt"], attempts=attempt + 1)
    res.write(dict(best, section="throughput_kept"))
    return best


def section_throughput(b: Bench, res: Results, workloads: list[Workload], notes: list[str]) -> dict:
    results: dict = {}
    for wl in workloads:
        variants = list(LOADERS)
        if wl.kind == "io":
            if b.has_threads:
                variants.insert(2, "raydl-threads8")
            else:
                notes.append(
                    "raydl.DataLoader has no `ray_threads_per_worker` keyword: the threads_per_worker=8 "
                    "variant of the I/O workload was skipped."
                )
        log(f"throughput: {wl.name} ({wl.n} samples/epoch, batch {wl.batch_size}, {b.args.reps} reps of {variants})")
        for rep in range(b.args.reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for loader in order:
                rec = measure_throughput(b, res, wl, loader, rep)
                results.setdefault((wl.name, loader), []).append(rec)
                log(
                    f"  rep {rep} {loader:15s} {rec['samples_per_s']:9.0f} samples/s  first batch "
                    f"{rec['ttfb_s'] * 1e3:6.0f} ms  foreign load {rec['foreign_cores']:.2f} cores"
                )
    return results


def section_memory(b: Bench, res: Results) -> dict:
    """(f) 20 epochs (persistent workers): driver RSS, object-store use, batches in flight."""
    import raydl as _raydl

    wl = b.memory_wl
    epochs = b.args.memory_epochs
    proc = psutil.Process()
    out = {}
    for name in ("raydl", "torch", "raydata"):
        _raydl.release_idle_workers()
        gc.collect()
        time.sleep(0.5)
        base_store = object_store_stats()
        kw = {} if name == "raydata" else {"persistent_workers": True}
        loader = b.make(name, wl, **kw)
        per_epoch = []
        state = {"max_outstanding": 0, "max_store": 0, "max_objects": 0}

        def probe(it: Any, k: int) -> None:
            sched = getattr(it, "_sched", None)  # raydl keeps its tasks in a Schedule; torch on the iterator
            n = sched.tasks_outstanding if sched is not None else getattr(it, "_tasks_outstanding", None)
            if n is not None:
                state["max_outstanding"] = max(state["max_outstanding"], n)
            if k % 8 == 4:
                s = object_store_stats()
                state["max_store"] = max(state["max_store"], s.get("used_bytes", 0))
                state["max_objects"] = max(state["max_objects"], s.get("num_objects", 0))

        for epoch in range(epochs):
            consume(loader, time.perf_counter(), probe)
            s = object_store_stats()
            rec = {
                "section": "memory",
                "loader": name,
                "epoch": epoch + 1,
                "rss_bytes": proc.memory_info().rss,
                "store_used_bytes": s.get("used_bytes"),
                "store_objects": s.get("num_objects"),
            }
            per_epoch.append(rec)
            res.write(rec)
        # Ray's raylet frees released objects in batches (every 1 s, or 100 objects: RAY_free_objects_period_milliseconds,
        # RAY_free_objects_batch_size), so the store right after an epoch still holds batches the driver dropped.
        time.sleep(1.5)
        settled = object_store_stats()
        if hasattr(loader, "shutdown"):
            loader.shutdown()
        del loader
        gc.collect()
        time.sleep(1.5)
        after = object_store_stats()
        rss = [r["rss_bytes"] for r in per_epoch]
        summary = {
            "section": "memory_summary",
            "loader": name,
            "epochs": epochs,
            "batch_size": wl.batch_size,
            "rss_epoch1_mib": rss[0] / 2**20,
            "rss_last_mib": rss[-1] / 2**20,
            "rss_max_mib": max(rss) / 2**20,
            "rss_growth_pct": 100.0 * (rss[-1] - rss[0]) / rss[0],
            "store_base_bytes": base_store.get("used_bytes"),
            "store_end_bytes": per_epoch[-1]["store_used_bytes"],
            "store_end_objects": per_epoch[-1]["store_objects"],
            "store_max_bytes_during": state["max_store"],
            "store_max_objects_during": state["max_objects"],
            "store_settled_bytes": settled.get("used_bytes"),
            "store_settled_objects": settled.get("num_objects"),
            "store_after_shutdown_bytes": after.get("used_bytes"),
            "store_after_shutdown_objects": after.get("num_objects"),
            "max_tasks_outstanding": state["max_outstanding"] if name != "raydata" else None,
            "bound": (2 * b.W) if name != "raydata" else None,
            "store_error": base_store.get("error"),
        }
        res.write(summary)
        out[name] = summary
        log(
            f"memory {name}: RSS {summary['rss_epoch1_mib']:.0f} -> {summary['rss_last_mib']:.0f} MiB "
            f"({summary['rss_growth_pct']:+.1f}%), store max {summary['store_max_bytes_during'] / 2**20:.1f} MiB, "
            f"max outstanding {summary['max_tasks_outstanding']}"
        )
    return out


# --------------------------------------------------------------------------- report


def paired_ratios(thr: dict, workload: str, loader: str) -> list[float]:
    """Per repetition, loader's rate / torch's rate in the same repetition (measured minutes apart at most).

    The median of these is robust to the machine getting slower or faster during the run, which
    a ratio of medians is not.
    """
    torch_by_rep = {r["rep"]: r["samples_per_s"] for r in thr[(workload, "torch")]}
    return [r["samples_per_s"] / torch_by_rep[r["rep"]] for r in thr[(workload, loader)] if r["rep"] in torch_by_rep]


def fmt_rate(xs: list[float]) -> str:
    return f"{median(xs):,.0f} ({min(xs):,.0f}–{max(xs):,.0f})"


def build_report(
    b: Bench, info: dict, cold: dict, warm: dict, thr: dict, mem: dict, workloads, notes, elapsed_s
) -> str:
    lines = [
        f"## raydl throughput benchmark ({'quick' if b.args.quick else 'full'} run)",
        "",
        describe_machine(info),
        "",
    ]
    lines.append(
        f"{b.W} workers for every loader; torch's DataLoader with the default fork context; Ray Data "
        f"`range(N).map_batches(same per-sample work, concurrency={b.W}).iter_torch_batches()` with "
        f"DataContext.op_resource_reservation_enabled={b.args.raydata_reservation} (Ray Data's default True "
        f"would let its map run 1 task at a time on 2 CPUs). "
        f"{b.args.reps} alternating repetitions per loader; median (min–max). vs torch: median (min–max) over "
        "repetitions of the loader's rate / torch's rate in the same repetition. Steady state: each repetition is a new "
        f"loader run for 1 + {b.args.epochs} epochs (torch and raydl with persistent_workers=True; Ray Data "
        "re-executes the dataset each epoch); samples/s over the epochs after the first. First batch: time "
        "to the first batch of that new loader (raydl: from its warm pool). Foreign load: cores used by "
        "processes other than this benchmark (its own local Ray included) during the measurement, "
        "median over repetitions; a measurement above "
        f"{DISTURBED_FOREIGN_CORES} cores was rerun (at most {b.args.max_retries}×, within "
        f"{b.args.retry_budget_s:.0f} s in all) and the least disturbed attempt kept. Before each measurement the "
        f"run waited up to {b.args.quiet_wait_s:g} s for a quiet second (waited {b.gate.waited_s:.0f} s in all; "
        f"{b.gate.gave_up} times the machine stayed busy)."
    )
    lines.append("")
    lines.append("### Steady-state throughput (samples/s)")
    lines.append("")
    rows = []
    for wl in workloads:
        for loader in [v for v in ("torch", "raydl", "raydl-threads8", "raydata") if (wl.name, v) in thr]:
            recs = thr[(wl.name, loader)]
            rates = [r["samples_per_s"] for r in recs]
            ratios = paired_ratios(thr, wl.name, loader)
            ratio = f"{median(ratios):.2f}×" + (f" ({min(ratios):.2f}–{max(ratios):.2f})" if loader != "torch" else "")
            retries = sum(r["retries"] for r in recs)
            rows.append(
                [
                    wl.description,
                    loader,
                    fmt_rate(rates),
                    ratio,
                    f"{median([r['ttfb_s'] for r in recs]) * 1e3:,.0f}",
                    f"{median([r['foreign_cores'] for r in recs]):.2f}" + (f" ({retries} reruns)" if retries else ""),
                ]
            )
    lines.append(
        md_table(
            ["workload", "loader", "samples/s", "vs torch (paired)", "first batch (ms)", "foreign load (cores)"], rows
        )
    )
    lines.append("")

    def _cold_raydl(cold: dict) -> str:
        ray_up_s = cold["raydl_import_ray_s"] + cold["raydl_ray_init_s"]
        if (
            not ray_up_s < cold["raydl"]
        ):  # a cold start: the first batch was made in this process (NOTE [ raydl cold start ])
            return f"{cold['raydl'] * 1e3:,.0f} (made in the driver while Ray started; Ray up at {ray_up_s * 1e3:,.0f})"
        return (
            f"{cold['raydl'] * 1e3:,.0f} (import ray {cold['raydl_import_ray_s'] * 1e3:,.0f} + ray.init "
            f"{cold['raydl_ray_init_s'] * 1e3:,.0f} + actors and first batch {(cold['raydl'] - ray_up_s) * 1e3:,.0f})"
        )

    lines.append("### Start-up: time to first batch (ms)")
    lines.append("")
    rows = [
        [
            "cold: first loader of the process",
            f"{cold['torch'] * 1e3:,.0f}",
            _cold_raydl(cold),
            "—",
            f"{cold['raydata'] * 1e3:,.0f} (import ray.data {cold['raydata_import_s'] * 1e3:,.0f}; Ray already up)",
        ]
    ]
    med = lambda k: f"{median(warm[k]) * 1e3:,.0f}"  # noqa: E731
    rows.append(
        [
            "warm: new loader, Ray up",
            med(("torch", "warm")),
            med(("raydl", "warm")) + " (warm pool)",
            med(("raydl (ray_reuse_workers=False)", "warm")),
            med(("raydata", "warm")),
        ]
    )
    rows.append(
        [
            "next epoch, persistent workers",
            med(("torch", "next_epoch")),
            med(("raydl", "next_epoch")),
            "—",
            med(("raydata", "next_epoch")) + " (re-executes the dataset)",
        ]
    )
    lines.append(md_table(["case", "torch", "raydl", "raydl, ray_reuse_workers=False", "Ray Data"], rows))
    lines.append("")
    lines.append(
        f"Start-up workload: {b.startup_wl.description}, {b.startup_wl.n} samples; warm and next-epoch values "
        f"are medians of {b.args.startup_reps}."
    )
    lines.append("")
    lines.append(
        f"### Memory over {b.args.memory_epochs} epochs ({b.memory_wl.description}, {b.memory_wl.n} samples/epoch, persistent workers)"
    )
    lines.append("")
    rows = []
    for name, s in mem.items():
        mib = lambda x: f"{(x or 0) / 2**20:.1f}"  # noqa: E731
        store = (
            "n/a"
            if s["store_error"]
            else f"{mib(s['store_base_bytes'])} / {mib(s['store_max_bytes_during'])} / {mib(s['store_end_bytes'])} "
            f"({s['store_end_objects']} obj) / {mib(s['store_settled_bytes'])} ({s['store_settled_objects']} obj) / "
            f"{mib(s['store_after_shutdown_bytes'])}"
        )
        held = "—" if s["max_tasks_outstanding"] is None else f"{s['max_tasks_outstanding']} (bound {s['bound']})"
        rows.append(
            [
                name,
                f"{s['rss_epoch1_mib']:.0f} → {s['rss_last_mib']:.0f} (max {s['rss_max_mib']:.0f})",
                f"{s['rss_growth_pct']:+.1f}%",
                store,
                held,
            ]
        )
    lines.append(
        md_table(
            [
                "loader",
                "driver RSS MiB, epoch 1 → last",
                "RSS growth",
                "object store MiB: before / max during / end of last epoch / 1.5 s later / after shutdown",
                "max batches in flight",
            ],
            rows,
        )
    )
    lines.append("")
    lines.append(
        "Object store = the driver node's plasma store (what `ray memory --stats-only` reports; sampled every 8 "
        "batches and at each epoch's end); torch uses none. Ray's raylet frees released objects in batches "
        "(every second or every 100 objects), so right after an epoch the store still holds batches the "
        "driver already dropped; the value 1.5 s later shows what is really held. Batches in flight = the "
        "iterator's `_tasks_outstanding` after each batch (torch has the same attribute); Ray Data bounds "
        "its own read-ahead by bytes."
    )
    for n in notes:
        lines.append("")
        lines.append(f"Note: {n}")
    lines.append("")
    lines.append(
        f"Run took {elapsed_s / 60:.1f} min; load average at end {' / '.join(f'{x:.2f}' for x in os.getloadavg())}."
    )
    return "\n".join(lines)


def plot(path: str, b: Bench, workloads, thr: dict, cold: dict, warm: dict) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colors = {"torch": "#4c72b0", "raydl": "#dd8452", "raydl-threads8": "#c44e52", "raydata": "#55a868"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    width = 0.2
    for j, loader in enumerate(("torch", "raydl", "raydl-threads8", "raydata")):
        xs, ys, errs = [], [], []
        for i, wl in enumerate(workloads):
            recs = thr.get((wl.name, loader))
            if not recs:
                continue
            rates = [r["samples_per_s"] for r in recs]
            m = median(rates)
            xs.append(i + (j - 1.5) * width)
            ys.append(m)
            errs.append([[m - min(rates)], [max(rates) - m]])
        if xs:
            yerr = [[e[0][0] for e in errs], [e[1][0] for e in errs]]
            ax.bar(xs, ys, width, label=loader, color=colors[loader], yerr=yerr, capsize=2)
            if loader != "torch":
                for x, y, wl in zip(xs, ys, [w for w in workloads if thr.get((w.name, loader))]):
                    ratio = median(paired_ratios(thr, wl.name, loader))
                    ax.annotate(
                        f"{ratio:.2f}×",
                        (x, y),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        xytext=(0, 2),
                        textcoords="offset points",
                    )
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels([wl.name for wl in workloads])
    ax.set_yscale("log")
    ax.set_ylabel("steady-state samples/s (log)")
    ax.set_title(f"Throughput, {b.W} workers (median, min–max)")
    ax.legend(fontsize=8)
    ax = axes[1]
    cases = ["cold", "warm", "next epoch"]
    for j, loader in enumerate(("torch", "raydl", "raydata")):
        ys = [cold[loader], median(warm[(loader, "warm")]), median(warm[(loader, "next_epoch")])]
        ax.bar([i + (j - 1) * 0.27 for i in range(3)], ys, 0.27, label=loader, color=colors[loader])
    ax.set_xticks(range(3))
    ax.set_xticklabels(cases)
    ax.set_yscale("log")
    ax.set_ylabel("time to first batch, s (log)")
    ax.set_title("Start-up")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: small epochs, 1 repetition (~1-2 min)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=None, help="repetitions per loader and workload (default 4; quick 1)")
    p.add_argument("--epochs", type=int, default=None, help="measured epochs after the first (default 2; quick 1)")
    p.add_argument(
        "--max-retries",
        type=int,
        default=None,
        help="reruns of a throughput measurement during which other processes used > "
        f"{DISTURBED_FOREIGN_CORES} cores (default 1; quick 0)",
    )
    p.add_argument("--retry-budget-s", type=float, default=120.0, help="total seconds spent on reruns, at most")
    p.add_argument(
        "--quiet-wait-s",
        type=float,
        default=None,
        help="before each throughput measurement, wait up to this long for a quiet second (default 10; quick 0)",
    )
    p.add_argument("--quiet-budget-s", type=float, default=90.0, help="total seconds spent waiting for quiet")
    p.add_argument(
        "--raydata-reservation",
        action="store_true",
        help="keep Ray Data's per-operator resource reservation on (its default; halves its map "
        "concurrency on a 2-CPU machine)",
    )
    p.add_argument("--scale", type=float, default=1.0, help="multiply every epoch size by this")
    p.add_argument("--only", default="", help="comma-separated workloads to run (cpu,trivial,large,io); default all")
    args = p.parse_args()
    args.reps = args.reps if args.reps is not None else (1 if args.quick else 4)
    args.max_retries = args.max_retries if args.max_retries is not None else (0 if args.quick else 1)
    args.quiet_wait_s = args.quiet_wait_s if args.quiet_wait_s is not None else (0.0 if args.quick else 10.0)
    args.epochs = args.epochs if args.epochs is not None else (1 if args.quick else 2)
    args.startup_reps = 3 if args.quick else 5
    args.memory_epochs = 20
    start = time.perf_counter()

    info = {**machine_info(ray_version=importlib.metadata.version("ray")), "num_workers": args.num_workers}
    res = Results("bench_throughput", args.quick)
    res.write({"section": "machine", **info, "argv": sys.argv[1:]})
    log(describe_machine(info))

    q = 0.3 if args.quick else 1.0
    sz = lambda n, bs: max(bs * 6, int(n * q * args.scale) // bs * bs)  # noqa: E731
    iters = calibrate_cpu_iters()
    cpu_wl = Workload("cpu", "CPU-bound ~1 ms/sample, 3×64×64 f32, batch 64", sz(2048, 64), 64, "cpu", iters)
    per_sample = sample_cost_s(cpu_wl.sample)
    log(f"CPU workload: {iters} numpy passes per sample, measured {per_sample * 1e3:.2f} ms/sample in this process")
    workloads = [
        cpu_wl,
        Workload("trivial", "overhead floor: 16-float sample, batch 64", sz(64 * 160, 64), 64, "trivial"),
        Workload("large", "large: 3×224×224 uint8, batch 256", sz(256 * 12, 256), 256, "large"),
        Workload("io", f"I/O-bound: {IO_SLEEP_S * 1e3:.0f} ms sleep/sample, batch 64", sz(64 * 10, 64), 64, "io"),
    ]
    if args.only:
        keep = set(args.only.split(","))
        workloads = [w for w in workloads if w.name in keep]
    res.write(
        {
            "section": "workloads",
            "cpu_iters": iters,
            "cpu_ms_per_sample_measured": per_sample * 1e3,
            "workloads": [w.__dict__ for w in workloads],
        }
    )

    RayDataEpochs.reservation = args.raydata_reservation
    b = Bench(args)
    b.retry_s = 0.0
    b.gate = QuietGate(args.quiet_wait_s, args.quiet_budget_s)
    b.startup_wl = Workload("trivial", "trivial samples, batch 64", 64 * 8, 64, "trivial")
    b.memory_wl = Workload(
        "mem", "3×64×64 f32 samples (cheap), batch 64", 2048 if not args.quick else 1024, 64, "small"
    )
    notes: list[str] = []
    try:
        cold = section_cold(b, res)
        warm = section_warm(b, res)
        thr = section_throughput(b, res, workloads, notes)
        mem = section_memory(b, res)
    finally:
        try:
            raydl.release_idle_workers()
        except Exception:
            pass
    for (wname, loader), recs in thr.items():
        res.write(
            {
                "section": "throughput_summary",
                "workload": wname,
                "loader": loader,
                "samples_per_s_median": median([r["samples_per_s"] for r in recs]),
                "samples_per_s_all": [r["samples_per_s"] for r in recs],
                "ratio_to_torch_paired_median": median(paired_ratios(thr, wname, loader)),
                "ratio_to_torch_paired_all": paired_ratios(thr, wname, loader),
                "ttfb_s_median": median([r["ttfb_s"] for r in recs]),
                "foreign_cores_median": median([r["foreign_cores"] for r in recs]),
            }
        )
    report = build_report(b, info, cold, warm, thr, mem, workloads, notes, time.perf_counter() - start)
    print(report)
    md = res.write_text(".md", report + "\n")
    png = plot(res.figure_path(), b, workloads, thr, cold, warm)
    res.close()
    print(f"\nresults: {res.jsonl_path}\n         {md}\n         {png or '(no chart: pip install matplotlib)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
