"""Whether a worker reached over Ray's calls sits on a node that went silent (NOTE [ raydl silent node ]).

A lane hears a worker's heartbeats; a Ray call hears nothing until its reply. `RaySilence` keeps, per worker, when
the driver last heard from it (a reply, or a call sent when it had none outstanding) and, once that is
`ray_silence_timeout_s` ago for a worker on another node the driver waits on, asks the kernel whether the node still
answers: one TCP connection to its raylet's port (`reach_raylet`). A node that answers is not asked again for
another timeout; one that does not is marked silent and its worker's call dropped (`LaneSilent`, recovered as a
death).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..._constants import RAYLET_PROBE_S
from ...cluster.silent_nodes import mark_silent, reach_raylet

if TYPE_CHECKING:
    from ...cluster.pool_protocol import DriverPool

__all__ = ["RaySilence"]


class RaySilence:
    """The Ray calls of one iterator's pool, watched for silent nodes. `node_of(worker_id)`: the worker's node, None
    until known or when it is the driver's own; `reach(node_id, timeout_s)`: the probe (`reach_raylet`)."""

    def __init__(
        self,
        pool: DriverPool,
        node_of: Callable[[int], Optional[str]],
        timeout_s: float,
        reach: Optional[Callable[[str, float], str]] = None,
    ) -> None:
        self._pool = pool
        self._node_of = node_of
        self._timeout_s = timeout_s
        self._reach = reach if reach is not None else reach_raylet
        self._outstanding: dict[int, tuple[Any, int]] = {}  # worker id -> (its actor, Ray calls the driver awaits)
        self._heard: dict[int, float] = {}  # worker id -> when the driver last heard from it
        self._answered: dict[str, float] = {}  # node id -> when its raylet last answered a probe

    def sent(self, worker_id: int) -> None:
        """A Ray call went to the worker: an idle worker's clock starts now."""
        actor = self._pool.actors[worker_id]
        held, count = self._outstanding.get(worker_id, (None, 0))
        if held is not actor:  # a replacement starts afresh
            count = 0
        if count == 0:
            self._heard[worker_id] = time.monotonic()
        self._outstanding[worker_id] = (actor, count + 1)

    def done(self, worker_id: int) -> None:
        """A call of the worker was read or let go: the driver heard from it (or waits on it no more)."""
        actor, count = self._outstanding.get(worker_id, (None, 0))
        self._outstanding[worker_id] = (actor, max(0, count - 1))
        self._heard[worker_id] = time.monotonic()

    def why_silent(self, worker_id: int) -> Optional[str]:
        """Why the worker's node is silent, or None; probes the node once a timeout has passed without a word."""
        actor, count = self._outstanding.get(worker_id, (None, 0))
        if count == 0 or actor is not self._pool.actors[worker_id]:
            return None
        now = time.monotonic()
        quiet_s = now - self._heard.get(worker_id, now)
        if quiet_s < self._timeout_s:
            return None
        node = self._node_of(worker_id)
        if node is None or now - self._answered.get(node, -float("inf")) < self._timeout_s:
            return None
        verdict = self._reach(node, RAYLET_PROBE_S)
        if verdict not in ("timeout", "refused"):  # it answers (a slow batch), or Ray cannot say: keep waiting
            self._answered[node] = time.monotonic()
            return None
        what = "did not answer within" if verdict == "timeout" else "refused a connection, tried for"
        why = (
            f"its node {node[:8]} went silent: nothing from worker {worker_id}'s Ray calls for {quiet_s:.1f} s and "
            f"its raylet {what} {RAYLET_PROBE_S:g} s (ray_silence_timeout_s={self._timeout_s:g})"
        )
        mark_silent(node, why)
        self._outstanding.pop(worker_id, None)
        return why
