"""A worker pool that grows and shrinks mid-epoch: `loader.set_num_workers(n)`, the autoscaler, lost nodes.

NOTE [ raydl elastic pool ]
The driver owns the sampler order and every task (NOTE [ raydl ordering ] in driver/iter.py), so which
worker makes a batch never changes which batch comes out next: the pool may change under an
epoch. An `ElasticPool` changes it, one worker at a time, between two batches:
  * growing: a new actor under a new worker id (never reused within an iterator, so a retired
    id's late replies are never taken for a new worker's); the driver does not wait for it but
    polls at each `next()`, and a started one joins the round robin at the end of the cycle with
    `prefetch_factor` more tasks. One that dies or does not start in `ray_startup_timeout_s` is
    dropped with a warning;
  * shrinking: joining workers go first, then the newest active ones retire: out of the round
    robin at once, they finish the tasks they have, then are released (warm when clean);
  * a worker lost for good (its replacement cannot be placed in time): its tasks go to the
    survivors; the iterator fails (WorkerDiedError) only when no worker is left.
Each batch is still handed out exactly once, in sampler order with in_order=True: tasks keep
their idx whatever worker makes them, so with ray_seed="batch" an epoch through any resizes is
identical to an undisturbed one. In a worker, `get_worker_info().id` is unique within the
iterator (it can reach num_workers or more after a resize) and `num_workers` is the target size
when it first started; an IterableDataset is never resized.
NOTE [ raydl rebalance ]
A lost node's workers are replaced on the nodes left, and a node that joins later got none: the
pool stayed on the survivors (3 workers on one node of two for the rest of an epoch), and over node
slots (NOTE [ raydl node slots ]) every slot's units went to that one node's cache. So every
REBALANCE_INTERVAL_S the pool compares its active workers' nodes with the share of each node workers
may go to now (by their CPUs: `WorkerPool.worker_to_move`); when a node holds a worker more than its
share while another holds one fewer, one worker moves: a new worker starts (placed where the pool is
most below its share), and once it has started the newest worker of the node most over its share
retires as a resize retires one (its tasks finished, no batch lost). One move at a time; the slots'
deal follows the workers' nodes. Only where a batch's content does not depend on its worker
(`ray_seed` "batch" or "sample", map-style datasets), and not for a job's pool (its coordinator
places the workers).
The autoscaler (`ray_max_workers=N`) measures per batch how long `next()` waited and how long its
worker took, over windows of AUTOSCALE_WINDOW_BATCHES batches and AUTOSCALE_WINDOW_MIN_S, and
takes at most one step per window: add a worker when the loop waited while the workers were busy
(and the cluster has room now: no autoscaler is asked for a node by surprise), retire the newest
when one fewer would still idle, undo an addition that did not pay (AUTOSCALE_UNDO_WINDOWS), then
stop growing for the epoch. Far-apart thresholds, one decision at a time and measurements
restarted after each change are the hysteresis; each epoch's first window is not measured. Every
decision is logged at INFO. Thresholds' measurements: docs/design-notes.md.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from .._constants import (
    AUTOSCALE_ADD_BUSY_FRACTION,
    AUTOSCALE_ADD_WAIT_FRACTION,
    AUTOSCALE_RETIRE_BUSY_FRACTION,
    AUTOSCALE_RETIRE_WAIT_FRACTION,
    AUTOSCALE_UNDO_WINDOWS,
    AUTOSCALE_WINDOW_BATCHES,
    AUTOSCALE_WINDOW_MIN_S,
    REBALANCE_INTERVAL_S,
)
from .._errors import WorkerDiedError, WorkerPlacementError
from .connect import fits_available, resource_request

if TYPE_CHECKING:
    from .pool_protocol import ResizablePool

__all__ = ["ElasticPool", "ElasticSchedule", "AutoscaleDecision", "AutoscaleRule"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscaleDecision:
    """One autoscaler step, with the figures it was taken on (kept in `ElasticPool.decisions`)."""

    action: str  # "add", "retire" or "undo"
    workers_before: int
    workers_after: int
    batches: int  # batches in the window
    window_s: float
    wait_fraction: float  # of the window, the loop waiting in next()
    busy_fraction: float  # of the workers' time, making batches
    batches_per_s: float
    batch_number: int  # batches handed out this epoch when it was taken


class AutoscaleRule:
    """The autoscaler's rule (NOTE [ raydl elastic pool ]): at most one step per measured window.

    A private pool's `ElasticPool` and a job's coordinator (NOTE [ raydl job pool ]) decide by it;
    they measure and act, this only decides, and remembers an addition being judged.
    """

    def __init__(self, min_workers: int, max_workers: int) -> None:
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.new_epoch()

    def new_epoch(self) -> None:
        self.cap = self.max_workers  # growth stops here for the epoch (lowered by an undo or a failed start)
        # an addition being judged: (size before, batches/s and wait fraction before it, windows that failed it)
        self.pending: Optional[tuple[int, float, float, int]] = None

    def decide(
        self, n: int, wait: float, busy_workers: float, rate: float, has_room: Callable[[], bool]
    ) -> Optional[tuple[str, str]]:
        """One window: `n` workers, the loop waiting `wait` of it, `busy_workers` workers' worth of batch making
        (fetch seconds per second), `rate` batches/s. Returns ("add" | "retire" | "undo", why) or None."""
        busy = busy_workers / n
        pending, self.pending = self.pending, None
        if pending is not None:
            size_before, rate_before, wait_before, strikes = pending
            possible = min(1.0 / size_before, wait_before / max(1.0 - wait_before, 1e-9))
            if n > self.min_workers and rate < rate_before * (1.0 + 0.25 * possible):
                if strikes + 1 < AUTOSCALE_UNDO_WINDOWS:  # one noisy window does not decide
                    self.pending = (size_before, rate_before, wait_before, strikes + 1)
                    return None
                self.cap = size_before
                return "undo", f"{rate_before:.1f} batches/s before it: the addition did not pay"
        if wait > AUTOSCALE_ADD_WAIT_FRACTION and busy >= AUTOSCALE_ADD_BUSY_FRACTION and n < self.cap and has_room():
            self.pending = (n, rate, wait, 0)
            return "add", f"threshold {AUTOSCALE_ADD_WAIT_FRACTION:.0%}"
        if n > self.min_workers and wait < AUTOSCALE_RETIRE_WAIT_FRACTION:
            busy_fewer = busy_workers / (n - 1)
            if busy_fewer < AUTOSCALE_RETIRE_BUSY_FRACTION:
                return "retire", f"one fewer would be busy {busy_fewer:.0%}"
        return None


class ElasticSchedule(Protocol):
    """What resizing uses of the driver's `Schedule` (driver/schedule.py), which this layer does not import."""

    active: list[int]  # the round robin's worker ids, in cycle order
    max_tasks: int  # the bound on tasks in flight
    workers_num_tasks: list[int]  # worker id -> its tasks in flight

    def add_worker(self, worker_id: int) -> None:
        """A started worker joins the round robin at the end of the cycle."""
        ...

    def remove_worker(self, worker_id: int, lost: bool = False) -> None:
        """Worker `worker_id` gets no new task (`lost`: its tasks wait for `reassign`)."""
        ...

    def reassign(self, worker_id: int) -> list[int]:
        """Worker `worker_id` is gone: its tasks not yet received go to the active workers; returns their idxs."""
        ...


