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
from tests._parity import assert_epochs_equal, run_epochs, torch_epochs

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
    assert lm.take(2) is None and lm.counts.no_slots == 1
    view = np.frombuffer(memoryview(arrays[0]), np.float32, 4, 64)  # what a reply's arrays hold
    del arrays
    again, slots = lm.take(2)
    assert slots == [(8192, 8192), (16384, 8192)] and lm.reused == 1  # slot 0 still used by `view`
    del again, view
    assert lm.take(3)[1][0] == (0, 8192)


@pytest.mark.parametrize("grow", [False, True])
def test_held_and_growing_batches_on_a_local_lane_match_torch(ray_session, grow):
    """Persistent workers, 2 epochs on local lanes, every batch of the run kept by the caller: with batches of one
    size the lane's slots run out (replies then cross the socket); with batches growing to 48x the first one's
    size the memory grows with them, up to its cap (then the socket). torch's batches throughout: those in a
    memory since replaced included."""
    ds = _Growing(192, grow)
    kwargs = dict(batch_size=4, num_workers=2, persistent_workers=True)
    expected = torch_epochs(ds, 2, **kwargs)
    with raydl.DataLoader(ds, timeout=TIMEOUT_S, ray_lane=True, **kwargs) as loader:
        actual = run_epochs(loader, 2)  # keeps every batch
        lanes = loader._iterator._calls._lanes
        memories = [lane.memory for lane in lanes._lanes.values() if lane.memory is not None]
        figures = loader.stats().lane_memory
        assert lanes.calls_sent > 0 and memories
        if not grow:
            assert figures["calls_without_slots"] > 0  # kept: every slot held
            assert figures["regrown"] == figures["replies_did_not_fit"] == 0
        else:
            assert figures["regrown"] > 0 and figures["replies_did_not_fit"] > 0
            assert figures["mapped_bytes"] > sum(m.size for m in memories)  # replaced ones still hold kept batches
    assert_epochs_equal(expected, actual)


def _memory_figures(loader) -> dict:
    """The loader's lane memory figures, checked for what holds whatever the run: the replies counted are at most
    the lane calls; the memory mapped is whole pages; the text form says them."""
    stats = loader.stats()
    m = stats.lane_memory
    assert m is not None and set(m) == {
        "replies_in_memory",
        "replies_did_not_fit",
        "replies_refused",
        "replies_failed",
        "calls_without_slots",
        "calls_paused",
        "regrown",
        "slot_bytes",
        "mapped_bytes",
    }
    replies = sum(m[k] for k in ("replies_in_memory", "replies_did_not_fit", "replies_refused", "replies_failed"))
    assert replies + m["calls_without_slots"] + m["calls_paused"] <= loader._iterator._calls.lane_calls
    assert m["mapped_bytes"] > 0 and m["mapped_bytes"] % 4096 == 0 and m["slot_bytes"] % 4096 == 0
    assert f"{m['replies_in_memory']} replies through it" in str(stats)
    return m


def test_batches_growing_past_the_first_go_through_a_larger_memory(ray_session):
    """The first batches 64 KiB (the memory's slots: 160 KiB), the rest 4x that: the first larger reply crosses the
    socket marked as not fitting, the lane's memory grows, and the larger batches go through it; every batch
    torch's, those held from before the memory grew included. Two epochs: lanes open once a worker's first batch
    is in, which on a busy host may be late in the first."""
    ds = _StepUp(96, small=16)
    kwargs = dict(batch_size=4, num_workers=2, persistent_workers=True)
    expected = torch_epochs(ds, 2, **kwargs)
    with raydl.DataLoader(ds, timeout=TIMEOUT_S, ray_lane=True, **kwargs) as loader:
        actual = run_epochs(loader, 2)  # keeps every batch
        m = _memory_figures(loader)
        assert m["regrown"] >= 1 and m["replies_did_not_fit"] >= 1
        assert m["slot_bytes"] >= 1.5 * 4 * 4 * 16384  # a slot for a larger batch
        assert m["replies_in_memory"] > 2 * 16 // 4  # more than the small batches: larger ones went through memory
        assert m["replies_refused"] == m["replies_failed"] == 0
    assert_epochs_equal(expected, actual)


