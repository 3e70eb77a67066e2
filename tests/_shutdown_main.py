"""Run by tests/test_shutdown.py in a fresh interpreter: a script that uses raydl, then calls `ray.shutdown()`.

Modes (argv[1]):
  exit   join the cluster at argv[2] (a `ray start` head), run loaders with persistent_workers=True
         (one to its end, one left after its first batch, one of a `ray_job`), then `ray.shutdown()`.
         Print `SHUTDOWN`, wait until the file argv[3] exists (the test stopped the head by then),
         give raydl's background threads 3 s, drop the loaders (their finalizers run), and report:
         raydl's threads still alive, whether Ray is initialized, and any gcs_server / raylet this
         process started (a Ray started behind the user's back). Then `END` and exit.
  again  a persistent loader's epoch (raydl starts Ray), `ray.shutdown()`, the same loader's
         next epoch: raydl starts Ray again (and says so) and new workers, and the batches are
         torch's for a loader that starts new workers every epoch.
Prints `FACTS {json}`.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback only

import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

import raydl  # noqa: E402


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i):
        return torch.tensor([i, i * i])


def _ray_daemons_started_here() -> list:
    """gcs_server / raylet processes among this process's descendants."""
    names = []
    for child in psutil.Process().children(recursive=True):
        try:
            names.append(child.name())
        except psutil.Error:
            pass
    return sorted(n for n in names if n in ("gcs_server", "raylet"))


def _loader(**kw) -> raydl.DataLoader:
    g = torch.Generator().manual_seed(3)
    return raydl.DataLoader(Squares(), batch_size=4, shuffle=True, generator=g, num_workers=2, timeout=60, **kw)


def exit_mode(address: str, signal_file: str) -> dict:
    ray.init(address=address)
    whole = _loader(persistent_workers=True)
    n = sum(len(b) for b in whole)
    left = _loader(persistent_workers=True)
    next(iter(left))  # prefetched tasks stay behind on its workers
    os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
    job = _loader(persistent_workers=True, ray_job="shutdown-job")
    m = sum(len(b) for b in job)
    ray.shutdown()
    print("SHUTDOWN", flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(signal_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(3.0)  # the warm pool's reaper wakes every second, the lease renewal every 2 s
    del whole, left, job
    gc.collect()
    time.sleep(1.0)
    return {
        "samples": [n, m],
        "head_stopped": os.path.exists(signal_file),
        "raydl_threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("raydl")),
        "ray_initialized": ray.is_initialized(),
        "ray_daemons": _ray_daemons_started_here(),
    }


def again_mode() -> dict:
    records = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("raydl").addHandler(Keep())
    # Workers started anew draw a new base seed from the generator, as torch's do whenever it starts workers: the
    # reference is torch's loader without persistent workers (new workers every epoch).
    g = torch.Generator().manual_seed(3)
    reference_loader = torch.utils.data.DataLoader(Squares(), batch_size=4, shuffle=True, generator=g, num_workers=2)
    reference = [b.tolist() for epoch in range(2) for b in reference_loader]
    loader = _loader(persistent_workers=True)
    got = [b.tolist() for b in loader]  # raydl starts Ray: first use, nothing to say
    first_session = ray.get_runtime_context().gcs_address
    ray.shutdown()  # the user shuts Ray down between two epochs of a persistent loader
    got += [b.tolist() for b in loader]
    loader.shutdown()
    return {
        "equal": got == reference,
        "batches": len(got),
        "said": [m for m in records if "Ray was shut down" in m],
        "new_session": ray.get_runtime_context().gcs_address != first_session,
    }


if __name__ == "__main__":
    facts = exit_mode(sys.argv[2], sys.argv[3]) if sys.argv[1] == "exit" else again_mode()
    print("FACTS " + json.dumps(facts), flush=True)
    print("END", time.time(), flush=True)
