"""On a real multi-node Ray cluster on localhost: placement, parity, node loss, clean shutdown."""

from __future__ import annotations

import pytest

from tests._session import background_main, run_main

# its driver runs in the background while the suite's in-process tests run (NOTE [ tests background commands ])
background_main("tests/test_multinode.py::", "tests._multinode_main")


@pytest.fixture(scope="module")
def facts():
    """Runs tests/_multinode_main.py once (its own 3-node cluster, in a subprocess) and returns what it saw."""
    return run_main("tests._multinode_main")


def test_cluster_has_three_nodes(facts):
    """The harness really runs a head and two worker nodes."""
    assert facts["nodes"] == 3


def test_default_placement_spreads_and_matches_torch(facts):
    """By default, workers spread over the nodes other than the driver's and batches are torch's, batch for batch."""
    first = facts["placement_first"]
    assert sorted(first) == ["data0", "data0", "data1", "data1"] and first[0] != first[1] and first[:2] == first[2:]
    assert facts["default_same_as_torch"]


def test_default_placement_holds_run_after_run(facts):
    """The same plan every time, after other loaders came and went, served by the same warm workers on their nodes."""
    assert facts["placement_runs"] == [facts["placement_first"]] * 3
    assert facts["placement_runs_complete"]
    assert facts["placement_warm_reused"]


def test_replaced_worker_goes_back_to_its_share(facts):
    """A killed worker's replacement goes to the node short of its share: the dead worker's own node."""
    replaced = facts["placement_replaced"]
    assert replaced["complete_in_order"]
    assert replaced["restarts"] == [0, 1, 0, 0]
    assert replaced["after"] == replaced["before"] == facts["placement_first"]


def test_default_placement_on_two_nodes_and_in_proportion_to_cpus(facts):
    """2 nodes (driver's + one): all workers on the other one; with a 2-CPU node joined, shares follow CPUs 1:2."""
    assert facts["alive_after_removal"] == 2 and facts["cpus_free_before_two_nodes"]
    assert facts["placement_two_nodes"] == [["survivor"] * 3] * 2
    assert facts["alive_after_join"] == 3 and facts["cpus_free_before_proportional"]
    for nodes in facts["placement_proportional"]:
        assert sorted(nodes) == ["big", "big", "survivor"]
    assert facts["placement_proportional"][0] == facts["placement_proportional"][1]


def test_resources_keep_workers_on_data_nodes(facts):
    """ray_remote_args resources put workers on both data nodes and never on the trainer's node."""
    assert facts["data_nodes_used"] == 2
    assert not facts["on_trainer_node"]


def test_batches_from_other_nodes_are_pulled_ahead(facts):
    """While the caller is busy, finished batches of workers on other nodes already move to the driver's node."""
    assert facts["prefetch_outstanding"] == 4
    assert facts["prefetch_local_before_next"] == facts["prefetch_outstanding"]
    assert facts["prefetch_rest_complete"]


def test_workers_on_other_nodes_take_tcp_lanes_read_ahead_and_match_torch(facts):
    """By default a worker on another node gets its calls over a TCP lane once started; its replies are read while
    the caller is busy (every outstanding lane call's batches in hand after a pause); batches equal torch's."""
    assert facts["lane_same_as_torch"]
    outstanding, on_lanes = facts["lane_outstanding"]
    assert outstanding == 4 and on_lanes >= 2, (facts["lane_outstanding"], facts["lane_batches_before_all_on_lanes"])
    assert facts["lane_read_before_next"] == on_lanes
    lane_calls, calls = facts["lane_calls_of"]
    assert facts["lane_remote_calls"] == lane_calls and lane_calls > calls / 2, facts["lane_calls_of"]


def test_node_removed_mid_epoch_is_recovered(facts):
    """A data node removed mid-epoch, its workers on their TCP lanes: they are replaced on the survivor; all batches
    once, in order."""
    assert facts["lane_calls_before_removal"] >= 4
    assert facts["after_removal_complete_in_order"]
    assert facts["restarts"] >= 1
    assert facts["survivor_node_only"]


def test_no_actor_left_behind(facts):
    """After the loaders are dropped, no actor is alive anywhere in the cluster."""
    assert facts["alive_actors_after"] == 0


