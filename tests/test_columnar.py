"""Columnar batches (NOTE [ raydl columnar batches ]): exactly torch's default_collate of the rows, type by type.

Each case builds a dataset over one Arrow type, takes a shuffled batch both ways, as a raydl
worker's fetcher does (`MapFetcher(..., columnar=True)`) and as torch does (`__getitems__` then
`default_collate`), and compares keys, order, dtypes, shapes and values; where the rows' path
raises, the columnar one must raise the same error.
"""

from __future__ import annotations

import datetime
import decimal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import default_collate

import raydl
from raydl.data.columnar import collate_columns
from raydl.worker.fetch import MapFetcher

N = 40
INDICES = [int(i) for i in np.random.default_rng(3).permutation(N)[:16]]


def _same(a, b, where="batch") -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _both_ways(dataset, indices=INDICES):
    """(columnar result or error, rows' result or error), and whether the columnar path was taken."""
    by_column = MapFetcher(dataset, True, default_collate, columnar=True)
    took = dataset.raydl_collate(indices) is not None

    def run(fn):
        try:
            return fn(), None
        except Exception as e:  # noqa: BLE001 - the error itself is compared
            return None, e

    got = run(lambda: by_column.fetch(indices))
    want = run(lambda: default_collate(dataset.__getitems__(indices)))
    return got, want, took


def _check(dataset, columnar_expected: bool, indices=INDICES) -> None:
    (got, got_err), (want, want_err), took = _both_ways(dataset, indices)
    assert took == columnar_expected, f"columnar path taken: {took}, expected {columnar_expected}"
    if want_err is not None:
        assert got_err is not None and type(got_err) is type(want_err) and str(got_err) == str(want_err)
        return
    assert got_err is None, got_err
    _same(got, want)


def _arr(values, type_):
    return pa.array(values, type=type_)


rng = np.random.default_rng(0)
# name -> (Arrow array of N values, whether the columnar path takes it)
CASES = {
    **{
        str(t): (_arr(rng.integers(-100 if "u" not in str(t) else 0, 100, N), t), True)
        for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32())
    },
    "uint64-large": (_arr([2**64 - 1 - i for i in range(N)], pa.uint64()), False),
    "float16": (_arr(rng.random(N).astype(np.float16), pa.float16()), True),
    "float32-nan": (
        _arr(np.where(np.arange(N) % 5 == 0, np.nan, rng.random(N)).astype(np.float32), pa.float32()),
        True,
    ),
    "float64": (_arr(rng.random(N), pa.float64()), True),
    "bool": (_arr(rng.random(N) > 0.5, pa.bool_()), True),
    "string": (_arr([f"s{i}" * (i % 3) for i in range(N)], pa.string()), True),
    "large_string": (_arr([f"é{i}" for i in range(N)], pa.large_string()), True),
    "binary": (_arr([bytes([i]) * (i % 4) for i in range(N)], pa.binary()), True),
    "large_binary": (_arr([bytes([i, i]) for i in range(N)], pa.large_binary()), True),
    "fixed_size_binary": (_arr([bytes([i, 1, 2]) for i in range(N)], pa.binary(3)), True),
    "list<float32>": (_arr([rng.random(4).astype(np.float32) for _ in range(N)], pa.list_(pa.float32())), True),
    "fixed_size_list<float32>": (
        _arr([rng.random(8).astype(np.float32) for _ in range(N)], pa.list_(pa.float32(), 8)),
        True,
    ),
    "large_list<int16>": (_arr([[i, i + 1] for i in range(N)], pa.large_list(pa.int16())), True),
    "list<bool>": (_arr([[i % 2 == 0] * 3 for i in range(N)], pa.list_(pa.bool_())), True),
    "list<int64>-ragged": (_arr([list(range(i % 3)) for i in range(N)], pa.list_(pa.int64())), False),
    "list<float64>-null-inside": (
        _arr([[1.0, None] if i == 7 else [1.0, 2.0] for i in range(N)], pa.list_(pa.float64())),
        None,
    ),
    "list<string>": (_arr([["a", "b"] for _ in range(N)], pa.list_(pa.string())), False),
    "int64-nulls": (_arr([None if i % 4 == 0 else i for i in range(N)], pa.int64()), False),
    "string-nulls": (_arr([None if i % 4 == 0 else "x" for i in range(N)], pa.string()), False),
    "timestamp": (
        _arr([datetime.datetime(2026, 1, 1) + datetime.timedelta(hours=i) for i in range(N)], pa.timestamp("us")),
        False,
    ),
    "date": (_arr([datetime.date(2026, 1, 1 + i % 28) for i in range(N)], pa.date32()), False),
    "decimal": (_arr([decimal.Decimal(i) / 4 for i in range(N)], pa.decimal128(10, 2)), False),
    "struct": (
        _arr([{"a": i, "b": float(i)} for i in range(N)], pa.struct([("a", pa.int64()), ("b", pa.float64())])),
        False,
    ),
    "dictionary": (pa.array([f"c{i % 3}" for i in range(N)]).dictionary_encode(), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_column_of_each_type_is_torchs_batch(name):
    array, columnar = CASES[name]
    if columnar is None:  # a null inside one row's list: only batches holding that row go per row
        columnar = 7 not in INDICES
    _check(raydl.ArrowDataset(pa.table({"x": array, "label": pa.array(range(N))})), columnar)


def test_every_type_in_one_table_and_the_common_shape():
    """All columns the columnar path takes, together, from a table of several record batches; and the issue's
    table's shape (16 float32 columns, an int64 label, a 64-float32 fixed-size list)."""
    taken = {name: array for name, (array, columnar) in CASES.items() if columnar}
    table = pa.table(taken)
    chunked = pa.Table.from_batches(table.to_batches(max_chunksize=7))
    for t in (table, chunked):
        _check(raydl.ArrowDataset(t), True)
    wide = {f"f{i}": rng.random(N).astype(np.float32) for i in range(16)}
    wide["label"] = rng.integers(0, 10, N)
    wide["emb"] = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(N * 64).astype(np.float32)), 64)
    batch = MapFetcher(raydl.ArrowDataset(wide), True, default_collate, columnar=True).fetch(INDICES)
    assert batch["emb"].shape == (16, 64) and batch["emb"].dtype == torch.float32 and batch["f0"].dtype == torch.float64
    _check(raydl.ArrowDataset(wide), True)


