"""Receiving a batch: the bounded wait for a task's result, and reading it from the transport that carries it.

NOTE [ raydl receive ]
The iterator decides *which* batch is next (NOTE [ raydl ordering ] in driver/iter.py); this
module gets it. Why apart: the wait is where the epoch meets the world outside the driver
(a slow worker, a dead one, a user error in the dataset), and each of those has one answer here:
  * every wait is a slice of at most STATUS_CHECK_INTERVAL_S, so between slices the driver can
    raise torch's timeout or warn of a stall (NOTE [ raydl waits ]); a timeout leaves the task in
    place, and the next `next()` waits for the same batch;
  * one read takes a whole call's reply (NOTE [ raydl calls ]): the call's other batches wait in
    it, in the driver, for their turn;
  * a lost worker (actor died, object lost, lane lost) is recovered by the host (NOTE [ raydl
    recovery ]), and the wait goes on for the same idx on the replacement; if recovery held that
    task for probation, `TaskHeld` tells the iterator to pick another (in_order=False only);
  * user code that raised in the worker comes back as Ray's `RayTaskError` or, from a lane's
    `BatchFailed`, as `BatchError`; `failure` reads the user's exception and its remote traceback
    from either, so the iterator raises both the same way: refill first, then the user's
    exception, with the worker and batch named (as torch refills before `reraise`).
A `Receiver` holds the epoch's parts (schedule, transport, waits), never the iterator: the
iterator passes itself as `host` of each call (as `Recovery` does), so no cycle keeps it alive.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from .._constants import STATUS_CHECK_INTERVAL_S
from .._errors import remote_traceback
from ..worker.actor import BatchFailed, BatchMeta
from .transport.lane import LaneLost

if TYPE_CHECKING:
    from .schedule import Schedule, Task
    from .transport.calls import CallSender
    from .waits import BatchWaits

__all__ = ["BatchError", "TaskHeld", "ReceiveHost", "Receiver", "failure"]


class BatchError(Exception):
    """User code raised while the worker made this batch; `error` and `traceback` are the worker's, raised again in
    the driver."""

    def __init__(self, error: BaseException, traceback_text: str) -> None:
        super().__init__(error)
        self.error = error
        self.traceback = traceback_text


class TaskHeld(Exception):
    """The task waited on was held for its worker's probation (NOTE [ raydl scheduling ] in driver/schedule.py); the
    iterator picks another."""


class ReceiveHost(Protocol):
    """What receiving asks of the iterator it serves."""

    def on_batch_made(self, idx: int, task: Task, meta: BatchMeta, nbytes: int) -> None:
        """Task `idx`'s batch is in hand, with what its worker reported about making it."""

    def recover(self, worker_id: int, error: BaseException) -> None:
        """Replace a lost worker and resend its tasks, or raise WorkerDiedError (NOTE [ raydl recovery ])."""


class Receiver:
    """Waits for and reads the batches of one iterator's tasks (NOTE [ raydl receive ])."""

    def __init__(self, sched: Schedule, calls: CallSender, waits: BatchWaits) -> None:
        self._sched = sched
        self._calls = calls
        self._waits = waits

    def first_ready(self, rcvd_idx: int) -> int:
        """in_order=False: the idx of whichever worker's oldest task finishes first, bounded by `timeout` (the error
        names task `rcvd_idx`, the oldest not handed out)."""
        deadline = self._waits.deadline()
        task_info = self._sched.task_info
        by_ref = self._sched.unordered_candidates()
        for idx in by_ref.values():
            call = task_info[idx].call
            if call is not None and call.received:  # a later batch of a call already read
                return idx
        while True:
            calls = [task_info[idx].call for idx in by_ref.values()]
            ready = self._calls.first_ready(calls, STATUS_CHECK_INTERVAL_S)
            if ready is not None:
                return by_ref[ready]
            if deadline is not None and time.monotonic() >= deadline:
                self._waits.raise_timeout(rcvd_idx, task_info.get(rcvd_idx))

    def get(self, idx: int, task: Task, host: ReceiveHost) -> Any:
        """Task `idx`'s batch, read in slices bounded by `timeout`; a lost worker is recovered by `host`.

        Raises:
            BatchError, RayTaskError: user code failed in the worker (`failure` reads either).
            TaskHeld: recovery held this task for probation (in_order=False picks another).
            RuntimeError: torch's timeout error, with the batch and worker named.
            WorkerDiedError: the worker died and cannot be replaced (NOTE [ raydl recovery ]).
        """
        from ray.exceptions import ActorUnschedulableError, GetTimeoutError, ObjectLostError, RayActorError

        deadline = self._waits.deadline()
        while True:
            try:
                call = task.call
                assert call is not None, "raydl bug: waiting on a task no call carries"
                if not call.received:  # one get for the whole call (NOTE [ raydl calls ])
                    call.batches, call.metas = self._calls.receive(call, task.worker_id, STATUS_CHECK_INTERVAL_S)
                data, meta = call.take(idx)
                if isinstance(data, BatchFailed):
                    raise BatchError(data.error, data.traceback)
                nbytes = self._calls.on_batch(task.worker_id, meta.nbytes, data)
                host.on_batch_made(idx, task, meta, nbytes)
                self._waits.on_batch(task)
                return data
            except GetTimeoutError:
                self._waits.after_slice(idx, task, deadline)  # torch's timeout error, or a stall warning
            except (RayActorError, ObjectLostError, ActorUnschedulableError, LaneLost) as e:
                host.recover(task.worker_id, e)
                task = self._sched.task_info[idx]
                if task.held:  # in_order=False picked a later batch of the worker: it waits its turn
                    raise TaskHeld from None
                deadline = self._waits.deadline()


def failure(error: Any) -> tuple[BaseException, str]:
    """(the user's exception, its traceback text in the worker) of a `BatchError` or a Ray `RayTaskError`."""
    if isinstance(error, BatchError):
        return error.error, error.traceback
    return error.cause, remote_traceback(error)
