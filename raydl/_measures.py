"""Measures a worker takes of its own batches and the driver reads back: below both sides.

NOTE [ raydl shared measures ]
Code that runs in a worker actor (raydl/worker/) never imports the trainer's side (raydl/driver/,
raydl/job/): the actor would load the driver's modules for nothing, and a change on the driver's side
could break the workers. What both sides measure of a batch lives here: its bytes (`batch_nbytes`,
summed by the driver's stats) and its time in the `raydl_batch_seconds` Ray histogram
(`observe_batch_time`, observed in the worker, NOTE [ raydl stats ] in driver/stats/recorder.py). Stdlib only
at module level.
"""

from __future__ import annotations

from typing import Any

__all__ = ["batch_nbytes", "observe_batch_time", "BATCH_TIME_BUCKETS_S"]

BATCH_TIME_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


_tensor_view: Any = None  # worker/transfer.py's _TensorView, imported on first use (this module loads first)


def batch_nbytes(data: Any) -> int:
    """Bytes of the array data in an encoded batch (tensors, NumPy arrays, bytes, str), for stats. Once a batch
    per worker and per call on the driver: no import and no generator per element (a dict of 18 columns went
    36-70 -> 1.7-2.8 us)."""
    global _tensor_view
    if _tensor_view is None:
        from .worker.transfer import _TensorView

        _tensor_view = _TensorView
    kind = type(data)
    if kind is _tensor_view:
        return data.array.nbytes
    if kind is dict:
        data = data.values()
    elif not (kind is list or isinstance(data, tuple)):
        return _leaf_nbytes(data)
    total = 0
    for v in data:
        k = type(v)
        total += v.array.nbytes if k is _tensor_view else batch_nbytes(v)
    return total


def _leaf_nbytes(data: Any) -> int:
    if isinstance(data, (bytes, bytearray, str)):
        return len(data)
    nbytes = getattr(data, "nbytes", None)  # NumPy arrays, and torch tensors (torch >= 2.1)
    return nbytes if isinstance(nbytes, int) else 0


_batch_time_hist = None


def observe_batch_time(name: str, worker_id: int, fetch_s: float) -> None:
    """In a worker: one observation of the `raydl_batch_seconds` histogram (see NOTE [ raydl stats ])."""
    global _batch_time_hist
    if _batch_time_hist is None:
        from ray.util.metrics import Histogram

        _batch_time_hist = Histogram(
            "raydl_batch_seconds",
            description="Seconds a raydl worker spent making one batch (fetch, collate, encode).",
            boundaries=BATCH_TIME_BUCKETS_S,
            tag_keys=("loader", "worker"),
        )
    _batch_time_hist.observe(fetch_s, tags={"loader": name, "worker": str(worker_id)})
