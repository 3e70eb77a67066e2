"""Three of torchdata's own checkpoint patterns (test_state_dict.py), run the same way through StatefulDataLoader and
raydl: each loader must give what StatefulDataLoader gives, and a state moves from one loader to the other wherever
the layout allows it.

  * the end of an epoch with `shuffle=True` and no generator: the state taken after the epoch, loaded into a new
    loader, gives the saver's next epoch although the global torch RNG moved on meanwhile (nothing re-seeds it
    between the runs, as in torchdata's test);
  * a state asked for after a load, before every worker has handed out a batch: the workers that have not report
    their dataset's state as it started after the load (torchdata's), and the state resumes the rest exactly;
  * the state right after `iter()`: every worker's dataset state as its `__iter__` left it, in a later epoch of
    persistent workers too (their streams restart at `iter()`).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import raydl
from tests import _datasets as D
from tests import _resume_datasets as RD
from tests._parity import BATCH_TIMEOUT_S
from tests._resume_parity import _mp_context, _roundtrip, _same, _same_layout, check_resume

pytestmark = pytest.mark.usefixtures("ray_session")

LOADERS = (StatefulDataLoader, raydl.DataLoader)


def _make(cls: type, dataset: Any, num_workers: int, **kwargs: Any) -> Any:
    extra = {"multiprocessing_context": _mp_context()} if cls is StatefulDataLoader else {}
    return cls(dataset, num_workers=num_workers, timeout=BATCH_TIMEOUT_S, **extra, **kwargs)


def _done(loader: Any) -> None:
    if isinstance(loader, raydl.DataLoader):
        loader.shutdown()


def _resumed(make: Callable[[], Any], state: dict) -> list:
    loader = make()
    loader.load_state_dict(state)
    out = list(loader)
    _done(loader)
    return out


def _samples(batches: list) -> list:
    return sorted(int(x) for b in batches for x in (b if isinstance(b, list) else [b]))


# ------------------------------------------------------------------ the end of an epoch, shuffle=True, no generator

N_SHUFFLE = 12


@pytest.mark.parametrize("batch_size", [None, 4])
@pytest.mark.parametrize("persistent", [False, True])
def test_end_of_epoch_shuffle_without_generator_resumes_into_the_saved_next_epoch(persistent, batch_size):
    """A whole epoch, the state, the next epoch: a new loader loading the state gives that next epoch, for
    StatefulDataLoader (its sampler's generator is in the state) and for raydl (its state records the global RNG
    the next epoch draws from). Across loaders the order is the loading loader's own (their shuffle samplers
    differ): a whole epoch, each sample once."""
    kwargs = {"shuffle": True, "batch_size": batch_size, "collate_fn": RD.identity_collate}
    kwargs["persistent_workers"] = persistent

    def make(cls: type) -> Callable[[], Any]:
        return lambda: _make(cls, D.RangeDataset(N_SHUFFLE), 3, **kwargs)

    torch.manual_seed(0)  # once, as torch's TestCase does before a test: nothing re-seeds between the runs below
    states = {}
    for cls in LOADERS:
        loader = make(cls)()
        list(loader)
        states[cls] = _roundtrip(loader.state_dict())
        expected = list(loader)
        _done(loader)
        _same(expected, _resumed(make(cls), states[cls]), f"{cls.__name__} resumed from its end-of-epoch state")
    if batch_size is None:
        return  # across loaders once per persistent setting: the batched runs move the same states
    for saver, cls in ((raydl.DataLoader, StatefulDataLoader), (StatefulDataLoader, raydl.DataLoader)):
        out = _resumed(make(cls), states[saver])
        assert _samples(out) == list(range(N_SHUFFLE)), f"{cls.__name__} from {saver.__name__}'s end state: {out}"


# ------------------------------------------------------------------ a state after a load, before every worker yielded

N_STREAM = 24


def _after_a_load(make: Callable[[], Any], first_read: int) -> tuple[dict, list]:
    """Read `first_read` batches, take A, read 2, keep the rest; load A into the same loader, read 2, take B:
    (B, the rest)."""
    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    for _ in range(first_read):
        next(it)
    a = loader.state_dict()
    for _ in range(2):
        next(it)
    expected = list(it)
    loader.load_state_dict(a)
    it = iter(loader)
    for _ in range(2):
        next(it)
    b = _roundtrip(loader.state_dict())
    _done(loader)
    return b, expected


def _streams(cls: type, dataset: Any) -> Callable[[], Any]:
    return lambda: _make(cls, dataset, 4, batch_size=1, persistent_workers=True)


@pytest.mark.parametrize("first_read", [8, 5])
def test_state_after_a_load_before_every_worker_yielded(first_read):
    """4 persistent workers, batch 1, a state B taken after a load into the same loader and 2 batches: the workers
    that yielded nothing since the load report the state their dataset started with after it (its pass count moved
    on), as torchdata's do; B resumes exactly the rest, in either loader."""
    runs = {}
    for cls in LOADERS:
        make = _streams(cls, RD.PassCountingIterable(N_STREAM))
        b, expected = runs[cls] = _after_a_load(make, first_read)
        passes = [s["dataset_state"]["passes"] for s in b["_snapshot"]["_worker_snapshots"].values()]
        assert passes == [2] * 4, f"{cls.__name__}: every worker's dataset started a second pass at the load: {passes}"
        _same(expected, _resumed(make, b), f"{cls.__name__} resumed from its own state")
    _same_layout(runs[StatefulDataLoader][0], runs[raydl.DataLoader][0], True, "the state taken after the load")
    for saver, cls in ((raydl.DataLoader, StatefulDataLoader), (StatefulDataLoader, raydl.DataLoader)):
        state, expected = runs[saver]
        make = _streams(cls, RD.PassCountingIterable(N_STREAM))
        _same(expected, _resumed(make, state), f"{cls.__name__} resumed from {saver.__name__}'s state")


