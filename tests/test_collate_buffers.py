"""Collate buffers (NOTE [ raydl collate buffers ]): a worker stacks large batches into memory it reuses, never
while a batch in it is still on its way; the batches stay torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import raydl
from raydl._constants import REUSE_KEEP, REUSE_MIN_BYTES, REUSE_SHAPES
from raydl.worker.collate import BatchBuffers
from tests import _datasets as D
from tests._parity import assert_batches_equal, assert_epochs_equal, run_epochs

TIMEOUT_S = 120


class BigSampleDataset(D.RangeDataset):
    """48 KiB float32 'images' (a batch of 24 is over REUSE_MIN_BYTES) with a random draw made in the worker."""

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        image = torch.rand(3, 64, 64, generator=g) + torch.rand(1)  # torch.rand(1): the worker's seeded RNG
        return {"image": image, "ids": np.arange(i, i + 8), "label": i}


def _reused(loader) -> list[int]:
    import ray

    actors = loader._iterator._pool.actors
    return ray.get([a.__ray_call__.remote(lambda w: w._body._buffers.reused) for a in actors], timeout=TIMEOUT_S)


@pytest.mark.usefixtures("ray_session")
def test_default_configuration_reuses_buffers_and_matches_torch():
    """shuffle=True, no generator, persistent workers, 3 epochs, every batch kept: torch's batches, and the workers
    stacked at least half of them into memory they had used before (the first batches of each call into fresh memory:
    19 of the 30 in one run, 20 or more in the others, by how the calls fell)."""
    assert 24 * 3 * 64 * 64 * 4 >= REUSE_MIN_BYTES
    kwargs = dict(batch_size=24, shuffle=True, num_workers=2, persistent_workers=True)
    torch.manual_seed(3)
    expected = run_epochs(torch.utils.data.DataLoader(BigSampleDataset(240), **kwargs), 3)
    torch.manual_seed(3)
    with raydl.DataLoader(BigSampleDataset(240), timeout=TIMEOUT_S, **kwargs) as loader:
        actual = run_epochs(loader, 3)
        reused = _reused(loader)
    assert_epochs_equal(expected, actual)
    assert sum(reused) >= 15, f"30 batches, yet only {reused} were stacked into a kept buffer"


@pytest.mark.usefixtures("ray_session")
def test_batches_of_one_call_never_share_a_buffer():
    """Four batches a call: a call's batches are all alive until it returns, so each needs its own buffer (a buffer
    reused while held would make them equal); later calls reuse the freed ones."""
    kwargs = dict(
        batch_size=24, shuffle=True, generator=torch.Generator().manual_seed(5), num_workers=2, persistent_workers=True
    )
    expected = run_epochs(torch.utils.data.DataLoader(BigSampleDataset(480), **kwargs), 2)
    kwargs["generator"] = torch.Generator().manual_seed(5)
    with raydl.DataLoader(BigSampleDataset(480), timeout=TIMEOUT_S, ray_batches_per_call=4, **kwargs) as loader:
        actual = run_epochs(loader, 2)
        reused = _reused(loader)
    assert_epochs_equal(expected, actual)
    assert sum(reused) > 0, reused


@pytest.mark.usefixtures("ray_session")
def test_an_idle_worker_keeps_no_buffer():
    """A worker given back to the warm pool drops its buffers (idle memory does not grow)."""
    import ray

    loader = raydl.DataLoader(BigSampleDataset(96), batch_size=24, num_workers=1, timeout=TIMEOUT_S)
    it = iter(loader)
    next(it), next(it)
    actor = it._pool.actors[0]
    held = ray.get(actor.__ray_call__.remote(lambda w: len(w._body._buffers._pools)), timeout=TIMEOUT_S)
    list(it)  # the epoch ends: the worker goes back to the warm pool
    after = ray.get(actor.__ray_call__.remote(lambda w: len(w._body._buffers._pools)), timeout=TIMEOUT_S)
    loader.shutdown()
    assert (held, after) == (1, 0)


def _samples(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(3, 64, 64, generator=g), {"ids": np.arange(4) + i, "w": float(i)}) for i in range(n)]


@pytest.mark.parametrize(
    "hold",
    [lambda t: t[3:], lambda t: torch.from_numpy(t.numpy()), lambda t: t],
    ids=["a view", "a NumPy alias", "the batch tensor"],
)
def test_a_buffer_is_never_written_while_anything_holds_it(hold):
    """While a view, a NumPy alias or the batch tensor itself is alive the buffer is not reused; once it is gone
    the next batch of the shape goes into it."""
    buffers = BatchBuffers()
    first = buffers(_samples(24, 1))
    address = first[0].data_ptr()
    keep = hold(first[0])
    want = keep.clone()
    del first
    second = buffers(_samples(24, 2))
    assert second[0].data_ptr() != address and buffers.reused == 0
    assert torch.equal(keep, want), "a held batch was overwritten"
    del keep
    third = buffers(_samples(24, 3))
    assert buffers.reused == 1 and third[0].data_ptr() == address
    assert torch.equal(third[0], default_collate(_samples(24, 3))[0])


def test_same_values_as_default_collate_and_same_errors():
    """Nested containers, NumPy arrays, numbers, small tensors: default_collate's values; mismatched shapes raise
    its error; tensors that need autograd take torch's own path."""
    buffers = BatchBuffers()
    for seed in range(3):
        samples = _samples(24, seed)
        got, want = buffers(samples), default_collate(samples)
        assert_batches_equal(want, got)
        del got
    assert buffers.reused == 2
    bad = [torch.zeros(3, 64, 64)] * 23 + [torch.zeros(3, 64, 65)]
    with pytest.raises(RuntimeError) as theirs:
        default_collate(bad)
    with pytest.raises(RuntimeError) as ours:
        buffers(bad)
    assert str(ours.value) == str(theirs.value)
    grad = [torch.zeros(3, 64, 64, requires_grad=True) for _ in range(24)]
    assert buffers(grad).requires_grad


def test_the_pool_is_bounded_and_cleared():
    """At most REUSE_KEEP buffers a shape and REUSE_SHAPES shapes are kept; clear() drops them."""
    buffers = BatchBuffers()
    held = [buffers(_samples(24)) for _ in range(REUSE_KEEP + 2)]  # all held: each gets fresh memory
    for n in range(25, 25 + REUSE_SHAPES + 1):
        held.append(buffers(_samples(n)))
    assert len(buffers._pools) == REUSE_SHAPES
    assert all(len(pool) <= REUSE_KEEP for pool in buffers._pools.values())
    assert buffers.reused == 0
    buffers.clear()
    assert not buffers._pools
