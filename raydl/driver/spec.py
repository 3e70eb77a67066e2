"""`LoaderSpec`: what an epoch's iterator needs of its DataLoader, read once at `iter()`.

The loader builds one per iterator (`LoaderSpec.of`) and hands it over instead of itself, so no
iterator reads or writes the loader afterwards. What changes later reaches an iterator through the
calls the loader makes on it (`EpochIter` in driver/lifecycle.py): the next epoch's
`_IterableDataset_len_called` (`next_epoch`), a resize (`resize`). The attribute names are torch's,
so the state, payload and warning helpers read a spec as they read a loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch.utils.data import IterableDataset

from .._options import RayOptions

__all__ = ["LoaderSpec", "index_sampler_of"]


def index_sampler_of(loader: Any) -> Any:
    """What a loader draws from: its batch sampler with automatic batching, else its sampler (torch's rule)."""
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


@dataclass(frozen=True)
class LoaderSpec:
    """A DataLoader's configuration as of `iter()` (torch's attribute names), and its `ray_*` options."""

    dataset: Any
    sampler: Any
    batch_sampler: Any
    batch_size: Optional[int]
    drop_last: bool
    collate_fn: Any
    worker_init_fn: Any
    generator: Any
    num_workers: int
    prefetch_factor: Optional[int]
    timeout: float
    persistent_workers: bool
    in_order: bool
    pin_memory: bool
    pin_memory_device: str
    multiprocessing_context: Any
    options: RayOptions
    len_called: Optional[int]  # torch's `_IterableDataset_len_called` (len(loader) of an iterable, or None)
    default_shuffle: bool  # the sampler is the RandomSampler shuffle=True made (driver/state/samplers.py)
    hint_given: list  # [bool], shared by the loader's iterators: the data-stall hint is logged once a loader

    @classmethod
    def of(cls, loader: Any) -> LoaderSpec:
        """The spec of `loader`: raydl's DataLoader, or a patched torch one (its `ray_*` options defaulted)."""
        return cls(
            dataset=loader.dataset,
            sampler=loader.sampler,
            batch_sampler=loader.batch_sampler,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            collate_fn=loader.collate_fn,
            worker_init_fn=loader.worker_init_fn,
            generator=loader.generator,
            num_workers=loader.num_workers,
            prefetch_factor=loader.prefetch_factor,
            timeout=loader.timeout,
            persistent_workers=loader.persistent_workers,
            in_order=loader.in_order,
            pin_memory=loader.pin_memory,
            pin_memory_device=loader.pin_memory_device,
            multiprocessing_context=loader.multiprocessing_context,
            options=RayOptions.from_loader(loader),
            len_called=loader._IterableDataset_len_called,
            default_shuffle=bool(getattr(loader, "_default_shuffle", False)),
            hint_given=loader.__dict__.setdefault("_hint_given", [False]),
        )

    @property
    def auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def index_sampler(self) -> Any:
        return index_sampler_of(self)

    @property
    def is_iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)
