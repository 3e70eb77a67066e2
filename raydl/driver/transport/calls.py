"""Sending a worker's calls and letting go of their results: the driver's side of NOTE [ raydl calls ].

A call travels by one of two transports with one interface (`Transport`): Ray's actor calls (`RayCalls`) or the
worker's lane (`Lanes`, NOTE [ raydl lane, driver ] in driver/transport/lane.py). `CallSender` offers each call
to the lanes first, then to Ray, and every later step of the call (receive, first_ready, abandon) goes to the
transport that sent it (`Call.via`). `RayCalls` makes each actor call (`Worker.fetch_many` with two returns,
its `.options()` made once per actor), starts the transfer of a call made on another node at once (NOTE
[ raydl ordering ] in driver/iter.py: `ref.future()` asks the local raylet to pull the object as soon as it
exists), and hands the calls whose results the driver no longer needs back to the pool, once per call
(their worker must finish them before it is reused).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from ..._constants import MIXED_WAIT_FIRST_S, MIXED_WAIT_MAX_S, RAY_INLINE_BYTES_DEFAULT, RAY_INLINE_SHARE
from ..._measures import batch_nbytes
from ...cluster.silent_nodes import reach_raylet_from_cluster
from .lane import Lanes, LaneSilent, worker_node
from .ray_silence import RaySilence

if TYPE_CHECKING:
    from ...cluster.pool_protocol import DriverPool

__all__ = ["CallSender", "RayCalls", "Transport"]


class Transport(Protocol):
    """One way a worker's calls travel. `ref`: what `send` returned first for the call (an ObjectRef, a LaneTicket)."""

    def send(self, worker_id: int, epoch: int, tasks: list) -> Optional[tuple[Any, Any]]:
        """One call to the worker for `tasks` [(idx, work), ...]: (ref, meta ref or None); None when this transport
        does not take the worker's calls now."""

    def receive(self, call: Any, worker_id: int, timeout_s: float) -> tuple[list, list]:
        """`call`'s (batches, metas) (a `Call`: `ref`, `meta_ref`), waiting at most `timeout_s` (Ray's
        GetTimeoutError)."""

    def first_ready(self, refs: list, timeout_s: float) -> Optional[Any]:
        """One of `refs` whose batches are in (or whose worker is lost), waiting at most `timeout_s`; None by then."""

    def abandon(self, worker_id: int, ref: Any) -> None:
        """The call's batches are not needed (once per call)."""


class RayCalls:
    """Ray's actor calls to one iterator's pool. `on_other_node(worker_id)`: the call's batches start moving here at
    once; `silent(worker_id)`: why the worker's node is known silent, or None; `sent(worker_id)`: told of each call;
    `watch`: asks whether a worker's node went silent while its calls are awaited (NOTE [ raydl silent node ])."""

    def __init__(
        self,
        pool: DriverPool,
        on_other_node: Callable[[int], bool],
        silent: Optional[Callable[[int], Optional[str]]] = None,
        sent: Optional[Callable[[int], None]] = None,
        watch: Optional[RaySilence] = None,
    ) -> None:
        self._pool = pool
        self._on_other_node = on_other_node
        self._silent = silent
        self._sent = sent
        self._watch = watch
        self._methods: dict[int, tuple[Any, Any]] = {}  # worker id -> (its actor, fetch_many with num_returns=2)
        self._worker_of: dict[Any, int] = {}  # a watched call's ref -> its worker (first_ready's silence check)
        self._silenced: dict[Any, str] = {}  # a ref first_ready returned for its silent node -> why

    def send(self, worker_id: int, epoch: int, tasks: list) -> tuple[Any, Any]:
        actor = self._pool.actors[worker_id]
        cached = self._methods.get(worker_id)
        if cached is None or cached[0] is not actor:  # `.options()` once per actor: ~25 us a call (Ray 2.60)
            cached = self._methods[worker_id] = (actor, actor.fetch_many.options(num_returns=2))
        ref, meta_ref = cached[1].remote(epoch, tasks)
        if self._sent is not None:
            self._sent(worker_id)
        if self._watch is not None:
            self._watch.sent(worker_id)
            self._worker_of[ref] = worker_id
        if self._on_other_node(worker_id):
            prefetch([ref])
        return ref, meta_ref

    def receive(self, call: Any, worker_id: int, timeout_s: float) -> tuple[list, list]:
        import ray

        why = self._silenced.pop(call.ref, None)
        if why is None and self._silent is not None:
            why = self._silent(worker_id)
        if why is None and self._watch is not None:
            why = self._watch.why_silent(worker_id)
        if why is not None:
            self._worker_of.pop(call.ref, None)
            raise LaneSilent(why)
        batches, metas = ray.get([call.ref, call.meta_ref], timeout=timeout_s)
        if self._worker_of.pop(call.ref, None) is not None:
            self._watch.done(worker_id)
        return batches, metas

    def first_ready(self, refs: list, timeout_s: float) -> Optional[Any]:
        import ray

        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s, fetch_local=True)
        if ready:
            return ready[0]
        if self._watch is not None:  # in_order=False: a silent node's call is "ready" to raise in `receive`
            for ref in refs:
                worker_id = self._worker_of.get(ref)
                why = None if worker_id is None else self._watch.why_silent(worker_id)
                if why is not None:
                    self._silenced[ref] = why
                    return ref
        return None

    def abandon(self, worker_id: int, ref: Any) -> None:
        if self._worker_of.pop(ref, None) is not None:
            self._watch.done(worker_id)
        self._silenced.pop(ref, None)
        self._pool.abandon(worker_id, ref)


