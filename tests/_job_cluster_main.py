"""Run in a subprocess by tests/test_job_cluster.py: a DDP job's ranks, real processes, share one pool on a cluster.

A 3-node Ray cluster on loopback (ray.cluster_utils: a head and two nodes, one CPU each), and
rank processes that each init torch.distributed (gloo), join the cluster and iterate
`raydl.DataLoader(Traced(N), sampler=DistributedSampler(shuffle=True, seed=SEED), num_workers=2,
ray_job=..., ray_seed="sample")` in lockstep (tests/_job_rank_main.py, which logs every batch:
indices, a torch draw made in `__getitem__`, and the pid and node of the worker that made it).
Phases:
  1. share: 2 ranks, epoch 0 uninterrupted (the reference run; every rank also saves its
     state after K steps), then epoch 1 with one of the job's workers SIGKILLed by rank 0 after
     its first batch (phase "kill"). Rank 0 counts the cluster's actors mid-epoch.
  2. restart: 2 ranks under torchrun (--max-restarts=1, a fixed --rdzv-id, ray_job=True: the job
     is named after TORCHELASTIC_RUN_ID; the ranks find the cluster through RAY_ADDRESS); rank 1
     dies hard mid-epoch on the first attempt (os._exit: it never leaves the pool), torchrun
     restarts the worker group, and each rank resumes from the state it saved after its last step.
  3. resume: rank 0's state after K steps of phase 1 loaded by every rank of a 3-rank job, the
     global batch kept (2 x 6 then 3 x 4).
  4. the restart job's pool ends once no rank holds it (its crashed rank's lease runs out).
Prints one line `FACTS {json}` for the test to check; a phase whose processes failed reports
their exit codes and the tails of their output instead of facts (`<phase>_run`), and a phase
whose records could not be read, the traceback (`<phase>_error`). RAYDL_KEEP_TMP=1 keeps the
ranks' records and logs (the folder is `tmp` in the facts).
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback only

import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import raydl  # noqa: E402
from tests._job_rank_main import Traced, alive_actors, coordinator_id  # noqa: E402
from tests._session import patient_clusters  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_SCRIPT = os.path.join(REPO, "tests", "_job_rank_main.py")
N = 96  # divisible by 2 x 6 and 3 x 4: no padding, and the global batch is 12 in both jobs
BATCH = 6  # per rank in the 2-rank jobs (3 x 4 = 2 x 6 in the 3-rank job)
SEED = 5
DELAY_S = 0.01  # per sample: a batch takes ~60 ms, so every worker has batches in flight while the ranks step
K = 2  # steps the 2-rank job had taken when its state was saved
PHASE_TIMEOUT_S = 240  # a phase takes 10-40 s here; sized for a loaded 2-core machine
# RAYDL_JOB_LEASE_S for the torchrun phase. The crashed rank is dead, so its hold on the pool lasts this long after
# its last renewal, and the restarted ranks must rejoin within it: they do in 5-20 s here ("restart_rejoin_s"), loaded
# or not. A live rank never loses its hold to a late renewal (its Ray job is alive: NOTE [ raydl job pool ]).
RESTART_LEASE_S = 45.0
JOB_END_TIMEOUT_S = RESTART_LEASE_S + 90.0  # that lease plus the coordinator's check, with room for a loaded machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict) -> dict:
    # no RAY_* of this driver (the ranks join by address), except the suite's worker niceness
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k == "RAY_worker_niceness"}
    env.update(
        {
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
            **extra,
        }
    )
    return env


def _wait(procs: list, logs: list, timeout_s: float) -> dict:
    """Wait for every process (bounded: the late ones are killed); their exit codes and, on failure, output tails."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the session this driver started for it (torchrun: with its ranks)
            p.wait(timeout=30)
            codes.append("timeout")
    result: dict = {"codes": codes}
    if any(c != 0 for c in codes):
        result["tails"] = []
        for path in logs:
            with open(path, errors="replace") as f:
                result["tails"].append(f.read()[-3000:])
    return result


def _launch_ranks(world: int, cfg: dict, tmp: str, tag: str) -> dict:
    """`world` rank processes, given their rank as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    port = _free_port()
    procs, logs = [], []
    for rank in range(world):
        log = os.path.join(tmp, f"{tag}-{rank}.log")
        logs.append(log)
        env = _env(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests._job_rank_main", json.dumps(cfg)],
                    cwd=REPO,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return _wait(procs, logs, PHASE_TIMEOUT_S)


def _records(path_template: str, world: int) -> list:
    out = []
    for rank in range(world):
        path = path_template.replace("{rank}", str(rank))
        with open(path) as f:
            out.append([json.loads(line) for line in f if line.strip()])
    return out


def _batches(records: list, epoch: int, attempt=None) -> list:
    return [
        r
        for r in records
        if r["kind"] == "batch" and r["epoch"] == epoch and (attempt is None or r["attempt"] == attempt)
    ]


def _reference(world: int, epoch: int) -> list:
    """Each rank's batches (indices, draws) of an uninterrupted private run, in this process (ray_seed='sample')."""
    out = []
    for rank in range(world):
        dataset = Traced(N)
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
        sampler.set_epoch(epoch)
        loader = raydl.DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=0, ray_seed="sample")
        out.append([[b["i"].tolist(), b["draw"].tolist()] for b in loader])
    return out


