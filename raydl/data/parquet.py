"""`raydl.ParquetDataset`: Parquet files in object storage or a folder, read by row group through a node cache.

NOTE [ raydl parquet ]
The footers are the index. The driver lists the files and reads every footer once, with parallel
requests (`_read_footers`); from them it knows each row group's rows and the byte ranges of its
column chunks (only the selected `columns`). Row `i` lives in unit `u` (one row group) where
`starts[u] <= i < starts[u + 1]`. The dataset is pickled to the workers with the footers, so no
worker or rank reads a footer again.
A worker reads a batch unit by unit: it asks its node's cache (NOTE [ raydl node cache ] in
cluster/cache/node_actor.py) for the unit's bytes, which the cache fetched ahead of time from storage into
a local file, decodes the row group from them (`ParquetFile(metadata=footer)` over a file
object that serves the original offsets from the cached ranges: no footer read, no re-encoding)
and keeps a few decoded units in memory (a window shuffle reads each unit over several
consecutive batches). Without Ray (plain `ds[i]` in a process with no Ray) it reads the ranges
straight from storage.
The shuffle over it: NOTE [ raydl unit order ] in data/unit_order.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .arrow import check_columns_and_transform
from .columnar import (
    RowGroupColumns,
    collate_columns,
    collate_pieces,
    group_rows,
    transformed_batch,
    transformed_row,
    transformed_rows,
)
from .segments import SegmentFile, merge_segments
from .unit_order import ParquetDistributedSampler, ParquetShuffleSampler, shard_aware_order
from .units import KeptUnits, UnitDataset

__all__ = [
    "ParquetDataset",
    "ParquetShuffleSampler",
    "ParquetDistributedSampler",
    "parse_size",
    "shard_aware_order",
]

_SUFFIXES = (".parquet", ".pq")
_FOOTER_THREADS = 16
# Decoded row groups a worker keeps (NOTE [ raydl parquet ]): one window's, at most this many bytes; the default
# window is also bounded by it, so that a worker decodes each row group once per pass of its window.
_DECODED_BYTES = int(os.environ.get("RAYDL_PARQUET_DECODED_BYTES", str(256 << 20)))
_DEFAULT_LIMIT = "10GB"
_THREADED_DECODE = 8 << 20  # a row group's uncompressed bytes from which Arrow's threads decode it
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "K": 10**3, "M": 10**6, "G": 10**9})


def parse_size(value: Union[int, str]) -> int:
    """Bytes from an int or a string such as "20GB", "512 MiB", "1.5e9"."""
    if isinstance(value, bool):
        raise TypeError(f"cache_limit should be a number of bytes or a string such as '20GB', got {value!r}")
    if isinstance(value, (int, np.integer)):
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", value)
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"cache_limit: cannot read {value!r} as a size (examples: 20GB, 512MiB, 1000000)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    else:
        raise TypeError(f"cache_limit should be a number of bytes or a string such as '20GB', got {value!r}")
    if n <= 0:
        raise ValueError(f"cache_limit should be positive, got {value!r}")
    return n


class ParquetDataset(UnitDataset):
    """A map-style dataset over Parquet files in object storage or a folder, read through a node-local cache.

    Example, on a local folder:
        >>> import os, tempfile
        >>> import pyarrow as pa, pyarrow.parquet as pq
        >>> import raydl
        >>> folder = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": [0, 1, 2, 3], "y": list("abcd")}), os.path.join(folder, "part-0.parquet"))
        >>> ds = raydl.ParquetDataset(folder, cache_dir=os.path.join(folder, "cache"))
        >>> len(ds), ds[2]
        (4, {'x': 2, 'y': 'c'})
        >>> [batch["x"].tolist() for batch in raydl.DataLoader(ds, batch_size=2)]
        [[0, 1], [2, 3]]

    From object storage, with workers (docs/streaming.md has more)::

        ds = raydl.ParquetDataset("s3://bucket/corpus/", cache_dir="/local/nvme/raydl", cache_limit="20GB")
        loader = raydl.DataLoader(ds, batch_size=256, shuffle=True, num_workers=8)

    `len(ds)` is the number of rows (from the footers); `ds[i]` is row `i` as a dict
    {column: value}. With `shuffle=True` the loader uses the dataset's `ParquetShuffleSampler`
    (NOTE [ raydl unit order ]); workers read row groups from their node's cache (NOTE [
    raydl node cache ] in cluster/cache/node_actor.py).

    Args:
        url_or_files: a URL or path of a folder (every ``.parquet`` / ``.pq`` file under it, in
            name order) or of one file, or a list of them: ``s3://``, ``gs://``, ``hdfs://``, a
            local or NFS path.
        columns (list of str, optional): read only these columns. Defaults to ``None`` (all).
        transform (callable, optional): applied to each row (a dict) in the worker. Defaults to
            ``None``.
        batch_transform (callable, optional): applied to each whole batch in the worker, for
            vectorized preprocessing: a dict {column: NumPy array} in, a dict of equal-length
            columns (tensors or NumPy arrays of numbers, lists of str / bytes) out, as for
            `ArrowDataset` (its docstring and NOTE [ raydl batch transforms ] in data/columnar.py
            say what each Arrow type becomes). Not with `transform`. Defaults to ``None``.
        filesystem (pyarrow.fs.FileSystem, optional): the filesystem the URL's path is on (e.g.
            ``S3FileSystem(endpoint_override=...)`` for MinIO); the scheme is then dropped from
            the URL. Defaults to ``None`` (from the URL, pyarrow's defaults).
        cache_dir (str, optional): the node-local folder of the cache; ``{node_id}`` in it becomes
            each node's Ray node id (a folder of each node's own on a file system the nodes share).
            Defaults to ``<tempdir>/raydl-cache``.
        cache_limit (int or str): the most bytes the cache holds on each node, e.g. ``"20GB"``.
            Defaults to ``"10GB"``.
        shuffle_window (int, optional): row groups whose rows are shuffled together. Defaults to
            ``None``: as many as fit in half of `cache_limit`, and whose decoded size fits in a
            worker's 256 MiB of decoded row groups (`RAYDL_PARQUET_DECODED_BYTES`).
        node_slots (int, optional): the slots `shuffle=True`'s order deals the row groups to: each
            batch comes from one slot's window, the slots taking turns batch by batch, and the
            loader makes a slot's batches on the node it is dealt to, so a node's cache fetches
            only its own slots' row groups (NOTE [ raydl node slots ]). Given: that many slots of
            `shuffle_window // node_slots` row groups each, the order the same on any nodes (``1``:
            every batch mixes the whole window, the nodes' caches share row groups). Defaults to
            ``None``: one slot a node, each a whole window, the count settled by the nodes the
            loader's workers run on when its first epoch starts and kept for the run (in its
            state): one node is the window shuffle (docs/streaming.md).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: no Parquet file found, a file that is not Parquet (named), files whose
            schemas disagree, an unknown column, a `cache_limit` too small for what the
            loader must hold at once (the message gives the number it needs), or both
            `transform` and `batch_transform`.
    """

    _WHO = "ParquetDataset"

    def __init__(
        self,
        url_or_files: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
        *,
        columns: Optional[Sequence[str]] = None,
        transform: Optional[Callable[[dict], Any]] = None,
        batch_transform: Optional[Callable[[dict], dict]] = None,
        filesystem: Any = None,
        cache_dir: Optional[str] = None,
        cache_limit: Union[int, str] = _DEFAULT_LIMIT,
        shuffle_window: Optional[int] = None,
        node_slots: Optional[int] = None,
    ) -> None:
        columns = check_columns_and_transform("ParquetDataset", columns, transform, batch_transform)
        self._columns = columns
        self._transform = transform
        self._batch_transform = batch_transform
        self.cache_dir = os.path.abspath(cache_dir or os.path.join(tempfile.gettempdir(), "raydl-cache"))
        self.cache_limit = parse_size(cache_limit)
        self.filesystem, infos = _list_files(url_or_files, filesystem)
        self.files = [i.path for i in infos]
        self._file_sizes = [int(i.size) for i in infos]
        self._footers = _read_footers(self.filesystem, infos)
        self._build_units(infos)
        self.shuffle_window = self._check_window(shuffle_window)
        self.node_slots = self._check_slots(node_slots)
        self._kept = KeptUnits()  # {row group: RowGroupColumns}

    # ------------------------------------------------------------------ the index

    def _build_units(self, infos: list) -> None:
        first = self._footers[0].schema.to_arrow_schema()
        names = first.names
        for path, md in zip(self.files, self._footers):
            if md.schema.to_arrow_schema().names != names:
                raise ValueError(f"ParquetDataset: {path} has columns {md.schema.names}, {self.files[0]} has {names}")
        if self._columns is not None:
            unknown = [c for c in self._columns if c not in names]
            if unknown:
                raise ValueError(f"ParquetDataset: unknown columns {unknown}; the files have {names}")
        wanted = set(self._columns if self._columns is not None else names)
        rows, unit_file, unit_rg, segments, keys, decoded = [], [], [], [], [], []
        for f, (info, md) in enumerate(zip(infos, self._footers)):
            ident = f"{info.path}|{info.size}|{info.mtime_ns}"
            for g in range(md.num_row_groups):
                rg = md.row_group(g)
                segs = []
                for j in range(rg.num_columns):
                    col = rg.column(j)
                    if col.path_in_schema.split(".")[0] not in wanted:
                        continue
                    start = col.data_page_offset
                    if col.has_dictionary_page and col.dictionary_page_offset:
                        start = min(start, col.dictionary_page_offset)
                    segs.append((int(start), int(col.total_compressed_size)))
                    decoded.append((len(rows), int(col.total_uncompressed_size)))
                segs = merge_segments(segs)
                rows.append(rg.num_rows)
                unit_file.append(f)
                unit_rg.append(g)
                segments.append(tuple(segs))
                keys.append(hashlib.sha1(f"{ident}|{g}|{segs}".encode()).hexdigest()[:24])
        self._rows = np.asarray(rows, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._rows)]).astype(np.int64)
        self._unit_file = unit_file
        self._unit_rg = unit_rg
        self._segments = segments
        self._unit_keys = keys
        self._unit_bytes = np.asarray([sum(n for _, n in s) for s in segments], dtype=np.int64)
        per_unit = np.zeros(len(rows), dtype=np.int64)
        for u, n in decoded:
            per_unit[u] += n
        self._largest_decoded = int(per_unit.max()) if len(per_unit) else 0  # Parquet's uncompressed size
        self._unit_decoded = per_unit
        self.token = hashlib.sha1("|".join(keys).encode()).hexdigest()[:16]

    def _check_window(self, window: Optional[int]) -> int:
        """The window in row groups; refuses a cache_limit too small for what must be held at once."""
        from ..cluster.cache.unit_file import UNIT_TRAILER_BYTES, folder_bytes

        # a row group as the node cache holds it: its column chunks and its checksum trailer (a limit of exactly twice
        # the chunks held one unit, not two: one node re-read the data 3.4x, cooperative caches waited on each other)
        largest = int(self._unit_bytes.max()) + UNIT_TRAILER_BYTES if len(self._unit_bytes) else 0
        # metadata another dataset keeps in the folder (a tar index, a file listing) counts against the limit
        self.cache_metadata_bytes = meta = folder_bytes(self.cache_dir)[0]
        room, of = self.cache_limit - meta, self._metadata_clause(meta)
        need = 2 * largest  # one row group being read, the next one arriving
        if room < need:
            raise ValueError(
                f"ParquetDataset: cache_limit={self.cache_limit} bytes is too small{of}: a batch in flight needs at "
                f"least {need} bytes (2 x the largest row group as the cache holds it, {largest} bytes with its "
                f"checksum). Raise cache_limit to {need + meta} or more."
            )
        if window is None:
            # half the cache: the other half prefetches (reckoned in column chunks, as it always was: the window
            # decides the shuffle's order, which must not move under a saved checkpoint)
            fits = (self.cache_limit // 2) // max(largest - UNIT_TRAILER_BYTES, 1)
            decodes = max(2, _DECODED_BYTES // max(self._largest_decoded, 1))
            return max(1, min(self.num_units, fits, decodes))
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(
                f"ParquetDataset: shuffle_window should be a positive number of row groups, got {window!r}"
            )
        need = (window + 1) * largest
        if room < need:
            raise ValueError(
                f"ParquetDataset: shuffle_window={window} row groups need up to {need} bytes of cache (the window and "
                f"one row group arriving, largest {largest} bytes with its checksum); cache_limit is {self.cache_limit}"
                f"{of}. Raise cache_limit to {need + meta} or lower shuffle_window to {max(1, room // largest - 1)}."
            )
        return window

    @property
    def raydl_batch_transform(self) -> Optional[Callable[[dict], dict]]:
        """The `batch_transform` this dataset applies to each batch, if any."""
        return self._batch_transform

    @property
    def column_names(self) -> list:
        return self._columns if self._columns is not None else self._footers[0].schema.to_arrow_schema().names

    # ------------------------------------------------------------------ what the loader and the cache ask

    def raydl_cache_units(self) -> list:
        """Per unit: (path, file size, byte segments, key): what the node cache fetches (cluster/cache/node_actor.py)."""
        return [
            (self.files[f], self._file_sizes[f], segs, key)
            for f, segs, key in zip(self._unit_file, self._segments, self._unit_keys)
        ]

    # ------------------------------------------------------------------ reading

    def __getitem__(self, index: int) -> Any:
        if self._batch_transform is not None:
            idx = self._wrapped([index])
            return transformed_row(self._batch_transform, self._take_table(idx), "ParquetDataset", int(idx[0]))
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list:
        idx = self._wrapped(indices)
        if self._batch_transform is not None:
            return transformed_rows(self._batch_transform, self._take_table(idx), "ParquetDataset")
        out = self._take_table(idx).to_pylist()
        if self._transform is not None:
            out = [self._transform(r) for r in out]
        return out

    def raydl_collate(self, indices: Sequence[int]) -> Optional[dict]:
        """torch's `default_collate` of the samples at `indices`, built column by column in a raydl worker
        (NOTE [ raydl columnar batches ] in data/columnar.py); None where the per-row path must make it."""
        if self._transform is not None:
            return None
        try:
            idx = np.asarray(indices, dtype=np.int64)
        except (TypeError, ValueError):
            return None  # index types NumPy cannot read: the per-row path decides
        n = len(self)
        if idx.ndim != 1 or len(idx) == 0 or idx.min() < 0 or idx.max() >= n:
            return None  # the per-row path wraps negative indices and names one out of range
        if self._batch_transform is not None:
            return transformed_batch(self._batch_transform, self._take_table(idx), "ParquetDataset")
        groups = group_rows(self.units_of(idx))
        decoded = self._tables(np.array([u for u, _ in groups], dtype=np.int64))
        pieces = [(decoded[u], where, idx[where] - self._starts[u]) for u, where in groups]
        out = collate_pieces(pieces, len(idx))  # NOTE [ raydl gathered pieces ] in data/columnar.py
        return out if out is not None else collate_columns(self._take_table(idx), lists_as_arrays=False)

    def _take_table(self, idx: np.ndarray) -> Any:
        """The rows at `idx` (in range), in that order: one take per row group they fall in."""
        import pyarrow as pa

        groups = group_rows(self.units_of(idx))
        tables = self._tables(np.array([u for u, _ in groups], dtype=np.int64))
        pieces, places = [], []
        for u, where in groups:
            pieces.append(tables[u].table.take(idx[where] - self._starts[u]))
            places.append(where)
        if len(pieces) <= 1:  # no index: the rows' path makes what torch does of no rows
            return pieces[0] if pieces else pa.table({})
        order = np.empty(len(idx), dtype=np.int64)
        order[np.concatenate(places)] = np.arange(len(idx))  # output row k is row order[k] of the pieces
        return pa.concat_tables(pieces).combine_chunks().take(pa.array(order))

    def _read_units(self, units: list) -> None:
        self._tables(np.asarray(units, dtype=np.int64))

    def _tables(self, units: np.ndarray) -> dict:
        """{unit: RowGroupColumns} for these units: from this process's few, else read from the node cache and
        decoded (NOTE [ raydl gathered pieces ] in data/columnar.py)."""
        found, missing = self._kept.split(units.tolist())
        if missing:
            limit = min(_DECODED_BYTES, self.units_in_use * max(self._largest_decoded, 1))
            for u, data in self._read(missing, self._kept.keys()).items():
                found[u] = t = RowGroupColumns(self._decode(u, data))
                self._kept.put(u, t, t.nbytes, limit)
        return found

    def _decode(self, unit: int, data: bytes) -> Any:
        """Row group `unit` from its cached column-chunk bytes; a corrupt one is named with its file and row group."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        f, g = self._unit_file[unit], self._unit_rg[unit]
        raw = SegmentFile(data, self._segments[unit], self._file_sizes[f])
        try:
            # pages written with their CRC (write_page_checksum) are checked as they are decoded (NOTE [ raydl
            # node cache ], checksums); pages without one are read as before
            pf = pq.ParquetFile(
                pa.PythonFile(raw, mode="r"), metadata=self._footers[f], page_checksum_verification=True
            )
            # Arrow's threads decode the columns of a large row group side by side; for a small one they cost more
            # than they save (a 190 KB row group of 18 columns: 0.85 -> 0.69 ms of CPU without them)
            return pf.read_row_group(g, columns=self._columns, use_threads=self._unit_decoded[unit] >= _THREADED_DECODE)
        except (OSError, pa.ArrowException, ValueError) as e:
            raise ValueError(f"ParquetDataset: row group {g} of {self.files[f]} is corrupt or truncated: {e}") from e

    def describe_unit(self, unit: int) -> str:
        return f"row group {self._unit_rg[unit]} of {self.files[self._unit_file[unit]]}"

    def __repr__(self) -> str:
        return f"ParquetDataset({len(self.files)} files, {len(self)} rows, {self.num_units} row groups, {self.nbytes} bytes)"


