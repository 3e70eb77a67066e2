"""Run in a subprocess by tests/test_multinode.py: a real 3-node Ray cluster on loopback.

Nodes: a head with resource "trainer" (where the driver runs) and two worker nodes with
resource "data", all raylets on 127.0.0.1 (ray.cluster_utils). Prints one JSON line of facts
for the test to check. Two other modules' multi-node checks run here too (step 1f: torch's worker count
warning for tests/test_worker_warning.py; tests/_arrow_multinode.py, files missing on the workers' nodes), read
from the same run: a cluster of their own each cost ~45 core-s on this 2-core machine.
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
from tests._arrow_multinode import files_missing_facts  # noqa: E402
from tests._session import patient_clusters  # noqa: E402


def _default_run(num_workers: int, name) -> dict:
    """One epoch of a loader with no placement hint: where each worker ran (node names), pids, completeness."""
    loader = raydl.DataLoader(D.RangeDataset(4 * num_workers), batch_size=2, num_workers=num_workers, timeout=60)
    it = iter(loader)
    out = [b.flatten().tolist() for b in it]
    run = {
        "nodes": [name(r.node_id) for r in it.worker_records],
        "pids": [r.pid for r in it.worker_records],
        "complete": out == [[i, i + 1] for i in range(0, 4 * num_workers, 2)],
    }
    del it, loader
    return run


def _wait_cpus_free(timeout_s: float = 60) -> bool:
    """Until the actors of loaders that reserved CPUs are gone: the plan follows free CPUs (NOTE [ raydl placement ])."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", -1):
            return True
        time.sleep(0.2)
    return False


def _wait_alive(n: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    alive = -1
    while time.monotonic() < deadline:
        alive = len([n_ for n_ in ray.nodes() if n_["Alive"]])
        if alive == n:
            break
        time.sleep(0.5)
    return alive


def _parquet_run(name) -> dict:
    """Two epochs of `shuffle=True` over 32 row groups (a window of one, batches of one row group), 2 workers."""
    import tempfile

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tempfile.mkdtemp(prefix="raydl-mn-parquet-")
    for f in range(8):
        ids = np.arange(f * 256, (f + 1) * 256)
        pq.write_table(pa.table({"id": ids}), os.path.join(root, f"part-{f}.parquet"), row_group_size=64)
    ds = raydl.ParquetDataset(root, cache_dir=os.path.join(root, "cache"), cache_limit="1MB", shuffle_window=1)
    loader = raydl.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, persistent_workers=True, timeout=60)
    out: dict = {"rows_once": [], "per_node": []}
    for _ in range(2):
        it = iter(loader)
        ids = [i for batch in it for i in batch["id"].tolist()]
        out["rows_once"].append(sorted(ids) == list(range(len(ds))))
        per_node = loader.stats().cache["per_node"]
        out["per_node"].append({name(n): st for n, st in per_node.items()})
        out["worker_nodes"] = sorted(name(r.node_id) for r in it.worker_records)
        del it
    loader.shutdown()
    out["caches_released"] = raydl.release_node_caches()  # detached: they would outlive the loader by 15 min
    return out


ONCE_ROWS, ONCE_BATCH, ONCE_SEED = 150, 64, 11  # 32 row groups of 150 rows, ~40 KB each (incompressible payload)


def _once_corpus() -> str:
    import tempfile

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tempfile.mkdtemp(prefix="raydl-mn-once-")
    rng = np.random.default_rng(3)
    for f in range(8):
        ids = np.arange(f * 4 * ONCE_ROWS, (f + 1) * 4 * ONCE_ROWS)
        table = pa.table({"id": ids, "payload": [rng.bytes(256) for _ in ids]})
        pq.write_table(table, os.path.join(root, f"part-{f}.parquet"), row_group_size=ONCE_ROWS)
    return root


def _once_expected(root: str, limit: int, epochs: int, nodes: int) -> list:
    """torch's DataLoader over the same folder with the same generator, the order of a loader over `nodes` nodes (one
    slot a node, NOTE [ raydl node slots ]): each epoch's batches (ids, payload bytes)."""
    local = raydl.ParquetDataset(root, cache_dir=os.path.join(root, "reference-cache"), cache_limit=limit)
    g = torch.Generator().manual_seed(ONCE_SEED)
    ref = torch.utils.data.DataLoader(
        local,
        batch_size=ONCE_BATCH,
        sampler=raydl.ParquetShuffleSampler(local, g, ONCE_BATCH, node_slots=nodes),
        generator=g,
    )
    out = [[(b["id"].tolist(), list(b["payload"])) for b in ref] for _ in range(epochs)]
    raydl.release_node_caches()  # the head's cache of the reference
    return out


