"""A start-up process: worker `i`'s first incarnation, forked from the trainer while Ray starts.

NOTE [ raydl start-up process ]
On a cold start (NOTE [ raydl cold start ] in driver/coldstart/iter.py) the driver forks one process
per worker, as torch's DataLoader forks its workers, and each runs `serve_startup`: a plain
`Worker` (worker/actor.py), so it seeds itself, sets the worker info and runs `worker_init_fn`
exactly as the worker's actor does, and each batch comes back with the same `BatchMeta` (its
dataset's state, the generators that moved). When Ray's actors run, the driver hands each
worker's stream over to its actor from those metas: the actor starts as a resumed worker.
The process shares the trainer's memory copy-on-write (a shared Arrow table or NumPy array is
not copied), has its own interpreter state (what user code does to globals stays here), and its
death is a worker's death: the driver sees the pipe end and forks a replacement from the
worker's last reported state.

The protocol on the pipe (a `multiprocessing` connection, one per process):
  * the process first writes its start reply: `("started", snapshot)` or `("failed", error, traceback)`;
  * the driver writes calls, `(epoch, [(idx, work), ...])`, and the process answers each in
    order with `fetch_many`'s `(batches, metas)` through `send_reply` (large arrays out of band);
  * `None`, or the pipe's end (the trainer exited), ends the process.
SIGINT is ignored here: Ctrl-C reaches the whole process group, and the trainer decides.
Ray is never started or imported on purpose here (a batch pickle refuses is the one exception:
cloudpickle is Ray's).
"""

from __future__ import annotations

import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Optional

from .._errors import TRACEBACK_ATTR
from .actor import WorkerBody, WorkerPayload, _portable_error, _sendable_reply
from .lane import send_reply

__all__ = ["StartSpec", "serve_startup"]


@dataclass(frozen=True)
class StartSpec:
    """What every start-up process of one cold start is given (each also gets its worker id and, for a replacement,
    the worker's last state)."""

    payload: WorkerPayload
    num_workers: int
    base_seed: int
    epoch: int


def serve_startup(conn: Connection, spec: StartSpec, worker_id: int, worker_state: Optional[dict]) -> None:
    """The body of a start-up process (see the module's NOTE); returns when the driver is done with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = WorkerBody()
    worker.in_actor = False
    try:
        started = worker.configure(
            spec.payload, worker_id, spec.num_workers, spec.base_seed, worker_state, epoch=spec.epoch
        )
    except Exception as e:  # worker_init_fn (or a dataset's load_state_dict) raised: the driver raises it
        tb = getattr(e, TRACEBACK_ATTR, None) or traceback.format_exc()
        send_reply(conn, ("failed", _portable_error(e), tb))
        return
    send_reply(conn, ("started", started["state"]))
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        if call is None:
            return
        call_epoch, tasks = call
        try:
            send_reply(conn, worker._fetch_many(call_epoch, tasks), _sendable_reply)
        except (BrokenPipeError, ConnectionResetError):
            return