def _list_files(source: Any, filesystem: Any) -> tuple:
    """(filesystem, FileInfos of the Parquet files, in name order per source) for a URL/path or a list of them."""
    import pyarrow.fs as pafs

    sources = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not sources:
        raise ValueError("ParquetDataset: no files given")
    fs = filesystem
    infos = []
    for src in sources:
        src = os.fspath(src)
        if fs is None:
            fs, _ = pafs.FileSystem.from_uri(src if "://" in src else os.path.abspath(src))
        path = _path_of(src, fs)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"ParquetDataset: {src} does not exist")
        if info.type == pafs.FileType.Directory:
            found = [
                i
                for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                if i.type == pafs.FileType.File and i.path.lower().endswith(_SUFFIXES)
            ]
            if not found:
                raise ValueError(f"ParquetDataset: no .parquet or .pq file under {src}")
            infos.extend(sorted(found, key=lambda i: i.path))
        else:
            infos.append(info)
    return fs, infos


def _path_of(src: str, fs: Any) -> str:
    """The filesystem path of a URL: the scheme dropped (s3://bucket/key -> bucket/key), a local path made absolute."""
    if "://" in src:
        return src.split("://", 1)[1]
    return os.path.abspath(src) if type(fs).__name__ == "LocalFileSystem" else src


def _read_footers(fs: Any, infos: list) -> list:
    """Every file's footer, read with parallel requests; a file that is not Parquet is named."""
    import pyarrow.parquet as pq

    from .storage import with_retries

    def read(info: Any) -> Any:
        def once() -> Any:
            with fs.open_input_file(info.path) as f:
                return pq.read_metadata(f)

        try:
            return with_retries(once, f"the footer of {info.path}")
        except FileNotFoundError:
            raise
        except Exception as e:
            raise ValueError(f"ParquetDataset: cannot read the Parquet footer of {info.path}: {e}") from e

    with ThreadPoolExecutor(min(_FOOTER_THREADS, len(infos))) as pool:
        return list(pool.map(read, infos))
