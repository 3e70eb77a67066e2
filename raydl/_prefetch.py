"""Pulling batches made on other nodes to the driver's node before the caller asks for them.

NOTE [ raydl remote prefetch ]
A batch made by a worker on another node lives in that node's object store; `ray.get` in the
driver pulls it over the network only when called, i.e. after the caller's training step,
so the transfer would sit on the critical path. Ray starts a standing pull when
`ray.wait(fetch_local=True)` is called on an object that already exists (measured with Ray
2.60: a wait on a still-running task's ref with timeout=0 registers nothing). So a thread of
the driver watches the refs of remote batches with `ray.wait(fetch_local=False)` (ready
anywhere) and, the moment one exists, issues the zero-timeout `fetch_local=True` wait that
starts its transfer. Its only state is a set of refs; it never deserialises anything, holds
no batch, and releases its refs at `shutdown()` (bounded join), so it changes neither
ordering nor the number of batches in flight.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ._constants import PIN_THREAD_JOIN_TIMEOUT_S, PREFETCH_POLL_S

__all__ = ["RemotePrefetcher"]

logger = logging.getLogger(__name__)


class RemotePrefetcher:
    """A daemon thread that starts the transfer of each watched object once it exists."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[Any, None] = {}  # insertion-ordered set of refs
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raydl_prefetch", daemon=True)
        self._thread.start()

    def watch(self, refs: list) -> None:
        """Start the transfer of `refs` to this node as soon as each exists."""
        if not refs:
            return
        with self._lock:
            self._watched.update(dict.fromkeys(refs))
        self._wake.set()

    def forget(self, refs: list) -> None:
        """Stop watching `refs` (their batches were handed out or dropped)."""
        with self._lock:
            for ref in refs:
                self._watched.pop(ref, None)

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            with self._lock:
                refs = list(self._watched)
            if not refs:
                self._wake.wait(PREFETCH_POLL_S * 10)
                self._wake.clear()
                continue
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=PREFETCH_POLL_S, fetch_local=False)
                if ready:
                    ray.wait(ready, num_returns=len(ready), timeout=0, fetch_local=True)
            except Exception as e:  # Ray going away under us: prefetching is only an optimisation
                logger.debug("raydl: prefetch thread stops: %s", e)
                return
            self.forget(ready)

    def shutdown(self) -> None:
        """Stop the thread and drop every ref (bounded join); idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=PIN_THREAD_JOIN_TIMEOUT_S)
        with self._lock:
            self._watched.clear()
