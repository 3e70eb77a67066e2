#!/usr/bin/env python3
"""Batches made on other Ray nodes: per-batch latency and bandwidth through Ray's object transfer.

    python -m benchmarks.bench_multinode            # full run (about 3-5 minutes with cluster start-up)
    python -m benchmarks.bench_multinode --quick    # smoke run (about 1-2 minutes)

A local multi-node cluster (cluster/local_launcher.sh: a head node with the driver and 2 worker
nodes with resource "data", every node its own raylet and object store, all on 127.0.0.1; own
directory and ports: RAYDL_CLUSTER_DIR=/tmp/raydl-bench-mn, port 6690, dashboard 8690). For batch
sizes from 64 KB to 64 MB, the same raydl loader runs with its workers
  * remote: on the worker nodes (ray_remote_args={"resources": {"data": 1}}), raydl's default:
    once started, each worker's batches come over its TCP lane (NOTE [ raydl lane ]), read by a
    thread of the driver as they arrive;
  * remote-ray: the same with ray_lane=False: every batch is copied from the worker node's object
    store to the head's by Ray's object manager;
  * local: on the driver's node (NodeAffinitySchedulingStrategy): the batch only goes through
    the local object store;
and, for reference, torch's DataLoader (forked workers, shared memory). A batch is 16 samples of
size/16 bytes that each worker holds already (no per-sample work), collated by torch's
default_collate, so the numbers are the collate copy (the same for every loader) plus the
transport: for raydl the worker's put into its node's object store, the transfer and the
driver's get (the tensor is made over the object store's memory, no copy); for torch, passing
a shared-memory handle.

Latency: 1 worker, prefetch_factor=1, so each next() waits for exactly one round trip (the task
is sent when the previous batch is handed out); p50/p95 over an epoch, after a warm-up epoch.
Bandwidth: 2 workers, prefetch_factor=2 (torch's defaults), MB/s over the second epoch.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import sys
import time

import torch
import torch.utils.data
from torch.utils.data import Dataset

import raydl
from benchmarks.common.clusters import LocalCluster, connect_driver, disconnect_and_stop, wait_for_nodes
from benchmarks.common.machine import LoadMonitor, QuietGate, describe_machine, machine_info
from benchmarks.common.results import Results, log, md_table, median, percentile

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


SAMPLES_PER_BATCH = 16


class BlobDataset(Dataset):
    """Samples of nbytes/16 uint8 each, one cached tensor per worker (no per-sample work): a batch of 16
    is what torch's default_collate makes of them (one copy, into shared memory inside a worker)."""

    def __init__(self, batch_bytes: int, n_batches: int) -> None:
        self.nbytes, self.n = batch_bytes // SAMPLES_PER_BATCH, n_batches * SAMPLES_PER_BATCH
        self._sample = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._sample is None:
            self._sample = torch.full((self.nbytes,), 7, dtype=torch.uint8)
        return self._sample

    def __getstate__(self):
        return {"nbytes": self.nbytes, "n": self.n, "_sample": None}


