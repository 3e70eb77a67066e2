#!/usr/bin/env python3
"""A JPEG image pipeline (ImageNet-shaped) through raydl and the loaders users would pick instead.

    python -m benchmarks.bench_images            # full run (about 11-15 minutes on 2 cores; +70 s once for the JPEGs)
    python -m benchmarks.bench_images --quick    # smoke run (about 1 minute; +20 s once for its JPEGs)
    python -m benchmarks.bench_images --report benchmarks/results/bench_images-<stamp>.jsonl   # re-render a run
    python -m benchmarks.bench_images --offload [--quick]   # the offload shape (bench_images_offload.py)

The workload: a folder of generated 500x375 JPEGs that decode like photos (1/f texture, light
gradient, soft-edged objects, sensor noise; ~100 KB each, quality 90), one folder per class, the
label the folder's index; written once to --cache-dir (default /tmp/raydl-bench-images) and reused.
Per sample: PIL decode, RandomResizedCrop(224) (bilinear), random horizontal flip, to tensor,
normalize (examples/train_image_classifier.py: `JpegFolder`, `TrainTransform`, the same algorithms
as torchvision's v1 transforms), batch 64, a new shuffle each epoch.

Loaders, each for the same CPU budget (2 workers or 2 threads on 2 cores), each in a fresh child
process (so its CPU and memory, Ray's processes included, are its own):
  torch           torch.utils.data.DataLoader(num_workers=2, persistent_workers=True)
  raydl           raydl.DataLoader with the same arguments (raydl starts its local Ray)
  raydl-threads2  the same with ray_threads_per_worker=2 (samples of a batch on 2 threads)
  raydata         Ray Data: from_items(paths, labels).random_shuffle().map(same load + transform)
                  .iter_torch_batches(batch_size=64); a local Ray started as raydl starts its own
  spdl            SPDL pipeline: source (shuffled indices) -> pipe(same load + transform,
                  concurrency=2) -> aggregate(64) -> pipe(collate) -> sink; 2 threads
  spdl-io         SPDL's own decoder (spdl.io: FFmpeg decode, crop/scale/flip as an FFmpeg filter;
                  the crop drawn as above), normalize per batch in torch; 2 threads (needs FFmpeg's
                  shared libraries; skipped with a note when spdl.io cannot load them)
  nodes           torchdata.nodes as its DataLoader-migration guide builds it: SamplerWrapper ->
                  Batcher(64) -> ParallelMapper(load + collate, num_workers=2, method="process",
                  fork) -> Prefetcher -> Loader
  ceiling         the machine's ceiling, no loader: one fresh (spawned) process per worker, side by
                  side, each decoding, augmenting and collating batches of 64 from its own share of
                  a shuffled epoch; images/s = all their images over the span of their steady epochs
                  (after a first epoch each, started together at a barrier). What a loader adds on
                  top (handing batches to a consumer, its own processes) is what it loses to this.

Per loader and repetition: steady images/s (the epochs after the first: their images over the time
from the end of epoch 1 to the end of the last), time to first batch cold (fresh process: from
before the loader library's import; Ray's start included) and warm (a second new loader in the same
process), CPU seconds per image over the steady epochs (psutil cpu_times of every process under the
child: driver, workers, Ray's raylet, GCS, agents and Ray worker processes; split by kind), peak
PSS (sum over every process under the child, sampled every --pss-interval-s by this parent).
Repetitions rotate the loaders' order; ratios are paired (same repetition). A measurement during
which other processes used > 0.25 cores is rerun once (within --retry-budget-s).
Outputs: Markdown on stdout and in benchmarks/results/bench_images-<stamp>.md, JSON lines (.jsonl) beside it, and
the chart benchmarks/figures/bench_images.png (a --quick run's beside its report).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from benchmarks.common import REPO
from benchmarks.common.machine import DISTURBED_FOREIGN_CORES, LoadMonitor, QuietGate, describe_machine, machine_info
from benchmarks.common.peers import Loader, make_loader
from benchmarks.common.processes import RESULT_PREFIX, child_result, script_command
from benchmarks.common.results import Results, figure_path, log, md_table

LOADERS = ("torch", "raydl", "raydl-threads2", "raydata", "spdl", "spdl-io", "nodes", "ceiling")
PEERS = ("torch", "raydata", "spdl", "spdl-io", "nodes")
MIB = 2**20

# Kinds of processes under a child, for the CPU and memory split (matched on the command line).
_RAY_DAEMONS = (
    ("gcs_server", "gcs"),
    ("raylet", "raylet"),
    ("dashboard", "ray agents"),
    ("runtime_env", "ray agents"),
    ("log_monitor", "ray agents"),
    ("monitor.py", "ray agents"),
)


def process_label(p) -> str:
    """A process's command line (its name if that is empty), "" if it is gone."""
    try:
        return " ".join(p.cmdline()) or p.name()
    except Exception:
        return ""


def process_kind(pid: int, label: str, driver_pid: int, worker_pids: set, ray_workers_are_workers: bool) -> str:
    """driver | workers | raylet | gcs | ray agents | idle Ray workers, for one process under a child."""
    if pid == driver_pid:
        return "driver"
    if pid in worker_pids:
        return "workers"
    for needle, kind in _RAY_DAEMONS:
        if needle in label:
            return kind
    if label.startswith("ray::") or "default_worker.py" in label:
        return "workers" if ray_workers_are_workers else "idle Ray workers"
    return "workers"  # torch's, torchdata's forked workers


# =========================================================================== child: one loader


