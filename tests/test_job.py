"""One worker pool for every rank of a job: `ray_job` (NOTE [ raydl job pool ]).

Ranks are loaders in this process, each told its rank by RANK / WORLD_SIZE as torchrun tells a
process, stepping in lockstep as DDP does; the workers are the suite's Ray actors.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

import raydl
from tests._session import wait_until

pytestmark = pytest.mark.usefixtures("ray_session")

N = 48


class Made(Dataset):
    """Item i: [i, the pid that made it, a torch draw]."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return torch.tensor([i, os.getpid(), int(torch.randint(0, 1 << 30, ()))])


def _rank_loader(monkeypatch, rank: int, world: int, job: str | None, **kw) -> raydl.DataLoader:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    sampler = DistributedSampler(Made(), num_replicas=world, rank=rank, shuffle=True, seed=1)
    kw = {"num_workers": 1, "timeout": 60, **kw}  # each worker is a process importing torch: as few as shows it
    if kw["num_workers"] == 0:
        kw.pop("timeout")
    return raydl.DataLoader(Made(), batch_size=4, sampler=sampler, ray_job=job, **kw)


def _lockstep(iterators, on_step=None) -> list[list]:
    """One step of every rank at a time, to each rank's StopIteration (DDP's ranks have equal steps)."""
    out = [[] for _ in iterators]
    done = [False] * len(iterators)
    step = 0
    while not all(done):
        for r, it in enumerate(iterators):
            if not done[r]:
                try:
                    out[r].append(next(it))
                except StopIteration:
                    done[r] = True
        if on_step is not None and not all(done):
            on_step(step)
        step += 1
    return out


def _drawn(batches) -> list:
    """Each batch's rows as (index, the torch draw made for it): what must not depend on the worker."""
    return [b[:, [0, 2]].tolist() for b in batches]


def _coordinator_alive(name: str) -> bool:
    import ray

    try:
        ray.get_actor(f"raydl-job:{name}", namespace="raydl")
    except ValueError:
        return False
    return True


def test_two_ranks_share_one_pool_and_every_sample_comes_once(monkeypatch):
    loaders = [_rank_loader(monkeypatch, r, 2, "job-share") for r in range(2)]
    its = [iter(loader) for loader in loaders]  # each iter() reads RANK when its pool client starts
    out = _lockstep(its)
    rows = [torch.cat(o).tolist() for o in out]
    pids = [{row[1] for row in r} for r in rows]
    assert len(pids[0] | pids[1]) == 2, "one pool of 2 x 1 workers for the job"
    assert pids[0] == pids[1], "each rank's batches come from every worker of the job"
    assert sorted(row[0] for r in rows for row in r) == list(range(N))
    draws = [row[2] for r in rows for row in r]
    assert len(set(draws)) > 0.9 * len(draws), "the ranks' batches drew the same numbers"
    for loader in loaders:
        loader.shutdown()
    assert wait_until(lambda: not _coordinator_alive("job-share"), timeout_s=90), "the pool outlived its last rank"


def test_a_live_rank_whose_renewals_stop_keeps_the_pool(monkeypatch):
    """The lease is renewed by liveness: a rank whose renewal thread falls silent for several leases (as a starved
    process's would on a loaded machine) keeps the pool while its process lives, and finishes its epoch."""
    monkeypatch.setenv("RAYDL_JOB_LEASE_S", "2")  # the coordinator checks every 0.5 s
    loader = _rank_loader(monkeypatch, 0, 1, "job-liveness")
    it = iter(loader)
    first = next(it)
    it._pool._stop.set()  # no renewal from here on
    time.sleep(5.0)  # more than two leases with no renewal
    assert _coordinator_alive("job-liveness"), "the pool ended under a live rank"
    rows = torch.cat([first, *it]).tolist()
    assert sorted(row[0] for row in rows) == list(range(N))
    loader.shutdown()
    assert wait_until(lambda: not _coordinator_alive("job-liveness"), timeout_s=90), "the pool outlived its rank"


