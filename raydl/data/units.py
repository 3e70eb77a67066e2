"""What the datasets streamed through the node cache share: samples laid out in units, and the order over them.

A unit is what the node cache fetches and holds (a Parquet row group, a run of a tar shard's samples): sample `i`
lives in unit `u` where `_starts[u] <= i < _starts[u + 1]`. `shuffle=True` gives the dataset's own sampler over
`shuffled_order` (NOTE [ raydl unit order ] in data/unit_order.py), which the cache is told ahead of
time (`raydl_order_ahead`). A subclass sets `_starts`, `_rows`, `_unit_bytes`, `shuffle_window` and `_WHO`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .unit_order import ParquetDistributedSampler, ParquetShuffleSampler, _ShuffleIter, shard_aware_order, slotted_order

__all__ = ["KeptUnits", "UnitDataset"]


class KeptUnits:
    """The units one process keeps between batches (decoded row groups, or a unit's bytes), the least recently used
    let go first once they pass a byte limit, one always kept. Each process starts with none: it pickles empty."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # also guards the subclass's bytes read ahead (`UnitDataset._read`)
        self._units: OrderedDict = OrderedDict()  # unit -> (what is kept, its bytes)
        self._nbytes = 0

    def split(self, units: Iterable[int]) -> tuple[dict, list]:
        """({unit: what is kept} for the units kept, now the most recent; [the others], in their order)."""
        found, missing = {}, []
        with self.lock:
            for u in units:
                got = self._units.get(u)
                if got is None:
                    missing.append(u)
                else:
                    self._units.move_to_end(u)
                    found[u] = got[0]
        return found, missing

    def keys(self) -> list:
        with self.lock:
            return list(self._units)

    def put(self, unit: int, value: Any, nbytes: int, limit: int) -> None:
        """Keep `value` (`nbytes`) for `unit`; then let the oldest go while more than `limit` bytes are kept."""
        with self.lock:
            old = self._units.pop(unit, None)
            self._nbytes += nbytes - (old[1] if old is not None else 0)
            self._units[unit] = (value, nbytes)
            while self._nbytes > limit and len(self._units) > 1:
                _, (_, n) = self._units.popitem(last=False)
                self._nbytes -= n

    def __len__(self) -> int:
        return len(self._units)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]


