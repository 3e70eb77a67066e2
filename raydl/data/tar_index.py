"""The sample index of tar shards: where each sample's members lie, read from the headers once and kept on disk.

NOTE [ raydl tar index ]
A shard is scanned header by header (`scan_members`): ustar and GNU headers, GNU long names, pax
extended headers (`path`, `size`; Solaris's `X` as `x`; a global header's `path` for every later
member, as Python's tarfile reads it), each header's checksum checked; directories, links and other
non-regular members are skipped, as tar's and webdataset's readers skip them; GNU sparse files (type
`S`, or pax `GNU.sparse.*` records) are refused, never read as their stored bytes. Members are grouped
into samples by WebDataset's rule (`group_samples`): the key is the path up to the first `.` of its
last component, the rest, lower-cased, the field; a run of consecutive members with one key is one
sample; `__*__` metadata members and names without a `.` are skipped; a field twice in one run, or a
member claiming `__key__` or `__url__`, is an error, and a sample with a non-empty `__bad__` member is
dropped, as in webdataset. A key whose members are not adjacent makes two samples, as webdataset does.
Checked against webdataset 1.0.2 on its own test tars and ~150 hand-made ones (2026-11-29); where
the two still differ, raydl follows GNU tar: a GNU header's unused prefix bytes are not a path prefix,
a directory or link header's size is skipped as data, a shard that ends in garbage is an error.
How a shard is read for its headers: a local (or NFS) shard by positioned reads that hop over the
data; a remote one in one streamed request, since each hop would be a request (~20 ms each to S3;
benchmarks/README.md, "Tar shards: the index"). Shards are scanned in parallel. Each shard's index is
written to `<cache_dir>/tar-index/` under a key of its path, size and modification time: a second
job, another node or the next run reads it instead of scanning, and a shard that changed gets a new
key, so it is scanned again, never read with a stale index. Progress (shards, bytes, time left) goes
to a terminal's line, else to log lines; Ctrl-C stops the scan and keeps what was written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, Optional

__all__ = [
    "RESERVED_FIELDS",
    "TarFormatError",
    "group_samples",
    "index_shards",
    "is_bad",
    "sample_key",
    "scan_members",
    "write_json",
]

logger = logging.getLogger("raydl.data")

BLOCK = 512
_ZERO = bytes(BLOCK)
_REGULAR = (b"0", b"\x00", b"7")
_SKIPPED = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, FIFOs
_META = re.compile(r"__[^/]*__($|/)")
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_INDEX_THREADS = 16
_STREAM_CHUNK = 8 << 20
_INDEX_VERSION = 2  # 2: `__bad__` samples dropped, `__key__` / `__url__` fields refused, pax sparse files refused
RESERVED_FIELDS = ("__key__", "__url__")  # fields a sample has already: a member claiming one repeats it (webdataset)


class TarFormatError(ValueError):
    """A shard that is not a tar, is truncated, or has a header whose checksum fails: names the shard and offset."""


def _number(field: bytes, shard: str, offset: int) -> int:
    """A header's numeric field: octal, or GNU's base-256 (first byte 0x80 / 0xff)."""
    if field and field[0] in (0x80, 0xFF):
        n = 0
        for b in field[1:]:
            n = (n << 8) | b
        return n if field[0] == 0x80 else n - (256 ** (len(field) - 1))
    text = field.split(b"\x00", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarFormatError(f"{shard}: a tar header at byte {offset} has a malformed number {field!r}") from None


def _checksum_ok(block: bytes, shard: str, offset: int) -> bool:
    try:
        want = _number(block[148:156], shard, offset)
    except TarFormatError:
        return False
    unsigned = sum(block[:148]) + 256 + sum(block[156:])  # the checksum field counts as 8 spaces
    signed = unsigned - sum(b for b in block[:148] if b > 127) * 2 - sum(b for b in block[156:] if b > 127) * 2
    return want in (unsigned, signed)


def _text(raw: bytes) -> str:
    return raw.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes, shard: str, offset: int) -> dict:
    """A pax extended header's records ("LEN key=value\\n")."""
    out, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] not in (b"\x00", b""):
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise TarFormatError(f"{shard}: a malformed pax header at byte {offset}") from None
        record = data[space + 1 : pos + length - 1]
        key, _, value = record.partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def scan_members(read: Callable[[int, int], bytes], size: int, shard: str) -> Iterator[tuple]:
    """(name, data offset, data size) of each regular member of a tar of `size` bytes, `read(offset, n)` giving its
    bytes (offsets only grow). Raises TarFormatError naming the shard and byte offset."""
    offset = 0
    long_name: Optional[str] = None
    pax: dict = {}
    global_pax: dict = {}  # a 'g' header's records hold for every later member, as Python's tarfile applies them
    while True:
        if offset + BLOCK > size:
            if offset == size and offset > 0:
                return  # no end-of-archive blocks: tar and webdataset accept that too
            if offset == 0:
                raise TarFormatError(f"{shard}: not a tar file (empty or shorter than one header)")
            raise TarFormatError(f"{shard}: truncated at byte {size}: a header at byte {offset} is cut off")
        block = read(offset, BLOCK)
        if block == _ZERO:
            return
        if not _checksum_ok(block, shard, offset):
            if offset == 0:
                raise TarFormatError(f"{shard}: not a tar file (the first header's checksum fails)")
            raise TarFormatError(f"{shard}: the tar header at byte {offset} fails its checksum (corrupt shard)")
        kind = block[156:157]
        n = _number(block[124:136], shard, offset)
        if "size" in pax:
            try:
                n = int(pax["size"])
            except ValueError:
                raise TarFormatError(
                    f"{shard}: the pax header before byte {offset} has a malformed size {pax['size']!r}"
                ) from None
        data_at = offset + BLOCK
        if data_at + n > size:
            raise TarFormatError(
                f"{shard}: truncated at byte {size}: the member whose header is at byte {offset} needs "
                f"{n} bytes from byte {data_at}"
            )
        nxt = data_at + (n + BLOCK - 1) // BLOCK * BLOCK
        if kind in (b"x", b"X"):  # X: Solaris's name for the same
            pax = _pax(read(data_at, n), shard, offset)
        elif kind == b"g":
            global_pax.update(_pax(read(data_at, n), shard, offset))
        elif kind == b"L":
            long_name = _text(read(data_at, n))
        elif kind == b"K":
            pass  # a long link target: links are skipped
        elif kind == b"S":
            raise TarFormatError(f"{shard}: the member at byte {offset} is a GNU sparse file, which raydl cannot read")
        else:
            name = long_name if long_name is not None else _text(block[0:100])
            prefix = _text(block[345:500]) if block[257:263] == b"ustar\x00" else ""
            if long_name is None and prefix:
                name = prefix + "/" + name
            path = pax.get("path", global_pax.get("path"))
            if path is not None:
                name = path
            if any(k.startswith("GNU.sparse.") for k in pax):
                raise TarFormatError(
                    f"{shard}: the member {pax.get('GNU.sparse.name', name)!r} at byte {offset} is a GNU sparse file "
                    "(pax format), which raydl cannot read: write the shard without tar's --sparse"
                )
            if kind in _REGULAR and not (kind == b"\x00" and name.endswith("/")):
                yield name, data_at, n
            elif kind not in _SKIPPED and kind not in _REGULAR:
                logger.debug("raydl: %s: member %r of tar type %r skipped", shard, name, kind)
            long_name, pax = None, {}
        offset = nxt


