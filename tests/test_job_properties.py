"""Property tests (hypothesis) of the job pool's resizing, without Ray (NOTE [ raydl job elastic ]).

The coordinator's logic and each rank's `JobElastic` + `Schedule` run in this process over a fake
worker pool; random sequences of resizes (from any rank), ranks stepping at different paces, ranks
leaving and joining, workers starting late and workers dying must keep the protocol's promises:
  * no worker is released while a rank still has a task on it;
  * a rank never sends a task to a released worker, nor to a retiring one once it has heard of it
    (before that it may: the worker waits for this rank to be done with it);
  * every rank's tasks are handed out once, in order;
  * a dead worker is replaced at most once, whichever ranks notice, and never once the job retired it;
  * once the ranks have caught up, the job has the size last asked for and nothing left retiring.
"""

from __future__ import annotations

import threading

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from raydl.driver.schedule import Schedule  # noqa: E402
from raydl.job import coordinator as job_coordinator  # noqa: E402
from raydl.job.elastic import JobElastic  # noqa: E402

WORLD = 2
PREFETCH = 2


class _Pool:
    """The coordinator's `WorkerPool`, with workers that start when `start_all` says so."""

    def __init__(self, payload_ref, num_workers, *args, **kwargs) -> None:
        self.actors = [f"w{i}" for i in range(num_workers)]
        self.records = [None] * num_workers
        self.joining: dict = {}
        self.released: set = set()
        self.actor_options: dict = {}
        self.ready_to_join = False

    def add_worker(self, info_num_workers: int) -> int:
        self.actors.append(f"w{len(self.actors)}")
        self.records.append(None)
        self.joining[len(self.actors) - 1] = 0.0
        return len(self.actors) - 1

    def poll_joining(self, timeout_s: float):
        if not self.ready_to_join:
            return [], []
        joined, self.joining = sorted(self.joining), {}
        return joined, []

    def release(self, wid: int) -> None:
        self.released.add(wid)
        self.joining.pop(wid, None)

    def replace(self, wid: int) -> None:
        assert wid not in self.released, f"released worker {wid} replaced"
        self.replaced = getattr(self, "replaced", 0) + 1

    def wait_ready(self, timeout_s: float) -> None:
        pass

    def shutdown(self, tasks_known: bool = True) -> None:
        pass


class _Rank:
    """A rank's `JobPool` surface, calling the coordinator directly (no Ray)."""

    def __init__(self, coord, member: str) -> None:
        self.coord, self.member = coord, member
        self.changed = threading.Event()
        reply = coord.join(
            member,
            {},
            {
                "num_workers": 2,
                "world": WORLD,
                "base_seed": 0,
                "actor_options": {},
                "node_id": None,
                "startup_timeout_s": 60.0,
                "lease_s": 30.0,
            },
            ["payload"],
        )
        self.actors = []
        self.generations = list(reply["generations"])
        self._take(reply)

    def _take(self, reply: dict) -> None:
        # as JobPool._take: workers this rank knows keep the generation it knows until its own replace
        self.generations += list(reply["generations"][len(self.generations) :])
        self.actors = list(reply["actors"])
        self.active, self.retiring = list(reply["active"]), list(reply["retiring"])
        self.joining = {w: 0.0 for w in reply["joining"]}
        self.job_world, self.version, self.decisions = reply["world"], reply["version"], []

    def view(self) -> None:
        self.changed.clear()
        self._take(self.coord.view())

    def resize(self, per_rank: int) -> None:
        self.changed.clear()
        self._take(self.coord.resize(per_rank))

    def done_with(self, wid: int) -> None:
        self.coord.done_with(self.member, wid)

    def replace(self, wid: int) -> None:
        reply = self.coord.replace(wid, self.generations[wid])
        self.generations[wid] = reply["generation"]
        if reply["retired"]:
            self.changed.set()

    def renew(self) -> None:
        if self.coord.renew(self.member)["version"] != self.version:
            self.changed.set()


