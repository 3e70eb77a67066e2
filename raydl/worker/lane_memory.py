"""A local lane's shared memory: a worker writes its batches' arrays where the trainer reads them.

NOTE [ raydl lane memory ]
On the driver's node a lane's reply crossed a Unix socket (NOTE [ raydl lane ]): the worker copied
each array into the kernel and the trainer's core copied it out, then unpickled one small array
object per column and rebuilt each tensor from it. For an 18-column batch of 336 KB (bench_arrow's
table) that was ~0.28 ms of the trainer's core a batch, most of what a lane costs it
(bench_lane_reply, retired at 3d9a662, docs/benchmark-notes.md#retired-benchmarks; this project's 2-core host:
220 us to read and unpickle the reply, 53-67 to make tensors). So a lane on the driver's node has
its own memory, shared by the two processes:
  * the driver makes it (`memfd_create`: no name in /dev/shm to clean up, its size not bounded by
    /dev/shm's) as `slots` slots of `slot_bytes` each, and sends its descriptor as the lane's first
    message (SCM_RIGHTS over the Unix socket that proved itself with the token);
  * each call carries the slots its reply may fill (one per batch it asks for, free ones only: the
    driver's `LaneMemory`, driver/transport/lane_memory.py); the worker pickles its reply with each
    tensor's array written into the slots, 64-byte aligned, and a persistent id in the pickle in
    its place (`dumps_into`); the pickle, a few hundred bytes, goes over the socket;
  * the driver unpickles it with each id made a `_TensorView` over the slot's memory (`loads_from`),
    which `decode` makes a tensor over that memory: no copy on the trainer's core;
  * a slot is given to a call again only once nothing refers to the memory of its last reply (the
    batch's tensors, any view of them, anything the user kept: Python's reference count, as NOTE
    [ raydl receive buffers ]), so a batch in the user's hands is never written;
  * a reply that does not fit its slots (a batch grown past the size the first one set), or one
    the plain pickler refuses, goes over the socket as before: correctness never rests on room.
    Such a reply's message starts with a mark saying why (FELL_BACK: "full", "refused", "error"),
    which the driver counts (`loader.stats().lane_memory`);
  * the memory grows with the batches: a "full" reply of n bytes (its socket form's, arrays and
    pickle) makes the driver, before the lane's next call, make a memory of slots of 1.5 n + 64 KiB
    (at most LANE_MEMORY_MAX_SLOT_BYTES; a slot's pages cost nothing until written, so one sized
    for a whole reply of several batches costs no more than one batch's) and send its descriptor
    as it sent the first: a ("memory", size) message with it attached. The worker reads every
    message of a Unix lane with `recv_message` (ancillary data looked for), maps the new memory in
    place of its old mapping and fills the slots of later calls there; calls sent before it carry
    slots of the old memory and are answered before the worker reads it (the lane's order). The
    driver's old mapping is no one's to unmap: the arrays of the batches still using it refer to
    it (and the calls in flight to their slots), and it goes with the last of them;
  * errors while writing a reply into the memory: MemoryFull is room (above); an error pickling
    one of the user's objects (anything raised outside `persistent_id`) is "refused", quiet, as
    `send_reply` then sends the reply with cloudpickle or its batches as errors, the same as a lane
    without memory; an error inside `persistent_id`, this module writing an array (a dtype it has no
    code for, a released view), is a bug of raydl's: raised as LaneMemoryError, the reply still
    goes over the socket (the batch is not lost) marked "error", and the worker logs it once per
    lane at warning level with its traceback. Writing the pickle to the socket is outside all this:
    an OSError there is the lane's end, as for any reply;
  * pauses: a worker whose replies cannot use the memory (each larger than the largest slot the cap
    allows, or holding an object only cloudpickle sends) would pickle every reply twice, once into
    the slots and once for the socket. So after such a reply the driver sends the lane's next call
    without slots, after the next such reply the next 2, then 4, up to LANE_MEMORY_MAX_PAUSE; a reply
    that comes through the memory ends it. Batches that only sometimes outgrow the memory lose at
    most a few calls' worth of it (`calls_paused` in the stats).
Measured the same way: 0.12 ms a batch against 0.28 (bench_lane_reply; docs/benchmark-notes.md#retired-benchmarks,
"Lane memory": with 8 workers on 16 cores, bench_arrow's raydl rate 1.8-2.0x what it was).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import socket
import struct
from typing import Any, Optional

import numpy as np
import torch

from .transfer import _NUMPY_DTYPES, _TensorView

__all__ = [
    "ARENA_MARK",
    "FELL_BACK",
    "LaneMemoryError",
    "MemoryFull",
    "dumps_into",
    "loads_from",
    "recv_message",
    "send_memory",
    "map_memory",
]

# the first 4 bytes of a reply pickled into a lane's memory (a socket reply starts with its buffer count, < 2**31)
ARENA_MARK = b"\xff\xff\xff\xff"
# ... and of a socket reply to a call that was given slots, before its buffer count: why it is not in the memory
FELL_BACK = {"full": b"\xff\xff\xff\xfe", "refused": b"\xff\xff\xff\xfd", "error": b"\xff\xff\xff\xfc"}
_ALIGN = 64

# torch dtype <-> a small code in the persistent ids, and the NumPy dtype of its arrays
_TORCH_DTYPES = sorted(_NUMPY_DTYPES, key=str)
_CODES = {dtype: code for code, dtype in enumerate(_TORCH_DTYPES)}
_NP_DTYPES = [torch.empty(0, dtype=dtype).numpy().dtype for dtype in _TORCH_DTYPES]


class MemoryFull(Exception):
    """A reply's arrays do not fit the slots its call was given: it goes over the socket instead."""


