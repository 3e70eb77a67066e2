"""A worker's end of a lane: the driver's calls over a local socket instead of one Ray actor call each.

NOTE [ raydl lane ]
Ray's per-call cost on the driver's core is most of what a batch costs the trainer at the
overhead floor (figures: docs/design-notes.md). So by default (`ray_lane=True`) a worker on the
driver's node whose batches are small (LANE_MAX_BATCH_BYTES: its first batch tells), and a worker
on another node whatever its batches' size, is sent its calls over a socket the driver opened for
it (abstract Unix socket on the node, TCP across nodes; the worker proves itself with a random
token given through Ray):
  * one socket per worker: the driver writes each call's tasks and reads the replies in the order
    it wrote the calls;
  * a daemon thread in the worker makes each call with the same `fetch_many` a Ray call runs,
    under the actor's lock (one fetch at a time); it stops at the socket's end or when the actor
    is given another loader (its generation);
  * calls are made in the order the driver sent them, whichever way they went: each lane call
    carries how many Ray calls the driver had sent, and waits until the worker made that many;
  * batches travel pickled (protocol 5), large arrays out of band into memory the driver's arrays
    then use: one copy into the kernel, one out; on the driver's node the arrays are written into
    memory the two share instead, and only the pickle crosses (NOTE [ raydl lane memory ]);
  * across nodes a driver thread reads replies as they arrive (NOTE [ raydl lane, driver ]) and a
    worker thread writes them, with a heartbeat every LANE_HEARTBEAT_S: a lane silent for
    `ray_silence_timeout_s` is a silent node's (NOTE [ raydl silent node ]); TCP keepalive and a
    user timeout (LANE_TCP_*) are the backstop;
  * under Ray's TLS a TCP lane is TLS 1.3 with Ray's files (NOTE [ raydl lane TLS ]), never
    plaintext: where TLS cannot be set up those workers keep Ray's calls. The listener takes only
    a connection that sends the token (NOTE [ raydl lane listener ]);
  * a reply no pickle can carry has each such batch replaced by its pickling error, raised in the
    driver at that batch's turn: a lane thread never dies leaving the driver waiting.
The driver's side (driver/transport/lane.py) says when a worker's calls move to its lane and what happens
when the lane breaks (a dead worker: the socket's end, as Ray's actor death).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import socket
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, Optional

from .._constants import (
    LANE_HEARTBEAT_S,
    LANE_HELLO_S,
    LANE_OUT_OF_BAND_BYTES,
    LANE_TCP_CONNECT_S,
    LANE_TCP_KEEPALIVE_COUNT,
    LANE_TCP_KEEPALIVE_IDLE_S,
    LANE_TCP_KEEPALIVE_INTERVAL_S,
    LANE_TCP_USER_TIMEOUT_S,
)
from .lane_memory import (
    ARENA_MARK,
    FELL_BACK,
    LaneMemoryError,
    MemoryFull,
    dumps_into,
    loads_from,
    map_memory,
    recv_message,
)
from .lane_tls import TLS_FLAG, TlsConnection, tls_connect, tls_wanted

__all__ = [
    "serve_lane",
    "connect_lane",
    "MemoryWriter",
    "dumps_reply",
    "send_reply",
    "recv_reply",
    "Turns",
    "tune_tcp",
    "shut_down",
    "since_received_s",
]

logger = logging.getLogger(__name__)


def dumps_reply(value: Any) -> tuple[bytes, list[memoryview]]:
    """A call's reply for the lane: pickle's protocol 5, arrays of LANE_OUT_OF_BAND_BYTES or more out of band (their
    memory, not copied), smaller ones in the pickle; cloudpickle for what pickle refuses (a lambda, a local class)."""
    buffers: list[memoryview] = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < LANE_OUT_OF_BAND_BYTES:
            return True  # in band
        buffers.append(raw)
        return False

    try:
        return pickle.dumps(value, protocol=5, buffer_callback=out_of_band), buffers
    except Exception:
        from ray import cloudpickle  # here, not at import: the driver imports Ray late (NOTE [ raydl node Ray ])

        buffers.clear()
        return cloudpickle.dumps(value, protocol=5, buffer_callback=out_of_band), buffers


def send_reply(
    conn: Connection, value: Any, sendable: Optional[Callable[[Any, BaseException], Any]] = None, mark: bytes = b""
) -> None:
    """Write a reply: one message (`mark`, the buffers' sizes, then the pickle), then each out-of-band buffer's bytes
    as they are (one copy, into the kernel). A value pickle refuses is sent as `sendable(value, error)` makes it, if
    given. `mark`: why a reply to a call given slots of the lane's memory is not in them (FELL_BACK)."""
    try:
        data, buffers = dumps_reply(value)
    except Exception as e:  # noqa: BLE001 - a batch pickle refuses: an error for the driver, not a hang
        if sendable is None:
            raise
        data, buffers = dumps_reply(sendable(value, e))
    sizes = [b.nbytes for b in buffers]
    conn.send_bytes(mark + struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes) + data)
    if isinstance(conn, TlsConnection):
        for buf in buffers:
            conn.write_all(buf)
        return
    fd = conn.fileno()
    for buf in buffers:
        sent = 0
        while sent < buf.nbytes:
            sent += os.write(fd, buf[sent:])


