"""Streaming Parquet from S3: raydl.ParquetDataset + node cache vs Ray Data, a naive lazy dataset, and the storage ceiling.

The store: moto's S3 server on loopback behind a proxy that adds `--latency-ms` (20) to every
request (tests/_s3.py). The data: `--files` Parquet files of `--groups` row groups of `--rows`
rows with a `--payload`-byte incompressible column, four times larger than raydl's cache_limit.
Each reader runs `--epochs` (2) epochs of batches of `--batch-size` (64) with a shuffle, `--workers` (2) workers;
`--columns numeric` writes an id, a label and 16 float32 features instead of the payload (issue 38's streamed target
is on numeric columns); `--storage-cores 12-15` keeps moto's server and the proxy's threads on those cores and
everything else (this process, the Ray it starts, the readers) on the others, so that on a machine with cores to
spare the storage emulation does not take the loaders' cores (Linux):
  * raydl: `ParquetDataset(cache_limit=data/4)` + `raydl.DataLoader(shuffle=True, num_workers=2)`;
  * Ray Data: `read_parquet` + `iter_torch_batches(local_shuffle_buffer_size=<raydl's window in rows>)`;
  * naive: torch's DataLoader(num_workers=2, shuffle=True) over a map-style dataset whose
    `__getitem__` opens the row's file in S3 and reads its row group (cut after `--naive-s`);
  * ceiling: every file read whole by 8 threads (the store's own bandwidth, in rows/s).
Prints one JSON line per reader (samples/s per epoch, bytes fetched per epoch / data size, cache
peak / limit, first batch), the cores each role used in the last epoch (storage, node cache, workers, this process;
Linux) and a Markdown table.

    .venv/bin/python -m benchmarks.bench_streaming
    python -m benchmarks.bench_streaming --columns numeric --workers 8 --storage-cores 12-15 --skip naive
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from benchmarks.common.results import figure_path, printed_report
from tests._s3 import FaultProxy, MotoServer, s3fs, upload_folder


def write_corpus(folder: str, files: int, groups: int, rows: int, payload: int, columns: str = "payload") -> None:
    """`columns`: "payload" (an id, a label, `payload` incompressible bytes a row) or "numeric" (an id, a label and 16
    float32 features, the numeric table issue 38's streamed target is stated on)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    for f in range(files):
        ids = np.arange(f * groups * rows, (f + 1) * groups * rows)
        if columns == "numeric":
            features = {f"f{c}": rng.standard_normal(len(ids), dtype=np.float32) for c in range(16)}
            table = pa.table({"id": ids, "label": ids % 10, **features})
        else:
            table = pa.table({"id": ids, "label": ids % 10, "payload": [rng.bytes(payload) for _ in ids]})
        pq.write_table(table, os.path.join(folder, f"part-{f:03d}.parquet"), row_group_size=rows)


class NaiveS3Dataset(torch.utils.data.Dataset):
    """What a user writes without a streaming loader: each row opens its file and reads its row group."""

    def __init__(self, port: int, files: list, groups: int, rows: int) -> None:
        self.port, self.files, self.groups, self.rows = port, files, groups, rows

    def __len__(self) -> int:
        return len(self.files) * self.groups * self.rows

    def __getitem__(self, i: int) -> dict:
        import pyarrow.parquet as pq

        per_file = self.groups * self.rows
        f, g, r = i // per_file, (i % per_file) // self.rows, i % self.rows
        with s3fs(self.port, attempts=3).open_input_file(self.files[f]) as src:
            row = pq.ParquetFile(src).read_row_group(g).slice(r, 1).to_pylist()[0]
        return row


def _ray_data_collate(batch: dict) -> dict:
    """Ray Data's batch (NumPy columns) as torch's default_collate gives raydl's: tensors, bytes as a list."""
    return {k: list(v) if v.dtype == object else torch.as_tensor(v) for k, v in batch.items()}


def cpu_by_role(storage_pid: int) -> dict:
    """CPU seconds so far of each role on this machine (Linux /proc; {} elsewhere): the storage (moto's server), this
    process (the training loop and the fault proxy's threads), raydl's node cache, raydl's workers, the rest of Ray."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(pid) == storage_pid:
            role = "storage"
        elif int(pid) == os.getpid():
            role = "loop_and_proxy"
        elif cmd.startswith("ray::NodeCache"):
            role = "node_cache"
        elif cmd.startswith("ray::Worker"):
            role = "raydl_workers"
        elif "ray" in cmd:
            role = "ray_other"
        else:
            continue
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def parse_cores(text: str) -> set:
    """'12-15' or '1,3,5-6' as a set of CPU numbers, checked against this machine's."""
    cores: set = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    have = os.sched_getaffinity(0)
    if not cores or not cores < have:
        raise SystemExit(f"--storage-cores {text!r}: name some, not all, of this machine's cores {sorted(have)}")
    return cores


def pin_storage(cores: set, moto_pid: int, proxy: FaultProxy) -> set:
    """Moto's server (each thread it has; new ones inherit) and the proxy's serving thread (its request threads are
    made by it, and inherit) on `cores`; this thread, and so the Ray and the workers it starts, on the others."""
    for tid in os.listdir(f"/proc/{moto_pid}/task"):
        os.sched_setaffinity(int(tid), cores)
    os.sched_setaffinity(proxy.thread.native_id, cores)
    rest = os.sched_getaffinity(0) - cores
    os.sched_setaffinity(0, rest)
    return rest


def epochs_of(
    make_iter, epochs: int, proxy: FaultProxy, deadline_s: float = float("inf"), storage_pid: int = 0
) -> dict:
    out = {"samples_per_s": [], "bytes_per_epoch": [], "first_batch_s": None, "cut": False}
    for e in range(epochs):
        proxy.reset_counts()
        cpu0 = cpu_by_role(storage_pid)
        t0 = time.perf_counter()
        n = 0
        for batch in make_iter():
            if out["first_batch_s"] is None:
                out["first_batch_s"] = time.perf_counter() - t0
            n += len(batch["id"])
            if time.perf_counter() - t0 > deadline_s:
                out["cut"] = True
                break
        dt = time.perf_counter() - t0
        cpu1 = cpu_by_role(storage_pid)
        # the last epoch's CPU, in cores: on a small machine the storage emulation shares the cores with the loader
        out["cores_by_role"] = {k: round((v - cpu0.get(k, 0.0)) / dt, 2) for k, v in sorted(cpu1.items())}
        out["samples_per_s"].append(n / dt)
        out["bytes_per_epoch"].append(proxy.get_bytes)
        out.setdefault("rows_read", []).append(n)
        if out["cut"]:
            break
    return out


def plot(results: list, path: str, batch_size: int = 64) -> None:
    """Samples/s per epoch (log scale) and bytes fetched per epoch / data, one bar per reader and epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    labels, sps, byt = [], [], []
    for r in results:
        for e, (x, y) in enumerate(zip(r["samples_per_s"], r["bytes_over_data"])):
            labels.append(f"{r['reader']}\nepoch {e + 1}" if len(r["samples_per_s"]) > 1 else r["reader"])
            sps.append(x)
            byt.append(y)
    a.bar(range(len(labels)), sps, color="tab:blue")
    a.set_yscale("log")
    a.set_title(f"samples/s (2 workers, batch {batch_size}, shuffle)")
    b.bar(range(len(labels)), byt, color="tab:orange")
    b.set_yscale("log")
    b.axhline(1.15, color="gray", linestyle="--", linewidth=1)
    b.set_title("bytes fetched per epoch / data size")
    for ax in (a, b):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def checksum_cost(mib: int = 64, reps: int = 5) -> float:
    """GB/s of one core checking a unit's CRC-32 (`unsealed`, NOTE [ raydl node cache ], checksums): the best of
    `reps` passes over `mib` MiB, what each worker pays per byte it reads from the cache."""
    from raydl.cluster.cache.unit_file import seal, unsealed

    body = os.urandom(mib << 20)
    raw = body + seal([body])
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        assert unsealed(raw) is not None
        best = min(best, time.perf_counter() - t0)
    return (mib << 20) / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checksum-only", action="store_true", help="only measure the cache's checksum cost per byte")
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--payload", type=int, default=1024)
    p.add_argument("--columns", choices=("payload", "numeric"), default="payload", help="the table (write_corpus)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="each loader's workers")
    p.add_argument("--storage-cores", default="", help="cores for moto and the proxy, e.g. 12-15 (Linux)")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument(
        "--window",
        type=float,
        default=None,
        help="raydl's shuffle_window as a share of the cache's units (the default's is about 0.5; 1: the most it "
        "accepts, the cache less one unit): what a larger window costs (issue 64)",
    )
    p.add_argument("--naive-s", type=float, default=30.0)
    p.add_argument("--skip", default="", help="comma-separated readers to skip: raydl,raydata,naive,ceiling")
    p.add_argument("--png", default=figure_path("bench_streaming"), help="'' for none")
    args = p.parse_args()
    gbps = checksum_cost()
    print(
        f"cache checksum (CRC-32 of each unit read, one core): {gbps:.2f} GB/s, {1e3 / gbps:.2f} ms of CPU per GB read"
    )
    if args.checksum_only:
        return
    skip = set(filter(None, args.skip.split(",")))
    storage_cores = parse_cores(args.storage_cores) if args.storage_cores else None  # checked before anything starts

    import ray

    import raydl
    from raydl.cluster.cache.handles import node_cache

    tmp = tempfile.mkdtemp(prefix="bench-streaming-")
    corpus = os.path.join(tmp, "corpus")
    os.makedirs(corpus)
    write_corpus(corpus, args.files, args.groups, args.rows, args.payload, args.columns)
    n_rows = args.files * args.groups * args.rows
    moto = MotoServer()
    proxy = None
    results = []
    try:
        fs = moto.filesystem()
        fs.create_dir("corpus")
        upload_folder(corpus, fs, "corpus/data")
        proxy = FaultProxy(moto.port)
        if storage_cores is not None:
            rest = pin_storage(storage_cores, moto.proc.pid, proxy)
            print(f"storage on cores {args.storage_cores}, the loaders on {len(rest)} others", file=sys.stderr)
        data_bytes = sum(os.path.getsize(os.path.join(corpus, f)) for f in os.listdir(corpus))
        files = sorted(f"corpus/data/{f}" for f in os.listdir(corpus))
        ray.init(address="local", num_cpus=max(2, args.workers), include_dashboard=False, log_to_driver=False)
        proxy.latency_s = args.latency_ms / 1000

        probe = raydl.ParquetDataset("s3://corpus/data/", filesystem=s3fs(proxy.port))
        limit = probe.nbytes // 4
        window_rows = None

        if "raydl" not in skip:
            t0 = time.perf_counter()
            window = None
            if args.window is not None:
                largest = int(probe.unit_nbytes.max()) + 8  # a unit as the cache counts it, with its checksum
                window = max(1, min(limit // largest - 1, int(args.window * limit) // largest))
            ds = raydl.ParquetDataset(
                "s3://corpus/data/",
                filesystem=s3fs(proxy.port),
                cache_dir=os.path.join(tmp, "cache"),
                cache_limit=limit,
                shuffle_window=window,
            )
            footers_s = time.perf_counter() - t0
            window_rows = ds.shuffle_window * args.rows
            loader = raydl.DataLoader(
                ds,
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=args.workers,
                persistent_workers=True,
                generator=torch.Generator().manual_seed(0),
            )
            cache = node_cache(ds.cache_dir, ds.cache_limit)
            r = epochs_of(lambda: loader, args.epochs, proxy, storage_pid=moto.proc.pid)
            st = ray.get(cache.stats.remote(), timeout=30)
            figures = loader.stats().cache
            r.update(
                reader="raydl",
                shuffle_window=ds.shuffle_window,
                units=ds.num_units,
                footers_s=footers_s,
                cache_peak_over_limit=st["peak_bytes"] / ds.cache_limit,
                cache_fetched_over_data=[b / ds.nbytes for b in r["bytes_per_epoch"]],
                storage_wait_share=figures["storage_wait_share"] if figures else None,
                hit_rate=figures["hit_rate"] if figures else None,
            )
            loader.shutdown()
            results.append(r)
        print(json.dumps(r, default=float), file=sys.stderr)

        if "raydata" not in skip:
            import ray.data

            ctx = ray.data.DataContext.get_current()
            ctx.enable_progress_bars = False
            buf = window_rows or (n_rows // 8)
            dsr = ray.data.read_parquet("s3://corpus/data/", filesystem=s3fs(proxy.port, attempts=3))
            r = epochs_of(
                lambda: dsr.iter_torch_batches(
                    batch_size=args.batch_size,
                    local_shuffle_buffer_size=buf,
                    prefetch_batches=4,
                    collate_fn=_ray_data_collate,
                ),
                args.epochs,
                proxy,
                storage_pid=moto.proc.pid,
            )
            r.update(reader="ray_data", local_shuffle_buffer_size=buf)
            results.append(r)
        print(json.dumps(r, default=float), file=sys.stderr)

        if "naive" not in skip:
            naive = NaiveS3Dataset(proxy.port, files, args.groups, args.rows)
            dl = torch.utils.data.DataLoader(
                naive,
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=args.workers,
                generator=torch.Generator().manual_seed(0),
            )
            r = epochs_of(lambda: dl, 1, proxy, deadline_s=args.naive_s)
            r["bytes_per_epoch"] = [proxy.get_bytes * n_rows / max(1, r["rows_read"][0])]  # extrapolated
            r.update(reader="naive_torch")
            results.append(r)
        print(json.dumps(r, default=float), file=sys.stderr)

        if "ceiling" not in skip:
            s3 = s3fs(proxy.port, attempts=3)

            def whole(path: str) -> int:
                with s3.open_input_file(path) as f:
                    return len(f.read())

            proxy.reset_counts()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                got = sum(pool.map(whole, files))
            dt = time.perf_counter() - t0
            results.append(
                dict(reader="ceiling", samples_per_s=[n_rows / dt], bytes_per_epoch=[got], mb_per_s=got / dt / 1e6)
            )
    finally:
        if proxy is not None:
            proxy.stop()
        moto.stop()
        if ray.is_initialized():
            ray.shutdown()

    info = dict(
        rows=n_rows,
        data_bytes=data_bytes,
        cache_limit=limit,
        latency_ms=args.latency_ms,
        cpus=os.cpu_count(),
        workers=args.workers,
        storage_cores=args.storage_cores or None,
        columns=args.columns,
        batch_size=args.batch_size,
    )
    print(json.dumps({"config": info}))
    for r in results:
        r["bytes_over_data"] = [b / data_bytes for b in r["bytes_per_epoch"]]
        print(json.dumps(r, default=float))
    base = {r["reader"]: r for r in results}
    print("\n| reader | samples/s per epoch | bytes fetched per epoch / data | first batch s | cache peak / limit |")
    print("|---|---|---|---|---|")
    for r in results:
        sps = " / ".join(f"{x:,.0f}" for x in r["samples_per_s"])
        byt = " / ".join(f"{x:.2f}" for x in r["bytes_over_data"])
        fb = f"{r['first_batch_s']:.2f}" if r.get("first_batch_s") is not None else "-"
        peak = f"{r['cache_peak_over_limit']:.2f}" if "cache_peak_over_limit" in r else "-"
        cut = " (cut)" if r.get("cut") else ""
        print(f"| {r['reader']}{cut} | {sps} | {byt} | {fb} | {peak} |")
    if args.png:
        plot(results, args.png, args.batch_size)
    if "raydl" in base and "ray_data" in base:
        a, b = base["raydl"]["samples_per_s"], base["ray_data"]["samples_per_s"]
        print(f"\nraydl / Ray Data samples/s per epoch: {' / '.join(f'{x / y:.2f}' for x, y in zip(a, b))}")
    for r in results:
        if r.get("cores_by_role"):
            roles = ", ".join(f"{k} {v:.2f}" for k, v in r["cores_by_role"].items())
            print(f"{r['reader']}: cores used in its last epoch by role: {roles} (of {os.cpu_count()})")
    if "raydl" in base and "ceiling" in base:
        print(
            f"raydl's last epoch reached {base['raydl']['samples_per_s'][-1] / base['ceiling']['samples_per_s'][0]:.0%} "
            "of the storage ceiling"
        )


if __name__ == "__main__":
    with printed_report("bench_streaming", quick="--quick" in sys.argv):
        main()
