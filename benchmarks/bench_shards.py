#!/usr/bin/env python3
"""JPEGs in WebDataset tar shards and as plain files in S3: raydl's TarDataset / FileDataset against the peers.

    python -m benchmarks.bench_shards                 # 768 JPEGs 256x256 in 16 shards, 20 ms a request (~6 min)
    python -m benchmarks.bench_shards --images 192    # a smoke run

The store: moto's S3 server on loopback behind tests/_s3.FaultProxy, which adds --latency-ms to every
request and counts the bytes of the GET responses (what storage sent). The work per sample: PIL
decode, RandomResizedCrop(224), flip, normalize (examples/train_image_classifier.TrainTransform),
batch 32, 2 epochs, 2 workers (or 2 processes / 2 threads).
Rows, each run in this process one after the other (the fork-based loaders before Ray starts):
  ceiling         the same decode + transform + collate from memory, one process per core (no loader)
  torch-in-memory torch's DataLoader over the JPEGs' bytes held in memory: a loader with no storage at all
  webdataset      wds.WebDataset(urls, shardshuffle=True).shuffle(256).map(decode).batched(32) through torch's
                  DataLoader(num_workers=2), each shard read through the proxy with curl (webdataset's pipe:)
  get-per-item    a Dataset doing one GET per __getitem__ (pyarrow's S3 client) through torch's DataLoader
  raydl-tar-1/4   raydl.TarDataset, cache_limit a quarter of the data ("full": the data's bytes + 5 %)
  raydl-files-1/4 raydl.FileDataset over the ImageFolder, the same limits
  raydata-wds     ray.data.read_webdataset(decoder=None) + map(decode) + iter_torch_batches
  raydata-images  ray.data.read_images + map(transform) + iter_torch_batches
Each row: samples/s per epoch, the bytes storage sent per epoch as a multiple of the data's bytes, the
requests of the last epoch, and the cores moto's process used meanwhile (storage shares this machine's cores).
Outputs: Markdown on stdout and in benchmarks/results/bench_shards-<stamp>.md, JSON lines beside it, and
benchmarks/figures/bench_shards.png.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import tarfile
import tempfile
import time
from typing import Any, Callable, Iterable, Optional

import torch

from benchmarks.common.results import Results, figure_path, log, md_table, printed_report
from examples.train_image_classifier import TrainTransform, write_jpeg_folder
from tests._s3 import FaultProxy, MotoServer, s3fs, stop_all

_TRANSFORM = TrainTransform(224)


def decode(jpeg: bytes) -> torch.Tensor:
    from PIL import Image

    return _TRANSFORM(Image.open(io.BytesIO(jpeg)).convert("RGB"))


def tar_sample(sample: dict) -> tuple:
    return decode(sample["jpg"]), int(sample["cls"])


def file_sample(sample: dict) -> tuple:
    return decode(sample["jpg"]), int(sample["__key__"].split("/")[0].split("_")[1])


def collate(samples: list) -> tuple:
    return torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])


# ------------------------------------------------------------------ the data


def write_shards(image_dir: str, shard_dir: str, shards: int) -> list:
    """The ImageFolder's JPEGs as WebDataset shards: key NNNNNN, fields jpg and cls; round robin over shards."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(image_dir) for f in fs if f.endswith(".jpg"))
    os.makedirs(shard_dir, exist_ok=True)
    paths = [os.path.join(shard_dir, f"train-{s:06d}.tar") for s in range(shards)]
    tars = [tarfile.open(p, "w") for p in paths]
    for i, f in enumerate(files):
        label = int(os.path.basename(os.path.dirname(f)).split("_")[1])
        for ext, data in (("jpg", open(f, "rb").read()), ("cls", str(label).encode())):
            info = tarfile.TarInfo(f"{i:06d}.{ext}")
            info.size = len(data)
            tars[i % shards].addfile(info, io.BytesIO(data))
    for t in tars:
        t.close()
    return paths


