"""Who makes a cold start's first batches: a process forked from the trainer, or (opt-in) the trainer itself.

Both kinds answer the same calls for `ColdStartIter` (driver/coldstart/iter.py): `send` a task, `poll`
for its reply with a bound, `read` the next batch in the order sent. A forked one is worker
`i`'s first incarnation (NOTE [ raydl start-up process ] in worker/startup.py); an in-process one
(`ray_cold_start="in_process"`) makes each batch in the trainer when it is read, as a
`ShadowWorker` (driver/coldstart/shadow.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import traceback
from collections import deque
from typing import Any, Optional

from ..._errors import TRACEBACK_ATTR, rebuild_worker_exception
from ...worker.actor import BatchFailed, BatchMeta
from ...worker.lane import recv_reply
from ...worker.startup import StartSpec, serve_startup
from .shadow import ShadowWorker

__all__ = ["ForkedMaker", "InProcessMaker", "MakerDied"]

logger = logging.getLogger(__name__)

# How long a start-up process that was told to stop may take to exit before it is killed.
_STOP_WAIT_S = 2.0


class MakerDied(Exception):
    """A start-up process ended without answering (its pipe ended): a worker's death."""


class ForkedMaker:
    """Worker `worker_id`'s start-up process (NOTE [ raydl start-up process ]), forked at construction."""

    in_process = False

    def __init__(self, spec: StartSpec, worker_id: int, worker_state: Optional[dict]) -> None:
        ctx = multiprocessing.get_context("fork")  # as torch's workers on Linux: the trainer's memory, shared
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=serve_startup,
            args=(child, spec, worker_id, worker_state),
            name=f"raydl-start-up-{worker_id}",
            daemon=True,  # never outlives the trainer
        )
        t0 = time.perf_counter()
        self._proc.start()
        self.fork_s = time.perf_counter() - t0
        child.close()
        self.worker_id = worker_id
        self.pid: Optional[int] = self._proc.pid
        self.sent: deque = deque()  # idx of the tasks sent and not read, oldest first
        self.started: Optional[tuple] = None  # ("started", snapshot) once its start reply is read

    def describe(self) -> str:
        return f"raydl worker {self.worker_id}'s start-up process (pid {self.pid})"

    def send(self, epoch: int, idx: int, index: Any) -> None:
        self.sent.append(idx)
        try:
            self._conn.send((epoch, [(idx, index)]))
        except OSError:  # it died: its pipe's end shows at the read, where the task is made again
            pass

    def poll(self, timeout_s: Optional[float]) -> bool:
        """Whether a reply (or the pipe's end) is there, waiting at most `timeout_s` (None: as long as it takes)."""
        try:
            return self._conn.poll(timeout_s)
        except OSError:
            return True  # the read raises MakerDied

    def read(self) -> Optional[tuple[Any, BatchMeta]]:
        """The next reply: None for the start reply, else the oldest task's `(batch, meta)`; the batch is a
        `BatchFailed` where user code raised. Raises MakerDied, or worker_init_fn's error (torch's form)."""
        try:
            reply = recv_reply(self._conn)
        except (EOFError, OSError) as e:
            raise MakerDied(self._death(e)) from None
        if self.started is None:
            if reply[0] == "failed":
                _, error, tb = reply
                raise rebuild_worker_exception(error, f"in {self.describe()} while starting", tb)
            self.started = reply
            return None
        batches, metas = reply
        self.sent.popleft()
        return batches[0], metas[0]

    def _death(self, error: BaseException) -> str:
        self._proc.join(timeout=1.0)
        code = self._proc.exitcode
        how = f"exit code {code}" if code is not None and code >= 0 else f"signal {-code}" if code else str(error)
        return f"{self.describe()} exited unexpectedly ({how})"

    def stop(self) -> None:
        """Tell it to exit and reap it; killed if it is still busy with a batch after `_STOP_WAIT_S`."""
        busy = bool(self.sent)
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._conn.close()
        self._proc.join(timeout=0.05 if busy else _STOP_WAIT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=_STOP_WAIT_S)


class InProcessMaker:
    """Worker `worker_id`'s batches made in the trainer's process when read (`ray_cold_start="in_process"`)."""

    in_process = True
    fork_s = 0.0
    pid = None

    def __init__(self, spec: StartSpec, worker_id: int, worker_state: Optional[dict]) -> None:
        assert worker_state is None, "an in-process maker never dies, so it is never replaced"
        self.worker_id = worker_id
        self._spec = spec
        self._shadow: Optional[ShadowWorker] = None
        self.sent: deque = deque()  # (idx, index) of the tasks sent and not read, oldest first
        self.started: Optional[tuple] = None

    def describe(self) -> str:
        return f"raydl worker {self.worker_id}'s start-up maker in this process"

    def send(self, epoch: int, idx: int, index: Any) -> None:
        self.sent.append((idx, index))

    def poll(self, timeout_s: Optional[float]) -> bool:
        return True  # made when read: the trainer's own time

    def read(self) -> Optional[tuple[Any, BatchMeta]]:
        if self._shadow is None:
            p = self._spec.payload
            try:
                self._shadow = ShadowWorker(
                    self.worker_id,
                    self._spec.num_workers,
                    self._spec.base_seed,
                    p.dataset,
                    p.auto_collation,
                    p.collate_fn,
                    p.worker_init_fn,
                    p.threads_per_worker,
                )
            except Exception as e:
                raise rebuild_worker_exception(
                    e, f"in {self.describe()} while starting", traceback.format_exc()
                ) from None
            self.started = ("started", None)
            return None
        idx, index = self.sent.popleft()
        started_s, t0 = time.time(), time.perf_counter()
        try:
            return self._shadow.fetch(idx, index)
        except Exception as e:
            tb = getattr(e, TRACEBACK_ATTR, None) or traceback.format_exc()
            return BatchFailed(e, tb), BatchMeta(self.worker_id, idx, started_s, time.perf_counter() - t0)

    def stop(self) -> None:
        self.sent.clear()
        self._shadow = None
