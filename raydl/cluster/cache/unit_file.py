"""A cached unit's file (NOTE [ raydl node cache ] in node_actor.py): written whole or not at all (a temporary name,
then a rename), and ending in a trailer, a marker and the CRC-32 of the bytes before it, checked before any byte of
it is used (by the cache actor, a peer receiving it, and the workers reading it)."""

from __future__ import annotations

import errno
import os
import struct
import time
import uuid
import zlib
from typing import Optional

__all__ = [
    "UNIT_TRAILER_BYTES",
    "TMP_PREFIX",
    "seal",
    "unsealed",
    "sound",
    "write_whole",
    "unlink",
    "folder_bytes",
    "intact",
    "clean_tmp",
]

UNIT_TRAILER = (
    b"rdl\x01"  # a unit file's last 8 bytes: this marker, then the CRC-32 of the bytes before (little-endian)
)
UNIT_TRAILER_BYTES = 8
TMP_PREFIX = ".tmp-"  # a unit file being written (removed when a crashed writer left it)


def write_whole(folder: str, key: str, parts: list) -> None:
    """Write a unit's file from `parts` (its bytes, then its trailer) under a temporary name, then rename it."""
    tmp = os.path.join(folder, f"{TMP_PREFIX}{key}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as out:
            for p in parts:
                out.write(p)
        os.replace(tmp, os.path.join(folder, key))
    except OSError as e:
        unlink(tmp)
        if e.errno == errno.ENOSPC:
            raise OSError(e.errno, f"the cache folder {folder} is full (no space left on device)") from e
        raise


def seal(parts: list) -> bytes:
    """The trailer a unit's file ends with: UNIT_TRAILER and the CRC-32 of `parts`, the unit's bytes in order."""
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return UNIT_TRAILER + struct.pack("<I", crc)


def unsealed(raw: bytes) -> Optional[memoryview]:
    """A unit file's bytes without their trailer when the CRC matches; None for a file that fails it."""
    if len(raw) < UNIT_TRAILER_BYTES or raw[-UNIT_TRAILER_BYTES:-4] != UNIT_TRAILER:
        return None
    body = memoryview(raw)[:-UNIT_TRAILER_BYTES]
    (crc,) = struct.unpack("<I", raw[-4:])
    return body if zlib.crc32(body) == crc else None


def sound(path: str) -> bool:
    """Whether the unit file at `path` passes its checksum (False if it is gone)."""
    try:
        with open(path, "rb") as f:
            return unsealed(f.read()) is not None
    except OSError:
        return False


def unlink(path: str) -> None:
    """Remove `path` if it is there."""
    try:
        os.unlink(path)
    except OSError:
        pass


def folder_bytes(folder: str) -> tuple[int, dict]:
    """What a cache folder holds: (bytes in its subfolders, the datasets' metadata: the tar index, the file listing;
    {name: bytes} of its top-level files, unit files, temporary ones left out). Counted against `cache_limit`
    (NOTE [ raydl node cache ], "the folder")."""
    meta, units = 0, {}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0, {}
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                for root, _, files in os.walk(e.path):
                    for f in files:
                        try:
                            meta += os.path.getsize(os.path.join(root, f))
                        except OSError:
                            pass
            elif e.is_file(follow_symlinks=False) and not e.name.startswith(TMP_PREFIX):
                units[e.name] = e.stat(follow_symlinks=False).st_size
        except OSError:
            pass
    return meta, units


def intact(folder: str, key: str, nbytes: int) -> bool:
    """A whole file of the unit's size, trailer included (its bytes are checked by each reader: `unsealed`)."""
    try:
        return os.path.getsize(os.path.join(folder, key)) == nbytes
    except OSError:
        return False


def clean_tmp(folder: str, older_s: float = 3600) -> None:
    """Remove the temporary files a crashed writer left (older than `older_s`; a live writer's are newer)."""
    now = time.time()
    for name in os.listdir(folder):
        if name.startswith(TMP_PREFIX):
            p = os.path.join(folder, name)
            try:
                if now - os.path.getmtime(p) > older_s:
                    os.unlink(p)
            except OSError:
                pass
