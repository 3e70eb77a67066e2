"""raydl's own loader options (`ray_*`), validated once, with their defaults in one place."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import torch

from ._constants import (
    DEFAULT_MAX_WORKER_RESTARTS,
    DEFAULT_SILENCE_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    LANE_HEARTBEAT_S,
    LANE_SILENCE_MIN_BEATS,
)
from .worker.seeding import SEED_MODES

__all__ = ["RayOptions"]


@dataclass(frozen=True)
class RayOptions:
    """The `ray_*` keyword arguments of `raydl.DataLoader`; see its docstring for their meaning."""

    address: Optional[str] = None
    remote_args: Optional[Mapping[str, Any]] = field(default=None)
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    shared_dataset_memory: bool = False
    max_worker_restarts: int = DEFAULT_MAX_WORKER_RESTARTS
    reuse_workers: bool = True
    threads_per_worker: int = 1
    device: Any = None
    seed: str = "worker"
    max_workers: Optional[int] = None
    stats: bool = True
    name: Optional[str] = None
    job: Any = None  # None, True or a name (NOTE [ raydl job pool ])
    batches_per_call: Optional[int] = None  # None ("auto"): adaptive (NOTE [ raydl calls ] in driver/schedule.py)
    cold_start: Union[bool, str] = (
        True  # True, False or "in_process": NOTE [ raydl cold start ] in driver/coldstart/iter.py
    )
    lane: bool = True  # NOTE [ raydl lane ] in worker/lane.py
    silence_timeout_s: Optional[float] = DEFAULT_SILENCE_TIMEOUT_S  # NOTE [ raydl silent node ]

    def __post_init__(self) -> None:
        if self.address is not None and not isinstance(self.address, str):
            raise TypeError(f"ray_address should be a str such as 'auto' or 'ray://host:10001', got {self.address!r}")
        if self.remote_args is not None and not isinstance(self.remote_args, Mapping):
            raise TypeError(
                f"ray_remote_args should be a dict of Ray actor options such as {{'num_cpus': 1}}, got {self.remote_args!r}"
            )
        t = self.startup_timeout_s
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not t > 0:
            raise ValueError(f"ray_startup_timeout_s should be a positive number of seconds, got {t!r}")
        r = self.max_worker_restarts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"ray_max_worker_restarts should be a non-negative int (0 disables recovery), got {r!r}")
        if self.device is not None and not isinstance(self.device, (str, torch.device)):
            raise TypeError(f"ray_device should be None, a str such as 'cuda:0' or a torch.device, got {self.device!r}")
        m = self.max_workers
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(
                f"ray_max_workers should be None (no autoscaling) or a positive int, at least num_workers, got {m!r}"
            )
        n = self.threads_per_worker
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"ray_threads_per_worker should be a positive int (1: no threads), got {n!r}")
        if not isinstance(self.seed, str) or self.seed not in SEED_MODES:
            raise ValueError(
                f"ray_seed should be 'worker' (torch's seeding: each worker seeded once, the default), 'batch' "
                f"(each batch seeded from its position in the epoch, whatever worker makes it) or 'sample' (each "
                f"sample seeded from its index, whatever batch, worker or rank makes it), got {self.seed!r}"
            )
        if self.seed == "sample" and n > 1:
            raise ValueError(
                f"ray_seed='sample' seeds the worker's global generators before each sample, which threads would "
                f"share: use ray_threads_per_worker=1 with it (got {n})"
            )
        j = self.job
        if j is not None and j is not True and not (isinstance(j, str) and j.strip()):
            raise ValueError(
                f"ray_job should be None, True (the launcher names the job) or a non-empty name, got {j!r}"
            )
        if j is not None and self.seed == "worker":
            raise ValueError(
                "ray_seed='worker' seeds each worker once, so a batch's draws would depend on which worker of the "
                "job made it, and the ranks share the job's workers: use ray_seed='batch' (the default with ray_job) "
                "or 'sample'"
            )
        k = self.batches_per_call
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(
                f"ray_batches_per_call should be 'auto' (adaptive) or a positive int (the most batches one actor "
                f"call carries; 1: one call per batch), got {k!r}"
            )
        if not isinstance(self.cold_start, bool) and self.cold_start != "in_process":
            raise TypeError(
                "ray_cold_start should be True (start-up processes), False (no cold start) or 'in_process' (the "
                f"first batches made in this process), got {self.cold_start!r}"
            )
        q = self.silence_timeout_s
        least = LANE_SILENCE_MIN_BEATS * LANE_HEARTBEAT_S
        if q is not None and (not isinstance(q, numbers.Real) or isinstance(q, bool) or not q >= least):
            raise ValueError(
                f"ray_silence_timeout_s should be None (a silent node is left to TCP's and Ray's own timeouts) or a "
                f"number of seconds of at least {least:g} ({LANE_SILENCE_MIN_BEATS} of a lane's heartbeats, sent "
                f"every {LANE_HEARTBEAT_S:g} s), got {q!r}"
            )
        if not isinstance(self.lane, bool):
            raise TypeError(f"ray_lane should be True or False, got {self.lane!r}")
        if not isinstance(self.stats, bool):
            raise TypeError(f"ray_stats should be True or False, got {self.stats!r}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ValueError(
                f"ray_name should be a non-empty str naming the loader in stats and Ray metrics, got {self.name!r}"
            )

    @classmethod
    def from_loader(cls, loader: Any) -> RayOptions:
        """The options of any DataLoader: a raydl one's `ray_*` attributes, or the defaults for a torch one."""
        defaults = cls()
        return cls(
            address=getattr(loader, "ray_address", defaults.address),
            remote_args=getattr(loader, "ray_remote_args", defaults.remote_args),
            startup_timeout_s=getattr(loader, "ray_startup_timeout_s", defaults.startup_timeout_s),
            shared_dataset_memory=getattr(loader, "ray_shared_dataset_memory", defaults.shared_dataset_memory),
            max_worker_restarts=getattr(loader, "ray_max_worker_restarts", defaults.max_worker_restarts),
            reuse_workers=getattr(loader, "ray_reuse_workers", defaults.reuse_workers),
            threads_per_worker=getattr(loader, "ray_threads_per_worker", defaults.threads_per_worker),
            device=getattr(loader, "ray_device", defaults.device),
            seed=getattr(loader, "ray_seed", defaults.seed),
            max_workers=getattr(loader, "ray_max_workers", defaults.max_workers),
            stats=getattr(loader, "ray_stats", defaults.stats),
            name=getattr(loader, "ray_name", defaults.name),
            job=getattr(loader, "ray_job", defaults.job),
            batches_per_call=_batches_per_call(getattr(loader, "ray_batches_per_call", "auto")),
            cold_start=getattr(loader, "ray_cold_start", defaults.cold_start),
            lane=getattr(loader, "ray_lane", defaults.lane),
            silence_timeout_s=getattr(loader, "ray_silence_timeout_s", defaults.silence_timeout_s),
        )


def _batches_per_call(value: Any) -> Optional[int]:
    """A loader's `ray_batches_per_call` as RayOptions keeps it: None for "auto"."""
    return None if value == "auto" else value
