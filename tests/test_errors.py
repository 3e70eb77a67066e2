"""Errors users see: torch's argument errors, worker exceptions, timeouts, start-up and pickling failures."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import raydl
from tests import _datasets as D

pytestmark = pytest.mark.usefixtures("ray_session")

TIMEOUT_S = 60


def _error_of(factory):
    try:
        factory()
    except Exception as e:  # noqa: BLE001 - the test compares whatever was raised
        return type(e), str(e)
    return None


BAD_ARGS = [
    dict(num_workers=-1),
    dict(timeout=-1),
    dict(num_workers=0, prefetch_factor=2),
    dict(num_workers=2, prefetch_factor=-1),
    dict(persistent_workers=True),
    dict(shuffle=True, sampler=[0, 1]),
    dict(batch_sampler=[[0]], batch_size=2),
    dict(batch_sampler=[[0]], drop_last=True),
    dict(batch_size=None, drop_last=True),
    dict(num_workers=2, multiprocessing_context="no-such-method"),
    dict(num_workers=0, multiprocessing_context="spawn"),
]


@pytest.mark.parametrize("kwargs", BAD_ARGS, ids=[",".join(k) for k in BAD_ARGS])
def test_invalid_arguments_raise_torchs_errors(kwargs):
    """Invalid combinations raise the exception type and message torch raises."""
    expected = _error_of(lambda: torch.utils.data.DataLoader(D.RangeDataset(4), **kwargs))
    assert expected is not None
    assert _error_of(lambda: raydl.DataLoader(D.RangeDataset(4), **kwargs)) == expected


@pytest.mark.parametrize(
    "kwargs",
    [dict(shuffle=True), dict(sampler=[0]), dict(batch_sampler=[[0]])],
    ids=["shuffle", "sampler", "batch_sampler"],
)
def test_iterable_dataset_argument_errors_match_torch(kwargs):
    """IterableDataset rejects shuffle/sampler/batch_sampler with torch's messages."""
    expected = _error_of(lambda: torch.utils.data.DataLoader(D.ShardedIterable(0, 4), **kwargs))
    assert _error_of(lambda: raydl.DataLoader(D.ShardedIterable(0, 4), **kwargs)) == expected


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(ray_address=5), TypeError),
        (dict(ray_remote_args=[("num_cpus", 1)]), TypeError),
        (dict(ray_startup_timeout_s=0), ValueError),
        (dict(ray_startup_timeout_s="10"), ValueError),
    ],
)
def test_invalid_ray_options(kwargs, exc):
    """Bad ray_ options fail at construction with a message naming the option."""
    with pytest.raises(exc, match=next(iter(kwargs))):
        raydl.DataLoader(D.RangeDataset(4), num_workers=1, **kwargs)


def test_multiprocessing_context_accepted_and_warned_once():
    """multiprocessing_context is accepted (it means nothing for actors) and warned about once per process."""
    import raydl.loader as loader_mod

    loader_mod._mp_context_warned = False
    with pytest.warns(UserWarning, match="ignores multiprocessing_context"):
        dl = raydl.DataLoader(D.RangeDataset(4), num_workers=1, multiprocessing_context="spawn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raydl.DataLoader(D.RangeDataset(4), num_workers=1, multiprocessing_context="spawn")
    assert [b.tolist() for b in dl] == [[[0]], [[1]], [[2]], [[3]]]


def _outcomes(loader):
    """Each next() of the loader: ('ok', batch) or ('err', type, message); stops at the end."""
    out = []
    it = iter(loader)
    while True:
        try:
            out.append(("ok", next(it).tolist()))
        except StopIteration:
            return out
        except Exception as e:  # noqa: BLE001
            out.append(("err", type(e), str(e)))


def test_dataset_error_surfaces_with_worker_and_iteration_continues():
    """A dataset exception keeps its type, names worker and indices, carries the worker traceback; next() goes on."""
    kwargs = dict(batch_size=2, num_workers=2, timeout=TIMEOUT_S)
    expected = _outcomes(torch.utils.data.DataLoader(D.RaisingDataset(10, 5), multiprocessing_context="fork", **kwargs))
    actual = _outcomes(raydl.DataLoader(D.RaisingDataset(10, 5), **kwargs))
    assert [o[:2] for o in actual] == [o[:2] for o in expected]
    assert [o for o in actual if o[0] == "ok"] == [o for o in expected if o[0] == "ok"]
    (err,) = [o for o in actual if o[0] == "err"]
    assert err[1] is ValueError
    msg = err[2]
    assert "Caught ValueError in raydl worker 0" in msg
    assert "batch 2" in msg and "[4, 5]" in msg
    assert "Traceback (most recent call last)" in msg and "bad index 5" in msg and "_datasets.py" in msg


def test_key_error_message_is_readable():
    """A KeyError from a worker prints its multi-line message as text, like torch's."""
    with pytest.raises(KeyError) as info:
        list(raydl.DataLoader(D.KeyErrorDataset(6), batch_size=2, num_workers=2, timeout=TIMEOUT_S))
    text = str(info.value)
    assert "Caught KeyError in raydl worker" in text and "missing-key" in text and "\\n" not in text


def test_exception_that_cannot_take_a_message_becomes_runtime_error():
    """An exception type whose constructor needs other arguments is re-raised as RuntimeError (torch's rule)."""
    with pytest.raises(RuntimeError, match="Caught TwoArgError in raydl worker"):
        list(raydl.DataLoader(D.TwoArgErrorDataset(6), batch_size=1, num_workers=2, timeout=TIMEOUT_S))


def test_iterable_error_surfaces():
    """An exception inside an IterableDataset's iterator reaches the driver with its type."""
    with pytest.raises(ValueError, match="stream broke"):
        list(raydl.DataLoader(D.RaisingIterable(), batch_size=None, num_workers=1, timeout=TIMEOUT_S))


def test_worker_init_fn_error_raises_on_first_batch():
    """A failing worker_init_fn raises its own exception type, naming the worker, at the start of iteration."""
    loader = raydl.DataLoader(D.RangeDataset(4), num_workers=2, worker_init_fn=D.failing_init_fn, timeout=TIMEOUT_S)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"Caught RuntimeError in raydl worker \d while starting") as info:
        next(iter(loader))
    assert "init failed in worker" in str(info.value) and "failing_init_fn" in str(info.value)
    assert time.monotonic() - t0 < 120  # bounded: ray_startup_timeout_s (3 s) plus the diagnosis, never a hang


