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
    queue keeps that order; for an IterableDataset it is the replica's stream order);
  * how a worker's tasks are grouped into actor calls (NOTE [ raydl calls ]).

NOTE [ raydl calls ]
One actor call carries the tasks of one worker, oldest first, and returns their batches together
(`Worker.fetch_many`: one object with the batches, one small object with their `BatchMeta`s), so
Ray's per-call cost on the driver's core is paid once for k batches. Which task goes to which
worker is still torch's rule, task by task; a task assigned to a worker is *pending*
(`Task.call is None`, the worker not on probation) until its worker's call goes out:
  * when the worker has `batches_per_call` pending tasks (adaptive: what fits in CALL_TARGET_S
    of its measured batch time, at most MAX_BATCHES_PER_CALL, its share of the prefetch bound
    and, where Ray sends a reply inline, `call_bytes(worker)`; 1 until a batch was timed;
    `ray_batches_per_call` fixes it);
  * or when the driver is about to wait on one of them (`flush_for`), when the sampler has no
    more draws (`flush_all`) and when the worker leaves the round robin: a pending task never
    waits for a draw that cannot come.
Pending tasks count towards the prefetch bound as torch's sent ones do, so a call never carries
more than a worker's share of it. A call's objects are read with one `ray.get` when its first
batch is needed; the rest wait in `Call.batches` (in the object store) until their turn. A worker
that dies costs only the tasks of its calls not yet received, re-made exactly once (probation).
Invariants, between calls (tests/test_recovery.py checks them after every `next()`):
  * `tasks_outstanding == len(task_info) <= max_tasks`;
  * `workers_num_tasks[w] ==` the number of tasks in `task_info` on worker w;
  * `workers_status[w]` is False once iterable worker w reported the end of its stream;
  * `probation[w]`: idxs of the batches lost with worker w's last process and not yet handed
    out; while w is on probation exactly one of its tasks is sent, its oldest; off probation
    a task without a call is pending (NOTE [ raydl calls ]), and a worker's pending tasks are
    younger than its sent ones;
  * `active` lists distinct worker ids; the per-worker lists are indexed by worker id and
    cover every id ever used (a retired id keeps its slot, with no task).
