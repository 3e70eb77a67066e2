"""Pinning batches in the driver, on a thread of its own.

The one import of a private torch helper lives here: `torch.utils.data._utils.pin_memory.
pin_memory` (checked against torch 2.13). It pins tensors and recurses through mappings,
namedtuples, sequences and any object with a `.pin_memory()` method, keeping container types.

NOTE [ raydl pinning ]
The driver resolves batches in yield order and hands up to PIN_LOOKAHEAD_BATCHES of them to the
pin thread ahead of the one the caller is about to receive, so pinning batch k+1 overlaps the
training step on batch k. Errors travel through the same queue, in order, untouched.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils.data._utils.pin_memory import pin_memory as _torch_pin_memory

from .._constants import PIN_LOOKAHEAD_BATCHES, PIN_THREAD_JOIN_TIMEOUT_S, STATUS_CHECK_INTERVAL_S
from ..worker.transfer import decode

__all__ = [
    "pin_memory",
    "pin_memory_target",
    "warn_pin_memory_args",
    "PinStage",
    "PinnedBatches",
    "DeviceCopier",
    "resolve_device",
]

_DATA, _ERROR = "data", "error"


def pin_memory(data: Any, device: Optional[str] = None) -> Any:
    """Pin every tensor in `data` (recursively), as torch's DataLoader does."""
    return _torch_pin_memory(data, device)


def warn_pin_memory_args(loader: Any) -> None:
    """torch's two warnings about `pin_memory` arguments, with its text, as its iterators give them."""
    import warnings

    if loader.pin_memory and loader.pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the device,"
            f"ignore pin_memory_device='{loader.pin_memory_device}'.",
            stacklevel=4,
        )
    if loader.pin_memory and not torch.accelerator.is_available():
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=4,
        )


def pin_memory_target(pin_memory_flag: bool) -> Optional[str]:
    """The accelerator type to pin for, or None when pinning is off or impossible (torch's rule)."""
    if not pin_memory_flag or not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    if acc is None or acc.type == "mps":
        return None
    return acc.type


def resolve_device(device: Any) -> Optional[torch.device]:
    """`ray_device` as a torch.device (None when unset); only CUDA devices are supported.

    Raises:
        ValueError: not a CUDA device, or CUDA is not available in this process.
    """
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"ray_device supports CUDA devices only (e.g. 'cuda' or 'cuda:1'), got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"ray_device={device!r} but CUDA is not available here; drop ray_device on CPU-only machines")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _to_device(data: Any, device: torch.device) -> Any:
    """Copy every tensor in `data` to `device` (non_blocking: the sources are pinned), keeping container types."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    kind = type(data)
    if kind is dict:
        return {k: _to_device(v, device) for k, v in data.items()}
    if kind is list:
        return [_to_device(v, device) for v in data]
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):
            return kind(*(_to_device(v, device) for v in data))
        if kind is tuple:
            return tuple(_to_device(v, device) for v in data)
    if hasattr(data, "to") and callable(data.to) and not isinstance(data, (str, bytes)):
        try:
            return data.to(device, non_blocking=True)
        except TypeError:
            return data
    return data


def _tensors(data: Any):
    if isinstance(data, torch.Tensor):
        yield data
    elif type(data) is dict:
        for v in data.values():
            yield from _tensors(v)
    elif isinstance(data, (list, tuple)):
        for v in data:
            yield from _tensors(v)


class _OnDevice:
    """A batch copied on the side stream, and the event marking the copy's end."""

    __slots__ = ("data", "event")

    def __init__(self, data: Any, event: Any) -> None:
        self.data, self.event = data, event