def _tree(psutil):
    me = psutil.Process()
    return [me] + me.children(recursive=True)


def cpu_snapshot(psutil) -> dict:
    """pid -> (own CPU seconds, CPU seconds of its reaped children, command line) for this process and all under it."""
    out = {}
    for p in _tree(psutil):
        try:
            t = p.cpu_times()
            out[p.pid] = (t.user + t.system, t.children_user + t.children_system, process_label(p))
        except psutil.Error:
            pass
    return out


def cpu_split(cpu0: dict, cpu1: dict, kind_of: Callable) -> dict:
    """CPU seconds used between two snapshots, by process kind.

    A process alive at the end counts its own CPU since the start (all of it if it is new). A process
    that exited meanwhile was reaped by its parent (also under this process), whose children's CPU
    grew by that process's final total: the growth of every parent's reaped-children CPU, minus what
    the vanished processes had used at the start, is the CPU of processes that exited in the window
    (torchdata's per-epoch worker processes, Ray's stopped workers), counted under the vanished
    processes' kind (or "workers" when none was seen at the start).
    """
    split: dict = {}
    reaped = 0.0
    for pid, (own, children, label) in cpu1.items():
        own0, children0, _ = cpu0.get(pid, (0.0, 0.0, ""))
        k = kind_of(pid, label)
        split[k] = split.get(k, 0.0) + own - own0
        reaped += children - children0
    vanished = {pid: v for pid, v in cpu0.items() if pid not in cpu1}
    reaped -= sum(own + children for own, children, _ in vanished.values())
    if abs(reaped) > 1e-9:
        kinds = [kind_of(pid, label) for pid, (_, _, label) in vanished.items()] or ["workers"]
        k = max(set(kinds), key=kinds.count)
        split[k] = split.get(k, 0.0) + reaped
    return split


def run_epoch(loader: Loader, t0: float, expect: int, batch_size: int) -> dict:
    """One epoch; checks every batch's shape and dtype; the first batch's arrival and the epoch's end."""
    import torch

    n, first = 0, None
    for images, labels in loader.epoch():
        if first is None:
            first = time.perf_counter() - t0
        b = len(labels)
        if images.shape != (b, 3, 224, 224) or images.dtype != torch.float32 or labels.dtype != torch.int64:
            raise AssertionError(f"bad batch: {tuple(images.shape)} {images.dtype}, labels {labels.dtype}")
        n += b
        del images, labels
    if n != expect:
        raise AssertionError(f"epoch had {n} images, expected {expect}")
    return {"ttfb_s": first, "end": time.perf_counter(), "images": n}


