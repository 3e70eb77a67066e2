"""Resume in the configuration scripts write: `shuffle=True` and no generator (issue 18).

torch's RandomSampler draws each epoch's seed from the global torch RNG; a restarted job's RNG is
elsewhere (tests/_resume_parity.py resumes from RESTART_SEED), so only a state that records the
epoch's order resumes it. Checked against torchdata's StatefulDataLoader, both ways: its own
shuffle sampler draws another order than torch's, so each state must continue its saver's run.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler
from torch.utils.data import DataLoader as TorchDataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import raydl
from tests import _datasets as D
from tests._resume_parity import END, _mp_context, _roundtrip, check_resume

pytestmark = pytest.mark.usefixtures("ray_session")

N = 10  # 5 batches of 2


def _shuffle() -> dict:
    return {"batch_size": 2, "shuffle": True}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_true_no_generator_both_ways(num_workers):
    """States before the first batch, after one, mid-epoch, after the last and after StopIteration: raydl resumes its
    own run, torchdata's state continues torchdata's run in raydl, raydl's continues raydl's in torchdata; each has
    torchdata's layout. The epoch after StopIteration is drawn from the global RNG (restored with the checkpoint):
    raydl's is its own whichever loader saved the state."""
    check_resume(
        lambda: D.RangeDataset(N),
        _shuffle,
        num_workers=num_workers,
        ks=(0, 1, 3, 5, END),
        same_uninterrupted=False,
        next_from_state=False,
    )


@pytest.mark.parametrize("persistent", [False, True])
def test_shuffle_true_no_generator_second_epoch(persistent):
    """A state in epoch 1 (its seed drawn from the global RNG after epoch 0's), persistent workers or not."""
    check_resume(
        lambda: D.RangeDataset(N),
        lambda: {**_shuffle(), "persistent_workers": persistent},
        num_workers=2,
        ks=(0, 2, END),
        epoch=1,
        same_uninterrupted=False,
        next_from_state=False,
    )


def test_shuffle_true_with_generator_both_ways():
    """shuffle=True with a generator: StatefulDataLoader's sampler shares the generator; each state continues its
    saver's run, into its next epoch too (the generator made anew for the new loader)."""
    check_resume(
        lambda: D.RangeDataset(N),
        lambda: {**_shuffle(), "generator": torch.Generator().manual_seed(7)},
        num_workers=2,
        ks=(0, 2, END),
        same_uninterrupted=False,
    )


def test_shuffle_true_without_batching_both_ways():
    """batch_size=None: the sampler's own iterator state is the whole sampler state, in torchdata's layout."""
    check_resume(
        lambda: D.RangeDataset(N),
        lambda: {"batch_size": None, "shuffle": True},
        num_workers=0,
        ks=(0, 3, N),
        same_uninterrupted=False,
    )


def test_shuffle_true_in_order_false_hands_out_each_sample_once():
    """in_order=False, no generator: the interrupted and the resumed run hand out every sample exactly once."""

    def make():
        return raydl.DataLoader(
            D.RangeDataset(24), batch_size=2, shuffle=True, num_workers=2, in_order=False, timeout=60
        )

    torch.manual_seed(0)
    with make() as loader:
        it = iter(loader)
        first = [next(it) for _ in range(4)]
        state = _roundtrip(loader.state_dict())
    torch.manual_seed(99)
    with make() as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    seen = sorted(v for b in first + rest for v in b.view(-1).tolist())
    assert seen == list(range(24))


# ------------------------------------------------------------------ torch's other samplers drawing from the global RNG


def _subset() -> dict:
    return {"sampler": SubsetRandomSampler(list(range(0, N, 2)) + [1, 3]), "batch_size": 2}


def _weighted() -> dict:
    return {"sampler": WeightedRandomSampler([1.0 + (i % 3) for i in range(N)], num_samples=9), "batch_size": 2}


def _replacement() -> dict:
    return {"sampler": RandomSampler(range(N), replacement=True, num_samples=37), "batch_size": 4}


def _batch_sampler() -> dict:
    return {"batch_sampler": BatchSampler(RandomSampler(range(N)), batch_size=3, drop_last=True)}


def _unbatched_subset() -> dict:
    return {"sampler": SubsetRandomSampler(list(range(N))), "batch_size": None}


