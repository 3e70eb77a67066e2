"""On a namespace cluster started with Ray's TLS (cluster/netns_testbed.py --tls: a CA and node certificates naming
each node's IP): the TCP lanes between namespaces are TLS, and no sample's bytes cross the wire in the clear
(issue 37). tests/test_netns.py is the control: the same sniffer finds the marker on a cluster without TLS."""

from __future__ import annotations

import pytest

from tests._netns import namespace_cluster, run_driver

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster():
    yield from namespace_cluster(1, workers=1, tls=True)


def test_lanes_are_tls_and_no_batch_crosses_in_the_clear(cluster):
    """The worker node's calls go over a TLS lane to the driver's address; a sniffer on the bridge sees the lane's
    bytes (at least the batches' size) but never the marker every sample carries."""
    facts = run_driver(cluster, "tls", timeout_s=200)
    assert facts["driver_ip"] == cluster.ip(0) and facts["alive"] == 2
    wire = facts["wire"]
    assert wire["complete"] and wire["worker_ips"] == [cluster.ip(1)] * 2
    assert len(wire["lanes"]) == 2 and all(kind == "TlsConnection" for _, kind in wire["lanes"].values()), wire
    assert wire["lane_calls"] > wire["calls"] / 2, wire
    sniffed = wire["sniffed"]
    lane_bytes = sum(sniffed["tcp_bytes"].get(str(port), 0) for port, _ in wire["lanes"].values())
    assert lane_bytes >= wire["lane_calls"] * 4 * 64 * 1024, (lane_bytes, wire)  # the sniffer saw the batches go by
    assert sniffed["marker_frames"] == {}, sniffed
