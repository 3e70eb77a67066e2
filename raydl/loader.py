"""`raydl.DataLoader`: torch's DataLoader, with Ray actors as its worker processes."""

from __future__ import annotations

import copy
import logging
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar, Union

from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data import Dataset, IterableDataset, Sampler
from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe

from ._constants import DEFAULT_MAX_WORKER_RESTARTS, DEFAULT_SILENCE_TIMEOUT_S, DEFAULT_STARTUP_TIMEOUT_S
from ._options import RayOptions
from .cluster.connect import worker_actor_options
from .cluster.locality import warn_if_workers_oversubscribe
from .driver.coldstart.iter import ColdStartIter, cold_start_applies
from .driver.inprocess import _InProcessIter
from .driver.iter import _RayLoaderIter
from .driver.lifecycle import EpochIter, StartHold
from .driver.spec import LoaderSpec, index_sampler_of
from .driver.state.draws import restore_next_epoch_rng
from .driver.state.layout import FINISHED, STEPS_SINCE_SNAPSHOT, validate
from .driver.state.samplers import inexact_sampler
from .driver.stats.snapshot import LoaderStats

__all__ = ["DataLoader"]

logger = logging.getLogger(__name__)

T_co = TypeVar("T_co", covariant=True)

_mp_context_warned = False

_ITERABLE_RESIZE_ERROR = (
    "raydl cannot resize the workers of an IterableDataset, so {what}: each replica yields its own "
    "shard, split by get_worker_info().num_workers, and a replica's position cannot move to another "
    "worker without losing or repeating samples. Build a new loader with the num_workers you want."
)
_mp_context_lock = threading.Lock()
# an epoch with Ray workers: from its start, or after its first batches were made here (NOTE [ raydl cold start ])
_RAY_ITERS = (_RayLoaderIter, ColdStartIter)


def _default_cold_start() -> bool | str:
    """ray_cold_start's default: RAYDL_COLD_START=0 turns it off, =in_process opts into the in-process makers."""
    value = os.environ.get("RAYDL_COLD_START", "1")
    return "in_process" if value == "in_process" else value != "0"


def _warn_mp_context_once() -> None:
    global _mp_context_warned
    with _mp_context_lock:
        if _mp_context_warned:
            return
        _mp_context_warned = True
    warnings.warn(
        "raydl.DataLoader ignores multiprocessing_context: its workers are Ray actors, not "
        "processes forked or spawned by this one (a context other than fork only keeps a cold start from forking "
        "its start-up processes: NOTE [ raydl cold start ]).",
        UserWarning,
        stacklevel=3,
    )


