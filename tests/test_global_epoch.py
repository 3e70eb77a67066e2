"""The job's epoch behind torch's DistributedSampler, and resume at another world size (NOTE [ raydl global epoch ]).

Ranks are simulated in one process, as DDP builds them: one loader per rank, each with
`DistributedSampler(num_replicas=W, rank=r)`, stepping in lockstep; the state of rank 0 after k
steps is what a trainer saves. The new job's ranks each load that state.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

import raydl
from tests._resume_parity import _roundtrip


class Augmented(Dataset):
    """Item i: [i, a torch draw, a `random` draw, a NumPy draw] — its content depends on how it was seeded."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.tensor(
            [i, int(torch.randint(0, 1 << 30, ())), random.randrange(1 << 30), int(np.random.randint(1 << 30))]
        )


def _loader(n, world, rank, batch, *, epoch=0, drop_last=False, shuffle=True, seed=3, num_workers=0, **kw):
    sampler = DistributedSampler(
        Augmented(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    sampler.set_epoch(epoch)
    extra = {"timeout": 60} if num_workers else {}
    return raydl.DataLoader(
        Augmented(n), batch_size=batch, sampler=sampler, num_workers=num_workers, ray_seed="sample", **extra, **kw
    )


def _rows(batches) -> list[tuple]:
    return [tuple(row) for b in batches for row in (b.view(-1, 4).tolist())]


def _global_batches(per_rank: list[list]) -> list[list[tuple]]:
    """Step j's global batch: the rows of every rank's batch j, sorted (a set, as DDP sees it)."""
    steps = max(len(b) for b in per_rank)
    return [sorted(r for batches in per_rank if j < len(batches) for r in _rows([batches[j]])) for j in range(steps)]


def _run(n, world, batch, **kw) -> list[list]:
    out = []
    for rank in range(world):
        loader = _loader(n, world, rank, batch, **kw)
        out.append(list(loader))
        loader.shutdown()
    return out


def _state_after(n, world, batch, k, **kw) -> dict:
    loader = _loader(n, world, 0, batch, **kw)
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = _roundtrip(loader.state_dict())
    loader.shutdown()
    return state


def _resumed(state, n, world, batch, **kw) -> list[list]:
    out = []
    for rank in range(world):
        loader = _loader(n, world, rank, batch, **kw)
        loader.load_state_dict(state)
        out.append(list(loader))
        loader.shutdown()
    return out


def check_redeal(n, old, new, k, *, drop_last=False, shuffle=True, epoch=0, num_workers=0, new_workers=None) -> None:
    """World size old=(W, B) -> new=(W', B') after k steps: the unconsumed samples once each (padding as torch pads
    for W'), every sample's content the uninterrupted run's, and with W * B == W' * B' the same global batches."""
    (w, b), (w2, b2) = old, new
    kw = {"drop_last": drop_last, "shuffle": shuffle, "epoch": epoch}
    full = _run(n, w, b, num_workers=num_workers, **kw)
    content = {row[0]: row for row in _rows(sum(full, []))}  # sample index -> its uninterrupted content
    state = _state_after(n, w, b, k, num_workers=num_workers, **kw)
    record = state["_raydl"]["global_epoch"]
    assert record["num_replicas"] == w and record["epoch"] == epoch
    rest = _resumed(state, n, w2, b2, num_workers=new_workers if new_workers is not None else num_workers, **kw)
    if (w, b) == (w2, b2) and new_workers in (None, num_workers):  # nothing to re-deal: each rank goes on exactly
        assert [_rows(r) for r in rest] == [_rows(batches[k:]) for batches in full]
        return
    consumed = {row[0] for batches in full for row in _rows(batches[:k])}
    got = [row for batches in rest for row in _rows(batches)]
    unconsumed = sorted(set(range(n)) - consumed)
    if not drop_last:
        assert sorted({row[0] for row in got}) == unconsumed, "a sample the old job had not consumed is missing"
        assert len(got) == -(-len(unconsumed) // w2) * w2, "padding is not torch's for the new world size"
    else:
        assert len(got) == len(unconsumed) // w2 * w2
    assert len({row[0] for row in got}) == min(len(got), len(unconsumed)), "a sample came twice before padding"
    for row in got:
        if row[0] in content:  # under drop_last the old run may never have made a dropped sample
            assert row == content[row[0]], f"sample {row[0]}: content differs from the uninterrupted run's"
    if w * b == w2 * b2 and not drop_last:
        old_steps, new_steps = _global_batches(full)[k:], _global_batches(rest)
        whole = len(unconsumed) // (w * b)  # global batches before any padding or partial batch
        assert new_steps[:whole] == old_steps[:whole], "global batches differ from the uninterrupted run's"


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_two_ranks_to_three_keeping_the_global_batch(k):
    """2 ranks x 3 -> 3 ranks x 2 at steps 0, 1, mid-epoch and past the end (a rank's last batch is partial)."""
    check_redeal(50, (2, 3), (3, 2), k)


@pytest.mark.parametrize("old,new", [((3, 2), (2, 3)), ((4, 2), (1, 8)), ((2, 4), (4, 2))])
def test_other_world_sizes(old, new):
    check_redeal(37, old, new, 2)


def test_drop_last_and_no_shuffle():
    check_redeal(41, (2, 3), (3, 2), 2, drop_last=True)
    check_redeal(41, (3, 2), (2, 3), 2, shuffle=False)


def test_a_later_epoch_uses_that_epochs_permutation():
    check_redeal(30, (2, 3), (3, 2), 1, epoch=4)


@pytest.mark.usefixtures("ray_session")
def test_ray_workers_two_ranks_to_three():
    """The same with Ray workers: 2 per rank before, 1 per rank after (a state of another num_workers re-deals)."""
    check_redeal(30, (2, 3), (3, 2), 2, num_workers=2, new_workers=1)


def test_a_redealt_epoch_resumes_again_at_a_third_world_size():
    """2 -> 3 ranks, a state in the re-dealt epoch, -> 1 rank: still every unconsumed sample once, same content."""
    n = 40
    full = _run(n, 2, 3)
    content = {row[0]: row for row in _rows(sum(full, []))}
    first = _state_after(n, 2, 3, 2)
    second = None
    consumed = {row[0] for batches in full for row in _rows(batches[:2])}
    for rank in range(3):
        loader = _loader(n, 3, rank, 2)
        loader.load_state_dict(first)
        it = iter(loader)
        consumed |= {row[0] for row in _rows([next(it), next(it)])}
        if rank == 0:
            second = _roundtrip(loader.state_dict())
            assert second["_raydl"]["global_epoch"]["start"] == 12
    final = _rows(sum(_resumed(second, n, 1, 6), []))
    assert sorted(row[0] for row in final) == sorted(set(range(n)) - consumed)
    assert all(row == content[row[0]] for row in final)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(5, 60), w=st.integers(1, 4), w2=st.integers(1, 4), b=st.integers(1, 5), data=st.data())
def test_property_any_world_sizes(n, w, w2, b, data):
    """Any dataset length, world sizes and step: the new ranks get exactly the unconsumed samples (then padding)."""
    steps = -(-(-(-n // w)) // b)  # noqa: B002 (ceil of ceil) batches per rank
    k = data.draw(st.integers(0, steps))
    b2 = data.draw(st.integers(1, 5))
    check_redeal(n, (w, b), (w2, b2), k)


def test_same_world_size_resumes_the_rank_exactly():
    """World size, batch size and num_workers unchanged: no re-deal, rank 0's state resumes rank 0 exactly."""
    full = _run(30, 2, 3)
    state = _state_after(30, 2, 3, 2)
    loader = _loader(30, 2, 0, 3)
    loader.load_state_dict(state)
    assert _rows(list(loader)) == _rows(full[0][2:])


def test_states_that_cannot_be_redealt_are_refused():
    state = _state_after(30, 2, 3, 2)
    cases = [
        (_loader(31, 3, 0, 2), "dataset_len was 30 when the state was saved and is 31"),
        (_loader(30, 3, 0, 2, seed=4), "seed was 3 when the state was saved and is 4"),
        (_loader(30, 3, 0, 2, shuffle=False), "shuffle was True"),
        (raydl.DataLoader(Augmented(30), batch_size=2, shuffle=True), "has none"),
    ]
    for loader, message in cases:
        with pytest.raises(ValueError, match=message):
            loader.load_state_dict(state)


def test_sample_seeding_is_independent_of_batch_and_workers():
    """ray_seed="sample": a sample's content is the same whatever batch size or pool makes it."""

    def rows(**kw):
        return sorted(_rows(list(_loader(24, 1, 0, **kw))))

    assert rows(batch=4) == rows(batch=5) == rows(batch=None)


@pytest.mark.usefixtures("ray_session")
def test_sample_seeding_with_ray_workers_matches_in_process():
    loader = _loader(24, 1, 0, 4, num_workers=2)
    with_workers = sorted(_rows(list(loader)))
    loader.shutdown()
    assert with_workers == sorted(_rows(list(_loader(24, 1, 0, 5))))


def test_sample_seeding_restores_the_callers_generators():
    torch.manual_seed(1)
    torch.empty((), dtype=torch.int64).random_()  # the iterator's base seed, drawn as torch draws it
    expected = torch.rand(3)
    torch.manual_seed(1)
    list(_loader(12, 1, 0, 4))
    assert torch.equal(torch.rand(3), expected)


def test_sample_seeding_refuses_what_it_cannot_key():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ValueError, match="IterableDataset's samples have none"):
        raydl.DataLoader(Stream(), batch_size=2, ray_seed="sample")
    with pytest.raises(ValueError, match="ray_threads_per_worker=1"):
        raydl.DataLoader(Augmented(4), batch_size=2, ray_seed="sample", ray_threads_per_worker=2)


def test_distributed_sampler_state_interchanges_with_statefuldataloader():
    """The job's record is raydl's own section: with the world size kept, states move between raydl and torchdata's
    StatefulDataLoader both ways, batch for batch (tests/_resume_parity.py)."""
    from tests import _datasets as D
    from tests._resume_parity import check_resume

    def kwargs():
        sampler = DistributedSampler(D.RangeDataset(21), num_replicas=2, rank=1, shuffle=True, seed=5)
        sampler.set_epoch(2)
        return {"batch_size": 3, "sampler": sampler}

    check_resume(lambda: D.RangeDataset(21), kwargs, num_workers=0, ks=(0, 1, 2))
