"""What raydl's stats tell the outside: the data-stall hint and Ray metrics (NOTE [ raydl stats ] in driver/stats/recorder.py).

The measures a worker takes itself (batch bytes, the batch-time histogram) live in raydl/_measures.py.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from .snapshot import LoaderStats

__all__ = ["hint", "driver_metrics", "logger"]

logger = logging.getLogger("raydl.stats")
# The hint is INFO: give this logger that level (a user's own setLevel overrides it).
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)

# An epoch whose loop waited longer than this share of its wall time gets a hint ...
HINT_WAIT_SHARE = 0.2
# ... if it was long enough to mean something (a half-second first epoch is mostly start-up), and no hint was
# given for this loader yet in this process (the recorder keeps that).
HINT_MIN_BATCHES = 100
HINT_MIN_EPOCH_S = 5.0

# A worker "stands out" when its median batch time exceeds the others' by this factor.
HINT_SLOW_WORKER_FACTOR = 1.5
# ... and by at least this many seconds per batch (1 ms vs 0.5 ms is noise, not a slow node).
HINT_SLOW_WORKER_MIN_S = 0.005
# Workers making batches for less than this share of the epoch are not what the loop waits for.
HINT_BUSY_SHARE = 0.3
# Workers whose CPU seconds are below this share of their batch time mostly wait (I/O, sleeps).
HINT_IO_CPU_SHARE = 0.5

_SHARE_BUCKETS = [0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 0.9]


# --------------------------------------------------------------------------- Ray metrics


_DRIVER_METRICS: Optional[dict] = None


def driver_metrics() -> dict:
    """The driver's Ray metrics, created once per process (Ray registers a metric by name)."""
    global _DRIVER_METRICS
    if _DRIVER_METRICS is None:
        from ray.util.metrics import Counter, Gauge, Histogram

        lw = ("loader", "worker")
        _DRIVER_METRICS = {
            "batches": Counter("raydl_batches", description="Batches made by a raydl worker.", tag_keys=lw),
            "bytes": Counter("raydl_batch_bytes", description="Bytes of the batches a raydl worker made.", tag_keys=lw),
            "busy": Counter(
                "raydl_worker_busy_seconds", description="Seconds a raydl worker spent making batches.", tag_keys=lw
            ),
            "cpu": Counter(
                "raydl_worker_cpu_seconds",
                description="CPU seconds of a raydl worker while making batches.",
                tag_keys=lw,
            ),
            "restarts": Counter(
                "raydl_worker_restarts", description="Replacements of a dead raydl worker.", tag_keys=lw
            ),
            "samples": Counter(
                "raydl_samples", description="Samples a raydl loader handed to the training loop.", tag_keys=("loader",)
            ),
            "wait": Counter(
                "raydl_wait_seconds",
                description="Seconds the training loop waited inside next() on a raydl loader (data stall).",
                tag_keys=("loader",),
            ),
            "epochs": Counter("raydl_epochs", description="Epochs a raydl loader finished.", tag_keys=("loader",)),
            "in_flight": Gauge(
                "raydl_batches_in_flight",
                description="Batches asked of raydl workers, not yet handed out.",
                tag_keys=("loader",),
            ),
            "share": Histogram(
                "raydl_epoch_wait_share",
                description="Share of an epoch the loop waited for data.",
                boundaries=_SHARE_BUCKETS,
                tag_keys=("loader",),
            ),
        }
    return _DRIVER_METRICS


# --------------------------------------------------------------------------- the hint


def hint(stats: LoaderStats, threads_per_worker: int, cluster_cpus: Callable[[], tuple[float, float]]) -> bool:
    """One INFO line when the loop waited > HINT_WAIT_SHARE of an epoch of at least HINT_MIN_BATCHES batches
    and HINT_MIN_EPOCH_S seconds, with what would help; returns whether it gave one.

    What helps depends on where the time goes. Workers busy for a small share of the epoch are
    not what the loop waits for (start-up of a worker, the transfer, this process's own load).
    Workers whose CPU time is a small share of their batch time wait on I/O: more threads per
    worker overlap those waits. Busy workers need more workers, which only helps if the cluster
    has CPUs they do not use already (`cluster_cpus()`: total and unreserved CPUs, asked of Ray
    only here). A worker much slower than the others is named: more workers will not fix a slow
    node.
    """
    share = stats.steady_wait_share  # start-up is not a data stall that more workers or threads would fix
    if share <= HINT_WAIT_SHARE or not stats.workers:
        return False
    if stats.batches < HINT_MIN_BATCHES or stats.wall_s < HINT_MIN_EPOCH_S:
        return False
    if not logger.isEnabledFor(logging.INFO):
        return False
    parts = [
        f"raydl loader {stats.name!r}: the training loop waited for data {share:.0%} of epoch {stats.epoch} "
        f"after its first batch ({stats.wait_s:.1f} s of {stats.wall_s:.1f} s in all)"
    ]
    busy = sum(w.busy_s for w in stats.workers)
    cpu = sum(w.cpu_s for w in stats.workers)
    n = len(stats.workers)
    utilization = busy / (n * stats.wall_s) if stats.wall_s > 0 else 0.0
    if utilization < HINT_BUSY_SHARE:
        parts.append(
            f"yet the workers were making batches only {utilization:.0%} of the epoch: the time goes elsewhere "
            "(a worker still starting, the transfer of batches to this process, or this process's own load)"
        )
    elif cpu < HINT_IO_CPU_SHARE * busy:
        parts.append(
            f"workers use the CPU {cpu / busy:.0%} of their batch time (they wait on I/O): "
            + (
                "ray_threads_per_worker=8 fetches a batch's samples on 8 threads"
                if threads_per_worker == 1
                else f"more threads per worker (ray_threads_per_worker={threads_per_worker} now) or more workers"
            )
        )
    else:
        total, free = cluster_cpus()
        if total > n + 1:
            parts.append(
                f"more workers would help: the cluster has {total:g} CPUs ({free:g} unreserved) for {n} workers "
                "and this process"
            )
        else:
            parts.append(
                f"the {n} workers are CPU-bound and the cluster's {total:g} CPUs are taken: add nodes (raydl "
                "workers go anywhere in the cluster) or make samples cheaper"
            )
    medians = sorted(((w.median_s, w) for w in stats.workers if w.batches), key=lambda x: x[0])
    if len(medians) >= 2:
        slow_s, slow = medians[-1]
        others = [m for m, _ in medians[:-1]]
        typical = others[len(others) // 2]
        if slow_s > HINT_SLOW_WORKER_FACTOR * typical and slow_s - typical >= HINT_SLOW_WORKER_MIN_S:
            parts.append(
                f"worker {slow.worker_id} (pid {slow.pid}, node {slow.node_ip}) is the slowest: "
                f"{slow_s * 1e3:.0f} ms per batch vs {typical * 1e3:.0f} ms for the others"
            )
    message = "; ".join(parts) + ". (Silence: logging.getLogger('raydl.stats').setLevel(logging.WARNING).)"
    if logger.hasHandlers():
        logger.info(message)
    else:  # no logging configured: Python would drop an INFO record
        print(message, file=sys.stderr)
    return True