class MemoryWriter:
    """A Unix lane's shared memory on the worker's side (NOTE [ raydl lane memory ]): mapped as the driver sends it
    (`map`, again for a larger one), and `reply` writing each reply into the slots its call was given, else over the
    socket marked with why not (FELL_BACK)."""

    def __init__(self) -> None:
        self._mapping: Optional[Any] = None
        self._view: Optional[memoryview] = None
        self._warned = False  # a failure writing into the memory is logged once per lane

    def map(self, fd: int, size: int) -> None:
        """Use the memory whose descriptor came with the driver's ("memory", size) message, in place of any before
        (the driver's own mapping of the old one stays while its batches use it)."""
        self.close()
        self._mapping = map_memory(fd, size)
        self._view = memoryview(self._mapping)

    def reply(
        self, conn: Connection, reply: Any, slots: Optional[list], sendable: Optional[Callable[..., Any]] = None
    ) -> None:
        """Send a call's reply: into `slots` if given and it fits, else over the socket (`send_reply`). The socket's
        errors are raised as they are (the lane's end)."""
        if not slots:
            send_reply(conn, reply, sendable)
            return
        why = self._into(conn, reply, slots)
        if why is not None:
            send_reply(conn, reply, sendable, FELL_BACK[why])

    def _into(self, conn: Connection, reply: Any, slots: list) -> Optional[str]:
        """None once the reply is in the slots and its pickle sent; else why not (FELL_BACK's key), nothing sent."""
        try:
            if self._view is None:
                raise LaneMemoryError("a call was given slots of a lane memory this worker was never sent")
            data = dumps_into(reply, self._view, slots)
        except MemoryFull:
            return "full"
        except LaneMemoryError as e:  # a bug of raydl's: the reply goes over the socket, but it is said once
            if not self._warned:
                self._warned = True
                logger.warning(
                    "raydl: a lane reply could not be written into the lane's shared memory; it and any other such "
                    "go over the socket (replies_failed in loader.stats().lane_memory): %r",
                    e,
                    exc_info=e,
                )
            return "error"
        except Exception:  # noqa: BLE001 - the user's object the plain pickler refuses: cloudpickle or `sendable`
            return "refused"
        conn.send_bytes(data)
        return None

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a view of it not yet collected: it is unmapped when that goes
                pass
            self._mapping = None


def recv_reply(
    conn: Connection,
    wake_bytes: int = 0,
    alloc: Optional[Callable[[int], Any]] = None,
    regions: Optional[list] = None,
    noted: Optional[Callable[[str, int], None]] = None,
) -> Any:
    """Read a reply `send_reply` wrote: each out-of-band buffer straight into memory (one copy, out of the kernel)
    that the unpickled arrays then use (writable, as torch's batches are): a fresh array, or `alloc(size)`'s (a
    uint8 array nothing else uses: the driver's NOTE [ raydl receive buffers ]). EOFError when the lane ends.
    `wake_bytes` (a TCP lane's reader): `_read_in_chunks` reads each large buffer. `regions`: the slots of the
    lane's memory the call was given, where a reply `MemoryWriter` wrote has its arrays (NOTE [ raydl lane memory ]).
    `noted(how, nbytes)` is told how a reply to a call given slots came: "memory", or FELL_BACK's key and the bytes
    it took over the socket."""
    import numpy as np

    head = conn.recv_bytes()
    while not head:  # a heartbeat of a TCP lane's worker (NOTE [ raydl silent node ]): proof of life only
        head = conn.recv_bytes()
    if head[:4] == ARENA_MARK:
        if regions is None:
            raise ValueError("a lane reply in shared memory came for a call given no slots")
        if noted is not None:
            noted("memory", 0)
        return loads_from(head, regions)
    start = 4 if head[3] & 0x80 else 0  # FELL_BACK's mark (a buffer count is < 2**31), before a call's reply
    (count,) = struct.unpack_from("<I", head, start)
    sizes = struct.unpack_from(f"<{count}Q", head, start + 4)
    buffers = []
    fd = conn.fileno()  # (a TLS connection's too: EOF-checked while the lane is open)
    for size in sizes:
        buf = np.empty(size, dtype=np.uint8) if alloc is None else alloc(size)
        view = memoryview(buf).cast("B")
        if isinstance(conn, TlsConnection):
            conn.read_into(view)  # TLS records of 16 KiB at most: no wake-up below that to save
        elif wake_bytes and size > wake_bytes:
            _read_in_chunks(fd, view, wake_bytes)
        else:
            got = 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise EOFError("the lane ended in the middle of a reply")
                got += n
        buffers.append(buf)
    value = pickle.loads(memoryview(head)[start + 4 + 8 * count :], buffers=buffers)
    if start and noted is not None:
        noted(_WHY[bytes(head[:4])], len(head) + sum(sizes))
    return value


