"""What a loader's epoch looked like: per-worker figures, the loop's data stall, Ray metrics, a timeline.

NOTE [ raydl stats ]
The driver already sees every batch: when it was asked for, what its worker reported about
making it (`BatchMeta`: wall-clock start, seconds spent, CPU seconds, samples, bytes), and when
the training loop asked for it. A `StatsRecorder`, one per iterator, writes that down:
  * the stall: the time the loop spends inside `next()` (waiting for a batch, decoding it, and
    with pin_memory / ray_device waiting for the pin thread), per call, as a span;
  * per worker: a batch span (its own wall clock, from `BatchMeta`), seconds per batch, CPU
    seconds, bytes and samples; restarts, node and pid come from the worker pool;
  * with pinning, the pin thread's spans (pin, and the device copy with ray_device).
Per call that is two clock reads and a few list appends in the driver, and a `process_time()`
and a walk over the batch's top-level containers in the worker; benchmarks/README.md has the
measured cost (`ray_stats=False` turns it all off).
An epoch runs from `iter()` (the iterator's `_reset`) to the `next()` that raises StopIteration
(for an epoch still running, or left by `break`: to the last batch handed out). At its end:
  * the hint: if the loop waited more than HINT_WAIT_SHARE of the epoch after its first batch
    (whose wait includes the workers' start-up, which no loader setting shortens), one INFO line
    on the `raydl.stats` logger says what would help (`hint` in report.py); it reaches stderr
    with no logging configured, and `setLevel(logging.WARNING)` on that logger silences it;
  * figures are exported through `ray.util.metrics` (also every METRICS_FLUSH_S during an
    epoch): counters tagged with the loader's name (`ray_name`) and worker id, so the Ray
    dashboard and Prometheus show them beside Ray's own; the per-batch time histogram is
    observed by the workers (`observe_batch_time` in raydl/_measures.py), off the driver's
    critical path (benchmarks/README.md: a Ray histogram observation's cost).
`snapshot()` copies the figures into a plain `LoaderStats` (what `DataLoader.stats()` returns),
with the spans for `LoaderStats.timeline()`. Totals cover every epoch of one iterator, i.e. of
one set of persistent workers.
The recorder is sent events, as SPDL's pipeline hooks are, and never holds or reads its iterator:
the hooks above, `workers` (where the workers run and their restarts, sent whenever the pool may
have changed) and `watch` (the epoch's tasks in flight and its node cache, the figures only they
hold now, held weakly: they go with their iterator). A loader that keeps the last epoch's stats
thus never keeps its workers alive.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections import deque
from typing import Any, Callable, Optional

__all__ = ["LoaderStats", "WorkerStats", "StatsTotals", "StatsRecorder", "make_recorder", "batch_nbytes"]

from ..._measures import batch_nbytes
from .report import driver_metrics, hint, logger
from .snapshot import LoaderStats, StatsTotals, WorkerStats, _percentile

# How often (seconds) counters are pushed to Ray's metrics during an epoch (and at its end).
METRICS_FLUSH_S = 2.0
# Spans kept per track and epoch for the timeline; figures are exact beyond it.
MAX_SPANS = 200_000

# --------------------------------------------------------------------------- recording


class _WorkerAcc:
    """One worker's running figures: this epoch's, and totals."""

    __slots__ = (
        "times",
        "batches",
        "samples",
        "busy_s",
        "cpu_s",
        "bytes",
        "total_batches",
        "total_bytes",
        "total_busy_s",
        "total_cpu_s",
        "flushed",
    )

    def __init__(self) -> None:
        self.total_batches = 0
        self.total_bytes = 0
        self.total_busy_s = 0.0
        self.total_cpu_s = 0.0
        self.flushed = [0, 0, 0.0, 0.0, 0]  # batches, bytes, busy_s, cpu_s, restarts already exported
        self.new_epoch()

    def new_epoch(self) -> None:
        self.times: list[float] = []
        self.batches = 0
        self.samples = 0
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self.bytes = 0


class _NextCall:
    """Context manager around one `next()`: its span is the loop's wait (NOTE [ raydl stats ])."""

    __slots__ = ("_rec", "_t0")

    def __init__(self, rec: StatsRecorder) -> None:
        self._rec = rec

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        self._rec._next_done(self._t0, time.perf_counter(), kind)


