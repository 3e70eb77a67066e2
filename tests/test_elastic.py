"""A pool that changes under an epoch (NOTE [ raydl elastic pool ]): set_num_workers, lost workers, the autoscaler."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import raydl
from raydl.cluster.elastic import ElasticPool
from raydl.driver.schedule import Schedule
from tests import _datasets as D
from tests import _elastic_helpers as E

TIMEOUT_S = 60
# A new worker actor starts (imports torch) in 2-5 s here when quiet; bounds on joins are sized for a loaded machine.
JOIN_DEADLINE_S = 180.0


def _torch_batches(dataset, **kwargs):
    return [b.tolist() for b in torch.utils.data.DataLoader(dataset, **kwargs)]


def _wait_joined(it, n: int, deadline_s: float = JOIN_DEADLINE_S) -> None:
    """Iterate `it` is not needed: joining happens inside next(); this only bounds a test's wait for it."""
    t0 = time.monotonic()
    while len(it._sched.active) < n:
        assert time.monotonic() - t0 < deadline_s, f"workers did not join: {it._sched.active}, {it._pool.joining}"
        time.sleep(0.05)
        it._elastic.step()


# ---------------------------------------------------------------------- set_num_workers


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("in_order", [True, False])
def test_set_num_workers_mid_epoch_keeps_every_batch_once(in_order):
    """Grow 2 -> 4, then shrink 4 -> 1, mid-epoch: torch's batches, each once (in order with in_order=True)."""
    kwargs = dict(batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5))
    expected = _torch_batches(D.RangeDataset(120), **kwargs)
    kwargs["generator"] = torch.Generator().manual_seed(5)
    loader = raydl.DataLoader(
        D.SlowDataset(120, {i: 0.004 for i in range(120)}),
        num_workers=2,
        timeout=TIMEOUT_S,
        in_order=in_order,
        **kwargs,
    )
    it = iter(loader)
    out, sizes = [], []
    for k, batch in enumerate(it):
        out.append(batch.tolist())
        if k == 2:
            loader.set_num_workers(4)
            _wait_joined(it, 4)
        if k == 12:
            sizes.append(len(it._sched.active))
            assert it._sched.max_tasks == it._prefetch_factor * 4
            loader.set_num_workers(1)
            assert it._sched.active == [0] and it._sched.max_tasks == it._prefetch_factor
        if k > 12:
            assert it._sched.tasks_outstanding <= it._prefetch_factor * 4
    assert out == expected if in_order else sorted(out) == sorted(expected)
    assert sizes == [4]
    assert it._pool.released >= {1, 2, 3}, "retired workers were not released once their batches were handed out"
    assert loader.num_workers == 1


@pytest.mark.usefixtures("ray_session")
def test_new_workers_get_new_ids_and_worker_info():
    """Added workers get ids never used before (a retired id is not reused); WorkerInfo.num_workers is the size they started in."""
    loader = raydl.DataLoader(E.WorkerInfoDataset(80, 0.005), batch_size=1, num_workers=2, timeout=TIMEOUT_S)
    it = iter(loader)
    seen = []
    for k, batch in enumerate(it):
        seen.append(batch[0].tolist())
        if k == 1:
            loader.set_num_workers(1)  # worker 1 retires
        if k == 6:
            loader.set_num_workers(3)  # two new workers: ids 2 and 3, never 1 again
            _wait_joined(it, 3)
    assert [s[0] for s in seen] == list(range(80))
    info = {wid: nw for _, wid, nw in seen}
    assert info[0] == 2 and info.get(2) == 3 and info.get(3) == 3, info
    late_ids = {wid for i, wid, _ in seen if i >= 20}
    assert 1 not in late_ids and late_ids <= {0, 2, 3}
    assert sorted(r.worker_id for r in it.worker_records) == [0, 2, 3]


