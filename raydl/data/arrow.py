"""`raydl.ArrowDataset`: a map-style dataset over a pyarrow Table, one copy per node under raydl.

NOTE [ raydl arrow ]
Why: a dataset of Python objects (a list of paths, a dict of captions) is copied into every
worker: raydl's actors each unpickle their own, and torch's forked workers copy it page by page
as reference counts are written (pytorch/pytorch#13246). Arrow keeps the same data in a few
large immutable buffers and no per-row Python objects, so it can be shared instead:
  * in memory (a Table, Parquet, CSV, pandas, a dict of columns): the first raydl loader puts
    the table into Ray's object store (`ray.put`, whose pickling keeps Arrow buffers out of
    band) and the driver's dataset then reads that object-store copy too. Every worker of a
    node maps the same buffers, read-only: one copy per node, driver included. The object stays
    as long as the dataset object lives, so the next loader over it puts nothing;
  * memory-mapped (uncompressed Arrow IPC / Feather files): pickled as paths; each process maps
    the files again, and the OS page cache is the one copy. A worker on a node where a file is
    missing (or has another size) reads the table from the object store instead, when raydl put
    it there: it does when the cluster has more than one node (see NOTE [ raydl shared memory ]
    in data/share.py, which also covers Hugging Face `datasets` cache files);
  * a Hugging Face `datasets.Dataset` keeps its own tables, pickled the way `datasets` pickles
    them (cache files by path, in-memory tables by value), with the same sharing rules.
With plain pickle (torch's spawn start method, copy.deepcopy) an in-memory table is copied and
a memory-mapped one is reopened by path. torch's forked workers share every kind for free:
Arrow buffers hold no reference counts, so reading them writes nothing.
Reading: `__getitems__` takes a whole batch with one vectorized `Table.take` (one per record
batch the indices fall in, for a table of several chunks: pyarrow's take on a chunked string
column copies the whole column first), converts it to Python column by column, then builds rows (and applies `transform` per row); `ds[i]` slices one
row without copying the table. A `batch_transform` takes the batch's columns instead (NOTE [ raydl batch transforms ]
in data/columnar.py). Rows hold Python values (int, float, str, bytes, None, lists),
except lists of numbers, which become 1-D NumPy arrays (so `default_collate` stacks them).
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
from torch.utils.data import Dataset

from .columnar import ColumnViews, by_chunk, transformed_batch, transformed_row, transformed_rows

__all__ = ["ArrowDataset", "check_columns_and_transform"]

_PARQUET = (".parquet", ".pq")
_IPC = (".arrow", ".feather", ".ipc")
_CSV = (".csv",)
_SUFFIXES = _PARQUET + _IPC + _CSV
# An IPC read that allocates more than this was decompressed, not mapped.
_MAPPED_SLACK_BYTES = 1 << 20


def check_columns_and_transform(
    owner: str, columns: Any, transform: Any, batch_transform: Any = None
) -> Optional[list]:
    """The `columns=`, `transform=` and `batch_transform=` arguments of a row dataset, checked: the columns as a
    list (or None)."""
    if columns is not None:
        if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
            raise TypeError(f"{owner}: columns should be a list of column names, got {columns!r}")
        columns = list(columns)
    for name, fn in (("transform", transform), ("batch_transform", batch_transform)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{owner}: {name} should be callable, got {fn!r}")
    if transform is not None and batch_transform is not None:
        raise ValueError(
            f"{owner}: transform= (one row at a time) and batch_transform= (the whole batch) were both given; pass "
            "one: do the per-row work inside batch_transform, or keep transform= and make the batch in collate_fn"
        )
    return columns


class ArrowDataset(Dataset):
    """A map-style dataset over a pyarrow Table, in place of a dataset of Python objects.

    Example:
        >>> import raydl
        >>> ds = raydl.ArrowDataset({"path": ["a.jpg", "b.jpg", "c.jpg"], "label": [0, 1, 0]})
        >>> ds[1]
        {'path': 'b.jpg', 'label': 1}
        >>> next(iter(raydl.DataLoader(ds, batch_size=2)))["label"].tolist()
        [0, 1]

    Args:
        source: a `pyarrow.Table` or `RecordBatch`; a path, or a list of paths, to Parquet
            (``.parquet``, ``.pq``), Arrow IPC / Feather (``.arrow``, ``.feather``, ``.ipc``,
            memory-mapped) or CSV (``.csv``) files, or to a folder of them; a pandas DataFrame;
            a dict of columns; or a Hugging Face ``datasets.Dataset``.
        columns (list of str, optional): keep only these columns, in this order. Defaults to
            ``None`` (all).
        transform (callable, optional): applied to each row (a dict) to make the sample, e.g.
            to open an image or tokenize a caption. Defaults to ``None`` (the row itself).
        batch_transform (callable, optional): applied to each whole batch, in the worker, for
            vectorized preprocessing (as Ray Data's ``map_batches``). It receives a dict
            {column: NumPy array} of the batch's rows in the sampler's order (numbers in their
            Arrow dtype, fixed-size lists as N-D arrays, variable-length lists as object arrays
            of 1-D arrays, strings and bytes as object arrays; private, writable copies), and
            returns a dict of columns of equal length: tensors or NumPy arrays of numbers, or
            lists of str / bytes. The batch is those columns as tensors (their own dtype) and
            lists. ``raydl.pad_tokens`` / ``pack_tokens`` turn a column of token lists into
            padded or packed tensors. Not with `transform`. Defaults to ``None``. Details: NOTE
            [ raydl batch transforms ] in data/columnar.py.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: an unknown column, a file that is not of its kind, a folder with no
            supported files or with several kinds, both `transform` and `batch_transform`.
        TypeError: a source that is not tabular.

    See NOTE [ raydl arrow ] for how the table is shared between raydl's workers.
    """

    def __init__(
        self,
        source: Any,
        *,
        columns: Optional[Sequence[str]] = None,
        transform: Optional[Callable[[dict], Any]] = None,
        batch_transform: Optional[Callable[[dict], dict]] = None,
    ) -> None:
        columns = check_columns_and_transform("ArrowDataset", columns, transform, batch_transform)
        self._columns = columns
        self._transform = transform
        self._batch_transform = batch_transform
        self._hf: Any = None  # the Hugging Face dataset this reads, if any
        self._mapped: Optional[tuple] = None  # the memory-mapped files this reads, if any
        self._ref: Any = None  # the object-store copy, once a raydl loader made one
        self._ref_owner: Any = None
        self._taker: Optional[_Taker] = None  # the table's takes, by record batch
        self._views: Optional[tuple] = None  # (ColumnViews, _Taker of its other columns), once a batch asked
        self._table = _project(_read(source, columns, self), columns)

    # ------------------------------------------------------------------ reading

    @property
    def table(self) -> pa.Table:
        """The (projected) pyarrow Table this dataset reads."""
        return self._table

    @property
    def column_names(self) -> list:
        return self._table.column_names

    @property
    def raydl_batch_transform(self) -> Optional[Callable[[dict], dict]]:
        """The `batch_transform` this dataset applies to each batch, if any."""
        return self._batch_transform

    @property
    def is_memory_mapped(self) -> bool:
        """Whether the table is read from memory-mapped files (reopened by path in each process)."""
        return self._mapped is not None

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, index: Any) -> Any:
        i = self._check_index(index)
        if self._batch_transform is not None:
            return transformed_row(self._batch_transform, self._table.slice(i, 1), "ArrowDataset", i)
        row = _to_rows(self._table.slice(i, 1))[0]
        return self._transform(row) if self._transform is not None else row

    def __getitems__(self, indices: Sequence[Any]) -> list:
        """The samples at `indices`: one vectorized `take` for the whole batch, then per-row transforms (or the
        batch transform's rows)."""
        idx = self._in_range(indices)
        if idx is None:
            return [self[i] for i in indices]  # odd index types: let __getitem__ name the bad one
        if self._batch_transform is not None:
            return transformed_rows(self._batch_transform, self._take_table(idx), "ArrowDataset")
        rows = _to_rows(self._take_table(idx))
        if self._transform is not None:
            return [self._transform(r) for r in rows]
        return rows

    def raydl_collate(self, indices: Sequence[Any]) -> Optional[dict]:
        """torch's `default_collate` of the samples at `indices`, built column by column in a raydl worker
        (NOTE [ raydl columnar batches ] in data/columnar.py); None where the per-row path must make it."""
        if self._transform is not None:
            return None
        idx = self._in_range(indices)
        if idx is None or (self._batch_transform is not None and len(idx) == 0):
            return None
        if self._batch_transform is not None:
            return transformed_batch(self._batch_transform, self._take_table(idx), "ArrowDataset")
        if self._views is None:  # once per table (NOTE [ raydl column views ] in data/columnar.py)
            views = ColumnViews(self._table, lists_as_arrays=True)
            self._views = (views, _Taker(views.rest_table) if views.rest_table is not None else None)
        views, rest = self._views
        return views.collate(idx, rest.take if rest is not None else _no_rest)

    def _in_range(self, indices: Sequence[Any]) -> Optional[np.ndarray]:
        """`indices` as int64 row numbers (negative ones wrapped); None for index types NumPy cannot take.
        Raises __getitem__'s IndexError for the first one out of range."""
        n = self._table.num_rows
        try:
            idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError):
            return None
        if not idx.size:
            return idx
        low = idx.min()
        if low < -n or idx.max() >= n:
            bad = next(int(i) for i in idx if not -n <= i < n)
            self._check_index(bad)
        return idx if low >= 0 else np.where(idx < 0, idx + n, idx)  # a sampler's indices are rarely negative

    def _take_table(self, idx: np.ndarray) -> pa.Table:
        """The rows at `idx` (in range), in that order (`_Taker`)."""
        if self._taker is None:
            self._taker = _Taker(self._table)
        return self._taker.take(idx)

    def _check_index(self, index: Any) -> int:
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"ArrowDataset indices are integers, got {index!r} ({type(index).__name__})") from None
        n = self._table.num_rows
        if not -n <= i < n:
            raise IndexError(f"ArrowDataset index {i} is out of range for a dataset of {n} rows")
        return i + n if i < 0 else i

    def __repr__(self) -> str:
        where = f", memory-mapped from {len(self._mapped)} file(s)" if self._mapped else ""
        where += ", from a Hugging Face dataset" if self._hf is not None else ""
        return f"ArrowDataset({len(self)} rows, columns={self.column_names}{where})"

    # ------------------------------------------------------------------ pickling (NOTE [ raydl arrow ])

    def __reduce__(self):
        fns = (self._transform, self._batch_transform)
        if self._mapped is not None:
            return _reopen, (self._mapped, self._columns, fns)
        if self._hf is not None:
            return _from_hf, (self._hf, self._columns, fns)
        return _from_table, (self._table, fns)

    def _raydl_ship_reduce(self, ctx: Any) -> Any:
        """How raydl's payload pickler ships this dataset (NOTE [ raydl shared memory ] in data/share.py)."""
        if self._mapped is not None:
            fallback = ctx.fallback_ref(self, lambda: self._table)
            return _reopen_or_shared, (
                self._mapped,
                ctx.fingerprints(self._mapped),
                fallback,
                self._columns,
                (self._transform, self._batch_transform),
            )
        if self._hf is not None:
            return self.__reduce__()  # the pickler ships the dataset's tables
        return _from_shared, (self._shared_ref(), (self._transform, self._batch_transform))

    def _shared_ref(self) -> Any:
        """The table in the object store, put once; the driver then reads that copy as well."""
        import ray

        ctx = ray.get_runtime_context()
        owner = (ctx.get_node_id(), ctx.get_job_id())
        if self._ref is None or self._ref_owner != owner:  # a Ray started later cannot use an old ref
            self._ref = ray.put(self._table)
            self._ref_owner = owner
            self._table = ray.get(self._ref)  # zero-copy view of the object store: the heap copy goes
            self._taker = self._views = None
            pa.default_memory_pool().release_unused()
        return self._ref


