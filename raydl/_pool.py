"""A fixed set of worker actors for one loader iterator: start in parallel, prove alive, kill once."""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Optional

from ._constants import INFEASIBLE_GRACE_S, STATUS_CHECK_INTERVAL_S
from ._errors import WorkerDiedError, WorkerPlacementError, WorkerRecord, rebuild_worker_exception, remote_traceback
from ._ray_utils import describe_placement
from ._worker import Worker

__all__ = ["WorkerPool"]

logger = logging.getLogger(__name__)

_remote_worker_cls = None


def _worker_actor_class():
    """`ray.remote(Worker)`, built once per process so Ray exports the class once."""
    global _remote_worker_cls
    if _remote_worker_cls is None:
        import ray

        _remote_worker_cls = ray.remote(Worker)
    return _remote_worker_cls


class WorkerPool:
    """`num_workers` worker actors sharing one payload ObjectRef.

    Construction only submits actor creation (all in parallel) and one `ready()` call each;
    `wait_ready()` blocks, bounded, until every worker reports where it runs.
    `shutdown()` is idempotent (see NOTE [ raydl shutdown ] in _iter.py).
    """

    def __init__(
        self,
        payload_ref: Any,
        num_workers: int,
        base_seed: int,
        actor_options: Mapping[str, Any],
    ) -> None:
        self.num_workers = num_workers
        self.actor_options = dict(actor_options)
        self._payload_ref = payload_ref
        self._base_seed = base_seed
        cls = _worker_actor_class()
        try:
            self._configured = cls.options(**self.actor_options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"raydl: invalid ray_remote_args {dict(actor_options)!r}: {e}") from None
        self.actors = [self._start(wid) for wid in range(num_workers)]
        self._ready_refs: list[Optional[Any]] = [a.ready.remote() for a in self.actors]
        self.records: list[Optional[WorkerRecord]] = [None] * num_workers
        # replacements made for each worker id (NOTE [ raydl recovery ] in _iter.py)
        self.restarts = [0] * num_workers
        self._alive = True
        logger.debug("raydl: submitted %d worker actors (options %s)", num_workers, self.actor_options)

    def _start(self, worker_id: int) -> Any:
        return self._configured.remote(self._payload_ref, worker_id, self.num_workers, self._base_seed)

    def replace(self, worker_id: int) -> None:
        """Kill worker `worker_id` (if still there) and start a new actor with the same id, seed and payload.

        The new actor seeds itself and runs worker_init_fn exactly as the first one did; the
        caller waits for it with `wait_ready`.
        """
        import ray

        try:
            ray.kill(self.actors[worker_id], no_restart=True)
        except Exception:  # already dead: the usual case
            pass
        self.restarts[worker_id] += 1
        self.actors[worker_id] = self._start(worker_id)
        # records[worker_id] keeps the old location until the new actor reports its own.
        self._ready_refs[worker_id] = self.actors[worker_id].ready.remote()
        logger.debug("raydl: replaced worker %d (restart %d)", worker_id, self.restarts[worker_id])

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def is_ready(self) -> bool:
        return all(r is None for r in self._ready_refs)

    def describe(self, worker_id: int) -> str:
        """Where worker `worker_id` runs, for error messages (falls back to its id before it is ready)."""
        record = self.records[worker_id]
        return record.describe() if record else f"raydl worker {worker_id}"

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every worker has started, at most `timeout_s` seconds.

        Raises:
            the user's exception type: `worker_init_fn` (or `iter(dataset)`) failed in a worker.
            WorkerPlacementError: a worker could not be placed or started within `timeout_s`,
                or (after INFEASIBLE_GRACE_S) no node could ever host it.
            WorkerDiedError: a worker process died while starting.
        """
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        start = time.monotonic()
        while not self.is_ready:
            pending = {ref: wid for wid, ref in enumerate(self._ready_refs) if ref is not None}
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=STATUS_CHECK_INTERVAL_S * 5)
            for ref in done:
                wid = pending[ref]
                try:
                    info = ray.get(ref)
                except RayTaskError as e:
                    raise rebuild_worker_exception(
                        e.cause, f"in raydl worker {wid} while starting", remote_traceback(e)
                    ) from None
                except RayActorError as e:
                    raise WorkerDiedError(f"raydl worker {wid} died while starting: {e}") from None
                self.records[wid] = WorkerRecord(worker_id=wid, **info)
                self._ready_refs[wid] = None
            if self.is_ready:
                break
            waited_s = time.monotonic() - start
            if waited_s >= min(INFEASIBLE_GRACE_S, timeout_s):
                n_pending = sum(r is not None for r in self._ready_refs)
                feasible, msg = describe_placement(self.actor_options, n_pending, self.num_workers)
                if not feasible or waited_s >= timeout_s:
                    self.shutdown()
                    raise WorkerPlacementError(f"{msg} (waited {waited_s:.0f} s)")
        logger.debug("raydl: %d workers ready: %s", self.num_workers, self.records)

    def shutdown(self) -> None:
        """Kill every actor now (idempotent); pending and future calls on them fail."""
        if not self._alive:
            return
        self._alive = False
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead, or Ray is shutting down
                pass
        self._ready_refs = [None] * self.num_workers
        logger.debug("raydl: killed %d worker actors", self.num_workers)
