"""The memory a lane's replies are read into, used again once the batches on it are gone.

NOTE [ raydl receive buffers ]
A lane's reply carries each large array out of band (NOTE [ raydl lane ] in worker/lane.py): the
driver reads it straight into memory the batch's tensor then uses. Fresh memory costs the reading
core its page faults and the kernel's zeroing of every page before the copy even starts: a
38.5 MB batch (64 JPEGs as 3 x 224 x 224 float32) took 9.8 ms of CPU to fill fresh, 2.8 ms
to fill again (measured on this project's 2-core host), and with workers on another node that
reading is done on the trainer's core, once a batch. So `ReceiveBuffers` keeps the arrays it
handed out and gives one again, for a reply array of the same size, once nothing else refers
to it: the batch's tensors (`torch.from_numpy` keeps its array, which keeps the buffer), every
view of them and anything the user kept. Python's reference count says so exactly
(`sys.getrefcount`): a buffer still referred to from anywhere is never written, so a batch the
user holds (or a tensor a pinning thread is copying) is never overwritten. What stays with the
user is unchanged: fresh-looking, writable tensors, torch's values.

At most `limit` buffers are kept (the iterator's prefetch bound plus what the trainer and a
pinning step may hold); a new size evicts a kept buffer no one uses, and when every kept buffer
is in use the new one is simply not kept. The pool belongs to one iterator's lanes and is
dropped with them: an idle loader keeps no memory of its batches.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["ReceiveBuffers", "refs", "UNUSED_REFS"]


def refs(kept: list, i: int) -> int:
    """References to `kept[i]`, this function's own included."""
    buf = kept[i]
    return sys.getrefcount(buf)


# `refs` of a kept buffer nothing else refers to: measured, not assumed (interpreters count a call's
# borrowed references differently)
UNUSED_REFS = refs([object()], 0)


class ReceiveBuffers:
    """Arrays for a lane's out-of-band reply buffers, used again once free (NOTE [ raydl receive buffers ]).
    `take` may be called from several reader threads at once."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._kept: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (tests, stats)
        # where the next search starts: the buffers are freed about in the order they were handed out, so the one
        # after the last handed out is most often free already, and a search is not a look at every kept buffer
        # (up to four per worker: the prefetch bound, twice)
        self._next = 0

    def take(self, size: int) -> np.ndarray:
        """A writable uint8 array of `size` bytes that nothing else refers to (its content is undefined)."""
        with self._lock:
            evictable = -1
            n = len(self._kept)
            for k in range(n):  # from the one after the last handed out: batches go roughly first in, first out
                i = (self._next + k) % n
                if refs(self._kept, i) == UNUSED_REFS:
                    if self._kept[i].nbytes == size:
                        self.reused += 1
                        self._next = i + 1
                        return self._kept[i]
                    evictable = i
            buf = np.empty(size, dtype=np.uint8)
            if len(self._kept) < self.limit:
                self._kept.append(buf)
            elif evictable >= 0:
                self._kept[evictable] = buf
            return buf

    def clear(self) -> None:
        """Keep nothing more (the iterator's lanes closed); arrays still in use stay with their users."""
        with self._lock:
            self._kept.clear()
