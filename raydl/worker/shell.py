"""The worker actor's class as Ray sees it: a shell that imports torch only inside the actor.

NOTE [ raydl worker shell ]
`ray.remote` needs the actor's class in the process that creates the actors, and creating them is
not only the trainer's work: a job's coordinator actor (job/coordinator.py) starts and replaces the
workers of a `ray_job` pool, and needs nothing of torch for it. The body of the worker
(worker/actor.py, `WorkerBody`) imports torch, NumPy and the collate code at module level; had
cluster/pool.py imported it, every coordinator would import torch too: about 2.5 s of CPU on a
2-core host before the job's first worker is even asked for. So Ray is given this class: the same
public methods, each handing its call to the body, which `__init__` imports and builds in the
actor's own process. Its name, `Worker`, is what Ray shows (`ray::Worker`, the state API's
class_name). A public method added to the body is added here too (tests/test_layout.py checks the
two agree); one frame of forwarding is all it costs a call.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["Worker"]


class Worker:
    """A raydl worker actor: `configure` it with a loader's payload, then `fetch_many` (NOTE [ raydl worker shell ])."""

    def __init__(self) -> None:
        from .actor import WorkerBody  # in the actor's process only: torch and the collate code come with it

        self._body = WorkerBody()

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with this (the body's: its worker id)
        body = self.__dict__.get("_body")
        return "raydl.Worker(id=-1)" if body is None else repr(body)

    def configure(self, *args: Any, **kwargs: Any) -> dict:
        # (the body's parameters: payload, worker_id, num_workers, base_seed, worker_state, track_rng, epoch, pipe_seed)
        return self._body.configure(*args, **kwargs)

    def reset(self) -> None:
        return self._body.reset()

    def fetch_many(self, epoch: int, tasks: list) -> tuple[list, list]:
        return self._body.fetch_many(epoch, tasks)

    def open_lane(self, address: str, token: bytes) -> bool:
        return self._body.open_lane(address, token)

    def fetch(self, epoch: int, idx: int, index: Any) -> tuple:
        return self._body.fetch(epoch, idx, index)

    def restart_stream(self, epoch: int, pipe_seed: Optional[int] = None) -> Optional[dict]:
        return self._body.restart_stream(epoch, pipe_seed)
