"""The worker actors of one loader iterator: start in parallel, prove alive, grow and shrink, kill once."""

from __future__ import annotations

import logging
import sys
import time
import weakref
from typing import Any, Callable, Mapping, Optional

from .._constants import DEFAULT_STARTUP_TIMEOUT_S, INFEASIBLE_GRACE_S, PLACEMENT_RETRIES, STATUS_CHECK_INTERVAL_S
from .._errors import WorkerPlacementError, WorkerRecord, WorkerStartDied, rebuild_worker_exception, remote_traceback
from ..worker.shell import Worker  # torch-free: a job's coordinator builds pools too (NOTE [ raydl worker shell ])
from .connect import describe_placement, resource_request
from .placement import Placement
from .warm import WARM_POOL, warm_key

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
    `wait_ready()` blocks, bounded, until every worker reports where it runs. A warm actor
    found dead there (it died while idle) is swapped for a new one before it made anything:
    that is no restart, and the owner resends the tasks it had queued on it (`take_swapped`).
    `shutdown()` is idempotent (NOTE [ raydl shutdown ] in driver/iter.py); it returns clean workers
    to the warm pool. Its owner releases it through `release_when_collected`, never from a
    `__del__`.

    Resizing (NOTE [ raydl elastic pool ] in cluster/elastic.py): `add_worker()` starts a worker under
    a new id (ids are never reused; per-worker lists are indexed by id and only grow), on the
    node the placement plan picks for one more worker; `poll_joining()` reports it once
    started, without blocking; `release()` ends one worker early. `wait_ready()` never waits
    for joining workers.
    """

    def __init__(
        self,
        payload_ref: Any,
        num_workers: int,
        base_seed: int,
        actor_options: Mapping[str, Any],
        reuse: bool = True,
        placement: Optional[Placement] = None,
        worker_states: Optional[list] = None,
        track_rng: bool = True,
        epoch: int = 0,
        pipe_seed: Optional[int] = None,
    ) -> None:
        from .connect import ray_session

        self._session = ray_session()  # its actors live and die with this Ray session
        self.num_workers = num_workers
        # the snapshot each worker starts from (NOTE [ raydl checkpoint ]); None: a fresh start
        self._worker_states: list[Optional[dict]] = list(worker_states) if worker_states else [None] * num_workers
        self._track_rng = track_rng
        self.epoch = epoch  # the iterator's epoch, which a (re)started worker joins
        self.pipe_seed = pipe_seed  # that epoch's shared seed of an IterDataPipe (NOTE [ raydl datapipes ])
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
        # workers whose dead warm actor was swapped for a new one, until the owner resent their tasks
        self._swapped: set[int] = set()
        # how many dead warm actors this pool swapped (none in a healthy process; the tests count them)
        self.warm_swaps = 0
        self.actors = [warm[wid] if wid in warm else self._new_actor(wid) for wid in range(num_workers)]
        # num_workers each worker's WorkerInfo reports: the pool's size when it first started
        self._info_num_workers = [num_workers] * num_workers
        self._ready_refs: list[Optional[Any]] = [self._configure(wid) for wid in range(num_workers)]
        # `is_ready` once it held: asked before every batch, so not a scan of every worker each time; only a
        # fresh actor (`_start_fresh`) outside `joining` makes the pool not ready again
        self._all_ready = False
        self.records: list[Optional[WorkerRecord]] = [None] * num_workers
        # each worker's snapshot as it started (its configure() reply): worker id -> snapshot (NOTE [ raydl checkpoint ])
        self.started_states: dict[int, Optional[dict]] = {}
        # replacements made for each worker id (NOTE [ raydl recovery ] in driver/recovery.py)
        self.restarts = [0] * num_workers
        # refs of tasks the driver gave up on, per worker: a worker goes back to the warm pool
        # only once all of them have finished (never with an unresolved task on it)
        self._abandoned: list[list[Any]] = [[] for _ in range(num_workers)]
        # workers that died or failed to start: never reused
        self._failed: set[int] = set()
        # workers started by add_worker and not yet reported started: wid -> when they were started
        self.joining: dict[int, float] = {}
        # workers ended before the pool (retired by a resize, or lost with no room for a replacement)
        self.released: set[int] = set()
        self._alive = True
        logger.debug("raydl: %d workers (%d warm) with options %s", num_workers, len(warm), self.actor_options)

    def in_session(self) -> bool:
        """Whether Ray still runs the session this pool's actors belong to (never starts one)."""
        from .connect import ray_session

        return self._session is not None and ray_session() == self._session

    def abandon(self, worker_id: int, ref: Any) -> None:
        """The driver no longer needs the result of `ref`, a task on worker `worker_id`.

        Only unfinished refs are kept (finished ones are dropped so their objects are freed).
        """
        import ray

        if not self.in_session():  # Ray shut down: nothing to keep, no call (it would start a new Ray)
            return

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
        return self.actors[worker_id].configure.remote(
            self._payload_ref,
            worker_id,
            self._info_num_workers[worker_id],
            self._base_seed,
            self._worker_states[worker_id],
            self._track_rng,
            self.epoch,
            self.pipe_seed,
        )

    def _start_fresh(self, worker_id: int) -> None:
        self.actors[worker_id] = self._new_actor(worker_id)
        self._ready_refs[worker_id] = self._configure(worker_id)
        self._all_ready = False

    def replace(self, worker_id: int, state: Optional[dict] = None) -> None:
        """Kill worker `worker_id` (if still there) and start a new actor with the same id, seed and payload.

        The new actor seeds itself and runs worker_init_fn exactly as the first one did, then
        takes back `state` (the dead worker's snapshot as of its last batch read, NOTE [ raydl
        checkpoint ]) when given; the caller waits for it with `wait_ready`.
        """
        self._worker_states[worker_id] = state
        import ray

        try:
            ray.kill(self.actors[worker_id], no_restart=True)
        except Exception:  # already dead: the usual case
            pass
        self.restarts[worker_id] += 1
        self._abandoned[worker_id] = []
        self._failed.discard(worker_id)
        self._unconfirmed_warm.discard(worker_id)
        self._swapped.discard(worker_id)  # the owner holds and resends its tasks (NOTE [ raydl recovery ])
        self._replan(worker_id)
        # records[worker_id] keeps the old location until the new actor reports its own.
        self._start_fresh(worker_id)
        logger.debug("raydl: replaced worker %d (restart %d)", worker_id, self.restarts[worker_id])

    def _replan(self, worker_id: int) -> None:
        """Give worker `worker_id` a node by the plan's rule among the nodes alive now (NOTE [ raydl placement ])."""
        if self._placement is not None:
            others = [
                self.node_of(w)
                for w in range(len(self.actors))
                if w != worker_id and w not in self._failed and w not in self.released
            ]
            self.nodes[worker_id] = self._placement.node_for_new_worker(others) or self.nodes[worker_id]

    def worker_to_move(self, active: list[int]) -> Optional[int]:
        """NOTE [ raydl rebalance ]: the worker to move when a node holds more of the `active` workers than its share of
        the nodes workers may go to now (by their CPUs) while another holds fewer, as after a node lost and another
        joined: the newest active worker of the node most over its share; None when no move evens them (or the user's
        actor options place the workers)."""
        if self._placement is None or len(active) < 2:
            return None
        from collections import Counter

        from .placement import apportion

        nodes = self._placement.candidates(by_total=True)
        if len(nodes) < 2:
            return None
        wanted = Counter(apportion(nodes, len(active)))
        have = Counter(self.node_of(w) for w in active)
        over = max(have, key=lambda n: (have[n] - wanted.get(n, 0), str(n)))
        under = max(wanted, key=lambda n: (wanted[n] - have.get(n, 0), str(n)))
        if have[over] - wanted.get(over, 0) < 1 or wanted[under] - have.get(under, 0) < 1:
            return None
        old = max(w for w in active if self.node_of(w) == over)
        # where the placement would start its replacement now (by free CPUs): a move only to a node below its share
        target = self._placement.node_for_new_worker([self.node_of(w) for w in active if w != old])
        return old if target is not None and have.get(target, 0) < wanted.get(target, 0) else None

    def node_of(self, worker_id: int) -> Optional[str]:
        """Where worker `worker_id` runs (its record), or where it was planned before it reported."""
        record = self.records[worker_id]
        return record.node_id if record is not None else self.nodes[worker_id]

    @property
    def alive(self) -> bool:
        return self._alive

    def restart_streams(self, epoch: int) -> dict:
        """Persistent iterable workers: each live worker restarts its stream for `epoch` now (`Worker.restart_stream`,
        with the epoch's `pipe_seed`); {worker id: the ref of its snapshot as of the restart}."""
        return {
            w: actor.restart_stream.remote(epoch, self.pipe_seed)
            for w, actor in enumerate(self.actors)
            if w not in self.released and w not in self._failed and w not in self.joining
        }

    @property
    def is_ready(self) -> bool:
        """Every worker not joining has started (its configure() reply was read)."""
        if not self._all_ready:
            self._all_ready = all(r is None for w, r in enumerate(self._ready_refs) if w not in self.joining)
        return self._all_ready

    # ------------------------------------------------------------------ resizing (NOTE [ raydl elastic pool ])

    def add_worker(self, info_num_workers: int) -> int:
        """Start one more worker under a new id (a warm actor when one is idle where it goes); returns its id.

        It does not block: `poll_joining()` reports it once it has started.
        """
        wid = len(self.actors)
        self.nodes.append(None)
        self.records.append(None)
        self.restarts.append(0)
        self._abandoned.append([])
        self._info_num_workers.append(info_num_workers)
        self._worker_states.append(None)
        self._ready_refs.append(None)
        self._replan(wid)
        warm = WARM_POOL.take(self._warm_key(self.nodes[wid]), 1) if self._reuse else []
        if warm:
            self._unconfirmed_warm.add(wid)
        self.actors.append(warm[0] if warm else self._new_actor(wid))
        self._ready_refs[wid] = self._configure(wid)
        self.joining[wid] = time.monotonic()
        logger.debug("raydl: worker %d starting (%s)", wid, "warm" if warm else "new actor")
        return wid

    def poll_joining(self, timeout_s: float) -> tuple[list[int], list[tuple[int, str]]]:
        """Without blocking: (joining workers now started, [(worker, why)] for those that failed to start).

        A joining worker fails when its process dies while starting, or when it has not started
        `timeout_s` after `add_worker` (the cluster has no room for it). A failed one is killed.

        Raises:
            the user's exception type: `worker_init_fn` failed in the new worker (as at the first start).
        """
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if not self.joining:
            return [], []
        refs = {self._ready_refs[w]: w for w in self.joining}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        joined, failed = [], []
        for ref in done:
            wid = refs[ref]
            try:
                info = ray.get(ref)
            except RayTaskError as e:
                self._drop_joining(wid)
                where = f"in raydl worker {wid} while starting"
                raise rebuild_worker_exception(e.cause, where, remote_traceback(e)) from None
            except RayActorError as e:  # ActorUnschedulableError included: its node left
                if wid in self._unconfirmed_warm:  # an idle warm actor had died: start a new one
                    self._unconfirmed_warm.discard(wid)
                    self._start_fresh(wid)
                    continue
                self._drop_joining(wid)
                failed.append((wid, f"died while starting: {e}"))
                continue
            self._unconfirmed_warm.discard(wid)
            self.records[wid] = self._started(wid, info)
            self._ready_refs[wid] = None
            del self.joining[wid]
            joined.append(wid)
        now = time.monotonic()
        for wid, since_s in list(self.joining.items()):
            if now - since_s >= timeout_s:
                _, msg = describe_placement(self.actor_options, 1, 1)
                self._drop_joining(wid)
                failed.append((wid, f"not started after {now - since_s:.0f} s: {msg}"))
        return joined, failed

    def _drop_joining(self, wid: int) -> None:
        self._failed.add(wid)
        del self.joining[wid]
        self.release(wid)

    def release(self, worker_id: int) -> None:
        """End worker `worker_id` now (it has no task the driver still needs): warm pool if clean, else killed."""
        import ray

        if worker_id in self.released:
            return
        self.released.add(worker_id)
        self.joining.pop(worker_id, None)
        actor = self.actors[worker_id]
        if self._is_clean(worker_id):
            actor.reset.remote()
            pending = self._abandoned[worker_id] + [r for r in [self._ready_refs[worker_id]] if r is not None]
            key = self._warm_key(self.node_of(worker_id) if self._placement is not None else None)
            WARM_POOL.give(key, [(actor, pending)])
        else:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        self._ready_refs[worker_id] = None
        self._abandoned[worker_id] = []
        logger.debug("raydl: worker %d released", worker_id)

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
            pending = {
                ref: wid for wid, ref in enumerate(self._ready_refs) if ref is not None and wid not in self.joining
            }
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
                        # An idle actor died while it waited in the warm pool: start a new one. Not a
                        # restart: the dead one made nothing; the tasks queued on it are resent.
                        self._unconfirmed_warm.discard(wid)
                        self._swapped.add(wid)
                        self.warm_swaps += 1
                        logger.debug("raydl: warm worker %d was dead before its start (%s); starting a new one", wid, e)
                        self._start_fresh(wid)
                        continue
                    self._failed.add(wid)
                    raise WorkerStartDied(wid, f"raydl worker {wid} died while starting: {e}") from None
                except ActorUnschedulableError as e:
                    # Its planned node left before the actor was placed there (NOTE [ raydl placement ]).
                    if self._placement is not None and replanned.get(wid, 0) < PLACEMENT_RETRIES:
                        replanned[wid] = replanned.get(wid, 0) + 1
                        self._unconfirmed_warm.discard(wid)
                        self._swapped.add(wid)  # it ran nothing: the tasks queued on it follow the new actor
                        self._replan(wid)
                        self._start_fresh(wid)
                        continue
                    self._failed.add(wid)
                    raise WorkerStartDied(wid, f"raydl worker {wid} could not be placed: {e}") from None
                self._unconfirmed_warm.discard(wid)
                self.records[wid] = self._started(wid, info)
                self._ready_refs[wid] = None
            if self.is_ready:
                break
            waited_s = time.monotonic() - start
            # A request no node can satisfy fails fast, unless the user raised the timeout (an
            # autoscaling cluster that starts without the nodes it needs).
            grace_s = min(INFEASIBLE_GRACE_S, timeout_s) if timeout_s <= DEFAULT_STARTUP_TIMEOUT_S else timeout_s
            if waited_s >= grace_s:
                unplaced = [w for w, ref in enumerate(self._ready_refs) if ref is not None and w not in self.joining]
                feasible, msg = describe_placement(self.actor_options, len(unplaced), self.num_workers)
                if not feasible or waited_s >= timeout_s:
                    # never-placed actors must not linger as resource demand (an autoscaler would
                    # act on it); the caller ends the pool, or goes on without them (NOTE [ raydl elastic pool ])
                    for w in unplaced:
                        self._failed.add(w)
                        self.release(w)
                    raise WorkerPlacementError(f"{msg} (waited {waited_s:.0f} s)", tuple(unplaced))
        logger.debug("raydl: %d workers ready: %s", self.num_workers, self.records)

    def _started(self, worker_id: int, info: dict) -> WorkerRecord:
        """A worker's configure() reply: where it runs; its starting snapshot is kept in `started_states`."""
        self.started_states[worker_id] = info.pop("state", None)
        return WorkerRecord(worker_id=worker_id, **info)

    def take_swapped(self) -> list[int]:
        """Workers whose dead warm actor was swapped since the last call: their queued tasks must be sent again."""
        swapped, self._swapped = sorted(self._swapped), set()
        return swapped

    def release_when_collected(self, owner: Any) -> Callable[[], None]:
        """A callable that shuts this pool down once; it also runs when `owner` is garbage collected.

        NOTE [ raydl shutdown ] in driver/iter.py: the finalizer holds the pool, so the pool and its
        actor handles stay reachable from it and never join `owner` in a garbage cycle. In such
        a cycle Python runs every member's finalizer, the handles' included, and Ray then kills
        their actors, even ones handed to the warm pool a moment before.
        """
        release = weakref.finalize(owner, _shutdown_quietly, self)
        release.atexit = False  # at interpreter exit Ray tears the actors down with the driver
        return release

    def _is_clean(self, worker_id: int) -> bool:
        """Whether the worker may serve another loader once its pending tasks (configure included) drain."""
        return self._reuse and worker_id not in self._failed

    def shutdown(self, tasks_known: bool = True) -> None:
        """End this pool (idempotent): clean, started workers go back to the warm pool, the rest are killed.

        Args:
            tasks_known: False when the owner was collected with tasks it never `abandon`ed:
                its workers are then reused only once everything queued on them has run.
        """
        if not self._alive:
            return
        self._alive = False
        from .connect import ray_calls

        reusable: dict[str, list] = {}
        with ray_calls(self._session) as session:  # may run in a finalizer, in any thread
            if session is None:
                # Ray was shut down since this pool started: its actors died with that session, and a
                # call now would start a new Ray behind the user's back (NOTE [ raydl no Ray behind the user's back ]).
                self._ready_refs = [None] * len(self.actors)
                self.joining = {}
                logger.debug("raydl: pool ended with its Ray session")
                return
            import ray

            for wid, actor in enumerate(self.actors):
                if wid in self.released:
                    continue
                if self._is_clean(wid):
                    reset = actor.reset.remote()  # runs after the tasks already sent to it
                    ready = self._ready_refs[wid]
                    pending = self._abandoned[wid] + ([ready] if ready is not None else [])
                    if not tasks_known:
                        # reset runs after every task sent before it (one at a time, in order): once it
                        # has run, none of the tasks whose refs died with the owner is left on the actor
                        pending.append(reset)
                    # Placed workers are kept under the node they really run on (soft affinity may have moved one).
                    key = self._warm_key(self.node_of(wid) if self._placement is not None else None)
                    reusable.setdefault(key, []).append((actor, pending))
                    continue
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already dead, or Ray is shutting down
                    pass
        for key, actors in reusable.items():  # outside the block: the warm pool's lock is taken before Ray's
            WARM_POOL.give(key, actors)
        self._ready_refs = [None] * len(self.actors)
        self.joining = {}
        logger.debug("raydl: pool ended (%d workers kept warm)", sum(map(len, reusable.values())))


def _shutdown_quietly(pool: WorkerPool) -> None:
    """A pool's finalizer: shut it down; never raise (Ray may already be gone)."""
    if sys.is_finalizing():
        return
    try:
        pool.shutdown(tasks_known=False)
    except Exception:
        pass
