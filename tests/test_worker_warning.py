"""torch's worker-count warning: same text as torch when every worker runs on this host, silent otherwise.

pyproject's filterwarnings ignores "This DataLoader will create" for the suite (the parity harness
uses more workers than this machine's cores); `recwarn` records warnings whatever the filters say,
which `test_suite_filter_does_not_hide_the_warning_from_recwarn` checks.
"""

from __future__ import annotations

import warnings

import torch

import raydl
from raydl.cluster.locality import confined_nodes
from tests import _datasets as D
from tests._session import background_main, run_main

TOO_MANY = torch._utils.cpu_count() + 1  # torch's own count, so the test follows this machine
PREFIX = "This DataLoader will create"


def _messages(records) -> list[str]:
    return [str(w.message) for w in records if str(w.message).startswith(PREFIX)]


def _construct_and_iterate(cls, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = cls(D.RangeDataset(4), batch_size=2, num_workers=TOO_MANY, timeout=60, **kwargs)
        it = iter(loader)
        first = next(it)
        del it
    assert first.flatten().tolist() == [0, 1]
    return _messages(caught)


def test_same_warnings_as_torch_on_a_single_node_ray(ray_session):
    """More workers than CPUs on a one-node Ray: raydl warns at construction and at iter(), torch's text and numbers."""
    expected = _construct_and_iterate(torch.utils.data.DataLoader)
    got = _construct_and_iterate(raydl.DataLoader, ray_remote_args={"num_cpus": 0})
    assert len(expected) == 2, expected
    assert f"create {TOO_MANY} worker processes" in expected[0]
    assert got == expected


def test_no_warning_within_the_cpu_count(ray_session, recwarn):
    """As many workers as CPUs: no warning, as with torch."""
    loader = raydl.DataLoader(D.RangeDataset(4), batch_size=2, num_workers=torch._utils.cpu_count(), timeout=60)
    assert next(iter(loader)).flatten().tolist() == [0, 1]
    assert _messages(recwarn.list) == []


def test_suite_filter_does_not_hide_the_warning_from_recwarn(ray_session, recwarn):
    """The suite-wide ignore filter is active here, yet recwarn still sees the warning (so the tests above can fail)."""
    assert any(f[0] == "ignore" and f[1] is not None and f[1].match(PREFIX) for f in warnings.filters)
    raydl.DataLoader(D.RangeDataset(4), num_workers=TOO_MANY)
    assert len(_messages(recwarn.list)) == 1


def test_construction_before_ray_warns_only_for_a_local_start(monkeypatch, recwarn):
    """Ray not connected: no address means a local Ray on this host (warn); an address may lead anywhere (silent)."""
    import raydl.cluster.locality as locality

    monkeypatch.setattr(locality, "_ray_connected", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    raydl.DataLoader(D.RangeDataset(4), num_workers=TOO_MANY, ray_address="ray://127.0.0.1:1")
    assert _messages(recwarn.list) == []
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    raydl.DataLoader(D.RangeDataset(4), num_workers=TOO_MANY)
    assert _messages(recwarn.list) == []
    monkeypatch.delenv("RAY_ADDRESS")
    raydl.DataLoader(D.RangeDataset(4), num_workers=TOO_MANY)
    assert len(_messages(recwarn.list)) == 1


def _node(node_id: str, alive=True, labels=None, **resources) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 1.0, **resources}, "Labels": labels or {}}


def test_candidate_nodes_follow_resources_labels_and_affinity():
    """Which alive nodes could host a worker: resources, label_selector and node affinity narrow them."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    head, data1 = "a1" * 28, "b2" * 28
    nodes = [
        _node(head, labels={"role": "trainer"}, GPU=1.0),
        _node(data1, labels={"role": "data"}, data=4.0),
        _node("c3" * 28, alive=False, data=4.0),
    ]
    assert confined_nodes(nodes, {"num_cpus": 0}) == {head, data1}
    assert confined_nodes(nodes, {"num_gpus": 1}) == {head}
    assert confined_nodes(nodes, {"resources": {"data": 1}}) == {data1}
    assert confined_nodes(nodes, {"label_selector": {"role": "trainer"}}) == {head}
    assert confined_nodes(nodes, {"label_selector": {"role": "!trainer"}}) == {data1}
    assert confined_nodes(nodes, {"label_selector": {"role": "in(data,trainer)"}}) == {head, data1}
    pinned = NodeAffinitySchedulingStrategy(node_id=head, soft=True)
    assert confined_nodes(nodes, {"scheduling_strategy": pinned}) == {head}
    pg = PlacementGroupSchedulingStrategy(placement_group=None)
    assert confined_nodes(nodes, {"scheduling_strategy": pg}) is None


# its scenario runs on tests/_multinode_main.py's three-node cluster, in the background while the in-process tests run
# (NOTE [ tests background commands ] in tests/_session.py)
background_main(
    "tests/test_worker_warning.py::test_silent_when_workers_can_go_to_another_node", "tests._multinode_main"
)


def test_silent_when_workers_can_go_to_another_node():
    """On a 3-node loopback cluster: no warning by default; pinned to the driver's node, torch's warning (twice)."""
    facts = run_main("tests._multinode_main")["worker_warning"]
    assert facts["nodes"] == 3
    assert facts["default"] == []
    assert len(facts["pinned"]) == 2 and f"create {torch._utils.cpu_count() + 1} worker" in facts["pinned"][0]