def sample_key(name: str) -> tuple:
    """(key, field) of a member or object name by WebDataset's rule; (None, None) for a name it skips (`__*__`
    metadata, no `.` in the last component)."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return None, None
    if _META.match(name):
        return None, None
    m = _KEY.match(name)
    if m is None:
        return None, None
    return m.group(1), m.group(2).lower()


def is_bad(fields: list) -> bool:
    """Whether a sample's [(field, offset, size)] hold a non-empty `__bad__` member: webdataset drops such a sample."""
    return any(f == "__bad__" and size > 0 for f, _, size in fields)


def group_samples(members: Iterator[tuple], shard: str) -> list:
    """[(key, [(field, offset, size), ...]), ...] by WebDataset's rule (NOTE [ raydl tar index ]): a sample with a
    non-empty `__bad__` member is dropped, as webdataset's `valid_sample` drops it."""
    samples: list = []
    key: Optional[str] = None
    fields: list = []
    names: set = set()

    def close() -> None:
        if fields and not is_bad(fields):
            samples.append((key, fields))

    for name, offset, n in members:
        prefix, field = sample_key(name)
        if prefix is None:
            continue
        if prefix != key:
            close()
            key, fields, names = prefix, [], set(RESERVED_FIELDS)
        if field in names:
            raise ValueError(f"{shard}: member {name!r} repeats field {field!r} of sample {key!r} (duplicate name)")
        names.add(field)
        fields.append((field, offset, n))
    close()
    return samples


