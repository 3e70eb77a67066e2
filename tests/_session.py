"""Helpers over the suite's shared Ray session: bounded waits, counting raydl's worker actors, a fresh Python.

Every count asks the state API of *this* session's GCS (other Rays may run on the machine) and,
unless told otherwise, first releases the idle workers the warm pool keeps, so that a count is
of the workers loaders still hold.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import raydl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.2) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; its last value (never a hang)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def gcs_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def worker_actors(alive_only: bool = False, detail: bool = False) -> list:
    """raydl worker actors of this session (the state API's records)."""
    from ray.util.state import list_actors

    filters = [("class_name", "=", "Worker")] + ([("state", "=", "ALIVE")] if alive_only else [])
    return list_actors(address=gcs_address(), filters=filters, detail=detail, limit=10000,
                       raise_on_missing_output=False)


def alive_worker_actors(release_warm: bool = True) -> int:
    """How many raydl worker actors are alive (after releasing the warm pool's idle ones, by default)."""
    if release_warm:
        raydl.release_idle_workers()
    return len(worker_actors(alive_only=True))


def settled_alive_worker_actors(timeout_s: float = 20.0) -> int:
    """`alive_worker_actors()` once two reads 1 s apart agree (actors just killed still read ALIVE for a moment)."""
    deadline = time.monotonic() + timeout_s
    last = alive_worker_actors()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = alive_worker_actors()
        if now == last:
            return now
        last = now
    return last


def run_python(code: str, timeout_s: int = 180, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`code` in a new interpreter at the repository root, with no RAY_* variable of this process (no Ray to join)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
