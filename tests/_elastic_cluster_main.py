"""Run in a subprocess by tests/test_elastic_cluster.py: a node leaves mid-epoch and no other node has room.

Nodes (ray.cluster_utils, all raylets on 127.0.0.1): a head with resource "trainer" (the driver's),
data node A with {"data": 1} and data node B with {"data": 2}. Three workers asking for
{"data": 1} fill both data nodes (one on A, two on B). The same epoch runs twice with
ray_seed="batch": undisturbed, then with node A removed after a few batches, when its worker's
replacement can go nowhere. Prints one JSON line of facts for the test to check.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback only

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import raydl  # noqa: E402
from tests import _elastic_helpers as E  # noqa: E402
from tests._parity import assert_batches_equal  # noqa: E402
from tests._session import patient_clusters  # noqa: E402

# Cold starts on a loaded 2-core CI machine can take tens of seconds: the loaders start with a
# generous ray_startup_timeout_s, and the disturbed iterator's bound is lowered once its workers
# run, so the replacement that cannot be placed is given up on in REPLACEMENT_TIMEOUT_S.
STARTUP_TIMEOUT_S = 120
REPLACEMENT_TIMEOUT_S = 6


def _loader() -> raydl.DataLoader:
    return raydl.DataLoader(
        E.SlowRandomDataset(48, delay_s=0.02),
        batch_size=2,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        num_workers=3,
        timeout=120,
        ray_seed="batch",
        ray_startup_timeout_s=STARTUP_TIMEOUT_S,
        ray_remote_args={"num_cpus": 0, "resources": {"data": 1}},
    )


def main() -> None:
    facts: dict = {}
    patient_clusters()  # node start-up bounds sized for a loaded machine
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "node_ip_address": "127.0.0.1",
            "resources": {"trainer": 1},
            "include_dashboard": False,
        },
    )
    node_a = cluster.add_node(num_cpus=1, resources={"data": 1}, node_ip_address="127.0.0.1")
    node_b = cluster.add_node(num_cpus=1, resources={"data": 2}, node_ip_address="127.0.0.1")
    try:
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        expected = list(_loader())

        it = iter(_loader())
        got = [next(it) for _ in range(3)]
        it._recovery.startup_timeout_s = it._elastic._startup_timeout_s = REPLACEMENT_TIMEOUT_S
        placement = {r.worker_id: r.node_id for r in it.worker_records}
        facts["placement_as_planned"] = sorted(placement.values()).count(node_b.node_id) == 2
        lost = next(w for w, n in placement.items() if n == node_a.node_id)
        t0 = time.monotonic()
        cluster.remove_node(node_a)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got += list(it)
        facts["rest_of_epoch_s"] = round(time.monotonic() - t0, 1)
        facts["batches"] = [len(expected), len(got)]
        facts["in_order"] = [b["i"].tolist() for b in got] == [b["i"].tolist() for b in expected]
        try:
            for k, (a, e) in enumerate(zip(got, expected)):
                assert_batches_equal(a, e, f"batch {k}")
            facts["identical"] = True
        except AssertionError as e:
            facts["identical"] = str(e)
        messages = [str(w.message) for w in caught]
        facts["warning_names_worker_and_node"] = any(
            f"raydl worker {lost} " in m and node_a.node_id[:8] in m and "could not be replaced" in m for m in messages
        )
        facts["survivors"] = sorted(it._sched.active)
        facts["survivors_on_b"] = {r.node_id for r in it.worker_records} == {node_b.node_id}
        facts["lost"] = lost
        del it
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("FACTS " + json.dumps(facts))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