class _Marks(logging.Handler):
    """Seconds from `t0` to raydl's debug lines "local Ray up" and "workers ready" (the first of each)."""

    def __init__(self, t0: float) -> None:
        super().__init__(logging.DEBUG)
        self.t0, self.marks = t0, {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        for needle, name in (("local Ray up", "ray_up_s"), ("workers ready", "workers_ready_s")):
            if needle in msg and name not in self.marks:
                self.marks[name] = time.perf_counter() - self.t0


def child(kind: str, args) -> None:
    """Measure one loader in this (fresh) process; print `RESULT {json}`."""
    if kind == "ceiling":
        print(RESULT_PREFIX + json.dumps(ceiling_child(args)), flush=True)
        return
    import psutil
    import torch  # noqa: F401
    from PIL import Image  # noqa: F401

    from examples.train_image_classifier import JpegFolder, TrainTransform

    ds = JpegFolder(args.data_dir, TrainTransform(224), limit=args.images)
    n = len(ds)
    rec: dict = {"loader": kind, "images_per_epoch": n, "measured_epochs": args.epochs}
    loader = None
    raydl_log = logging.getLogger("raydl")
    try:
        t0 = time.perf_counter()  # cold: from before the loader library's import (Ray's import and start included)
        marks = _Marks(t0)
        raydl_log.setLevel(logging.DEBUG)
        raydl_log.addHandler(marks)
        with LoadMonitor() as start_mon:
            loader = make_loader(kind, ds, args)
            e1 = run_epoch(loader, t0, n, args.batch_size)
        raydl_log.removeHandler(marks)
        rec.update(marks.marks)
        rec["ttfb_cold_s"] = e1["ttfb_s"]
        rec["first_epoch_s"] = e1["end"] - t0
        rec["foreign_cores_startup"] = round(start_mon.foreign_cores, 3)
        worker_pids = loader.worker_pids()
        with LoadMonitor() as mon:
            cpu0 = cpu_snapshot(psutil)
            t1 = time.perf_counter()
            images, next_ttfb = 0, []
            for _ in range(args.epochs):
                te = time.perf_counter()
                r = run_epoch(loader, te, n, args.batch_size)
                images += r["images"]
                next_ttfb.append(r["ttfb_s"])
            t2 = time.perf_counter()
            cpu1 = cpu_snapshot(psutil)
        worker_pids |= loader.worker_pids()
        me, ray_flag = os.getpid(), loader.ray_workers_are_workers

        def kind_of(pid: int, label: str) -> str:
            return process_kind(pid, label, me, worker_pids, ray_flag)

        split = cpu_split(cpu0, cpu1, kind_of)
        procs: dict = {}
        for pid, (_, _, label) in cpu1.items():
            k = kind_of(pid, label)
            procs[k] = procs.get(k, 0) + 1
        rec.update(
            {
                "images_per_s": images / (t2 - t1),
                "steady_s": t2 - t1,
                "next_epoch_ttfb_s": sorted(next_ttfb)[len(next_ttfb) // 2],
                "cpu_s_per_image": sum(split.values()) / images,
                "cpu_s_per_image_by_kind": {k: v / images for k, v in split.items()},
                "processes_by_kind": procs,
                "cores_used": sum(split.values()) / (t2 - t1),
                "foreign_cores": round(mon.foreign_cores, 3),
                "loadavg1": round(os.getloadavg()[0], 2),
                "worker_pids": sorted(worker_pids),
                "ray_workers_are_workers": loader.ray_workers_are_workers,
            }
        )
        # warm: a second new loader in this process (raydl: its warm pool; Ray Data: a new dataset on the running Ray)
        loader.close()
        loader = None
        t0 = time.perf_counter()
        loader = make_loader(kind, ds, args)
        it = iter(loader.epoch())
        next(it)
        rec["ttfb_warm_s"] = time.perf_counter() - t0
        close = getattr(it, "close", None)
        if close is not None:
            close()
        del it
    finally:
        if loader is not None:
            loader.close()
        del loader
        if "ray" in sys.modules:
            import ray

            try:
                import raydl

                raydl.release_idle_workers()
            except Exception:
                pass
            ray.shutdown()
    print(RESULT_PREFIX + json.dumps(rec), flush=True)


def _ceiling_part(part: int, args, barrier, results) -> None:
    """One process of the ceiling: its share of each epoch's shuffled order, batch by batch, no loader."""
    import torch
    from torch.utils.data import default_collate

    from examples.train_image_classifier import JpegFolder, TrainTransform

    torch.set_num_threads(1)  # as torch's and raydl's workers do
    ds = JpegFolder(args.data_dir, TrainTransform(224), limit=args.images)
    g = torch.Generator()
    g.manual_seed(1000 + part)

    def epoch() -> int:
        order = torch.randperm(len(ds), generator=g)[part :: args.num_workers].tolist()
        n = 0
        for s in range(0, len(order), args.batch_size):
            images, labels = default_collate([ds[i] for i in order[s : s + args.batch_size]])
            n += len(labels)
            del images, labels
        return n

    epoch()  # a first epoch, as the loaders' first (files in the page cache, allocator warm)
    barrier.wait(timeout=600)
    t1, c1 = time.perf_counter(), time.process_time()
    n = sum(epoch() for _ in range(args.epochs))
    results.put((part, n, t1, time.perf_counter(), time.process_time() - c1))
    barrier.wait(timeout=600)


def ceiling_child(args) -> dict:
    """The machine's ceiling for this pipeline (the `ceiling` loader of the module's docstring)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fresh interpreters, as a loader's workers are fresh processes
    parties = args.num_workers
    barrier, results = ctx.Barrier(parties + 1), ctx.Queue()
    procs = [ctx.Process(target=_ceiling_part, args=(i, args, barrier, results)) for i in range(parties)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=600)  # every part finished its first epoch
        with LoadMonitor() as mon:
            barrier.wait(timeout=600)  # and its steady epochs
        parts = [results.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    images = sum(n for _, n, _, _, _ in parts)
    span = max(t2 for _, _, _, t2, _ in parts) - min(t1 for _, _, t1, _, _ in parts)
    cpu = sum(c for *_, c in parts)
    nan = float("nan")
    return {
        "loader": "ceiling",
        "images_per_epoch": args.images,
        "measured_epochs": args.epochs,
        "images_per_s": images / span,
        "steady_s": span,
        "ttfb_cold_s": nan,
        "ttfb_warm_s": nan,
        "next_epoch_ttfb_s": nan,
        "first_epoch_s": nan,
        "foreign_cores_startup": 0.0,
        "cpu_s_per_image": cpu / images,
        "cpu_s_per_image_by_kind": {"workers": cpu / images},
        "processes_by_kind": {"workers": parties},
        "cores_used": cpu / span,
        "foreign_cores": round(mon.foreign_cores, 3),
        "loadavg1": round(os.getloadavg()[0], 2),
        "worker_pids": [p.pid for p in procs],
        "ray_workers_are_workers": False,
    }


# =========================================================================== parent


class PssSampler:
    """Every `interval_s`, the summed PSS of every process under `pid` (and which kinds they are); keeps the peak.

    Runs in the parent (its reads of /proc/<pid>/smaps_rollup are not the child's CPU); remembers
    every pid it saw so that none can be left behind.
    """

    def __init__(self, pid: int, interval_s: float) -> None:
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_mib = 0.0
        self.peak_by_pid: dict = {}
        self.seen: dict = {}
        self.kinds: dict = {}
        self.samples = 0
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)

    def sample(self) -> None:
        psutil = self.psutil
        c0 = time.thread_time()
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except psutil.Error:
            return
        total, by_pid = 0.0, {}
        for p in procs:
            try:
                pss = p.memory_full_info().pss / MIB
                if p.pid not in self.seen:
                    self.seen[p.pid] = p
                    self.kinds[p.pid] = process_kind(p.pid, process_label(p), self.root.pid, set(), False)
            except psutil.Error:
                continue
            total += pss
            by_pid[p.pid] = pss
        self.samples += 1
        if total > self.peak_mib:
            self.peak_mib, self.peak_by_pid = total, by_pid
        self.cpu_s += time.thread_time() - c0

    def peak_by_kind(self, worker_pids: set, ray_workers_are_workers: bool) -> dict:
        """The peak sample's PSS by process kind, now that the child has said which processes were its workers."""
        out: dict = {}
        for pid, pss in self.peak_by_pid.items():
            kind = self.kinds[pid]
            if pid in worker_pids or (ray_workers_are_workers and kind == "idle Ray workers"):
                kind = "workers"
            out[kind] = out.get(kind, 0.0) + pss
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "PssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def kill_leftovers(self) -> list:
        """Kill (by pid) any process the child started that outlived it; returns their pids."""
        left = []
        for pid, p in self.seen.items():
            try:
                if p.is_running() and p.status() != self.psutil.STATUS_ZOMBIE:
                    left.append(pid)
                    p.kill()
            except self.psutil.Error:
                pass
        return left


def run_child_once(kind: str, args, data_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    if args.ffmpeg_lib_dir and kind == "spdl-io":
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [args.ffmpeg_lib_dir, env.get("LD_LIBRARY_PATH")]))
    cmd = [
        *script_command("bench_images"),
        "--child",
        kind,
        "--data-dir",
        data_dir,
        "--images",
        str(args.images),
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--num-workers",
        str(args.num_workers),
        "--spdl-threads",
        str(args.spdl_threads),
    ] + (["--raydata-reservation"] if args.raydata_reservation else [])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = PssSampler(proc.pid, args.pss_interval_s)
    with sampler:
        try:
            out, err = proc.communicate(timeout=args.child_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=30)
            err += f"\n(killed after {args.child_timeout_s} s)"
    left = sampler.kill_leftovers()
    rec = child_result(subprocess.CompletedProcess(cmd, proc.returncode, out, err), kind)
    by_kind = sampler.peak_by_kind(set(rec["worker_pids"]), rec["ray_workers_are_workers"])
    rec.update(
        {
            "peak_pss_mib": sampler.peak_mib,
            "peak_pss_by_kind_mib": by_kind,
            "pss_samples": sampler.samples,
            "pss_sampler_cpu_s": sampler.cpu_s,
            "leftover_pids_killed": left,
        }
    )
    return rec


def measure(kind: str, args, data_dir: str, state: dict, rep: int) -> dict:
    """One child run of `kind`: a child that failed is run again (3 attempts in all); one during whose steady
    epochs other processes used > 0.25 cores is rerun once (within --retry-budget-s), the less disturbed kept."""

    kept, failures, attempts = None, 0, 0
    while True:
        state["gate"].wait()
        attempts += 1
        try:
            rec = run_child_once(kind, args, data_dir)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failures += 1
            log(f"  {kind} rep {rep}: child failed (attempt {attempts}): {str(e).strip().splitlines()[-1][:300]}")
            if failures == 3:
                raise
            continue
        rec.update({"rep": rep, "attempt": attempts - 1})
        if kept is None or rec["foreign_cores"] < kept["foreign_cores"]:
            kept = rec
        if (
            rec["foreign_cores"] <= DISTURBED_FOREIGN_CORES
            or args.quick
            or attempts - failures >= 2
            or state["retry_s"] >= args.retry_budget_s
        ):
            break
        state["retry_s"] += rec["steady_s"]
        log(f"  {kind} rep {rep}: other processes used {rec['foreign_cores']:.2f} cores: rerunning")
    return dict(kept, attempts=attempts, failed_attempts=failures)


def spdl_io_available(args) -> Optional[str]:
    """None if spdl.io can load FFmpeg here (with --ffmpeg-lib-dir), else why not."""
    env = dict(os.environ)
    if args.ffmpeg_lib_dir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [args.ffmpeg_lib_dir, env.get("LD_LIBRARY_PATH")]))
    code = "import spdl.io.lib as l; l._import_libspdl()"
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "spdl.io import timed out"
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["?"])[-1][:300]


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "ray", "raydl", "spdl", "spdl_io", "torchdata", "pillow", "numpy", "pyarrow"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def med(xs: list) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


