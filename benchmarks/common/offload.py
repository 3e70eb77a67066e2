"""The offload shape: the trainer keeps one core, the loader's workers run on a Ray node on another.

Importing this module pins the process to the first of its CPUs (the trainer's, `TRAINER_CPU`)
before torch starts its threads, so import it before torch; the second (`DATA_CPU`) is the data
node's. Every thread of the process, and every process it forks, inherits the single-CPU mask, as
on a trainer's host with no spare CPU. Then torch runs on one thread. Shared by bench_offload.py
(a synthetic workload) and bench_images_offload.py (the JPEG pipeline): the train step, the
contention probe and the ceilings, the cluster, placement checks, and the report's cells.
"""

from __future__ import annotations

import os
import sys

if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
    sys.exit("the offload benchmarks need Linux and at least 2 usable CPUs")
TRAINER_CPU, DATA_CPU = sorted(os.sched_getaffinity(0))[:2]
# Before torch (and its thread pools) or Ray (its threads) start: every thread of this process,
# and every process it forks, inherits this single-CPU mask.
os.sched_setaffinity(0, {TRAINER_CPU})

import subprocess  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import REPO  # noqa: E402
from benchmarks.common.clusters import LocalCluster, connect_driver, wait_for_nodes  # noqa: E402
from benchmarks.common.results import log, median  # noqa: E402
from benchmarks.common.workloads import cpu_sample, register_by_value  # noqa: E402

torch.set_num_threads(1)  # one core for the trainer
# torch warns that 2 workers exceed this process's 1 allowed CPU: that is the point of the offload shape.
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
    return subprocess.Popen(
        ["taskset", "-c", str(DATA_CPU), sys.executable, "-c", f"from benchmarks.common import workloads as C\n{code}"],
        cwd=REPO,
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
    `sample_code` (the same work forever; code run after `from benchmarks.common import workloads as C`); the process on
    the data core gets `settle_s` to start before each timing (longer when its code imports torch).
    """
    if sample is None:

        def sample(i: int) -> Any:
            return cpu_sample(i, iters)

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
    samples = sample_code or f"i = 0\nwhile True:\n    C.cpu_sample(i, {iters}); i += 1"  # C: the child's
    data_f, step_f = [], []
    for _ in range(rounds):
        alone_d, alone_s = per_sample(), per_step()
        data_f.append(beside(matmul, per_sample) / alone_d)
        step_f.append(beside(samples, per_step) / alone_s)
    return median(data_f), median(step_f)


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


def start_cluster(cluster: LocalCluster, data_slots: int) -> float:
    """The offload shape: a head node on the trainer's core (GCS, the driver's raylet), a 1-CPU
    {"data": data_slots} node on the data core; connect this driver. Returns the seconds it took."""
    t0 = time.perf_counter()
    cluster.start(0, taskset=str(TRAINER_CPU))  # head only: GCS + the driver's raylet, on the trainer's core
    cluster.add_worker_node(
        num_cpus=1, resources={"data": data_slots}, object_store_bytes=500_000_000, taskset=str(DATA_CPU)
    )
    connect_driver(cluster.address)
    import ray

    wait_for_nodes(2)
    register_by_value()
    took = time.perf_counter() - t0
    log(f"cluster up in {took:.1f} s: {[n_['Resources'] for n_ in ray.nodes() if n_['Alive']]}")
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


def paired_cells(rates: list, torch_rates: list) -> tuple[list, list]:
    """Per-repetition ratios to torch (same repetition: measured close together) and the two table cells."""
    paired = [r / t for r, t in zip(rates, torch_rates)]
    return paired, [
        f"{median(rates):,.0f} ({min(rates):,.0f}–{max(rates):,.0f})",
        f"{median(paired):.2f}× ({min(paired):.2f}–{max(paired):.2f})",
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
