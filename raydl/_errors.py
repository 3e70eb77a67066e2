"""raydl's exception types, and how a worker's exception is re-raised in the driver.

NOTE [ raydl errors ]
A dataset, collate_fn or worker_init_fn exception escapes the actor method, so Ray carries it
to the driver as a `RayTaskError` holding the original exception (`.cause`) and the worker's
traceback. The driver re-raises it the way torch's `ExceptionWrapper.reraise` does: an
exception *of the same type* whose message says where it happened and carries the worker's
traceback, raised `from None` so the user reads their own code's traceback, not Ray's.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerDiedError", "WorkerPlacementError", "WorkerRecord"]


class WorkerDiedError(RuntimeError):
    """A raydl worker actor exited while the driver still needed it (its process died or its node left)."""


class WorkerStartDied(WorkerDiedError):
    """Internal: worker `worker_id`'s process died before it reported it had started.

    Tasks may already have been queued behind its start (a pool's first start), so the driver
    treats this as any other death of that worker (NOTE [ raydl recovery ] in driver/recovery.py).
    """

    def __init__(self, worker_id: int, message: str) -> None:
        super().__init__(message)
        self.worker_id = worker_id


class WorkerPlacementError(RuntimeError):
    """Ray could not place (or start) the worker actors within the startup timeout.

    `worker_ids`: the workers that were not placed (empty when unknown).
    """

    def __init__(self, message: str, worker_ids: tuple = ()) -> None:
        super().__init__(message)
        self.worker_ids = list(worker_ids)


@dataclass(frozen=True)
class WorkerRecord:
    """Where one worker actor runs, as reported by the actor itself once it is ready."""

    worker_id: int
    pid: int
    node_id: str
    node_ip: str

    def describe(self) -> str:
        """A short human-readable location, used in every error message."""
        return f"raydl worker {self.worker_id} (pid {self.pid}, node {self.node_ip} {self.node_id[:8]})"


class _KeyErrorMessage(str):
    """A str whose repr is itself, so a KeyError prints a multi-line message readably (as torch does)."""

    def __repr__(self) -> str:
        return str(self)


def format_exception_text(exc: BaseException) -> str:
    """The traceback text of `exc` as the worker saw it."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def rebuild_worker_exception(cause: BaseException, where: str, remote_traceback: str) -> BaseException:
    """An exception of `cause`'s type whose message names `where` and carries the worker's traceback.

    Falls back to RuntimeError when the type cannot be built from one message (as torch does).
    """
    exc_type = type(cause)
    msg = f"Caught {exc_type.__name__} {where}.\nOriginal {remote_traceback.rstrip()}"
    if exc_type is KeyError:
        msg = _KeyErrorMessage(msg)
    try:
        rebuilt = exc_type(msg)
    except Exception:
        return RuntimeError(msg)
    return rebuilt


TRACEBACK_ATTR = "__raydl_traceback__"


def annotate_traceback(exc: BaseException) -> None:
    """Attach the worker-side traceback text to `exc` (it travels with the exception's __dict__)."""
    try:
        setattr(exc, TRACEBACK_ATTR, format_exception_text(exc))
    except Exception:  # exceptions with __slots__ or read-only attributes
        pass


def remote_traceback(err: BaseException) -> str:
    """The worker-side traceback text of a RayTaskError's cause."""
    cause = getattr(err, "cause", None)
    tb = getattr(cause, TRACEBACK_ATTR, None)
    if tb:
        return tb
    text = str(err)
    # Ray's text starts with a header line of its own; the rest is the worker's traceback.
    body = text.split("\n", 1)[1] if "\n" in text else text
    return "Traceback (most recent call last):\n" + body


def short_indices(index: Any, limit: int = 8) -> str:
    """Indices for an error message, shortened for big batches."""
    if isinstance(index, (list, tuple)) and len(index) > limit:
        return f"[{', '.join(map(str, index[:limit]))}, ... ({len(index)} in all)]"
    return str(index)