_WHY = {mark: why for why, mark in FELL_BACK.items()}


def _read_in_chunks(fd: int, view: memoryview, wake_bytes: int) -> None:
    """Fill `view` from a TCP socket, woken by the kernel once `wake_bytes` (or the rest, if less) are in, not at
    every segment: per 38.5 MB batch on loopback, 61 reads and 17 ms of CPU become 13 reads and 12 ms, and the
    trainer's core switches to the reader far less often.

    SO_RCVLOWAT sets the wake-up; each chunk waits in `poll` (no byte taken before it is ready) and is then read
    without blocking. A blocking read under SO_RCVLOWAT can stall for good: once it has taken part of a chunk, the
    kernel wakes it only when `wake_bytes` *more* are in, which the rest of a reply may never be (seen on Linux
    6.18: a reader asleep with 919,306 bytes of its last chunk in the socket)."""
    import select

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    size, got = view.nbytes, 0
    with _borrowed(fd) as sock:
        try:
            while got < size:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(wake_bytes, size - got))
                poller.poll()  # until that much is in, or the connection ends (then the read says which)
                try:
                    n = sock.recv_into(view[got:], size - got, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if n == 0:
                    raise EOFError("the lane ended in the middle of a reply")
                got += n
        finally:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # a small reply wakes the reader again
            except OSError:
                pass


class Turns:
    """The actor's order of calls: one at a time (the lock), Ray's calls counted, a generation per loader."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.generation = 0
        self.ray_calls = 0  # Ray calls of this loader made so far

    def new_loader(self) -> None:
        """The actor is given another loader (or none): lanes of the old one stop, the count starts anew."""
        with self.cond:
            self.generation += 1
            self.ray_calls = 0
            self.cond.notify_all()

    def ray_call(self, make: Callable[[], Any]) -> Any:
        """A Ray call's fetch: made under the lock, then counted."""
        with self.cond:
            try:
                return make()
            finally:
                self.ray_calls += 1
                self.cond.notify_all()

    def lane_call(self, born: int, after: int, make: Callable[[], Any]) -> tuple[bool, Any]:
        """A lane call of generation `born`, once `after` Ray calls were made: (False, None) when the actor serves
        another loader now (the lane stops), else (True, its reply)."""
        with self.cond:
            self.cond.wait_for(lambda: self.generation != born or self.ray_calls >= after)
            if self.generation != born:
                return False, None
            return True, make()


def tune_tcp(sock: socket.socket) -> None:
    """A TCP lane's socket, on either end: calls and small replies go at once (no Nagle delay), and a peer whose node
    vanished without closing the connection ends it within about LANE_TCP_USER_TIMEOUT_S (keepalive probes while it
    is idle, the user timeout while data waits unacknowledged) instead of leaving a reader blocked for good."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", LANE_TCP_KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", LANE_TCP_KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", LANE_TCP_KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", LANE_TCP_USER_TIMEOUT_S * 1000),
    ):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all; elsewhere the system's keepalive defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, option, int(value))


# Linux's struct tcp_info: tcpi_last_data_recv, milliseconds since the last data the connection received, is the
# 14th field (after eight one-byte ones and five four-byte ones), a u32 at byte 52. `ss -i` shows it as lastrcv.
_TCP_INFO_LAST_DATA_RECV = 52


def since_received_s(conn: Any) -> Optional[float]:
    """Seconds since a TCP lane's connection last received data (a heartbeat, a reply's bytes, TLS records alike),
    as the kernel counts them; None where the system cannot say (not Linux) or the connection is closed."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return None
    try:
        fd = conn.fileno()
        with _borrowed(fd) as sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_LAST_DATA_RECV + 4)
    except (OSError, ValueError):
        return None
    if len(info) < _TCP_INFO_LAST_DATA_RECV + 4:
        return None
    return struct.unpack_from("=I", info, _TCP_INFO_LAST_DATA_RECV)[0] / 1000.0


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket]:
    """A socket object over a connection's descriptor, for socket calls; the descriptor stays the connection's."""
    sock = socket.socket(fileno=fd)
    try:
        yield sock
    finally:
        sock.detach()


