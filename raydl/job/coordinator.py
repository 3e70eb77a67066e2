"""The job's coordinator: a detached Ray actor per `ray_job` name that owns the job's workers and their set.

NOTE [ raydl job pool ] in job/pool.py says what it does for the ranks (the payload copy, the
pool of `num_workers x world size` workers, replacing a dead worker once for the job,
membership by lease); NOTE [ raydl job elastic ] in job/elastic.py how ranks follow its worker
set through resizes and autoscaling. This module runs in the coordinator's own process; each
rank talks to it through `JobPool` (job/pool.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Optional

__all__ = ["start_coordinator", "coordinator_name", "lease_s", "JOB_NAMESPACE", "JOB_LEASE_S", "JOB_LEASE_RENEW_S"]

logger = logging.getLogger(__name__)

JOB_NAMESPACE = "raydl"
JOB_LEASE_S = 30.0  # a member not heard from for this long is gone (its process died); env RAYDL_JOB_LEASE_S
JOB_LEASE_RENEW_S = 2.0  # also how soon a rank hears of a change another rank or the autoscaler made


def lease_s() -> float:
    """The job's lease, as the rank that starts the pool sees it: RAYDL_JOB_LEASE_S, else JOB_LEASE_S.

    Shorter frees a killed rank's hold on the pool sooner; it must stay well above the renewal
    period (a rank renews every min(JOB_LEASE_RENEW_S, lease / 4)) and above any pause of a rank's process."""
    raw = os.environ.get("RAYDL_JOB_LEASE_S")
    if raw is None:
        return JOB_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 2.0:
        raise ValueError(f"RAYDL_JOB_LEASE_S should be a number of seconds, at least 2, got {raw!r}")
    return value


_COORDINATOR_CHECK_S = 5.0


def coordinator_name(name: str) -> str:
    return f"raydl-job:{name}"


