"""Lifecycle users see: no side effects at construction, nothing left behind, persistent workers kept."""

from __future__ import annotations

import gc
import inspect
import threading

import pytest
import torch

import raydl
from tests import _datasets as D
from tests._session import alive_worker_actors as _alive_worker_actors
from tests._session import run_python as _run_python
from tests._session import wait_until as _wait_until

TIMEOUT_S = 60


def test_constructor_arguments_are_public_attributes():
    """Every __init__ parameter is an attribute of the same name (trainers re-instantiate from them)."""
    loader = raydl.DataLoader(
        D.RangeDataset(8), batch_size=2, num_workers=1, ray_remote_args={"num_cpus": 0.25}, ray_address="auto"
    )
    params = [p for p in inspect.signature(raydl.DataLoader.__init__).parameters if p != "self"]
    missing = [p for p in params if not hasattr(loader, p)]
    assert missing == []
    assert loader.ray_remote_args == {"num_cpus": 0.25} and loader.ray_address == "auto"
    assert isinstance(loader, torch.utils.data.DataLoader)
    torch_params = list(inspect.signature(torch.utils.data.DataLoader.__init__).parameters)
    assert params[: len(torch_params) - 1] == torch_params[1:], "torch's parameters, in torch's order, come first"


def test_reinstantiation_keeps_ray_options():
    """Rebuilding a loader from its attributes (as Lightning does) keeps the ray_ options."""
    loader = raydl.DataLoader(D.RangeDataset(8), batch_size=2, num_workers=1, ray_remote_args={"num_cpus": 0.25})
    kwargs = {
        name: getattr(loader, name)
        for name in ("dataset", "batch_size", "num_workers", "collate_fn", "ray_remote_args", "ray_startup_timeout_s")
    }
    clone = type(loader)(**kwargs)
    assert clone.ray_remote_args == {"num_cpus": 0.25} and clone.batch_size == 2


def test_len_matches_torch():
    """len() is torch's for map-style and iterable datasets."""
    for kwargs in (dict(batch_size=3), dict(batch_size=3, drop_last=True), dict(batch_size=None)):
        assert len(raydl.DataLoader(D.RangeDataset(10), num_workers=2, **kwargs)) == len(
            torch.utils.data.DataLoader(D.RangeDataset(10), **kwargs)
        )
    assert len(raydl.DataLoader(D.UnshardedIterable(7), batch_size=2, num_workers=2)) == 4


