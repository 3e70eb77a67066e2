"""raydl: torch's DataLoader with Ray actors as its workers.

Change one import, `from raydl import DataLoader`, and a PyTorch job loads its data with Ray
actors instead of worker processes: on a laptop with no set-up, or across a Ray cluster.

Reuse policy: raydl subclasses the public `torch.utils.data.DataLoader` (trainers check
`isinstance` and re-instantiate it; torch's constructor also gives its argument checks and
messages). It uses public torch APIs otherwise, with three private touches, each confined and checked
against torch 2.13: torch's pin helper (`driver/device.py`), torch's worker-info global
(`worker/actor.py`, cleared around a collate in `worker/collate.py`) and the count of a storage's
holders (`worker/collate.py`, before a batch buffer is reused). The epoch iterator is raydl's own;
nothing builds on torch's private iterator classes. Ray's private parts are touched in
`cluster/connect.py` only (the loopback start-up flag, the locks around its init and shutdown).
"""

from __future__ import annotations

import importlib
from typing import Any

from ._errors import WorkerDiedError, WorkerPlacementError, WorkerRecord

# Imported on first use (PEP 562): a worker process imports `raydl.worker.actor`, hence this package,
# and needs none of the driver's modules (the loader, the patch, pyarrow through ArrowDataset);
# importing them there took `import raydl.worker.actor` (then `raydl._worker`) from 1 to 6 MiB USS (benchmarks/README.md).
_LAZY = {
    "DataLoader": ".loader",
    "ArrowDataset": ".data.arrow",
    "ParquetDataset": ".data.parquet",
    "ParquetShuffleSampler": ".data.parquet",
    "ParquetDistributedSampler": ".data.parquet",
    "TarDataset": ".data.tar",
    "FileDataset": ".data.files",
    "pad_tokens": ".data.tokens",
    "pack_tokens": ".data.tokens",
    "get_worker_info": ".worker.actor",
    "release_idle_workers": ".cluster.warm",
    "release_node_caches": ".cluster.cache.handles",
    "start": ".cluster.startup",
    "Startup": ".cluster.startup",
    "patch": ".driver.patch",
    "unpatch": ".driver.patch",
    "patched": ".driver.patch",
    "is_patched": ".driver.patch",
    "LoaderStats": ".driver.stats.snapshot",
    "WorkerStats": ".driver.stats.snapshot",
    "StatsTotals": ".driver.stats.snapshot",
}

__all__ = [
    "DataLoader",
    "ArrowDataset",
    "ParquetDataset",
    "ParquetShuffleSampler",
    "ParquetDistributedSampler",
    "TarDataset",
    "FileDataset",
    "pad_tokens",
    "pack_tokens",
    "get_worker_info",
    "release_idle_workers",
    "release_node_caches",
    "start",
    "Startup",
    "patch",
    "unpatch",
    "patched",
    "is_patched",
    "WorkerDiedError",
    "WorkerPlacementError",
    "WorkerRecord",
    "LoaderStats",
    "WorkerStats",
    "StatsTotals",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'raydl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"
