"""Batches gathered from zero-copy column views (NOTE [ raydl column views ]) are exactly the take path's.

For every numeric Arrow type the views serve (and a few they leave to Arrow), over tables of one
chunk, of several chunks laid out differently per column, with empty chunks and sliced (non-zero
offset) chunks, and indices with negatives and duplicates: `ArrowDataset.raydl_collate` equals
`collate_columns` of Arrow's take and torch's `default_collate` of the rows, key for key, dtype for
dtype, shape for shape, bit for bit. The views must also be views: no copy of the table.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

import raydl
from raydl.data.columnar import ColumnViews, by_chunk, collate_columns

NUMERIC = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "float16", "float32", "float64"]
N = 37


def _values(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(kind)
    if dtype.kind == "f":
        v = rng.standard_normal(n).astype(dtype) * 100
        v[:5] = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], dtype=dtype)  # n >= 37 here
        return v
    info = np.iinfo(dtype)
    v = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    v[:2] = [info.min, info.max]
    return v


def _column(kind: str, n: int, rng: np.random.Generator) -> pa.Array:
    if kind == "bool":
        return pa.array(rng.random(n) < 0.5)
    if kind.startswith("list_"):  # fixed-size list of 3
        return pa.FixedSizeListArray.from_arrays(pa.array(_values(kind[5:], 3 * n, rng)), 3)
    if kind == "string":
        return pa.array([f"s{i}" * (i % 3) for i in range(n)])
    return pa.array(_values(kind, n, rng))


def _chunked(array: pa.Array, cuts: list, lead: int) -> pa.ChunkedArray:
    """`array` (of `lead` extra leading rows) split at `cuts`, each chunk a slice (so with an offset)."""
    bounds = [lead, *[lead + c for c in cuts], len(array)]
    return pa.chunked_array([array.slice(a, b - a) for a, b in zip(bounds, bounds[1:])], type=array.type)


def _table(kinds: list, layout: str, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    lead = 0 if layout == "one" else 5
    columns = {}
    for j, kind in enumerate(kinds):
        array = _column(kind, N + lead, rng)
        if layout == "one":
            columns[f"c{j}_{kind}"] = pa.chunked_array([array])
        elif layout == "sliced":
            columns[f"c{j}_{kind}"] = _chunked(array, [], lead)
        else:  # chunks: each column cut at its own places, an empty chunk among them
            cuts = sorted({int(c) for c in rng.integers(1, N, 2 + j % 3)} | {7})
            cuts = [*cuts[:1], cuts[0], *cuts[1:]]  # the same cut twice: an empty chunk
            columns[f"c{j}_{kind}"] = _chunked(array, cuts, lead)
    return pa.table(columns)


def _same(a, b, where: str = "batch") -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (where, a.dtype, b.dtype, a.shape, b.shape)
        if a.is_floating_point():
            assert torch.equal(a.isnan(), b.isnan()), where
            a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
            assert torch.equal(a.signbit(), b.signbit()), where  # -0.0 stays -0.0
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def _check(table: pa.Table, indices: list) -> dict:
    ds = raydl.ArrowDataset(table)
    got = ds.raydl_collate(indices)
    n = len(table)
    idx = np.array([i + n if i < 0 else i for i in indices], dtype=np.int64)
    _same(got, collate_columns(table.take(pa.array(idx)), lists_as_arrays=True), "take path")
    if got is not None:  # None: the rows' path makes the batch (NOTE [ raydl columnar batches ])
        _same(got, default_collate(ds.__getitems__(indices)), "rows")
    return got


INDICES = [int(i) for i in np.random.default_rng(7).integers(-N, N, 40)] + [3, 3, -1, 0, N - 1]


@pytest.mark.parametrize("layout", ["one", "sliced", "chunks"])
@pytest.mark.parametrize("kind", [*NUMERIC, "bool", *(f"list_{k}" for k in NUMERIC)])
def test_each_numeric_type_gathered_from_views(kind, layout):
    table = _table([kind, "string", kind], layout)
    _check(table, INDICES)
    ds = raydl.ArrowDataset(table)
    ds.raydl_collate([0])
    views, rest = ds._views
    assert sorted(views.views) == [0, 2] and views.rest == [1]  # the numbers from views, the strings by Arrow


def test_all_numeric_types_in_one_table_need_no_take():
    table = _table([*NUMERIC, "bool", "list_float32", "list_int64"], "chunks", seed=1)
    ds = raydl.ArrowDataset(table)
    _check(table, INDICES)
    ds.raydl_collate([1, 2])
    views, rest = ds._views
    assert views.rest == [] and rest is None


def test_columns_the_views_leave_to_arrow():
    """A column with a null anywhere, uint64, a fixed-size list of booleans or with a null, a variable list:
    taken by Arrow, and the batch is what it was (None where the rows must make it)."""
    rng = np.random.default_rng(2)
    with_null = pa.array([None if i == 30 else float(i) for i in range(N)])
    table = pa.table(
        {
            "nulls": with_null,
            "bool_lists": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(2 * N) < 0.5), 2),
            "var": pa.array([[1.0, 2.0]] * N),
            "x": pa.array(np.arange(N, dtype=np.float32)),
        }
    )
    ds = raydl.ArrowDataset(table)
    _check(table, [0, 1, 2, -1])  # no null in these rows: a batch by columns
    assert ds.raydl_collate([29, 30]) is None  # the null's row: the rows' path decides
    views, _ = ds._views
    assert sorted(views.views) == [3] and views.rest == [0, 1, 2]
    u64 = pa.table({"u64": pa.array(rng.integers(0, 2**63, N, dtype=np.uint64)), "x": table.column("x")})
    assert _check(u64, [0, 5]) is None  # torch's collate of Python ints past int64 is the rows' to give


def test_views_are_the_tables_own_memory():
    table = _table(["float32", "int16", "bool", "list_float64"], "chunks", seed=3)
    views = ColumnViews(table, lists_as_arrays=True)
    for pos, v in views.views.items():
        column = table.column(pos)
        for chunk, array in zip(column.chunks, v.arrays):
            if len(chunk) == 0:
                continue  # nothing to view: NumPy's own empty array
            if v.bits:
                data, offset = array
                assert data.ctypes.data == chunk.buffers()[1].address and offset == chunk.offset
            else:
                buffer = chunk.buffers()[-1]  # the values (of the list's child for a fixed-size list)
                assert buffer.address <= array.ctypes.data < buffer.address + max(buffer.size, 1)
                assert not array.flags.writeable  # a view of Arrow's buffer, not a copy


def test_batches_are_private_and_writable():
    rows = np.arange(N)
    table = pa.table(
        {
            "f": rows.astype(np.float64),
            "i": rows,
            "e": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(2 * N, dtype=np.float32)), 2),
        }
    )
    ds = raydl.ArrowDataset(table)
    before = table.to_pydict()
    batch = ds.raydl_collate(list(range(N)))
    for t in batch.values():
        t.zero_()  # a view of the table would raise (read-only) or change it
    assert table.to_pydict() == before


def test_by_chunk_groups_in_order():
    starts = np.array([0, 4, 4, 10], dtype=np.int64)  # chunk 1 is empty
    idx = np.array([11, 0, 4, 3, 9, 10, 4], dtype=np.int64)
    groups = by_chunk(starts, idx)
    assert [g[0] for g in groups] == [0, 2, 3]
    rebuilt = np.empty_like(idx)
    for chunk, where, local in groups:
        rebuilt[where] = local + starts[chunk]
    assert rebuilt.tolist() == idx.tolist()


@settings(max_examples=40, deadline=None)
@given(
    kinds=st.lists(st.sampled_from([*NUMERIC, "bool", "list_float32", "list_uint8", "string"]), min_size=1, max_size=4),
    layout=st.sampled_from(["one", "sliced", "chunks"]),
    seed=st.integers(0, 1000),
    indices=st.lists(st.integers(-N, N - 1), min_size=1, max_size=60),
)
def test_any_table_any_indices(kinds, layout, seed, indices):
    _check(_table(kinds, layout, seed), indices)