class UnitDataset(Dataset):
    """A map-style dataset whose samples lie in units that a node cache fetches (see the module's docstring)."""

    _WHO = "UnitDataset"
    _starts: np.ndarray
    _rows: np.ndarray
    _unit_bytes: np.ndarray
    shuffle_window: int
    node_slots: Optional[int] = 1  # set by `_check_slots`; None: one slot a node (NOTE [ raydl node slots ])
    _kept: KeptUnits  # what this process keeps (the subclass decides what: decoded, or bytes)

    @property
    def num_units(self) -> int:
        """The units the cache holds."""
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        """Bytes of every unit: what one epoch fetches at least."""
        return int(self._unit_bytes.sum())

    @property
    def unit_nbytes(self) -> np.ndarray:
        """Bytes of each unit: what the node cache holds for it."""
        return self._unit_bytes

    def __len__(self) -> int:
        return int(self._starts[-1])

    def shuffled_order(self, seed: int) -> np.ndarray:
        """The epoch's order for `seed` (NOTE [ raydl unit order ])."""
        return shard_aware_order(self._starts, self._rows, self.shuffle_window, seed)

    def slotted_order(self, seed: int, batch_size: int, slots: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's order over the node slots for batches of `batch_size`, and each batch's slot (NOTE [ raydl
        unit order ]): the `node_slots` given, each a share of the window, or (the default) `slots` slots, one a
        node, each a whole window."""
        if self.node_slots is not None:
            return slotted_order(self._starts, self._rows, self.shuffle_window, self.node_slots, batch_size, seed)
        n = max(1, int(slots or 1))
        return slotted_order(self._starts, self._rows, self.shuffle_window, n, batch_size, seed, self.shuffle_window)

    def _check_slots(self, slots: Optional[int]) -> Optional[int]:
        """`node_slots` as given (at most `shuffle_window`), or None: one slot a node (NOTE [ raydl node slots ])."""
        if slots is None:
            return None
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"{self._WHO}: node_slots should be a positive int, got {slots!r}")
        if slots > self.shuffle_window:
            raise ValueError(
                f"{self._WHO}: node_slots={slots} is more than shuffle_window={self.shuffle_window}: each slot shuffles "
                f"at least one unit of the window at a time. Lower node_slots to {self.shuffle_window} or raise "
                "shuffle_window (and cache_limit: one node making every slot's batches holds the whole window)."
            )
        return slots

    def _metadata_clause(self, meta: int) -> str:
        """For an error about `cache_limit`: how much of it the folder's metadata already holds (none: "")."""
        return f" ({meta} bytes of it hold the metadata in {self.cache_dir}: tar-index/, file-listing/)" if meta else ""

    @property
    def units_in_use(self) -> int:
        """Units one worker reads from at once: the window, and over node slots one more a slot (a batch that
        straddles two of its windows), since the slots take turns batch by batch (NOTE [ raydl node slots ]); with
        one slot a node, a node's workers read its slot's window and one more."""
        if self.node_slots is None:
            return self.shuffle_window + 1
        return self.shuffle_window + (self.node_slots if self.node_slots > 1 else 0)

    @property
    def _reads_ahead(self) -> bool:
        """A worker's call to its cache also takes the units its node's plan uses next (NOTE [ raydl read ahead ]):
        over node slots, where a batch reads one or two units."""
        return self.node_slots is None or self.node_slots > 1

    def raydl_read_ahead(self, batches: list) -> None:
        """A worker is about to make these batches (its call's, in order): the units they read that this process does
        not keep, in one read from the node cache, as many as it keeps (`units_in_use`). Over node slots a batch
        reads one or two units, so read one batch at a time they would cost a cache round trip each."""
        try:
            idx = [np.asarray(b, dtype=np.int64).reshape(-1) for b in batches]
        except (TypeError, ValueError):
            return  # indices NumPy cannot read: each batch reads its own (and names what is wrong)
        if not idx:
            return
        flat = np.concatenate(idx)
        n = len(self)
        if not len(flat) or flat.min() < -n or flat.max() >= n:
            return
        units = list(dict.fromkeys(self.units_of(np.where(flat < 0, flat + n, flat)).tolist()))
        self._read_units(units[: self.units_in_use])

    def _read_units(self, units: list) -> None:
        """Bring these units into this process (what a subclass keeps decoded or as bytes)."""

    def _read(self, missing: list, kept: Sequence[int]) -> dict:
        """{unit: its bytes} for these units, which this process does not keep (`kept`: those it does): from the bytes
        read ahead, else from the node cache, which over node slots also hands over up to `units_in_use` units the
        node's plan uses next, kept here as bytes until a batch reads them (NOTE [ raydl read ahead ] in
        cluster/cache/worker_read.py). Called with no lock held."""
        from ..cluster.cache.worker_read import read_units

        lock = self._kept.lock
        with lock:
            ahead = self.__dict__.setdefault("_ahead", OrderedDict())  # unit -> bytes read ahead (a worker's own)
            out = {u: ahead.pop(u) for u in missing if u in ahead}
            have = (*kept, *ahead)
        rest = [u for u in missing if u not in out]
        if rest:
            n = self.units_in_use - len(rest) if self._reads_ahead else 0
            got = read_units(self, rest, ahead=max(0, n), have=have)
            with lock:
                for u, data in got.items():
                    if u in rest:
                        out[u] = data
                    else:
                        ahead[u] = data
                while len(ahead) > self.units_in_use:
                    ahead.popitem(last=False)
        return out

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_ahead", None)  # bytes read ahead are this process's, as are the units kept (`KeptUnits`)
        return state

    def units_of(self, indices: Any) -> np.ndarray:
        """The unit of each index."""
        return np.searchsorted(self._starts, np.asarray(indices, dtype=np.int64), side="right") - 1

    def raydl_shuffle_sampler(
        self, generator: Optional[torch.Generator], batch_size: Optional[int] = None
    ) -> ParquetShuffleSampler:
        """The sampler `shuffle=True` uses over this dataset, cut for the loader's batches (NOTE [ raydl parquet
        shuffle ])."""
        return ParquetShuffleSampler(self, generator, batch_size)  # type: ignore[arg-type]

    @staticmethod
    def raydl_batch_slots(sampler_iter: Any, batch_size: Optional[int]) -> Optional[np.ndarray]:
        """The node slot of each batch of the epoch, when the sampler iterator's order was cut for these batches
        (NOTE [ raydl node slots ]); else None."""
        for it in (sampler_iter, getattr(sampler_iter, "_it", None)):
            if isinstance(it, _ShuffleIter):
                return it.batch_slots(batch_size)
        dist = UnitDataset.raydl_distributed(sampler_iter)
        return dist.rank_batch_slots(batch_size) if dist is not None else None

    @staticmethod
    def raydl_settle_slots(sampler_iter: Any, nodes: int) -> Optional[int]:
        """The loader's epoch starts over workers on `nodes` nodes: with slots per node (the default `node_slots`), a
        run's first epoch makes that its slot count, kept for the run (NOTE [ raydl node slots ]). The run's count, or
        None when the sampler iterator is not the dataset's own."""
        for it in (sampler_iter, getattr(sampler_iter, "_it", None), getattr(sampler_iter, "sampler", None)):
            if isinstance(it, _ShuffleIter):
                return it._sampler.settle(nodes)
            if isinstance(it, (ParquetShuffleSampler, ParquetDistributedSampler)):  # a batch iterator's sampler
                return it.settle(nodes)
        return None

    @staticmethod
    def raydl_distributed(sampler_iter: Any) -> Optional[ParquetDistributedSampler]:
        """The ParquetDistributedSampler a batch iterator draws from, while it deals the sampler's own epoch (not an
        epoch re-dealt at another world size: NOTE [ raydl global epoch ])."""
        sampler = getattr(sampler_iter, "sampler", None)
        return sampler if isinstance(sampler, ParquetDistributedSampler) else None

    @staticmethod
    def raydl_order_ahead(sampler_iter: Any) -> Optional[np.ndarray]:
        """The indices an epoch's sampler iterator will still yield, when it knows them (the dataset's own sampler)."""
        for it in (sampler_iter, getattr(sampler_iter, "_it", None)):
            if isinstance(it, _ShuffleIter):
                return it.remaining_order()
        return None

    def _wrapped(self, indices: Sequence[int], what: str = "rows") -> np.ndarray:
        """`indices` as sample numbers, negative ones wrapped; IndexError names the first out of range."""
        idx = np.asarray([int(i) for i in indices], dtype=np.int64)
        n = len(self)
        bad = idx[(idx < -n) | (idx >= n)]
        if len(bad):
            raise IndexError(f"{self._WHO}: index {int(bad[0])} out of range for {n} {what}")
        return np.where(idx < 0, idx + n, idx)
