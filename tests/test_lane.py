"""Lanes (NOTE [ raydl lane ]): a local worker's calls over a socket instead of Ray calls; the batches stay torch's.

Lanes are the default, so the whole suite runs on them where they apply; `pytest --no-ray-lane` runs it with every
call through Ray.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

import raydl
from raydl._constants import LANE_MAX_BATCH_BYTES, LANE_OUT_OF_BAND_BYTES
from raydl.worker.lane import recv_reply, send_reply
from raydl.worker.transfer import decode, encode
from tests import _datasets as D
from tests._parity import assert_epochs_equal, run_epochs, torch_epochs
from tests._resume_parity import check_resume

pytestmark = pytest.mark.usefixtures("ray_session")

TIMEOUT_S = 120


@pytest.fixture
def lanes_on():
    """Every raydl.DataLoader built in the test has ray_lane=True by default (harnesses that build torchdata's loader
    from the same kwargs need no raydl-only argument)."""
    defaults = raydl.DataLoader.__init__.__kwdefaults__
    old = defaults["ray_lane"]
    defaults["ray_lane"] = True
    yield
    defaults["ray_lane"] = old


def _lane_calls(it) -> int:
    return it._calls.lane_calls


@pytest.fixture(params=["unix", "tcp"])
def kind(request, monkeypatch):
    """The test twice: on the Unix-socket lanes of workers on the driver's node, then on the TCP lanes of workers on
    other nodes (the driver is told each started worker runs elsewhere: the same code a multi-node cluster runs,
    here on one node; tests/test_multinode.py runs it across nodes)."""
    if request.param == "tcp":
        from raydl.driver.transport import lane as L

        real = L.worker_node
        monkeypatch.setattr(L, "worker_node", lambda pool, w: None if real(pool, w) is None else "another-node")
    return request.param


def _check_kind(it, kind: str) -> None:
    """The lane calls went the way `kind` says."""
    remote = it._calls._lanes.remote_calls_sent
    assert remote == (_lane_calls(it) if kind == "tcp" else 0), (kind, remote, _lane_calls(it))


def test_default_configuration_on_lanes_matches_torch(lanes_on, kind):
    """shuffle=True, no generator, persistent workers, 3 epochs: torch's batches, and the calls went over lanes."""
    torch.manual_seed(7)
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    expected = torch_epochs(D.RandomAugmentDataset(160), 3, **kwargs)
    torch.manual_seed(7)
    with raydl.DataLoader(D.RandomAugmentDataset(160), **kwargs) as loader:
        actual = run_epochs(loader, 3)
        it = loader._iterator
        # the first calls go through Ray while the workers start; then every call takes its worker's lane
        assert _lane_calls(it) > 0.8 * it._sched.calls_sent, (_lane_calls(it), it._sched.calls_sent)
        _check_kind(it, kind)
    assert_epochs_equal(expected, actual)


def test_worker_sigkilled_on_its_lane_is_recovered(kind):
    """SIGKILL of a worker whose calls go over its lane: the lane's end is its death; no batch lost or repeated."""
    loader = raydl.DataLoader(
        D.SlowDataset(64, {i: 0.01 for i in range(64)}), batch_size=2, num_workers=2, timeout=TIMEOUT_S, ray_lane=True
    )
    it = iter(loader)
    out = []
    while _lane_calls(it) < 4:  # both workers on their lanes
        out.append(next(it).flatten().tolist())
    os.kill(it.worker_records[1].pid, signal.SIGKILL)
    out += [b.flatten().tolist() for b in it]
    assert out == [[i, i + 1] for i in range(0, 64, 2)]
    assert it._pool.restarts == [0, 1]
    _check_kind(it, kind)


def test_state_taken_on_lanes_resumes_as_torchdata(lanes_on, kind):
    """States after 3 and 20 batches of a loader on lanes (shuffle=True, no generator; then random draws in the
    workers): raydl and torchdata resume each other's states batch for batch."""
    check_resume(
        lambda: D.RangeDataset(64),
        lambda: dict(batch_size=2, shuffle=True),
        num_workers=2,
        ks=(3, 20),
        same_uninterrupted=False,  # torchdata's RandomSampler draws a permutation more (tests/_resume_parity.py)
        next_from_state=False,
    )
    check_resume(
        lambda: D.RandomAugmentDataset(64),
        lambda: dict(batch_size=2),
        num_workers=2,
        ks=(3, 20),
        td_resume_exact=False,
    )


