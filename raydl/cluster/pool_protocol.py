"""What the driver uses of a worker pool, named: `DriverPool` for any pool, `ResizablePool` for one of its own.

Two classes are pools: `WorkerPool` (cluster/pool.py), an iterator's own actors, and `JobPool` (job/pool.py), a
rank's view of the job's shared actors (NOTE [ raydl pool choice ] in driver/pool_choice.py). The iterator, its
recovery, its transports and its elastic policy hold one and use only what these Protocols name;
tests/test_pool_protocol.py checks that both classes have every member, so neither side drifts unseen.
A job's pool also has what `JobElastic` (job/elastic.py) follows the job's worker set by: that stays `JobPool`'s own.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from .._errors import WorkerRecord

__all__ = ["DriverPool", "ResizablePool"]


class DriverPool(Protocol):
    """The worker pool of one iterator, as its driver side sees it: worker ids index every list, and only grow."""

    actors: list  # worker id -> its actor handle (a replacement takes the dead one's place)
    records: list[Optional[WorkerRecord]]  # worker id -> where it runs, once it reported (None before)
    restarts: list[int]  # worker id -> replacements made for it (NOTE [ raydl recovery ])
    joining: dict[int, float]  # workers started and not yet reported started -> since when
    released: set[int]  # workers ended before the pool
    epoch: int  # the iterator's epoch, which a (re)started worker joins
    pipe_seed: Optional[int]  # that epoch's shared seed of an IterDataPipe (NOTE [ raydl datapipes ])
    actor_options: dict  # Ray's options of every worker actor

    @property
    def num_workers(self) -> int:
        """The size the pool started with (a private pool) or has now (a job's)."""
        ...

    @property
    def alive(self) -> bool:
        """False once `shutdown` ran."""
        ...

    @property
    def is_ready(self) -> bool:
        """Every worker not joining has started."""
        ...

    def in_session(self) -> bool:
        """Whether Ray still runs the session the pool's actors belong to (never starts one)."""
        ...

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every worker not joining has started, at most `timeout_s` seconds."""
        ...

    def replace(self, worker_id: int, state: Optional[dict] = None) -> None:
        """A new actor for dead worker `worker_id`, started from `state` (NOTE [ raydl recovery ])."""
        ...

    def abandon(self, worker_id: int, ref: Any) -> None:
        """The driver no longer needs the result of `ref`, a call on worker `worker_id`."""
        ...

    def mark_failed(self, worker_id: int) -> None:
        """Worker `worker_id` died or failed: never reused."""
        ...

    def take_swapped(self) -> list[int]:
        """Workers whose dead idle actor was swapped since the last call: their queued tasks are sent again."""
        ...

    def node_of(self, worker_id: int) -> Optional[str]:
        """The node worker `worker_id` runs on (or is planned for), None when not known."""
        ...

    def describe(self, worker_id: int) -> str:
        """Worker `worker_id` and where it runs, for error messages."""
        ...

    def release_when_collected(self, owner: Any) -> Any:
        """A `weakref.finalize` that ends the pool once, also when `owner` is collected (NOTE [ raydl shutdown ])."""
        ...

    def shutdown(self, tasks_known: bool = True) -> None:
        """End the pool (idempotent)."""
        ...


class ResizablePool(DriverPool, Protocol):
    """A pool of the iterator's own (`WorkerPool`): `ElasticPool` resizes it one worker at a time (NOTE [ raydl
    elastic pool ]); a persistent iterable iterator restarts its streams; a resumed one reads where its workers
    started (NOTE [ raydl checkpoint ]). The iterator asks a pool for the last two before it uses them."""

    started_states: dict[int, Optional[dict]]  # worker id -> its snapshot as it started

    def add_worker(self, info_num_workers: int) -> int:
        """Start one more worker under a new id, without waiting for it; returns its id."""
        ...

    def poll_joining(self, timeout_s: float) -> tuple[list[int], list[tuple[int, str]]]:
        """Without blocking: (joining workers now started, [(worker, why)] for those that failed to start)."""
        ...

    def release(self, worker_id: int) -> None:
        """End worker `worker_id` now (it has no task the driver still needs)."""
        ...

    def restart_streams(self, epoch: int) -> dict:
        """Each live worker restarts its stream for `epoch`: {worker id: the ref of its snapshot then}."""
        ...