class _Taker:
    """A table's rows at some indices (in range), in that order: one take per record batch they fall in.

    `Table.take` on a column of several chunks concatenates them first for variable-width
    types (strings; pyarrow 26): a copy of the whole column per batch. A file read as many
    record batches (IPC, Parquet row groups) is such a table, so the indices are split by
    record batch instead, each batch takes only its rows, and the batch's rows are put in order.
    """

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.batches: Optional[list] = None  # the table's record batches, for multi-chunk takes
        self.starts: Optional[np.ndarray] = None  # row offset of each of them

    def take(self, idx: np.ndarray) -> pa.Table:
        if len(idx) == 0 or all(c.num_chunks <= 1 for c in self.table.columns):
            return self.table.take(pa.array(idx, type=pa.int64()))
        if self.batches is None:
            self.batches = self.table.to_batches()
            self.starts = np.cumsum([0] + [b.num_rows for b in self.batches[:-1]], dtype=np.int64)
        pieces, places = [], []
        for b, where, local in by_chunk(self.starts, idx):
            pieces.append(self.batches[b].take(pa.array(local, type=pa.int64())))
            places.append(where)
        order = np.empty(len(idx), dtype=np.int64)
        order[np.concatenate(places)] = np.arange(len(idx))  # output row k is row order[k] of the pieces
        return pa.Table.from_batches(pieces, schema=self.table.schema).combine_chunks().take(pa.array(order))


