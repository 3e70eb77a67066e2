"""The epoch's order for a checkpoint: torch's samplers iterated with a state (NOTE [ raydl checkpoint ]).

`BatchIter` iterates torch's `BatchSampler` as torch does, with torchdata's batch-iterator state;
`RngSamplerIter` iterates torch's random samplers (RandomSampler, SubsetRandomSampler,
WeightedRandomSampler) by their own `__iter__`, with the generator each epoch draws from made
explicit and recorded in torchdata's random-sampler layout. Where that record goes in a loader
state (torchdata's keys or raydl's section), and which samplers raydl cannot record, are decided
here too; driver/state/checkpoint.py assembles and restores the state around them.
"""

from __future__ import annotations

import base64
import itertools
import types
from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import BatchSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from ...worker.state import by_value, is_stateful

__all__ = [
    "RNG_SAMPLERS",
    "BatchIter",
    "RngSamplerIter",
    "export_sampler_state",
    "fresh_state",
    "import_sampler_state",
    "inexact_sampler",
    "iterable_sampler_state",
    "new_sampler_iter",
    "rng_record_for_torchdata",
    "rng_sampler",
    "sampler_iter",
    "sampler_state",
]


class RngSamplerIter(Iterator[int]):
    """One epoch of a torch `RandomSampler`, `SubsetRandomSampler` or `WeightedRandomSampler`, made
    by the sampler's own `__iter__` (torch's sequence, drawn when torch draws it), with the
    generator the epoch draws from made explicit so that the epoch can be rebuilt.

    Its state is torchdata's random-sampler iterator state: `{"yielded": samples handed out,
    "generator": that generator's state before the epoch's first draw}`. Without a generator of
    its own the sampler draws from torch's global RNG when its epoch starts: a `RandomSampler` a
    seed for a generator it makes, the other two their permutation or multinomial draw directly.
    Here the first seeds the generator with that same draw, the others draw from a copy of the
    global generator which then moves on as the draw moved it: the global RNG ends where torch's
    would, and the permutation is torch's. A loaded state (`load_state_dict`) draws nothing from
    the global RNG: the epoch's draws belong to the saved run; it sets the sampler's own
    generator to the record, and the epoch's draws move it on (NOTE [ raydl checkpoint ], draws).
    """

    YIELDED, GENERATOR = "yielded", "generator"  # torchdata's keys (_StatefulRandomSamplerIterator)
    raydl_fresh_state = True  # `state_dict` gives a new dict; `start` is replaced at `_begin`, never written

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.yielded = 0
        self.start: Optional[torch.Tensor] = None  # the generator's state before the epoch's first draw
        self._it: Optional[Iterator[int]] = None
        self._gen: Optional[types.GeneratorType] = None  # `_it` when it is a generator (`take`)
        self._head: tuple = ()  # the epoch's first sample, drawn at `_begin`, not taken yet (with `_gen`)
        self._last: Optional[int] = None  # samples after which the epoch ends without resuming torch's generator

    def __iter__(self) -> RngSamplerIter:
        return self

    def _begin(self, start: Optional[torch.Tensor]) -> None:
        s = self.sampler
        own = s.generator
        g = own if own is not None else torch.Generator()
        if start is not None:
            g.set_state(start)
        elif own is None and type(s) is RandomSampler:
            g.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))  # torch's seed draw
        elif own is None:
            g.set_state(torch.get_rng_state())
        self.start = g.get_state()
        it = iter(s)
        s.generator = g  # torch's __iter__ reads it once, at its first step
        try:
            head = next(it, _END)
        finally:
            s.generator = own
        if own is None and start is None and type(s) is not RandomSampler:
            torch.set_rng_state(g.get_state())  # the global RNG moved on as torch's draw moves it
        self._gen = it if type(it) is types.GeneratorType else None  # for `take` (NOTE [ raydl sampler take ])
        # NOTE [ raydl sampler end ]: torch's RandomSampler, once it has yielded its `num_samples`, still draws the
        # permutation of a remainder it slices to nothing (`randperm(n).tolist()[:0]`: 6.5 ms of the trainer's core
        # for 200,000 rows, 0.03 ms a batch of 1,024, about a tenth of what raydl's loop costs it a batch). That draw
        # only moves the generator it draws from; when that generator is the epoch's own (the sampler has none:
        # `shuffle=True` without `generator`) nothing reads it afterwards, so the epoch ends at `num_samples`
        # without resuming torch's generator. A sampler's own generator is moved on as torch moves it.
        self._last = len(s) if own is None and type(s) is RandomSampler else None
        if self._gen is not None:
            self._it, self._head = it, (() if head is _END else (head,))
        else:
            self._it, self._head = (it if head is _END else itertools.chain((head,), it)), ()

    def _next(self) -> Any:
        """The next sample, or _END."""
        if self._head:
            value, self._head = self._head[0], ()
            return value
        return next(self._it, _END)  # type: ignore[arg-type]

    def __next__(self) -> int:
        if self._it is None:
            self._begin(None)
        if self._last is not None and self.yielded >= self._last:
            raise StopIteration  # NOTE [ raydl sampler end ]
        value = self._next()
        if value is _END:
            raise StopIteration
        self.yielded += 1
        return value

    def take(self, n: int) -> list:
        """The next `n` samples (fewer at the epoch's end): what `n` calls of `next` give, without a Python call per
        sample (a batch of 1,024 cost the driver about 0.2 ms more one by one)."""
        if self._it is None:
            self._begin(None)
        if self._gen is None:
            batch = [*itertools.islice(self._it, n)]  # type: ignore[arg-type]
        else:
            batch = self._take_delegated(n)
        self.yielded += len(batch)
        return batch

    # NOTE [ raydl sampler take ]
    # torch's random samplers are generators that mostly `yield from` a list (RandomSampler: `yield from
    # torch.randperm(n).tolist()`; WeightedRandomSampler and RandomSampler with replacement alike), so each sample
    # taken through the generator resumes its frame once: about 0.1 ms of the trainer's core for a batch of 1,024.
    # While the generator delegates to a list's iterator (its `gi_yieldfrom`, a documented generator attribute),
    # `take` slices that iterator directly: the same samples in the same order, and the generator, resumed later,
    # goes on from the same place, since it would only have asked that iterator for its next item. Anything else it
    # delegates to, or a plain `yield` (SubsetRandomSampler), is taken one sample at a time as before.
    def _take_delegated(self, n: int) -> list:
        gen = self._gen
        batch = list(self._head)
        self._head = ()
        while len(batch) < n:
            inner = gen.gi_yieldfrom  # type: ignore[union-attr]
            if type(inner) is _LIST_ITERATOR:
                batch += itertools.islice(inner, n - len(batch))
                if len(batch) == n:
                    break
            if self._last is not None and self.yielded + len(batch) >= self._last:
                break  # NOTE [ raydl sampler end ]
            value = next(gen, _END)  # type: ignore[arg-type]
            if value is _END:
                break
            batch.append(value)
        return batch

    def state_dict(self) -> dict:
        if self._it is None:  # torchdata's iterator holds its generator from its creation: draw the epoch now
            self._begin(None)
        return {self.YIELDED: self.yielded, self.GENERATOR: self.start}

    def load_state_dict(self, sd: Mapping) -> None:
        start = sd.get(self.GENERATOR)
        if not isinstance(start, torch.Tensor):
            raise ValueError(
                f"DataLoader.load_state_dict: the state of the {type(self.sampler).__name__}'s epoch has no generator "
                f"state (got {type(start).__name__}): it was not saved by raydl or torchdata's StatefulDataLoader"
            )
        self._begin(start)
        n = int(sd[self.YIELDED])
        for k in range(n):
            if self._next() is _END:
                raise ValueError(
                    f"DataLoader.load_state_dict: the state is {n} samples into its epoch, but this loader's "
                    f"{type(self.sampler).__name__} has {k}: the dataset or the sampler changed since the state was saved"
                )
        self.yielded = n


