"""Resume parity against torchdata's StatefulDataLoader, the reference implementation.

For one configuration `check_resume` runs torchdata's StatefulDataLoader and raydl's DataLoader
and checks:
  * uninterrupted, they hand out the same batches (raydl's are torch's);
  * a state taken by raydl after k batches (through torch.save / torch.load(weights_only=True),
    and JSON when torchdata's is JSON) resumes a fresh raydl loader with exactly the rest of the
    uninterrupted run: over the interrupted and the resumed run every batch exactly once, worker
    RNG included;
  * a state taken by torchdata after k batches loaded into raydl, and raydl's loaded into
    torchdata, continue with the batches torchdata continues with from its own state;
  * `state_dict()` right after `load_state_dict()` returns the loaded state;
  * each state has StatefulDataLoader's layout (`_layout`): the same keys, a snapshot for every
    worker, and the same values where the two runs are the same (right after `iter()` included).
States are taken during one uninterrupted pass (a state once taken never changes), so each
configuration costs one pass per loader plus the resumed runs.

`check_epoch_end` checks states taken at the end of an epoch (after its last batch, and after
StopIteration) the way a job that builds its loader with a seeded `torch.Generator` resumes: the
same generator object, re-seeded to its seed, goes to the new loader; the next epoch must be the
saver's next epoch, whichever loader saved and whichever loads.
"""

from __future__ import annotations

import io
import json
import multiprocessing
from typing import Any, Callable, Sequence

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import raydl
from tests._parity import BATCH_TIMEOUT_S, assert_batches_equal

_CTX = None


def _mp_context():
    """torchdata's workers come from a forkserver started once: a plain fork of a process running Ray's
    threads can deadlock in the child, and spawn re-imports torch for every worker."""
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "tests._datasets", "tests._resume_datasets"])
    return _CTX


def _roundtrip(state: dict) -> dict:
    """What a checkpoint does to a state: torch.save, then torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _json_ok(state: dict) -> bool:
    try:
        json.dumps(state)
    except TypeError:
        return False
    return True


# A restarted job's global torch RNG is somewhere else than the saver's was: each resume starts
# from this seed. The epoch after a state taken at its end draws from the global RNG (torch's
# rule without a generator): the saver sets END_SEED just before it takes that state and goes on
# into its next epoch, and a resume sets END_SEED too (what a job restoring torch's RNG with its
# checkpoint does); raydl's state records the RNG it was taken at, torchdata's does not.
RESTART_SEED = 424242
END_SEED = 171717
END = "end"  # in ks: the state taken after the epoch's StopIteration


def _pass(make_loader: Callable[[], Any], epoch: int, ks: Sequence) -> tuple[list, dict, Any, list]:
    """Epochs before `epoch` in full, then epoch `epoch` with a state after each k in ks:
    (batches, {k: state}, loader, the next epoch's batches when END is in ks)."""
    torch.manual_seed(0)  # a script's `torch.manual_seed` before it builds its loader
    loader = make_loader()
    for _ in range(epoch):
        list(loader)
    batches, states = [], {}
    it = iter(loader)
    if 0 in ks:
        states[0] = loader.state_dict()
    for b in it:
        batches.append(b)
        if len(batches) in ks:
            states[len(batches)] = loader.state_dict()
    following: list = []
    if END in ks:
        torch.manual_seed(END_SEED)
        states[END] = loader.state_dict()
        following = list(loader)
    return batches, states, loader, following


def _resume(make_loader: Callable[[], Any], state: dict, *, check_echo: bool = False, finished: bool = False) -> list:
    torch.manual_seed(0)
    loader = make_loader()
    torch.manual_seed(END_SEED if finished else RESTART_SEED)
    loader.load_state_dict(state)
    if check_echo:
        echo = loader.state_dict()
        assert _key(echo) == _key(state), "state_dict() right after load_state_dict() is not the loaded state"
    out = list(loader)
    if isinstance(loader, raydl.DataLoader):
        loader.shutdown()
    return out


# raydl's own keys, which StatefulDataLoader ignores: a state's section and a worker snapshot's generators
_RAYDL_KEYS = ("_raydl", "_raydl_rng")


def _layout(state: Any, values: bool = True) -> Any:
    """A state as StatefulDataLoader lays it out: raydl's own keys dropped, tensors as lists; with
    `values=False` only the keys and which entries are None, dicts or plain values."""
    if isinstance(state, dict):
        return {k: _layout(v, values) for k, v in state.items() if k not in _RAYDL_KEYS}
    if isinstance(state, torch.Tensor):
        return state.tolist() if values else "tensor"
    if values or state is None:
        return state
    return "list" if isinstance(state, (list, tuple)) else "value"


def _same_layout(td_state: dict, rd_state: dict, values: bool, where: str) -> None:
    td, rd = _layout(td_state, values), _layout(rd_state, values)
    assert td == rd, (
        f"{where}: raydl's state is not laid out as StatefulDataLoader's:\n  torchdata {td}\n  raydl     {rd}"
    )


def _key(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"T{obj.tolist()}"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k}:{_key(v)}" for k, v in sorted(obj.items())) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_key(v) for v in obj) + "]"
    return repr(obj)


