"""The stats recorder is fed by events (NOTE [ raydl stats ]): it reports what it was sent, holds no iterator, and lets
go of the epoch's parts with their iterator. Pure logic: no Ray."""

from __future__ import annotations

import gc
import inspect

from raydl._errors import WorkerRecord
from raydl.driver.schedule import Schedule
from raydl.driver.stats.recorder import StatsRecorder, make_recorder
from raydl.worker.actor import BatchMeta


def _never_sent(worker_id, epoch, items):  # the tasks below stay pending: no call is made
    raise AssertionError("no call expected")


def test_the_recorder_takes_no_iterator():
    """Neither the recorder nor `make_recorder` has a parameter for an iterator: all it knows is sent to it."""
    assert list(inspect.signature(StatsRecorder).parameters) == ["name", "threads_per_worker", "hint_given"]
    assert list(inspect.signature(make_recorder).parameters) == ["name", "threads_per_worker", "hint_given"]


def test_workers_and_restarts_come_from_events():
    """A snapshot shows the worker records and restarts last sent, as the pool held them then."""
    rec = StatsRecorder("events")
    rec._next_flush = float("inf")  # no Ray metrics here
    rec.begin_epoch()
    records = [WorkerRecord(0, 101, "n0", "10.0.0.1"), None]
    restarts = [0, 0]
    rec.workers(records, restarts)
    rec.batch_made(BatchMeta(1, 0, 0.0, 0.01, samples=2, nbytes=10, cpu_s=0.0))
    s = rec.snapshot()
    assert [(w.worker_id, w.pid, w.node_ip, w.restarts) for w in s.workers] == [(0, 101, "10.0.0.1", 0), (1, 0, "", 0)]
    records[1] = WorkerRecord(1, 202, "n1", "10.0.0.2")  # the pool's list, changed in place: read at the snapshot
    restarts[1] = 1
    s = rec.snapshot()
    assert [(w.worker_id, w.pid, w.restarts) for w in s.workers] == [(0, 101, 0), (1, 202, 1)]
    rec.workers([None, None, WorkerRecord(2, 303, "n2", "10.0.0.3")], [0, 0, 0])  # a pool that replaced its lists
    assert [(w.worker_id, w.pid) for w in rec.snapshot().workers] == [(1, 0), (2, 303)]


def test_in_flight_comes_from_the_watched_schedule_held_weakly():
    """Batches in flight are the watched schedule's tasks; once the schedule is gone (with its iterator), none."""
    rec = StatsRecorder("events")
    rec._next_flush = float("inf")
    rec.begin_epoch()
    assert rec.snapshot().batches_in_flight == 0  # nothing watched yet
    sched = Schedule(2, 8, True, _never_sent, batches_per_call=4)
    rec.watch(sched)
    for idx in range(3):
        sched.add(idx, idx % 2, [idx], [idx])
    s = rec.snapshot()
    assert (s.batches_in_flight, s.store_bytes_held) == (3, 0)  # pending tasks: no call, nothing made yet
    assert s.cache is None  # no node cache watched
    del sched
    gc.collect()
    assert rec.snapshot().batches_in_flight == 0
