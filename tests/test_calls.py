"""Several batches per actor call (NOTE [ raydl calls ] in raydl/driver/schedule.py): what grouping could break.

The whole parity and property suites also run with grouping forced (`pytest --ray-batches-per-call=4`);
these tests force it where it matters and check what a user sees against torch (and torchdata for
states): order, content, each batch made once, errors at their turn, recovery, resizing.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
import torch

import raydl
from raydl.driver.schedule import Schedule
from tests import _datasets as D
from tests._parity import assert_batches_equal, assert_same_batches, run_epochs
from tests._resume_parity import check_resume

pytestmark = pytest.mark.usefixtures("ray_session")

TIMEOUT_S = 120


@pytest.fixture
def calls_of():
    """`calls_of(k)`: every raydl.DataLoader built in the test carries up to k batches per call by default, so
    harnesses that build torchdata's loader from the same kwargs need no raydl-only argument."""
    defaults = raydl.DataLoader.__init__.__kwdefaults__
    old = defaults["ray_batches_per_call"]
    yield lambda k: defaults.__setitem__("ray_batches_per_call", k)
    defaults["ray_batches_per_call"] = old


def _torch(dataset, **kwargs):
    return [b.flatten().tolist() for b in torch.utils.data.DataLoader(dataset, **kwargs)]


class LoggedExitDataset(D.RangeDataset):
    """Logs every item it makes (one line each, appended) and exits the process at `bad_index` once."""

    def __init__(self, n: int, bad_index: int, log: str, marker: str) -> None:
        super().__init__(n)
        self.bad_index, self.log, self.marker = bad_index, log, marker

    def __getitem__(self, i):
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        if i == self.bad_index and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return torch.tensor([i])


# --------------------------------------------------------------------------- the configuration people write


def test_default_configuration_matches_torch():
    """shuffle=True, no generator, default arguments: torch's batches, with adaptive grouping on (the default)."""
    torch.manual_seed(5)  # no generator: both loaders draw from torch's global RNG
    expected = run_epochs(
        torch.utils.data.DataLoader(D.RandomAugmentDataset(200), batch_size=4, shuffle=True, num_workers=2), 2
    )
    torch.manual_seed(5)
    with raydl.DataLoader(D.RandomAugmentDataset(200), batch_size=4, shuffle=True, num_workers=2) as loader:
        actual = run_epochs(loader, 2)
    for e, (exp, act) in enumerate(zip(expected, actual)):
        assert len(exp) == len(act)
        for i, (x, y) in enumerate(zip(exp, act)):
            assert_batches_equal(x, y, f"epoch {e} batch {i}")


@pytest.mark.parametrize("in_order", [True, False])
def test_forced_grouping_matches_torch_over_epochs(calls_of, in_order):
    """k=4 with a prefetch bound that lets it: torch's batches (random augmentation in the workers), two epochs."""
    calls_of(4)
    assert_same_batches(  # with in_order=False torch's own worker choice depends on timing: content without RNG
        (lambda: D.RandomAugmentDataset(96)) if in_order else (lambda: D.RangeDataset(96)),
        epochs=2,
        compare="exact" if in_order else "multiset",
        batch_size=3,
        shuffle=True,
        num_workers=2,
        prefetch_factor=4,
        persistent_workers=True,
        in_order=in_order,
    )


def test_grouping_happens_and_respects_the_prefetch_bound(calls_of):
    """Forced k=4: fewer calls than batches, and never more than prefetch_factor x num_workers batches assigned."""
    calls_of(4)
    loader = raydl.DataLoader(D.RangeDataset(64), batch_size=2, num_workers=2, prefetch_factor=2, timeout=TIMEOUT_S)
    it = iter(loader)
    out, most = [], 0
    for b in it:
        out.append(b.flatten().tolist())
        most = max(most, it._sched.tasks_outstanding)
    assert out == [[i, i + 1] for i in range(0, 64, 2)]
    assert most <= 2 * 2
    assert it._sched.calls_sent <= 32 // 2 + 2, it._sched.calls_sent  # k capped at the worker's share, 2


def test_iterable_streams_with_grouping(calls_of):
    """Uneven IterableDataset shards over 2 workers, k=4: torch's batches, each stream's end honoured."""
    calls_of(4)
    assert_same_batches(lambda: D.UnevenIterable([7, 2]), batch_size=2, num_workers=2, prefetch_factor=4)


# --------------------------------------------------------------------------- errors, recovery, resizing mid-call


