"""One pool of worker actors for every rank of a training job: `DataLoader(..., ray_job=...)`.

NOTE [ raydl job pool ]
Without `ray_job` each rank's loader starts its own workers. With it, the loaders of one job
(same name) share one pool, owned by a coordinator actor named after the job (namespace "raydl",
detached, so that no rank's exit takes the pool with it):
  * the first rank to arrive puts the worker payload (dataset, collate_fn, worker_init_fn) in the
    object store; the coordinator takes its own copy (so the payload outlives that rank) and
    starts `num_workers x world size` workers with the usual `WorkerPool` (placement rules
    included, planned from the first rank's node). Later ranks send no payload: they join and
    get the actor handles. A rank whose loader differs (dataset type or length, batch size,
    collate_fn, options) is refused with a ValueError naming the job and the difference.
  * each rank keeps its own sampler order, reorder buffer, prefetch bound (prefetch_factor x its
    num_workers), pinning and state, exactly as a private loader; it sends each batch to the
    job's worker with the fewest of its own batches in flight (ties: its own cycle, which starts
    at `rank x num_workers`), so a slow worker gets few of every rank's batches instead of half
    of one rank's (see dispatch below). Batch content must not depend on the worker: under `ray_job` the default
    seeding is `ray_seed="batch"`, keyed by (base seed, epoch, batch, rank) so two ranks never
    draw the same numbers, or "sample"; `ray_seed="worker"` is refused.
  * a worker that dies is replaced once for the job: each rank that sees the death asks the
    coordinator to replace the worker generation it knew; the first asks starts a replacement,
    the others get it. Every rank re-sends its own lost batches (NOTE [ raydl recovery ]).
  * membership: each rank's pool client registers with the coordinator and renews its lease from
    a daemon thread (every JOB_LEASE_RENEW_S); a rank that leaves (iterator shut down) or whose
    lease runs out (JOB_LEASE_S: its process died) is dropped. With no member left the
    coordinator ends the workers and itself; a restarted rank finds the pool while any rank
    holds it, or starts a new one. A coordinator that died is recreated by the next rank that
    calls it (its workers die with it: each rank's recovery asks for a replacement, finds the
    coordinator gone, joins the new one with its payload and re-sends its lost batches there;
    tests/test_job.py kills it mid-epoch).
  * dispatch: a rank picks the worker that would finish one more of its batches first, by (its
    batches in flight there + 1) x that worker's moving-average batch time, so a worker 3x
    slower than the rest is left alone while faster ones have room (benchmarks/bench_job.py).
Not yet for a job pool: resizing and autoscaling (`set_num_workers`, `ray_max_workers`), worker
state in checkpoints (the seeding above makes it unnecessary for map-style datasets), and
IterableDatasets (a replica's stream belongs to one rank).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Mapping, Optional

from .._errors import WorkerRecord

__all__ = ["JobPool", "job_name", "job_fingerprint", "rank_and_world", "coordinator_name", "JOB_NAMESPACE"]

logger = logging.getLogger(__name__)

JOB_NAMESPACE = "raydl"
JOB_LEASE_S = 30.0  # a member not heard from for this long is gone (its process died)
JOB_LEASE_RENEW_S = 5.0
_COORDINATOR_CHECK_S = 5.0


def job_name(ray_job: Any) -> str:
    """The job's name: `ray_job` itself, or (True) what the launcher says, else a ValueError naming the fix."""
    if isinstance(ray_job, str):
        return ray_job
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    try:
        from ray import train

        ctx = train.get_context()
        name = ctx.get_experiment_name() if ctx is not None else None
        if name:
            return f"raytrain-{name}"
    except Exception:  # not inside Ray Train
        pass
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return f"ddp-{addr}:{port}"
    raise ValueError(
        "ray_job=True takes the job's name from the launcher (torchrun's TORCHELASTIC_RUN_ID, Ray Train's run, or "
        "MASTER_ADDR and MASTER_PORT), and none is set here. Pass a name: ray_job='my-run', the same in every rank."
    )


