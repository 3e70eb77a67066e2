"""Datasets and training functions shared by test_patch.py and test_integrations.py.

Module level in an importable module, so that torch's worker processes, raydl's Ray actors and
Ray Train's workers all unpickle them by reference.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

# Columns of the `meta` tensor of every ProvenanceDataset item.
INDEX, WORKER_ID, PID, PPID = range(4)


class ProvenanceDataset(Dataset):
    """Item i: (features, label, meta) where meta = [i, worker id, pid, parent pid] of the process that made it.

    `features` are drawn from the worker's seeded torch RNG, so two loaders seeded alike give the
    same values only if they seed their workers alike. A Ray actor's parent is its raylet; a torch
    worker's parent is the process iterating the loader: that tells the two apart.
    """

    def __init__(self, n: int = 32, dim: int = 4) -> None:
        self.n = n
        self.dim = dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        meta = torch.tensor([i, -1 if info is None else info.id, os.getpid(), os.getppid()], dtype=torch.int64)
        return torch.rand(self.dim), torch.tensor(i % 2), meta


class AssignedCpuDataset(Dataset):
    """Item i: the CPUs Ray assigned to the actor that made it (-1 outside Ray), as a float tensor."""

    def __init__(self, n: int = 4) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import ray

        if not ray.is_initialized():
            return torch.tensor([-1.0])
        return torch.tensor([float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0))])


def metas(batches: list) -> torch.Tensor:
    """All meta rows of a list of ProvenanceDataset batches, in order."""
    return torch.cat([b[2] for b in batches])


def assert_made_by_ray_workers(meta: torch.Tensor, trainer_pid: int) -> None:
    """Every row was made in a Ray actor: a worker (id set), not the trainer, not a process the trainer forked."""
    assert meta.numel() > 0
    assert (meta[:, WORKER_ID] >= 0).all(), "a batch was made outside any DataLoader worker"
    assert (meta[:, PID] != trainer_pid).all(), "a batch was made in the training process"
    assert (meta[:, PPID] != trainer_pid).all(), "a batch was made by a process the trainer forked (torch's workers)"


def ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train `train_loop_per_worker`: two raydl loaders through `prepare_data_loader`, a few SGD steps each.

    Writes `rank{R}.json` to `config["out"]` with what each loader became and where its batches
    were made (Ray Train keeps only rank 0's reported metrics; the files hold every rank's).
    """
    import ray.train
    import ray.train.torch
    from torch import nn
    from torch.utils.data import DistributedSampler

    import raydl

    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    n = config["samples"]
    model = ray.train.torch.prepare_model(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"rank": rank, "world_size": world_size, "pid": os.getpid()}

    def train(loader) -> list:
        rows = []
        for x, y, meta in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            rows += meta.tolist()
        return rows

    # Documented path: the loader brings its own DistributedSampler, so prepare_data_loader keeps it.
    own = raydl.DataLoader(
        ProvenanceDataset(n),
        batch_size=4,
        sampler=DistributedSampler(ProvenanceDataset(n), num_replicas=world_size, rank=rank, shuffle=True, seed=0),
        num_workers=1,
        timeout=60,
        ray_remote_args={"num_cpus": 0},
    )
    prepared = ray.train.torch.prepare_data_loader(own)
    inner = getattr(prepared, "_dataloader", prepared)  # Ray Train wraps it to move batches to the device
    out["own_sampler"] = {"class": f"{type(inner).__module__}.{type(inner).__qualname__}", "is_same": inner is own}
    out["own_sampler"]["rows"] = train(prepared)

    # Default sampler: with world_size > 1, prepare_data_loader rebuilds a plain torch DataLoader;
    # under raydl.patched() that one loads with Ray workers too (with the ray_ options given here).
    default = raydl.DataLoader(ProvenanceDataset(n), batch_size=4, shuffle=True, num_workers=1, timeout=60)
    with raydl.patched(ray_remote_args={"num_cpus": 0}):
        prepared = ray.train.torch.prepare_data_loader(default)
        inner = getattr(prepared, "_dataloader", prepared)
        out["patched"] = {"class": f"{type(inner).__module__}.{type(inner).__qualname__}", "is_same": inner is default}
        out["patched"]["rows"] = train(prepared)

    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def ray_train_prepare_then_resume_loop(config: dict[str, Any]) -> None:
    """Both Ray Train checks in one fit (a fit costs ~30 core-s of Ray Train's own actors on this machine): the
    `prepare_data_loader` loop, then the checkpointing loop (tests/_resume_datasets.py), on every rank."""
    from tests import _resume_datasets as RD

    ray_train_loop(config["prepare"])
    RD.ray_train_resume_loop(config["resume"])


_RAY_TRAIN_OUTPUTS: dict = {}

# Ray Train's own pace, for a test's tiny fits on a 2-core machine (Ray Train passes these from the driver to its
# controller and workers): its controller polls the workers every 0.2 s, not 2 s (a fit ends at the next poll), and
# neither the preemption watcher (an actor process of its own, polling every 5 s) nor the state actor's
# reconciliation runs. raydl's behaviour under Ray Train does not depend on any of them.
RAY_TRAIN_QUICK_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
}


def ray_train_outputs(gcs_address: str, tmp_root: Any, timeout_s: int = 420) -> dict:
    """The folders tests/_ray_train_main.py's fit ("prepare", "resume") wrote, made by one driver joined to
    `gcs_address` (it says why a driver of its own), the first time a test asks: a second driver would import Ray
    Train, torch and raydl again (about 6 s of CPU) to connect to the same Ray. Fails with the driver's output."""
    import subprocess
    import sys

    if gcs_address in _RAY_TRAIN_OUTPUTS:
        return _RAY_TRAIN_OUTPUTS[gcs_address]
    outs = {mode: os.path.join(str(tmp_root), mode) for mode in ("prepare", "resume")}
    for folder in outs.values():
        os.makedirs(folder, exist_ok=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)  # RAY_AUTH_MODE (set by ray.init for its cluster) and the loopback flag are inherited
    env.update(RAY_ADDRESS=gcs_address, PYTHONPATH=os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")])))
    env.update(RAY_TRAIN_QUICK_ENV)
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    proc = subprocess.run(
        [sys.executable, os.path.join(repo, "tests", "_ray_train_main.py")] + [f"{m}={d}" for m, d in outs.items()],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0 and proc.stdout.count("RESULT ") == 1, proc.stdout[-3000:] + proc.stderr[-5000:]
    _RAY_TRAIN_OUTPUTS[gcs_address] = outs
    return outs
