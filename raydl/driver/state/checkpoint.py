"""Loader state for mid-epoch resume, in torchdata's StatefulDataLoader layout.

NOTE [ raydl checkpoint ]
`DataLoader.state_dict()` describes the iterator most recently created (or the one a
`load_state_dict` prepared) as of the last batch handed to the caller; `load_state_dict()`
applies to the next `iter()`. The layout is StatefulDataLoader's (torchdata 0.11), so either
loader loads the other's state for the same dataset, sampler and num_workers (the keys:
docs/design-notes.md). `_raydl`, which torchdata ignores, holds what validates a state against a
loader, a random sampler's epoch record when torchdata's keys cannot hold it, and the batches
handed out ahead of the first missing one (in_order=False).
A state costs no call to any worker beyond those the loader makes anyway:
  * sampler: the driver draws every index; the position is the first batch not yet handed out,
    restored from the sampler's `state_dict()` where it has one, else by fast-forwarding (drawing
    and discarding, fetching nothing). A random sampler's generator is made explicit
    (`RngSamplerIter`, driver/state/samplers.py) and recorded before the epoch's first draw;
  * draws: the base seed and the epoch's order come from the state, never from a new draw; a
    resumed iterator still draws (and discards) a base seed from the loader's `generator` as
    torch does, so the runs line up in the next epoch (`_raydl.next_epoch_rng` where that epoch
    draws from the global RNG);
  * workers: each `fetch` returns the worker's state after the task (`BatchMeta`, only what
    changed); the driver keeps per worker the state as of the last batch *handed out*
    (`committed`, what `state_dict()` reports) and as of the last batch *read* (`latest`, what a
    replacement after a death starts from);
  * cursors: task idxs continue at the batch's position, the base seed is the saved one, and the
    round robin goes on after `_last_yielded_worker_id`: batch k goes to the worker that made it.
Invariant: over the interrupted and the resumed run every batch is handed out exactly once
(batches in flight when the state was taken are made again); worker-side random draws are only
guaranteed identical with in_order=True (with False, timing picks the worker). Known limits (an epoch left by `break`, `set_num_workers`) and each
part in full: docs/design-notes.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import IterableDataset

from ..._constants import DEFAULT_STARTUP_TIMEOUT_S
from ...job.global_epoch import (
    GLOBAL_EPOCH,
    distributed_sampler,
    epoch_record,
    load_order,
    rank_length,
    redealt_iter,
)
from ...worker.state import (
    DATASET_ITER_STATE,
    DATASET_STATE,
    FETCHER_ENDED,
    FETCHER_STATE,
    RNG,
    WORKER_ID,
    by_value,
    is_stateful,
)
from .draws import global_rng_record, next_epoch_draws_global, saved_base_seed
from .layout import (
    BASE_SEED,
    FINISHED,
    INDEX_SAMPLER_STATE,
    LAST_YIELDED_WORKER_ID,
    LEN_CALLED,
    MAIN_SNAPSHOT,
    NEXT_EPOCH_RNG,
    NUM_WORKERS,
    RAYDL,
    SAMPLER_EPOCH,
    SAMPLER_ITER_STATE,
    SAMPLER_ITER_YIELDED,
    SHARED_SEED,
    SNAPSHOT,
    SNAPSHOT_STEP,
    STEPS_SINCE_SNAPSHOT,
    WORKER_SNAPSHOTS,
    loader_facts,
    redeals,
    worker_key,
)
from .samplers import (
    export_sampler_state,
    import_sampler_state,
    iterable_sampler_state,
    new_sampler_iter,
    rng_record_for_torchdata,
    sampler_state,
)

__all__ = [
    "Tracker",
    "restore_sampler",
]

# ---------------------------------------------------------------------------------------- samplers


def restore_sampler(
    index_sampler: Any, it: Iterator, main: Mapping, is_iterable: bool, finished: bool = False, record: Any = None
) -> Iterator:
    """The sampler iterator positioned at the state's `_sampler_iter_yielded` batches (at its end if `finished`);
    `record`: the random sampler's epoch record from `_raydl` (`export_sampler_state`)."""
    if is_iterable:  # the index sampler only counts: the workers' streams hold the position
        return it
    it = _position_sampler(index_sampler, it, main, record)
    if finished:  # the epoch is over: its last draws (torch's RandomSampler draws one at its end) are made
        for _ in it:
            pass
    return it