def rank_and_world() -> tuple[int, int]:
    """(rank, world size): torch.distributed when initialized, else RANK / WORLD_SIZE, else Ray Train, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        from ray import train

        ctx = train.get_context()
        return ctx.get_world_rank(), ctx.get_world_size()
    except Exception:  # not inside Ray Train
        return 0, 1


def _name_of(obj: Any) -> Optional[str]:
    if obj is None:
        return None
    target = getattr(obj, "__func__", obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(obj).__qualname__)}"


def job_fingerprint(loader: Any, options: Any) -> dict:
    """What every rank's loader of one job must share: the job's workers are configured once, for all of them."""
    try:
        length = len(loader.dataset)
    except TypeError:
        length = None
    return {
        "dataset": f"{type(loader.dataset).__module__}.{type(loader.dataset).__qualname__}",
        "dataset_len": length,
        "num_workers": loader.num_workers,
        "collate_fn": _name_of(loader.collate_fn),
        "worker_init_fn": _name_of(loader.worker_init_fn),
        "ray_seed": options.seed,
        "ray_remote_args": repr(sorted((options.remote_args or {}).items())),
        "ray_shared_dataset_memory": options.shared_dataset_memory,
        "ray_threads_per_worker": options.threads_per_worker,
    }


def coordinator_name(name: str) -> str:
    return f"raydl-job:{name}"


class _Coordinator:
    """The job's coordinator (a threaded Ray actor): owns the payload copy and the workers (NOTE [ raydl job pool ])."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.RLock()
        self._pool: Any = None
        self._payload_ref: Any = None
        self._fingerprint: Optional[dict] = None
        self._generations: list[int] = []
        self._members: dict[str, float] = {}
        self._ended = False
        threading.Thread(target=self._watch, name="raydl_job_watch", daemon=True).start()

    def join(self, member: str, fingerprint: dict, config: dict, payload: Optional[list] = None) -> dict:
        """Register `member`; start the pool on the first call that brings the payload."""
        import ray

        with self._lock:
            if self._ended:
                return {"ended": True}
            if self._fingerprint is not None and fingerprint != self._fingerprint:
                diff = sorted(k for k in set(fingerprint) | set(self._fingerprint)
                              if fingerprint.get(k) != self._fingerprint.get(k))
                return {"mismatch": {k: (self._fingerprint.get(k), fingerprint.get(k)) for k in diff}}
            if self._pool is None:
                if payload is None:
                    return {"need_payload": True}
                from ..cluster.placement import worker_placement
                from ..cluster.pool import WorkerPool

                self._payload_ref = ray.put(ray.get(payload[0]))  # this actor's own copy: it outlives the rank
                self._fingerprint = fingerprint
                options = dict(config["actor_options"])
                self._pool = WorkerPool(
                    self._payload_ref, config["num_workers"], config["base_seed"], options, reuse=False,
                    placement=worker_placement(options, config["node_id"]), track_rng=False,
                )
                self._generations = [0] * config["num_workers"]
            self._members[member] = time.monotonic()
            return {"actors": list(self._pool.actors), "generations": list(self._generations),
                    "records": list(self._pool.records)}

    def wait_ready(self, timeout_s: float) -> dict:
        with self._lock:
            self._pool.wait_ready(timeout_s)
            return {"actors": list(self._pool.actors), "generations": list(self._generations),
                    "records": list(self._pool.records)}

    def replace(self, worker_id: int, generation: int) -> dict:
        """Replace worker `worker_id` if it is still the `generation` the caller knew; return the current one."""
        with self._lock:
            if self._generations[worker_id] == generation:
                self._pool.replace(worker_id)
                self._generations[worker_id] += 1
                self._pool.records[worker_id] = None
            return {"actor": self._pool.actors[worker_id], "generation": self._generations[worker_id]}

    def renew(self, member: str) -> bool:
        with self._lock:
            if member not in self._members or self._ended:
                return False
            self._members[member] = time.monotonic()
            return True

    def leave(self, member: str) -> None:
        with self._lock:
            self._members.pop(member, None)
            self._end_if_unused()

    def _watch(self) -> None:
        while not self._ended:
            time.sleep(_COORDINATOR_CHECK_S)
            with self._lock:
                now = time.monotonic()
                for m, seen in list(self._members.items()):
                    if now - seen > JOB_LEASE_S:
                        logger.info("raydl job %r: a rank was not heard from for %.0f s: dropped", self._name, now - seen)
                        del self._members[m]
                self._end_if_unused()

    def _end_if_unused(self) -> None:
        if self._members or self._ended:
            return
        self._ended = True
        if self._pool is not None:
            self._pool.shutdown(tasks_known=False)
        import ray

        threading.Thread(target=lambda: (time.sleep(0.2), ray.actor.exit_actor()), daemon=True).start()


_COORDINATOR_CLASS: Any = None


def _coordinator(name: str) -> Any:
    """The job's coordinator actor, created here if no rank has created it yet."""
    global _COORDINATOR_CLASS
    import ray

    if _COORDINATOR_CLASS is None:
        _COORDINATOR_CLASS = ray.remote(num_cpus=0, max_concurrency=16)(_Coordinator)
    return _COORDINATOR_CLASS.options(
        name=coordinator_name(name), namespace=JOB_NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=0,
    ).remote(name)