def _quiet(r: dict) -> bool:
    """Whether other processes used at most machine.DISTURBED_FOREIGN_CORES of cores during r's steady epochs."""

    return r["foreign_cores"] <= DISTURBED_FOREIGN_CORES


def paired(runs: dict, a: str, b: Callable[[int], Optional[float]], quiet_only: bool = False) -> list:
    """Per repetition: a's images/s / b(rep) (another loader's images/s in the same repetition); with
    `quiet_only`, only repetitions in which neither measurement was disturbed (b returns None for those)."""
    out = []
    for r in runs.get(a, []):
        if quiet_only and not _quiet(r):
            continue
        other = b(r["rep"])
        if other:
            out.append(r["images_per_s"] / other)
    return out


def rate_in_rep(runs: dict, kind: str, quiet_only: bool = False) -> Callable[[int], Optional[float]]:
    by_rep = {r["rep"]: r["images_per_s"] for r in runs.get(kind, []) if not quiet_only or _quiet(r)}
    return lambda rep: by_rep.get(rep)


def fastest_peer_in_rep(runs: dict, peers: list, quiet_only: bool = False) -> Callable[[int], Optional[float]]:
    def f(rep: int) -> Optional[float]:
        recs = [r for k in peers for r in runs.get(k, []) if r["rep"] == rep]
        if quiet_only and not all(_quiet(r) for r in recs):
            return None
        return max(r["images_per_s"] for r in recs) if recs else None

    return f


def fmt_range(xs: list, f: str = "{:,.0f}") -> str:
    xs = [x for x in xs if x == x]  # the ceiling has no first batch (NaN)
    if not xs:
        return "—"
    return f"{f.format(med(xs))} ({f.format(min(xs))}–{f.format(max(xs))})"


