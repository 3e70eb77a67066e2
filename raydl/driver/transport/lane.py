"""The driver's end of the lanes: a worker's calls over a socket (NOTE [ raydl lane ] in worker/lane.py).

NOTE [ raydl lane, driver ]
`Lanes` belongs to one iterator's `CallSender`. For a started worker on the driver's node with a
small first batch (LANE_MAX_BATCH_BYTES), or on another node, the driver asks for a lane at its
next call: it listens (abstract Unix socket, or TCP on its node's IP, TLS under Ray's: NOTE
[ raydl lane TLS ]) and asks the actor through Ray (`Worker.open_lane`, queued behind the calls
sent) to connect with a random token. Calls go through Ray until a connection that sent the
token reaches the listener's thread (NOTE [ raydl lane listener ]), checked without waiting at
each call; then over the lane for good. Each lane call carries how many Ray calls the worker was
sent, and the worker makes it only after those (NOTE [ raydl lane ]): a worker's calls are made in
the order sent, whichever way they went. A lane that does not open leaves the actor on Ray's
calls; a node whose workers cannot reach a TCP lane is not asked again by this process.
A lane call is a `LaneTicket` where a Ray call has its ObjectRef. On the driver's node `receive`
reads replies in order up to the ticket's, keeping earlier ones and dropping abandoned ones.
Across nodes a thread per lane reads each reply as it arrives and rings the lane's bell (a
socket pair `receive` and `first_ready` wait on), so a large batch crosses the network while the
trainer steps. `receive` waits in slices (`GetTimeoutError`, as `ray.get`) and raises `LaneLost`
when the socket ends, which recovery treats as Ray's actor death (NOTE [ raydl recovery ]). With
in_order=False `first_ready` waits on the lanes in short slices and looks at Ray's refs between
them. A replaced worker is a new actor: Ray's calls until its own lane opens. Lanes close with the
iterator's workers (`close`) or the actor's next loader (its generation).
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any, Optional

from ..._constants import (
    LANE_HEARTBEAT_S,
    LANE_HELLO_PENDING,
    LANE_MAX_BATCH_BYTES,
    LANE_OPEN_S,
)
from ..._measures import batch_nbytes
from ...cluster.silent_nodes import mark_silent
from ...worker.lane import since_received_s
from ...worker.lane_tls import TLS_FLAG, tls_context, tls_wanted
from .buffers import ReceiveBuffers
from .lane_accept import Greeter
from .lane_conn import Lane, LaneLost, LaneSilent, LaneTicket, RemoteLane
from .lane_memory import LaneMemoryCounts, memory_for

if TYPE_CHECKING:
    from ...cluster.pool_protocol import DriverPool

__all__ = ["Lanes", "LaneTicket", "LaneLost", "LaneSilent", "worker_node", "listen_for_lane"]

logger = logging.getLogger(__name__)


def worker_node(pool: DriverPool, worker_id: int) -> Optional[str]:
    """The node a pool's worker runs on; None until its actor reported where it runs (it has not started)."""
    record = pool.records[worker_id]
    return None if record is None else record.node_id


# nodes whose workers could not connect to a TCP lane of this process (a firewall): not asked again
_UNREACHED: set[str] = set()


class _Opening:
    """A lane asked for: the driver listens (its `Greeter` hears who connects: NOTE [ raydl lane listener ] in
    driver/transport/lane_accept.py), the actor connects when its queue reaches `open_lane`."""

    def __init__(self, actor: Any, greeter: Greeter, address: Any, reply: Any, node: Any) -> None:
        self.actor, self.greeter, self.reply = actor, greeter, reply
        self.listener_address = address
        self.node: Optional[str] = node  # the worker's node, for a TCP lane to another node; else None
        self.remote = node is not None
        self.answered_s: Optional[float] = None  # when open_lane said the actor connected

    def close(self) -> None:
        self.greeter.stop()


