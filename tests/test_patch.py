"""raydl.patch(): torch's own DataLoader (and its subclasses) loading with Ray workers, and back."""

from __future__ import annotations

import os

import pytest
import torch
import torch.utils.data
import torch.utils.data.dataloader
from torch.utils.data import DataLoader as TorchDataLoader

import raydl
from raydl.driver.iter import _RayLoaderIter
from tests import _integration_helpers as H

TIMEOUT_S = 60
ORIGINALS = {name: TorchDataLoader.__dict__[name] for name in ("_get_iterator", "__iter__")}


pytestmark = pytest.mark.usefixtures("unpatched", "release_warm_workers_after_module")


def _torch_loader(n: int = 24, seed: int = 0, **kwargs) -> TorchDataLoader:
    kwargs.setdefault("num_workers", 2)
    return TorchDataLoader(
        H.ProvenanceDataset(n),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        timeout=TIMEOUT_S if kwargs["num_workers"] > 0 else 0,  # torch: no timeout without workers
        **kwargs,
    )


def _assert_made_by_torch_workers(meta: torch.Tensor) -> None:
    assert (meta[:, H.WORKER_ID] >= 0).all()
    assert (meta[:, H.PPID] == os.getpid()).all()


def _assert_same_batches(a: list, b: list) -> None:
    """Same features, labels, indices and worker ids, batch for batch (pids naturally differ)."""
    assert len(a) == len(b)
    for (xa, ya, ma), (xb, yb, mb) in zip(a, b):
        torch.testing.assert_close(xa, xb, rtol=0, atol=0)
        assert torch.equal(ya, yb)
        assert torch.equal(ma[:, [H.INDEX, H.WORKER_ID]], mb[:, [H.INDEX, H.WORKER_ID]])


def test_public_api_is_exported():
    """patch, unpatch, patched and is_patched are raydl's public names for the _patch module's functions."""
    from raydl.driver import patch as _patch

    for name in ("patch", "unpatch", "patched", "is_patched"):
        assert getattr(raydl, name) is getattr(_patch, name)
        assert name in raydl.__all__


def test_patched_torch_loader_gives_torchs_batches_from_ray_workers(ray_session):
    """Under patch, a plain torch DataLoader with a seeded generator yields torch's exact batches, made by Ray actors."""
    expected = list(_torch_loader(seed=7))
    _assert_made_by_torch_workers(H.metas(expected))

    raydl.patch()
    loader = _torch_loader(seed=7)
    iterator = iter(loader)
    assert isinstance(iterator, _RayLoaderIter)
    got = list(iterator)
    _assert_same_batches(got, expected)
    H.assert_made_by_ray_workers(H.metas(got), os.getpid())
    assert sorted(H.metas(got)[:, H.INDEX].tolist()) == list(range(24))


def test_patch_twice_is_a_noop_and_unpatch_restores_torchs_exact_functions(ray_session):
    """patch() twice installs once; unpatch() puts back torch's very function objects and is itself idempotent."""
    names_before = (torch.utils.data.DataLoader, torch.utils.data.dataloader.DataLoader)
    assert not raydl.is_patched()
    raydl.patch()
    installed = {name: TorchDataLoader.__dict__[name] for name in ORIGINALS}
    assert all(installed[name] is not ORIGINALS[name] for name in ORIGINALS)
    raydl.patch()
    assert raydl.is_patched()
    assert {name: TorchDataLoader.__dict__[name] for name in ORIGINALS} == installed
    # The public names are never rebound: isinstance checks and subclasses keep working.
    assert (torch.utils.data.DataLoader, torch.utils.data.dataloader.DataLoader) == names_before

    raydl.unpatch()
    assert not raydl.is_patched()
    assert all(TorchDataLoader.__dict__[name] is ORIGINALS[name] for name in ORIGINALS)
    raydl.unpatch()
    assert all(TorchDataLoader.__dict__[name] is ORIGINALS[name] for name in ORIGINALS)
    assert (torch.utils.data.DataLoader, torch.utils.data.dataloader.DataLoader) == names_before
    _assert_made_by_torch_workers(H.metas(list(_torch_loader(n=8))))


def test_patch_options_are_validated_and_conflicting_repatch_raises():
    """patch() rejects unknown or invalid ray_ options, and a second patch() with other options while patched."""
    with pytest.raises(TypeError, match="ray_remote_args"):
        raydl.patch(remote_args={"num_cpus": 1})
    with pytest.raises(ValueError, match="ray_startup_timeout_s"):
        raydl.patch(ray_startup_timeout_s=0)
    assert not raydl.is_patched()
    raydl.patch(ray_remote_args={"num_cpus": 0.5})
    raydl.patch(ray_remote_args={"num_cpus": 0.5})  # same options: no-op
    with pytest.raises(RuntimeError, match="unpatch"):
        raydl.patch()
    assert raydl.is_patched()


def test_loader_built_before_patch_uses_ray_while_patched_and_torch_after(ray_session):
    """An existing torch loader switches to Ray workers while patched and back to torch's processes after unpatch()."""
    loader = _torch_loader(n=12)
    _assert_made_by_torch_workers(H.metas(list(loader)))
    with raydl.patched():
        H.assert_made_by_ray_workers(H.metas(list(loader)), os.getpid())
    _assert_made_by_torch_workers(H.metas(list(loader)))


