#!/usr/bin/env python3
"""Offload: the trainer keeps its core; raydl's workers run on another Ray node (another core).

    python benchmarks/bench_offload.py            # full run (about 3-5 minutes with cluster start-up)
    python benchmarks/bench_offload.py --quick    # smoke run (about 1-2 minutes)

The training process (this driver) is pinned to CPU 0 with os.sched_setaffinity before anything
starts a thread, so torch's forked DataLoader workers share that one core with it — exactly
what happens when a trainer's host has no spare CPU. raydl's workers run on a second Ray node
started with `ray start` under `taskset -c 1` (resource {"data": ...}), selected with
ray_remote_args={"resources": {"data": 1}, "num_cpus": ...} ("raydl"), or with no ray_remote_args at
all ("raydl-auto": raydl's own placement, NOTE [ raydl placement ], which must pick the node that
is not the driver's). The head node (GCS, the driver's
raylet and object store) is started under `taskset -c 0`, beside the trainer, as the GPU host's
own raylet would be. Both use cluster/local_cluster.sh's loopback-only start, in their own
directory and ports (RAYDL_CLUSTER_DIR=/tmp/raydl-bench-off, port 6590, dashboard 8590).

Workload: CPU-bound ~1 ms/sample producing 3x64x64 float32, batch 64, 2 workers; optionally a
simulated training step in the driver (a fixed amount of single-threaded matmul work per batch).
Reported: steady-state samples/s (epochs after the first) of torch and the raydl variants, in rotated order, and
the raydl/torch ratio. Every process started here is stopped in a `finally` (bounded waits).
"""

from __future__ import annotations

import os
import sys

if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
    sys.exit("bench_offload.py needs Linux and at least 2 usable CPUs")
TRAINER_CPU, DATA_CPU = sorted(os.sched_getaffinity(0))[:2]
# Before torch (and its thread pools) or Ray (its threads) start: every thread of this process,
# and every process it forks, inherits this single-CPU mask.
os.sched_setaffinity(0, {TRAINER_CPU})

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import warnings  # noqa: E402

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.utils.data  # noqa: E402

import raydl  # noqa: E402

torch.set_num_threads(1)  # one core for the trainer
# torch warns that 2 workers exceed this process's 1 allowed CPU: that is the point of this benchmark.
warnings.filterwarnings("ignore", message="This DataLoader will create")


# The step's matmuls keep their values near 0.5 (gain 1.4 over 192 terms of N(0, 1) weights). A smaller gain
# (0.01, before 2026-11-26) shrank them into denormal floats within ~40 matmuls: x86 cores compute those in
# microcode, ~10x slower, and the contention probe measured that 2.3-2.5x slower beside a busy other core on an
# Intel host (a sound step: 1.00-1.14x), so the step's cost per matmul and its contention depended on how many
# matmuls it ran. The step is torch's matmul on torch's
# one thread (set above): NumPy's BLAS starts a thread per CPU it saw at its import, and when it was imported
# before this process was pinned (`bench_images.py --offload` imports it first) two BLAS threads shared the
# trainer's core, spinning for each other (a 192 x 192 matmul took 1-7 ms instead of 0.12).
STEP_GAIN = 0.1


