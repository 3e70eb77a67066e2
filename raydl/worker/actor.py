"""The worker actor: one per `num_workers`, doing what torch's worker process does.

NOTE [ raydl seeding ]
torch draws one `base_seed` per iterator from the loader's `generator` (or torch's default
RNG) and gives worker `i` the seed `base_seed + i` for `random` and `torch`, and NumPy a
32-bit state array derived from `(base_seed, i)`. torch's derivation is NumPy's SeedSequence
applied to the entropy `[i, base_seed & 0xFFFFFFFF, base_seed >> 32, 0]`, so raydl uses
NumPy's public SeedSequence with that entropy (tests/test_units.py checks the two agree).
A raydl worker seeds itself exactly so, sets the worker info, then runs `worker_init_fn`:
augmentations drawn in workers match torch's batch for batch.
With `ray_seed="batch"` (`WorkerPayload.seed_per_batch`), the worker also re-seeds `random`,
torch and NumPy right before each batch, from (base_seed, epoch, task idx): a batch's draws then
depend on its position in the epoch, not on the worker (NOTE [ raydl batch seeding ] in
worker/seeding.py). The per-worker seeding above still runs first (worker_init_fn and `iter(dataset)`
see torch's seeds), and `get_worker_info().seed` is still `base_seed + worker_id`.

raydl touches torch's private parts in two places, both checked against torch 2.13. Here:
`get_worker_info()` reads the module global `torch.utils.data._utils.worker._worker_info`, which
this module sets inside the actor so datasets that shard with torch's own function work unchanged
(worker/collate.py clears it around a collate). And worker/collate.py asks how many hold a
storage (`torch._C._storage_Use_Count`) before it reuses a batch buffer; without that call it
reuses none (NOTE [ raydl collate buffers ]).
"""

from __future__ import annotations

import inspect
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.utils.data._utils.worker as _torch_worker
from torch.utils.data import default_collate

from .._errors import TRACEBACK_ATTR, annotate_traceback
from .._measures import batch_nbytes, observe_batch_time
from ..data.share import open_payload
from .collate import BatchBuffers
from .datapipes import seed_pipe, shard_pipe
from .fetch import IterableFetcher, MapFetcher, StartFailed, StreamEnd, _WorkerSignal
from .lane import Turns, serve_lane
from .seeding import seed_batch, seed_sample
from .state import (
    DATASET_ITER_STATE,
    DATASET_STATE,
    FETCHER_STATE,
    RNG,
    RngTracker,
    by_value,
    is_stateful,
    make_worker_snapshot,
    restore_rng,
)
from .transfer import encode

__all__ = ["WorkerPayload", "BatchMeta", "BatchFailed", "WorkerBody", "numpy_seed_state", "get_worker_info"]


def _not_begun(fetcher: Any) -> bool:
    """Whether an iterable's stream is a generator whose body has not run yet (its dataset's `__iter__` is one)."""
    it = getattr(fetcher, "dataset_iter", None)
    return inspect.isgenerator(it) and inspect.getgeneratorstate(it) == inspect.GEN_CREATED


@dataclass(frozen=True)
class WorkerPayload:
    """What every worker needs, put into the object store once per pool (not once per worker)."""

    dataset: Any
    is_iterable: bool
    auto_collation: bool
    collate_fn: Callable
    drop_last: bool
    worker_init_fn: Optional[Callable[[int], None]]
    threads_per_worker: int = 1
    seed_per_batch: bool = False  # ray_seed="batch" (NOTE [ raydl batch seeding ])
    # Each task comes as (seed key, work): ("sample", key, epoch) seeds each sample (NOTE [ raydl sample
    # seeding ]), ("batch", base seed, epoch, idx, rank) the batch for a rank of a job (NOTE [ raydl job pool ]).
    keyed_seeds: bool = False
    stats_name: Optional[str] = None  # the loader's name for Ray metrics; None: ray_stats=False
    # A DataPipe dataset (NOTE [ raydl datapipes ] in worker/datapipes.py): torch's distributed (world size, rank) for
    # its sharding; with `pipe_seeds` (an IterDataPipe) each task comes as (the epoch's shared seed, work).
    pipe_world: Optional[tuple] = None
    pipe_seeds: bool = False