class CallSender:
    """The calls of one iterator's pool; `driver_node_id`: the node this process runs on; `lanes`: workers' calls go
    over lanes once they may (NOTE [ raydl lane, driver ] in driver/transport/lane.py); `max_batches`: the prefetch bound."""

    def __init__(
        self,
        pool: DriverPool,
        driver_node_id: str,
        lanes: bool = False,
        max_batches: int = 2,
        silence_timeout_s: Optional[float] = None,
    ) -> None:
        self._pool = pool
        self._driver_node_id = driver_node_id
        self._lanes: Optional[Lanes] = Lanes(pool, driver_node_id, max_batches, silence_timeout_s) if lanes else None
        watch = None
        if silence_timeout_s is not None:  # NOTE [ raydl silent node ]: a Ray Client driver asks from the cluster
            reach = reach_raylet_from_cluster if _via_ray_client() else None
            watch = RaySilence(pool, self._other_node, silence_timeout_s, reach=reach)
        if self._lanes is None:
            self._ray = RayCalls(pool, self.on_other_node, watch=watch)
        else:
            self._ray = RayCalls(
                pool, self.on_other_node, self._lanes.node_went_silent, self._lanes.note_ray_call, watch=watch
            )
        # offered a call in this order: a lane when the worker has one open, else Ray's call (it takes every call)
        self._transports: tuple[Transport, ...] = (self._ray,) if self._lanes is None else (self._lanes, self._ray)
        self._ray_call_bytes = int(RAY_INLINE_SHARE * _ray_inline_bytes())  # NOTE [ raydl calls ]: Ray's inline share

    def send(self, worker_id: int, epoch: int, tasks: list) -> tuple[Any, Any, Transport]:
        """One call to a worker for `tasks` [(idx, work), ...]: (ref, meta ref or None, the transport that sent it)."""
        for via in self._transports:
            sent = via.send(worker_id, epoch, tasks)
            if sent is not None:
                return sent[0], sent[1], via
        raise AssertionError("raydl bug: no transport took a call (Ray's calls take every call)")

    def receive(self, call: Any, worker_id: int, timeout_s: float) -> tuple[list, list]:
        """Worker `worker_id`'s call's (batches, metas), waiting at most `timeout_s` (ray's GetTimeoutError); a
        lane's end raises LaneLost, a Ray call's worker death Ray's errors, and either LaneSilent when a lane to the
        worker's node went silent (NOTE [ raydl silent node ])."""
        return call.via.receive(call, worker_id, timeout_s)

    def first_ready(self, calls: list, timeout_s: float) -> Optional[Any]:
        """in_order=False: the ref of one of `calls` whose batches are in, waiting at most `timeout_s`; None when none
        is by then. With calls on both transports, the lanes are waited on in slices growing from MIXED_WAIT_FIRST_S
        to MIXED_WAIT_MAX_S and Ray's refs looked at between them (never waited on)."""
        by_via: dict[Any, list] = {}
        for call in calls:
            by_via.setdefault(call.via, []).append(call.ref)
        if len(by_via) == 1:
            ((via, refs),) = by_via.items()
            return via.first_ready(refs, timeout_s)
        (waited, waited_refs), *looked_at = [(via, by_via[via]) for via in self._transports if via in by_via]
        deadline = time.monotonic() + timeout_s
        slice_s = MIXED_WAIT_FIRST_S
        while True:
            for via, refs in looked_at:
                ready = via.first_ready(refs, 0)
                if ready is not None:
                    return ready
            left = deadline - time.monotonic()
            ready = waited.first_ready(waited_refs, max(0.0, min(slice_s, left)))
            if ready is not None or left <= slice_s:
                return ready
            slice_s = min(2 * slice_s, MIXED_WAIT_MAX_S)

    def call_bytes(self, worker_id: int) -> Optional[int]:
        """The most bytes of batches worker `worker_id`'s next call should carry: on another node and on Ray's calls,
        what Ray still sends inline with the reply (NOTE [ raydl calls ]); None (no bound) otherwise."""
        if not self.on_other_node(worker_id) or (self._lanes is not None and self._lanes.has_lane(worker_id)):
            return None
        return self._ray_call_bytes

    def on_batch(self, worker_id: int, nbytes: int, batch: Any) -> int:
        """A batch is in hand: its size tells whether its worker may take a lane (NOTE [ raydl lane, driver ]) and,
        on another node, how many such batches a Ray call may carry (`call_bytes`). Returns that size: `nbytes`
        from the batch's meta, or with stats off (0) measured here for a worker on another node."""
        if not nbytes and self.on_other_node(worker_id):
            nbytes = batch_nbytes(batch)
        if self._lanes is not None:
            self._lanes.on_batch(worker_id, nbytes, batch)
        return nbytes

    @property
    def lane_memory(self) -> Any:
        """The local lanes' `LaneMemoryCounts` (NOTE [ raydl lane memory ]); None without lanes."""
        return None if self._lanes is None else self._lanes.memory_counts

    @property
    def lane_calls(self) -> int:
        """Calls sent over lanes so far (NOTE [ raydl lane, driver ])."""
        return 0 if self._lanes is None else self._lanes.calls_sent

    def close(self) -> None:
        """The iterator lets its workers go: their lanes close."""
        if self._lanes is not None:
            self._lanes.close()

    def on_other_node(self, worker_id: int) -> bool:
        return self._other_node(worker_id) is not None

    def _other_node(self, worker_id: int) -> Optional[str]:
        """The worker's node when it is another than the driver's, else None."""
        node = worker_node(self._pool, worker_id)
        return node if node is not None and node != self._driver_node_id else None

    def abandon(self, tasks: list) -> None:
        """Forget these tasks' results: each call carrying one of them goes back to the pool once."""
        seen: set[int] = set()
        for task in tasks:
            call = task.call
            if call is not None and id(call) not in seen:
                seen.add(id(call))
                call.via.abandon(task.worker_id, call.ref)

    def start_transfers(self, tasks: Any) -> None:
        """The workers just said where they run: calls already sent to other nodes start moving here."""
        calls = {id(t.call): (t.call, t.worker_id) for t in tasks if t.call is not None and t.call.via is self._ray}
        prefetch([c.ref for c, w in calls.values() if not c.received and self.on_other_node(w)])


def prefetch(refs: list) -> None:
    """Have Ray pull these (remote) batches to this node as soon as they exist."""
    for ref in refs:
        ref.future()


def _via_ray_client() -> bool:
    """This process reaches Ray through Ray Client (its nodes' raylet ports need not be reachable from here)."""
    import ray

    return ray.util.client.ray.is_connected()


def _ray_inline_bytes() -> int:
    """Ray's inline limit for a task's return (`max_direct_call_object_size`), as this process's environment sets it."""
    try:
        return int(os.environ.get("RAY_max_direct_call_object_size", RAY_INLINE_BYTES_DEFAULT))
    except ValueError:
        return RAY_INLINE_BYTES_DEFAULT
