"""The synthetic workloads: the very same per-sample code for torch's workers, raydl's actors and Ray Data's tasks.

`register_by_value()` makes Ray's cloudpickle ship this module by value, so Ray's worker processes
need not import it. Of the package it imports only `percentile`, which the calibration uses in the
driver and no shipped object refers to.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from benchmarks.common.results import percentile


def calibrate_cpu_iters(target_s: float = 1e-3) -> int:
    """Number of numpy passes that make `cpu_sample` take about `target_s` on an uncontended core.

    Uses the 10th percentile of the timings, not the median: on a shared machine a sample is often
    preempted, and calibrating on contended timings would make the workload lighter than intended.
    """
    iters = 4
    for _ in range(6):
        ts = []
        for i in range(40):
            t0 = time.perf_counter()
            cpu_sample(i, iters)
            ts.append(time.perf_counter() - t0)
        per = percentile(ts, 10)
        iters = max(1, round(iters * target_s / per))
    return iters


def sample_cost_s(fn: Callable[[int], Any], n: int = 60) -> float:
    """Uncontended cost of one sample (10th percentile of `n` timings)."""
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t0)
    return percentile(ts, 10)


def cpu_sample(i: int, iters: int) -> np.ndarray:
    """~1 ms of Python + numpy work (with the calibrated `iters`) producing a 3x64x64 float32 image."""
    rng = np.random.default_rng(i)
    x = rng.standard_normal((3, 64, 64), dtype=np.float32)
    acc = 0.0
    for k in range(iters):
        x = np.tanh(x * 1.01 + 0.001 * k)
        acc += float(x[0, 0, k % 64])  # a little per-iteration Python work, as a decoder would have
    x[0, 0, 0] = acc
    return x


def trivial_sample(i: int) -> np.ndarray:
    return np.full((16,), i, dtype=np.float32)


def large_sample(i: int) -> np.ndarray:
    return np.full((3, 224, 224), i % 251, dtype=np.uint8)


IO_SLEEP_S = 0.004


def io_sample(i: int) -> np.ndarray:
    time.sleep(IO_SLEEP_S)  # stands in for a remote storage read
    return np.full((3, 64, 64), i % 7, dtype=np.float32)


def small_sample(i: int) -> np.ndarray:
    return np.full((3, 64, 64), i % 7, dtype=np.float32)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    n: int
    batch_size: int
    kind: str  # cpu | trivial | large | io | small
    cpu_iters: int = 0

    def sample(self, i: int) -> np.ndarray:
        if self.kind == "cpu":
            return cpu_sample(i, self.cpu_iters)
        if self.kind == "trivial":
            return trivial_sample(i)
        if self.kind == "large":
            return large_sample(i)
        if self.kind == "io":
            return io_sample(i)
        if self.kind == "small":
            return small_sample(i)
        raise ValueError(self.kind)


class WorkloadDataset(Dataset):
    """Map-style dataset: sample i -> (tensor, label i). The same code for torch, raydl and Ray Data."""

    def __init__(self, workload: Workload, n: Optional[int] = None) -> None:
        self.workload = workload
        self.n = workload.n if n is None else n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.from_numpy(self.workload.sample(int(i))), int(i)


class RayDataMap:
    """Ray Data `map_batches` function doing the same per-sample work as WorkloadDataset."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload

    def __call__(self, batch: dict) -> dict:
        ids = batch["id"]
        xs = [self.workload.sample(int(i)) for i in ids]
        return {"x": np.stack(xs), "y": np.asarray(ids, dtype=np.int64)}


def register_by_value() -> None:
    """Ship this module by value in Ray's pickles (what a Ray worker runs need not be importable there)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def batch_samples(batch: Any) -> int:
    """Number of samples in a batch from any of the loaders (tuple/list or Ray Data dict)."""
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)):
        return len(batch[1])
    return len(batch)
