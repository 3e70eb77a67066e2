"""A batch of Arrow rows collated column by column: torch's `default_collate` of the rows, without the rows;
and a dataset's `batch_transform` run over a whole batch (NOTE [ raydl batch transforms ], below).

NOTE [ raydl columnar batches ]
`ArrowDataset` and `ParquetDataset` hand torch's DataLoader a list of row dicts, which
`default_collate` stacks back into one tensor per column: per-row Python both ways (95,000 rows/s
for 16 float columns, an int label and a 64-float embedding at batch 1024, issue 38). Where the
loader's `collate_fn` is torch's `default_collate` and the dataset has no per-row `transform`, a
raydl worker asks the dataset for the whole batch instead (`raydl_collate(indices)`): one `take`,
then each column converted as a whole through NumPy (`ArrowDataset`'s numeric columns are gathered
from zero-copy views of its table instead: NOTE [ raydl column views ]), giving exactly what
`default_collate` of the rows gives, key for key (the columns, in order), dtype for dtype and value for value:
  * integers -> int64 tensors, floats -> float64 tensors, booleans -> bool tensors (the rows hold
    Python ints, floats and bools, which torch collates so);
  * strings and binary -> the list of the batch's values (torch's collate leaves them as a list);
  * for `ArrowDataset` (rows hold lists of numbers as 1-D NumPy arrays): a list column whose rows
    all have one length -> a 2-D tensor of the list's own dtype (float32 stays float32).
Anything else, or anything the rows would not collate the same way (a null, rows of different
list lengths, uint64, nested or temporal types, duplicate column names, an empty batch): `None`,
and the worker takes the per-row path, which gives the batch (or raises the error) it always did.
`tests/test_columnar.py` compares the two paths over every Arrow type the datasets accept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

__all__ = [
    "ColumnViews",
    "RowGroupColumns",
    "by_chunk",
    "collate_columns",
    "collate_pieces",
    "group_rows",
    "numpy_batch",
    "transformed_batch",
    "transformed_row",
    "transformed_rows",
]


def collate_columns(table: pa.Table, lists_as_arrays: bool) -> Optional[dict]:
    """`default_collate` of `table`'s rows as dicts, built per column; None where only the rows give it exactly.

    `lists_as_arrays`: the rows hold lists of numbers as NumPy arrays (`ArrowDataset`), not Python lists."""
    names = table.column_names
    if table.num_rows == 0 or not names or len(set(names)) != len(names):
        return None
    out = {}
    for name, column in zip(names, table.columns):
        value = _collate_column(column, lists_as_arrays)
        if value is None:
            return None
        out[name] = value
    return out


# ---------------------------------------------------------------------- gathered from views

# NOTE [ raydl column views ]
# The take above copies each batch twice: Arrow's `take` (a new table), then each column converted to
# torch's dtype. For a table that stays (an `ArrowDataset`'s, a decoded row group), `ColumnViews` looks
# at it once and keeps, for each column the rows would collate as numbers, zero-copy NumPy views of its
# chunks' buffers (a chunk's offset applied by Arrow's `to_numpy`; a fixed-size list of numbers viewed as
# [rows, k] over its values; booleans as their bit-packed bytes). A batch is then one NumPy gather per
# column and chunk, straight into the output dtype: no Arrow take, no whole column copied, the table
# still shared. Chosen once per table, never per batch: a column of a kind `_collate_column` handles
# (integers but uint64, floats, booleans; fixed-size lists of non-boolean numbers where
# `lists_as_arrays`) with no null anywhere in it, so every batch of it is nulls-free and `_collate_column`
# would give the same tensor. Every other column (strings, binary, nulls, variable lists, ...) is taken
# by Arrow and collated by `_collate_column` as before, and a None from it is the batch's None.
# Chunks: the indices are grouped by the chunk they fall in (`by_chunk`), each chunk gathers its own.


class _Views:
    """One column's chunks as NumPy views, and how to gather rows from them (NOTE [ raydl column views ])."""

    __slots__ = ("arrays", "starts", "dtype", "shape", "bits")

    def __init__(self, arrays: list, starts: np.ndarray, dtype: np.dtype, shape: tuple, bits: bool) -> None:
        self.arrays, self.starts, self.dtype, self.shape, self.bits = arrays, starts, dtype, shape, bits

    def _take(self, chunk: int, local: np.ndarray) -> np.ndarray:
        if self.bits:  # booleans: Arrow packs 8 to a byte, least significant bit first
            data, offset = self.arrays[chunk]
            i = local + offset
            return ((data[i >> 3] >> (i & 7).astype(np.uint8)) & 1).astype(np.bool_)
        return self.arrays[chunk].take(local, axis=0).astype(self.dtype, copy=False)

    def gather(self, idx: np.ndarray, groups: Optional[list]) -> torch.Tensor:
        if groups is None:
            return torch.from_numpy(self._take(0, idx))
        out = np.empty((len(idx), *self.shape), dtype=self.dtype)
        for chunk, where, local in groups:
            out[where] = self._take(chunk, local)
        return torch.from_numpy(out)

    def fill(self, out: np.ndarray, where: np.ndarray, local: np.ndarray) -> None:
        """`out[where]` = this column's rows `local` (rows of its own table)."""
        if len(self.arrays) == 1:
            out[where] = self._take(0, local)
            return
        for chunk, w, rows in by_chunk(self.starts, local):
            out[where[w]] = self._take(chunk, rows)

    def kind(self) -> tuple:
        """What a batch of this column is (the output dtype and row shape): equal kinds gather into one tensor."""
        return (self.dtype, self.shape)