class TrainStep:
    """A fixed amount of single-threaded work per batch (calibrated once to about `ms` on an idle core)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self.a = torch.from_numpy(np.random.default_rng(0).standard_normal((192, 192)).astype(np.float32))
        self.reps = 0
        if ms > 0:
            self.reps = 1
            for _ in range(5):
                t0 = time.perf_counter()
                self(None)
                per = (time.perf_counter() - t0) / self.reps
                self.reps = max(1, round(ms / 1e3 / per))

    def __call__(self, batch) -> None:
        x = self.a
        for _ in range(self.reps):
            x = torch.tanh(x @ self.a * STEP_GAIN)


def _busy_other_core(code: str):
    """A process pinned to the data core running `code` forever (killed by the caller)."""
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    return subprocess.Popen(
        [
            "taskset",
            "-c",
            str(DATA_CPU),
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {bench_dir!r}); import _common as C\n{code}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def measure_contention(
    iters: int,
    step: TrainStep,
    rounds: int = 3,
    sample: Optional[Callable[[int], Any]] = None,
    sample_code: Optional[str] = None,
    settle_s: float = 0.5,
) -> tuple[float, float]:
    """How much slower each side runs while the other core is busy: (data factor, step factor).

    The ideal offload ratio assumes the two cores do not slow each other. On a VM whose vCPUs
    share a physical core (or its caches and memory bandwidth) they do, and no loader can beat
    the contended ceiling. Measured on the trainer's core, alone and beside a process on the data
    core running the other side's work; median of `rounds` alternations. The data work is
    `sample(i)` (default: this benchmark's CPU-bound sample, `iters` passes) and, on the data core,
    `sample_code` (the same work forever; code run after `import _common as C`); the process on
    the data core gets `settle_s` to start before each timing (longer when its code imports torch).
    """
    if sample is None:

        def sample(i: int) -> Any:
            return C.cpu_sample(i, iters)

    def per_sample() -> float:
        t0 = time.perf_counter()
        for i in range(120):
            sample(i)
        return (time.perf_counter() - t0) / 120

    def per_step() -> float:
        t0 = time.perf_counter()
        for _ in range(6):
            step(None)
        return (time.perf_counter() - t0) / 6

    def beside(code: str, timed) -> float:
        """`timed()` while a process on the data core runs `code`."""
        other = _busy_other_core(code)
        try:
            time.sleep(settle_s)
            return timed()
        finally:
            other.kill()
            other.wait()

    matmul = (  # the train step's work, forever
        "import numpy as np, torch\ntorch.set_num_threads(1)\n"
        "a = torch.from_numpy(np.random.default_rng(0).standard_normal((192, 192)).astype(np.float32))\n"
        f"b = a.clone()\nwhile True: a = torch.tanh(a @ b * {STEP_GAIN})"
    )
    samples = sample_code or f"i = 0\nwhile True:\n    C.cpu_sample(i, {iters}); i += 1"
    data_f, step_f = [], []
    for _ in range(rounds):
        alone_d, alone_s = per_sample(), per_step()
        data_f.append(beside(matmul, per_sample) / alone_d)
        step_f.append(beside(samples, per_step) / alone_s)
    return C.median(data_f), C.median(step_f)


def run_epochs(loader, epochs: int, step: TrainStep) -> dict:
    """Epoch 1 (start-up) then `epochs` measured epochs; the step runs on every batch."""
    t0 = time.perf_counter()
    first_batch = None
    for batch in loader:
        if first_batch is None:
            first_batch = time.perf_counter() - t0
        step(batch)
    t1 = time.perf_counter()
    n = 0
    for _ in range(epochs):
        for batch in loader:
            step(batch)
            n += len(batch[1])
    t2 = time.perf_counter()
    return {"ttfb_s": first_batch, "samples_per_s": n / (t2 - t1), "first_epoch_s": t1 - t0}


def start_cluster(cluster: C.LocalCluster, data_slots: int) -> float:
    """The offload shape: a head node on the trainer's core (GCS, the driver's raylet), a 1-CPU
    {"data": data_slots} node on the data core; connect this driver. Returns the seconds it took."""
    t0 = time.perf_counter()
    cluster.start(0, taskset=str(TRAINER_CPU))  # head only: GCS + the driver's raylet, on the trainer's core
    cluster.add_worker_node(
        num_cpus=1, resources={"data": data_slots}, object_store_bytes=500_000_000, taskset=str(DATA_CPU)
    )
    C.connect_driver(cluster.address)
    import ray

    C.wait_for_nodes(2)
    C.register_by_value()
    took = time.perf_counter() - t0
    C.log(f"cluster up in {took:.1f} s: {[n_['Resources'] for n_ in ray.nodes() if n_['Alive']]}")
    return took


def raydl_placement(loader, driver_node: str) -> tuple[bool, list]:
    """(whether every worker of a started raydl loader is on a node other than the driver's, their CPU affinity)."""
    recs = loader.worker_records
    return (
        all(r.node_id != driver_node for r in recs),
        sorted({c for r in recs for c in psutil.Process(r.pid).cpu_affinity()}),
    )


def children_affinity() -> list:
    """CPU affinity of this process's children (torch's forked workers)."""
    return sorted({c for ch in psutil.Process().children() for c in ch.cpu_affinity()})


def offload_ceilings(data_ms: float, step_ms: float, contention: tuple[float, float]) -> tuple[str, str]:
    """(ideal offload ratio, ceiling with the cores contended), formatted; "—" while D is not known.

    torch's one core does data (D ms/batch) and step S in turn, 1/(D+S); offloaded, the slower of
    the two sets the pace, 1/max(D, S): the ratio is at most (D+S)/max(D, S) <= 2. Contended: each
    side slowed by its factor measured while the other core is busy.
    """
    ideal = f"{(data_ms + step_ms) / max(data_ms, step_ms):.2f}×" if data_ms else "—"
    contended = (
        f"{(data_ms + step_ms) / max(data_ms * contention[0], step_ms * contention[1]):.2f}×"
        if data_ms and step_ms
        else ideal
    )
    return ideal, contended


def epoch_ceiling(data_ms: float, step_ms: float, contention: tuple[float, float], n: int) -> str:
    """The contended ceiling over an epoch of `n` batches, formatted: an offloaded loader waits for the epoch's
    first batch (D') and its last step overlaps nothing (S'); the n - 1 others go at the slower side's pace:
    n (D + S) / (D' + S' + (n - 1) max(D', S')), D' and S' slowed by their contention factors."""
    if not (data_ms and step_ms and n):
        return "—"
    d, s = data_ms * contention[0], step_ms * contention[1]
    return f"{n * (data_ms + step_ms) / (d + s + (n - 1) * max(d, s)):.2f}×"


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
        **C.machine_info(ray_version=importlib.metadata.version("ray")),
        "trainer_cpu": TRAINER_CPU,
        "data_cpu": DATA_CPU,
    }
    res = C.Results("offload", args.quick)
    res.write({"section": "machine", **info, "argv": sys.argv[1:]})
    C.log(C.describe_machine(info))

    iters = C.calibrate_cpu_iters()  # on the trainer's core, before anything else runs on it
    wl = C.Workload("cpu", "CPU-bound ~1 ms/sample, 3×64×64 f32, batch 64", n, 64, "cpu", iters)
    per_sample = C.sample_cost_s(wl.sample)
    wanted = [x.strip() for x in args.train_ms.split(",")]
    if "D" in wanted and wanted[0] != "0":
        p.error("--train-ms: 'D' (a step as long as the data work per batch) needs 0 first, which measures it")
    steps = {float(x): TrainStep(float(x)) for x in wanted if x != "D"}
    C.log(
        f"workload: {iters} numpy passes/sample = {per_sample * 1e3:.2f} ms/sample; train steps "
        + ", ".join(f"{ms:g} ms -> {s.reps} matmuls" for ms, s in steps.items())
    )

    # Measured before any Ray process exists: how much the two cores slow each other.
    contention = measure_contention(iters, TrainStep(64.0), rounds=1 if args.quick else 3)
    C.log(
        f"contention: a data sample takes {contention[0]:.2f}x as long, a train step {contention[1]:.2f}x, "
        "while the other core is busy"
    )
    res.write({"section": "contention", "data_factor": contention[0], "step_factor": contention[1]})

    cluster = C.LocalCluster(args.cluster_dir, args.port, args.dashboard_port, env={"RAYDL_CLUSTER_HEAD_CPUS": "1"})
    rows, notes = [], []
    data_ms = 0.0  # torch's ms of data work per batch on the one core, from the step-0 row
    try:
        cluster_start_s = start_cluster(cluster, W)
        import ray

        driver_node = ray.get_runtime_context().get_node_id()

        def make(name: str):
            ds = C.WorkloadDataset(wl)
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
        C.log(f"placement: {placement}")
        for name in variants:
            if not placement[f"{name}_worker_nodes_differ_from_driver"] or placement[f"{name}_worker_affinity"] != [
                DATA_CPU
            ]:
                notes.append(f"{name}'s workers were NOT where intended: {placement}")

        mon_roots = cluster.pids
        gate = C.QuietGate(
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
                with C.LoadMonitor(extra_roots=mon_roots) as mon:
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
                C.log(
                    f"train {ms:g} ms/batch rep {rep} {name:6s} {r['samples_per_s']:7.0f} samples/s "
                    f"(foreign load {mon.foreign_cores:.2f} cores)"
                )
            t = [r["samples_per_s"] for r in got["torch"]]
            fl = C.median([r["foreign_cores"] for name in names for r in got[name]])
            # The best any offload can do: torch's one core does data (D ms/batch, from torch's rate
            # without a step) and step S in turn, 1/(D+S); offloaded, the slower of the two sets
            # the pace, 1/max(D, S). So the ratio is at most (D+S)/max(D, S) <= 2.
            if ms == 0:
                data_ms = 1e3 * wl.batch_size / C.median(t)
                if "D" in wanted:  # the balanced case: a step as long as torch's data work per batch
                    queue.append((round(data_ms), TrainStep(round(data_ms))))
                    C.log(f"D = {data_ms:.0f} ms of data work per batch: adding a {round(data_ms)} ms step")
            ceiling, contended = offload_ceilings(data_ms, ms, contention)
            row = [f"{ms:g}", f"{C.median(t):,.0f} ({min(t):,.0f}–{max(t):,.0f})"]
            for name in variants:
                d = [r["samples_per_s"] for r in got[name]]
                paired, cells = paired_cells(d, t)
                row += cells
                res.write(
                    {
                        "section": "offload_summary",
                        "loader": name,
                        "train_ms": ms,
                        "torch_median": C.median(t),
                        "raydl_median": C.median(d),
                        "ratio_paired_median": C.median(paired),
                        "ratio_paired_all": paired,
                        "foreign_cores_median": fl,
                    }
                )
            rows.append(row + [ceiling, contended, f"{fl:.2f}"])
    finally:
        C.disconnect_and_stop(cluster)

    lines = [
        f"## raydl offload benchmark ({'quick' if args.quick else 'full'} run)",
        "",
        C.describe_machine(info),
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
    lines.append(C.md_table(header + ["ideal offload ratio", "ceiling, cores contended", "foreign load (cores)"], rows))
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


def paired_cells(rates: list, torch_rates: list) -> tuple[list, list]:
    """Per-repetition ratios to torch (same repetition: measured close together) and the two table cells."""
    paired = [r / t for r, t in zip(rates, torch_rates)]
    return paired, [
        f"{C.median(rates):,.0f} ({min(rates):,.0f}–{max(rates):,.0f})",
        f"{C.median(paired):.2f}× ({min(paired):.2f}–{max(paired):.2f})",
    ]


def rotation(names: list, reps: int):
    """(repetition, loader) pairs: each repetition runs every loader, starting one further along each time."""
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            yield rep, name


def close_report(res, lines: list, notes: list, cluster_start_s: float, start: float) -> int:
    """The report's notes, then the results written (Markdown, JSON lines) with the cluster's start-up time."""
    for note in notes:
        lines += ["", f"Note: {note}"]
    res.finish_cluster_report(lines, cluster_start_s, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
