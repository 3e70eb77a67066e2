"""Mid-epoch resume: raydl's state_dict()/load_state_dict() against torchdata's StatefulDataLoader (tests/_resume_parity.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import RandomSampler
from torchdata.stateful_dataloader import sampler as tdl

import raydl
from tests import _datasets as D
from tests import _resume_datasets as RD
from tests._resume_parity import _roundtrip, _same, check_resume

pytestmark = pytest.mark.usefixtures("ray_session")

N = 10  # 5 batches of 2
KS = (0, 1, 3, 5)  # a state before any batch, after one, mid-epoch, after the last one


def _seq() -> dict:
    return {"batch_size": 2, "generator": torch.Generator().manual_seed(7)}


def _torch_shuffle() -> dict:
    """shuffle with a generator: torch's RandomSampler, given explicitly (torchdata's shuffle=True uses its own sampler)."""
    return {
        "batch_size": 2,
        "sampler": RandomSampler(range(N), generator=torch.Generator().manual_seed(3)),
        "generator": torch.Generator().manual_seed(7),
    }


def _stateful_sampler() -> dict:
    """torchdata's RandomSampler, whose iterator has state_dict(): its state is saved and loaded, not fast-forwarded."""
    return {
        "batch_size": 2,
        "sampler": tdl.RandomSampler(range(N), generator=torch.Generator().manual_seed(3)),
        "generator": torch.Generator().manual_seed(7),
    }


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_sequential_parity(num_workers):
    """num_workers 0, 2, 3: states at 0, 1, k and all batches continue identically in raydl and torchdata, both ways."""
    check_resume(lambda: D.RangeDataset(N), _seq, num_workers=num_workers, ks=KS)


@pytest.mark.parametrize("num_workers", [0, 3])
def test_shuffle_with_generator_parity(num_workers):
    """A torch RandomSampler with a generator: fast-forwarded, same permutation after resume."""
    check_resume(lambda: D.RangeDataset(N), _torch_shuffle, num_workers=num_workers, ks=(1, 3))


def test_stateful_sampler_parity_persistent_second_epoch():
    """torchdata's stateful sampler, persistent workers, a state taken in the second epoch."""
    check_resume(
        lambda: D.RangeDataset(N),
        lambda: {**_stateful_sampler(), "persistent_workers": True},
        num_workers=2,
        ks=(0, 3),
        epoch=1,
        same_uninterrupted=False,
    )


def test_global_rng_dataset_resumes_bit_identically():
    """A dataset drawing from torch/NumPy/random in its workers: raydl restores each worker's RNG, so its
    resume equals the uninterrupted run; torchdata reseeds (its own resume differs), and cross-loaded
    states behave as torchdata's."""
    check_resume(lambda: D.RandomAugmentDataset(N), _seq, num_workers=2, ks=(1, 3), td_resume_exact=False)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_map_dataset_parity(num_workers):
    """A map-style dataset with state_dict(): each worker's dataset state is restored in its worker."""
    check_resume(lambda: RD.CountingDataset(N), _seq, num_workers=num_workers, ks=(1, 3))


def test_stateful_iterable_parity():
    """An IterableDataset whose iterator has state_dict(), sharded by worker, drawing from torch's RNG."""
    check_resume(lambda: RD.StatefulIterable(N), _seq, num_workers=2, ks=(1, 3), td_resume_exact=False)


def test_iterable_without_state_is_replayed():
    """An IterableDataset without state: raydl replays the batches already handed out, as torchdata does."""
    check_resume(lambda: D.ShardedIterable(0, N), _seq, num_workers=2, ks=(0, 3))


def test_second_epoch_shuffle_true_persistent_workers_raydl_only():
    """shuffle=True with a generator, persistent workers, worker RNG, a state in the second epoch: raydl restores
    the generator's epoch-start state and each worker's RNG, so the resume is the uninterrupted run's rest
    (torchdata's shuffle=True uses another sampler, so this is raydl against itself)."""
    check_resume(
        lambda: D.RandomAugmentDataset(N),
        lambda: {
            "batch_size": 2,
            "shuffle": True,
            "generator": torch.Generator().manual_seed(5),
            "persistent_workers": True,
        },
        num_workers=2,
        ks=(2,),
        epoch=1,
        cross=False,
    )


@pytest.mark.parametrize("persistent", [False, True])
def test_state_after_the_epoch_ended_resumes_into_the_next(persistent):
    """A state taken after StopIteration resumes into the next epoch: same permutation, same worker RNG."""

    def make():
        return raydl.DataLoader(
            D.RandomAugmentDataset(N),
            batch_size=2,
            shuffle=True,
            num_workers=2,
            persistent_workers=persistent,
            generator=torch.Generator().manual_seed(5),
            timeout=60,
        )

    with make() as loader:
        list(loader)
        state = loader.state_dict()
        assert state["_iterator_finished"] is True
        expected = list(loader)
    with make() as loader:
        loader.load_state_dict(state)
        _same(expected, list(loader), "next epoch after a finished state")


def test_in_order_false_hands_out_every_batch_exactly_once():
    """in_order=False: batches handed out ahead of a slow one are recorded, so the interrupted and the resumed run
    together hand out every batch exactly once (torchdata gives no guarantee here)."""

    def make():
        return raydl.DataLoader(
            RD.DelayedDataset(16, slow={0, 1}),
            batch_size=2,
            num_workers=2,
            in_order=False,
            generator=torch.Generator().manual_seed(1),
            timeout=60,
        )

    with make() as loader:
        it = iter(loader)
        first = [next(it) for _ in range(3)]
        state = _roundtrip(loader.state_dict())
    assert sorted(b[0].item() for b in first) != [0, 2, 4], "no batch overtook the slow one: the test proves nothing"
    with make() as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    seen = sorted(v for b in first + rest for v in b.view(-1).tolist())
    assert seen == list(range(16))