def test_timeout_raises_torchs_error_with_details():
    """timeout > 0: torch's 'DataLoader timed out after N seconds', plus the batch and worker waited on."""
    loader = raydl.DataLoader(D.SlowDataset(4, {0: 30}), batch_size=1, num_workers=1, timeout=1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 1 seconds") as info:
        list(loader)
    assert "batch 0" in str(info.value) and "raydl worker 0" in str(info.value)
    assert time.monotonic() - t0 < 20


def test_unpicklable_dataset_names_the_attribute():
    """A dataset holding a lock fails at iteration with a TypeError naming dataset.lock and the fix."""
    loader = raydl.DataLoader(D.LockedDataset(4), num_workers=1)
    with pytest.raises(TypeError, match=r"dataset\.lock \(a lock\) cannot be pickled") as info:
        iter(loader)
    assert "Fix:" in str(info.value)


@pytest.mark.parametrize("field", ["collate_fn", "worker_init_fn"])
def test_unpicklable_functions_are_named(field):
    """A collate_fn / worker_init_fn closing over a lock fails with a TypeError naming that argument."""
    import threading

    lock = threading.Lock()

    def uses_lock(arg):
        with lock:
            return arg

    loader = raydl.DataLoader(D.RangeDataset(4), num_workers=1, **{field: uses_lock})
    with pytest.raises(TypeError, match=rf"raydl cannot send {field} to its Ray workers: {field}.* cannot be pickled"):
        iter(loader)


def test_unplaceable_workers_fail_with_the_shortfall():
    """Workers asking for a resource no node has end in WorkerPlacementError naming it, within the timeout."""
    loader = raydl.DataLoader(
        D.RangeDataset(4),
        num_workers=2,
        ray_remote_args={"resources": {"no_such_resource": 1}},
        ray_startup_timeout_s=3,
    )
    t0 = time.monotonic()
    with pytest.raises(raydl.WorkerPlacementError, match="no_such_resource") as info:
        list(loader)
    assert "2 of 2 raydl workers could not be placed" in str(info.value) and "Fix:" in str(info.value)
    assert time.monotonic() - t0 < 120  # bounded: ray_startup_timeout_s (3 s) plus the diagnosis, never a hang


def test_workers_slow_to_start_with_resources_free_point_to_the_logs():
    """Free resources but no worker running within ray_startup_timeout_s: the error says so and where to look."""
    loader = raydl.DataLoader(
        D.RangeDataset(4),
        num_workers=1,
        # A runtime_env of its own: Ray must start a new process (several seconds), none is waiting.
        ray_remote_args={"runtime_env": {"env_vars": {"RAYDL_TEST_SLOW_START": "1"}}},
        ray_startup_timeout_s=0.05,
        ray_reuse_workers=False,
    )
    with pytest.raises(raydl.WorkerPlacementError, match="1 of 1 raydl workers did not start") as info:
        list(loader)
    assert "has that free" in str(info.value) and "logs" in str(info.value)
    assert "could not be placed" not in str(info.value)


def test_dataset_module_missing_on_workers_names_the_module_and_the_fix(tmp_path, monkeypatch):
    """A dataset whose module only the driver can import fails at start-up naming the module and how to ship it."""
    pkg = tmp_path / "driver_only_mod_raydl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import torch\n"
        "class Data(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 4\n"
        "    def __getitem__(self, i):\n        return i\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver only: workers were started without it
    import driver_only_mod_raydl

    loader = raydl.DataLoader(driver_only_mod_raydl.Data(), num_workers=1, timeout=TIMEOUT_S, ray_reuse_workers=False)
    with pytest.raises(ModuleNotFoundError, match=r"raydl worker 0 while starting .*'driver_only_mod_raydl'") as info:
        list(loader)
    assert "py_modules" in str(info.value)
