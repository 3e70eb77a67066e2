"""Mid-epoch resume end to end: Lightning's mid-epoch checkpoints, a plain torch.save loop, Ray Train checkpoints."""

from __future__ import annotations

import glob
import io
import json
import pathlib

import pytest
import torch
from torch import nn

import raydl
from tests import _resume_datasets as RD

pytestmark = pytest.mark.usefixtures("ray_session", "release_warm_workers_after_module")

TIMEOUT_S = 60


def _loader(n: int = 24) -> raydl.DataLoader:
    return raydl.DataLoader(
        RD.NoisyPoints(n),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        timeout=TIMEOUT_S,
        generator=torch.Generator().manual_seed(3),
    )


def _rows(batches) -> list:
    return [(idx.tolist(), x) for x, _, idx in batches]


def _assert_same(expected: list, actual: list) -> None:
    assert [e[0] for e in expected] == [a[0] for a in actual]
    for (_, a), (_, b) in zip(expected, actual):
        assert torch.equal(a, b), "same indices, different augmentation"


def test_lightning_mid_epoch_checkpoint_resumes_exactly(tmp_path):
    """ModelCheckpoint(every_n_train_steps=2), then fit(ckpt_path=...): Lightning saves and loads the loader's
    state itself, and the second fit trains on exactly the batches the uninterrupted fit saw after step 2."""
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)
            self.rows: list = []

        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            self.rows.append((idx.tolist(), x.clone()))
            return nn.functional.cross_entropy(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def trainer(max_steps, **kwargs):
        return L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **kwargs,
        )

    full = Module()
    with _loader() as loader:
        trainer(6, enable_checkpointing=False).fit(full, loader)
    callback = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    with _loader() as loader:
        trainer(3, callbacks=[callback]).fit(Module(), loader)
    ckpt = glob.glob(str(tmp_path / "*step=2*.ckpt"))[0]
    resumed = Module()
    with _loader() as loader:
        trainer(6, enable_checkpointing=False).fit(resumed, loader, ckpt_path=ckpt)
    _assert_same(full.rows[2:], resumed.rows)


def test_plain_loop_torch_save_resumes_exactly():
    """A loop saving {"model", "loader": loader.state_dict()} with torch.save resumes from torch.load(weights_only=True)."""
    with _loader() as loader:
        expected = _rows(loader)
    model = nn.Linear(4, 2)
    buf = io.BytesIO()
    with _loader() as loader:
        before = []
        for step, batch in enumerate(loader):
            before += _rows([batch])
            if step == 2:
                torch.save({"model": model.state_dict(), "loader": loader.state_dict()}, buf)
                break
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    with _loader() as loader:
        loader.load_state_dict(ckpt["loader"])
        after = _rows(loader)
    _assert_same(expected, before + after)


def test_ray_train_checkpoint_holds_the_loader_state(ray_session, tmp_path_factory):
    """Ray Train: the loader's state goes into the checkpoint the loop reports; loaded from that checkpoint, a
    fresh loader hands out exactly the rest of the epoch (the loop also loads it when restarted: ray_train_resume_loop)."""
    pytest.importorskip("ray.train.torch")
    from tests._integration_helpers import ray_train_outputs

    # TorchTrainer.fit() in its own driver on this Ray (tests/_ray_train_main.py says why); it copies
    # the reported checkpoint's state to reported_state.pt.
    gcs = ray_session.get_runtime_context().gcs_address
    out = pathlib.Path(ray_train_outputs(gcs, tmp_path_factory.getbasetemp() / "train")["resume"])
    first = json.loads((out / "seen_first.json").read_text())
    state = torch.load(out / "reported_state.pt", weights_only=True)
    assert state["step"] == 2
    with RD.ray_train_loader() as loader:  # the uninterrupted epoch, same seeds, made here
        full = [[idx.tolist(), x.tolist()] for x, _, idx in loader]
    with RD.ray_train_loader() as loader:
        loader.load_state_dict(state["loader"])
        rest = [[idx.tolist(), x.tolist()] for x, _, idx in loader]
    assert len(full) == 6 and len(first) == 2
    assert first + rest == full