def _chunk_starts(column: pa.ChunkedArray) -> np.ndarray:
    return np.cumsum([0] + [len(c) for c in column.chunks[:-1]], dtype=np.int64)


def group_rows(which: np.ndarray) -> list:
    """The positions of `which` grouped by value, in value order: a list of (value, positions), each positions
    array ascending. One sort for the whole batch, instead of one scan of it per value."""
    if not len(which):
        return []
    order = np.argsort(which, kind="stable")
    sorted_ = which[order]
    cuts = np.flatnonzero(sorted_[1:] != sorted_[:-1]) + 1
    return [(int(which[where[0]]), where) for where in np.split(order, cuts)]


def by_chunk(starts: np.ndarray, idx: np.ndarray) -> list:
    """`idx` (in range) grouped by the chunk each falls in, chunks starting at row `starts`: a list of
    (chunk, positions in idx, row numbers within the chunk), in chunk order."""
    which = np.searchsorted(starts, idx, side="right") - 1
    return [(chunk, where, idx[where] - starts[chunk]) for chunk, where in group_rows(which)]


def _column_views(column: pa.ChunkedArray, lists_as_arrays: bool) -> Optional[_Views]:
    t = column.type
    if column.null_count or column.num_chunks == 0:
        return None
    starts = _chunk_starts(column)
    chunks = column.chunks
    try:
        if pa.types.is_boolean(t):
            arrays = [(_bytes(c.buffers()[1]), c.offset) for c in chunks]
            return _Views(arrays, starts, np.dtype(np.bool_), (), bits=True)
        if pa.types.is_integer(t) and not pa.types.is_uint64(t):
            return _Views([c.to_numpy(zero_copy_only=True) for c in chunks], starts, np.dtype(np.int64), (), False)
        if pa.types.is_floating(t):
            return _Views([c.to_numpy(zero_copy_only=True) for c in chunks], starts, np.dtype(np.float64), (), False)
        if lists_as_arrays and pa.types.is_fixed_size_list(t):
            v = t.value_type
            if not (pa.types.is_integer(v) or pa.types.is_floating(v)):
                return None
            k = t.list_size
            arrays = []
            for c in chunks:
                flat = c.flatten()  # the chunk's own rows' values (its offset applied), no copy
                if flat.null_count:
                    return None
                arrays.append(flat.to_numpy(zero_copy_only=True).reshape(len(c), k))
            return _Views(arrays, starts, np.dtype(v.to_pandas_dtype()), (k,), False)
    except pa.ArrowInvalid:  # a buffer NumPy cannot view: Arrow's path decides
        return None
    return None


def _bytes(buffer: Optional[pa.Buffer]) -> np.ndarray:
    return np.frombuffer(buffer, dtype=np.uint8) if buffer is not None else np.zeros(0, dtype=np.uint8)


