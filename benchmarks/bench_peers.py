"""Streaming peers beside raydl: Mosaic Streaming and litdata, on Parquet rows or on JPEGs in tar shards from S3.

Two workloads (`--workload parquet|shards|both`, parquet by default), each in moto's S3 server behind `FaultProxy`
adding `--latency-ms` (20) to every request:
  * parquet: bench_streaming's (`write_corpus`): Parquet files of row groups with an id, a label and an
    incompressible payload;
  * shards: bench_shards' (`write_shards`): generated JPEGs (`--images` 4096 of `--size` 256 px, 10 classes) in
    `--shards` (16) WebDataset tar shards, each sample decoded in the loader's workers as bench_shards decodes (PIL,
    RandomResizedCrop(224), flip, normalize: `decode`), raydl in `TarDataset(transform=...)`, the peers in their
    dataset (Mosaic: `get_item` of a StreamingDataset subclass, as its vision datasets; litdata: `transform=`).
Each peer reads its own format, converted from the same rows (the same JPEG bytes + label, in the shards' order)
before the measurement (conversion time and bytes reported apart):
  * raydl: `ParquetDataset` / `TarDataset(cache_limit=...)` + `raydl.DataLoader(shuffle=True)` on the files as is;
  * mosaic: mosaicml-streaming's `MDSWriter` (shards of a source file's bytes, at most a 20th of the data: Mosaic
    refuses a cache_limit under 4 shards; `size_limit`), then its
    `StreamingDataset(remote=s3://..., shuffle=True, batch_size=..., cache_limit=...)`, every other argument its
    documented default, + its `StreamingDataLoader`;
  * mosaic+client (the shards' default Mosaic): the same, but the S3 client Mosaic made in this process (for index.json) is dropped before its
    workers fork (`stream._downloader.clean_up()`): otherwise the forked workers share its open keep-alive connection
    (seen here: a download stalls for Mosaic's 60 s download_timeout, and a shard can be saved with another
    response's bytes: an IndexError, or another shard's samples under its name);
  * litdata: litdata's `optimize()` (`chunk_bytes` the same), then its
    `StreamingDataset(s3://..., shuffle=True, max_cache_size=..., storage_options=<the endpoint>)` + its
    `StreamingDataLoader`.
Each runs `--epochs` (2) epochs, `--workers` (2) workers, batch `--batch-size` (64), with a cache of a quarter of its
data and of the whole data (`--quick`: a smaller corpus, the quarter only). Per run: samples/s per epoch, bytes
fetched from S3 per epoch (the proxy's count of GET bodies) / the data, every id delivered exactly once per epoch,
distinct source files (Parquet files, tar shards) per batch (the shuffle's reach), and whether a mid-epoch
`state_dict()` taken at half the first epoch, loaded into a fresh loader, hands out exactly the rest of that epoch.

The peers do not install beside raydl's torch/NumPy: each runs in a venv of its own (benchmarks/common/peer_envs.py,
built once under ~/.cache/raydl-bench-peers), as a child process (`--child PEER`: that peer, and bench_shards' decode
for the JPEGs) that asks this process to read the proxy's byte count at each epoch's start and end (a `MARK` line
answered on stdin). Every wait is bounded: a child with no progress for `--stall-s` (120 s), or still running after
`--cap-s` (300 s; --quick 180 s), is killed (its process group) and its row says so, with how far it got (samples/s
and bytes fetched per sample in the epoch it was cut in); raydl's batches wait at most `--stall-s` (its DataLoader
`timeout`).
Results: benchmarks/results/bench_peers[-<workload>][-quick]-<stamp>.jsonl (config, conversions, one record a run)
and .md (no -<workload> for parquet).

    .venv/bin/python -m benchmarks.bench_peers --quick
    .venv/bin/python -m benchmarks.bench_peers
    .venv/bin/python -m benchmarks.bench_peers --workload shards
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

LOADERS = ("raydl", "mosaic", "mosaic+client", "litdata")
PEER_OF = {"mosaic": "mosaic", "mosaic+client": "mosaic", "litdata": "litdata"}  # a loader's venv
WORKLOADS = ("parquet", "shards")
# The shards' default: Mosaic with its client dropped before the fork only (at its defaults its shared keep-alive
# connection saved a shard with another response's bytes: an IndexError in epoch 1; a first batch after 60 s).
DEFAULT_LOADERS = {"parquet": LOADERS, "shards": ("raydl", "mosaic+client", "litdata")}


# --------------------------------------------------------------------------- the child (a peer's venv)


def _collate(samples: list) -> dict:
    """A Parquet batch as raydl's: ids and labels as tensors, the payloads as a list of bytes (torch's default_collate
    would turn each bytes into a sequence of ints)."""
    import torch

    return {
        "id": torch.tensor([int(s["id"]) for s in samples]),
        "label": torch.tensor([int(s["label"]) for s in samples]),
        "payload": [bytes(s["payload"]) for s in samples],
    }


def _copy_bytes(sample: dict) -> dict:
    """litdata hands a `bytes` column as a memoryview into its memory map: a worker cannot pickle that."""
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}


def _decoded(s: dict) -> dict:
    """A JPEG sample decoded in the worker as bench_shards decodes (PIL, RandomResizedCrop(224), flip, normalize):
    raydl's tar samples ({"__key__", "jpg", "cls"}) and the peers' ({"id", "label", "jpg"})."""
    from benchmarks.bench_shards import decode

    return {
        "id": int(s["id"] if "id" in s else s["__key__"]),
        "label": int(s["label"] if "label" in s else s["cls"]),
        "x": decode(bytes(s["jpg"])),
    }


_ROWS: list = []


def _rows_of(part: tuple):
    """One sample a row of a part of the corpus, in its order (litdata's optimize() function; Mosaic's writer's
    source): the rows [lo, hi) of the Parquet rows (npz, lo, hi), or the samples of a tar shard (path,)."""
    if len(part) == 1:
        import tarfile

        fields: dict = {}
        with tarfile.open(part[0]) as tar:
            for m in tar:
                key, ext = m.name.split(".", 1)
                fields.setdefault(key, {})[ext] = tar.extractfile(m).read()
        for key, f in fields.items():
            yield {"id": int(key), "label": int(f["cls"]), "jpg": f["jpg"]}
        return
    import numpy as np

    npz, lo, hi = part
    if not _ROWS:
        with np.load(npz) as z:
            _ROWS.append((z["id"], z["label"], z["payload"]))
    ids, labels, payload = _ROWS[0]
    for i in range(lo, hi):
        yield {"id": int(ids[i]), "label": int(labels[i]), "payload": payload[i].tobytes()}


def _dir_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def child_convert(peer: str, cfg: dict) -> dict:
    """Write the corpus (cfg["parts"], read by `_rows_of`) in the peer's format to cfg["out"], shards of about
    cfg["shard_bytes"]."""
    parts = [tuple(x) for x in cfg["parts"]]
    t0 = time.perf_counter()
    if peer == "mosaic":
        from streaming import MDSWriter

        columns = {"id": "int64", "label": "int64", cfg["field"]: "bytes"}
        with MDSWriter(out=cfg["out"], columns=columns, size_limit=cfg["shard_bytes"]) as w:
            for part in parts:
                for row in _rows_of(part):
                    w.write(row)
    else:
        from litdata import optimize

        optimize(
            fn=_rows_of, inputs=parts, output_dir=cfg["out"], chunk_bytes=cfg["shard_bytes"], num_workers=cfg["workers"]
        )
    seconds = time.perf_counter() - t0
    files = [f for _, _, fs in os.walk(cfg["out"]) for f in fs]
    return {"convert_s": seconds, "format_bytes": _dir_bytes(cfg["out"]), "format_files": len(files)}


def _storage_env(cfg: dict) -> None:
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        S3_ENDPOINT_URL=cfg["endpoint"],  # Mosaic's way to a non-AWS endpoint
        AWS_ALLOW_HTTP="true",  # litdata's chunk GETs go through obstore, which refuses http:// without it
    )


def _make_peer_loader(peer: str, cfg: dict, local: str):
    """The peer's dataset + its StreamingDataLoader, its defaults but the cache size (and what S3 needs); the JPEGs
    decoded in its dataset (Mosaic: `get_item`, as its own vision datasets; litdata: its `transform`)."""
    shards = cfg["workload"] == "shards"
    if peer == "mosaic":
        from streaming import StreamingDataLoader, StreamingDataset

        class Decoded(StreamingDataset):
            def get_item(self, idx: int):
                return _decoded(super().get_item(idx))

        ds = (Decoded if shards else StreamingDataset)(
            remote=cfg["remote"],
            local=local,
            shuffle=True,
            batch_size=cfg["batch_size"],
            cache_limit=cfg["cache_bytes"],
        )
        if cfg.get("fresh_client"):
            # The S3 client Mosaic made in this process (for index.json) would be forked into the workers with its
            # open keep-alive connection, which they then share: drop it so that each worker makes its own.
            for stream in ds.streams:
                stream._downloader.clean_up()
        return StreamingDataLoader(
            ds, batch_size=cfg["batch_size"], num_workers=cfg["workers"], collate_fn=None if shards else _collate
        )
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader

    # litdata's chunk GETs go through obstore with fixed client options (no storage option reaches them), and obstore
    # refuses an http:// endpoint without allow_http: set it in those options (the workers fork with it).
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    ds = StreamingDataset(
        cfg["remote"],
        cache_dir=local,
        shuffle=True,
        max_cache_size=cfg["cache_bytes"],
        storage_options={
            "endpoint_url": cfg["endpoint"],
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
        },
        transform=_decoded if shards else _copy_bytes,
    )
    return StreamingDataLoader(
        ds, batch_size=cfg["batch_size"], num_workers=cfg["workers"], collate_fn=None if shards else _collate
    )


def _mark(what: str) -> None:
    """Tell the parent (stdout) and wait for its answer (stdin): it reads the proxy's byte count meanwhile."""
    print(f"MARK {what}", flush=True)
    sys.stdin.readline()