class DataLoader(_TorchDataLoader[T_co]):
    """Drop-in replacement for `torch.utils.data.DataLoader` whose `num_workers` workers are Ray actors.

    Every argument of torch's DataLoader means what torch's documentation says, with the same
    defaults and the same errors; `num_workers=0` loads in the calling process exactly as torch
    does. Options only raydl has are keyword-only and start with `ray_`.

    Example (on the Ray this process runs, else on a local one it starts):
        >>> from raydl import DataLoader
        >>> loader = DataLoader(range(10), batch_size=4, num_workers=2)
        >>> [b.tolist() for b in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        >>> [b.tolist() for b in DataLoader(range(10), batch_size=4, num_workers=0)]  # in this process, as torch
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]

    Args (raydl's own; torch's are documented by torch):
        ray_address (str, optional): Ray cluster to connect to on first iteration, e.g.
            "ray://head:10001" or "auto". Defaults to ``None``: `RAY_ADDRESS` if set, else the
            Ray this process already runs, else a local Ray started on loopback.
        ray_remote_args (dict, optional): options for each worker actor, passed to
            `ray.remote(...).options()`: num_cpus, num_gpus, memory, resources,
            label_selector, scheduling_strategy, runtime_env, ... They override raydl's
            defaults key by key. Defaults to ``None`` (`{"num_cpus": 0}`: workers reserve no
            CPU, like torch's processes, so they always fit; with no resource beyond that, no
            label_selector and no scheduling_strategy, raydl gives each worker its node:
            NOTE [ raydl placement ]).
        ray_startup_timeout_s (float): seconds to wait for every worker to be placed and to
            finish start-up before raising `WorkerPlacementError`. Defaults to ``60.0``.
        ray_shared_dataset_memory (bool): ship the dataset as a Ray object, so NumPy arrays in
            it are shared read-only by all workers of a node (one copy per node instead of one
            per worker). Defaults to ``False``: each worker gets a private writable copy, as
            with torch.
        ray_max_worker_restarts (int): how many times each worker may be replaced after it dies
            (its process exits or is killed, or its node leaves); its in-flight batches are
            resent, so no batch is lost or repeated. One more death raises `WorkerDiedError`
            naming the batch it was making. ``0`` disables recovery. Defaults to ``3``.
        ray_reuse_workers (bool): when this loader's workers end cleanly and reserve no Ray
            resources (the default num_cpus=0; workers holding CPUs, GPUs or custom resources
            are never kept idle), keep their started processes warm for the next loader with
            the same ray_remote_args (its first batch then skips process start-up); idle ones are released after
            RAYDL_IDLE_WORKER_TIMEOUT_S seconds (120), at exit, or by
            `raydl.release_idle_workers()`. ``False``: always new processes, killed at the end.
            Defaults to ``True``.
        ray_threads_per_worker (int): threads each worker uses to fetch the samples of a batch,
            for I/O-bound datasets (remote reads, decoders that release the GIL). Batch content
            and order stay deterministic (draws from global RNGs inside __getitem__ are then
            not). Map-style datasets without __getitems__ only. Defaults to ``1``.
        ray_device (str or torch.device, optional): a CUDA device ("cuda", "cuda:1"): batches
            are handed to the loop already on it, copied from pinned memory with
            non_blocking=True on a side stream in the pin thread, so the copy of batch k+1
            overlaps the step on batch k (the current stream waits on the copy's event).
            Implies pinning. Defaults to ``None`` (batches stay on the CPU, as torch's).
        ray_seed (str): ``"worker"``: torch's seeding (worker `i` seeds `random`, torch and NumPy
            once, from the iterator's base seed + `i`). ``"batch"``: before each batch, its worker
            also seeds them from (base seed, the batch's position in the epoch) with NumPy's
            SeedSequence, so a batch's random draws do not depend on which worker makes it (the
            same with 1 or 64 workers, after a replacement); num_workers=0 seeds each batch the
            same way in the calling process and restores the caller's generators after it. See
            NOTE [ raydl batch seeding ]. ``"sample"`` (map-style datasets): right before each
            `dataset[i]`, `random`, torch and NumPy are seeded from (key, epoch, i), the key and
            epoch being a `DistributedSampler`'s seed and epoch when there is one (else the base
            seed's and the iterator's): a sample's draws depend only on its index, not on its
            batch, worker, rank or the world size (8 us per sample; NOTE [ raydl sample
            seeding ]). Defaults to ``"worker"``; ``"batch"`` with `ray_job`, and with
            ``shuffle=True`` over a streamed dataset whose order is cut over node slots
            (`ParquetDataset`, `TarDataset`, `FileDataset`: NOTE [ raydl node slots ]), whose
            batches are made on the node that caches their units, whatever worker that is.
        ray_job (bool or str, optional): share one pool of `num_workers x world size` workers
            between every rank of a training job (NOTE [ raydl job pool ]): ``True`` names the
            job after the launcher (torchrun, Ray Train, MASTER_ADDR:MASTER_PORT), a str names it.
            Each rank keeps its own order and state; batches go to the job's least busy worker;
            ``ray_seed`` defaults to ``"batch"`` then (``"worker"`` is refused); `set_num_workers`
            and ``ray_max_workers`` (per rank) act on the job's pool. Defaults to ``None`` (a
            pool per loader).
        ray_max_workers (int, optional): autoscale between `num_workers` and this many workers
            while iterating: a worker is added while the loop waits for data more than 10% of
            its time (and the cluster has room for one now), and extra workers are retired when
            batches sit ready long before they are taken; each decision is logged at INFO.
            Map-style datasets only. Defaults to ``None`` (a fixed pool; see `set_num_workers`).
        ray_stats (bool): record per-worker figures and the loop's data stall (`loader.stats()`,
            `stats.timeline()`), export them as Ray metrics, and log a hint when an epoch waited
            on data more than 20% of its time (NOTE [ raydl stats ]). Defaults to ``True``.
        ray_name (str, optional): the loader's name in stats, hints and the `loader` tag of
            Ray metrics. Defaults to ``None``: the dataset's class name.
        ray_batches_per_call (int or "auto"): how many of a worker's batches one actor call
            carries (NOTE [ raydl calls ]). ``"auto"``: as many as the worker makes in 5 ms, at
            most 8 and at most its share of the prefetch bound (``prefetch_factor``), 1 for
            batches of 5 ms or more, and for a worker on another node on Ray's calls no more than
            Ray sends inline with the reply (75 KiB); an int fixes the most (1: one call per batch). The batches
            are the same either way. Defaults to ``"auto"``.
        ray_cold_start (bool or str): in a process that has not used Ray yet, the first `iter()`
            starts Ray and the workers in the background and, meanwhile, forks one start-up
            process per worker from this one, as torch forks its workers: each makes its worker's
            first batches exactly as the worker would (torch's seeds, worker_init_fn,
            get_worker_info(), its random streams), until the workers run and take the epoch on
            from where those streams stand. The batches are torch's, the first one comes about
            as soon as torch's, and no dataset code runs in this process: a start-up process that
            dies is replaced as a worker is, and `timeout` holds for its batches. Map-style
            datasets with ray_seed="worker", without pinning, ray_device or ray_job, where this
            process may fork (NOTE [ raydl cold start ]). ``"in_process"``: those first batches
            are made in this process instead (no fork; user code then runs here, where a crash
            ends the training process). ``False``: every batch is made in a worker, after Ray and
            the workers started. Defaults to ``None``: ``True`` unless the environment sets
            ``RAYDL_COLD_START=0`` (or ``=in_process``).
        ray_lane (bool): a worker on this process's node whose batches are at most 4 MiB of
            arrays (they are copied through the socket, where Ray's object store maps larger
            ones without a copy) gets its calls over a local socket (a "lane")
            instead of one Ray actor call each, once it started: a batch then costs the trainer's
            core under a third as much (NOTE [ raydl lane ] in raydl/worker/lane.py). A worker on
            another node gets a TCP lane to this process's node whatever its batches' size (a
            thread here reads each batch as it arrives: one copy, where Ray's transfer costs both
            nodes' raylets). ``ray_job`` and Ray Client keep Ray's calls. The batches are the same
            either way. ``False``: every call through Ray. Defaults to ``True``.
        ray_silence_timeout_s (float): a worker on another node writes at least a heartbeat on
            its TCP lane every 0.5 s; when nothing arrives on a lane the loader waits on for
            this many seconds, the worker's node is taken as silent (a frozen VM, a dead link:
            no error ever comes): the worker is replaced elsewhere and its batches remade, every
            batch once and in order, and no worker is placed on that node until Ray reaches it
            again (NOTE [ raydl silent node ] in raydl/cluster/silent_nodes.py; docs/faults.md).
            Over Ray's calls (``ray_lane=False``, ``ray_job``), after this long with nothing from
            a worker on another node, one TCP connection to its node's raylet tells a silent node
            (no answer) from a slow batch.
            Lower: a silent node costs less; higher: fewer false alarms (one worker replaced each)
            when workers hold the GIL in native code for long. At least 2. ``None``: TCP's and
            Ray's own timeouts decide (about a minute). Defaults to ``4.0``.

    Construction has no side effects: Ray starts, and actors are created, on first iteration
    (in the background on a cold start: see ``ray_cold_start``).

    Mid-epoch resume: `state_dict()` / `load_state_dict()` behave as torchdata's
    `StatefulDataLoader`'s, with its state layout (either loader loads the other's state), and
    continue bit-exactly, worker-side random draws included (docs/resume.md).
    """

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: Optional[int] = 1,
        shuffle: Optional[bool] = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler[list] | Iterable[list] | None = None,
        num_workers: int = 0,
        collate_fn: Optional[Callable[[list], Any]] = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Optional[Callable[[int], None]] = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        ray_address: Optional[str] = None,
        ray_remote_args: Optional[Mapping[str, Any]] = None,
        ray_startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        ray_shared_dataset_memory: bool = False,
        ray_max_worker_restarts: int = DEFAULT_MAX_WORKER_RESTARTS,
        ray_reuse_workers: bool = True,
        ray_threads_per_worker: int = 1,
        ray_device: Any = None,
        ray_seed: Optional[str] = None,
        ray_max_workers: Optional[int] = None,
        ray_stats: bool = True,
        ray_name: Optional[str] = None,
        ray_job: Any = None,
        ray_batches_per_call: int | str = "auto",
        ray_cold_start: Union[bool, str, None] = None,
        ray_lane: bool = True,
        ray_silence_timeout_s: Optional[float] = DEFAULT_SILENCE_TIMEOUT_S,
    ) -> None:
        if ray_job is False:
            ray_job = None
        if batch_size is not None and callable(getattr(sampler, "rank_batch_slots", None)):
            if getattr(sampler, "batch_size", 0) is None:  # NOTE [ raydl distributed slots ]: dealt in our batches
                sampler.batch_size = batch_size
        if ray_seed is None:  # torch's per-worker seeding, unless the ranks share the workers or batches go by node
            ours = sampler is None or (
                callable(getattr(sampler, "rank_batch_slots", None)) and bool(getattr(sampler, "shuffle", False))
            )
            by_node = (shuffle or sampler is not None) and ours and batch_sampler is None and batch_size is not None
            slots = getattr(dataset, "node_slots", 1)  # None: one slot a node (NOTE [ raydl node slots ])
            by_node = by_node and (slots > 1 if slots is not None else hasattr(dataset, "raydl_shuffle_sampler"))
            ray_seed = "worker" if ray_job is None and not by_node else "batch"
        options = RayOptions(
            address=ray_address,
            remote_args=ray_remote_args,
            startup_timeout_s=ray_startup_timeout_s,
            shared_dataset_memory=ray_shared_dataset_memory,
            max_worker_restarts=ray_max_worker_restarts,
            reuse_workers=bool(ray_reuse_workers),
            threads_per_worker=ray_threads_per_worker,
            device=ray_device,
            seed=ray_seed,
            max_workers=ray_max_workers,
            stats=ray_stats,
            name=ray_name,
            job=ray_job,
            batches_per_call=None if ray_batches_per_call == "auto" else ray_batches_per_call,
            # None: the process-wide default, RAYDL_COLD_START (NOTE [ raydl cold start ])
            cold_start=_default_cold_start() if ray_cold_start is None else ray_cold_start,
            lane=ray_lane,
            silence_timeout_s=ray_silence_timeout_s,
        )
        if multiprocessing_context is not None and num_workers > 0:
            _warn_mp_context_once()
        # Set before torch's __init__, which locks some attributes once it finishes.
        self.ray_address = options.address
        self.ray_remote_args = dict(options.remote_args) if options.remote_args is not None else None
        self.ray_startup_timeout_s = float(options.startup_timeout_s)
        self.ray_shared_dataset_memory = bool(options.shared_dataset_memory)
        self.ray_max_worker_restarts = options.max_worker_restarts
        self.ray_reuse_workers = options.reuse_workers
        self.ray_threads_per_worker = options.threads_per_worker
        self.ray_device = options.device
        self.ray_seed = options.seed
        self.ray_job = options.job
        self.ray_max_workers = options.max_workers
        self.ray_batches_per_call = "auto" if options.batches_per_call is None else options.batches_per_call
        self.ray_cold_start = options.cold_start
        self.ray_lane = options.lane
        self.ray_silence_timeout_s = options.silence_timeout_s
        self._ray_iters: weakref.WeakSet = weakref.WeakSet()  # live iterators, for set_num_workers
        self.ray_stats = options.stats
        self.ray_name = options.name
        self._stats_recorder: Any = None  # the last iterator's (NOTE [ raydl stats ]); never the iterator itself
        self.shuffle = shuffle
        # the RandomSampler shuffle=True makes (its state goes where torchdata's shuffle sampler keeps its own)
        self._default_shuffle = bool(shuffle) and sampler is None and batch_sampler is None
        self._next_iter_state: Optional[Mapping] = None  # from load_state_dict, for the next iter()
        self._state_source: Any = None  # what state_dict() reads: the last iterator's (or its tracker)
        self._prepared_iter: Any = None  # made by state_dict() before any iteration; the next iter() returns it
        self._start_hold: Optional[StartHold] = None  # NOTE [ raydl start hold ] in driver/lifecycle.py
        torch_shuffle = shuffle
        if shuffle and sampler is None and batch_sampler is None and hasattr(dataset, "raydl_shuffle_sampler"):
            # the dataset supplies what shuffle=True means over it (NOTE [ raydl unit order ] in data/unit_order.py)
            sampler, torch_shuffle = dataset.raydl_shuffle_sampler(generator, batch_size), False
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=torch_shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        if ray_max_workers is not None:
            if num_workers == 0:
                raise ValueError("ray_max_workers needs num_workers >= 1 (num_workers=0 loads in this process)")
            if ray_max_workers < num_workers:
                raise ValueError(
                    f"ray_max_workers ({ray_max_workers}) should be at least num_workers ({num_workers}), "
                    "the size the autoscaler never goes below"
                )
            if isinstance(dataset, IterableDataset):
                raise ValueError(_ITERABLE_RESIZE_ERROR.format(what="ray_max_workers is not supported"))
        if self.ray_job is not None and isinstance(dataset, IterableDataset):
            raise ValueError(
                "ray_job shares one pool between the ranks, and an IterableDataset's replica stream belongs to one "
                "rank's worker: use a map-style dataset with a DistributedSampler, or leave ray_job unset"
            )
        if self.ray_seed == "sample" and isinstance(dataset, IterableDataset):
            raise ValueError(
                "ray_seed='sample' seeds each sample from its index, and an IterableDataset's samples have none: "
                "use ray_seed='batch' (each batch seeded from its position) or a map-style dataset"
            )

    def check_worker_number_rationality(self) -> None:
        """torch's warning about more workers than this host's CPUs, given only when every worker runs on this host.

        Workers that can go to other nodes do not share this host's CPUs: no warning then. See
        NOTE [ raydl worker-count warning ] in cluster/locality.py.
        """
        warn_if_workers_oversubscribe(self, worker_actor_options(self.ray_remote_args), at_construction=True)

    def _get_iterator(self):
        # Kept for code that calls torch's private factory directly.
        if self.num_workers == 0:
            state, self._next_iter_state = self._next_iter_state, None
            if isinstance(self.dataset, (IterDataPipe, MapDataPipe)) and self.ray_seed == "worker":
                return super()._get_iterator()  # torch's own path (sharding, shared seed)
            it = _InProcessIter(LoaderSpec.of(self), state)
            self._state_source = it.checkpoint
            return it
        return self._new_iterator()

    def _new_iterator(self, state: Optional[Mapping] = None) -> EpochIter:
        spec = LoaderSpec.of(self)  # what the iterator reads of this loader, as of now
        it: EpochIter = ColdStartIter(spec) if cold_start_applies(spec, state) else _RayLoaderIter(spec, state)
        self._live_iters().add(it)
        self._stats_recorder = it.stats_recorder  # NOTE [ raydl stats ]: the recorder, never the iterator
        self._state_source = it.checkpoint  # never the iterator: a dropped one is released, except
        self._start_hold = StartHold.of(it)  # while its workers' start snapshots are not in (NOTE [ raydl start hold ])
        return it

    def _live_iters(self) -> weakref.WeakSet:
        if "_ray_iters" not in self.__dict__:  # an unpickled copy
            self._ray_iters = weakref.WeakSet()
        return self._ray_iters

    def __iter__(self):
        if self._prepared_iter is not None:
            it, self._prepared_iter = self._prepared_iter, None
            return it
        state = self._next_iter_state
        if self.num_workers == 0:
            it = super().__iter__()  # _get_iterator resumes from the loaded state (replaying an iterable without state)
            if state is not None and state.get(FINISHED):  # as torchdata: on into the next epoch
                restore_next_epoch_rng(state)
                it = super().__iter__()
            return it
        self._next_iter_state = None
        if self.persistent_workers:
            if state is None and isinstance(self._iterator, _RAY_ITERS) and self._iterator.reusable:
                self._iterator.next_epoch(self._IterableDataset_len_called)
                self._state_source = self._iterator.checkpoint
            else:
                if isinstance(self._iterator, _RAY_ITERS):  # a loaded state starts its own workers
                    self._iterator.shutdown()
                self._iterator = self._new_iterator(state)
            it = self._iterator
        else:
            it = self._new_iterator(state)
        if state is not None:
            it = self._resume(it, state)
        return it

    def _resume(self, it: EpochIter, state: Mapping) -> EpochIter:
        """After a loaded state: replay what cannot be positioned, and go on into the next epoch if it had ended."""
        for _ in range(it.checkpoint.replay + int(state.get(STEPS_SINCE_SNAPSHOT) or 0)):
            try:
                next(it)
            except StopIteration:
                break
        if state.get(FINISHED):  # as torchdata: a state taken after StopIteration resumes into the next epoch
            restore_next_epoch_rng(state)
            if self.persistent_workers:
                it.next_epoch(self._IterableDataset_len_called)
            else:
                it.shutdown()
                it = self._new_iterator()
        return it

    def state_dict(self) -> dict:
        """The state of the iterator most recently created, as of the last batch it handed out.

        Same semantics and layout as torchdata's `StatefulDataLoader.state_dict()`: plain data
        (survives `torch.save` / `torch.load(weights_only=True)`; JSON wherever torchdata's is),
        never changed by later iteration; called before any iteration it describes the iterator
        the next `iter()` returns; right after `load_state_dict()` it returns the loaded state.
        It never waits on workers: the driver already holds their state (NOTE [ raydl checkpoint ]).
        """
        reason = inexact_sampler(index_sampler_of(self))
        if reason is not None and not self.__dict__.get("_warned_inexact"):
            self._warned_inexact = True  # once per loader
            warnings.warn(f"DataLoader.state_dict(): {reason}", UserWarning, stacklevel=2)
        if self._next_iter_state is not None:
            return copy.deepcopy(dict(self._next_iter_state))
        if self._state_source is None:
            self._prepared_iter = iter(self)
        return self._state_source.state_dict()

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Resume from `state_dict` (raydl's or StatefulDataLoader's) at the next `iter()`.

        The next iteration hands out exactly the batches the saved run had not handed out yet,
        with worker-side random draws continuing as they would have. `{}` is ignored, as torchdata does.

        Raises:
            ValueError: `state_dict` is not a loader state, or was saved by a loader with another
                num_workers, dataset length, batch size or sampler type (the message names it).
        """
        if isinstance(state_dict, Mapping) and len(state_dict) == 0:
            return
        validate(state_dict, self)
        if isinstance(self._prepared_iter, _RAY_ITERS) and self._prepared_iter is not self._iterator:
            self._prepared_iter.shutdown()
        self._prepared_iter = None
        self._next_iter_state = copy.deepcopy(dict(state_dict))  # by value: the caller may reuse or change theirs

    def set_num_workers(self, num_workers: int) -> None:
        """Resize the worker pool to `num_workers`, now: mid-epoch, in every live iterator, and for later ones.

        New workers join the round robin once started (`next()` never waits for them); removed
        ones stop getting batches at once and end after the batches they are making have been
        handed out. Every batch is still handed out exactly once, in sampler order with
        in_order=True; with `ray_seed="batch"` the batches are identical to a fixed pool's.
        Under `ray_job` it resizes the job's pool to `num_workers x world size` for every rank
        (NOTE [ raydl job elastic ]).
        Persistent workers keep the new size for the next epochs; with `ray_max_workers` the new
        size is the autoscaler's floor. See docs/faults.md.

        Args:
            num_workers (int): the new size, at least 1 and at most `ray_max_workers` when set.

        Raises:
            ValueError: a bad size, a loader created with num_workers=0, or an IterableDataset
                (its replicas are sharded by num_workers: resizing would lose or repeat samples).
        """
        n = num_workers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"set_num_workers expects a positive int, got {n!r}")
        if self.num_workers == 0:
            raise ValueError(
                "set_num_workers needs a loader created with num_workers >= 1: num_workers=0 loads in this "
                "process, without workers to resize (and without a prefetch_factor)"
            )
        if isinstance(self.dataset, IterableDataset):
            raise ValueError(_ITERABLE_RESIZE_ERROR.format(what="set_num_workers is refused"))
        if self.ray_max_workers is not None and n > self.ray_max_workers:
            raise ValueError(f"set_num_workers({n}) exceeds ray_max_workers={self.ray_max_workers}")
        self.num_workers = n
        for it in list(self._live_iters()):
            it.resize(n)

    def stats(self) -> Optional[LoaderStats]:
        """Figures of the current (or last) epoch: data stall, per-worker times, bytes, restarts.

        Returns a `raydl.LoaderStats` (`print(loader.stats())` shows a table;
        `loader.stats().timeline("epoch.json")` writes a Chrome trace and a PNG), or None before
        the first iteration. See NOTE [ raydl stats ] in driver/stats/recorder.py.

        Example:
            >>> from raydl import DataLoader
            >>> loader = DataLoader(range(8), batch_size=2, num_workers=2, ray_name="digits")
            >>> _ = list(loader)
            >>> stats = loader.stats()
            >>> stats.name, stats.finished, stats.batches, stats.samples, len(stats.workers)
            ('digits', True, 4, 8, 2)
            >>> sum(w.batches for w in stats.workers)
            4
            >>> print(stats)  # the data stall first, then one row per worker
            raydl loader 'digits', epoch 0 (finished): 4 batches, 8 samples in ... s; the loop waited for data ...
            in flight: 0 batches, ...
            worker  node ... restarts
            ...

        Raises:
            RuntimeError: num_workers=0 (torch's in-process loading, nothing to measure here), or
                ray_stats=False.
        """
        if self.num_workers == 0:
            raise RuntimeError(
                "raydl stats cover Ray workers: this loader has num_workers=0 (torch's in-process loading)"
            )
        if not self.ray_stats:
            raise RuntimeError("stats are off for this loader (ray_stats=False); pass ray_stats=True to record them")
        recorder = self._stats_recorder
        return recorder.snapshot() if recorder is not None else None

    @property
    def worker_records(self) -> list:
        """Where the persistent workers run (worker id, pid, node); empty before the first iteration."""
        return self._iterator.worker_records if isinstance(self._iterator, _RAY_ITERS) else []

    def shutdown(self) -> None:
        """Release the persistent workers now (idempotent); the next iteration starts new ones."""
        if isinstance(self._iterator, _RAY_ITERS):
            self._iterator.shutdown()
        self._iterator = None
        self._start_hold = None

    def __enter__(self) -> DataLoader[T_co]:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_iterator"] = None  # actors belong to this process's loader, not to a copy
        state["_state_source"] = None
        state["_prepared_iter"] = None
        state["_start_hold"] = None
        state.pop("_ray_iters", None)
        state["_stats_recorder"] = None
        return state
