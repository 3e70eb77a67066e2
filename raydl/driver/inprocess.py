"""`_InProcessIter`: num_workers=0, loading in the calling process as torch does, with a state.

torch's in-process iterator is private and has no state; this one makes the same batches (same
sampler draws, base seed drawn from the loader's generator in torch's order, torch's fetch and
collate rules via worker/fetch.py, torch's pinning; with ray_seed="batch" each batch seeded by its
position, NOTE [ raydl batch seeding ]) and has `state_dict()` in StatefulDataLoader's
num_workers=0 layout (NOTE [ raydl checkpoint ] in driver/state/checkpoint.py). Everything happens in the
caller's thread, so the state is simply read when asked for.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from ..job.global_epoch import GLOBAL_EPOCH
from ..worker.fetch import IterableFetcher, MapFetcher, warn_if_length_exceeded
from ..worker.seeding import _SavedRNG, seed_batch, seed_sample
from ..worker.state import DATASET_ITER_STATE, DATASET_STATE, FETCHER_ENDED, FETCHER_STATE, by_value, is_stateful
from .device import pin_memory, pin_memory_target, warn_pin_memory_args
from .state.checkpoint import Deal, restore_sampler
from .state.draws import draw_base_seed, global_rng_record, iterator_base_seed, next_epoch_draws_global, saved_base_seed
from .state.layout import (
    FINISHED,
    INDEX_SAMPLER_STATE,
    LEN_CALLED,
    NEXT_EPOCH_RNG,
    NUM_YIELDED,
    RAYDL,
    SAMPLER_EPOCH,
    SAMPLER_ITER_STATE,
    SAMPLER_ITER_YIELDED,
    SHARED_SEED,
    loader_facts,
)
from .state.samplers import export_sampler_state, new_sampler_iter, rng_record_for_torchdata, sampler_state

if TYPE_CHECKING:
    from .spec import LoaderSpec

__all__ = ["_InProcessIter"]

logger = logging.getLogger(__name__)


class _InProcessIter(Iterator[Any]):
    """One epoch of a num_workers=0 loader; resumes from `state` when given (already validated)."""

    def __init__(self, spec: LoaderSpec, state: Optional[dict] = None) -> None:
        self._dataset = spec.dataset
        self._is_iterable = spec.is_iterable
        self._auto_collation = spec.auto_collation
        self._index_sampler = spec.index_sampler
        self._IterableDataset_len_called = spec.len_called
        warn_pin_memory_args(spec)  # torch's warnings, at iterator creation as torch's
        self._pin_device = pin_memory_target(spec.pin_memory)
        self._facts = loader_facts(spec)
        self._rng_for_td = rng_record_for_torchdata(spec, self._index_sampler)
        self._next_draws_global = next_epoch_draws_global(spec, self._index_sampler)
        # torch's order: the sampler iterator, then the base seed (it consumes the generator; only
        # ray_seed="batch" uses it, NOTE [ raydl batch seeding ]).
        self._sampler_iter = new_sampler_iter(self._index_sampler)
        saved_seed = (state.get(RAYDL) or {}).get("base_seed") if state is not None else None
        # a resumed iterator draws from the loader's generator as a new one does, never from the global RNG,
        # and takes the saved base seed (NOTE [ raydl checkpoint ], draws)
        drawn = iterator_base_seed(spec.generator, state is not None)
        if saved_seed is not None:
            drawn = int(saved_seed)
        if drawn is None:  # torchdata's state has none, and the global RNG is left alone: a seed of its own
            own = torch.Generator()
            own.seed()  # non-deterministic, as an unseeded job's base seed is
            drawn = draw_base_seed(own)
        self._base_seed = drawn
        self._seed_per_batch = spec.options.seed == "batch"
        self._deal = Deal(spec, self._index_sampler, state)  # NOTE [ raydl global epoch ]
        if self._deal.redeal:  # the saved job's position, re-dealt: nothing else of its layout applies
            self._base_seed = saved_base_seed(state)  # type: ignore[arg-type]
            self._sampler_iter = self._deal.iterator()
            state = None
        sample_seeded = spec.options.seed == "sample"
        self._sample_key = self._deal.sample_key(self._base_seed, 0) if sample_seeded else None
        self._sampler_iter_yielded = 0
        self._num_yielded = 0
        self._finished = False
        collate = spec.collate_fn
        replay = 0
        if state is not None:
            self._sampler_iter = restore_sampler(
                self._index_sampler,
                self._sampler_iter,
                state,
                self._is_iterable,
                bool(state.get(FINISHED)),
                (state.get(RAYDL) or {}).get(SAMPLER_EPOCH),
            )
            self._sampler_iter_yielded = int(state[SAMPLER_ITER_YIELDED])
            self._num_yielded = int(state[NUM_YIELDED])
            if state.get(DATASET_STATE) is not None and is_stateful(self._dataset):
                self._dataset.load_state_dict(state[DATASET_STATE])
        if self._is_iterable:
            self._fetcher: Any = IterableFetcher(self._dataset, self._auto_collation, collate, spec.drop_last)
            if state is not None:
                it = self._fetcher.dataset_iter
                fetcher_state = state.get(FETCHER_STATE) or {}
                if is_stateful(self._dataset) or is_stateful(it):
                    if fetcher_state.get(DATASET_ITER_STATE) is not None and is_stateful(it):
                        it.load_state_dict(fetcher_state[DATASET_ITER_STATE])
                    self._fetcher.ended = bool(fetcher_state.get(FETCHER_ENDED, False))
                else:  # a stream without state: replay it, as torchdata does
                    replay, self._num_yielded = self._num_yielded, 0
        else:
            self._fetcher = MapFetcher(self._dataset, self._auto_collation, collate)
        for _ in range(replay):
            next(self)
        if state is not None:
            self._finished = bool(state.get(FINISHED, False))

    def __iter__(self) -> _InProcessIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        try:
            index = next(self._sampler_iter)
            self._sampler_iter_yielded += 1
            work = (len(index) if self._auto_collation else None) if self._is_iterable else index
            if self._seed_per_batch:  # seeded by its position; the caller's generators restored after
                saved = _SavedRNG()
                seed_batch(self._base_seed, 0, self._sampler_iter_yielded - 1)
                try:
                    data = self._fetcher.fetch(work)
                finally:
                    saved.restore()
            elif self._sample_key is not None:  # NOTE [ raydl sample seeding ]; the caller's generators restored after
                key, epoch = self._sample_key
                saved = _SavedRNG()
                try:
                    data = self._fetcher.fetch(work, lambda i: seed_sample(key, epoch, i))
                finally:
                    saved.restore()
            else:
                data = self._fetcher.fetch(work)
        except StopIteration:
            self._finished = True
            raise
        if self._pin_device is not None:
            data = pin_memory(data, self._pin_device)
        self._num_yielded += 1
        if self._is_iterable:
            warn_if_length_exceeded(
                self._dataset, self._IterableDataset_len_called, self._num_yielded, multiprocess=False
            )
        return data

    @property
    def finished(self) -> bool:
        return self._finished

    # ------------------------------------------------------------------ `EpochIter`: no workers, no next epoch here

    stats_recorder = None  # nothing to measure: `loader.stats()` refuses num_workers=0
    replay = 0  # a stream without state is replayed in __init__
    reusable = False  # torch keeps no num_workers=0 iterator between epochs

    @property
    def checkpoint(self) -> _InProcessIter:
        """The state is read from this iterator itself: it holds no worker or process to release."""
        return self

    @property
    def worker_records(self) -> list:
        return []

    def next_epoch(self, len_called: Optional[int]) -> None:
        raise RuntimeError("raydl bug: a num_workers=0 iterator is made again for each epoch")

    def resize(self, num_workers: int) -> None:
        raise RuntimeError("raydl bug: set_num_workers refuses a num_workers=0 loader")

    def shutdown(self) -> None:
        """Nothing to release."""

    def state_dict(self) -> dict:
        """StatefulDataLoader's num_workers=0 state, plus raydl's `_raydl` section."""
        it_state, idx_state = by_value(sampler_state(self._index_sampler, self._sampler_iter))  # the caller's copy
        it_state, record = export_sampler_state(self._index_sampler, it_state, self._rng_for_td)
        if self._is_iterable:
            it = self._fetcher.dataset_iter
            fetcher_state: Optional[dict] = {
                DATASET_ITER_STATE: by_value(it.state_dict()) if is_stateful(it) else None,
                FETCHER_ENDED: bool(self._fetcher.ended),
            }
            dataset_state = (
                by_value(self._dataset.state_dict()) if it is not self._dataset and is_stateful(self._dataset) else None
            )
        else:
            fetcher_state = None
            dataset_state = by_value(self._dataset.state_dict()) if is_stateful(self._dataset) else None
        ours = {
            **self._facts,
            SAMPLER_EPOCH: record,
            GLOBAL_EPOCH: self._deal.record(self._sampler_iter_yielded),
            "done_ahead": [],
            "base_seed": self._base_seed,
        }
        if self._finished and self._next_draws_global:  # the next epoch's draws (NOTE [ raydl checkpoint ], draws)
            ours[NEXT_EPOCH_RNG] = global_rng_record()
        return {
            INDEX_SAMPLER_STATE: idx_state,
            SAMPLER_ITER_STATE: it_state,
            SAMPLER_ITER_YIELDED: self._sampler_iter_yielded,
            NUM_YIELDED: self._num_yielded,
            LEN_CALLED: self._IterableDataset_len_called,
            SHARED_SEED: None,
            FETCHER_STATE: fetcher_state,
            DATASET_STATE: dataset_state,
            FINISHED: self._finished,
            RAYDL: ours,
        }