def test_per_row_paths_are_kept():
    """A transform, a user collate_fn, or an index out of range: the rows' path (and its error), as before."""
    table = pa.table({"x": pa.array(range(N))})
    assert raydl.ArrowDataset(table, transform=lambda r: r).raydl_collate(INDICES) is None
    assert MapFetcher(raydl.ArrowDataset(table), True, lambda rows: rows, columnar=False).fetch([1, 2]) == [
        {"x": 1},
        {"x": 2},
    ]
    _check(raydl.ArrowDataset(table), True, indices=[-1, 0, -N])  # negative indices wrap, as __getitems__'s
    with pytest.raises(IndexError):
        MapFetcher(raydl.ArrowDataset(table), True, default_collate, columnar=True).fetch([0, N])
    assert collate_columns(table.slice(0, 0), lists_as_arrays=True) is None
    chunked = pa.Table.from_batches(table.to_batches(max_chunksize=7))
    _check(raydl.ArrowDataset(chunked), False, indices=[])  # no index: torch's collate error, both ways


def test_batches_are_writable_and_private():
    """Each tensor owns its memory (Arrow's buffers are read-only and shared): writing one changes nothing else."""
    ds = raydl.ArrowDataset({"x": np.arange(N, dtype=np.int64), "v": np.ones(N, dtype=np.float64)})
    a = ds.raydl_collate([0, 1, 2])
    a["x"] += 100
    assert ds.raydl_collate([0, 1, 2])["x"].tolist() == [0, 1, 2]