def test_job_batches_equal_private_loaders_with_sample_seeding(monkeypatch):
    """ray_seed='sample': a job's batches are the private loaders' ones, sample for sample."""
    private = []
    for r in range(2):
        loader = _rank_loader(monkeypatch, r, 2, None, ray_seed="sample")
        private.append(_drawn(loader))
        loader.shutdown()
    loaders = [_rank_loader(monkeypatch, r, 2, "job-sample", ray_seed="sample") for r in range(2)]
    out = _lockstep([iter(loader) for loader in loaders])
    for r in range(2):
        assert _drawn(out[r]) == private[r]
    for loader in loaders:
        loader.shutdown()


def test_a_killed_worker_costs_no_rank_a_batch(monkeypatch):
    """A job worker SIGKILLed mid-epoch with batches of both ranks on it: each rank still gets its batches once, in
    order, with their content; the job replaces it once, whichever rank sees the death first."""
    n = 96
    expected = [_drawn(loader) for loader in _timed_ranks(monkeypatch, 2, None, n, num_workers=0)]
    loaders = _timed_ranks(monkeypatch, 2, "job-kill", n, delay_s=0.005)
    its = [iter(loader) for loader in loaders]
    killed = []

    def kill_one(step: int) -> None:
        if step == 2:
            record = its[0]._pool.records[1]
            os.kill(record.pid, signal.SIGKILL)
            killed.append(record.pid)

    out = _lockstep(its, kill_one)
    assert killed
    for r in range(2):
        assert _drawn(out[r]) == expected[r], f"rank {r}"
    pids = {row[1] for o in out for row in torch.cat(o[8:]).tolist()}
    assert killed[0] not in pids
    assert _job_view("job-kill")["generations"] == [0, 1], "replaced once for the job"
    assert [it._pool.restarts for it in its] in ([[0, 1]] * 2, [[0, 1], [0, 0]], [[0, 0], [0, 1]])
    for loader in loaders:
        loader.shutdown()


def test_a_silent_node_under_a_job_costs_no_rank_a_batch(monkeypatch):
    """The job's workers reached over Ray's calls (ranks have no lanes) on a node that goes silent mid-epoch (a worker
    frozen, its node's raylet no longer answering the probe): the ranks do not wait for Ray's verdict; each still gets
    its batches once, in order, with their content, and the frozen worker makes none of the later ones."""
    from raydl.cluster import silent_nodes
    from tests._silence import frozen, workers_on_another_node

    verdicts, asked = workers_on_another_node(monkeypatch)
    n = 96
    expected = [_drawn(loader) for loader in _timed_ranks(monkeypatch, 2, None, n, num_workers=0)]
    loaders = _timed_ranks(monkeypatch, 2, "job-silent", n, delay_s=0.005)
    its = [iter(loader) for loader in loaders]
    frozen_pids: list = []

    with contextlib.ExitStack() as unfreeze:

        def freeze_one(step: int) -> None:
            if step == 2:
                verdicts["another-node"] = "timeout"
                frozen_pids.append(its[0]._pool.records[1].pid)
                unfreeze.enter_context(frozen(frozen_pids[-1]))

        unfreeze.callback(silent_nodes._forget_all)
        out = _lockstep(its, freeze_one)
    assert frozen_pids and asked
    for r in range(2):
        assert _drawn(out[r]) == expected[r], f"rank {r}"
    later = {row[1] for o in out for row in torch.cat(o[12:]).tolist()}
    assert frozen_pids[0] not in later
    assert _job_view("job-silent")["generations"][1] >= 1, "the frozen worker was replaced for the job"
    for loader in loaders:
        loader.shutdown()


def test_a_restarted_rank_rejoins_the_pool(monkeypatch):
    """Rank 1 leaves and comes back while rank 0 holds the pool: same workers, no new pool."""
    rank0 = _rank_loader(monkeypatch, 0, 2, "job-rejoin")
    it0 = iter(rank0)
    first = _rank_loader(monkeypatch, 1, 2, "job-rejoin")
    it1 = iter(first)
    pids_before = {r.pid for r in it1._pool.records}
    next(it0), next(it1)
    first.shutdown()
    again = _rank_loader(monkeypatch, 1, 2, "job-rejoin")
    it1 = iter(again)
    assert {r.pid for r in it1._pool.records} == pids_before
    out = _lockstep([it0, it1])
    assert len(out[1]) == N // 2 // 4
    rank0.shutdown()
    again.shutdown()
    assert wait_until(lambda: not _coordinator_alive("job-rejoin"), timeout_s=90)