_END = object()
_LIST_ITERATOR = type(iter([]))
RNG_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def sampler_iter(sampler: Any) -> Iterator:
    """An epoch's iterator over an index sampler: `RngSamplerIter` for torch's own random samplers."""
    return RngSamplerIter(sampler) if type(sampler) in RNG_SAMPLERS else iter(sampler)


class BatchIter(Iterator[list]):
    """Iterates a torch `BatchSampler` exactly as torch does (same batches, first draw at the first
    `next`), with the state of torchdata's batch-sampler iterator: `samples_yielded`, and the
    sampler's and its iterator's own states when they have `state_dict()`."""

    def __init__(self, batch_sampler: BatchSampler) -> None:
        self.sampler = batch_sampler.sampler
        self.batch_size = batch_sampler.batch_size
        self.drop_last = batch_sampler.drop_last
        self.samples_yielded = 0
        self._it: Optional[Iterator] = None
        self._done = False

    def __iter__(self) -> BatchIter:
        return self

    def __next__(self) -> list:
        if self._done:
            raise StopIteration
        if self._it is None:
            self._it = sampler_iter(self.sampler)
        it = self._it
        batch = it.take(self.batch_size) if type(it) is RngSamplerIter else [*itertools.islice(it, self.batch_size)]
        self.samples_yielded += len(batch)
        if not batch or (self.drop_last and len(batch) < self.batch_size):
            self._done = True
            raise StopIteration
        return batch

    def state_dict(self) -> dict:
        if self._it is None:
            # The sampler's iterator is made now rather than at the first `next`, so a stateful one
            # (torchdata's RandomSampler: the epoch's generator state) is in the state. Both happen
            # after the loader's base seed draw, with nothing drawn in between: the batches are the same.
            self._it = sampler_iter(self.sampler)
        sd: dict = {"samples_yielded": self.samples_yielded}
        if is_stateful(self.sampler):
            sd["sampler_state"] = self.sampler.state_dict()
        if self._it is not None and is_stateful(self._it):
            sd["sampler_iter_state"] = self._it.state_dict()
        return sd

    def load_state_dict(self, sd: Mapping) -> None:
        self.samples_yielded = int(sd["samples_yielded"])
        if sd.get("sampler_state") is not None and is_stateful(self.sampler):
            self.sampler.load_state_dict(sd["sampler_state"])
        self._it = sampler_iter(self.sampler)
        self._done = False
        if sd.get("sampler_iter_state") is not None and is_stateful(self._it):
            self._it.load_state_dict(sd["sampler_iter_state"])
        elif not is_stateful(self.sampler):
            # fast-forward, as torchdata's batch iterator does (validate() refused the states for
            # which this cannot be exact: a random sampler drawing from the global RNG)
            for _ in range(self.samples_yielded):
                next(self._it)


