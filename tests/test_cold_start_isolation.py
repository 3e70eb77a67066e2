"""A cold start with the defaults runs no dataset code in the trainer's process (NOTE [ raydl cold start ]).

Each test is a fresh driver (no Ray in it yet, the library's defaults; it joins the suite's Ray in the
background: NOTE [ tests joined cold starts ] in tests/_session.py): the first batches come from
start-up processes forked from it, so a dataset that ends its process is a worker's death, torch's
`timeout` holds, the stats count the wait, and a shared Arrow table stays shared.
"""

from __future__ import annotations

import pytest

from tests._session import read_facts, run_python

# A dataset whose process exits (os._exit, as a native crash or an OOM kill) the first time it reaches `bad`;
# each sample says which process made it. torch's loader over the same dataset (no crash: its marker is set)
# is the reference for the batches.
_CRASH_SCRIPT = r"""
import json, os, random, tempfile
import numpy as np, torch
import raydl
import raydl.driver.coldstart.iter as coldstart
from torch.utils.data import Dataset

MARKER = os.path.join(tempfile.mkdtemp(), "crashed")


class ExitOnce(Dataset):
    def __len__(self):
        return 36

    def __getitem__(self, i):
        if i == {bad} and not os.path.exists(MARKER):
            open(MARKER, "w").close()
            os._exit(1)
        return torch.tensor([float(i), torch.rand(()).item(), random.random(), float(np.random.rand()), os.getpid()],
                            dtype=torch.float64)


def run(DataLoader):
    torch.manual_seed(7)
    it = iter(DataLoader(ExitOnce(), batch_size=3, shuffle=True, num_workers=2))
    return [b for b in it], it


open(MARKER, "w").close()
expected, _ = run(torch.utils.data.DataLoader)
os.remove(MARKER)
got, it = run(raydl.DataLoader)
pids = sorted({{int(p) for b in got for p in b[:, 4].tolist()}})
same = len(got) == len(expected) and all(torch.equal(a[:, :4], b[:, :4]) for a, b in zip(got, expected))
print("FACTS " + json.dumps({{"same": same, "crashed": os.path.exists(MARKER), "pids": pids, "me": os.getpid(),
                             "made_by_makers": getattr(it, "batches_in_driver", None), "kind": type(it).__name__}}))
"""


@pytest.mark.parametrize("bad", [0, 10], ids=["first-batch", "mid-epoch"])
def test_a_dataset_that_ends_its_process_is_a_workers_death(joined_ray, bad):
    """os._exit in __getitem__ while Ray starts (in the first batch, and a few batches on): the trainer lives on,
    the process is replaced, and the epoch is torch's, every batch once, in order."""
    facts = read_facts(run_python(_CRASH_SCRIPT.format(bad=bad), timeout_s=300, env_extra=joined_ray))
    assert facts["crashed"], facts  # the dataset did end a process
    assert facts["same"], f"the batches differ from torch's: {facts}"
    assert facts["me"] not in facts["pids"], f"dataset code ran in the trainer's process: {facts}"
    assert facts["kind"] == "ColdStartIter", facts
    if bad == 0:  # batch 0 is made before Ray's start even begins: a start-up process made it, and died
        assert facts["made_by_makers"] >= 1, facts


_TIMEOUT_SCRIPT = r"""
import json, time
import torch
import raydl
from torch.utils.data import Dataset


class Sleepy(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        time.sleep(3)
        return i


loader = raydl.DataLoader(Sleepy(), batch_size=2, num_workers=2, timeout=1)
t0 = time.monotonic()
error = None
try:
    next(iter(loader))
except RuntimeError as e:
    error = str(e)
print("FACTS " + json.dumps({"error": error, "after_s": time.monotonic() - t0}))
"""


def test_timeout_holds_for_the_first_batch(joined_ray):
    """torch's test_timeout with the defaults: items of 3 s, timeout=1: torch's error at the first next()."""
    facts = read_facts(run_python(_TIMEOUT_SCRIPT, timeout_s=300, env_extra=joined_ray))
    assert facts["error"] is not None and facts["error"].startswith("DataLoader timed out after 1 seconds"), facts
    assert "start-up process" in facts["error"], facts  # it names who was making the batch
    assert facts["after_s"] < 6, facts  # raised, not the batch returned (2 items of 3 s)


