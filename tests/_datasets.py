"""Datasets, collate functions and hooks shared by the tests.

They live at module level in an importable module so that both torch's worker processes and
raydl's Ray actors can unpickle them by reference (closures and lambdas are covered by tests
of their own).
"""

from __future__ import annotations

import random
import threading
import time
from collections import namedtuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Point = namedtuple("Point", ["x", "label"])


class RangeDataset(Dataset):
    """Item i is the int64 tensor [i]."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


class DictDataset(RangeDataset):
    """Item i is a dict of a float tensor, an int, a str and a nested list."""

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "id": i, "name": f"s{i}", "pair": [i, -i]}


class NamedTupleDataset(RangeDataset):
    def __getitem__(self, i):
        return Point(x=np.full((3,), i, dtype=np.float32), label=i % 3)


class StrDataset(RangeDataset):
    def __getitem__(self, i):
        return f"item-{i}"


class GetItemsDataset(RangeDataset):
    """Defines __getitems__, which torch's fetcher prefers for batches."""

    def __getitems__(self, indices):
        return [torch.tensor([i * 10]) for i in indices]


class RandomAugmentDataset(RangeDataset):
    """Each item draws from torch, numpy and random: parity here proves the workers are seeded as torch's."""

    def __getitem__(self, i):
        info = get_worker_info()
        wid = -1 if info is None else info.id
        return {
            "i": i,
            "torch": torch.rand(2),
            "numpy": np.random.rand(2),
            "random": random.random(),
            "worker": wid,
            "seed": -1 if info is None else info.seed,
        }


class RaisingDataset(RangeDataset):
    """Raises ValueError for one index."""

    def __init__(self, n: int, bad_index: int) -> None:
        super().__init__(n)
        self.bad_index = bad_index

    def __getitem__(self, i):
        if i == self.bad_index:
            raise ValueError(f"bad index {i}")
        return torch.tensor([i])


class KeyErrorDataset(RangeDataset):
    def __getitem__(self, i):
        if i == 3:
            raise KeyError("missing-key")
        return torch.tensor([i])


class TwoArgError(Exception):
    def __init__(self, a, b):
        super().__init__(a, b)


class TwoArgErrorDataset(RangeDataset):
    def __getitem__(self, i):
        if i == 2:
            raise TwoArgError(1, 2)
        return torch.tensor([i])


class SlowDataset(RangeDataset):
    """Item i sleeps delays_s.get(i, 0) seconds first: forces out-of-order completion or a timeout."""

    def __init__(self, n: int, delays_s: dict) -> None:
        super().__init__(n)
        self.delays_s = dict(delays_s)

    def __getitem__(self, i):
        time.sleep(self.delays_s.get(i, 0.0))
        return torch.tensor([i])


class PidDataset(RangeDataset):
    def __getitem__(self, i):
        import os

        return torch.tensor([i, os.getpid()])


class LockedDataset(RangeDataset):
    """Holds a threading.Lock: cannot be pickled."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = threading.Lock()


class ShardedIterable(IterableDataset):
    """Yields range(start, end), split between workers with torch's get_worker_info()."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            lo, hi = self.start, self.end
        else:
            per = int(np.ceil((self.end - self.start) / info.num_workers))
            lo = self.start + info.id * per
            hi = min(lo + per, self.end)
        return iter(torch.tensor([v]) for v in range(lo, hi))


class UnevenIterable(IterableDataset):
    """Worker w yields lengths[w] items (w*100 + k); in the driver, all of them in worker order."""

    def __init__(self, lengths) -> None:
        self.lengths = list(lengths)

    def _items(self, wid):
        return [wid * 100 + k for k in range(self.lengths[wid])]

    def __iter__(self):
        info = get_worker_info()
        ids = range(len(self.lengths)) if info is None else [info.id]
        return iter([v for w in ids for v in self._items(w)])


class UnshardedIterable(IterableDataset):
    """Every worker yields the whole range (duplicates, as torch documents)."""

    def __init__(self, n: int, reported_len: int | None = None) -> None:
        self.n = n
        self.reported_len = reported_len

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.reported_len if self.reported_len is not None else self.n


class RaisingIterable(IterableDataset):
    def __iter__(self):
        yield 0
        yield 1
        raise ValueError("stream broke")


class InitSensitiveDataset(RangeDataset):
    """Returns the value worker_init_fn stored on this worker's copy of the dataset."""

    offset = 0

    def __getitem__(self, i):
        return torch.tensor([i + self.offset])


def set_offset_init_fn(worker_id: int) -> None:
    """worker_init_fn: gives each worker's dataset copy an offset of 1000 * (worker_id + 1)."""
    info = get_worker_info()
    info.dataset.offset = 1000 * (worker_id + 1)


def failing_init_fn(worker_id: int) -> None:
    raise RuntimeError(f"init failed in worker {worker_id}")


