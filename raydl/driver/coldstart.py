"""`ColdStartIter`: a new process's first batches, made in the driver while Ray and the workers come up.

NOTE [ raydl cold start ]
A process that has never used Ray pays, before its first batch from a worker, for `ray.init()`
(GCS, raylet, agents: 4-10 s on a 2-core machine) and for its workers' start (a Python process
importing torch each: 1.3-2 s), where torch's DataLoader forks its workers in milliseconds
(benchmarks/README.md, start-up). So on a cold start the loader's first `iter()`:
  1. begins Ray's start and its workers' in the background, through `raydl.start()`'s thread
     (NOTE [ raydl early start ] in cluster/startup.py), right after the first batch (importing
     Ray holds the GIL for most of a second, which would slow that batch): Ray by the usual
     precedence, and blank workers put in the warm pool, which the loader takes when they run.
     Only the loader's own
     iteration starts Ray, as before (construction still starts nothing), and only in a
     process that never used Ray: after the user's `ray.shutdown()` the loader starts Ray at
     `iter()` in the foreground, with its warning (NOTE [ raydl no Ray behind the user's back ]);
  2. draws the base seed and the sampler's indices exactly as the Ray iterator would, and while
     the workers are not running, makes each batch in the driver as the worker that would have
     made it: batch k by worker k mod num_workers (torch's round robin), with that worker's own
     copy of the dataset, `worker_init_fn` run on it, `get_worker_info()` answering as in that
     worker, and its `random`, torch and NumPy streams seeded as torch seeds it
     (`ShadowWorker`, driver/shadow.py). The driver's own generators, worker info and thread
     count are put back after each batch;
  3. once Ray is up and the started workers run (checked without blocking before each batch),
     hands the epoch over: the driver's record of it is a loader state (NOTE [ raydl
     checkpoint ]) as of the last batch made here, with each worker's generators (and its
     dataset's `state_dict()`, for a stateful dataset); a `_RayLoaderIter` is built from that
     state, with the sampler iterator and base seed passed on as they are (nothing drawn
     again, nothing replayed), so each actor starts as a resumed worker: seeded, worker_init_fn
     run on its own copy, then its generators set to where its shadow left them. The epoch
     goes on at the next batch, on the worker that would have made it.
An epoch that runs out in the driver hands over at its end (waiting, bounded, for the workers), so
an epoch still ends with Ray up and the workers holding its streams, as without a cold start: a
failed start (a bad `ray_address`) raises there at the latest, a persistent loader's next epoch
goes on in the workers, and the script finds Ray initialized after its first epoch. Only the
first batches come sooner; the first epoch lasts at least Ray's and the workers' start.
The batches are those of a loader whose workers made them all, batch for batch: torch's.
Which batches the driver made depends only on timing; their content does not.
Applies to: num_workers > 0, a map-style dataset, `ray_seed="worker"` without `ray_job`, no
pinning or `ray_device`, no loaded state, `ray_cold_start` not False (the default: on unless
RAYDL_COLD_START=0 in the environment). A script's own Ray call while Ray starts in the
background (`ray.get_runtime_context()`, `ray.get`: Ray initializes itself on first use) waits for
that start and then uses its Ray: raydl inits under the lock Ray's own automatic init takes
(`_init_unless_connected` in cluster/connect.py); without it the two inits raced and one failed
with Ray's "ray.init twice" error (seen in Lightning DDP ranks that read their Ray context before
their first epoch ended; tests/test_cold_start.py repeats it). Otherwise the
iterator is today's: IterableDataset streams stay in their workers (a stream's position cannot
be handed from the driver to an actor unless it has a `state_dict()`).
Costs and limits: each shadow holds a copy of the dataset (large arrays shared, see
driver/shadow.py) until the handover; user code (`__getitem__`, collate_fn, worker_init_fn) runs
in the trainer's process, where its effects beyond the generators, worker info and thread count
stay; `loader.stats()` starts with the first batch a worker made. `ray_cold_start=False` keeps
every batch in the workers.
"""

from __future__ import annotations

import logging
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Iterator, Optional

from torch.utils.data import IterableDataset
from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe

from .._constants import WARM_MAX_IDLE_PER_KEY
from .._options import RayOptions
from ..cluster.connect import never_connected, resource_request, worker_actor_options
from ..cluster.startup import Startup, start, starts_in_progress
from ..job.global_epoch import GLOBAL_EPOCH
from .checkpoint import Tracker, iterator_base_seed
from .iter import _RayLoaderIter
from .shadow import ShadowWorker
from .state_layout import RAYDL

if TYPE_CHECKING:
    from ..loader import DataLoader

__all__ = ["ColdStartIter", "cold_start_applies"]

logger = logging.getLogger(__name__)

# Tests only: after this many batches made in the driver, the next one waits for the workers (None: no limit).
_MAX_DRIVER_BATCHES: Optional[int] = None