@pytest.mark.parametrize("first_read", [8, 5])
def test_state_after_a_load_with_a_generator_iter_resumes_exactly(first_read):
    """The same with a dataset whose generator `__iter__` takes the loaded state in its body: a worker that yielded
    nothing since the load still holds the loaded state (its copy's own, which StatefulDataLoader reports, would
    restart its stream), and B resumes exactly the rest."""
    make = _streams(raydl.DataLoader, RD.LazyResumeIterable(N_STREAM))
    b, expected = _after_a_load(make, first_read)
    _same(expected, _resumed(make, b), "raydl resumed from its state")


# ------------------------------------------------------------------ the state right after iter()


@pytest.mark.parametrize("persistent", [False, True])
def test_state_right_after_iter_holds_each_dataset_as_its_iter_left_it(persistent):
    """iter() then state_dict(), in epochs 0 and 1: every worker's dataset state counts the passes its copy started
    (1, then 2 for persistent workers whose streams restarted), the same state as StatefulDataLoader's."""
    states: dict = {}
    for cls in LOADERS:
        torch.manual_seed(0)
        loader = _make(cls, RD.PassCountingIterable(8), 2, batch_size=2, persistent_workers=persistent)
        states[cls] = []
        for _ in range(2):
            it = iter(loader)
            states[cls].append(_roundtrip(loader.state_dict()))
            list(it)
        _done(loader)
    for epoch, (td, rd) in enumerate(zip(states[StatefulDataLoader], states[raydl.DataLoader])):
        passes = [s["dataset_state"]["passes"] for s in rd["_snapshot"]["_worker_snapshots"].values()]
        assert passes == [1 + (epoch if persistent else 0)] * 2, f"epoch {epoch}: {passes}"
        _same_layout(td, rd, True, f"the state right after iter() in epoch {epoch}")


@pytest.mark.parametrize(
    "make_dataset, td_exact",
    [(lambda: RD.PassCountingIterable(8), True), (lambda: RD.StatefulIterable(8), False)],
    ids=["dataset-state", "iterator-state"],
)
def test_state_right_after_iter_of_a_restarted_stream_resumes_both_ways(make_dataset, td_exact):
    """Persistent workers in epoch 1, right after iter(): the dataset's (or its iterator's) state as the restarted
    stream began, torchdata's layout and values, and each loader resumes the other's state (an iterator drawing from
    torch's RNG: raydl's own resume is exact, torchdata re-seeds, cross-loaded states behave as torchdata's)."""
    check_resume(
        make_dataset,
        lambda: {"batch_size": 2, "persistent_workers": True},
        num_workers=2,
        ks=(0,),
        epoch=1,
        td_resume_exact=td_exact,
    )
