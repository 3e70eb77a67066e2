"""The order `shuffle=True` gives a `ParquetDataset` (data/parquet.py): a sampler a node cache can serve, and torch's
DistributedSampler over the same order.

NOTE [ raydl parquet shuffle ]
`shuffle=True` over a ParquetDataset does not make torch's RandomSampler: the dataset supplies
`ParquetShuffleSampler`, an order a cache can serve. Each epoch draws one seed exactly as
RandomSampler draws its own (`torch.empty((), dtype=torch.int64).random_(generator=g)`, from the
loader's `generator`, else from torch's global RNG), then:
  1. the row groups are permuted with that seed;
  2. consecutive runs of `shuffle_window` row groups of that permutation form windows;
  3. the rows of each window are permuted, and the windows are concatenated.
Every row comes once per epoch; the row-group permutation leaves no trace of storage order (the
rank correlation with it is about 1/sqrt(number of row groups)); a batch mixes the rows of a
whole window, hence of several files. Each row group is used only inside its window, so with a
window that fits in half the cache every byte is fetched once per epoch. The sampler's iterator
has a state (`{"seed", "yielded", "layout"}`), recorded by raydl's checkpoint as torchdata's sampler
iterator state: a resume rebuilds the epoch from its seed and skips what was handed out; `layout` names the units and
the window, and a state saved over others (the files, `cache_limit` or `shuffle_window` changed) is refused.
`ParquetDistributedSampler` is torch's DistributedSampler (seed + epoch, padding, rank r taking
positions r, r + W, ...) over the same order, so ranks stay equal and share one node cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

if TYPE_CHECKING:
    from .parquet import ParquetDataset

__all__ = ["ParquetDistributedSampler", "ParquetShuffleSampler", "shard_aware_order"]


def shard_aware_order(starts: np.ndarray, rows: np.ndarray, window: int, seed: int) -> np.ndarray:
    """The epoch's row order for `seed` (NOTE [ raydl parquet shuffle ]): row groups permuted, rows shuffled per window."""
    rng = np.random.default_rng(int(seed) & 0xFFFFFFFFFFFFFFFF)
    perm = rng.permutation(len(rows))
    parts = []
    for w0 in range(0, len(perm), window):
        units = perm[w0 : w0 + window]
        idx = np.concatenate([np.arange(starts[u], starts[u] + rows[u], dtype=np.int64) for u in units])
        rng.shuffle(idx)
        parts.append(idx)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _draw_seed(generator: Optional[torch.Generator]) -> int:
    """One int64 drawn as torch's RandomSampler draws its seed (from `generator`, else torch's global RNG)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class _ShuffleIter(Iterator[int]):
    """One epoch of `ParquetShuffleSampler`; its state is `{"seed", "yielded"}` (NOTE [ raydl parquet shuffle ])."""

    def __init__(self, sampler: ParquetShuffleSampler) -> None:
        self._sampler = sampler
        self.seed: Optional[int] = None  # drawn at the first step, when torch's RandomSampler draws its own
        self.yielded = 0
        self._order: Optional[np.ndarray] = None

    def __iter__(self) -> _ShuffleIter:
        return self

    def _begin(self, seed: Optional[int]) -> None:
        self.seed = _draw_seed(self._sampler.generator) if seed is None else int(seed)
        self._order = self._sampler.dataset.shuffled_order(self.seed)

    def __next__(self) -> int:
        if self._order is None:
            self._begin(None)
        if self.yielded >= len(self._order):  # type: ignore[arg-type]
            raise StopIteration
        value = int(self._order[self.yielded])  # type: ignore[index]
        self.yielded += 1
        return value

    def remaining_order(self) -> np.ndarray:
        """The indices this epoch will still yield, in order: what the node cache is told ahead."""
        if self._order is None:
            self._begin(None)
        return self._order[self.yielded :]  # type: ignore[index]

    def _layout(self) -> str:
        """What the epoch's order depends on besides the seed: the dataset's units and the window."""
        ds = self._sampler.dataset
        return f"{getattr(ds, 'token', '')}:{ds.shuffle_window}"

    def state_dict(self) -> dict:
        if self._order is None:  # the base seed was drawn before: drawing the epoch's now keeps torch's order of draws
            self._begin(None)
        return {"seed": self.seed, "yielded": self.yielded, "layout": self._layout()}

    def load_state_dict(self, sd: dict) -> None:
        if "seed" not in sd:
            raise ValueError(
                f"ParquetShuffleSampler: the state {sd!r} has no epoch seed: it was saved for another sampler"
            )
        if sd.get("layout") is not None and sd["layout"] != self._layout():
            raise ValueError(
                "the state was saved over other units or another shuffle window (layout "
                f"{sd['layout']!r}, now {self._layout()!r}): the files, cache_limit or shuffle_window changed, and "
                "the same seed would now give another order. Build the dataset as the saved run did to resume it."
            )
        self._begin(int(sd["seed"]))
        n = int(sd["yielded"])
        if n > len(self._order):  # type: ignore[arg-type]
            raise ValueError(
                f"ParquetShuffleSampler: the state is {n} rows into its epoch, but this dataset has "
                f"{len(self._order)} rows: the files changed since the state was saved"  # type: ignore[arg-type]
            )
        self.yielded = n


class ParquetShuffleSampler(Sampler[int]):
    """What `shuffle=True` samples over a `ParquetDataset`: row groups permuted, rows shuffled within windows.

    Args:
        dataset (ParquetDataset): the dataset.
        generator (torch.Generator, optional): each epoch draws its seed from it, as torch's
            RandomSampler does. Defaults to ``None`` (torch's global RNG).
    """

    def __init__(self, dataset: ParquetDataset, generator: Optional[torch.Generator] = None) -> None:
        self.dataset = dataset
        self.generator = generator

    def __iter__(self) -> _ShuffleIter:
        return _ShuffleIter(self)

    def __len__(self) -> int:
        return len(self.dataset)


class ParquetDistributedSampler(DistributedSampler):
    """torch's `DistributedSampler` over a `ParquetDataset`'s shard-aware order (NOTE [ raydl parquet shuffle ]).

    Same arguments, `set_epoch` and split as torch's: the global order of epoch `e` is the
    dataset's order for seed `seed + e`, padded (or cut, `drop_last`) to the world size, rank `r`
    taking positions r, r + W, r + 2W, ... . A state saved with it resumes at another world
    size as torch's does (NOTE [ raydl global epoch ] in job/global_epoch.py).
    """

    def global_order(self, epoch: int, seed: Optional[int] = None, shuffle: Optional[bool] = None) -> list:
        """The job's order P of `epoch` before padding and dealing (what a resume at another world size re-deals)."""
        seed = self.seed if seed is None else seed
        shuffle = self.shuffle if shuffle is None else shuffle
        if shuffle:
            return self.dataset.shuffled_order(seed + epoch).tolist()
        return list(range(len(self.dataset)))

    def __iter__(self) -> Iterator[int]:
        indices = self.global_order(self.epoch)
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if padding > 0 and indices:
                indices += (indices * (padding // len(indices) + 1))[:padding]
        else:
            indices = indices[: self.total_size]
        return iter(indices[self.rank : self.total_size : self.num_replicas])
