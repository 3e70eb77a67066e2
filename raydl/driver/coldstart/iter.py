"""`ColdStartIter`: a new process's first batches, made by start-up processes while Ray and the workers come up.

NOTE [ raydl cold start ]
Before a new process's first batch from a worker actor, Ray must start (GCS, raylet, agents) and
so must each worker (a Python process importing torch): seconds, where torch forks its workers in
milliseconds. So on a cold start the loader's first `iter()`:
  1. forks one start-up process per worker, as torch forks its workers (NOTE [ raydl start-up
     process ] in worker/startup.py), and sends them the first `prefetch_factor * num_workers`
     tasks: the base seed and the sampler's indices drawn exactly as the Ray iterator draws them,
     task k to worker k mod num_workers (torch's round robin); each process is a plain `Worker`
     (torch's seeds, `worker_init_fn`, `get_worker_info()`, each batch's `BatchMeta`);
  2. after the first batch is out (importing Ray holds the GIL), starts Ray and blank warm
     workers in the background through `raydl.start()`'s thread (NOTE [ raydl early start ]);
  3. once Ray and those workers run (checked without blocking at each `next()`), sends the
     processes no more tasks, hands out their batches in flight, then hands the epoch over: its
     record is a loader state as of the last batch handed out (NOTE [ raydl checkpoint ]), from
     which a `_RayLoaderIter` starts with the sampler iterator, base seed and stats recorder as
     they are (nothing drawn again); each actor starts as a resumed worker, its generators where
     its start-up process left them. The processes exit.
Invariant: the batches are those of a loader whose actors made them all, batch for batch:
torch's. Which batches the start-up processes made depends only on timing, never their content.
A start-up process keeps a worker's guarantees: one that dies is replaced by a fork from the
worker's last batch read, up to `ray_max_worker_restarts` times; a user error is raised at its
batch's turn; `timeout` bounds each batch (the wait for Ray at the handover is bounded by
`ray_startup_timeout_s`: Ray's start is not a batch). An epoch that runs out before the workers
run hands over at its end, so every epoch ends with Ray up and the workers holding its streams.
Applies to (`cold_start_applies`): `ray_cold_start` on (the default; RAYDL_COLD_START=0 turns it
off), num_workers > 0, a map-style dataset not streamed through the node cache, fork allowed (no
`multiprocessing_context` but fork), `ray_seed="worker"`, no `ray_job`, pinning, `ray_device` or
loaded state, and a process that never used Ray. `ray_cold_start="in_process"` makes the first
batches in the trainer itself, one at a time (`ShadowWorker`, shadow.py): no fork, but a crash
there ends the training process. The detail and figures are in docs/design-notes.md.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import weakref
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Optional

from torch.utils.data import IterableDataset
from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe

from ..._constants import WARM_MAX_IDLE_PER_KEY
from ..._errors import WorkerDiedError, rebuild_worker_exception, short_indices
from ...cluster.connect import never_connected, resource_request, worker_actor_options
from ...cluster.startup import Startup, start, starts_in_progress
from ...job.global_epoch import GLOBAL_EPOCH
from ...worker.actor import BatchFailed
from ...worker.startup import StartSpec
from ...worker.transfer import decode
from ..iter import _RayLoaderIter
from ..lifecycle import IterState
from ..pool_choice import worker_payload
from ..state.checkpoint import Tracker
from ..state.draws import iterator_base_seed
from ..state.layout import RAYDL
from ..stats.recorder import make_recorder
from ..waits import BatchWaits
from .makers import ForkedMaker, InProcessMaker, MakerDied

if TYPE_CHECKING:
    from ..spec import LoaderSpec

__all__ = ["ColdStartIter", "cold_start_applies", "IN_PROCESS"]

logger = logging.getLogger(__name__)

IN_PROCESS = "in_process"  # ray_cold_start's opt-in: the first batches made in the trainer's process

# Tests only: after this many batches made by start-up makers, the next ones wait for the workers (None: no limit).
_MAX_DRIVER_BATCHES: Optional[int] = None


def cold_start_applies(spec: LoaderSpec, state: Optional[Any]) -> bool:
    """Whether `iter(loader)` makes its first batches while Ray starts (NOTE [ raydl cold start ])."""
    dataset = spec.dataset
    options = spec.options
    return (
        bool(options.cold_start)
        and state is None
        and spec.num_workers > 0
        and not isinstance(dataset, (IterableDataset, IterDataPipe, MapDataPipe))
        and not callable(getattr(dataset, "raydl_cache_units", None))  # streamed through the node cache
        and options.seed == "worker"
        and options.job is None
        and not spec.pin_memory
        and options.device is None
        and never_connected()
        and (options.cold_start == IN_PROCESS or _fork_allowed(spec))
    )


def _fork_allowed(spec: LoaderSpec) -> bool:
    """Whether start-up processes may be forked: the platform forks, and the user asked for no other start method
    (a `multiprocessing_context` of spawn or forkserver says this process must not be forked)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    ctx = spec.multiprocessing_context
    return ctx is None or ctx.get_start_method() == "fork"