@dataclass(frozen=True)
class BatchMeta:
    """What a worker reports about one task, returned beside the batch (`fetch` has two returns).

    Small, so Ray inlines it in the task's reply: the driver reads it without touching the
    batch's buffers.
    """

    worker_id: int
    idx: int  # the task's idx in its epoch (the driver's send order)
    started_s: float  # time.time() in the worker when the fetch began
    fetch_s: float  # seconds spent making the batch (fetch, collate, encode)
    # NOTE [ raydl stats ] in driver/stats/recorder.py; left at 0 with ray_stats=False. samples == 0: a signal, not a batch.
    samples: int = 0
    nbytes: int = 0  # bytes of the batch's array data, as encoded
    cpu_s: float = 0.0  # CPU seconds of this process while making it (far below fetch_s: waiting on I/O)
    # NOTE [ raydl checkpoint ] (driver/state/checkpoint.py): the worker's state after this task, so the
    # driver holds every worker's state as of the last batch it handed out without asking.
    state: Optional[dict] = None  # torchdata's worker snapshot; None: a map-style dataset without state
    rng: Optional[dict] = None  # the random/torch/NumPy states; None: unchanged since this worker's last meta
    signal: bool = False  # the task returned a signal (end of an iterable stream), not a batch


class BatchFailed:
    """In a call's batches (`Worker.fetch_many`): the making of this batch raised in user code.

    The error travels as a value, so the call's other batches are kept; the driver raises it
    (torch's reraise, with the worker's traceback text) when the batch's turn comes.
    """

    __slots__ = ("error", "traceback")

    def __init__(self, error: BaseException, traceback_text: str) -> None:
        self.error = error
        self.traceback = traceback_text

    def __reduce__(self):
        return (type(self), (self.error, self.traceback))


def _portable_error(error: BaseException) -> BaseException:
    """`error` if Ray can pickle it to the driver, else a RuntimeError saying what it was."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(
            f"{type(error).__module__}.{type(error).__qualname__}: {error} (the exception itself could not be pickled)"
        )


def numpy_seed_state(base_seed: int, worker_id: int) -> list[int]:
    """The NumPy seed torch gives worker `worker_id` for `base_seed` (see NOTE [ raydl seeding ])."""
    entropy = [worker_id, base_seed & 0xFFFFFFFF, base_seed >> 32, 0]
    return np.random.SeedSequence(entropy).generate_state(4).tolist()


def get_worker_info() -> Optional[Any]:
    """The current worker's `torch.utils.data.WorkerInfo` inside a raydl worker; None in the driver.

    Same object as `torch.utils.data.get_worker_info()` returns, so either function works.
    """
    return torch.utils.data.get_worker_info()


def _sendable_reply(reply: tuple[list, list], error: BaseException) -> tuple[list, list]:
    """A lane reply that could not be pickled (`error`): each batch that cannot be becomes a `BatchFailed` carrying
    its pickling error, raised in the driver at its turn (as Ray's call raises a return it cannot serialize)."""
    from .lane import dumps_reply

    batches, metas = reply
    out = []
    for batch in batches:
        try:
            dumps_reply(batch)
            out.append(batch)
        except Exception as e:  # noqa: BLE001 - the batch's own pickling error, for the user
            why = f"the batch could not be sent to your process: {e} (a batch must be picklable to leave its worker)"
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, chain=False))
            out.append(BatchFailed(_portable_error(TypeError(why)), f"{tb}TypeError: {why}\n"))
    return out, metas


def _describe_process() -> dict:
    import ray

    ctx = ray.get_runtime_context()
    return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address()}


# Ray's log monitor names an actor's log lines after the last line starting with this in its
# stdout or stderr (Ray writes one with the actor's repr when the actor starts; ray_constants
# LOG_PREFIX_ACTOR_NAME). A worker learns its id later, at configure, and a warm worker changes it.
_LOG_NAME_PREFIX = ":actor_name:"


