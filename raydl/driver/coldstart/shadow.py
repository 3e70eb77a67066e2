"""`ShadowWorker`: worker `i`'s batches made in the driver, exactly as the worker actor would make them.

Used by the opt-in in-process cold start (`ray_cold_start="in_process"`, NOTE [ raydl cold start ]
in driver/coldstart/iter.py; the default forks start-up processes instead) while Ray and the actors
come up. A shadow holds what the actor would hold after the same batches: its own copy of the
dataset (and of collate_fn and worker_init_fn, copied together as one payload, so a
worker_init_fn bound to the dataset acts on the copy), and its own `random`, torch and NumPy
streams, seeded as torch seeds worker `i` (NOTE [ raydl seeding ] in worker/actor.py).
`worker_init_fn` runs once, on the copy, with `get_worker_info()` answering as in worker `i`.

Around each of its steps the driver's own state is saved and put back: the three global
generators, torch's worker-info global (None in the driver) and torch's thread count (a worker
runs with one thread: ops whose result depends on the thread count give the worker's result).
torch's CPU generator is seeded directly, never with `torch.manual_seed`, which would also queue
a lazy seeding of the driver's CUDA generators. What user code does to other process-wide state
(environment variables, open files, module globals) stays in the driver: the default cold start
keeps all user code out of the trainer's process.

The copy is a `copy.deepcopy` (what pickling gives the worker: the same `__reduce_ex__` /
`__getstate__` state, and it also copies classes defined in a function, which `pickle` refuses).
Large arrays are not copied but shared with the driver's dataset (torch tensors and NumPy arrays
of `_SHARE_MIN_BYTES` or more found in the payload's first levels, and immutable Arrow data): a
dataset that writes into its own large arrays in `__getitem__` would then write into the
driver's; turn the cold start off for such a dataset.
"""

from __future__ import annotations

import copy
import random
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.utils.data._utils.worker as _torch_worker
from torch.utils.data import default_collate

from ..._measures import batch_nbytes
from ..._thread_random import only_this_thread_draws
from ...worker.actor import BatchMeta, numpy_seed_state
from ...worker.collate import private_memory_collate
from ...worker.fetch import MapFetcher
from ...worker.seeding import _SavedRNG
from ...worker.state import RngTracker, make_worker_snapshot

__all__ = ["ShadowWorker", "private_copy"]

_SHARE_MIN_BYTES = 1 << 20
_SHARE_DEPTH = 4


def _shared_leaves(obj: Any, memo: dict, depth: int = 0) -> None:
    """Put large arrays and Arrow data found under `obj` into deepcopy's `memo`, so the copy shares them."""
    if id(obj) in memo or depth > _SHARE_DEPTH:
        return
    if isinstance(obj, torch.Tensor):
        if obj.nbytes >= _SHARE_MIN_BYTES:
            memo[id(obj)] = obj
        return
    if isinstance(obj, np.ndarray):
        if obj.nbytes >= _SHARE_MIN_BYTES:
            memo[id(obj)] = obj
        return
    module = type(obj).__module__ or ""
    if module.startswith("pyarrow") or module == "datasets.table":  # immutable tables
        memo[id(obj)] = obj
        return
    if isinstance(obj, dict):
        children: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    else:
        children = getattr(obj, "__dict__", {}).values()
    for child in children:
        _shared_leaves(child, memo, depth + 1)


def private_copy(obj: Any) -> Any:
    """A worker's private copy of `obj` (its large arrays shared with the original; see the module's docstring)."""
    memo: dict = {}
    _shared_leaves(obj, memo)
    return copy.deepcopy(obj, memo)


class _DriverState:
    """The driver's generators, worker-info global and thread count, saved for one shadow step and put back."""

    def __init__(self) -> None:
        self._rng = _SavedRNG()
        self._info = _torch_worker._worker_info
        self._threads = torch.get_num_threads()

    def restore(self) -> None:
        self._rng.restore()
        _torch_worker._worker_info = self._info
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)


class ShadowWorker:
    """Worker `worker_id` of `num_workers` for an iterator with `base_seed`, run in the driver (see the module)."""

    def __init__(
        self,
        worker_id: int,
        num_workers: int,
        base_seed: int,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Callable,
        worker_init_fn: Optional[Callable[[int], None]],
        threads: int = 1,
    ) -> None:
        self.worker_id = worker_id
        self.batches = 0  # batches made by this shadow, over all epochs
        self._rng = RngTracker()  # what moved since its last batch, as the worker reports it
        driver = _DriverState()
        try:
            dataset, collate, init_fn = private_copy((dataset, collate_fn, worker_init_fn))
            self._init(worker_id, num_workers, base_seed, dataset, auto_collation, collate, init_fn, threads)
        finally:
            driver.restore()

    def _init(
        self,
        worker_id: int,
        num_workers: int,
        base_seed: int,
        dataset: Any,
        auto_collation: bool,
        collate: Callable,
        init_fn: Optional[Callable[[int], None]],
        threads: int,
    ) -> None:
        seed = base_seed + worker_id
        with only_this_thread_draws():  # NOTE [ raydl random and threads ]
            self.dataset = dataset
            if collate is default_collate:  # the worker's collate (worker/actor.py)
                collate = private_memory_collate
            self._fetcher = MapFetcher(dataset, auto_collation, collate, threads)
            self._info = _torch_worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
            # As Worker.configure: seed, worker info, then worker_init_fn (CPU generator only, see the module).
            random.seed(seed)
            torch.default_generator.manual_seed(seed)
            np.random.seed(numpy_seed_state(base_seed, worker_id))
            self._enter()
            try:
                if init_fn is not None:
                    init_fn(worker_id)
            finally:
                self._leave()

    def _enter(self) -> None:
        _torch_worker._worker_info = self._info
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)

    def _leave(self) -> None:
        """Keep this shadow's generator states (the worker's, as of its last step)."""
        self._states = (random.getstate(), torch.default_generator.get_state(), np.random.get_state())

    def _load(self) -> None:
        py, th, npy = self._states
        random.setstate(py)
        torch.default_generator.set_state(th)
        np.random.set_state(npy)

    def fetch(self, idx: int, index: Any) -> tuple[Any, BatchMeta]:
        """Task `idx`: the batch for `index` as the worker would make it next, and the `BatchMeta` the worker
        would report with it (its dataset's state, the generators that moved); the driver's state is untouched."""
        started_s, t0, c0 = time.time(), time.perf_counter(), time.process_time()
        driver = _DriverState()
        try:
            with only_this_thread_draws():  # NOTE [ raydl random and threads ]
                self._load()
                self._enter()
                try:
                    batch = self._fetcher.fetch(index)
                finally:
                    self.batches += 1
                    rng = self._rng.changed()  # while this shadow's generators are the live ones
                    self._leave()
        finally:
            driver.restore()
        state = make_worker_snapshot(self.worker_id, self._fetcher, self.dataset, False)
        samples = len(index) if self._fetcher.auto_collation else 1
        return batch, BatchMeta(
            self.worker_id,
            idx,
            started_s,
            time.perf_counter() - t0,
            samples,
            batch_nbytes(batch),
            time.process_time() - c0,
            state=state,
            rng=rng,
        )
