"""`ray_seed="batch"`: a batch's random draws depend on its position in the epoch, not on the pool (NOTE [ raydl batch seeding ])."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import raydl
from raydl.worker.seeding import batch_seed_words
from tests import _datasets as D

TIMEOUT_S = 60
N, BATCH = 30, 3


def _draws(batches) -> list:
    """The random draws of each batch (RandomAugmentDataset), without the worker id and seed fields."""
    return [(b["i"].tolist(), b["torch"].tolist(), b["numpy"].tolist(), b["random"].tolist()) for b in batches]


def _run(num_workers: int, seed_mode: str = "batch", **kwargs) -> tuple[list, set]:
    loader = raydl.DataLoader(
        D.RandomAugmentDataset(N),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        num_workers=num_workers,
        timeout=TIMEOUT_S if num_workers else 0,
        ray_seed=seed_mode,
        **kwargs,
    )
    batches = list(loader)
    return _draws(batches), {w for b in batches for w in b["worker"].tolist()}


def test_ray_seed_is_validated_and_kept():
    """ray_seed accepts 'worker' (default), 'batch' and 'sample', is kept as an attribute, and anything else is a
    clear error."""
    assert raydl.DataLoader(D.RangeDataset(4)).ray_seed == "worker"
    assert raydl.DataLoader(D.RangeDataset(4), ray_seed="batch").ray_seed == "batch"
    assert raydl.DataLoader(D.RangeDataset(4), ray_seed="sample").ray_seed == "sample"
    for bad in ("samples", "", 1):
        with pytest.raises(ValueError, match="ray_seed should be 'worker'.*'batch'.* or 'sample'"):
            raydl.DataLoader(D.RangeDataset(4), ray_seed=bad)


def test_batch_seed_words_are_distinct_per_position_and_epoch():
    """Different positions, epochs or base seeds give different seeds; the same triple the same seed."""
    seen = {tuple(batch_seed_words(b, e, i)) for b in (0, 2**62 + 3) for e in range(3) for i in range(200)}
    assert len(seen) == 2 * 3 * 200
    assert (batch_seed_words(7, 1, 9) == batch_seed_words(7, 1, 9)).all()


def test_in_process_batch_seeding_restores_the_callers_generators():
    """num_workers=0 with ray_seed='batch': the caller's random, torch and NumPy streams are as before the epoch."""
    random.seed(1), torch.manual_seed(1), np.random.seed(1)
    expected = (random.random(), torch.rand(1).item(), np.random.rand())
    random.seed(1), torch.manual_seed(1), np.random.seed(1)
    loader = raydl.DataLoader(
        D.RandomAugmentDataset(9), batch_size=3, generator=torch.Generator().manual_seed(0), ray_seed="batch"
    )
    assert len(list(loader)) == 3
    assert (random.random(), torch.rand(1).item(), np.random.rand()) == expected


@pytest.mark.usefixtures("ray_session")
def test_batch_seeding_is_the_same_with_any_number_of_workers():
    """With ray_seed='batch', 0 (in-process), 1, 2 and 5 workers give identical batches; torch's seeding does not."""
    reference, workers = _run(0)
    assert workers == {-1}
    for num_workers in (1, 2, 5):
        draws, workers = _run(num_workers)
        assert workers == set(range(num_workers)), "get_worker_info() must keep working in every worker"
        assert draws == reference, f"{num_workers} workers"
    # The test can fail: with torch's per-worker seeding the pool size changes the draws.
    assert _run(1, "worker")[0] != _run(2, "worker")[0]


@pytest.mark.usefixtures("ray_session")
def test_batch_seeding_survives_a_replaced_worker_and_differs_per_epoch():
    """A worker killed mid-epoch is replaced and the batches are still the undisturbed ones; later epochs draw anew."""
    import ray

    reference, _ = _run(0)
    loader = raydl.DataLoader(
        D.RandomAugmentDataset(N),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        num_workers=2,
        timeout=TIMEOUT_S,
        persistent_workers=True,
        ray_seed="batch",
    )
    it = iter(loader)
    batches = [next(it)]
    ray.kill(it._pool.actors[1], no_restart=True)
    batches += list(it)
    assert it._pool.restarts == [0, 1], "the worker was not replaced: the test exercised nothing"
    assert _draws(batches) == reference
    second = _draws(loader)  # persistent workers: epoch 1 of the same iterator
    # Same base seed (persistent workers keep the iterator), but the epoch is part of each batch's seed.
    assert all(a[1] != b[1] for a, b in zip(second, reference))
    loader.shutdown()


@pytest.mark.usefixtures("unpatched")
def test_patched_torch_loader_in_process_uses_batch_seeding():
    """raydl.patched(ray_seed='batch'): a torch DataLoader with num_workers=0 gives raydl's batch-seeded batches."""
    reference, _ = _run(0)
    with raydl.patched(ray_seed="batch"):
        loader = torch.utils.data.DataLoader(
            D.RandomAugmentDataset(N), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5)
        )
        assert _draws(loader) == reference
