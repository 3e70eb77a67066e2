"""Arrow data in memory: rows per second through each loader, against one process's index_select ceiling.

    python -m benchmarks.bench_arrow                       # 200,000 rows, batch 1024, 2 workers, 2 epochs each
    python -m benchmarks.bench_arrow --rows 50000 --epochs 1

The table (issue 38): 16 float32 columns, an int64 label and a 64-float32 embedding as a
fixed-size list (328 bytes a row). Every loader shuffles and yields batches of `--batch` rows as
torch's default_collate gives them (dict of tensors); the loop does nothing with them (data-bound),
and the rate is the last epoch's (the first pays start-up):
  * ceiling: one process, the columns preloaded as tensors, `index_select` of each shuffled batch (torch's
    intra-op threads: every core); ceiling-one-thread: the same on one thread (not in the default list);
  * raydl columnar: `raydl.DataLoader(raydl.ArrowDataset(table))`, the defaults (NOTE [ raydl
    columnar batches ]);
  * raydl native dtypes: the same with `batch_transform=keep_columns` (the identity on the batch's columns: a
    batch transform's columns keep their Arrow dtypes, float32 here, where default_collate's path gives torch's
    float64 for Python floats, NOTE [ raydl batch transforms ]): the batches Ray Data and the ceiling give;
  * raydl per-row: the same with `collate_fn` a function calling default_collate (the rows' path);
  * torch: `torch.utils.data.DataLoader` over the same ArrowDataset, forked workers;
  * Ray Data: `ray.data.from_arrow(table).iter_torch_batches(batch_size, local_shuffle_buffer_size=...)`;
  * Hugging Face: a `datasets.Dataset` with `with_format("torch")` through torch's DataLoader.
All in one run, so the ratios compare the same minutes of the machine. Prints one JSON line per
loader, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

from benchmarks.common.results import printed_report


def make_table(rows: int) -> pa.Table:
    rng = np.random.default_rng(0)
    cols = {f"f{i}": rng.random(rows, dtype=np.float32) for i in range(16)}
    cols["label"] = rng.integers(0, 1000, rows, dtype=np.int64)
    cols["emb"] = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows * 64, dtype=np.float32)), 64)
    return pa.table(cols)


def keep_columns(columns: dict) -> dict:
    return columns


def per_row_collate(rows):
    return default_collate(rows)  # not torch's function object: raydl keeps the rows' path


def _rate(batches, epochs: int) -> tuple[float, int]:
    """Rows per second of the last of `epochs` passes of `batches()` (a fresh iterable each pass)."""
    rate, total = 0.0, 0
    for _ in range(epochs):
        t0, total = time.perf_counter(), 0
        for b in batches():
            total += len(b["label"])
        rate = total / (time.perf_counter() - t0)
    return rate, total


def ceiling(table: pa.Table, batch: int, epochs: int) -> tuple[float, int]:
    cols = {n: torch.from_numpy(table.column(n).to_numpy()) for n in table.column_names if n != "emb"}
    cols["emb"] = torch.from_numpy(table.column("emb").combine_chunks().flatten().to_numpy().reshape(-1, 64))
    g = torch.Generator().manual_seed(0)

    def batches():
        order = torch.randperm(table.num_rows, generator=g)
        for s in range(0, table.num_rows, batch):
            idx = order[s : s + batch]
            yield {n: c.index_select(0, idx) for n, c in cols.items()}

    return _rate(batches, epochs)


def one_thread(run):
    """`run()` with torch's intra-op threads set to 1: the ceiling as one core makes it (by default index_select
    uses every core, here both)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run()
    finally:
        torch.set_num_threads(threads)


def loader_rate(make, epochs: int) -> tuple[float, int]:
    loader = make()
    try:
        return _rate(lambda: loader, epochs)
    finally:
        if hasattr(loader, "shutdown"):
            loader.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--loaders", default="ceiling,raydl-columnar,raydl-native,raydl-per-row,torch,ray-data,hf")
    args = ap.parse_args()
    import ray

    import raydl

    ray.init(address="local", include_dashboard=False, num_cpus=max(2, args.workers))  # its own Ray, not a running one
    table = make_table(args.rows)
    ds = raydl.ArrowDataset(table)
    common = dict(batch_size=args.batch, shuffle=True, num_workers=args.workers, persistent_workers=True)

    def ray_data():
        rd = ray.data.from_arrow(table)
        return lambda: rd.iter_torch_batches(batch_size=args.batch, local_shuffle_buffer_size=8 * args.batch)

    def hf():
        import datasets

        hf_ds = datasets.Dataset(table).with_format("torch")
        return torch.utils.data.DataLoader(hf_ds, **common)

    runs = {
        "ceiling": lambda: ceiling(table, args.batch, args.epochs),
        "ceiling-one-thread": lambda: one_thread(lambda: ceiling(table, args.batch, args.epochs)),
        "raydl-columnar": lambda: loader_rate(lambda: raydl.DataLoader(ds, **common), args.epochs),
        "raydl-native": lambda: loader_rate(
            lambda: raydl.DataLoader(raydl.ArrowDataset(table, batch_transform=keep_columns), **common), args.epochs
        ),
        "raydl-per-row": lambda: loader_rate(
            lambda: raydl.DataLoader(ds, collate_fn=per_row_collate, **common), args.epochs
        ),
        "torch": lambda: loader_rate(lambda: torch.utils.data.DataLoader(ds, **common), args.epochs),
        "ray-data": lambda: _rate(ray_data(), args.epochs),
        "hf": lambda: loader_rate(hf, args.epochs),
    }
    results = {}
    for name in args.loaders.split(","):
        rate, rows = runs[name]()
        results[name] = rate
        print(json.dumps({"loader": name, "rows_per_s": round(rate), "rows": rows}), flush=True)
    print(f"\n{args.rows:,} rows, batch {args.batch}, {args.workers} workers, shuffled, last of {args.epochs} epochs\n")
    print("| loader | rows/s | of the ceiling | / Ray Data |")
    print("|---|---|---|---|")
    for name, rate in results.items():
        ceil = f"{rate / results['ceiling']:.3f}" if "ceiling" in results else "—"
        rd = f"{rate / results['ray-data']:.2f}×" if "ray-data" in results else "—"
        print(f"| {name} | {rate:,.0f} | {ceil} | {rd} |")
    ray.shutdown()


if __name__ == "__main__":
    with printed_report("bench_arrow", quick="--quick" in sys.argv):
        main()