def _same(expected: list, actual: list, where: str) -> None:
    assert len(expected) == len(actual), f"{where}: {len(expected)} batches expected, got {len(actual)}"
    for i, (x, y) in enumerate(zip(expected, actual)):
        assert_batches_equal(x, y, f"{where}, batch {i}")


def check_resume(
    make_dataset: Callable[[], Any],
    make_kwargs: Callable[[], dict],
    *,
    num_workers: int,
    ks: Sequence = (0, 1, 3),
    epoch: int = 0,
    td_resume_exact: bool = True,
    cross: bool = True,
    same_uninterrupted: bool = True,
    next_from_state: bool = True,
) -> None:
    """Run the checks of this module's docstring for one configuration.

    `make_kwargs()` returns fresh loader kwargs (new, equally seeded samplers and generators) on
    each call, as a restarted job would build them. `ks` beyond the epoch's length mean "all
    batches". `td_resume_exact=False`: torchdata's resume does not reproduce its own
    uninterrupted run (worker RNG is not in its state); cross-loaded states are then compared
    with torchdata's own resume. `cross=False`: raydl against itself only (a configuration
    torchdata cannot resume, such as an epoch > 0 with torch's RandomSampler).
    `same_uninterrupted=False`: the two uninterrupted runs differ by design (torchdata's own
    RandomSampler under StatefulDataLoader draws a permutation it discards when its iterator is
    made, torch's loader and raydl's do not); each state then continues its saver's run, and the
    states' layouts are compared without their values. `next_from_state=False`: the epoch after an
    end-of-epoch state is drawn from the global RNG (a random sampler without a generator), which
    the harness restores (END_SEED): raydl gives its own next epoch whichever state it loaded.
    """
    extra = {"timeout": BATCH_TIMEOUT_S} if num_workers > 0 else {}
    td_extra = {"timeout": BATCH_TIMEOUT_S, "multiprocessing_context": _mp_context()} if num_workers > 0 else {}

    def make_td() -> StatefulDataLoader:
        return StatefulDataLoader(make_dataset(), num_workers=num_workers, **td_extra, **make_kwargs())

    def make_rd() -> raydl.DataLoader:
        return raydl.DataLoader(make_dataset(), num_workers=num_workers, **extra, **make_kwargs())

    rd_batches, rd_states, rd_loader, rd_next = _pass(make_rd, epoch, ks)
    rd_loader.shutdown()
    if cross:
        td_batches, td_states, _, td_next = _pass(make_td, epoch, ks)
        if same_uninterrupted:
            _same(td_batches, rd_batches, "uninterrupted raydl vs torchdata")
    for k in sorted(rd_states, key=str):
        rd_state = rd_states[k]
        if cross and _json_ok(td_states[k]):
            assert _json_ok(rd_state), f"raydl's state after {k} batches is not JSON though torchdata's is"
        if cross:
            # torchdata's end-of-epoch state is its snapshot at the last batch: streams that ended after it are not in it
            values = same_uninterrupted and k != END
            _same_layout(td_states[k], rd_state, values, f"the state after {k} batches")
        rd_state = _roundtrip(rd_state)
        if k == END:
            _check_end(
                make_rd,
                make_td,
                rd_state,
                _roundtrip(td_states[k]) if cross else None,
                rd_next,
                td_next if cross else [],
                next_from_state,
            )
            continue
        _same(rd_batches[k:], _resume(make_rd, rd_state, check_echo=True), f"raydl resumed from raydl's state at {k}")
        if not cross:
            continue
        td_state = _roundtrip(td_states[k])
        td_own = td_batches[k:] if td_resume_exact else _resume(make_td, td_state)
        _same(td_own, _resume(make_rd, td_state), f"raydl resumed from torchdata's state at {k}")
        rd_expected = rd_batches[k:] if td_resume_exact else td_own
        _same(rd_expected, _resume(make_td, rd_state), f"torchdata resumed from raydl's state at {k}")