def cold_start_applies(loader: DataLoader, state: Optional[Any]) -> bool:
    """Whether `iter(loader)` makes its first batches in the driver (NOTE [ raydl cold start ])."""
    dataset = loader.dataset
    return (
        getattr(loader, "ray_cold_start", False)
        and state is None
        and loader.num_workers > 0
        and not isinstance(dataset, (IterableDataset, IterDataPipe, MapDataPipe))
        and not callable(getattr(dataset, "raydl_cache_units", None))  # streamed through the node cache
        and loader.ray_seed == "worker"
        and loader.ray_job is None
        and not loader.pin_memory
        and loader.ray_device is None
        and never_connected()
    )


class _Handover:
    """What the Ray iterator takes as it is from the driver's part of the epoch: no draw is made again."""

    def __init__(self, sampler_iter: Iterator, base_seed: int, len_called: Optional[int]) -> None:
        self._sampler_iter = sampler_iter
        self._base_seed = base_seed
        self._len_called = len_called

    def take_main(self, tracker: Tracker) -> tuple[Iterator, int]:
        """The sampler iterator (at the first batch not made) and the base seed, recorded in `tracker`."""
        tracker.base_seed = self._base_seed
        tracker.len_called = self._len_called
        return self._sampler_iter, self._base_seed


class _State(IntEnum):
    RUNNING = 0
    EXHAUSTED = 1
    SHUT_DOWN = 2


