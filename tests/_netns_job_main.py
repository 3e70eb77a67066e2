"""The job service (`ray_job`, docs/job.md) on a namespace cluster (cluster/netns_testbed.py): two ranks of a gloo job
on two nodes, rank 0 in the head's namespace and rank 1 in worker node 1's, each joining the cluster with its node's
Ray environment, the gloo rendezvous at the head's bridge address.

`python -m tests._netns_job_main job` (run by tests/_netns.py's `run_driver(..., module=...)` in the head's namespace)
starts both ranks, waits for them (bounded) and prints one `FACTS {json}` line with what each saw;
`python -m tests._netns_job_main rank` is one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in its environment):
a loader with `DistributedSampler` and `ray_job`, stepping in lockstep (one all_reduce per step, as DDP's backward).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys

from tests._netns_driver import main, state_cluster
from tests._session import read_facts

N, BATCH, SEED, JOB = 48, 4, 7, "netns-job"
RANK_TIMEOUT_S = 180.0


def rank() -> dict:
    import ray
    import torch
    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    import raydl
    from tests import _datasets as D

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    me, world = dist.get_rank(), dist.get_world_size()
    # RAY_ADDRESS and the token from the environment; the node's own address given: the namespaces share /tmp, where
    # Ray caches a node's address (the head's, read by a driver on another node of this machine)
    ray.init(_node_ip_address=_own_ip(os.environ["MASTER_ADDR"]))
    ds = D.RangeDataset(N)
    loader = raydl.DataLoader(
        ds,
        batch_size=BATCH,
        sampler=DistributedSampler(ds, seed=SEED),
        num_workers=1,
        ray_job=JOB,
        ray_remote_args={"num_cpus": 0},
        timeout=60,
        ray_startup_timeout_s=240,
    )
    got, pool = [], []
    it = iter(loader)
    try:
        for step, batch in enumerate(it):
            got.append(batch.flatten().tolist())
            if step == 0:
                pool = sorted([r.pid, r.node_ip] for r in it.worker_records)
            dist.all_reduce(torch.zeros(1))  # lockstep
        coordinator = ray.get_actor(f"raydl-job:{JOB}", namespace="raydl")._actor_id.hex()
    finally:
        del it
        loader.shutdown()
        dist.destroy_process_group()
    expected = list(DistributedSampler(ds, num_replicas=world, rank=me, seed=SEED))
    facts = {
        "rank": me,
        "ip": ray.util.get_node_ip_address(),
        "shard_exact": [i for b in got for i in b] == expected and len(got) == len(expected) // BATCH,
        "samples": [i for b in got for i in b],
        "pool": pool,
        "coordinator": coordinator,
    }
    ray.shutdown()
    return facts


def _own_ip(peer: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def job(facts: dict) -> None:
    cluster = state_cluster()
    with socket.socket() as s:  # the gloo rendezvous port, on the head's bridge address
        s.bind((cluster.ip(0), 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for r, node in enumerate((0, 1)):  # rank 0 on the head, rank 1 on worker node 1
            env = dict(cluster.node_env(node), RAY_ADDRESS=cluster.address, PYTHONPATH=os.environ["PYTHONPATH"])
            env.update(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR=cluster.ip(0), MASTER_PORT=str(port))
            env.update(GLOO_SOCKET_IFNAME="eth0", RAYDL_NETNS_STATE=os.environ["RAYDL_NETNS_STATE"])
            procs.append(
                subprocess.Popen(
                    [*cluster.exec_prefix(node), sys.executable, "-m", "tests._netns_job_main", "rank"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outs = [p.communicate(timeout=RANK_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:  # a rank still running (a timeout, an error above): its group, by its pid
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    facts["ranks"] = [
        read_facts(subprocess.CompletedProcess(p.args, p.returncode, out, "")) for p, out in zip(procs, outs)
    ]


if __name__ == "__main__":
    main({"job": job, "rank": lambda facts: facts.update(rank())}, join_ray=False)