def _once_epoch(loader, name, expected, remove=None) -> dict:
    """One epoch: whether it is torch's, and what each node's cache took from storage and from its peers; `remove`
    (called after 6 batches) takes a node away mid-epoch."""
    it = iter(loader)
    got = []
    for b in it:
        got.append((b["id"].tolist(), list(b["payload"])))
        if remove is not None and len(got) == 6:
            remove()
    per_node = loader.stats().cache["per_node"]
    keys = ("bytes_fetched", "bytes_from_peers", "bytes_served", "peer_fallbacks", "adopted")
    run = {
        "same_as_torch": got == expected,
        "per_node": {name(n): {k: st[k] for k in keys} for n, st in per_node.items()},
        "worker_nodes": sorted(name(r.node_id) for r in it.worker_records),
    }
    del it
    return run


def _parquet_once_runs(cluster, name, names) -> dict:
    """Issue 38 item 3 (NOTE [ raydl cooperative caches ]): the window shuffle (a batch spreads over its window) with
    a worker on each data node, each node its own cache folder (`{node_id}`), a quarter of the data each: two epochs;
    then a third data node joins and is removed mid-epoch (it owned a third of the units)."""
    import shutil

    root = _once_corpus()
    out: dict = {}
    try:
        data = int(raydl.ParquetDataset(root).nbytes)
        limit = data // 4
        out["data_bytes"] = data
        expected = _once_expected(root, limit, 2, nodes=2)
        ds = raydl.ParquetDataset(root, cache_dir=os.path.join(root, "cache-{node_id}"), cache_limit=limit)

        def loader(workers: int):
            return raydl.DataLoader(
                ds,
                batch_size=ONCE_BATCH,
                shuffle=True,
                num_workers=workers,
                generator=torch.Generator().manual_seed(ONCE_SEED),
                persistent_workers=False,  # each epoch draws its base seed as torch's reference does
                timeout=60,
            )

        two = loader(2)
        out["epochs"] = [_once_epoch(two, name, expected[e]) for e in range(2)]
        del two
        raydl.release_node_caches()
        extra = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        names[extra.node_id] = "extra"
        _wait_alive(4)
        _wait_cpus_free()
        three = loader(3)  # three nodes: three slots, a third of them on the node removed
        lost_expected = _once_expected(root, limit, 1, nodes=3)[0]
        out["lost"] = _once_epoch(three, name, lost_expected, remove=lambda: cluster.remove_node(extra))
        del three
        out["alive_after"] = _wait_alive(3)
        out["caches_released"] = raydl.release_node_caches()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _worker_warning_facts() -> dict:
    """torch's "This DataLoader will create N worker processes" warning (N one more than this machine's cores): not
    given by default, where workers can go to other nodes; given (twice, as torch does) pinned to the driver's node."""
    import warnings

    n = torch._utils.cpu_count() + 1

    def messages(**kwargs) -> list:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = raydl.DataLoader(D.RangeDataset(4), batch_size=2, num_workers=n, timeout=60, **kwargs)
            first = next(iter(loader)).flatten().tolist()
            loader.shutdown()
        assert first == [0, 1], first
        return [str(w.message) for w in caught if str(w.message).startswith("This DataLoader will create")]

    here = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False
    )
    return {
        "nodes": _wait_alive(3),
        "default": messages(),
        "pinned": messages(ray_remote_args={"scheduling_strategy": here}),
    }


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
    data_nodes = [cluster.add_node(num_cpus=1, resources={"data": 4}, node_ip_address="127.0.0.1") for _ in range(2)]
    try:
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        head_id = ray.get_runtime_context().get_node_id()
        facts["nodes"] = len([n for n in ray.nodes() if n["Alive"]])
        names = {head_id: "head", data_nodes[0].node_id: "data0", data_nodes[1].node_id: "data1"}
        name = lambda node_id: names.get(node_id, node_id)  # noqa: E731

        # 1. Default placement spreads over nodes, and batches equal torch's.
        gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
        kwargs = dict(batch_size=3, shuffle=True)
        expected = [b.tolist() for b in torch.utils.data.DataLoader(D.RangeDataset(30), generator=gen(), **kwargs)]
        loader = raydl.DataLoader(D.RangeDataset(30), num_workers=4, generator=gen(), timeout=60, **kwargs)
        it = iter(loader)
        got = [b.tolist() for b in it]
        facts["default_same_as_torch"] = got == expected
        facts["default_nodes"] = len({r.node_id for r in it.worker_records})
        # NOTE [ raydl placement ]: 3 equal nodes, the driver's excluded: 2 workers on each data node.
        facts["placement_first"] = [name(r.node_id) for r in it.worker_records]
        del it, loader

        # 1b. Batches made on other nodes move to the driver's node while the caller is busy
        # (NOTE [ raydl ordering ]): after a pause, every finished batch is already local. Ray's calls here
        # (ray_lane=False); the lanes' own reader threads are checked after.
        loader = raydl.DataLoader(
            D.ImageDataset(48),
            batch_size=8,
            num_workers=2,
            timeout=60,
            ray_remote_args={"num_cpus": 0.25, "resources": {"data": 1}},
            ray_lane=False,
            ray_batches_per_call=1,  # every task sent at once (a grouped worker may hold one back, NOTE [ raydl calls ])
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

        # 1b'. The default: workers on other nodes take TCP lanes once started (NOTE [ raydl lane, driver ]); their
        # replies are read as they arrive, so after a pause every finished batch is already in the driver's memory.
        expected = [b["ids"].tolist() for b in torch.utils.data.DataLoader(D.ImageDataset(160), batch_size=8)]
        loader = raydl.DataLoader(
            D.ImageDataset(160),
            batch_size=8,
            num_workers=2,
            timeout=60,
            ray_remote_args={"resources": {"data": 1}},
            ray_batches_per_call=1,  # every task sent at once: a grouped worker may hold one back (NOTE [ raydl calls ])
        )
        it = iter(loader)

        def lane_tasks(it) -> tuple[list, list]:
            tasks = list(it._sched.task_info.values())
            # a task not sent yet (its worker's call waits for a second cheap batch: NOTE [ raydl calls ]) has no call
            return tasks, [t.call for t in tasks if t.call is not None and type(t.call.ref).__name__ == "LaneTicket"]

        got = [next(it)["ids"].tolist() for _ in range(4)]  # the lanes open meanwhile
        # A worker's lane opens when it connects back (asked through Ray, behind its calls: NOTE [ raydl lane,
        # driver ]); on a loaded machine one may open some batches later, and the calls sent before it went through
        # Ray (stop 50's CI: 1 of 4 on a lane after 4 batches). The read-ahead is checked once every outstanding call
        # went on a lane: a bounded number of batches, 8 left to read after.
        while len(got) < 12:
            tasks, on_lanes = lane_tasks(it)
            if len(on_lanes) == len(tasks):
                break
            got.append(next(it)["ids"].tolist())
        facts["lane_batches_before_all_on_lanes"] = len(got)
        time.sleep(2.0)
        tasks, on_lanes = lane_tasks(it)
        facts["lane_outstanding"] = [len(tasks), len(on_lanes)]
        facts["lane_read_before_next"] = sum(c.received or c.ref.reply is not None for c in on_lanes)
        got += [b["ids"].tolist() for b in it]
        facts["lane_same_as_torch"] = got == expected
        facts["lane_remote_calls"] = it._calls._lanes.remote_calls_sent
        facts["lane_calls_of"] = [it._calls.lane_calls, it._sched.calls_sent]
        del it, loader

        # 1c. Run after run, after other loaders (hinted ones above, default ones here) came and went:
        # the same plan, served by the same warm workers; a replaced worker goes back to its node.
        runs = [_default_run(4, name) for _ in range(3)]
        facts["placement_runs"] = [r["nodes"] for r in runs]
        facts["placement_runs_complete"] = all(r["complete"] for r in runs)
        facts["placement_warm_reused"] = [sorted(zip(r["nodes"], r["pids"])) for r in runs[1:]] == [
            sorted(zip(runs[0]["nodes"], runs[0]["pids"]))
        ] * 2
        loader = raydl.DataLoader(
            D.SlowDataset(24, {i: 0.05 for i in range(24)}), batch_size=2, num_workers=4, timeout=60
        )
        it = iter(loader)
        out = [next(it).flatten().tolist()]
        before = [name(r.node_id) for r in it.worker_records]
        ray.kill(it._pool.actors[1], no_restart=True)
        out += [b.flatten().tolist() for b in it]
        facts["placement_replaced"] = {
            "complete_in_order": out == [[i, i + 1] for i in range(0, 24, 2)],
            "restarts": list(it._pool.restarts),
            "before": before,
            "after": [name(r.node_id) for r in it.worker_records],
        }
        del it, loader

        # 1d. A streamed Parquet dataset (NOTE [ raydl node cache ]) with its workers on both data nodes: each
        # node's cache brings in only the row groups its own worker reads (a batch is one row group here).
        facts["parquet"] = _parquet_run(name)
        # 1e. The window shuffle across the data nodes: each row group fetched from storage by one node per epoch.
        facts["parquet_once"] = _parquet_once_runs(cluster, name, names)
        _wait_cpus_free()

        # 1f. Scenarios of other modules on this cluster (a cluster of their own each cost ~45 core-s here):
        # tests/test_worker_warning.py's, and tests/_arrow_multinode.py's (files missing where the workers run).
        facts["worker_warning"] = _worker_warning_facts()
        facts["arrow_files_missing"] = files_missing_facts(
            {"num_cpus": 0, "resources": {"data": 1}}, {n.node_id for n in data_nodes}, head_id
        )
        facts["arrow_files_missing"]["nodes"] = len([n for n in ray.nodes() if n["Alive"]])

        # 2. "data" nodes only, never the trainer's node; then a data node is removed mid-epoch.
        loader = raydl.DataLoader(
            D.SlowDataset(80, {i: 0.05 for i in range(80)}),
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
        # the workers' calls move to their TCP lanes (on a busy machine a lane can open after a dozen batches)
        while it._calls.lane_calls < 4 and it._rcvd_idx < 24:
            out.append(next(it).flatten().tolist())
        facts["lane_calls_before_removal"] = it._calls.lane_calls
        victim = next(n for n in data_nodes if n.node_id == it.worker_records[1].node_id)
        t0 = time.monotonic()
        cluster.remove_node(victim)
        out += [b.flatten().tolist() for b in it]
        facts["recovery_s"] = round(time.monotonic() - t0, 1)
        facts["after_removal_complete_in_order"] = out == [[i, i + 1] for i in range(0, 80, 2)]
        facts["restarts"] = sum(it._pool.restarts)
        facts["survivor_node_only"] = {r.node_id for r in it.worker_records} == {
            data_nodes[0].node_id if victim is data_nodes[1] else data_nodes[1].node_id
        }
        del it, loader

        # 2b. Default placement on what is now a 2-node cluster (the driver's node and the survivor):
        # every worker on the survivor. Then a 2-CPU node joins: shares follow the CPUs (1:2).
        names[victim.node_id] = "removed"
        names[(data_nodes[1] if victim is data_nodes[0] else data_nodes[0]).node_id] = "survivor"
        facts["alive_after_removal"] = _wait_alive(2)
        facts["cpus_free_before_two_nodes"] = _wait_cpus_free()
        facts["placement_two_nodes"] = [_default_run(3, name)["nodes"] for _ in range(2)]
        # 2c. NOTE [ raydl rebalance ]: a loader whose workers are all on the survivor when a node joins moves one there
        moving = raydl.DataLoader(
            D.SlowDataset(4000, {i: 0.01 for i in range(4000)}),
            batch_size=2,
            num_workers=2,
            timeout=60,
            ray_seed="batch",
        )
        mit = iter(moving)
        got = [next(mit).flatten().tolist()]
        before = sorted(name(mit._pool.node_of(w)) for w in mit._sched.active)
        big = cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        names[big.node_id] = "big"
        deadline = time.monotonic() + 90
        while mit._elastic.moves == 0 and time.monotonic() < deadline:
            got.append(next(mit).flatten().tolist())
        got += [next(mit).flatten().tolist() for _ in range(4)]  # batches go on after the move
        facts["rebalance"] = {
            "before": before,
            "after": sorted(name(mit._pool.node_of(w)) for w in mit._sched.active),
            "moves": mit._elastic.moves,
            "in_order": got == [[i, i + 1] for i in range(0, 2 * len(got), 2)],
        }
        del mit, moving
        facts["alive_after_join"] = _wait_alive(3)
        facts["cpus_free_before_proportional"] = _wait_cpus_free()
        facts["placement_proportional"] = [_default_run(3, name)["nodes"] for _ in range(2)]

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