_STATS_SCRIPT = r"""
import json, os, tempfile, time
import torch
import raydl
from torch.utils.data import Dataset


class Spin(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        end = time.thread_time() + 0.01
        while time.thread_time() < end:
            pass
        return torch.tensor([i])


loader = raydl.DataLoader(Spin(), batch_size=4, num_workers=2)
for batch in loader:  # data-bound: no step
    pass
stats = loader.stats()
path = os.path.join(tempfile.mkdtemp(), "epoch.json")
stats.timeline(path)
with open(path) as f:
    events = json.load(f)["traceEvents"]
tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
busy = sorted({tracks[e["tid"]] for e in events if e["ph"] == "X" and e.get("cat") in ("worker", "start-up")})
print("FACTS " + json.dumps({"share": stats.wait_share, "batches": stats.batches, "busy_tracks": busy}))
"""


def test_stats_count_the_wait_for_start_up_batches(joined_ray):
    """A data-bound 8-batch epoch with the defaults: the loop's wait is counted, one timeline track per process
    that made batches."""
    facts = read_facts(run_python(_STATS_SCRIPT, timeout_s=300, env_extra=joined_ray))
    assert facts["batches"] == 8, facts
    assert facts["share"] >= 0.5, facts
    tracks = facts["busy_tracks"]
    assert len(tracks) >= 2 and all("start-up process" in t or t.startswith("worker") for t in tracks), facts
    made_by = {t.split("worker ")[1].split(" ")[0] for t in tracks}
    assert made_by == {"0", "1"}, facts  # both workers' batches, whoever made them


_ARROW_SCRIPT = r"""
import json, os
import numpy as np, psutil, pyarrow as pa, torch
import raydl
from torch.utils.data import Dataset


class Probe(Dataset):
    def __init__(self, data, n):
        self.data, self.n = data, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        table = self.data.table
        total = int(pa.compute.sum(table.column("x")).as_py())  # every page of the table read
        return {"uss": psutil.Process().memory_full_info().uss, "pid": os.getpid(), "sum": total}


def reports(data, **kwargs):
    loader = raydl.DataLoader(Probe(data, 4), batch_size=None, num_workers=2, collate_fn=lambda x: x, **kwargs)
    return [list(loader), list(loader)] if kwargs.get("persistent_workers") else [list(loader)]


rows = 5_000_000  # 40 MB
big = reports(raydl.ArrowDataset(pa.table({"x": np.arange(rows, dtype=np.int64)})), persistent_workers=True)
idle = reports(raydl.ArrowDataset(pa.table({"x": np.arange(10, dtype=np.int64)})), ray_reuse_workers=False)[0]
print("FACTS " + json.dumps({"startup": big[0], "workers": big[1], "idle": idle, "nbytes": rows * 8,
                             "me": os.getpid(), "sum": rows * (rows - 1) // 2}))
"""


def test_arrow_table_stays_shared_with_the_defaults(joined_ray):
    """An ArrowDataset over a 40 MB table: the start-up processes share the trainer's copy (fork), and the workers
    that take over map the object store's: none grows by the table's size."""
    facts = read_facts(run_python(_ARROW_SCRIPT, timeout_s=300, env_extra=joined_ray))
    idle_uss = max(r["uss"] for r in facts["idle"])
    for phase in ("startup", "workers"):
        for r in facts[phase]:
            assert r["sum"] == facts["sum"] and r["pid"] != facts["me"], facts
            assert r["uss"] - idle_uss < facts["nbytes"] / 4, (phase, r, idle_uss)


_POISON_SCRIPT = r"""
import json, os
import torch
import raydl
from torch.utils.data import Dataset


class Poison(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 5:
            os._exit(3)
        return i


error = None
try:
    list(raydl.DataLoader(Poison(), batch_size=2, num_workers=2, ray_max_worker_restarts=1))
except raydl.WorkerDiedError as e:
    error = str(e)
print("FACTS " + json.dumps({"error": error}))
"""


def test_a_batch_that_kills_every_start_up_process_ends_in_a_clear_error(joined_ray):
    """A sample that ends every process it reaches: replaced ray_max_worker_restarts times, then WorkerDiedError
    naming the start-up process, the batch and its indices (the trainer lives to report it)."""
    facts = read_facts(run_python(_POISON_SCRIPT, timeout_s=300, env_extra=joined_ray))
    error = facts["error"]
    assert error is not None and "start-up process" in error and "exit code 3" in error, facts
    assert "while making batch 2 (indices [4, 5])" in error and "after 1 restart(s)" in error, facts
