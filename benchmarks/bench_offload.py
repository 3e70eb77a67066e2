#!/usr/bin/env python3
"""Offload: the trainer keeps its core; raydl's workers run on another Ray node (another core).

    python -m benchmarks.bench_offload            # full run (about 3-5 minutes with cluster start-up)
    python -m benchmarks.bench_offload --quick    # smoke run (about 1-2 minutes)

The training process (this driver) is pinned to CPU 0 with os.sched_setaffinity before anything
starts a thread, so torch's forked DataLoader workers share that one core with it — exactly
what happens when a trainer's host has no spare CPU. raydl's workers run on a second Ray node
started with `ray start` under `taskset -c 1` (resource {"data": ...}), selected with
ray_remote_args={"resources": {"data": 1}, "num_cpus": ...} ("raydl"), or with no ray_remote_args at
all ("raydl-auto": raydl's own placement, NOTE [ raydl placement ], which must pick the node that
is not the driver's). The head node (GCS, the driver's
raylet and object store) is started under `taskset -c 0`, beside the trainer, as the GPU host's
own raylet would be. Both use cluster/local_launcher.sh's loopback-only start, in their own
directory and ports (RAYDL_CLUSTER_DIR=/tmp/raydl-bench-off, port 6590, dashboard 8590).

Workload: CPU-bound ~1 ms/sample producing 3x64x64 float32, batch 64, 2 workers; optionally a
simulated training step in the driver (a fixed amount of single-threaded matmul work per batch).
Reported: steady-state samples/s (epochs after the first) of torch and the raydl variants, in rotated order, and
the raydl/torch ratio. Every process started here is stopped in a `finally` (bounded waits).
"""

from __future__ import annotations

# First: importing the offload module pins this process to the trainer's CPU before torch starts its threads.
from benchmarks.common.offload import (
    DATA_CPU,
    TRAINER_CPU,
    TrainStep,
    children_affinity,
    close_report,
    measure_contention,
    offload_ceilings,
    paired_cells,
    raydl_placement,
    rotation,
    run_epochs,
    start_cluster,
)

# isort: split

import argparse
import gc
import importlib.metadata
import os
import sys
import time

import torch
import torch.utils.data

