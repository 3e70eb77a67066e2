"""Run one configuration through torch's DataLoader and raydl's, and compare every batch."""

from __future__ import annotations

import collections
import gc
import random
from typing import Any, Callable

import numpy as np
import torch

import raydl

# Generous per-batch bound: a hang becomes a failure, never a stuck CI job.
BATCH_TIMEOUT_S = 60


def assert_batches_equal(a: Any, b: Any, where: str = "batch") -> None:
    """Recursive equality that also checks container types, tensor dtypes and shapes."""
    assert type(a) is type(b), f"{where}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, collections.abc.Mapping):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_batches_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_batches_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_epochs_equal(expected: list, actual: list) -> None:
    """Two loaders' epochs (run_epochs' lists of batches) equal batch for batch, in order."""
    assert len(expected) == len(actual), f"{len(expected)} epochs against {len(actual)}"
    for e, (exp, act) in enumerate(zip(expected, actual)):
        assert len(exp) == len(act), f"epoch {e}: {len(exp)} batches against {len(act)}"
        for i, (x, y) in enumerate(zip(exp, act)):
            assert_batches_equal(x, y, f"epoch {e} batch {i}")


def _key(batch: Any) -> str:
    """A canonical text of a batch, for multiset comparison."""
    if isinstance(batch, torch.Tensor):
        return f"T{batch.dtype}{batch.tolist()}"
    if isinstance(batch, np.ndarray):
        return f"N{batch.dtype}{batch.tolist()}"
    if isinstance(batch, collections.abc.Mapping):
        return "{" + ",".join(f"{k}:{_key(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        return type(batch).__name__ + "[" + ",".join(_key(v) for v in batch) + "]"
    return repr(batch)


def _seed_everything(seed: int) -> None:
    """The driver's own RNGs (used with num_workers=0), seeded alike before each loader runs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_epochs(loader, epochs: int) -> list[list[Any]]:
    return [list(loader) for _ in range(epochs)]


def _run_forked(fn: Callable[[], Any]) -> Any:
    """Run torch's loader, whose workers are forks of this Ray driver, with no garbage for them to collect.

    A forked child that garbage-collects an object it inherited (an ObjectRef, a zero-copy batch of an
    earlier raydl loader in a reference cycle) talks to Ray over the parent's sockets; the raylet then
    reads an invalid Plasma message and exits, taking the test session's Ray with it (seen twice in CI
    runs, in tests/test_arrow.py). Collected first and frozen, the inherited objects are never collected
    in a child (CPython's advice for gc before fork).
    """
    gc.collect()
    gc.freeze()
    try:
        return fn()
    finally:
        gc.unfreeze()


def torch_epochs(dataset: Any, epochs: int, **kwargs: Any) -> list[list[Any]]:
    """torch's own epochs of `torch.utils.data.DataLoader(dataset, **kwargs)`, the reference a test compares with.

    Its workers are forks of this process, a Ray driver with many threads, and a fork can leave a lock held in the
    child: a worker once stopped inside default_collate's `torch.stack` for good (beside two CPU spinners; the test
    then timed out at 600 s). So with workers torch's own `timeout` bounds each batch (BATCH_TIMEOUT_S), and a loader
    that timed out is made again once, from the same RNG states (the global one, the loader's `generator`), so the
    second try draws what the first drew. Garbage is frozen first, as for `_run_forked`."""
    if kwargs.get("num_workers", 0) > 0:
        kwargs.setdefault("timeout", BATCH_TIMEOUT_S)
    generator = kwargs.get("generator")
    states = (torch.get_rng_state(), generator.get_state() if generator is not None else None)
    try:
        return _run_forked(lambda: run_epochs(torch.utils.data.DataLoader(dataset, **kwargs), epochs))
    except RuntimeError as e:
        if "timed out" not in str(e):
            raise
    torch.set_rng_state(states[0])
    if generator is not None:
        generator.set_state(states[1])
    return _run_forked(lambda: run_epochs(torch.utils.data.DataLoader(dataset, **kwargs), epochs))


def assert_same_batches(
    make_dataset: Callable[[], Any],
    *,
    epochs: int = 1,
    seed: int | None = 0,
    compare: str = "exact",
    torch_workers: int | None = None,
    **loader_kwargs: Any,
) -> list[list[Any]]:
    """Build torch's and raydl's loader from the same arguments (and equally seeded generators) and compare.

    compare="exact": batch for batch, in order. compare="multiset": the same batches in any order.
    torch runs with the same num_workers unless `torch_workers` says otherwise. Returns raydl's batches.
    """
    kwargs = dict(loader_kwargs)
    num_workers = kwargs.pop("num_workers", 2)
    t_kwargs = dict(kwargs)
    r_kwargs = dict(kwargs)
    tw = num_workers if torch_workers is None else torch_workers
    if tw == 0:
        t_kwargs.pop("prefetch_factor", None)
        t_kwargs.pop("persistent_workers", None)
        t_kwargs.pop("in_order", None)
    else:
        t_kwargs.setdefault("multiprocessing_context", "fork")
        t_kwargs.setdefault("timeout", BATCH_TIMEOUT_S)
    if num_workers > 0:
        r_kwargs.setdefault("timeout", BATCH_TIMEOUT_S)
    if seed is not None:
        t_kwargs["generator"] = torch.Generator().manual_seed(seed)
        r_kwargs["generator"] = torch.Generator().manual_seed(seed)
        _seed_everything(seed)
    expected = torch_epochs(make_dataset(), epochs, num_workers=tw, **t_kwargs)
    if seed is not None:
        _seed_everything(seed)
    with raydl.DataLoader(make_dataset(), num_workers=num_workers, **r_kwargs) as loader:
        actual = run_epochs(loader, epochs)
    for e, (exp, act) in enumerate(zip(expected, actual)):
        if compare == "exact":
            assert len(exp) == len(act), f"epoch {e}: torch gave {len(exp)} batches, raydl {len(act)}"
            for i, (x, y) in enumerate(zip(exp, act)):
                assert_batches_equal(x, y, f"epoch {e} batch {i}")
        else:
            assert sorted(map(_key, exp)) == sorted(map(_key, act)), f"epoch {e}: batches differ as multisets"
    return actual
