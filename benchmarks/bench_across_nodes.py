"""Bytes a streamed ParquetDataset (or TarDataset) fetches from S3 per epoch, per node and for the cluster, at 1-4 data nodes.

Issue 38 item 3. Each data node is a node of the namespace cluster (cluster/netns_testbed.py, `private=True`): its
own network namespace and address, its own tmpfs at the cache's folder. S3 is moto's server behind a proxy that counts
the GET bytes it relays to each client address (tests/_s3.py), in the head's namespace, where the driver runs (no
worker there). The data: `--files` Parquet files of `--groups` row groups of `--rows` rows with a `--payload`-byte
incompressible column; `cache_limit` a quarter of the data on each node; `shuffle=True` (the order over the dataset's
node slots, NOTE [ raydl node slots ]), batch 64, one worker per data node, `--epochs` epochs. Each cluster size runs
these, each in cache folders of its own:
  * node slots (the default since issue 58; one slot a node since issue 64): each batch made on the node its slot
    is dealt to;
  * `node_slots=1`, the default before: the window shuffle by torch's round robin (other batches: its own reference),
    cooperative caches (issue 38, NOTE [ raydl cooperative caches ]): each unit fetched by one owner node, the others
    take it from the owner's cache;
  * with `--alone`, also `node_slots=1` with each node's cache alone (`RAYDL_CACHE_PEERS=0`);
  * with `--unordered`, also node slots with `in_order=False` (its batches compared with torch's as a set).
Prints, per cluster size, mode and epoch: S3 bytes / data for the cluster and for each node, bytes taken from peers
(the caches' count), the bytes the bridge carried from a data node to another (its ports' counters:
`NetnsCluster.count_links`), fallbacks to storage, whether the batches are torch's (its DataLoader over the same
files, the dataset's sampler, same generator), and samples/s (a 2-core machine: the rate is the CPUs', not
storage's). Needs root (network namespaces).

    .venv/bin/python -m benchmarks.bench_across_nodes [--nodes 1,2,3,4]
    .venv/bin/python -m benchmarks.bench_across_nodes --format tar   # the same corpus as WebDataset tar shards
    .venv/bin/python -m benchmarks.bench_across_nodes --nodes 3 --ddp 2   # two DDP ranks over three data nodes
    .venv/bin/python -m benchmarks.bench_across_nodes --nodes 3 --ddp 2 --deals ranks,job   # ranks as processes

`--deals ranks,job`: the ranks are W processes as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT; a gloo
process group; an all_reduce a batch as DDP's step), each `sampler=ParquetDistributedSampler(ds)` with no
`node_slots` (the slot count agreed through the group: rank 0's node count), private pools (`ranks`) or one pool
for the job (`job`: `ray_job`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

from benchmarks.common.clusters import run_in_netns_head
from benchmarks.common.results import md_table, printed_report

BATCH, SEED = 64, 11
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_tar_corpus(folder: str, files: int, groups: int, rows: int, payload: int) -> None:
    """The same corpus as WebDataset tar shards (`--format tar`): `files` shards of `groups * rows` samples, each
    key NNNNNNNN with fields `id` and `bin` (`payload` incompressible bytes)."""
    import io
    import tarfile

    import numpy as np

    rng = np.random.default_rng(3)
    for f in range(files):
        with tarfile.open(os.path.join(folder, f"part-{f:03d}.tar"), "w") as tar:
            for i in range(f * groups * rows, (f + 1) * groups * rows):
                for ext, data in (("id", str(i).encode()), ("bin", rng.bytes(payload))):
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def tar_row(sample: dict) -> dict:
    """A tar sample as the Parquet corpus's row: {"id", "payload"} (what `_batches` reads)."""
    return {"id": int(sample["id"]), "payload": sample["bin"]}


def _dataset(args, source, **kw):
    import raydl

    if args.format == "tar":
        return raydl.TarDataset(source, transform=tar_row, **kw)
    return raydl.ParquetDataset(source, **kw)


def _s3_dataset(args, proxy, head: str, cache_dir: str, limit: int, **kw):
    """The corpus in S3 through the counting proxy, cached in `cache_dir` on each node."""
    from tests._s3 import s3fs

    fs = s3fs(proxy.port, attempts=3, host=head)
    return _dataset(args, "s3://corpus/data/", filesystem=fs, cache_dir=cache_dir, cache_limit=limit, **kw)