class LaneMemoryError(Exception):
    """Writing an array into the lane's memory failed other than for room: a bug (NOTE [ raydl lane memory ])."""


class _IntoSlots(pickle.Pickler):
    def __init__(self, out: io.BytesIO, memory: memoryview, slots: list) -> None:
        super().__init__(out, protocol=5)
        self._memory = memory
        self._slots = slots  # [(start, size)] in the lane's memory, in the order they are filled
        self._slot = 0
        self._pos = 0

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not _TensorView:
            return None
        try:
            return self._write(obj)
        except MemoryFull:
            raise
        except Exception as e:
            raise LaneMemoryError(
                f"writing a {obj.dtype} array of shape {obj.shape} into the lane's memory: {e!r}"
            ) from e

    def _write(self, obj: _TensorView) -> tuple:
        array = obj.array
        n = array.nbytes
        start, size = self._slots[self._slot]
        if self._pos + n > size:  # on to the next slot (a batch's arrays usually fill one)
            self._slot += 1
            if self._slot >= len(self._slots) or n > self._slots[self._slot][1]:
                raise MemoryFull(f"{n} bytes do not fit the lane memory's slots left")
            start, size = self._slots[self._slot]
            self._pos = 0
        pos = self._pos
        if n:
            self._memory[start + pos : start + pos + n] = memoryview(array).cast("B")
        self._pos = pos + n + (-n) % _ALIGN
        return (self._slot, pos, _CODES[obj.dtype], obj.shape)


def dumps_into(value: Any, memory: memoryview, slots: list) -> bytes:
    """A reply pickled with each `_TensorView`'s array written into `slots` [(start, size)] of `memory` and a
    persistent id in its place: ARENA_MARK + the pickle. MemoryFull when they do not fit, LaneMemoryError when an
    array cannot be written for another reason; pickle's errors as they are (the caller sends the reply over the
    socket then)."""
    out = io.BytesIO()
    out.write(ARENA_MARK)
    _IntoSlots(out, memory, slots).dump(value)
    return out.getvalue()


class _FromSlots(pickle.Unpickler):
    def __init__(self, data: memoryview, regions: list) -> None:
        super().__init__(io.BytesIO(data))
        # one memoryview a slot: the arrays made from it refer to it, and through it to the slot's array, whose
        # reference count then says the slot is in use (NOTE [ raydl lane memory ])
        self._views = [memoryview(r) for r in regions]

    def persistent_load(self, pid: Any) -> Any:
        slot, pos, code, shape = pid
        count = 1
        for d in shape:
            count *= d
        # flat: `decode` gives it the tensor's shape
        return _TensorView(np.frombuffer(self._views[slot], _NP_DTYPES[code], count, pos), _TORCH_DTYPES[code], shape)


def loads_from(head: bytes, regions: list) -> Any:
    """The reply `dumps_into` wrote (`head` with its mark), its arrays over `regions` (the call's slots, as uint8
    arrays of the driver's mapping of the memory). ValueError if an id points outside its slot."""
    return _FromSlots(memoryview(head)[len(ARENA_MARK) :], regions).load()


# ---------------------------------------------------------------- the memory's descriptor, sent on the lane


def send_memory(conn: Any, fd: int, size: int) -> None:
    """Driver side: a ("memory", size) message, `Connection`-framed, with the memory's descriptor attached: the lane's
    first message, and later a larger memory's."""
    body = pickle.dumps(("memory", size), protocol=5)
    frame = struct.pack("!i", len(body)) + body
    sock = socket.socket(fileno=conn.fileno())
    try:
        sent = socket.send_fds(sock, [frame], [fd])
        if sent < len(frame):
            sock.sendall(frame[sent:])
    finally:
        sock.detach()


def recv_message(conn: Any) -> tuple[bytes, Optional[int]]:
    """Worker side: a Unix lane's next message (a `Connection` frame) and the descriptor that came with it, if any
    (`Connection.recv_bytes` would drop it: the kernel closes a descriptor whose message is read without room for
    it)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        head, fds, _, _ = socket.recv_fds(sock, 4, 1)
        if not head:
            raise EOFError("the lane ended")
        for extra in fds[1:]:
            os.close(extra)
        fd = fds[0] if fds else None
        while len(head) < 4:
            more = sock.recv(4 - len(head))
            if not more:
                raise EOFError("the lane ended")
            head += more
        (n,) = struct.unpack("!i", head)
        body = bytearray()
        while len(body) < n:
            more = sock.recv(n - len(body))
            if not more:
                raise EOFError("the lane ended")
            body += more
        return bytes(body), fd
    finally:
        sock.detach()


def map_memory(fd: int, size: int) -> mmap.mmap:
    """The lane's memory mapped (shared, read-write); the descriptor is closed."""
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