def exiting_init_fn(worker_id: int) -> None:
    """worker_init_fn whose process exits (a native crash in start-up code)."""
    import os

    os._exit(4)


def sum_collate(batch):
    """A custom collate_fn: the sum of the batch's first elements, and its length."""
    return {"sum": sum(int(b[0]) for b in batch), "n": len(batch)}


class ArrayDataset(RangeDataset):
    """Holds a NumPy array; item i reports whether this worker's copy of it is writable."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.array = np.arange(n * 1000, dtype=np.float32)

    def __getitem__(self, i):
        return torch.tensor([i, int(self.array.flags.writeable)])


class ExitOnceDataset(RangeDataset):
    """The worker process exits (os._exit) on `bad_index`, the first time only (a marker file remembers)."""

    def __init__(self, n: int, bad_index: int, marker: str, delay_s: float = 0.0) -> None:
        super().__init__(n)
        self.bad_index, self.marker, self.delay_s = bad_index, marker, delay_s

    def __getitem__(self, i):
        import os

        time.sleep(self.delay_s)
        if i == self.bad_index and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return torch.tensor([i])


class PoisonDataset(RangeDataset):
    """The worker process exits every time it reaches `bad_index`."""

    def __init__(self, n: int, bad_index: int) -> None:
        super().__init__(n)
        self.bad_index = bad_index

    def __getitem__(self, i):
        import os

        if i == self.bad_index:
            os._exit(3)
        return torch.tensor([i])


class ListDataset(Dataset):
    """A plain list as a dataset: an out-of-range index raises the list's own IndexError."""

    def __init__(self, n: int) -> None:
        self.items = list(range(n))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class BigSampleDataset(RangeDataset):
    """Item i is a float32 tensor of `mb` megabytes filled with i (for object-store pressure)."""

    def __init__(self, n: int, mb: int) -> None:
        super().__init__(n)
        self.numel = mb * 1024 * 1024 // 4

    def __getitem__(self, i):
        return torch.full((self.numel,), float(i))


class ImageDataset(RangeDataset):
    """Deterministic 'images' big enough to travel zero-copy: uint8, float16, bool, int64 and bfloat16 fields."""

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {
            "image": torch.randint(0, 256, (3, 64, 64), generator=g, dtype=torch.uint8),
            "half": torch.rand(64, 64, generator=g).half(),
            "mask": torch.rand(64, 64, generator=g) > 0.5,
            "ids": torch.arange(i, i + 4096),
            "bf16": torch.rand(128, 128, generator=g).bfloat16(),
            "label": i % 10,
        }


class SleepyDataset(RangeDataset):
    """Each sample waits `sleep_s` (I/O stand-in) and records the thread that fetched it."""

    def __init__(self, n: int, sleep_s: float) -> None:
        super().__init__(n)
        self.sleep_s = sleep_s

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return torch.tensor([i, threading.get_ident() % 100000])


class TaggedShards(IterableDataset):
    """Worker w's replica yields (w, k) for k < n, sleeping `delay_s` first on the (w, k) pairs in `slow`.

    In the driver (no worker info) it yields worker 0's stream.
    """

    def __init__(self, n: int, slow=(), delay_s: float = 0.05) -> None:
        self.n, self.slow, self.delay_s = n, {tuple(s) for s in slow}, delay_s

    def __iter__(self):
        info = get_worker_info()
        w = 0 if info is None else info.id
        for k in range(self.n):
            if (w, k) in self.slow:
                time.sleep(self.delay_s)
            yield (w, k)


class WorkerTaggedDataset(RangeDataset):
    """Item i is (id of the worker that made it, i); the indices in `delays_s` sleep first."""

    def __init__(self, n: int, delays_s: dict) -> None:
        super().__init__(n)
        self.delays_s = dict(delays_s)

    def __getitem__(self, i):
        time.sleep(self.delays_s.get(i, 0.0))
        info = get_worker_info()
        return (-1 if info is None else info.id, i)


def note_init_thread(worker_id: int) -> None:
    """A worker_init_fn that records whether it ran on its process's main thread (ThreadReportDataset reports it)."""
    info = torch.utils.data.get_worker_info()
    info.dataset.init_on_main_thread = threading.current_thread() is threading.main_thread()


class ThreadReportDataset(RangeDataset):
    """Item i is [i, made on the main thread?, worker_init_fn ran on the main thread? (-1: it did not run)]."""

    init_on_main_thread: bool | None = None

    def __getitem__(self, i):
        init = -1 if self.init_on_main_thread is None else int(self.init_on_main_thread)
        return torch.tensor([i, int(threading.current_thread() is threading.main_thread()), init])


class LockAtDataset(RangeDataset):
    """Item i is (i, 0), except item `at`, which holds a threading.Lock (no pickle can carry it)."""

    def __init__(self, n: int, at: int) -> None:
        super().__init__(n)
        self.at = at

    def __getitem__(self, i):
        return (i, threading.Lock() if i == self.at else 0)