def _driver(args) -> dict:
    """In the head's namespace: S3 and its proxy there, both modes' epochs; the figures."""
    import shutil
    import tempfile

    import ray
    import torch

    import raydl
    from tests._netns_cache_main import _batches, _write_corpus
    from tests._netns_driver import state_cluster, wait_alive
    from tests._s3 import FaultProxy, MotoServer, upload_folder

    ray.init()
    cluster = state_cluster()
    head = cluster.ip(0)
    out: dict = {"alive": wait_alive(len(cluster.nodes)), "modes": {}}
    ip_of = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    corpus = tempfile.mkdtemp(prefix="raydl-bench-across-")
    moto = proxy = None
    try:
        write = write_tar_corpus if args.format == "tar" else _write_corpus
        write(corpus, args.files, args.groups, args.rows, args.payload)
        moto = MotoServer(host=head)
        fs = moto.filesystem()
        fs.create_dir("corpus")
        upload_folder(corpus, fs, "corpus/data")
        proxy = FaultProxy(moto.port, host=head, upstream_host=head)
        data = int(_dataset(args, corpus, cache_dir=os.path.join(corpus, "cache")).nbytes)
        limit = data // 4
        out["data_bytes"] = data
        local = _dataset(args, corpus, cache_dir=os.path.join(corpus, "cache"), cache_limit=limit)
        data_nodes = [n for n in cluster.nodes if n != 0]
        g = torch.Generator().manual_seed(SEED)
        # the default: one slot a node, the order of a loader over the data nodes (issue 64)
        sampler = raydl.ParquetShuffleSampler(local, g, BATCH, node_slots=len(data_nodes))
        reference = torch.utils.data.DataLoader(local, batch_size=BATCH, sampler=sampler, generator=g)
        expected = [_batches(reference) for _ in range(args.epochs)]
        raydl.release_node_caches()
        # node_slots=1: the window shuffle by torch's round robin, the default before issue 58 (its own batches)
        one = _dataset(args, corpus, cache_dir=os.path.join(corpus, "cache"), cache_limit=limit, node_slots=1)
        g = torch.Generator().manual_seed(SEED)
        reference = torch.utils.data.DataLoader(
            one, batch_size=BATCH, sampler=raydl.ParquetShuffleSampler(one, g, BATCH), generator=g
        )
        expected_one = [_batches(reference) for _ in range(args.epochs)]
        # one epoch unmeasured from the local folder: the workers' processes start here, not in the first mode's epoch
        _batches(raydl.DataLoader(one, batch_size=BATCH, num_workers=len(cluster.nodes) - 1, timeout=120))
        raydl.release_node_caches()
        if args.ddp:
            out["ddp"] = _ddp_runs(args, cluster, proxy, head, limit, local, data_nodes, ip_of)
            return out
        # (mode, RAYDL_CACHE_PEERS, in_order, node_slots)
        modes = [("node slots", "1", True, None), ("node_slots=1, cooperative", "1", True, 1)]
        if args.alone:
            modes.append(("node_slots=1, each node alone", "0", True, 1))
        if args.unordered:
            modes.append(("node slots, in_order=False", "1", False, None))
        runs = [(rep, *m) for rep in range(args.reps) for m in modes]  # the modes in turn, rep after rep (paired)
        for rep, mode, peers, in_order, slots in runs:
            os.environ["RAYDL_CACHE_PEERS"] = peers  # read by the driver's plan (CacheFeed)
            folder = mode.replace(" ", "-").replace(",", "").replace("=", "-") + f"-{rep}"
            ds = _s3_dataset(args, proxy, head, os.path.join(cluster.private_dir, folder), limit, node_slots=slots)
            want = expected if slots is None else expected_one
            loader = raydl.DataLoader(
                ds,
                batch_size=BATCH,
                shuffle=True,
                num_workers=len(cluster.nodes) - 1,
                generator=torch.Generator().manual_seed(SEED),
                persistent_workers=False,
                in_order=in_order,
                timeout=120,
                ray_startup_timeout_s=300,
            )
            epochs = []
            for e in range(args.epochs):
                proxy.reset_counts()
                links0 = cluster.link_bytes()
                it = iter(loader)
                t0 = time.perf_counter()
                got = _batches(it)
                dt = time.perf_counter() - t0
                links = cluster.link_bytes()
                cache = loader.stats().cache
                per_node = cache["per_node"]
                epochs.append(
                    {
                        # bytes the bridge carried from a data node to another, as counted there (count_links)
                        "link_bytes_between": sum(
                            links[k] - links0.get(k, 0) for k in links if k[0] in data_nodes and k[1] in data_nodes
                        ),
                        "placement": cache.get("placement", {}).get("mode"),
                        "same_as_torch": got == want[e] if in_order else sorted(got) == sorted(want[e]),
                        "samples_s": round(len(local) / dt),
                        "units_per_batch": _units_per_batch(local, [ids for ids, _ in got]),
                        "s3_bytes": proxy.get_bytes,
                        "s3_bytes_by_ip": dict(proxy.get_bytes_by_client),
                        "nodes": {
                            ip_of.get(n, n): {
                                k: st.get(k, 0)
                                for k in ("bytes_fetched", "bytes_from_peers", "bytes_served", "peer_fallbacks")
                            }
                            for n, st in per_node.items()
                        },
                        "worker_ips": sorted(r.node_ip for r in it.worker_records),
                    }
                )
                del it
            loader.shutdown()
            del loader
            raydl.release_node_caches()
            out["modes"].setdefault(mode, []).append(epochs)
    finally:
        if proxy is not None:
            proxy.stop()
        if moto is not None:
            moto.stop()
        shutil.rmtree(corpus, ignore_errors=True)
        raydl.release_idle_workers()
        ray.shutdown()
    return out