@pytest.mark.usefixtures("ray_session")
def test_persistent_workers_keep_the_new_size():
    """set_num_workers on a persistent loader: the next epochs run on the new pool, batches unchanged."""
    loader = raydl.DataLoader(
        D.SlowDataset(24, {i: 0.01 for i in range(24)}),
        batch_size=2,
        num_workers=1,
        persistent_workers=True,
        timeout=TIMEOUT_S,
    )
    expected = [[i, i + 1] for i in range(0, 24, 2)]
    with loader:
        it = iter(loader)
        first = [next(it).flatten().tolist()]
        loader.set_num_workers(3)
        first += [b.flatten().tolist() for b in it]
        assert first == expected
        _wait_joined(loader._iterator, 3)
        second = [b.flatten().tolist() for b in loader]
        assert second == expected
        assert len(loader._iterator._sched.active) == 3 and loader._iterator._sched.max_tasks == 3 * 2
        assert len(loader.worker_records) == 3


def test_resizing_refused_with_clear_errors():
    """Bad sizes, num_workers=0 and IterableDataset resizes are refused with errors naming the fix."""
    loader = raydl.DataLoader(D.RangeDataset(4), num_workers=1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            loader.set_num_workers(bad)
    with pytest.raises(ValueError, match="num_workers >= 1"):
        raydl.DataLoader(D.RangeDataset(4)).set_num_workers(2)
    with pytest.raises(ValueError, match="IterableDataset.*set_num_workers is refused"):
        raydl.DataLoader(D.ShardedIterable(0, 8), num_workers=2).set_num_workers(3)
    with pytest.raises(ValueError, match="IterableDataset.*ray_max_workers is not supported"):
        raydl.DataLoader(D.ShardedIterable(0, 8), num_workers=2, ray_max_workers=4)
    with pytest.raises(ValueError, match=r"ray_max_workers \(1\) should be at least num_workers \(2\)"):
        raydl.DataLoader(D.RangeDataset(4), num_workers=2, ray_max_workers=1)
    with pytest.raises(ValueError, match="ray_max_workers should be None"):
        raydl.DataLoader(D.RangeDataset(4), num_workers=2, ray_max_workers="8")
    with pytest.raises(ValueError, match="needs num_workers >= 1"):
        raydl.DataLoader(D.RangeDataset(4), ray_max_workers=2)
    capped = raydl.DataLoader(D.RangeDataset(4), num_workers=1, ray_max_workers=2)
    with pytest.raises(ValueError, match="exceeds ray_max_workers=2"):
        capped.set_num_workers(3)


# ---------------------------------------------------------------------- a worker with no room for a replacement


def _warm_up(n: int) -> None:
    """Leave `n` started workers in the warm pool, so a loader with a short ray_startup_timeout_s starts in time."""
    assert len(list(raydl.DataLoader(D.RangeDataset(n), num_workers=n, timeout=TIMEOUT_S))) == n


def _make_replacements_unplaceable(it) -> None:
    """From now on, a replacement actor asks for a resource no node has: it can never be placed."""
    from raydl.cluster.pool import _worker_actor_class

    options = {**it._pool.actor_options, "resources": {"raydl_test_nowhere": 1}}
    it._pool._configured = _worker_actor_class().options(**options)
    it._pool.actor_options = options  # what the placement diagnosis reads
    it._pool._placement = None  # no node plan: new actors are started from _configured
    it._pool.nodes = [None] * len(it._pool.nodes)


def _kill_and_wait(it, worker_id: int) -> None:
    """Kill the worker's actor and wait (bounded) until its process is gone. ray.kill is asynchronous: on a loaded
    machine the rest of a short epoch came over the lane before the kill landed, and nothing died (seen once)."""
    import psutil
    import ray

    pid = it.worker_records[worker_id].pid
    ray.kill(it._pool.actors[worker_id], no_restart=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"worker {worker_id}'s process {pid} outlived ray.kill by 60 s"
        time.sleep(0.05)


@pytest.mark.usefixtures("ray_session")
def test_unplaceable_replacement_leaves_the_survivors_to_finish():
    """A dead worker whose replacement fits nowhere: a warning names it and its node; the others finish the epoch, in order."""
    _warm_up(3)
    loader = raydl.DataLoader(
        D.SlowDataset(40, {i: 0.01 for i in range(40)}),
        batch_size=2,
        num_workers=3,
        timeout=TIMEOUT_S,
        ray_startup_timeout_s=10,  # the warm workers configure in well under a second; the replacement never starts
    )
    it = iter(loader)
    out = [next(it).flatten().tolist()]
    victim = it.worker_records[1]
    _make_replacements_unplaceable(it)
    _kill_and_wait(it, 1)
    with pytest.warns(
        RuntimeWarning,
        match=rf"raydl worker 1 \(pid {victim.pid}, node 127.0.0.1 .*could not be replaced.*going on with 2 worker",
    ):
        out += [b.flatten().tolist() for b in it]
    assert out == [[i, i + 1] for i in range(0, 40, 2)]
    assert it._sched.active == [0, 2]


@pytest.mark.usefixtures("ray_session")
def test_no_worker_left_is_an_error():
    """The last worker dies and cannot be replaced anywhere: WorkerDiedError saying no worker is left."""
    _warm_up(1)
    loader = raydl.DataLoader(
        D.SlowDataset(20, {i: 0.01 for i in range(20)}),
        batch_size=2,
        num_workers=1,
        timeout=TIMEOUT_S,
        ray_startup_timeout_s=10,  # the warm workers configure in well under a second; the replacement never starts
    )
    it = iter(loader)
    next(it)
    _make_replacements_unplaceable(it)
    _kill_and_wait(it, 0)
    with pytest.raises(raydl.WorkerDiedError, match="no worker is left"):
        list(it)


@pytest.mark.usefixtures("ray_session")
def test_retiring_worker_death_sends_its_batches_to_the_others():
    """A worker killed while it retires is not replaced: its batches are re-made by the active workers, in order."""
    import ray

    loader = raydl.DataLoader(
        D.SlowDataset(40, {i: 0.05 for i in range(40)}),
        batch_size=1,
        num_workers=2,
        prefetch_factor=4,
        timeout=TIMEOUT_S,
    )
    it = iter(loader)
    out = [next(it).item()]
    loader.set_num_workers(1)
    assert it._elastic.retiring == {1}
    ray.kill(it._pool.actors[1], no_restart=True)
    out += [b.item() for b in it]
    assert out == list(range(40))
    assert it._pool.restarts[1] == 0 and 1 in it._pool.released


# ---------------------------------------------------------------------- autoscaler, end to end


@pytest.mark.usefixtures("ray_session")
def test_autoscaler_adds_a_worker_when_the_loop_waits(caplog):
    """An I/O-bound dataset and a fast loop: the autoscaler adds a worker, logging its figures at INFO."""
    _warm_up(2)  # the added worker comes from the warm pool: its join does not race the epoch on a loaded machine
    loader = raydl.DataLoader(
        D.SlowDataset(6000, {i: 0.01 for i in range(6000)}),  # up to 60 s of I/O at 1 worker; it stops once joined
        batch_size=2,
        num_workers=1,
        ray_max_workers=2,
        timeout=TIMEOUT_S,
    )
    it = iter(loader)
    with caplog.at_level(logging.INFO, logger="raydl.cluster.elastic"):
        for k, _ in enumerate(it):
            if len(it._sched.active) == 2:
                break
    assert len(it._sched.active) == 2, f"no worker added in {k} batches: {it._elastic.decisions}"
    decision = it._elastic.decisions[0]
    assert decision.action == "add" and decision.wait_fraction > 0.1
    assert any(
        "raydl autoscale: add, 1 -> 2 workers" in r.getMessage() and "waited" in r.getMessage() for r in caplog.records
    )
    del it


@pytest.mark.usefixtures("ray_session")
def test_autoscaler_adds_nothing_for_a_loop_slower_than_its_data():
    """The loop takes 150 ms a batch, the data 4 ms: no worker is added (margins for a loaded machine; the rule itself
    is tested on a fake clock below)."""
    loader = raydl.DataLoader(
        D.SlowDataset(40, {i: 0.002 for i in range(40)}),
        batch_size=2,
        num_workers=1,
        ray_max_workers=4,
        timeout=TIMEOUT_S,
    )
    it = iter(loader)
    for _ in it:
        time.sleep(0.15)
    assert it._elastic.decisions == [] and len(it._sched.active) == 1 and not it._pool.joining


# ---------------------------------------------------------------------- autoscaler rule, on a fake clock


class _FakePool:
    def __init__(self, n: int) -> None:
        self.joining: dict = {}
        self.released: set = set()
        self.restarts = [0] * n
        self.actor_options = {"num_cpus": 0}
        self._next = n

    def add_worker(self, info_num_workers: int) -> int:
        wid, self._next = self._next, self._next + 1
        self.joining[wid] = 0.0
        return wid

    def poll_joining(self, timeout_s: float):
        joined = sorted(self.joining)
        self.joining = {}
        return joined, []

    def release(self, wid: int) -> None:
        self.released.add(wid)
        self.joining.pop(wid, None)


class _Sim:
    """A loop taking `step_s` per batch, fed by workers taking `make_s` per batch each, on a fake clock."""

    def __init__(self, min_workers: int, max_workers: int, step_s: float, make_s: float) -> None:
        self.now = 0.0
        self.pool = _FakePool(min_workers)
        self.sched = Schedule(min_workers, 2 * min_workers, True, lambda w, i, x: (object(), object(), None))
        self.elastic = ElasticPool(
            self.pool, self.sched, 2, lambda: None, 60.0, min_workers, max_workers, True, clock=lambda: self.now
        )
        self.step_s, self.make_s = step_s, make_s
        self.latency_s = 0.0  # a wait per batch that more workers cannot remove (round trips on a busy machine)

    def run(self, batches: int, gain=None) -> None:
        for _ in range(batches):
            self.elastic.step()
            n = len(self.sched.active)
            # delivered rate: n workers in parallel, or the loop, whichever is slower (gain: cap on useful workers)
            useful = n if gain is None else min(n, gain)
            per_batch_s = max(self.make_s / useful, self.step_s)
            wait_s = per_batch_s - self.step_s + self.latency_s
            self.now += per_batch_s + self.latency_s
            self.elastic.on_batch_made(self.make_s)
            self.elastic.on_next(wait_s)


def test_rule_grows_to_the_data_rate_then_stops():
    """Workers making a batch in 40 ms, a loop taking 10 ms: the pool grows one by one to 4-5 and stays (no oscillation)."""
    sim = _Sim(1, 8, step_s=0.010, make_s=0.040)
    sim.run(3000)
    actions = [d.action for d in sim.elastic.decisions]
    assert actions[:3] == ["add", "add", "add"] and "retire" not in actions, actions
    assert len(sim.sched.active) in (4, 5)
    assert all(d.wait_fraction > 0.1 for d in sim.elastic.decisions if d.action == "add")


def test_rule_adds_nothing_when_the_loop_is_slower():
    """Workers faster than the loop: not one decision."""
    sim = _Sim(1, 8, step_s=0.030, make_s=0.008)
    sim.run(2000)
    assert sim.elastic.decisions == []


def test_rule_retires_extra_workers_when_the_loop_slows():
    """Grown for a fast loop, then the loop slows 10x: extra workers are retired down to num_workers, never below."""
    sim = _Sim(1, 4, step_s=0.005, make_s=0.020)
    sim.run(2000)
    assert len(sim.sched.active) == 4
    sim.step_s = 0.1
    sim.run(400)
    assert len(sim.sched.active) == 1
    assert [d.action for d in sim.elastic.decisions].count("retire") == 3


def test_rule_undoes_an_addition_that_did_not_pay():
    """When a second worker brings no speed (the cluster's CPUs are the limit), it is retired and the pool stops growing."""
    sim = _Sim(1, 8, step_s=0.001, make_s=0.020)
    sim.run(1500, gain=1)
    actions = [d.action for d in sim.elastic.decisions]
    assert actions == ["add", "undo"], actions
    assert len(sim.sched.active) == 1


def test_rule_one_noisy_window_does_not_undo_an_addition():
    """A neighbour's burst slows the first window after an addition: it is judged again, not undone."""
    sim = _Sim(1, 2, step_s=0.001, make_s=0.020)
    while not sim.elastic.decisions:
        sim.run(1)
    sim.run(60, gain=1)  # the window after the addition: no gain (noise)
    assert sim.elastic.rule.pending is not None and sim.elastic.rule.pending[3] == 1
    sim.run(400)
    assert [d.action for d in sim.elastic.decisions] == ["add"] and len(sim.sched.active) == 2


def test_rule_adds_nothing_when_the_loop_waits_on_latency_with_idle_workers():
    """The loop waits 25 % of its time while its worker is busy 20 %: latency, not too few workers; nothing added."""
    sim = _Sim(1, 8, step_s=0.030, make_s=0.008)
    sim.latency_s = 0.010
    sim.run(2000)
    assert sim.elastic.decisions == []


# ---------------------------------------------------------------------- rebalance (NOTE [ raydl rebalance ])


class _NodesPool(_FakePool):
    """A fake pool whose workers sit on nodes; `worker_to_move` is WorkerPool's own over a fake placement."""

    def __init__(self, where: dict, nodes: list) -> None:
        super().__init__(len(where))
        self.where, self.nodes_now = dict(where), list(nodes)
        self._placement = self

    def candidates(self, by_total: bool = False):
        from raydl.cluster.placement import NodeWeight

        assert by_total
        return [NodeWeight(n, (n,), 1.0) for n in self.nodes_now]

    def node_for_new_worker(self, others):
        counts = {n: sum(o == n for o in others) for n in self.nodes_now}
        return min(self.nodes_now, key=lambda n: (counts[n], n))

    def add_worker(self, info_num_workers: int) -> int:
        wid = super().add_worker(info_num_workers)
        self.where[wid] = self.node_for_new_worker([self.where[w] for w in self.where if w not in self.released])
        return wid

    def node_of(self, wid: int):
        return self.where[wid]

    from raydl.cluster.pool import WorkerPool

    worker_to_move = WorkerPool.worker_to_move


def test_a_node_that_joins_takes_workers_from_the_crowded_one():
    """A node lost, its workers replaced on the node left (3 on a, 0 elsewhere), then node b joins: within the
    rebalance interval a worker moves to b (a new one starts there, a's newest retires once it has started), one move
    at a time, until 2 and 1; nothing moves while the nodes are even, nor with rebalance off (torch's seeding)."""
    from raydl._constants import REBALANCE_INTERVAL_S

    now = [0.0]
    pool = _NodesPool({0: "a", 1: "a", 2: "a"}, ["a"])
    sched = Schedule(3, 6, True, lambda w, i, x: (object(), object(), None))
    elastic = ElasticPool(pool, sched, 2, lambda: None, 60.0, 3, None, True, clock=lambda: now[0], rebalance=True)
    for _ in range(3):  # one node: nothing to even
        now[0] += REBALANCE_INTERVAL_S
        elastic.step()
    assert not pool.joining and elastic.moves == 0
    pool.nodes_now = ["a", "b"]  # b joins
    elastic.step()
    assert not pool.joining  # not before the interval
    now[0] += REBALANCE_INTERVAL_S
    pool.poll_joining = lambda timeout_s: ([], [])  # the new worker still starting
    elastic.step()  # the move starts: a worker joining on b
    assert elastic.moving == {3: 2} and pool.where[3] == "b" and sorted(sched.active) == [0, 1, 2]
    del pool.poll_joining
    elastic.step()  # it started: worker 2 (a's newest) retires, released when its tasks are done
    assert sorted(sched.active) == [0, 1, 3] and 2 in pool.released and elastic.moves == 1
    for _ in range(3):
        now[0] += REBALANCE_INTERVAL_S
        elastic.step()
    assert elastic.moves == 1 and sorted(pool.where[w] for w in sched.active) == ["a", "a", "b"]

    off = ElasticPool(
        _NodesPool({0: "a", 1: "a"}, ["a", "b"]),
        Schedule(2, 4, True, lambda w, i, x: None),
        2,
        lambda: None,
        60.0,
        2,
        None,
        True,
        clock=lambda: now[0],
    )
    now[0] += REBALANCE_INTERVAL_S
    off.step()
    assert off.moves == 0 and not off.moving
