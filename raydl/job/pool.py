"""One pool of worker actors for every rank of a training job: `DataLoader(..., ray_job=...)`.

NOTE [ raydl job pool ]
Without `ray_job` each rank's loader starts its own workers. With it, the loaders of one job
(same name) share one pool, owned by a coordinator actor named after the job (namespace "raydl",
detached, so that no rank's exit takes the pool with it; job/coordinator.py):
  * the first rank puts the payload in the object store; the coordinator keeps its own copy and
    starts `num_workers x world size` workers with the usual `WorkerPool`. Later ranks join and
    get the handles; a rank whose loader differs is refused with a ValueError naming the
    difference;
  * each rank keeps its own sampler order, reorder buffer, prefetch bound, pinning and state, as
    a private loader, and sends each batch to the worker that would finish one more of its
    batches first ((its batches there + 1) x the worker's average batch time). Batch content must
    not depend on the worker: the default seeding is `ray_seed="batch"`, keyed by rank too;
    `ray_seed="worker"` is refused;
  * a dead worker is replaced once for the job (the first rank to ask starts the replacement, the
    others get it); every rank re-sends its own lost batches (NOTE [ raydl recovery ]);
  * membership is a lease each rank renews from a thread (JOB_LEASE_RENEW_S, JOB_LEASE_S), also
    renewed while GCS lists the rank's Ray job alive, so a starved thread never costs a live rank
    the pool. With no member left the coordinator ends the workers and itself; a coordinator that
    died is recreated by the next rank that calls it;
  * resizing and autoscaling act on the job's pool: the coordinator owns the worker set and its
    version, ranks follow it (NOTE [ raydl job elastic ]). A rank joining later uses the pool as
    it is.
Not yet for a job pool: worker state in checkpoints (the seeding makes it unnecessary for
map-style datasets), and IterableDatasets (a replica's stream belongs to one rank).
Detail: docs/design-notes.md.
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
from .coordinator import JOB_LEASE_RENEW_S, JOB_NAMESPACE, coordinator_name, lease_s, start_coordinator

__all__ = ["JobPool", "job_name", "job_fingerprint", "rank_and_world", "coordinator_name", "JOB_NAMESPACE"]

logger = logging.getLogger(__name__)


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
        "collate_fn": _name_of(loader.collate_fn),
        "worker_init_fn": _name_of(loader.worker_init_fn),
        "ray_seed": options.seed,
        "ray_max_workers": options.max_workers,
        "ray_remote_args": repr(sorted((options.remote_args or {}).items())),
        "ray_shared_dataset_memory": options.shared_dataset_memory,
        "ray_threads_per_worker": options.threads_per_worker,
    }


class JobPool:
    """A rank's view of the job's pool, with the `WorkerPool` surface the iterator, recovery and elastic use."""

    def __init__(
        self,
        name: str,
        rank: int,
        world: int,
        num_workers: int,
        make_payload_ref: Callable[[], Any],
        fingerprint: Mapping[str, Any],
        base_seed: int,
        actor_options: Mapping[str, Any],
        startup_timeout_s: float,
        max_workers: Optional[int] = None,
    ) -> None:
        import ray

        self.name, self.rank, self.world = name, rank, world
        self.actor_options = dict(actor_options)
        self._make_payload_ref = make_payload_ref
        self._fingerprint = dict(fingerprint)
        self._config = {
            "num_workers": num_workers,
            "world": world,
            "max_workers": max_workers,
            "base_seed": base_seed,
            "actor_options": self.actor_options,
            "node_id": ray.get_runtime_context().get_node_id(),
            "startup_timeout_s": startup_timeout_s,
            "lease_s": lease_s(),
            # a driver's Ray job id: the coordinator keeps its hold while the job lives (NOTE [ raydl job pool ]);
            # inside an actor (Ray Train) the job outlives the rank, so the lease alone decides there
            "job_id": None if ray.get_runtime_context().get_actor_id() else ray.get_runtime_context().get_job_id(),
        }
        self._renew_s = min(JOB_LEASE_RENEW_S, self._config["lease_s"] / 4)
        self._member = f"{rank}-{uuid.uuid4().hex[:8]}"
        from ..cluster.connect import ray_session

        self._session = ray_session()
        self._startup_timeout_s = startup_timeout_s
        self.epoch = 0
        self.pipe_seed: Optional[int] = None  # a job takes no IterDataPipe (an iterable): never set
        self.joining: dict[int, float] = {}
        self.released: set[int] = set()
        self.restarts: list[int] = []
        self.changed = threading.Event()  # the coordinator's worker set changed: fetch `view()`
        self._alive = True
        self._ready = False
        self._attach()
        # The coordinator configured the workers, not this process: Ray orders one caller's tasks to an
        # actor, not two callers', so no task of this rank may reach a worker before it is ready.
        self.wait_ready(startup_timeout_s)
        self._stop = threading.Event()
        threading.Thread(
            target=_renew_loop, args=(weakref.ref(self), self._stop, self._renew_s), name="raydl_job_lease", daemon=True
        ).start()

    # ------------------------------------------------------------------ the coordinator

    def _attach(self) -> None:
        import ray

        for _ in range(3):
            self._coord = start_coordinator(self.name)
            reply = ray.get(self._coord.join.remote(self._member, self._fingerprint, self._config))
            if reply.get("need_payload"):
                reply = ray.get(
                    self._coord.join.remote(self._member, self._fingerprint, self._config, [self._make_payload_ref()])
                )
            if reply.get("ended"):  # the last rank just left: a new coordinator comes up
                time.sleep(0.5)
                continue
            if "mismatch" in reply:
                raise ValueError(
                    f"ray_job {self.name!r}: this rank's loader differs from the job's: "
                    + ", ".join(f"{k} {old!r} there, {new!r} here" for k, (old, new) in reply["mismatch"].items())
                    + ". Every rank of a job must build the same loader (or use another ray_job name)."
                )
            self._take(reply, fresh=True)
            return
        raise RuntimeError(f"ray_job {self.name!r}: the job's coordinator kept ending while this rank joined")

    def _take(self, reply: dict, fresh: bool = False) -> None:
        """Take the coordinator's worker set. Only a fresh one (just joined: maybe a new coordinator) replaces the
        actors this rank knows; otherwise it learns only new workers: a worker another rank replaced is learned
        when this rank's task on the dead actor fails and `replace` names the generation it knew (taking the
        new generation here would have the coordinator replace a healthy replacement)."""
        if fresh:
            self.actors = list(reply["actors"])
            self.generations = list(reply["generations"])
        else:
            known = len(self.actors)
            self.actors += list(reply["actors"][known:])
            self.generations += list(reply["generations"][known:])
        self.records: list[Optional[WorkerRecord]] = list(reply["records"])
        self.active: list[int] = list(reply["active"])
        self.retiring: list[int] = list(reply["retiring"])
        self.job_world: int = reply["world"]
        self.version: int = reply["version"]
        self.decisions: list = list(reply["decisions"])
        self.restarts += [0] * (len(self.actors) - len(self.restarts))
        self.joining = {w: 0.0 for w in reply["joining"]}
        self.released = set(range(len(self.actors))) - set(self.active) - set(self.retiring) - set(self.joining)

    # ------------------------------------------------------------------ the job's worker set

    def view(self) -> None:
        """Fetch the coordinator's worker set now."""
        self.changed.clear()
        reply = self._call("view")
        if reply is not None:
            self._take(reply)

    def resize(self, per_rank: int) -> None:
        """The job's pool becomes `per_rank x world size` workers (set_num_workers on any rank)."""
        self._config["num_workers"] = per_rank  # a coordinator recreated later starts the pool at this size
        self.changed.clear()
        reply = self._call("resize", per_rank)
        if reply is not None:
            self._take(reply)

    def done_with(self, worker_id: int) -> None:
        """This rank has no task left on retiring worker `worker_id`."""
        self._coord.done_with.remote(self._member, worker_id)

    def report(self, epoch: int, figures: tuple) -> None:
        """One autoscaler window of this rank, for the job's rule (in the coordinator)."""
        version = self._call("report", self._member, self.version, epoch, figures)
        if version is None or version != self.version:
            self.changed.set()

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
            if reply["retired"]:
                self.changed.set()
        self.restarts[worker_id] += 1
        self._ready = False

    def abandon(self, worker_id: int, ref: Any) -> None:
        """Nothing to keep: the job's workers never go back to a warm pool."""

    def mark_failed(self, worker_id: int) -> None:
        """The coordinator replaces it when asked (`replace`)."""

    def take_swapped(self) -> list[int]:
        return []

    def node_of(self, worker_id: int) -> Optional[str]:
        """Where worker `worker_id` runs, once it reported (the coordinator places the job's workers)."""
        record = self.records[worker_id] if worker_id < len(self.records) else None
        return record.node_id if record is not None else None

    def describe(self, worker_id: int) -> str:
        record = self.records[worker_id] if worker_id < len(self.records) else None
        where = f"pid {record.pid}, node {record.node_ip}" if record is not None else "not started"
        return f"raydl worker {worker_id} of job {self.name!r} ({where})"

    def release_when_collected(self, owner: Any) -> Any:
        return weakref.finalize(owner, _leave, self._coord, self._member, self._stop)

    def shutdown(self, tasks_known: bool = True) -> None:
        if self._alive:
            self._alive = False
            if self.in_session():  # else Ray was shut down: the coordinator's handle died with it
                _leave(self._coord, self._member, self._stop)
            else:
                self._stop.set()

    def in_session(self) -> bool:
        """Whether Ray still runs the session this rank joined the job in (never starts one)."""
        from ..cluster.connect import ray_session

        return self._session is not None and ray_session() == self._session

    def renew(self) -> bool:
        """Renew this rank's lease (from the lease thread): whether the coordinator still counts it as a member.
        Each Ray call is made in a short `ray_calls` block, so a `ray.shutdown()` never waits more than a slice."""
        import ray

        from ..cluster.connect import ray_calls

        with ray_calls(self._session) as session:
            if session is None:
                return False
            ref = self._coord.renew.remote(self._member)
        deadline = time.monotonic() + self._renew_s * 2
        while True:
            with ray_calls(self._session) as session:
                if session is None:
                    return False
                try:
                    ready, _ = ray.wait([ref], timeout=0.2, fetch_local=True)
                    reply = ray.get(ref, timeout=1) if ready else None
                except Exception:  # the coordinator is gone: the next call finds out
                    return False
            if reply is not None:
                break
            if time.monotonic() > deadline:  # slow: the next renewal tries again
                return False
        if reply["version"] != self.version:
            self.changed.set()
        return bool(reply["member"])


def _leave(coord: Any, member: str, stop: threading.Event) -> None:
    from ..cluster.connect import ray_calls

    stop.set()
    with ray_calls() as session:
        if session is None:  # Ray already shut down (a call would start a new one): the lease runs out
            return
        try:
            coord.leave.remote(member)
        except Exception:  # Ray going down
            pass


def _renew_loop(pool_ref: Any, stop: threading.Event, every_s: float) -> None:
    from ..cluster.connect import ray_session

    while not stop.wait(every_s):
        pool = pool_ref()
        if pool is None or not pool.alive or ray_session() is None:  # never a call that would start a Ray
            return
        pool.renew()
        del pool