def test_batches_past_the_cap_cross_the_socket_counted_intact(ray_session, monkeypatch):
    """With the memory's cap at its first size it cannot grow: each larger batch crosses the socket, counted as not
    fitting, and arrives as torch's; after such replies the lane's calls pause the memory (two epochs: calls sent
    after the first large replies are read)."""
    from raydl.driver.transport import lane_memory

    monkeypatch.setattr(lane_memory, "LANE_MEMORY_MAX_SLOT_BYTES", 160 * 1024)
    ds = _StepUp(48, small=16)
    kwargs = dict(batch_size=4, num_workers=2, persistent_workers=True)
    expected = torch_epochs(ds, 2, **kwargs)
    with raydl.DataLoader(ds, timeout=TIMEOUT_S, ray_lane=True, **kwargs) as loader:
        actual = run_epochs(loader, 2)
        m = _memory_figures(loader)
        assert m["regrown"] == 0 and m["replies_did_not_fit"] >= 1 and m["slot_bytes"] == 160 * 1024
        assert m["calls_paused"] >= 1  # the worker stops pickling each large batch twice
    assert_epochs_equal(expected, actual)


def test_a_batch_the_plain_pickler_refuses_is_counted_and_arrives(ray_session):
    """A batch carrying a local function (pickle refuses it, cloudpickle sends it): over the socket, counted as
    refused, its tensors torch's and its function working."""
    ds = _Growing(32, False)
    kwargs = dict(batch_size=4, collate_fn=_collate_with_local_function)
    expected = [b for b, _ in torch.utils.data.DataLoader(ds, **kwargs)]  # (its workers' pickle refuses the batches)
    with raydl.DataLoader(
        ds, num_workers=2, persistent_workers=True, timeout=TIMEOUT_S, ray_lane=True, **kwargs
    ) as loader:
        got = run_epochs(loader, 2)  # (the second on the lanes the first opened)
        m = _memory_figures(loader)
        assert m["replies_refused"] >= 1 and m["replies_in_memory"] == m["replies_failed"] == 0
        assert m["calls_paused"] >= 1  # the worker stops trying the memory for a while
    assert_epochs_equal([expected, expected], [[b for b, _ in epoch] for epoch in got])
    assert all(f(3) == 9 for epoch in got for _, f in epoch)


def _collate_with_local_function(samples):
    def square(x):
        return x * x

    return torch.utils.data.default_collate(samples), square


def test_a_lane_pauses_its_memory_while_replies_cannot_use_it(monkeypatch):
    """A reply refused by the plain pickler, or larger than the cap allows, makes the lane's next calls go without
    slots: 1, then 2, 4, ... after each next such reply, at most LANE_MEMORY_MAX_PAUSE; a reply through the memory
    ends the pauses. A reply too large for slots that can still grow makes a larger memory, no pause."""
    import socket
    from multiprocessing.connection import Connection

    from raydl._constants import LANE_MEMORY_MAX_PAUSE
    from raydl.driver.transport import lane_memory
    from raydl.driver.transport.lane_conn import Lane
    from raydl.driver.transport.lane_memory import LaneMemory

    here, there = socket.socketpair()
    try:
        lane = Lane(None, Connection(here.detach()), LaneMemory(4, 8192))

        def run(replies: list, nbytes: int = 100_000) -> list:
            """For each reply (its `how`), the calls without slots sent before the next call given slots."""
            skipped = []
            for how in replies:
                lane._noted(how, nbytes)
                n = 0
                while True:
                    taken = lane.slots_for(1)
                    if taken is not None:
                        break
                    n += 1
                del taken  # the slot is free again
                skipped.append(n)
            return skipped

        assert run(["refused"] * 9) == [1, 2, 4, 8, 16, 32, 64, 64, 64] and LANE_MEMORY_MAX_PAUSE == 64
        assert run(["memory", "refused", "refused"]) == [0, 1, 2]  # a reply through the memory starts again at 1
        assert lane.memory.counts.paused == 1 + 2 + 4 + 8 + 16 + 32 + 3 * 64 + 3
        lane._noted("memory", 0)
        grown = run(["full"])  # below the cap: a larger memory, sent ahead of the call
        assert grown == [0] and lane.memory.slot_bytes > 100_000 and lane.memory.counts.regrown == 1
        monkeypatch.setattr(lane_memory, "LANE_MEMORY_MAX_SLOT_BYTES", lane.memory.slot_bytes)
        at_cap = run(["full", "full", "memory", "full"], nbytes=lane.memory.slot_bytes + 1)
        assert at_cap == [1, 2, 0, 1] and lane.memory.counts.regrown == 1  # at the cap: pauses, as for refused
    finally:
        lane.close()
        there.close()


