"""What the three epoch iterators share: their states (`IterState`) and what the loader calls on them (`EpochIter`)."""

from __future__ import annotations

import weakref
from enum import IntEnum
from typing import Any, Iterator, Optional, Protocol

__all__ = ["Checkpoint", "EpochIter", "IterState", "StartHold"]


class IterState(IntEnum):
    """Lifecycle of an iterator; it only moves up, except `next_epoch` (persistent workers) back to RUNNING."""

    RUNNING = 0
    EXHAUSTED = 1
    SHUT_DOWN = 2


class Checkpoint(Protocol):
    """What `DataLoader.state_dict()` reads: an epoch's record, kept by the loader apart from its iterator (a
    dropped iterator is released, its record stays; NOTE [ raydl checkpoint ] in driver/state/checkpoint.py)."""

    @property
    def replay(self) -> int:
        """Batches a resumed iterator hands out again and drops (a stream that cannot be positioned)."""
        ...

    def state_dict(self) -> dict: ...

    def call_when_started(self, callback: Any) -> bool:
        """Call `callback()()` once every worker's start snapshot is in; False when they all are already."""
        ...


class StartHold:
    """The loader's hold on its newest iterator until every worker's start snapshot is in.

    NOTE [ raydl start hold ]: a state taken right after `iter()`, before any batch, reports each worker's dataset
    state as its `__iter__` (or a loaded state) left it, as StatefulDataLoader's does; only the workers know it, and
    they report it when they have started (their configure() reply). torchdata's loader keeps its last iterator, so
    `iter(loader); loader.state_dict()` still finds the workers; raydl's loader keeps only an iterator's record, so
    that a dropped iterator releases its workers at once. In between: the loader keeps the newest iterator only
    while some of its workers' start snapshots are missing (a stateful or iterable dataset, or a loaded state:
    for a map-style dataset without state the driver knows them), and lets go of it once they are in, at the
    next `iter()` or at `shutdown()`. A dropped iterator whose workers are still starting is so released once a
    `state_dict()` has waited for them (bounded by `ray_startup_timeout_s`), or at the loader's next `iter()`."""

    __slots__ = ("it", "__weakref__")

    def __init__(self, it: Any) -> None:
        self.it = it

    @classmethod
    def of(cls, it: Any) -> Optional[StartHold]:
        """A hold on `it` while its record waits for start snapshots; None when it waits for none."""
        hold = cls(it)
        return hold if it.checkpoint.call_when_started(weakref.WeakMethod(hold.release)) else None

    def release(self) -> None:
        self.it = None


class EpochIter(Protocol):
    """What `DataLoader` calls on an epoch's iterator (driver/iter.py, driver/coldstart/iter.py,
    driver/inprocess.py), and nothing else; it reads no loader: it was given a `LoaderSpec` (driver/spec.py)."""

    stats_recorder: Any  # NOTE [ raydl stats ]: what `loader.stats()` reads (None without Ray workers)

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def __len__(self) -> int: ...

    @property
    def checkpoint(self) -> Checkpoint: ...

    @property
    def reusable(self) -> bool:
        """Whether a persistent loader's next epoch may go on with this iterator (`next_epoch`)."""
        ...

    @property
    def worker_records(self) -> list: ...

    def next_epoch(self, len_called: Optional[int]) -> None:
        """Persistent workers: the next epoch on the same workers; `len_called`: the loader's
        `_IterableDataset_len_called` now."""
        ...

    def resize(self, num_workers: int) -> None:
        """`set_num_workers`: the pool's new size, now (NOTE [ raydl elastic pool ] in cluster/elastic.py)."""
        ...

    def shutdown(self) -> None: ...
