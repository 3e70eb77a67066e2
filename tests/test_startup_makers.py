"""A start-up process on its own (NOTE [ raydl start-up process ]): no Ray, no loader, just the fork and its pipe."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch.utils.data import default_collate

from raydl.driver.coldstart.makers import ForkedMaker, MakerDied
from raydl.worker.actor import BatchFailed, WorkerBody, WorkerPayload
from raydl.worker.startup import StartSpec
from raydl.worker.transfer import decode
from tests import _datasets as D


def _spec(dataset, worker_init_fn=None) -> StartSpec:
    payload = WorkerPayload(dataset, False, True, default_collate, False, worker_init_fn, stats_name="test")
    return StartSpec(payload, num_workers=2, base_seed=1234, epoch=0)


@contextlib.contextmanager
def _forked(dataset, worker_id: int = 0, worker_init_fn=None):
    maker = ForkedMaker(_spec(dataset, worker_init_fn), worker_id=worker_id, worker_state=None)
    try:
        yield maker
    finally:
        maker.stop()


def _read_batch(maker: ForkedMaker):
    assert maker.poll(60)
    reply = maker.read()
    if reply is None:  # the start reply comes first
        assert maker.poll(60)
        reply = maker.read()
    return reply


def test_batches_and_metas_are_the_actors():
    """What a start-up process sends for a task is what a `WorkerBody` (the actor's body) makes for it: batch, state and generators."""
    dataset = D.RandomAugmentDataset(16)
    reference = WorkerBody()
    reference.in_actor = False
    reference.configure(_spec(dataset).payload, 1, 2, 1234)
    try:
        with _forked(dataset, worker_id=1) as maker:
            for idx, index in [(1, [2, 3]), (3, [6, 7])]:
                maker.send(0, idx, index)
                batch, meta = _read_batch(maker)
                (want,), (want_meta,) = reference._fetch_many(0, [(idx, index)])
                torch.testing.assert_close(decode(batch), decode(want), rtol=0, atol=0)
                assert (meta.worker_id, meta.idx, meta.samples, meta.rng.keys()) == (1, idx, 2, want_meta.rng.keys())
            assert maker.pid != os.getpid()
    finally:
        # the body set torch's worker info in this (pytest's) process: later tests read None there
        reference.reset()
    assert torch.utils.data.get_worker_info() is None


def test_a_process_that_dies_is_reported_with_its_exit_code():
    with _forked(D.PoisonDataset(8, bad_index=3)) as maker:
        maker.send(0, 0, [2, 3])
        with pytest.raises(MakerDied, match=r"start-up process \(pid \d+\) exited unexpectedly \(exit code 3\)"):
            _read_batch(maker)


def test_user_errors_come_back_as_failed_batches_and_start_errors_in_torchs_form():
    with _forked(D.RaisingDataset(8, bad_index=1)) as maker:
        maker.send(0, 0, [0, 1])
        maker.send(0, 1, [2, 3])
        failed, _ = _read_batch(maker)
        assert isinstance(failed, BatchFailed) and "Traceback" in failed.traceback
        ok, _ = _read_batch(maker)  # the process goes on after a user error, as a torch worker does
        assert decode(ok).flatten().tolist() == [2, 3]
    with _forked(D.RangeDataset(8), worker_init_fn=D.failing_init_fn) as broken:
        assert broken.poll(60)
        with pytest.raises(RuntimeError, match=r"Caught RuntimeError in raydl worker 0's start-up process .* starting"):
            broken.read()


def test_stop_ends_a_busy_process():
    """A process still in a long __getitem__ when its iterator goes is killed, not waited for."""
    maker = ForkedMaker(_spec(D.SlowDataset(8, {0: 60.0})), worker_id=0, worker_state=None)
    maker.send(0, 0, [0, 1])
    maker.stop()
    assert not maker._proc.is_alive()
