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
from typing import Any, Callable, Optional

import torch
from torch.utils.data._utils.pin_memory import pin_memory as _torch_pin_memory

from ._constants import PIN_LOOKAHEAD_BATCHES, PIN_THREAD_JOIN_TIMEOUT_S, STATUS_CHECK_INTERVAL_S

__all__ = ["pin_memory", "pin_memory_target", "PinStage"]

_DATA, _ERROR = "data", "error"


def pin_memory(data: Any, device: Optional[str] = None) -> Any:
    """Pin every tensor in `data` (recursively), as torch's DataLoader does."""
    return _torch_pin_memory(data, device)


def pin_memory_target(pin_memory_flag: bool) -> Optional[str]:
    """The accelerator type to pin for, or None when pinning is off or impossible (torch's rule)."""
    if not pin_memory_flag or not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    if acc is None or acc.type == "mps":
        return None
    return acc.type


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
