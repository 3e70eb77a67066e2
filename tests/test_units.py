"""Pieces tested on their own, without Ray: seeding, the pin stage, warnings that match torch."""

from __future__ import annotations

import random
import threading
import warnings

import pytest
import torch

import raydl
from raydl.driver.device import PinStage
from raydl.worker.actor import numpy_seed_state
from tests import _datasets as D


def test_numpy_seed_matches_torchs_derivation():
    """raydl's NumPy seed for (base_seed, worker_id) equals torch's private derivation, bit for bit."""
    from torch.utils.data._utils.worker import _generate_state  # test-only use of the private reference

    rng = random.Random(7)
    for _ in range(500):
        base, wid = rng.getrandbits(63), rng.randrange(256)
        assert numpy_seed_state(base, wid) == _generate_state(base, wid)


class _Pinnable:
    """A custom batch type with its own pin_memory(), as torch's docs describe."""

    def __init__(self, value):
        self.value = value
        self.pinned = False

    def pin_memory(self):
        self.pinned = True
        return self


def _fake_pin(data):
    from raydl.driver.device import pin_memory as real_pin

    # Without an accelerator, tensors cannot be pinned here: mark them instead, and let
    # torch's recursive helper handle containers and custom types.
    if isinstance(data, torch.Tensor):
        return ("pinned", data)
    if isinstance(data, dict):
        return {k: _fake_pin(v) for k, v in data.items()}
    return real_pin(data)


def test_pin_stage_keeps_order_types_and_errors():
    """The pin thread returns items in submission order, pins custom types, and passes errors through in place."""
    stage = PinStage(_fake_pin)
    try:
        stage.submit_data({"x": torch.ones(1)})
        stage.submit_error(ValueError("boom"))
        custom = _Pinnable(3)
        stage.submit_data(custom)
        first = stage.take()
        assert first["x"][0] == "pinned"
        with pytest.raises(ValueError, match="boom"):
            stage.take()
        assert stage.take().pinned is True
        assert stage.in_flight == 0
    finally:
        stage.shutdown()
    assert not [t for t in threading.enumerate() if t.name == "raydl_pin"]
    stage.shutdown()  # idempotent


def test_pin_stage_reports_a_failing_pin():
    """An exception while pinning reaches the caller instead of killing the thread silently."""

    def bad_pin(data):
        raise RuntimeError("cannot pin")

    stage = PinStage(bad_pin)
    try:
        stage.submit_data(1)
        with pytest.raises(RuntimeError, match="cannot pin"):
            stage.take()
    finally:
        stage.shutdown()


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator path")
def test_pin_memory_without_accelerator_warns_like_torch(ray_session):
    """pin_memory=True without an accelerator: torch's warning, and the batches are unchanged."""
    with warnings.catch_warnings(record=True) as torch_w:
        warnings.simplefilter("always")
        expected = [b.tolist() for b in torch.utils.data.DataLoader(D.RangeDataset(4), batch_size=2, pin_memory=True)]
    with warnings.catch_warnings(record=True) as raydl_w:
        warnings.simplefilter("always")
        actual = [b.tolist() for b in raydl.DataLoader(D.RangeDataset(4), batch_size=2, pin_memory=True, num_workers=2)]
    assert actual == expected
    torch_msgs = {str(w.message) for w in torch_w if "pin_memory" in str(w.message)}
    raydl_msgs = {str(w.message) for w in raydl_w if "pin_memory" in str(w.message)}
    assert torch_msgs and torch_msgs == raydl_msgs


def test_iterable_length_warning_like_torch(ray_session):
    """An IterableDataset whose __len__ under-reports triggers torch's warning after len(loader) was read."""
    loader = raydl.DataLoader(D.UnshardedIterable(4, reported_len=2), batch_size=None, num_workers=2, timeout=60)
    assert len(loader) == 2
    with pytest.warns(UserWarning, match="Length of IterableDataset .* was reported to be 2"):
        batches = list(loader)
    assert sorted(batches) == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA unavailable")
@pytest.mark.gpu
def test_pin_memory_on_cuda(ray_session):
    """With CUDA, batches come back pinned, in order, for tensors, dicts and namedtuples."""
    loader = raydl.DataLoader(D.DictDataset(8), batch_size=2, pin_memory=True, num_workers=2, timeout=60)
    batches = list(loader)
    assert len(batches) == 4
    assert all(b["x"].is_pinned() for b in batches)
    assert [b["id"].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_ray_device_without_cuda_is_a_clear_error(ray_session):
    """ray_device='cuda' where CUDA is absent fails at iteration with a message naming the option."""
    loader = raydl.DataLoader(D.RangeDataset(4), num_workers=1, ray_device="cuda")
    with pytest.raises(ValueError, match="ray_device='cuda' but CUDA is not available"):
        iter(loader)
    with pytest.raises(TypeError, match="ray_device"):
        raydl.DataLoader(D.RangeDataset(4), num_workers=1, ray_device=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA unavailable")
@pytest.mark.gpu
def test_device_copier_overlaps_and_synchronises():
    """DeviceCopier copies pinned batches on a side stream; finish() makes the current stream wait; values intact."""
    from raydl.driver.device import DeviceCopier, PinStage, pin_memory

    copier = DeviceCopier(torch.device("cuda", 0))
    stage = PinStage(lambda data: copier(pin_memory(data)))
    try:
        batches = [{"x": torch.full((1024, 1024), float(i)), "y": torch.tensor([i])} for i in range(6)]
        for b in batches[:2]:
            stage.submit_data(b)
        out = []
        for i in range(6):
            got = copier.finish(stage.take())
            if i + 2 < 6:
                stage.submit_data(batches[i + 2])
            got["x"].mul_(2)  # a step on the current stream, after the copy's event
            out.append(got)
        torch.cuda.synchronize()
        assert all(o["x"].is_cuda and float(o["x"][0, 0]) == 2 * i and int(o["y"]) == i for i, o in enumerate(out))
    finally:
        stage.shutdown()


def test_kept_units_let_the_oldest_go_by_bytes_and_pickle_empty():
    """The units a worker keeps between batches (data/units.py KeptUnits): least recently used out first once past
    the byte limit, never the last one; a unit kept again counts its new size; a pickled copy keeps nothing."""
    import pickle

    from raydl.data.units import KeptUnits

    kept = KeptUnits()
    for u in range(3):
        kept.put(u, f"u{u}", 10, limit=30)
    assert kept.split([0, 5, 2]) == ({0: "u0", 2: "u2"}, [5])  # 0 and 2 now the most recent: 1 goes first
    kept.put(3, "u3", 10, limit=30)
    assert kept.keys() == [0, 2, 3]
    kept.put(0, "u0 again", 25, limit=30)  # 0's size is now 25, not 35: only 2 and 3 go
    assert kept.keys() == [0] and kept.split([0]) == ({0: "u0 again"}, [])
    kept.put(9, "huge", 100, limit=30)
    assert kept.keys() == [9], "one unit is kept even past the limit"
    copy = pickle.loads(pickle.dumps(kept))
    assert len(copy) == 0 and copy.split([9]) == ({}, [9]) and len(kept) == 1
    with copy.lock:
        pass
