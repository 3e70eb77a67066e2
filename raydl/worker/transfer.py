"""How batch tensors travel from a worker to the driver without a pickle copy of their data.

NOTE [ raydl zero-copy ]
Ray stores NumPy arrays in its object store out of band: the driver maps them, with no copy.
torch tensors, by contrast, are pickled through their storage bytes (a copy on each side). So a
worker `encode`s each dense CPU tensor of its batch as a `_TensorView` holding the tensor's
memory as a NumPy array (a view, no copy), and the driver `decode`s it back into a tensor:
  * without pinning, the tensor is made over the object-store memory itself: no copy at all.
    Ray flags such arrays read-only, but the store is mapped read-write into the driver and a
    batch's object is read by this driver alone, once; so the tensor is writable, as torch's
    are (its `.numpy()` too). It keeps the object alive — and its store memory in use — for
    as long as any view of it lives, exactly as torch's batches keep their shared memory.
    Ray's shutdown does not unmap memory still referenced (checked with Ray 2.60).
  * with pinning, the pin thread decodes into pinned memory: the driver's one copy, which
    torch makes too. A driver connected through Ray Client (`ray://`) also copies: its values
    arrive as Python bytes objects, which must not be written.
Tensors NumPy cannot represent (bfloat16, complex32, quantized, sparse, non-CPU) and
containers other than dict, list, tuple and namedtuple travel as Ray pickles them, unchanged.
Small tensors take the same route: torch pickles a tensor through `torch.save` of its storage
(about 0.2 ms even for a 0-dim label tensor, on each side), a NumPy array pickles in a few
microseconds, and Ray sends small objects inline with the task's reply. On the overhead-floor
benchmark (batch of 64 tiny samples) this alone moved raydl from ~1.0x to ~1.3x torch.
"""

from __future__ import annotations

import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np
import torch

from .. import _constants

__all__ = ["encode", "decode", "copy_array"]


class _TensorView:
    """A CPU tensor's memory as a NumPy array, plus what is needed to rebuild the exact tensor."""

    __slots__ = ("array", "dtype", "shape")

    def __init__(self, array: np.ndarray, dtype: torch.dtype, shape: tuple) -> None:
        self.array, self.dtype, self.shape = array, dtype, shape

    def __reduce__(self):
        return (_TensorView, (self.array, self.dtype, self.shape))


def _encode_tensor(t: torch.Tensor) -> Any:
    if (
        type(t) is not torch.Tensor
        or not t.is_cpu  # (half the cost of t.device.type: once per tensor of every batch)
        or t.layout is not torch.strided
        or t.is_nested  # torch.nested's default layout reports itself strided and contiguous
        or t.is_quantized
        or t.requires_grad
        or t.dtype not in _NUMPY_DTYPES
        or not t.is_contiguous()  # keep torch's strides exactly: such tensors travel pickled
        or t.is_conj()  # lazy conjugate / negative views: numpy() refuses them
        or t.is_neg()
    ):
        return t
    return _TensorView(t.numpy(), t.dtype, tuple(t.shape))


_NUMPY_DTYPES = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}  # fmt: skip


def _walk(data: Any, leaf: Callable[[Any], Any]) -> Any:
    """Apply `leaf` to every element of exact dicts, lists, tuples and namedtuples, keeping their types."""
    kind = type(data)
    if kind is dict:
        return {k: _walk(v, leaf) for k, v in data.items()}
    if kind is list:
        return [_walk(v, leaf) for v in data]
    if kind is tuple:
        return tuple(_walk(v, leaf) for v in data)
    if isinstance(data, tuple) and hasattr(data, "_fields") and type(data).__bases__ == (tuple,):
        return kind(*(_walk(v, leaf) for v in data))
    return leaf(data)


def encode(batch: Any) -> Any:
    """Worker side: replace large dense CPU tensors by zero-copy `_TensorView`s."""
    return _walk(batch, lambda x: _encode_tensor(x) if isinstance(x, torch.Tensor) else x)


