"""`_RayLoaderIter`: one epoch of a raydl DataLoader, driven from the caller's thread.

NOTE [ raydl ordering ]
The driver follows torch's multiprocessing iterator step for step, with ObjectRefs in place of
index and result queues:
  * the (batch) sampler is drawn in the driver; each draw becomes task `send_idx`, given to the
    next worker of a round-robin cycle (skipping exhausted iterable workers; with in_order=False
    also workers that already hold their share of tasks); a worker's tasks may travel several to
    an actor call (NOTE [ raydl calls ] in driver/schedule.py), which changes no batch;
  * the prefetch is primed with `prefetch_factor * num_workers` tasks and refilled by one task
    each time a batch is handed out (or an iterable worker reports its end); over a node cache a
    task also waits until its batch's units fit in the cache beside those in flight, and the
    tasks held back go as room comes (`_refill`; NOTE [ raydl node cache ]);
  * with in_order=True batches are handed out in send order: the driver waits on task
    `rcvd_idx`; with in_order=False, on whichever outstanding batch is ready first;
  * results stay in Ray's object store (or a local lane's socket) until handed out: only the
    call whose batch is about to be returned is read, its other batches wait in it (NOTE [ raydl
    receive ] in driver/receive.py); a remote worker's lane is read by its reader thread as the
    reply arrives (NOTE [ raydl lane, driver ]).
Same generator, same sampler draws, same worker for every batch: the batches are torch's.
A batch made on another node starts moving to the driver's node as soon as it exists, so the
transfer overlaps the training step: `ref.future()` (driver/transport/calls.py) registers Ray's
asynchronous get, whose pull starts once the object is made, where a plain `ray.get` pulls only
when called, after the step. The future is dropped at once: nothing waits on it, and it holds no
batch once the pull is done (docs/design-notes.md has why `ray.wait` does not do this).

NOTE [ raydl shutdown ]
`shutdown()` is the one way resources are released; it is idempotent and runs, in order:
  1. stop and join the pin thread (bounded wait);
  2. drop every buffered ObjectRef (Ray frees the objects);
  3. kill the worker actors (`ray.kill(no_restart=True)`), or return clean ones to the warm pool.
It runs when an epoch ends without persistent workers, when an error ends the iterator, and from
`DataLoader.shutdown()` / the loader's context manager. Persistent workers survive the end of an
epoch: only step 2 happens there, and `_reset` starts the next epoch on the same actors. Nothing
runs while the interpreter is finalizing: Ray tears its actors down with the driver then.
A dropped iterator (an early `break`, a loader let go, a traceback that kept it alive) is
released by `weakref.finalize` callbacks that hold the `WorkerPool` (`release_when_collected`)
and the pin stage, never the iterator, and never by a `__del__`. Why: the iterator often dies in
a reference cycle (a traceback's frame holds it), and the cyclic collector finalizes every object
of the garbage set together; were the pool reachable only from the iterator, its actor handles
would be finalized in the same collection, and Ray kills an actor whose handles are all gone,
even one just handed to the warm pool. Held by a finalizer, the pool and its handles stay
reachable, and the finalizer returns clean actors to the warm pool. Buffered refs go with the
iterator, unabandoned, so a worker given back that way is reused only after the `reset` queued
behind all its tasks has run (NOTE [ raydl warm pool ] in cluster/warm.py).
Recovery and receiving hold the epoch's parts, never the iterator: it passes itself as `host`
of each call (`RecoveryHost`, `ReceiveHost`); the stats recorder is sent events (NOTE [ raydl stats ]).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Optional

from .._errors import rebuild_worker_exception, short_indices
from ..cluster.cache.driver_feed import CacheFeed
from ..cluster.connect import ensure_ray_initialized, worker_actor_options
from ..cluster.elastic import ElasticPool
from ..cluster.locality import warn_if_workers_oversubscribe
from ..cluster.startup import wait_for_early_start
from ..worker.actor import BatchMeta
from ..worker.datapipes import is_iter_datapipe
from ..worker.fetch import StartFailed, StreamEnd, warn_if_length_exceeded
from ..worker.transfer import decode
from .device import DeviceCopier, PinnedBatches, pin_memory_target, resolve_device, warn_pin_memory_args
from .lifecycle import IterState
from .node_slots import SlotDeal, batch_nodes, epoch_deal, next_worker, settle_slots
from .pool_choice import make_elastic, make_pool, worker_payload
from .receive import BatchError, Receiver, TaskHeld, failure
from .recovery import Recovery
from .schedule import Schedule, Task
from .state.checkpoint import Tracker
from .state.draws import draw_base_seed, iterator_base_seed
from .stats.recorder import make_recorder
from .transport.calls import CallSender
from .waits import BatchWaits

if TYPE_CHECKING:
    from .spec import LoaderSpec

__all__ = ["_RayLoaderIter"]

logger = logging.getLogger(__name__)


class _RayLoaderIter(Iterator[Any]):
    """Iterates once over a raydl DataLoader's dataset with Ray actors as workers (an `EpochIter`).

    State (torch's names), with invariants that hold between calls:
      * `_send_idx`: idx of the next task to send; `_rcvd_idx`: idx of the next task to hand out
        in order; `0 <= _rcvd_idx <= _send_idx`.
      * `_sched` (a `Schedule`) holds every task sent and not yet handed out or dropped, keyed by
        idx: its keys lie in `[_rcvd_idx, _send_idx)`; which worker gets a task, probation and
        held tasks are its business (NOTE [ raydl scheduling ] in driver/schedule.py, with its own
        invariants).
    See NOTE [ raydl ordering ], NOTE [ raydl receive ] (driver/receive.py), NOTE [ raydl recovery ]
    (driver/recovery.py), NOTE [ raydl scheduling ], NOTE [ raydl waits ] (driver/waits.py) and NOTE [ raydl shutdown ].
    """

    def __init__(self, spec: LoaderSpec, state: Optional[dict] = None, handover: Any = None) -> None:
        """`spec`: the loader as of `iter()`; `state`: a validated loader state to resume from (NOTE [ raydl
        checkpoint ] in driver/state/checkpoint.py); `handover`: with it, the driver's part of a cold start (NOTE
        [ raydl cold start ] in driver/coldstart/iter.py)."""
        options = spec.options
        self._dataset = spec.dataset
        self._is_iterable = spec.is_iterable
        self._auto_collation = spec.auto_collation
        self._index_sampler = spec.index_sampler
        self._num_workers = spec.num_workers
        self._prefetch_factor = spec.prefetch_factor
        self._timeout = spec.timeout
        self._persistent_workers = spec.persistent_workers
        self._in_order = spec.in_order
        self._IterableDataset_len_called = spec.len_called
        self._state = IterState.RUNNING
        self._pinned: Optional[PinnedBatches] = None  # made at the first pinned batch
        # a dataset streamed through the node cache, which is told the epoch's order (NOTE [ raydl node cache ])
        self._feed = CacheFeed.for_dataset(
            spec.dataset,
            getattr(self._index_sampler, "batch_size", 1) if self._auto_collation else 1,
            where=self._batch_nodes,
        )

        warn_pin_memory_args(spec)  # torch's warnings, at iterator creation as torch's
        self._pin_device = pin_memory_target(spec.pin_memory)
        self._copier: Optional[DeviceCopier] = None
        target = resolve_device(options.device)
        if target is not None:  # batches go to the GPU from pinned memory: pinning is implied
            self._pin_device = "cuda"
            self._copier = DeviceCopier(target)

        # torch draws the base seed after creating the sampler iterator and before the first
        # index: the generator is consumed in the same order here. A resumed iterator then takes
        # its sampler position, base seed and epoch from the state (NOTE [ raydl checkpoint ], draws).
        self._ckpt = Tracker(spec, self._index_sampler, state)
        self._generator = spec.generator
        # NOTE [ raydl datapipes ]: an IterDataPipe's shared seed, drawn first as torch's iterator draws it; the
        # workers shuffle with it this epoch (and with the one `_reset` draws at each later epoch)
        self._pipe = is_iter_datapipe(spec.dataset)
        pipe_seed: Optional[int] = None  # then the pool's (`pipe_seed`), which each epoch's tasks carry
        if handover is not None:  # the sampler and base seed as the driver left them: nothing drawn again
            self._sampler_iter, self._base_seed = handover.take_main(self._ckpt)
        else:
            if self._pipe:
                pipe_seed = draw_base_seed(spec.generator)
            self._sampler_iter = self._ckpt.sampler_iter()
            base_seed = iterator_base_seed(spec.generator, state is not None)
            self._sampler_iter, self._base_seed = self._ckpt.resume_main(
                self._sampler_iter, base_seed, self._IterableDataset_len_called
            )
        self._epoch = self._ckpt.epoch
        self._seed_per_sample = options.seed == "sample"
        self._seed_mode = options.seed
        self._deal: Optional[SlotDeal] = None  # this epoch's batches by node slot (NOTE [ raydl node slots ])

        ensure_ray_initialized(options.address)
        wait_for_early_start()  # a raydl.start() in progress hands its workers over first (NOTE [ raydl early start ])
        import ray

        self._driver_node_id = ray.get_runtime_context().get_node_id()
        self._via_client = (
            ray.util.client.ray.is_connected()
        )  # Ray Client: batches are copied (NOTE [ raydl zero-copy ])
        payload = worker_payload(spec, options, self._is_iterable, self._auto_collation)
        actor_options = worker_actor_options(options.remote_args)
        warn_if_workers_oversubscribe(spec, actor_options)  # NOTE [ raydl worker-count warning ]
        # the job's pool, shared by its ranks, or one of its own (NOTE [ raydl pool choice ])
        self._pool: Any
        self._job_rank: Optional[int]
        self._pool, self._job_rank = make_pool(
            spec,
            options,
            payload,
            self._base_seed,
            self._ckpt,
            self._driver_node_id,
            self._epoch,
            actor_options,
            pipe_seed,
        )
        self._calls = CallSender(  # NOTE [ raydl calls ]; a worker's lane: NOTE [ raydl lane, driver ]
            self._pool,
            self._driver_node_id,
            lanes=options.lane and self._job_rank is None and not self._via_client,
            max_batches=self._prefetch_factor * self._num_workers,
            silence_timeout_s=options.silence_timeout_s,
        )
        # NOTE [ raydl shutdown ]: released by a finalizer holding the pool, never from __del__
        self._release_pool = self._pool.release_when_collected(self)
        self._sched = Schedule(
            self._pool.num_workers,
            self._prefetch_factor * self._num_workers,
            self._in_order,
            self._calls.send,
            balanced_from=None if self._job_rank is None else self._job_rank * self._num_workers,
            batches_per_call=options.batches_per_call,
            call_bytes=self._calls.call_bytes,
        )
        self._elastic: ElasticPool = make_elastic(  # NOTE [ raydl elastic pool ], [ raydl job elastic ]
            self._pool, self._sched, self._job_rank, spec, self._try_put_index
        )
        self._recovery = Recovery(  # NOTE [ raydl recovery ] in driver/recovery.py
            self._pool,
            self._sched,
            self._ckpt,
            self._elastic,
            is_iterable=self._is_iterable,
            max_worker_restarts=options.max_worker_restarts,
            startup_timeout_s=options.startup_timeout_s,
            driver_node_id=self._driver_node_id,
        )
        self._ckpt.await_start = weakref.WeakMethod(self._await_start)  # a state before any batch
        self._waits = BatchWaits(self._timeout, self._pool.describe)  # NOTE [ raydl waits ]
        self._receiver = Receiver(self._sched, self._calls, self._waits)  # NOTE [ raydl receive ]
        # NOTE [ raydl stats ]: per-worker figures, the loop's wait in next(), metrics, timeline; the recorder is
        # sent events and never holds this iterator; a cold start's goes on with the epoch it began (NOTE [ raydl
        # cold start ])
        taken = handover.recorder if handover is not None else None
        self.stats_recorder = (
            taken
            if taken is not None
            else make_recorder(payload.stats_name, options.threads_per_worker, spec.hint_given)
        )
        self.stats_recorder.watch(self._sched, self._feed, self._calls.lane_memory)
        self._reset(first_iter=True, epoch_begun=taken is not None)

    # ------------------------------------------------------------------ public surface

    def __iter__(self) -> _RayLoaderIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)  # type: ignore[arg-type]

    def state_dict(self) -> dict:
        """This iterator's state as of the last batch handed out (NOTE [ raydl checkpoint ]); never waits on workers."""
        return self._ckpt.state_dict()

    @property
    def checkpoint(self) -> Tracker:
        """The epoch's record, which the loader keeps after this iterator is dropped (`EpochIter`)."""
        return self._ckpt

    @property
    def worker_records(self) -> list:
        """Where each worker runs (`WorkerRecord`s; None for a worker not yet started); retired workers are left out."""
        return [r for w, r in enumerate(self._pool.records) if w not in self._pool.released]

    def resize(self, num_workers: int) -> None:
        """Resize the pool now, mid-epoch included (NOTE [ raydl elastic pool ])."""
        if self._state != IterState.SHUT_DOWN:
            self._elastic.resize(num_workers)
            self._report_workers()

    def __next__(self) -> Any:
        if self._state == IterState.SHUT_DOWN:
            raise StopIteration
        t0 = time.perf_counter()
        # Batches arrive encoded (NOTE [ raydl zero-copy ]): tensors over the object store, or copied once into pinned memory.
        with self.stats_recorder.next_call():  # the time spent here is the loop's data stall
            try:
                data = (
                    self._next_pinned()
                    if self._pin_device is not None
                    else decode(self._next_data(), copy=self._via_client)
                )
            except StopIteration:
                self._ckpt.on_end()
                raise
        self._elastic.on_next(time.perf_counter() - t0)  # the autoscaler's measure
        self._report_workers()  # it may have added or dropped a worker
        self._num_yielded += 1
        self._ckpt.on_handed_out()
        if self._is_iterable:
            warn_if_length_exceeded(
                self._dataset, self._IterableDataset_len_called, self._num_yielded, multiprocess=True
            )
        return data

    def shutdown(self) -> None:
        """Release the pin thread, buffered refs and worker actors; idempotent (NOTE [ raydl shutdown ])."""
        if self._state == IterState.SHUT_DOWN:
            return
        self._state = IterState.SHUT_DOWN
        if self._pinned is not None:
            self._pinned.shutdown()
            self._pinned = None
        self._release_workers()
        logger.debug("raydl: iterator shut down")

    # torch's private name for the same, which code outside torch calls on `loader._iterator` (torch's own tests do)
    _shutdown_workers = shutdown

    def __getstate__(self):
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")

    # ------------------------------------------------------------------ epoch state machine

    def next_epoch(self, len_called: Optional[int]) -> None:
        """Persistent workers: the next epoch on the same actors (`EpochIter`)."""
        self._reset(len_called)

    def _reset(self, len_called: Optional[int] = None, first_iter: bool = False, epoch_begun: bool = False) -> None:
        """Start an epoch: fresh cursors, a fresh sampler iterator (after the first), prime the prefetch.
        `len_called`: the loader's `_IterableDataset_len_called` now (after the first epoch);
        `epoch_begun`: the stats recorder already records this epoch (a cold start's)."""
        if not first_iter:
            self._sampler_iter = self._ckpt.sampler_iter()
            self._IterableDataset_len_called = len_called
            self._drop_all_tasks()
            self._epoch += 1
            self._pool.epoch = self._epoch
            self._state = IterState.RUNNING
            if self._pinned is not None:
                self._pinned.source_ended = False
        if self._pipe:  # torch draws a shared seed at each reset, its first included; later epochs' go to the workers
            seed = draw_base_seed(self._generator)
            if not first_iter:
                self._pool.pipe_seed = seed
        if not epoch_begun:
            self.stats_recorder.begin_epoch()
        self._settle_slots()
        # A resumed epoch starts at the position of its first batch not handed out (NOTE [ raydl checkpoint ]).
        start, first_worker = self._ckpt.start_epoch(self._sampler_iter, first_iter, self._epoch)
        if not first_iter and self._is_iterable and hasattr(self._pool, "restart_streams"):
            self._ckpt.on_streams_restarting(self._pool.restart_streams(self._epoch))  # NOTE [ raydl checkpoint ]
        self._sample_key = self._ckpt.deal.sample_key(self._base_seed, self._epoch) if self._seed_per_sample else None
        self._num_yielded = self._ckpt.num_yielded
        self._waits.new_epoch()
        self._send_idx = start  # idx of the next task to be sent to workers
        self._rcvd_idx = start  # idx of the next task to be handed out in order
        self._sched.reset(first_worker, self._epoch)
        self._deal = self._slot_deal()
        self._elastic.new_epoch()
        if self._feed is not None:  # the plan first: what the first batches may fetch is weighed too (`has_room`)
            self._feed.begin_epoch(self._sampler_iter, self._rcvd_idx, self._worker_nodes())
        for _ in range(self._sched.max_tasks):
            self._try_put_index()
        self._report_workers()

    def _refill(self) -> None:
        """After a batch is handed out: the next task, as torch sends one; and, while the node cache held some back
        (`_try_put_index`), as many as the prefetch bound and the cache's room allow."""
        while self._try_put_index() and self._feed is not None:
            if self._sched.tasks_outstanding >= self._sched.max_tasks > 0:
                return

    def _try_put_index(self) -> bool:
        """Draw the next index from the sampler and give it to the next eligible worker (torch's rule); whether a
        task was added."""
        if 0 < self._sched.max_tasks <= self._sched.tasks_outstanding:
            return False  # the pool shrank: refills wait until the tasks in flight fit its bound
        if (
            self._feed is not None
            and self._sched.tasks_outstanding > 0
            and not self._feed.has_room(self._rcvd_idx, self._send_idx)
        ):
            return False  # the cache cannot hold one more batch's units beside those in flight: it waits its turn
        while True:
            try:
                index = next(self._sampler_iter)
            except StopIteration:
                self._sched.flush_all()  # no draw will fill a call: pending tasks go now (NOTE [ raydl calls ])
                return False
            self._ckpt.on_draw(self._send_idx, self._sampler_iter)
            if not self._ckpt.skip(self._send_idx):
                break
            self._send_idx += 1  # handed out before the state was taken (in_order=False): not made again
        worker_id = self._next_worker()
        if worker_id is None:
            return False
        # An iterable worker only needs the batch length; its replica decides the items.
        work = (len(index) if self._auto_collation else None) if self._is_iterable else index
        if self._sample_key is not None:  # NOTE [ raydl sample seeding ]
            work = (("sample", *self._sample_key), work)
        elif self._job_rank is not None:  # a job's batch, keyed by its rank (NOTE [ raydl job pool ])
            work = (("batch", self._base_seed, self._epoch, self._send_idx, self._job_rank), work)
        if self._pipe:  # the epoch's shared seed, outermost (NOTE [ raydl datapipes ])
            work = (self._pool.pipe_seed, work)
        self._sched.add(self._send_idx, worker_id, index, work)
        self._send_idx += 1
        if self._feed is not None:  # after the round robin moved on: the feed's look ahead starts at _send_idx
            self._feed.on_send(self._send_idx - 1, index, self._pool_node(worker_id))
        return True

    def _settle_slots(self) -> None:
        """The run's slot count, at its first epoch (NOTE [ raydl node slots ]: `settle_slots`)."""
        by_node = self._feed is not None and self._seed_mode != "worker"
        if by_node and any(self._pool_node(w) is None for w in self._sched.active) and not self._pool.is_ready:
            self._wait_workers_ready()  # the user's actor options place them: where they run is known once started
        settle_slots(self._dataset, self._sampler_iter, len(self._worker_nodes()) if by_node else 1)

    def _slot_deal(self) -> Optional[SlotDeal]:
        """This epoch's deal of batches to nodes by slot, or None where torch's round robin places them."""
        if self._feed is None:
            return None
        batch = getattr(self._index_sampler, "batch_size", None) if self._auto_collation else None
        deal, self._feed.placement = epoch_deal(
            self._dataset, self._sampler_iter, batch, self._seed_mode, self._pool_node
        )
        return deal

    def _next_worker(self) -> Optional[int]:
        """The worker of the next task: one on its slot's node (NOTE [ raydl node slots ]), else torch's rule."""
        return next_worker(self._deal, self._sched, self._send_idx)

    def _abandon(self, tasks: list[Task]) -> None:
        """Forget these tasks' results (their worker must finish their calls before being reused)."""
        self._calls.abandon(tasks)

    def _abandon_task(self, idx: int) -> None:
        self._abandon([self._sched.pop(idx)])

    def _drop_all_tasks(self) -> None:
        if hasattr(self, "_sched"):
            self._abandon(self._sched.drop_all())

    def _next_data(self) -> Any:
        """The next batch, per NOTE [ raydl ordering ]; raises StopIteration at the end of the epoch. Run in the pin
        thread with pinning. Whatever happens, the stats recorder is then sent the workers (started, replaced,
        joined or retired on the way), before the epoch's end reaches it."""
        try:
            return self._next_batch()
        finally:
            self._report_workers()

    def _next_batch(self) -> Any:
        """`_next_data`'s search: skip what is gone, pick the batch (in order or first ready), receive it."""
        from ray.exceptions import RayTaskError

        if self._state != IterState.RUNNING:
            raise StopIteration
        if not self._pool.is_ready:
            self._wait_workers_ready()
        self._elastic.step()  # workers that started join, retired ones that are done leave
        while True:
            while self._rcvd_idx < self._send_idx:
                task = self._sched.task_info.get(self._rcvd_idx)
                if task is not None:
                    if self._sched.workers_status[task.worker_id]:
                        break
                    self._abandon_task(self._rcvd_idx)
                self._rcvd_idx += 1
            else:
                self._end_epoch()
                raise StopIteration

            if self._in_order:
                idx = self._rcvd_idx
                self._sched.flush_for(idx)  # a pending task's call goes before it is waited on
            else:
                idx = self._receiver.first_ready(self._rcvd_idx)
            task = self._sched.task_info[idx]
            try:
                # A timeout leaves the task in place: the next call waits for the same batch.
                data = self._receiver.get(idx, task, self)
            except TaskHeld:
                continue
            except (RayTaskError, BatchError) as e:
                self._ckpt.on_batch_failed(idx)
                self._consume(idx)
                # As torch does: refill before raising, so a caller that catches the error can go on.
                self._refill()
                cause, tb = failure(e)
                raise rebuild_worker_exception(
                    cause,
                    f"in {self._pool.describe(task.worker_id)} while making batch {idx} (indices {short_indices(task.index)})",
                    tb,
                ) from None
            self._consume(idx)
            if isinstance(data, StartFailed):  # unreachable: workers are waited for before any batch is read
                self.fail()
                raise RuntimeError(f"raydl bug: read a batch from worker {data.worker_id}, whose start failed")
            if isinstance(data, StreamEnd):
                self._retire_worker(data.worker_id)
                self._refill()
                continue
            self._refill()
            return data

    def _consume(self, idx: int) -> None:
        """Task `idx` has been handed out (or failed): forget it and advance the in-order cursor."""
        self._sched.pop(idx)
        if idx == self._rcvd_idx:
            self._rcvd_idx += 1
        if self._feed is not None:
            self._feed.advance(self._rcvd_idx, self._send_idx)

    def _retire_worker(self, worker_id: int) -> None:
        """Iterable worker `worker_id` has no more data this epoch: send it nothing more."""
        self._abandon(self._sched.retire(worker_id))

    def _release_workers(self) -> None:
        """Steps 2 and 3 of NOTE [ raydl shutdown ]: drop buffered refs, kill the actors (or keep them warm)."""
        self._drop_all_tasks()
        if hasattr(self, "_calls"):
            self._calls.close()
        if getattr(self, "_feed", None) is not None:
            self._feed.close()
        self._release_pool.detach()
        self._pool.shutdown()

    def _end_epoch(self) -> None:
        self._state = IterState.EXHAUSTED
        if self._feed is not None:
            self._feed.close()
        if not self._persistent_workers:
            self._release_workers()

    def fail(self) -> None:
        """An unrecoverable error: no more batches from this iterator; the workers go now."""
        self._state = IterState.EXHAUSTED
        self._release_workers()

    @property
    def reusable(self) -> bool:
        """Whether a persistent loader can start its next epoch on this iterator's workers (they live in this
        process's current Ray session: after the user's `ray.shutdown()` a new iterator starts anew)."""
        return self._state != IterState.SHUT_DOWN and self._pool.alive and self._pool.in_session()

    def recover(self, worker_id: int, error: BaseException) -> None:
        """Replace a dead worker and resend its tasks, or raise WorkerDiedError (`ReceiveHost`; NOTE [ raydl
        recovery ])."""
        self._recovery.recover(worker_id, error, self)

    def _wait_workers_ready(self) -> None:
        """Bounded wait for (new) workers to start; a death is recovered, any other failure ends the iterator."""
        self._recovery.wait_ready(self)

    @property
    def running(self) -> bool:
        return self._state == IterState.RUNNING

    def _report_workers(self) -> None:
        """Send the stats recorder where the workers run and their restarts (NOTE [ raydl stats ])."""
        self.stats_recorder.workers(self._pool.records, self._pool.restarts)

    def _pool_node(self, worker_id: Optional[int]) -> Optional[str]:
        """Where worker `worker_id` runs (or is planned to run); None if not known."""
        return self._pool.node_of(worker_id) if worker_id is not None else None

    def _worker_nodes(self) -> list:
        """The nodes the workers run on (or are planned to), each once."""
        return list(dict.fromkeys(n for n in map(self._pool_node, self._sched.active) if n is not None))

    def _batch_nodes(self, first: int, end: int) -> list:
        """The node of the worker that makes each batch position in [first, end), None where not known (NOTE [ raydl
        node cache ]: the plan of such a batch goes to every node)."""
        return batch_nodes(self._deal, self._sched, self._send_idx, first, end, self._pool_node)

    def _await_start(self) -> None:
        """A state taken before the workers started waits for them: their start replies hold their snapshots."""
        if self._state == IterState.RUNNING and not self._pool.is_ready:
            self._wait_workers_ready()
            self._report_workers()

    def on_workers_ready(self) -> None:
        """Every worker has started (`RecoveryHost`): latencies count from now; remote batches start moving here."""
        self._waits.workers_ready()
        self._ckpt.on_workers_started(getattr(self._pool, "started_states", {}))
        if self._feed is not None:  # the caches of the workers' nodes get the plan too (NOTE [ raydl node cache ])
            self._feed.add_nodes(self._worker_nodes())
        # Tasks sent before the workers reported where they run: start their transfers now.
        self._calls.start_transfers(self._sched.task_info.values())

    def on_batch_made(self, idx: int, task: Task, meta: BatchMeta, nbytes: int) -> None:
        """Task `idx`'s batch is in hand, with what its worker reported about making it (`ReceiveHost`)."""
        self._ckpt.on_batch_made(idx, task.worker_id, meta)
        self._elastic.on_batch_made(meta.fetch_s)
        self._sched.on_batch_made(task.worker_id, meta.fetch_s, nbytes)
        self.stats_recorder.batch_made(meta)

    # ------------------------------------------------------------------ pinning

    def _next_pinned(self) -> Any:
        """The next batch through the pin thread (NOTE [ raydl pinning ] in driver/device.py)."""
        if self._pinned is None:
            recorder = self.stats_recorder
            self._pinned = PinnedBatches(self, self._pin_device, self._copier, recorder.timed_pin)
        try:
            return self._pinned.next(self._next_data, lambda: self._state == IterState.RUNNING)
        except StopIteration:
            if not self._persistent_workers:
                self.shutdown()
            raise
