"""A dataset holding a multiprocessing synchronisation object: the error names the attribute, says why, gives the fix."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from torch.utils.data import Dataset

import raydl
from raydl.data.mp_objects import dumps_checked, mp_kind
from tests import _datasets as D

TIMEOUT_S = 60


class HoldsState(Dataset):
    """A map-style dataset with one attribute, `state`, holding whatever the test gives it."""

    def __init__(self, state) -> None:
        self.state = state

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return torch.tensor(i)


@pytest.fixture(scope="module")
def manager():
    """One multiprocessing Manager (a server process) for every proxy case."""
    m = mp.Manager()
    yield m
    m.shutdown()


KINDS = {
    "Value": lambda m: mp.Value("i", 0),
    "Array": lambda m: mp.Array("i", 3),
    "RawValue": lambda m: mp.RawValue("i", 0),
    "RawArray": lambda m: mp.RawArray("i", 3),
    "Lock": lambda m: mp.Lock(),
    "RLock": lambda m: mp.RLock(),
    "Semaphore": lambda m: mp.Semaphore(2),
    "BoundedSemaphore": lambda m: mp.BoundedSemaphore(2),
    "Event": lambda m: mp.Event(),
    "Condition": lambda m: mp.Condition(),
    "Barrier": lambda m: mp.Barrier(2),
    "Queue": lambda m: mp.Queue(),
    "JoinableQueue": lambda m: mp.JoinableQueue(),
    "SimpleQueue": lambda m: mp.SimpleQueue(),
    "Pipe connection": lambda m: mp.Pipe()[0],
    "Manager proxy (DictProxy)": lambda m: m.dict(),
    "Manager proxy (ValueProxy)": lambda m: m.Value("i", 0),
    "Manager proxy (AcquirerProxy)": lambda m: m.Lock(),
    "Manager": lambda m: m,
    "torch Queue": lambda m: torch.multiprocessing.Queue(),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_multiprocessing_object_in_dataset_is_named_with_the_fix(ray_session, manager, kind):
    """iter() raises a TypeError naming dataset.state, what it is, why Ray workers cannot share it, and the fix."""
    loader = raydl.DataLoader(HoldsState(KINDS[kind](manager)), num_workers=1, timeout=TIMEOUT_S)
    with pytest.raises(TypeError) as info:
        iter(loader)
    msg = str(info.value)
    expected_kind = "multiprocessing " + ("Queue" if kind == "torch Queue" else kind)
    assert f"raydl cannot send dataset to its Ray workers: dataset.state is a {expected_kind}." in msg
    assert "processes started by Ray, possibly on other machines" in msg
    assert "Fix: keep shared state in a Ray actor" in msg and "worker_init_fn" in msg


def test_nested_object_in_worker_init_fn_and_shared_memory_mode(ray_session, manager):
    """Found inside a closure of worker_init_fn, and with ray_shared_dataset_memory=True (which pickles otherwise)."""
    lock = mp.Lock()

    def init(worker_id):
        with lock:
            pass

    loader = raydl.DataLoader(D.RangeDataset(4), num_workers=1, worker_init_fn=init, timeout=TIMEOUT_S)
    with pytest.raises(
        TypeError, match=r"send worker_init_fn to its Ray workers: worker_init_fn holds a multiprocessing Lock"
    ):
        iter(loader)
    shared = raydl.DataLoader(
        HoldsState({"counts": manager.dict()}), num_workers=1, ray_shared_dataset_memory=True, timeout=TIMEOUT_S
    )
    with pytest.raises(TypeError, match=r"dataset\.state\['counts'\] is a multiprocessing Manager proxy"):
        iter(shared)


def test_ordinary_objects_are_not_multiprocessing_objects():
    """Plain values, ctypes values, threading locks and tensors are not flagged; the checked pickle equals cloudpickle's."""
    import ctypes
    import threading

    from ray import cloudpickle

    for obj in (1, "x", ctypes.c_int(3), torch.zeros(2), threading.Event(), D.RangeDataset(3)):
        assert mp_kind(obj) is None
    data = {"a": [1, 2, 3], "t": torch.arange(4)}
    assert cloudpickle.loads(dumps_checked(data))["a"] == [1, 2, 3]


class CountingDataset(HoldsState):
    """Counts its reads in a Ray actor, the fix the error suggests for a shared multiprocessing counter."""

    def __getitem__(self, i: int):
        import ray

        ray.get(self.state.add.remote())
        return torch.tensor(i)


def test_a_ray_actor_is_the_shared_counter(ray_session):
    """The suggested fix works: every worker increments one Ray actor, which sees every sample once.

    On the suite's Ray: the counter actor is killed at the end, so it never outlives the test.
    """
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Counter:
        def __init__(self):
            self.n = 0

        def add(self):
            self.n += 1
            return self.n

    counter = Counter.remote()
    try:
        loader = raydl.DataLoader(CountingDataset(counter), batch_size=2, num_workers=2, timeout=TIMEOUT_S)
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
        assert ray.get(counter.add.remote(), timeout=TIMEOUT_S) == 5
    finally:
        ray.kill(counter, no_restart=True)
