"""Pickle a worker payload so Arrow data (and, on request, every buffer) is shared, not copied, per node.

NOTE [ raydl shared memory ]
A loader's payload (dataset, collate_fn, worker_init_fn) is pickled once in the driver by
`pack()` and put into Ray's object store once; every worker unpickles it in `configure`
(`open_payload`). Pickle protocol 5 lets a buffer travel out of band: the pickle stream refers
to it, and Ray stores it as raw bytes in the object, which a worker then maps read-only instead
of copying (a NumPy array or an Arrow buffer becomes a view of shared memory). What is shared:
  * `ray_shared_dataset_memory=True`: every out-of-band buffer (NumPy arrays, pyarrow Tables,
    Arrays, ChunkedArrays, RecordBatches anywhere in the dataset): one copy per node, and
    writing to one fails (read-only), as Ray documents for NumPy arrays.
  * always: `raydl.ArrowDataset` and Hugging Face `datasets` tables. Arrow data is immutable
    through pyarrow's API, so sharing it changes nothing a worker can see but memory. An
    in-memory table goes into the object store as its own object (`ArrowDataset` keeps it for
    its later loaders; a Hugging Face in-memory table is put once per loader). A memory-mapped
    file (an `ArrowDataset` over Arrow IPC files, a `datasets` cache file) travels as its path
    and size: each worker maps the file itself.
  * otherwise nothing: the default gives each worker a private, writable copy, as torch does.
Files on other nodes: a worker whose node lacks a mapped file (or holds one of another size)
reads the table from the object store instead, when the driver put it there. The driver does
so (one object-store copy on its node, moved to other nodes only when a worker there asks)
when the cluster has more than one node at the time the loader starts; on a single node the
files are the driver's own and nothing is put. A missing file with no such copy (a node
added after the loader started) is a FileNotFoundError naming the file and the fix.
ObjectRefs that the payload holds (raydl's own, or a user's) are listed beside the pickle
stream, so Ray counts them as held by the payload (nested refs) and frees nothing too early.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
from typing import Any, Callable, Optional

from .mp_objects import MultiprocessingObjectError, mp_kind

__all__ = ["pack", "open_payload", "Shipped", "files_here"]

logger = logging.getLogger(__name__)

# The refs of the payload being unpickled in this thread (see `_ref_at`).
_loading = threading.local()


class Shipped:
    """A payload with out-of-band buffers and nested refs; `load()` unpickles it in the worker."""

    def __init__(self, data: bytes, buffers: list, refs: list) -> None:
        self.data = data
        self.buffers = buffers
        self.refs = refs

    def __reduce__(self):
        # Ray pickles this with protocol 5: the PickleBuffers go out of band (mapped, not copied,
        # by the worker) and the refs are recorded as nested in the payload object.
        return Shipped, (self.data, [pickle.PickleBuffer(b) for b in self.buffers], self.refs)

    def load(self) -> Any:
        previous = getattr(_loading, "refs", None)
        _loading.refs = self.refs
        try:
            return pickle.loads(self.data, buffers=self.buffers)
        finally:
            _loading.refs = previous


def open_payload(payload: Any) -> Any:
    """The payload object, from what `configure` received: bytes (a private copy), `Shipped`, or the object."""
    if isinstance(payload, bytes):
        return pickle.loads(payload)
    if isinstance(payload, Shipped):
        return payload.load()
    return payload


def _ref_at(index: int) -> Any:
    refs = getattr(_loading, "refs", None)
    if refs is None:
        raise RuntimeError("raydl: an ObjectRef of a raydl payload was unpickled outside open_payload()")
    return refs[index]


class ShipContext:
    """What one `pack()` call knows: the cluster's size, and the objects it put (each at most once)."""

    def __init__(self) -> None:
        self._multi_node: Optional[bool] = None
        self._puts: dict = {}  # id(owner) -> (owner, ref): the owner is kept so its id is not reused

    @property
    def multi_node(self) -> bool:
        if self._multi_node is None:
            import ray

            self._multi_node = sum(1 for n in ray.nodes() if n.get("Alive")) > 1
        return self._multi_node

    def put_once(self, owner: Any, make: Callable[[], Any]) -> Any:
        """`ray.put(make())`, once per `owner` in this payload."""
        import ray

        key = id(owner)
        if key not in self._puts:
            self._puts[key] = (owner, ray.put(make()))
        return self._puts[key][1]

    def fallback_ref(self, owner: Any, make_table: Callable[[], Any]) -> Any:
        """An object-store copy of a memory-mapped table for nodes without its files; None on one node."""
        return self.put_once(owner, make_table) if self.multi_node else None

    @staticmethod
    def fingerprints(paths: Any) -> list:
        """What a worker checks before mapping a file by path: its size in bytes (None: gone here too)."""
        return [os.path.getsize(p) if os.path.isfile(p) else None for p in paths]


