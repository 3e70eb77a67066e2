"""What a result depends on, and what else the machine did meanwhile.

`machine_info()` describes the machine, the versions and raydl's commit (`describe_machine()`
renders it as the report's first line); `LoadMonitor` measures the CPU other processes used during
a measurement and `QuietGate` waits (bounded) for a quiet moment before one;
`object_store_stats()` reads the node's object store.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from typing import Any, Callable, Iterable, Optional

import numpy as np
import psutil
import torch

from benchmarks.common import REPO

# A measurement during which processes other than ours used more than this many cores on
# average is flagged as disturbed (and retried where the benchmark supports it).
DISTURBED_FOREIGN_CORES = 0.25


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(ray_version: Optional[str] = None) -> dict:
    """What the results depend on. Pass `ray_version` to avoid importing Ray here (cold start-up is timed)."""
    if ray_version is None:
        import ray

        ray_version = ray.__version__
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "cpu_model": cpu_model(),
        "mem_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray_version,
        "numpy": np.__version__,
        "raydl_commit": _git_head(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _git_head() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", REPO, "status", "--porcelain", "raydl"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() + ("+dirty(raydl/)" if dirty.stdout.strip() else "")
    except Exception:
        return "unknown"


def describe_machine(info: dict) -> str:
    return (
        f"Machine: {info['cpu_count']} CPUs ({info['cpus_usable']} usable), {info['cpu_model']}, "
        f"{info['mem_gib']} GiB RAM; Python {info['python']}, torch {info['torch']}, ray {info['ray']}, "
        f"numpy {info['numpy']}; raydl at {info['raydl_commit']}; load average at start "
        f"{' / '.join(map(str, info['loadavg_at_start']))}"
    )


# --------------------------------------------------------------------------- load monitoring


def _tree_cpu_s(roots: Iterable[psutil.Process]) -> float:
    """CPU seconds of `roots` and all their descendants, reaped children included."""
    seen: set[int] = set()
    total = 0.0
    for root in roots:
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
    return total


def _system_busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


class LoadMonitor:
    """How much CPU processes *other than ours* used during a measurement (in cores, averaged).

    Ours = this process and its descendants (a local Ray started by the driver is a child of
    it), plus any extra roots (`extra_roots()` returns processes of a cluster started apart).
    """

    def __init__(self, extra_roots: Optional[Callable[[], list]] = None) -> None:
        self._extra_roots = extra_roots or (lambda: [])

    def _ours(self) -> float:
        roots = [psutil.Process()] + [psutil.Process(p) for p in self._extra_roots() if psutil.pid_exists(p)]
        return _tree_cpu_s(roots)

    def __enter__(self) -> "LoadMonitor":
        self._t0 = time.perf_counter()
        self._sys0 = _system_busy_s()
        self._ours0 = self._ours()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        sys_busy = _system_busy_s() - self._sys0
        ours = self._ours() - self._ours0
        self.wall_s = wall
        self.ours_cores = ours / wall
        self.foreign_cores = max(0.0, (sys_busy - ours) / wall)

    @property
    def disturbed(self) -> bool:
        return self.foreign_cores > DISTURBED_FOREIGN_CORES


class QuietGate:
    """Before a measurement, wait (bounded) for a 1 s window in which other processes used < threshold cores.

    The machine these benchmarks run on may be shared (other test runs). Waiting a little for a
    quiet moment costs less than a disturbed measurement; the wait is bounded per call
    (`max_wait_s`) and in total (`budget_s`), after which measurements proceed regardless (and
    their foreign load is reported).
    """

    def __init__(self, max_wait_s: float, budget_s: float, extra_roots: Optional[Callable[[], list]] = None) -> None:
        self.max_wait_s, self.budget_s = max_wait_s, budget_s
        self.extra_roots = extra_roots
        self.waited_s = 0.0
        self.gave_up = 0

    def wait(self) -> float:
        """Seconds waited; 0 if the machine was quiet at once (or the budget is spent)."""
        if self.max_wait_s <= 0 or self.waited_s >= self.budget_s:
            return 0.0
        t0 = time.perf_counter()
        while True:
            with LoadMonitor(self.extra_roots) as mon:
                time.sleep(0.5)
            waited = time.perf_counter() - t0
            if not mon.disturbed:
                break
            if waited >= self.max_wait_s or self.waited_s + waited >= self.budget_s:
                self.gave_up += 1
                break
        self.waited_s += waited
        return waited


# --------------------------------------------------------------------------- object store


def object_store_stats() -> dict:
    """Bytes and number of objects in the object store of the node this driver is on (Ray's internal API).

    `ray._private.internal_api.get_memory_info_reply` is what `ray memory --stats-only` reads;
    it needs no dashboard. Returns {} if this Ray has no such API.
    """
    import ray

    try:
        from ray._private import internal_api

        state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
        reply = internal_api.get_memory_info_reply(state)
        s = reply.store_stats
        return {"used_bytes": int(s.object_store_bytes_used), "num_objects": int(s.num_local_objects)}
    except Exception as e:  # private API: degrade to nothing rather than fail the run
        return {"error": f"{type(e).__name__}: {e}"}
