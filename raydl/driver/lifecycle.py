"""What the three epoch iterators share: their states (`IterState`) and what the loader calls on them (`EpochIter`)."""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Iterator, Optional, Protocol

__all__ = ["Checkpoint", "EpochIter", "IterState"]


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
