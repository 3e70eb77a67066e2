"""Datasets for the elastic-pool tests (module level, so Ray actors unpickle them by reference)."""

from __future__ import annotations

import random
import time

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info


class _DelayedDataset(Dataset):
    """n items, each taking `delay_s` to make."""

    def __init__(self, n: int, delay_s: float = 0.0) -> None:
        self.n = n
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n


class SlowRandomDataset(_DelayedDataset):
    """Item i sleeps `delay_s`, then draws from random, torch and NumPy: its content depends on the worker's RNG state."""

    def __getitem__(self, i):
        if self.delay_s:
            time.sleep(self.delay_s)
        return {"i": i, "torch": torch.rand(2), "numpy": np.random.rand(2), "random": random.random()}


class WorkerInfoDataset(_DelayedDataset):
    """Item i is [i, worker id, the worker's num_workers]."""

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        info = get_worker_info()
        return torch.tensor([i, info.id, info.num_workers])
