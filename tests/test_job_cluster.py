"""A DDP job's ranks as real processes (torch.distributed, gloo) sharing one raydl pool on a 3-node loopback cluster.

tests/_job_cluster_main.py runs once, in a fresh interpreter with a cluster of its own (a head and
two nodes), and reports what the ranks saw (tests/_job_rank_main.py logs every batch: indices, a
torch draw made in `__getitem__`, the pid and node of the worker that made it). Its phases:
2 ranks, one epoch uninterrupted, then one with a worker SIGKILLed; 2 ranks under torchrun whose
rank 1 crashes mid-epoch and is restarted; rank 0's state after K steps resumed by a 3-rank job.
"""

from __future__ import annotations

import pytest

from tests._session import background_main, run_main

# The driver runs 4 phases of real rank processes on a 3-node cluster: ~2 min here when quiet; sized for a loaded machine.
pytestmark = pytest.mark.timeout(1200)
# its driver runs in the background while the suite's in-process tests run (NOTE [ tests background commands ])
background_main("tests/test_job_cluster.py::", "tests._job_cluster_main", timeout_s=1100)

N = 96  # the driver's dataset: 2 ranks x 8 batches of 6, or 3 ranks x 8 batches of 4
K = 2  # steps taken when the state was saved


@pytest.fixture(scope="module")
def facts():
    """Runs tests/_job_cluster_main.py once and returns what it saw."""
    return run_main("tests._job_cluster_main", timeout_s=1100)


def _ran(facts, phase: str, ranks: int) -> None:
    run = facts.get(f"{phase}_run")
    assert run is not None and run["codes"] == [0] * ranks, run
    assert f"{phase}_error" not in facts, facts[f"{phase}_error"]


def test_cluster_has_three_nodes(facts):
    assert facts["nodes"] == 3


def test_one_pool_in_the_cluster_serves_both_ranks(facts):
    """Both ranks get the same 2 x 2 workers from one coordinator: one pool in the cluster, not one per rank, and
    workers that make batches of both ranks (never the ranks' own processes)."""
    _ran(facts, "share", 2)
    pools = facts["share_pool_by_rank"]
    assert pools[0] == pools[1] and len(pools[0]) == 4
    coordinators = facts["share_coordinators"]
    assert coordinators[0] is not None and coordinators[0] == coordinators[1]
    alive = facts["share_alive_actors_mid_epoch"]
    assert alive.get("Worker") == 4 and sum(alive.values()) == 5, alive  # 4 workers and the job's coordinator
    assert len(facts["share_pids"]) <= 4 and set(facts["share_pids"]) <= set(pools[0])
    assert facts["share_pids_serving_both"] >= 1, facts["share_pids_by_rank"]
    assert not set(facts["share_rank_pids"]) & set(facts["share_pids"])


def test_workers_run_on_the_nodes_beside_the_ranks(facts):
    """The ranks run on the head; the job's workers are planned from the first rank's node: 2 on each other node."""
    _ran(facts, "share", 2)
    assert facts["share_rank_nodes"] == ["head", "head"]
    assert facts["share_pool_nodes"] == ["node1", "node1", "node2", "node2"]
    assert facts["share_worker_nodes"] == ["node1", "node2"]