def _no_rest(idx: np.ndarray) -> pa.Table:
    raise AssertionError("every column was gathered from views: nothing to take")


# ---------------------------------------------------------------------- rebuilding (module level: picklable)
# `fns` is the pair (transform, batch_transform).


def _bare(columns: Optional[list], fns: tuple) -> ArrowDataset:
    ds = ArrowDataset.__new__(ArrowDataset)
    ds._columns = columns
    ds._transform, ds._batch_transform = fns
    ds._hf = ds._mapped = ds._ref = ds._ref_owner = ds._taker = ds._views = None
    return ds


def _from_table(table: pa.Table, fns: tuple) -> ArrowDataset:
    ds = _bare(None, fns)
    ds._table = table
    return ds


def _from_shared(ref: Any, fns: tuple) -> ArrowDataset:
    import ray

    return _from_table(ray.get(ref), fns)


def _from_hf(hf: Any, columns: Optional[list], fns: tuple) -> ArrowDataset:
    ds = _bare(columns, fns)
    ds._hf = hf
    ds._table = _project(_hf_table(hf), columns)
    return ds


def _reopen(paths: tuple, columns: Optional[list], fns: tuple) -> ArrowDataset:
    ds = _bare(columns, fns)
    ds._table = _project(_read_ipc_files(list(paths), ds), columns)
    return ds


