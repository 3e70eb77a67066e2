"""The driver's end of the lanes: a local worker's calls over a socket (NOTE [ raydl lane ] in worker/lane.py).

NOTE [ raydl lane, driver ]
`Lanes` belongs to one iterator's `CallSender`. For a worker that runs on the driver's node, has
started (its record says where it runs) and whose first batch was small (LANE_MAX_BATCH_BYTES of
arrays at most), the driver asks for a lane at its next call: it
listens on a fresh abstract Unix socket and asks the actor through Ray (`Worker.open_lane`, queued
behind the calls already sent) to connect with a random token. Calls go through Ray until the
connection is there (checked without waiting at each call: the actor's queue may hold slow
calls), then over the lane for good. Each lane call carries how many Ray calls the worker was
sent, and the worker makes it only after those (NOTE [ raydl lane ]): the order of a worker's
calls is the order they were sent, whichever way they went. An actor whose lane did not open
keeps Ray's calls (logged at debug level).
A lane call is a `LaneTicket` in the `Call` where a Ray call has its ObjectRef. `receive` reads the
worker's replies in order until the ticket's, keeping those of earlier calls for their turn and
dropping those of abandoned ones; it waits in slices (Ray's `GetTimeoutError` when the slice ends,
as `ray.get`'s timeout) and raises `LaneLost` when the socket ends: the worker died, which
recovery treats as Ray's actor death (NOTE [ raydl recovery ] in driver/recovery.py). With
in_order=False the driver waits on the sockets of the workers' oldest calls at once (`first_ready`:
the first reply in is handed out first, as `ray.wait` does for Ray's calls); while some of those
calls went through Ray, `CallSender.first_ready` waits on the lanes in short slices and looks at the
Ray refs between them. A replaced
worker is a new actor: its calls go through Ray until its own lane opens. The lanes close with the
iterator's workers (`close`), or with the actor's next loader (its generation).
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Optional

from .._constants import LANE_MAX_BATCH_BYTES, LANE_OPEN_S
from .._measures import batch_nbytes
from ..worker.lane import recv_reply

__all__ = ["Lanes", "LaneTicket", "LaneLost", "worker_node"]

logger = logging.getLogger(__name__)


def worker_node(pool: Any, worker_id: int) -> Optional[str]:
    """The node a pool's worker runs on; None until its actor reported where it runs (it has not started)."""
    record = pool.records[worker_id]
    return None if record is None else record.node_id


class LaneLost(Exception):
    """The lane of a worker ended while the driver waited on it: its process died (NOTE [ raydl lane, driver ])."""


class LaneTicket:
    """A call sent over a worker's lane, in place of a Ray call's ObjectRef."""

    __slots__ = ("worker_id", "reply", "abandoned")

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.reply: Optional[tuple] = None  # (batches, metas) once read, while the call waits its turn
        self.abandoned = False


class _Lane:
    """One worker's socket: its actor, the connection, the tickets in send order whose replies are not read yet."""

    def __init__(self, actor: Any, conn: Connection) -> None:
        self.actor = actor
        self.conn = conn
        self.unread: deque[LaneTicket] = deque()

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


class _Opening:
    """A lane asked for: the driver listens, the actor connects when its queue reaches `open_lane`."""

    def __init__(self, actor: Any, listener: socket.socket, token: bytes, reply: Any) -> None:
        self.actor, self.listener, self.token, self.reply = actor, listener, token, reply