def test_state_taken_after_a_worker_death_is_exact(tmp_path):
    """A worker dies mid-epoch: its replacement starts from its state (RNG included), so batches stay those of the
    run without a death, and a state taken after the replacement resumes exactly."""

    def make(exit_index=-1):
        ds = RD.NoisyDataset(16, exit_index=exit_index, marker=str(tmp_path / "died"))
        return raydl.DataLoader(ds, batch_size=2, num_workers=2, generator=torch.Generator().manual_seed(2), timeout=60)

    with make() as loader:
        expected = list(loader)
    with make(exit_index=9) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(6)]
        assert (tmp_path / "died").exists()
        state = _roundtrip(loader.state_dict())
    _same(expected[:6], got, "batches around a worker death")
    with make() as loader:
        loader.load_state_dict(state)
        _same(expected[6:], list(loader), "resumed after a death")


def test_bad_states_raise_value_errors_naming_the_mismatch():
    """Not a state, another num_workers, dataset length, batch size or sampler type: a ValueError that says which."""
    state = _state0(D.RangeDataset(N), batch_size=2)
    cases = [
        ("not a state", "not a loader state", D.RangeDataset(N), {"batch_size": 2}),
        ({"a": 1}, "not a loader state", D.RangeDataset(N), {"batch_size": 2}),
        (state, "num_workers mismatch", D.RangeDataset(N), {"batch_size": 2, "num_workers": 2}),
        (state, "dataset length mismatch", D.RangeDataset(N + 2), {"batch_size": 2}),
        (state, "batch size mismatch", D.RangeDataset(N), {"batch_size": 3}),
        (state, "sampler type mismatch", D.RangeDataset(N), {"batch_size": 2, "shuffle": True}),
    ]
    for bad, message, ds, kwargs in cases:
        loader = raydl.DataLoader(ds, **kwargs)
        with pytest.raises(ValueError, match=message):
            loader.load_state_dict(bad)


def test_state_is_plain_data_and_never_changes():
    """A state survives torch.load(weights_only=True) and JSON, and iterating on does not change a state taken."""
    loader = raydl.DataLoader(D.RangeDataset(N), batch_size=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    frozen = json.dumps(state, sort_keys=True)
    list(it)
    assert json.dumps(state, sort_keys=True) == frozen
    assert _roundtrip(state) == state


def test_generator_tracking_can_be_turned_off(monkeypatch):
    """RAYDL_TRACK_WORKER_RNG=0 (docs/resume.md): worker snapshots carry no generator states, and a
    dataset that draws no randomness in its workers still resumes exactly (torchdata parity)."""

    def rng_keys(track: str) -> bool:
        monkeypatch.setenv("RAYDL_TRACK_WORKER_RNG", track)
        loader = raydl.DataLoader(D.RandomAugmentDataset(N), batch_size=2, num_workers=2)
        it = iter(loader)
        next(it)
        next(it)
        state = loader.state_dict()
        loader.shutdown()
        return "_raydl_rng" in json.dumps(state)

    assert rng_keys("1")  # on by default: the check below can fail
    assert not rng_keys("0")
    check_resume(lambda: D.RangeDataset(N), _seq, num_workers=2, ks=(1, 3))


def _state0(ds, **kwargs) -> dict:
    loader = raydl.DataLoader(ds, **kwargs)
    it = iter(loader)
    next(it)
    return loader.state_dict()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_seeding_survives_a_resume(num_workers):
    """ray_seed="batch" seeds batch idx from (base seed, epoch, idx): a resume keeps the base seed, the epoch
    (persistent workers) and the idxs, so its batches are the uninterrupted run's."""
    extra = {"persistent_workers": True} if num_workers else {}
    check_resume(
        lambda: D.RandomAugmentDataset(N),
        lambda: {
            "batch_size": 2,
            "shuffle": True,
            "generator": torch.Generator().manual_seed(5),
            "ray_seed": "batch",
            **extra,
        },
        num_workers=num_workers,
        ks=(3,),
        epoch=1 if num_workers else 0,
        cross=False,
    )


def test_state_dict_before_any_iteration_describes_the_next_iterator():
    """As torchdata: state_dict() before iter() makes the iterator the next iter() returns, and describes its start."""
    loader = raydl.DataLoader(D.RangeDataset(N), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(4))
    state = _roundtrip(loader.state_dict())
    assert state["_num_yielded"] == 0 and state["_iterator_finished"] is False
    batches = list(loader)
    resumed = raydl.DataLoader(
        D.RangeDataset(N), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(4)
    )
    resumed.load_state_dict(state)
    _same(batches, list(resumed), "resumed from a state taken before any iteration")


def test_state_taken_after_a_resize_resumes_exactly_with_batch_seeding():
    """set_num_workers mid-epoch, then a state: with ray_seed="batch" a loader of the original size resumes exactly."""

    def make():
        return raydl.DataLoader(
            D.RandomAugmentDataset(16),
            batch_size=2,
            num_workers=2,
            ray_seed="batch",
            timeout=60,
            generator=torch.Generator().manual_seed(6),
        )

    with make() as loader:
        expected = list(loader)
    with make() as loader:
        it = iter(loader)
        got = [next(it) for _ in range(2)]
        loader.set_num_workers(3)
        got += [next(it) for _ in range(3)]
        state = _roundtrip(loader.state_dict())
    _same(expected[:5], got, "batches around a resize")
    with make() as loader:
        loader.load_state_dict(state)
        _same(expected[5:], list(loader), "resumed after a resize")