def shut_down(conn: Connection) -> None:
    """End a connection both ways without closing its descriptor (its owner closes it)."""
    try:
        fd = conn.fileno()
    except (OSError, ValueError):
        return
    with _borrowed(fd) as sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def connect_lane(address: Any, token: bytes) -> Any:
    """A worker's connection to the driver's lane at `address`, its token sent: a Unix socket's, a TCP one's, or over
    TLS when the address says the driver expects it or Ray's TLS is on here (NOTE [ raydl lane TLS ]). OSError when
    there is no lane to have (the driver no longer listens, a TLS context or handshake fails: never plaintext)."""
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(10.0)
            sock.connect(address)
        except OSError:
            sock.close()
            raise
        sock.settimeout(None)
        conn: Any = Connection(sock.detach())
    else:
        host, port = address[0], address[1]
        tls = TLS_FLAG in tuple(address[2:]) or tls_wanted()
        sock = socket.create_connection((host, port), timeout=LANE_TCP_CONNECT_S)
        try:
            tune_tcp(sock)
            if tls:
                conn = tls_connect(sock, host, LANE_HELLO_S)
            else:
                sock.settimeout(None)
                conn = Connection(sock.detach())
        except BaseException:
            sock.close()
            raise
    try:
        conn.send_bytes(token)
    except BaseException:
        conn.close()
        raise
    return conn


def serve_lane(
    address: Any,
    token: bytes,
    turns: Turns,
    make_call: Callable[[int, list], Any],
    sendable: Callable[[Any, BaseException], Any],
) -> None:
    """Connect to the driver's lane at `address` (an abstract Unix socket's name, or a (host, port) on another node)
    and, in a daemon thread, make each call it sends with `make_call` in its turn (`turns`) while the actor serves
    this loader; a reply that cannot be pickled is sent as `sendable(reply, error)` makes it (its unpicklable
    batches as errors). Over TCP a second thread writes the replies. Raises OSError when the driver's lane is not
    there."""
    conn = connect_lane(address, token)
    born = turns.generation
    replies: Optional[queue.SimpleQueue] = None if isinstance(address, str) else queue.SimpleQueue()

    def send_behind() -> None:
        """Write the replies `loop` made, in order; after a failed write only drain them (the driver is gone). Any
        other failure ends the connection, as it would a Unix lane's one thread: the driver sees the lane end, never
        a reply that does not come."""
        assert replies is not None
        failed = False
        while True:
            try:
                reply = replies.get(timeout=LANE_HEARTBEAT_S)
            except queue.Empty:  # nothing to send for a while: a heartbeat (NOTE [ raydl silent node ])
                if not failed:
                    try:
                        conn.send_bytes(b"")
                    except OSError:
                        failed = True
                continue
            if reply is None:
                return
            if not failed:
                try:
                    send_reply(conn, reply, sendable)
                except OSError:
                    failed = True
                except BaseException:
                    failed = True
                    logger.exception("raydl: a lane's reply could not be written; the lane ends")
                    shut_down(conn)

    def loop() -> None:
        writer = None
        if replies is not None:
            writer = threading.Thread(target=send_behind, name="raydl-lane-send", daemon=True)
            writer.start()
        memory = MemoryWriter()  # a Unix lane's shared memory, once the driver sends it (NOTE [ raydl lane memory ])
        try:
            while True:
                if replies is None:  # a Unix lane: a message may hand over the lane's memory, first or larger
                    message, fd = recv_message(conn)
                    if fd is not None:
                        memory.map(fd, pickle.loads(message)[1])
                        continue
                else:
                    message = conn.recv_bytes()
                after, epoch, tasks, slots = pickle.loads(message)
                go_on, reply = turns.lane_call(born, after, lambda: make_call(epoch, tasks))
                if not go_on:  # the actor serves another loader now: nothing more from this lane
                    return
                if replies is not None:
                    replies.put(reply)
                else:
                    memory.reply(conn, reply, slots, sendable)
                del reply
        except (EOFError, OSError):  # the driver closed the lane (epoch over, loader shut down) or went away
            return
        finally:
            if writer is not None:
                assert replies is not None
                replies.put(None)
                writer.join()
            conn.close()
            memory.close()

    threading.Thread(target=loop, name="raydl-lane", daemon=True).start()