class JobPool:
    """A rank's view of the job's pool, with the `WorkerPool` surface the iterator, recovery and elastic use."""

    def __init__(self, name: str, rank: int, world: int, num_workers: int, make_payload_ref: Callable[[], Any],
                 fingerprint: Mapping[str, Any], base_seed: int, actor_options: Mapping[str, Any],
                 startup_timeout_s: float) -> None:
        import ray

        self.name, self.rank, self.world = name, rank, world
        self.actor_options = dict(actor_options)
        self._make_payload_ref = make_payload_ref
        self._fingerprint = dict(fingerprint)
        self._config = {"num_workers": num_workers * world, "base_seed": base_seed,
                        "actor_options": self.actor_options, "node_id": ray.get_runtime_context().get_node_id()}
        self._member = f"{rank}-{uuid.uuid4().hex[:8]}"
        self._startup_timeout_s = startup_timeout_s
        self.epoch = 0
        self.joining: dict[int, float] = {}
        self.released: set[int] = set()
        self._alive = True
        self._ready = False
        self._attach()
        n = len(self.actors)
        self.restarts = [0] * n
        # The coordinator configured the workers, not this process: Ray orders one caller's tasks to an
        # actor, not two callers', so no task of this rank may reach a worker before it is ready.
        self.wait_ready(startup_timeout_s)
        self._stop = threading.Event()
        threading.Thread(target=_renew_loop, args=(weakref.ref(self), self._stop), name="raydl_job_lease",
                         daemon=True).start()

    # ------------------------------------------------------------------ the coordinator

    def _attach(self) -> None:
        import ray

        for _ in range(3):
            self._coord = _coordinator(self.name)
            reply = ray.get(self._coord.join.remote(self._member, self._fingerprint, self._config))
            if reply.get("need_payload"):
                reply = ray.get(self._coord.join.remote(self._member, self._fingerprint, self._config,
                                                        [self._make_payload_ref()]))
            if reply.get("ended"):  # the last rank just left: a new coordinator comes up
                time.sleep(0.5)
                continue
            if "mismatch" in reply:
                raise ValueError(
                    f"ray_job {self.name!r}: this rank's loader differs from the job's: "
                    + ", ".join(f"{k} {old!r} there, {new!r} here" for k, (old, new) in reply["mismatch"].items())
                    + ". Every rank of a job must build the same loader (or use another ray_job name)."
                )
            self._take(reply)
            return
        raise RuntimeError(f"ray_job {self.name!r}: the job's coordinator kept ending while this rank joined")

    def _take(self, reply: dict) -> None:
        self.actors = list(reply["actors"])
        self.generations = list(reply["generations"])
        self.records: list[Optional[WorkerRecord]] = list(reply["records"])

    def _call(self, method: str, *args: Any) -> Any:
        """A coordinator call; a dead coordinator is recreated (and the pool with it) once."""
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(getattr(self._coord, method).remote(*args))
        except RayActorError:
            logger.warning("raydl job %r: its coordinator died; starting the job's pool again", self.name)
            self._attach()
            self._ready = False
            return None

    # ------------------------------------------------------------------ WorkerPool's surface

    @property
    def num_workers(self) -> int:
        return len(self.actors)

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def is_ready(self) -> bool:
        return self._ready

    def wait_ready(self, timeout_s: float) -> None:
        reply = self._call("wait_ready", timeout_s)
        if reply is None:  # recreated: wait for the new pool
            reply = self._call("wait_ready", timeout_s)
        self._take(reply)
        self._ready = True

    def replace(self, worker_id: int, state: Optional[dict] = None) -> None:
        reply = self._call("replace", worker_id, self.generations[worker_id])
        if reply is not None:
            self.actors[worker_id] = reply["actor"]
            self.generations[worker_id] = reply["generation"]
        self.restarts[worker_id] += 1
        self._ready = False

    def abandon(self, worker_id: int, ref: Any) -> None:
        """Nothing to keep: the job's workers never go back to a warm pool."""

    def mark_failed(self, worker_id: int) -> None:
        """The coordinator replaces it when asked (`replace`)."""

    def take_swapped(self) -> list[int]:
        return []

    def describe(self, worker_id: int) -> str:
        record = self.records[worker_id] if worker_id < len(self.records) else None
        where = f"pid {record.pid}, node {record.node_ip}" if record is not None else "not started"
        return f"raydl worker {worker_id} of job {self.name!r} ({where})"

    def add_worker(self, info_num_workers: int) -> int:
        raise ValueError("a ray_job pool cannot be resized yet")

    def poll_joining(self, timeout_s: float) -> tuple[list[int], list[tuple[int, str]]]:
        return [], []

    def release(self, worker_id: int) -> None:
        self.released.add(worker_id)

    def release_when_collected(self, owner: Any) -> Any:
        return weakref.finalize(owner, _leave, self._coord, self._member, self._stop)

    def shutdown(self, tasks_known: bool = True) -> None:
        if self._alive:
            self._alive = False
            _leave(self._coord, self._member, self._stop)

    def renew(self) -> bool:
        import ray

        try:
            return bool(ray.get(self._coord.renew.remote(self._member), timeout=JOB_LEASE_RENEW_S * 2))
        except Exception:  # the coordinator is gone or slow: the next call finds out
            return False


def _leave(coord: Any, member: str, stop: threading.Event) -> None:
    import ray

    stop.set()
    if not ray.is_initialized():  # Ray already shut down (a call would start a new one): the lease runs out
        return
    try:
        coord.leave.remote(member)
    except Exception:  # Ray going down
        pass


def _renew_loop(pool_ref: Any, stop: threading.Event) -> None:
    while not stop.wait(JOB_LEASE_RENEW_S):
        pool = pool_ref()
        if pool is None or not pool.alive:
            return
        pool.renew()
        del pool
