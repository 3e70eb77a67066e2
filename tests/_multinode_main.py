"""Run in a subprocess by tests/test_multinode.py: a real 3-node Ray cluster on loopback.

Nodes: a head with resource "trainer" (where the driver runs) and two worker nodes with
resource "data", all raylets on 127.0.0.1 (ray.cluster_utils). Prints one JSON line of facts
for the test to check.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback only

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import raydl  # noqa: E402
from tests import _datasets as D  # noqa: E402


def main() -> None:
    facts: dict = {}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "resources": {"trainer": 1}, "include_dashboard": False},
    )
    data_nodes = [cluster.add_node(num_cpus=1, resources={"data": 4}, node_ip_address="127.0.0.1") for _ in range(2)]
    try:
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        head_id = ray.get_runtime_context().get_node_id()
        facts["nodes"] = len([n for n in ray.nodes() if n["Alive"]])

        # 1. Default placement spreads over nodes, and batches equal torch's.
        gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
        kwargs = dict(batch_size=3, shuffle=True)
        expected = [b.tolist() for b in torch.utils.data.DataLoader(D.RangeDataset(30), generator=gen(), **kwargs)]
        loader = raydl.DataLoader(D.RangeDataset(30), num_workers=4, generator=gen(), timeout=60, **kwargs)
        it = iter(loader)
        got = [b.tolist() for b in it]
        facts["default_same_as_torch"] = got == expected
        facts["default_nodes"] = len({r.node_id for r in it.worker_records})

        # 1b. Batches made on other nodes move to the driver's node while the caller is busy
        # (NOTE [ raydl ordering ]): after a pause, every finished batch is already local.
        loader = raydl.DataLoader(
            D.ImageDataset(48), batch_size=8, num_workers=2, timeout=60,
            ray_remote_args={"num_cpus": 0.25, "resources": {"data": 1}},
        )  # ~0.3 MB per batch: in the object store, not inlined
        it = iter(loader)
        next(it)
        time.sleep(2.0)  # a "training step": the remaining batches finish meanwhile
        refs = [t.ref for t in it._sched.task_info.values()]
        ray.wait(refs, num_returns=len(refs), timeout=30, fetch_local=False)
        time.sleep(0.5)
        locations = ray.experimental.get_object_locations(refs)
        facts["prefetch_outstanding"] = len(refs)
        facts["prefetch_local_before_next"] = sum(head_id in loc["node_ids"] for loc in locations.values())
        facts["prefetch_rest_complete"] = 1 + len(list(it)) == 6
        del it, loader

        # 2. "data" nodes only, never the trainer's node; then a data node is removed mid-epoch.
        loader = raydl.DataLoader(
            D.SlowDataset(40, {i: 0.05 for i in range(40)}),
            batch_size=2,
            num_workers=4,
            timeout=60,
            ray_remote_args={"num_cpus": 0.25, "resources": {"data": 1}},
        )
        it = iter(loader)
        out = [next(it).flatten().tolist()]
        placed = {r.node_id for r in it.worker_records}
        facts["data_nodes_used"] = len(placed)
        facts["on_trainer_node"] = head_id in placed
        victim = next(n for n in data_nodes if n.node_id == it.worker_records[1].node_id)
        t0 = time.monotonic()
        cluster.remove_node(victim)
        out += [b.flatten().tolist() for b in it]
        facts["recovery_s"] = round(time.monotonic() - t0, 1)
        facts["after_removal_complete_in_order"] = out == [[i, i + 1] for i in range(0, 40, 2)]
        facts["restarts"] = sum(it._pool.restarts)
        facts["survivor_node_only"] = {r.node_id for r in it.worker_records} == {data_nodes[0].node_id if victim is data_nodes[1] else data_nodes[1].node_id}
        del it, loader

        # 3. Clean shutdown: no raydl worker actor left alive on any node once the idle warm
        # workers are released (the dashboard is off here: count through the GCS instead).
        facts["warm_released"] = raydl.release_idle_workers()
        deadline = time.monotonic() + 30
        alive = None
        while time.monotonic() < deadline:
            alive = sum(1 for a in ray._private.state.actors().values() if a["State"] == "ALIVE")
            if alive == 0:
                break
            time.sleep(0.5)
        facts["alive_actors_after"] = alive
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("FACTS " + json.dumps(facts))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
