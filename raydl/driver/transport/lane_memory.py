"""The driver's side of a local lane's shared memory: made, sent, and its slots given to calls (NOTE [ raydl lane
memory ] in worker/lane_memory.py)."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Optional

import numpy as np

from ..._constants import LANE_MEMORY_MAX_SLOT_BYTES
from ...worker.lane_memory import map_memory, send_memory
from .buffers import UNUSED_REFS, refs

__all__ = ["LaneMemory", "LaneMemoryCounts", "memory_for"]

logger = logging.getLogger(__name__)

_PAGE = 4096


class LaneMemoryCounts:
    """How one iterator's local lanes used their shared memory, over its life: `loader.stats().lane_memory`."""

    def __init__(self) -> None:
        self.memories = 0  # memories made (a lane's first, and each larger one)
        self.regrown = 0  # ... of which made larger for replies that did not fit
        self.slot_bytes = 0  # the largest slot made
        self.replies = 0  # replies read from the memory
        self.fell_back = {"full": 0, "refused": 0, "error": 0}  # replies to calls given slots that came over the socket
        self.no_slots = 0  # calls given no slots (too few free: the user holds the batches), their replies the socket's
        self.paused = 0  # calls given no slots in a pause: the worker's last replies could not use the memory
        self.mapped_bytes = 0  # bytes of lane memory this process maps now (an old memory until its batches go)
        self._lock = threading.Lock()  # a mapping's finalizer runs in whichever thread drops its last batch

    def noted(self, how: str, nbytes: int = 0) -> None:
        """A reply to a call given slots came: through the memory ("memory"), or why not (FELL_BACK's key)."""
        if how == "memory":
            self.replies += 1
        else:
            self.fell_back[how] += 1

    def mapped(self, mapping: Any, size: int, slot_bytes: int) -> None:
        with self._lock:
            self.memories += 1
            self.slot_bytes = max(self.slot_bytes, slot_bytes)
            self.mapped_bytes += size
        weakref.finalize(mapping, self._unmapped, size)

    def _unmapped(self, size: int) -> None:
        with self._lock:
            self.mapped_bytes -= size

    def figures(self) -> Optional[dict]:
        """`LoaderStats.lane_memory`: None where no lane had shared memory."""
        if not self.memories:
            return None
        return {
            "replies_in_memory": self.replies,
            "replies_did_not_fit": self.fell_back["full"],
            "replies_refused": self.fell_back["refused"],
            "replies_failed": self.fell_back["error"],
            "calls_without_slots": self.no_slots,
            "calls_paused": self.paused,
            "regrown": self.regrown,
            "slot_bytes": self.slot_bytes,
            "mapped_bytes": self.mapped_bytes,
        }


class LaneMemory:
    """`slots` slots of `slot_bytes` in memory shared with one worker. `take(k)` gives k slots nothing refers to (a
    slot in use is referred to by the call it was given to until its reply is read, then by the reply's arrays).
    The pages are the kernel's until first written: slots are taken lowest first, so a lane touches only as many
    as it keeps in use at once. `counts`: the iterator's `LaneMemoryCounts` (one of its own if not given)."""

    def __init__(self, slots: int, slot_bytes: int, counts: Optional[LaneMemoryCounts] = None) -> None:
        self.slot_bytes = _page_up(slot_bytes)
        self.size = slots * self.slot_bytes
        self.fd = os.memfd_create("raydl-lane")  # (close-on-exec)
        try:
            os.ftruncate(self.fd, self.size)
            mapping = map_memory(os.dup(self.fd), self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.counts = counts if counts is not None else LaneMemoryCounts()
        self.counts.mapped(mapping, self.size, self.slot_bytes)  # unmapped once no slot's array refers to it
        whole = np.frombuffer(mapping, dtype=np.uint8)
        # each slot its own array: its reference count says whether it is in use
        self._slots = [whole[i * self.slot_bytes : (i + 1) * self.slot_bytes] for i in range(slots)]
        self._given = [False] * slots
        self.reused = 0  # slots given to a call again (tests); calls that found too few free: `counts.no_slots`

    def send(self, conn: Any) -> None:
        """Hand the memory to the worker (the lane's first message, or ahead of a call: a larger memory); this process
        keeps only its mapping."""
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
        self.counts.no_slots += 1
        return None

    def grown(self, reply_bytes: int) -> Optional[LaneMemory]:
        """A memory of as many slots, each for a reply of `reply_bytes` (a reply that did not fit, as it crossed the
        socket), at most LANE_MEMORY_MAX_SLOT_BYTES: None where its slots would be no larger than these (a reply to a
        call sent before these were made, or the cap reached) or it cannot be made (NOTE [ raydl lane memory ])."""
        slot_bytes = _page_up(min(_slot_bytes(reply_bytes), LANE_MEMORY_MAX_SLOT_BYTES))
        if slot_bytes <= self.slot_bytes:
            return None
        try:
            return LaneMemory(len(self._slots), slot_bytes, self.counts)
        except OSError as e:
            logger.debug("raydl: no larger shared memory for a lane (%s): replies that do not fit cross the socket", e)
            return None


def _page_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _slot_bytes(batch_bytes: int) -> int:
    """A slot for a batch (or a reply) of `batch_bytes`: room to grow and for each array's alignment."""
    return int(batch_bytes * 1.5) + 64 * 1024


def memory_for(batch_bytes: int, max_batches: int, counts: Optional[LaneMemoryCounts] = None) -> Optional[LaneMemory]:
    """Shared memory for a local lane whose worker's first batch had `batch_bytes` of arrays, or None where the system
    has none to share (not Linux) or it cannot be made (then the lane's replies cross the socket, as before)."""
    if not hasattr(os, "memfd_create"):
        return None
    # a slot holds one batch: its size with room to grow and each array's alignment; enough slots for the worker's
    # calls in flight (at most the prefetch bound's `max_batches`) and the batches the trainer, the reorder buffer
    # and a pinning copy may hold, twice over (untouched slots cost no memory)
    slots = min(32, 2 * max_batches + 4)
    try:
        return LaneMemory(slots, _slot_bytes(batch_bytes), counts)
    except OSError as e:
        logger.debug("raydl: no shared memory for a lane (%s): its replies cross the socket", e)
        return None