def test_error_in_the_middle_of_a_call_is_raised_at_its_turn(calls_of):
    """A batch of a 4-batch call raises: the batches before and after it in the call come out, the error at its
    turn with the worker's traceback, and the epoch goes on after it as torch's does."""
    calls_of(4)

    def run(loader):
        out = []
        it = iter(loader)
        while True:
            try:
                out.append(next(it).flatten().tolist())
            except StopIteration:
                return out
            except ValueError as e:
                assert "bad index 9" in str(e) and "Traceback" in str(e)
                out.append("error")

    kwargs = dict(batch_size=2, num_workers=2, prefetch_factor=4)
    expected = run(torch.utils.data.DataLoader(D.RaisingDataset(32, bad_index=9), **kwargs))
    assert run(raydl.DataLoader(D.RaisingDataset(32, bad_index=9), timeout=TIMEOUT_S, **kwargs)) == expected
    assert expected.count("error") == 1


def test_worker_killed_mid_call_remakes_only_that_call(calls_of, tmp_path):
    """Worker 0 exits in the second batch of its second 4-batch call: the epoch is torch's, batch for batch, and
    the only samples made twice are those of that call (the batches already received are not made again)."""
    calls_of(4)
    log, marker = str(tmp_path / "made"), str(tmp_path / "died")
    # no shuffle, batch 2, 2 workers: worker 0 makes batches 0, 2, 4, ...; its second call is batches 8..14, and
    # batch 10 holds samples 20 and 21
    loader = raydl.DataLoader(
        LoggedExitDataset(64, 20, log, marker), batch_size=2, num_workers=2, prefetch_factor=4, timeout=TIMEOUT_S
    )
    it = iter(loader)
    out = [b.flatten().tolist() for b in it]
    assert os.path.exists(marker), "the worker never died: the test exercised nothing"
    assert out == [[i, i + 1] for i in range(0, 64, 2)]
    assert it._pool.restarts[0] == 1
    made = Counter(int(line) for line in open(log).read().split())
    twice = {i for i, n in made.items() if n > 1}
    assert all(n <= 2 for n in made.values()), made
    second_call = {s for b in (8, 10, 12, 14) for s in (2 * b, 2 * b + 1)}
    assert 20 in twice and twice <= second_call, sorted(twice)


def test_sigkill_while_received_batches_wait_is_recovered(calls_of):
    """SIGKILL of a worker whose received call still has batches waiting to be handed out: no batch lost or
    repeated, in order."""
    calls_of(4)
    loader = raydl.DataLoader(
        D.SlowDataset(48, {i: 0.02 for i in range(48)}),
        batch_size=2,
        num_workers=2,
        prefetch_factor=4,
        timeout=TIMEOUT_S,
    )
    it = iter(loader)
    out = [next(it).flatten().tolist()]  # worker 0's first call is in hand: three of its batches wait
    os.kill(it.worker_records[0].pid, signal.SIGKILL)
    out += [b.flatten().tolist() for b in it]
    assert out == [[i, i + 1] for i in range(0, 48, 2)]


def test_in_order_false_slow_first_batch_of_a_call_holds_back_no_other_worker(calls_of):
    """in_order=False, k=2: worker 0's call starts with a slow batch; worker 1's batches come out meanwhile, and
    worker 0's still come out in the order it made them."""
    calls_of(2)
    loader = raydl.DataLoader(
        D.SlowDataset(16, {0: 2.0}), batch_size=1, num_workers=2, in_order=False, timeout=TIMEOUT_S
    )
    out = [int(b) for b in loader]
    assert sorted(out) == list(range(16))
    assert out[0] != 0 and out.index(1) < out.index(0), out
    assert out.index(0) < out.index(2), out  # one worker's batches in its order


def test_resize_mid_call_keeps_torchs_batches(calls_of):
    """set_num_workers up and down mid-epoch with k=4 calls in flight: torch's batches, in order."""
    calls_of(4)
    kwargs = dict(batch_size=2, shuffle=True)
    expected = _torch(D.RangeDataset(120), generator=torch.Generator().manual_seed(3), **kwargs)
    loader = raydl.DataLoader(
        D.RangeDataset(120),
        num_workers=2,
        prefetch_factor=4,
        timeout=TIMEOUT_S,
        generator=torch.Generator().manual_seed(3),
        **kwargs,
    )
    it = iter(loader)
    out = []
    for i, b in enumerate(it):
        out.append(b.flatten().tolist())
        if i == 3:
            loader.set_num_workers(3)
        if i == 30:
            loader.set_num_workers(1)
    assert out == expected


# --------------------------------------------------------------------------- resume: a state taken mid-call


def test_state_while_a_call_is_half_received_resumes_as_torchdata(calls_of):
    """States after 1, 3 and 5 batches, with 4-batch calls partly handed out, shuffle=True and no generator: raydl
    and torchdata resume each other's states batch for batch."""
    calls_of(4)
    check_resume(
        lambda: D.RangeDataset(64),
        lambda: dict(batch_size=2, shuffle=True, prefetch_factor=4),
        num_workers=2,
        ks=(1, 3, 5),
        same_uninterrupted=False,  # torchdata's RandomSampler draws a permutation more (tests/_resume_parity.py)
        next_from_state=False,
    )