class StatsRecorder:
    """Records one iterator's epochs from the events it sends (NOTE [ raydl stats ]); it holds no iterator."""

    enabled = True

    def __init__(self, name: str, threads_per_worker: int = 1, hint_given: Optional[list] = None) -> None:
        self.name = name
        # [bool], shared by the recorders of one loader's iterators: the stall hint comes once per loader
        self._hint_given = hint_given if hint_given is not None else [False]
        self._threads_per_worker = threads_per_worker
        self._pool_lists: Optional[tuple[list, list]] = None  # the pool's records and restarts as sent (`workers`)
        self._schedule: Optional[weakref.ref] = None  # the epoch's tasks in flight (`watch`)
        self._feed: Optional[weakref.ref] = None  # its node cache's feed (`watch`)
        self._lane_memory: Optional[weakref.ref] = None  # its local lanes' shared memory counts (`watch`)
        # perf_counter -> wall clock (time.time()), to put the driver's spans on the workers' clock
        self._wall_offset = time.time() - time.perf_counter()
        self._workers: dict[int, _WorkerAcc] = {}
        self._records: list = []
        self._restarts: list = []
        self._next_call = _NextCall(self)
        self._epoch = -1  # the iterator's `_reset` starts epoch 0
        self._finished = True
        self._pin_spans: list = []
        self._total = [0, 0, 0.0, 0.0]  # batches, samples, wall_s, wait_s of finished epochs
        self._flushed = [0, 0.0, 0]  # samples, wait_s, epochs already exported
        self._epochs_finished = 0
        self._next_flush = 0.0
        self._metrics: Optional[dict] = None
        self._cpus: Optional[tuple[float, float]] = None

    @property
    def _ray(self) -> Any:
        import ray  # not at construction: a cold start records its first batches before it imports Ray

        return ray

    # ------------------------------------------------------------------ hooks (hot path)

    def workers(self, records: list, restarts: list) -> None:
        """Where each worker runs (`WorkerRecord`s, None until it reports) and how often each was restarted: the
        pool's lists, sent whenever the pool may have changed; a snapshot copies them."""
        self._pool_lists = (records, restarts)

    def watch(self, schedule: Any, feed: Any = None, lane_memory: Any = None) -> None:
        """The epoch's tasks in flight (a `Schedule`: `task_info`), its node cache's feed (a `CacheFeed`, None
        without a cache) and its lanes' `LaneMemoryCounts` (None without lanes), sent once by a Ray iterator: what
        only they know now (batches in flight and the bytes made of them, the cache's figures, how replies came
        through the lanes' shared memory). Held weakly: they go with their iterator."""
        self._schedule = weakref.ref(schedule)
        self._feed = weakref.ref(feed) if feed is not None else None
        self._lane_memory = weakref.ref(lane_memory) if lane_memory is not None else None

    def next_call(self) -> _NextCall:
        """Wrap the body of `__next__` in this: its time is the loop's wait."""
        return self._next_call

    def batch_made(self, meta: Any, startup_pid: Optional[int] = None) -> None:
        """A batch's `BatchMeta` is in the driver (`on_batch_made`); signals carry samples == 0. `startup_pid`: a
        cold start's maker made it (its process id, 0 for the trainer's own): a track of its own, not a worker's."""
        if meta.samples == 0:
            return
        if startup_pid is not None:
            self._pending_samples.append(meta.samples)
            if len(self._startup_spans) < MAX_SPANS:
                self._startup_spans.append((meta.worker_id, startup_pid, meta.idx, meta.started_s, meta.fetch_s))
            return
        w = self._workers.get(meta.worker_id)
        if w is None:
            w = self._workers[meta.worker_id] = _WorkerAcc()
        w.times.append(meta.fetch_s)
        w.batches += 1
        w.samples += meta.samples
        w.busy_s += meta.fetch_s
        w.cpu_s += meta.cpu_s
        w.bytes += meta.nbytes
        self._pending_samples.append(meta.samples)
        if len(self._batch_spans) < MAX_SPANS:
            self._batch_spans.append((meta.worker_id, meta.idx, meta.started_s, meta.fetch_s))
        now = time.perf_counter()
        if now >= self._next_flush:
            self._flush_metrics(now)

    def timed_pin(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`fn` (the pin thread's pin / device copy), recording each call's span."""
        rec = self

        def timed(data: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(data)
            finally:
                spans = rec._pin_spans  # this epoch's list (begin_epoch starts a new one)
                if len(spans) < MAX_SPANS:
                    spans.append((t0, time.perf_counter()))

        return timed

    def waited(self, t0: float, t1: float) -> None:
        """The loop waited from `t0` to `t1` (perf_counter) in a `next()` that the next `next_call` does not cover."""
        if self._finished:
            return
        self._wait_s += t1 - t0
        if len(self._waits) < MAX_SPANS:
            self._waits.append((t0, t1))

    def _next_done(self, t0: float, t1: float, kind: Any) -> None:
        if self._finished:
            return
        self._wait_s += t1 - t0
        if len(self._waits) < MAX_SPANS:
            self._waits.append((t0, t1))
        if kind is None:
            if self._batches == 0:
                self._first_batch = (t1 - self._start_s, t1 - t0)
            self._batches += 1
            self._samples += self._pending_samples.popleft() if self._pending_samples else 0
            self._last_s = t1
        elif kind is StopIteration:
            self._last_s = t1
            self.end_epoch()

    # ------------------------------------------------------------------ epochs

    def begin_epoch(self) -> None:
        """An epoch starts (the iterator's `_reset`)."""
        if self._epoch >= 0 and not self._finished:
            self._add_to_totals()  # an epoch left by `break` still counts
        self._epoch += 1
        self._finished = False
        self._start_s = self._last_s = time.perf_counter()
        self._batches = 0
        self._samples = 0
        self._wait_s = 0.0
        self._first_batch = (0.0, 0.0)  # (seconds from iter() to the first batch, the wait of that next())
        self._pending_samples: deque = deque()
        self._waits: list = []
        self._batch_spans: list = []
        self._startup_spans: list = []
        self._pin_spans = []
        for w in self._workers.values():
            w.new_epoch()

    def end_epoch(self) -> None:
        """The epoch ended (StopIteration): totals, the hint, metrics."""
        if self._finished:
            return
        self._finished = True
        self._epochs_finished += 1
        self._add_to_totals()
        self._refresh_pool()
        stats = self.snapshot()
        try:
            if not self._hint_given[0]:
                self._hint_given[0] = hint(stats, self._threads_per_worker, self._cluster_cpus)
        except Exception as e:  # a hint must never break an epoch (e.g. Ray going away)
            logger.debug("raydl: no hint: %s", e)
        self._flush_metrics(time.perf_counter(), share=stats.wait_share)

    def _add_to_totals(self) -> None:
        self._total[0] += self._batches
        self._total[1] += self._samples
        self._total[2] += self._last_s - self._start_s
        self._total[3] += self._wait_s
        for w in self._workers.values():
            w.total_batches += w.batches
            w.total_bytes += w.bytes
            w.total_busy_s += w.busy_s
            w.total_cpu_s += w.cpu_s

    def _cluster_cpus(self) -> tuple[float, float]:
        """(total, unreserved) CPUs of the cluster, asked of Ray once per iterator (for the hint)."""
        if self._cpus is None:
            self._cpus = (
                self._ray.cluster_resources().get("CPU", 0.0),
                self._ray.available_resources().get("CPU", 0.0),
            )
        return self._cpus

    def _refresh_pool(self) -> None:
        """Copy where workers run and their restarts, as last sent (`workers`; none from a cold start's makers)."""
        if self._pool_lists is not None:
            self._records = list(self._pool_lists[0])
            self._restarts = list(self._pool_lists[1])

    def _watched(self) -> tuple[Any, Any]:
        """(the schedule, the feed) sent by `watch`, each None if not sent or gone with its iterator."""
        sched = self._schedule() if self._schedule is not None else None
        feed = self._feed() if self._feed is not None else None
        return sched, feed

    # ------------------------------------------------------------------ reading

    def snapshot(self) -> LoaderStats:
        """The figures now, as a plain `LoaderStats`."""
        self._refresh_pool()
        in_flight, held = self._live_figures()
        wall_s = self._last_s - self._start_s
        totals = self._total
        total = StatsTotals(
            epochs=self._epoch + 1,
            batches=totals[0] + (0 if self._finished else self._batches),
            samples=totals[1] + (0 if self._finished else self._samples),
            wall_s=totals[2] + (0.0 if self._finished else wall_s),
            wait_s=totals[3] + (0.0 if self._finished else self._wait_s),
        )
        ids = sorted(set(self._workers) | {i for i, r in enumerate(self._records) if r is not None})
        workers = []
        for wid in ids:
            w = self._workers.get(wid) or _WorkerAcc()
            rec = self._records[wid] if wid < len(self._records) else None
            times = sorted(w.times)
            workers.append(
                WorkerStats(
                    worker_id=wid,
                    node_ip=getattr(rec, "node_ip", ""),
                    node_id=getattr(rec, "node_id", ""),
                    pid=getattr(rec, "pid", 0),
                    batches=w.batches,
                    samples=w.samples,
                    median_s=_percentile(times, 50),
                    p95_s=_percentile(times, 95),
                    busy_s=w.busy_s,
                    cpu_s=w.cpu_s,
                    bytes=w.bytes,
                    restarts=self._restarts[wid] if wid < len(self._restarts) else 0,
                    total_batches=w.total_batches + (0 if self._finished else w.batches),
                    total_bytes=w.total_bytes + (0 if self._finished else w.bytes),
                    total_busy_s=w.total_busy_s + (0.0 if self._finished else w.busy_s),
                )
            )
        spans = {
            "start_wall_s": self._start_s + self._wall_offset,
            "end_wall_s": self._last_s + self._wall_offset,
            "batches": list(self._batch_spans),
            "startup": list(self._startup_spans),
            "waits": [(a + self._wall_offset, b + self._wall_offset) for a, b in self._waits],
            "pins": [(a + self._wall_offset, b + self._wall_offset) for a, b in self._pin_spans],
            "truncated": any(
                len(x) >= MAX_SPANS for x in (self._batch_spans, self._startup_spans, self._waits, self._pin_spans)
            ),
        }
        feed = self._watched()[1]
        if feed is not None:  # a streamed dataset: its node caches' fetches from storage (NOTE [ raydl node cache ])
            spans["cache"] = feed.fetch_spans(spans["start_wall_s"])
        return LoaderStats(
            name=self.name,
            epoch=self._epoch,
            finished=self._finished,
            batches=self._batches,
            samples=self._samples,
            wall_s=wall_s,
            wait_s=self._wait_s,
            workers=tuple(workers),
            batches_in_flight=in_flight,
            store_bytes_held=held,
            total=total,
            first_batch_s=self._first_batch[0],
            cache=self._cache_figures(sum(w.busy_s for w in workers)),
            lane_memory=self._lane_memory_figures(),
            _first_wait_s=self._first_batch[1],
            spans=spans,
        )

    def _cache_figures(self, busy_s: float) -> Optional[dict]:
        """The node cache's figures for a streamed dataset (NOTE [ raydl node cache ]), else None."""
        feed = self._watched()[1]
        return feed.stats(busy_s) if feed is not None else None

    def _lane_memory_figures(self) -> Optional[dict]:
        """How the local lanes' replies came through their shared memory (NOTE [ raydl lane memory ]), else None."""
        counts = self._lane_memory() if self._lane_memory is not None else None
        return counts.figures() if counts is not None else None

    def _live_figures(self) -> tuple[int, int]:
        """(batches in flight, object-store bytes of those already made), from the schedule sent by `watch`."""
        sched = self._watched()[0]
        if sched is None:
            return 0, 0
        calls = {id(t.call): t.call for t in sched.task_info.values() if t.call is not None}
        if not calls:
            return len(sched.task_info), 0
        ray = self._ray
        try:
            # a lane's call (NOTE [ raydl lane, driver ]) has no metas to peek at before it is read
            meta_refs = [c.meta_ref for c in calls.values() if c.meta_ref is not None]
            ready, _ = ray.wait(meta_refs, num_returns=len(meta_refs), timeout=0, fetch_local=False)
            made = dict(zip(ready, ray.get(ready, timeout=5))) if ready else {}
        except Exception:  # a dead worker's task: its figures are unknown, not an error here
            made = {}
        nbytes = 0
        for idx, t in list(sched.task_info.items()):  # a call's batches not handed out yet (NOTE [ raydl calls ])
            metas = made.get(t.call.meta_ref) if t.call is not None else None
            if metas is not None:
                nbytes += getattr(metas[t.call.idxs.index(idx)], "nbytes", 0)
        return len(sched.task_info), nbytes

    # ------------------------------------------------------------------ Ray metrics

    def _flush_metrics(self, now: float, share: Optional[float] = None) -> None:
        """Push what changed since the last flush to `ray.util.metrics` (NOTE [ raydl stats ])."""
        self._next_flush = now + METRICS_FLUSH_S
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():  # a cold start's first batches: their figures go out later
            return
        try:
            m = self._metrics or self._make_metrics()
            loader = {"loader": self.name}
            live = not self._finished  # a finished epoch is already in the totals
            for wid, w in self._workers.items():
                tags = {"loader": self.name, "worker": str(wid)}
                f = w.flushed
                restarts = self._restarts[wid] if wid < len(self._restarts) else 0
                cumulative = (
                    w.total_batches + (w.batches if live else 0),
                    w.total_bytes + (w.bytes if live else 0),
                    w.total_busy_s + (w.busy_s if live else 0.0),
                    w.total_cpu_s + (w.cpu_s if live else 0.0),
                    restarts,
                )
                for i, key in enumerate(("batches", "bytes", "busy", "cpu", "restarts")):
                    if cumulative[i] > f[i]:
                        m[key].inc(cumulative[i] - f[i], tags=tags)
                        f[i] = cumulative[i]
            samples = self._total[1] + (0 if self._finished else self._samples)
            wait_s = self._total[3] + (0.0 if self._finished else self._wait_s)
            if samples > self._flushed[0]:
                m["samples"].inc(samples - self._flushed[0], tags=loader)
                self._flushed[0] = samples
            if wait_s > self._flushed[1]:
                m["wait"].inc(wait_s - self._flushed[1], tags=loader)
                self._flushed[1] = wait_s
            if self._epochs_finished > self._flushed[2]:
                m["epochs"].inc(self._epochs_finished - self._flushed[2], tags=loader)
                self._flushed[2] = self._epochs_finished
            sched = self._watched()[0]
            m["in_flight"].set(len(sched.task_info) if sched is not None else 0, tags=loader)
            if share is not None:
                m["share"].observe(share, tags=loader)
        except Exception as e:  # metrics are best effort: a Ray without its metrics agent still loads data
            logger.debug("raydl: metrics not exported: %s", e)

    def _make_metrics(self) -> dict:
        self._metrics = driver_metrics()
        return self._metrics


class _Off:
    """The recorder of a loader with ray_stats=False: every hook does nothing."""

    enabled = False

    def __init__(self) -> None:
        import contextlib

        self._null = contextlib.nullcontext()

    def workers(self, records: list, restarts: list) -> None:
        pass

    def watch(self, schedule: Any, feed: Any = None, lane_memory: Any = None) -> None:
        pass

    def next_call(self) -> Any:
        return self._null

    def batch_made(self, meta: Any, startup_pid: Optional[int] = None) -> None:
        pass

    def waited(self, t0: float, t1: float) -> None:
        pass

    def timed_pin(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return fn

    def begin_epoch(self) -> None:
        pass

    def snapshot(self) -> None:
        return None


def make_recorder(
    name: Optional[str], threads_per_worker: int, hint_given: Optional[list] = None
) -> StatsRecorder | _Off:
    """An iterator's recorder: a `StatsRecorder` named `name`, or a no-op one for None (ray_stats=False)."""
    return StatsRecorder(name, threads_per_worker, hint_given) if name is not None else _Off()
