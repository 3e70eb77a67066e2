"""A process-wide pool of idle, already-started worker actors, so a new loader starts in milliseconds.

NOTE [ raydl warm pool ]
Starting a Ray actor that imports torch takes seconds; configuring a started one takes
milliseconds. When a loader's workers end cleanly (no task left on them), they are reset and
kept here, keyed by their exact actor options (and, for workers raydl placed itself, the node
they run on: NOTE [ raydl placement ]), instead of being killed; the next loader with
the same options takes them and configures them (new payload, seeds, worker_init_fn), so its
first batch does not wait for process start-up. Only workers that reserve no Ray resources (raydl's default, num_cpus=0) are kept: an idle
actor holding CPUs, GPUs or custom resources would starve other Ray work. Bounds:
  * at most MAX_IDLE_PER_KEY idle actors per option set (extra ones are killed at once);
  * an actor idle for longer than the idle timeout (RAYDL_IDLE_WORKER_TIMEOUT_S, default
    WARM_IDLE_TIMEOUT_S) is killed by a reaper thread, which exits when the pool is empty;
  * `raydl.release_idle_workers()` kills them all now, and so does interpreter exit;
  * a worker is handed out only once every task its last loader abandoned (an early `break`
    leaves prefetched ones) has finished: configure() must not queue behind a stuck sample.
    One still busy WARM_DRAIN_TIMEOUT_S after it was given back is killed;
  * a worker that failed, or one from another Ray session, is never reused.
Workers come back here from a finalizer too (an iterator garbage collected): the pool that gives
them is held by a `weakref.finalize`, so its actor handles stay reachable and are never
finalized with the iterator (NOTE [ raydl shutdown ] in driver/iter.py); a handle Python has
finalized no longer keeps its actor alive, and Ray kills it. Since a collection can start at
any allocation, also inside this pool's own critical sections, the lock is re-entrant and every
scan runs over a copy: a `give` from a finalizer in the middle of a `take` must not deadlock.
A warm actor that still turns out dead when a loader configures it is replaced by a new one,
and the tasks the loader queued on it follow (NOTE [ raydl recovery ]); that is no restart.
`ray_reuse_workers=False` on a loader opts out: its workers are always new processes and are
killed when it ends.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .._constants import WARM_DRAIN_TIMEOUT_S, WARM_IDLE_TIMEOUT_S, WARM_MAX_IDLE_PER_KEY
from .connect import ray_calls, ray_session

__all__ = ["WARM_POOL", "release_idle_workers", "warm_key"]

logger = logging.getLogger(__name__)


def warm_key(options: Mapping[str, Any], node_id: Optional[str] = None) -> str:
    """The key idle actors are kept under: their actor options, plus their node when raydl placed them (NOTE [ raydl placement ])."""
    key = repr(sorted(options.items(), key=lambda kv: kv[0]))
    return key if node_id is None else f"{key}@{node_id}"


def _idle_timeout_s() -> float:
    try:
        return float(os.environ.get("RAYDL_IDLE_WORKER_TIMEOUT_S", WARM_IDLE_TIMEOUT_S))
    except ValueError:
        return WARM_IDLE_TIMEOUT_S


def _kill(actor: Any) -> None:
    import ray

    with ray_calls() as session:
        if session is None:  # Ray shut down: its actors went with it (NOTE [ raydl no Ray behind the user's back ])
            return
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead
            pass


@dataclass
class _Idle:
    actor: Any
    since_s: float
    # tasks the last loader abandoned on it: the actor is handed out only once they finished
    pending: list

    def drained(self) -> bool:
        if self.pending:
            import ray

            with ray_calls() as session:
                if session is None:
                    # Ray shut down (or shutting down in another thread): no call (never auto-init), and the refs
                    # are not dropped here either: freeing one while Ray shuts down ends the process (NOTE [ raydl
                    # no Ray behind the user's back ]); the entry is forgotten with its session.
                    return False
                try:
                    _, self.pending = ray.wait(
                        self.pending, num_returns=len(self.pending), timeout=0, fetch_local=False
                    )
                except Exception:  # its tasks (and actor) are gone
                    self.pending = []
        return not self.pending


class WarmPool:
    """Idle worker actors by option key; see NOTE [ raydl warm pool ]."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: `give` may run from a finalizer inside a critical section
        self._idle: dict[str, list[_Idle]] = {}
        self._session: str | None = None
        self._reaper: threading.Thread | None = None
        self._wake = threading.Event()

    def take(self, key: str, n: int) -> list[Any]:
        """Up to `n` idle actors started with options `key` (fresher ones first)."""
        session = ray_session()
        now = time.monotonic()
        limit_s = _idle_timeout_s() * 0.8  # leave the reaper a margin: never hand out one it is killing
        with self._lock:
            if self._session != session:
                self._idle.clear()  # handles from another Ray session are meaningless here
                self._session = session
            idle = self._idle.get(key, [])
            taken = []
            for entry in reversed(list(idle)):  # freshest first
                if len(taken) == n:
                    break
                if now - entry.since_s >= limit_s:
                    idle.remove(entry)
                    _kill(entry.actor)
                elif entry.drained():
                    idle.remove(entry)
                    taken.append(entry.actor)
        if taken:
            logger.debug("raydl: took %d warm workers", len(taken))
        return taken

    def give(self, key: str, actors: list[tuple[Any, list]]) -> None:
        """Keep `(actor, unfinished abandoned refs)` pairs (reset queued) for later loaders; kill the surplus."""
        if not actors:
            return
        session = ray_session()
        if session is None:  # Ray was shut down: these actors died with it, and no call may start a new one
            with self._lock:
                self._idle.clear()
            return
        now = time.monotonic()
        surplus = []
        with self._lock:
            if self._session != session:
                self._idle.clear()
                self._session = session
            idle = self._idle.setdefault(key, [])
            for actor, pending in actors:
                if len(idle) < WARM_MAX_IDLE_PER_KEY:
                    idle.append(_Idle(actor, now, list(pending)))
                else:
                    surplus.append(actor)
            self._ensure_reaper()
        for actor in surplus:
            _kill(actor)

    def release_all(self) -> int:
        """Kill every idle actor now; returns how many. The reaper thread then exits."""
        with self._lock:
            entries = [e for idle in self._idle.values() for e in idle]
            self._idle.clear()
            reaper = self._reaper
        for entry in entries:
            _kill(entry.actor)
        self._wake.set()
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(timeout=5.0)
        return len(entries)

    def idle_count(self, key: str | None = None, ready: bool = False) -> int:
        """Idle actors kept, for one option key or (None) for all; with `ready`, only those a loader could
        take now (their last tasks finished)."""
        with self._lock:
            idles = [self._idle.get(key, [])] if key is not None else list(self._idle.values())
            return sum(1 for idle in idles for e in list(idle) if not ready or e.drained())

    def _ensure_reaper(self) -> None:
        # Called with the lock held.
        if self._reaper is None or not self._reaper.is_alive():
            self._wake.clear()
            self._reaper = threading.Thread(target=self._reap_loop, name="raydl_warm_reaper", daemon=True)
            self._reaper.start()

    def _reap_loop(self) -> None:
        while True:
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if ray_session() != self._session:
                # Ray was shut down (or restarted): the idle actors died with their session, so this thread
                # forgets them and ends without one Ray call (NOTE [ raydl no Ray behind the user's back ]).
                with self._lock:
                    self._idle.clear()
                    self._reaper = None
                return
            timeout_s = _idle_timeout_s()
            now = time.monotonic()
            expired = []
            with self._lock:
                for key in list(self._idle):
                    keep, gone = [], []
                    for e in list(self._idle[key]):
                        age_s = now - e.since_s
                        stuck = age_s >= WARM_DRAIN_TIMEOUT_S and not e.drained()
                        (gone if age_s >= timeout_s or stuck else keep).append(e)
                    expired += gone
                    # filtered again, not replaced by `keep`: a re-entrant `give` may have added one
                    keep = [e for e in self._idle[key] if not any(e is g for g in gone)]
                    if keep:
                        self._idle[key] = keep
                    else:
                        del self._idle[key]
                if not self._idle:
                    self._reaper = None
                    done = True
                else:
                    done = False
            for entry in expired:
                _kill(entry.actor)
            if expired:
                logger.debug("raydl: released %d idle warm workers", len(expired))
            if done:
                return


WARM_POOL = WarmPool()


def release_idle_workers() -> int:
    """Kill the idle worker actors raydl keeps warm for new loaders; returns how many were released.

    Idle workers also go by themselves after RAYDL_IDLE_WORKER_TIMEOUT_S seconds (default 120)
    and at interpreter exit. Loaders that are running are not affected.
    """
    return WARM_POOL.release_all()


@atexit.register
def _release_at_exit() -> None:
    try:
        WARM_POOL.release_all()
    except Exception:  # Ray may be gone already
        pass