def _announce_name(worker: Any) -> None:
    """Name this actor's later log lines after its current repr (its worker id)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            print(f"{_LOG_NAME_PREFIX}{worker!r}", file=stream, flush=True)
        except (OSError, ValueError):  # a closed stream: no log lines to name either
            pass


class WorkerBody:
    """Body of the raydl worker actor: the actor Ray runs is worker/shell.py's `Worker`, which builds one of these in
    its process and hands it every call (NOTE [ raydl worker shell ]); `ray.remote` is applied by the pool, with the
    user's options.

    An actor starts blank (its process has imported torch and raydl) and is given a loader's
    payload by `configure()`, which seeds it, sets the worker info and runs worker_init_fn; a
    blank actor can therefore be kept warm and configured for the next loader in milliseconds
    (see cluster/warm.py). `fetch()` makes one batch; `reset()` drops the loader's state before the
    actor goes back to the warm pool. An exception in user code escapes `configure`/`fetch`, so
    Ray carries its type and traceback to the driver (NOTE [ raydl errors ]).
    """

    def __init__(self) -> None:
        torch.set_num_threads(1)
        # one fetch at a time and in the order sent, by a Ray call or over a lane (NOTE [ raydl lane ] in worker/lane.py)
        self._turns = Turns()
        self._worker_id = -1
        self._payload: Optional[WorkerPayload] = None
        self._fetcher: MapFetcher | IterableFetcher | None = None
        self._init_error: Optional[BaseException] = None
        self._epoch = 0
        self._epoch_start: Optional[dict] = None  # an iterable's snapshot as its stream restarted for `_epoch`
        self._base_seed = 0
        self._rng = RngTracker()
        self._track_rng = True
        self._buffers = BatchBuffers()
        # False in a cold start's start-up process (worker/startup.py), which has no Ray: no Ray metrics, log names
        # or runtime context there
        self.in_actor = True

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with this.
        return f"raydl.Worker(id={self._worker_id})"

    def configure(
        self,
        payload: WorkerPayload | bytes,
        worker_id: int,
        num_workers: int,
        base_seed: int,
        worker_state: Optional[dict] = None,
        track_rng: bool = True,
        epoch: int = 0,
        pipe_seed: Optional[int] = None,
    ) -> dict:
        """Become worker `worker_id` of a loader, as torch's worker process starts; returns where it runs
        (`pid`, `node_id`, `node_ip`) and its snapshot as it starts (`state`, None for a map-style dataset
        without state): torchdata's startup state, which a loader state taken before the worker's first
        batch reports (NOTE [ raydl checkpoint ]).

        `worker_state`: a snapshot from a loader state (NOTE [ raydl checkpoint ]): after seeding
        and worker_init_fn, the dataset's state, then its iterator's, then the generators' are
        restored from it, in torchdata's order. `track_rng`: report the generators' state with
        each batch (off only to measure what tracking costs). `epoch`: the iterator's epoch
        the worker joins (a resumed or replaced persistent worker). `pipe_seed`: that epoch's
        shared seed of an IterDataPipe (NOTE [ raydl datapipes ]).

        Raises the error of unpickling the payload, of `worker_init_fn` or of `iter(dataset)`.
        """
        self.reset()
        self._epoch = epoch
        self._worker_id = worker_id
        if self.in_actor:
            _announce_name(self)
        self._base_seed = base_seed
        try:
            # bytes by default: a private, writable copy, as torch's workers get (NOTE [ raydl shared memory ])
            payload = open_payload(payload)
            self._payload = payload
            seed = base_seed + worker_id
            random.seed(seed)
            torch.manual_seed(seed)
            np.random.seed(numpy_seed_state(base_seed, worker_id))
            seed_pipe(payload.dataset, pipe_seed)  # NOTE [ raydl datapipes ]: torch's order, seed then info
            _torch_worker._worker_info = _torch_worker.WorkerInfo(
                id=worker_id, num_workers=num_workers, seed=seed, dataset=payload.dataset
            )
            if payload.pipe_world is not None:
                shard_pipe(payload.dataset, num_workers, worker_id, payload.pipe_world)
            if payload.worker_init_fn is not None:
                payload.worker_init_fn(worker_id)
            self._track_rng = track_rng
            if worker_state is None:
                self._fetcher = self._make_fetcher()
            else:
                self._restore(worker_state)
            state = make_worker_snapshot(worker_id, self._fetcher, payload.dataset, payload.is_iterable)
            if worker_state is not None and state is not None and _not_begun(self._fetcher):
                # a generator `__iter__` takes a loaded state in its body, which first runs at the first batch: until
                # then the loaded state is the dataset's, not what the copy reports (NOTE [ raydl checkpoint ])
                state = {**state, DATASET_STATE: worker_state.get(DATASET_STATE)}
        except Exception as e:
            annotate_traceback(e)
            self._init_error = e
            raise
        return {**(_describe_process() if self.in_actor else {"pid": os.getpid()}), "state": state}

    def _restore(self, state: dict) -> None:
        """Take back a worker snapshot (torchdata's order: dataset, then its iterator; then the generators)."""
        p = self._payload
        assert p is not None
        # by value: a dataset may keep what it loads and mutate it (NOTE [ raydl state by value ] in worker/state.py)
        if state.get(DATASET_STATE) is not None and is_stateful(p.dataset):
            p.dataset.load_state_dict(by_value(state[DATASET_STATE]))
        self._fetcher = self._make_fetcher()
        fetcher_state = state.get(FETCHER_STATE)
        if p.is_iterable and fetcher_state is not None:
            it_state = fetcher_state.get(DATASET_ITER_STATE)
            if it_state is not None and is_stateful(self._fetcher.dataset_iter):
                self._fetcher.dataset_iter.load_state_dict(by_value(it_state))
            # As torchdata: an ended stream is asked once more, and says so again.
            self._fetcher.ended = False
        if state.get(RNG) is not None:
            restore_rng(state[RNG])

    def reset(self) -> None:
        """Forget the current loader (dataset, fetcher, worker info) so the process can serve another."""
        self._turns.new_loader()  # after a lane's fetch in progress; its queued calls are not made (NOTE [ raydl lane ])
        self._payload = None
        self._fetcher = None
        self._buffers.clear()
        self._init_error = None
        self._epoch = 0
        self._epoch_start = None
        self._rng.reset()
        _torch_worker._worker_info = None

    def _make_fetcher(self) -> MapFetcher | IterableFetcher:
        p = self._payload
        assert p is not None
        # torch's default_collate into buffers this worker reuses (NOTE [ raydl collate buffers ] in worker/collate.py)
        collate = self._buffers if p.collate_fn is default_collate else p.collate_fn
        if p.is_iterable:
            return IterableFetcher(p.dataset, p.auto_collation, collate, p.drop_last)
        return MapFetcher(
            p.dataset, p.auto_collation, collate, p.threads_per_worker, columnar=p.collate_fn is default_collate
        )

    def fetch_many(self, epoch: int, tasks: list) -> tuple[list, list]:
        """One call of the driver (NOTE [ raydl calls ] in driver/schedule.py): tasks `[(idx, work), ...]` made in
        order, as `fetch` makes each. Called with `num_returns=2`: returns their batches (a batch, a signal, or a
        `BatchFailed` when user code raised: the next tasks are still made, as a torch worker goes on after an
        error) and their `BatchMeta`s."""
        return self._turns.ray_call(lambda: self._fetch_many(epoch, tasks))

    def open_lane(self, address: str, token: bytes) -> bool:
        """Take this loader's calls over the driver's lane at `address` too (NOTE [ raydl lane ] in worker/lane.py);
        False when the driver no longer listens there (its iterator ended before this call's turn came)."""
        try:
            serve_lane(address, token, self._turns, self._fetch_many, _sendable_reply)
        except OSError:
            return False
        return True

    def _fetch_many(self, epoch: int, tasks: list) -> tuple[list, list]:
        batches, metas = [], []
        self._read_ahead(tasks)
        for idx, work in tasks:
            started_s, t0 = time.time(), time.perf_counter()
            try:
                batch, meta = self.fetch(epoch, idx, work)
            except Exception as e:
                tb = getattr(e, TRACEBACK_ATTR, None) or traceback.format_exc()
                batch = BatchFailed(_portable_error(e), tb)
                meta = BatchMeta(self._worker_id, idx, started_s, time.perf_counter() - t0)
            batches.append(batch)
            metas.append(meta)
        return batches, metas

    def _read_ahead(self, tasks: list) -> None:
        """A streamed dataset reads the units of a call's batches at once (`UnitDataset.raydl_read_ahead`); a failure
        is left to the batch that reads the unit, which reports it as its own."""
        p = self._payload
        if p is None or p.is_iterable or len(tasks) < 2:
            return
        ahead = getattr(p.dataset, "raydl_read_ahead", None)
        if ahead is None:
            return
        keyed = p.keyed_seeds
        try:
            ahead([work[1] if keyed else work for _, work in tasks])
        except Exception:  # noqa: BLE001 - the batch's own read raises it again, with its index
            pass

    def fetch(self, epoch: int, idx: int, index: Any) -> tuple[Any, BatchMeta]:
        """Task `idx`: one batch for `index` (a list of indices, one index, or for iterables the batch length).

        Returns the batch (or a `_WorkerSignal`) and its `BatchMeta`; `fetch_many` calls it for each task of a call.
        `epoch` changes only with persistent workers; an iterable worker then restarts its
        stream, as torch's worker does when it is told to resume.
        """
        started_s, t0, c0 = time.time(), time.perf_counter(), time.process_time()
        key = pipe_seed = None
        if self._payload is not None and self._payload.pipe_seeds:  # NOTE [ raydl datapipes ]
            pipe_seed, index = index
        if self._payload is not None and self._payload.keyed_seeds:
            key, index = index
            if key[0] == "batch":
                seed_batch(key[1], key[2], key[3], stream=key[4])
                key = None
        elif self._payload is not None and self._payload.seed_per_batch:
            seed_batch(self._base_seed, epoch, idx)
        batch = self._fetch(epoch, index, key, pipe_seed)
        fetch_s = time.perf_counter() - t0
        p = self._payload
        state = rng = None
        if p is not None and self._fetcher is not None:  # NOTE [ raydl checkpoint ]
            state = make_worker_snapshot(self._worker_id, self._fetcher, p.dataset, p.is_iterable)
            rng = self._rng.changed() if self._track_rng else None
        signal = isinstance(batch, _WorkerSignal)
        name = p.stats_name if p is not None else None
        if name is None or signal:
            return batch, BatchMeta(self._worker_id, idx, started_s, fetch_s, state=state, rng=rng, signal=signal)
        if self.in_actor:
            observe_batch_time(name, self._worker_id, fetch_s)
        return batch, BatchMeta(
            self._worker_id,
            idx,
            started_s,
            fetch_s,
            self._samples(index),
            batch_nbytes(batch),
            time.process_time() - c0,
            state=state,
            rng=rng,
            signal=signal,
        )

    def _samples(self, index: Any) -> int:
        """Samples in the batch just made (for stats)."""
        fetcher = self._fetcher
        if isinstance(fetcher, IterableFetcher):
            return fetcher.last_count
        return len(index) if fetcher is not None and fetcher.auto_collation else 1

    def restart_stream(self, epoch: int, pipe_seed: Optional[int] = None) -> Optional[dict]:
        """A persistent iterable worker joins `epoch`: its stream restarts now unless that epoch's first fetch
        restarted it already; returns its snapshot as of the restart, `iter(dataset)` included, with its generators
        (torchdata's worker acknowledges its next epoch with that state). A Ray call outside the count of fetch
        calls, made under the same lock (NOTE [ raydl lane ] in worker/lane.py); None for a worker that failed to
        start; `pipe_seed`: the epoch's shared seed of an IterDataPipe (NOTE [ raydl datapipes ])."""
        with self._turns.cond:
            if self._init_error is not None or self._payload is None:
                return None
            self._enter_epoch(epoch, pipe_seed)
            return self._epoch_start

    def _enter_epoch(self, epoch: int, pipe_seed: Optional[int] = None) -> None:
        """The first call of a new epoch (persistent workers): an iterable's stream restarts, as torch's worker does
        when it is told to resume, and its snapshot at that point is kept for `restart_stream`; an IterDataPipe is
        seeded first with the epoch's shared seed (NOTE [ raydl datapipes ])."""
        if epoch <= self._epoch:
            return
        p = self._payload
        assert p is not None
        self._epoch = epoch
        self._rng.reset()
        seed_pipe(p.dataset, pipe_seed)
        if p.is_iterable:
            self._fetcher = self._make_fetcher()
            start = make_worker_snapshot(self._worker_id, self._fetcher, p.dataset, p.is_iterable)
            if start is not None and self._track_rng:
                start[RNG] = RngTracker().changed()  # a tracker of its own: the batches' reports stay complete
            self._epoch_start = start

    def _fetch(self, epoch: int, index: Any, key: Optional[tuple] = None, pipe_seed: Optional[int] = None) -> Any:
        if self._init_error is not None:
            return StartFailed(self._worker_id)
        if self._payload is None:
            raise RuntimeError("raydl worker used before configure(): this is a raydl bug")
        try:
            if self._payload.is_iterable and epoch < self._epoch:
                # a call of an epoch this stream has left (dropped by the driver): nothing of the new stream goes to it
                return StreamEnd(self._worker_id)
            self._enter_epoch(epoch, pipe_seed)
            assert self._fetcher is not None
            if key is not None:  # NOTE [ raydl sample seeding ]
                _, base, key_epoch = key
                return encode(self._fetcher.fetch(index, lambda i: seed_sample(base, key_epoch, i)))
            return encode(self._fetcher.fetch(index))
        except StopIteration:
            if self._payload.is_iterable:
                return StreamEnd(self._worker_id)
            # A map-style dataset raising StopIteration is a bug in it; keep its traceback.
            raise RuntimeError(
                "StopIteration raised while fetching from a map-style dataset:\n" + traceback.format_exc()
            ) from None
        except Exception as e:
            annotate_traceback(e)
            raise
