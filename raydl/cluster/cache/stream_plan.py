"""A loader iterator's plan as the node cache keeps it (NOTE [ raydl node cache ] in node_actor.py): the units each
batch position uses, and the cursors that say which uses are past, which are in flight and how far ahead the rest
are (Belady's eviction and the fetch order read it)."""

from __future__ import annotations

import bisect
import time

__all__ = ["INF", "StreamPlan"]

INF = float("inf")


class StreamPlan:
    """One loader iterator's plan: the units of each batch position, and its cursors."""

    def __init__(self) -> None:
        self.steps: dict[int, list] = {}  # batch position -> unit keys
        self.uses: dict[str, list] = {}  # unit key -> sorted batch positions using it
        self.cursor = 0  # next batch to hand out
        self.sent = 0  # end of the batches in flight
        self.last = -1  # last position known
        self.scan = 0  # no missing unit before this position (reset when a unit leaves the cache)
        self.touched = time.monotonic()  # the driver's last word
        self.owners: dict[str, str] = {}  # unit key -> the node whose cache fetches it from storage (not this one)

    def add(self, step: int, keys: list) -> None:
        self.steps[step] = keys
        self.last = max(self.last, step)
        for k in keys:
            lst = self.uses.setdefault(k, [])
            if not lst or lst[-1] < step:
                lst.append(step)
            else:
                bisect.insort(lst, step)

    def drop(self, first: int, end: int) -> None:
        """Forget what the plan said of positions [first, end)."""
        for step in [k for k in self.steps if first <= k < end]:
            for k in self.steps.pop(step):
                lst = self.uses[k]
                lst.pop(bisect.bisect_left(lst, step))
                if not lst:
                    del self.uses[k]

    def next_use(self, key: str) -> tuple[float, bool]:
        """(batches until the key's next use, whether a batch in flight uses it)."""
        lst = self.uses.get(key)
        if not lst:
            return INF, False
        i = bisect.bisect_left(lst, self.cursor)
        if i == len(lst):
            return INF, False
        return float(lst[i] - self.cursor), lst[i] < self.sent