def _stop_all(makers: dict) -> None:
    """Stop every start-up maker (also run by the iterator's finalizer: a dropped iterator leaves no process)."""
    for maker in list(makers.values()):
        maker.stop()
    makers.clear()


class _Sent(NamedTuple):
    """A task sent to a start-up maker and not handed out yet."""

    worker_id: int
    index: Any


class _Handover:
    """What the Ray iterator takes as it is from the start-up part of the epoch: no draw is made again."""

    def __init__(self, sampler_iter: Iterator, base_seed: int, len_called: Optional[int], recorder: Any) -> None:
        self._sampler_iter = sampler_iter
        self._base_seed = base_seed
        self._len_called = len_called
        self.recorder = recorder  # the epoch's stats go on in the same recorder (NOTE [ raydl stats ])

    def take_main(self, tracker: Tracker) -> tuple[Iterator, int]:
        """The sampler iterator (at the first batch not made) and the base seed, recorded in `tracker`."""
        tracker.base_seed = self._base_seed
        tracker.len_called = self._len_called
        return self._sampler_iter, self._base_seed


class _EpochRecord:
    """The record of a cold-started epoch (a `Checkpoint`): the makers' tracker, then the Ray iterator's. It holds
    no iterator, so a dropped `ColdStartIter` is released (its makers stop) as a dropped Ray iterator is."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    @property
    def replay(self) -> int:
        return self.tracker.replay

    def state_dict(self) -> dict:
        return self.tracker.state_dict()

    def call_when_started(self, callback: Any) -> bool:
        return self.tracker.call_when_started(callback)


class ColdStartIter(Iterator[Any]):
    """An epoch that starts with start-up makers and goes on with Ray workers (NOTE [ raydl cold start ]); an
    `EpochIter`.

    State between calls (torch's names, as `_RayLoaderIter`):
      * `_send_idx`: idx of the next task to send; `_rcvd_idx`: idx of the next one to hand out;
      * `_tasks`: idx -> (worker id, indices) for every task sent and not handed out, keys in
        `[_rcvd_idx, _send_idx)`; task k goes to maker k mod num_workers (torch's round robin);
      * `_draining`: no task is sent any more (the workers run, a resize waits, or the test cap);
        the epoch is handed over once `_tasks` is empty, never with a batch in flight.
    Before the handover it records its batches in a `Tracker` as the Ray iterator records its
    workers' batches; after it, every call goes to `_RayLoaderIter`.
    """

    def __init__(self, spec: LoaderSpec) -> None:
        self._spec = spec  # the handover builds the Ray iterator from it
        self._num_workers = spec.num_workers
        self._auto_collation = spec.auto_collation
        self._index_sampler = spec.index_sampler
        self._timeout = spec.timeout  # torch's: the bound on one batch, as the user gave it
        self._waits = BatchWaits(self._timeout, lambda w: self._makers[w].describe())  # NOTE [ raydl waits ]
        self._inner: Optional[_RayLoaderIter] = None
        options = spec.options
        self._options = options
        self._payload = worker_payload(spec, options, False, self._auto_collation)
        self._maker_kind = InProcessMaker if options.cold_start == IN_PROCESS else ForkedMaker
        # a maker in this process makes its batches when read: one at a time, none ahead
        self._window = 1 if self._maker_kind is InProcessMaker else spec.prefetch_factor * self._num_workers
        # torch's order, as _RayLoaderIter: the sampler iterator, then the base seed
        self._tracker = Tracker(spec, self._index_sampler, None)
        it = self._tracker.sampler_iter()
        base_seed = iterator_base_seed(spec.generator, False)
        self._sampler_iter, self._base_seed = self._tracker.resume_main(it, base_seed, None)
        self._tracker.await_start = weakref.WeakMethod(self._await_makers_start)
        self._record = _EpochRecord(self._tracker)
        self._epoch = 0
        self._makers: dict[int, Any] = {}
        self._finalizer = weakref.finalize(self, _stop_all, self._makers)
        self._restarts: dict[int, int] = {}
        self._start_snapshots: dict[int, Optional[dict]] = {}
        self.batches_in_driver = 0  # batches handed out that start-up makers made, over all epochs (name kept)
        self.fork_s: list[float] = []  # each fork's time, and the handover's (the retired bench_startup reported them)
        self.handover_s = 0.0
        self._max_in_driver = _MAX_DRIVER_BATCHES
        self._resize_to: Optional[int] = None
        self._startups: Optional[list[Startup]] = None  # started once the first batch is out (see `__next__`)
        self.stats_recorder = make_recorder(self._payload.stats_name, options.threads_per_worker, spec.hint_given)
        self._begin_epoch(first_iter=True)

    def _start_ray(self) -> list[Startup]:
        """Ray, and blank workers where the warm pool may hold them, started by `raydl.start()`'s thread."""
        if self._startups is None:
            actor_options = worker_actor_options(self._options.remote_args)
            keep_warm = self._options.reuse_workers and not resource_request(actor_options)
            wanted = self._num_workers if self._resize_to is None else self._resize_to  # the loader's size now
            n = wanted if keep_warm and wanted <= WARM_MAX_IDLE_PER_KEY else 0
            self._startups = [
                *starts_in_progress(),
                start(n, ray_address=self._options.address, ray_remote_args=self._options.remote_args),
            ]
            logger.debug("raydl: cold start: Ray and %d workers start in the background", n)
        return self._startups

    def _begin_epoch(self, first_iter: bool) -> None:
        self._state = IterState.RUNNING
        self._send_idx = 0  # idx of the next task to send: made by worker idx % num_workers
        self._rcvd_idx = 0  # idx of the next task to hand out
        self._tasks: dict[int, _Sent] = {}
        self._sampler_done = False
        self._draining = self._max_in_driver == 0
        self.stats_recorder.begin_epoch()
        self._tracker.start_epoch(self._sampler_iter, first_iter, self._epoch)
        self._fill()  # as torch primes its workers at iter(): the first batches are under way at once

    # ------------------------------------------------------------------ the loader's iterator surface

    def __iter__(self) -> ColdStartIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)  # type: ignore[arg-type]

    def __getstate__(self):
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")

    @property
    def checkpoint(self) -> _EpochRecord:
        """What the loader's `state_dict()` reads: the makers' record, then the Ray iterator's (`EpochIter`)."""
        return self._record

    def state_dict(self) -> dict:
        """The loader state as of the last batch handed out (NOTE [ raydl checkpoint ])."""
        return self._record.state_dict()

    @property
    def worker_records(self) -> list:
        return self._inner.worker_records if self._inner is not None else []

    @property
    def reusable(self) -> bool:
        """Whether a persistent loader's next epoch goes on with this iterator (its makers, or its workers)."""
        if self._inner is not None:
            return self._inner.reusable
        return self._state != IterState.SHUT_DOWN

    def next_epoch(self, len_called: Optional[int]) -> None:
        """Persistent workers: the next epoch, on the same workers (or makers), with a new sampler iterator."""
        if self._inner is not None:
            self._inner.next_epoch(len_called)
            return
        self._sampler_iter = self._tracker.sampler_iter()
        self._epoch += 1
        self._begin_epoch(first_iter=False)

    def resize(self, num_workers: int) -> None:
        """A resize goes to the workers: no task is sent to the makers any more, the epoch is handed over once
        their batches in flight are handed out, and the pool is resized then."""
        if self._inner is not None:
            self._inner.resize(num_workers)
        elif self._state == IterState.RUNNING:
            self._resize_to = num_workers
            self._draining = True

    def shutdown(self) -> None:
        """NOTE [ raydl shutdown ]: the Ray iterator's, once there; the makers go with this iterator."""
        if self._inner is not None:
            self._inner.shutdown()
        self._state = IterState.SHUT_DOWN
        _stop_all(self._makers)

    # torch's private name for the same, which code outside torch calls on `loader._iterator` (torch's own tests do)
    _shutdown_workers = shutdown

    def __next__(self) -> Any:
        if self._inner is None and self._state == IterState.RUNNING and self._time_to_hand_over():
            t0 = time.perf_counter()
            self._hand_over_when_running()
            self.stats_recorder.waited(t0, time.perf_counter())  # the loop waited for the workers
        if self._inner is not None:
            return next(self._inner)
        if self._state != IterState.RUNNING:
            raise StopIteration
        with self.stats_recorder.next_call():  # waiting for a maker's batch is the loop's data stall
            data = self._next_made()
        self._tracker.on_handed_out()
        return data

    def _time_to_hand_over(self) -> bool:
        """Whether the epoch goes to the workers now: they run (or the makers are done) and no batch is in flight."""
        if self.batches_in_driver > 0 or self._draining:
            # after the first batch: importing Ray holds the GIL for most of a second, which would slow that one
            startups = self._start_ray()
            if not self._draining and all(s.running_now() for s in startups):
                self._draining = True
        return not self._tasks and (self._draining or self._sampler_done)

    def _hand_over_when_running(self) -> None:
        """Wait (bounded, never under `timeout`: Ray's start is not a batch) for Ray and the workers, then hand over."""
        for startup in self._start_ray():
            try:
                startup.wait(self._options.startup_timeout_s)
            except Exception:  # the Ray iterator reports a failed start as a loader without a cold start does
                break
        self._handover()

    # ------------------------------------------------------------------ the makers' part

    def _maker(self, worker_id: int, worker_state: Optional[dict] = None) -> Any:
        maker = self._makers.get(worker_id)
        if maker is None:
            spec = StartSpec(self._payload, self._num_workers, self._base_seed, self._epoch)
            maker = self._makers[worker_id] = self._maker_kind(spec, worker_id, worker_state)
            self.fork_s.append(maker.fork_s)
        return maker

    def _fill(self) -> None:
        """Send tasks until `_window` are in flight (none while draining)."""
        while not self._draining and not self._sampler_done and len(self._tasks) < self._window:
            if self._max_in_driver is not None and self._send_idx >= self._max_in_driver:
                self._draining = True
                break
            try:
                index = next(self._sampler_iter)
            except StopIteration:
                self._sampler_done = True
                break
            idx = self._send_idx
            self._send_idx += 1
            self._tracker.on_draw(idx, self._sampler_iter)
            worker_id = idx % self._num_workers
            self._tasks[idx] = _Sent(worker_id, index)
            self._maker(worker_id).send(self._epoch, idx, index)

    def _next_made(self) -> Any:
        idx = self._rcvd_idx
        worker_id, index = self._tasks[idx]
        batch, meta = self._receive(idx, worker_id)
        del self._tasks[idx]
        self._rcvd_idx += 1
        self.batches_in_driver += 1
        maker = self._makers[worker_id]
        self._fill()  # as torch: refill before raising, so a caller that catches the error can go on
        if isinstance(batch, BatchFailed):
            self._tracker.on_batch_failed(idx)
            raise rebuild_worker_exception(
                batch.error,
                f"in {maker.describe()} while making batch {idx} (indices {short_indices(index)})",
                batch.traceback,
            )
        self._tracker.on_batch_made(idx, worker_id, meta)
        self.stats_recorder.batch_made(meta, startup_pid=maker.pid or 0)
        return decode(batch)

    def _receive(self, idx: int, worker_id: int) -> tuple[Any, Any]:
        """Task `idx`'s reply from its maker, within torch's `timeout`; a maker that died is replaced."""
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            maker = self._makers[worker_id]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not maker.poll(remaining):
                self._waits.raise_timeout(idx, self._tasks[idx])  # torch's error, as the Ray iterator raises it
            try:
                reply = maker.read()
            except MakerDied as e:
                self._replace(worker_id, str(e))
                continue
            except Exception:  # worker_init_fn failed: as a worker's start failing, it ends the iterator
                self._state = IterState.EXHAUSTED
                _stop_all(self._makers)
                raise
            if reply is None:  # its start reply
                self._started(worker_id, maker)
                continue
            return reply

    def _replace(self, worker_id: int, cause: str) -> None:
        """A start-up process died: fork its replacement from the worker's last batch read and send it the lost
        tasks again (the same batches), or raise past `ray_max_worker_restarts`, as for a worker actor."""
        self._makers.pop(worker_id).stop()
        lost = sorted(i for i, (w, _) in self._tasks.items() if w == worker_id)
        restarts = self._restarts.get(worker_id, 0)
        if restarts >= self._options.max_worker_restarts:
            self._state = IterState.EXHAUSTED
            _stop_all(self._makers)
            what = f"while making batch {lost[0]} (indices {short_indices(self._tasks[lost[0]].index)})" if lost else ""
            raise WorkerDiedError(
                f"{cause} {what} after {restarts} restart(s) (ray_max_worker_restarts="
                f"{self._options.max_worker_restarts}). If this batch kills every worker it reaches, a sample in it "
                "crashes the process (out of memory, native code): fix or skip that sample."
            ) from None
        self._restarts[worker_id] = restarts + 1
        logger.warning("raydl: %s; starting a replacement and resending %d batch(es)", cause, len(lost))
        maker = self._maker(worker_id, self._tracker.restart_state(worker_id))
        for i in lost:
            maker.send(self._epoch, i, self._tasks[i].index)

    def _started(self, worker_id: int, maker: Any) -> None:
        """A maker's start reply: once every worker's is in, the tracker has each one's snapshot as it started
        (torchdata's startup state, NOTE [ raydl checkpoint ])."""
        self._start_snapshots[worker_id] = maker.started[1]
        if len(self._start_snapshots) == self._num_workers:
            self._tracker.on_workers_started(self._start_snapshots)

    def _await_makers_start(self) -> None:
        """A state asked for before every worker made a batch: each maker's start reply first (bounded)."""
        for worker_id, maker in list(self._makers.items()):
            if maker.started is None and not maker.in_process and maker.poll(self._options.startup_timeout_s):
                try:
                    if maker.read() is None:
                        self._started(worker_id, maker)
                except Exception:  # a failed start: raised at the batch's turn (its read fails the same way)
                    pass

    def _handover(self) -> None:
        """The Ray iterator takes the epoch on from the record of it (NOTE [ raydl cold start ], step 3)."""
        assert not self._tasks
        _stop_all(self._makers)
        self._finalizer.detach()
        state = self._tracker.state_dict()
        state[RAYDL][GLOBAL_EPOCH] = None  # this rank's epoch goes on as it is: nothing to re-deal
        handover = _Handover(self._sampler_iter, self._base_seed, self._tracker.len_called, self.stats_recorder)
        t0 = time.perf_counter()  # the epoch goes on as it was, with the spec's num_workers: a resize follows
        self._inner = _RayLoaderIter(self._spec, state, handover=handover)
        self.handover_s = time.perf_counter() - t0
        self._record.tracker = self._inner.checkpoint
        if self._resize_to is not None:
            self._inner.resize(self._resize_to)
        logger.debug(
            "raydl: cold start: workers take over after %d batches from start-up makers", self.batches_in_driver
        )