def _pairs(batches: list) -> list:
    return [[b["idx"], b["draw"]] for b in batches]


def _wait_job_ended(job: str, timeout_s: float) -> dict:
    """Until the job's coordinator and every raydl worker of the cluster are gone (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        coord = coordinator_id(job)
        workers = alive_actors().get("Worker", 0)
        if (coord is None and workers == 0) or time.monotonic() > deadline:
            return {"coordinator": coord, "workers": workers}
        time.sleep(0.5)


def _phase_share(address: str, tmp: str, names: dict, facts: dict) -> None:
    job = "jc-share"
    out = os.path.join(tmp, "share-{rank}.jsonl")
    cfg = {
        "address": address,
        "out": out,
        "n": N,
        "batch": BATCH,
        "seed": SEED,
        "num_workers": 2,
        "job": job,
        "delay_s": DELAY_S,
        "epochs": [0, 1],
        "count_at": {"epoch": 0, "step": 1},
        "kill_at": {"epoch": 1, "step": 0},
        "save_at": {"epoch": 0, "step": K - 1, "path": os.path.join(tmp, "state-{rank}.pt")},
    }
    t0 = time.monotonic()
    run = _launch_ranks(2, cfg, tmp, "share")
    facts["share_s"] = round(time.monotonic() - t0, 1)
    facts["share_run"] = run
    if run["codes"] != [0, 0]:
        return
    ranks = _records(out, 2)
    epoch0 = [_batches(r, 0) for r in ranks]
    facts["share_steps"] = [len(b) for b in epoch0]
    pids = [sorted({p for b in batches for p in b["pid"]}) for batches in epoch0]
    facts["share_pids_by_rank"] = pids
    facts["share_pids"] = sorted(set(pids[0]) | set(pids[1]))
    facts["share_pids_serving_both"] = len(set(pids[0]) & set(pids[1]))
    facts["share_worker_nodes"] = sorted({names.get(n, n) for b in epoch0[0] + epoch0[1] for n in b["node"]})
    starts = [next(r for r in recs if r["kind"] == "start") for recs in ranks]
    facts["share_rank_pids"] = [s["pid"] for s in starts]
    facts["share_rank_nodes"] = [names.get(s["node"], s["node"]) for s in starts]
    pools = [next(r for r in recs if r["kind"] == "pool" and r["epoch"] == 0) for recs in ranks]
    facts["share_pool_by_rank"] = [sorted(p for p, _ in pool["workers"]) for pool in pools]
    facts["share_pool_nodes"] = sorted(names.get(n, n) for _, n in pools[0]["workers"])
    facts["share_coordinators"] = [pool["coordinator"] for pool in pools]
    count = next(r for r in ranks[0] if r["kind"] == "count")
    facts["share_alive_actors_mid_epoch"] = count["actors"]
    indices = [i for batches in epoch0 for b in batches for i in b["idx"]]
    facts["share_samples_sorted_is_range"] = sorted(indices) == list(range(N))
    facts["share_samples_count"] = len(indices)
    reference0 = _reference(2, 0)
    facts["share_same_as_private"] = [_pairs(epoch0[r]) == reference0[r] for r in range(2)]
    facts["share_pool_ended"] = _wait_job_ended(job, 30)
    # what phase "resume" compares with: the uninterrupted run's content, and its global batches
    facts["_content"] = {i: d for batches in epoch0 for b in batches for i, d in zip(b["idx"], b["draw"])}
    facts["_global"] = [sorted(epoch0[0][j]["idx"] + epoch0[1][j]["idx"]) for j in range(len(epoch0[0]))]
    facts["_consumed"] = sorted(i for batches in epoch0 for b in batches[:K] for i in b["idx"])
    # phase "kill" (epoch 1): rank 0 SIGKILLed the job's worker 1 after its first batch
    killed = next(r for r in ranks[0] if r["kind"] == "killed")
    facts["kill_step"] = killed["step"]
    epoch1 = [_batches(r, 1) for r in ranks]
    reference1 = _reference(2, 1)
    facts["kill_steps"] = [len(b) for b in epoch1]
    facts["kill_batches_as_uninterrupted"] = [_pairs(epoch1[r]) == reference1[r] for r in range(2)]
    before = sorted(p for p, _ in next(r for r in ranks[0] if r["kind"] == "pool" and r["epoch"] == 1)["workers"])
    after = [
        sorted(p for p, _ in next(r for r in recs if r["kind"] == "pool_after" and r["epoch"] == 1)["workers"])
        for recs in ranks
    ]
    facts["kill_killed_was_a_worker"] = killed["pid"] in before
    facts["kill_pool_after_by_rank"] = after
    facts["kill_new_pids"] = sorted({p for a in after for p in set(a) - set(before)})
    # raydl worker actors the cluster started for the job by the end of epoch 1 (4, and the killed one's replacements)
    end1 = next(r for r in ranks[0] if r["kind"] == "pool_after" and r["epoch"] == 1)
    facts["kill_workers_created"] = end1["created"]
    facts["kill_noticed_by"] = [r for r in range(2) if killed["pid"] not in after[r]]
    # batches dispatched after the kill (beyond each rank's prefetch window of 2 x 2 batches, and the batch the
    # other rank may take meanwhile) never come from it
    window = killed["step"] + 2 * 2 + 2
    facts["kill_victim_batches_after_window"] = sum(killed["pid"] in b["pid"] for bs in epoch1 for b in bs[window:])
    facts["kill_victim_batches_before"] = sum(killed["pid"] in b["pid"] for bs in epoch1 for b in bs[:window])


def _phase_restart(address: str, tmp: str, facts: dict) -> tuple:
    run_id = f"jc-{uuid.uuid4().hex[:8]}"
    job = f"torchrun-{run_id}"
    out = os.path.join(tmp, "restart-{rank}.jsonl")
    crash_step = 3
    cfg = {
        "address": None,
        "out": out,
        "n": N,
        "batch": BATCH,
        "seed": SEED,
        "num_workers": 2,
        "job": None,
        "epochs": [0],
        "checkpoint": os.path.join(tmp, "ckpt-{rank}.pt"),
        "crash_at": {"rank": 1, "step": crash_step},
    }
    log = os.path.join(tmp, "torchrun.log")
    # torchrun's default (static) rendezvous on a free port; --rdzv-id names the run (TORCHELASTIC_RUN_ID)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        f"--rdzv-id={run_id}",
        "--monitor-interval=0.2",
        RANK_SCRIPT,
        json.dumps(cfg),
    ]
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_env({"RAY_ADDRESS": address, "RAYDL_JOB_LEASE_S": str(RESTART_LEASE_S)}),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    run = _wait([proc], [log], PHASE_TIMEOUT_S + 60)
    facts["restart_s"] = round(time.monotonic() - t0, 1)
    facts["restart_run"] = run
    facts["restart_job"] = job
    facts["restart_lease_s"] = RESTART_LEASE_S
    # the restarted ranks left; the crashed one never did, and its lease still holds the pool
    facts["restart_pool_after_ranks_left"] = coordinator_id(job) is not None
    left_t = time.time()
    if run["codes"] != [0]:
        return job, None
    ranks = _records(out, 2)
    crashed = [r for r in ranks[1] if r["kind"] == "crash"]
    crash_t = crashed[0]["time"] if crashed else None
    # how long after the crash the restarted ranks had left: the crashed rank's hold must still be on if that is
    # well within its lease (on a loaded machine the restarted run can outlast it)
    facts["restart_ranks_left_after_crash_s"] = round(left_t - crash_t, 1) if crash_t else None
    facts["restart_crashed"] = len(crashed)
    facts["restart_attempts"] = [sorted({r["attempt"] for r in recs if r["kind"] == "start"}) for recs in ranks]
    facts["restart_job_env"] = sorted({r["job_env"] for recs in ranks for r in recs if r["kind"] == "start"})
    pools = {(r["rank"], r["attempt"]): r for recs in ranks for r in recs if r["kind"] == "pool"}
    facts["restart_pools_seen"] = sorted(f"{rank}/{attempt}" for rank, attempt in pools)
    facts["restart_coordinators"] = sorted({p["coordinator"] for p in pools.values()}, key=str)
    facts["restart_worker_pids"] = {
        f"{rank}/{attempt}": sorted(w for w, _ in p["workers"]) for (rank, attempt), p in pools.items()
    }
    resumed = [next((r["step"] for r in recs if r["kind"] == "resumed"), None) for recs in ranks]
    facts["restart_resumed_at"] = resumed
    rejoined = [p["time"] for (_, attempt), p in pools.items() if attempt == 1 and p.get("time")]
    facts["restart_rejoin_s"] = round(max(rejoined) - crash_t, 1) if rejoined and crash_t else None
    reference0 = _reference(2, 0)
    combined = []
    for r in range(2):
        first = [b for b in _batches(ranks[r], 0, attempt=0) if resumed[r] is None or b["step"] < resumed[r]]
        combined.append(_pairs(first) + _pairs(_batches(ranks[r], 0, attempt=1)))
    facts["restart_batches_as_uninterrupted"] = [combined[r] == reference0[r] for r in range(2)]
    facts["restart_ended"] = [any(r["kind"] == "end" and r["attempt"] == 1 for r in recs) for recs in ranks]
    return job, crash_t


def _phase_resume(address: str, tmp: str, facts: dict) -> None:
    out = os.path.join(tmp, "resume-{rank}.jsonl")
    cfg = {
        "address": address,
        "out": out,
        "n": N,
        "batch": BATCH * 2 // 3,
        "seed": SEED,
        "num_workers": 2,
        "job": "jc-resume",
        "epochs": [0],
        "load": os.path.join(tmp, "state-0.pt"),
    }
    t0 = time.monotonic()
    run = _launch_ranks(3, cfg, tmp, "resume")
    facts["resume_s"] = round(time.monotonic() - t0, 1)
    facts["resume_run"] = run
    if run["codes"] != [0, 0, 0]:
        return
    ranks = _records(out, 3)
    batches = [_batches(r, 0) for r in ranks]
    facts["resume_steps"] = [len(b) for b in batches]
    got = [i for bs in batches for b in bs for i in b["idx"]]
    content = facts["_content"]
    expected = sorted(set(range(N)) - set(facts["_consumed"]))
    facts["resume_consumed_before"] = len(facts["_consumed"])
    facts["resume_rest_once"] = sorted(got) == expected
    facts["resume_rest_count"] = [len(got), len(expected)]
    facts["resume_content_as_uninterrupted"] = all(
        content[i] == d for bs in batches for b in bs for i, d in zip(b["idx"], b["draw"])
    )
    steps = min(len(b) for b in batches)
    resumed_global = [sorted(i for r in range(3) for i in batches[r][j]["idx"]) for j in range(steps)]
    facts["resume_global_batches_as_sets"] = resumed_global == facts["_global"][K : K + steps]
    facts["resume_global_batches"] = [len(resumed_global), len(facts["_global"]) - K]
    pools = [next(r for r in recs if r["kind"] == "pool") for recs in ranks]
    facts["resume_pool_by_rank"] = [sorted(p for p, _ in pool["workers"]) for pool in pools]
    facts["resume_worker_pids"] = sorted({p for bs in batches for b in bs for p in b["pid"]})


def _guarded(phase: str, run, *args):
    """A phase whose facts could not be read reports why (`<phase>_error`) instead of ending the driver."""
    facts = args[-1]
    try:
        return run(*args)
    except Exception:
        facts[f"{phase}_error"] = traceback.format_exc()[-3000:]
        return None


def main() -> None:
    facts: dict = {}
    tmp = tempfile.mkdtemp(prefix="raydl_job_cluster_")
    t_start = time.monotonic()
    patient_clusters()  # node start-up bounds sized for a loaded machine
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    data_nodes = [cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1") for _ in range(2)]
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes(timeout=60)
        address = ray.get_runtime_context().gcs_address
        head = ray.get_runtime_context().get_node_id()
        names = {head: "head", data_nodes[0].node_id: "node1", data_nodes[1].node_id: "node2"}
        facts["nodes"] = len([n for n in ray.nodes() if n["Alive"]])
        facts["cluster_s"] = round(time.monotonic() - t_start, 1)

        _guarded("share", _phase_share, address, tmp, names, facts)
        restart_job, crash_t = _guarded("restart", _phase_restart, address, tmp, facts) or (None, None)
        if "_content" in facts:
            _guarded("resume", _phase_resume, address, tmp, facts)
        # the restart job's crashed rank never left: its lease runs out, then the pool ends (and every worker with it)
        ended = _wait_job_ended(restart_job or "-", JOB_END_TIMEOUT_S)
        facts["restart_pool_ended"] = ended
        if crash_t is not None:
            facts["restart_pool_ended_after_crash_s"] = round(time.time() - crash_t, 1)
        facts["alive_actors_at_end"] = alive_actors()
    finally:
        for key in [k for k in facts if k.startswith("_")]:
            del facts[key]
        facts["total_s"] = round(time.monotonic() - t_start, 1)
        ray.shutdown()
        cluster.shutdown()
        if os.environ.get("RAYDL_KEEP_TMP"):
            facts["tmp"] = tmp
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print("FACTS " + json.dumps(facts))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
