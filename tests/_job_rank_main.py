"""One rank of a DDP job (gloo) whose raydl loader joins the job's pool: run by tests/_job_cluster_main.py.

Started as torchrun starts a rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
by the driver itself, or by torchrun (`python -m torch.distributed.run ... tests/_job_rank_main.py`).
Its one argument is a JSON config (see `main`). The rank joins the cluster at `address` (or
RAY_ADDRESS), builds `raydl.DataLoader(Traced(n), sampler=DistributedSampler(...), ray_job=...,
ray_seed="sample")`, steps in lockstep with the other ranks (one all_reduce per step, as DDP's
backward does) and appends what it saw to its JSON-lines file, one line per event, flushed at
once, so that what a rank saw before it crashed is kept:
  {"kind": "start", ...}                        who it is (rank, pid, Ray node, torchrun restart count)
  {"kind": "batch", "epoch", "step", "idx", "draw", "pid", "node"}   one per batch handed out
  {"kind": "pool", ...}                         the job's pool as this rank sees it (worker pids, coordinator)
                                                at its first step of an epoch; "pool_after" at the epoch's end
  {"kind": "count", ...}                        raydl actors alive in the whole cluster, mid-epoch
  {"kind": "killed", "pid"}                     the worker this rank SIGKILLed
  {"kind": "resumed", "step"} / {"kind": "crash"}   a restarted rank's first step / a rank about to die
  {"kind": "end"}                               the rank finished its epochs and left the pool
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback only

import datetime  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

JOB_NAMESPACE = "raydl"

_NODE: list = []


def _node_id() -> str:
    """The Ray node this process runs on (a worker actor's, or the calling process's)."""
    if not _NODE:
        import ray

        _NODE.append(ray.get_runtime_context().get_node_id())
    return _NODE[0]


class Traced(Dataset):
    """Sample i: its index, a torch draw (seeded per sample under ray_seed='sample'), and who made it (pid, node).
    Each takes `delay_s`, so that batches are really in flight on every worker while the ranks step."""

    def __init__(self, n: int, delay_s: float = 0.0) -> None:
        self.n = n
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.delay_s:
            time.sleep(self.delay_s)
        return {"i": i, "draw": int(torch.randint(0, 1 << 30, ())), "pid": os.getpid(), "node": _node_id()}


def alive_actors() -> dict:
    """Alive actors of the whole cluster by class name (the GCS's table: no dashboard needed)."""
    import ray

    counts: dict = {}
    for actor in ray._private.state.actors(actor_state_name="ALIVE").values():
        name = actor.get("ActorClassName") or actor.get("class_name") or "?"
        counts[name] = counts.get(name, 0) + 1
    return counts


def coordinator_id(job: str):
    """The actor id of the job's coordinator, or None when there is none."""
    import ray

    try:
        return ray.get_actor(f"raydl-job:{job}", namespace=JOB_NAMESPACE)._actor_id.hex()
    except ValueError:
        return None


def init_gloo(attempt: int) -> None:
    """torch.distributed with gloo, from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Under torchrun the ranks rendezvous in the agent's store, which outlives a restart with the failed
    attempt's keys in it: a restarted rank could read a dead peer's gloo address and fail to connect
    (pytorch/pytorch#135712). Each attempt gets a key space of its own."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"raydl-test-attempt-{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def worker_actors_created() -> int:
    """raydl worker actors the cluster has seen, alive or dead."""
    import ray

    return sum(1 for a in ray._private.state.actors().values() if a.get("ActorClassName") == "Worker")


def main() -> None:
    """Config keys: address (null: RAY_ADDRESS), out (this rank's file: '{rank}' is replaced), n, batch, seed,
    num_workers, job (a name, or null: ray_job=True, the launcher names it), epochs, and the optional ones: delay_s
    (each sample's), load (a state file every rank loads), save_at {"epoch", "step", "path"} (the state after batch
    `step`), count_at {"epoch", "step"} (rank 0 counts the cluster's actors), kill_at {"epoch", "step"} (rank 0
    SIGKILLs the job's worker 1), checkpoint (a per-rank state file written after every step, and loaded at start
    when present), crash_at {"rank", "step"} (that rank dies hard before its batch `step`, without leaving the
    pool, on torchrun's first attempt only)."""
    import ray
    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    import raydl

    cfg = json.loads(sys.argv[1])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_gloo(attempt)
    rank, world = dist.get_rank(), dist.get_world_size()
    ray.init(address=cfg.get("address") or os.environ["RAY_ADDRESS"], log_to_driver=False)
    out = open(cfg["out"].replace("{rank}", str(rank)), "a")

    def emit(**record) -> None:
        out.write(json.dumps({"rank": rank, "attempt": attempt, **record}) + "\n")
        out.flush()

    emit(kind="start", world=world, pid=os.getpid(), node=_node_id(), job_env=os.environ.get("TORCHELASTIC_RUN_ID"))
    dataset = Traced(cfg["n"], cfg.get("delay_s", 0.0))
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg["seed"])
    loader = raydl.DataLoader(
        dataset,
        batch_size=cfg["batch"],
        sampler=sampler,
        num_workers=cfg["num_workers"],
        persistent_workers=True,
        ray_job=cfg["job"] or True,
        ray_seed="sample",
        timeout=60,
    )
    job = cfg["job"] or f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"

    def at(key: str, epoch: int, step: int) -> bool:
        action = cfg.get(key)
        return bool(action) and action["epoch"] == epoch and action["step"] == step

    first_step = 0
    checkpoint = cfg["checkpoint"].replace("{rank}", str(rank)) if cfg.get("checkpoint") else None
    if cfg.get("load"):
        loader.load_state_dict(torch.load(cfg["load"], weights_only=False)["state"])
    elif checkpoint and os.path.exists(checkpoint):  # a restarted rank resumes where it last saved
        saved = torch.load(checkpoint, weights_only=False)
        loader.load_state_dict(saved["state"])
        first_step = saved["step"] + 1
        emit(kind="resumed", step=first_step)
    for epoch in cfg["epochs"]:
        sampler.set_epoch(epoch)
        crash = cfg.get("crash_at")
        for step, batch in enumerate(loader, start=first_step if epoch == cfg["epochs"][0] else 0):
            dist.all_reduce(torch.ones(1))  # lockstep: every rank has its batch `step` now
            emit(
                kind="batch",
                epoch=epoch,
                step=step,
                idx=batch["i"].tolist(),
                draw=batch["draw"].tolist(),
                pid=batch["pid"].tolist(),
                node=list(batch["node"]),
            )
            if step == first_step:
                emit(
                    kind="pool",
                    epoch=epoch,
                    workers=[[r.pid, r.node_id] for r in loader.worker_records],
                    coordinator=coordinator_id(job),
                    time=time.time(),
                )
            if rank == 0 and at("count_at", epoch, step):
                emit(kind="count", epoch=epoch, actors=alive_actors(), coordinator=coordinator_id(job))
            if at("save_at", epoch, step):
                torch.save(
                    {"step": step, "state": loader.state_dict()}, cfg["save_at"]["path"].replace("{rank}", str(rank))
                )
            if checkpoint:
                tmp = checkpoint + ".tmp"
                torch.save({"step": step, "state": loader.state_dict()}, tmp)
                os.replace(tmp, checkpoint)
            if rank == 0 and at("kill_at", epoch, step):
                victim = loader.worker_records[1].pid
                os.kill(victim, signal.SIGKILL)
                emit(kind="killed", epoch=epoch, step=step, pid=victim)
            if crash and attempt == 0 and rank == crash["rank"] and step + 1 == crash["step"]:
                emit(kind="crash", step=step + 1, time=time.time())
                out.close()
                os._exit(1)  # a crash: no clean exit, so this rank never leaves the pool (its lease runs out)
        emit(
            kind="pool_after",
            epoch=epoch,
            workers=[[r.pid, r.node_id] for r in loader.worker_records],
            created=worker_actors_created(),
        )
        first_step = 0
    loader.shutdown()  # this rank leaves the job's pool
    dist.barrier()
    emit(kind="end")
    dist.destroy_process_group()
    ray.shutdown()


if __name__ == "__main__":
    # The module's own names, not __main__'s: the workers unpickle the dataset by reference (tests on sys.path).
    from tests._job_rank_main import main as _main

    _main()