class _Driver:
    """One rank's conductor, reduced to what resizing touches: draw, send, hand out the oldest."""

    def __init__(self, coord, member: str, sent: dict) -> None:
        self.pool = _Rank(coord, member)
        self.sched = Schedule(len(self.pool.actors), PREFETCH * 2, True, self._submit, balanced_from=0)
        self.elastic = JobElastic(self.pool, self.sched, PREFETCH, self.put_index, 60.0, autoscale=False)
        self.next_idx = self.handed = 0
        self.sent = sent  # worker id -> tasks in flight there, over all ranks
        for _ in range(self.sched.max_tasks):
            self.put_index()

    def _submit(self, wid: int, epoch: int, tasks: list):
        coord = self.pool.coord
        for idx, _work in tasks:
            assert wid not in coord._pool.released, f"task {idx} sent to worker {wid}, which the job released"
            assert wid not in coord._retiring or self.pool.version < coord._version, (
                f"task {idx} sent to worker {wid}, which the job retires, by a rank that knows it"
            )
        return object(), object(), None

    def put_index(self) -> None:
        if self.sched.tasks_outstanding >= self.sched.max_tasks:
            return
        wid = self.sched.next_worker()
        self.sched.add(self.next_idx, wid, None, None)
        # counted when assigned: a task waiting for its worker's call (NOTE [ raydl calls ]) goes there too
        self.sent[wid] = self.sent.get(wid, 0) + 1
        self.next_idx += 1

    def step(self) -> None:
        """One `next()`: follow the job, hand out the oldest task, draw the next."""
        self.elastic.step()
        self.sched.flush_for(self.handed)  # as the driver does before it waits on a task
        task = self.sched.pop(self.handed)
        self.sent[task.worker_id] -= 1
        self.handed += 1
        self.put_index()

    def worker_died(self, wid: int) -> None:
        """Recovery, as driver/recovery.py does it: a retired worker's tasks go to the others, else it is replaced
        (its tasks stay on it and are sent again)."""
        on_it = self.sched.workers_num_tasks[wid] if wid < len(self.sched.workers_num_tasks) else 0
        if on_it == 0:
            return  # this rank has nothing there: it does not notice
        before = list(self.sched.workers_num_tasks)
        if self.elastic.take_over_lost(wid):  # its tasks moved to the others: move their counts
            after = self.sched.workers_num_tasks
            for w, n in enumerate(after):
                self.sent[w] = self.sent.get(w, 0) + n - (before[w] if w < len(before) else 0)
        else:
            self.pool.replace(wid)

    def leave(self) -> None:
        for idx in sorted(self.sched.task_info):
            self.sent[self.sched.task_info[idx].worker_id] -= 1
        self.pool.coord.leave(self.pool.member)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("resize"), st.integers(0, WORLD - 1), st.integers(1, 4)),
        st.tuples(st.just("step"), st.integers(0, WORLD - 1), st.integers(1, 6)),
        st.tuples(st.just("start"), st.just(0), st.just(0)),  # the joining workers have started
        st.tuples(st.just("renew"), st.integers(0, WORLD - 1), st.just(0)),
        st.tuples(st.just("rejoin"), st.integers(0, WORLD - 1), st.just(0)),  # a rank leaves and a new one joins
        st.tuples(st.just("kill"), st.just(0), st.integers(0, 7)),  # the k-th newest worker not released dies
    ),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(ops)
def test_resizes_never_release_a_worker_with_tasks_and_converge(monkeypatch, sequence):
    monkeypatch.setattr("raydl.cluster.pool.WorkerPool", _Pool)
    monkeypatch.setattr(job_coordinator._Coordinator, "_watch", lambda self: None)  # polled by "start" below
    monkeypatch.setattr(job_coordinator._Coordinator, "_own_copy", staticmethod(lambda ref: ref))
    coord = job_coordinator._Coordinator("prop")
    sent: dict = {}
    ranks = [_Driver(coord, f"r{r}", sent) for r in range(WORLD)]
    asked = 2
    members = WORLD

    def check() -> None:
        for wid, n in sent.items():
            assert n >= 0
            if wid in coord._pool.released:
                assert n == 0, f"worker {wid} released with {n} task(s) of the ranks on it"

    for op, r, arg in sequence:
        if op == "resize":
            ranks[r].elastic.resize(arg)
            asked = arg
        elif op == "step":
            for _ in range(arg):
                ranks[r].step()
        elif op == "start":
            coord._pool.ready_to_join = True
            coord._poll_joining()
            coord._pool.ready_to_join = False
        elif op == "renew":
            ranks[r].pool.renew()
        elif op == "kill":
            alive = [w for w in range(len(coord._pool.actors)) if w not in coord._pool.released]
            wid = alive[-1 - arg % len(alive)]  # 0: the newest (the first to retire)
            before = coord._generations[wid]
            for rank in ranks:
                rank.worker_died(wid)
            assert coord._generations[wid] <= before + 1, f"worker {wid} replaced more than once for one death"
        else:
            ranks[r].leave()
            ranks[r] = _Driver(coord, f"r{r}-{members}", sent)
            members += 1
        check()
    # catch up: workers start, every rank hears of the last change and steps past its old tasks
    coord._pool.ready_to_join = True
    coord._poll_joining()
    for _ in range(3):
        for rank in ranks:
            rank.pool.renew()
            for _ in range(PREFETCH * 8 + 2):
                rank.step()
        check()
    assert len(coord._active()) == asked * WORLD and not coord._pool.joining
    assert not coord._retiring, f"still retiring: {coord._retiring}"
    for rank in ranks:
        assert sorted(rank.sched.active) == coord._active()
        assert rank.handed + rank.sched.tasks_outstanding == rank.next_idx


def test_the_lease_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv("RAYDL_JOB_LEASE_S", raising=False)
    assert job_coordinator.lease_s() == job_coordinator.JOB_LEASE_S
    monkeypatch.setenv("RAYDL_JOB_LEASE_S", "8")
    assert job_coordinator.lease_s() == 8.0
    for bad in ("soon", "1", "-5", "nan"):
        monkeypatch.setenv("RAYDL_JOB_LEASE_S", bad)
        with pytest.raises(ValueError, match="RAYDL_JOB_LEASE_S should be a number of seconds, at least 2"):
            job_coordinator.lease_s()