class ColumnViews:
    """A table seen once for gathering batches from it (NOTE [ raydl column views ]): `collate(idx)` is
    `collate_columns(table.take(idx), lists_as_arrays)`, without taking the columns it can view."""

    def __init__(self, table: pa.Table, lists_as_arrays: bool) -> None:
        names = table.column_names
        self.names = names
        self.lists_as_arrays = lists_as_arrays
        self.usable = bool(names) and len(set(names)) == len(names)
        views = [_column_views(c, lists_as_arrays) if self.usable else None for c in table.columns]
        self.views = {pos: v for pos, v in enumerate(views) if v is not None}
        self.rest = [pos for pos, v in enumerate(views) if v is None]
        self.rest_table = table.select(self.rest) if self.rest and self.usable else None

    def collate(self, idx: np.ndarray, take_rest: Callable[[np.ndarray], pa.Table]) -> Optional[dict]:
        """The batch of rows `idx` (int64, in range); `take_rest(idx)` takes those rows of `rest_table`."""
        if not self.usable or len(idx) == 0:
            return None
        out: list = [None] * len(self.names)
        if self.rest_table is not None:
            rest = collate_columns(take_rest(idx), self.lists_as_arrays)
            if rest is None:
                return None
            for pos, value in zip(self.rest, rest.values()):
                out[pos] = value
        groups: dict = {}
        for pos, v in self.views.items():
            key = None
            if len(v.arrays) > 1:
                key = v.starts.tobytes()
                if key not in groups:
                    groups[key] = by_chunk(v.starts, idx)
            out[pos] = v.gather(idx, groups.get(key))
        return dict(zip(self.names, out))


# NOTE [ raydl gathered pieces ]
# A ParquetDataset batch mixes the rows of several decoded row groups (a window shuffle). Taking each
# row group's rows with Arrow and concatenating them was most of a streamed worker's CPU: one Arrow
# `take` per row group per batch, a concatenation, a second `take` to put the rows in order, then
# each column converted (6.3 ms of CPU for a 1024-row batch of 18 numeric columns drawn from 16 row
# groups, against 1.3 ms for reading and decoding the row groups it needs). Filling each column from
# each row group's NumPy view (`ColumnViews`) still made 18 x 16 small NumPy calls a batch.
# `RowGroupColumns` lays a decoded row group out once instead: the columns `ColumnViews` can view
# (numbers without nulls, one chunk), grouped by their NumPy dtype, are copied into one
# [columns, rows] block per dtype, and their Arrow buffers are let go (the row group is held once);
# the Arrow path, where it is needed, gets a table whose columns are zero-copy views of the blocks.
# A batch is then, per block, one fancy-indexed assignment per row group the batch touches (NumPy
# casts to torch's dtype as it assigns), in the sampler's order. Booleans (bit-packed) and columns
# of several chunks gather column by column; strings, binary, nulls and lists are taken with Arrow
# from each row group's `rest_table` and collated by `_collate_column`, as before. Where the row
# groups of a batch are not laid out alike (a null in one of them, a column of another Arrow type
# in another file), `collate_pieces` gives None and the caller takes the rows its old way, so the
# batch is always `collate_columns` of the taken rows (tests/test_columnar.py compares them).


