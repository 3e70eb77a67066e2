"""`raydl.TarDataset`: WebDataset tar shards in object storage or a folder, read by units through the node cache.

NOTE [ raydl tar shards ]
The driver lists the shards (a brace pattern, a folder or prefix, or URLs: data/sources.py) and
reads or builds their index (NOTE [ raydl tar index ] in data/tar_index.py): each sample's key and
the byte range of each of its members. A shard's samples are cut, in order, into units of whole
samples of up to `RAYDL_TAR_UNIT_BYTES` (8 MiB, or a sixteenth of `cache_limit` if less; a larger
sample is a unit alone), each one byte
range of its shard: the node cache fetches a unit with one ranged request, checks it with its CRC
trailer, prefetches and evicts by the epoch's known order, and cooperative caches fetch each unit
once per epoch for the cluster, exactly as for a Parquet row group (NOTE [ raydl node cache ] in
cluster/cache/node_actor.py). A sample never straddles two units. `shuffle=True` permutes the units
and shuffles the samples within windows of units that fit in half the cache (NOTE [ raydl parquet
shuffle ]): every sample once per epoch, and the same `generator` gives the same order. A worker
keeps the units of its current window in memory and slices each sample's members out of them
(NOTE [ raydl member samples ] in data/members.py): `ds[i]` is `{"__key__", "__url__", field:
bytes, ...}`, what webdataset's tar reader yields.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Optional, Sequence, Union

from .members import MemberDataset
from .shipped_index import dali_reader, is_wids, wids_shards
from .sources import list_objects
from .tar_index import index_shards

__all__ = ["TarDataset"]

_UNIT_BYTES = int(os.environ.get("RAYDL_TAR_UNIT_BYTES", str(8 << 20)))
_DEFAULT_LIMIT = "10GB"


class TarDataset(MemberDataset):
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
        node_slots (int, optional): the slots `shuffle=True`'s order deals the units to: each
            batch comes from one slot's window, the slots taking turns batch by batch, and the
            loader makes a slot's batches on the node it is dealt to, so a node's cache fetches
            only its own slots' units (NOTE [ raydl node slots ]). Given: that many slots of
            `shuffle_window // node_slots` units each, the order the same on any nodes (``1``:
            every batch mixes the whole window, the nodes' caches share units). Defaults to
            ``None``: one slot a node, each a whole window, the count settled by the nodes the
            loader's workers run on when its first epoch starts and kept for the run (in its
            state): one node is the window shuffle (docs/streaming.md).
        index (str, optional): ``"dali"`` reads DALI's ``wds2idx`` index (``<shard>.idx`` beside each shard)
            instead of scanning the shards. Defaults to ``None``: raydl's own index, built once and kept. A
            `source` ending in ``.json`` is a webdataset ``wids`` shard index: its shards, their sample counts
            checked (NOTE [ raydl shipped indexes ] in data/shipped_index.py).

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
        node_slots: Optional[int] = None,
        index: Optional[str] = None,
    ) -> None:
        self._configure(transform, batch_transform, cache_dir, cache_limit)
        if index not in (None, "dali"):
            raise ValueError(
                f"TarDataset: index should be None (raydl's own) or 'dali' (<shard>.idx files), got {index!r}"
            )
        counts = None
        if is_wids(source):  # NOTE [ raydl shipped indexes ]
            fs, found = list_objects("TarDataset", source, filesystem, ())
            listed = wids_shards(fs, str(source), found[0][1].path)
            source, counts, filesystem = [u for u, _ in listed], [n for _, n in listed], fs
        self.filesystem, shards = list_objects("TarDataset", source, filesystem, (".tar",))
        self.urls = [u for u, _ in shards]
        self.files = [i.path for _, i in shards]
        shipped = dali_reader(self.filesystem) if index == "dali" else None
        per_shard, self.index_s, self.index_bytes = index_shards(self.filesystem, shards, self.cache_dir, shipped)
        for url, want, got in zip(self.urls, counts or [], per_shard):
            if want != len(got):
                raise ValueError(f"TarDataset: the wids index says {url} holds {want} samples; it holds {len(got)}")
        units, specs, self._unit_range = [], [], []
        for s, ((url, info), samples) in enumerate(zip(shards, per_shard)):
            ident = f"{info.path}|{info.size}|{info.mtime_ns}"
            for lo, hi, run in _runs(samples, self._unit_target(_UNIT_BYTES)):
                units.append([(key, url, [(f, off - lo, n) for f, off, n in members]) for key, members in run])
                specs.append(
                    (
                        info.path,
                        int(info.size),
                        ((lo, hi - lo),),
                        hashlib.sha1(f"tar|{ident}|{lo}|{hi}".encode()).hexdigest()[:24],
                    )
                )
                self._unit_range.append((s, lo, hi))
        if not units:
            raise ValueError(f"TarDataset: the {len(shards)} shard(s) hold no sample (first: {shards[0][0]})")
        self._set_units(units, specs)
        self.shuffle_window = self._check_window(shuffle_window)
        self.node_slots = self._check_slots(node_slots)

    def describe_unit(self, unit: int) -> str:
        s, lo, hi = self._unit_range[unit]
        return f"bytes {lo}-{hi} of {self.urls[s]}"

    def __repr__(self) -> str:
        return f"TarDataset({len(self.files)} shards, {len(self)} samples, {self.num_units} units, {self.nbytes} bytes)"


def _runs(samples: list, most: int) -> list:
    """A shard's samples cut, in order, into runs of whole samples spanning up to `most` bytes (a larger sample
    alone): [(first byte, end byte, samples), ...]."""
    out = []
    k = 0
    while k < len(samples):
        lo = min(off for _, off, _ in samples[k][1])
        hi, j = lo, k
        while j < len(samples):
            end = max(off + n for _, off, n in samples[j][1])
            if j > k and end - lo > most:
                break
            hi, j = max(hi, end), j + 1
        out.append((lo, hi, samples[k:j]))
        k = j
    return out