def new_sampler_iter(index_sampler: Any) -> Iterator:
    """The epoch's iterator over the (batch) sampler: `BatchIter` for torch's own BatchSampler."""
    if type(index_sampler) is BatchSampler:
        return BatchIter(index_sampler)
    return sampler_iter(index_sampler)


def fresh_state(obj: Any) -> bool:
    """Whether `obj.state_dict()` (just called) gave new containers of values that later draws never change: raydl's
    own samplers' iterators, whose states hold ints, strings and a generator state taken once an epoch and never
    written, and torch's BatchSampler iterated over them or over a sampler without state."""
    if type(obj) is BatchIter:
        inner = obj._it
        return (not is_stateful(obj.sampler) or fresh_state(obj.sampler)) and (
            inner is None or not is_stateful(inner) or fresh_state(inner)
        )
    return getattr(type(obj), "raydl_fresh_state", False) is True


def _kept(state_of: Any) -> Any:
    """`state_of.state_dict()` as it is now, sharing nothing that changes later (NOTE [ raydl state by value ])."""
    sd = state_of.state_dict()
    return sd if fresh_state(state_of) else by_value(sd)


def sampler_state(index_sampler: Any, it: Any) -> tuple:
    """(sampler iterator state, index sampler state) now; (None, None) for samplers without state."""
    return (  # by value: recorded at a draw, read at a later state_dict() (NOTE [ raydl state by value ])
        _kept(it) if is_stateful(it) else None,
        _kept(index_sampler) if is_stateful(index_sampler) else None,
    )