def _source(i: int, cfg: dict) -> int:
    """The source file of sample `i`: its tar shard (written round robin), or its Parquet file (rows in order)."""
    return i % cfg["shards"] if cfg.get("shards") else i // cfg["rows_per_file"]


def run_epochs(loader, cfg: dict, mark, progress: bool) -> tuple:
    """The epochs of a loader, a peer's (in its child) or raydl's (in the parent): ids, source files per batch,
    samples/s; `mark(...)` at each epoch's start and end (the proxy's count read there); and the `state_dict()` taken
    after batch `resume_at` of the first epoch."""
    import copy

    out: dict = {"samples_per_s": [], "ids": [], "files_per_batch": [], "first_batch_s": None}
    k, state = cfg["resume_at"], None
    for e in range(cfg["epochs"]):
        mark(f"start {e}")
        t0 = time.perf_counter()
        ids: list = []
        for b, batch in enumerate(loader):
            got = batch["id"].tolist()
            if out["first_batch_s"] is None:
                out["first_batch_s"] = time.perf_counter() - t0
            ids += got
            out["files_per_batch"].append(len({_source(i, cfg) for i in got}))
            if e == 0 and b + 1 == k:
                try:
                    state = copy.deepcopy(loader.state_dict())
                except Exception as ex:  # noqa: BLE001 - reported as the loader's answer
                    state = {"__error__": f"{type(ex).__name__}: {ex}"}
            if progress and b % 8 == 0:
                print(f"PROGRESS {e} {b}", flush=True)
        dt = time.perf_counter() - t0
        mark(f"end {e}")
        out["samples_per_s"].append(len(ids) / dt)
        out["ids"].append(ids)
    return out, state


