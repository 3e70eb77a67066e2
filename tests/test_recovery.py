"""Worker loss costs no data: dead workers are replaced and their batches resent (NOTE [ raydl recovery ])."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import raydl
from tests import _datasets as D

pytestmark = pytest.mark.usefixtures("ray_session")

TIMEOUT_S = 60


def _kill_one_worker_and_expect(loader, worker_id: int, match: str) -> None:
    """After the first batch, kill one worker actor; the rest of the epoch must raise WorkerDiedError matching `match`."""
    import ray

    it = iter(loader)
    next(it)
    ray.kill(it._pool.actors[worker_id], no_restart=True)
    with pytest.raises(raydl.WorkerDiedError, match=match):
        for _ in it:
            pass


def _torch_batches(dataset, **kwargs):
    return [b.tolist() for b in torch.utils.data.DataLoader(dataset, **kwargs)]


@pytest.mark.parametrize("in_order", [True, False])
def test_process_exit_inside_a_sample_is_recovered(tmp_path, in_order):
    """A worker whose process exits mid-sample is replaced: every batch once, in order, torch's content."""
    kwargs = dict(batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1))
    expected = _torch_batches(D.RangeDataset(30), **kwargs)
    kwargs["generator"] = torch.Generator().manual_seed(1)
    loader = raydl.DataLoader(
        D.ExitOnceDataset(30, bad_index=17, marker=str(tmp_path / "died")),
        num_workers=2,
        timeout=TIMEOUT_S,
        in_order=in_order,
        **kwargs,
    )
    actual = [b.tolist() for b in loader]
    assert (tmp_path / "died").exists(), "the worker never died: the test exercised nothing"
    if in_order:
        assert actual == expected
    else:
        assert sorted(actual) == sorted(expected)


def test_sigkill_from_outside_is_recovered():
    """SIGKILL of a worker's process from outside, mid-epoch: the epoch completes, in order, without loss."""
    loader = raydl.DataLoader(
        D.SlowDataset(24, {i: 0.05 for i in range(24)}), batch_size=2, num_workers=2, timeout=TIMEOUT_S
    )
    it = iter(loader)
    out = [next(it).flatten().tolist() for _ in range(2)]
    victim = it.worker_records[1]
    os.kill(victim.pid, signal.SIGKILL)
    out += [b.flatten().tolist() for b in it]
    assert out == [[i, i + 1] for i in range(0, 24, 2)]
    assert it._pool.restarts == [0, 1]


@pytest.mark.parametrize("bad_index", [4, 5])
def test_poison_batch_ends_in_a_clear_error(bad_index):
    """A batch that kills every worker it reaches ends, after ray_max_worker_restarts, in WorkerDiedError naming it.

    Every batch before it is handed out first. bad_index=4 kills the worker the moment it starts
    batch 2, right after it finished batch 0: Ray may then report batch 0 as lost too, and only
    the replacement's one-at-a-time re-making (probation) pins the death on the right batch.
    """
    loader = raydl.DataLoader(
        D.PoisonDataset(12, bad_index=bad_index),
        batch_size=2,
        num_workers=2,
        timeout=TIMEOUT_S,
        ray_max_worker_restarts=1,
    )
    seen = []
    t0 = time.monotonic()
    with pytest.raises(raydl.WorkerDiedError) as info:
        for batch in loader:
            seen.append(batch.flatten().tolist())
    msg = str(info.value)
    assert "raydl worker 0" in msg and "ray_max_worker_restarts=1" in msg
    assert "while making batch 2 (indices [4, 5]) after" in msg, msg
    assert seen == [[0, 1], [2, 3]]
    assert time.monotonic() - t0 < 60


def test_worker_init_fn_that_kills_the_process_ends_in_a_clear_error():
    """A worker_init_fn that kills every process is retried ray_max_worker_restarts times, then named as the cause."""
    loader = raydl.DataLoader(
        D.RangeDataset(8),
        batch_size=2,
        num_workers=1,
        worker_init_fn=D.exiting_init_fn,
        timeout=TIMEOUT_S,
        ray_max_worker_restarts=1,
    )
    with pytest.raises(raydl.WorkerDiedError) as info:
        next(iter(loader))
    msg = str(info.value)
    assert "raydl worker 0" in msg and "died while starting" in msg and "worker_init_fn" in msg, msg
    assert "after 1 restart(s) (ray_max_worker_restarts=1)" in msg