def upload(fs: Any, local: str, prefix: str) -> int:
    total = 0
    for d, _, fs_names in os.walk(local):
        for name in sorted(fs_names):
            if not name.endswith((".jpg", ".tar")):
                continue
            path = os.path.join(d, name)
            rel = os.path.relpath(path, local).replace(os.sep, "/")
            with open(path, "rb") as src, fs.open_output_stream(f"{prefix}/{rel}") as dst:
                data = src.read()
                dst.write(data)
                total += len(data)
    return total


# ------------------------------------------------------------------ the rows


class FolderPeak:
    """The most bytes a folder held, walked every 10 ms in a thread (files in its subfolders too: what `cache_limit`
    bounds)."""

    def __init__(self, folder: str) -> None:
        import threading

        self.folder, self.peak, self._stop = folder, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            held = 0
            for root, _, files in os.walk(self.folder):
                for f in files:
                    try:
                        held += os.path.getsize(os.path.join(root, f))
                    except OSError:
                        pass
            self.peak = max(self.peak, held)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def epochs_of(
    make: Callable[[], Iterable], epochs: int, proxy: FaultProxy, n: int, data_bytes: int, storage_pid: int
) -> list:
    """[{samples_per_s, first_batch_s, storage_x, requests, storage_cpu_s}] per epoch of the loader `make()` returns;
    the storage's CPU is moto's process's and the proxy's thread's share is left in this process."""
    import psutil

    storage = psutil.Process(storage_pid)
    out = []
    loader = make()
    for _ in range(epochs):
        proxy.reset_counts()
        cpu0 = sum(storage.cpu_times()[:2])
        t0, seen, first = time.perf_counter(), 0, None
        for _, labels in loader:
            seen += len(labels)
            first = time.perf_counter() - t0 if first is None else first
        took = time.perf_counter() - t0
        out.append(
            {
                "samples": seen,
                "samples_per_s": seen / took,
                "first_batch_s": first,
                "storage_x": proxy.get_bytes / data_bytes,
                "requests": proxy.requests,
                "storage_cpu_share": (sum(storage.cpu_times()[:2]) - cpu0) / took,
            }
        )
        if seen != n:
            log(f"  note: {seen} samples in the epoch, {n} in the data")
    return out


_CEILING_BATCH = 32


def _ceiling_part(jpegs: list) -> int:
    torch.set_num_threads(1)
    for k in range(0, len(jpegs), _CEILING_BATCH):
        collate([(decode(j), 0) for j in jpegs[k : k + _CEILING_BATCH]])  # decoded, augmented, collated
    return len(jpegs)


def ceiling(image_dir: str, workers: int, batch_size: int) -> list:
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(image_dir) for f in fs if f.endswith(".jpg"))
    jpegs = [open(f, "rb").read() for f in files]
    parts = [jpegs[k::workers] for k in range(workers)]
    global _CEILING_BATCH
    _CEILING_BATCH = batch_size
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.map(_ceiling_part, [p[:8] for p in parts])  # warm
        t0 = time.perf_counter()
        done = sum(pool.map(_ceiling_part, parts))
        rate = done / (time.perf_counter() - t0)
    return [{"samples": done, "samples_per_s": rate, "storage_x": 0.0, "requests": 0, "storage_cpu_share": 0.0}] * 2


class InMemory(torch.utils.data.Dataset):
    """The JPEGs' bytes in memory: torch's DataLoader over it is what a loader gets with no storage at all."""

    def __init__(self, image_dir: str) -> None:
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(image_dir) for f in fs if f.endswith(".jpg"))
        self.items = [(open(f, "rb").read(), int(os.path.basename(os.path.dirname(f)).split("_")[1])) for f in files]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple:
        jpeg, label = self.items[i]
        return decode(jpeg), label


class GetPerItem(torch.utils.data.Dataset):
    """One GET per __getitem__: what a user writes first over files in S3."""

    def __init__(self, port: int, keys: list) -> None:
        self.port, self.keys, self.fs = port, keys, None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple:
        if self.fs is None:
            self.fs = s3fs(self.port, 3)
        with self.fs.open_input_stream(self.keys[i]) as f:
            data = f.read()
        return decode(data), int(self.keys[i].split("/")[-2].split("_")[1])