def test_state_mid_call_keeps_worker_random_draws(calls_of):
    """Random augmentation drawn in the workers: each state's per-worker RNG is the one after the last batch handed
    out, not after its call's last batch (against torchdata, which samples in order here: its shuffle=True uses
    another sampler; and raydl against itself with shuffle=True and a generator)."""
    calls_of(4)
    check_resume(
        lambda: D.RandomAugmentDataset(64),
        lambda: dict(batch_size=2, prefetch_factor=4),
        num_workers=2,
        ks=(1, 3, 5),
        td_resume_exact=False,
    )
    check_resume(
        lambda: D.RandomAugmentDataset(64),
        lambda: dict(batch_size=2, shuffle=True, prefetch_factor=4, generator=torch.Generator().manual_seed(7)),
        num_workers=2,
        ks=(1, 3),
        cross=False,
    )


# --------------------------------------------------------------------------- the rule, on simulated timings


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, worker_id, epoch, tasks):
        self.calls.append((worker_id, [idx for idx, _ in tasks]))
        return object(), object(), None


def _schedule(workers=2, max_tasks=16, k=None, rec=None):
    return Schedule(workers, max_tasks, True, rec or _Recorder(), batches_per_call=k)


def test_calls_grow_for_cheap_batches_and_stay_single_for_slow_ones():
    s = _schedule(max_tasks=32)  # a share of 16 per worker
    assert s.batches_per_call(0) == 1  # nothing timed yet
    for _ in range(10):
        s.on_batch_made(0, 0.0002)
        s.on_batch_made(1, 0.008)
    assert s.batches_per_call(0) == 8  # capped at MAX_BATCHES_PER_CALL
    assert s.batches_per_call(1) == 1  # 8 ms a batch: a call's cost no longer matters
    for _ in range(30):
        s.on_batch_made(0, 0.002)
    assert s.batches_per_call(0) == 2  # as many as fit in 5 ms
    assert _schedule(max_tasks=4).batches_per_call(0) == 1
    small = _schedule(max_tasks=4, k=8)  # prefetch_factor 2 x 2 workers: a share of 2
    assert small.batches_per_call(0) == 2


def test_calls_under_a_byte_bound_carry_no_more_batches_than_fit():
    """A worker on another node on Ray's calls (`call_bytes`): k cheap batches together stay under the bound (Ray's
    inline limit); a batch over the bound is grouped as before (a pull per call either way); no bound, no change."""
    bounds = {0: 75 * 1024, 1: None}
    s = Schedule(2, 32, True, _Recorder(), call_bytes=bounds.get)
    for _ in range(10):
        s.on_batch_made(0, 0.0002, 16 * 1024)
        s.on_batch_made(1, 0.0002, 16 * 1024)
    assert s.batches_per_call(0) == 4  # 4 x 16 KiB fit in 75 KiB, 5 do not
    assert s.batches_per_call(1) == 8  # no bound: MAX_BATCHES_PER_CALL
    s.on_batch_made(0, 0.0002, 48 * 1024)
    assert s.batches_per_call(0) == 1
    s.on_batch_made(0, 0.0002, 300 * 1024)
    assert s.batches_per_call(0) == 8
    bounds[0] = None  # its lane opened
    s.on_batch_made(0, 0.0002, 48 * 1024)
    assert s.batches_per_call(0) == 8


def test_pending_tasks_go_when_needed():
    rec = _Recorder()
    s = _schedule(max_tasks=8, k=4, rec=rec)
    for idx in range(6):
        s.add(idx, s.next_worker(), [idx], [idx])
    assert rec.calls == []  # three pending on each worker
    s.flush_for(1)  # the driver waits on task 1: worker 1's call goes, worker 0's waits
    assert rec.calls == [(1, [1, 3, 5])]
    s.add(6, s.next_worker(), [6], [6])
    assert rec.calls[-1] == (0, [0, 2, 4, 6])  # four pending: a full call
    s.add(7, s.next_worker(), [7], [7])
    s.flush_all()  # the sampler ended
    assert rec.calls[-1] == (1, [7])
    assert all(not t.held for t in s.task_info.values())


def test_unordered_candidates_send_a_worker_whose_oldest_task_is_pending():
    rec = _Recorder()
    s = Schedule(2, 8, False, rec, batches_per_call=4)
    for idx in range(4):
        s.add(idx, s.next_worker(), [idx], [idx])
    candidates = s.unordered_candidates()
    assert sorted(candidates.values()) == [0, 1] and len(rec.calls) == 2