def test_every_sample_once_across_ranks(facts):
    """DistributedSampler's shards (no padding: N divisible by 2 x 6), each sample once across the ranks, and each
    rank's batches as a private in-process loader makes them (ray_seed='sample')."""
    _ran(facts, "share", 2)
    assert facts["share_steps"] == [N // 2 // 6] * 2
    assert facts["share_samples_count"] == N and facts["share_samples_sorted_is_range"]
    assert facts["share_same_as_private"] == [True, True]


def test_the_pool_ends_when_its_ranks_leave(facts):
    """Both ranks shut their loaders down: the coordinator and every worker of the job end."""
    _ran(facts, "share", 2)
    assert facts["share_pool_ended"] == {"coordinator": None, "workers": 0}


def test_a_killed_worker_costs_no_rank_a_batch(facts):
    """A worker of the job's pool SIGKILLed by rank 0 mid-epoch: every rank still gets its batches once, in order, with
    the uninterrupted run's content; the worker is replaced, and no batch sent after the death comes from it."""
    _ran(facts, "share", 2)
    assert facts["kill_killed_was_a_worker"]
    assert facts["kill_steps"] == [N // 2 // 6] * 2
    assert facts["kill_batches_as_uninterrupted"] == [True, True]
    assert facts["kill_noticed_by"], facts["kill_pool_after_by_rank"]
    assert len(facts["kill_new_pids"]) == 1 and facts["kill_workers_created"] == 5, "replaced once for the job"
    assert facts["kill_victim_batches_after_window"] == 0


def test_a_two_rank_state_resumes_in_a_three_rank_job(facts):
    """Rank 0's state after K steps of the 2-rank job (2 x 6) loaded by each rank of a 3-rank job (3 x 4, one pool of
    3 x 2 workers): the samples not consumed, each once, each with the uninterrupted run's content, and the global
    batches of 12 the uninterrupted run's as sets."""
    _ran(facts, "share", 2)
    _ran(facts, "resume", 3)
    assert facts["resume_consumed_before"] == K * 2 * 6
    assert facts["resume_rest_count"] == [N - K * 12] * 2 and facts["resume_rest_once"]
    assert facts["resume_content_as_uninterrupted"]
    assert facts["resume_steps"] == [(N - K * 12) // 12] * 3
    assert facts["resume_global_batches"] == [(N - K * 12) // 12] * 2 and facts["resume_global_batches_as_sets"]
    pools = facts["resume_pool_by_rank"]
    assert pools[0] == pools[1] == pools[2] and len(pools[0]) == 6
    assert set(facts["resume_worker_pids"]) <= set(pools[0])


def test_a_rank_restarted_by_torchrun_rejoins_the_pool(facts):
    """torchrun (--max-restarts=1, ray_job=True: the job named after TORCHELASTIC_RUN_ID): rank 1 dies mid-epoch
    without leaving the pool, torchrun restarts the ranks, and they find the same coordinator and workers (the pool
    outlived the ranks); resumed from their last states, each rank's batches are the uninterrupted run's, once."""
    _ran(facts, "restart", 1)
    assert facts["restart_crashed"] == 1
    assert facts["restart_attempts"] == [[0, 1], [0, 1]]
    assert facts["restart_job"] == f"torchrun-{facts['restart_job_env'][0]}" and len(facts["restart_job_env"]) == 1
    assert facts["restart_pools_seen"] == ["0/0", "0/1", "1/0", "1/1"]
    assert len(facts["restart_coordinators"]) == 1 and facts["restart_coordinators"][0] is not None
    pids = facts["restart_worker_pids"]
    assert len(pids["0/0"]) == 4 and pids["0/0"] == pids["1/0"] == pids["0/1"] == pids["1/1"], pids
    assert facts["restart_batches_as_uninterrupted"] == [True, True]
    assert facts["restart_ended"] == [True, True]


def test_the_restarted_job_pool_ends_once_the_crashed_rank_lease_runs_out(facts):
    """The crashed rank never left: its lease held the pool after the restarted ranks left (checked when they left
    well within it: on a loaded machine their run can outlast it), and once it ran out (the lease after the crash,
    RAYDL_JOB_LEASE_S=45 here, give or take a renewal) the pool ended. No actor is left in the cluster."""
    _ran(facts, "restart", 1)
    # The hold lasts one lease from the crashed rank's last renewal, which a loaded machine can delay by many
    # seconds (two spinners: the pool was gone 43 s after the crash once): checked when the ranks left within half.
    if facts["restart_ranks_left_after_crash_s"] < facts["restart_lease_s"] / 2:
        assert facts["restart_pool_after_ranks_left"], "the pool ended while the crashed rank's lease still held it"
    assert facts["restart_pool_ended_after_crash_s"] >= facts["restart_lease_s"] / 2
    assert facts["restart_pool_ended"] == {"coordinator": None, "workers": 0}
    assert facts["alive_actors_at_end"] == {}
