"""States taken by value (NOTE [ raydl state by value ]) and each worker's state right after `iter()` (NOTE [ raydl
start hold ]): the two details torchdata's own test_state_dict.py checks where look-alike tests did not.

  * a dataset, sampler or worker_init_fn whose `state_dict()` returns its live objects: a state belongs to the
    batch it was taken at, whatever batches come after it before it is sent or read;
  * `iter(loader)` dropped at once, then `loader.state_dict()`: each worker's start snapshot, as StatefulDataLoader
    (which keeps its last iterator) reports it, also after a load and in a fresh process where Ray and the workers
    are still starting.
"""

from __future__ import annotations

import pytest
import torch

import raydl
from tests import _resume_datasets as RD
from tests._parity import BATCH_TIMEOUT_S
from tests._resume_parity import _roundtrip, _same
from tests._session import read_facts, run_python

pytestmark = pytest.mark.usefixtures("ray_session")


def _loader(dataset, num_workers, **kwargs):
    return raydl.DataLoader(dataset, num_workers=num_workers, timeout=BATCH_TIMEOUT_S, **kwargs)


def _workers(state: dict) -> list:
    return list(state["_snapshot"]["_worker_snapshots"].values())


# ------------------------------------------------------------------ states returned by reference


@pytest.mark.parametrize("num_workers, persistent", [(4, True), (2, False)])
def test_live_iterable_state_resumes_exactly_also_after_a_load(num_workers, persistent):
    """The issue's loop: A after 15 batches, then a load of A and B before every worker yielded since it. A new
    loader loading B gives exactly the rest; with states recorded by reference it differed at item 14."""
    kw = dict(batch_size=1, collate_fn=RD.identity_collate, persistent_workers=persistent)
    dl = _loader(RD.LiveFlips(), num_workers, **kw)
    it = iter(dl)
    for _ in range(15):
        next(it)
    a = dl.state_dict()
    next(it), next(it)
    rest = list(it)
    assert len(rest) == num_workers * 60 - 17, len(rest)
    dl.load_state_dict(a)
    it = iter(dl)
    next(it), next(it)
    b = _roundtrip(dl.state_dict())
    dl.shutdown()
    dl2 = _loader(RD.LiveFlips(), num_workers, **kw)
    dl2.load_state_dict(b)
    assert list(dl2) == rest
    dl2.shutdown()


@pytest.mark.parametrize("per_call", ["auto", 3], ids=["default", "3-per-call"])
def test_live_map_state_and_worker_init_fn_state_resume_exactly(per_call):
    """shuffle=True, no generator, a map-style dataset whose live box worker_init_fn sets: the state after 3
    batches resumes the rest, each item's call count and offset included (by default each call's reply is sent at
    once; with several batches per call the first ones' states wait for the last)."""
    kw = dict(batch_size=2, shuffle=True, worker_init_fn=RD.live_counter_init, ray_batches_per_call=per_call)
    torch.manual_seed(7)
    dl = _loader(RD.LiveCounter(24), 2, **kw)
    it = iter(dl)
    for _ in range(3):
        next(it)
    state = dl.state_dict()
    rest = list(it)
    boxes = [w["dataset_state"]["box"] for w in _workers(state)]
    assert [b["calls"] for b in boxes] == [4, 2] and [b["offset"] for b in boxes] == [0, 100], boxes
    dl2 = _loader(RD.LiveCounter(24), 2, **kw)
    dl2.load_state_dict(_roundtrip(state))
    _same(rest, list(dl2), "resumed from a live map-style state")


def test_live_sampler_state_resumes_exactly():
    """A sampler whose `state_dict()` returns its live position, under torch's BatchSampler: the driver draws
    ahead of the batches handed out, and the state records the position at the last one handed out."""
    kw = dict(batch_size=2, sampler=RD.LiveSampler(20), collate_fn=RD.identity_collate)
    dl = _loader(RD.CountingDataset(20), 2, **kw)
    it = iter(dl)
    for _ in range(3):
        next(it)
    state = _roundtrip(dl.state_dict())
    rest = [[x.tolist() for x in b] for b in it]
    kw["sampler"] = RD.LiveSampler(20)
    dl2 = _loader(RD.CountingDataset(20), 2, **kw)
    dl2.load_state_dict(state)
    assert [[x.tolist() for x in b] for b in dl2] == rest


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_shuffle_state_is_the_callers_own(num_workers):
    """`shuffle=True`'s sampler records are kept per draw without a copy (samplers.py `fresh_state`): a state handed
    out must still be the caller's. Writing into its generator state changes neither a later state nor the batches a
    later state resumes."""
    torch.manual_seed(11)
    dl = _loader(range(96), num_workers, batch_size=4, shuffle=True)
    it = iter(dl)
    for _ in range(3):
        next(it)
    a = dl.state_dict()

    def generator(state):  # torchdata's layouts: the main process's keys at the top without workers
        main = state["_snapshot"]["_main_snapshot"] if num_workers else state
        return main["_sampler_iter_state"]["sampler_iter_state"]["generator"]

    want = generator(a).clone()
    generator(a).zero_()
    b = dl.state_dict()
    assert torch.equal(generator(b), want)
    rest = list(it)
    dl.shutdown()
    dl2 = _loader(range(96), num_workers, batch_size=4, shuffle=True)
    dl2.load_state_dict(b)
    got = list(dl2)
    dl2.shutdown()
    assert len(got) == len(rest) == 21 and all(torch.equal(x, y) for x, y in zip(got, rest))