def _report_head(args, info: dict, vers: dict) -> list:
    """The report's title, machine, versions and workload."""
    lines = [
        f"## Images: a JPEG pipeline through raydl and its peers ({'quick' if args.quick else 'full'} run)",
        "",
        describe_machine(info),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items() if v),
        "",
        f"{args.images} JPEGs (500x375, ~{args.avg_kb:.0f} KB, {args.classes} class folders) per epoch, batch "
        f"{args.batch_size}, {args.num_workers} workers/threads per loader; PIL decode + RandomResizedCrop(224) + "
        f"flip + to tensor + normalize. Each loader in a fresh process, {args.reps} repetitions in rotated order; "
        f"steady = the {args.epochs} epochs after the first. Median (min–max) over repetitions; ratios paired "
        "per repetition.",
        "",
    ]
    return lines


def _loaders_table(runs: dict, loaders: list) -> list:
    """Per loader: images/s, first batches, CPU per image, peak PSS, foreign load."""
    lines: list = []
    rows = []
    for k in loaders:
        rs = runs.get(k, [])
        if not rs:
            continue
        rows.append(
            [
                k,
                fmt_range([r["images_per_s"] for r in rs]),
                fmt_range([r["ttfb_cold_s"] for r in rs], "{:.2f}"),
                fmt_range([r["ttfb_warm_s"] for r in rs], "{:.2f}"),
                fmt_range([r["next_epoch_ttfb_s"] for r in rs], "{:.2f}"),
                fmt_range([r["cpu_s_per_image"] * 1e3 for r in rs], "{:.2f}"),
                fmt_range([r["peak_pss_mib"] for r in rs]),
                f"{med([r['foreign_cores'] for r in rs]):.2f}",
            ]
        )
    lines.append(
        md_table(
            [
                "loader",
                "images/s",
                "first batch, cold (s)",
                "first batch, warm (s)",
                "first batch, next epoch (s)",
                "CPU ms/image",
                "peak PSS (MiB)",
                "foreign load (cores)",
            ],
            rows,
        )
    )
    lines.append("")
    return lines


def _ratio_tables(runs: dict, loaders: list) -> list:
    """raydl's variants against torch, Ray Data, the fastest peer (and the ceiling), all and undisturbed."""
    lines: list = []
    peers = [k for k in loaders if k in PEERS]
    for quiet in (False, True):
        rrows = []
        for k in [x for x in loaders if x.startswith("raydl")]:
            if k not in runs:
                continue
            cells = []
            for other in (
                rate_in_rep(runs, "torch", quiet),
                rate_in_rep(runs, "raydata", quiet),
                fastest_peer_in_rep(runs, peers, quiet),
            ):
                xs = paired(runs, k, other, quiet)
                cells.append(f"{fmt_range(xs, '{:.2f}×')} [{len(xs)}]")
            if "ceiling" in runs:
                xs = paired(runs, k, rate_in_rep(runs, "ceiling", quiet), quiet)
                cells.append(f"{fmt_range(xs, '{:.2f}')} [{len(xs)}]")
            rrows.append([k] + cells)
        if rrows:
            lines.append(
                "Ratios of images/s, paired per repetition: median (min–max) [repetitions]"
                + (
                    f", only repetitions in which no measurement compared had foreign load > "
                    f"{DISTURBED_FOREIGN_CORES} cores:"
                    if quiet
                    else ":"
                )
            )
            lines.append("")
            lines.append(
                md_table(
                    [
                        "raydl variant",
                        "/ torch (target ≥ 1.1×)",
                        "/ Ray Data (target ≥ 1.5×)",
                        "/ fastest peer in the same repetition (target ≥ 0.9×)",
                    ]
                    + (["of the machine's ceiling (target ≥ 0.90)"] if "ceiling" in runs else []),
                    rrows,
                )
            )
            lines.append("")
    return lines


def _ceiling_table(runs: dict, loaders: list) -> list:
    """Every loader's share of the machine's ceiling, when the ceiling was measured."""
    lines: list = []
    if "ceiling" in runs:
        crows = []
        for k in loaders:
            if k == "ceiling" or k not in runs:
                continue
            xs = paired(runs, k, rate_in_rep(runs, "ceiling"))
            qs = paired(runs, k, rate_in_rep(runs, "ceiling", True), True)
            crows.append([k, f"{fmt_range(xs, '{:.2f}')} [{len(xs)}]", f"{fmt_range(qs, '{:.2f}')} [{len(qs)}]"])
        lines.append(
            "Share of the machine's ceiling (the same decode + augment + collate in one fresh process per worker, "
            "side by side, no loader), paired per repetition:"
        )
        lines.append("")
        lines.append(md_table(["loader", "all repetitions", "undisturbed"], crows))
        lines.append("")
    return lines


