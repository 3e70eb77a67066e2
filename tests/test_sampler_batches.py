"""`BatchIter` over torch's random samplers takes a batch's indices at once (`RngSamplerIter.take`): the batches,
the global RNG afterwards and the checkpoint state are what torch's `BatchSampler` and one `next` per index give."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from raydl.driver.state.samplers import BatchIter, RngSamplerIter


def _samplers(seeded: bool):
    g = (lambda: torch.Generator().manual_seed(5)) if seeded else (lambda: None)
    weights = torch.rand(50, generator=torch.Generator().manual_seed(2)).tolist()
    return {
        "random": lambda: RandomSampler(range(103), generator=g()),
        "random_replacement": lambda: RandomSampler(range(103), replacement=True, num_samples=77, generator=g()),
        "subset": lambda: SubsetRandomSampler(list(range(3, 90, 2)), generator=g()),
        "weighted": lambda: WeightedRandomSampler(weights, 61, generator=g()),
    }


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("kind", ["random", "random_replacement", "subset", "weighted"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_and_global_rng_are_torchs(kind, seeded, drop_last):
    make = _samplers(seeded)[kind]
    torch.manual_seed(11)
    want = list(BatchSampler(make(), 8, drop_last))
    after_torch = torch.rand(3)
    torch.manual_seed(11)
    got = list(BatchIter(BatchSampler(make(), 8, drop_last)))
    assert got == want
    assert torch.equal(torch.rand(3), after_torch)


@pytest.mark.parametrize("kind", ["random", "subset", "weighted"])
def test_state_after_some_batches_resumes_the_same_epoch(kind):
    make = _samplers(True)[kind]
    first = BatchIter(BatchSampler(make(), 8, False))
    taken = [next(first), next(first), next(first)]
    sd = first.state_dict()
    assert sd["samples_yielded"] == sum(map(len, taken))
    assert sd["sampler_iter_state"][RngSamplerIter.YIELDED] == sd["samples_yielded"]
    rest = list(first)
    again = BatchIter(BatchSampler(make(), 8, False))
    again.load_state_dict(sd)
    assert list(again) == rest


def test_take_counts_what_it_gives():
    it = RngSamplerIter(RandomSampler(range(10), generator=torch.Generator().manual_seed(1)))
    one_by_one = RngSamplerIter(RandomSampler(range(10), generator=torch.Generator().manual_seed(1)))
    assert it.take(4) == [next(one_by_one) for _ in range(4)]
    assert it.take(100) == list(one_by_one)  # the epoch's end: fewer than asked
    assert it.take(5) == [] and it.yielded == 10


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["random", "random_replacement", "subset", "weighted", "random_num_samples"]),
    n=st.integers(1, 120),
    num_samples=st.integers(1, 300),
    steps=st.lists(st.integers(0, 70), min_size=1, max_size=40),
    resume_at=st.integers(0, 39),
)
def test_takes_and_nexts_mixed_give_torchs_samples_and_resume(kind, n, num_samples, steps, resume_at):
    """NOTE [ raydl sampler take ]: `take` reads the list torch's generator delegates to; mixed with `next` (0 in
    `steps`), across the generator's chunks (replacement: 32 samples each; num_samples > n: a new permutation), and
    resumed from a state taken between two steps, the samples are the sampler's own, in its order."""
    g = lambda: torch.Generator().manual_seed(n * 1000 + num_samples)  # noqa: E731
    make = {
        "random": lambda: RandomSampler(range(n), generator=g()),
        "random_replacement": lambda: RandomSampler(range(n), replacement=True, num_samples=num_samples, generator=g()),
        "random_num_samples": lambda: RandomSampler(range(n), num_samples=num_samples, generator=g()),
        "subset": lambda: SubsetRandomSampler(list(range(n)), generator=g()),
        "weighted": lambda: WeightedRandomSampler([1.0 + i % 3 for i in range(n)], num_samples, generator=g()),
    }[kind]
    want = list(make())
    it, got, state = RngSamplerIter(make()), [], None
    for k, step in enumerate(steps):
        if k == resume_at:
            state = (it.state_dict(), len(got))
        if step == 0:
            value = next(it, None)
            got += [] if value is None else [value]
        else:
            taken = it.take(step)
            assert len(taken) == min(step, len(want) - len(got))
            got += taken
    got += it.take(len(want) + 1)
    assert got == want and it.yielded == len(want)
    if state is not None:
        resumed = RngSamplerIter(make())
        resumed.load_state_dict(state[0])
        assert resumed.take(len(want) + 1) == want[state[1] :]


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("by", ["batches", "samples"])
@pytest.mark.parametrize("num_samples", [None, 206, 150])
def test_an_epoch_of_random_sampler_skips_the_remainder_draw_only_for_its_private_generator(
    monkeypatch, own, by, num_samples
):
    """NOTE [ raydl sampler end ]: with no generator of the sampler's own (shuffle=True's default) the epoch ends at
    its last sample without torch's trailing `randperm` of a remainder sliced to nothing: one draw fewer, the same
    samples and global RNG. With the sampler's own generator every draw is made, so the generator ends where torch
    leaves it (the next epoch depends on it)."""
    real = torch.randperm
    draws = []
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: draws.append(a) or real(*a, **k))

    def make():
        g = torch.Generator().manual_seed(9) if own else None
        return RandomSampler(range(103), num_samples=num_samples, generator=g)

    torch.manual_seed(4)
    reference = make()
    want = list(BatchSampler(reference, 8, False)) if by == "batches" else list(reference)
    torch_draws, draws[:] = len(draws), []
    after_torch = torch.rand(2)
    torch.manual_seed(4)
    sampler = make()
    got = list(BatchIter(BatchSampler(sampler, 8, False))) if by == "batches" else list(RngSamplerIter(sampler))
    assert got == want and torch.equal(torch.rand(2), after_torch)
    assert torch_draws == -(-len(reference) // 103) + (len(reference) % 103 == 0)
    assert len(draws) == torch_draws - (not own and len(reference) % 103 == 0)
    if own:
        assert torch.equal(sampler.generator.get_state(), reference.generator.get_state())
