#!/usr/bin/env python3
"""The JPEG pipeline of bench_images.py in bench_offload.py's shape: the trainer keeps one core,
raydl's workers run on a second (loopback) Ray node on the other core, and every batch is
followed by a training step as costly as making the batch.

    python -m benchmarks.bench_images --offload            # full run (about 8-10 minutes on 2 cores; +45 s once)
    python -m benchmarks.bench_images --offload --quick    # smoke run (about 2 minutes)
    python -m benchmarks.bench_images_offload [--quick]    # the same

Shape (bench_offload.py's helpers, imported): this driver is pinned to the first usable CPU
before torch or Ray start a thread (importing bench_offload does it), so torch's forked workers
share that core with the trainer; a head node (GCS, the driver's raylet and object store) is
started with cluster/local_launcher.sh under `taskset -c <trainer cpu>` and a 1-CPU node with
{"data": num_workers} under `taskset -c <data cpu>` (own directory and ports:
/tmp/raydl-bench-imgoff, 6790, dashboard 8790).

Workload: bench_images.py's (examples/train_image_classifier.py: JpegFolder + TrainTransform,
generated 500x375 JPEGs in --cache-dir; PIL decode, RandomResizedCrop(224), flip, to tensor,
normalize), 1536 images per epoch, batch 64, shuffled, 2 workers, persistent. D = torch's data work
per batch on the one core: 64 / torch's images/s in the 0 row (no step), as bench_offload.py
takes it; the same batch (decode + crop + flip + normalize of 64 images, collate) is also made in
this process on the idle trainer core before Ray starts, and that figure is D when no 0 row comes
first. The "D" row's training step S is bench_offload's TrainStep (single-threaded matmul work)
calibrated to D ms, so the step is as costly as the batch. Rows: --train-ms (default 0,D).

Loaders (--loaders, torch first):
  torch         torch.utils.data.DataLoader: 2 workers forked on the trainer's core
  raydl-auto    raydl.DataLoader, no ray_remote_args: raydl's own placement must pick the data node
  raydl-hinted  raydl.DataLoader(ray_remote_args={"resources": {"data": 1}, "num_cpus": 0.5})
  raydl-ray     raydl-auto with ray_lane=False: each batch through Ray's object transfer instead of the
                workers' TCP lanes (not run unless listed: --loaders torch,raydl-auto,raydl-ray)
  raydata       Ray Data as bench_images.py builds it, its shuffle and map tasks with the same
                remote args (on the data node); iter_torch_batches assembles batches in the driver
SPDL and torchdata.nodes are not in this shape: SPDL's pipeline runs in the trainer's own threads
and torchdata.nodes' workers are forked from the trainer, so both stay on the trainer's host.

Reported: steady images/s (epochs after the first), paired ratio vs torch per repetition (loaders
in rotated order), the ideal offload ratio (D+S)/max(D,S) and the ceiling with the two cores'
measured contention, where the workers ran (checked), the target (>= 1.7x torch at S = D).
"""

from __future__ import annotations

# First: importing the offload module pins this process to the trainer's CPU before torch starts its threads.
from benchmarks.common import offload as O

# isort: split

import argparse
import functools
import gc
import importlib.metadata
import logging
import os
import sys
import time
from typing import Any, Callable

import torch
from torch.utils.data import default_collate

from benchmarks.common import REPO
from benchmarks.common.clusters import LocalCluster, disconnect_and_stop
from benchmarks.common.machine import LoadMonitor, QuietGate, describe_machine, machine_info
from benchmarks.common.peers import Loader, RayDataLoader, TorchLike
from benchmarks.common.results import Results, log, md_table, median
from examples import train_image_classifier as T

LOADERS = ("torch", "raydl-auto", "raydl-hinted", "raydl-ray", "raydata")
TARGET = 1.7  # issue 20: with the offload node, at least 1.7x torch at S = D


def data_ms_per_batch(ds, batch_size: int, batches: int) -> list[float]:
    """ms to make each of `batches` batches in this process (one warm-up batch first): load + transform of
    `batch_size` images in a shuffled order, then default_collate: a worker's work for one batch."""
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    out = []
    for b in range(batches + 1):
        idx = [order[(b * batch_size + k) % len(order)] for k in range(batch_size)]
        t0 = time.perf_counter()
        default_collate([ds[i] for i in idx])
        out.append((time.perf_counter() - t0) * 1e3)
    return out[1:]


