"""Where an iterator's workers come from: what it ships to them, and the job's pool or a pool of its own.

NOTE [ raydl pool choice ]
An iterator (driver/iter.py) builds one `WorkerPayload` (the dataset, collate_fn, worker_init_fn,
seeding mode, stats name) and hands it to its pool:
  * under `ray_job`, the job's `JobPool` (NOTE [ raydl job pool ] in job/pool.py), shared by the
    job's ranks: the payload is put in the object store only if this rank creates the pool, and
    every batch is keyed by the rank, so seeds follow the batch, not the worker;
  * otherwise a `WorkerPool` of its own (cluster/pool.py): warm workers reused where the options
    allow, placed by `ray_remote_args` or raydl's placement (NOTE [ raydl placement ]), and
    started with the worker states of a resumed iterator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from .._options import RayOptions
from ..cluster.elastic import ElasticPool
from ..cluster.placement import worker_placement
from ..cluster.pool import WorkerPool
from ..data.payload import put_payload
from ..job.elastic import JobElastic
from ..job.pool import JobPool, job_fingerprint, job_name, rank_and_world
from ..worker.actor import WorkerPayload
from ..worker.datapipes import is_datapipe, is_iter_datapipe
from .state.checkpoint import Tracker
from .state.draws import track_rng_enabled

if TYPE_CHECKING:
    from ..cluster.pool_protocol import DriverPool
    from .schedule import Schedule
    from .spec import LoaderSpec

__all__ = ["worker_payload", "make_pool"]


def worker_payload(loader: Any, options: RayOptions, is_iterable: bool, auto_collation: bool) -> WorkerPayload:
    """What every worker of `loader`'s iterator is configured with."""
    return WorkerPayload(
        dataset=loader.dataset,
        is_iterable=is_iterable,
        auto_collation=auto_collation,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        worker_init_fn=loader.worker_init_fn,
        threads_per_worker=options.threads_per_worker,
        seed_per_batch=options.seed == "batch",
        keyed_seeds=options.seed == "sample" or options.job is not None,
        stats_name=(options.name or type(loader.dataset).__name__) if options.stats else None,
        pipe_world=_distributed_settings() if is_datapipe(loader.dataset) else None,
        pipe_seeds=is_iter_datapipe(loader.dataset),
    )


def _distributed_settings() -> tuple[int, int]:
    """(world size, rank) of torch.distributed's default group, (1, 0) without one: what torch shards a DataPipe by
    (NOTE [ raydl datapipes ] in worker/datapipes.py)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def make_pool(
    loader: Any,
    options: RayOptions,
    payload: WorkerPayload,
    base_seed: int,
    ckpt: Tracker,
    driver_node_id: str,
    epoch: int,
    actor_options: dict,
    pipe_seed: Optional[int] = None,
) -> tuple[DriverPool, Optional[int]]:
    """(the pool, this process's rank in its job or None) for one iterator (NOTE [ raydl pool choice ])."""
    if options.job is not None:
        rank, world = rank_and_world()
        pool: DriverPool = JobPool(
            job_name(options.job),
            rank,
            world,
            loader.num_workers,
            lambda: put_payload(payload, options.shared_dataset_memory),
            job_fingerprint(loader, options),
            base_seed,
            actor_options,
            options.startup_timeout_s,
            max_workers=options.max_workers,
        )
        return pool, rank
    pool = WorkerPool(
        put_payload(payload, options.shared_dataset_memory),
        loader.num_workers,
        base_seed,
        actor_options,
        reuse=options.reuse_workers,
        # None when ray_remote_args says where workers go (NOTE [ raydl placement ])
        placement=worker_placement(actor_options, driver_node_id),
        worker_states=ckpt.worker_states,
        track_rng=track_rng_enabled(),
        epoch=epoch,
        pipe_seed=pipe_seed,
    )
    return pool, None


def make_elastic(
    pool: DriverPool, sched: Schedule, job_rank: Optional[int], spec: LoaderSpec, put_index: Callable[[], None]
) -> ElasticPool:
    """The resize and autoscale policy that goes with the pool `make_pool` chose: the job's (its ranks decide
    together, NOTE [ raydl job elastic ]) or the iterator's own (NOTE [ raydl elastic pool ])."""
    options = spec.options
    if job_rank is not None:
        return JobElastic(
            pool,
            sched,
            spec.prefetch_factor,
            put_index,
            options.startup_timeout_s,
            autoscale=options.max_workers is not None,
        )
    return ElasticPool(
        pool,
        sched,
        spec.prefetch_factor,
        put_index,
        options.startup_timeout_s,
        spec.num_workers,
        options.max_workers,
        resizable=not spec.is_iterable,
        # workers moved to a node that joined (NOTE [ raydl rebalance ]): a batch's content must not depend on its worker
        rebalance=not spec.is_iterable and options.seed != "worker",
    )
