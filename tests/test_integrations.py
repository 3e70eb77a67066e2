"""raydl inside real trainers: Lightning (single device and 2-process DDP), accelerate, Ray Train.

Every test checks where the batches were made: each sample carries the worker id, pid and
parent pid of the process that made it (tests/_integration_helpers.py), which must be a Ray
actor, neither the training process nor one it forked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import raydl
from tests import _integration_helpers as H

TIMEOUT_S = 60
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("unpatched", "release_warm_workers_after_module")


def _lightning_trainer(**kwargs):
    L = pytest.importorskip("lightning")
    kwargs.setdefault("max_steps", 4)
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _lightning_module():
    """A linear classifier that remembers the meta rows of every batch it trained on."""
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)
            self.rows: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            x, y, meta = batch
            self.rows.append(meta)
            return nn.functional.cross_entropy(self.layer(x), y)

        def predict_step(self, batch, batch_idx):
            return batch[2]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def _raydl_loader(n: int = 32, **kwargs) -> raydl.DataLoader:
    return raydl.DataLoader(
        H.ProvenanceDataset(n),
        batch_size=4,
        num_workers=2,
        timeout=TIMEOUT_S,
        ray_remote_args={"num_cpus": 0, "scheduling_strategy": "DEFAULT"},
        ray_startup_timeout_s=45.0,
        **kwargs,
    )


def test_lightning_fit_single_device_trains_on_ray_workers(ray_session):
    """Trainer.fit on CPU trains on the raydl loader as given, every batch made by a Ray actor."""
    loader = _raydl_loader(shuffle=True)
    model = _lightning_module()
    trainer = _lightning_trainer(max_steps=4)
    trainer.fit(model, loader)

    assert trainer.global_step == 4
    assert trainer.train_dataloader is loader
    meta = torch.cat(model.rows)
    assert len(meta) == 16
    H.assert_made_by_ray_workers(meta, os.getpid())
    assert set(meta[:, H.WORKER_ID].tolist()) == {0, 1}


def test_lightning_reinstantiation_keeps_raydl_class_and_ray_options(ray_session):
    """When Lightning rebuilds the loader (predict injects its own batch sampler), it is a raydl.DataLoader with its ray_ options."""
    loader = _raydl_loader(n=12)
    trainer = _lightning_trainer()
    predictions = trainer.predict(_lightning_module(), dataloaders=loader)

    rebuilt = trainer.predict_dataloaders
    assert rebuilt is not loader  # re-instantiated from its attributes ...
    assert type(rebuilt) is raydl.DataLoader  # ... as raydl's class, with raydl's options
    assert rebuilt.ray_remote_args == {"num_cpus": 0, "scheduling_strategy": "DEFAULT"}
    assert rebuilt.ray_startup_timeout_s == 45.0
    meta = torch.cat(predictions)
    assert sorted(meta[:, H.INDEX].tolist()) == list(range(12))
    H.assert_made_by_ray_workers(meta, os.getpid())


def test_lightning_ddp_two_processes_rebuild_raydl_loaders_on_one_ray(ray_session, tmp_path):
    """DDP with 2 CPU processes: each rank's re-instantiated raydl loader (DistributedSampler, ray_ options kept) joins the same Ray."""
    pytest.importorskip("lightning")
    gcs_address = ray_session.get_runtime_context().gcs_address
    env = dict(os.environ)
    # RAY_AUTH_MODE=token (set by ray.init for its cluster) and the loopback flag are inherited.
    env.update(RAY_ADDRESS=gcs_address, PYTHONPATH=os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")])))
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Every batch from the Ray workers (what this test checks): a cold start would make the first ones (here all
    # 3 steps) in each rank. The ranks' Ray call during a cold start is tests/test_cold_start.py's.
    env["RAYDL_COLD_START"] = "0"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "_lightning_ddp_main.py"), "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    shards = []
    for rank, record in enumerate(records):
        assert record["rank"] == rank and record["world_size"] == 2
        assert record["class"] == "raydl.loader.DataLoader"
        assert record["ray_remote_args"] == {"num_cpus": 0, "scheduling_strategy": "DEFAULT"}
        assert record["ray_startup_timeout_s"] == 45.0
        assert record["sampler"] == "DistributedSampler"
        assert record["gcs_address"] == gcs_address
        meta = torch.tensor(record["rows"])
        assert len(meta) == 12  # 3 steps of 4
        H.assert_made_by_ray_workers(meta, record["pid"])
        shards.append(set(meta[:, H.INDEX].tolist()))
    assert records[0]["pid"] != records[1]["pid"]
    assert not shards[0] & shards[1], "the two ranks' DistributedSamplers overlap"


def test_accelerate_prepare_under_patch_keeps_ray_workers(ray_session):
    """accelerate's prepare() rebuilds the loader as a DataLoaderShard; under raydl.patched() it still loads with Ray actors."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    loader = _raydl_loader(n=24, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        with raydl.patched(ray_remote_args=loader.ray_remote_args):
            model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
            assert prepared is not loader and isinstance(prepared, torch.utils.data.DataLoader)
            rows, losses = [], []
            for x, y, meta in prepared:
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                rows.append(meta)
                losses.append(loss.item())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    meta = torch.cat(rows)
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert sorted(meta[:, H.INDEX].tolist()) == list(range(24))
    H.assert_made_by_ray_workers(meta, os.getpid())


def test_ray_train_torch_trainer_prepare_data_loader_keeps_ray_workers(ray_session, tmp_path_factory):
    """TorchTrainer, 2 workers: a raydl loader with its own DistributedSampler survives prepare_data_loader; a rebuilt one loads from Ray under patch."""
    pytest.importorskip("ray.train.torch")
    samples = 16  # tests/_ray_train_main.py's "prepare" run: TorchTrainer in its own driver, on this Ray
    out = H.ray_train_outputs(ray_session.get_runtime_context().gcs_address, tmp_path_factory.getbasetemp() / "train")
    records = [json.loads(open(os.path.join(out["prepare"], f"rank{r}.json")).read()) for r in (0, 1)]

    for key, expected_class, same in (
        ("own_sampler", "raydl.loader.DataLoader", True),
        ("patched", "torch.utils.data.dataloader.DataLoader", False),
    ):
        shards = []
        for rank, record in enumerate(records):
            assert record["world_size"] == 2 and record["rank"] == rank
            assert record[key]["class"] == expected_class and record[key]["is_same"] is same, (key, record[key])
            meta = torch.tensor(record[key]["rows"])
            H.assert_made_by_ray_workers(meta, record["pid"])
            shards.append(set(meta[:, H.INDEX].tolist()))
        assert not shards[0] & shards[1], key
        assert shards[0] | shards[1] == set(range(samples)), key