def test_job_options_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="ray_seed='worker'.*ranks share the job's workers"):
        raydl.DataLoader(Made(), batch_size=4, num_workers=2, ray_job="x", ray_seed="worker")

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ValueError, match="IterableDataset's replica stream belongs to one rank"):
        raydl.DataLoader(Stream(), batch_size=2, num_workers=2, ray_job="x")
    for var in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    loader = raydl.DataLoader(Made(), batch_size=4, num_workers=2, ray_job=True, timeout=60)
    with pytest.raises(ValueError, match="Pass a name: ray_job='my-run'"):
        iter(loader)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29512")
    loader = _rank_loader(monkeypatch, 0, 1, True)
    it = iter(loader)
    assert _coordinator_alive("ddp-127.0.0.1:29512") and len(list(it)) == N // 4
    loader.shutdown()


def test_a_rank_joining_later_uses_the_jobs_pool_as_it_is(monkeypatch):
    """num_workers sizes the pool when a rank starts it; a rank that asks for another count joins the job's pool, a
    rank with another loader (another ray_seed) is refused, naming the difference, and the job goes on."""
    rank0 = _rank_loader(monkeypatch, 0, 2, "job-size")
    it0 = iter(rank0)
    monkeypatch.setenv("RANK", "1")
    other = raydl.DataLoader(Made(), batch_size=4, num_workers=2, ray_job="job-size", ray_seed="sample", timeout=60)
    with pytest.raises(ValueError, match="job-size.*ray_seed 'batch' there, 'sample' here"):
        iter(other)
    first = next(it0)
    rank1 = _rank_loader(monkeypatch, 1, 2, "job-size", num_workers=3)
    it1 = iter(rank1)
    assert len(it1._sched.active) == len(it0._sched.active) == 2
    assert [r.pid for r in it1._pool.records] == [r.pid for r in it0._pool.records]
    out = _lockstep([it0, it1])
    out[0].insert(0, first)
    assert sorted(row[0] for o in out for row in torch.cat(o).tolist()) == list(range(N))
    rank0.shutdown()
    rank1.shutdown()


def test_a_two_rank_job_state_resumes_in_a_three_rank_job(monkeypatch):
    """Rank 0's state after 2 steps of a 2-rank job, loaded by every rank of a 3-rank job (one pool each job):
    the samples the old job had not consumed, once each, with the uninterrupted run's content (ray_seed='sample')."""

    def ranks(world, batch, job, num_workers=1):
        out = []
        for r in range(world):
            monkeypatch.setenv("RANK", str(r))
            monkeypatch.setenv("WORLD_SIZE", str(world))
            sampler = DistributedSampler(Made(), num_replicas=world, rank=r, shuffle=True, seed=1)
            out.append(
                raydl.DataLoader(
                    Made(),
                    batch_size=batch,
                    sampler=sampler,
                    num_workers=num_workers,
                    ray_job=job,
                    ray_seed="sample",
                    timeout=60 if num_workers else 0,
                )
            )
        return out

    full = _lockstep([iter(loader) for loader in ranks(2, 3, None, num_workers=0)])  # content needs no pool
    content = {row[0]: (row[0], row[2]) for o in full for row in torch.cat(o).tolist()}
    old = ranks(2, 3, "job-old")
    its = [iter(loader) for loader in old]
    seen = [[next(it) for _ in range(2)] for it in its]
    state = old[0].state_dict()
    for loader in old:
        loader.shutdown()
    del its
    new = ranks(3, 2, "job-new")
    for loader in new:
        loader.load_state_dict(state)
    rest = _lockstep([iter(loader) for loader in new])
    consumed = {row[0] for s in seen for row in torch.cat(s).tolist()}
    got = [row for o in rest for row in torch.cat(o).tolist()]
    assert sorted(row[0] for row in got) == sorted(set(range(N)) - consumed)
    assert all((row[0], row[2]) == content[row[0]] for row in got)
    for loader in new:
        loader.shutdown()


