"""`raydl.TarDataset`: WebDataset tar shards in object storage or a folder, read by units through the node cache.

NOTE [ raydl tar shards ]
The driver lists the shards (a brace pattern, a folder or prefix, or URLs: data/sources.py) and
reads or builds their index (NOTE [ raydl tar index ] in data/tar_index.py): each sample's key and
the byte range of each of its members. A shard's samples are cut, in order, into units of whole
samples of up to `RAYDL_TAR_UNIT_BYTES` (8 MiB; a larger sample is a unit alone), each one byte
range of its shard: the node cache fetches a unit with one ranged request, checks it with its CRC
trailer, prefetches and evicts by the epoch's known order, and cooperative caches fetch each unit
once per epoch for the cluster, exactly as for a Parquet row group (NOTE [ raydl node cache ] in
cluster/cache/node_actor.py). A sample never straddles two units. `shuffle=True` permutes the units
and shuffles the samples within windows of units that fit in half the cache (NOTE [ raydl parquet
shuffle ]): every sample once per epoch, and the same `generator` gives the same order. A worker
keeps the units of its current window in memory and slices each sample's members out of them:
`ds[i]` is `{"__key__", "__url__", field: bytes, ...}`, what webdataset's tar reader yields.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .parquet import parse_size
from .sources import list_objects
from .tar_index import index_shards
from .units import UnitDataset

__all__ = ["TarDataset"]

_UNIT_BYTES = int(os.environ.get("RAYDL_TAR_UNIT_BYTES", str(8 << 20)))
_KEPT_BYTES = int(os.environ.get("RAYDL_TAR_KEPT_BYTES", str(256 << 20)))  # units a worker keeps in memory
_DEFAULT_LIMIT = "10GB"


class TarDataset(UnitDataset):
    """A map-style dataset over WebDataset tar shards, read through a node-local cache.

    Example, on a local folder:
        >>> import io, os, tarfile, tempfile
        >>> import raydl
        >>> folder = tempfile.mkdtemp()
        >>> with tarfile.open(os.path.join(folder, "train-0.tar"), "w") as tar:
        ...     for name, data in [("a.cls", b"0"), ("a.txt", b"hi"), ("b.cls", b"1"), ("b.txt", b"yo")]:
        ...         info = tarfile.TarInfo(name)
        ...         info.size = len(data)
        ...         tar.addfile(info, io.BytesIO(data))
        >>> ds = raydl.TarDataset(os.path.join(folder, "train-{0..0}.tar"), cache_dir=os.path.join(folder, "cache"))
        >>> len(ds), ds[1]["__key__"], ds[1]["txt"], ds[1]["cls"]
        (2, 'b', b'yo', b'1')

    From object storage, decoding images in the workers (docs/shards.md has more)::

        def decode(sample):
            image = torchvision.io.decode_image(torch.frombuffer(sample["jpg"], dtype=torch.uint8))
            return augment(image), int(sample["cls"])

        ds = raydl.TarDataset("s3://bucket/train-{000000..000999}.tar", transform=decode,
                              cache_dir="/local/nvme/raydl", cache_limit="200GB")
        loader = raydl.DataLoader(ds, batch_size=256, shuffle=True, num_workers=8)

    Args:
        source: a brace pattern (``"s3://b/train-{000..099}.tar"``), a folder or prefix (every ``.tar`` under
            it, in name order), or a list of URLs or paths: local, NFS, ``s3://``, ``gs://``, anything pyarrow's
            filesystems reach.
        filesystem (pyarrow.fs.FileSystem, optional): the filesystem the paths are on (e.g.
            ``S3FileSystem(endpoint_override=...)``); the scheme is then dropped from URLs. Defaults to ``None``.
        cache_dir (str, optional): the node-local folder of the cache and of the shard index (``{node_id}``
            as for `ParquetDataset`). Defaults to ``<tempdir>/raydl-cache``.
        cache_limit (int or str): the most bytes the cache holds on each node. Defaults to ``"10GB"``.
        transform (callable, optional): applied to each sample dict in the worker (decoding is yours).
        batch_transform (callable, optional): applied to the list of a batch's sample dicts in the worker,
            with the loader's default `collate_fn`; what it returns is the batch. Not with `transform`.
        shuffle_window (int, optional): units whose samples are shuffled together. Defaults to ``None``: as
            many as fit in half of `cache_limit` and in a worker's 256 MiB of kept units.

    Raises:
        FileNotFoundError: a named shard or folder does not exist.
        ValueError: nothing matched, a malformed brace pattern, a shard that is not a tar, is truncated or has a
            corrupt header (`TarFormatError`, naming the shard and byte offset), a field twice in one sample, a
            `cache_limit` too small for the largest unit, or both `transform` and `batch_transform`.
    """

    _WHO = "TarDataset"

    def __init__(
        self,
        source: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
        *,
        filesystem: Any = None,
        cache_dir: Optional[str] = None,
        cache_limit: Union[int, str] = _DEFAULT_LIMIT,
        transform: Optional[Callable[[dict], Any]] = None,
        batch_transform: Optional[Callable[[list], Any]] = None,
        shuffle_window: Optional[int] = None,
    ) -> None:
        if transform is not None and batch_transform is not None:
            raise ValueError("TarDataset: give transform (per sample) or batch_transform (per batch), not both")
        self._transform = transform
        self._batch_transform = batch_transform
        self.cache_dir = os.path.abspath(cache_dir or os.path.join(tempfile.gettempdir(), "raydl-cache"))
        self.cache_limit = parse_size(cache_limit)
        self.filesystem, shards = list_objects("TarDataset", source, filesystem, (".tar",))
        self.urls = [u for u, _ in shards]
        self.files = [i.path for _, i in shards]
        self._file_sizes = [int(i.size) for _, i in shards]
        per_shard, self.index_s, self.index_bytes = index_shards(self.filesystem, shards, self.cache_dir)
        self._build_units(shards, per_shard)
        self.shuffle_window = self._check_window(shuffle_window)
        self._kept: OrderedDict = OrderedDict()
        self._kept_bytes = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the units

    def _build_units(self, shards: list, per_shard: list) -> None:
        fields: dict = {}
        rows, unit_shard, segments, keys = [], [], [], []
        sample_keys: list = []
        m_lo, m_field, m_off, m_size = [0], [], [], []
        for s, ((url, info), samples) in enumerate(zip(shards, per_shard)):
            ident = f"{info.path}|{info.size}|{info.mtime_ns}"
            k = 0
            while k < len(samples):
                lo = samples[k][1][0][1]
                hi, j = lo, k
                while j < len(samples):
                    end = max(off + n for _, off, n in samples[j][1])
                    if j > k and end - lo > _UNIT_BYTES:
                        break
                    hi, j = max(hi, end), j + 1
                for key, members in samples[k:j]:
                    sample_keys.append(key)
                    for field, off, n in members:
                        m_field.append(fields.setdefault(field, len(fields)))
                        m_off.append(off - lo)
                        m_size.append(n)
                    m_lo.append(len(m_off))
                rows.append(j - k)
                unit_shard.append(s)
                segments.append(((lo, hi - lo),))
                keys.append(hashlib.sha1(f"tar|{ident}|{lo}|{hi}".encode()).hexdigest()[:24])
                k = j
        if not rows:
            raise ValueError(f"TarDataset: the {len(shards)} shard(s) hold no sample (first: {shards[0][0]})")
        self._fields = list(fields)
        self._keys = sample_keys
        self._m_lo = np.asarray(m_lo, dtype=np.int64)
        self._m_field = np.asarray(m_field, dtype=np.int32)
        self._m_off = np.asarray(m_off, dtype=np.int64)
        self._m_size = np.asarray(m_size, dtype=np.int64)
        self._rows = np.asarray(rows, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._rows)]).astype(np.int64)
        self._unit_shard = unit_shard
        self._segments = segments
        self._unit_keys = keys
        self._unit_bytes = np.asarray([s[0][1] for s in segments], dtype=np.int64)
        self.token = hashlib.sha1("|".join(keys).encode()).hexdigest()[:16]

    def _check_window(self, window: Optional[int]) -> int:
        from ..cluster.cache.unit_file import UNIT_TRAILER_BYTES

        largest = int(self._unit_bytes.max()) + UNIT_TRAILER_BYTES
        need = 2 * largest  # one unit being read, the next one arriving
        if self.cache_limit < need:
            u = int(self._unit_bytes.argmax())
            raise ValueError(
                f"TarDataset: cache_limit={self.cache_limit} bytes is too small: the largest unit ({self.describe_unit(u)},"
                f" {largest} bytes with its checksum) must fit twice. Raise cache_limit to {need} or more."
            )
        if window is None:
            fits = (self.cache_limit // 2) // largest
            return max(1, min(self.num_units, fits, max(2, _KEPT_BYTES // largest)))
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"TarDataset: shuffle_window should be a positive number of units, got {window!r}")
        if self.cache_limit < (window + 1) * largest:
            raise ValueError(
                f"TarDataset: shuffle_window={window} units need up to {(window + 1) * largest} bytes of cache; "
                f"cache_limit is {self.cache_limit}. Raise it, or lower shuffle_window to "
                f"{max(1, self.cache_limit // largest - 1)}."
            )
        return window

    def raydl_cache_units(self) -> list:
        """Per unit: (path, shard size, byte segments, key): what the node cache fetches."""
        return [
            (self.files[s], self._file_sizes[s], segs, key)
            for s, segs, key in zip(self._unit_shard, self._segments, self._unit_keys)
        ]

    def describe_unit(self, unit: int) -> str:
        ((lo, n),) = self._segments[unit]
        return f"bytes {lo}-{lo + n} of {self.urls[self._unit_shard[unit]]}"

    @property
    def raydl_batch_transform(self) -> Optional[Callable[[list], Any]]:
        return self._batch_transform

    @property
    def fields(self) -> list:
        """Every field name found in the shards (a sample has some of them)."""
        return list(self._fields)

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
            shard = self.urls[self._unit_shard[u]]
            sample: dict = {"__key__": self._keys[i], "__url__": shard}
            for m in range(int(self._m_lo[i]), int(self._m_lo[i + 1])):
                off = int(self._m_off[m])
                sample[self._fields[self._m_field[m]]] = bytes(buf[off : off + int(self._m_size[m])])
            out.append(sample)
        return out

    def _units(self, units: list) -> dict:
        """{unit: its bytes}: from this process's kept units, else through the node cache (or storage without Ray)."""
        found, missing = {}, []
        with self._lock:
            for u in units:
                b = self._kept.get(u)
                if b is None:
                    missing.append(u)
                else:
                    self._kept.move_to_end(u)
                    found[u] = b
        if missing:
            from ..cluster.cache.worker_read import read_units

            got = read_units(self, missing)
            limit = min(_KEPT_BYTES, self.shuffle_window * int(self._unit_bytes.max()))
            with self._lock:
                for u, b in got.items():
                    if len(b) != int(self._unit_bytes[u]):
                        raise OSError(
                            f"TarDataset: {self.describe_unit(u)} read {len(b)} bytes, expected "
                            f"{int(self._unit_bytes[u])}: the shard changed since it was indexed"
                        )
                    found[u] = b = memoryview(b)
                    self._kept[u] = b
                    self._kept_bytes += len(b)
                    while self._kept_bytes > limit and len(self._kept) > 1:
                        _, old = self._kept.popitem(last=False)
                        self._kept_bytes -= len(old)
        return found

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_kept"], state["_kept_bytes"], state["_lock"] = OrderedDict(), 0, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TarDataset({len(self.files)} shards, {len(self)} samples, {self.num_units} units, {self.nbytes} bytes)"
