"""Reading object storage: which errors are worth retrying, and retries with backoff.

A read from S3, GCS or NFS can fail for a moment (5xx, SlowDown, throttling, a reset connection, a
timeout) or for good (a missing object, no access). The first kind is retried with exponential
backoff and jitter, STORAGE_ATTEMPTS tries in all; the second is raised at once, so its message
(the file, the row group) reaches the user without a minute of retries. Used for the Parquet
footers (data/parquet.py) and the node cache's fetches (NOTE [ raydl node cache ] in
cluster/cache/node_actor.py).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

__all__ = ["OpenFiles", "is_transient", "with_retries"]

logger = logging.getLogger(__name__)

STORAGE_ATTEMPTS = 6  # tries per request on a transient error
BACKOFF_S = 0.05  # first backoff; doubles per try, capped at BACKOFF_MAX_S, with jitter
BACKOFF_MAX_S = 2.0
_NOT_TRANSIENT = (
    "NO_SUCH_KEY",
    "NoSuchKey",
    "ACCESS_DENIED",
    "AccessDenied",
    "does not exist",
    "NoSuchBucket",
    "changed since it was indexed",
)


def is_transient(e: BaseException) -> bool:
    """Whether a storage error is worth retrying: 5xx, SlowDown, throttling, resets, timeouts (not a missing file)."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(e, (TimeoutError, ConnectionError)):
        return True
    return isinstance(e, OSError) and not any(s in str(e) for s in _NOT_TRANSIENT)


def with_retries(fn: Callable[[], Any], what: str, on_retry: Optional[Callable[[BaseException], None]] = None) -> Any:
    """`fn()`, retried with exponential backoff on transient storage errors (NOTE [ raydl node cache ])."""
    for attempt in range(STORAGE_ATTEMPTS):
        try:
            return fn()
        except Exception as e:
            if not is_transient(e) or attempt == STORAGE_ATTEMPTS - 1:
                raise
            if on_retry is not None:
                on_retry(e)
            delay = min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt) * (0.5 + random.random())
            logger.debug("raydl cache: %s failed (%s); retry in %.2f s", what, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


# NOTE [ raydl open storage files ]
# pyarrow's S3 filesystem sends a HEAD request each time a file is opened (to learn its size) before
# the ranged GET that reads a row group: two requests a unit (counted through moto's proxy). A node cache reads every row
# group of a file over an epoch, so it keeps the files it reads open (`OpenFiles`) and reads later
# row groups of a file with one ranged GET each: an epoch's requests drop from 2 per unit to 1 per
# unit plus 1 per file (S3 bills and rate-limits HEAD like GET). `read_at` of a pyarrow file is
# safe from several threads at once. A handle is dropped after any error (the retry opens the file
# again) and after OPEN_FILE_TTL_S, so a file replaced in storage is opened anew within that time; at
# most OPEN_FILES_MAX stay open, the least recently used dropped first (never closed under a reader:
# the last reference closes it).
OPEN_FILE_TTL_S = 60.0
OPEN_FILES_MAX = 64


_OBJECT_THREADS = 64
_object_pool: Optional[Any] = None
_object_pool_lock = threading.Lock()


def read_objects(fs: Any, paths: Sequence[str]) -> list:
    """The whole bytes of each object of a multi-object unit (`FileDataset`, NOTE [ raydl member samples ]): one
    streamed GET each, up to 64 at once, so a unit of many small objects costs about one request's latency."""
    global _object_pool

    def one(path: str) -> bytes:
        with fs.open_input_stream(path) as f:
            return f.read()

    if len(paths) == 1:
        return [one(paths[0])]
    with _object_pool_lock:
        if _object_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _object_pool = ThreadPoolExecutor(_OBJECT_THREADS, thread_name_prefix="raydl_objects")
    return list(_object_pool.map(one, paths))


class OpenFiles:
    """Files of a filesystem kept open for ranged reads (NOTE [ raydl open storage files ])."""

    def __init__(self, ttl_s: float = OPEN_FILE_TTL_S, most: int = OPEN_FILES_MAX) -> None:
        self._ttl_s, self._most = ttl_s, most
        self._lock = threading.Lock()
        # (id(fs), path) -> (file, opened at, fs): the entry keeps `fs` alive, so its id names no other filesystem
        self._files: OrderedDict = OrderedDict()
        self._opening: dict = {}  # (id(fs), path) -> the lock of the thread opening it

    def read_segments(self, fs: Any, path: str, segments: Any, size: Optional[int] = None) -> list:
        """The bytes of each (offset, length) of `path`, read through a kept handle (opened if none); with `size`,
        a file of another size (changed since it was indexed) raises OSError naming it, never serves other bytes."""
        key = (id(fs), path)
        f = self._kept(key)
        if f is None:
            with self._lock:
                gate = self._opening.setdefault(key, threading.Lock())
            try:
                with gate:  # one open (one HEAD) a file, however many threads want it at once
                    f = self._kept(key)
                    if f is None:
                        f = fs.open_input_file(path)  # a request to storage, outside the table's lock
                        with self._lock:
                            self._files[key] = (f, time.monotonic(), fs)
                            self._files.move_to_end(key)
                            while len(self._files) > self._most:
                                self._files.popitem(last=False)
            finally:
                with self._lock:
                    if self._opening.get(key) is gate:
                        del self._opening[key]
        try:
            if size is not None and f.size() != size:
                raise OSError(
                    f"{path} changed since it was indexed: {f.size()} bytes, indexed at {size}; build the dataset "
                    "again (its index is re-made for the changed file)"
                )
            return [f.read_at(n, off) for off, n in segments]
        except BaseException:
            with self._lock:
                if self._files.get(key, (None,))[0] is f:
                    del self._files[key]
            raise

    def _kept(self, key: tuple) -> Any:
        with self._lock:
            kept = self._files.get(key)
            if kept is None or time.monotonic() - kept[1] >= self._ttl_s:
                return None
            self._files.move_to_end(key)
            return kept[0]
