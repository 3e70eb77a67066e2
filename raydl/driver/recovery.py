"""Recovery from a lost worker: replace it, re-make its batches one at a time, or end with a named error.

NOTE [ raydl recovery ]
The driver owns the sampler order and every in-flight task, so a lost worker costs no data.
When a task reports that its worker died (process gone, node gone) or its result was lost:
  1. the worker is replaced: a new actor with the same worker id, base seed and payload, seeded
     and initialised as the first one was, and given its predecessor's state as of the last
     batch read (NOTE [ raydl checkpoint ]), so its re-made batches are the dead worker's;
  2. the driver waits (ray_startup_timeout_s) for it to start with nothing queued behind, so a
     death there is a death starting, not making a batch;
  3. every task outstanding on the dead worker and not yet received is sent again, in send order,
     under the same idx: ordering and the reorder buffer are untouched.
A silent node's workers (NOTE [ raydl silent node ]) are recovered the same way, together, and none
is placed there. An actor from the warm pool found dead at `configure()` died idle: it is swapped
with no restart counted (`Schedule.resend`).
Probation: a replacement re-makes the lost batches one at a time (the next when the one before
is handed out; tasks drawn for it meanwhile are held: NOTE [ raydl scheduling ]). Why: an actor
that dies just after a task may take its reply with it, and Ray reports that task failed too; with
one task in flight a death is pinned on one batch.
Bounds: `ray_max_worker_restarts` replacements per worker id and iterator; one more death ends
the iterator with WorkerDiedError naming the worker, its node and the batch it was making: a
poison batch ends there, never in an endless loop. A replacement no node can host in time is
given up and the survivors make its batches (NOTE [ raydl elastic pool ]). IterableDataset workers
are not replaced (a stream cannot be replayed to the point of death): WorkerDiedError at once.
Invariant: every batch is handed out exactly once, in order.
`Recovery` holds the iterator's parts, never the iterator: the iterator passes itself as `host`
of each call (`RecoveryHost`), so no reference cycle keeps it alive (NOTE [ raydl shutdown ]).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Protocol

from .._errors import WorkerDiedError, WorkerPlacementError, WorkerStartDied, short_indices
from ..cluster.silent_nodes import mark_silent, raylet_refuses
from .transport.lane import LaneSilent

if TYPE_CHECKING:
    from ..cluster.elastic import ElasticPool
    from ..cluster.pool_protocol import DriverPool
    from .schedule import Schedule
    from .state.checkpoint import Tracker

__all__ = ["Recovery", "RecoveryHost"]

logger = logging.getLogger(__name__)


class RecoveryHost(Protocol):
    """What recovery asks of the iterator it serves."""

    @property
    def running(self) -> bool:
        """Whether the epoch is still running (a death after it ended is not recovered)."""

    def fail(self) -> None:
        """End the iterator: no more batches, the workers go now."""

    def on_workers_ready(self) -> None:
        """Every worker has started: latencies restart from now, queued tasks follow swapped actors."""


class Recovery:
    """Replaces dead workers of one iterator (NOTE [ raydl recovery ])."""

    def __init__(
        self,
        pool: DriverPool,
        sched: Schedule,
        ckpt: Tracker,
        elastic: ElasticPool,
        *,
        is_iterable: bool,
        max_worker_restarts: int,
        startup_timeout_s: float,
        driver_node_id: Optional[str] = None,
    ) -> None:
        self._pool = pool
        self._driver_node_id = driver_node_id
        self._sched = sched
        self._ckpt = ckpt
        self._elastic = elastic
        self._is_iterable = is_iterable
        self._max_worker_restarts = max_worker_restarts
        self.startup_timeout_s = startup_timeout_s

    def recover(self, worker_id: int, error: BaseException, host: RecoveryHost) -> None:
        """Replace a dead worker and resend its outstanding tasks, or raise WorkerDiedError (NOTE [ raydl recovery ]).
        A worker lost to a silent node takes the other workers of that node with it: their replacements start
        together, instead of each after the last one's wait (NOTE [ raydl silent node ])."""
        if not isinstance(error, LaneSilent) and self._raylet_gone(worker_id):  # NOTE [ raydl silent node ]
            error = LaneSilent(f"{_first_line(error)}; its node's raylet refuses connections: the node is gone")
        mates = self._node_mates(worker_id) if isinstance(error, LaneSilent) else []
        held: dict[int, list] = {}
        for w, e in [(worker_id, error), *((m, LaneSilent(f"{error}; worker {m} is on that node too")) for m in mates)]:
            lost = self._replace(w, e, host)
            if lost is not None:
                held[w] = lost
        if not held:
            return
        self.wait_ready(host)  # a replacement dying while starting recurses here, one restart more
        for w, lost in held.items():
            first = self._sched.task_info.get(lost[0]) if lost else None
            if first is not None and first.held and first.worker_id == w:  # not moved to a survivor
                self._sched.send_held(lost[0])

    def _raylet_gone(self, worker_id: int) -> bool:
        """Whether the dead worker's node (another node's) has lost its raylet: then it is marked like a silent one."""
        node = self._pool.node_of(worker_id)
        if node is None or self._is_iterable or node == self._driver_node_id or not raylet_refuses(node):
            return False
        mark_silent(node, "its raylet refuses connections")
        return True

    def _node_mates(self, worker_id: int) -> list[int]:
        """The other active workers on worker `worker_id`'s node."""
        node = self._pool.node_of(worker_id)
        if node is None:
            return []
        return [w for w in self._sched.active if w != worker_id and self._pool.node_of(w) == node]

    def _replace(self, worker_id: int, error: BaseException, host: RecoveryHost) -> Optional[list[int]]:
        """Start a replacement for a dead worker and hold its lost batches (their idxs), None when it needs none (it
        was retiring); WorkerDiedError when it may not be replaced."""
        where = self._pool.describe(worker_id)
        on_worker = self._sched.tasks_on(worker_id)
        sent = [i for i in on_worker if not self._sched.task_info[i].held]
        cause = _first_line(error)
        self._pool.mark_failed(worker_id)
        if self._is_iterable:
            host.fail()
            raise WorkerDiedError(
                f"{where} exited unexpectedly ({cause}). raydl does not restart IterableDataset workers: "
                "a stream cannot be replayed to where it stopped without duplicating or losing samples. "
                "Restart the epoch, or use a map-style dataset to get automatic recovery."
            ) from None
        if self._elastic.take_over_lost(worker_id):  # it was retiring: its tasks went to the others
            return None
        if self._pool.restarts[worker_id] >= self._max_worker_restarts:
            suspect = short_indices(self._sched.task_info[sent[0]].index) if sent else ""
            host.fail()
            restarts = (
                f"after {self._pool.restarts[worker_id]} restart(s) (ray_max_worker_restarts="
                f"{self._max_worker_restarts}): {cause}."
            )
            if not sent:
                raise WorkerDiedError(
                    f"{where} died while starting (unpickling the dataset, running worker_init_fn) {restarts} If "
                    "every new worker dies there, that code crashes the process (out of memory, native code): "
                    "fix it, or give workers more memory via ray_remote_args."
                ) from None
            starting = "while starting or " if isinstance(error, WorkerStartDied) else ""
            raise WorkerDiedError(
                f"{where} exited unexpectedly {starting}while making batch {sent[0]} (indices "
                f"{suspect}){_also_sent(sent)} {restarts} If this batch kills every "
                "worker it reaches, a sample in it crashes the process (out of memory, native code): fix or "
                "skip that sample, or give workers more memory via ray_remote_args."
            ) from None
        logger.warning(
            "raydl: %s died (%s); starting a replacement and resending %d batch(es)", where, cause, len(on_worker)
        )
        self._pool.replace(worker_id, self._ckpt.restart_state(worker_id))
        # Probation: the lost batches are re-made one at a time, oldest first, once the replacement runs.
        return self._sched.hold_for_replacement(worker_id)  # its batches not yet received (NOTE [ raydl calls ])

    def wait_ready(self, host: RecoveryHost) -> None:
        """Bounded wait for (new) workers to start; a death is recovered, any other failure ends the iterator."""
        try:
            try:
                self._pool.wait_ready(self.startup_timeout_s)
            except WorkerPlacementError as e:
                # a replacement with no room anywhere: go on with the survivors (NOTE [ raydl elastic pool ])
                if not host.running or not self._elastic.survive_unplaceable(e):
                    raise
        except WorkerStartDied as e:
            if not host.running:
                raise
            self.recover(e.worker_id, e, host)  # replaces it and waits again (NOTE [ raydl recovery ])
            return
        except BaseException:
            host.fail()
            raise
        # A warm actor found dead at its start was swapped for a new one: its queued tasks follow it.
        for worker_id in self._pool.take_swapped():
            self._sched.resend(worker_id)
        host.on_workers_ready()


def _first_line(error: BaseException, limit: int = 300) -> str:
    """The gist of a Ray error for a one-line message."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _also_sent(sent: list) -> str:
    """For a death with several tasks in flight: the later ones, any of which may have caused it."""
    if len(sent) < 2:
        return ""
    return f" or a batch sent to it after that one (batch(es) {', '.join(map(str, sent[1:]))})"
