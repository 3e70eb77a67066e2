"""A node leaves mid-epoch and no node has room for its worker's replacement (NOTE [ raydl elastic pool ])."""

from __future__ import annotations

from tests._session import background_main, run_main

# its driver runs in the background while the suite's in-process tests run (NOTE [ tests background commands ])
background_main("tests/test_elastic_cluster.py::", "tests._elastic_cluster_main")


def test_node_removed_with_no_room_the_survivors_finish_the_epoch_bit_identical():
    """Loopback 3-node cluster: its data node removed mid-epoch, the survivors finish; every batch once, in order, identical to undisturbed (ray_seed="batch")."""
    facts = run_main("tests._elastic_cluster_main")
    assert facts["placement_as_planned"], facts
    assert facts["batches"] == [24, 24], facts
    assert facts["in_order"] and facts["identical"] is True, facts
    assert facts["warning_names_worker_and_node"], facts
    assert len(facts["survivors"]) == 2 and facts["lost"] not in facts["survivors"] and facts["survivors_on_b"], facts
