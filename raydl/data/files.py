"""`raydl.FileDataset`: plain files under a prefix (an ImageFolder in S3), grouped into samples, read through the
node cache many objects to a unit.

NOTE [ raydl file samples ]
The driver lists the objects once (a folder or prefix, a list of URLs, or a manifest file with one
URL or path a line) and keeps the listing in `<cache_dir>/file-listing/`, keyed by the sources, so
the next run or another rank does not list a million objects again (`relist=True` lists anew).
Objects are grouped by WebDataset's key rule on their path below the common folder: `cat/0001.jpg`
and `cat/0001.json` are one sample `{"__key__": "cat/0001", "jpg": ..., "json": ...}`, and an
ImageFolder's class is the key's parent folder. Consecutive samples (in key order) form a unit of
up to `RAYDL_FILE_UNIT_BYTES` (4 MiB, or a sixteenth of `cache_limit` if less) and
`RAYDL_FILE_UNIT_OBJECTS` (64) objects: the node cache fetches a unit's objects with one GET each
(pyarrow's S3 client sends a HEAD before it), 64 at a time, ahead of use in the epoch's known
order, so a loader pays storage's latency once per unit, not once per `__getitem__`. The rest (CRC
trailer, eviction, cooperative caches, shuffle, resume) is the node cache's and `MemberDataset`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from typing import Any, Callable, Optional, Sequence, Union

from .members import MemberDataset
from .sources import list_objects, path_of
from .tar_index import RESERVED_FIELDS, sample_key, write_json

__all__ = ["FileDataset"]

_UNIT_BYTES = int(os.environ.get("RAYDL_FILE_UNIT_BYTES", str(4 << 20)))
_UNIT_OBJECTS = int(os.environ.get("RAYDL_FILE_UNIT_OBJECTS", "64"))
_DEFAULT_LIMIT = "10GB"
_LISTING_VERSION = 1


class FileDataset(MemberDataset):
    """A map-style dataset over the files under a folder or prefix, grouped into samples by their key.

    Example, an ImageFolder on a local disk:
        >>> import os, tempfile
        >>> import raydl
        >>> root = tempfile.mkdtemp()
        >>> for cls, name in [("cat", "0001"), ("dog", "0002")]:
        ...     os.makedirs(os.path.join(root, "train", cls), exist_ok=True)
        ...     for ext, data in [("jpg", b"<jpeg>"), ("json", b"{}")]:
        ...         with open(os.path.join(root, "train", cls, f"{name}.{ext}"), "wb") as f:
        ...             _ = f.write(data)
        >>> ds = raydl.FileDataset(os.path.join(root, "train"), cache_dir=os.path.join(root, "cache"))
        >>> len(ds), ds[1]["__key__"], sorted(k for k in ds[1] if not k.startswith("__"))
        (2, 'dog/0002', ['jpg', 'json'])
        >>> ds[1]["__key__"].rsplit("/", 1)[0]  # the class of an ImageFolder
        'dog'

    Args:
        source: a folder or prefix (every object under it), a list of URLs or paths, or the path of a manifest
            file listing one URL or path a line (relative ones against the manifest's folder); local, NFS,
            ``s3://``, ``gs://``, anything pyarrow's filesystems reach.
        filesystem (pyarrow.fs.FileSystem, optional): the filesystem the paths are on. Defaults to ``None``.
        cache_dir (str, optional): the node-local folder of the cache and of the listing. Defaults to
            ``<tempdir>/raydl-cache``.
        cache_limit (int or str): the most bytes the cache holds on each node. Defaults to ``"10GB"``.
        transform (callable, optional): applied to each sample dict in the worker.
        batch_transform (callable, optional): applied to the list of a batch's sample dicts in the worker,
            with the loader's default `collate_fn`. Not with `transform`.
        shuffle_window (int, optional): units whose samples are shuffled together. Defaults to ``None``: as
            many as fit in half of `cache_limit`.
        node_slots (int, optional): the slots `shuffle=True`'s order deals the units to, each
            node making its own slots' batches: as for `TarDataset` (NOTE [ raydl node slots ]).
        relist (bool): list the source again instead of reading the kept listing. Defaults to ``False``.

    Raises:
        FileNotFoundError: a named object, folder or manifest does not exist.
        ValueError: nothing found, two objects giving one sample the same field (`a.JPG` and `a.jpg`), an
            object larger than `cache_limit` allows, or both `transform` and `batch_transform`.
    """

    _WHO = "FileDataset"

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
        relist: bool = False,
    ) -> None:
        self._configure(transform, batch_transform, cache_dir, cache_limit)
        self.filesystem, objects, self.listed = _listing(source, filesystem, self.cache_dir, relist)
        root = posixpath.commonpath([posixpath.dirname(p) for _, p, _, _ in objects]) if objects else ""
        samples: dict = {}  # key -> [(field, object), ...], in path order
        for k, (_, path, _, _) in enumerate(objects):
            key, field = sample_key(posixpath.relpath(path, root) if root else path)
            if key is None:
                continue
            if field in RESERVED_FIELDS:
                raise ValueError(
                    f"FileDataset: {objects[k][0]} would be field {field!r} of sample {key!r}, which every sample has "
                    "already (webdataset refuses such a member too): rename it"
                )
            members = samples.setdefault(key, [])
            if any(f == field for f, _ in members):
                other = objects[next(o for f, o in members if f == field)][0]
                raise ValueError(f"FileDataset: {objects[k][0]} and {other} are both field {field!r} of sample {key!r}")
            members.append((field, k))
        if not samples:
            raise ValueError(f"FileDataset: no object under {source!r} has a name of the form key.field")
        units, specs = [], []
        run: list = []
        run_bytes = run_objects = 0
        most = self._unit_target(_UNIT_BYTES)
        for key in sorted(samples):
            members = samples[key]
            size = sum(objects[o][2] for _, o in members)
            if run and (run_bytes + size > most or run_objects + len(members) > _UNIT_OBJECTS):
                units.append(run)
                run, run_bytes, run_objects = [], 0, 0
            run.append((key, members))
            run_bytes += size
            run_objects += len(members)
        if run:
            units.append(run)
        unit_samples = []
        self._unit_first = []
        for run in units:
            order = [o for _, members in run for _, o in members]
            place, off = {}, 0
            for o in order:
                place[o] = off
                off += objects[o][2]
            unit_samples.append(
                [
                    (key, objects[members[0][1]][0], [(f, place[o], objects[o][2]) for f, o in members])
                    for key, members in run
                ]
            )
            ident = "|".join(f"{objects[o][1]}|{objects[o][2]}|{objects[o][3]}" for o in order)
            specs.append(
                (
                    tuple(objects[o][1] for o in order),
                    off,
                    tuple((0, objects[o][2]) for o in order),
                    hashlib.sha1(f"files|{ident}".encode()).hexdigest()[:24],
                )
            )
            self._unit_first.append((run[0][0], run[-1][0], len(order)))
        self._set_units(unit_samples, specs)
        self.shuffle_window = self._check_window(shuffle_window)
        self.node_slots = self._check_slots(node_slots)

    def describe_unit(self, unit: int) -> str:
        first, last, n = self._unit_first[unit]
        return f"the {n} object(s) of samples {first!r} to {last!r}"

    def __repr__(self) -> str:
        return f"FileDataset({len(self)} samples, {self.num_units} units, {self.nbytes} bytes)"


def _listing(source: Any, filesystem: Any, cache_dir: str, relist: bool) -> tuple:
    """(filesystem, [(url, path, size, mtime_ns)] in path order, whether listed now): the kept listing when there
    is one (NOTE [ raydl file samples ]), else a new one, kept."""
    import pyarrow.fs as pafs

    sources = [os.fspath(source)] if isinstance(source, (str, os.PathLike)) else [os.fspath(s) for s in source]
    fs = filesystem
    if fs is None and sources:
        first = sources[0]
        fs, _ = pafs.FileSystem.from_uri(first if "://" in first else os.path.abspath(first))
    name = hashlib.sha1(json.dumps([_LISTING_VERSION, fs.type_name, [path_of(s, fs) for s in sources]]).encode())
    file = os.path.join(cache_dir, "file-listing", name.hexdigest()[:32] + ".json")
    if not relist:
        try:
            with open(file, encoding="utf-8") as f:
                return fs, [tuple(x) for x in json.load(f)], False
        except (OSError, ValueError):
            pass
    fs, found = list_objects("FileDataset", sources, fs, ())
    if len(sources) == 1 and len(found) == 1 and found[0][1].path == path_of(sources[0], fs):
        fs, found = _manifest(sources[0], found[0][1].path, fs)
    objects = sorted(((u, i.path, int(i.size), i.mtime_ns) for u, i in found), key=lambda o: o[1])
    write_json(file, objects)
    return fs, objects, True


def _manifest(url: str, path: str, fs: Any) -> tuple:
    """The objects a manifest file names, one URL or path a line (blank lines and `#` comments skipped)."""
    with fs.open_input_stream(path) as f:
        lines = f.read().decode("utf-8").splitlines()
    base_url = url.rsplit("/", 1)[0] if "/" in url else "."
    names = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    urls = [n if "://" in n or n.startswith("/") else f"{base_url}/{n}" for n in names]
    if not urls:
        raise ValueError(f"FileDataset: the manifest {url} names no object")
    return list_objects("FileDataset", urls, fs, ())