def listen_for_lane(listener: socket.socket, address: Any, token: bytes, remote: bool) -> tuple[Greeter, Any]:
    """Listen on a lane's bound socket, its connections heard by a `Greeter` (NOTE [ raydl lane listener ]): the
    greeter and the address the worker is sent. A TCP lane (`remote`) is TLS when Ray's is on (NOTE [ raydl lane
    TLS ]): the address then says so. OSError, the listener closed, when it cannot be had (TLS included)."""
    try:
        tls = tls_context(server=True) if remote and tls_wanted() else None
        listener.listen(LANE_HELLO_PENDING)
        listener.setblocking(False)
        greeter = Greeter(listener, token, remote, tls)
    except BaseException:
        listener.close()
        raise
    return greeter, ((*address, TLS_FLAG) if tls is not None else address)


class Lanes:
    """The lanes of one iterator's workers (NOTE [ raydl lane, driver ])."""

    def __init__(
        self, pool: DriverPool, driver_node_id: str, max_batches: int, silence_timeout_s: Optional[float] = None
    ) -> None:
        self._pool = pool
        self._silence_timeout_s = silence_timeout_s  # None: only TCP's own timeouts end a silent node's lane
        self._silenced: dict[int, str] = {}  # worker id -> why its lane was closed as silent, until raised
        self._driver_node_id = driver_node_id
        # replies' large arrays: read into memory used again once their batches are gone (NOTE [ raydl receive
        # buffers ]); the batches in flight (`max_batches`), twice, and four more (the trainer's, a pinning copy's)
        self._buffers = ReceiveBuffers(2 * max_batches + 4)
        self._max_batches = max_batches
        self._lanes: dict[int, Lane] = {}
        self._opening: dict[int, _Opening] = {}
        self._ray_sent: dict[int, tuple[Any, int]] = {}  # worker id -> (its actor, Ray calls sent to it)
        self._refused: list[Any] = []  # actors whose lane did not open: they keep Ray's calls
        self._small: dict[int, bool] = {}  # worker id -> whether its first batch was small enough for a lane
        self._first_bytes: dict[int, int] = {}  # worker id -> its first batch's bytes (sizes a lane's memory)
        self.memory_counts = LaneMemoryCounts()  # the local lanes' shared memory (`loader.stats().lane_memory`)
        self._ip: Optional[str] = None  # this node's IP, where lanes to other nodes listen (asked of Ray once)
        self.calls_sent = 0  # calls that went over a lane (stats and tests) ...
        self.remote_calls_sent = 0  # ... of which to workers on other nodes

    def has_lane(self, worker_id: int) -> bool:
        """Whether the worker's next call goes over its open lane (asks for none)."""
        lane = self._lanes.get(worker_id)
        return lane is not None and lane.actor is self._pool.actors[worker_id]

    def lane_for(self, worker_id: int) -> Optional[Lane]:
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
            self._opening.pop(worker_id).close()
            opening = None
        if opening is None:
            node = worker_node(self._pool, worker_id)
            if node is None or any(a is actor for a in self._refused):
                return None
            remote = node != self._driver_node_id
            if (not remote and not self._small.get(worker_id)) or (remote and node in _UNREACHED):
                return None
            opening = self._ask(worker_id, actor, remote)
            if opening is None:
                return None
        lane = self._accept(worker_id, opening)
        if lane is not None:
            self._lanes[worker_id] = lane
        return lane

    def _refuse(self, worker_id: int, actor: Any, why: Any, unreached: bool = False) -> None:
        """The actor keeps Ray's calls; `unreached`: it could not connect to its lane (its node is not asked again)."""
        logger.debug("raydl: worker %d keeps Ray's calls: its lane did not open (%s)", worker_id, why)
        self._refused.append(actor)
        opening = self._opening.pop(worker_id, None)
        if opening is not None:
            opening.close()
            if unreached and opening.node is not None and opening.node not in _UNREACHED:
                _UNREACHED.add(opening.node)
                logger.info(
                    "raydl: workers on node %s could not open a TCP lane to this process at %s (%s): they keep "
                    "Ray's calls (%s; ray_lane=False skips the attempt)",
                    opening.node,
                    opening.listener_address,
                    why,
                    "TLS failed there? the worker's log says why"
                    if TLS_FLAG in opening.listener_address[2:]
                    else "a firewall between the nodes?",
                )

    def _ask(self, worker_id: int, actor: Any, remote: bool) -> Optional[_Opening]:
        """Listen (`_listen`) and ask the actor (through Ray, after its queued calls) to connect."""
        token = secrets.token_bytes(16)
        try:
            listener, address = self._listen(remote)
            greeter, address = listen_for_lane(listener, address, token, remote)
        except OSError as e:  # (a TLS context that cannot be made: logged once by tls_context)
            self._refuse(worker_id, actor, e)
            return None
        node = worker_node(self._pool, worker_id) if remote else None
        try:
            reply = actor.open_lane.remote(address, token)
        except Exception as e:  # noqa: BLE001
            greeter.stop()
            self._refuse(worker_id, actor, e)
            return None
        opening = self._opening[worker_id] = _Opening(actor, greeter, address, reply, node)
        return opening

    def _listen(self, remote: bool) -> tuple[socket.socket, Any]:
        """A fresh abstract Unix socket, or for a worker on another node a TCP port on this node's IP (the one Ray
        uses): (the bound socket, the address the worker connects to)."""
        if remote:
            ip = self._node_ip()
            family, address = (socket.AF_INET6 if ":" in ip else socket.AF_INET), (ip, 0)
        else:
            family, address = socket.AF_UNIX, f"\0raydl-lane-{os.getpid()}-{secrets.token_hex(8)}"
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind(address)
        except OSError:
            listener.close()
            raise
        return listener, (listener.getsockname()[:2] if remote else address)

    def _node_ip(self) -> str:
        if self._ip is None:
            import ray

            self._ip = ray.util.get_node_ip_address()
        return self._ip

    def _accept(self, worker_id: int, opening: _Opening) -> Optional[Lane]:
        """The lane, if the actor's connection has proved itself to the listener's greeter (never waits for it: the
        actor's queue may hold slow calls, and a stranger on the port is the greeter's business, not this thread's)."""
        import ray

        conn = opening.greeter.take()
        if conn is None:
            if opening.answered_s is None:
                done, _ = ray.wait([opening.reply], timeout=0, fetch_local=False)
                if not done:
                    return None  # the actor has not reached open_lane yet
                try:
                    connected = ray.get(opening.reply, timeout=LANE_OPEN_S)
                    why: Any = "no connection"
                except Exception as e:  # noqa: BLE001
                    connected, why = None, e
                if not connected:  # open_lane could not connect (a firewall, TLS refused there) or the actor died
                    self._refuse(worker_id, opening.actor, why, unreached=connected is False)
                    return None
                opening.answered_s = time.monotonic()
            conn = opening.greeter.take()  # its hello may have come meanwhile
            if conn is None:
                if time.monotonic() - opening.answered_s > LANE_OPEN_S:  # it connected; its hello never passed
                    self._refuse(worker_id, opening.actor, f"its connection was dropped ({opening.greeter.why})")
                return None
        opening.close()
        del self._opening[worker_id]
        if opening.remote:
            return RemoteLane(opening.actor, conn, worker_id, self._buffers)
        memory = memory_for(self._first_bytes.get(worker_id, 0), self._max_batches, self.memory_counts)
        if memory is not None:
            try:
                memory.send(conn)
            except OSError:  # the worker is gone: its calls find the lane's end
                memory = None
        return Lane(opening.actor, conn, memory)

    def on_batch(self, worker_id: int, nbytes: int, batch: Any) -> None:
        """A batch of the worker is in hand (`nbytes` from its meta, 0 when stats are off): the first one decides
        whether the worker's batches are small enough for a lane."""
        if worker_id not in self._small:
            size = nbytes or batch_nbytes(batch)
            self._small[worker_id] = size <= LANE_MAX_BATCH_BYTES
            self._first_bytes[worker_id] = size

    def note_ray_call(self, worker_id: int) -> None:
        """A Ray call went to the worker: its lane calls wait until it has run (NOTE [ raydl lane ])."""
        actor = self._pool.actors[worker_id]
        known = self._ray_sent.get(worker_id)
        count = known[1] if known is not None and known[0] is actor else 0
        self._ray_sent[worker_id] = (actor, count + 1)

    def send(self, worker_id: int, epoch: int, tasks: list) -> Optional[tuple[LaneTicket, None]]:
        """One call over the worker's lane: (its ticket, None); None while the worker has no open lane (the call goes
        by Ray; `lane_for` asks for a lane meanwhile)."""
        lane = self.lane_for(worker_id)
        if lane is None:
            return None
        ticket = LaneTicket(worker_id)
        known = self._ray_sent.get(worker_id)
        after = known[1] if known is not None and known[0] is lane.actor else 0
        slots = None
        if lane.remote:
            with lane.lock:  # its reader pops the tickets
                lane.unread.append(ticket)
            self.remote_calls_sent += 1
        else:
            lane.unread.append(ticket)
            taken = lane.slots_for(len(tasks))
            if taken is not None:
                ticket.regions, slots = taken
        try:
            lane.conn.send_bytes(pickle.dumps((after, epoch, tasks, slots), protocol=5))
        except OSError:
            pass  # the worker is gone: `receive` reports it when the driver waits on this call
        self.calls_sent += 1
        return ticket, None

    def receive(self, call: Any, worker_id: int, timeout_s: float) -> tuple:
        """The call's (batches, metas) (`call.ref`: its ticket); GetTimeoutError after `timeout_s`, LaneLost when the
        worker's lane ended."""
        from ray.exceptions import GetTimeoutError

        ticket = call.ref
        if ticket.reply is not None:
            reply, ticket.reply = ticket.reply, None
            return reply
        lane = self._lanes.get(ticket.worker_id)
        if lane is None:
            why = self._silenced.pop(ticket.worker_id, None)
            if why is not None:
                raise LaneSilent(why)
            raise LaneLost(f"the lane of worker {ticket.worker_id} is closed")
        if lane.remote:
            return self._receive_remote(lane, ticket, timeout_s)
        if ticket not in lane.unread:
            raise LaneLost(f"the lane of worker {ticket.worker_id} is closed")
        while True:
            try:
                ready = lane.conn.poll(timeout_s)
                reply = lane.recv(self._buffers.take) if ready else None
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

    def _receive_remote(self, lane: Any, ticket: LaneTicket, timeout_s: float) -> tuple:
        """`receive` on a lane to another node: its reader thread puts the reply in the ticket and rings the bell."""
        from multiprocessing.connection import wait

        from ray.exceptions import GetTimeoutError

        deadline = time.monotonic() + timeout_s
        while True:
            lane.silence()
            try:
                reply = lane.take(ticket)
            except LaneLost:
                self._lost(ticket.worker_id)
                raise
            if reply is not None:
                return reply
            if self._went_silent(lane, ticket.worker_id):
                raise LaneSilent(self._silenced.pop(ticket.worker_id))
            left = deadline - time.monotonic()
            if left <= 0:
                raise GetTimeoutError(f"no reply on worker {ticket.worker_id}'s lane within {timeout_s} s")
            try:
                wait([lane.bell], min(left, LANE_HEARTBEAT_S))
            except OSError:  # the bell closed under the wait: the lane was closed
                pass

    def first_ready(self, tickets: list, timeout_s: float) -> Optional[LaneTicket]:
        """in_order=False: one of `tickets` (each its worker's oldest call in flight) whose reply is in (or whose
        lane ended: `receive` then raises LaneLost), waiting at most `timeout_s`; None when none is ready by then.
        A reply read here waits in its ticket; replies of abandoned calls before it are dropped."""
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout_s
        while True:
            by_conn: dict[Any, LaneTicket] = {}  # a local lane's connection, or a remote lane's bell -> its ticket
            for ticket in tickets:
                if ticket.reply is not None:
                    return ticket
                lane = self._lanes.get(ticket.worker_id)
                if lane is None:
                    return ticket
                if lane.remote:
                    lane.silence()
                    if lane.ready(ticket) or self._went_silent(lane, ticket.worker_id):
                        return ticket
                    by_conn[lane.bell] = ticket
                elif ticket not in lane.unread:
                    return ticket
                else:
                    by_conn[lane.conn] = ticket
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                readable = wait(list(by_conn), min(left, LANE_HEARTBEAT_S))
            except OSError:  # a lane closed under the wait: its worker died
                readable = list(by_conn)
            if not readable:
                continue  # (the deadline is looked at above; silent lanes too)
            for conn in readable:
                ticket = by_conn[conn]
                lane = self._lanes.get(ticket.worker_id)
                if lane is None or (not lane.remote and self._read_until(ticket)):
                    return ticket
            # a remote lane rang (this ticket's reply, its end, or an abandoned call's reply): the loop looks again

    def _read_until(self, ticket: LaneTicket) -> bool:
        """Read the replies already arriving on the ticket's lane, up to its own; whether it is ready (or the
        lane ended)."""
        lane = self._lanes[ticket.worker_id]
        try:
            while lane.conn.poll(0):
                reply = lane.recv(self._buffers.take)
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

    def abandon(self, worker_id: int, ticket: LaneTicket) -> None:
        """The call's batches are not needed: its reply is dropped when it arrives."""
        ticket.abandoned = True
        ticket.reply = None

    def _went_silent(self, lane: Any, worker_id: int) -> bool:
        """Whether the worker's lane to another node has received nothing for the silence timeout: then it is closed
        and its node marked silent (NOTE [ raydl silent node ]); `receive` raises LaneSilent for its call."""
        if self._silence_timeout_s is None:
            return False
        quiet_s = since_received_s(lane.conn)
        if quiet_s is None or quiet_s < self._silence_timeout_s:
            return False
        node = worker_node(self._pool, worker_id)
        self._silenced[worker_id] = (
            f"its node {node[:8] if node else '?'} went silent: nothing on the lane of worker {worker_id} for "
            f"{quiet_s:.1f} s (heartbeats every {LANE_HEARTBEAT_S} s; ray_silence_timeout_s="
            f"{self._silence_timeout_s:g})"
        )
        self._lost(worker_id)
        if node is not None:
            mark_silent(node)
        return True

    def node_went_silent(self, worker_id: int) -> Optional[str]:
        """For a Ray call of worker `worker_id` (sent before its lane opened, or no lane): why its node is silent when
        an open lane to that node is (`_went_silent`), else None. The driver never waits for Ray's verdict on a node
        a lane already shows silent."""
        if self._silence_timeout_s is None:
            return None
        node = worker_node(self._pool, worker_id)
        if node is None or node == self._driver_node_id:
            return None
        for wid, lane in list(self._lanes.items()):
            if lane.remote and worker_node(self._pool, wid) == node and self._went_silent(lane, wid):
                why = self._silenced.pop(wid)
                return why if wid == worker_id else f"{why}; worker {worker_id} is on that node too"
        return None

    def _lost(self, worker_id: int) -> None:
        lane = self._lanes.pop(worker_id, None)
        if lane is not None:
            lane.close()

    def close(self) -> None:
        """Close every lane: the workers' threads stop (their queued calls were abandoned with the iterator)."""
        for lane in self._lanes.values():
            lane.close()
        for opening in self._opening.values():
            opening.close()
        self._lanes.clear()
        self._opening.clear()
        self._buffers.clear()