def test_streamed_parquet_each_node_fetches_the_row_groups_its_worker_reads(facts):
    """ParquetDataset with one worker on each data node: every row once per epoch, and each node's cache brings in
    the 16 of the 32 row groups its own worker reads (not the epoch's 32); the trainer's node is not fed."""
    run = facts["parquet"]
    assert run["rows_once"] == [True, True]
    assert run["worker_nodes"] == ["data0", "data1"]
    assert run["caches_released"] == 2  # raydl.release_node_caches(): one per data node, none on the trainer's
    first = run["per_node"][0]
    assert sorted(first) == ["data0", "data1"], first
    for node, st in first.items():
        # its worker's 16 (one of which may be asked before the node's counters start); all 32 without the split
        assert 12 <= st["fetches"] + st["adopted"] <= 16, (node, st)
        # asked at most for those: over node slots (the default, one a node: 2 here) a call also takes the units the
        # node's plan uses next without asking for each (NOTE [ raydl read ahead ]), so 8 asks for 16 row groups
        assert 1 <= st["hits"] + st["misses"] <= 16, (node, st)


def test_streamed_parquet_window_shuffle_is_read_once_by_the_cluster(facts):
    """Issues 38 and 58 (NOTE [ raydl node slots ]): `shuffle=True` with a worker on each data node, each node its own
    cache folder of a quarter of the data: every batch is torch's, the cluster fetches each byte from storage about
    once per epoch (not once per node), and the nodes' caches take at most 0.15x of it from each other."""
    run = facts["parquet_once"]
    data = run["data_bytes"]
    for e, epoch in enumerate(run["epochs"]):
        assert epoch["same_as_torch"], e
        assert epoch["worker_nodes"] == ["data0", "data1"], epoch
        per_node = epoch["per_node"]
        assert sorted(per_node) == ["data0", "data1"], per_node
        storage = sum(st["bytes_fetched"] for st in per_node.values())
        assert storage <= 1.15 * data, (e, storage / data, per_node)
        assert all(st["adopted"] == 0 for st in per_node.values()), per_node  # a folder of its own each
        assert sum(st["bytes_from_peers"] for st in per_node.values()) <= 0.15 * data, per_node
    assert (
        run["epochs"][0]["per_node"]
        and sum(st["bytes_fetched"] for st in run["epochs"][0]["per_node"].values()) >= 0.9 * data
    )  # an empty cluster's first epoch reads the data (what each row group left in it is re-read)


def test_streamed_parquet_owner_node_lost_mid_epoch(facts):
    """A third data node, dealt a third of the node slots, removed mid-epoch: its slots are dealt to the survivors, its
    workers' batches made again there, their caches fetch its units from storage: the epoch is torch's."""
    run = facts["parquet_once"]
    lost = run["lost"]
    assert lost["same_as_torch"]
    assert run["alive_after"] == 3
    survivors = {n: st for n, st in lost["per_node"].items() if n in ("data0", "data1")}
    assert len(survivors) == 2, lost["per_node"]
    assert sum(st["bytes_fetched"] for st in survivors.values()) > 0


def test_arrow_files_missing_on_the_workers_nodes_come_through_the_object_store(facts):
    """tests/_arrow_multinode.py on this cluster: files absent where the workers run (the data nodes, the folder
    renamed after the driver mapped it): an HF dataset and a mapped ArrowDataset still give torch's batches, their
    tables reaching the workers through the object store."""
    f = facts["arrow_files_missing"]
    assert f["nodes"] == 3 and f["ipc_mapped"]
    for name in ("hf", "ipc"):
        assert f[f"{name}_same_as_torch"], f
        assert f[f"{name}_worker_nodes"] == [True] and not f[f"{name}_driver_node_used"], f
        assert f[f"{name}_places"] == ["plasma"], f


def test_a_node_that_joins_takes_a_worker_of_a_running_loader(facts):
    """NOTE [ raydl rebalance ]: a loader's two workers on the one data node left; a 2-CPU node joins mid-epoch: within
    the rebalance interval a worker moves there (a new one starts on it, one on the crowded node retires), and every
    batch comes once, in order."""
    run = facts["rebalance"]
    assert run["before"] == ["survivor", "survivor"], run
    assert run["moves"] >= 1 and "big" in run["after"] and len(run["after"]) == 2, run
    assert run["in_order"], run