GLOBAL_RNG_SAMPLERS = [_subset, _weighted, _replacement, _batch_sampler, _unbatched_subset]


@pytest.mark.parametrize("make_kwargs", GLOBAL_RNG_SAMPLERS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("num_workers", [0, 2])
def test_global_rng_samplers_match_torch_uninterrupted(make_kwargs, num_workers):
    """Uninterrupted, two epochs: torch's batches and torch's global RNG afterwards (the draws are torch's own)."""

    def run(loader_cls, **extra):
        torch.manual_seed(3)
        loader = loader_cls(D.RangeDataset(N), **make_kwargs(), **extra)
        out = [[b.tolist() for b in loader] for _ in range(2)]
        if isinstance(loader, raydl.DataLoader):
            loader.shutdown()
        return out, torch.rand(3).tolist()

    extra = {"num_workers": num_workers, "timeout": 60} if num_workers else {}
    assert run(TorchDataLoader) == run(raydl.DataLoader, **extra)


@pytest.mark.parametrize("make_kwargs", GLOBAL_RNG_SAMPLERS, ids=lambda f: f.__name__.strip("_"))
def test_global_rng_samplers_resume_exactly(make_kwargs):
    """raydl's state records each of these samplers' epoch: exact at every point, in epoch 0 and 1."""
    for epoch in (0, 1):
        check_resume(lambda: D.RangeDataset(N), make_kwargs, num_workers=2, ks=(0, 1, 2, END), epoch=epoch, cross=False)


def test_torchdata_state_of_a_global_rng_sampler_is_refused():
    """StatefulDataLoader keeps no record of a torch SubsetRandomSampler's order: raydl refuses its state loudly
    rather than fast-forward through another permutation; torchdata fails on raydl's state instead of doing so."""
    torch.manual_seed(0)
    td = StatefulDataLoader(D.RangeDataset(N), **_subset())
    it = iter(td)
    next(it)
    td_state = _roundtrip(td.state_dict())
    loader = raydl.DataLoader(D.RangeDataset(N), **_subset())
    with pytest.raises(ValueError, match="does not record the order of its epoch.*SubsetRandomSampler"):
        loader.load_state_dict(td_state)
    it = iter(loader)
    next(it)
    rd_state = _roundtrip(loader.state_dict())
    td = StatefulDataLoader(D.RangeDataset(N), **_subset())
    td.load_state_dict(rd_state)
    with pytest.raises(AssertionError):
        list(td)


class _MyRandomSampler(RandomSampler):
    """A subclass raydl cannot rebuild (it may draw differently): state_dict() warns."""


def test_state_dict_warns_for_a_sampler_it_cannot_rebuild():
    loader = raydl.DataLoader(D.RangeDataset(N), batch_size=2, sampler=_MyRandomSampler(range(N)))
    next(iter(loader))
    with pytest.warns(UserWarning, match="_MyRandomSampler .*draws its order from torch.s global RNG.*generator"):
        loader.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.state_dict()  # once per loader
    seeded = raydl.DataLoader(
        D.RangeDataset(N), batch_size=2, sampler=_MyRandomSampler(range(N), generator=torch.Generator().manual_seed(1))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seeded.state_dict()


def test_state_taken_after_an_iterator_was_dropped_without_a_batch():
    """An iterator made and dropped before its first batch: the state describes it (0 batches, its order), as
    torchdata's does, and both loaders resume it into the whole epoch of that order."""
    torch.manual_seed(0)
    loader = raydl.DataLoader(D.RangeDataset(N), num_workers=2, timeout=60, **_shuffle())
    it = iter(loader)
    del it
    state = _roundtrip(loader.state_dict())
    assert state["_snapshot"]["_snapshot_step"] == 0 and state["_iterator_finished"] is False
    loader.shutdown()
    torch.manual_seed(5)
    resumed = raydl.DataLoader(D.RangeDataset(N), num_workers=2, timeout=60, **_shuffle())
    resumed.load_state_dict(state)
    ours = [b.tolist() for b in resumed]
    resumed.shutdown()
    td = StatefulDataLoader(D.RangeDataset(N), num_workers=2, multiprocessing_context=_mp_context(), **_shuffle())
    td.load_state_dict(state)
    assert [b.tolist() for b in td] == ours
    assert sorted(v for b in ours for (v,) in b) == list(range(N))
