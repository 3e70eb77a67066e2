"""The driver's side of a local lane's shared memory: made, sent, and its slots given to calls (NOTE [ raydl lane
memory ] in worker/lane_memory.py)."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import numpy as np

from ...worker.lane_memory import map_memory, send_memory
from .buffers import UNUSED_REFS, refs

__all__ = ["LaneMemory", "memory_for"]

logger = logging.getLogger(__name__)

_PAGE = 4096


class LaneMemory:
    """`slots` slots of `slot_bytes` in memory shared with one worker. `take(k)` gives k slots nothing refers to (a
    slot in use is referred to by the call it was given to until its reply is read, then by the reply's arrays).
    The pages are the kernel's until first written: slots are taken lowest first, so a lane touches only as many
    as it keeps in use at once."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        self.size = slots * self.slot_bytes
        self.fd = os.memfd_create("raydl-lane")  # (close-on-exec)
        try:
            os.ftruncate(self.fd, self.size)
            mapping = map_memory(os.dup(self.fd), self.size)
        except BaseException:
            os.close(self.fd)
            raise
        whole = np.frombuffer(mapping, dtype=np.uint8)
        # each slot its own array: its reference count says whether it is in use
        self._slots = [whole[i * self.slot_bytes : (i + 1) * self.slot_bytes] for i in range(slots)]
        self._given = [False] * slots
        self.reused = 0  # slots given to a call again (tests) ...
        self.full = 0  # ... and calls that found too few free slots (their replies came over the socket)

    def send(self, conn: Any) -> None:
        """Hand the memory to the worker (the lane's first message); this process keeps only its mapping."""
        try:
            send_memory(conn, self.fd, self.size)
        finally:
            os.close(self.fd)
            self.fd = -1

    def take(self, k: int) -> Optional[tuple[list, list]]:
        """k free slots: (their arrays, to keep with the call; their [(start, size)] for the worker), else None."""
        free = []
        for i in range(len(self._slots)):
            if refs(self._slots, i) == UNUSED_REFS:
                free.append(i)
                if len(free) == k:
                    for j in free:
                        self.reused += self._given[j]
                        self._given[j] = True
                    return [self._slots[j] for j in free], [(j * self.slot_bytes, self.slot_bytes) for j in free]
        self.full += 1
        return None


def memory_for(batch_bytes: int, max_batches: int) -> Optional[LaneMemory]:
    """Shared memory for a local lane whose worker's first batch had `batch_bytes` of arrays, or None where the system
    has none to share (not Linux) or it cannot be made (then the lane's replies cross the socket, as before)."""
    if not hasattr(os, "memfd_create"):
        return None
    # a slot holds one batch: its size with room to grow and each array's alignment; enough slots for the worker's
    # calls in flight (at most the prefetch bound's `max_batches`) and the batches the trainer, the reorder buffer
    # and a pinning copy may hold, twice over (untouched slots cost no memory)
    slot_bytes = int(batch_bytes * 1.5) + 64 * 1024
    slots = min(32, 2 * max_batches + 4)
    try:
        return LaneMemory(slots, slot_bytes)
    except OSError as e:
        logger.debug("raydl: no shared memory for a lane (%s): its replies cross the socket", e)
        return None