class ColdStartIter(Iterator[Any]):
    """An epoch that starts in the driver and goes on with Ray workers (NOTE [ raydl cold start ]).

    Before the handover it draws and makes batches itself, recording them in a `Tracker` as the
    Ray iterator records its workers' batches; after it, every call goes to `_RayLoaderIter`.
    """

    def __init__(self, loader: DataLoader) -> None:
        self._loader: Optional[DataLoader] = loader  # until the handover builds the Ray iterator from it
        self._num_workers = loader.num_workers
        self._auto_collation = loader.batch_sampler is not None
        self._index_sampler = loader.batch_sampler if self._auto_collation else loader.sampler
        self._inner: Optional[_RayLoaderIter] = None
        self.stats_recorder = None  # the Ray iterator's, once it runs (NOTE [ raydl stats ])
        # torch's order, as _RayLoaderIter: the sampler iterator, then the base seed
        self._tracker = Tracker(loader, self._index_sampler, None)
        it = self._tracker.sampler_iter()
        base_seed = iterator_base_seed(loader.generator, False)
        self._sampler_iter, self._base_seed = self._tracker.resume_main(it, base_seed, None)
        self._epoch = 0
        self._shadows: dict[int, ShadowWorker] = {}
        self.batches_in_driver = 0  # over all epochs, handed out or raised
        self._max_in_driver = _MAX_DRIVER_BATCHES
        self._startup_timeout_s = loader.ray_startup_timeout_s
        self._startups: Optional[list[Startup]] = None  # started once the first batch is out (see `__next__`)
        self._begin_epoch(first_iter=True)

    def _start_ray(self) -> list[Startup]:
        """Ray, and blank workers where the warm pool may hold them, started by `raydl.start()`'s thread."""
        if self._startups is None:
            loader = self._loader
            assert loader is not None
            options = RayOptions.from_loader(loader)
            actor_options = worker_actor_options(options.remote_args)
            keep_warm = options.reuse_workers and not resource_request(actor_options)
            n = loader.num_workers if keep_warm and loader.num_workers <= WARM_MAX_IDLE_PER_KEY else 0
            self._startups = [
                *starts_in_progress(),
                start(n, ray_address=options.address, ray_remote_args=options.remote_args),
            ]
            logger.debug("raydl: cold start: Ray and %d workers start in the background", n)
        return self._startups

    def _begin_epoch(self, first_iter: bool) -> None:
        self._state = _State.RUNNING
        self._send_idx = 0  # idx of the next batch: made by worker idx % num_workers
        self._tracker.start_epoch(self._sampler_iter, first_iter, self._epoch)

    # ------------------------------------------------------------------ the loader's iterator surface

    def __iter__(self) -> ColdStartIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)  # type: ignore[arg-type]

    def __getstate__(self):
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")

    @property
    def _ckpt(self) -> ColdStartIter:
        """What the loader's `state_dict()` reads (this iterator answers for both parts of the epoch)."""
        return self

    def state_dict(self) -> dict:
        """The loader state as of the last batch handed out (NOTE [ raydl checkpoint ])."""
        if self._inner is not None:
            return self._inner._ckpt.state_dict()
        return self._tracker.state_dict()

    @property
    def worker_records(self) -> list:
        return self._inner.worker_records if self._inner is not None else []

    @property
    def reusable(self) -> bool:
        """Whether a persistent loader's next epoch goes on with this iterator (its shadows, or its workers)."""
        if self._inner is not None:
            return self._inner.reusable
        return self._state != _State.SHUT_DOWN

    def _reset(self, loader: DataLoader) -> None:
        """Persistent workers: the next epoch, on the same workers (or shadows), with a new sampler iterator."""
        if self._inner is not None:
            self._inner._reset(loader)
            return
        self._loader = loader
        self._sampler_iter = self._tracker.sampler_iter()
        self._epoch += 1
        self._begin_epoch(first_iter=False)

    def _set_num_workers(self, num_workers: int) -> None:
        """A resize goes to the workers: the epoch is handed over now (waiting for Ray), then resized."""
        if self._inner is None and self._state == _State.RUNNING:
            for startup in self._start_ray():
                startup.wait(self._startup_timeout_s)
            self._handover()
        if self._inner is not None:
            self._inner._set_num_workers(num_workers)

    def shutdown(self) -> None:
        """NOTE [ raydl shutdown ]: the Ray iterator's, once there; the shadows go with this iterator."""
        if self._inner is not None:
            self._inner.shutdown()
        self._state = _State.SHUT_DOWN
        self._shadows.clear()

    def __next__(self) -> Any:
        if self._inner is not None:
            return next(self._inner)
        if self._state != _State.RUNNING:
            raise StopIteration
        if self.batches_in_driver == 0 and self._max_in_driver != 0:
            # The first batch before Ray's start: importing Ray holds the GIL for most of a second, and a
            # batch whose ops release the GIL would wait for it at each op (up to 5 ms each, sys.getswitchinterval).
            return self._next_in_driver()
        startups = self._start_ray()
        if self._max_in_driver is not None and self.batches_in_driver >= self._max_in_driver:
            return self._hand_over_when_running()
        if all(s.running_now() for s in startups):
            self._handover()
            return next(self._inner)  # type: ignore[arg-type]
        return self._next_in_driver()

    def _hand_over_when_running(self) -> Any:
        """Wait (bounded) for Ray and the workers, hand the epoch over, and go on with the workers."""
        for startup in self._start_ray():
            try:
                startup.wait(self._startup_timeout_s)
            except Exception:  # the Ray iterator reports a failed start as a loader without a cold start does
                break
        self._handover()
        return next(self._inner)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ the driver's part

    def _next_in_driver(self) -> Any:
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            # An epoch made wholly here still ends with Ray up and the workers holding its streams, as
            # without a cold start: a failed start raises here, a persistent loader's next epoch goes on
            # in the workers, and Ray is initialized for what the script does next.
            return self._hand_over_when_running()
        idx = self._send_idx
        self._send_idx += 1
        self.batches_in_driver += 1
        self._tracker.on_draw(idx, self._sampler_iter)
        worker_id = idx % self._num_workers
        try:
            shadow = self._shadow(worker_id)
        except Exception:  # worker_init_fn failed: as a worker's start failing, it ends the iterator
            self._state = _State.EXHAUSTED
            raise
        try:
            batch, meta = shadow.fetch(idx, index)
        except Exception as e:
            self._tracker.on_batch_failed(idx)  # consumed, as a worker's failed batch: the caller may go on
            e.add_note(
                f"raised in the driver, making batch {idx} as raydl worker {worker_id} would while Ray starts "
                "(NOTE [ raydl cold start ]; ray_cold_start=False makes every batch in a worker)"
            )
            raise
        self._tracker.on_batch_made(idx, worker_id, meta)
        self._tracker.on_handed_out()
        return batch

    def _shadow(self, worker_id: int) -> ShadowWorker:
        shadow = self._shadows.get(worker_id)
        if shadow is None:
            loader = self._loader
            assert loader is not None
            shadow = self._shadows[worker_id] = ShadowWorker(
                worker_id,
                self._num_workers,
                self._base_seed,
                loader.dataset,
                self._auto_collation,
                loader.collate_fn,
                loader.worker_init_fn,
                loader.ray_threads_per_worker,
            )
        return shadow

    def _handover(self) -> None:
        """The Ray iterator takes the epoch on from the driver's record of it (NOTE [ raydl cold start ], step 3)."""
        loader = self._loader
        assert loader is not None
        state = self._tracker.state_dict()
        state[RAYDL][GLOBAL_EPOCH] = None  # this rank's epoch goes on as it is: nothing to re-deal
        handover = _Handover(self._sampler_iter, self._base_seed, self._tracker.len_called)
        made = {w: s.batches for w, s in self._shadows.items()}
        self._inner = _RayLoaderIter(loader, state, handover=handover)
        self.stats_recorder = self._inner.stats_recorder
        loader._stats_recorder = self.stats_recorder
        self._loader = None
        self._shadows.clear()
        logger.debug(
            "raydl: cold start: workers take over after %d batches made in the driver %s", self.batches_in_driver, made
        )
