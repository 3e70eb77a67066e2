"""A cold start (NOTE [ raydl cold start ]): a new process's epoch equals torch's, whichever batches the driver made."""

from __future__ import annotations

import pytest
import torch

import raydl
from raydl.driver.coldstart.iter import ColdStartIter
from raydl.driver.iter import _RayLoaderIter
from tests import _datasets as D
from tests._session import read_facts, run_python

# A fresh driver: torch's DataLoader first (its forked workers are the reference, and Ray is not
# up in it yet), then raydl's on a cold start, joining the suite's Ray (NOTE [ tests joined
# cold starts ] in tests/_session.py; the race below starts a local Ray of its own). The dataset draws from torch, random and NumPy in
# __getitem__ and reports its worker info; worker_init_fn draws too and writes into the worker's
# copy of the dataset (the driver's own copy must keep offset -1).
_SCRIPT = r"""
import json, random
import numpy as np, torch
import raydl
import raydl.driver.coldstart.iter as coldstart
from torch.utils.data import Dataset

coldstart._MAX_DRIVER_BATCHES = {max_in_driver}


class Augmented(Dataset):
    offset = -1

    def __len__(self):
        return 40

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([float(i), float(info.id), float(info.seed % 1000003), torch.rand(()).item(),
                             random.random(), float(np.random.rand()), float(self.offset)], dtype=torch.float64)


def init_fn(worker_id):
    info = torch.utils.data.get_worker_info()
    info.dataset.offset = worker_id * 100 + random.randint(0, 9)
    torch.rand(2)
    np.random.rand()


def run(DataLoader, **kwargs):
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    dataset = Augmented()
    generator = torch.Generator().manual_seed(11) if {generator} else None
    loader = DataLoader(dataset, batch_size=3, shuffle=True, num_workers=2, worker_init_fn=init_fn,
                        generator=generator, persistent_workers={persistent}, **kwargs)
    batches, made, kinds = [], [], []
    for _ in range({epochs}):
        it = iter(loader)
        batches.append([b.tolist() for b in it])
        made.append(getattr(it, "batches_in_driver", None))
        kinds.append(type(it).__name__)
    after = [torch.rand(()).item(), random.random(), float(np.random.rand()), dataset.offset]
    return batches, made, kinds, after


expected = run(torch.utils.data.DataLoader)
got = run(raydl.DataLoader, {raydl_kwargs})
first_diff = next(([e, b] for e in range(len(got[0])) for b in range(len(got[0][e]))
                   if b >= len(expected[0][e]) or got[0][e][b] != expected[0][e][b]), None)
print("FACTS " + json.dumps({{"same": got[0] == expected[0], "first_diff": first_diff, "made": got[1],
                             "kinds": got[2], "after": [got[3], expected[3]], "offset": got[3][3]}}))
"""


def _cold_epochs(joined_ray, max_in_driver, generator, persistent=False, epochs=2, raydl_kwargs="") -> dict:
    """The script's facts, its driver joining the suite's Ray (NOTE [ tests joined cold starts ])."""
    code = _SCRIPT.format(
        max_in_driver=max_in_driver,
        generator=generator,
        persistent=persistent,
        epochs=epochs,
        raydl_kwargs=raydl_kwargs,
    )
    facts = read_facts(run_python(code, timeout_s=300, env_extra=joined_ray))
    assert facts["same"], f"raydl's batches differ from torch's at [epoch, batch] {facts['first_diff']}: {facts}"
    assert facts["offset"] == -1, f"worker_init_fn wrote into the driver's dataset: {facts}"
    # The batches made here leave the script's torch and NumPy streams where torch's loader leaves them. Python's
    # `random` is not compared: Ray's client code draws from it in this process (ids, retry jitter), as without a
    # cold start (Ray's start itself draws in a generator of its own, NOTE [ raydl early start ]).
    (torch_after, _, numpy_after, _), (torch_ref, _, numpy_ref, _) = facts["after"]
    assert (torch_after, numpy_after) == (torch_ref, numpy_ref), f"the driver's generators moved: {facts}"
    return facts


@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "generator"])
def test_epoch_equals_torch_with_some_batches_made_in_the_driver(joined_ray, generator):
    """Batches made in the driver, then by the actors from the handed-over streams: torch's, batch for batch."""
    facts = _cold_epochs(joined_ray, max_in_driver=3, generator=generator)
    assert facts["kinds"] == ["ColdStartIter", "_RayLoaderIter"], facts
    # the workers took over mid-epoch: Ray is up seconds after the first batch (more than 3 batches only when the
    # workers were not running within ray_startup_timeout_s: a very busy machine)
    assert 1 <= facts["made"][0] < 14, facts


@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "generator"])
def test_epoch_equals_torch_with_no_batch_made_in_the_driver(joined_ray, generator):
    """The workers take over before the first batch (the driver only drew the seeds): torch's batches."""
    facts = _cold_epochs(joined_ray, max_in_driver=0, generator=generator)
    assert facts["made"][0] == 0, facts


def test_persistent_workers_continue_the_driver_streams_across_epochs(joined_ray):
    """An epoch made wholly in the driver (handed over at its end): the persistent workers' streams go on from there."""
    facts = _cold_epochs(joined_ray, max_in_driver=16, generator=True, persistent=True, epochs=3)  # 14 batches an epoch
    assert facts["kinds"] == ["ColdStartIter"] * 3, facts
    assert facts["made"][0] == 14 and facts["made"][-1] == 14, facts  # not one batch of epochs 2 and 3 in the driver