def check_resume(make, state, expected: list, progress: bool) -> dict:
    """A fresh loader (`make()`) loaded with the state taken mid-epoch 1: does it hand out the rest of that epoch?"""
    if state is None:
        return {"verdict": "not reached (no state taken)"}
    if "__error__" in state:
        return {"verdict": f"not supported: state_dict() raised {state['__error__']}"}
    try:
        fresh = make()
        fresh.load_state_dict(state)
    except Exception as ex:  # noqa: BLE001
        return {"verdict": f"not supported: load_state_dict() raised {type(ex).__name__}: {str(ex)[:200]}"}
    got: list = []
    try:
        for b, batch in enumerate(fresh):
            got += batch["id"].tolist()
            if progress and b % 8 == 0:
                print(f"PROGRESS resume {b}", flush=True)
    except Exception as ex:  # noqa: BLE001
        return {"verdict": f"failed: iterating after load_state_dict() raised {type(ex).__name__}: {str(ex)[:200]}"}
    finally:
        getattr(fresh, "shutdown", lambda: None)()  # raydl's workers
    return compare_resume(got, expected)


def child_measure(peer: str, cfg: dict) -> dict:
    import gc

    _storage_env(cfg)

    def make():  # the same local cache folder each time (litdata's state names it, and refuses another)
        if peer == "mosaic":
            from streaming.base.util import clean_stale_shared_memory

            clean_stale_shared_memory()
        return _make_peer_loader(peer, cfg, os.path.join(cfg["local"], "run"))

    t_build = time.perf_counter()
    loader = make()
    build_s = time.perf_counter() - t_build
    out, state = run_epochs(loader, cfg, _mark, True)
    out["build_s"] = build_s
    expected = out["ids"][0][cfg["resume_at"] * cfg["batch_size"] :]
    out["ids"] = [_exactly_once(ids, cfg["rows"]) for ids in out["ids"]]
    print("EPOCHS " + json.dumps(out), flush=True)  # the epochs' figures stand if the resume check is then cut
    del loader
    gc.collect()
    out["resume"] = check_resume(make, state, expected, True)
    return out


def compare_resume(got: list, expected: list) -> dict:
    if got == expected:
        verdict = "exact (same samples, same order)"
    elif sorted(got) == sorted(expected):
        verdict = "same samples, other order"
    else:
        g, x = set(got), set(expected)
        verdict = f"differs: {len(got)} samples for {len(expected)} expected, {len(x - g)} missing, {len(g - x)} extra"
    return {"verdict": verdict, "resumed": len(got), "expected": len(expected)}


