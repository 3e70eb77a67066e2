"""torch's default_collate in a worker, writing large batches into memory the worker reuses.

NOTE [ raydl collate buffers ]
Inside a torch worker, `default_collate` allocates each batch tensor in fresh shared memory, which
torch's queue hands to the main process. A raydl worker's batch travels through Ray instead (its
object store copies it, or a lane pickles it: NOTE [ raydl zero-copy ], NOTE [ raydl lane ]), so
its batches are collated into private memory (`private_memory_collate`). Fresh memory is costly
for a large batch: glibc maps every allocation over 32 MiB anew and unmaps it when freed, so each
batch of 64 ImageNet crops (38.5 MB of float32) first takes ~9,400 page faults and the kernel's
zeroing of every page: `torch.stack` of such a batch costs ~21 ms into fresh memory and ~4 ms into
memory already mapped (this 2-core machine), ~8 % of the worker's CPU in bench_images (retired at 3d9a662:
docs/benchmark-notes.md#retired-benchmarks).
So a worker's `BatchBuffers` keeps the tensors it collated large batches into (each at least
REUSE_MIN_BYTES) and stacks a later batch of the same dtype and shape into one of them — only when
nothing else holds it any more: no reference to the pooled tensor but the pool's (Python's count)
and no other tensor or storage object over its memory (torch's count of a storage's holders, a
private call; without it nothing is reused). The batch a worker
returns is held by what sends it (the NumPy alias `encode` makes, which Ray's return value holds
while it is copied into the object store; a lane's pickling) until it was copied out, so a
buffer is never written while a batch in it is on its way, whichever path and whatever the
timing; the driver never sees the buffer, only its copy. User code never sees it either: buffers
are used only when the loader's `collate_fn` is torch's `default_collate`, whose tensors the
worker hands straight to transport.
The pool keeps at most REUSE_KEEP buffers per shape and REUSE_SHAPES shapes (the last used), and
drops them when the worker leaves its loader (`clear`), so an idle worker holds none.
The driver's cold start (driver/coldstart/shadow.py) collates with `private_memory_collate`: its batches
go to the user, who may keep views of them.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
import torch.utils.data._utils.worker as _torch_worker
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from .._constants import REUSE_KEEP, REUSE_MIN_BYTES, REUSE_SHAPES

__all__ = ["private_memory_collate", "BatchBuffers"]


def _outside_worker(collate_fn: Callable[..., Any], batch: Any, **kwargs: Any) -> Any:
    """`collate_fn(batch)` with torch's worker info cleared: torch's tensor collate then takes private memory."""
    info = _torch_worker._worker_info
    _torch_worker._worker_info = None
    try:
        return collate_fn(batch, **kwargs)
    finally:
        _torch_worker._worker_info = info


def private_memory_collate(batch: Any) -> Any:
    """torch's default_collate, without its shared-memory output (NOTE [ raydl collate buffers ])."""
    return _outside_worker(default_collate, batch)


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private; without it, no reuse


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """Who holds `t` or its memory: references to this tensor object, and the tensors (views, `.numpy()`'s alias)
    and storage objects (one made here) over its memory."""
    return sys.getrefcount(t), _storage_use_count(t.untyped_storage()._cdata)  # type: ignore[misc]


def _unused_holders() -> tuple[int, int]:
    """`_holders` of a tensor only a pool holds, seen from the same code shape as `BatchBuffers._free_buffer`'s."""
    for buf in [torch.empty(1)]:
        return _holders(buf)
    raise AssertionError("unreachable")


class BatchBuffers:
    """A worker's default_collate that reuses the memory of its large batches (NOTE [ raydl collate buffers ])."""

    def __init__(self) -> None:
        self._pools: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()
        self._fn_map = dict(default_collate_fn_map)
        self._fn_map[torch.Tensor] = self._collate_tensor
        self._unused = _unused_holders() if _storage_use_count is not None else None
        self.reused = 0  # batch tensors stacked into a kept buffer (tests)

    def __call__(self, batch: Any) -> Any:
        return _outside_worker(collate, batch, collate_fn_map=self._fn_map)  # small tensors: torch's own, private

    def clear(self) -> None:
        self._pools.clear()

    def _collate_tensor(self, batch: Any, *, collate_fn_map: Optional[dict] = None) -> torch.Tensor:
        elem = batch[0]
        if (
            type(elem) is not torch.Tensor
            or elem.layout != torch.strided
            or elem.device.type != "cpu"
            or elem.is_nested
            or elem.is_quantized
            or elem.requires_grad  # stack(out=) refuses autograd; torch's own collate handles it
            or elem.numel() * elem.element_size() * len(batch) < REUSE_MIN_BYTES
            or any(x.shape != elem.shape or x.dtype != elem.dtype for x in batch)  # torch.stack's own error
        ):
            return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        key = (elem.dtype, (len(batch), *elem.shape))
        buf = self._free_buffer(key)
        if buf is None:
            buf = torch.empty(key[1], dtype=elem.dtype)
            if self._unused is not None:
                self._keep(key, buf)
        else:
            self.reused += 1
        return torch.stack(batch, 0, out=buf)

    def _free_buffer(self, key: tuple) -> Optional[torch.Tensor]:
        pool = self._pools.get(key)
        if pool is None:
            return None
        self._pools.move_to_end(key)
        for buf in pool:
            if _holders(buf) == self._unused:  # nothing holds it but the pool: its last batch was sent
                return buf
        return None

    def _keep(self, key: tuple, buf: torch.Tensor) -> None:
        pool = self._pools.setdefault(key, [])
        self._pools.move_to_end(key)
        if len(pool) < REUSE_KEEP:
            pool.append(buf)
        while len(self._pools) > REUSE_SHAPES:
            self._pools.popitem(last=False)
