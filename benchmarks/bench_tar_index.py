#!/usr/bin/env python3
"""How long TarDataset's index takes to build, per GB, by reading the whole shard or hopping from header to header.

    python -m benchmarks.bench_tar_index                       # 16 shards of 4 MB and one of 256 MB (~3 min)
    python -m benchmarks.bench_tar_index --large-mb 1024       # a 1 GB shard

Shards of --sample-kb samples (a .jpg of random bytes and a .cls each) on a local disk and in S3 (moto behind
tests/_s3.FaultProxy adding --latency-ms a request). Each shard is scanned (raydl.data.tar_index.scan_shard) in
both modes: "stream" reads the shard in one streamed GET and parses the headers as they pass; "hop" reads each
header with a positioned read (one ranged GET each in S3). Per case: seconds, seconds per GB, requests; 16 shards
are scanned 16 at a time, as TarDataset does. What raydl chooses: "hop" on a local disk, "stream" elsewhere.
"""

from __future__ import annotations

import argparse
import io
import os
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common.results import log, md_table, printed_report
from raydl.data.tar_index import scan_shard
from tests._s3 import FaultProxy, MotoServer, s3fs


def write_shard(path: str, nbytes: int, sample_kb: int) -> int:
    """A shard of about `nbytes` of samples (random bytes as .jpg, a label as .cls); returns its member count."""
    chunk = os.urandom(sample_kb * 1024)
    samples = max(1, nbytes // len(chunk))
    with tarfile.open(path, "w") as tar:
        for k in range(samples):
            for ext, data in (("jpg", chunk), ("cls", str(k % 10).encode())):
                info = tarfile.TarInfo(f"{k:08d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return 2 * samples


def timed_scan(fs, paths: list, urls: list, mode: str, proxy=None) -> tuple:
    if proxy is not None:
        proxy.reset_counts()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(16, len(paths))) as pool:
        n = sum(
            len(s)
            for s in pool.map(
                lambda pu: scan_shard(fs, pu[0], fs.get_file_info(pu[0]).size, pu[1], mode), zip(paths, urls)
            )
        )
    return time.perf_counter() - t0, n, (proxy.requests if proxy is not None else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small-shards", type=int, default=16)
    p.add_argument("--small-mb", type=int, default=4)
    p.add_argument("--large-mb", type=int, default=256)
    p.add_argument("--sample-kb", type=int, default=100)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--no-large-s3-hop", action="store_true", help="skip the large shard's hops in S3 (minutes)")
    args = p.parse_args()
    import pyarrow.fs as pafs

    folder = tempfile.mkdtemp(prefix="raydl-bench-index-")
    sets = {
        f"{args.small_shards} x {args.small_mb} MB": [
            (os.path.join(folder, f"small-{s:03d}.tar"), args.small_mb << 20) for s in range(args.small_shards)
        ],
        f"1 x {args.large_mb} MB": [(os.path.join(folder, "large-000.tar"), args.large_mb << 20)],
    }
    members = {}
    for name, shards in sets.items():
        members[name] = sum(write_shard(path, nbytes, args.sample_kb) for path, nbytes in shards)
    moto = MotoServer()
    proxy = None
    rows = []
    try:
        moto.make_bucket("idx")
        up = moto.filesystem()
        for shards in sets.values():
            for path, _ in shards:
                with open(path, "rb") as src, up.open_output_stream(f"idx/{os.path.basename(path)}") as dst:
                    while chunk := src.read(8 << 20):
                        dst.write(chunk)
        proxy = FaultProxy(moto.port)
        proxy.latency_s = args.latency_ms / 1000
        s3 = s3fs(proxy.port, 3)
        local = pafs.LocalFileSystem()
        for name, shards in sets.items():
            gb = sum(os.path.getsize(p) for p, _ in shards) / 1e9
            for where, fs, paths, px in (
                ("local disk", local, [p for p, _ in shards], None),
                ("S3, 20 ms a request", s3, [f"idx/{os.path.basename(p)}" for p, _ in shards], proxy),
            ):
                for mode in ("stream", "hop"):
                    if mode == "hop" and px is not None and len(shards) == 1 and args.no_large_s3_hop:
                        continue
                    took, samples, requests = timed_scan(fs, paths, paths, mode, px)
                    rows.append(
                        [name, where, mode, f"{took:.2f}", f"{took / gb:.1f}", requests or "", samples, members[name]]
                    )
                    log(" | ".join(str(x) for x in rows[-1]))
    finally:
        if proxy is not None:
            proxy.stop()
        moto.stop()
    with printed_report("bench_tar_index"):
        print(
            f"# bench_tar_index: samples of {args.sample_kb} KB (2 members each), {args.latency_ms:.0f} ms a request\n"
        )
        header = ["shards", "where", "mode", "seconds", "s per GB", "requests", "samples", "members"]
        print(md_table(header, rows))


if __name__ == "__main__":
    main()