def test_parquet_numeric_and_string_columns(tmp_path, ray_session):
    """ParquetDataset: numeric and string columns by column over several row groups; a list column (Python lists
    in its rows, which torch's collate transposes) keeps the rows' path."""
    table = pa.table(
        {
            "f": rng.random(N).astype(np.float32),
            "i": pa.array(range(N), type=pa.int32()),
            "s": pa.array([f"r{i}" for i in range(N)]),
            "b": pa.array(rng.random(N) > 0.5),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=9)
    _check(raydl.ParquetDataset(str(tmp_path / "a.parquet"), cache_dir=str(tmp_path / "c")), True)
    listed = table.append_column("l", pa.array([[1.0, 2.0]] * N))
    pq.write_table(listed, tmp_path / "b.parquet", row_group_size=9)
    _check(raydl.ParquetDataset(str(tmp_path / "b.parquet"), cache_dir=str(tmp_path / "d")), False)


def test_a_loader_gives_torchs_batches_by_column(ray_session):
    """Through Ray workers (the columnar path on), batch for batch what torch's DataLoader gives over the same data."""
    table = pa.table({name: array for name, (array, columnar) in CASES.items() if columnar})
    ds = raydl.ArrowDataset(table)
    g = torch.Generator().manual_seed(5)
    want = list(torch.utils.data.DataLoader(ds, batch_size=6, shuffle=True, generator=g))
    g = torch.Generator().manual_seed(5)
    got = list(raydl.DataLoader(ds, batch_size=6, shuffle=True, generator=g, num_workers=2, timeout=120))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        _same(a, b)


def test_parquet_batches_gathered_across_row_groups(tmp_path, ray_session, monkeypatch):
    """NOTE [ raydl gathered pieces ]: batches drawn from many row groups of several files, every column type the
    Parquet path collates (numbers in blocks, booleans column by column, strings and binary with Arrow), at batch
    sizes from 1 to the whole dataset and with repeated indices: exactly default_collate of the rows. A file whose
    row group holds a null where the others hold none makes its batches take the Arrow path, still exact (and a
    batch holding the null's row raises torch's collate error, both ways)."""
    import raydl.data.parquet as parquet_module

    names = [n for n, (_, columnar) in CASES.items() if columnar is True and "list" not in n]
    table = pa.table({n: CASES[n][0] for n in names})
    folder = tmp_path / "data"
    folder.mkdir()
    for f in range(3):
        pq.write_table(table, folder / f"p{f}.parquet", row_group_size=7)
    holed = table.set_column(
        names.index("int32"), "int32", pa.array([None if i == 9 else i for i in range(N)], pa.int32())
    )
    pq.write_table(holed, folder / "p3.parquet", row_group_size=7)  # its second row group has the null
    ds = raydl.ParquetDataset(str(folder), cache_dir=str(tmp_path / "cache"))
    holed_unit = [u for u in range(ds.num_units) if ds.describe_unit(u) == f"row group 1 of {ds.files[3]}"]
    real, gathered = parquet_module.collate_pieces, []
    monkeypatch.setattr(parquet_module, "collate_pieces", lambda p, n: gathered.append(real(p, n)) or gathered[-1])
    order = [int(i) for i in ds.shuffled_order(7)]
    batches = [order[s : s + size] for size in (1, 5, 64, len(order)) for s in range(0, len(order), size)]
    batches += [[3, 3, 50, 3], [len(ds) - 1, 0, len(ds) - 1]]
    for indices in batches:
        gathered.clear()
        (got, got_err), (want, want_err), _ = _both_ways(ds, indices)
        if want_err is not None:  # the null's row itself: torch's collate error, both ways
            assert type(got_err) is type(want_err) and str(got_err) == str(want_err)
        else:
            assert got_err is None, got_err
            _same(got, want)
        units = set(ds.units_of(indices).tolist())
        with_hole = bool(units & set(holed_unit))
        refused = (with_hole and len(units) > 1) or 3 * N + 9 in indices  # laid out unlike the others; the null
        assert all((g is None) == refused for g in gathered), (indices, units)
        assert gathered, "the gather was not tried"
    assert ds.raydl_collate([[0, 1], [2, 3]]) is None  # not a list of indices: the rows' path decides (and raises)
    assert ds.__getitems__([]) == []  # no index: no row (the rows' path, as before the gather)


def test_parquet_gathered_columns_own_their_memory(tmp_path, ray_session):
    """Columns gathered from one block (NOTE [ raydl gathered pieces ]) are tensors whose storage is their own bytes,
    as default_collate's: saving one does not carry the others (a tensor indexed out of the whole block would)."""
    table = pa.table({f"f{i}": rng.random(N).astype(np.float32) for i in range(4)})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=9)
    ds = raydl.ParquetDataset(str(tmp_path / "a.parquet"), cache_dir=str(tmp_path / "c"))
    batch = ds.raydl_collate(INDICES)
    assert batch is not None
    for t in batch.values():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