class RowGroupColumns:
    """A decoded row group laid out for gathering batches across row groups (NOTE [ raydl gathered pieces ]).
    `table` gives it back as a table, its blocked columns views of the blocks."""

    __slots__ = ("_schema", "_arrow", "nbytes", "names", "rest", "rest_table", "blocks", "singles", "signature")

    def __init__(self, table: pa.Table) -> None:
        names = table.column_names
        usable = bool(names) and len(set(names)) == len(names)
        grouped: dict = {}
        self.names, self.rest, self.singles = names, [], {}
        for pos, column in enumerate(table.columns):
            array = _plain_numbers(column) if usable else None
            if array is not None:  # the common case, looked at without ColumnViews' generality
                out = np.dtype(np.float64) if array.dtype.kind == "f" else np.dtype(np.int64)
                grouped.setdefault((array.dtype, out), []).append((pos, array))
                continue
            v = _column_views(column, lists_as_arrays=False) if usable else None
            if v is None:
                self.rest.append(pos)
            else:
                self.singles[pos] = v
        self.rest_table = table.select(self.rest) if self.rest and usable else None
        self.blocks: list = []
        self._schema = table.schema
        self._arrow: list = list(table.columns)  # the columns not in a block (the others: None)
        for (_, dtype), columns in grouped.items():
            block = np.stack([array for _, array in columns])  # the one copy: [columns, rows]
            for pos, _ in columns:
                self._arrow[pos] = None  # its Arrow buffers are let go
            self.blocks.append((tuple(pos for pos, _ in columns), dtype, block))
        self.nbytes = sum(c.nbytes for c in self._arrow if c is not None) + sum(b.nbytes for _, _, b in self.blocks)
        self.signature = (
            usable,
            tuple(self.names),
            tuple(self.rest),
            tuple((positions, dtype, block.dtype) for positions, dtype, block in self.blocks),
            tuple((p, v.kind()) for p, v in self.singles.items()),
        )

    @property
    def table(self) -> pa.Table:
        """The row group as a table, its blocked columns zero-copy Arrow views of the blocks (for the Arrow path)."""
        arrays = list(self._arrow)
        for positions, _, block in self.blocks:
            for row, pos in enumerate(positions):
                arrays[pos] = pa.array(block[row], type=self._schema.field(pos).type)
        return pa.Table.from_arrays(arrays, schema=self._schema)


def _plain_numbers(column: pa.ChunkedArray) -> Optional[np.ndarray]:
    """A one-chunk integer (not uint64) or float column without nulls, as a zero-copy NumPy array; else None."""
    if column.num_chunks != 1 or column.null_count:
        return None
    t = column.type
    if not (pa.types.is_floating(t) or (pa.types.is_integer(t) and not pa.types.is_uint64(t))):
        return None
    try:
        return column.chunk(0).to_numpy(zero_copy_only=True)
    except pa.ArrowInvalid:
        return None


def collate_pieces(pieces: list, n: int) -> Optional[dict]:
    """`collate_columns` of a batch of `n` rows drawn from several row groups (NOTE [ raydl gathered pieces ]).

    `pieces`: (RowGroupColumns, positions in the batch, row numbers in that row group), every position of the
    batch in exactly one piece. None where the row groups are not laid out alike or the batch's rows would not
    collate by column: the caller then takes the rows with Arrow."""
    first = pieces[0][0]
    if not first.signature[0] or n == 0:
        return None
    if any(c.signature != first.signature for c, _, _ in pieces[1:]):
        return None
    out: list = [None] * len(first.names)
    if first.rest:
        taken = pa.concat_tables([c.rest_table.take(pa.array(local)) for c, _, local in pieces])
        positions = np.concatenate([where for _, where, _ in pieces])
        if not np.array_equal(positions, np.arange(n)):  # row k of `taken` is the batch's row positions[k]
            order = np.empty(n, dtype=np.int64)
            order[positions] = np.arange(n)
            taken = taken.combine_chunks().take(pa.array(order))
        rest = collate_columns(taken, lists_as_arrays=False)
        if rest is None:
            return None
        for pos, value in zip(first.rest, rest.values()):
            out[pos] = value
    for b, (positions, dtype, _) in enumerate(first.blocks):
        gathered = np.empty((len(positions), n), dtype=dtype)
        for c, where, local in pieces:
            gathered[:, where] = c.blocks[b][2][:, local]  # NumPy casts to torch's dtype as it assigns
        for row, pos in enumerate(positions):  # a tensor over its row alone: its storage is that row's bytes
            out[pos] = torch.from_numpy(gathered[row])
    for pos, v in first.singles.items():
        column = np.empty((n, *v.shape), dtype=v.dtype)
        for c, where, local in pieces:
            c.singles[pos].fill(column, where, local)
        out[pos] = torch.from_numpy(column)
    return dict(zip(first.names, out))


def _fresh(array: np.ndarray, dtype: np.dtype) -> torch.Tensor:
    """A tensor over a private, writable copy of `array` as `dtype` (Arrow's own buffers are read-only)."""
    return torch.from_numpy(np.array(array, dtype=dtype, copy=True))


