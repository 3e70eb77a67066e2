"""A picture of one epoch: `LoaderStats.timeline()` as a Chrome trace and a Gantt chart.

The trace uses Chrome's Trace Event Format (JSON object form, "X" complete events with
microsecond timestamps, "M" metadata events naming each track), which Perfetto
(https://ui.perfetto.dev) and chrome://tracing open. Tracks, in one trace process named after
the loader:
  * tid 1, "training loop: waiting in next()": the loop's waits (the data stall);
  * tid 2, "pin / device copy": the pin thread's work (only with pin_memory or ray_device);
  * tid 3 + n, "node cache (node)": for a dataset streamed through the node cache
    (`raydl.ParquetDataset`), each fetch of a unit from storage by that node's cache, named by the
    unit's key (a failed fetch says so);
  * tid 10 + w, "worker w (pid, node)": worker w's batch spans, named by task idx;
  * tid 100000 + n, "start-up process for worker w (pid)": on a cold start, the batches a
    process forked from the trainer made as worker w while Ray started (NOTE [ raydl cold start ]),
    one track per such process ("... in this process" for ray_cold_start="in_process").
Times are seconds since the epoch's start. Worker spans are on the worker's own wall clock
(`BatchMeta.started_s`), driver spans on the driver's: on one machine they share a clock; across
nodes they are as aligned as the nodes' clocks (NTP: typically within milliseconds).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .snapshot import LoaderStats

__all__ = ["write_trace", "write_png"]

_LOOP_TID, _PIN_TID, _CACHE_TID0, _WORKER_TID0, _STARTUP_TID0 = 1, 2, 3, 10, 100_000


def _startup_tracks(stats: LoaderStats) -> list[tuple[str, list]]:
    """(label, [(idx, start, dur)]) per start-up maker that made batches this epoch, by worker id then pid."""
    tracks: dict[tuple[int, int], list] = {}
    for wid, pid, idx, start, dur in stats.spans.get("startup") or []:
        tracks.setdefault((wid, pid), []).append((idx, start, dur))
    return [
        (
            f"start-up process for worker {wid} (pid {pid})"
            if pid
            else f"start-up maker for worker {wid} (this process)",
            spans,
        )
        for (wid, pid), spans in sorted(tracks.items())
    ]


def _cache_tracks(stats: LoaderStats) -> list[tuple[str, list]]:
    """(label, [(start, end, key, nbytes, error)]) per node cache that fetched during the epoch."""
    by_node = stats.spans.get("cache") or {}
    return [(f"node cache ({node[:8]}): fetches", spans) for node, spans in sorted(by_node.items()) if spans]


def _worker_label(stats: LoaderStats, wid: int) -> str:
    for w in stats.workers:
        if w.worker_id == wid and w.pid:
            return f"worker {wid} (pid {w.pid}, {w.node_ip})"
    return f"worker {wid}"


def trace_events(stats: LoaderStats) -> list[dict]:
    """The epoch's events in Chrome's Trace Event Format."""
    sp = stats.spans
    t0 = sp["start_wall_s"]
    us = lambda t: round((t - t0) * 1e6, 1)  # noqa: E731
    pid = 1
    events: list[dict] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": pid,
            "args": {"name": f"raydl loader {stats.name!r}, epoch {stats.epoch}"},
        },
        {
            "ph": "M",
            "name": "thread_name",
            "pid": pid,
            "tid": _LOOP_TID,
            "args": {"name": "training loop: waiting in next()"},
        },
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": _LOOP_TID, "args": {"sort_index": 0}},
    ]
    for a, b in sp["waits"]:
        events.append(
            {
                "ph": "X",
                "name": "wait",
                "cat": "loop",
                "pid": pid,
                "tid": _LOOP_TID,
                "ts": us(a),
                "dur": round((b - a) * 1e6, 1),
            }
        )
    if sp["pins"]:
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": _PIN_TID, "args": {"name": "pin / device copy"}}
        )
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": _PIN_TID, "args": {"sort_index": 1}})
        for a, b in sp["pins"]:
            events.append(
                {
                    "ph": "X",
                    "name": "pin",
                    "cat": "pin",
                    "pid": pid,
                    "tid": _PIN_TID,
                    "ts": us(a),
                    "dur": round((b - a) * 1e6, 1),
                }
            )
    for n, (label, spans) in enumerate(_cache_tracks(stats)[: _WORKER_TID0 - _CACHE_TID0]):
        tid = _CACHE_TID0 + n
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": 2 + n}})
        for a, b, key, nbytes, error in spans:
            events.append(
                {
                    "ph": "X",
                    "name": key if error is None else f"{key} (failed)",
                    "cat": "cache",
                    "pid": pid,
                    "tid": tid,
                    "ts": us(a),
                    "dur": round((b - a) * 1e6, 1),
                    "args": {"bytes": nbytes, "error": error},
                }
            )
    worker_ids = sorted({w.worker_id for w in stats.workers} | {s[0] for s in sp["batches"]})
    for wid in worker_ids:
        tid = _WORKER_TID0 + wid
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": _worker_label(stats, wid)}}
        )
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": 10 + wid}}
        )
    for n, (label, spans) in enumerate(_startup_tracks(stats)):
        tid = _STARTUP_TID0 + n
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for idx, start, dur in spans:
            events.append(
                {
                    "ph": "X",
                    "name": f"batch {idx}",
                    "cat": "start-up",
                    "pid": pid,
                    "tid": tid,
                    "ts": us(start),
                    "dur": round(dur * 1e6, 1),
                    "args": {"idx": idx},
                }
            )
    for wid, idx, start, dur in sp["batches"]:
        events.append(
            {
                "ph": "X",
                "name": f"batch {idx}",
                "cat": "worker",
                "pid": pid,
                "tid": _WORKER_TID0 + wid,
                "ts": us(start),
                "dur": round(dur * 1e6, 1),
                "args": {"idx": idx},
            }
        )
    return events


def write_trace(stats: LoaderStats, path: str) -> str:
    """Write the Chrome trace JSON to `path`; returns `path`."""
    doc = {
        "traceEvents": trace_events(stats),
        "displayTimeUnit": "ms",
        "otherData": {
            "loader": stats.name,
            "epoch": stats.epoch,
            "wall_s": stats.wall_s,
            "wait_s": stats.wait_s,
            "wait_share": stats.wait_share,
            "truncated": stats.spans["truncated"],
        },
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def write_png(stats: LoaderStats, path: str, width_in: float = 9.0) -> Optional[str]:
    """A Gantt chart of the same tracks; None without matplotlib.

    Drawn on a bare `matplotlib.figure.Figure` (no pyplot): the caller's backend and figures
    are left alone.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    sp = stats.spans
    t0 = sp["start_wall_s"]
    worker_ids = sorted({w.worker_id for w in stats.workers} | {s[0] for s in sp["batches"]})
    rows: list[tuple[str, list, str]] = []
    labels: dict[int, list] = {}  # row -> (x, idx) of each batch span, to print the batch's idx in it
    for wid in reversed(worker_ids):
        mine = [(start - t0, dur, idx) for w, idx, start, dur in sp["batches"] if w == wid]
        labels[len(rows)] = [(x + d / 2, idx) for x, d, idx in mine]
        rows.append((_worker_label(stats, wid), [(x, d) for x, d, _ in mine], "#4c72b0"))
    for label, spans in reversed(_startup_tracks(stats)):
        labels[len(rows)] = [(start - t0 + dur / 2, idx) for idx, start, dur in spans]
        rows.append((label, [(start - t0, dur) for _, start, dur in spans], "#dd8452"))
    for label, spans in _cache_tracks(stats):
        rows.append((label, [(a - t0, b - a) for a, b, *_ in spans], "#8172b2"))
    if sp["pins"]:
        rows.append(("pin / device copy", [(a - t0, b - a) for a, b in sp["pins"]], "#55a868"))
    rows.append(("loop waiting in next()", [(a - t0, b - a) for a, b in sp["waits"]], "#c44e52"))
    fig = Figure(figsize=(width_in, 0.9 + 0.45 * len(rows)))
    ax = fig.subplots()
    for y, (_, spans, color) in enumerate(rows):
        if spans:
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, edgecolors="white", linewidth=0.3)
    if sum(len(v) for v in labels.values()) <= 120:  # readable: small epochs only
        for y, marks in labels.items():
            for x, idx in marks:
                ax.text(x, y, str(idx), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.set_xlim(0, max(stats.wall_s, 1e-3))
    ax.set_xlabel("seconds since the epoch started")
    ax.set_title(
        f"raydl loader {stats.name!r}, epoch {stats.epoch}: {stats.batches} batches in {stats.wall_s:.2f} s, "
        f"loop waited {stats.wait_share:.0%}",
        fontsize=9,
    )
    ax.grid(axis="x", alpha=0.3)
    with warnings.catch_warnings():  # a very short epoch crowds the ticks; the chart is still right
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