def test_in_process_makers_still_give_torchs_epoch(joined_ray):
    """ray_cold_start="in_process" (opt-in): the first batches made in the trainer's process, torch's batches."""
    facts = _cold_epochs(joined_ray, max_in_driver=3, generator=True, raydl_kwargs="ray_cold_start='in_process'")
    assert facts["kinds"] == ["ColdStartIter", "_RayLoaderIter"] and facts["made"][0] == 3, facts


def test_cold_start_off_makes_every_batch_in_a_worker(joined_ray):
    """ray_cold_start=False: the Ray iterator from the first batch on, with torch's batches."""
    facts = _cold_epochs(joined_ray, max_in_driver=None, generator=True, epochs=1, raydl_kwargs="ray_cold_start=False")
    assert facts["kinds"] == ["_RayLoaderIter"] and facts["made"] == [None], facts


def test_cold_start_is_on_by_default_and_the_environment_turns_it_off(monkeypatch):
    """ray_cold_start defaults to True; RAYDL_COLD_START=0 makes the default False (=in_process: the in-process
    makers); an explicit argument wins."""
    # the library's own default (pytest's process turns it off for the suite's in-process tests: conftest.py)
    monkeypatch.setitem(raydl.DataLoader.__init__.__kwdefaults__, "ray_cold_start", None)
    monkeypatch.delenv("RAYDL_COLD_START", raising=False)
    assert raydl.DataLoader(D.RangeDataset(4), num_workers=2).ray_cold_start is True
    monkeypatch.setenv("RAYDL_COLD_START", "0")
    assert raydl.DataLoader(D.RangeDataset(4), num_workers=2).ray_cold_start is False
    assert raydl.DataLoader(D.RangeDataset(4), num_workers=2, ray_cold_start=True).ray_cold_start is True
    monkeypatch.setenv("RAYDL_COLD_START", "in_process")
    assert raydl.DataLoader(D.RangeDataset(4), num_workers=2).ray_cold_start == "in_process"


# A fresh driver whose own Ray call comes while raydl's background start is inside `ray.init` (held there 1.5 s, in
# raydl's thread only): Ray initializes itself on first use, so without raydl's init under Ray's auto-init lock the
# two inits overlapped and the script's failed with "ray.init twice" when raydl's connected first (Lightning DDP
# ranks reading their Ray context before their first epoch ended, 1 run in 4; here the script's connect is held
# until raydl's is done, so that order is certain). The call waits for raydl's Ray and uses it; the epoch is torch's.
_RACE_SCRIPT = r"""
import json, threading, time
import torch
import ray, ray._private.worker as ray_worker
import raydl
from torch.utils.data import Dataset

inside = threading.Event()
real_connect = ray_worker.connect


def held_connect(*args, **kwargs):
    if threading.current_thread() is not threading.main_thread():  # raydl's start
        inside.set()
        time.sleep(1.5)  # the script's own call comes meanwhile
    else:  # the script's own init, had it begun one: it connects after raydl's, the order that failed
        deadline = time.monotonic() + 60
        while not ray_worker.global_worker.connected and time.monotonic() < deadline:
            time.sleep(0.05)
    return real_connect(*args, **kwargs)


ray_worker.connect = held_connect


class Squares(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([i * i, torch.randint(0, 1000, ()).item()])


def run(DataLoader, probe):
    torch.manual_seed(3)
    batches, context = [], None
    for b in DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2):
        batches.append(b.tolist())
        if probe and len(batches) == 2:  # Ray's start begins as the second batch is asked for (NOTE [ raydl cold start ])
            assert inside.wait(60), "raydl's background start never reached ray.init"
            context = ray.get_runtime_context().gcs_address  # Ray auto-initializes here: raydl's start is under way
    return batches, context


expected, _ = run(torch.utils.data.DataLoader, probe=False)
got, context = run(raydl.DataLoader, probe=True)
print("FACTS " + json.dumps({"same": got == expected, "context": context,
                            "loader_gcs": ray.get_runtime_context().gcs_address}))
"""


def test_scripts_own_ray_call_during_the_background_start_waits_for_it():
    """The script's `ray.get_runtime_context()` while raydl's cold start is inside ray.init: one Ray, torch's batches."""
    facts = read_facts(run_python(_RACE_SCRIPT, timeout_s=300))
    assert facts["same"], facts
    assert facts["context"] is not None and facts["context"] == facts["loader_gcs"], facts


def test_ray_cold_start_must_be_a_bool():
    """A non-bool ray_cold_start is refused at construction."""
    with pytest.raises(TypeError, match="ray_cold_start should be True .*, False .* or .in_process."):
        raydl.DataLoader(D.RangeDataset(4), num_workers=2, ray_cold_start="yes")


def test_no_cold_start_once_ray_runs(ray_session):
    """With Ray up in this process, iter() is the Ray iterator as before."""
    loader = raydl.DataLoader(
        D.RangeDataset(8), batch_size=2, num_workers=2, ray_remote_args={"num_cpus": 0}, ray_cold_start=True
    )
    it = iter(loader)
    assert type(it) is _RayLoaderIter and not isinstance(it, ColdStartIter)
    assert [b.tolist() for b in it] == [
        b.tolist() for b in torch.utils.data.DataLoader(D.RangeDataset(8), batch_size=2)
    ]