def _position_sampler(index_sampler: Any, it: Iterator, main: Mapping, record: Any) -> Iterator:
    idx_state = main.get(INDEX_SAMPLER_STATE)
    it_state = import_sampler_state(index_sampler, main.get(SAMPLER_ITER_STATE), record)
    if idx_state is not None and is_stateful(index_sampler):
        index_sampler.load_state_dict(idx_state)
        it = new_sampler_iter(index_sampler)
        if it_state is not None and is_stateful(it):
            it.load_state_dict(it_state)
        return it
    if it_state is not None and is_stateful(it):
        it.load_state_dict(it_state)
        return it
    yielded = int(main.get(SAMPLER_ITER_YIELDED) or 0)
    for n in range(yielded):
        try:
            next(it)
        except StopIteration:
            raise ValueError(
                f"the loader state is {yielded} batches into its epoch, but this loader's sampler has only {n}: "
                "the dataset or the batch size changed since the state was saved"
            ) from None
    return it


class Deal:
    """This rank's deal of the job's epoch (NOTE [ raydl global epoch ]): where it started in the
    permutation, how many samples it holds, and the state's record of the job's position."""

    def __init__(self, loader: Any, index_sampler: Any, loaded: Optional[Mapping]) -> None:
        self.sampler = distributed_sampler(index_sampler)
        self._index_sampler = index_sampler
        self._batch = loader.batch_size if loader.batch_sampler is not None and loader.batch_size else 1
        self.loaded = loaded
        self.start = 0
        self.rank_total: Optional[int] = None  # samples of this rank's deal (None: the sampler's own epoch)
        self._epoch: Optional[int] = None  # the re-dealt epoch (None: the sampler's)
        self._record = (loaded.get(RAYDL) or {}).get(GLOBAL_EPOCH) if loaded is not None else None
        load_order(
            self._record, self.sampler
        )  # the saved job's node slots and batch (NOTE [ raydl distributed slots ])
        self.redeal = loaded is not None and redeals(loaded, loader, self.sampler)

    def iterator(self) -> Iterator:
        """The re-dealt epoch's iterator over this rank's (batches of) indices."""
        it, self.start, self.rank_total = redealt_iter(self._record, self._index_sampler)  # type: ignore[arg-type]
        self._epoch = int(self._record["epoch"])  # type: ignore[index]
        return it

    def new_epoch(self) -> None:
        self.start, self.rank_total, self._epoch = 0, None, None

    def sample_key(self, base_seed: int, epoch: int) -> tuple[int, int]:
        """(key, epoch) of this epoch's per-sample seeds (NOTE [ raydl sample seeding ]): the DistributedSampler's
        seed and epoch (the re-dealt one's), else the iterator's base seed and epoch."""
        if self.sampler is None:
            return base_seed, epoch
        return int(self.sampler.seed), int(self.sampler.epoch if self._epoch is None else self._epoch)

    def record(self, batches_handed_out: int) -> Optional[dict]:
        """The job's position after this rank handed out `batches_handed_out` batches (None without a DistributedSampler)."""
        if self.sampler is None:
            return None
        total = self.rank_total if self.rank_total is not None else rank_length(self.sampler, 0)
        return epoch_record(self.sampler, self.start, min(total, batches_handed_out * self._batch), self._epoch)


# ----------------------------------------------------------------------------------------- tracker