def test_a_dead_coordinator_is_recreated_and_no_batch_is_lost(monkeypatch):
    """The coordinator killed mid-epoch takes the job's workers with it: the ranks start the pool again and each
    still gets its batches once, in order, with their content (ray_seed='sample')."""
    import ray

    expected = []
    for r in range(2):
        loader = _rank_loader(monkeypatch, r, 2, None, ray_seed="sample", num_workers=0)
        expected.append(_drawn(loader))
    loaders = [_rank_loader(monkeypatch, r, 2, "job-coord", ray_seed="sample") for r in range(2)]
    its = [iter(loader) for loader in loaders]

    def kill_coordinator(step: int) -> None:
        if step == 2:
            ray.kill(ray.get_actor("raydl-job:job-coord", namespace="raydl"), no_restart=True)

    out = _lockstep(its, kill_coordinator)
    for r in range(2):
        assert _drawn(out[r]) == expected[r], f"rank {r}"
    for loader in loaders:
        loader.shutdown()
    assert wait_until(lambda: not _coordinator_alive("job-coord"), timeout_s=90)


class Timed(Dataset):
    """Item i after `delay_s` (I/O-like): [i, the pid that made it, a torch draw]."""

    def __init__(self, n: int, delay_s: float = 0.0) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.tensor([i, os.getpid(), int(torch.randint(0, 1 << 30, ()))])


def _timed_ranks(monkeypatch, world: int, job, n: int, delay_s: float = 0.0, **kw) -> list:
    out = []
    for r in range(world):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        sampler = DistributedSampler(Timed(n), num_replicas=world, rank=r, shuffle=True, seed=3)
        out.append(
            raydl.DataLoader(
                Timed(n, delay_s),
                batch_size=2,
                sampler=sampler,
                ray_job=job,
                ray_seed="sample",
                **{"num_workers": 1, "timeout": 60, **kw},
            )
        )
    return out


def _job_view(name: str) -> dict:
    import ray

    return ray.get(ray.get_actor(f"raydl-job:{name}", namespace="raydl").view.remote())


def test_set_num_workers_resizes_the_jobs_pool_for_every_rank(monkeypatch):
    """set_num_workers on every rank (as an SPMD script calls it) grows the job's pool to n x world mid-epoch, then
    shrinks it: both ranks use the new workers, the retired ones end, and each rank's batches are the
    uninterrupted run's, once each, in order, with their content."""
    import ray

    n = 96
    expected = [_drawn(loader) for loader in _timed_ranks(monkeypatch, 2, None, n, num_workers=0)]
    loaders = _timed_ranks(monkeypatch, 2, "job-resize", n)
    its = [iter(loader) for loader in loaders]
    views = {}

    def resize(step: int) -> None:
        if step == 3:
            for loader in loaders:
                loader.set_num_workers(2)
            views["grown"] = _job_view("job-resize")
        if step == 14:
            for loader in loaders:
                loader.set_num_workers(1)
            views["shrunk"] = _job_view("job-resize")

    out = _lockstep(its, resize)
    for r in range(2):
        assert _drawn(out[r]) == expected[r], f"rank {r}"
    grown, shrunk = views["grown"], views["shrunk"]
    assert len(grown["active"]) + len(grown["joining"]) == 4 and not grown["retiring"]
    assert len(shrunk["active"]) == 2 and len(shrunk["retiring"]) + len(shrunk["joining"]) <= 2
    new_pids = {r.pid for r in _job_view("job-resize")["records"][2:4] if r is not None}
    middle = [{row[1] for row in torch.cat(o[6:14]).tolist()} for o in out]
    assert all(p & new_pids for p in middle) or not new_pids, "both ranks use the workers the job added"
    assert wait_until(lambda: not _job_view("job-resize")["retiring"], timeout_s=90), "retired workers are released"
    after = _job_view("job-resize")
    assert len(after["active"]) == 2 and set(after["active"]) == set(its[0]._pool.active) == set(its[1]._pool.active)
    retired = [after["actors"][w] for w in range(len(after["actors"])) if w not in after["active"]]
    assert retired and wait_until(lambda: all(_actor_dead(a) for a in retired), timeout_s=90)
    for loader in loaders:
        loader.shutdown()
    del ray