def _startup_section(runs: dict, loaders: list) -> list:
    """Cold start: Ray up, raydl's workers ready, first batch (and raydl's first batches against Ray Data's)."""
    lines: list = []
    if "raydl" in runs and "raydata" in runs:
        ratio_cold = med([r["ttfb_cold_s"] for r in runs["raydl"]]) / med([r["ttfb_cold_s"] for r in runs["raydata"]])
        ratio_warm = med([r["ttfb_warm_s"] for r in runs["raydl"]]) / med([r["ttfb_warm_s"] for r in runs["raydata"]])
        lines.append(f"First batch, raydl / Ray Data (target ≤ 0.5): cold {ratio_cold:.2f}, warm {ratio_warm:.2f}.")
        lines.append("")
    srow = []
    for k in loaders:
        rs = runs.get(k, [])
        if not rs:
            continue
        up = [r["ray_up_s"] for r in rs if "ray_up_s" in r]
        ready = [r["workers_ready_s"] for r in rs if "workers_ready_s" in r]
        srow.append(
            [
                k,
                fmt_range(up, "{:.2f}") if up else "—",
                fmt_range(ready, "{:.2f}") if ready else "—",
                fmt_range([r["ttfb_cold_s"] for r in rs], "{:.2f}"),
                f"{med([r.get('foreign_cores_startup', float('nan')) for r in rs]):.2f}",
            ]
        )
    lines.append(
        "Cold start, seconds from before the loader's first import (Ray up = raydl's local Ray start returned; "
        "Ray Data's child starts Ray the same way):"
    )
    lines.append("")
    lines.append(
        md_table(
            [
                "loader",
                "Ray up (s)",
                "raydl workers ready (s)",
                "first batch (s)",
                "foreign load during start-up (cores)",
            ],
            srow,
        )
    )
    lines.append("")
    return lines


def _cpu_and_pss_tables(runs: dict, loaders: list) -> list:
    """CPU per image and peak PSS, split by process kind."""
    lines: list = []
    kinds = ["driver", "workers", "raylet", "gcs", "ray agents", "idle Ray workers", "other"]
    crow = []
    for k in loaders:
        rs = runs.get(k, [])
        if not rs:
            continue
        crow.append(
            [k]
            + [f"{med([r['cpu_s_per_image_by_kind'].get(kind, 0.0) * 1e3 for r in rs]):.2f}" for kind in kinds]
            + [f"{med([r['cores_used'] for r in rs]):.2f}"]
        )
    lines.append("CPU ms per image over the steady epochs, by process (median over repetitions):")
    lines.append("")
    lines.append(md_table(["loader"] + kinds + ["cores used"], crow))
    lines.append("")
    mrow = []
    for k in loaders:
        rs = runs.get(k, [])
        if not rs:
            continue
        mrow.append([k] + [f"{med([r['peak_pss_by_kind_mib'].get(kind, 0.0) for r in rs]):,.0f}" for kind in kinds])
    lines.append("PSS (MiB) at the sample with the highest total, by process kind (median over repetitions):")
    lines.append("")
    lines.append(md_table(["loader"] + kinds, mrow))
    return lines


def build_report(args, info: dict, vers: dict, runs: dict, loaders: list, notes: list, elapsed_s: float) -> str:
    """The run's Markdown report: its sections in order, then the notes and the run's time."""
    lines = _report_head(args, info, vers)
    for section in (_loaders_table, _ratio_tables, _ceiling_table, _startup_section, _cpu_and_pss_tables):
        lines += section(runs, loaders)
    for n in notes:
        lines += ["", f"Note: {n}"]
    lines += [
        "",
        f"Run took {elapsed_s / 60:.1f} min; load average at end {' / '.join(f'{x:.2f}' for x in os.getloadavg())}.",
    ]
    return "\n".join(lines)