def step_ms(step: O.TrainStep, calls: int = 3) -> float:
    """What a calibrated step really takes now (fastest of `calls`)."""
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        step(None)
        ts.append((time.perf_counter() - t0) * 1e3)
    return min(ts)


class Epochs:
    """An iterable of one epoch per iter() over a peers Loader (what O.run_epochs iterates)."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def __iter__(self):
        return iter(self.loader.epoch())


def forked(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with the garbage collected and the rest frozen: torch's workers, forked meanwhile, inherit no garbage
    (a child collecting an inherited ObjectRef or zero-copy batch would write to the raylet's socket; tests/_parity.py)."""
    gc.collect()
    gc.freeze()
    try:
        return fn(*args)
    finally:
        gc.unfreeze()


def _where(row: dict) -> dict:
    """Ray Data probe: the node and CPUs of the task that ran this row."""
    import os as os_

    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "cpus": str(sorted(os_.sched_getaffinity(0)))}


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 256 images, 1 measured epoch, 1 repetition")
    p.add_argument(
        "--loaders",
        default=",".join(n for n in LOADERS if n != "raydl-ray"),
        help=f"comma list from {','.join(LOADERS)}; torch first",
    )
    p.add_argument(
        "--train-ms",
        default="0,D",
        help="training step per batch, ms of work (comma list; D = as long as "
        "the data work of one batch on one core, measured at start)",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions, loaders in rotated order (default 3; quick 1)")
    p.add_argument("--epochs", type=int, default=1, help="measured epochs after the first (default 1)")
    p.add_argument(
        "--images",
        type=int,
        default=None,
        help="images per epoch (default 1536; quick 256): the more "
        "batches per epoch, the less the epoch's start and end (nothing to overlap) weigh",
    )
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--cache-dir", default="/tmp/raydl-bench-images")
    p.add_argument("--raydata-reservation", action="store_true", help="keep Ray Data's per-operator reservation")
    p.add_argument(
        "--quiet-wait-s",
        type=float,
        default=None,
        help="wait up to this long for a quiet second before each measurement (default 10; quick 0)",
    )
    p.add_argument("--quiet-budget-s", type=float, default=90.0, help="total seconds spent waiting for quiet")
    p.add_argument("--cluster-dir", default="/tmp/raydl-bench-imgoff")
    p.add_argument("--port", type=int, default=6790)
    p.add_argument("--dashboard-port", type=int, default=8790)
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.quick else 3)
    epochs = args.epochs
    n = args.images or (256 if args.quick else 1536)
    W, bs = args.num_workers, args.batch_size
    names = [x.strip() for x in args.loaders.split(",") if x.strip()]
    if names[0] != "torch" or not set(names) <= set(LOADERS) or len(names) < 2:
        p.error(f"--loaders: torch first, then some of {LOADERS[1:]}")
    variants = names[1:]
    wanted = [x.strip() for x in args.train_ms.split(",") if x.strip()]
    hint = {"resources": {"data": 1}, "num_cpus": 1 / W}
    start = time.perf_counter()

    info = {
        **machine_info(ray_version=importlib.metadata.version("ray")),
        "trainer_cpu": O.TRAINER_CPU,
        "data_cpu": O.DATA_CPU,
    }
    res = Results("bench_images_offload", args.quick)
    res.write({"section": "machine", **info, "argv": sys.argv[1:] if argv is None else argv})
    log(describe_machine(info))

    data_dir = os.path.join(args.cache_dir, f"500x375-n{n}-c{args.classes}-q90")
    t = time.perf_counter()
    T.write_jpeg_folder(data_dir, n, args.classes, size=(500, 375), quality=90)
    ds = T.JpegFolder(data_dir, T.TrainTransform(224))
    avg_kb = sum(os.path.getsize(path) for path, _ in ds.samples) / len(ds) / 1024
    log(f"{len(ds)} JPEGs in {data_dir} (avg {avg_kb:.0f} KB; {time.perf_counter() - t:.0f} s to write or find)")

    # Ray's workers on both nodes import the example's module (Ray Data's map does) from this checkout.
    pythonpath = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    cluster = LocalCluster(
        args.cluster_dir,
        args.port,
        args.dashboard_port,
        env={"RAYDL_CLUSTER_HEAD_CPUS": "1", "RAYDL_CLUSTER_OBJECT_STORE_BYTES": "500000000", "PYTHONPATH": pythonpath},
    )
    gate = QuietGate(
        args.quiet_wait_s if args.quiet_wait_s is not None else (0 if args.quick else 10),
        args.quiet_budget_s,
        cluster.pids,
    )

    # One batch's data work in this process, then the fixed steps, on the idle trainer core before Ray starts.
    gate.wait()
    d_all = data_ms_per_batch(ds, bs, 3 if args.quick else 8)
    data_direct = median(d_all)
    log(f"one batch of {bs} made in this process: {data_direct:.0f} ms ({min(d_all):.0f}–{max(d_all):.0f})")
    s_real: dict = {}

    def make_step(ms: float) -> O.TrainStep:
        step = O.TrainStep(ms)
        s_real[ms] = step_ms(step) if ms else 0.0
        log(f"train step {ms:g} ms -> {step.reps} matmuls ({s_real[ms]:.0f} ms measured now)")
        return step

    fixed = {float(x): make_step(float(x)) for x in wanted if x != "D"}
    busy_code = (
        "from examples.train_image_classifier import JpegFolder, TrainTransform\n"
        f"ds = JpegFolder({data_dir!r}, TrainTransform(224))\ni = 0\n"
        "while True:\n    ds[i % len(ds)]; i += 1"
    )
    gate.wait()
    contention = O.measure_contention(
        0,
        O.TrainStep(64.0),
        rounds=1 if args.quick else 3,
        sample=lambda i: ds[i % len(ds)],
        sample_code=busy_code,
        settle_s=3.0,
    )
    log(
        f"contention: an image takes {contention[0]:.2f}x as long, a train step {contention[1]:.2f}x, "
        "while the other core is busy"
    )
    res.write(
        {
            "section": "calibration",
            "images": len(ds),
            "avg_kb": avg_kb,
            "data_ms_per_batch": d_all,
            "data_ms_median": data_direct,
            "contention_data_factor": contention[0],
            "contention_step_factor": contention[1],
        }
    )

    rows, notes, placement = [], [], {}
    data_torch = 0.0  # torch's ms per batch on the one core with no step (the 0 row), if run
    cluster_start_s = 0.0
    try:
        cluster_start_s = O.start_cluster(cluster, W)
        import ray
        from ray import cloudpickle

        for mod in (T, sys.modules["benchmarks.common.peers"], sys.modules[__name__]):  # shipped by value
            cloudpickle.register_pickle_by_value(mod)
        driver_node = ray.get_runtime_context().get_node_id()

        def make(name: str) -> Loader:
            if name == "torch":
                return TorchLike("torch", ds, args)
            if name == "raydl-auto":  # no placement hints: raydl's own plan decides the node
                return TorchLike("raydl", ds, args)
            if name == "raydl-hinted":
                return TorchLike("raydl", ds, args, raydl_kwargs={"ray_remote_args": hint})
            if name == "raydl-ray":
                return TorchLike("raydl", ds, args, raydl_kwargs={"ray_lane": False})
            return RayDataLoader(ds, args, remote_args=hint)

        # Where everything runs: checked, not assumed.
        placement["driver_affinity"] = sorted(os.sched_getaffinity(0))
        for name in variants:
            if name == "raydata":
                import ray.data

                ray.data.DataContext.get_current().enable_progress_bars = False
                logging.getLogger("ray.data").setLevel(logging.WARNING)  # no per-epoch "Starting execution" lines
                got = ray.data.range(8, override_num_blocks=8).map(_where, **hint).take_all()
                placement["raydata_tasks_off_driver_node"] = all(r["node"] != driver_node for r in got)
                placement["raydata_task_affinity"] = sorted({r["cpus"] for r in got})
                ok = placement["raydata_tasks_off_driver_node"] and placement["raydata_task_affinity"] == [
                    str([O.DATA_CPU])
                ]
            else:
                loader = make(name)
                next(iter(loader.epoch()))
                off, aff = O.raydl_placement(loader.loader, driver_node)
                placement[f"{name}_worker_nodes_differ_from_driver"], placement[f"{name}_worker_affinity"] = off, aff
                loader.close()
                ok = off and aff == [O.DATA_CPU]
            if not ok:
                notes.append(f"{name}'s work was NOT where intended: {placement}")
        loader = make("torch")
        it = forked(iter, Epochs(loader))
        next(it)
        placement["torch_worker_affinity"] = O.children_affinity()
        del it
        loader.close()
        del loader
        res.write({"section": "placement", **placement})
        log(f"placement: {placement}")

        for x in wanted:
            if x == "D":  # the balanced row: a step as costly as torch's data work per batch on the one core
                d_ms = data_torch or data_direct
                log(
                    f"D = {d_ms:.0f} ms per batch ({'torch, no step' if data_torch else 'in this process'}): "
                    f"adding a {round(d_ms)} ms step"
                )
                ms, step = round(d_ms), make_step(round(d_ms))
            else:
                ms, step = float(x), fixed[float(x)]
            got: dict = {name: [] for name in names}
            for rep, name in O.rotation(names, reps):  # rotated order
                gc.collect()
                loader = make(name)
                gate.wait()
                with LoadMonitor(extra_roots=cluster.pids) as mon:
                    run = functools.partial(forked, O.run_epochs) if name == "torch" else O.run_epochs
                    r = run(Epochs(loader), epochs, step)
                loader.close()
                del loader
                rec = {
                    "section": "offload",
                    "loader": name,
                    "train_ms": ms,
                    "rep": rep,
                    "num_workers": W,
                    "images_per_epoch": len(ds),
                    "measured_epochs": epochs,
                    "ttfb_s": r["ttfb_s"],
                    "first_epoch_s": r["first_epoch_s"],
                    "images_per_s": r["samples_per_s"],
                    "step_ms_measured": s_real[ms],
                    "foreign_cores": round(mon.foreign_cores, 3),
                    "our_cores": round(mon.ours_cores, 3),
                }
                res.write(rec)
                got[name].append(rec)
                log(
                    f"train {ms:g} ms/batch rep {rep} {name:12s} {r['samples_per_s']:6.1f} images/s "
                    f"(foreign load {mon.foreign_cores:.2f} cores)"
                )
            tr = [r["images_per_s"] for r in got["torch"]]
            if ms == 0:
                data_torch = 1e3 * bs / median(tr)
            d_ideal = data_torch or data_direct
            ideal, contended = O.offload_ceilings(d_ideal, ms, contention)
            n_batches = -(-len(ds) // bs)
            in_epoch = O.epoch_ceiling(d_ideal, ms, contention, n_batches)
            row = [f"{ms:g}" + (" (S = D)" if x == "D" else ""), f"{median(tr):,.0f} ({min(tr):,.0f}–{max(tr):,.0f})"]
            for name in variants:
                d = [r["images_per_s"] for r in got[name]]
                paired, cells = O.paired_cells(d, tr)
                row += cells
                res.write(
                    {
                        "section": "offload_summary",
                        "loader": name,
                        "train_ms": ms,
                        "torch_median": median(tr),
                        "median": median(d),
                        "ratio_paired_median": median(paired),
                        "ratio_paired_all": paired,
                        "ideal": ideal,
                        "contended_ceiling": contended,
                        "epoch_ceiling": in_epoch,
                    }
                )
                if x == "D" and name.startswith("raydl"):
                    verdict = "met" if median(paired) >= TARGET else "NOT met"
                    share = ""
                    if in_epoch != "—":
                        share = f", {100 * median(paired) / float(in_epoch.rstrip('×')):.0f} % of the epoch's"
                    notes.append(
                        f"target ≥ {TARGET}× torch at S = D: {name} {median(paired):.2f}× — {verdict} "
                        f"(ideal {ideal}, ceiling with the cores contended {contended}, over an epoch {in_epoch}"
                        f"{share})"
                    )
            fl = median([r["foreign_cores"] for name in names for r in got[name]])
            rows.append(row + [ideal, contended, in_epoch, f"{fl:.2f}"])
    finally:
        disconnect_and_stop(cluster)

    if data_torch:
        d_text = (
            f"D = {data_torch:.0f} ms: torch's data work per batch on the one core, from its rate with no "
            f"step ({bs} / images/s); the S = D step is calibrated to it. The same batch made in this process "
            f"on the idle core before Ray started (decode + crop + flip + normalize of {bs} images + collate, "
            f"median of {len(d_all)}) took {data_direct:.0f} ms ({min(d_all):.0f}–{max(d_all):.0f}); the "
            "rest is torch's hand-over of the batch and whatever else ran on that core"
        )
    else:
        d_text = (
            f"D = {data_direct:.0f} ms ({min(d_all):.0f}–{max(d_all):.0f}): one batch made in this process on "
            f"the idle trainer core before Ray started (decode + crop + flip + normalize of {bs} images + "
            f"collate, median of {len(d_all)}); no 0 row, so the ideal and the S = D step use it"
        )
    steps_text = ", ".join(f"{ms:g} → {v:.0f}" for ms, v in s_real.items() if ms)
    lines = [
        f"## Images, offload shape: JPEG pipeline, trainer on one core, workers on a second node "
        f"({'quick' if args.quick else 'full'} run)",
        "",
        describe_machine(info),
        "",
        f"{len(ds)} generated JPEGs (500x375, ~{avg_kb:.0f} KB) per epoch, PIL decode + RandomResizedCrop(224) + "
        f"flip + to tensor + normalize, batch {bs}, shuffled, {W} workers, persistent. Trainer (this process, "
        f"torch.set_num_threads(1)) pinned to CPU {O.TRAINER_CPU} with the head node (GCS, its raylet and object "
        f"store); torch's {W} forked workers inherit CPU {O.TRAINER_CPU}. A second Ray node (1 CPU, "
        f"{{'data': {W}}}) under `taskset -c {O.DATA_CPU}`. raydl-auto: no ray_remote_args (raydl's own "
        f"placement; its workers' batches come over TCP lanes); raydl-hinted: ray_remote_args={hint}; raydl-ray: "
        "raydl-auto with ray_lane=False (each batch through Ray's object transfer); raydata: Ray Data's shuffle "
        "and map tasks with the "
        f"same remote args, batches assembled in the driver by iter_torch_batches. SPDL and torchdata.nodes are "
        "not in this shape: SPDL runs in the trainer's threads and torchdata.nodes forks its workers from the "
        "trainer, so neither can put its work on another node.",
        "",
        f"{d_text}. Train step S = single-threaded matmul work per batch calibrated on the trainer's core "
        f"(ms asked → ms measured right after: {steps_text or '—'}). Steady images/s over {epochs} epoch(s) "
        f"after the first; {reps} repetition(s) in rotated order, median (min–max); ratios paired per "
        f"repetition. Placement checked: {placement}. Before each measurement (and the calibrations) the run "
        f"waited up to "
        f"{gate.max_wait_s:g} s for a quiet second (waited {gate.waited_s:.0f} s in all; {gate.gave_up} times the "
        "machine stayed busy).",
        "",
    ]
    n_batches = -(-len(ds) // bs)
    header = ["train step ms/batch", "torch images/s"]
    for name in variants:
        header += [f"{name} images/s", f"{name} / torch (paired)"]
    lines.append(
        md_table(
            header + ["ideal offload ratio", "ceiling, cores contended", "same, over an epoch", "foreign load (cores)"],
            rows,
        )
    )
    lines += [
        "",
        "Ideal offload ratio = (D + S) / max(D, S): torch's one core does both in turn, an offloaded loader "
        "lets the slower of the two set the pace (1× with no step, at most 2×, at S = D). Ceiling, cores "
        f"contended = (D + S) / max(D × {contention[0]:.2f}, S × {contention[1]:.2f}), the factors measured on the "
        "trainer's core beside a process on the other core running the other side's work (an image's transform, "
        f"a train step), before Ray starts. Within an epoch of n batches an offloaded loader also waits for "
        "the first batch and the last step has nothing to overlap, so at S = D the steady epochs can reach "
        f"at most 2n/(n+1) = {2 * n_batches / (n_batches + 1):.2f}× (n = {n_batches}); with the cores contended, "
        "n (D + S) / (D' + S' + (n - 1) max(D', S')), D' and S' the contended times (the column 'same, over an "
        f"epoch'). Every batch ({bs * 3 * 224 * 224 * 4 / 1e6:.1f} MB of float32) made on the data node crosses "
        "to the trainer's process: over raydl's TCP lane, one copy out of the kernel on the trainer's core; "
        "on Ray's transfer (raydl-ray, Ray Data), through both nodes' object stores. Target (issue 20): "
        f"≥ {TARGET}× torch at S = D, raydl's workers on the offload node; torch's workers cannot leave the "
        "trainer's host, Ray Data's tasks can (measured here when listed).",
    ]
    return O.close_report(res, lines, notes, cluster_start_s, start)


if __name__ == "__main__":
    sys.exit(main())
