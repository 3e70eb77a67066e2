"""What `loader.stats()` returns: the epoch's figures as frozen dataclasses, and how they print.

NOTE [ raydl stats ] in driver/stats/recorder.py says how they are measured; `StatsRecorder` there fills them
in at the end of an epoch (and on request mid-epoch). This module holds only the public snapshot:
`LoaderStats` (one epoch), `WorkerStats` (one worker's part), `StatsTotals` (over every epoch of
persistent workers), their text form and the percentile they use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["LoaderStats", "WorkerStats", "StatsTotals"]


@dataclass(frozen=True)
class WorkerStats:
    """One worker's figures for the epoch (times in seconds, sizes in bytes).

    `median_s` / `p95_s`: seconds per batch as the worker measured it (fetch, collate, encode);
    `busy_s`: their sum; `cpu_s`: CPU seconds of the worker process meanwhile (much lower than
    `busy_s` means the worker mostly waits: I/O, sleeps); `restarts`: replacements of this worker
    id since its iterator started (NOTE [ raydl recovery ]); `total_*`: over every epoch of the
    same persistent workers.
    """

    worker_id: int
    node_ip: str
    node_id: str
    pid: int
    batches: int
    samples: int
    median_s: float
    p95_s: float
    busy_s: float
    cpu_s: float
    bytes: int
    restarts: int
    total_batches: int
    total_bytes: int
    total_busy_s: float


@dataclass(frozen=True)
class StatsTotals:
    """Figures summed over every epoch of one iterator (one set of persistent workers)."""

    epochs: int  # epochs started
    batches: int
    samples: int
    wall_s: float
    wait_s: float

    @property
    def wait_share(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class LoaderStats:
    """A raydl loader's figures for its current (or last) epoch; returned by `DataLoader.stats()`.

    Attributes (seconds and bytes):
        name: the loader's name (`ray_name`; by default the dataset's class name).
        epoch: the epoch's number, counted from 0 over one set of (persistent) workers.
        finished: whether the epoch ran to its end (StopIteration).
        batches, samples: handed out to the training loop.
        wall_s: from `iter()` to the epoch's end (or to the last batch handed out).
        wait_s: time the loop spent inside `next()`: the data stall. `wait_share` = wait_s / wall_s.
        first_batch_s: from `iter()` to the first batch (worker start-up included; warm workers,
            persistent workers' later epochs: one batch's making). `steady_wait_share`: the wait
            share after the first batch, the figure the hint uses.
        workers: one `WorkerStats` per worker.
        batches_in_flight: batches asked of workers and not yet handed out (now; 0 once the
            iterator is gone).
        store_bytes_held: object-store bytes of the batches already made and waiting to be
            handed out (now). Batches handed out without pinning keep their object-store memory
            while the loop holds their tensors (NOTE [ raydl zero-copy ]); those are not counted.
        total: `StatsTotals` over every epoch of these workers.
        cache: for a dataset streamed through the node cache (`raydl.ParquetDataset`), that
            cache's figures for the epoch: `hits`, `misses`, `hit_rate` (units present when a
            worker asked), `bytes_fetched` from storage, `retries` (transient storage errors),
            `evictions`, `prefetch_depth` (units held ahead of the cursor, now), `bytes_held`,
            `peak_bytes` and `limit_bytes`, `wait_s` (workers' time waiting on storage) and
            `storage_wait_share` (its share of the workers' busy time), summed over the `nodes`
            whose caches serve this loader, `bytes_from_peers` (units other nodes' caches handed over:
            NOTE [ raydl cooperative caches ]), `bytes_served` (to them), `peer_fallbacks` (units read
            from storage when their owner could not give them), and `per_node` (node id -> that node's
            `hits`, `misses`, `bytes_fetched`, `fetches`, `adopted`, `bytes_from_peers`, `peer_fetches`,
            `bytes_served`, `peer_fallbacks`, `bytes_held`, `peak_bytes`); else None.
        lane_memory: for workers on the driver's node whose lanes have shared memory (NOTE [ raydl lane
            memory ]), since the iterator started (over every epoch of persistent workers):
            `replies_in_memory` (replies written where the trainer reads them), the replies to calls
            given slots that came over the socket instead, by why: `replies_did_not_fit` (larger than
            the slots: the memory grows), `replies_refused` (the plain pickler refused a batch: sent
            with cloudpickle, or as its error), `replies_failed` (writing into the memory failed: a bug,
            logged once by the worker); `calls_without_slots` (no free slots: the loop, the reorder
            buffer and the prefetch held them; their replies came over the socket), `calls_paused` (calls sent
            without slots because the worker's last replies could not use them: larger than the largest
            memory, or refused by the plain pickler), `regrown` (memories
            made larger for batches that outgrew their slots), `slot_bytes` (the largest slot made) and
            `mapped_bytes` (lane memory this process maps now: a memory replaced stays mapped while
            its batches are held); else None.
        spans: the timed spans the timeline draws, by kind (the workers' batches, start-up batches, the
            driver's waits and pin copies, cache fetches per node; at most 200,000 each, `truncated` says
            whether any was dropped).
    `str(stats)` is a compact table; `stats.timeline(path)` writes a Chrome trace (and a PNG).
    """

    name: str
    epoch: int
    finished: bool
    batches: int
    samples: int
    wall_s: float
    wait_s: float
    workers: tuple[WorkerStats, ...]
    batches_in_flight: int
    store_bytes_held: int
    total: StatsTotals
    first_batch_s: float = 0.0
    cache: Optional[dict] = None
    lane_memory: Optional[dict] = None
    _first_wait_s: float = field(default=0.0, repr=False)
    spans: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def wait_share(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steady_wait_share(self) -> float:
        """The wait share after the first batch: without the workers' start-up and the first batch's making."""
        wall_s = self.wall_s - self.first_batch_s
        if self.batches < 2 or wall_s <= 0:
            return 0.0
        return max(0.0, self.wait_s - self._first_wait_s) / wall_s

    def __str__(self) -> str:
        state = "finished" if self.finished else "running"
        lines = [
            f"raydl loader {self.name!r}, epoch {self.epoch} ({state}): {self.batches} batches, {self.samples} samples "
            f"in {self.wall_s:.2f} s; the loop waited for data {self.wait_s:.2f} s ({self.wait_share:.1%}; "
            f"{self.steady_wait_share:.1%} after the first batch, which came after {self.first_batch_s:.2f} s)",
            f"in flight: {self.batches_in_flight} batches, {_fmt_bytes(self.store_bytes_held)} waiting in the object store",
        ]
        header = ["worker", "node", "pid", "batches", "median ms", "p95 ms", "busy s", "cpu %", "bytes", "restarts"]
        rows = [
            [
                str(w.worker_id),
                w.node_ip or "?",
                str(w.pid or "?"),
                str(w.batches),
                f"{w.median_s * 1e3:.1f}",
                f"{w.p95_s * 1e3:.1f}",
                f"{w.busy_s:.2f}",
                f"{100 * w.cpu_s / w.busy_s:.0f}" if w.busy_s > 0 else "-",
                _fmt_bytes(w.bytes),
                str(w.restarts),
            ]
            for w in self.workers
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, *rows]:
            lines.append("  ".join(c.rjust(wd) if i else c.ljust(wd) for i, (c, wd) in enumerate(zip(r, widths))))
        c = self.cache
        if c:
            lines.append(
                f"node cache: {c['hits']} hits, {c['misses']} misses ({c['hit_rate']:.0%}), "
                f"{_fmt_bytes(c['bytes_fetched'])} fetched"
                + (
                    f", {_fmt_bytes(c['bytes_from_peers'])} from other nodes' caches"
                    if c.get("bytes_from_peers")
                    else ""
                )
                + f", {c['retries']} retries, prefetch depth "
                f"{c['prefetch_depth']} units, {_fmt_bytes(c['bytes_held'])} held (peak {_fmt_bytes(c['peak_bytes'])}, "
                f"limit {_fmt_bytes(c['limit_bytes'])}), workers waited on storage {c['storage_wait_share']:.1%} of their time"
            )
        m = self.lane_memory
        if m:
            lines.append(
                f"lane memory: {m['replies_in_memory']} replies through it, over the socket "
                f"{m['replies_did_not_fit']} that did not fit, {m['replies_refused']} refused by pickle, "
                f"{m['replies_failed']} failed, {m['calls_without_slots']} with no free slot, {m['calls_paused']} paused; regrown "
                f"{m['regrown']} times, slots of {_fmt_bytes(m['slot_bytes'])}, {_fmt_bytes(m['mapped_bytes'])} mapped"
            )
        t = self.total
        lines.append(
            f"total over {t.epochs} epoch(s): {t.batches} batches, {t.samples} samples in {t.wall_s:.2f} s; "
            f"waited {t.wait_s:.2f} s ({t.wait_share:.1%})"
        )
        return "\n".join(lines)

    def timeline(self, path: str) -> list[str]:
        """Write the epoch as a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing).

        One track per worker (its batch spans, on its own clock), one for the loop's waits inside
        `next()`, one for pinning / device copies, and for a dataset streamed through the node cache
        (`raydl.ParquetDataset`) one per node cache: its fetches from storage, each named by its unit. With matplotlib installed, also a Gantt chart
        of the same next to it (`path` with `.png` in place of `.json`, or `.png` appended).

        Returns:
            the paths written.
        """
        from .timeline import write_png, write_trace

        written = [write_trace(self, path)]
        png = write_png(self, path[:-5] + ".png" if path.endswith(".json") else path + ".png")
        if png is not None:
            written.append(png)
        return written


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _percentile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (0 for an empty one)."""
    if not sorted_xs:
        return 0.0
    k = max(0, min(len(sorted_xs) - 1, math.ceil(q / 100 * len(sorted_xs)) - 1))
    return sorted_xs[k]