import raydl
from benchmarks.common.clusters import LocalCluster, disconnect_and_stop
from benchmarks.common.machine import LoadMonitor, QuietGate, describe_machine, machine_info
from benchmarks.common.results import Results, log, md_table, median
from benchmarks.common.workloads import Workload, WorkloadDataset, calibrate_cpu_iters, sample_cost_s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument(
        "--reps", type=int, default=None, help="repetitions per loader, in rotated order (default 3; quick 1)"
    )
    p.add_argument("--epochs", type=int, default=None, help="measured epochs after the first (default 2; quick 1)")
    p.add_argument("--samples", type=int, default=None, help="samples per epoch (default 2048; quick 512)")
    p.add_argument(
        "--train-ms",
        default="0,32,64,D",
        help="simulated training step per batch, ms of work (comma list; "
        "D = as long as torch's data work per batch, measured by the 0 step, which must come first)",
    )
    p.add_argument(
        "--quiet-wait-s",
        type=float,
        default=None,
        help="wait up to this long for a quiet second before each measurement (default 10; quick 0)",
    )
    p.add_argument(
        "--loaders",
        default="torch,raydl,raydl-auto",
        help="comma list: torch, raydl (resources hint), raydl-auto (no placement hints); torch first",
    )
    p.add_argument("--cluster-dir", default="/tmp/raydl-bench-off")
    p.add_argument("--port", type=int, default=6590)
    p.add_argument("--dashboard-port", type=int, default=8590)
    args = p.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    epochs = args.epochs or (1 if args.quick else 2)
    n = args.samples or (512 if args.quick else 2048)
    W = args.num_workers
    names = [x.strip() for x in args.loaders.split(",")]
    if names[0] != "torch" or not set(names) <= {"torch", "raydl", "raydl-auto"} or len(names) < 2:
        p.error("--loaders: torch first, then raydl and/or raydl-auto")
    variants = names[1:]
    start = time.perf_counter()

    info = {
        **machine_info(ray_version=importlib.metadata.version("ray")),
        "trainer_cpu": TRAINER_CPU,
        "data_cpu": DATA_CPU,
    }
    res = Results("bench_offload", args.quick)
    res.write({"section": "machine", **info, "argv": sys.argv[1:]})
    log(describe_machine(info))

    iters = calibrate_cpu_iters()  # on the trainer's core, before anything else runs on it
    wl = Workload("cpu", "CPU-bound ~1 ms/sample, 3×64×64 f32, batch 64", n, 64, "cpu", iters)
    per_sample = sample_cost_s(wl.sample)
    wanted = [x.strip() for x in args.train_ms.split(",")]
    if "D" in wanted and wanted[0] != "0":
        p.error("--train-ms: 'D' (a step as long as the data work per batch) needs 0 first, which measures it")
    steps = {float(x): TrainStep(float(x)) for x in wanted if x != "D"}
    log(
        f"workload: {iters} numpy passes/sample = {per_sample * 1e3:.2f} ms/sample; train steps "
        + ", ".join(f"{ms:g} ms -> {s.reps} matmuls" for ms, s in steps.items())
    )

    # Measured before any Ray process exists: how much the two cores slow each other.
    contention = measure_contention(iters, TrainStep(64.0), rounds=1 if args.quick else 3)
    log(
        f"contention: a data sample takes {contention[0]:.2f}x as long, a train step {contention[1]:.2f}x, "
        "while the other core is busy"
    )
    res.write({"section": "contention", "data_factor": contention[0], "step_factor": contention[1]})

    cluster = LocalCluster(args.cluster_dir, args.port, args.dashboard_port, env={"RAYDL_CLUSTER_HEAD_CPUS": "1"})
    rows, notes = [], []
    data_ms = 0.0  # torch's ms of data work per batch on the one core, from the step-0 row
    try:
        cluster_start_s = start_cluster(cluster, W)
        import ray

        driver_node = ray.get_runtime_context().get_node_id()

        def make(name: str):
            ds = WorkloadDataset(wl)
            if name == "torch":
                return torch.utils.data.DataLoader(ds, batch_size=64, num_workers=W, persistent_workers=True)
            if name == "raydl-auto":  # no placement hints: raydl's own plan decides the node
                return raydl.DataLoader(ds, batch_size=64, num_workers=W, persistent_workers=True)
            return raydl.DataLoader(
                ds,
                batch_size=64,
                num_workers=W,
                persistent_workers=True,
                ray_remote_args={"resources": {"data": 1}, "num_cpus": 1 / W},
            )

        # Where everything runs: checked, not assumed.
        placement = {"driver_affinity": sorted(os.sched_getaffinity(0))}
        for name in variants:
            loader = make(name)
            next(iter(loader))
            (placement[f"{name}_worker_nodes_differ_from_driver"], placement[f"{name}_worker_affinity"]) = (
                raydl_placement(loader, driver_node)
            )
            loader.shutdown()
        loader = make("torch")
        it = iter(loader)
        next(it)
        placement["torch_worker_affinity"] = children_affinity()
        del it, loader
        res.write({"section": "placement", **placement})
        log(f"placement: {placement}")
        for name in variants:
            if not placement[f"{name}_worker_nodes_differ_from_driver"] or placement[f"{name}_worker_affinity"] != [
                DATA_CPU
            ]:
                notes.append(f"{name}'s workers were NOT where intended: {placement}")

        mon_roots = cluster.pids
        gate = QuietGate(
            args.quiet_wait_s if args.quiet_wait_s is not None else (0 if args.quick else 10), 90, mon_roots
        )
        queue = list(steps.items())
        while queue:
            ms, step = queue.pop(0)
            got: dict = {name: [] for name in names}
            for rep, name in rotation(names, reps):  # rotated order
                gc.collect()
                loader = make(name)
                gate.wait()
                with LoadMonitor(extra_roots=mon_roots) as mon:
                    r = run_epochs(loader, epochs, step)
                if hasattr(loader, "shutdown"):
                    loader.shutdown()
                del loader
                rec = {
                    "section": "offload",
                    "loader": name,
                    "train_ms": ms,
                    "rep": rep,
                    "num_workers": W,
                    "samples_per_epoch": n,
                    "measured_epochs": epochs,
                    **r,
                    "foreign_cores": round(mon.foreign_cores, 3),
                    "our_cores": round(mon.ours_cores, 3),
                }
                res.write(rec)
                got[name].append(rec)
                log(
                    f"train {ms:g} ms/batch rep {rep} {name:6s} {r['samples_per_s']:7.0f} samples/s "
                    f"(foreign load {mon.foreign_cores:.2f} cores)"
                )
            t = [r["samples_per_s"] for r in got["torch"]]
            fl = median([r["foreign_cores"] for name in names for r in got[name]])
            # The best any offload can do: torch's one core does data (D ms/batch, from torch's rate
            # without a step) and step S in turn, 1/(D+S); offloaded, the slower of the two sets
            # the pace, 1/max(D, S). So the ratio is at most (D+S)/max(D, S) <= 2.
            if ms == 0:
                data_ms = 1e3 * wl.batch_size / median(t)
                if "D" in wanted:  # the balanced case: a step as long as torch's data work per batch
                    queue.append((round(data_ms), TrainStep(round(data_ms))))
                    log(f"D = {data_ms:.0f} ms of data work per batch: adding a {round(data_ms)} ms step")
            ceiling, contended = offload_ceilings(data_ms, ms, contention)
            row = [f"{ms:g}", f"{median(t):,.0f} ({min(t):,.0f}–{max(t):,.0f})"]
            for name in variants:
                d = [r["samples_per_s"] for r in got[name]]
                paired, cells = paired_cells(d, t)
                row += cells
                res.write(
                    {
                        "section": "offload_summary",
                        "loader": name,
                        "train_ms": ms,
                        "torch_median": median(t),
                        "raydl_median": median(d),
                        "ratio_paired_median": median(paired),
                        "ratio_paired_all": paired,
                        "foreign_cores_median": fl,
                    }
                )
            rows.append(row + [ceiling, contended, f"{fl:.2f}"])
    finally:
        disconnect_and_stop(cluster)

    lines = [
        f"## raydl offload benchmark ({'quick' if args.quick else 'full'} run)",
        "",
        describe_machine(info),
        "",
        f"Trainer (this process, torch.set_num_threads(1)) pinned to CPU {TRAINER_CPU}; torch's {W} forked workers "
        f"inherit that CPU. raydl's {W} workers on a second Ray node started under `taskset -c {DATA_CPU}` "
        f"(raydl: ray_remote_args={{'resources': {{'data': 1}}, 'num_cpus': {1 / W:g}}}; raydl-auto: no ray_remote_args, "
        f"raydl's own placement); the head node (GCS, the driver's "
        f"raylet and object store) under `taskset -c {TRAINER_CPU}`. Workload: {wl.description} "
        f"({per_sample * 1e3:.2f} ms/sample measured), {n} samples/epoch; steady state over {epochs} epoch(s) after "
        f"the first; {reps} repetitions in rotated order, median (min–max); raydl / torch = median (min–max) of the "
        f"per-repetition ratios (loaders measured one after the other in each repetition). Train step = a fixed amount of "
        f"single-threaded matmul work per batch, calibrated to that many ms on an idle core. Placement checked: "
        f"{placement}. Before each measurement the run waited up to {gate.max_wait_s:g} s for a quiet second "
        f"(waited {gate.waited_s:.0f} s in all; {gate.gave_up} times the machine stayed busy).",
        "",
    ]
    header = ["train step ms/batch", "torch samples/s"]
    for name in variants:
        header += [f"{name} samples/s", f"{name} / torch (paired)"]
    lines.append(md_table(header + ["ideal offload ratio", "ceiling, cores contended", "foreign load (cores)"], rows))
    lines += [
        "",
        f"Ideal offload ratio = (D + S) / max(D, S), D = {data_ms:.0f} ms of data work per batch on one core "
        "(torch's rate with no step), S = the step: torch's one core does both in turn, an offloaded loader lets "
        "the slower of the two set the pace. It is 1 with no step and at most 2 (S = D). Ceiling, cores contended = "
        f"(D + S) / max(D × {contention[0]:.2f}, S × {contention[1]:.2f}): the same with each side slowed by the "
        "factor measured on this machine while the other core is busy (a data sample, a train step; medians of "
        "alternated runs before Ray starts). torch's single core runs uncontended; an offloaded loader keeps both "
        "cores busy, so this is the most any loader can reach here.",
    ]
    return close_report(res, lines, notes, cluster_start_s, start)


if __name__ == "__main__":
    sys.exit(main())