def test_death_on_the_first_batch_is_recovered_and_named():
    """A worker dying on its first batch, right after starting, is one more recoverable death; the batch is named."""
    loader = raydl.DataLoader(
        D.PoisonDataset(8, bad_index=0), batch_size=2, num_workers=1, timeout=TIMEOUT_S, ray_max_worker_restarts=1
    )
    with pytest.raises(raydl.WorkerDiedError) as info:
        next(iter(loader))
    msg = str(info.value)
    assert "while making batch 0 (indices [0, 1])" in msg and "after 1 restart(s)" in msg, msg


def _check_invariants(it) -> None:
    """The invariants written in _RayLoaderIter's docstring and NOTE [ raydl scheduling ]."""
    sched = it._sched
    tasks = sched.task_info
    assert 0 <= it._rcvd_idx <= it._send_idx
    assert all(it._rcvd_idx <= i < it._send_idx for i in tasks)
    assert sched.tasks_outstanding == len(tasks) <= it._prefetch_factor * it._num_workers
    for w in range(it._num_workers):
        mine = sorted(i for i, t in tasks.items() if t.worker_id == w)
        assert sched.workers_num_tasks[w] == len(mine)
        sent = [i for i in mine if tasks[i].ref is not None]
        if w in sched.probation:
            assert sent == mine[:1], f"worker {w} on probation has {sent} sent of {mine}"
        else:  # the rest wait for a full call (NOTE [ raydl calls ]): younger than the sent ones, fewer than a call
            assert sent == mine[: len(sent)], f"worker {w} has {sent} sent of {mine}"
            assert len(mine) - len(sent) < sched.batches_per_call(w)


@pytest.mark.parametrize("in_order", [True, False])
def test_replacement_remakes_lost_batches_one_at_a_time(in_order):
    """After a SIGKILL with four batches lost, the replacement has one in flight until they are re-made; torch's batches."""
    kwargs = dict(batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(3))
    expected = _torch_batches(D.RangeDataset(40), **kwargs)
    kwargs["generator"] = torch.Generator().manual_seed(3)
    loader = raydl.DataLoader(
        D.SlowDataset(40, {i: 0.02 for i in range(40)}),
        num_workers=2,
        prefetch_factor=4,
        timeout=TIMEOUT_S,
        in_order=in_order,
        **kwargs,
    )
    it = iter(loader)
    out = [next(it).tolist()]
    _check_invariants(it)
    os.kill(it.worker_records[1].pid, signal.SIGKILL)
    probation_seen = 0
    while True:
        try:
            out.append(next(it).tolist())
        except StopIteration:
            break
        _check_invariants(it)
        probation_seen += 1 in it._sched.probation
    assert out == expected if in_order else sorted(out) == sorted(expected)
    assert it._pool.restarts == [0, 1]
    assert probation_seen >= 2, "the replacement was never on probation: the test exercised nothing"


def test_recovery_disabled_raises_at_once():
    """ray_max_worker_restarts=0: a killed worker surfaces as WorkerDiedError naming it (no hang, no retry)."""
    loader = raydl.DataLoader(
        D.SlowDataset(8, {i: 0.3 for i in range(8)}),
        batch_size=1,
        num_workers=2,
        timeout=TIMEOUT_S,
        ray_max_worker_restarts=0,
    )
    _kill_one_worker_and_expect(loader, worker_id=1, match="raydl worker 1")


def test_iterable_worker_death_is_a_clear_error():
    """IterableDataset workers are not replayed: their death raises WorkerDiedError explaining why."""
    loader = raydl.DataLoader(D.UnshardedIterable(200), batch_size=2, num_workers=2, timeout=TIMEOUT_S)
    _kill_one_worker_and_expect(loader, worker_id=0, match="does not restart IterableDataset workers")


def test_persistent_worker_killed_between_epochs():
    """A persistent worker killed between epochs is replaced during the next epoch, which is complete."""
    loader = raydl.DataLoader(
        D.RangeDataset(10), batch_size=2, num_workers=2, persistent_workers=True, timeout=TIMEOUT_S
    )
    with loader:
        assert len(list(loader)) == 5
        os.kill(loader.worker_records[0].pid, signal.SIGKILL)
        time.sleep(0.5)
        assert [b.flatten().tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