def files_here(paths: Any, fingerprints: list, fallback: Any, what: str) -> bool:
    """Whether this node holds the driver's files (map them); False: read `fallback` from the object store.

    Raises:
        FileNotFoundError: a file is missing or differs here, and the driver shipped no copy.
    """
    bad = [
        p
        for p, size in zip(paths, fingerprints)
        if size is None or not (os.path.isfile(p) and os.path.getsize(p) == size)
    ]
    if not bad:
        return True
    if fallback is not None:
        logger.info("raydl: %s file %s is not on this node; reading its table from the object store", what, bad[0])
        return False
    import ray

    state = "missing" if not os.path.exists(bad[0]) else "not the driver's (another size, or gone from the driver)"
    raise FileNotFoundError(
        f"{what}: memory-mapped file {bad[0]} is {state} on node {ray.util.get_node_ip_address()}, and raydl "
        "shipped no copy of its table (it does when the cluster has more than one node as the loader starts). "
        "Fix: put the files on storage every node sees, or load the table into memory first."
    )


class _PayloadPickler:
    """cloudpickle with raydl's reducers (NOTE [ raydl shared memory ]); built lazily (Ray's cloudpickle)."""

    cls: Any = None

    @classmethod
    def make(cls, file: Any, share_buffers: bool, ctx: ShipContext) -> Any:
        if cls.cls is None:
            cls.cls = _pickler_class()
        return cls.cls(file, share_buffers, ctx)


def _pickler_class() -> type:
    import ray
    from ray import cloudpickle

    class PayloadPickler(cloudpickle.Pickler):
        def __init__(self, file: Any, share_buffers: bool, ctx: ShipContext) -> None:
            super().__init__(file, protocol=5, buffer_callback=self._on_buffer)
            self.share_buffers = share_buffers
            self.ctx = ctx
            self.buffers: list = []
            self.refs: list = []

        def _on_buffer(self, buffer: pickle.PickleBuffer) -> bool:
            if not self.share_buffers:
                return True  # in band: each worker unpickles its own copy
            self.buffers.append(buffer)
            return False

        def reducer_override(self, obj: Any) -> Any:
            kind = mp_kind(obj)  # NOTE [ raydl multiprocessing objects ]: fails here even where pickle would not
            if kind is not None:
                raise MultiprocessingObjectError(obj, kind)
            if isinstance(obj, ray.ObjectRef):
                self.refs.append(obj)
                return _ref_at, (len(self.refs) - 1,)
            hook = getattr(type(obj), "_raydl_ship_reduce", None)
            if hook is not None:
                return hook(obj, self.ctx)
            if type(obj).__module__ == "datasets.table":
                reduced = _hf_table_reduce(obj, self.ctx)
                if reduced is not None:
                    return reduced
            return super().reducer_override(obj)

    return PayloadPickler


def pack(payload: Any, share_buffers: bool) -> Any:
    """The payload as bytes (nothing shared: as before raydl knew Arrow) or as a `Shipped`."""
    stream = io.BytesIO()
    pickler = _PayloadPickler.make(stream, share_buffers, ShipContext())
    pickler.dump(payload)
    if not pickler.buffers and not pickler.refs:
        return stream.getvalue()
    return Shipped(stream.getvalue(), [b.raw() for b in pickler.buffers], pickler.refs)


# ---------------------------------------------------------------------- Hugging Face datasets tables


def _hf_table_reduce(table: Any, ctx: ShipContext) -> Any:
    """A `datasets.table` block: a cache file by path (with a fallback copy), an in-memory table by ref."""
    name = type(table).__name__
    if name == "MemoryMappedTable":
        fallback = ctx.fallback_ref(table, lambda: table.table)
        return _open_hf_file, (table.path, table.replays, ctx.fingerprints([table.path]), fallback)
    if name == "InMemoryTable":
        return _hf_in_memory, (ctx.put_once(table, lambda: table.table),)
    return None  # ConcatenationTable pickles its blocks, which come back here


def _open_hf_file(path: str, replays: Any, fingerprints: list, fallback: Any) -> Any:
    from datasets.table import InMemoryTable, MemoryMappedTable

    if files_here([path], fingerprints, fallback, "Hugging Face datasets"):
        return MemoryMappedTable.from_file(path, replays)
    import ray

    return InMemoryTable(ray.get(fallback))


def _hf_in_memory(ref: Any) -> Any:
    import ray
    from datasets.table import InMemoryTable

    return InMemoryTable(ray.get(ref))