def webdataset_loader(urls: list, args: Any) -> Any:
    import webdataset as wds

    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
        .shuffle(256)
        .map(tar_sample)
        .batched(args.batch_size, collation_fn=collate)
    )
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers, persistent_workers=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=768)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--skip", nargs="*", default=[], help="rows to leave out")
    p.add_argument("--cache-dir", default="/tmp/raydl-bench-shards")
    args = p.parse_args()

    res = Results("bench_shards", args.images < 768)
    image_dir = write_jpeg_folder(
        os.path.join(args.cache_dir, f"{args.size}-n{args.images}"), args.images, 10, size=(args.size, args.size)
    )
    shard_dir = tempfile.mkdtemp(prefix="raydl-bench-shards-")
    write_shards(image_dir, shard_dir, args.shards)
    moto = MotoServer()
    proxy = None
    rows: dict = {}
    try:
        moto.make_bucket("bench")
        tar_bytes = upload(moto.filesystem(), shard_dir, "bench/shards")
        file_bytes = upload(moto.filesystem(), image_dir, "bench/files")
        proxy = FaultProxy(moto.port)
        proxy.latency_s = args.latency_ms / 1000
        n = args.images
        log(f"{n} JPEGs, {file_bytes / 1e6:.1f} MB as files, {tar_bytes / 1e6:.1f} MB in {args.shards} shards")
        urls = [
            f"pipe:curl -s http://127.0.0.1:{proxy.port}/bench/shards/train-{s:06d}.tar" for s in range(args.shards)
        ]
        import pyarrow.fs as pafs  # here: bench_peers' children import decode() without pyarrow

        listed = moto.filesystem().get_file_info(pafs.FileSelector("bench/files", recursive=True))
        file_keys = sorted(i.path for i in listed if i.path.endswith(".jpg"))

        def run(name: str, make: Callable[[], Any], data_bytes: int, watch: Optional[tuple] = None) -> None:
            """`watch`: (a cache folder, its limit): the folder's peak over the row's epochs, index included, over the limit."""
            if name in args.skip:
                return
            log(f"{name} ...")
            peak = FolderPeak(watch[0]) if watch else None
            rows[name] = epochs_of(make, args.epochs, proxy, n, data_bytes, moto.proc.pid)
            if peak is not None:
                rows[name][-1]["folder_peak_over_limit"] = peak.stop() / watch[1]
            log(f"  {name}: " + ", ".join(f"{e['samples_per_s']:.0f}/s {e['storage_x']:.2f}x" for e in rows[name]))
            res.write({"row": name, "epochs": rows[name]})

        if "ceiling" not in args.skip:
            rows["ceiling"] = ceiling(image_dir, args.workers, args.batch_size)
            log(f"ceiling: {rows['ceiling'][0]['samples_per_s']:.0f}/s")

        def torch_loader(ds: Any) -> Any:
            return torch.utils.data.DataLoader(
                ds,
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=args.workers,
                persistent_workers=True,
                collate_fn=collate,
            )

        run("torch-in-memory", lambda: torch_loader(InMemory(image_dir)), file_bytes)
        run("webdataset", lambda: webdataset_loader(urls, args), tar_bytes)
        run("get-per-item", lambda: torch_loader(GetPerItem(proxy.port, file_keys)), file_bytes)

        import raydl

        fs = s3fs(proxy.port, 3)
        for kind, source, data_bytes, make_ds in (
            ("tar", "s3://bench/shards/", tar_bytes, raydl.TarDataset),
            ("files", "s3://bench/files/", file_bytes, raydl.FileDataset),
        ):
            # "full": the data's bytes and 5 % more, for the units' checksum trailers and headers between samples
            for limit, label in ((data_bytes // 4, "1/4"), (int(data_bytes * 1.05), "full")):
                cache = tempfile.mkdtemp(prefix="raydl-bench-cache-")
                transform = tar_sample if kind == "tar" else file_sample

                def make(source=source, limit=limit, cache=cache, transform=transform, make_ds=make_ds):
                    ds = make_ds(source, filesystem=fs, cache_dir=cache, cache_limit=limit, transform=transform)
                    return raydl.DataLoader(
                        ds,
                        batch_size=args.batch_size,
                        shuffle=True,
                        num_workers=args.workers,
                        persistent_workers=True,
                        collate_fn=collate,
                    )

                run(f"raydl-{kind}-{label}", make, data_bytes, watch=(cache, limit))

        import ray.data

        def raydata_wds():
            ds = ray.data.read_webdataset("bench/shards/", filesystem=fs, decoder=None)
            ds = ds.map(lambda r: {"x": decode(r["jpg"]).numpy(), "y": int(r["cls"])})
            return _RayDataEpochs(ds, args.batch_size)

        def raydata_images():
            from PIL import Image

            ds = ray.data.read_images("bench/files/", filesystem=fs, include_paths=True)
            ds = ds.map(
                lambda r: {
                    "x": _TRANSFORM(Image.fromarray(r["image"]).convert("RGB")).numpy(),
                    "y": int(r["path"].split("/")[-2].split("_")[1]),
                }
            )
            return _RayDataEpochs(ds, args.batch_size)

        run("raydata-wds", raydata_wds, tar_bytes)
        run("raydata-images", raydata_images, file_bytes)
    finally:
        stop_all(proxy, moto)
    report(rows, args, res, tar_bytes, file_bytes)


class _RayDataEpochs:
    """A Ray Data dataset iterated as torch batches, a new random order each epoch."""

    def __init__(self, ds: Any, batch_size: int) -> None:
        self.ds, self.batch_size = ds, batch_size

    def __iter__(self):
        for b in self.ds.random_shuffle().iter_torch_batches(batch_size=self.batch_size):
            yield b["x"], b["y"]


def report(rows: dict, args: Any, res: Results, tar_bytes: int, file_bytes: int) -> None:
    ceiling_rate = rows.get("ceiling", [{}])[0].get("samples_per_s")
    table = []
    for name, eps in rows.items():
        line = [name]
        for e in eps[: args.epochs]:
            line.append(f"{e['samples_per_s']:.0f}")
        for e in eps[: args.epochs]:
            line.append(f"{e['storage_x']:.2f}x")
        line.append(f"{eps[-1]['samples_per_s'] / ceiling_rate:.2f}" if ceiling_rate else "")
        line.append(f"{eps[-1]['requests']}")
        line.append(f"{eps[-1]['storage_cpu_share']:.2f}")
        line.append(f"{eps[0]['first_batch_s']:.2f}" if eps[0].get("first_batch_s") is not None else "")
        peak = eps[-1].get("folder_peak_over_limit")
        line.append(f"{peak:.3f}" if peak is not None else "")
        table.append(line)
    header = ["row", *[f"epoch {k + 1} samples/s" for k in range(args.epochs)]]
    header += [*[f"epoch {k + 1} storage bytes" for k in range(args.epochs)], "last epoch / ceiling"]
    header += ["last epoch requests", "last epoch storage cores", "epoch 1 first batch s", "cache folder peak / limit"]
    quick = args.images < 768
    with printed_report("bench_shards", quick):
        print(
            f"# bench_shards: {args.images} JPEGs {args.size}x{args.size} ({file_bytes / 1e6:.1f} MB as files, "
            f"{tar_bytes / 1e6:.1f} MB in {args.shards} shards), {args.latency_ms:.0f} ms a request, "
            f"{args.workers} workers, batch {args.batch_size}\n"
        )
        print(md_table(header, table))
    plot(rows, args, figure_path("bench_shards", quick))
    res.close()


def plot(rows: dict, args: Any, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [n for n in rows if n != "ceiling"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / args.epochs
    for k in range(args.epochs):
        ax.bar(
            [i + k * width for i in range(len(names))],
            [rows[n][k]["samples_per_s"] for n in names],
            width,
            label=f"epoch {k + 1}",
        )
    if "ceiling" in rows:
        ax.axhline(rows["ceiling"][0]["samples_per_s"], color="k", linestyle="--", label="decode ceiling")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("samples/s")
    ax.set_title(f"JPEGs from S3 ({args.latency_ms:.0f} ms a request), {args.workers} workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"figure: {path}")


if __name__ == "__main__":
    main()