def _actor_dead(actor) -> bool:
    import ray

    try:
        ray.get(actor.__ray_ready__.remote(), timeout=5)
    except Exception:
        return True
    return False


def test_the_jobs_autoscaler_adds_workers_for_starved_ranks(monkeypatch):
    """ray_max_workers under ray_job: two ranks waiting on one worker each; the coordinator, on both ranks' windows,
    adds a worker to the job's pool, both ranks send to it once it started, and every batch comes in order."""
    n = 4000  # 20 s at 2 workers: the loop stops once the added worker serves the ranks
    loaders = _timed_ranks(monkeypatch, 2, "job-autoscale", n, delay_s=0.01, ray_max_workers=2)
    its = [iter(loader) for loader in loaders]
    out = [[], []]
    grown_at = None
    for step in range(n // 4):
        for r in range(2):
            out[r].append(next(its[r]))
        if grown_at is None and all(len(it._sched.active) > 2 for it in its):
            grown_at = step
        if grown_at is not None and step >= grown_at + 20:
            break
    assert grown_at is not None, "no worker added"
    decisions = _job_view("job-autoscale")["decisions"]
    assert decisions[0].action == "add" and decisions[0].wait_fraction > 0.1, decisions
    assert all(d.workers_after <= 4 for d in decisions)
    added = {w for it in its for w in it._sched.active} - {0, 1}
    served = [
        {its[r]._pool.records[w].pid for w in added} & {row[1] for row in torch.cat(out[r][grown_at:]).tolist()}
        for r in range(2)
    ]
    assert all(served), "both ranks use the worker the job added"
    for r in range(2):
        sampled = list(DistributedSampler(Timed(n), num_replicas=2, rank=r, shuffle=True, seed=3))
        got = torch.cat(out[r])[:, 0].tolist()
        assert got == sampled[: len(got)], f"rank {r}"
    for loader in loaders:
        loader.shutdown()


def test_a_worker_killed_while_the_job_retires_it_costs_no_batch(monkeypatch):
    """Shrinking the job's pool while the retiring worker's process is SIGKILLed with batches of both ranks on it:
    its batches are re-made by the workers that stay, each rank's batches are the uninterrupted run's."""
    n = 64
    expected = [_drawn(loader) for loader in _timed_ranks(monkeypatch, 2, None, n, num_workers=0)]
    loaders = _timed_ranks(monkeypatch, 2, "job-retire-kill", n, delay_s=0.005, num_workers=2)
    its = [iter(loader) for loader in loaders]
    killed = []

    def shrink_and_kill(step: int) -> None:
        if step == 2:
            victim = max(its[0]._sched.active)
            pid = its[0]._pool.records[victim].pid
            for loader in loaders:
                loader.set_num_workers(1)
            os.kill(pid, signal.SIGKILL)
            killed.append((victim, pid, {rec.pid for rec in its[0]._pool.records if rec is not None}))

    out = _lockstep(its, shrink_and_kill)
    for r in range(2):
        assert _drawn(out[r]) == expected[r], f"rank {r}"
    victim, pid, pool_pids = killed[0]
    assert all(victim not in it._sched.active and it._pool.restarts[victim] == 0 for it in its)
    # no replacement process made a batch (batches the victim finished before its kill may still be handed out:
    # how many depends on the machine's pace)
    assert {row[1] for o in out for row in torch.cat(o).tolist()} <= pool_pids
    assert wait_until(
        lambda: len(_job_view("job-retire-kill")["active"]) == 2 and not _job_view("job-retire-kill")["retiring"],
        timeout_s=90,
    )
    for loader in loaders:
        loader.shutdown()
