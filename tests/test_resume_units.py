"""The driver's resume bookkeeping (raydl/driver/state/checkpoint.py Tracker) without Ray: look-ahead and out-of-order hand-out."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, SequentialSampler

from raydl.driver.state.checkpoint import Tracker
from raydl.worker.actor import BatchMeta
from tests import _datasets as D


class _Loader:
    """What Tracker reads from a loader."""

    def __init__(self, n: int, batch_size: int, workers: int) -> None:
        self.dataset = D.RangeDataset(n)
        self.num_workers, self.batch_size, self.drop_last = workers, batch_size, False
        self.generator = None
        self.sampler = SequentialSampler(range(n))
        self.batch_sampler = BatchSampler(self.sampler, batch_size, False)


def _tracker(n=40, bs=2, workers=2):
    loader = _Loader(n, bs, workers)
    t = Tracker(loader, loader.batch_sampler, None)
    it = t.sampler_iter()
    it, _ = t.resume_main(it, 123, None)
    t.start_epoch(it, first_iter=True, epoch=0)
    return t, it


def _rng(tag: int) -> dict:
    return {"python": [3, f"p{tag}", None], "torch": f"t{tag}", "numpy": ["MT19937", f"n{tag}", 0, 0, 0.0]}


def test_batches_read_ahead_are_not_in_the_state():
    """The pin thread reads batches ahead: only batches handed to the loop count, each worker's RNG as of its last one."""
    t, it = _tracker()
    for idx in range(4):
        next(it)
        t.on_draw(idx, it)
        t.on_batch_made(idx, idx % 2, BatchMeta(idx % 2, idx, 0.0, 0.0, rng=_rng(idx)))
    t.on_handed_out()  # the loop got batch 0; batches 1-3 are in the pin thread
    state = t.state_dict()["_snapshot"]
    assert state["_snapshot_step"] == 1 and state["_last_yielded_worker_id"] == 0
    assert state["_main_snapshot"]["_sampler_iter_yielded"] == 1
    assert state["_main_snapshot"]["_sampler_iter_state"] == {"samples_yielded": 2}
    assert state["_worker_snapshots"]["worker_0"]["_raydl_rng"] == _rng(0)
    assert "_raydl_rng" not in state["_worker_snapshots"]["worker_1"]  # worker 1 has handed out nothing yet
    assert t.restart_state(1)["_raydl_rng"] == _rng(3)  # a replacement starts after the last batch read


def test_unchanged_rng_keeps_the_last_one_sent():
    """A worker sends its generators only when they moved: None means the last ones it sent."""
    t, it = _tracker()
    for idx, rng in enumerate([_rng(0), None, None]):
        next(it)
        t.on_draw(idx, it)
        t.on_batch_made(idx, 0, BatchMeta(0, idx, 0.0, 0.0, rng=rng))
        t.on_handed_out()
    assert t.state_dict()["_snapshot"]["_worker_snapshots"]["worker_0"]["_raydl_rng"] == _rng(0)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_out_of_order_hand_out_records_exactly_what_is_left(data):
    """in_order=False: whatever order batches are handed out in, the state's position (first missing batch) and
    the batches handed out beyond it describe exactly the batches not yet handed out."""
    n_batches = data.draw(st.integers(1, 12))
    t, it = _tracker(n=2 * n_batches)
    order = data.draw(st.permutations(range(n_batches)))
    k = data.draw(st.integers(0, n_batches))
    for idx in range(n_batches):
        next(it)
        t.on_draw(idx, it)
    for idx in order[:k]:
        t.on_batch_made(idx, idx % 2, BatchMeta(idx % 2, idx, 0.0, 0.0))
        t.on_handed_out()
    state = t.state_dict()
    frontier = state["_snapshot"]["_main_snapshot"]["_sampler_iter_yielded"]
    ahead = set(state["_raydl"]["done_ahead"])
    left = {i for i in range(n_batches) if i >= frontier and i not in ahead}
    assert left == set(order[k:])
    assert state["_snapshot"]["_snapshot_step"] == k
    assert torch.tensor(sorted(ahead)).ge(frontier).all() if ahead else True
