"""raydl: torch's DataLoader with Ray actors as its workers.

Change one import, `from raydl import DataLoader`, and a PyTorch job loads its data with Ray
actors instead of worker processes: on a laptop with no set-up, or across a Ray cluster.

Reuse policy: raydl subclasses the public `torch.utils.data.DataLoader` (trainers check
`isinstance` and re-instantiate it; torch's constructor also gives its argument checks and
messages). It uses public torch APIs otherwise, with two private touches, each confined to one
module and checked against torch 2.13: torch's pin helper (`_device.py`) and torch's worker-info
global (`_worker.py`). The epoch iterator is raydl's own; nothing builds on torch's private
iterator classes. One private Ray constant is touched, in `_ray_utils.py` (loopback start-up).
"""

from __future__ import annotations

from .arrow import ArrowDataset
from ._errors import WorkerDiedError, WorkerPlacementError, WorkerRecord
from ._patch import is_patched, patch, patched, unpatch
from ._startup import Startup, start
from ._warm import release_idle_workers
from ._worker import get_worker_info
from .loader import DataLoader

__all__ = [
    "DataLoader",
    "ArrowDataset",
    "get_worker_info",
    "release_idle_workers",
    "start",
    "Startup",
    "patch",
    "unpatch",
    "patched",
    "is_patched", "WorkerDiedError", "WorkerPlacementError", "WorkerRecord", "__version__"]

__version__ = "0.1.0"
