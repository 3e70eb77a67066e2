"""raydl's placement plan (NOTE [ raydl placement ]): the pure rules here; on real multi-node clusters in test_multinode.py."""

from __future__ import annotations

import random

import pytest

import raydl
from raydl.cluster.connect import worker_actor_options
from raydl.cluster.placement import NodeWeight, Placement, apportion, has_placement_hints
from tests import _datasets as D


def _nodes(*weights: float) -> list[NodeWeight]:
    return [NodeWeight(f"n{i}", ("127.0.0.1", 1000 + i, f"n{i}"), w) for i, w in enumerate(weights)]


def test_shares_follow_cpus_and_are_dealt_round_robin():
    """Workers are apportioned in proportion to the nodes' CPUs and dealt to them in turn."""
    assert apportion(_nodes(1, 1), 4) == ["n0", "n1", "n0", "n1"]
    assert apportion(_nodes(1, 2), 3) == ["n0", "n1", "n1"]
    assert apportion(_nodes(4, 2, 2), 4) == ["n0", "n1", "n2", "n0"]
    assert apportion(_nodes(8), 5) == ["n0"] * 5


def test_fewer_workers_than_nodes_go_to_the_biggest_then_in_stable_order():
    """With fewer workers than nodes the largest nodes win; among equals, the stable order decides."""
    assert sorted(apportion(_nodes(1, 4, 2), 2)) == ["n1", "n2"]
    assert apportion(_nodes(2, 2, 2), 2) == ["n0", "n1"]


def test_nodes_without_weight_only_when_all_are_without():
    """A node with no free CPU gets no worker while others have some; all at 0: equal shares."""
    assert apportion(_nodes(0, 3), 3) == ["n1"] * 3
    assert apportion(_nodes(0, 0), 2) == ["n0", "n1"]


def test_plan_is_the_same_whatever_order_ray_lists_the_nodes():
    """Same cluster, same plan: the result does not depend on the order of the node table."""
    nodes = _nodes(1, 2, 1, 3)
    expected = apportion(nodes, 7)
    rng = random.Random(0)
    for _ in range(20):
        rng.shuffle(nodes)
        assert apportion(nodes, 7) == expected
    assert [expected.count(f"n{i}") for i in range(4)] == [1, 2, 1, 3]


class _FixedPlacement(Placement):
    """A Placement over a fixed node list (no Ray)."""

    def __init__(self, nodes):
        super().__init__("driver")
        self._fixed = nodes

    def candidates(self):
        return list(self._fixed)


def test_a_new_worker_goes_to_the_node_furthest_below_its_share():
    """A replacement (or added worker) goes where the pool, at its new size, is short of its share."""
    p = _FixedPlacement(_nodes(1, 1))
    assert p.node_for_new_worker(["n0", "n1", "n0"]) == "n1"
    assert p.node_for_new_worker(["n0", "n1"]) == "n0"
    # The others' node died: they count nowhere, the survivors' shares decide.
    p = _FixedPlacement(_nodes(1, 2))
    assert p.node_for_new_worker(["gone", "n1", "n1"]) == "n0"
    assert p.node_for_new_worker([]) == "n1"


def test_a_jobs_workers_avoid_every_trainer_node_it_heard_of(monkeypatch):
    """A job's pool: candidates leave out each rank's node once known; the trainers' nodes only when none other is alive."""
    import ray

    rows = [
        {
            "NodeID": f"n{i}",
            "Alive": True,
            "NodeManagerAddress": "127.0.0.1",
            "NodeManagerPort": 1000 + i,
            "Resources": {"CPU": 2.0},
        }
        for i in range(4)
    ]
    monkeypatch.setattr(ray, "nodes", lambda: rows)
    monkeypatch.setattr("raydl.cluster.placement._free_cpus_by_node", lambda: None)
    p = Placement("n0")
    assert [n.node_id for n in p.candidates()] == ["n1", "n2", "n3"]
    p.add_trainer_node("n1")
    assert [n.node_id for n in p.candidates()] == ["n2", "n3"]
    assert p.node_for_new_worker(["n2", "n2", "n1"]) == "n3"
    for node in ("n2", "n3"):
        p.add_trainer_node(node)
    assert [n.node_id for n in p.candidates()] == ["n0", "n1", "n2", "n3"]


@pytest.mark.parametrize(
    "args, hinted",
    [
        (None, False),
        ({"num_cpus": 0}, False),
        ({"runtime_env": {"env_vars": {"A": "1"}}, "max_concurrency": 1}, False),
        ({"num_cpus": 0.5}, True),
        ({"resources": {"data": 1}}, True),
        ({"memory": 10**9}, True),
        ({"label_selector": {"zone": "a"}}, True),
        ({"scheduling_strategy": "DEFAULT"}, True),
    ],
)
def test_placement_hints_are_resources_labels_or_a_strategy(args, hinted):
    """raydl places workers itself only when ray_remote_args has no resource beyond num_cpus=0, label or strategy."""
    options = worker_actor_options(args)
    assert has_placement_hints(options) is hinted
    if not hinted:
        assert "scheduling_strategy" not in options
    elif not (args or {}).get("scheduling_strategy"):
        assert options["scheduling_strategy"] == "SPREAD"
    else:
        assert options["scheduling_strategy"] == args["scheduling_strategy"]


@pytest.mark.usefixtures("ray_session", "release_warm_workers_after_module")
def test_one_node_places_every_worker_there_and_reuses_warm_workers_there():
    """On one node every worker goes to it (soft affinity), and a second loader takes the first one's warm workers."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    loader = raydl.DataLoader(D.RangeDataset(8), batch_size=2, num_workers=2, timeout=60)
    it = iter(loader)
    assert [b.flatten().tolist() for b in it] == [[i, i + 1] for i in range(0, 8, 2)]
    assert it._pool.nodes == [node, node]
    first = {r.pid for r in it.worker_records}
    assert {r.node_id for r in it.worker_records} == {node}
    del it
    it = iter(raydl.DataLoader(D.RangeDataset(8), batch_size=2, num_workers=2, timeout=60))
    next(it)
    assert {r.pid for r in it.worker_records} == first, "the warm workers on this node were not reused"
    del it
