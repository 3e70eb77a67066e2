"""Sending a worker's calls and letting go of their results: the driver's side of NOTE [ raydl calls ].

`CallSender` makes each actor call (`Worker.fetch_many` with two returns, its `.options()` made once per
actor), starts the transfer of a call made on another node at once (NOTE [ raydl ordering ] in
driver/iter.py: `ref.future()` asks the local raylet to pull the object as soon as it exists), and
hands the calls whose results the driver no longer needs back to the pool, once per call
(their worker must finish them before it is reused).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from ..._constants import MIXED_WAIT_FIRST_S, MIXED_WAIT_MAX_S, RAY_INLINE_BYTES_DEFAULT, RAY_INLINE_SHARE
from ..._measures import batch_nbytes
from .lane import Lanes, LaneSilent, LaneTicket, worker_node

__all__ = ["CallSender"]


class CallSender:
    """The calls of one iterator's pool; `driver_node_id`: the node this process runs on; `lanes`: workers' calls go
    over lanes once they may (NOTE [ raydl lane, driver ] in driver/transport/lane.py); `max_batches`: the prefetch bound."""

    def __init__(
        self,
        pool: Any,
        driver_node_id: str,
        lanes: bool = False,
        max_batches: int = 2,
        silence_timeout_s: Optional[float] = None,
    ) -> None:
        self._pool = pool
        self._driver_node_id = driver_node_id
        self._methods: dict[int, tuple[Any, Any]] = {}  # worker id -> (its actor, fetch_many with num_returns=2)
        self._lanes: Optional[Lanes] = Lanes(pool, driver_node_id, max_batches, silence_timeout_s) if lanes else None
        self._ray_call_bytes = int(RAY_INLINE_SHARE * _ray_inline_bytes())  # NOTE [ raydl calls ]: Ray's inline share

    def send(self, worker_id: int, epoch: int, tasks: list) -> tuple[Any, Any]:
        """One call to a worker for `tasks` [(idx, work), ...]: (batches ref, metas ref), or (LaneTicket, None)."""
        if self._lanes is not None:
            lane = self._lanes.lane_for(worker_id)
            if lane is not None:
                return self._lanes.send(lane, worker_id, epoch, tasks), None
        actor = self._pool.actors[worker_id]
        cached = self._methods.get(worker_id)
        if cached is None or cached[0] is not actor:  # `.options()` once per actor: ~25 us a call (Ray 2.60)
            cached = self._methods[worker_id] = (actor, actor.fetch_many.options(num_returns=2))
        ref, meta_ref = cached[1].remote(epoch, tasks)
        if self._lanes is not None:
            self._lanes.note_ray_call(worker_id)
        if self.on_other_node(worker_id):
            self.prefetch([ref])
        return ref, meta_ref

    def receive(self, call: Any, worker_id: int, timeout_s: float) -> tuple[list, list]:
        """Worker `worker_id`'s call's (batches, metas), waiting at most `timeout_s` (ray's GetTimeoutError); a
        lane's end raises LaneLost, a Ray call's worker death Ray's errors, and either LaneSilent when a lane to the
        worker's node went silent (NOTE [ raydl silent node ])."""
        if type(call.ref) is LaneTicket:
            assert self._lanes is not None
            return self._lanes.receive(call.ref, timeout_s)
        import ray

        if self._lanes is not None:
            silent = self._lanes.node_went_silent(worker_id)
            if silent is not None:
                raise LaneSilent(silent)

        batches, metas = ray.get([call.ref, call.meta_ref], timeout=timeout_s)
        return batches, metas

    def first_ready(self, refs: list, timeout_s: float) -> Optional[Any]:
        """in_order=False: one of `refs` (calls' ObjectRefs or LaneTickets) whose batches are in, waiting at most
        `timeout_s`; None when none is by then. With both kinds, the lanes are waited on in slices growing from
        MIXED_WAIT_FIRST_S to MIXED_WAIT_MAX_S and Ray's refs looked at between them (never waited on)."""
        import ray

        tickets = [r for r in refs if type(r) is LaneTicket]
        if not tickets:
            ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s, fetch_local=True)
            return ready[0] if ready else None
        assert self._lanes is not None
        others = [r for r in refs if type(r) is not LaneTicket]
        if not others:
            return self._lanes.first_ready(tickets, timeout_s)
        deadline = time.monotonic() + timeout_s
        slice_s = MIXED_WAIT_FIRST_S
        while True:
            ready, _ = ray.wait(others, num_returns=1, timeout=0, fetch_local=True)
            if ready:
                return ready[0]
            left = deadline - time.monotonic()
            ticket = self._lanes.first_ready(tickets, max(0.0, min(slice_s, left)))
            if ticket is not None or left <= slice_s:
                return ticket
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
    def lane_calls(self) -> int:
        """Calls sent over lanes so far (NOTE [ raydl lane, driver ])."""
        return 0 if self._lanes is None else self._lanes.calls_sent

    def close(self) -> None:
        """The iterator lets its workers go: their lanes close."""
        if self._lanes is not None:
            self._lanes.close()

    @staticmethod
    def prefetch(refs: list) -> None:
        """Have Ray pull these (remote) batches to this node as soon as they exist."""
        for ref in refs:
            ref.future()

    def on_other_node(self, worker_id: int) -> bool:
        node = worker_node(self._pool, worker_id)
        return node is not None and node != self._driver_node_id

    def abandon(self, tasks: list) -> None:
        """Forget these tasks' results: each call carrying one of them goes back to the pool once."""
        seen: set[int] = set()
        for task in tasks:
            call = task.call
            if call is not None and id(call) not in seen:
                seen.add(id(call))
                if type(call.ref) is LaneTicket:
                    assert self._lanes is not None
                    self._lanes.abandon(call.ref)
                else:
                    self._pool.abandon(task.worker_id, call.ref)

    def start_transfers(self, tasks: Any) -> None:
        """The workers just said where they run: calls already sent to other nodes start moving here."""
        calls = {id(t.call): (t.call, t.worker_id) for t in tasks if t.call is not None and t.call.meta_ref is not None}
        self.prefetch([c.ref for c, w in calls.values() if not c.received and self.on_other_node(w)])


def _ray_inline_bytes() -> int:
    """Ray's inline limit for a task's return (`max_direct_call_object_size`), as this process's environment sets it."""
    try:
        return int(os.environ.get("RAY_max_direct_call_object_size", RAY_INLINE_BYTES_DEFAULT))
    except ValueError:
        return RAY_INLINE_BYTES_DEFAULT
