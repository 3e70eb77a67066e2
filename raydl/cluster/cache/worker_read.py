"""A worker's side of the node cache: the units of one batch, read through this node's cache actor.

NOTE [ raydl node cache ] in cluster/cache/node_actor.py has the design. A worker asks its node's cache for
the units (row groups) a batch needs, waits (bounded by READ_TIMEOUT_S) while the cache fetches
what it does not hold, reads the files, checks each one's CRC (a file that fails it is never
decoded: the cache refetches it) and releases them. A cache that died or was replaced is
found (or started) again; without Ray (a dataset used in a plain process) units are read straight
from storage, with the same retries.
"""

from __future__ import annotations

import time
from typing import Any

from ...data.storage import read_objects, with_retries
from .handles import _ensure_registered, _name, _registered, node_cache
from .node_actor import ACQUIRE_SLICE_S, READ_TIMEOUT_S
from .unit_file import unsealed

__all__ = ["read_units"]


# NOTE [ raydl read ahead ]
# Over node slots (NOTE [ raydl node slots ] in driver/node_slots.py) the slots take turns batch by
# batch and a batch reads one or two units, so a worker that reads a unit only when a batch needs it
# calls its cache about once a batch: 7x the calls of the window shuffle, whose batches read a whole
# window's units together, and 0.59x its samples/s on one node of tiny batches (bench_across_nodes; 0.92x / 1.12x
# in epochs 1 / 2 with what follows, paired medians of 3).
# So a worker that must call its cache anyway takes, with the units it asks for, up to `ahead` more
# that the cache holds and the node's plan uses next (`NodeCache.acquire`), as bytes it keeps until
# a batch needs them (`UnitDataset._read`): no decoding ahead, and never a wait for a unit that is
# not there yet.


def read_units(dataset: Any, units: list, ahead: int = 0, have: tuple = ()) -> dict:
    """{unit: its bytes}, read from this node's cache (in a worker), or from storage without Ray; with `ahead`, also
    up to that many units the node's plan uses next that the cache holds, `have` excepted (NOTE [ raydl read
    ahead ]).

    Raises:
        OSError / FileNotFoundError: storage failed for good; names the file and row group.
        TimeoutError: the units did not arrive within READ_TIMEOUT_S.
    """
    import ray

    if not ray.is_initialized():
        return {u: _read_direct(dataset, u) for u in units}
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + READ_TIMEOUT_S
    name = _name(ray.get_runtime_context().get_node_id(), dataset.cache_dir)
    out: dict = {}
    todo = list(units)
    fresh = False
    first = True  # the batch's first call counts its hits and misses
    while todo:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"raydl cache: {dataset.describe_unit(todo[0])} (and {len(todo) - 1} more) did not arrive in "
                f"{READ_TIMEOUT_S:.0f} s (RAYDL_CACHE_READ_TIMEOUT_S)"
            )
        actor = node_cache(dataset.cache_dir, dataset.cache_limit, fresh=fresh)
        fresh = False
        try:
            _ensure_registered(actor, dataset, name)
            got = ray.get(
                actor.acquire.remote(
                    token=dataset.token,
                    units=todo,
                    timeout_s=left,
                    count=first,
                    ahead=ahead if first else 0,
                    have=tuple(have) if first and ahead else (),
                ),
                timeout=ACQUIRE_SLICE_S + 30,
            )
            first = False
        except (RayActorError, GetTimeoutError):  # the cache died (or was replaced): find or start another
            fresh = True
            time.sleep(0.1)
            continue
        if got["unknown"]:
            _registered.discard((name, dataset.token))
            continue
        for u, msg in got["errors"].items():
            kind = FileNotFoundError if msg.startswith("FileNotFoundError") else OSError
            raise kind(f"raydl cache: cannot fetch {dataset.describe_unit(u)}: {msg}")
        lost, corrupt = [], []
        extra = got.get("ahead") or {}
        for u, path in [*got["ready"].items(), *extra.items()]:
            try:
                with open(path, "rb") as f:
                    body = unsealed(f.read())
            except FileNotFoundError:
                lost.append(u)
                continue
            if body is None:  # its checksum fails: never decoded; the cache deletes it and fetches it again
                corrupt.append(u)
            else:
                out[u] = body
        pinned = [*got["ready"], *extra]
        actor.release.remote(token=dataset.token, units=pinned, lost=tuple(lost), corrupt=tuple(corrupt))
        todo = [u for u in todo if u not in out]
    return out


def _read_direct(dataset: Any, unit: int) -> bytes:
    path, _size, segs, _key = dataset.raydl_cache_units()[unit]

    def read() -> bytes:
        if isinstance(path, tuple):  # several whole objects (FileDataset)
            return b"".join(read_objects(dataset.filesystem, path))
        with dataset.filesystem.open_input_file(path) as f:
            return b"".join(f.read_at(n, off) for off, n in segs)

    data = with_retries(read, f"reading {path}")
    if len(data) != sum(n for _, n in segs):
        raise OSError(f"cannot read {dataset.describe_unit(unit)}: {path} is truncated")
    return data