class _StepUp(torch.utils.data.Dataset):
    """Samples of 4096 floats (a batch of 4: 64 KiB) for the first `small`, then of 4x that."""

    def __init__(self, n: int, small: int) -> None:
        self.n, self.small = n, small

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4096 if i < self.small else 4 * 4096,), float(i))


def test_a_reply_that_cannot_be_written_goes_over_the_socket_marked_and_logged_once(caplog):
    """The worker's end: a reply whose arrays cannot be written (a slot outside the memory: a bug) crosses the socket
    marked "error", logged once at warning level; one the plain pickler refuses is marked "refused", not logged; one
    too large "full"; each read intact, `noted` told why. A broken socket is raised, not hidden."""
    import logging
    import os
    import socket
    from multiprocessing.connection import Connection

    from raydl.driver.transport.lane_memory import LaneMemory
    from raydl.worker.lane import MemoryWriter, recv_reply

    a, b = socket.socketpair()
    worker, driver = Connection(a.detach()), Connection(b.detach())
    lm = LaneMemory(2, 8192)
    writer = MemoryWriter()
    writer.map(os.dup(lm.fd), lm.size)
    regions, slots = lm.take(1)
    noted = []

    def roundtrip(reply, given):
        writer.reply(worker, reply, given)
        return recv_reply(driver, regions=regions, noted=lambda how, n: noted.append((how, n)))

    def square(x):
        return x * x

    x = torch.arange(100, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="raydl.worker.lane"):
        for _ in range(2):
            got = roundtrip(([encode({"x": x})], [None]), [(lm.size + 4096, 8192)])  # outside the memory
            assert torch.equal(decode(got[0][0])["x"], x)
        got = roundtrip(([encode({"x": x}), square], [None]), slots)
        assert torch.equal(decode(got[0][0])["x"], x) and got[0][1](3) == 9
        big = torch.zeros(4096)
        got = roundtrip(([encode({"x": big})], [None]), slots)
        assert torch.equal(decode(got[0][0])["x"], big)
        got = roundtrip(([encode({"x": x})], [None]), slots)
        assert torch.equal(decode(got[0][0])["x"], x)
    assert [how for how, _ in noted] == ["error", "error", "refused", "full", "memory"]
    assert noted[3][1] > big.nbytes  # the socket's bytes of the reply that did not fit
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "LaneMemoryError" in warnings[0].getMessage() and warnings[0].exc_info
    driver.close()
    with pytest.raises(OSError):
        for _ in range(100):  # (the first writes may land in the socket's buffer)
            writer.reply(worker, ([encode({"x": x})], [None]), slots)
    del got
    writer.close()
    worker.close()


def test_lane_memory_grows_to_its_cap_and_a_replaced_one_stays_mapped_while_used():
    """LaneMemory.grown: slots for 1.5x the reply and 64 KiB, as many; None when no larger than now or past the cap.
    A replaced memory stays mapped (mapped_bytes) while an array of its slots lives, and is unmapped after."""
    import gc

    from raydl._constants import LANE_MEMORY_MAX_SLOT_BYTES
    from raydl.driver.transport.lane_memory import LaneMemory

    lm = LaneMemory(3, 100_000)
    counts = lm.counts
    assert lm.grown(10_000) is None  # a reply these slots would take
    bigger = lm.grown(400_000)
    assert bigger.slot_bytes == 667648 and bigger.size == 3 * 667648 and bigger.counts is counts
    capped = bigger.grown(100 * LANE_MEMORY_MAX_SLOT_BYTES)
    assert capped.slot_bytes == LANE_MEMORY_MAX_SLOT_BYTES and capped.grown(10**12) is None
    assert counts.memories == 3 and counts.mapped_bytes == lm.size + bigger.size + capped.size
    kept = lm.take(1)[0][0][:10]  # a batch's array over the first memory
    size = lm.size
    del lm, bigger
    gc.collect()
    assert counts.mapped_bytes == size + capped.size
    kept[:] = 7  # still mapped: writable
    del kept
    gc.collect()
    assert counts.mapped_bytes == capped.size


class _Growing(torch.utils.data.Dataset):
    """Samples of 256 floats, or with `grow` of 256 more every four (a batch's samples stack): the first batches
    small, the last 48x larger."""

    def __init__(self, n: int, grow: bool) -> None:
        self.n, self.grow = n, grow

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256 * (1 + (i // 4 if self.grow else 0)),), float(i))
