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


def test_poison_batch_ends_in_a_clear_error():
    """A batch that kills every worker it reaches ends, after ray_max_worker_restarts, in WorkerDiedError naming it."""
    loader = raydl.DataLoader(
        D.PoisonDataset(12, bad_index=5), batch_size=2, num_workers=2, timeout=TIMEOUT_S, ray_max_worker_restarts=1
    )
    seen = []
    t0 = time.monotonic()
    with pytest.raises(raydl.WorkerDiedError) as info:
        for batch in loader:
            seen.append(batch.flatten().tolist())
    msg = str(info.value)
    assert "raydl worker 0" in msg and "batch 2" in msg and "[4, 5]" in msg and "ray_max_worker_restarts=1" in msg
    assert seen == [[0, 1], [2, 3]]
    assert time.monotonic() - t0 < 60


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
    loader = raydl.DataLoader(D.RangeDataset(10), batch_size=2, num_workers=2, persistent_workers=True, timeout=TIMEOUT_S)
    with loader:
        assert len(list(loader)) == 5
        os.kill(loader.worker_records[0].pid, signal.SIGKILL)
        time.sleep(0.5)
        assert [b.flatten().tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
