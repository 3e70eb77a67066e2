"""Datasets whose samples are byte members of cached units: a tar shard's samples, a prefix's objects.

NOTE [ raydl member samples ]
`TarDataset` (data/tar.py) and `FileDataset` (data/files.py) differ only in where a unit's bytes come
from: one byte range of a tar shard, or several whole objects read one after the other. Either way
the node cache holds a unit as one file of bytes, and a sample is its key, its URL and a few members,
each a (field, offset in the unit, size). This base keeps those tables as flat arrays (a worker
receives them pickled with the dataset: no listing or index is read again there), slices a sample's
members out of its unit's bytes (`ds[i]` = `{"__key__", "__url__", field: bytes, ...}`, webdataset's
layout), and keeps the units of a worker's current window in memory, up to `RAYDL_MEMBER_KEPT_BYTES`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .parquet import parse_size
from .units import KeptUnits, UnitDataset

__all__ = ["MemberDataset"]

_KEPT_BYTES = int(os.environ.get("RAYDL_MEMBER_KEPT_BYTES", str(256 << 20)))
_UNITS_IN_CACHE = 16  # a unit spans at most this fraction of cache_limit


class MemberDataset(UnitDataset):
    """A dataset of samples made of members of cached units (NOTE [ raydl member samples ])."""

    _transform: Optional[Callable[[dict], Any]]
    _batch_transform: Optional[Callable[[list], Any]]
    cache_limit: int

    def _configure(
        self,
        transform: Optional[Callable],
        batch_transform: Optional[Callable],
        cache_dir: Optional[str],
        cache_limit: Union[int, str],
    ) -> None:
        """The arguments every subclass takes: transforms, the cache's folder (the default one under the temp
        folder) and its limit."""
        if transform is not None and batch_transform is not None:
            raise ValueError(f"{self._WHO}: give transform (per sample) or batch_transform (per batch), not both")
        self._transform = transform
        self._batch_transform = batch_transform
        self.cache_dir = os.path.abspath(cache_dir or os.path.join(tempfile.gettempdir(), "raydl-cache"))
        self.cache_limit = parse_size(cache_limit)

    def _set_units(self, units: list, specs: list) -> None:
        """`units`: per unit, its samples [(key, url, [(field, offset in the unit, size), ...]), ...];
        `specs`: per unit, (path or tuple of paths, file size or total bytes, segments, cache key) for the node
        cache."""
        fields: dict = {}
        urls: dict = {}
        rows, keys, sample_url = [], [], []
        m_lo, m_field, m_off, m_size = [0], [], [], []
        for samples in units:
            rows.append(len(samples))
            for key, url, members in samples:
                keys.append(key)
                sample_url.append(urls.setdefault(url, len(urls)))
                for field, off, n in members:
                    m_field.append(fields.setdefault(field, len(fields)))
                    m_off.append(off)
                    m_size.append(n)
                m_lo.append(len(m_off))
        self._fields = list(fields)
        self._urls = list(urls)
        self._keys = keys
        self._sample_url = np.asarray(sample_url, dtype=np.int32)
        self._m_lo = np.asarray(m_lo, dtype=np.int64)
        self._m_field = np.asarray(m_field, dtype=np.int32)
        self._m_off = np.asarray(m_off, dtype=np.int64)
        self._m_size = np.asarray(m_size, dtype=np.int64)
        self._rows = np.asarray(rows, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._rows)]).astype(np.int64)
        self._specs = specs
        self._unit_bytes = np.asarray([sum(n for _, n in segs) for _, _, segs, _ in specs], dtype=np.int64)
        self.token = hashlib.sha1("|".join(k for _, _, _, k in specs).encode()).hexdigest()[:16]
        self._kept = KeptUnits()  # {unit: its bytes}

    def _unit_target(self, most: int) -> int:
        """Bytes a unit spans at most: `most`, or a sixteenth of `cache_limit` if smaller, so that a window holds
        several units even in a small cache (a sample larger than that is a unit alone)."""
        return max(1, min(most, self.cache_limit // _UNITS_IN_CACHE))

    def _check_window(self, window: Optional[int]) -> int:
        """The shuffle window in units; refuses a cache_limit that cannot hold the largest unit twice."""
        from ..cluster.cache.unit_file import UNIT_TRAILER_BYTES, folder_bytes

        largest = int(self._unit_bytes.max()) + UNIT_TRAILER_BYTES
        # the folder's metadata (this dataset's index or listing, and any other's) counts against the limit
        self.cache_metadata_bytes = meta = folder_bytes(self.cache_dir)[0]
        room, of = self.cache_limit - meta, self._metadata_clause(meta)
        need = 2 * largest  # one unit being read, the next one arriving
        if room < need:
            u = int(self._unit_bytes.argmax())
            raise ValueError(
                f"{self._WHO}: cache_limit={self.cache_limit} bytes is too small{of}: the largest unit "
                f"({self.describe_unit(u)}, {largest} bytes with its checksum) must fit twice. Raise cache_limit to "
                f"{need + meta} or more."
            )
        if window is None:
            # half the cache (the other half prefetches), reckoned on the limit alone so that metadata written
            # later into the folder never moves a saved order
            fits = min(self.cache_limit // 2, room - largest) // largest
            return max(1, min(self.num_units, fits, max(2, _KEPT_BYTES // largest)))
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{self._WHO}: shuffle_window should be a positive number of units, got {window!r}")
        if room < (window + 1) * largest:
            raise ValueError(
                f"{self._WHO}: shuffle_window={window} units need up to {(window + 1) * largest} bytes of cache; "
                f"cache_limit is {self.cache_limit}{of}. Raise it, or lower shuffle_window to "
                f"{max(1, room // largest - 1)}."
            )
        return window

    # ------------------------------------------------------------------ what the loader and the cache ask

    def raydl_cache_units(self) -> list:
        """Per unit: (path or paths, file size or total bytes, byte segments, key): what the node cache fetches."""
        return self._specs

    @property
    def raydl_batch_transform(self) -> Optional[Callable[[list], Any]]:
        """The `batch_transform` this dataset applies to each batch, if any."""
        return self._batch_transform

    @property
    def fields(self) -> list:
        """Every field name found (a sample has some of them)."""
        return list(self._fields)

    def key(self, index: int) -> str:
        """Sample `index`'s key, known without reading its bytes."""
        return self._keys[int(self._wrapped([index], "samples")[0])]

    # ------------------------------------------------------------------ reading

    def __getitem__(self, index: int) -> Any:
        sample = self._samples(self._wrapped([index], "samples"))[0]
        if self._batch_transform is not None:
            return self._batch_transform([sample])
        return self._transform(sample) if self._transform is not None else sample

    def __getitems__(self, indices: Sequence[int]) -> list:
        samples = self._samples(self._wrapped(indices, "samples"))
        if self._transform is not None:
            return [self._transform(s) for s in samples]
        return samples

    def raydl_collate(self, indices: Sequence[int]) -> Optional[Any]:
        """With `batch_transform`: the batch it makes of the samples at `indices` (in a raydl worker, in place of
        torch's default_collate); None otherwise (the per-sample path)."""
        if self._batch_transform is None:
            return None
        return self._batch_transform(self._samples(self._wrapped(indices, "samples")))

    def _samples(self, idx: np.ndarray) -> list:
        units = self.units_of(idx)
        data = self._units(sorted(set(units.tolist())))
        out = []
        for i, u in zip(idx.tolist(), units.tolist()):
            buf = data[u]
            sample: dict = {"__key__": self._keys[i], "__url__": self._urls[self._sample_url[i]]}
            for m in range(int(self._m_lo[i]), int(self._m_lo[i + 1])):
                off = int(self._m_off[m])
                sample[self._fields[self._m_field[m]]] = bytes(buf[off : off + int(self._m_size[m])])
            out.append(sample)
        return out

    def _read_units(self, units: list) -> None:
        self._units(units)

    def _units(self, units: list) -> dict:
        """{unit: its bytes}: from this process's kept units, else through the node cache (or storage without Ray)."""
        found, missing = self._kept.split(units)
        if missing:
            got = self._read(missing, self._kept.keys())
            limit = min(_KEPT_BYTES, self.units_in_use * int(self._unit_bytes.max()))
            for u, b in got.items():  # whole: the cache and the direct read check each unit's length
                found[u] = b = memoryview(b)
                self._kept.put(u, b, len(b), limit)
        return found
