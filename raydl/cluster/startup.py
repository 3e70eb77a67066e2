"""`raydl.start()`: bring Ray and idle workers up in the background, while the script builds its model.

NOTE [ raydl early start ]
The first loader of a process pays for Ray's start (seconds: GCS, raylet, agents) and for its
workers' start (a Python process each, importing torch). Both can overlap work the script does
anyway before its first batch (building the model, loading a checkpoint). `raydl.start(num_workers)`,
called early, returns at once and runs in a background thread:
  1. connect to (or start) Ray, with the same precedence and loopback guarantee as a loader's
     first iteration (`ensure_ray_initialized`);
  2. create `num_workers` blank worker actors with the options a loader with the same
     `ray_remote_args` would use, and put them in the warm pool (NOTE [ raydl warm pool ]).
The next loader with those options takes them (and configures them with its dataset) instead of
starting processes. A loader's first iteration waits (bounded) for a start in progress to hand
its workers over, so a loader created meanwhile never starts a second set.
Calls are idempotent: `start(n)` tops the idle workers with those options up to `n`, so calling
it again starts nothing (`start(4)` after `start(2)` starts two more). Only workers that
reserve no Ray resources can wait idle (the warm pool's rule), so `ray_remote_args` asking for
CPUs, GPUs, memory or custom resources is refused. Started workers are idle warm workers: they
are released after RAYDL_IDLE_WORKER_TIMEOUT_S seconds unused (120), at exit, or by
`raydl.release_idle_workers()`. Nothing happens at import or at loader construction: only this
explicit call starts anything early.
The work runs in one daemon thread per process that never exits, even when idle: Ray ties the
processes of a local Ray to the driver with Linux's parent-death signal, which fires when the
*thread* that spawned them ends, so a short-lived thread that started Ray would take Ray's GCS
and raylet down with it (measured: they die when such a thread returns).
Ray's start draws from Python's global `random` (a free port, ids), which every thread shares:
while a start runs, this thread draws from a generator of its own, so the script's stream (and
a worker's stream that a cold start makes live in the driver) loses no draw to it
(NOTE [ raydl random and threads ] in raydl/_thread_random.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Mapping, Optional

from .._constants import DEFAULT_STARTUP_TIMEOUT_S, WARM_MAX_IDLE_PER_KEY
from .._thread_random import diverted

__all__ = ["start", "Startup", "wait_for_early_start", "starts_in_progress"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_in_progress: list["Startup"] = []
_jobs: "queue.SimpleQueue[Startup]" = queue.SimpleQueue()
_runner: Optional[threading.Thread] = None


def _warm_key(options: Mapping[str, Any], node_id: Optional[str] = None) -> str:
    """The warm pool's key for a set of actor options (the one WorkerPool uses), per node when raydl places them."""
    from .warm import warm_key

    return warm_key(options, node_id)