def _units_per_batch(local, batches: list) -> float:
    """Distinct units (row groups, shard runs) a batch draws from, the mean over the full batches."""
    import numpy as np

    full = [b for b in batches if len(b) == BATCH]
    return round(float(np.mean([len(set(local.units_of(b).tolist())) for b in full])), 2) if full else 0.0


def _ddp_runs(args, cluster, proxy, head, limit, local, data_nodes, ip_of) -> dict:
    """`--ddp W`: W ranks in this process, stepping together as DDP does, each its own loader and pool of one worker
    a data node, each `sampler=ParquetDistributedSampler(ds, num_replicas=W, rank=r)`: dealt by batch over one slot a
    data node (the count rank 0's node count gives every rank through torch.distributed; given to the sampler here,
    where the ranks share one process), then by position (`node_slots=1`, the deal before issue 64). Per mode and
    epoch: S3 bytes, bytes between data nodes, every sample once over the ranks, units per batch."""

    import raydl

    n = len(data_nodes)
    known = {
        "batch": ("DDP, dealt by batch over node slots", n),
        "position": ("DDP, dealt by position (before)", 1),
        "ranks": ("DDP, rank processes (gloo), slots agreed, private pools", "ranks"),
        "job": ("DDP, rank processes (gloo), slots agreed, ray_job", "job"),
    }
    modes = [known[d] for d in args.deals.split(",")]
    out: dict = {}
    for rep in range(args.reps):
        for mode, slots in modes:
            if isinstance(slots, str):
                cfg = dict(vars(args), proxy_port=proxy.port, head=head, limit=limit, workers=n, rep=rep, mode=slots)
                cfg["cache_dir"] = os.path.join(cluster.private_dir, f"ddp-{slots}-{rep}")
                out.setdefault(mode, []).append(_rank_processes(cfg, cluster, proxy, local, data_nodes, ip_of))
                raydl.release_node_caches()
                continue
            folder = f"ddp-{slots}-{rep}"
            ds = _s3_dataset(args, proxy, head, os.path.join(cluster.private_dir, folder), limit)
            samplers = [
                raydl.ParquetDistributedSampler(ds, num_replicas=args.ddp, rank=r, seed=SEED, node_slots=slots)
                for r in range(args.ddp)
            ]
            loaders = [
                raydl.DataLoader(
                    ds,
                    batch_size=BATCH,
                    sampler=sm,
                    num_workers=n,
                    timeout=120,
                    ray_startup_timeout_s=300,
                )
                for sm in samplers
            ]
            epochs = []
            for e in range(args.epochs):
                for sm in samplers:
                    sm.set_epoch(e)
                proxy.reset_counts()
                links0 = cluster.link_bytes()
                its = [iter(lo) for lo in loaders]
                t0 = time.perf_counter()
                got: list = [[] for _ in its]
                live = list(range(len(its)))
                while live:
                    for r in list(live):
                        b = next(its[r], None)
                        if b is None:
                            live.remove(r)
                        else:
                            got[r].append(b["id"].tolist())
                dt = time.perf_counter() - t0
                stats = [{"per_node": lo.stats().cache["per_node"]} for lo in loaders]
                placement = loaders[0].stats().cache.get("placement", {}).get("mode")
                epochs.append(
                    _ddp_epoch(
                        got, stats, placement, dt, (links0, cluster.link_bytes()), proxy, local, data_nodes, ip_of
                    )
                )
                del its
            for lo in loaders:
                lo.shutdown()
            del loaders
            raydl.release_node_caches()
            out.setdefault(mode, []).append(epochs)
    return out