def iterable_sampler_state(index_sampler: Any, batches: int) -> Optional[dict]:
    """An IterableDataset's batch-iterator state after `batches` draws, as torchdata records it (its
    sampler only counts: torch's BatchSampler over the infinite sampler draws `batch_size` a batch)."""
    if type(index_sampler) is BatchSampler:
        return {"samples_yielded": batches * index_sampler.batch_size}
    return None


def rng_record_for_torchdata(loader: Any, index_sampler: Any) -> bool:
    """Whether a torch random sampler's epoch record goes under torchdata's sampler keys.

    Yes for the sampler `shuffle=True` made (torchdata's own RandomSampler reads the same record
    there) and for one with no generator (StatefulDataLoader cannot rebuild that epoch: it fails on
    the record, loudly, instead of fast-forwarding through another permutation). A sampler given
    with its own generator keeps the record in raydl's section: StatefulDataLoader fast-forwards it,
    as it does its own states.
    """
    s = rng_sampler(index_sampler)
    return s is None or s.generator is None or bool(getattr(loader, "default_shuffle", False))


def export_sampler_state(index_sampler: Any, it_state: Any, for_torchdata: bool) -> tuple[Any, Any]:
    """(state under torchdata's `_sampler_iter_state`, the random sampler's epoch record kept in `_raydl` or None)."""
    if for_torchdata or it_state is None or rng_sampler(index_sampler) is None:
        return it_state, None
    if type(index_sampler) is BatchSampler:
        rest = {k: v for k, v in it_state.items() if k != "sampler_iter_state"}
        return rest, _json_record(it_state.get("sampler_iter_state"))
    return None, _json_record(it_state)


def _json_record(record: Optional[Mapping]) -> Optional[dict]:
    """The epoch record with its generator state as base64 text: raydl's section stays JSON where torchdata's is."""
    if record is None:
        return None
    start = record[RngSamplerIter.GENERATOR]
    return {**record, RngSamplerIter.GENERATOR: base64.b64encode(start.numpy().tobytes()).decode("ascii")}


def _tensor_record(record: Mapping) -> dict:
    text = record[RngSamplerIter.GENERATOR]
    start = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8) if isinstance(text, str) else text
    return {**record, RngSamplerIter.GENERATOR: start}


def import_sampler_state(index_sampler: Any, it_state: Any, record: Any) -> Any:
    """The inverse of `export_sampler_state`: torchdata's `_sampler_iter_state` with the epoch record back in it."""
    if record is None:
        return it_state
    record = _tensor_record(record)
    if type(index_sampler) is BatchSampler:
        return {**(it_state or {}), "sampler_iter_state": record}
    return record


def rng_sampler(index_sampler: Any) -> Any:
    """The torch random sampler an index sampler draws from (itself, or under torch's BatchSampler), or None."""
    s = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    return s if type(s) in RNG_SAMPLERS else None


def inexact_sampler(index_sampler: Any) -> Optional[str]:
    """Why a state of this (batch) sampler cannot rebuild its epoch, or None when it can.

    raydl rebuilds torch's own random samplers (`RngSamplerIter`) and positions every sampler whose
    draws do not depend on the global RNG (fast-forward) or that has `state_dict()`. What is left:
    a subclass of torch's random samplers, or a batch sampler of another type over one, drawing
    from the global RNG with no generator of its own.
    """
    if is_stateful(index_sampler) or rng_sampler(index_sampler) is not None:
        return None
    inner = getattr(index_sampler, "sampler", None)
    for s, where in ((index_sampler, ""), (inner, f" under the batch sampler {type(index_sampler).__name__}")):
        if isinstance(s, RNG_SAMPLERS) and getattr(s, "generator", None) is None and not is_stateful(s):
            return (
                f"{type(s).__name__}{where} draws its order from torch's global RNG, which raydl cannot record for "
                "a sampler of this type: a resume from this state would hand out another order. Give the sampler "
                "a generator (torch.Generator().manual_seed(seed)), or use a sampler with state_dict()."
            )
    return None