def test_error_on_a_lane_is_raised_at_its_turn_and_the_epoch_goes_on(kind):
    """User code raising in a lane call: torch's error at that batch; the caller catches it and gets the rest."""
    loader = raydl.DataLoader(D.KeyErrorDataset(40), batch_size=1, num_workers=2, timeout=TIMEOUT_S, ray_lane=True)
    it = iter(loader)
    got = []
    with pytest.raises(KeyError, match="missing-key"):
        while True:
            got.append(next(it).item())
    got += [b.item() for b in it]
    assert got == [i for i in range(40) if i != 3]
    _check_kind(it, kind)


def test_timeout_on_a_lane_is_torchs_error(kind):
    """A batch slower than `timeout` on a lane raises torch's timeout error, naming the batch."""
    delays = {i: 0.0 for i in range(40)}
    delays[30] = 6.0
    loader = raydl.DataLoader(D.SlowDataset(40, delays), batch_size=1, num_workers=2, timeout=2, ray_lane=True)
    it = iter(loader)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 2 seconds"):
        for _ in it:
            pass
    assert _lane_calls(it) > 0
    _check_kind(it, kind)
    it.shutdown()


def test_warm_worker_reused_after_a_lane_makes_the_next_loaders_batches():
    """A loader on lanes ends early; its workers go back to the warm pool and the next loader's batches are its own."""
    first = raydl.DataLoader(D.RangeDataset(64), batch_size=2, num_workers=2, ray_lane=True)
    it = iter(first)
    for _ in range(12):
        next(it)
    assert _lane_calls(it) > 0
    pids = {r.pid for r in it.worker_records}
    del it
    first.shutdown()
    second = raydl.DataLoader(D.PidDataset(16), batch_size=2, num_workers=2, ray_lane=True)
    rows = torch.cat(list(second))
    assert rows[:, 0].tolist() == list(range(16))
    assert set(rows[:, 1].tolist()) <= pids  # the same processes, now the second loader's workers


def test_in_order_false_on_lanes_hands_out_batches_as_they_arrive(kind):
    """in_order=False: once the lanes are open, a slow batch of one worker holds back none of the other's; every
    batch comes out once."""
    loader = raydl.DataLoader(
        D.SlowDataset(48, {24: 1.5}), batch_size=1, num_workers=2, in_order=False, timeout=TIMEOUT_S, ray_lane=True
    )
    it = iter(loader)
    out = [int(b) for b in it]
    assert sorted(out) == list(range(48))
    assert out.index(24) > 24, out  # batches sent after it came out first
    assert _lane_calls(it) > 0
    _check_kind(it, kind)


class _SizeByWorker(torch.utils.data.Dataset):
    """Worker 0's samples are tiny (its batches take a lane); worker 1's are a quarter of LANE_MAX_BATCH_BYTES
    (a batch of 8 keeps Ray's calls). A sample takes 25 ms; each worker sleeps 1.5 s once, at its first sample made
    `SLOW_AFTER_S[worker]` seconds after its first: worker 1 early, worker 0 once worker 1 is back."""

    SLOW_AFTER_S = {1: 0.3, 0: 2.2}

    def __init__(self, n: int) -> None:
        self.n, self.t0, self.slept = n, None, False

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import time

        w = torch.utils.data.get_worker_info().id
        now = time.monotonic()
        self.t0 = now if self.t0 is None else self.t0
        slow = not self.slept and now - self.t0 >= self.SLOW_AFTER_S[w]
        if slow:
            self.slept = True
            time.sleep(1.5)
        time.sleep(0.025)
        size = LANE_MAX_BATCH_BYTES // 16 if w == 1 else 1
        return {"i": torch.tensor([i]), "w": torch.tensor([w]), "slow": torch.tensor([slow]), "x": torch.zeros(size)}