class _Coordinator:
    """The job's coordinator (a threaded Ray actor): owns the payload copy and the workers (NOTE [ raydl job pool ]).

    Worker ids are never reused: a worker is joining (started, not ready), active (ranks send to it),
    retiring (ranks send nothing new; released once every member is done with it) or released.
    `version` counts changes of that set; ranks learn of one at their next lease renewal, window
    report or resize, and fetch the new `view()`.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.RLock()
        self._pool: Any = None
        self._placement: Any = None
        self._payload_ref: Any = None
        self._fingerprint: Optional[dict] = None
        self._generations: list[int] = []
        self._members: dict[str, float] = {}  # member -> when it was last heard from (monotonic)
        self._member_jobs: dict[str, str] = {}  # member -> its process's Ray job id (a driver's), for liveness
        self._ended = False
        self._version = 0
        self._lease_s = JOB_LEASE_S
        self._world = 1
        self._target = 0  # workers active or joining that the job wants
        self._retiring: dict[int, set[str]] = {}  # worker id -> members that may still have tasks on it
        self._rule: Any = None  # the job's autoscaler (ray_max_workers), fed by every rank's windows
        self._reports: dict[str, tuple] = {}
        self._epoch = -1
        self._decisions: list = []
        self._wake = threading.Event()
        threading.Thread(target=self._watch, name="raydl_job_watch", daemon=True).start()

    def join(self, member: str, fingerprint: dict, config: dict, payload: Optional[list] = None) -> dict:
        """Register `member`; start the pool on the first call that brings the payload."""
        with self._lock:
            if self._ended:
                return {"ended": True}
            if self._fingerprint is not None and fingerprint != self._fingerprint:
                diff = sorted(
                    k
                    for k in set(fingerprint) | set(self._fingerprint)
                    if fingerprint.get(k) != self._fingerprint.get(k)
                )
                return {"mismatch": {k: (self._fingerprint.get(k), fingerprint.get(k)) for k in diff}}
            if self._pool is None:
                if payload is None:
                    return {"need_payload": True}
                from ..cluster.elastic import AutoscaleRule
                from ..cluster.placement import worker_placement
                from ..cluster.pool import WorkerPool

                self._payload_ref = self._own_copy(payload[0])
                self._fingerprint = fingerprint
                options = dict(config["actor_options"])
                self._world = config["world"]
                self._startup_timeout_s = config["startup_timeout_s"]
                self._lease_s = config["lease_s"]
                self._target = config["num_workers"] * self._world
                self._placement = worker_placement(options, config["node_id"])
                self._pool = WorkerPool(
                    self._payload_ref,
                    self._target,
                    config["base_seed"],
                    options,
                    reuse=False,
                    placement=self._placement,
                    track_rng=False,
                )
                self._generations = [0] * self._target
                if config.get("max_workers") is not None:
                    self._rule = AutoscaleRule(self._target, config["max_workers"] * self._world)
            if self._placement is not None:  # workers added or replaced later avoid every rank's node
                self._placement.add_trainer_node(config.get("node_id"))
            self._members[member] = time.monotonic()
            if config.get("job_id"):
                self._member_jobs[member] = config["job_id"]
            return self._view()

    @staticmethod
    def _own_copy(payload_ref: Any) -> Any:
        """This actor's own copy of the worker payload: it outlives the rank that sent it."""
        import ray

        return ray.put(ray.get(payload_ref))

    def _view(self) -> dict:
        pool = self._pool
        return {
            "actors": list(pool.actors),
            "generations": list(self._generations),
            "records": list(pool.records),
            "active": self._active(),
            "joining": sorted(pool.joining),
            "retiring": sorted(self._retiring),
            "world": self._world,
            "version": self._version,
            "decisions": list(self._decisions),
        }

    def view(self) -> dict:
        with self._lock:
            return self._view()

    def _active(self) -> list[int]:
        pool = self._pool
        return [
            w
            for w in range(len(pool.actors))
            if w not in pool.released and w not in pool.joining and w not in self._retiring
        ]

    def wait_ready(self, timeout_s: float) -> dict:
        with self._lock:
            self._pool.wait_ready(timeout_s)
            return self._view()

    def replace(self, worker_id: int, generation: int) -> dict:
        """Replace worker `worker_id` if it is still the `generation` the caller knew; return the current one.

        A worker retired or released meanwhile is not replaced (the caller's view is behind)."""
        with self._lock:
            gone = worker_id in self._pool.released or worker_id in self._retiring
            if self._generations[worker_id] == generation and not gone:
                self._pool.replace(worker_id)
                self._generations[worker_id] += 1
                self._pool.records[worker_id] = None
            return {"actor": self._pool.actors[worker_id], "generation": self._generations[worker_id], "retired": gone}

    # ------------------------------------------------------------------ resizing (NOTE [ raydl job pool ])

    def resize(self, per_rank: int) -> dict:
        """`set_num_workers(per_rank)` on a rank: the job's pool becomes `per_rank x world` workers."""
        with self._lock:
            if self._rule is not None:
                self._rule.min_workers = per_rank * self._world
                self._rule.max_workers = max(self._rule.max_workers, self._rule.min_workers)
                self._rule.pending = None
            self._resize_to(per_rank * self._world)
            return self._view()

    def _size(self) -> int:
        return len(self._active()) + len(self._pool.joining)

    def _resize_to(self, target: int) -> None:
        self._target = target
        before = self._size()
        while self._size() < target:
            self._pool.add_worker(target)
            self._generations.append(0)
        while self._size() > target:
            self._retire_newest()
        if before != target:
            logger.info("raydl job %r: pool resized from %d to %d workers", self._name, before, target)
            self._changed()

    def _retire_newest(self) -> None:
        """Cancel the newest joining worker, else take the newest active one out of every rank's dispatch."""
        if self._pool.joining:
            self._pool.release(max(self._pool.joining))
            return
        wid = max(self._active())
        self._retiring[wid] = set(self._members)
        self._release_if_done(wid)

    def done_with(self, member: str, worker_id: int) -> None:
        """`member` has no task left on retiring worker `worker_id`."""
        with self._lock:
            if worker_id in self._retiring:
                self._retiring[worker_id].discard(member)
                self._release_if_done(worker_id)

    def _release_if_done(self, wid: int) -> None:
        if not self._retiring[wid]:
            del self._retiring[wid]
            self._pool.release(wid)
            self._changed()

    def _changed(self) -> None:
        self._version += 1
        self._reports.clear()  # windows measured before the change do not count
        self._wake.set()

    def report(self, member: str, version: int, epoch: int, figures: tuple) -> int:
        """A rank's autoscaler window: (batches, seconds, seconds waited in next(), seconds of batch making).

        Once every member has reported one since the last change, the job's rule decides: the job
        waits as much as its most starved rank, its workers are as busy as all ranks' batches keep them."""
        with self._lock:
            if self._rule is None or version != self._version or member not in self._members:
                return self._version
            if epoch > self._epoch:
                self._epoch = epoch
                self._rule.new_epoch()
            self._reports[member] = figures
            if set(self._members) <= set(self._reports) and not self._pool.joining and not self._retiring:
                self._decide()
            return self._version

    def _decide(self) -> None:
        from ..cluster.connect import fits_available, resource_request
        from ..cluster.elastic import AutoscaleDecision

        reports, self._reports = list(self._reports.values()), {}
        n = len(self._active())
        window_s = max(r[1] for r in reports)
        wait = max(r[2] / r[1] for r in reports)
        busy_workers = sum(r[3] / r[1] for r in reports)
        rate = min(r[0] / r[1] for r in reports)  # the job steps at its slowest rank's pace
        request = resource_request(self._pool.actor_options)
        step = self._rule.decide(n, wait, busy_workers, rate, lambda: not request or fits_available(request))
        if step is None:
            return
        action, why = step
        after = n + 1 if action == "add" else n - 1
        self._resize_to(after)
        self._decisions.append(
            AutoscaleDecision(action, n, after, sum(r[0] for r in reports), window_s, wait, busy_workers / n, rate, 0)
        )
        logger.info(
            "raydl job %r autoscale: %s, %d -> %d workers: over %.2f s the most starved rank waited %.0f%%, "
            "workers were busy %.0f%% (%s)",
            self._name,
            action,
            n,
            after,
            window_s,
            100 * wait,
            100 * busy_workers / n,
            why,
        )

    def _poll_joining(self) -> None:
        if not self._pool.joining:
            return
        try:
            joined, failed = self._pool.poll_joining(self._pool_startup_timeout_s())
        except Exception as e:  # worker_init_fn raised in a new worker: the pool stays as it was
            logger.warning("raydl job %r: a new worker failed to start (%s)", self._name, e)
            self._rule_cap()
            self._changed()
            return
        for wid, why in failed:
            logger.warning("raydl job %r: worker %d was not added to the pool (%s)", self._name, wid, why)
        if failed:
            self._rule_cap()
        if joined or failed:
            self._changed()

    def _rule_cap(self) -> None:
        if self._rule is not None:
            self._rule.cap = min(self._rule.cap, self._size())
            self._rule.pending = None

    def _pool_startup_timeout_s(self) -> float:
        return float(self._startup_timeout_s)

    # ------------------------------------------------------------------ membership

    def renew(self, member: str) -> dict:
        with self._lock:
            if member not in self._members or self._ended:
                return {"member": False, "version": self._version}
            self._members[member] = time.monotonic()
            return {"member": True, "version": self._version}

    def leave(self, member: str) -> None:
        with self._lock:
            self._drop(member)
            self._end_if_unused()

    def _drop(self, member: str) -> None:
        self._members.pop(member, None)
        self._member_jobs.pop(member, None)
        self._reports.pop(member, None)
        for wid in list(self._retiring):
            self._retiring[wid].discard(member)
            self._release_if_done(wid)

    def _watch(self) -> None:
        last_check = time.monotonic()
        while not self._ended:
            check_s = min(_COORDINATOR_CHECK_S, self._lease_s / 4)
            self._wake.wait(0.1 if self._pool is not None and self._pool.joining else check_s)
            self._wake.clear()
            with self._lock:
                if self._ended:
                    return
                if self._pool is not None:
                    self._poll_joining()
                now = time.monotonic()
                if now - last_check < check_s:
                    continue
                last_check = now
                late = [m for m, seen in self._members.items() if now - seen > self._lease_s]
                alive = self._alive_members(late) if late else set()
                for m in late:
                    if m in alive:  # its renewals are late (a starved process), but it lives: it keeps its hold
                        self._members[m] = now
                        continue
                    logger.info(
                        "raydl job %r: a rank was not heard from for %.0f s and its process is gone: dropped",
                        self._name,
                        now - self._members[m],
                    )
                    self._drop(m)
                self._end_if_unused()

    def _alive_members(self, members: list) -> set:
        """Those of `members` whose process is known to live: a driver whose Ray job GCS has not marked dead.

        A lease is renewed by liveness (NOTE [ raydl job pool ]): on a loaded machine a rank's renewal
        thread can be starved for longer than the lease, and a live rank must never lose the pool for
        it. A member with no job id (it runs inside an actor, e.g. a Ray Train worker, whose job outlives
        it) or a GCS that does not answer gives no liveness signal: the lease alone decides then."""
        by_job = {m: self._member_jobs[m] for m in members if m in self._member_jobs}
        if not by_job:
            return set()
        try:
            import ray._private.worker as ray_worker

            info = ray_worker.global_worker.gcs_client.get_all_job_info(timeout=5)
            live_jobs = {job_id.hex() for job_id, data in info.items() if not data.is_dead}
        except Exception as e:  # private API changed or GCS busy: fall back to the lease alone
            logger.debug("raydl job %r: job liveness unknown (%s)", self._name, e)
            return set()
        return {m for m, job in by_job.items() if job in live_jobs}

    def _end_if_unused(self) -> None:
        if self._members or self._ended:
            return
        self._ended = True
        if self._pool is not None:
            self._pool.shutdown(tasks_known=False)
        import ray

        threading.Thread(target=lambda: (time.sleep(0.2), ray.actor.exit_actor()), daemon=True).start()


_COORDINATOR_CLASS: Any = None


def start_coordinator(name: str) -> Any:
    """The job's coordinator actor, created here if no rank has created it yet."""
    global _COORDINATOR_CLASS
    import ray

    if _COORDINATOR_CLASS is None:
        _COORDINATOR_CLASS = ray.remote(num_cpus=0, max_concurrency=16)(_Coordinator)
    return _COORDINATOR_CLASS.options(
        name=coordinator_name(name),
        namespace=JOB_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=0,
    ).remote(name)
