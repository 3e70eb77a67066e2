"""`raydl.patch()`: every `torch.utils.data.DataLoader` with `num_workers > 0` loads with Ray workers.

For trainers that build their loaders themselves (accelerate's `prepare()`, Ray Train's
`prepare_data_loader`, Lightning's re-instantiation, any library's internals), where changing
one import is not possible:

    import raydl

    raydl.patch()                    # from here on, torch DataLoaders load with Ray actors
    ...
    raydl.unpatch()                  # torch's own worker processes again

    with raydl.patched():            # or only for a block (also usable as a decorator)
        accelerator.prepare(model, optimizer, loader)
        ...

NOTE [ raydl patch design ]
The patch is at the iterator level: while patched, `torch.utils.data.DataLoader._get_iterator`
and `DataLoader.__iter__` are replaced, on torch's class itself, by versions that return
`raydl.driver.iter._RayLoaderIter(loader)` when `loader.num_workers > 0`; with `num_workers == 0`
they call torch's originals. Why there:
  * every torch DataLoader is covered, whoever built it and whenever (one made before `patch()`
    too, until `unpatch()`), and every subclass that keeps torch's iteration (accelerate, Ray
    Train, Lightning); one that overrides `_get_iterator` or `__iter__` keeps its own;
  * the names `torch.utils.data.DataLoader` are NOT rebound: that would miss every import made
    before `patch()`, leave subclasses of the original unpatched and break `isinstance` checks.
`raydl.DataLoader` behaves identically patched or not.
A plain torch loader gets raydl's defaults or the `ray_*` options given to `patch(...)`; a loader
carrying `ray_*` attributes keeps its own. torch's arguments keep their meaning;
`multiprocessing_context` is ignored, and torch's too-many-workers warning is given at `iter()`
only when every worker runs on this host (NOTE [ raydl worker-count warning ]).
Persistent workers: the `_RayLoaderIter` sits in torch's own slot, `loader._iterator`, so a
library that resets the slot releases the Ray workers as it would torch's; torch processes found
there are replaced at the next `iter()`, and `unpatch()` shuts the Ray ones down (an epoch already
running finishes on them).
`patch()` and `unpatch()` are idempotent and thread-safe; `patch()` while patched with other
`ray_*` options raises. `patched()` undoes only what it did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
import weakref
from typing import Any, Iterator, Mapping, Optional

from torch.utils.data import DataLoader as _TorchDataLoader

from .._options import RayOptions
from .iter import _RayLoaderIter
from .spec import LoaderSpec

__all__ = ["patch", "unpatch", "patched", "is_patched"]

_lock = threading.RLock()
# torch's own functions, taken from the class dict when patching (None while unpatched).
_originals: Optional[dict[str, Any]] = None
# The `ray_*` options given to patch(), as attribute name -> value; None: raydl's defaults.
_ray_defaults: Optional[dict[str, Any]] = None
_active_options: Optional[RayOptions] = None
# torch loaders whose persistent Ray iterator sits in their `_iterator` slot (released by unpatch).
_persistent_loaders: "weakref.WeakSet[_TorchDataLoader]" = weakref.WeakSet()

_PATCHED_NAMES = ("_get_iterator", "__iter__")


class _LoaderWithRayDefaults:
    """A read-through view of a loader in which the `ray_*` options it lacks read as patch()'s."""

    __slots__ = ("_raydl_loader", "_raydl_defaults", "__weakref__")

    def __init__(self, loader: Any, defaults: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_raydl_loader", loader)
        object.__setattr__(self, "_raydl_defaults", defaults)

    def __getattr__(self, name: str) -> Any:
        loader = object.__getattribute__(self, "_raydl_loader")
        try:
            return getattr(loader, name)
        except AttributeError:
            defaults = object.__getattribute__(self, "_raydl_defaults")
            if name in defaults:
                return defaults[name]
            raise

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_raydl_loader"), name, value)


def _source(loader: Any) -> Any:
    defaults = _ray_defaults
    return loader if not defaults else _LoaderWithRayDefaults(loader, defaults)


def _patched_get_iterator(self):
    """torch's `_get_iterator`, with raydl's Ray-actor iterator when num_workers > 0 (see raydl.patch)."""
    originals = _originals
    if (
        self.num_workers == 0
        and originals is not None
        and getattr(_source(self), "ray_seed", "worker") in ("batch", "sample")
    ):
        from .inprocess import _InProcessIter  # imported late: it pulls in the checkpoint machinery

        return _InProcessIter(LoaderSpec.of(_source(self)))  # NOTE [ raydl batch seeding ], in-process
    if self.num_workers == 0 or originals is None:
        original = originals["_get_iterator"] if originals is not None else _TorchDataLoader._get_iterator
        return original(self)
    return _RayLoaderIter(LoaderSpec.of(_source(self)))


def _patched_iter(self):
    """torch's `__iter__`, keeping a persistent loader's Ray iterator in torch's `_iterator` slot (see raydl.patch)."""
    originals = _originals
    if originals is None:  # unpatched meanwhile: this function is only reachable through a stale reference
        return _TorchDataLoader.__iter__(self)
    if not (self.persistent_workers and self.num_workers > 0):
        return originals["__iter__"](self)
    current = self._iterator
    if isinstance(current, _RayLoaderIter):
        if current.reusable:
            current.next_epoch(self._IterableDataset_len_called)
            return current
        current.shutdown()
    elif current is not None:
        if not _is_torch_multiprocessing_iter(current):
            # Some other iterator a subclass made (its own `_get_iterator`): torch's behaviour.
            current._reset(self)
            return current
        # torch's worker processes from before patch(): end them, start Ray workers instead.
        current._shutdown_workers()
    self._iterator = None
    self._iterator = self._get_iterator()
    if isinstance(self._iterator, _RayLoaderIter):
        with _lock:
            _persistent_loaders.add(self)
    return self._iterator


def _is_torch_multiprocessing_iter(it: Any) -> bool:
    from torch.utils.data import dataloader as torch_dataloader

    cls = getattr(torch_dataloader, "_MultiProcessingDataLoaderIter", None)
    return cls is not None and isinstance(it, cls) and hasattr(it, "_shutdown_workers")


_REPLACEMENTS = {"_get_iterator": _patched_get_iterator, "__iter__": _patched_iter}


def _validated(ray_options: Mapping[str, Any]) -> RayOptions:
    fields = {f.name for f in dataclasses.fields(RayOptions)}
    kwargs = {}
    for key, value in ray_options.items():
        if not key.startswith("ray_") or key[4:] not in fields:
            known = ", ".join(sorted(f"ray_{name}" for name in fields))
            raise TypeError(f"raydl.patch() got an unexpected keyword argument {key!r}; it accepts {known}")
        kwargs[key[4:]] = value
    return RayOptions(**kwargs)


def patch(**ray_options: Any) -> None:
    """Make every torch DataLoader with num_workers > 0 load with Ray workers, until `unpatch()`.

    Applies to loaders built before and after the call, of torch's class and of subclasses that
    keep torch's iteration (see NOTE [ raydl patch design ]). `raydl.DataLoader` is unaffected.
    Calling it again while patched is a no-op.

    Example:
        >>> import torch
        >>> import raydl
        >>> raydl.patch(ray_remote_args={"num_cpus": 0})  # torch loaders with num_workers > 0 now use Ray workers
        >>> raydl.is_patched()
        True
        >>> loader = torch.utils.data.DataLoader(range(6), batch_size=3)  # num_workers=0: torch's own loading
        >>> [batch.tolist() for batch in loader]
        [[0, 1, 2], [3, 4, 5]]
        >>> raydl.unpatch()

    Args:
        **ray_options: `raydl.DataLoader`'s `ray_*` options (`ray_address`, `ray_remote_args`,
            `ray_startup_timeout_s`, ...), used for loaders that do not carry their own.

    Raises:
        TypeError: an option that `raydl.DataLoader` does not have.
        ValueError: an invalid option value (the same checks as `raydl.DataLoader`).
        RuntimeError: already patched with different options.
    """
    global _originals, _ray_defaults, _active_options
    options = _validated(ray_options)
    with _lock:
        if _originals is not None:
            if options != _active_options:
                raise RuntimeError(
                    f"raydl is already patched with {_describe(_active_options)}; call raydl.unpatch() "
                    f"before patching with {_describe(options)}"
                )
            return
        originals = {name: _TorchDataLoader.__dict__[name] for name in _PATCHED_NAMES}
        defaults = {
            f"ray_{f.name}": getattr(options, f.name)
            for f in dataclasses.fields(RayOptions)
            if getattr(options, f.name) != f.default
        }
        _ray_defaults = defaults or None
        _active_options = options
        _originals = originals
        for name, replacement in _REPLACEMENTS.items():
            setattr(_TorchDataLoader, name, replacement)


def unpatch() -> None:
    """Restore torch's own `DataLoader._get_iterator` and `__iter__`; a no-op when not patched.

    Persistent Ray workers held by torch loaders are shut down, so their next epoch uses torch's
    worker processes; an epoch in progress on Ray workers finishes there.
    """
    global _originals, _ray_defaults, _active_options
    with _lock:
        if _originals is None:
            return
        for name, original in _originals.items():
            current = _TorchDataLoader.__dict__.get(name)
            if current is not _REPLACEMENTS[name]:
                warnings.warn(
                    f"torch.utils.data.DataLoader.{name} was replaced by someone else after raydl.patch(); "
                    "raydl.unpatch() restores torch's original over it",
                    RuntimeWarning,
                    stacklevel=2,
                )
            setattr(_TorchDataLoader, name, original)
        _originals = None
        _ray_defaults = None
        _active_options = None
        loaders = list(_persistent_loaders)
        _persistent_loaders.clear()
    for loader in loaders:
        it = getattr(loader, "_iterator", None)
        if isinstance(it, _RayLoaderIter):
            loader._iterator = None
            try:
                it.shutdown()
            except Exception:  # Ray may be gone already; its actors went with it
                pass


def is_patched() -> bool:
    """Whether `patch()` is in force."""
    return _originals is not None


@contextlib.contextmanager
def patched(**ray_options: Any) -> Iterator[None]:
    """`patch(**ray_options)` for a `with` block (or a decorated function); undone on exit if it patched.

    Nested inside an active `patch()` with the same options it changes nothing, and its exit
    leaves the outer patch in force.
    """
    with _lock:
        was_patched = is_patched()
        patch(**ray_options)
    try:
        yield
    finally:
        if not was_patched:
            unpatch()


def _describe(options: Optional[RayOptions]) -> str:
    if options is None:
        return "no options"
    changed = {
        f"ray_{f.name}": getattr(options, f.name)
        for f in dataclasses.fields(RayOptions)
        if getattr(options, f.name) != f.default
    }
    return ", ".join(f"{k}={v!r}" for k, v in changed.items()) or "raydl's default options"