WHERE = ("remote", "remote-ray", "local", "torch")


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=None, help="alternating repetitions (default 2; quick 1)")
    p.add_argument(
        "--quiet-wait-s",
        type=float,
        default=None,
        help="wait up to this long for a quiet second before each measurement (default 5; quick 0)",
    )
    p.add_argument("--cluster-dir", default="/tmp/raydl-bench-mn")
    p.add_argument("--port", type=int, default=6690)
    p.add_argument("--dashboard-port", type=int, default=8690)
    p.add_argument("--object-store-bytes", type=int, default=1_000_000_000, help="per node")
    args = p.parse_args()
    reps = args.reps or (1 if args.quick else 2)
    budget = (128 << 20) if args.quick else (768 << 20)  # bytes per epoch and size
    start = time.perf_counter()

    info = machine_info(ray_version=importlib.metadata.version("ray"))
    res = Results("bench_multinode", args.quick)
    res.write({"section": "machine", **info, "argv": sys.argv[1:]})
    log(describe_machine(info))

    cluster = LocalCluster(
        args.cluster_dir,
        args.port,
        args.dashboard_port,
        env={"RAYDL_CLUSTER_OBJECT_STORE_BYTES": str(args.object_store_bytes)},
    )
    results: dict = {}
    placement_seen: dict = {}
    try:
        t0 = time.perf_counter()
        cluster.start(2)
        connect_driver(cluster.address)
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        wait_for_nodes(3)
        cluster_start_s = time.perf_counter() - t0
        driver_node = ray.get_runtime_context().get_node_id()
        log(f"cluster up in {cluster_start_s:.1f} s; driver on node {driver_node[:8]}")
        remote_args = {
            "remote": {"resources": {"data": 1}},
            "remote-ray": {"resources": {"data": 1}},
            "local": {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=driver_node, soft=False)},
        }

        def make(where: str, ds: Dataset, workers: int, prefetch: int):
            kw = dict(
                batch_size=SAMPLES_PER_BATCH, num_workers=workers, prefetch_factor=prefetch, persistent_workers=True
            )
            if where == "torch":
                return torch.utils.data.DataLoader(ds, **kw)
            return raydl.DataLoader(ds, **kw, ray_remote_args=remote_args[where], ray_lane=where != "remote-ray")

        def latency(where: str, size: int, n: int) -> dict:
            loader = make(where, BlobDataset(size, n), 1, 1)
            for _ in loader:  # warm-up epoch: start-up, first transfers
                pass
            lat = []
            it = iter(loader)
            while True:
                t = time.perf_counter()
                try:
                    b = next(it)
                except StopIteration:
                    break
                lat.append(time.perf_counter() - t)
                assert b.numel() == size, (b.shape, size)
                del b
            del it
            nodes = sorted({r.node_id[:8] for r in loader.worker_records}) if where != "torch" else ["driver's host"]
            if hasattr(loader, "shutdown"):
                loader.shutdown()
            return {
                "p50_ms": percentile(lat, 50) * 1e3,
                "p95_ms": percentile(lat, 95) * 1e3,
                "mean_ms": sum(lat) / len(lat) * 1e3,
                "batches": len(lat),
                "worker_nodes": nodes,
            }

        def bandwidth(where: str, size: int, n: int) -> dict:
            loader = make(where, BlobDataset(size, n), 2, 2)
            for _ in loader:
                pass
            t, cpu = time.perf_counter(), time.process_time()
            total = batches = 0
            for b in loader:
                total += b.numel()
                batches += 1
                del b
            dt = time.perf_counter() - t
            cpu_ms = (time.process_time() - cpu) / batches * 1e3
            nodes = sorted({r.node_id[:8] for r in loader.worker_records}) if where != "torch" else ["driver's host"]
            if hasattr(loader, "shutdown"):
                loader.shutdown()
            return {
                "mb_per_s": total / dt / 1e6,
                "bytes": total,
                "seconds": dt,
                "driver_cpu_ms_per_batch": cpu_ms,
                "worker_nodes": nodes,
            }

        gate = QuietGate(
            args.quiet_wait_s if args.quiet_wait_s is not None else (0 if args.quick else 5), 90, cluster.pids
        )
        for size in SIZES:
            n_lat = max(16, min(200, budget // 4 // size))
            n_bw = max(16, min(400, budget // size))
            for rep in range(reps):
                order = (
                    ("remote", "remote-ray", "local", "torch")
                    if rep % 2 == 0
                    else ("local", "remote-ray", "remote", "torch")
                )
                for where in order:
                    gc.collect()
                    gate.wait()
                    with LoadMonitor(extra_roots=cluster.pids) as mon:
                        lat = latency(where, size, n_lat)
                        bw = bandwidth(where, size, n_bw)
                    rec = {
                        "section": "multinode",
                        "where": where,
                        "batch_bytes": size,
                        "rep": rep,
                        **{f"lat_{k}": v for k, v in lat.items()},
                        **{f"bw_{k}": v for k, v in bw.items()},
                        "foreign_cores": round(mon.foreign_cores, 3),
                        "our_cores": round(mon.ours_cores, 3),
                    }
                    res.write(rec)
                    results.setdefault((size, where), []).append(rec)
                    placement_seen.setdefault(where, set()).update(lat["worker_nodes"] + bw["worker_nodes"])
                    log(
                        f"{human(size):>6s} {where:10s} rep {rep}: p50 {lat['p50_ms']:8.2f} ms  p95 {lat['p95_ms']:8.2f} ms  "
                        f"{bw['mb_per_s']:8.0f} MB/s  driver CPU {bw['driver_cpu_ms_per_batch']:7.2f} ms/batch  "
                        f"(workers on {bw['worker_nodes']}; foreign load {mon.foreign_cores:.2f})"
                    )
    finally:
        disconnect_and_stop(cluster)

    rows = []
    for size in SIZES:
        get = lambda where, key: median([r[key] for r in results[(size, where)]])  # noqa: E731
        rows.append(
            [
                human(size),
                f"{get('remote', 'lat_p50_ms'):.2f} / {get('remote', 'lat_p95_ms'):.2f}",
                f"{get('remote-ray', 'lat_p50_ms'):.2f} / {get('remote-ray', 'lat_p95_ms'):.2f}",
                f"{get('local', 'lat_p50_ms'):.2f} / {get('local', 'lat_p95_ms'):.2f}",
                f"{get('torch', 'lat_p50_ms'):.2f} / {get('torch', 'lat_p95_ms'):.2f}",
                f"{get('remote', 'bw_mb_per_s'):,.0f}",
                f"{get('remote-ray', 'bw_mb_per_s'):,.0f}",
                f"{get('local', 'bw_mb_per_s'):,.0f}",
                f"{get('torch', 'bw_mb_per_s'):,.0f}",
                f"{get('remote', 'bw_mb_per_s') / get('local', 'bw_mb_per_s'):.2f}×",
                f"{get('remote', 'bw_driver_cpu_ms_per_batch'):.2f} / {get('remote-ray', 'bw_driver_cpu_ms_per_batch'):.2f}",
                f"{median([r['foreign_cores'] for w in WHERE for r in results[(size, w)]]):.2f}",
            ]
        )
    lines = [
        f"## raydl multi-node transfer benchmark ({'quick' if args.quick else 'full'} run)",
        "",
        describe_machine(info),
        "",
        'Local cluster: head (driver, {"trainer": 1}, 1 CPU) + 2 worker nodes ({"data": 4}, 2 CPUs each), every '
        f"node its own raylet and object store ({args.object_store_bytes / 1e9:g} GB), all on 127.0.0.1 of this one "
        "machine: 'remote' batches cross a TCP lane, 'remote-ray' ones Ray's object manager, both over loopback, not a "
        "real network. Driver CPU: this process's CPU time (its threads included, the head raylet's not) per batch "
        "in the bandwidth epoch. A batch = 16 "
        "cached samples collated by default_collate (one copy; no sample work). Latency: 1 worker, prefetch_factor=1, time of each next() "
        "(p50 / p95, ms). Bandwidth: 2 workers, prefetch_factor=2, MB/s (10^6 B/s) over an epoch after a warm-up "
        f"epoch. Median of {reps} alternating repetitions; before each, the run waited up to {gate.max_wait_s:g} s for a "
        f"quiet second (waited {gate.waited_s:.0f} s in all; {gate.gave_up} times the machine stayed busy). Worker nodes seen: "
        + ", ".join(f"{w}: {sorted(v)}" for w, v in placement_seen.items())
        + f" (driver node {driver_node[:8]}).",
        "",
    ]
    lines.append(
        md_table(
            [
                "batch",
                "remote p50/p95 ms",
                "remote-ray p50/p95 ms",
                "local p50/p95 ms",
                "torch p50/p95 ms",
                "remote MB/s",
                "remote-ray MB/s",
                "local MB/s",
                "torch MB/s",
                "remote / local",
                "driver CPU ms/batch, remote / remote-ray",
                "foreign load (cores)",
            ],
            rows,
        )
    )
    res.finish_cluster_report(lines, cluster_start_s, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