def _exactly_once(ids: list, n: int) -> dict:
    distinct = set(ids)
    missing = n - len(distinct & set(range(n)))
    foreign = len(distinct - set(range(n)))  # ids no row has: a sample decoded from the wrong bytes
    return {
        "delivered": len(ids),
        "duplicates": len(ids) - len(distinct),
        "missing": missing,
        "foreign": foreign,
        "ok": sorted(ids) == list(range(n)),
    }


def child_main(peer: str, mode: str, cfg_json: str) -> None:
    cfg = json.loads(cfg_json)
    rec = child_convert(peer, cfg) if mode == "convert" else child_measure(peer, cfg)
    print("RESULT " + json.dumps(rec), flush=True)


# --------------------------------------------------------------------------- the parent (raydl's venv)


class Child:
    """A peer's child process: its stdout read by a thread, each wait bounded; killed (its process group) at close."""

    def __init__(self, cmd: list, env: dict, cwd: str) -> None:
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own process group: its DataLoader workers end with it
        )
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._keep, args=(self.proc.stderr,), daemon=True).start()

    @staticmethod
    def _pump(stream, q: queue.Queue) -> None:
        for line in stream:
            q.put(line.rstrip("\n"))
        q.put(None)

    def _keep(self, stream) -> None:
        for line in stream:
            self.stderr.append(line)
            del self.stderr[:-60]

    def next_line(self, timeout_s: float):
        """The next stdout line; None at its end; raises queue.Empty after `timeout_s` without one."""
        return self.lines.get(timeout=timeout_s)

    def answer(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this child leads (start_new_session)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_child(peer: str, mode: str, cfg: dict, stall_s: float, cap_s: float, on_mark=None) -> dict:
    """One child run; {"stalled": "..."} when it printed nothing for `stall_s` (or ran past `cap_s`)."""
    from benchmarks.common import REPO
    from benchmarks.common.peer_envs import child_command, child_env

    child = Child(
        child_command(peer, "bench_peers", "--child", peer, "--mode", mode, json.dumps(cfg)), child_env(peer), REPO
    )
    t0 = time.perf_counter()
    where, epochs = "before its first line", {}
    try:
        while True:
            left = min(stall_s, cap_s - (time.perf_counter() - t0))
            try:
                line = child.next_line(max(0.1, left))
            except queue.Empty:
                took = time.perf_counter() - t0
                if took >= cap_s - 0.5:
                    return {**epochs, "stalled": f"cut: still running after {took:.0f} s (at {where})", "at": where}
                why = f"stalled: nothing for {stall_s:.0f} s (at {where}, {took:.0f} s in)"
                return {**epochs, "stalled": why, "at": where}
            if line is None:
                child.proc.wait(timeout=30)
                tail = "".join(child.stderr[-15:])
                last = [x.strip() for x in child.stderr if x.strip() and not x.startswith((" ", "-"))][-1:]
                why = f"failed: exited {child.proc.returncode} ({where}): {' '.join(last)[:200]}"
                return {**epochs, "failed": why, "stderr_tail": tail}
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
            if line.startswith("EPOCHS "):
                epochs = json.loads(line[len("EPOCHS ") :])
            if line.startswith("MARK "):
                where = line[5:]
                if on_mark is not None:
                    on_mark(where)
                child.answer()
            elif line.startswith("PROGRESS "):
                _, e, b = line.split()
                where = f"epoch {e} batch {b}" if e.isdigit() else f"the resume check, batch {b}"
                if on_mark is not None:
                    on_mark(line)
    finally:
        child.close()


def _marker(proxy, marks: dict):
    """The parent's `mark`: the proxy's bytes and requests and the time at each epoch's start and end; at a child's
    progress line (batch b of epoch e handed out) how far it got, for a run cut before its end."""

    def on_mark(what: str) -> None:
        if what.startswith("PROGRESS "):
            _, e, b = what.split()
            if e.isdigit():
                marks["last"] = (int(e), int(b) + 1, time.perf_counter(), proxy.get_bytes)
        else:
            marks[what] = (proxy.get_bytes, proxy.requests, time.perf_counter())

    return on_mark


def _epoch_bytes(rec: dict, marks: dict) -> dict:
    epochs = sorted({int(w.split()[1]) for w in marks if w.startswith("end ")})
    rec["bytes_per_epoch"] = [marks[f"end {e}"][0] - marks[f"start {e}"][0] for e in epochs]
    rec["requests_per_epoch"] = [marks[f"end {e}"][1] - marks[f"start {e}"][1] for e in epochs]
    return rec


def measure_peer(peer: str, cfg: dict, proxy, stall_s: float, cap_s: float) -> dict:
    marks: dict = {}
    rec = run_child(peer, "measure", cfg, stall_s, cap_s, _marker(proxy, marks))
    if "samples_per_s" in rec and ("stalled" in rec or "failed" in rec):  # cut in the resume check: its epochs stand
        rec["resume"] = {"verdict": rec.pop("stalled", None) or rec.pop("failed")}
    if "stalled" in rec or "failed" in rec:  # the epochs it finished before it was cut
        done = [e for e in range(cfg["epochs"]) if f"end {e}" in marks]
        rec["done_epochs"] = [
            {
                "samples_per_s": cfg["rows"] / max(1e-9, marks[f"end {e}"][2] - marks[f"start {e}"][2]),
                "bytes": marks[f"end {e}"][0] - marks[f"start {e}"][0],
            }
            for e in done
        ]
    if ("stalled" in rec or "failed" in rec) and "last" in marks and f"start {marks['last'][0]}" in marks:
        e, batches, t, got = marks["last"]
        b0, _, t0 = marks[f"start {e}"]
        rec["partial"] = {  # the epoch it was cut in, up to its last progress line (every 8th batch)
            "epoch": e,
            "batches": batches,
            "samples_per_s": batches * cfg["batch_size"] / max(1e-9, t - t0),
            "bytes": got - b0,
            "bytes_per_sample": (got - b0) / (batches * cfg["batch_size"]),
        }
    return _epoch_bytes(rec, marks)


def measure_raydl(source: str, ds_kwargs: dict, cfg: dict, proxy, stall_s: float) -> dict:
    """raydl in this process (`cfg["dataset"]` on `source`): the same epochs, checks and resume as a peer's child."""
    import torch

    import raydl

    def make_loader():
        return raydl.DataLoader(
            getattr(raydl, cfg["dataset"])(source, **ds_kwargs),
            batch_size=cfg["batch_size"],
            shuffle=True,
            num_workers=cfg["workers"],
            persistent_workers=True,
            timeout=stall_s,  # a batch not there in stall_s raises: the run is a "stalled" row
            generator=torch.Generator().manual_seed(0),
        )

    marks: dict = {}
    t_build = time.perf_counter()
    try:
        loader = make_loader()
    except Exception as ex:  # noqa: BLE001 - e.g. a cache_limit it refuses: this run's row
        return {"failed": f"{type(ex).__name__}: {ex}"[:300]}
    build_s = time.perf_counter() - t_build
    try:
        out, state = run_epochs(loader, cfg, _marker(proxy, marks), False)
    except Exception as ex:  # noqa: BLE001 - a timeout or a failure is this run's row
        return {"stalled" if "imeout" in type(ex).__name__ + str(ex) else "failed": f"{type(ex).__name__}: {ex}"[:300]}
    finally:
        loader.shutdown()
    out["build_s"] = build_s
    out["resume"] = check_resume(make_loader, state, out["ids"][0][cfg["resume_at"] * cfg["batch_size"] :], False)
    out["ids"] = [_exactly_once(ids, cfg["rows"]) for ids in out["ids"]]
    return _epoch_bytes(out, marks)


def _shm_files() -> set:
    """Mosaic's shared-memory files (<6 digits>_<name>, /dev/shm on Linux): a child killed mid-run leaves its own; and
    multiprocessing's semaphores (sem.mp-*), which litdata's optimize() leaves behind."""
    try:
        return {n for n in os.listdir("/dev/shm") if re.fullmatch(r"\d{6}_[a-z_]+|sem\.mp-.+", n)}
    except OSError:
        return set()


def _fmt_once(rec: dict) -> str:
    if not rec.get("ids"):
        return "-"
    parts = []
    for x in rec["ids"]:
        parts.append(
            "yes"
            if x["ok"]
            else f"no ({x['delivered']} rows, {x['duplicates']} dup, {x['missing']} missing, {x.get('foreign', 0)} foreign ids)"
        )
    return " / ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="measure", help=argparse.SUPPRESS)
    p.add_argument("cfg", nargs="?", default="", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="a smaller corpus, the quarter cache only (a few minutes)")
    p.add_argument("--workload", choices=(*WORKLOADS, "both"), default="parquet")
    p.add_argument("--files", type=int, default=None, help="parquet: Parquet files (16; --quick 8)")
    p.add_argument("--groups", type=int, default=None, help="parquet: row groups a file (8; --quick 4)")
    p.add_argument("--rows", type=int, default=128, help="parquet: rows a row group")
    p.add_argument("--payload", type=int, default=1024, help="parquet: bytes a row")
    p.add_argument("--images", type=int, default=None, help="shards: JPEGs (4096; --quick 512)")
    p.add_argument("--shards", type=int, default=None, help="shards: tar shards (16; --quick 8)")
    p.add_argument("--size", type=int, default=256, help="shards: the JPEGs' width and height")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--caches", default=None, help="quarter,whole (--quick: quarter)")
    p.add_argument(
        "--loaders", default="", help=f"comma-separated of {','.join(LOADERS)} (all; shards: all but mosaic)"
    )
    p.add_argument("--stall-s", type=float, default=120.0, help="a run with no progress this long is cut")
    p.add_argument("--cap-s", type=float, default=None, help="the most one run may take (300 s; --quick 180 s)")
    args = p.parse_args()
    if args.child:
        child_main(args.child, args.mode, args.cfg)
        return
    run_parent(args)


def _parquet_corpus(args, tmp: str, corpus: str) -> dict:
    """bench_streaming's Parquet files; their rows saved for the peers' writers (the children need no pyarrow)."""
    import numpy as np
    import pyarrow.parquet as pq

    from benchmarks.bench_streaming import write_corpus

    files = args.files or (8 if args.quick else 16)
    groups = args.groups or (4 if args.quick else 8)
    write_corpus(corpus, files, groups, args.rows, args.payload)
    n, per = files * groups * args.rows, groups * args.rows
    table = pq.read_table(corpus)
    npz = os.path.join(tmp, "rows.npz")
    payload = np.frombuffer(b"".join(table.column("payload").to_pylist()), dtype=np.uint8).reshape(n, -1)
    np.savez(npz, id=table.column("id").to_numpy(), label=table.column("label").to_numpy(), payload=payload)
    return dict(
        rows=n,
        files=files,
        rows_per_file=per,
        parts=[(npz, lo, min(lo + per, n)) for lo in range(0, n, per)],
        what=f"{n:,} rows of {args.payload:,} B in {files} Parquet files",
    )


def _shards_corpus(args, tmp: str, corpus: str) -> dict:
    """bench_shards' JPEGs (generated once, kept where bench_shards keeps them) in its WebDataset tar shards."""
    from benchmarks.bench_shards import write_shards
    from examples.train_image_classifier import write_jpeg_folder

    n, shards = args.images or (512 if args.quick else 4096), args.shards or (8 if args.quick else 16)
    images = os.path.join("/tmp/raydl-bench-shards", f"{args.size}-n{n}")
    paths = write_shards(write_jpeg_folder(images, n, 10, size=(args.size, args.size)), corpus, shards)
    what = f"{n:,} JPEGs {args.size}x{args.size} (10 classes) in {shards} WebDataset tar shards (round robin)"
    return dict(rows=n, files=shards, shards=shards, parts=[(x,) for x in paths], what=what)


def run_parent(args) -> None:
    import tempfile

    from benchmarks.common.machine import describe_machine, machine_info
    from benchmarks.common.peer_envs import ensure_venv, peer_version
    from benchmarks.common.results import Results, log

    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    caches = (args.caches or ("quarter" if args.quick else "quarter,whole")).split(",")
    loaders_of = {w: [x for x in args.loaders.split(",") if x] or DEFAULT_LOADERS[w] for w in workloads}
    loaders = [x for x in LOADERS if any(x in v for v in loaders_of.values())]
    args.cap_s = args.cap_s or (180.0 if args.quick else 300.0)
    res = Results("bench_peers" + ("" if workloads == ["parquet"] else f"-{args.workload}"), args.quick)
    info = machine_info()
    log(describe_machine(info))
    versions: dict = {}
    usable: list = []
    for name in loaders:
        if name == "raydl":
            usable.append(name)
            continue
        peer = PEER_OF[name]
        try:
            if peer not in versions:
                ensure_venv(peer, log=log, timeout_s=1200)
                versions[peer] = peer_version(peer)
                log(f"{peer}: {versions[peer]}")
            if "error" not in versions[peer]:
                usable.append(name)
        except Exception as ex:  # noqa: BLE001 - the peer's rows then say why
            versions[peer] = {"error": str(ex)[-500:]}
            log(f"{peer}: no venv: {str(ex)[-300:]}")
    res.write({"kind": "config", "machine": info, "peer_versions": versions, "workloads": workloads})
    t_start = time.perf_counter()
    lines = [describe_machine(info), "Peers: " + "; ".join(f"{k} {json.dumps(v)}" for k, v in versions.items())]
    for workload in workloads:
        tmp = tempfile.mkdtemp(prefix="bench-peers-")
        try:
            lines += run_workload(args, workload, caches, [x for x in usable if x in loaders_of[workload]], tmp, res)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the corpus, the formats, the caches
    lines.append(
        f"\nRun at {time.strftime('%Y-%m-%d %H:%M:%S %Z')} in {(time.perf_counter() - t_start) / 60:.1f} min; load "
        f"average at end {' / '.join(f'{x:.2f}' for x in os.getloadavg())}."
    )
    report = "\n".join(lines)
    print(report)
    md = res.write_text(".md", report + "\n")
    res.close()
    print(f"\nresults: {res.jsonl_path}\n         {md}")


def run_workload(args, workload: str, caches: list, usable: list, tmp: str, res) -> list:
    """The conversions and the runs of one workload; its report's lines."""
    from benchmarks.common.results import log
    from tests._s3 import FaultProxy, MotoServer, s3fs, upload_folder

    corpus = os.path.join(tmp, "corpus")
    os.makedirs(corpus)
    c = (_shards_corpus if workload == "shards" else _parquet_corpus)(args, tmp, corpus)
    data_bytes = sum(os.path.getsize(os.path.join(corpus, f)) for f in os.listdir(corpus))
    n_rows = c["rows"]
    # The peers' shards: a source file's bytes, at most a 20th of the data: Mosaic refuses a cache_limit under 4x its
    # largest shard, and the quarter cache must hold that.
    shard_bytes = min(data_bytes // c["files"], data_bytes // 20)
    config = dict(
        workload=workload,
        rows=n_rows,
        files=c["files"],
        data_bytes=data_bytes,
        shard_bytes=shard_bytes,
        latency_ms=args.latency_ms,
        batch_size=args.batch_size,
        workers=args.workers,
        epochs=args.epochs,
        caches=caches,
        resume_at_batch=(n_rows // args.batch_size) // 2,
    )
    log(f"corpus: {c['what']}, {json.dumps(config)}")
    res.write({"kind": "corpus", **config})
    field, source = ("jpg", "tar shards") if workload == "shards" else ("payload", "Parquet")

    conversions: dict = {}
    results: list = []
    shm_before = _shm_files()
    moto = MotoServer()
    proxy = None
    ray_started = False
    try:
        fs = moto.filesystem()
        fs.create_dir("corpus")
        upload_folder(corpus, fs, "corpus/data")
        proxy = FaultProxy(moto.port)
        for name in sorted({PEER_OF[x] for x in usable if x != "raydl"}):
            out = os.path.join(tmp, f"{name}-format")
            cfg = dict(parts=c["parts"], field=field, out=out, shard_bytes=shard_bytes, workers=args.workers)
            rec = run_child(name, "convert", cfg, args.stall_s, args.cap_s)
            conversions[name] = rec
            log(f"{name} conversion: {rec}")
            res.write({"kind": "conversion", "workload": workload, "loader": name, **rec})
            if "convert_s" in rec:
                for d, _, _files in os.walk(out):  # flat in both formats; sub-folders kept by name
                    rel = os.path.relpath(d, out)
                    upload_folder(d, fs, f"corpus/{name}" + ("" if rel == "." else f"/{rel}"))
        proxy.latency_s = args.latency_ms / 1000

        import ray

        for cache in caches:
            frac = {"quarter": 0.25, "whole": 1.0}[cache]
            for name in usable:
                t0 = time.perf_counter()
                base = dict(workload=workload, loader=name, cache=cache)
                run_cfg = dict(
                    workload=workload,
                    batch_size=args.batch_size,
                    workers=args.workers,
                    epochs=args.epochs,
                    rows=n_rows,
                    rows_per_file=c.get("rows_per_file"),
                    shards=c.get("shards"),
                    resume_at=config["resume_at_batch"],
                )
                if name == "raydl":
                    if not ray_started:
                        ray.init(
                            address="local", num_cpus=max(2, args.workers), include_dashboard=False, log_to_driver=False
                        )
                        ray_started = True
                    own_bytes = data_bytes
                    kw = dict(
                        filesystem=s3fs(proxy.port),
                        cache_dir=os.path.join(tmp, f"raydl-cache-{cache}"),
                        cache_limit=max(1, int(data_bytes * frac)),
                    )
                    if workload == "shards":
                        kw["transform"] = _decoded
                    base["cache_bytes"] = kw["cache_limit"]
                    run_cfg["dataset"] = "TarDataset" if workload == "shards" else "ParquetDataset"
                    rec = measure_raydl("s3://corpus/data/", kw, run_cfg, proxy, args.stall_s)
                else:
                    peer = PEER_OF[name]
                    if "convert_s" not in conversions.get(peer, {}):
                        results.append({**base, "failed": "no conversion"})
                        continue
                    own_bytes = conversions[peer]["format_bytes"]
                    base["cache_bytes"] = max(1, int(own_bytes * frac))
                    if ray_started:  # Ray's processes would take the peers' cores
                        ray.shutdown()
                        ray_started = False
                    run_cfg.update(
                        remote=f"s3://corpus/{peer}",
                        endpoint=f"http://127.0.0.1:{proxy.port}",
                        local=os.path.join(tmp, f"{name}-cache-{cache}".replace("+", "-")),
                        cache_bytes=base["cache_bytes"],
                        fresh_client=name == "mosaic+client",
                    )
                    rec = measure_peer(peer, run_cfg, proxy, args.stall_s, args.cap_s)
                rec.update(base, own_bytes=own_bytes, wall_s=time.perf_counter() - t0)
                if rec.get("bytes_per_epoch"):
                    rec["bytes_over_data"] = [b / own_bytes for b in rec["bytes_per_epoch"]]
                    rec["bytes_over_source"] = [b / data_bytes for b in rec["bytes_per_epoch"]]
                fpb = rec.pop("files_per_batch", None)
                if fpb:
                    rec["files_per_batch_mean"] = sum(fpb) / len(fpb)
                    rec["files_per_batch_min"] = min(fpb)
                log(f"{name} {cache}: {json.dumps({k: v for k, v in rec.items() if k != 'stderr_tail'})[:600]}")
                if rec.get("stderr_tail"):
                    log(f"{name} {cache} stderr tail:\n{rec['stderr_tail'][-1500:]}")
                res.write({"kind": "run", **rec})
                results.append(rec)
    finally:
        if proxy is not None:
            proxy.stop()
        moto.stop()
        if ray_started:
            import ray

            ray.shutdown()
        for name in _shm_files() - shm_before:  # what the children left in /dev/shm
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))
    return _report(args, workload, c, config, source, conversions, results)


def _report(args, workload: str, c: dict, config: dict, source: str, conversions: dict, results: list) -> list:
    from benchmarks.common.results import md_table

    data_bytes = config["data_bytes"]
    rows = []
    for r in results:
        problem = r.get("stalled") or r.get("failed")
        if problem:
            for e, d in enumerate(r.get("done_epochs") or []):
                problem += (
                    f"; epoch {e + 1} done: {d['samples_per_s']:,.0f} samples/s, "
                    f"{d['bytes'] / r['own_bytes']:.1f} x its data"
                )
            part = r.get("partial")
            if part:  # how far it got: samples/s and bytes fetched per sample so far x the rows, over its data
                sofar = part["bytes_per_sample"] * c["rows"] / r["own_bytes"]
                problem += (
                    f"; until then, epoch {part['epoch'] + 1}: {part['samples_per_s']:,.0f} samples/s over "
                    f"{part['batches']} batches, fetching at {sofar:.1f} x its data per epoch"
                )
            rows.append([r["loader"], r["cache"], problem, "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                r["loader"],
                f"{r['cache']} ({r['cache_bytes'] / 1e6:.1f} MB)",
                " / ".join(f"{x:,.0f}" for x in r["samples_per_s"]),
                " / ".join(f"{x:.2f}" for x in r["bytes_over_data"]),
                _fmt_once(r),
                f"{r['files_per_batch_mean']:.1f}",
                f"{r['first_batch_s']:.2f}" if r.get("first_batch_s") is not None else "-",
                r.get("resume", {}).get("verdict", "-"),
            ]
        )
    decode = ", each JPEG decoded with PIL + RandomResizedCrop(224) + flip + normalize" if workload == "shards" else ""
    return [
        "",
        f"# Streaming peers on {source} from S3 (bench_peers --workload {workload})",
        "",
        f"Corpus: {c['what']} ({data_bytes / 1e6:.1f} MB), {args.latency_ms:g} ms a request; {args.epochs} epochs, "
        f"{args.workers} workers, batch {args.batch_size}, shuffle on{decode}; resume state taken after batch "
        f"{config['resume_at_batch']} of epoch 1.",
        "",
        "Conversion (before the runs, not in them):",
        "",
        md_table(
            ["loader", "format", "convert s", "bytes", f"bytes / {source}", "files"],
            [["raydl", f"{source} as is", "0", f"{data_bytes:,}", "1.00", c["files"]]]
            + [
                [
                    k,
                    {"mosaic": "MDS", "litdata": "litdata chunks"}[k],
                    f"{v['convert_s']:.2f}",
                    f"{v['format_bytes']:,}",
                    f"{v['format_bytes'] / data_bytes:.2f}",
                    v["format_files"],
                ]
                if "convert_s" in v
                else [k, "-", v.get("stalled") or v.get("failed"), "-", "-", "-"]
                for k, v in conversions.items()
            ],
        ),
        "",
        md_table(
            [
                "loader",
                "cache",
                "samples/s per epoch",
                "bytes fetched / its data, per epoch",
                "each id once per epoch",
                f"source {'shards' if workload == 'shards' else 'files'} per batch",
                "first batch s",
                "mid-epoch resume",
            ],
            rows,
        ),
    ]


if __name__ == "__main__":
    main()