class Tracker:
    """The driver's record of one `_RayLoaderIter`'s position (NOTE [ raydl checkpoint ]).

    Fed by the iterator's hooks (draw, batch read, batch handed out, end); `state_dict()` only
    assembles what it holds: no call to any worker, O(num_workers).
    """

    def __init__(self, loader: Any, index_sampler: Any, loaded: Optional[Mapping]) -> None:
        self.num_workers = loader.num_workers
        self.is_iterable = isinstance(loader.dataset, IterableDataset)
        self._stateless_map = not self.is_iterable and not is_stateful(loader.dataset)
        self._index_sampler = index_sampler
        self._facts = loader_facts(loader)
        self._rng_for_td = rng_record_for_torchdata(loader, index_sampler)
        self._next_draws_global = next_epoch_draws_global(loader, index_sampler)
        self.deal = Deal(loader, index_sampler, loaded)  # NOTE [ raydl global epoch ]
        if self.deal.redeal:  # the old job's position is re-dealt: nothing of its per-rank layout applies
            loaded = None
        snaps = (loaded[SNAPSHOT].get(WORKER_SNAPSHOTS) or {}) if loaded is not None else {}
        self._loaded_workers = [snaps.get(worker_key(w)) for w in range(self.num_workers)]
        # A stream without state_dict() cannot be positioned: its loader replays the batches instead.
        self.replay = 0
        if loaded is not None and self.is_iterable and self._needs_replay():
            self.replay = int(loaded[SNAPSHOT][SNAPSHOT_STEP])
        self._resumed = resumed = loaded is not None and not self.replay
        self.latest: list[Optional[dict]] = [
            self._loaded_workers[w] if resumed else self._initial(w) for w in range(self.num_workers)
        ]
        self.committed = list(self.latest)
        self.worker_states: Optional[list] = list(self.latest) if resumed else None  # what the pool starts from
        # workers whose snapshot only they know until they start: taken from their configure() reply (a resumed
        # worker's too: its dataset's state after the loaded one and `iter(dataset)`, as torchdata reports it)
        self._unreported = {w for w in range(self.num_workers) if resumed or self.latest[w] is None}
        # persistent streams restarted for this epoch: {worker: the ref of its snapshot at the restart}
        self._restarts: dict[int, Any] = {}
        # the iterator's bounded wait for its workers' start (a weak method: None once it is gone)
        self.await_start: Optional[Callable[[], Optional[Callable[[], None]]]] = None
        # what to call once every start snapshot is in (a weak method: NOTE [ raydl start hold ] in driver/lifecycle.py)
        self._when_started: Optional[Callable[[], Optional[Callable[[], None]]]] = None
        self.base_seed = 0
        # the iterator's epoch (persistent workers count them; ray_seed="batch" seeds from it)
        self.epoch = int((loaded.get(RAYDL) or {}).get("epoch", 0)) if loaded is not None and not self.replay else 0
        self._loaded = loaded
        self.len_called: Optional[int] = None
        self._pending: deque = deque()
        self._sampler_at: dict[int, tuple] = {}  # task idx -> sampler state after its draw
        self._sampler_low = -1  # no key of `_sampler_at` is below this: where the next clean-up starts
        self._record_sampler = False
        self._reset_position()

    def on_workers_started(self, started: Mapping[int, Optional[dict]]) -> None:
        """The workers started: each one with no batch read yet takes the snapshot it started with (torchdata's
        startup state; a resumed worker keeps the loaded generators, which it restored)."""
        for w in sorted(self._unreported):
            if w >= len(self.latest) or started.get(w) is None:
                continue
            old = self.latest[w]
            if old is not None and not (self._resumed and old is self._loaded_workers[w]):
                continue  # a batch of it was read already
            snap = started[w]
            if old is not None and old.get(RNG) is not None and snap.get(RNG) is None:  # type: ignore[union-attr]
                snap = {**snap, RNG: old[RNG]}  # type: ignore[dict-item]
            self.latest[w] = snap
            if self.committed[w] is old:
                self.committed[w] = snap
        self._unreported.clear()
        self._started_now()

    def call_when_started(self, callback: Callable[[], Optional[Callable[[], None]]]) -> bool:
        """Call `callback()()` (a weak method) once every worker's start snapshot is in; False when all are already:
        the loader then need not keep the iterator for them (NOTE [ raydl start hold ] in driver/lifecycle.py)."""
        if not self._unreported:
            return False
        self._when_started = callback
        return True

    def _started_now(self) -> None:
        callback, self._when_started = self._when_started, None
        release = callback() if callback is not None else None
        if release is not None:
            release()

    def on_streams_restarting(self, refs: Mapping[int, Any]) -> None:
        """Persistent iterable workers restart their streams for the epoch just begun: the refs of their snapshots
        as of the restart, which a state taken before a worker hands out a batch of the epoch reports."""
        self._restarts = dict(refs)

    def _take_restarts(self) -> None:
        """Each worker with nothing handed out since its stream restarted reports its snapshot at the restart
        (bounded wait; a worker lost meanwhile keeps a stream restarting from its beginning)."""
        import ray
        from ray.exceptions import RayError

        for w, ref in sorted(self._restarts.items()):
            try:
                snap = ray.get(ref, timeout=DEFAULT_STARTUP_TIMEOUT_S)
            except RayError:
                snap = None
            if snap is not None and w < len(self.committed):
                self.committed[w] = snap
        self._restarts.clear()

    def _needs_replay(self) -> bool:
        for snap in self._loaded_workers:
            if snap is None:
                continue
            fetcher = snap.get(FETCHER_STATE) or {}
            return snap.get(DATASET_STATE) is None and fetcher.get(DATASET_ITER_STATE) is None
        return False

    def _initial(self, worker_id: int) -> Optional[dict]:
        """A fresh worker's snapshot when the driver knows it without asking; None (start from the seed) otherwise."""
        if self._stateless_map:
            return {WORKER_ID: worker_id, FETCHER_STATE: None, DATASET_STATE: None}
        return None

    def _reset_position(self) -> None:
        self.num_yielded = 0
        self.last_worker = self.num_workers - 1
        self.finished = False
        self._frontier = 0  # first batch (task idx) not handed out
        self._done_ahead: set[int] = set()  # handed out beyond the frontier (in_order=False)

    # ---------------------------------------------------------------- epoch start

    def sampler_iter(self) -> Iterator:
        """A new epoch's sampler iterator (torch's iterators draw nothing before their first `next`)."""
        return new_sampler_iter(self._index_sampler)

    def resume_main(self, it: Iterator, base_seed: Optional[int], len_called: Optional[int]) -> tuple[Iterator, int]:
        """First epoch: position the sampler and take the base seed from a loaded state (which replaces `base_seed`,
        what the iterator drew as a new one does: NOTE [ raydl checkpoint ], draws)."""
        self.len_called = len_called
        if self.deal.redeal:
            self.base_seed = saved_base_seed(self.deal.loaded)
            return self.deal.iterator(), self.base_seed
        if self._loaded is None:
            assert base_seed is not None
            self.base_seed = base_seed
            return it, self.base_seed
        main = self._loaded[SNAPSHOT][MAIN_SNAPSHOT]
        self.base_seed = int(main[BASE_SEED])
        if not self.replay:
            it = restore_sampler(
                self._index_sampler,
                it,
                main,
                self.is_iterable,
                bool(self._loaded.get(FINISHED)),
                (self._loaded.get(RAYDL) or {}).get(SAMPLER_EPOCH),
            )
        return it, self.base_seed

    def start_epoch(self, it: Iterator, first_iter: bool, epoch: int) -> tuple[int, int]:
        """Cursors for a new epoch: (idx of its first task, first worker of the round robin)."""
        self.epoch = epoch
        self._pending.clear()
        self._restarts.clear()
        self._sampler_at = {}
        self._reset_position()
        if not first_iter:
            self.deal.new_epoch()
        if not first_iter:
            if self.is_iterable:  # persistent workers restart their streams each epoch
                self.committed = [self._fresh_stream(s) for s in self.latest]
            else:
                self.committed = list(self.latest)
        start, first_worker = 0, 0
        if first_iter and self._loaded is not None and not self.replay:
            snap = self._loaded[SNAPSHOT]
            start = (
                int(snap[MAIN_SNAPSHOT].get(SAMPLER_ITER_YIELDED) or 0)
                if not self.is_iterable
                else int(snap[SNAPSHOT_STEP])
            )
            self.num_yielded = int(snap[SNAPSHOT_STEP])
            self.last_worker = int(snap[LAST_YIELDED_WORKER_ID])
            first_worker = (self.last_worker + 1) % self.num_workers
            self._frontier = start
            if not self.is_iterable:
                self._done_ahead = set((self._loaded.get(RAYDL) or {}).get("done_ahead") or [])
        # An iterable's sampler only counts (its workers' streams hold the position): nothing to record.
        self._record_sampler = not self.is_iterable and (is_stateful(it) or is_stateful(self._index_sampler))
        if not self.is_iterable:
            self._sampler_at[self._frontier - 1] = sampler_state(self._index_sampler, it)
        self._sampler_low = self._frontier - 1
        return start, first_worker

    @staticmethod
    def _fresh_stream(snap: Optional[dict]) -> Optional[dict]:
        if snap is None:
            return None
        return {**snap, FETCHER_STATE: {DATASET_ITER_STATE: None, FETCHER_ENDED: False}}

    # ---------------------------------------------------------------- per task

    def skip(self, idx: int) -> bool:
        """Whether task `idx` was handed out before the state was taken (in_order=False): draw it, send nothing."""
        return idx in self._done_ahead

    def on_draw(self, idx: int, it: Iterator) -> None:
        """Task `idx`'s indices were drawn: record the sampler's state after them (samplers with state only)."""
        if self._record_sampler:
            self._sampler_at[idx] = sampler_state(self._index_sampler, it)

    def _ensure(self, worker_id: int) -> None:
        """A worker id the pool added (a resize, NOTE [ raydl elastic pool ]): start its records."""
        while len(self.latest) <= worker_id:
            self.latest.append(self._initial(len(self.latest)))
            self.committed.append(self.latest[-1])

    def on_batch_made(self, idx: int, worker_id: int, meta: Any) -> None:
        """A task's result was read (it will be handed out next, or after the pin thread's look-ahead)."""
        self._ensure(worker_id)
        prev = self.latest[worker_id]
        snap = meta.state if meta.state is not None else self._initial(worker_id)
        prev_rng = prev.get(RNG) if prev else None
        # a worker sends only the generators that moved (_worker_state.RngTracker): merge into the last set
        rng = prev_rng if meta.rng is None else ({**prev_rng, **meta.rng} if prev_rng else meta.rng)
        if rng is not None:
            snap = {**(snap or {WORKER_ID: worker_id, FETCHER_STATE: None, DATASET_STATE: None}), RNG: rng}
        self.latest[worker_id] = snap
        self._pending.append((idx, worker_id, snap, bool(meta.signal)))

    def on_batch_failed(self, idx: int) -> None:
        """Task `idx` raised in user code: it counts as consumed once the caller goes on."""
        self._pending.append((idx, None, None, True))

    def _commit_next(self) -> tuple[Optional[int], bool]:
        """Commit the oldest pending task: (its worker, whether it was a signal or a failure, not a batch)."""
        idx, worker_id, snap, not_a_batch = self._pending.popleft()
        self._consumed(idx)
        if worker_id is not None:
            self.committed[worker_id] = snap
            self._restarts.pop(worker_id, None)
        return worker_id, not_a_batch

    def on_handed_out(self) -> None:
        """The caller got the next batch: commit the records up to it."""
        while self._pending:
            worker_id, not_a_batch = self._commit_next()
            if not not_a_batch:
                self.num_yielded += 1
                self.last_worker = worker_id
                return

    def on_end(self) -> None:
        """The epoch ended (StopIteration reached the caller)."""
        while self._pending:
            self._commit_next()
        self.finished = True

    def _consumed(self, idx: int) -> None:
        if self.is_iterable:
            # Tasks of a retired stream are dropped unread: no frontier for an iterable (its position
            # is its streams' state and the batch count).
            return
        if idx != self._frontier:
            self._done_ahead.add(idx)
            return
        self._frontier += 1
        while self._frontier in self._done_ahead:
            self._done_ahead.discard(self._frontier)
            self._frontier += 1
        # the states the frontier passed, each dropped once: O(1) a batch, not a walk over the batches in flight
        while self._sampler_low < self._frontier - 1:
            self._sampler_at.pop(self._sampler_low, None)
            self._sampler_low += 1

    def restart_state(self, worker_id: int) -> Optional[dict]:
        """What a replacement for a dead worker starts from: its predecessor's state after its last batch read."""
        self._ensure(worker_id)
        return self.latest[worker_id]

    # ---------------------------------------------------------------- the state

    def state_dict(self) -> dict:
        if self._unreported and self.await_start is not None:
            wait = self.await_start()  # before any batch: the workers' start replies hold their snapshots
            if wait is not None:
                wait()
        if self._restarts:
            self._take_restarts()
        # the caller's copy: a record kept without one (`fresh_state`) shares its generator state with the iterator
        it_state, idx_state = by_value(self._sampler_at.get(self._frontier - 1, (None, None)))
        it_state, record = export_sampler_state(self._index_sampler, it_state, self._rng_for_td)
        if self.is_iterable:
            it_state = iterable_sampler_state(self._index_sampler, self.num_yielded)
        main = {
            NUM_WORKERS: self.num_workers,
            SAMPLER_ITER_STATE: it_state,
            INDEX_SAMPLER_STATE: idx_state,
            SAMPLER_ITER_YIELDED: self.num_yielded if self.is_iterable else self._frontier,
            LEN_CALLED: self.len_called,
            SHARED_SEED: None,
            BASE_SEED: self.base_seed,
        }
        ours = {
            **self._facts,
            SAMPLER_EPOCH: record,
            GLOBAL_EPOCH: self.deal.record(self._frontier),
            "done_ahead": sorted(self._done_ahead),
            "epoch": self.epoch,
        }
        if self.finished and self._next_draws_global:  # the next epoch's draws: NOTE [ raydl checkpoint ], draws
            ours[NEXT_EPOCH_RNG] = global_rng_record()
        return {
            SNAPSHOT: {
                SNAPSHOT_STEP: self.num_yielded,
                LAST_YIELDED_WORKER_ID: self.last_worker,
                MAIN_SNAPSHOT: main,
                WORKER_SNAPSHOTS: {worker_key(w): self.committed[w] for w in range(len(self.committed))},
            },
            STEPS_SINCE_SNAPSHOT: 0,
            FINISHED: self.finished,
            RAYDL: ours,
        }