def _ddp_epoch(got, ranks, placement, dt, links01, proxy, local, data_nodes, ip_of) -> dict:
    """One DDP epoch's record: `got` each rank's batches of ids, `ranks` each rank's {"per_node": cache stats} (the
    rank's own view of every node's cache: the largest count a node reports is its count), `links01` the links' bytes
    before and after, `proxy` the S3 counts."""
    links0, links = links01
    ids = [i for rank in got for b in rank for i in b]
    per_node: dict = {}
    for rk in ranks:
        for node, st in rk["per_node"].items():
            mine = per_node.setdefault(ip_of.get(node, node), {"bytes_fetched": 0, "bytes_from_peers": 0})
            for k in mine:
                mine[k] = max(mine[k], st.get(k, 0))
    return {
        "link_bytes_between": sum(
            links[k] - links0.get(k, 0) for k in links if k[0] in data_nodes and k[1] in data_nodes
        ),
        "placement": placement,
        "every_sample_once": sorted(set(ids)) == list(range(len(local))) and len(ids) - len(local) < len(got),
        "equal_counts": len({sum(len(b) for b in rank) for rank in got}) == 1,
        "samples_s": round(len(local) / dt),
        "s3_bytes": proxy.get_bytes,
        "s3_bytes_by_ip": dict(proxy.get_bytes_by_client),
        "nodes": per_node,
        "units_per_batch": _units_per_batch(local, [b for rank in got for b in rank]),
    }


