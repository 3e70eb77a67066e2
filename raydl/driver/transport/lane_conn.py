"""One lane's connection on the driver's side (NOTE [ raydl lane, driver ] in driver/transport/lane.py): the calls
sent over it (`LaneTicket`), reading their replies in order on the driver's node (`Lane`, with its shared memory
growing for batches that outgrow it: NOTE [ raydl lane memory ]), and across nodes a reader thread per lane that
rings a bell as each reply arrives (`RemoteLane`). `Lanes` (lane.py) opens lanes and routes calls over them; this
module is what a lane is once open.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Optional

from ..._constants import LANE_MEMORY_MAX_PAUSE, LANE_TCP_WAKE_BYTES
from ...worker.lane import recv_reply, shut_down
from .buffers import ReceiveBuffers
from .lane_memory import LaneMemory

__all__ = ["Lane", "LaneLost", "LaneSilent", "LaneTicket", "RemoteLane"]


class LaneLost(Exception):
    """The lane of a worker ended while the driver waited on it: its process died (NOTE [ raydl lane, driver ])."""


class LaneSilent(LaneLost):
    """Nothing came on a worker's TCP lane for `ray_silence_timeout_s`: its node went silent (NOTE [ raydl silent
    node ] in cluster/silent_nodes.py). Recovered as a death; the lane is closed, so no late reply is read."""


class LaneTicket:
    """A call sent over a worker's lane, in place of a Ray call's ObjectRef."""

    __slots__ = ("worker_id", "reply", "abandoned", "regions")

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.reply: Optional[tuple] = None  # (batches, metas) once read, while the call waits its turn
        self.abandoned = False
        # the slots of the lane's memory its reply may fill, held (so in use) until the reply is read (NOTE [ raydl
        # lane memory ]); None: its reply crosses the socket
        self.regions: Optional[list] = None


class Lane:
    """One worker's socket: its actor, the connection, the tickets in send order whose replies are not read yet."""

    remote = False

    def __init__(self, actor: Any, conn: Connection, memory: Optional[LaneMemory] = None) -> None:
        self.actor = actor
        self.conn = conn
        self.memory = memory  # a local lane's shared memory (NOTE [ raydl lane memory ]), if it has one
        self.unread: deque[LaneTicket] = deque()
        # the largest reply that did not fit its slots since the memory last grew: it grows before the next call
        self.needed = 0
        # calls to send without slots before trying the memory again, and how many the last pause was: the worker's
        # replies could not use it (larger than the largest memory, or refused by the plain pickler; NOTE [ raydl
        # lane memory ], pauses)
        self.pause = 0
        self.last_pause = 0

    def recv(self, alloc: Any) -> tuple:
        """Read the next reply: the oldest unread ticket's (replies come in the order of the calls)."""
        ticket = self.unread[0]
        try:
            noted = None if ticket.regions is None else self._noted
            return recv_reply(self.conn, alloc=alloc, regions=ticket.regions, noted=noted)
        finally:
            ticket.regions = None  # its reply's arrays now hold the slots they use, nothing else

    def _noted(self, how: str, nbytes: int) -> None:
        """How a reply to a call given slots came (`recv_reply`): counted; one that did not fit grows the memory."""
        assert self.memory is not None
        self.memory.counts.noted(how)
        if how == "full":
            self.needed = max(self.needed, nbytes)
        elif how == "refused":
            self._paused()
        elif how == "memory":
            self.last_pause = 0

    def _paused(self) -> None:
        """The next calls go without slots: 1, then twice as many after each reply that still cannot use the memory,
        at most LANE_MEMORY_MAX_PAUSE (NOTE [ raydl lane memory ], pauses)."""
        self.last_pause = self.pause = min(max(1, 2 * self.last_pause), LANE_MEMORY_MAX_PAUSE)

    def slots_for(self, k: int) -> Optional[tuple[list, list]]:
        """The slots a call of `k` tasks may fill (`LaneMemory.take`), or None: no memory, none free, or a pause."""
        if self.memory is None:
            return None
        if self.needed:
            self.grow()
        if self.pause:
            self.pause -= 1
            self.memory.counts.paused += 1
            return None
        return self.memory.take(k)

    def grow(self) -> None:
        """A larger memory in place of this lane's, for the replies that did not fit (`needed`), sent to the worker
        ahead of the next call (NOTE [ raydl lane memory ]). The old one stays mapped while its batches use it."""
        assert self.memory is not None
        needed, self.needed = self.needed, 0
        memory = self.memory.grown(needed)
        if memory is None:
            if needed > self.memory.slot_bytes:  # at the cap (or no larger memory could be made): the socket it is
                self._paused()
            return
        try:
            memory.send(self.conn)
        except OSError:  # the worker is gone: its calls find the lane's end
            return
        memory.counts.regrown += 1
        self.memory = memory

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


class RemoteLane(Lane):
    """A lane to a worker on another node: its thread reads each reply as it arrives into its ticket and rings `bell`
    (NOTE [ raydl lane, driver ]). `lost` holds why the lane ended, once it did."""

    remote = True

    def __init__(self, actor: Any, conn: Connection, worker_id: int, buffers: ReceiveBuffers) -> None:
        super().__init__(actor, conn)
        self._buffers = buffers
        self.lock = threading.Lock()
        self.lost: Optional[BaseException] = None
        self.bell, self._ring = socket.socketpair()
        self.bell.setblocking(False)
        self._ring.setblocking(False)
        self._reader = threading.Thread(target=self._read, name=f"raydl-lane-{worker_id}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                reply = recv_reply(self.conn, LANE_TCP_WAKE_BYTES, self._buffers.take)
                with self.lock:
                    ticket = self.unread.popleft()
                    if not ticket.abandoned:
                        ticket.reply = reply
                del reply, ticket
                self._ring_bell()
        except BaseException as e:  # the end (EOFError, OSError), or a reply that cannot be read: raised at its turn
            with self.lock:
                self.lost = e
            self._ring_bell()
        finally:
            with self.lock:  # this thread closes the connection; `close` only shuts it down, under the same lock
                self.conn.close()

    def _ring_bell(self) -> None:
        try:
            self._ring.send(b"\0")
        except OSError:  # full (a ring is pending anyway), or the lane was closed
            pass

    def silence(self) -> None:
        """Drain the bell before looking at the tickets: a reply set after this rings again."""
        try:
            while self.bell.recv(4096):
                pass
        except OSError:
            pass

    def take(self, ticket: LaneTicket) -> Optional[tuple]:
        """The ticket's reply if in; LaneLost if the lane ended before it came; None while it is on its way."""
        with self.lock:
            reply = ticket.reply
            if reply is not None:
                ticket.reply = None
                return reply
            if self.lost is not None and not isinstance(self.lost, (EOFError, OSError)):
                raise self.lost  # what reading the reply raised (an unpicklable batch type here): as on a local lane
            if self.lost is not None or ticket not in self.unread:
                raise LaneLost(f"the lane of worker {ticket.worker_id} ended: its process died ({self.lost!r})")
        return None

    def ready(self, ticket: LaneTicket) -> bool:
        with self.lock:
            return ticket.reply is not None or self.lost is not None or ticket not in self.unread

    def close(self) -> None:
        """Shut the connection down (its reader sees the end and closes it) and the bell."""
        with self.lock:
            if not self.conn.closed:
                shut_down(self.conn)
        self.bell.close()
        self._ring.close()
