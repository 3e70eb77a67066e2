"""A rank's side of the job pool's resizing and autoscaling: `set_num_workers` and `ray_max_workers` under `ray_job`.

NOTE [ raydl job elastic ]
The job's coordinator (NOTE [ raydl job pool ] in job/pool.py) owns the job's worker set; each
rank's `JobElastic` follows it between two batches, as a private pool's `ElasticPool` follows
its own decisions (NOTE [ raydl elastic pool ] in cluster/elastic.py):
  * `loader.set_num_workers(n)` on any rank makes the job's pool `n x world size` workers (the
    same call on every rank, as SPMD scripts make it, asks for the same size: no change after
    the first). Workers the job adds join every rank's dispatch once started; workers it takes
    away stop getting new batches from every rank at once, and are released when every rank
    has handed out the batches it had on them (a rank that leaves counts as done).
  * the autoscaler (`ray_max_workers=m`, between `num_workers x world` and `m x world` workers):
    each rank measures its windows as a private pool does and reports them; once every rank has
    reported one since the last change, the coordinator decides one step by the same rule
    (`AutoscaleRule`): the job waits as much as its most starved rank (DDP steps at the
    slowest rank's pace), and its workers are as busy as all ranks' batches keep them.
  * each rank's prefetch bound is `prefetch_factor x ceil(job workers / world)`: its share.
  * a rank hears of a change made elsewhere at its next lease renewal (JOB_LEASE_RENEW_S) or
    window report, and fetches the job's worker set before its next batch.
Every batch of every rank is still handed out once, in its order: tasks keep their idx whatever
worker makes them, and the job's seeding does not depend on the worker.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from .._errors import WorkerPlacementError
from ..cluster.elastic import ElasticPool, ElasticSchedule

if TYPE_CHECKING:
    from .pool import JobPool

__all__ = ["JobElastic"]


class JobElastic(ElasticPool):
    """Follows the job's worker set in this rank's `Schedule` (NOTE [ raydl job elastic ]).

    Its pool is the rank's `JobPool`, not a `ResizablePool`: every method of `ElasticPool` that would start or
    release a worker itself is overridden here by one that asks the job's coordinator."""

    def __init__(
        self,
        pool: JobPool,
        sched: ElasticSchedule,
        prefetch_factor: int,
        put_index: Callable[[], None],
        startup_timeout_s: float,
        autoscale: bool,
    ) -> None:
        self._epoch = -1  # epochs started, for the coordinator's rule (its cap is per epoch)
        super().__init__(pool, sched, prefetch_factor, put_index, startup_timeout_s, 1, None, resizable=True)
        self._autoscale = autoscale
        self._apply(fill=False)

    @property
    def size(self) -> int:
        """This rank's share of the job's workers (its prefetch bound is `prefetch_factor` times it)."""
        return max(1, math.ceil(len(self._pool.active) / max(1, self._pool.job_world)))

    def _set_bound(self) -> None:
        self._sched.max_tasks = self._prefetch_factor * self.size

    def resize(self, num_workers: int) -> None:
        self._pool.resize(num_workers)
        self._apply()

    def step(self) -> None:
        """Before each batch: tell the job which retiring workers this rank is done with; follow a change."""
        for wid in [w for w in self.retiring if self._sched.workers_num_tasks[w] == 0]:
            self.retiring.discard(wid)
            self._pool.done_with(wid)
        if self._pool.changed.is_set():
            self._pool.view()
            self._apply()

    def _apply(self, fill: bool = True) -> None:
        """Make this rank's dispatch the job's active workers."""
        active = set(self._pool.active)
        for wid in [w for w in self._sched.active if w not in active]:
            self._sched.remove_worker(wid)
            if self._sched.workers_num_tasks[wid] == 0:
                self._pool.done_with(wid)
            else:
                self.retiring.add(wid)
        for wid in self._pool.retiring:  # retired before this rank sent it anything (it never heard it joined)
            if wid not in self._sched.active and wid not in self.retiring:
                self._pool.done_with(wid)
        for wid in self._pool.active:
            if wid not in self._sched.active and wid not in self.retiring:
                self._sched.add_worker(wid)
        before = self._sched.max_tasks
        self._set_bound()
        self.decisions = list(self._pool.decisions)
        self._restart_window()
        put_index = self._put_index_ref()
        for _ in range(max(0, self._sched.max_tasks - before) if fill and put_index is not None else 0):
            put_index()

    def take_over_lost(self, worker_id: int) -> bool:
        """A worker died: when the job retired it (maybe unknown here yet), its tasks go to the active workers."""
        if worker_id not in self.retiring:
            self._pool.view()
            self._pool.changed.set()  # the rest of the change (workers that joined) at the next batch
            if worker_id in self._pool.active or worker_id not in self._sched.active:
                return False
            self._sched.remove_worker(worker_id, lost=True)
        self.retiring.discard(worker_id)
        self._sched.reassign(worker_id)
        self._pool.done_with(worker_id)
        return True

    def survive_unplaceable(self, error: WorkerPlacementError) -> bool:
        return False  # a job's replacement that cannot be placed fails the rank (the coordinator keeps trying)

    def new_epoch(self) -> None:
        super().new_epoch()
        self._epoch += 1

    def _decide(self, window_s: float) -> None:
        """A window's end: the job's coordinator decides, on every rank's window (NOTE [ raydl job elastic ])."""
        self._pool.report(self._epoch, (self._win_batches, window_s, self._win_wait_s, self._win_fetch_s))
        self._restart_window()