def _wait_for(path: str, procs: list, timeout_s: float = 600) -> None:
    """Until `path` exists; a rank that exited or a wait past `timeout_s` fails naming it."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        gone = [p for p in procs if p.poll() not in (None, 0)]
        if gone or time.monotonic() > deadline:
            raise RuntimeError(f"waiting for {os.path.basename(path)}: ranks exited {[p.returncode for p in gone]}")
        time.sleep(0.05)


def _rank_processes(cfg: dict, cluster, proxy, local, data_nodes, ip_of) -> list:
    """`--deals ranks|job`: W rank processes as torchrun starts them (`_rank_main`); between epochs, at the ranks'
    barrier, this driver resets the S3 counts and reads the links' bytes. The same figures as the in-process modes."""
    import socket

    import ray

    work = tempfile.mkdtemp(prefix="raydl-bench-ranks-")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = dict(cfg, work=work)
    env = dict(os.environ, WORLD_SIZE=str(cfg["ddp"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    procs = []
    for r in range(cfg["ddp"]):
        log = open(os.path.join(work, f"rank-{r}.log"), "w")
        cmd = [sys.executable, "-m", "benchmarks.bench_across_nodes", "--rank-main", json.dumps(cfg)]
        rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r), PYTHONPATH=REPO)
        procs.append(subprocess.Popen(cmd, env=rank_env, cwd=REPO, stdout=log, stderr=log))
    epochs = []
    try:
        for e in range(cfg["epochs"]):
            _wait_for(os.path.join(work, f"start-{e}"), procs)
            proxy.reset_counts()
            links0 = cluster.link_bytes()
            t0 = time.perf_counter()
            open(os.path.join(work, f"go-{e}"), "w").close()
            _wait_for(os.path.join(work, f"end-{e}"), procs)
            dt = time.perf_counter() - t0
            links = cluster.link_bytes()
            counts = SimpleNamespace(get_bytes=proxy.get_bytes, get_bytes_by_client=dict(proxy.get_bytes_by_client))
            ranks = []
            for r in range(cfg["ddp"]):
                with open(os.path.join(work, f"rank-{r}-{e}.json")) as f:
                    ranks.append(json.load(f))
            open(os.path.join(work, f"ack-{e}"), "w").close()
            got = [rk["batches"] for rk in ranks]
            rec = _ddp_epoch(got, ranks, ranks[0]["placement"], dt, (links0, links), counts, local, data_nodes, ip_of)
            epochs.append(dict(rec, slots_agreed=[rk["slots"] for rk in ranks]))
        for p in procs:
            p.wait(timeout=120)
    except BaseException:
        for r in range(cfg["ddp"]):
            with open(os.path.join(work, f"rank-{r}.log")) as f:
                print(f"rank {r}:\n{f.read()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return epochs


def _rank_main(cfg: dict) -> None:
    """One DDP rank (`--deals ranks|job`): a gloo group, `ParquetDistributedSampler(ds)` with the slot count agreed
    through it, an all_reduce a batch (DDP's step), each epoch's batches' ids written for the driver."""
    from datetime import timedelta

    import ray
    import torch
    import torch.distributed as dist

    import raydl

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    ray.init(address=os.environ["RAY_ADDRESS"])
    args = SimpleNamespace(**cfg)
    ds = _s3_dataset(args, SimpleNamespace(port=cfg["proxy_port"]), cfg["head"], cfg["cache_dir"], cfg["limit"])
    sampler = raydl.ParquetDistributedSampler(ds, seed=SEED)
    job = f"bench-across-{os.environ['MASTER_PORT']}-{cfg['rep']}" if cfg["mode"] == "job" else None
    loader = raydl.DataLoader(
        ds,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=cfg["workers"],
        timeout=120,
        ray_startup_timeout_s=300,
        ray_job=job,
    )
    work = cfg["work"]

    def wait(name: str) -> None:
        deadline = time.monotonic() + 600
        while not os.path.exists(os.path.join(work, name)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: the driver never wrote {name}")
            time.sleep(0.05)

    for e in range(cfg["epochs"]):
        sampler.set_epoch(e)
        dist.barrier()
        if rank == 0:
            open(os.path.join(work, f"start-{e}"), "w").close()
            wait(f"go-{e}")
        dist.barrier()
        batches = []
        for b in loader:
            batches.append(b["id"].tolist())
            dist.all_reduce(torch.zeros(1))  # DDP's step: the ranks in lockstep
        cache = loader.stats().cache or {}
        doc = {"batches": batches, "slots": sampler.slots, "placement": cache.get("placement", {}).get("mode")}
        doc["per_node"] = {n: dict(st) for n, st in cache.get("per_node", {}).items()}
        with open(os.path.join(work, f"rank-{rank}-{e}.json"), "w") as f:
            json.dump(doc, f)
        dist.barrier()
        if rank == 0:
            open(os.path.join(work, f"end-{e}"), "w").close()
            wait(f"ack-{e}")
        dist.barrier()
    loader.shutdown()
    dist.destroy_process_group()


def _ddp_table(res: dict, args, n: int) -> list:
    data = res["data_bytes"]
    rows = []
    for mode, reps in res["ddp"].items():
        for rep, e, ep in ((r, e, ep) for r, eps in enumerate(reps) for e, ep in enumerate(eps)):
            per_node = [ep["s3_bytes_by_ip"].get(ip, 0) / data for ip in res["worker_node_ips"]]
            rows.append(
                [
                    n,
                    args.ddp,
                    mode + (f" (slots agreed: {ep['slots_agreed']})" if "slots_agreed" in ep else ""),
                    rep,
                    e,
                    f"{ep['s3_bytes'] / data:.2f}x",
                    " / ".join(f"{x:.2f}" for x in per_node),
                    f"{ep['link_bytes_between'] / data:.2f}x",
                    ep["units_per_batch"],
                    "yes" if ep["every_sample_once"] and ep["equal_counts"] else "NO",
                    ep["placement"],
                    ep["samples_s"],
                ]
            )
    return rows


def _run_cluster(n: int, args) -> dict:
    from cluster import netns_testbed

    cpus = max(1, args.ddp)  # a worker of each rank on each data node
    cluster = netns_testbed.NetnsCluster(
        workers=n, tag=f"b{os.getpid()}n{n}", private=True, worker_cpus=cpus, subnet=args.subnet
    )
    with cluster:
        cluster.count_links()  # the bytes between nodes, on the bridge's ports (read by the driver)
        res = run_in_netns_head(
            cluster,
            "bench_across_nodes",
            "--driver",
            *("--files", str(args.files), "--groups", str(args.groups), "--rows", str(args.rows)),
            *("--payload", str(args.payload), "--epochs", str(args.epochs), "--format", args.format),
            *(["--unordered"] if args.unordered else []),
            *(["--alone"] if args.alone else []),
            *("--reps", str(args.reps), "--ddp", str(args.ddp), "--deals", args.deals),
            timeout_s=1200,
            RAYDL_NETNS_STATE=cluster.root,  # how the driver finds the cluster (tests/_netns_main.py)
        )
        res["worker_node_ips"] = [cluster.ip(i) for i in range(1, n + 1)]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,2,3,4", help="data node counts, comma-separated")
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--rows", type=int, default=150)
    ap.add_argument("--payload", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument(
        "--format", choices=("parquet", "tar"), default="parquet", help="the corpus as Parquet or tar shards"
    )
    ap.add_argument("--unordered", action="store_true", help="also node slots with in_order=False")
    ap.add_argument("--alone", action="store_true", help="also node_slots=1 with each node's cache alone")
    ap.add_argument("--reps", type=int, default=1, help="the modes in turn this many times on each cluster (paired)")
    ap.add_argument("--subnet", default="10.237.0", help="the cluster's /24 (another one beside a running test suite)")
    ap.add_argument("--ddp", type=int, default=0, help="W > 0: W DDP ranks (ParquetDistributedSampler) instead")
    ap.add_argument("--deals", default="batch,position", help="with --ddp: the deals to run, in this order")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank-main", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        _rank_main(json.loads(args.rank_main))
        return
    if args.driver:
        print("RESULT " + json.dumps(_driver(args)), flush=True)
        return
    rows, ratios, ddp_rows = [], [], []
    for n in [int(x) for x in args.nodes.split(",")]:
        res = _run_cluster(n, args)
        print(f"{n} data node(s): " + json.dumps(res), flush=True)
        data = res["data_bytes"]
        if args.ddp:
            ddp_rows += _ddp_table(res, args, n)
            continue
        speeds = {mode: [[ep["samples_s"] for ep in rep] for rep in reps] for mode, reps in res["modes"].items()}
        if "node slots" in speeds and "node_slots=1, cooperative" in speeds:  # paired: the same rep, the same epoch
            for e in range(args.epochs):
                pairs = zip(speeds["node slots"], speeds["node_slots=1, cooperative"])
                r = sorted(a[e] / b[e] for a, b in pairs)
                ratios.append([n, e, " / ".join(f"{x:.2f}" for x in r), f"{r[len(r) // 2]:.2f}"])
        for mode, reps in res["modes"].items():
            for rep, e, ep in ((r, e, ep) for r, eps in enumerate(reps) for e, ep in enumerate(eps)):
                per_node = [ep["s3_bytes_by_ip"].get(ip, 0) / data for ip in res["worker_node_ips"]]
                peers = sum(st["bytes_from_peers"] for st in ep["nodes"].values()) / data
                fallbacks = sum(st["peer_fallbacks"] for st in ep["nodes"].values())
                rows.append(
                    [
                        n,
                        mode,
                        rep,
                        e,
                        f"{ep['s3_bytes'] / data:.2f}x",
                        " / ".join(f"{x:.2f}" for x in per_node),
                        f"{peers:.2f}x",
                        f"{ep['link_bytes_between'] / data:.2f}x",
                        fallbacks,
                        ep.get("units_per_batch", ""),
                        "yes" if ep["same_as_torch"] else "NO",
                        ep["samples_s"],
                    ]
                )
    print(
        f"\n{args.format}: data {data} B of units; cache_limit a quarter of it on each node; batch {BATCH}, one worker a node\n"
    )
    header = ["data nodes", "batches by", "rep", "epoch", "S3 bytes, cluster / data", "per node / data"]
    if args.ddp:
        header = ["data nodes", "ranks", "deal", "rep", "epoch", "S3 bytes, cluster / data", "per node / data"]
        header += ["between nodes on the links / data", "units per batch", "every sample once, equal counts"]
        header += ["placement", "samples/s"]
        print(f"\n{args.format}: data {data} B; cache_limit a quarter of it on each node; batch {BATCH}\n")
        print(md_table(header, ddp_rows))
        return
    header += ["from peers / data", "between nodes on the links / data", "fallbacks", "units per batch"]
    header += ["torch's batches", "samples/s"]
    print(md_table(header, rows))
    if ratios:
        print("\nsamples/s, node slots / node_slots=1 (cooperative), paired by rep:\n")
        print(md_table(["data nodes", "epoch", "ratios, sorted", "median"], ratios))


if __name__ == "__main__":
    with printed_report("bench_across_nodes", enabled="--driver" not in sys.argv):
        main()
