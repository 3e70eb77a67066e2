"""A fixed set of worker actors for one loader iterator: start in parallel, prove alive, kill once."""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Optional

from ._constants import DEFAULT_STARTUP_TIMEOUT_S, INFEASIBLE_GRACE_S, PLACEMENT_RETRIES, STATUS_CHECK_INTERVAL_S
from ._errors import WorkerPlacementError, WorkerRecord, WorkerStartDied, rebuild_worker_exception, remote_traceback
from ._placement import Placement
from ._ray_utils import describe_placement, resource_request
from ._warm import WARM_POOL, warm_key
from ._worker import Worker

__all__ = ["WorkerPool"]

logger = logging.getLogger(__name__)

_remote_worker_cls = None

_MISSING_MODULE_HINT = (
    " (the worker cannot import module {name!r}, which the dataset, collate_fn or worker_init_fn "
    "needs: install it on every node, or ship your code to the workers with "
    "ray.init(runtime_env={{'py_modules': [<your package>]}}) or runtime_env={{'working_dir': '.'}})"
)


def _worker_actor_class():
    """`ray.remote(Worker)`, built once per process so Ray exports the class once."""
    global _remote_worker_cls
    if _remote_worker_cls is None:
        import ray

        _remote_worker_cls = ray.remote(Worker)
    return _remote_worker_cls


