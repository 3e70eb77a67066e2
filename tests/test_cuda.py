"""On a CUDA machine: pinned and on-device batches are torch's batches, bit for bit (skipped without CUDA)."""

from __future__ import annotations

import collections

import pytest
import torch

import raydl
from tests import _datasets as D
from tests._parity import assert_batches_equal, assert_epochs_equal, run_epochs

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


# The paths a batch takes before it is pinned (issue 40): each checked for both hand-outs, pinned memory and the GPU.
MODES = ["pin_memory", "ray_device"]


class _Floats(D.RangeDataset):
    """Item i: {"x": `numel` float32 values i + k / numel, "i": i}, with `slow` items held back `delay_s` seconds."""

    def __init__(self, n: int, numel: int, slow=(), delay_s: float = 0.0) -> None:
        super().__init__(n)
        self.numel, self.slow, self.delay_s = numel, set(slow), delay_s

    def __getitem__(self, i):
        if i in self.slow:
            import time

            time.sleep(self.delay_s)
        return {"x": torch.arange(self.numel, dtype=torch.float32).div_(self.numel).add_(i), "i": i}


def _mode_kwargs(mode: str) -> dict:
    return {"pin_memory": True} if mode == "pin_memory" else {"ray_device": "cuda"}


def _handed_out(batch, mode: str, where: str):
    """The batch checked to be where `mode` puts it (every tensor pinned, or on the GPU), as host tensors."""
    if mode == "pin_memory":
        assert all(t.is_pinned() for t in _tensors(batch)), f"{where}: a tensor is not pinned"
        return batch
    assert all(t.is_cuda for t in _tensors(batch)), f"{where}: a tensor is not on the GPU"
    batch["x"].add_(0)  # a step on the current stream, at once
    return {k: v.cpu() for k, v in batch.items()}


def _epochs(loader, mode: str, epochs: int) -> list:
    return [[_handed_out(b, mode, f"epoch {e} batch {i}") for i, b in enumerate(loader)] for e in range(epochs)]


@pytest.mark.parametrize("mode", MODES)
def test_small_batches_on_lanes_reuse_receive_buffers(mode):
    """256 KiB batches (above the lane's out-of-band size, under its batch bound): they come over the lanes, their
    reply memory is used again (NOTE [ raydl receive buffers ], [ raydl lane memory ]) once the pinning copy is done
    with it, and every batch of 2 shuffled epochs equals torch's pinned one."""
    ds = _Floats(96, 16 * 1024)
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    expected = run_epochs(
        torch.utils.data.DataLoader(ds, pin_memory=True, generator=torch.Generator().manual_seed(3), **kwargs), 2
    )
    with raydl.DataLoader(
        ds, timeout=TIMEOUT_S, generator=torch.Generator().manual_seed(3), **_mode_kwargs(mode), **kwargs
    ) as loader:
        actual = _epochs(loader, mode, 2)
        calls = loader._iterator._calls
        assert calls.lane_calls > 0, "no batch came over a lane"
        lanes = calls._lanes
        memories = [lane.memory for lane in lanes._lanes.values() if getattr(lane, "memory", None) is not None]
        # local lanes read into their shared memory's slots (NOTE [ raydl lane memory ]), other lanes into buffers
        assert lanes._buffers.reused + sum(m.reused for m in memories) > 0, "no reply memory was used again"
    assert_epochs_equal(expected, actual)


@pytest.mark.parametrize("mode", MODES)
def test_large_batches_through_the_object_store(mode):
    """8 MiB batches (over the lane's bound): a worker on the driver's node keeps Ray's calls, the batch is read from
    the object store and copied into pinned memory, and equals torch's pinned batch."""
    from raydl._constants import LANE_MAX_BATCH_BYTES

    ds = _Floats(24, 512 * 1024)
    assert 4 * ds.numel * 4 > LANE_MAX_BATCH_BYTES
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2)
    expected = run_epochs(
        torch.utils.data.DataLoader(ds, pin_memory=True, generator=torch.Generator().manual_seed(4), **kwargs), 1
    )
    loader = raydl.DataLoader(
        ds, timeout=TIMEOUT_S, generator=torch.Generator().manual_seed(4), **_mode_kwargs(mode), **kwargs
    )
    it = iter(loader)
    actual = [[_handed_out(b, mode, f"batch {i}") for i, b in enumerate(it)]]
    assert it._calls.lane_calls == 0, "a large batch of a local worker took a lane"
    assert_epochs_equal(expected, actual)


@pytest.mark.parametrize("mode", MODES)
def test_out_of_order_batches_are_torchs(mode):
    """in_order=False with the first batch held back: every batch handed out is pinned (or on the GPU) and the epoch
    holds torch's batches, each once."""
    ds = _Floats(40, 16 * 1024, slow=range(4), delay_s=0.3)
    kwargs = dict(batch_size=4, num_workers=2, in_order=False)
    expected = run_epochs(torch.utils.data.DataLoader(ds, pin_memory=True, **kwargs), 1)[0]
    loader = raydl.DataLoader(ds, timeout=TIMEOUT_S, **_mode_kwargs(mode), **kwargs)
    actual = _epochs(loader, mode, 1)[0]
    by_first = sorted(actual, key=lambda b: int(b["i"][0]))
    assert_epochs_equal([sorted(expected, key=lambda b: int(b["i"][0]))], [by_first])


_COLD = """
import json, torch, raydl, ray
from tests import _datasets as D

kwargs = dict(batch_size=4, shuffle=True, num_workers=2)
expected = list(torch.utils.data.DataLoader(
    D.ImageDataset(16), pin_memory=True, generator=torch.Generator().manual_seed(9), **kwargs))
facts = {"ray_before": ray.is_initialized()}
for mode, extra in (("pin_memory", {"pin_memory": True}), ("ray_device", {"ray_device": "cuda"})):
    loader = raydl.DataLoader(D.ImageDataset(16), timeout=60, generator=torch.Generator().manual_seed(9),
                              **extra, **kwargs)
    got = list(loader)
    where = [all(t.is_pinned() if mode == "pin_memory" else t.is_cuda
                 for t in b.values() if isinstance(t, torch.Tensor)) for b in got]
    host = [{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in got]
    equal = len(host) == len(expected) and all(
        all(torch.equal(e[k], h[k]) if isinstance(e[k], torch.Tensor) else e[k] == h[k] for k in e)
        for e, h in zip(expected, host))
    facts[mode] = {"placed": all(where), "equal": equal, "batches": len(got)}
print("FACTS " + json.dumps(facts))
"""


def test_cold_start_in_a_fresh_driver():
    """A trainer with no Ray yet (a fresh interpreter): its first pinned, and its first on-device, epoch start Ray
    and are torch's batches (pinning keeps every batch in the workers: NOTE [ raydl cold start ])."""
    from tests._session import read_facts, run_python

    facts = read_facts(run_python(_COLD, timeout_s=300))
    assert facts["ray_before"] is False
    for mode in MODES:
        assert facts[mode] == {"placed": True, "equal": True, "batches": 4}, (mode, facts)
