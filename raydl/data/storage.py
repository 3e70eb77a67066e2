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
import time
from typing import Any, Callable, Optional

__all__ = ["is_transient", "with_retries"]

logger = logging.getLogger(__name__)

STORAGE_ATTEMPTS = 6  # tries per request on a transient error
BACKOFF_S = 0.05  # first backoff; doubles per try, capped at BACKOFF_MAX_S, with jitter
BACKOFF_MAX_S = 2.0
_NOT_TRANSIENT = ("NO_SUCH_KEY", "NoSuchKey", "ACCESS_DENIED", "AccessDenied", "does not exist", "NoSuchBucket")


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
