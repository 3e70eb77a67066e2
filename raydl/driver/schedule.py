"""Which worker makes which batch: torch's round robin, probation after a death, held tasks.

NOTE [ raydl scheduling ]
A `Schedule` owns the tasks of one epoch from the moment a sampler draw becomes task `idx` until
its batch is handed out or dropped. It decides, and records:
  * the worker of each new task: torch's round robin over the worker ids in `active` (0 ..
    num_workers-1 for a pool that is never resized), skipping iterable workers whose stream has
    ended; with in_order=False also skipping workers that already hold their share
    (`max_tasks // active workers`) of the tasks in flight. A resize (NOTE [ raydl elastic
    pool ] in cluster/elastic.py) adds a joined worker at the end of the cycle, or takes a retiring
    one out of it while its tasks stay where they are;
  * whether the task is sent now or held (or sent again: `resend`, when a dead warm actor was
    swapped for a new one at start-up, which is no death of the worker); a worker on probation
    (NOTE [ raydl recovery ] in driver/recovery.py) has exactly one task in flight, its oldest; its other tasks are held
    (`Task.ref is None`) and sent one at a time as the one before is handed out, then all at
    once when the batches lost with its last process have been re-made;
  * which finished tasks may be handed out first with in_order=False: only each worker's oldest
    task in flight, so one worker's batches come out in the order it made them (torch's result
    queue keeps that order; for an IterableDataset it is the replica's stream order).
Invariants, between calls (tests/test_recovery.py checks them after every `next()`):
  * `tasks_outstanding == len(task_info) <= max_tasks`;
  * `workers_num_tasks[w] ==` the number of tasks in `task_info` on worker w;
  * `workers_status[w]` is False once iterable worker w reported the end of its stream;
  * `probation[w]`: idxs of the batches lost with worker w's last process and not yet handed
    out; while w is on probation exactly one of its tasks is sent, its oldest; off probation
    every task has a ref;
  * `active` lists distinct worker ids; the per-worker lists are indexed by worker id and
    cover every id ever used (a retired id keeps its slot, with no task).
A Schedule talks to no actor: sending is the `submit(worker_id, idx, work)` callable it is given,
which returns the task's (batch ref, meta ref). It holds that callable weakly when it is a bound
method (the iterator's `_submit`): a strong one would put every iterator in a reference cycle, so
every dropped iterator would wait for the cyclic garbage collector to free it and its buffered
batches (what a collection of such garbage did to the warm pool: NOTE [ raydl shutdown ] in driver/iter.py).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["Task", "Schedule"]


@dataclass(frozen=True)
class Task:
    """One batch in flight: the worker making it, the refs of its results, the indices it covers, what was sent.

    `ref` (the batch) and `meta_ref` (the worker's `BatchMeta` for it) are None while the task is
    held for a worker on probation.
    """

    worker_id: int
    ref: Any
    meta_ref: Any
    index: Any
    work: Any
    sent_s: float = field(default_factory=time.monotonic)

    @property
    def held(self) -> bool:
        return self.ref is None


Submit = Callable[[int, int, Any], "tuple[Any, Any]"]


class Schedule:
    """The tasks in flight of one epoch and the rule that places new ones (NOTE [ raydl scheduling ])."""

    def __init__(
        self, num_workers: int, max_tasks: int, in_order: bool, submit: Submit, balanced_from: Optional[int] = None
    ) -> None:
        self.active = list(range(num_workers))  # the round robin's worker ids, in cycle order
        self._num_ids = num_workers  # worker ids ever used: the per-worker lists cover them all
        self.max_tasks = max_tasks
        self.in_order = in_order
        # a job's rank (NOTE [ raydl job pool ]): the worker that would finish a new task first, ties in
        # cycle order from this worker; None: torch's round robin
        self._balanced_from = balanced_from
        self._fetch_s: dict[int, float] = {}  # worker id -> moving average of its batch time (balanced only)
        self._submit_ref = weakref.WeakMethod(submit) if hasattr(submit, "__self__") else (lambda: submit)
        self.reset()

    @property
    def num_workers(self) -> int:
        """Workers in the round robin now."""
        return len(self.active)

    def reset(self, first_worker: int = 0) -> None:
        """A new epoch: no task, every worker active, the round robin at `first_worker` (its first worker, as
        torch's; a resumed epoch goes on after the worker of the last batch handed out, NOTE [ raydl checkpoint ])."""
        self.task_info: dict[int, Task] = {}
        self.tasks_outstanding = 0
        self.workers_status = [True] * self._num_ids
        self.workers_num_tasks = [0] * self._num_ids
        self.probation: dict[int, set[int]] = {}
        if self._balanced_from is not None:
            first_worker = self._balanced_from % max(1, self._num_ids)
        self._pos = (
            self.active.index(first_worker) if first_worker in self.active else 0
        )  # position in `active` of the next worker of the cycle

    def _submit(self, worker_id: int, idx: int, work: Any) -> tuple[Any, Any]:
        submit = self._submit_ref()
        if submit is None:
            raise RuntimeError("raydl bug: a Schedule outlived the iterator that sends its tasks")
        return submit(worker_id, idx, work)

    # ------------------------------------------------------------------ placing tasks

    def next_worker(self) -> Optional[int]:
        """The worker for the next task by torch's rule, or None when no worker may take one."""
        if self._balanced_from is not None:
            return self._least_loaded()
        for _ in range(len(self.active)):
            worker_id = self.active[self._pos]
            self._pos = (self._pos + 1) % len(self.active)
            if not self.workers_status[worker_id]:
                continue
            if self.in_order or self.workers_num_tasks[worker_id] < self.max_tasks // sum(
                self.workers_status[w] for w in self.active
            ):
                return worker_id
        return None

    def on_batch_made(self, worker_id: int, fetch_s: float) -> None:
        """A batch of `worker_id` took `fetch_s` to make: its moving average (a job's rank only)."""
        if self._balanced_from is not None:
            prev = self._fetch_s.get(worker_id)
            self._fetch_s[worker_id] = fetch_s if prev is None else 0.8 * prev + 0.2 * fetch_s

    def _least_loaded(self) -> Optional[int]:
        """A job's rank: the active worker that would finish one more of its tasks first, by its tasks in flight
        times its batch time (workers not timed yet count as the typical one); ties in cycle order."""
        n = len(self.active)
        order = [self.active[(self._pos + k) % n] for k in range(n)]
        candidates = [w for w in order if self.workers_status[w]]
        if not candidates:
            return None
        known = sorted(self._fetch_s.values())
        typical = known[len(known) // 2] if known else 1.0
        worker_id = min(candidates, key=lambda w: (self.workers_num_tasks[w] + 1) * self._fetch_s.get(w, typical))
        self._pos = (self.active.index(worker_id) + 1) % n
        return worker_id

    # ------------------------------------------------------------------ resizing (NOTE [ raydl elastic pool ])

    def add_worker(self, worker_id: int) -> None:
        """A new worker joins the round robin at the end of the cycle."""
        assert worker_id not in self.active
        self._num_ids = max(self._num_ids, worker_id + 1)
        grow = self._num_ids - len(self.workers_status)
        if grow > 0:
            self.workers_status += [True] * grow
            self.workers_num_tasks += [0] * grow
        self.workers_status[worker_id] = True
        self.active.append(worker_id)

    def remove_worker(self, worker_id: int) -> None:
        """Worker `worker_id` gets no new task; the tasks it has stay on it (or are moved by `reassign`)."""
        pos = self.active.index(worker_id)
        del self.active[pos]
        if pos < self._pos:
            self._pos -= 1
        if self._pos >= len(self.active):
            self._pos = 0

    def reassign(self, worker_id: int) -> list[int]:
        """Worker `worker_id` is gone for good: send its tasks, oldest first, to the least loaded active workers.

        Workers on probation are chosen last; a task moved to one is sent at once all the same (held,
        it could be the oldest batch of the epoch, waited on before the one its new worker makes).
        Returns the idxs moved.
        """
        assert self.active, "no worker left to take the tasks"
        self.probation.pop(worker_id, None)
        moved = self.tasks_on(worker_id)
        for idx in moved:
            old = self.task_info[idx]
            target = min(self.active, key=lambda w: (w in self.probation, self.workers_num_tasks[w]))
            ref, meta_ref = self._submit(target, idx, old.work)
            self.task_info[idx] = Task(target, ref, meta_ref, old.index, old.work)
            self.workers_num_tasks[worker_id] -= 1
            self.workers_num_tasks[target] += 1
        return moved

    def add(self, idx: int, worker_id: int, index: Any, work: Any) -> None:
        """Record task `idx` on `worker_id`; send it unless the worker is on probation."""
        assert self.tasks_outstanding < self.max_tasks or self.max_tasks == 0
        refs = (None, None) if worker_id in self.probation else self._submit(worker_id, idx, work)
        self.task_info[idx] = Task(worker_id, refs[0], refs[1], index, work)
        self.workers_num_tasks[worker_id] += 1
        self.tasks_outstanding += 1

    def send_held(self, idx: int) -> None:
        """Send task `idx`, held until now for its worker's probation."""
        self._send(idx)

    def resend(self, worker_id: int) -> None:
        """Worker `worker_id`'s actor was swapped before it made anything: send its sent tasks again, oldest first.

        The old refs are dropped (their actor is dead); the worker keeps its tasks, idxs and place.
        """
        for idx in self.tasks_on(worker_id):
            if not self.task_info[idx].held:
                self._send(idx)

    def _send(self, idx: int) -> None:
        task = self.task_info[idx]
        ref, meta_ref = self._submit(task.worker_id, idx, task.work)
        self.task_info[idx] = Task(task.worker_id, ref, meta_ref, task.index, task.work)

    # ------------------------------------------------------------------ removing tasks

    def pop(self, idx: int) -> Task:
        """Forget task `idx` (handed out, failed or dropped); a worker on probation sends its next."""
        task = self.task_info.pop(idx)
        self.tasks_outstanding -= 1
        self.workers_num_tasks[task.worker_id] -= 1
        lost = self.probation.get(task.worker_id)
        if lost is not None:
            lost.discard(idx)
            held = [i for i in self.tasks_on(task.worker_id) if self.task_info[i].held]
            if lost:
                if held:
                    self.send_held(held[0])
            else:
                del self.probation[task.worker_id]
                for i in held:
                    self.send_held(i)
        return task

    def drop_all(self) -> list[Task]:
        """Forget every task (nothing held is sent meanwhile); returns them, for their refs to be abandoned."""
        self.probation = {}
        return [self.pop(idx) for idx in list(self.task_info)]

    def retire(self, worker_id: int) -> list[Task]:
        """Iterable worker `worker_id` ended its stream: it gets no more tasks; returns the ones it had."""
        self.workers_status[worker_id] = False
        return [self.pop(idx) for idx in self.tasks_on(worker_id)]

    # ------------------------------------------------------------------ recovery and queries

    def hold_for_replacement(self, worker_id: int) -> list[int]:
        """Worker `worker_id` is being replaced: hold all its tasks and put it on probation; returns their idxs."""
        on_worker = self.tasks_on(worker_id)
        if on_worker:
            self.probation[worker_id] = set(on_worker)
        for i in on_worker:
            old = self.task_info[i]
            self.task_info[i] = Task(worker_id, None, None, old.index, old.work)
        return on_worker

    def tasks_on(self, worker_id: int) -> list[int]:
        """The idxs of worker `worker_id`'s tasks, oldest first."""
        return sorted(i for i, t in self.task_info.items() if t.worker_id == worker_id)

    def unordered_candidates(self) -> dict[Any, int]:
        """in_order=False: ref -> idx of each worker's oldest task in flight (the only ones that may go first)."""
        oldest: dict[int, int] = {}
        for idx, task in self.task_info.items():
            if not task.held and (task.worker_id not in oldest or idx < oldest[task.worker_id]):
                oldest[task.worker_id] = idx
        return {self.task_info[idx].ref: idx for idx in oldest.values()}