class Startup:
    """A background start by `raydl.start()`; `wait()` blocks until its workers are running."""

    def __init__(self, num_workers: int, address: Optional[str], options: dict) -> None:
        self.num_workers = num_workers
        self._address = address
        self._options = options
        self._handed_over = threading.Event()  # Ray is up and the actors are in the warm pool
        self._ready_refs: list[Any] = []
        self._running = False  # every started worker was seen running (`running_now`)
        self._error: Optional[BaseException] = None
        self.started = 0  # actors this call created (the rest existed from earlier calls)

    def _run(self) -> None:
        with diverted():  # NOTE [ raydl random and threads ]
            self._start()

    def _start(self) -> None:
        try:
            from .connect import ensure_ray_initialized
            from .pool import _worker_actor_class
            from .warm import WARM_POOL

            t0 = time.monotonic()
            ensure_ray_initialized(self._address)
            logger.debug("raydl.start: Ray up after %.2f s", time.monotonic() - t0)
            import ray

            from .placement import Placement, worker_placement

            # Where a loader with these options would put its workers (NOTE [ raydl placement ]): the
            # warm pool hands a placed worker only to a loader whose plan wants it on that node.
            placement = worker_placement(self._options, ray.get_runtime_context().get_node_id())
            plan = placement.plan(self.num_workers) if placement is not None else [None] * self.num_workers
            actors = []
            with _lock:  # count and top up atomically: two calls never both start the missing ones
                for node_id in dict.fromkeys(plan):
                    key = _warm_key(self._options, node_id)
                    missing = max(0, plan.count(node_id) - WARM_POOL.idle_count(key))
                    options = (
                        self._options
                        if node_id is None
                        else {**self._options, "scheduling_strategy": Placement.strategy(node_id)}
                    )
                    cls = _worker_actor_class().options(**options)
                    new = [cls.remote() for _ in range(missing)]  # non-blocking
                    # Handed over with nothing pending, so the next loader takes them even while they start.
                    WARM_POOL.give(key, [(a, []) for a in new])
                    actors += new
            self.started = len(actors)
            # Ray's own readiness probe: resolves once the actor's constructor ran (torch imported).
            self._ready_refs = [a.__ray_ready__.remote() for a in actors]
            logger.debug("raydl.start: %d workers starting (%d asked)", self.started, self.num_workers)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait(); a loader then reports its own
            self._error = e
        finally:
            self._handed_over.set()
            with _lock:
                if self in _in_progress:
                    _in_progress.remove(self)

    def done(self) -> bool:
        """Whether Ray is up and the workers have been requested (they may still be starting)."""
        return self._handed_over.is_set()

    def running_now(self) -> bool:
        """Without blocking: whether Ray is up and every started worker runs (or the start failed: `wait()` raises)."""
        if not self._handed_over.is_set():
            return False
        if self._error is None and self._ready_refs and not self._running:
            import ray

            refs = self._ready_refs
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            self._running = len(ready) == len(refs)
            return self._running
        return True

    def wait(self, timeout_s: Optional[float] = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        """Block until Ray is up and every started worker runs (its process imported torch).

        Args:
            timeout_s (float, optional): seconds to wait at most; ``None`` waits forever.
                Defaults to ``60.0``.

        Raises:
            TimeoutError: not ready within `timeout_s`.
            ConnectionError: Ray could not be reached or started (the error of the start).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._handed_over.wait(timeout_s):
            raise TimeoutError(f"raydl.start(): Ray was not up within {timeout_s} s")
        if self._error is not None:
            raise self._error
        if self._ready_refs:
            import ray

            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            _, pending = ray.wait(self._ready_refs, num_returns=len(self._ready_refs), timeout=left)
            if pending:
                raise TimeoutError(
                    f"raydl.start(): {len(pending)} of {self.started} workers not running within {timeout_s} s"
                )
            ray.get(self._ready_refs)


def start(
    num_workers: int = 0,
    *,
    ray_address: Optional[str] = None,
    ray_remote_args: Optional[Mapping[str, Any]] = None,
) -> Startup:
    """Start Ray and `num_workers` idle workers in the background, for the loaders this script makes next.

    Call it early (before building the model): it returns at once, and the first loader with
    the same `num_workers` and `ray_remote_args` then finds Ray up and its workers started,
    instead of waiting seconds for both. Same connection rules as a loader (`ray_address` >
    `RAY_ADDRESS` > the Ray this process runs > a local Ray on loopback). Idempotent.

    Example:
        >>> import raydl
        >>> startup = raydl.start(num_workers=1)  # returns at once
        >>> # ... build the model: Ray and the worker come up meanwhile ...
        >>> startup.wait(timeout_s=60)
        >>> loader = raydl.DataLoader(range(8), batch_size=4, num_workers=1)  # takes the started worker
        >>> [batch.tolist() for batch in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7]]

    Args:
        num_workers (int): workers to start, as the loader's `num_workers`; ``0`` only starts
            Ray. At most 16 (the warm pool's bound per option set). Defaults to ``0``.
        ray_address (str, optional): as the loader's `ray_address`. Defaults to ``None``.
        ray_remote_args (dict, optional): as the loader's; workers are shared only with loaders
            whose options are the same. They must reserve no Ray resources (idle workers holding
            CPUs or GPUs would starve other work). Defaults to ``None`` (raydl's defaults).

    Returns:
        Startup: `wait(timeout_s)` blocks until Ray and the workers run (and raises the start's
        error); `done()` says whether Ray is up and the workers were requested.

    Raises:
        ValueError: `num_workers` is not an int in [0, 16], or `ray_remote_args` reserves resources.
    """
    from .._options import RayOptions
    from .connect import resource_request, worker_actor_options

    if (
        isinstance(num_workers, bool)
        or not isinstance(num_workers, int)
        or not 0 <= num_workers <= WARM_MAX_IDLE_PER_KEY
    ):
        raise ValueError(
            f"raydl.start(): num_workers should be an int between 0 and {WARM_MAX_IDLE_PER_KEY} "
            f"(the most idle workers kept per option set), got {num_workers!r}"
        )
    validated = RayOptions(address=ray_address, remote_args=ray_remote_args)  # the loader's own checks
    options = worker_actor_options(validated.remote_args)
    reserved = resource_request(options)
    if reserved and num_workers:
        raise ValueError(
            f"raydl.start(): ray_remote_args reserve {reserved}: only workers that reserve no Ray resources "
            "can wait idle for a loader. Fix: drop num_cpus/num_gpus/memory/resources from ray_remote_args "
            "for start(), or call start(num_workers=0) to start only Ray."
        )
    startup = Startup(num_workers, validated.address, options)
    global _runner
    with _lock:
        _in_progress.append(startup)
        if _runner is None:
            _runner = threading.Thread(target=_run_forever, name="raydl_start", daemon=True)
            _runner.start()
    _jobs.put(startup)
    return startup


class _NotMainThreadNotice(logging.Filter):
    """Drops Ray's notice that a driver started off the main thread sets no SIGTERM handler (expected here)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.threadName == "raydl_start" and "SIGTERM handler is not set" in record.getMessage())


def _run_forever() -> None:
    """The one thread that runs every start(), and then stays: see NOTE [ raydl early start ] on why it never exits."""
    logging.getLogger("ray._private.worker").addFilter(_NotMainThreadNotice())
    while True:
        _jobs.get()._run()


def starts_in_progress() -> list[Startup]:
    """The `start()` calls whose Ray or workers are not handed over yet."""
    with _lock:
        return list(_in_progress)


def wait_for_early_start(timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
    """Called by a loader's first iteration: let a `start()` in progress hand its workers over first (bounded)."""
    with _lock:
        pending = list(_in_progress)
    deadline = time.monotonic() + timeout_s
    for startup in pending:
        startup._handed_over.wait(max(0.0, deadline - time.monotonic()))
