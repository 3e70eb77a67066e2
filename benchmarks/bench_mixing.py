"""Does the shuffle mix? Batches of a class-sorted Parquet corpus, measured on a model (issue 64).

The corpus: 40 Parquet files, one class a file (10 classes, 4 files each, in class order), 4 row groups
of 200 rows a file; 16 float32 features x0..x15 (the class's mean + Gaussian noise), the label `y`, the
file's number `file` and the row's number `row`. A test set of 4,000 rows drawn from the same
distribution with uniform classes stays in memory. raydl's `cache_limit` is a quarter of the data's
bytes (and, in a full run, half), so its shuffle window is about an eighth (a quarter) of the row groups.

Each loader reads one epoch of batches of 64 with its shuffle on:
  * raydl's default (`raydl.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2)`; Ray workers on
    this one node, so one node slot: the window shuffle), and the orders the default gives at 2, 3 and 4
    nodes (one slot a node), read in-process through torch's DataLoader with
    `raydl.ParquetShuffleSampler(ds, generator, 64, node_slots=N)` over the corpus's rows in memory (the
    dataset's rows: the first 8 batches are also read through `ds` and compared; one process reading every
    slot's units through `ds` is slow, which no loader over N nodes does). The Ray workers' batches are
    checked to be the sampler's order for one node; a mismatch is a note under the table;
  * raydl `node_slots=1` (the window shuffle) and `node_slots=12` (the default before issue 64) with Ray workers;
  * torch's `RandomSampler` over the whole corpus in memory (a uniform permutation: the upper bound);
  * Ray Data `read_parquet(folder).iter_torch_batches(batch_size=64, local_shuffle_buffer_size=...)` with
    as many rows in its buffer as raydl's cache holds, and as raydl's window holds (DataContext defaults,
    progress bars off: its reader makes this 3 MB corpus one block, so the buffer is filled from every file;
    the report's notes give the blocks); also with the cache's rows and `DataContext.target_max_block_size` set
    to a file's decoded bytes (blocks of a file's size, as 128 MiB blocks are to files of 128 MiB); and as a
    user of large files gets it: a block a file (as every block of a corpus of 128 MiB files holds one file's
    rows; `ray.data.from_arrow` of the files' tables, since its reader joins these small files into one block
    even with `override_num_blocks`) in a shuffled file order (as `shuffle="files"` gives), the buffer the rows
    of raydl's cache;
  * raydl's order with a window larger than its default (half the cache): three quarters of the cache and the
    whole cache less one unit (the most `shuffle_window` accepts), at 1 and 4 nodes: what a larger window buys
    the model (its cost in bytes and samples/s: `bench_streaming --window`).

Per loader: distinct files and labels per batch, distinct files over 8 consecutive batches (mean of
every run of 8), and the test accuracy of two models trained one epoch on its batches in their order,
`Linear(16, 32) -> BatchNorm1d(32) -> ReLU -> Linear(32, 10)` and `Linear(16, 10)` (SGD lr 0.05, the
same initial weights, `torch.manual_seed(0)`; evaluated in eval mode), averaged over 3 shuffle seeds
(the loader's generator seed). Prints one JSON line per loader and cache setting and a Markdown table.

    .venv/bin/python -m benchmarks.bench_mixing            # 2 cache settings x 3 seeds, ~2.5 min on 2 cores
    .venv/bin/python -m benchmarks.bench_mixing --quick    # a quarter of the data cached, 1 seed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from benchmarks.common.machine import describe_machine, machine_info
from benchmarks.common.peers import _start_local_ray_like_raydl
from benchmarks.common.results import Results, log, md_table

FEATURES = [f"x{c}" for c in range(16)]
CLASSES = 10
FILES_PER_CLASS = 4
GROUPS = 4  # row groups a file
ROWS = 200  # rows a row group
BATCH = 64
MEAN_SCALE = 0.6  # the class means' spread against unit noise: the best a model can do is ~77% (nearest mean)


def class_means() -> np.ndarray:
    return np.random.default_rng(1234).normal(0.0, MEAN_SCALE, size=(CLASSES, len(FEATURES))).astype(np.float32)


def write_corpus(folder: str) -> dict:
    """The class-sorted corpus (file f holds class f // FILES_PER_CLASS); returns its rows in memory, in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    means = class_means()
    rng = np.random.default_rng(0)
    xs, ys, fs = [], [], []
    per_file = GROUPS * ROWS
    for f in range(CLASSES * FILES_PER_CLASS):
        c = f // FILES_PER_CLASS
        x = means[c] + rng.standard_normal((per_file, len(FEATURES)), dtype=np.float32)
        y = np.full(per_file, c, dtype=np.int64)
        fid = np.full(per_file, f, dtype=np.int64)
        row = np.arange(f * per_file, (f + 1) * per_file, dtype=np.int64)
        table = pa.table({**{n: x[:, k] for k, n in enumerate(FEATURES)}, "y": y, "file": fid, "row": row})
        pq.write_table(table, os.path.join(folder, f"part-{f:03d}.parquet"), row_group_size=ROWS)
        xs.append(x)
        ys.append(y)
        fs.append(fid)
    n = len(fs) * per_file
    return {"x": np.concatenate(xs), "y": np.concatenate(ys), "file": np.concatenate(fs), "row": np.arange(n)}


def test_set(n: int = 4000) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform classes, the corpus's distribution, another generator."""
    rng = np.random.default_rng(99)
    y = rng.integers(0, CLASSES, size=n)
    x = class_means()[y] + rng.standard_normal((n, len(FEATURES)), dtype=np.float32)
    return torch.from_numpy(x), torch.from_numpy(y)


def as_xyf(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(features B x 16, labels, file ids, row ids or None) of a batch from any loader here."""
    if isinstance(batch, dict):
        x = torch.stack([torch.as_tensor(batch[n]) for n in FEATURES], dim=1).float()
        row = torch.as_tensor(batch["row"]) if "row" in batch else None
        return x, torch.as_tensor(batch["y"]).long(), torch.as_tensor(batch["file"]).long(), row
    x, y, f, row = batch
    return x, y, f, row


def collect(batches: Iterable) -> tuple[list, float]:
    """One epoch of (x, y, file, row) batches, and its seconds."""
    t0 = time.perf_counter()
    out = [as_xyf(b) for b in batches]
    return out, time.perf_counter() - t0


def mixing(batches: list) -> dict:
    files = [torch.unique(f).numel() for _, _, f, _ in batches]
    labels = [torch.unique(y).numel() for _, y, _, _ in batches]
    runs = [
        torch.unique(torch.cat([b[2] for b in batches[i : i + 8]])).numel() for i in range(max(1, len(batches) - 7))
    ]
    return {
        "files_per_batch": float(np.mean(files)),
        "labels_per_batch": float(np.mean(labels)),
        "files_per_8_batches": float(np.mean(runs)),
        "batches": len(batches),
    }


def train_accuracy(batches: list, test: tuple, make: Callable[[], torch.nn.Module]) -> float:
    """Test accuracy of `make()` trained one epoch on `batches` in their order (SGD lr 0.05, fixed initial weights)."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    for x, y, _, _ in batches:
        if len(y) < 2:  # BatchNorm needs two rows
            continue
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return float((model(test[0]).argmax(1) == test[1]).float().mean())


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    )


def linear() -> torch.nn.Module:
    return torch.nn.Linear(16, CLASSES)


def measure(batches: list, test: tuple) -> dict:
    return {
        **mixing(batches),
        "acc_mlp": train_accuracy(batches, test, mlp),
        "acc_linear": train_accuracy(batches, test, linear),
    }


def summarize(name: str, cache: str, per_seed: list, extra: dict) -> dict:
    keys = ("files_per_batch", "labels_per_batch", "files_per_8_batches", "acc_mlp", "acc_linear", "epoch_s")
    rec = {"loader": name, "cache": cache, **extra, "seeds": [m["seed"] for m in per_seed]}
    if per_seed and "slots_settled" in per_seed[0]:  # what the loader settled (NOTE [ raydl node slots ])
        rec["slots_settled"] = [m["slots_settled"] for m in per_seed]
    for k in keys:
        vals = [m[k] for m in per_seed]
        rec[k] = float(np.mean(vals))
        if k.startswith("acc"):
            rec[k + "_range"] = [float(min(vals)), float(max(vals))]
    return rec


def in_process_order(mem_ds, ds, seed: int, nodes: int) -> torch.utils.data.DataLoader:
    """torch's DataLoader with the order raydl's default gives at `nodes` nodes (one slot a node) for generator seed
    `seed`. The loader gets the generator too: its iterator draws its base seed from it before the sampler draws the
    epoch's, as raydl's loader does, so the orders are the same. `mem_ds` (the corpus in memory, in the dataset's row
    order) or `ds` itself: the same rows; reading `ds` in one process serves all the slots from one process's units,
    which a loader over `nodes` nodes never does (slow, nothing else)."""
    import raydl

    g = torch.Generator().manual_seed(seed)
    sampler = raydl.ParquetShuffleSampler(ds, g, BATCH, node_slots=nodes)
    return torch.utils.data.DataLoader(mem_ds, batch_size=BATCH, sampler=sampler, generator=g)


def files_as_blocks(corpus: str, seed: int):
    """Ray Data over the corpus's files as one block each, in an order shuffled by `seed`."""
    import pyarrow.parquet as pq
    import ray.data

    files = sorted(os.path.join(corpus, f) for f in os.listdir(corpus) if f.endswith(".parquet"))
    order = np.random.default_rng(seed).permutation(len(files))
    return ray.data.from_arrow([pq.read_table(files[i]) for i in order])


def rows_of(batches: list) -> np.ndarray:
    return torch.cat([b[3] for b in batches]).numpy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one seed, a quarter of the data cached")
    p.add_argument("--seeds", type=int, default=3, help="shuffle seeds (the loaders' generator seeds)")
    p.add_argument("--workers", type=int, default=2, help="raydl's workers")
    p.add_argument("--skip-raydata", action="store_true")
    args = p.parse_args()
    seeds = list(range(1 if args.quick else args.seeds))
    fractions = [4] if args.quick else [4, 2]  # cache_limit = data / fraction

    import logging

    import ray

    import raydl

    logging.getLogger("raydl.stats").setLevel(logging.WARNING)  # its waits-for-data advice is about speed, not this
    run_t0 = time.perf_counter()
    res = Results("bench_mixing", args.quick)
    tmp = tempfile.mkdtemp(prefix="bench-mixing-")
    corpus = os.path.join(tmp, "corpus")
    os.makedirs(corpus)
    mem = write_corpus(corpus)
    mem_ds = torch.utils.data.TensorDataset(*(torch.from_numpy(mem[k]) for k in ("x", "y", "file", "row")))
    test = test_set()
    records: list[dict] = []
    notes: list[str] = []

    def record(name: str, cache: str, per_seed: list, extra: dict) -> None:
        rec = summarize(name, cache, per_seed, extra)
        records.append(rec)
        res.write(rec)
        print(json.dumps(rec), flush=True)

    def raydl_epochs(ds, what: str) -> list:
        """One epoch per seed of raydl.DataLoader(ds, shuffle=True) on Ray workers, each checked against the order
        torch's DataLoader gets from ParquetShuffleSampler for one node."""
        out = []
        for s in seeds:
            loader = raydl.DataLoader(
                ds, batch_size=BATCH, shuffle=True, num_workers=args.workers, generator=torch.Generator().manual_seed(s)
            )
            batches, dt = collect(loader)
            slots = getattr(loader.sampler, "slots", None)
            loader.shutdown()
            if ds.node_slots is None:
                same = np.array_equal(rows_of(batches), rows_of(collect(in_process_order(mem_ds, ds, s, 1))[0]))
                if not same:
                    notes.append(f"{what}, seed {s}: the loader's order is NOT ParquetShuffleSampler's for one node")
            out.append({"seed": s, "epoch_s": dt, "slots_settled": slots, **measure(batches, test)})
        return out

    try:
        _start_local_ray_like_raydl()  # the local Ray raydl starts for itself; Ray Data runs on it too
        info = machine_info(ray.__version__)
        log(describe_machine(info))
        probe = raydl.ParquetDataset(corpus, cache_dir=os.path.join(tmp, "probe"), cache_limit=1 << 30)
        n_rows, data_bytes = len(probe), probe.nbytes
        log(
            f"corpus: {len(probe.files)} files, {probe.num_units} row groups, {n_rows} rows, {data_bytes} bytes "
            f"(row groups {int(probe.unit_nbytes.min())}-{int(probe.unit_nbytes.max())} bytes)"
        )

        # the upper bound: a uniform permutation of the corpus in memory
        per_seed = []
        for s in seeds:
            g = torch.Generator().manual_seed(s)
            dl = torch.utils.data.DataLoader(
                mem_ds, batch_size=BATCH, sampler=torch.utils.data.RandomSampler(mem_ds, generator=g)
            )
            batches, dt = collect(dl)
            per_seed.append({"seed": s, "epoch_s": dt, **measure(batches, test)})
        record("torch RandomSampler (in memory)", "-", per_seed, {})

        for frac in fractions:
            limit = data_bytes // frac
            cache = f"1/{frac}"
            cache_dir = os.path.join(tmp, f"cache-{frac}")
            ds = raydl.ParquetDataset(corpus, cache_dir=cache_dir, cache_limit=limit)
            window = ds.shuffle_window
            extra = {"cache_limit": limit, "shuffle_window": window, "units": ds.num_units}
            log(f"cache {cache}: cache_limit {limit} bytes, window {window} of {ds.num_units} row groups")

            per_seed = raydl_epochs(ds, f"cache {cache}, raydl default")
            record("raydl default (1 node, Ray workers)", cache, per_seed, {**extra, "slots": 1})

            for nodes in (2, 3, 4):
                per_seed = []
                for s in seeds:
                    batches, dt = collect(in_process_order(mem_ds, ds, s, nodes))
                    if s == seeds[0]:  # the rows in memory are the dataset's: its first batches read through it
                        head = [as_xyf(b) for _, b in zip(range(8), in_process_order(ds, ds, s, nodes))]
                        if not np.array_equal(rows_of(head), rows_of(batches[:8])):
                            notes.append(f"cache {cache}, {nodes} nodes: the dataset's rows are not the corpus's")
                    per_seed.append({"seed": s, "epoch_s": dt, **measure(batches, test)})
                record(f"raydl default at {nodes} nodes (order)", cache, per_seed, {**extra, "slots": nodes})

            largest = int(ds.unit_nbytes.max()) + 8  # a unit as the cache counts it (its checksum trailer)
            for share, most in (("3/4", limit * 3 // 4 // largest), ("all", limit // largest - 1)):
                dsw = raydl.ParquetDataset(corpus, cache_dir=cache_dir, cache_limit=limit, shuffle_window=most)
                for nodes in (1, 4):
                    per_seed = []
                    for s in seeds:
                        batches, dt = collect(in_process_order(mem_ds, dsw, s, nodes))
                        per_seed.append({"seed": s, "epoch_s": dt, **measure(batches, test)})
                    record(
                        f"raydl order, window of {share} the cache, {nodes} node(s)",
                        cache,
                        per_seed,
                        {**extra, "shuffle_window": most, "slots": nodes},
                    )

            for slots, what in ((1, "window shuffle"), (12, "old default")):
                if slots > window:
                    notes.append(f"cache {cache}: node_slots={slots} not run (more than the window, {window} units)")
                    continue
                dss = raydl.ParquetDataset(corpus, cache_dir=cache_dir, cache_limit=limit, node_slots=slots)
                per_seed = raydl_epochs(dss, f"cache {cache}, node_slots={slots}")
                record(f"raydl node_slots={slots} ({what})", cache, per_seed, {**extra, "slots": slots})

            if args.skip_raydata:
                continue
            import ray.data

            ctx = ray.data.DataContext.get_current()
            ctx.enable_progress_bars = False
            cache_rows = int(n_rows * limit / data_bytes)  # the rows whose row groups fill raydl's cache
            default_block = ctx.target_max_block_size
            file_block = sum(a.nbytes for a in mem.values()) // (CLASSES * FILES_PER_CLASS)  # a file's rows decoded
            runs = [(cache_rows, "cache", None), (window * ROWS, "window", None), (cache_rows, "cache", file_block)]
            runs.append((cache_rows, "cache", "files"))
            for buf, what, block in runs:
                ctx.target_max_block_size = block if isinstance(block, int) else default_block
                try:
                    # a block a file, the files' order shuffled (the blocks a read of 128 MiB files with
                    # shuffle="files" streams; its reader joins this corpus's small files into one block otherwise)
                    rds = files_as_blocks(corpus, seeds[0]) if block == "files" else ray.data.read_parquet(corpus)
                    if frac == fractions[0] and what == "cache":  # how the reader cut the corpus: the buffer's input
                        blocks = [(len(b["row"]), len(set(b["file"]))) for b in rds.iter_batches(batch_size=None)]
                        rows, files = zip(*blocks)
                        notes.append(
                            f"Ray Data, target_max_block_size {ctx.target_max_block_size:,} bytes: the corpus read as "
                            f"{len(rows)} block(s) of {min(rows):,}-{max(rows):,} rows, "
                            f"{float(np.mean(files)):.1f} files a block"
                        )
                    per_seed = []
                    for s in seeds:
                        rds = files_as_blocks(corpus, s) if block == "files" else rds
                        batches, dt = collect(
                            rds.iter_torch_batches(
                                batch_size=BATCH, local_shuffle_buffer_size=buf, local_shuffle_seed=s
                            )
                        )
                        per_seed.append({"seed": s, "epoch_s": dt, **measure(batches, test)})
                finally:
                    ctx.target_max_block_size = default_block
                name = f"Ray Data, buffer = rows in raydl's {what}"
                if block == "files":
                    name += ", a block a file, files shuffled"
                elif block:
                    name += f", blocks of a file's bytes ({block:,})"
                record(name, cache, per_seed, {"local_shuffle_buffer_size": buf, "target_max_block_size": block})
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    header = [
        "cache",
        "loader",
        "window (row groups)",
        "files / batch",
        "labels / batch",
        "files / 8 batches",
        "MLP acc (min-max)",
        "linear acc (min-max)",
    ]
    rows = []
    for r in records:
        win = r.get("shuffle_window", "-")
        if r.get("slots") == 12:
            win = f"{win} ({win // 12} a slot)"
        elif r.get("local_shuffle_buffer_size") is not None:
            win = f"buffer {r['local_shuffle_buffer_size']:,} rows"
        rows.append(
            [
                r["cache"],
                r["loader"],
                win,
                f"{r['files_per_batch']:.2f}",
                f"{r['labels_per_batch']:.2f}",
                f"{r['files_per_8_batches']:.1f}",
                f"{r['acc_mlp']:.3f} ({r['acc_mlp_range'][0]:.3f}-{r['acc_mlp_range'][1]:.3f})",
                f"{r['acc_linear']:.3f} ({r['acc_linear_range'][0]:.3f}-{r['acc_linear_range'][1]:.3f})",
            ]
        )
    lines = [
        "",
        describe_machine(info),
        f"corpus: {CLASSES * FILES_PER_CLASS} files (one class a file, {CLASSES} classes), {GROUPS} row groups of "
        f"{ROWS} rows a file, {n_rows} rows, {data_bytes:,} bytes of row groups; batch {BATCH}; shuffle seeds "
        f"{seeds}; test set {len(test[1])} rows, uniform classes",
        "",
        md_table(header, rows),
        *[f"\nnote: {n}" for n in notes],
        "",
        f"Run took {(time.perf_counter() - run_t0) / 60:.1f} min.",
    ]
    report = "\n".join(lines)
    print(report)
    md = res.write_text(".md", report + "\n")
    res.close()
    print(f"\nresults: {res.jsonl_path}\n         {md}", file=sys.stderr)


if __name__ == "__main__":
    main()
