"""Datasets and probes for the Arrow tests (module level: raydl's actors unpickle them by reference)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from torch.utils.data import Dataset


def identity(x):
    return x


def row_to_pair(row: dict):
    """A transform: (float features, int label) from a metadata row."""
    return np.asarray([row["score"], len(row["caption"])], dtype=np.float32), row["label"]


def metadata_columns(n: int) -> dict:
    """A small metadata table: a path, a label, a caption, a score and a list of numbers per row."""
    return {
        "path": [f"images/{i:06d}.jpg" for i in range(n)],
        "label": [i % 7 for i in range(n)],
        "caption": [f"a photo of thing {i}" + "!" * (i % 5) for i in range(n)],
        "score": [i / 10 for i in range(n)],
        "box": [[i, i + 1, i + 2] for i in range(n)],
    }


def anonymous_bytes() -> int:
    """This process's anonymous memory (heap and private copies; not shared memory, not mapped files)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Anonymous line in /proc/self/smaps_rollup")


def _mappings() -> list:
    """(start, end, path) of this process's memory mappings that have a path."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, parts[5].strip()))
    return out


def buffer_places(table: pa.Table) -> set:
    """Where the table's data buffers live: 'plasma' (Ray's object store), 'file:<name>' or 'heap'."""
    maps = _mappings()
    places = set()
    for column in table.columns:
        for chunk in column.chunks:
            for buf in chunk.buffers():
                if buf is None or buf.size == 0:
                    continue
                where = "heap"
                for start, end, path in maps:
                    if start <= buf.address < end and not path.startswith("["):  # [heap], [stack]: not files
                        where = "plasma" if "plasma" in path else f"file:{os.path.basename(path.split(' ')[0])}"
                        break
                places.add(where)
    return places


def write_fails(table: pa.Table) -> bool:
    """Whether writing into the table's first data buffer (as a NumPy view) raises."""
    buf = next(b for c in table.columns for ch in c.chunks for b in ch.buffers() if b is not None and b.size)
    view = np.frombuffer(buf, dtype=np.uint8)
    try:
        view[0] = view[0]
    except ValueError:
        return True
    return False


def touch(table: pa.Table) -> int:
    """Read every value of every numeric column (faults all their pages in)."""
    total = 0
    for column in table.columns:
        if pa.types.is_integer(column.type):
            total += pc.sum(column).as_py() or 0
    return total


def table_of(data) -> pa.Table:
    """The pyarrow Table behind what a probe holds."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, (pa.Array, pa.ChunkedArray)):
        return pa.table({"x": data})
    if hasattr(data, "table"):  # raydl.ArrowDataset
        return data.table
    return data.with_format("arrow")[:]  # a Hugging Face datasets.Dataset


class MemoryProbe(Dataset):
    """Holds some tabular data; item i reports, from inside the worker, how that data sits in memory."""

    def __init__(self, data, n: int = 2) -> None:
        self.data = data
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        import psutil

        table = table_of(self.data)
        touched = touch(table)
        return {
            "uss": psutil.Process().memory_full_info().uss,
            "anon": anonymous_bytes(),
            "places": sorted(buffer_places(table)),
            "write_fails": write_fails(table),
            "sum": touched,
            "pid": os.getpid(),
        }


class PathsDataset(Dataset):
    """docs/data-sources.md's example: file paths held as a Python list, or (one line changed) as a pyarrow array."""

    def __init__(self, paths, as_arrow: bool) -> None:
        self.paths = pa.array(paths) if as_arrow else list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i):
        path = self.paths[i]
        return path.as_py() if isinstance(path, pa.Scalar) else path