def test_in_process_state_is_not_changed_by_later_batches():
    """num_workers=0: a state held in memory (not saved) stays as it was taken, and loading it resumes the rest."""
    dl = raydl.DataLoader(RD.LiveFlips(20), batch_size=2)
    it = iter(dl)
    for _ in range(3):
        next(it)
    state = dl.state_dict()
    taken = _roundtrip(state)
    rest = list(it)
    assert state == taken, "the batches after the state changed it"
    dl.load_state_dict(state)
    _same(rest, list(dl), "num_workers=0 resumed from a state held in memory")


# ------------------------------------------------------------------ the state right after iter()


@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
@pytest.mark.parametrize("num_workers", [1, 3])
@pytest.mark.parametrize("kind", ["iterable", "map"])
def test_state_right_after_a_dropped_iter(kind, num_workers, persistent):
    """`iter(dl)` not kept, then `state_dict()`: each worker's start snapshot (its `__iter__` called once; a
    map-style dataset as worker_init_fn left it), not None; a new loader loading it reports the same after its own
    dropped `iter()`: `__iter__` called once after the load, not twice. As torchdata's TestSingleIterCalled."""
    if kind == "iterable":
        make, kw, key = (lambda: RD.IterCalls(12)), {}, "iter_calls"
    else:
        make, kw, key = (lambda: RD.InitCalls(12)), {"worker_init_fn": RD.count_init}, "inits"

    def counts(state):
        out = []
        for w in _workers(state):
            assert w is not None, f"a worker's snapshot is missing: {state['_snapshot']}"
            out.append((w["dataset_state"] or {}).get(key))
        return out

    dl = _loader(make(), num_workers, persistent_workers=persistent, **kw)
    iter(dl)
    state = _roundtrip(dl.state_dict())
    assert counts(state) == [1] * num_workers
    dl2 = _loader(make(), num_workers, persistent_workers=persistent, **kw)
    dl2.load_state_dict(state)
    iter(dl2)
    assert counts(dl2.state_dict()) == [1] * num_workers
    assert sorted(int(x) for b in dl2 for x in b) == list(range(12)), "the loaded state resumes the whole epoch"
    dl.shutdown()
    dl2.shutdown()


# A fresh driver (Ray not up in it: the workers are still starting when state_dict() is called, and a map-style
# dataset takes the cold start's start-up processes), joining the suite's Ray. StatefulDataLoader runs first, before
# Ray is in the process, with its default fork.
_FRESH = r"""
import json
import raydl
from torchdata.stateful_dataloader import StatefulDataLoader
from tests import _resume_datasets as RD

CASES = {"iterable": (lambda: RD.IterCalls(12), {}, "iter_calls"),
         "map": (lambda: RD.InitCalls(12), {"worker_init_fn": RD.count_init}, "inits")}


def run(cls, kind):
    make, kw, key = CASES[kind]
    counts, state = [], None
    for _ in range(2):
        dl = cls(make(), num_workers=2, **kw)
        if state is not None:
            dl.load_state_dict(state)
        iter(dl)
        state = dl.state_dict()
        counts.append([None if w is None else (w["dataset_state"] or {}).get(key)
                       for w in state["_snapshot"]["_worker_snapshots"].values()])
    return counts


facts = {f"{cls.__name__}/{kind}": run(cls, kind) for cls in (StatefulDataLoader, raydl.DataLoader) for kind in CASES}
print("FACTS " + json.dumps(facts))
"""


def test_state_right_after_iter_in_a_fresh_process_is_torchdatas(joined_ray):
    """torchdata's TestSingleIterCalled as a new user runs it: a fresh process, `iter(dl)` dropped, `state_dict()`
    while the workers are still starting; raydl gave None for every worker there."""
    facts = read_facts(run_python(_FRESH, timeout_s=300, env_extra=joined_ray))
    for kind in ("iterable", "map"):
        assert facts[f"DataLoader/{kind}"] == facts[f"StatefulDataLoader/{kind}"] == [[1, 1], [1, 1]], facts


def test_by_value_copies_plain_states_directly_and_others_through_pickle():
    """A generator's state is copied by `clone()` (no pickle), shares nothing, and keeps its dtype; a state with a
    tensor that needs grad, or a container of another type, keeps going through the round trip whole."""
    from collections import OrderedDict

    from raydl.worker.state import by_value

    g = torch.Generator().manual_seed(3)
    live = {"gen": g.get_state(), "seen": [1, 2], "pair": (0, "a")}
    snap = by_value(live)
    live["gen"][:] = 0
    live["seen"].append(3)
    assert snap["seen"] == [1, 2] and snap["pair"] == (0, "a")
    assert snap["gen"].dtype == torch.uint8 and torch.equal(snap["gen"], torch.Generator().manual_seed(3).get_state())
    w = torch.ones(2, requires_grad=True)
    copied = by_value({"w": w})["w"]
    assert copied.requires_grad and copied.grad_fn is None and copied is not w
    od = by_value(OrderedDict(a=torch.zeros(1)))
    assert type(od) is OrderedDict
