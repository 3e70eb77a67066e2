"""A row group's cached bytes read as the Parquet file they came from: only its column chunks, at their offsets.

The node cache keeps of each row group only the byte ranges of its column chunks (NOTE [ raydl
node cache ] in cluster/cache/node_actor.py). `ParquetDataset` decodes one with pyarrow, which seeks and reads
a file: `SegmentFile` is that file, of the original size, serving just those ranges; `merge_segments`
makes the ranges a unit fetches (adjacent or overlapping chunks read as one).
"""

from __future__ import annotations

import io

__all__ = ["SegmentFile", "merge_segments"]


class SegmentFile(io.RawIOBase):
    """A read-only file of the original size that serves only the cached byte segments, at their original offsets."""

    def __init__(self, data: bytes, segments: tuple, size: int) -> None:
        self._data = memoryview(data)
        self._segs = []  # (original offset, length, offset in data)
        at = 0
        for off, n in segments:
            self._segs.append((off, n, at))
            at += n
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else self._size + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self._size - self._pos
        for off, length, at in self._segs:
            if off <= self._pos and self._pos + n <= off + length:
                start = at + self._pos - off
                self._pos += n
                return bytes(self._data[start : start + n])
        raise OSError(f"read of {n} bytes at offset {self._pos} falls outside the cached column chunks")


def merge_segments(segs: list) -> list:
    """Sorted byte segments, adjacent or overlapping ones merged."""
    out: list = []
    for off, n in sorted(segs):
        if out and off <= out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], off + n)
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((off, n))
    return out
