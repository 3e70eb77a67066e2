"""On a CUDA machine: pinned and on-device batches are torch's batches, bit for bit (skipped without CUDA)."""

from __future__ import annotations

import collections

import pytest
import torch

import raydl
from tests import _datasets as D
from tests._parity import assert_batches_equal

pytestmark = [
    pytest.mark.usefixtures("ray_session"),
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA unavailable"),
]

TIMEOUT_S = 60


def _tensors(batch):
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, collections.abc.Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)


def _torch_batches(dataset, **kwargs):
    return list(torch.utils.data.DataLoader(dataset, num_workers=2, multiprocessing_context="fork", **kwargs))


@pytest.mark.parametrize("shuffle", [False, True])
def test_pin_memory_batches_are_torchs_and_pinned(shuffle):
    """pin_memory=True: every tensor pinned (so not a view of the object store), equal to torch's pinned batch."""
    kwargs = dict(batch_size=4, shuffle=shuffle, pin_memory=True)
    expected = _torch_batches(D.ImageDataset(24), generator=torch.Generator().manual_seed(5), **kwargs)
    loader = raydl.DataLoader(
        D.ImageDataset(24), num_workers=2, timeout=TIMEOUT_S, generator=torch.Generator().manual_seed(5), **kwargs
    )
    actual = list(loader)
    assert len(actual) == len(expected)
    for i, (e, a) in enumerate(zip(expected, actual)):
        assert_batches_equal(e, a, f"batch {i}")
        # Pinned means copied out of the object store (its pages are never pinned): the user's own memory.
        assert all(t.is_pinned() for t in _tensors(a)), f"batch {i}: a tensor is not pinned"


def test_ray_device_hands_out_torchs_batches_on_the_gpu():
    """ray_device='cuda': batches arrive on the GPU, equal to torch's batches moved there, usable at once."""
    kwargs = dict(batch_size=4, shuffle=True)
    expected = _torch_batches(D.ImageDataset(24), generator=torch.Generator().manual_seed(7), **kwargs)
    loader = raydl.DataLoader(
        D.ImageDataset(24),
        num_workers=2,
        timeout=TIMEOUT_S,
        ray_device="cuda",
        generator=torch.Generator().manual_seed(7),
        **kwargs,
    )
    seen = 0
    for i, (e, a) in enumerate(zip(expected, loader)):
        assert all(t.is_cuda for t in _tensors(a)), f"batch {i}: a tensor is not on the GPU"
        a["image"].add_(0)  # a step on the current stream uses the batch at once
        assert_batches_equal(
            e, {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}, f"batch {i}"
        )
        seen += 1
    assert seen == len(expected)


def test_ray_device_survives_a_worker_death(tmp_path):
    """Recovery and the device copy together: a worker exiting mid-epoch still gives torch's batches on the GPU."""
    expected = [b.tolist() for b in torch.utils.data.DataLoader(D.RangeDataset(30), batch_size=3)]
    loader = raydl.DataLoader(
        D.ExitOnceDataset(30, bad_index=17, marker=str(tmp_path / "died")),
        batch_size=3,
        num_workers=2,
        timeout=TIMEOUT_S,
        ray_device="cuda",
    )
    actual = []
    for b in loader:
        assert b.is_cuda
        actual.append(b.cpu().tolist())
    assert (tmp_path / "died").exists()
    assert actual == expected