def _collate_column(column: pa.ChunkedArray, lists_as_arrays: bool) -> Optional[object]:
    t = column.type
    if column.null_count:
        return None
    if pa.types.is_boolean(t):
        return _fresh(column.to_numpy(), np.bool_)
    if pa.types.is_integer(t):
        if pa.types.is_uint64(t):  # Python ints past int64's range make torch's collate raise: rows decide
            return None
        return _fresh(column.to_numpy(), np.int64)
    if pa.types.is_floating(t):
        return _fresh(column.to_numpy(), np.float64)
    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return column.to_pylist()
    if lists_as_arrays and (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return _collate_lists(column)
    return None


def _collate_lists(column: pa.ChunkedArray) -> Optional[torch.Tensor]:
    """A list column whose rows are 1-D arrays of one length: stacked, as `default_collate` stacks them."""
    v = column.type.value_type
    if not _numbers(v):
        return None
    array = column.combine_chunks()
    lengths = pc.list_value_length(array)
    low, high = pc.min_max(lengths).values()
    if low.as_py() != high.as_py():
        return None  # rows of different lengths: torch's stack raises, as the rows' path shows
    values = array.flatten()  # the rows' values, offsets applied
    if values.null_count:
        return None
    dtype = np.dtype(v.to_pandas_dtype())
    return _fresh(values.to_numpy(zero_copy_only=False), dtype).reshape(len(array), high.as_py())


# ---------------------------------------------------------------------- batch transforms

# NOTE [ raydl batch transforms ]
# `batch_transform=` on `ArrowDataset` / `ParquetDataset` is a function of a whole batch, for vectorized
# preprocessing (normalize, tokenize or decode many samples at once), as Ray Data's `map_batches`.
#   * It receives a dict {column: NumPy array}, each array one entry per row of the batch, the rows in the
#     sampler's order (`numpy_batch`); the arrays are the function's own (private copies, writable).
#   * It returns a dict {name: column}, every column with the same number of rows (at least one; it may
#     differ from the input's, e.g. several sequences packed into one row). A column is a tensor or a
#     NumPy array of numbers or booleans (first dimension: the rows), or a list (or NumPy array) of str
#     or bytes. Anything else is refused with the key named (`_output_columns`): a list of ints or a
#     ragged column has no single batched form, and raydl.pad_tokens gives one.
#   * The batch is those columns as tensors (`torch.from_numpy`: the array's own dtype) and lists,
#     whatever the loader: in a raydl worker with torch's default_collate it is built once
#     (`transformed_batch`); on every other path (torch's DataLoader, num_workers=0, a user's
#     collate_fn) the dataset's `__getitems__` returns its rows (`transformed_rows`), which
#     default_collate stacks back into exactly the same batch and a user's collate_fn receives as rows.
#   * It runs where the dataset is read: in the worker (num_workers=0: in the loader's process, as
#     torch's num_workers=0 does everything). It sees the batch's rows and nothing else, so (deterministic) its
#     batches are the same at any worker count, after a replacement and on resume; random draws in it
#     come from the worker's streams, as a per-row transform's do (ray_seed="batch" makes them
#     independent of the pool; ray_seed="sample" cannot apply, worker/fetch.py refuses it).
#   * An error in it keeps its type and gains a note naming the function and the dataset.


def numpy_batch(table: pa.Table, owner: str) -> dict:
    """`table`'s columns as the NumPy arrays a batch transform receives (NOTE [ raydl batch transforms ])."""
    names = table.column_names
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{owner}: batch_transform needs distinct column names; {twice} appear more than once")
    return {name: _numpy_column(column, name, owner) for name, column in zip(names, table.columns)}


def _numbers(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _own(array: np.ndarray) -> np.ndarray:
    return array if array.flags.writeable else array.copy()


def _no_nulls(array: Any, name: str, owner: str) -> None:
    if array.null_count:
        raise ValueError(
            f"{owner}: column {name!r} has nulls in this batch, and a NumPy array of {array.type} has no null: "
            "fill them (pyarrow.compute.fill_null) or drop those rows before building the dataset"
        )


def _numpy_column(column: pa.ChunkedArray, name: str, owner: str) -> np.ndarray:
    t = column.type
    if _numbers(t):
        _no_nulls(column, name, owner)
        return _own(column.to_numpy())
    shape = []
    inner = t
    while pa.types.is_fixed_size_list(inner):  # nested fixed-size lists: one N-D array
        shape.append(inner.list_size)
        inner = inner.value_type
    if shape and _numbers(inner):
        values = column.combine_chunks()
        for _ in shape:
            _no_nulls(values, name, owner)
            values = values.flatten()
        _no_nulls(values, name, owner)
        return _own(values.to_numpy(zero_copy_only=False)).reshape(len(column), *shape)
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and _numbers(t.value_type):
        array = column.combine_chunks()
        _no_nulls(array, name, owner)
        values = array.flatten()
        _no_nulls(values, name, owner)
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        flat = _own(values.to_numpy(zero_copy_only=False))
        out = np.empty(len(array), dtype=object)
        for i, row in enumerate(np.split(flat, np.cumsum(lengths)[:-1])):
            out[i] = row  # element by element: NumPy would make equal-length rows one 2-D array
        return out
    return _own(column.to_numpy())  # strings, bytes (None for a null), timestamps, structs, ...: as Arrow gives them


def _describe(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def transformed_batch(fn: Callable, table: pa.Table, owner: str) -> dict:
    """The batch `fn` makes of `table`: its output checked, as tensors and lists (NOTE [ raydl batch transforms ])."""
    batch = numpy_batch(table, owner)
    try:
        out = fn(batch)
    except Exception as e:
        if hasattr(e, "add_note"):  # Python 3.11+: printed with the traceback, in the worker's message too
            e.add_note(f"raised by the batch_transform {_describe(fn)} of {owner}, on a batch of {table.num_rows} rows")
        raise
    return _output_columns(out, fn, owner)


def _output_columns(out: Any, fn: Callable, owner: str) -> dict:
    where = f"{owner}: batch_transform {_describe(fn)}"
    if not isinstance(out, Mapping) or not out:
        raise TypeError(f"{where} returned {type(out).__name__} {out!r:.80}: it should return a dict of columns")
    columns = {key: _output_column(value, key, where) for key, value in out.items()}
    rows = {key: len(value) for key, value in columns.items()}
    if len(set(rows.values())) != 1:
        raise ValueError(f"{where} returned columns of different lengths {rows}: every column needs one row per sample")
    if not next(iter(rows.values())):
        raise ValueError(f"{where} returned no rows: a batch needs at least one sample")
    return columns


def _output_column(value: Any, key: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        return value
    if isinstance(value, np.ndarray) and value.ndim >= 1:
        if value.dtype.kind in "biufc":
            if not value.flags.writeable or not value.dtype.isnative:
                value = value.astype(value.dtype.newbyteorder("="), copy=True)
            return torch.from_numpy(value)
        if value.ndim == 1 and value.dtype.kind in "USO" and all(isinstance(v, (str, bytes)) for v in value.tolist()):
            return value.tolist()
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bytes)) for v in value):
        return list(value)
    raise TypeError(
        f"{where} returned {key!r} as {type(value).__name__}{_dtype_of(value)}: a column should be a tensor or NumPy "
        "array of numbers (one row per sample), or a list of str or bytes; pad a ragged column, e.g. with "
        "raydl.pad_tokens"
    )


def _dtype_of(value: Any) -> str:
    dtype = getattr(value, "dtype", None)
    return f" of {dtype}" if dtype is not None else ""


def transformed_rows(fn: Callable, table: pa.Table, owner: str) -> list:
    """The same batch as rows (dicts), which default_collate stacks back into `transformed_batch`'s output."""
    if table.num_rows == 0:
        return []  # no batch to transform: torch's collate names the empty batch
    columns = transformed_batch(fn, table, owner)
    n = len(next(iter(columns.values())))
    return [{key: value[i] for key, value in columns.items()} for i in range(n)]


def transformed_row(fn: Callable, table: pa.Table, owner: str, index: int) -> dict:
    """`ds[index]`: the one row `fn` makes of that row alone."""
    rows = transformed_rows(fn, table, owner)
    if len(rows) != 1:
        raise ValueError(
            f"{owner}[{index}]: batch_transform {_describe(fn)} made {len(rows)} rows of one; a transform that "
            "changes the number of rows (packing) makes batches, not samples: read it through a DataLoader with "
            "batch_size set"
        )
    return rows[0]