class _Forward:
    """`read(offset, n)` over a stream read forward in large chunks (a remote shard's one request). Offsets only grow;
    data between headers is read and dropped in bounded chunks, never held whole (a 1 GB member costs 8 MiB)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._buf = b""
        self._at = 0  # the stream offset of _buf[0]

    def read(self, offset: int, n: int) -> bytes:
        if offset < self._at:
            raise RuntimeError("raydl bug: a tar scan read backwards")
        held_end = self._at + len(self._buf)
        if offset >= held_end:  # hop over bytes not held: whole chunks read (each a request or more), dropped
            pos, buf = held_end, b""
            while True:
                chunk = self._stream.read(_STREAM_CHUNK)
                if not chunk:
                    break
                if pos + len(chunk) > offset:
                    buf = chunk
                    break
                pos += len(chunk)
            self._buf, self._at = buf, pos
        start = offset - self._at
        if start + n > len(self._buf):  # refill: one copy of what is kept, then whole chunks appended
            parts, have = [self._buf[start:]], len(self._buf) - start
            while have < n:
                chunk = self._stream.read(max(_STREAM_CHUNK, n - have))
                if not chunk:
                    break
                parts.append(chunk)
                have += len(chunk)
            self._buf, self._at, start = b"".join(parts), offset, 0
        return self._buf[start : start + n]


def scan_shard(fs: Any, path: str, size: int, url: str, mode: str = "auto") -> list:
    """One shard's samples (NOTE [ raydl tar index ]): positioned reads that hop over the data ("hop", the default on
    a local disk) or one streamed read ("stream", the default elsewhere)."""
    if mode == "auto":
        mode = "hop" if type(fs).__name__ == "LocalFileSystem" else "stream"
    if mode == "hop":
        with fs.open_input_file(path) as f:
            return group_samples(scan_members(lambda o, n: f.read_at(n, o), size, url), url)
    with fs.open_input_stream(path) as f:
        reader = _Forward(f)
        return group_samples(scan_members(reader.read, size, url), url)


def _stored_name(path: str, size: int, mtime_ns: Optional[int]) -> str:
    return hashlib.sha1(f"v{_INDEX_VERSION}|{path}|{size}|{mtime_ns}".encode()).hexdigest()[:32] + ".json"


def _load(file: str) -> Optional[list]:
    try:
        with open(file, encoding="utf-8") as f:
            doc = json.load(f)
        return [(k, [tuple(x) for x in fields]) for k, fields in doc["samples"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, or a partial write of another process: scanned again


def write_json(file: str, doc: Any) -> None:
    """`doc` as JSON at `file`, whole or not at all (a reader never sees a partial index or listing)."""
    os.makedirs(os.path.dirname(file), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, file)


class _Progress:
    """Shards done, bytes, time left: a terminal's line, else a log line every 10 s (first after 2 s)."""

    def __init__(self, total_shards: int, total_bytes: int) -> None:
        self.total_shards, self.total_bytes = total_shards, total_bytes
        self.shards = self.bytes = 0
        self.t0 = time.monotonic()
        self._last = self.t0 - 8.0
        self._tty = sys.stderr.isatty()
        self._lock = threading.Lock()

    def line(self) -> str:
        """The time left at the rate so far: of bytes where shards are scanned, of shards where their shipped indexes
        are read (`total_bytes` 0: no shard's bytes are read)."""
        took = time.monotonic() - self.t0
        done, total = (self.bytes, self.total_bytes) if self.total_bytes > 0 else (self.shards, self.total_shards)
        left = f"about {(total - done) * took / done:.0f} s left" if done > 0 and took > 0 else "time left unknown yet"
        size = f"{self.bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB, " if self.total_bytes > 0 else ""
        return f"raydl: indexing tar shards: {self.shards}/{self.total_shards} shards, {size}{took:.0f} s, {left}"

    def done(self, nbytes: int) -> None:
        with self._lock:
            self.shards += 1
            self.bytes += nbytes
            now = time.monotonic()
            if self._tty:
                if now - self._last >= 0.5 or self.shards == self.total_shards:
                    self._last = now
                    sys.stderr.write("\r" + self.line() + ("\n" if self.shards == self.total_shards else ""))
                    sys.stderr.flush()
            elif now - self._last >= 10.0:
                self._last = now
                logger.info("%s", self.line())