class Lanes:
    """The lanes of one iterator's workers (NOTE [ raydl lane, driver ])."""

    def __init__(self, pool: Any, driver_node_id: str) -> None:
        self._pool = pool
        self._driver_node_id = driver_node_id
        self._lanes: dict[int, _Lane] = {}
        self._opening: dict[int, _Opening] = {}
        self._ray_sent: dict[int, tuple[Any, int]] = {}  # worker id -> (its actor, Ray calls sent to it)
        self._refused: list[Any] = []  # actors whose lane did not open: they keep Ray's calls
        self._small: dict[int, bool] = {}  # worker id -> whether its first batch was small enough for a lane
        self.calls_sent = 0  # calls that went over a lane (stats and tests)

    def lane_for(self, worker_id: int) -> Optional[_Lane]:
        """The worker's lane if its next call goes over it, else None (Ray's call; a lane is asked for meanwhile)."""
        actor = self._pool.actors[worker_id]
        lane = self._lanes.get(worker_id)
        if lane is not None:
            if lane.actor is actor:
                return lane
            lane.close()  # the worker was replaced: the new actor starts on Ray's calls
            del self._lanes[worker_id]
        opening = self._opening.get(worker_id)
        if opening is not None and opening.actor is not actor:  # asked of an actor since replaced
            self._opening.pop(worker_id).listener.close()
            opening = None
        if opening is None:
            if (
                not self._small.get(worker_id)
                or any(a is actor for a in self._refused)
                or worker_node(self._pool, worker_id) != self._driver_node_id
            ):
                return None
            opening = self._ask(worker_id, actor)
            if opening is None:
                return None
        lane = self._accept(worker_id, opening)
        if lane is not None:
            self._lanes[worker_id] = lane
        return lane

    def _refuse(self, worker_id: int, actor: Any, why: Any) -> None:
        logger.debug("raydl: worker %d keeps Ray's calls: its lane did not open (%s)", worker_id, why)
        self._refused.append(actor)
        opening = self._opening.pop(worker_id, None)
        if opening is not None:
            opening.listener.close()

    def _ask(self, worker_id: int, actor: Any) -> Optional[_Opening]:
        """Listen on a fresh abstract socket and ask the actor (through Ray, after its queued calls) to connect."""
        token = secrets.token_bytes(16)
        address = f"\0raydl-lane-{os.getpid()}-{secrets.token_hex(8)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address)
            listener.listen(1)
            listener.setblocking(False)
            reply = actor.open_lane.remote(address, token)
        except Exception as e:  # noqa: BLE001 - no lane: the worker keeps Ray's calls
            listener.close()
            self._refuse(worker_id, actor, e)
            return None
        opening = self._opening[worker_id] = _Opening(actor, listener, token, reply)
        return opening

    def _accept(self, worker_id: int, opening: _Opening) -> Optional[_Lane]:
        """The lane, if the actor has connected (never waits for it to: its queue may hold slow calls)."""
        import ray

        for attempt in range(2):
            try:
                sock, _ = opening.listener.accept()
                break
            except BlockingIOError:
                done, _ = ray.wait([opening.reply], timeout=0, fetch_local=False)
                if not done:
                    return None  # the actor has not reached open_lane yet
                if attempt == 0:
                    continue  # it connected between the accept and the wait
                try:  # open_lane ran and no connection came: it failed (or the actor died)
                    ray.get(opening.reply, timeout=LANE_OPEN_S)
                    why: Any = "no connection"
                except Exception as e:  # noqa: BLE001
                    why = e
                self._refuse(worker_id, opening.actor, why)
                return None
            except OSError as e:
                self._refuse(worker_id, opening.actor, e)
                return None
        sock.setblocking(True)
        conn = Connection(sock.detach())
        try:
            ok = conn.poll(LANE_OPEN_S) and conn.recv_bytes() == opening.token
        except (EOFError, OSError):
            ok = False
        if not ok:
            conn.close()
            self._refuse(worker_id, opening.actor, "a connection without the lane's token")
            return None
        opening.listener.close()
        del self._opening[worker_id]
        return _Lane(opening.actor, conn)

    def on_batch(self, worker_id: int, nbytes: int, batch: Any) -> None:
        """A batch of the worker is in hand (`nbytes` from its meta, 0 when stats are off): the first one decides
        whether the worker's batches are small enough for a lane."""
        if worker_id not in self._small:
            self._small[worker_id] = (nbytes or batch_nbytes(batch)) <= LANE_MAX_BATCH_BYTES

    def note_ray_call(self, worker_id: int) -> None:
        """A Ray call went to the worker: its lane calls wait until it has run (NOTE [ raydl lane ])."""
        actor = self._pool.actors[worker_id]
        known = self._ray_sent.get(worker_id)
        count = known[1] if known is not None and known[0] is actor else 0
        self._ray_sent[worker_id] = (actor, count + 1)

    def send(self, lane: _Lane, worker_id: int, epoch: int, tasks: list) -> LaneTicket:
        ticket = LaneTicket(worker_id)
        known = self._ray_sent.get(worker_id)
        after = known[1] if known is not None and known[0] is lane.actor else 0
        try:
            lane.conn.send_bytes(pickle.dumps((after, epoch, tasks), protocol=5))
        except OSError:
            pass  # the worker is gone: `receive` reports it when the driver waits on this call
        lane.unread.append(ticket)
        self.calls_sent += 1
        return ticket

    def receive(self, ticket: LaneTicket, timeout_s: float) -> tuple:
        """The call's (batches, metas); GetTimeoutError after `timeout_s`, LaneLost when the worker's lane ended."""
        from ray.exceptions import GetTimeoutError

        if ticket.reply is not None:
            reply, ticket.reply = ticket.reply, None
            return reply
        lane = self._lanes.get(ticket.worker_id)
        if lane is None or ticket not in lane.unread:
            raise LaneLost(f"the lane of worker {ticket.worker_id} is closed")
        while True:
            try:
                ready = lane.conn.poll(timeout_s)
                reply = recv_reply(lane.conn) if ready else None
            except (EOFError, OSError) as e:
                self._lost(ticket.worker_id)
                raise LaneLost(f"the lane of worker {ticket.worker_id} ended: its process died ({e!r})") from None
            if not ready:  # (GetTimeoutError is an OSError: raised outside the try)
                raise GetTimeoutError(f"no reply on worker {ticket.worker_id}'s lane within {timeout_s} s")
            first = lane.unread.popleft()
            if first is ticket:
                return reply
            if not first.abandoned:
                first.reply = reply  # an earlier call of the worker: kept for its turn

    def first_ready(self, tickets: list, timeout_s: float) -> Optional[LaneTicket]:
        """in_order=False: one of `tickets` (each its worker's oldest call in flight) whose reply is in (or whose
        lane ended: `receive` then raises LaneLost), waiting at most `timeout_s`; None when none is ready by then.
        A reply read here waits in its ticket; replies of abandoned calls before it are dropped."""
        from multiprocessing.connection import wait

        by_conn: dict[Any, LaneTicket] = {}
        for ticket in tickets:
            if ticket.reply is not None:
                return ticket
            lane = self._lanes.get(ticket.worker_id)
            if lane is None or ticket not in lane.unread:
                return ticket
            by_conn[lane.conn] = ticket
        try:
            readable = wait(list(by_conn), timeout_s)
        except OSError:  # a lane closed under the wait: its worker died
            readable = list(by_conn)
        for conn in readable:
            ticket = by_conn[conn]
            if self._read_until(ticket):
                return ticket
        return None

    def _read_until(self, ticket: LaneTicket) -> bool:
        """Read the replies already arriving on the ticket's lane, up to its own; whether it is ready (or the
        lane ended)."""
        lane = self._lanes[ticket.worker_id]
        try:
            while lane.conn.poll(0):
                reply = recv_reply(lane.conn)
                first = lane.unread.popleft()
                if first is ticket:
                    ticket.reply = reply
                    return True
                if not first.abandoned:
                    first.reply = reply
        except (EOFError, OSError):
            self._lost(ticket.worker_id)
            return True
        return False

    def abandon(self, ticket: LaneTicket) -> None:
        """The call's batches are not needed: its reply is dropped when it arrives."""
        ticket.abandoned = True
        ticket.reply = None

    def _lost(self, worker_id: int) -> None:
        lane = self._lanes.pop(worker_id, None)
        if lane is not None:
            lane.close()

    def close(self) -> None:
        """Close every lane: the workers' threads stop (their queued calls were abandoned with the iterator)."""
        for lane in self._lanes.values():
            lane.close()
        for opening in self._opening.values():
            opening.listener.close()
        self._lanes.clear()
        self._opening.clear()