def test_num_workers_zero_stays_torchs_in_process_loading(ray_session):
    """Under patch, num_workers=0 still loads in the calling process with torch's own iterator."""
    with raydl.patched():
        loader = _torch_loader(n=8, num_workers=0)
        iterator = iter(loader)
        assert not isinstance(iterator, _RayLoaderIter)
        meta = H.metas(list(iterator))
    assert (meta[:, H.WORKER_ID] == -1).all()
    assert (meta[:, H.PID] == os.getpid()).all()


def test_raydl_dataloader_is_unaffected_by_patch(ray_session):
    """raydl.DataLoader gives the same batches, from Ray workers, patched or not; its persistent iterator is raydl's."""

    def make(**kwargs):
        return raydl.DataLoader(
            H.ProvenanceDataset(16),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            generator=torch.Generator().manual_seed(3),
            timeout=TIMEOUT_S,
            **kwargs,
        )

    unpatched = list(make())
    with raydl.patched(ray_remote_args={"num_cpus": 0.5}):
        loader = make(persistent_workers=True)
        patched_batches = list(loader)
        assert type(loader._iterator).__name__ == "_RayLoaderIter"  # in torch's slot, where trainers reset it
        assert loader.ray_remote_args is None
        loader.shutdown()
    _assert_same_batches(patched_batches, unpatched)
    H.assert_made_by_ray_workers(H.metas(patched_batches), os.getpid())
    H.assert_made_by_ray_workers(H.metas(unpatched), os.getpid())


def test_persistent_torch_loader_keeps_ray_workers_until_unpatch(ray_session):
    """A persistent torch loader reuses its Ray workers across epochs while patched; unpatch() releases them."""
    loader = _torch_loader(n=8, persistent_workers=True)
    before = H.metas(list(loader))  # torch's persistent processes, made before patching
    _assert_made_by_torch_workers(before)
    torch_iterator = loader._iterator

    raydl.patch()
    epoch1 = H.metas(list(loader))
    assert torch_iterator._shutdown and not any(w.is_alive() for w in torch_iterator._workers)
    ray_iterator = loader._iterator
    assert isinstance(ray_iterator, _RayLoaderIter)
    epoch2 = H.metas(list(loader))
    assert loader._iterator is ray_iterator  # same actors, next epoch
    H.assert_made_by_ray_workers(torch.cat([epoch1, epoch2]), os.getpid())
    assert set(epoch1[:, H.PID].tolist()) == set(epoch2[:, H.PID].tolist())

    raydl.unpatch()
    assert loader._iterator is None
    assert not ray_iterator.reusable
    _assert_made_by_torch_workers(H.metas(list(loader)))


def test_patch_options_reach_torch_loaders_but_not_loaders_with_their_own(ray_session):
    """patch(ray_remote_args=...) configures a plain torch loader's actors; a loader's own ray_ attribute wins."""
    raydl.release_idle_workers()  # this test reserves up to 1.5 of the session's 2 CPUs

    def loader(**attrs):
        dl = TorchDataLoader(H.AssignedCpuDataset(4), batch_size=2, num_workers=1, timeout=TIMEOUT_S)
        for name, value in attrs.items():
            setattr(dl, name, value)
        return dl

    with raydl.patched(ray_remote_args={"num_cpus": 0.5}):
        assert torch.cat(list(loader())).flatten().tolist() == [0.5] * 4
        assert torch.cat(list(loader(ray_remote_args={"num_cpus": 0.25}))).flatten().tolist() == [0.25] * 4
    with raydl.patched():
        assert torch.cat(list(loader())).flatten().tolist() == [0.0] * 4  # raydl's default: num_cpus=0


def test_patched_context_manager_nests_and_undoes_only_its_own_patch():
    """`with raydl.patched()` unpatches on exit (even on error) unless it was already patched when it began."""
    with pytest.raises(KeyError):
        with raydl.patched():
            assert raydl.is_patched()
            raise KeyError("boom")
    assert not raydl.is_patched()

    raydl.patch()
    with raydl.patched():
        assert raydl.is_patched()
    assert raydl.is_patched()  # the outer patch() is still in force
    raydl.unpatch()

    with raydl.patched():
        with raydl.patched():
            pass
        assert raydl.is_patched()
    assert not raydl.is_patched()

    @raydl.patched()
    def inside() -> bool:
        return raydl.is_patched()

    assert inside() and inside()
    assert not raydl.is_patched()


def test_subclass_that_keeps_torchs_iteration_is_patched(ray_session):
    """A torch DataLoader subclass (as accelerate's and Lightning's) loads with Ray workers under patch."""

    class Sub(TorchDataLoader):
        def __iter__(self):
            yield from super().__iter__()

    with raydl.patched():
        loader = Sub(H.ProvenanceDataset(8), batch_size=4, num_workers=2, timeout=TIMEOUT_S)
        H.assert_made_by_ray_workers(H.metas(list(loader)), os.getpid())
    _assert_made_by_torch_workers(H.metas(list(loader)))