def test_construction_has_no_side_effects_and_num_workers_zero_never_starts_ray():
    """Building loaders starts no Ray; num_workers=0 iterates in-process without Ray."""
    proc = _run_python(
        """
        import ray, raydl, torch
        from tests import _datasets as D
        loaders = [raydl.DataLoader(D.RangeDataset(6), batch_size=2, num_workers=4, shuffle=True) for _ in range(5)]
        assert not ray.is_initialized(), "construction started Ray"
        zero = raydl.DataLoader(D.RangeDataset(6), batch_size=2)
        assert [b.tolist() for b in zero] == [[[0], [1]], [[2], [3]], [[4], [5]]]
        # raydl's own in-process iterator (torch's batches, plus state_dict and ray_seed), never Ray
        assert type(iter(zero)).__module__ == "raydl.driver.inprocess"
        assert not ray.is_initialized(), "num_workers=0 started Ray"
        print("OK")
        """
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


# raydl's own local Ray binds 127.0.0.1 only: checked in tests/test_startup.py's fresh process (the same
# ensure_ray_initialized start a first loader makes), which saves a second local Ray start here.


def test_worker_info_in_workers_and_none_in_driver(ray_session):
    """raydl.get_worker_info() and torch's both give the worker's info inside workers, None in the driver."""
    assert raydl.get_worker_info() is None and torch.utils.data.get_worker_info() is None
    loader = raydl.DataLoader(D.RandomAugmentDataset(6), batch_size=1, num_workers=3, timeout=TIMEOUT_S)
    seeds = {}
    for batch in loader:
        seeds[int(batch["worker"])] = int(batch["seed"])
    assert sorted(seeds) == [0, 1, 2]
    base = seeds[0]
    assert seeds == {0: base, 1: base + 1, 2: base + 2}


@pytest.mark.usefixtures("ray_session")
class TestCleanup:
    """Actors, refs and threads end with the epoch, the break, or the loader."""

    def test_epoch_end_releases_workers(self):
        """A finished epoch without persistent workers leaves no worker actor alive."""
        base = _alive_worker_actors()
        assert len(list(raydl.DataLoader(D.RangeDataset(8), batch_size=2, num_workers=2, timeout=TIMEOUT_S))) == 4
        assert _wait_until(lambda: _alive_worker_actors() == base)

    def test_early_break_and_dropped_iterator_release_workers(self):
        """`break` out of the loop, then dropping the iterator, kills its workers."""
        base = _alive_worker_actors()
        for i, _ in enumerate(raydl.DataLoader(D.RangeDataset(32), batch_size=2, num_workers=3, timeout=TIMEOUT_S)):
            if i == 1:
                break
        gc.collect()
        assert _wait_until(lambda: _alive_worker_actors() == base)

    def test_exception_in_training_loop_releases_workers(self):
        """An exception raised by the training loop (the caller) leaves nothing behind."""
        base = _alive_worker_actors()

        def train():
            for _ in raydl.DataLoader(D.RangeDataset(32), batch_size=2, num_workers=2, timeout=TIMEOUT_S):
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            train()
        gc.collect()
        assert _wait_until(lambda: _alive_worker_actors() == base)

    def test_persistent_workers_kept_across_epochs_then_released(self):
        """persistent_workers=True reuses the same actors each epoch; shutdown() / the context manager ends them."""
        base = _alive_worker_actors()
        with raydl.DataLoader(
            D.PidDataset(6), batch_size=2, num_workers=2, persistent_workers=True, timeout=TIMEOUT_S
        ) as loader:
            pids = [{int(b[0, 1]) for b in loader} for _ in range(3)]
            assert pids[0] == pids[1] == pids[2] and len(pids[0]) == 2
            assert [r.worker_id for r in loader.worker_records] == [0, 1]
            assert _alive_worker_actors() == base + 2
        assert _wait_until(lambda: _alive_worker_actors() == base)

    def test_persistent_loader_dropped_releases_workers(self):
        """Dropping a persistent loader (no shutdown call) releases its actors."""
        base = _alive_worker_actors()
        loader = raydl.DataLoader(D.RangeDataset(6), batch_size=2, num_workers=2, persistent_workers=True)
        list(loader)
        del loader
        gc.collect()
        assert _wait_until(lambda: _alive_worker_actors() == base)

    def test_persistent_early_break_next_epoch_is_complete(self):
        """Breaking out of a persistent loader's epoch does not leak batches into the next epoch."""
        loader = raydl.DataLoader(D.RangeDataset(12), batch_size=2, num_workers=2, persistent_workers=True)
        for i, _ in enumerate(loader):
            if i == 1:
                break
        assert [b.flatten().tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
        loader.shutdown()
        loader.shutdown()  # idempotent

    # 100 loaders created, partly iterated and dropped leave no actors, objects or raydl threads: checked with 200
    # such cycles by tests/test_robustness.py::test_two_hundred_cycles_leave_resources_and_memory_where_they_began.


@pytest.mark.parametrize("shared, writable", [(False, 1), (True, 0)])
def test_dataset_copy_is_private_unless_shared(ray_session, shared, writable):
    """By default each worker gets a writable copy of the dataset (as torch); ray_shared_dataset_memory shares it read-only."""
    loader = raydl.DataLoader(
        D.ArrayDataset(4), batch_size=2, num_workers=2, timeout=TIMEOUT_S, ray_shared_dataset_memory=shared
    )
    assert {int(v) for b in loader for v in b[:, 1]} == {writable}


@pytest.mark.usefixtures("ray_session")
class TestWarmPool:
    """NOTE [ raydl warm pool ]: clean workers serve the next loader; everything else is killed."""

    def test_next_loader_reuses_clean_workers(self):
        """A loader that ran to the end hands its started workers to the next loader with the same options."""
        raydl.release_idle_workers()
        first = {
            int(b[0, 1]) for b in raydl.DataLoader(D.PidDataset(4), batch_size=1, num_workers=2, timeout=TIMEOUT_S)
        }
        it = iter(raydl.DataLoader(D.PidDataset(4), batch_size=1, num_workers=2, timeout=TIMEOUT_S))
        second = {int(next(it)[0, 1])} | {int(b[0, 1]) for b in it}
        # the same processes: no worker start (its seconds are what the warm pool saves: the retired bench_startup)
        assert second <= first and len(first) == 2
        del it

    def test_reused_workers_are_seeded_like_new_ones(self):
        """Workers taken from the warm pool are re-seeded: the batches still equal torch's."""
        from tests._parity import assert_same_batches

        for _ in range(2):
            assert_same_batches(lambda: D.RandomAugmentDataset(8), batch_size=2, shuffle=True, num_workers=2)

    def test_opt_out_and_other_options_get_new_processes(self):
        """ray_reuse_workers=False or reserved resources: never kept; different ray_remote_args never share workers."""
        raydl.release_idle_workers()
        base = _alive_worker_actors()
        kwargs = dict(batch_size=1, num_workers=2, timeout=TIMEOUT_S)
        list(raydl.DataLoader(D.PidDataset(2), ray_reuse_workers=False, **kwargs))
        assert raydl.cluster.warm.WARM_POOL.idle_count() == 0
        a = {int(b[0, 1]) for b in raydl.DataLoader(D.PidDataset(2), **kwargs)}
        kept = raydl.cluster.warm.WARM_POOL.idle_count()
        b = {int(b[0, 1]) for b in raydl.DataLoader(D.PidDataset(2), ray_remote_args={"num_cpus": 0.01}, **kwargs)}
        assert not (a & b)
        assert raydl.cluster.warm.WARM_POOL.idle_count() == kept, "workers reserving CPUs must not be kept idle"
        assert _wait_until(lambda: _alive_worker_actors() == base)

    def test_idle_workers_released_after_timeout(self, monkeypatch):
        """Idle warm workers are killed after RAYDL_IDLE_WORKER_TIMEOUT_S, and the reaper thread exits."""
        raydl.release_idle_workers()
        monkeypatch.setenv("RAYDL_IDLE_WORKER_TIMEOUT_S", "1")
        list(raydl.DataLoader(D.RangeDataset(2), batch_size=1, num_workers=2, timeout=TIMEOUT_S))

        def alive():
            return _alive_worker_actors(release_warm=False)

        assert raydl.cluster.warm.WARM_POOL.idle_count() == 2
        assert _wait_until(lambda: raydl.cluster.warm.WARM_POOL.idle_count() == 0 and alive() == 0, timeout_s=60)
        assert _wait_until(
            lambda: not [t for t in threading.enumerate() if t.name == "raydl_warm_reaper"], timeout_s=30
        )