def plot(path: str, runs: dict, loaders: list, title: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ks_all = [k for k in loaders if runs.get(k)]
    colors = {
        "torch": "#4c72b0",
        "raydl": "#dd8452",
        "raydl-threads2": "#c44e52",
        "raydata": "#55a868",
        "spdl": "#8172b3",
        "spdl-io": "#937860",
        "nodes": "#da8bc3",
        "ceiling": "#bbbbbb",
    }
    panels = [
        ("images_per_s", "steady images/s", 1.0),
        ("ttfb_cold_s", "first batch, cold (s, log)", 1.0),
        ("cpu_s_per_image", "CPU ms per image (all processes)", 1e3),
        ("peak_pss_mib", "peak PSS (MiB)", 1.0),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    for ax, (key, label, scale) in zip(axes, panels):
        ks = [k for k in ks_all if runs[k][0][key] == runs[k][0][key]]  # the ceiling has no first batch
        ys = [med([r[key] * scale for r in runs[k]]) for k in ks]
        lo = [y - min(r[key] * scale for r in runs[k]) for y, k in zip(ys, ks)]
        hi = [max(r[key] * scale for r in runs[k]) - y for y, k in zip(ys, ks)]
        ax.bar(range(len(ks)), ys, color=[colors.get(k, "#999999") for k in ks], yerr=[lo, hi], capsize=2)
        ax.set_xticks(range(len(ks)))
        ax.set_xticklabels(ks, rotation=35, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        if key == "ttfb_cold_s":
            ax.set_yscale("log")
        for i, y in enumerate(ys):
            ax.annotate(
                f"{y:,.0f}" if y >= 20 else f"{y:.2f}",
                (i, y),
                ha="left",
                va="bottom",
                fontsize=7,
                xytext=(3, 1),
                textcoords="offset points",
            )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    """The command line (the parent's options, and the child's hidden ones)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--offload",
        action="store_true",
        help="the offload shape instead: trainer on one core, workers on "
        "a second loopback Ray node, a training step as costly as the batch (bench_images_offload.py; "
        "`--offload --help` for its options)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 640 images, 1 measured epoch, 1 repetition")
    p.add_argument("--loaders", default=",".join(LOADERS), help=f"comma-separated, from {','.join(LOADERS)}")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; quick 1)")
    p.add_argument("--epochs", type=int, default=None, help="measured epochs after the first (default 2; quick 1)")
    p.add_argument("--images", type=int, default=None, help="images per epoch (default 2560; quick 640)")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--cache-dir", default="/tmp/raydl-bench-images")
    p.add_argument(
        "--ffmpeg-lib-dir",
        default=os.environ.get("RAYDL_BENCH_FFMPEG_LIB_DIR", ""),
        help="directory with FFmpeg's shared libraries for spdl.io (added to the spdl-io child's "
        "LD_LIBRARY_PATH; several dirs joined by ':')",
    )
    p.add_argument(
        "--raydata-reservation",
        action="store_true",
        help="keep Ray Data's per-operator resource reservation (its default; 1 map task at a time on 2 CPUs)",
    )
    p.add_argument(
        "--spdl-threads",
        type=int,
        default=0,
        help="SPDL's thread count and decode concurrency (default: --num-workers)",
    )
    p.add_argument("--pss-interval-s", type=float, default=1.0)
    p.add_argument("--child-timeout-s", type=float, default=None, help="per child (default 420; quick 240)")
    p.add_argument("--retry-budget-s", type=float, default=120.0)
    p.add_argument(
        "--quiet-wait-s",
        type=float,
        default=None,
        help="wait up to this for a quiet second before a child (default 10; quick 0)",
    )
    p.add_argument("--quiet-budget-s", type=float, default=90.0, help="total seconds spent waiting for quiet")
    p.add_argument(
        "--report",
        default=None,
        metavar="JSONL",
        help="only render the report and chart of a finished run again from its .jsonl",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)
    return p


def prepare_dataset(args, res) -> str:
    """The JPEG folder of this run (written once, then reused): its path; sets args.avg_kb."""
    from examples.train_image_classifier import write_jpeg_folder

    data_dir = os.path.join(args.cache_dir, f"500x375-n{args.images}-c{args.classes}-q90")
    t = time.perf_counter()
    write_jpeg_folder(data_dir, args.images, args.classes, size=(500, 375), quality=90)
    files = [os.path.join(d, f) for d, _, fs in os.walk(data_dir) for f in fs if f.endswith(".jpg")]
    args.avg_kb = sum(os.path.getsize(f) for f in files) / len(files) / 1024
    log(
        f"{len(files)} JPEGs in {data_dir} (avg {args.avg_kb:.0f} KB; {time.perf_counter() - t:.0f} s to write or find)"
    )
    res.write({"section": "dataset", "dir": data_dir, "images": len(files), "avg_kb": args.avg_kb})
    return data_dir


def choose_loaders(p: argparse.ArgumentParser, args, notes: list) -> list:
    """--loaders, checked; spdl-io left out (with a note) where spdl.io cannot load FFmpeg."""
    loaders = [k for k in args.loaders.split(",") if k]
    bad = [k for k in loaders if k not in LOADERS]
    if bad:
        p.error(f"unknown loaders {bad}")
    if "spdl-io" in loaders:
        why = spdl_io_available(args)
        if why:
            loaders.remove("spdl-io")
            notes.append(f"spdl-io skipped: spdl.io cannot load FFmpeg here ({why}); pass --ffmpeg-lib-dir.")
            log(notes[-1])
    return loaders


def our_raylets() -> int:
    """raylet processes of this environment's Ray (other engineers' Rays on this machine are not ours)."""
    import psutil

    return sum(
        1
        for q in psutil.process_iter(["name", "exe"])
        if q.info["name"] == "raylet" and (q.info["exe"] or "").startswith(sys.prefix)
    )


def run_repetitions(args, loaders: list, data_dir: str, res, notes: list) -> tuple:
    """Every loader in every repetition, in rotated order: (runs by loader, the quiet gate and retry state)."""
    state = {"gate": QuietGate(args.quiet_wait_s, args.quiet_budget_s), "retry_s": 0.0}
    runs: dict = {}
    for rep in range(args.reps):
        order = loaders[rep % len(loaders) :] + loaders[: rep % len(loaders)]
        for kind in order:
            try:
                rec = measure(kind, args, data_dir, state, rep)
            except Exception as e:  # one loader failing must not lose the others' numbers
                notes.append(f"{kind} rep {rep} failed: {str(e).strip().splitlines()[-1][:300]}")
                log(notes[-1])
                continue
            res.write({"section": "run", **rec})
            runs.setdefault(kind, []).append(rec)
            log(
                f"rep {rep} {kind:15s} {rec['images_per_s']:7.1f} images/s  first batch cold {rec['ttfb_cold_s']:.2f} s "
                f"warm {rec['ttfb_warm_s']:.2f} s  CPU {rec['cpu_s_per_image'] * 1e3:.2f} ms/image  peak PSS "
                f"{rec['peak_pss_mib']:,.0f} MiB  foreign {rec['foreign_cores']:.2f}"
                + (f"  (killed leftovers {rec['leftover_pids_killed']})" if rec["leftover_pids_killed"] else "")
            )
    return runs, state


def summarize(runs: dict, loaders: list) -> dict:
    """Medians per loader and raydl's paired ratios, for the run's summary line."""
    peers = [k for k in loaders if k in PEERS]
    summary = {}
    for k, rs in runs.items():
        summary[k] = {
            "images_per_s_median": med([r["images_per_s"] for r in rs]),
            "ttfb_cold_s_median": med([r["ttfb_cold_s"] for r in rs]),
            "ttfb_warm_s_median": med([r["ttfb_warm_s"] for r in rs]),
            "cpu_ms_per_image_median": med([r["cpu_s_per_image"] * 1e3 for r in rs]),
            "peak_pss_mib_median": med([r["peak_pss_mib"] for r in rs]),
        }
        if k.startswith("raydl"):
            summary[k].update(
                {
                    "vs_torch_paired": paired(runs, k, rate_in_rep(runs, "torch")),
                    "vs_raydata_paired": paired(runs, k, rate_in_rep(runs, "raydata")),
                    "vs_fastest_peer_paired": paired(runs, k, fastest_peer_in_rep(runs, peers)),
                }
            )
    return summary


def main() -> int:
    if "--offload" in sys.argv[1:]:  # its own driver, pinned to one core before torch is imported (no child processes)
        from benchmarks import bench_images_offload

        return bench_images_offload.main([a for a in sys.argv[1:] if a != "--offload"])
    p = build_parser()
    args = p.parse_args()
    if args.report:
        return rerender(args.report, p)
    args.images = args.images or (640 if args.quick else 2560)
    args.epochs = args.epochs or (1 if args.quick else 2)
    if args.child:
        child(args.child, args)
        return 0
    args.reps = args.reps or (1 if args.quick else 3)
    args.child_timeout_s = args.child_timeout_s or (240.0 if args.quick else 420.0)
    args.quiet_wait_s = args.quiet_wait_s if args.quiet_wait_s is not None else (0.0 if args.quick else 10.0)

    start = time.perf_counter()
    import importlib.metadata

    info = machine_info(ray_version=importlib.metadata.version("ray"))
    vers = versions()
    res = Results("bench_images", args.quick)
    res.write({"section": "machine", **info, "versions": vers, "argv": sys.argv[1:]})
    log(describe_machine(info))

    data_dir = prepare_dataset(args, res)
    notes: list = []
    loaders = choose_loaders(p, args, notes)

    raylets_before = our_raylets()
    runs, state = run_repetitions(args, loaders, data_dir, res, notes)
    gate = state["gate"]
    notes.append(
        f"Before each child the run waited up to {args.quiet_wait_s:g} s for a quiet second (waited "
        f"{gate.waited_s:.0f} s in all; {gate.gave_up} times the machine stayed busy); reruns took "
        f"{state['retry_s']:.0f} s of steady epochs."
    )
    raylets_after = our_raylets()
    notes.append(
        f"raylet processes of this environment's Ray before the run {raylets_before}, after {raylets_after}; "
        f"processes of a child left behind and killed: "
        f"{sum(len(r['leftover_pids_killed']) for rs in runs.values() for r in rs)}."
    )
    summary = summarize(runs, loaders)
    res.write({"section": "images_summary", **summary})
    res.write(
        {
            "section": "notes",
            "notes": notes,
            "elapsed_s": time.perf_counter() - start,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        }
    )
    elapsed_s, date = time.perf_counter() - start, time.strftime("%Y-%m-%d")
    md, png = render(args, info, vers, runs, loaders, notes, elapsed_s, res.prefix, res.figure_path(), date)
    res.close()
    print(f"\nresults: {res.jsonl_path}\n         {md}\n         {png or '(no chart: pip install matplotlib)'}")
    return 0


def render(
    args,
    info: dict,
    vers: dict,
    runs: dict,
    loaders: list,
    notes: list,
    elapsed_s: float,
    prefix: str,
    png_path: str,
    date: str,
) -> tuple:
    """Print the report and write it (prefix.md) and the chart (png_path); returns both paths."""
    report = build_report(args, info, vers, runs, loaders, notes, elapsed_s)
    print(report)
    md = prefix + ".md"
    with open(md, "w") as f:
        f.write(report + "\n")
    png = plot(
        png_path,
        runs,
        loaders,
        f"JPEG pipeline, {args.num_workers} workers, batch {args.batch_size}, raydl {info['raydl_commit']}, "
        f"{date}, {info['cpu_count']} CPUs (median, min–max over {args.reps} reps)",
    )
    return md, png


def rerender(path: str, parser: argparse.ArgumentParser) -> int:
    """--report: the report and chart of a finished run again, from its .jsonl (the report next to it, -report.md;
    the chart where the run drew it: figures/bench_images.png for a full run)."""
    recs = [json.loads(line) for line in open(path)]
    machine = next(r for r in recs if r.get("section") == "machine")
    args = parser.parse_args([a for a in machine["argv"] if a != "--report"])
    args.images = args.images or (640 if args.quick else 2560)
    args.epochs = args.epochs or (1 if args.quick else 2)
    args.reps = args.reps or (1 if args.quick else 3)
    args.avg_kb = next(r for r in recs if r.get("section") == "dataset")["avg_kb"]
    runs: dict = {}
    for r in recs:
        if r.get("section") == "run":
            runs.setdefault(r["loader"], []).append(r)
    loaders = [k for k in args.loaders.split(",") if k in runs]
    extra = next((r for r in recs if r.get("section") == "notes"), {})
    stamp = os.path.basename(path).rsplit("-", 2)[-2:]
    date = extra.get("date") or f"{stamp[0][:4]}-{stamp[0][4:6]}-{stamp[0][6:8]}"
    info = {k: v for k, v in machine.items() if k not in ("section", "versions", "argv")}
    md, png = render(
        args,
        info,
        machine["versions"],
        runs,
        loaders,
        extra.get("notes", []),
        extra.get("elapsed_s", 0.0),
        path[: -len(".jsonl")] + "-report",
        figure_path("bench_images", args.quick),
        date[:10],
    )
    print(f"\n{md}\n{png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