class DeviceCopier:
    """Copies pinned batches to a CUDA device on a side stream (in the pin thread); `finish` hands them over.

    NOTE [ raydl device transfer ]
    The pin thread issues the host-to-device copy of batch k+1 on a side stream with
    non_blocking=True while the training loop runs on batch k; an event recorded after the
    copy is waited on by the consumer's current stream in `finish` (a GPU-side wait, no host
    sync), and each tensor is marked as used on that stream (`record_stream`) so the caching
    allocator does not reuse its memory while the training step may still read it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def __call__(self, pinned: Any) -> _OnDevice:
        with torch.cuda.stream(self.stream):
            data = _to_device(pinned, self.device)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _OnDevice(data, event)

    def finish(self, item: Any) -> Any:
        if not isinstance(item, _OnDevice):
            return item
        current = torch.cuda.current_stream(self.device)
        current.wait_event(item.event)
        for t in _tensors(item.data):
            if t.device.type == "cuda":
                t.record_stream(current)
        return item.data


def _pin_memory_loop(
    in_q: queue.Queue,
    out_q: queue.Queue,
    pin_fn: Callable[[Any], Any],
    device_index: Optional[int],
    stop_event: threading.Event,
) -> None:
    """Body of the pin thread: pin each data item from `in_q`, pass errors through, until stopped."""
    torch.set_num_threads(1)
    if device_index is not None:
        torch.accelerator.set_device_index(device_index)
    while not stop_event.is_set():
        try:
            kind, payload = in_q.get(timeout=STATUS_CHECK_INTERVAL_S)
        except queue.Empty:
            continue
        if kind == _DATA:
            try:
                payload = pin_fn(payload)
            except Exception as e:
                kind, payload = _ERROR, e
        while not stop_event.is_set():
            try:
                out_q.put((kind, payload), timeout=STATUS_CHECK_INTERVAL_S)
                break
            except queue.Full:
                continue


class PinStage:
    """A pin thread with bounded queues; `submit` batches (or errors) in order, `take` them back pinned."""

    def __init__(self, pin_fn: Callable[[Any], Any], device_index: Optional[int] = None) -> None:
        self._in_q: queue.Queue = queue.Queue(maxsize=PIN_LOOKAHEAD_BATCHES + 1)
        self._out_q: queue.Queue = queue.Queue(maxsize=PIN_LOOKAHEAD_BATCHES + 1)
        self._stop = threading.Event()
        self.in_flight = 0
        self._thread = threading.Thread(
            target=_pin_memory_loop,
            args=(self._in_q, self._out_q, pin_fn, device_index, self._stop),
            name="raydl_pin",
            daemon=True,
        )
        self._thread.start()

    def submit_data(self, batch: Any) -> None:
        self._in_q.put((_DATA, batch))
        self.in_flight += 1

    def submit_error(self, error: BaseException) -> None:
        self._in_q.put((_ERROR, error))
        self.in_flight += 1

    def take(self) -> Any:
        """The next item in submission order, pinned; raises it if it is an error."""
        while True:
            try:
                kind, payload = self._out_q.get(timeout=STATUS_CHECK_INTERVAL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("Pin memory thread exited unexpectedly") from None
        self.in_flight -= 1
        if kind == _ERROR:
            raise payload
        return payload

    def shutdown(self) -> None:
        """Stop and join the thread (bounded by PIN_THREAD_JOIN_TIMEOUT_S); idempotent."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=PIN_THREAD_JOIN_TIMEOUT_S)


class PinnedBatches:
    """One iterator's batches through the pin thread (NOTE [ raydl pinning ]): up to PIN_LOOKAHEAD_BATCHES resolved
    ahead, handed out in order, decoded into pinned memory and, with a `copier`, sent on to the device.

    The stage's thread is stopped when `owner` (the iterator) is collected (NOTE [ raydl shutdown ] in driver/iter.py).
    """

    def __init__(self, owner: Any, device: Optional[str], copier: Optional[DeviceCopier], timed: Callable) -> None:
        """`timed(fn)`: `fn` wrapped by the stats recorder (the pin time is measured)."""

        def pin_fn(data: Any) -> Any:
            pinned = pin_memory(decode(data, pin=True), device)
            return copier(pinned) if copier is not None else pinned

        self.stage = PinStage(timed(pin_fn), torch.accelerator.current_device_index())
        stop = weakref.finalize(owner, self.stage.shutdown)
        stop.atexit = False
        self._copier = copier
        self.source_ended = False  # set back to False by the iterator at each new epoch

    def next(self, next_data: Callable[[], Any], running: Callable[[], bool]) -> Any:
        """The oldest batch, pinned; StopIteration once `next_data` ended and every batch was handed out.

        An error from `next_data` goes through the stage in its place and is handed out before anything after it is
        waited on; the source counts as ended after it when `running()` says the iterator stopped."""
        stage = self.stage
        while stage.in_flight < PIN_LOOKAHEAD_BATCHES and not self.source_ended:
            try:
                stage.submit_data(next_data())
            except StopIteration:
                self.source_ended = True
            except Exception as e:
                stage.submit_error(e)
                if not running():
                    self.source_ended = True
                break
        if stage.in_flight == 0:
            raise StopIteration
        data = stage.take()
        return self._copier.finish(data) if self._copier is not None else data

    def shutdown(self) -> None:
        self.stage.shutdown()
