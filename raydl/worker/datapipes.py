"""torch's DataPipes in a raydl worker: sharded over the workers and seeded together, as torch's workers do.

NOTE [ raydl datapipes ]
torch's DataLoader treats a DataPipe dataset specially when it has workers. Each worker shards the
graph (`graph_settings.apply_sharding` with the job's total workers, `num_workers x world size`, and
its global id, `worker_id x world size + rank`), so that a `sharding_filter` keeps one share per
worker; and an IterDataPipe's random operations (`shuffle()`) are seeded with one seed shared by all
workers, drawn by the iterator from the loader's generator (at its creation, then again at each
epoch of persistent workers), so that the workers' shuffles agree and a sharding filter after a
shuffle still deals each sample once. Without the two, every worker would yield the whole pipe.
raydl's driver draws the same seeds at the same moments (driver/iter.py, `_pipe_seed`) and hands
them over: the first with `configure()`, each later epoch's with the epoch's tasks and with
`restart_stream`. Here the worker applies them in torch's order: the shared seed, then the worker
info, then the sharding, then the user's `worker_init_fn`; a later epoch's seed before its stream
restarts (`iter()` draws the shuffle's order from it).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe

__all__ = ["is_datapipe", "is_iter_datapipe", "seed_pipe", "shard_pipe"]


def is_datapipe(dataset: Any) -> bool:
    return isinstance(dataset, (IterDataPipe, MapDataPipe))


def is_iter_datapipe(dataset: Any) -> bool:
    return isinstance(dataset, IterDataPipe)


def seed_pipe(dataset: Any, seed: Optional[int]) -> None:
    """An IterDataPipe's random operations seeded from the workers' shared `seed` (nothing for other datasets)."""
    if seed is None or not isinstance(dataset, IterDataPipe):
        return
    from torch.utils.data.graph_settings import apply_random_seed

    rng = torch.Generator()
    rng.manual_seed(int(seed))
    apply_random_seed(dataset, rng)  # in place: the graph's seeded operations take their seeds from `rng`


def shard_pipe(dataset: Any, num_workers: int, worker_id: int, world: tuple[int, int]) -> None:
    """A DataPipe's sharding filters set to this worker's share: `world` is (world size, rank), torch's
    distributed settings in the driver."""
    if not is_datapipe(dataset):
        return
    from torch.utils.data.graph_settings import apply_sharding

    world_size, rank = world
    apply_sharding(dataset, num_workers * world_size, worker_id * world_size + rank)