def _reopen_or_shared(
    paths: tuple, fingerprints: list, fallback: Any, columns: Optional[list], fns: tuple
) -> ArrowDataset:
    from .share import files_here

    if files_here(paths, fingerprints, fallback, "ArrowDataset"):
        return _reopen(paths, columns, fns)
    return _from_shared(fallback, fns)


# ---------------------------------------------------------------------- sources


def _read(source: Any, columns: Optional[list], ds: ArrowDataset) -> pa.Table:
    """Any supported source as a pyarrow Table; records on `ds` what pickling needs."""
    if isinstance(source, ArrowDataset):
        source = source.table
    if isinstance(source, pa.Table):
        return source
    if isinstance(source, pa.RecordBatch):
        return pa.Table.from_batches([source])
    if _is_hf_dataset(source):
        ds._hf = source
        return _hf_table(source)
    if _is_pandas(source):
        return pa.Table.from_pandas(source, preserve_index=False)
    if isinstance(source, Mapping):
        try:
            return pa.table(dict(source))
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise ValueError(
                f"ArrowDataset: this dict of columns is not a table ({e}); pass equal-length columns"
            ) from e
    if isinstance(source, (str, os.PathLike)):
        return _read_paths([source], columns, ds)
    if isinstance(source, (list, tuple)) and source and all(isinstance(p, (str, os.PathLike)) for p in source):
        return _read_paths(list(source), columns, ds)
    raise TypeError(
        f"ArrowDataset cannot read a {type(source).__module__}.{type(source).__qualname__}: pass a pyarrow "
        "Table or RecordBatch, a path (or list of paths, or a folder) of Parquet / Arrow IPC / Feather / CSV "
        "files, a pandas DataFrame, a dict of columns, or a Hugging Face datasets.Dataset"
    )


def _is_hf_dataset(source: Any) -> bool:
    import sys

    hf = sys.modules.get("datasets")
    if hf is None:
        return False
    if isinstance(source, (getattr(hf, "IterableDataset", ()), getattr(hf, "DatasetDict", ()))):
        raise TypeError(
            f"ArrowDataset needs a map-style Hugging Face datasets.Dataset, got a {type(source).__name__}"
            + (
                ": pick a split, e.g. ds['train']"
                if isinstance(source, hf.DatasetDict)
                else ": load it without streaming=True"
            )
        )
    return isinstance(source, hf.Dataset)


def _hf_table(hf: Any) -> pa.Table:
    # Zero-copy slices of the dataset's own (memory-mapped) table when it has no indices
    # mapping; a select/shuffle/filter mapping is taken into a new table.
    return hf.with_format("arrow")[:]


def _is_pandas(source: Any) -> bool:
    import sys

    pd = sys.modules.get("pandas")
    return pd is not None and isinstance(source, pd.DataFrame)


