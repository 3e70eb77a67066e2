"""On the namespace cluster (cluster/netns_testbed.py): a head and two worker nodes, each in its own network
namespace with its own address, links capped at 10 Gbit; the driver in the head's namespace. Skipped where network
namespaces cannot be made (not root, no CAP_NET_ADMIN, no `ip`)."""

from __future__ import annotations

import pytest

from tests._netns import namespace_cluster, run_driver

pytestmark = [pytest.mark.netns, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def cluster():
    yield from namespace_cluster(0, workers=2)


@pytest.fixture(scope="module")
def facts(cluster):
    """One driver run in the head's namespace (placement, lanes on the wire, then a node killed): what it saw."""
    facts = run_driver(cluster, "plain", timeout_s=300)
    print("tests/_netns_main.py plain:", facts)  # shown with -s or on a failure: the kill's timings among them
    return facts


def test_driver_and_nodes_on_their_own_addresses(cluster, facts):
    """The driver runs on the head's address, and the three nodes are up at the namespaces' addresses."""
    assert facts["driver_ip"] == cluster.ip(0)
    assert facts["alive"] == 3 and facts["node_ips"] == sorted(cluster.ip(n) for n in cluster.nodes)


def test_workers_placed_on_the_other_nodes_and_batches_are_torchs(cluster, facts):
    """raydl's own placement puts one worker on each worker node's address (never the driver's); the epoch is
    torch's, batch for batch."""
    assert facts["placement_same_as_torch"]
    assert facts["placement_ips"] == [cluster.ip(1), cluster.ip(2)]


def test_tcp_lanes_carry_the_batches_between_namespaces(cluster, facts):
    """Each worker's calls move to a TCP lane to the driver's address, and the batches cross the bridge on those
    lanes: a sniffer in the bridge's namespace finds the marker every sample carries in frames of the lanes' ports
    (no TLS on this cluster: the control of tests/test_netns_tls.py)."""
    wire = facts["wire"]
    assert wire["complete"]
    assert wire["worker_ips"] == [cluster.ip(1), cluster.ip(2)]
    assert len(wire["lanes"]) == 2 and all(kind == "Connection" for _, kind in wire["lanes"].values()), wire["lanes"]
    assert wire["remote_lane_calls"] == wire["lane_calls"] and wire["lane_calls"] > wire["calls"] / 2, wire
    ports = {str(port) for port, _ in wire["lanes"].values()}
    marked = wire["sniffed"]["marker_frames"]
    assert all(marked.get(p, 0) > 0 for p in ports), (ports, wire["sniffed"])


def test_node_killed_mid_epoch_every_batch_once_in_order(cluster, facts):
    """Every process of a worker node killed mid-epoch (its workers on TCP lanes): the epoch completes, every
    batch once and in order, the lost worker replaced on the surviving node."""
    assert facts["kill_lane_calls_before"] >= 2 and facts["killed_pids"] > 0
    assert facts["kill_complete_in_order"], facts
    assert (
        facts["kill_restarts"] == 1
    )  # never placed on the killed node: its raylet refuses (NOTE [ raydl silent node ])
    assert facts["kill_survivor_ips"] == [ip for ip in (cluster.ip(1), cluster.ip(2)) if ip != facts["kill_victim_ip"]]


def test_silent_node_mid_epoch_every_batch_once_no_replacement_there(cluster, facts):
    """The defaults (shuffle=True, no generator): the worker node's link set down mid-epoch (no RST, no FIN). The
    silence is named, both workers of the node are replaced once each (never on the silent node: here on the head,
    the only other node), every sample comes once with the link back before the epoch ends (late replies dropped),
    and the node's mark is lifted once Ray reaches it again."""
    assert facts["silent_workers_ips_before"] == [facts["silent_victim_ip"]]
    assert facts["silent_complete_once"], facts
    assert facts["silent_restarts"] == [1, 1], facts
    assert facts["silent_replacement_ips"] == [cluster.ip(0)], facts
    assert any("went silent" in line for line in facts["silent_said"]), facts["silent_said"]
    assert facts["silent_mark_right"], facts
    # the probe a driver on Ray's calls takes its verdict from (NOTE [ raydl silent node ]): the node's raylet port
    # answers a connection while its link is up, and nothing comes back once it is down
    assert (facts["silent_probe_before"], facts["silent_probe_down"]) == ("answers", "timeout"), facts