class ElasticPool:
    """Resizes one iterator's `WorkerPool` and `Schedule` (NOTE [ raydl elastic pool ]).

    `put_index` is the conductor's "draw the next task" (bounded by `Schedule.max_tasks`), held weakly.
    """

    def __init__(
        self,
        pool: ResizablePool,
        sched: ElasticSchedule,
        prefetch_factor: int,
        put_index: Callable[[], None],
        startup_timeout_s: float,
        min_workers: int,
        max_workers: Optional[int],
        resizable: bool,
        clock: Callable[[], float] = time.perf_counter,
        rebalance: bool = False,
    ) -> None:
        self._clock = clock
        self._rebalance = rebalance and resizable and callable(getattr(pool, "worker_to_move", None))
        self._next_balance = clock() + REBALANCE_INTERVAL_S
        self.moving: dict[int, int] = {}  # a worker joining -> the worker it replaces once started (a move)
        self.moves = 0  # workers moved to even the nodes (NOTE [ raydl rebalance ])
        self._pool = pool
        self._sched = sched
        self._prefetch_factor = prefetch_factor
        # weakly: a strong bound method of the iterator would put it in a reference cycle (NOTE [ raydl shutdown ])
        self._put_index_ref = weakref.WeakMethod(put_index) if hasattr(put_index, "__self__") else (lambda: put_index)
        self._startup_timeout_s = startup_timeout_s
        self._resizable = resizable
        self._max_option = max_workers  # ray_max_workers (None: no autoscaling)
        self.rule = AutoscaleRule(min_workers, max_workers if max_workers is not None else min_workers)
        self.retiring: set[int] = set()
        self.decisions: list[AutoscaleDecision] = []
        self._autoscale = resizable and self.rule.max_workers > self.rule.min_workers
        self.new_epoch()

    # ------------------------------------------------------------------ sizes

    @property
    def size(self) -> int:
        """Workers in the round robin plus workers joining: the pool's target size."""
        return len(self._sched.active) + len(self._pool.joining)

    def _set_bound(self) -> None:
        self._sched.max_tasks = self._prefetch_factor * len(self._sched.active)

    # ------------------------------------------------------------------ resizing

    def resize(self, num_workers: int) -> None:
        """Make the pool `num_workers` workers: start new ones, or retire the newest (NOTE [ raydl elastic pool ])."""
        if not self._resizable:
            raise ValueError(
                "raydl cannot resize the workers of an IterableDataset: each replica yields its own shard, "
                "split by get_worker_info().num_workers, and a replica's position cannot move to another "
                "worker without losing or repeating samples. Build a new loader with the new num_workers."
            )
        self.rule.min_workers = num_workers
        self.rule.max_workers = max(self._max_option or num_workers, num_workers)
        self._autoscale = self.rule.max_workers > self.rule.min_workers
        self.rule.pending = None
        before = self.size
        while self.size < num_workers:
            self._add(num_workers)
        while self.size > num_workers:
            self._retire_newest()
        if before != num_workers:
            logger.info("raydl: pool resized from %d to %d workers", before, num_workers)
        self._restart_window()

    def _add(self, info_num_workers: int) -> int:
        wid = self._pool.add_worker(info_num_workers)
        logger.debug("raydl: worker %d joining", wid)
        return wid

    def _retire_newest(self) -> int:
        """Cancel the newest joining worker, else retire the newest active one; returns its id."""
        if self._pool.joining:
            wid = max(self._pool.joining)
            self._pool.release(wid)
            self.moving.pop(wid, None)
            return wid
        return self._retire(max(self._sched.active))

    def _retire(self, wid: int) -> int:
        """Worker `wid` leaves the round robin now and is released once its tasks are done."""
        self._sched.remove_worker(wid)
        self._set_bound()
        if self._sched.workers_num_tasks[wid] == 0:
            self._pool.release(wid)
        else:
            self.retiring.add(wid)
        return wid

    def step(self) -> None:
        """Before each batch: release retired workers that are done, let started workers join; now and then, move a
        worker to a node that joined (NOTE [ raydl rebalance ])."""
        for wid in [w for w in self.retiring if self._sched.workers_num_tasks[w] == 0]:
            self.retiring.discard(wid)
            self._pool.release(wid)
        if self._rebalance and not self._pool.joining and self._clock() >= self._next_balance:
            self._next_balance = self._clock() + REBALANCE_INTERVAL_S
            old = self._pool.worker_to_move(list(self._sched.active))  # type: ignore[attr-defined]
            if old is not None:
                new = self._add(self.size)
                if self._pool.node_of(new) == self._pool.node_of(old):  # type: ignore[attr-defined]
                    self._pool.release(new)  # placed where the old one is (no room elsewhere): no move
                else:
                    self.moving[new] = old
        if not self._pool.joining:
            return
        joined, failed = self._pool.poll_joining(self._startup_timeout_s)
        for wid, why in failed:
            if self.moving.pop(wid, None) is not None:  # a move's worker: the pool stays where it is
                logger.info("raydl: worker %d, moving to a node that joined, did not start (%s)", wid, why)
                continue
            warnings.warn(f"raydl: worker {wid} was not added to the pool ({why})", RuntimeWarning, stacklevel=5)
            self.rule.cap = min(self.rule.cap, self.size)
            self.rule.pending = None
        for wid in joined:
            old = self.moving.pop(wid, None)
            if old is not None and old in self._sched.active:  # the move done: the worker it replaces leaves
                self._retire(old)
                self.moves += 1
                logger.info("raydl: worker %d moved to worker %d's node share (NOTE [ raydl rebalance ])", old, wid)
            self._sched.add_worker(wid)
            self._set_bound()
            logger.debug("raydl: worker %d joined (%d in the round robin)", wid, len(self._sched.active))
            put_index = self._put_index_ref()
            for _ in range(self._prefetch_factor if put_index is not None else 0):
                put_index()

    # ------------------------------------------------------------------ deaths

    def take_over_lost(self, worker_id: int) -> bool:
        """A worker died: when it was retiring, its tasks go to the active workers (True); else recovery replaces it."""
        if worker_id not in self.retiring:
            return False
        self.retiring.discard(worker_id)
        moved = self._sched.reassign(worker_id)
        self._pool.release(worker_id)
        logger.warning("raydl: retiring worker %d died; %d batch(es) resent to the others", worker_id, len(moved))
        return True

    def survive_unplaceable(self, error: WorkerPlacementError) -> bool:
        """Replacements that found no room: go on without them (NOTE [ raydl elastic pool ]); False if not survivable.

        Raises:
            WorkerDiedError: no worker would be left.
        """
        wids = list(getattr(error, "worker_ids", []))
        if not self._resizable or not wids or any(self._pool.restarts[w] == 0 for w in wids):
            return False  # a first start that cannot be placed is a configuration error: raised as is
        for wid in wids:
            where = self._pool.describe(wid)
            if wid in self._sched.active:
                self._sched.remove_worker(wid, lost=True)
            self.retiring.discard(wid)
            self._pool.release(wid)
            self._set_bound()
            if not self._sched.active:
                raise WorkerDiedError(
                    f"{where} died and no node can host a replacement ({error}); no worker is left to "
                    "finish the epoch. Fix: add nodes or free resources, or ask for less in ray_remote_args."
                ) from None
            moved = self._sched.reassign(wid)
            warnings.warn(
                f"raydl: {where} died and could not be replaced within ray_startup_timeout_s="
                f"{self._startup_timeout_s:g} s (no node has room for it); going on with "
                f"{len(self._sched.active)} worker(s), {len(moved)} batch(es) resent to them.",
                RuntimeWarning,
                stacklevel=6,
            )
        self.rule.cap = min(self.rule.cap, self.size)
        return True

    # ------------------------------------------------------------------ autoscaler

    def new_epoch(self) -> None:
        """Measurements restart with each epoch (its first batches include start-up)."""
        self.rule.new_epoch()
        self._batches = 0
        self._last_end_s: Optional[float] = None
        self._restart_window()
        # start-up transients too: new processes' first batches, the first prefetch filling up
        self._skip += AUTOSCALE_WINDOW_BATCHES

    def _restart_window(self) -> None:
        # skip what was in flight before the change: it was drawn for the old pool
        self._skip = self._prefetch_factor * max(self.size, 1)
        self._win_batches = 0
        self._win_wait_s = 0.0
        self._win_fetch_s = 0.0
        self._win_start_s: Optional[float] = None

    def on_batch_made(self, fetch_s: float) -> None:
        """A batch's worker reported how long making it took."""
        if self._autoscale:
            self._win_fetch_s += fetch_s

    def on_next(self, wait_s: float) -> None:
        """`next()` handed out a batch after waiting `wait_s` seconds for it; maybe take one autoscaling step."""
        if not self._autoscale:
            return
        now = self._clock()
        self._batches += 1
        last, self._last_end_s = self._last_end_s, now
        if self._pool.joining or self.retiring:
            self._restart_window()  # a change is still taking effect
            return
        if self._skip > 0:
            self._skip -= 1
            if self._skip == 0:
                self._win_start_s = now
                self._win_fetch_s = 0.0
            return
        if self._win_start_s is None or last is None:
            self._win_start_s = now
            self._win_fetch_s = 0.0
            return
        self._win_batches += 1
        self._win_wait_s += min(wait_s, now - last)
        window_s = now - self._win_start_s
        if self._win_batches < max(AUTOSCALE_WINDOW_BATCHES, 2 * self.size) or window_s < AUTOSCALE_WINDOW_MIN_S:
            return
        self._decide(window_s)

    def _decide(self, window_s: float) -> None:
        n = len(self._sched.active)
        wait = self._win_wait_s / window_s
        busy = self._win_fetch_s / (n * window_s)
        rate = self._win_batches / window_s
        figures = (self._win_batches, window_s, wait, busy, rate)
        step = self.rule.decide(n, wait, self._win_fetch_s / window_s, rate, self._has_room)
        if step is None:
            self._restart_window()
            return
        action, why = step
        if action == "add":
            self._add(n + 1)
        else:
            self._retire_newest()
        self._log(action, n, n + 1 if action == "add" else n - 1, figures, why)

    def _has_room(self) -> bool:
        """Room for one more worker now: it reserves nothing, or what it reserves is free in the cluster."""
        request = resource_request(self._pool.actor_options)
        return not request or fits_available(request)

    def _log(self, action: str, before: int, after: int, figures: tuple, why: str) -> None:
        batches, window_s, wait, busy, rate = figures
        self.decisions.append(
            AutoscaleDecision(action, before, after, batches, window_s, wait, busy, rate, self._batches)
        )
        logger.info(
            "raydl autoscale: %s, %d -> %d workers: over the last %d batches (%.2f s) the loop waited %.0f%% "
            "of its time, workers were busy %.0f%%, %.1f batches/s (%s)",
            action,
            before,
            after,
            batches,
            window_s,
            100 * wait,
            100 * busy,
            rate,
            why,
        )
        self._restart_window()