_read_only_warned = False  # torch.from_numpy has met a read-only array in this process (its warning is spent)


def _decode_leaf(x: Any, pin: bool, copy: bool) -> Any:
    if type(x) is not _TensorView:
        return x
    array = x.array.reshape(x.shape)
    if not pin and not copy:
        global _read_only_warned
        if array.flags.writeable or (_read_only_warned and not torch.is_warn_always_enabled()):
            # Nothing to silence: torch warns only of a read-only array, and once a process. (Entering
            # `catch_warnings` costs ~7 us a tensor, which a process that never met a read-only array paid for each.)
            return torch.from_numpy(array)
        with warnings.catch_warnings():
            # torch warns once about arrays flagged read-only; this memory may be written (NOTE above)
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(array)
        _read_only_warned = _read_only_warned or not array.flags.writeable
        return tensor
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
    copy_array(out.numpy(), array)  # the one copy, into pinned memory (or private memory)
    return out


# NOTE [ raydl pin copy ]
# The driver's one copy of a batch (into pinned memory, before the device copy) ran on one core: 10-11 GB/s on a lent
# H200 machine whose copy engine takes 55 GB/s from pinned memory, so a transfer-bound loop waited on it (torch's
# too); 4 threads took raydl's loop from 5.4 to 15-17 GB/s there (benchmarks/README.md, "GPU").
# An array of at least PIN_COPY_SPLIT_BYTES is cut into PIN_COPY_THREADS page-aligned slices: the calling thread
# copies the first, a small pool the others (NumPy releases the GIL while it copies). The pool is made on first
# use and again in a forked child (its threads do not survive a fork). Where the rest of the copy engine's rate
# goes (the host's memory, the workers' delivery) and what would remove this copy: that README section.
_copy_pool: Optional[ThreadPoolExecutor] = None
_copy_pool_key: tuple = ()
_copy_pool_lock = threading.Lock()
_PAGE = 4096


def _pool(threads: int) -> ThreadPoolExecutor:
    global _copy_pool, _copy_pool_key
    key = (os.getpid(), threads)
    with _copy_pool_lock:
        if _copy_pool_key != key:
            if _copy_pool is not None and _copy_pool_key[0] == key[0]:
                _copy_pool.shutdown(wait=False)
            _copy_pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="raydl_copy")
            _copy_pool_key = key
        return _copy_pool


def copy_array(out: np.ndarray, src: np.ndarray) -> None:
    """`src` into `out` (same shape and dtype), split among threads when large (NOTE [ raydl pin copy ])."""
    threads = _constants.PIN_COPY_THREADS
    n = src.nbytes
    if (
        threads <= 1
        or n < _constants.PIN_COPY_SPLIT_BYTES
        or not (src.flags.c_contiguous and out.flags.c_contiguous)
        or src.dtype != out.dtype
    ):
        np.copyto(out, src, casting="no")
        return
    dst_bytes, src_bytes = out.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    per_thread = -(-n // threads)  # rounded up, then to whole pages
    step = -(-per_thread // _PAGE) * _PAGE
    slices = [slice(i, min(i + step, n)) for i in range(0, n, step)]
    pool = _pool(threads)
    rest = [pool.submit(np.copyto, dst_bytes[s], src_bytes[s]) for s in slices[1:]]
    np.copyto(dst_bytes[slices[0]], src_bytes[slices[0]])
    for f in rest:
        f.result()


def decode(batch: Any, pin: bool = False, copy: bool = False) -> Any:
    """Driver side: rebuild tensors from `_TensorView`s over the received memory, or copied (into pinned memory if `pin`).

    `copy=True` is for a driver connected through Ray Client (`ray://`), whose values arrive as
    Python bytes objects that must not be written.
    """
    return _walk(batch, lambda x: _decode_leaf(x, pin, copy))
