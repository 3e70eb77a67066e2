"""A local lane's shared memory (NOTE [ raydl lane memory ]): replies written where the trainer reads them, a slot
given again only once nothing refers to its last reply, and the socket whenever a reply does not fit."""

from __future__ import annotations

import collections
import mmap

import numpy as np
import pytest
import torch

import raydl
from raydl.worker.lane_memory import ARENA_MARK, MemoryFull, dumps_into, loads_from
from raydl.worker.transfer import decode, encode
from tests._parity import assert_epochs_equal, run_epochs

TIMEOUT_S = 120
Pair = collections.namedtuple("Pair", "left right")


def _slots(memory: np.ndarray, n: int, size: int) -> tuple[list, list]:
    return [memory[i * size : (i + 1) * size] for i in range(n)], [(i * size, size) for i in range(n)]


def test_a_reply_in_lane_memory_comes_back_as_sent():
    """Every dtype a tensor view carries, 0-d, empty and 2-D shapes, nested containers, a namedtuple, strings and a
    pickled bfloat16 tensor: the same values, dtypes and shapes, the arrays over the slots' memory (writable)."""
    raw = mmap.mmap(-1, 4 * 65536)
    memory = np.frombuffer(raw, dtype=np.uint8)
    regions, slots = _slots(memory, 4, 65536)
    batch = {
        "f32": torch.randn(3, 5),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "bool": torch.tensor([True, False, True]),
        "half": torch.rand(7).half(),
        "complex": torch.randn(4, dtype=torch.complex64),
        "ints": [torch.arange(5, dtype=dt) for dt in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)],
        "pair": Pair(torch.ones(2), ("a", torch.full((2, 2), 3.0, dtype=torch.float64))),
        "bf16": torch.ones(3, dtype=torch.bfloat16),  # no NumPy dtype: pickled whole, in the message
        "text": ["x", "y"],
    }
    reply = ([encode(batch), encode({"again": torch.arange(10)})], [("meta", 1), ("meta", 2)])
    data = dumps_into(reply, memoryview(raw), slots)
    assert data[:4] == ARENA_MARK and len(data) < 4096
    batches, metas = loads_from(data, regions)
    got = decode(batches[0])
    assert metas == [("meta", 1), ("meta", 2)] and torch.equal(decode(batches[1])["again"], torch.arange(10))
    flat_expected, flat_got = _leaves(batch), _leaves(got)
    assert len(flat_expected) == len(flat_got)
    for e, g in zip(flat_expected, flat_got):
        if isinstance(e, torch.Tensor):
            assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)
        else:
            assert g == e
    assert isinstance(got["pair"], Pair)
    lo, hi = memory.ctypes.data, memory.ctypes.data + memory.nbytes
    assert lo <= got["f32"].data_ptr() < hi and lo <= got["ints"][4].data_ptr() < hi
    got["f32"].add_(1)  # writable, as torch's batches


def _leaves(x):
    if isinstance(x, dict):
        return [v for k in sorted(x) for v in _leaves(x[k])]
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _leaves(item)]
    return [x]


def test_a_reply_too_large_for_its_slots_is_memory_full_and_ids_outside_a_slot_are_refused():
    """A reply whose arrays overflow the slots raises MemoryFull (the worker then sends it over the socket); an id
    pointing past its slot's end is a ValueError, never a read of another slot's memory."""
    raw = mmap.mmap(-1, 2 * 8192)
    memory = np.frombuffer(raw, dtype=np.uint8)
    regions, slots = _slots(memory, 2, 8192)
    with pytest.raises(MemoryFull):
        dumps_into(([encode({"x": torch.zeros(3000)})], [None]), memoryview(raw), slots)  # 12 KB > a slot
    with pytest.raises(MemoryFull):
        dumps_into(([encode({"x": torch.zeros(1500)}) for _ in range(3)], [None] * 3), memoryview(raw), slots)
    data = dumps_into(([encode({"x": torch.zeros(1500)})], [None]), memoryview(raw), slots)
    with pytest.raises(ValueError):
        loads_from(data, [regions[0][:1000]])  # the slot the driver holds is shorter than the id says


def test_lane_memory_slots_are_given_again_only_when_free():
    """LaneMemory.take: k free slots, lowest first; a slot held by a call, or by an array made from its memory, is
    not given; with too few free the call gets none (and it is counted)."""
    from raydl.driver.transport.lane_memory import LaneMemory

    lm = LaneMemory(3, 5000)
    assert lm.slot_bytes == 8192 and lm.size == 3 * 8192
    arrays, slots = lm.take(2)
    assert slots == [(0, 8192), (8192, 8192)]
    assert lm.take(2) is None and lm.full == 1
    view = np.frombuffer(memoryview(arrays[0]), np.float32, 4, 64)  # what a reply's arrays hold
    del arrays
    again, slots = lm.take(2)
    assert slots == [(8192, 8192), (16384, 8192)] and lm.reused == 1  # slot 0 still used by `view`
    del again, view
    assert lm.take(3)[1][0] == (0, 8192)


@pytest.mark.parametrize("grow", [False, True])
def test_held_and_growing_batches_on_a_local_lane_match_torch(grow):
    """Persistent workers, 2 epochs on local lanes, every batch of the run kept by the caller: with batches of one
    size the lane's slots run out (replies then cross the socket); with batches growing to 48x the first one's
    size, past the slot size it set, those cross the socket. torch's batches throughout."""
    ds = _Growing(192, grow)
    kwargs = dict(batch_size=4, num_workers=2, persistent_workers=True)
    expected = run_epochs(torch.utils.data.DataLoader(ds, **kwargs), 2)
    with raydl.DataLoader(ds, timeout=TIMEOUT_S, ray_lane=True, **kwargs) as loader:
        actual = run_epochs(loader, 2)  # keeps every batch
        lanes = loader._iterator._calls._lanes
        memories = [lane.memory for lane in lanes._lanes.values() if lane.memory is not None]
        assert lanes.calls_sent > 0 and memories
        if not grow:
            assert sum(m.full for m in memories) > 0  # the kept batches held every slot
    assert_epochs_equal(expected, actual)
    if grow:
        slot = max(m.slot_bytes for m in memories)
        assert max(b.numel() * 4 for epoch in actual for b in epoch) > slot  # some batches outgrew their slots


class _Growing(torch.utils.data.Dataset):
    """Samples of 256 floats, or with `grow` of 256 more every four (a batch's samples stack): the first batches
    small, the last 48x larger."""

    def __init__(self, n: int, grow: bool) -> None:
        self.n, self.grow = n, grow

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256 * (1 + (i // 4 if self.grow else 0)),), float(i))