A Schedule talks to no actor: it sends each call through the `send(worker_id, epoch, [(idx, work), ...])`
callable it is given (the iterator's CallSender.send: its batches ref, metas ref and transport), with the epoch
`reset` gave it. It holds `send` strongly: the CallSender refers to the pool, never to the iterator, so no
reference cycle keeps an iterator alive (NOTE [ raydl shutdown ] in driver/iter.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from .._constants import CALL_TARGET_S, MAX_BATCHES_PER_CALL

if TYPE_CHECKING:
    from .transport.calls import Transport

__all__ = ["Call", "Task", "Schedule"]


class Call:
    """One actor call: the tasks of one worker it carries, its two result refs, the results once read."""

    __slots__ = ("ref", "meta_ref", "idxs", "via", "batches", "metas")

    def __init__(self, ref: Any, meta_ref: Any, idxs: list[int], via: Optional[Transport] = None) -> None:
        self.ref = ref  # the batches, one object (a Ray call's ObjectRef, a lane's ticket)
        self.meta_ref = meta_ref  # their BatchMetas, a small object Ray inlines in the reply (None on a lane)
        self.idxs = idxs
        self.via = via  # the transport that sent it, which receives and abandons it (driver/transport/calls.py)
        self.batches: Optional[list] = None  # read with one get when the first is needed
        self.metas: Optional[list] = None

    @property
    def received(self) -> bool:
        return self.batches is not None

    def take(self, idx: int) -> tuple[Any, Any]:
        """Task `idx`'s (batch, meta), read already; the call keeps no reference to the batch after this."""
        assert self.batches is not None and self.metas is not None
        pos = self.idxs.index(idx)
        batch, self.batches[pos] = self.batches[pos], None
        return batch, self.metas[pos]


class Task:
    """One batch assigned to a worker: its worker, the call carrying it (None while it is pending or held for a
    worker on probation), the indices it covers, what is sent for it and when it was sent."""

    __slots__ = ("worker_id", "call", "index", "work", "sent_s")

    def __init__(self, worker_id: int, index: Any, work: Any) -> None:
        self.worker_id = worker_id
        self.call: Optional[Call] = None
        self.index = index
        self.work = work
        self.sent_s = time.monotonic()

    @property
    def held(self) -> bool:
        """Not sent (pending, or held for probation): no call carries it."""
        return self.call is None

    @property
    def ref(self) -> Any:
        """The ref of its call's batches (None while not sent)."""
        return None if self.call is None else self.call.ref


Send = Callable[[int, int, "list[tuple[int, Any]]"], "tuple[Any, Any, Transport]"]


class Schedule:
    """The tasks in flight of one epoch and the rule that places new ones (NOTE [ raydl scheduling ])."""

    def __init__(
        self,
        num_workers: int,
        max_tasks: int,
        in_order: bool,
        send: Send,
        balanced_from: Optional[int] = None,
        batches_per_call: Optional[int] = None,
        call_bytes: Optional[Callable[[int], Optional[int]]] = None,
    ) -> None:
        self.active = list(range(num_workers))  # the round robin's worker ids, in cycle order
        self._num_ids = num_workers  # worker ids ever used: the per-worker lists cover them all
        self.max_tasks = max_tasks
        self.in_order = in_order
        # a job's rank (NOTE [ raydl job pool ]): the worker that would finish a new task first, ties in
        # cycle order from this worker; None: torch's round robin
        self._balanced_from = balanced_from
        self._fixed_k = batches_per_call  # None: adaptive (NOTE [ raydl calls ])
        self._fetch_s: dict[int, float] = {}  # worker id -> moving average of its batch time
        self._nbytes: dict[int, int] = {}  # worker id -> bytes of its last batch
        self._call_bytes = call_bytes  # worker id -> the most bytes its next call should carry (None: no bound)
        self._send = send
        self.epoch = 0  # the epoch each call carries (`reset`)
        self.calls_sent = 0  # actor calls made (for stats and tests: batches / calls is the grouping achieved)
        self.reset()

    @property
    def num_workers(self) -> int:
        """Workers in the round robin now."""
        return len(self.active)

    def reset(self, first_worker: int = 0, epoch: int = 0) -> None:
        """Epoch `epoch` begins: no task, every worker active, the round robin at `first_worker` (its first worker, as
        torch's; a resumed epoch goes on after the worker of the last batch handed out, NOTE [ raydl checkpoint ])."""
        self.epoch = epoch
        self.task_info: dict[int, Task] = {}
        self.tasks_outstanding = 0
        self.workers_status = [True] * self._num_ids
        self.workers_num_tasks = [0] * self._num_ids
        self._pending: dict[int, list[int]] = {}  # worker id -> its pending idxs, oldest first (NOTE [ raydl calls ])
        self.probation: dict[int, set[int]] = {}
        if self._balanced_from is not None:
            first_worker = self._balanced_from % max(1, self._num_ids)
        self._pos = (
            self.active.index(first_worker) if first_worker in self.active else 0
        )  # position in `active` of the next worker of the cycle

    def _submit(self, worker_id: int, idxs: list[int]) -> None:
        """One call to `worker_id` carrying tasks `idxs` (oldest first)."""
        ref, meta_ref, via = self._send(worker_id, self.epoch, [(i, self.task_info[i].work) for i in idxs])
        call = Call(ref, meta_ref, idxs, via)
        now = time.monotonic()
        for i in idxs:
            task = self.task_info[i]
            task.call, task.sent_s = call, now
        self.calls_sent += 1

    # ------------------------------------------------------------------ calls (NOTE [ raydl calls ])

    def batches_per_call(self, worker_id: int) -> int:
        """How many tasks worker `worker_id`'s next call carries."""
        share = max(1, self.max_tasks // max(1, len(self.active)))
        if self._fixed_k is not None:
            return max(1, min(self._fixed_k, share))
        fetch_s = self._fetch_s.get(worker_id)
        if fetch_s is None or fetch_s >= CALL_TARGET_S:
            return 1
        k = max(1, min(MAX_BATCHES_PER_CALL, share, int(CALL_TARGET_S / max(fetch_s, 1e-6))))
        bound = None if k == 1 or self._call_bytes is None else self._call_bytes(worker_id)
        nbytes = self._nbytes.get(worker_id, 0)
        if bound is not None and 0 < nbytes <= bound:  # a batch over the bound goes in a group all the same
            k = max(1, min(k, bound // nbytes))
        return k

    def flush(self, worker_id: int) -> None:
        """Send worker `worker_id`'s pending tasks now, in one call."""
        idxs = self._pending.pop(worker_id, None)
        if idxs:
            self._submit(worker_id, idxs)

    def flush_all(self) -> None:
        """No more tasks are coming (the sampler is exhausted): send every pending task."""
        for worker_id in list(self._pending):
            self.flush(worker_id)

    def flush_for(self, idx: int) -> None:
        """The driver is about to wait on task `idx`: if it is pending, its worker's call goes now."""
        task = self.task_info.get(idx)
        if task is not None and task.call is None and task.worker_id in self._pending:
            self.flush(task.worker_id)

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

    def least_busy(self, candidates: list[int]) -> Optional[int]:
        """Of these workers, an active one with the fewest tasks in flight (the next in the cycle on a tie), or None
        (NOTE [ raydl node slots ]: a batch goes to a worker of its slot's node)."""
        live = [w for w in candidates if self.workers_status[w]]
        if not live:
            return None
        n = len(self.active)
        rank = {w: (self.active.index(w) - self._pos) % n for w in live}
        worker_id = min(live, key=lambda w: (self.workers_num_tasks[w], rank[w]))
        self._pos = (self.active.index(worker_id) + 1) % n
        return worker_id

    def predicted_cycle(self) -> Optional[list[int]]:
        """The workers the next tasks go to, in order and repeating, if the pool stays as it is: torch's round robin
        in order. None where the rule depends on timing (out of order, a job's balance) or a worker is inactive."""
        if self._balanced_from is not None or not self.in_order or not self.active:
            return None
        if not all(self.workers_status[w] for w in self.active):
            return None
        n = len(self.active)
        return [self.active[(self._pos + k) % n] for k in range(n)]

    def workers_of(self, first: int, end: int, next_idx: int) -> list[Optional[int]]:
        """The worker that makes (or, by `predicted_cycle`, will make) each task idx in [first, end), `next_idx` being
        the next idx to place; None where that is not known."""
        cycle = self.predicted_cycle()
        out: list[Optional[int]] = []
        for idx in range(first, end):
            task = self.task_info.get(idx)
            if task is not None:
                out.append(task.worker_id)
            elif idx >= next_idx and cycle:
                out.append(cycle[(idx - next_idx) % len(cycle)])
            else:
                out.append(None)
        return out

    def on_batch_made(self, worker_id: int, fetch_s: float, nbytes: int = 0) -> None:
        """A batch of `worker_id` took `fetch_s` to make and has `nbytes` of array data: its moving average (call
        sizes, a job's balance) and its size (calls under a byte bound)."""
        prev = self._fetch_s.get(worker_id)
        self._fetch_s[worker_id] = fetch_s if prev is None else 0.8 * prev + 0.2 * fetch_s
        self._nbytes[worker_id] = nbytes
        pending = self._pending.get(worker_id)
        if pending and len(pending) >= self.batches_per_call(worker_id):  # its calls got smaller
            self.flush(worker_id)

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

    def remove_worker(self, worker_id: int, lost: bool = False) -> None:
        """Worker `worker_id` gets no new task; the tasks it has stay on it, its pending ones sent now, or, when it is
        `lost`, wait for `reassign` to move them."""
        if not lost:
            self.flush(worker_id)
        pos = self.active.index(worker_id)
        del self.active[pos]
        if pos < self._pos:
            self._pos -= 1
        if self._pos >= len(self.active):
            self._pos = 0

    def reassign(self, worker_id: int) -> list[int]:
        """Worker `worker_id` is gone for good: send its tasks not yet received, oldest first, to the least loaded
        active workers, one call each.

        Workers on probation are chosen last; a task moved to one is sent at once all the same (held,
        it could be the oldest batch of the epoch, waited on before the one its new worker makes).
        Returns the idxs moved.
        """
        assert self.active, "no worker left to take the tasks"
        self.probation.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        moved = [i for i in self.tasks_on(worker_id) if not self._received(i)]
        for idx in moved:
            old = self.task_info[idx]
            target = min(self.active, key=lambda w: (w in self.probation, self.workers_num_tasks[w]))
            self.task_info[idx] = Task(target, old.index, old.work)
            self.workers_num_tasks[worker_id] -= 1
            self.workers_num_tasks[target] += 1
            self._submit(target, [idx])
        return moved

    def add(self, idx: int, worker_id: int, index: Any, work: Any) -> None:
        """Record task `idx` on `worker_id`: pending until its worker's call goes (NOTE [ raydl calls ]), held while
        the worker is on probation."""
        assert self.tasks_outstanding < self.max_tasks or self.max_tasks == 0
        self.task_info[idx] = Task(worker_id, index, work)
        self.workers_num_tasks[worker_id] += 1
        self.tasks_outstanding += 1
        if worker_id in self.probation:
            return
        pending = self._pending.setdefault(worker_id, [])
        pending.append(idx)
        if len(pending) >= self.batches_per_call(worker_id):
            self.flush(worker_id)

    def send_held(self, idx: int) -> None:
        """Send task `idx`, held until now for its worker's probation, alone in its call."""
        self._submit(self.task_info[idx].worker_id, [idx])

    def resend(self, worker_id: int) -> None:
        """Worker `worker_id`'s actor was swapped before it made anything: send its sent tasks again, oldest first,
        in one call.

        The old refs are dropped (their actor is dead); the worker keeps its tasks, idxs and place.
        """
        sent = [i for i in self.tasks_on(worker_id) if not self.task_info[i].held]
        if sent:
            self._submit(worker_id, sent)

    def _received(self, idx: int) -> bool:
        call = self.task_info[idx].call
        return call is not None and call.received

    # ------------------------------------------------------------------ removing tasks

    def pop(self, idx: int) -> Task:
        """Forget task `idx` (handed out, failed or dropped); a worker on probation sends its next."""
        task = self.task_info.pop(idx)
        self.tasks_outstanding -= 1
        self.workers_num_tasks[task.worker_id] -= 1
        pending = self._pending.get(task.worker_id)
        if pending and idx in pending:
            pending.remove(idx)
        lost = self.probation.get(task.worker_id)
        if lost is not None:
            lost.discard(idx)
            held = [i for i in self.tasks_on(task.worker_id) if self.task_info[i].held]
            if lost:
                if held:
                    self.send_held(held[0])
            else:
                del self.probation[task.worker_id]
                if held:  # the lost batches are re-made: the rest go as one call
                    self._submit(task.worker_id, held)
        return task

    def drop_all(self) -> list[Task]:
        """Forget every task (nothing held is sent meanwhile); returns them, for their refs to be abandoned."""
        self.probation = {}
        self._pending = {}
        return [self.pop(idx) for idx in list(self.task_info)]

    def retire(self, worker_id: int) -> list[Task]:
        """Iterable worker `worker_id` ended its stream: it gets no more tasks; returns the ones it had."""
        self.workers_status[worker_id] = False
        self._pending.pop(worker_id, None)
        return [self.pop(idx) for idx in self.tasks_on(worker_id)]

    # ------------------------------------------------------------------ recovery and queries

    def hold_for_replacement(self, worker_id: int) -> list[int]:
        """Worker `worker_id` is being replaced: hold its tasks not yet received and put it on probation; returns
        their idxs (the batches lost with it)."""
        self._pending.pop(worker_id, None)
        lost = [i for i in self.tasks_on(worker_id) if not self._received(i)]
        if lost:
            self.probation[worker_id] = set(lost)
        for i in lost:
            self.task_info[i].call = None
        return lost

    def tasks_on(self, worker_id: int) -> list[int]:
        """The idxs of worker `worker_id`'s tasks, oldest first."""
        return sorted(i for i, t in self.task_info.items() if t.worker_id == worker_id)

    def unordered_candidates(self) -> dict[Any, int]:
        """in_order=False: ref -> idx of each worker's oldest task in flight (the only ones that may go first).

        A worker whose oldest task is pending sends its call first (NOTE [ raydl calls ])."""
        oldest: dict[int, int] = {}
        for idx, task in self.task_info.items():
            w = task.worker_id
            if (not task.held or w in self._pending) and (w not in oldest or idx < oldest[w]):
                oldest[w] = idx
        for idx in oldest.values():
            self.flush_for(idx)
        return {self.task_info[idx].ref: idx for idx in oldest.values()}