def test_in_order_false_with_lanes_and_ray_calls_mixed_hands_out_batches_as_they_arrive():
    """in_order=False with one worker on its lane and one on Ray's calls: a slow batch on either side holds back
    none of the other's batches; every batch comes out once, with its own content."""
    loader = raydl.DataLoader(
        _SizeByWorker(240), batch_size=8, num_workers=2, in_order=False, timeout=TIMEOUT_S, ray_lane=True
    )
    it = iter(loader)
    out = []  # (batch's place in the sampler's order, its worker, whether it was slow), as handed out
    for b in it:
        first = int(b["i"][0])
        assert b["i"].flatten().tolist() == list(range(first, first + 8))
        assert len(set(b["w"].flatten().tolist())) == 1
        out.append((first // 8, int(b["w"][0]), bool(b["slow"].any())))
    assert sorted(o[0] for o in out) == list(range(30))
    slow = [(pos, o) for pos, o in enumerate(out) if o[2]]
    assert sorted(o[1] for _, o in slow) == [0, 1], out  # one slow batch on each side
    for pos, (idx, w, _) in slow:
        assert any(later > idx and lw != w for later, lw, _ in out[:pos]), (idx, out)  # overtaken by the other
    assert 0 < _lane_calls(it) < it._sched.calls_sent, (_lane_calls(it), it._sched.calls_sent)


def test_ray_lane_must_be_a_bool():
    with pytest.raises(TypeError, match="ray_lane should be True or False"):
        raydl.DataLoader(D.RangeDataset(4), num_workers=2, ray_lane="yes")


class _Large(torch.utils.data.Dataset):
    """Samples of a quarter of LANE_MAX_BATCH_BYTES: a batch of 8 is twice the limit."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((LANE_MAX_BATCH_BYTES // 16,), float(i))


def test_large_batches_of_workers_on_other_nodes_take_tcp_lanes(kind):
    """Batches above LANE_MAX_BATCH_BYTES: a worker on the driver's node keeps Ray's calls (its zero-copy object
    store); a worker on another node takes a TCP lane (Ray would copy them through two raylets)."""
    loader = raydl.DataLoader(
        _Large(), batch_size=8, num_workers=2, timeout=TIMEOUT_S, ray_lane=True, persistent_workers=True
    )
    expected = [[float(i) for i in range(s, s + 8)] for s in range(0, 64, 8)]
    for _ in range(4):  # a lane opens while calls go through Ray: on a loaded machine an 8-batch epoch can end first
        it = iter(loader)
        assert [b[:, 0].tolist() for b in it] == expected
        if _lane_calls(it) > 0:
            break
    assert (_lane_calls(it) > 0) == (kind == "tcp")
    _check_kind(it, kind)
    loader.shutdown()


def test_reply_memory_is_used_again_only_once_its_batch_is_gone(kind):
    """shuffle=True, persistent workers, 2 epochs of 256 KiB batches on lanes: the replies' memory is used again
    (NOTE [ raydl receive buffers ]), yet every third batch, kept by the loop, and a view of another stay torch's
    values to the end, while the loop scribbles over each batch it does not keep."""
    ds = _Sized(96, 16 * 1024)
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    torch.manual_seed(3)
    expected = torch_epochs(ds, 2, **kwargs)
    torch.manual_seed(3)
    with raydl.DataLoader(ds, timeout=TIMEOUT_S, **kwargs) as loader:
        kept, view = [], None
        for _ in range(2):
            for i, batch in enumerate(loader):
                if i % 3 == 0:
                    kept.append(batch)
                elif view is None:
                    view = batch[1:3, 5:]  # the user keeps a view of a batch it drops
                else:
                    batch.fill_(-1.0)  # an in-place step on a batch not kept
        it = loader._iterator
        _check_kind(it, kind)
        assert _lane_calls(it) > 0
        lanes = it._calls._lanes
        if kind == "tcp":
            assert lanes._buffers.reused > 0
        else:  # a local lane's replies come through its shared memory (NOTE [ raydl lane memory ])
            assert sum(lane.memory.reused for lane in lanes._lanes.values()) > 0
    flat = [b for epoch in expected for b in epoch]
    assert all(torch.equal(k, flat[i]) for k, i in zip(kept, [i for i in range(len(flat)) if i % 24 % 3 == 0]))
    assert torch.equal(view, flat[1][1:3, 5:])


def test_receive_buffers_hand_out_only_memory_nothing_refers_to():
    """ReceiveBuffers (NOTE [ raydl receive buffers ]): a buffer comes back for the same size once its tensor and
    views are gone, never while one lives; at most `limit` are kept, a new size taking a free one's place."""
    from raydl.driver.transport.buffers import ReceiveBuffers

    pool = ReceiveBuffers(2)
    a = pool.take(1000)
    tensor = torch.from_numpy(a[8:].view(np.float32).reshape(2, -1))
    a_id = id(a)
    del a
    b = pool.take(1000)
    assert id(b) != a_id  # `tensor` still uses a's memory
    del tensor
    assert id(pool.take(1000)) == a_id and pool.reused == 1
    c = pool.take(1000)  # a is free, b held: a again; then a held too: a third, not kept (the limit)
    assert id(c) == a_id
    d = pool.take(1000)
    assert len(pool._kept) == 2 and all(d is not k for k in pool._kept)
    del b, c, d
    e = pool.take(500)  # a new size evicts a free buffer
    assert len(pool._kept) == 2 and any(e is k for k in pool._kept)
    pool.clear()
    assert pool._kept == []


def test_tcp_lane_sockets_are_set_to_end_a_silent_peer():
    """A TCP lane's socket (either end) sends at once and ends within LANE_TCP_USER_TIMEOUT_S when its peer's node goes
    silent: keepalive probes and a user timeout are set (a vanished node must not hang the loader)."""
    import socket

    from raydl import _constants as K
    from raydl.worker.lane import tune_tcp

    sock = socket.socket()
    try:
        tune_tcp(sock)
        get = lambda level, opt: sock.getsockopt(level, opt)  # noqa: E731
        assert get(socket.IPPROTO_TCP, socket.TCP_NODELAY) and get(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        assert get(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == K.LANE_TCP_KEEPALIVE_IDLE_S
        assert get(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == K.LANE_TCP_KEEPALIVE_INTERVAL_S
        assert get(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == K.LANE_TCP_KEEPALIVE_COUNT
        assert get(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == K.LANE_TCP_USER_TIMEOUT_S * 1000
        idle = K.LANE_TCP_KEEPALIVE_IDLE_S + K.LANE_TCP_KEEPALIVE_INTERVAL_S * K.LANE_TCP_KEEPALIVE_COUNT
        assert max(idle, K.LANE_TCP_USER_TIMEOUT_S) <= 60
    finally:
        sock.close()


def test_a_tcp_lane_the_worker_cannot_reach_leaves_its_node_on_rays_calls(monkeypatch):
    """A worker on another node that cannot connect to the driver's TCP lane (a firewall: here it is sent a port
    nobody listens on) keeps Ray's calls; its node is not asked again by this process; the batches are the same."""
    import socket

    from raydl.driver.transport import lane as L

    real_node, real_listen = L.worker_node, L.Lanes._listen
    asked = []

    def listen_behind_a_wall(self, remote):
        listener, address = real_listen(self, remote)
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        asked.append(closed.getsockname())
        closed.close()  # the worker is sent a port nobody listens on: its connection is refused
        return listener, asked[-1]

    monkeypatch.setattr(L, "worker_node", lambda pool, w: None if real_node(pool, w) is None else "walled-node")
    monkeypatch.setattr(L.Lanes, "_listen", listen_behind_a_wall)
    monkeypatch.setattr(L, "_UNREACHED", set())
    for _ in range(2):  # a second loader in the same process does not ask again
        loader = raydl.DataLoader(D.RangeDataset(64), batch_size=2, num_workers=2, timeout=TIMEOUT_S, ray_lane=True)
        it = iter(loader)
        assert [b.flatten().tolist() for b in it] == [[i, i + 1] for i in range(0, 64, 2)]
        assert _lane_calls(it) == 0
        loader.shutdown()
    assert L._UNREACHED == {"walled-node"}
    assert 1 <= len(asked) <= 2, asked  # at most the two workers asked before the first refusal was known


class _Sized(torch.utils.data.Dataset):
    """`n` samples of `numel` float32, sample i filled with i."""

    def __init__(self, n: int, numel: int) -> None:
        self.n, self.numel = n, numel

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.numel,), float(i))


@pytest.mark.parametrize("kib,grouped,stats", [(48, False, True), (8, True, True), (48, False, False)])
def test_ray_calls_to_another_node_keep_their_batches_inline(monkeypatch, kib, grouped, stats):
    """Workers on another node on Ray's calls (ray_lane=False): cheap batches are grouped only while the call's
    batches fit Ray's inline limit (48 KiB: one a call; 8 KiB: several; with ray_stats=False too, the workers then
    reporting no size), the batches those of torch."""
    from raydl.driver.transport import calls as C

    real = C.worker_node
    monkeypatch.setattr(C, "worker_node", lambda pool, w: None if real(pool, w) is None else "another-node")
    ds = _Sized(256, kib * 1024 // 4 // 4)  # a batch of 4 float32 samples: `kib` KiB
    loader = raydl.DataLoader(
        ds, batch_size=4, num_workers=2, timeout=TIMEOUT_S, ray_lane=False, prefetch_factor=8, ray_stats=stats
    )
    it = iter(loader)
    assert all(torch.equal(a, b) for a, b in zip(it, torch.utils.data.DataLoader(ds, batch_size=4), strict=True))
    assert (it._sched.calls_sent < 64) == grouped, it._sched.calls_sent
    loader.shutdown()


def test_large_batches_and_ray_lane_false_keep_rays_calls():
    """Batches above LANE_MAX_BATCH_BYTES stay on Ray's zero-copy object store; ray_lane=False never opens a lane."""
    large = raydl.DataLoader(_Large(), batch_size=8, num_workers=2, ray_lane=True)
    it = iter(large)
    assert [b[:, 0].tolist() for b in it] == [[float(i) for i in range(s, s + 8)] for s in range(0, 64, 8)]
    assert _lane_calls(it) == 0
    off = raydl.DataLoader(D.RangeDataset(64), batch_size=2, num_workers=2, ray_lane=False)
    it = iter(off)
    assert [b.flatten().tolist() for b in it] == [[i, i + 1] for i in range(0, 64, 2)]
    assert _lane_calls(it) == 0


@pytest.mark.parametrize("lane", [True, False])
def test_on_a_lane_batches_are_made_off_the_main_thread_and_worker_init_fn_on_it(lane):
    """What docs/usage.md says of `ray_lane`: worker_init_fn runs on the worker's main thread either way; batches made
    over a lane are made in another thread, with ray_lane=False every batch on the main thread."""
    loader = raydl.DataLoader(
        D.ThreadReportDataset(400),
        batch_size=2,
        num_workers=2,
        timeout=TIMEOUT_S,
        worker_init_fn=D.note_init_thread,
        ray_lane=lane,
    )
    it = iter(loader)
    rows = torch.cat(list(it))
    assert rows[:, 0].tolist() == list(range(400))
    assert set(rows[:, 2].tolist()) == {1}, "worker_init_fn ran off the main thread"
    on_main = rows[:, 1].tolist()
    if lane:
        assert it._calls.lane_calls > 0 and 0 in on_main, "no batch was made on a lane"
        assert on_main[:2] == [1, 1], "the first calls (through Ray) run on the main thread"
    else:
        assert it._calls.lane_calls == 0 and set(on_main) == {1}
    loader.shutdown()


class _MidSize(D.RangeDataset):
    """1 MiB batches of 8 (above the in-band size, under LANE_MAX_BATCH_BYTES) with a random draw in the worker."""

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.rand(32768, generator=g) + torch.rand(1), "i": i}


def test_mid_size_batches_take_lanes_out_of_band_and_match_torch(lanes_on, kind):
    """Batches of 1 MiB (their arrays out of band on the lane): shuffle=True, no generator, persistent workers, two
    epochs equal torch's, most calls on lanes, and the tensors are writable."""
    assert LANE_OUT_OF_BAND_BYTES < 32768 * 4 * 8 <= LANE_MAX_BATCH_BYTES
    kwargs = dict(batch_size=8, shuffle=True, num_workers=2, persistent_workers=True)
    torch.manual_seed(11)
    expected = torch_epochs(_MidSize(320), 2, **kwargs)
    torch.manual_seed(11)
    with raydl.DataLoader(_MidSize(320), timeout=TIMEOUT_S, **kwargs) as loader:
        actual = run_epochs(loader, 2)
        it = loader._iterator
        assert _lane_calls(it) > 0.5 * it._sched.calls_sent, (_lane_calls(it), it._sched.calls_sent)
        _check_kind(it, kind)
    assert_epochs_equal(expected, actual)
    actual[1][-1]["x"].add_(1)  # writable, as torch's


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_reply_carries_large_arrays_out_of_band_and_small_ones_in_the_pickle(transport):
    """send_reply / recv_reply over a socket pair (a local lane) or a TCP connection read as a TCP lane's reader
    reads (woken per LANE_TCP_WAKE_BYTES): values, dtypes and shapes as sent, large arrays writable, and a lane that
    ends in the middle of a reply is EOFError (the driver's LaneLost)."""
    import socket
    import threading
    from multiprocessing.connection import Connection

    from raydl._constants import LANE_TCP_WAKE_BYTES

    wake = 0
    if transport == "unix":
        a, b = socket.socketpair()
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
        listener.close()
        wake = LANE_TCP_WAKE_BYTES // 4  # the 1.2 MB array arrives in several wakes
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    batch = {
        "big": torch.arange(300_000, dtype=torch.float32).view(600, 500),
        "small": torch.ones(3, dtype=torch.int64),
        "half": torch.rand(70_000).half(),
        "text": ["a", "b"],
    }
    reply = ([encode(batch)], [("meta", 1)])
    writer = threading.Thread(target=send_reply, args=(sender, reply))
    writer.start()  # a thread: the reply is larger than the socket's buffer
    got_batches, metas = recv_reply(receiver, wake)
    writer.join(timeout=TIMEOUT_S)
    got = decode(got_batches[0])
    assert metas == [("meta", 1)] and got["text"] == ["a", "b"]
    for key in ("big", "small", "half"):
        assert got[key].dtype == batch[key].dtype and torch.equal(got[key], batch[key])
    got["big"][0, 0] = -1.0
    # a reply cut short: its head promises 1 MiB, the sender goes away after a part of it
    head = b"\x01\x00\x00\x00" + (1 << 20).to_bytes(8, "little") + b"x"
    sender.send_bytes(head)
    sender._send(b"\x00" * 1000)  # noqa: SLF001 - raw bytes of the buffer, as send_reply writes them
    sender.close()
    with pytest.raises(EOFError):
        recv_reply(receiver, wake)
    receiver.close()


def test_a_tcp_reply_whose_last_chunk_comes_in_parts_is_read_whole():
    """A TCP lane's reader, woken per `wake` bytes of a large buffer: a buffer of 1.25 `wake` whose first half
    `wake` arrives, then after a pause the rest (less than `wake`), is read whole and soon (a blocking read under
    SO_RCVLOWAT that took the first part would wait for `wake` more bytes, which never come)."""
    import pickle
    import socket
    import struct
    import threading
    import time
    from multiprocessing.connection import Connection

    import numpy as np

    wake = 256 * 1024
    size = wake + wake // 4
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    payload = np.arange(size, dtype=np.uint8)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(recv_reply(receiver, wake)), daemon=True)
    reader.start()
    pickled = pickle.dumps(pickle.PickleBuffer(payload), protocol=5, buffer_callback=lambda _: False)
    sender.send_bytes(struct.pack("<IQ", 1, size) + pickled)  # the head send_reply writes: one buffer, out of band
    sender._send(payload[: wake // 2].tobytes())  # noqa: SLF001 - raw bytes of the buffer, as send_reply writes them
    time.sleep(0.5)  # the reader is waiting on the first part
    sender._send(payload[wake // 2 :].tobytes())  # noqa: SLF001
    reader.join(timeout=10)
    try:
        assert not reader.is_alive(), "the reader stalled on the last part of the buffer"
        assert np.array_equal(np.asarray(got[0]), payload)
    finally:
        sender.close()
        receiver.close()


def test_a_batch_no_pickle_can_carry_is_an_error_at_its_turn_not_a_hang(kind):
    """A lane's batch holding a lock (collate_fn=list keeps it): its batch raises the pickling error when its turn
    comes, the batches before it are the dataset's, and the epoch goes on after it, as after any worker error."""
    loader = raydl.DataLoader(
        D.LockAtDataset(200, at=150), batch_size=2, num_workers=2, collate_fn=list, timeout=TIMEOUT_S, ray_lane=True
    )
    it = iter(loader)
    got = [[x for x, _ in next(it)] for _ in range(75)]
    assert got == [[i, i + 1] for i in range(0, 150, 2)]
    assert _lane_calls(it) > 0
    _check_kind(it, kind)
    with pytest.raises(TypeError, match="could not be sent to your process"):
        next(it)
    rest = [[x for x, _ in b] for b in it]
    assert rest == [[i, i + 1] for i in range(152, 200, 2)]