def _read_paths(paths: list, columns: Optional[list], ds: ArrowDataset) -> pa.Table:
    files = []
    for p in map(os.fspath, paths):
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p) if f.lower().endswith(_SUFFIXES))
            if not found:
                raise ValueError(f"ArrowDataset: folder {p} holds no {'/'.join(_SUFFIXES)} files")
            files += found
        elif os.path.exists(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"ArrowDataset: no such file or folder: {p}")
    kinds = {_kind(f) for f in files}
    if len(kinds) > 1:
        raise ValueError(f"ArrowDataset: files of several kinds ({', '.join(sorted(kinds))}) in {paths}; pass one kind")
    (kind,) = kinds
    if kind == "ipc":
        return _read_ipc_files(files, ds)
    tables = [_read_parquet(f, columns) if kind == "parquet" else _read_csv(f) for f in files]
    return _concat(tables, files)


def _kind(path: str) -> str:
    low = path.lower()
    if low.endswith(_PARQUET):
        return "parquet"
    if low.endswith(_IPC):
        return "ipc"
    if low.endswith(_CSV):
        return "csv"
    raise ValueError(
        f"ArrowDataset: cannot tell the format of {path}: its name should end with one of {', '.join(_SUFFIXES)}"
    )


def _read_parquet(path: str, columns: Optional[list]) -> pa.Table:
    import pyarrow.parquet as pq

    try:
        if columns is not None:
            _check_columns(columns, pq.read_schema(path).names)
        return pq.read_table(path, columns=columns)
    except pa.ArrowException as e:
        raise ValueError(f"ArrowDataset: {path} is not a readable Parquet file: {e}") from None


def _read_csv(path: str) -> pa.Table:
    import pyarrow.csv as pacsv

    try:
        return pacsv.read_csv(path)
    except pa.ArrowException as e:
        raise ValueError(f"ArrowDataset: {path} is not a readable CSV file: {e}") from None


def _read_ipc_files(files: list, ds: ArrowDataset) -> pa.Table:
    """Memory-map Arrow IPC files (file or stream format); a compressed file is decompressed, with a warning."""
    before = pa.total_allocated_bytes()
    tables = []
    for path in files:
        try:
            source = pa.memory_map(path, "r")
        except FileNotFoundError:
            raise FileNotFoundError(f"ArrowDataset: no such file: {path}") from None
        try:
            tables.append(pa.ipc.open_file(source).read_all())
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                tables.append(pa.ipc.open_stream(source).read_all())  # e.g. Hugging Face cache files
            except pa.ArrowInvalid as e:
                raise ValueError(f"ArrowDataset: {path} is not an Arrow IPC / Feather file: {e}") from None
    table = _concat(tables, files)
    if pa.total_allocated_bytes() - before > _MAPPED_SLACK_BYTES:
        warnings.warn(
            f"ArrowDataset: {files[0] if len(files) == 1 else f'{len(files)} files'} could not be memory-mapped "
            "(compressed) and was read into memory; write it with compression='uncompressed' to map it",
            stacklevel=4,
        )
        ds._mapped = None
    else:
        ds._mapped = tuple(os.path.abspath(f) for f in files)
    return table


def _concat(tables: list, files: list) -> pa.Table:
    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as e:
        raise ValueError(f"ArrowDataset: the files {files} do not share one schema: {e}") from None


def _check_columns(columns: list, names: list) -> None:
    unknown = [c for c in columns if c not in names]
    if unknown:
        raise ValueError(f"ArrowDataset: unknown column(s) {unknown}; the table has columns {names}")


def _project(table: pa.Table, columns: Optional[list]) -> pa.Table:
    if columns is None:
        return table
    _check_columns(columns, table.column_names)
    return table.select(columns)


# ---------------------------------------------------------------------- rows


def _numeric_list_dtype(t: pa.DataType) -> Optional[np.dtype]:
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        v = t.value_type
        if pa.types.is_integer(v) or pa.types.is_floating(v) or pa.types.is_boolean(v):
            return np.dtype(v.to_pandas_dtype())
    return None


def _column_values(column: pa.ChunkedArray) -> list:
    """One column as a list of Python values (lists of numbers as NumPy arrays), in one Arrow call."""
    values = column.to_pylist()
    dtype = _numeric_list_dtype(column.type)
    if dtype is not None:
        values = [None if v is None else np.asarray(v, dtype=dtype) for v in values]
    return values


def _to_rows(table: pa.Table) -> list:
    names = table.column_names
    if not names:
        return [{} for _ in range(table.num_rows)]
    columns = [_column_values(c) for c in table.columns]
    return [dict(zip(names, values)) for values in zip(*columns)]
