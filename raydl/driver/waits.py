"""Bounded waits on batches: torch's `timeout`, and a warning instead of a silent hang when there is none.

NOTE [ raydl waits ]
The driver never blocks on Ray for longer than STATUS_CHECK_INTERVAL_S at a time (driver/iter.py
waits in slices), so between slices it can decide:
  * with `timeout > 0` (torch's meaning: the bound on collecting one batch), raise torch's
    `RuntimeError("DataLoader timed out after N seconds")`, naming the batch, its indices and the
    worker making it; the task stays in place, so a caller that catches the error waits for the
    same batch on its next `next()`;
  * with `timeout=0` (wait forever, torch's default), warn once per batch that has been
    outstanding STALL_FACTOR times longer than batches typically take (at least STALL_WARN_MIN_S):
    a hung read or a deadlock in the dataset shows up in the log instead of as a silent hang.
A batch's latency counts from when it was sent, or from when the workers last became ready if that
is later (a worker's start-up is not a slow batch).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Optional

from .. import _constants
from .._errors import short_indices

__all__ = ["BatchWaits"]


class BatchWaits:
    """The timeout and stall rules of one iterator (NOTE [ raydl waits ]); `describe(worker_id)` names a worker."""

    def __init__(self, timeout_s: float, describe: Callable[[int], str]) -> None:
        self.timeout_s = timeout_s
        self._describe = describe
        self._typical_s: Optional[float] = None  # moving average of batch latency
        self._ready_at_s = 0.0  # when the workers last became ready: latencies start no earlier
        self._reported: set[int] = set()  # task idxs already reported as stalled

    def new_epoch(self) -> None:
        self._reported = set()

    def workers_ready(self) -> None:
        self._ready_at_s = time.monotonic()

    def deadline(self) -> Optional[float]:
        """When a wait that starts now must end (None: never, timeout=0)."""
        return time.monotonic() + self.timeout_s if self.timeout_s > 0 else None

    def _waited_s(self, task: Any) -> float:
        return time.monotonic() - max(task.sent_s, self._ready_at_s)

    def on_batch(self, task: Any) -> None:
        """Task `task`'s batch is in hand: its latency enters the typical one."""
        latency_s = self._waited_s(task)
        self._typical_s = latency_s if self._typical_s is None else 0.8 * self._typical_s + 0.2 * latency_s

    def raise_timeout(self, idx: int, task: Optional[Any]) -> None:
        """torch's timeout error, naming the batch waited for and its worker."""
        where = ""
        if task is not None:
            where = (
                f" (waiting for batch {idx}, indices {short_indices(task.index)}, "
                f"from {self._describe(task.worker_id)})"
            )
        raise RuntimeError(f"DataLoader timed out after {self.timeout_s} seconds{where}")

    def after_slice(self, idx: int, task: Any, deadline: Optional[float]) -> None:
        """A slice of the wait for task `idx` ended without its batch: raise torch's timeout error once the deadline
        passed; with no timeout, report (once) a batch outstanding far longer than its peers."""
        if deadline is not None:
            if time.monotonic() >= deadline:
                self.raise_timeout(idx, task)
            return
        waited_s = self._waited_s(task)
        typical_s = self._typical_s or 0.0
        if idx in self._reported or waited_s < max(_constants.STALL_WARN_MIN_S, _constants.STALL_FACTOR * typical_s):
            return
        self._reported.add(idx)
        warnings.warn(
            f"raydl: batch {idx} (indices {short_indices(task.index)}) has been outstanding for {waited_s:.0f} s on "
            f"{self._describe(task.worker_id)}; batches typically take {typical_s:.2f} s. The dataset may "
            "be stuck there (a hung read, a deadlock). Pass timeout=<seconds> to make this an error.",
            RuntimeWarning,
            stacklevel=4,
        )