class WorkerPool:
    """`num_workers` worker actors configured with one payload ObjectRef.

    With a `Placement` (no placement hint from the user), each worker id has a planned node
    (`nodes`, NOTE [ raydl placement ]) and its actor soft affinity to it.
    Construction takes idle actors from the warm pool (NOTE [ raydl warm pool ]) when
    `reuse` allows (for a placed worker, only one on its planned node), starts the rest (all in
    parallel), and submits one `configure()` to each;
    `wait_ready()` blocks, bounded, until every worker reports where it runs. `shutdown()` is
    idempotent (NOTE [ raydl shutdown ] in _iter.py); it returns clean workers to the warm pool.
    """

    def __init__(
        self,
        payload_ref: Any,
        num_workers: int,
        base_seed: int,
        actor_options: Mapping[str, Any],
        reuse: bool = True,
        placement: Optional[Placement] = None,
    ) -> None:
        self.num_workers = num_workers
        self.actor_options = dict(actor_options)
        self._payload_ref = payload_ref
        self._base_seed = base_seed
        # Only workers that reserve nothing are kept warm: an idle actor holding CPUs, GPUs or
        # custom resources would starve other Ray work (a Ray Train trainer, another loader).
        self._reuse = reuse and not resource_request(self.actor_options)
        cls = _worker_actor_class()
        try:
            self._configured = cls.options(**self.actor_options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"raydl: invalid ray_remote_args {dict(actor_options)!r}: {e}") from None
        # NOTE [ raydl placement ]: the node raydl wants each worker on (None: Ray decides)
        self._placement = placement
        self._per_node: dict[str, Any] = {}  # node id -> the actor class with soft affinity to it
        self.nodes: list[Optional[str]] = placement.plan(num_workers) if placement is not None else [None] * num_workers
        warm = self._take_warm()
        # workers whose actor came from the warm pool and has not confirmed it is alive yet
        self._unconfirmed_warm = set(warm)
        self.actors = [warm[wid] if wid in warm else self._new_actor(wid) for wid in range(num_workers)]
        self._ready_refs: list[Optional[Any]] = [self._configure(wid) for wid in range(num_workers)]
        self.records: list[Optional[WorkerRecord]] = [None] * num_workers
        # replacements made for each worker id (NOTE [ raydl recovery ] in _iter.py)
        self.restarts = [0] * num_workers
        # refs of tasks the driver gave up on, per worker: a worker goes back to the warm pool
        # only once all of them have finished (never with an unresolved task on it)
        self._abandoned: list[list[Any]] = [[] for _ in range(num_workers)]
        # workers that died or failed to start: never reused
        self._failed: set[int] = set()
        self._alive = True
        logger.debug(
            "raydl: %d workers (%d warm) with options %s", num_workers, len(warm), self.actor_options
        )

    def abandon(self, worker_id: int, ref: Any) -> None:
        """The driver no longer needs the result of `ref`, a task on worker `worker_id`.

        Only unfinished refs are kept (finished ones are dropped so their objects are freed).
        """
        import ray

        refs = self._abandoned[worker_id] + [ref]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        self._abandoned[worker_id] = pending

    def mark_failed(self, worker_id: int) -> None:
        """Worker `worker_id` died or failed: it must never be reused."""
        self._failed.add(worker_id)

    def _warm_key(self, node_id: Optional[str]) -> str:
        """Warm-pool key: the actor options, plus the node for workers raydl placed (a warm actor is where the plan wants it)."""
        return warm_key(self.actor_options, node_id)

    def _take_warm(self) -> dict[int, Any]:
        """Idle started actors for as many workers as the warm pool has, each on its worker's planned node."""
        if not self._reuse:
            return {}
        by_node: dict[Optional[str], list[int]] = {}
        for wid, node_id in enumerate(self.nodes):
            by_node.setdefault(node_id, []).append(wid)
        taken: dict[int, Any] = {}
        for node_id, wids in by_node.items():
            taken.update(zip(wids, WARM_POOL.take(self._warm_key(node_id), len(wids))))
        return taken

    def _new_actor(self, worker_id: int) -> Any:
        """Start an actor for worker `worker_id`, with soft affinity to its planned node if raydl placed it."""
        node_id = self.nodes[worker_id]
        if node_id is None:
            return self._configured.remote()
        if node_id not in self._per_node:
            options = {**self.actor_options, "scheduling_strategy": Placement.strategy(node_id)}
            self._per_node[node_id] = _worker_actor_class().options(**options)
        return self._per_node[node_id].remote()

    def _configure(self, worker_id: int) -> Any:
        return self.actors[worker_id].configure.remote(self._payload_ref, worker_id, self.num_workers, self._base_seed)

    def _start_fresh(self, worker_id: int) -> None:
        self.actors[worker_id] = self._new_actor(worker_id)
        self._ready_refs[worker_id] = self._configure(worker_id)

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
        self._abandoned[worker_id] = []
        self._failed.discard(worker_id)
        self._replan(worker_id)
        # records[worker_id] keeps the old location until the new actor reports its own.
        self._start_fresh(worker_id)
        logger.debug("raydl: replaced worker %d (restart %d)", worker_id, self.restarts[worker_id])

    def _replan(self, worker_id: int) -> None:
        """Give worker `worker_id` a node by the plan's rule among the nodes alive now (NOTE [ raydl placement ])."""
        if self._placement is not None:
            others = [self._node_of(w) for w in range(self.num_workers) if w != worker_id and w not in self._failed]
            self.nodes[worker_id] = self._placement.node_for_new_worker(others) or self.nodes[worker_id]

    def _node_of(self, worker_id: int) -> Optional[str]:
        """Where worker `worker_id` runs (its record), or where it was planned before it reported."""
        record = self.records[worker_id]
        return record.node_id if record is not None else self.nodes[worker_id]

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
            WorkerStartDied: a worker process died while starting.
        """
        import ray
        from ray.exceptions import ActorUnschedulableError, RayActorError, RayTaskError

        start = time.monotonic()
        replanned: dict[int, int] = {}  # worker id -> re-plans in this wait
        while not self.is_ready:
            pending = {ref: wid for wid, ref in enumerate(self._ready_refs) if ref is not None}
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=STATUS_CHECK_INTERVAL_S * 5)
            for ref in done:
                wid = pending[ref]
                try:
                    info = ray.get(ref)
                except RayTaskError as e:
                    self._failed.add(wid)
                    where = f"in raydl worker {wid} while starting"
                    if isinstance(e.cause, ModuleNotFoundError):
                        where += _MISSING_MODULE_HINT.format(name=e.cause.name)
                    raise rebuild_worker_exception(e.cause, where, remote_traceback(e)) from None
                except RayActorError as e:
                    if wid in self._unconfirmed_warm:
                        # An idle actor died while it waited in the warm pool: start a new one.
                        self._unconfirmed_warm.discard(wid)
                        self._start_fresh(wid)
                        continue
                    self._failed.add(wid)
                    raise WorkerStartDied(wid, f"raydl worker {wid} died while starting: {e}") from None
                except ActorUnschedulableError as e:
                    # Its planned node left before the actor was placed there (NOTE [ raydl placement ]).
                    if self._placement is not None and replanned.get(wid, 0) < PLACEMENT_RETRIES:
                        replanned[wid] = replanned.get(wid, 0) + 1
                        self._unconfirmed_warm.discard(wid)
                        self._replan(wid)
                        self._start_fresh(wid)
                        continue
                    self._failed.add(wid)
                    raise WorkerStartDied(wid, f"raydl worker {wid} could not be placed: {e}") from None
                self._unconfirmed_warm.discard(wid)
                self.records[wid] = WorkerRecord(worker_id=wid, **info)
                self._ready_refs[wid] = None
            if self.is_ready:
                break
            waited_s = time.monotonic() - start
            # A request no node can satisfy fails fast, unless the user raised the timeout (an
            # autoscaling cluster that starts without the nodes it needs).
            grace_s = min(INFEASIBLE_GRACE_S, timeout_s) if timeout_s <= DEFAULT_STARTUP_TIMEOUT_S else timeout_s
            if waited_s >= grace_s:
                n_pending = sum(r is not None for r in self._ready_refs)
                feasible, msg = describe_placement(self.actor_options, n_pending, self.num_workers)
                if not feasible or waited_s >= timeout_s:
                    # never-placed actors must not linger as resource demand (an autoscaler would act on it)
                    self._failed.update(w for w, ref in enumerate(self._ready_refs) if ref is not None)
                    self.shutdown()
                    raise WorkerPlacementError(f"{msg} (waited {waited_s:.0f} s)")
        logger.debug("raydl: %d workers ready: %s", self.num_workers, self.records)

    def _is_clean(self, worker_id: int) -> bool:
        """Whether the worker may serve another loader once its pending tasks (configure included) drain."""
        return self._reuse and worker_id not in self._failed

    def shutdown(self) -> None:
        """End this pool (idempotent): clean, started workers go back to the warm pool, the rest are killed."""
        if not self._alive:
            return
        self._alive = False
        import ray

        reusable: dict[str, list] = {}
        for wid, actor in enumerate(self.actors):
            if self._is_clean(wid):
                actor.reset.remote()  # runs after the tasks already sent to it
                pending = self._abandoned[wid] + ([self._ready_refs[wid]] if self._ready_refs[wid] is not None else [])
                # Placed workers are kept under the node they really run on (soft affinity may have moved one).
                key = self._warm_key(self._node_of(wid) if self._placement is not None else None)
                reusable.setdefault(key, []).append((actor, pending))
                continue
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead, or Ray is shutting down
                pass
        for key, actors in reusable.items():
            WARM_POOL.give(key, actors)
        self._ready_refs = [None] * self.num_workers
        logger.debug("raydl: pool ended (%d workers kept warm)", sum(map(len, reusable.values())))
