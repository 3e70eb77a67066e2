"""What a worker reports of its own state with each batch, and how a new worker takes it back.

See NOTE [ raydl checkpoint ] in driver/state/checkpoint.py. A worker's snapshot has torchdata's layout
(`worker_id`, `fetcher_state`, `dataset_state`), so StatefulDataLoader can load it, plus raydl's
`_raydl_rng`: the states of the worker's `random`, `torch` and NumPy global generators as of the
same batch, so random augmentation drawn in workers continues bit-identically after a resume.
Everything in it is plain data (str, int, float, None, lists and dicts): it survives
`torch.save` / `torch.load(weights_only=True)` and JSON. No pickle is ever loaded from a state.

Cost: reading the three generators costs about 18 us per batch when none of them moved, 26 us
when torch's did (half of it is `random.getstate()`; torch's state is compared as bytes; the
NumPy check reads the Mersenne Twister words through NumPy's public ctypes interface instead of
`np.random.get_state()`, which costs ~100 us); a worker sends a generator's state (python
~3.3 KB, torch ~6.7 KB, NumPy ~3.3 KB as base64) only with a batch after which it moved, and the
driver merges it into the last complete set it holds for that worker.
"""

from __future__ import annotations

import base64
import copy
import ctypes
import pickle
import random
from array import array
from typing import Any, Optional

import numpy as np
import torch

__all__ = [
    "by_value",
    "RngTracker",
    "restore_rng",
    "is_stateful",
    "make_worker_snapshot",
    "WORKER_ID",
    "FETCHER_STATE",
    "FETCHER_ENDED",
    "DATASET_STATE",
    "DATASET_ITER_STATE",
    "RNG",
]

# torchdata's worker snapshot keys (torchdata/stateful_dataloader/incremental_state.py)
WORKER_ID = "worker_id"
FETCHER_STATE = "fetcher_state"
FETCHER_ENDED = "fetcher_ended"
DATASET_STATE = "dataset_state"
DATASET_ITER_STATE = "dataset_iter_state"
# raydl's own key in a worker snapshot (StatefulDataLoader ignores it)
RNG = "_raydl_rng"

_MT_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos


def is_stateful(obj: Any) -> bool:
    """torchdata's `Stateful` protocol: the object has both `state_dict()` and `load_state_dict()`."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes)


def by_value(state: Any) -> Any:
    """`state` as it is now, sharing nothing with the object that reported it.

    NOTE [ raydl state by value ]: most datasets return their live attributes from `state_dict()`
    (`{"bits": self.bits}`), and the batches after the one a state belongs to go on mutating them.
    torchdata's worker pickles each state into its queue at the batch it belongs to; raydl keeps states
    before they are sent (a call's later batches, a worker's start and restart snapshots, the sampler's
    state per batch drawn, the `num_workers=0` state): each is taken through a pickle round trip at the
    moment it belongs to (a deep copy where pickle refuses, as for a class defined in a function).
    A state of plain data costs ~1 us a batch this way (a 2- or 8-key dict on this 2-core host). A torch
    generator's state costs ~70 us through pickle (torch's own pickling of a tensor), so a state made only of
    containers, scalars and plain CPU tensors is copied directly (`_plain_copy`, the tensors cloned: ~2 us), and
    the sampler records of raydl's own iterators, whose states hold a generator state made once an epoch and never
    written, are kept without a copy (driver/state/samplers.py `fresh_state`) and copied once when a `state_dict()`
    hands them out."""
    if type(state) in _IMMUTABLE:
        return state
    try:
        return _plain_copy(state)
    except _NotPlain:
        pass
    try:
        return pickle.loads(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return copy.deepcopy(state)


class _NotPlain(Exception):
    pass


def _plain_copy(x: Any) -> Any:
    """A copy of a state made only of dicts, lists, tuples, immutable scalars and plain CPU tensors (a generator's
    state is one: torch pickles it at ~70 us, `clone()` copies it in ~2 us); anything else raises `_NotPlain` and the
    state goes through pickle as a whole."""
    t = type(x)
    if t in _IMMUTABLE:
        return x
    if t is dict:
        return {k: _plain_copy(v) for k, v in x.items()}
    if t is list:
        return [_plain_copy(v) for v in x]
    if t is tuple:
        return tuple(_plain_copy(v) for v in x)
    if t is torch.Tensor and x.device.type == "cpu" and x.layout == torch.strided and not x.requires_grad:
        return x.clone()
    raise _NotPlain


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _numpy_words() -> bytes:
    """The raw words of NumPy's global Mersenne Twister: ~1 us, for change detection only."""
    bg = np.random.get_bit_generator()
    return ctypes.string_at(bg.ctypes.state_address, _MT_BYTES)


def _encode_python(py: tuple) -> list:
    version, internal, gauss = py
    return [version, _b64(array("I", internal).tobytes()), gauss]


def _torch_bytes() -> bytes:
    """torch's CPU generator state as bytes (~1 us: compared as bytes, 5x cheaper than torch.equal)."""
    return torch.get_rng_state().numpy().tobytes()


def _encode_numpy() -> list:
    # get_state (~90 us) is the only public way to the legacy generator's cached Gaussian.
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, _b64(np.asarray(keys, dtype=np.uint32).tobytes()), int(pos), int(has_gauss), float(cached)]


def restore_rng(state: dict) -> None:
    """Set this process's `random`, `torch` and NumPy global generators from a `_raydl_rng` entry."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(array("I", _unb64(internal))), gauss))
    torch.set_rng_state(torch.frombuffer(bytearray(_unb64(state["torch"])), dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.frombuffer(_unb64(keys), dtype=np.uint32).copy(), pos, has_gauss, cached))


class RngTracker:
    """In a worker: after each batch, the generators that moved since the last report (None: none moved).

    Only the generators that moved are encoded and sent ({"torch": ...} alone for a dataset that
    draws from torch only); the driver merges them into the last full set it holds for the
    worker. `reset()` forgets what was sent (a new epoch, a new loader): the next report is
    complete, so the driver, which applies reports in each worker's batch order, never merges
    into a set it did not see.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._py: Optional[tuple] = None
        self._th: Optional[bytes] = None
        self._np: Optional[bytes] = None

    def changed(self) -> Optional[dict]:
        py, th, words = random.getstate(), _torch_bytes(), _numpy_words()
        out = {}
        if self._py is None or py != self._py:
            out["python"] = _encode_python(py)
        if self._th is None or th != self._th:
            out["torch"] = _b64(th)
        if self._np is None or words != self._np:
            out["numpy"] = _encode_numpy()
        self._py, self._th, self._np = py, th, words
        return out or None


def make_worker_snapshot(worker_id: int, fetcher: Any, dataset: Any, is_iterable: bool) -> Optional[dict]:
    """torchdata's per-worker snapshot (`_make_state_dict` there), or None for a map-style dataset without state.
    Taken by value (NOTE [ raydl state by value ]): later batches do not change it."""
    if is_iterable:
        it = getattr(fetcher, "dataset_iter", None)
        fetcher_state = {
            DATASET_ITER_STATE: by_value(it.state_dict()) if is_stateful(it) else None,
            FETCHER_ENDED: bool(getattr(fetcher, "ended", False)),
        }
        dataset_state = by_value(dataset.state_dict()) if it is not dataset and is_stateful(dataset) else None
        return {WORKER_ID: worker_id, FETCHER_STATE: fetcher_state, DATASET_STATE: dataset_state}
    if not is_stateful(dataset):
        return None
    return {WORKER_ID: worker_id, FETCHER_STATE: None, DATASET_STATE: by_value(dataset.state_dict())}
