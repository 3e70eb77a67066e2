"""`IterState`: where a loader iterator is in its life, the same states for the Ray and the cold-start iterators."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["IterState"]


class IterState(IntEnum):
    """Lifecycle of an iterator; it only moves up, except `_reset` (persistent workers) back to RUNNING."""

    RUNNING = 0
    EXHAUSTED = 1
    SHUT_DOWN = 2