def _check_end(
    make_rd, make_td, rd_state: dict, td_state: Any, rd_next: list, td_next: list, next_from_state: bool
) -> None:
    """A state taken after StopIteration resumes into the next epoch: raydl's own exactly (the global RNG
    restored, the generators made anew). Across loaders each state goes on into its saver's next epoch when
    the state and the generators decide it (`next_from_state`); when it is drawn from the global RNG, raydl's
    is its own whichever state it loaded, and torchdata's a whole epoch."""
    assert rd_state["_iterator_finished"], "a state taken after StopIteration must say the iterator finished"
    _same(rd_next, _resume(make_rd, rd_state, finished=True), "raydl resumed from raydl's end-of-epoch state")
    if td_state is None:
        return
    from_td = _resume(make_rd, td_state, finished=True)
    from_rd = _resume(make_td, rd_state, finished=True)
    if next_from_state:
        _same(td_next, from_td, "raydl resumed from torchdata's end-of-epoch state")
        _same(rd_next, from_rd, "torchdata resumed from raydl's end-of-epoch state")
    else:
        _same(rd_next, from_td, "raydl resumed from torchdata's end-of-epoch state (its next epoch is its own)")
    assert len(from_td) == len(rd_next) and len(from_rd) == len(td_next), (
        f"after an end-of-epoch state a whole epoch comes next: {len(from_td)}/{len(rd_next)} (raydl), "
        f"{len(from_rd)}/{len(td_next)} (torchdata)"
    )


def check_epoch_end(
    make_dataset: Callable[[], Any], make_kwargs: Callable[[], dict], *, num_workers: int = 2, seed: int = 7
) -> None:
    """States at the end of an epoch, with the job's generator made again: the next epoch is the saver's.

    One `torch.Generator` object is the loaders' `generator`, re-seeded to `seed` before each loader
    is built (what a restarted job does: the generator is not in torch's RNG state). Each loader runs
    epoch 0 and takes a state after its last batch and one after StopIteration, then runs epoch 1;
    every state, loaded into a new StatefulDataLoader and a new raydl DataLoader, must give the
    saver's epoch 1 (after the rest of epoch 0, which is empty). The two loaders' uninterrupted runs
    are the same here unless `shuffle=True` (torchdata's own sampler draws other permutations).
    """
    g = torch.Generator()
    extra = {"timeout": BATCH_TIMEOUT_S} if num_workers > 0 else {}
    td_extra = {"timeout": BATCH_TIMEOUT_S, "multiprocessing_context": _mp_context()} if num_workers > 0 else {}

    def make(cls: type) -> Any:
        g.manual_seed(seed)  # the same generator object, re-seeded for each new loader
        kwargs = {**(td_extra if cls is StatefulDataLoader else extra), **make_kwargs()}
        return cls(make_dataset(), num_workers=num_workers, generator=g, **kwargs)

    def done(loader: Any) -> None:
        if isinstance(loader, raydl.DataLoader):
            loader.shutdown()

    saved = {}
    for cls in (StatefulDataLoader, raydl.DataLoader):
        loader = make(cls)
        last = None
        for _ in loader:
            last = loader.state_dict()
        end = loader.state_dict()
        saved[cls.__name__] = (_roundtrip(last), _roundtrip(end), list(loader))
        done(loader)
    for saver, (last, end, expected) in saved.items():
        assert not last["_iterator_finished"] and end["_iterator_finished"], saver
        for cls in (StatefulDataLoader, raydl.DataLoader):
            for when, state in (("after its last batch", last), ("after StopIteration", end)):
                where = f"{cls.__name__} resumed from {saver}'s state {when}"
                loader = make(cls)
                loader.load_state_dict(state)
                if not state["_iterator_finished"]:
                    assert list(loader) == [], f"{where}: the epoch had no batch left"
                _same(expected, list(loader), f"{where}, next epoch")
                done(loader)