def index_shards(fs: Any, shards: list, cache_dir: str, shipped: Optional[Callable] = None) -> tuple:
    """([samples of each shard], seconds spent scanning, bytes scanned) for `shards` = [(url, FileInfo)]: stored
    indexes read, the others scanned in parallel and stored (NOTE [ raydl tar index ]); with `shipped(url, info)`,
    each shard's samples come from the index the corpus ships (data/shipped_index.py) instead of a scan."""
    folder = os.path.join(cache_dir, "tar-index")
    out: list = [None] * len(shards)
    todo = []
    for k, (url, info) in enumerate(shards):
        name = _stored_name(info.path, int(info.size), info.mtime_ns)
        file = os.path.join(folder, ("shipped-" if shipped is not None else "") + name)
        got = _load(file)
        if got is None:
            todo.append((k, url, info, file))
        else:
            out[k] = got
    if not todo:
        return out, 0.0, 0
    progress = _Progress(len(todo), 0 if shipped is not None else sum(int(i.size) for _, _, i, _ in todo))
    t0 = time.perf_counter()

    def one(k: int, url: str, info: Any, file: str) -> None:
        from .storage import with_retries

        if shipped is not None:
            samples = with_retries(lambda: shipped(url, info), f"reading the index of {url}")
        else:
            samples = with_retries(lambda: scan_shard(fs, info.path, int(info.size), url), f"indexing {url}")
        write_json(file, {"url": url, "size": int(info.size), "samples": samples})
        out[k] = samples
        progress.done(0 if shipped is not None else int(info.size))

    pool = ThreadPoolExecutor(min(_INDEX_THREADS, len(todo)), thread_name_prefix="raydl_tar_index")
    futures = [pool.submit(one, *t) for t in todo]
    try:
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for fut in finished:
                fut.result()  # the first shard that failed stops the build, named
    except BaseException as e:
        pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(e, KeyboardInterrupt):
            logger.warning(
                "raydl: indexing interrupted: %d of %d shards indexed and kept in %s",
                progress.shards,
                len(todo),
                folder,
            )
        raise
    pool.shutdown()
    return out, time.perf_counter() - t0, progress.bytes
