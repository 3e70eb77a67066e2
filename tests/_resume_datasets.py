"""Datasets with their own state, for the resume tests (module level, so workers unpickle them by reference)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class CountingDataset(Dataset):
    """Item i is [i, calls so far in this process]: the batches depend on the dataset's own state."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        return torch.tensor([i, self.calls])

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]


class _StridedIter:
    """Yields [v, noise] for v in range(lo, n, step); its position is its state."""

    def __init__(self, lo: int, n: int, step: int) -> None:
        self.pos, self.n, self.step = lo, n, step

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= self.n:
            raise StopIteration
        v = self.pos
        self.pos += self.step
        return torch.tensor([v, int(torch.randint(0, 1000, ()))])

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class StatefulIterable(IterableDataset):
    """Worker w of n yields w, w+n, ...: an iterator with state_dict(), drawing from torch's global RNG too."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        return _StridedIter(0 if info is None else info.id, self.n, 1 if info is None else info.num_workers)


class NoisyDataset(Dataset):
    """Item i is [i, a draw from torch's global RNG]; the worker process exits (once) on `exit_index`."""

    def __init__(self, n: int, exit_index: int = -1, marker: str = "", delay_s: float = 0.0) -> None:
        self.n, self.exit_index, self.marker, self.delay_s = n, exit_index, marker, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        import os
        import time

        if self.delay_s:
            time.sleep(self.delay_s)
        if i == self.exit_index and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return torch.tensor([i, int(torch.randint(0, 10**6, ()))])


class DelayedDataset(Dataset):
    """Item i is [i]; items in `slow` take 50 ms, so with in_order=False later batches overtake them."""

    def __init__(self, n: int, slow=()) -> None:
        self.n, self.slow = n, set(slow)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        import time

        if i in self.slow:
            time.sleep(0.05)
        return torch.tensor([i])


class NoisyPoints(Dataset):
    """(x + noise from torch's RNG in the worker, label, index): worker-side random augmentation for the trainer tests."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 4, generator=g)
        self.y = (self.x.sum(dim=1) > 2).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(4), self.y[i], i


def ray_train_loader():
    import raydl

    return raydl.DataLoader(
        NoisyPoints(24),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        timeout=60,
        generator=torch.Generator().manual_seed(3),
        ray_remote_args={"num_cpus": 0},
    )


def ray_train_resume_loop(config: dict) -> None:
    """Ray Train loop: train on a raydl loader, report a checkpoint holding the loader's state every step,
    stop after config["stop_after"] steps; started from a checkpoint, load it and go on. Writes what it saw."""
    import json
    import os
    import tempfile

    import ray.train
    from torch import nn

    # Every rank runs the loop (Ray Train's report is collective); rank 0 alone reports checkpoints and writes what it
    # saw, so the fit's checkpoint is one rank's state.
    rank = ray.train.get_context().get_world_rank()
    loader = ray_train_loader()
    model = nn.Linear(4, 2)
    # A restarted run: Ray Train's own restore (get_checkpoint) or a reported checkpoint passed by path.
    ckpt = ray.train.get_checkpoint()
    if ckpt is None and config.get("resume_from"):
        ckpt = ray.train.Checkpoint(config["resume_from"])
    done = 0
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        loader.load_state_dict(state["loader"])
        model.load_state_dict(state["model"])
        done = state["step"]
    seen = []
    for x, y, idx in loader:
        if done == config["stop_after"]:
            break
        nn.functional.cross_entropy(model(x), y).backward()
        done += 1
        seen.append([idx.tolist(), x.tolist()])
        with tempfile.TemporaryDirectory() as d:
            torch.save(
                {"step": done, "model": model.state_dict(), "loader": loader.state_dict()}, os.path.join(d, "state.pt")
            )
            ray.train.report({"step": done}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
    loader.shutdown()
    if rank == 0:
        with open(os.path.join(config["out"], f"seen_{config['tag']}.json"), "w") as f:
            json.dump(seen, f)


class _PassIter:
    """A pass of `PassCountingIterable` in one worker: moves the dataset's own position."""

    def __init__(self, ds: "PassCountingIterable", worker: int, stride: int) -> None:
        self.ds, self.worker, self.stride = ds, worker, stride

    def __iter__(self):
        return self

    def __next__(self):
        v = self.worker + self.ds.pos * self.stride
        if v >= self.ds.n:
            raise StopIteration
        self.ds.pos += 1
        return v


class PassCountingIterable(IterableDataset):
    """Worker w of n yields w, w + n, ... from the dataset's position on; the state is the dataset's own (its iterator
    has none): that position and how many passes (`__iter__` calls) the copy started. A pass after a loaded state goes
    on from its position, any other starts over; the count grows at every `__iter__`, so the state after a load and
    `iter()` is not the loaded one (torchdata reports the former)."""

    def __init__(self, n: int) -> None:
        self.n, self.pos, self.passes, self._loaded = n, 0, 0, False

    def __iter__(self):
        info = get_worker_info()
        self.passes += 1
        if not self._loaded:
            self.pos = 0
        self._loaded = False
        return _PassIter(self, 0 if info is None else info.id, 1 if info is None else info.num_workers)

    def state_dict(self) -> dict:
        return {"pos": self.pos, "passes": self.passes}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.passes, self._loaded = state["pos"], state["passes"], True


class LazyResumeIterable(IterableDataset):
    """Worker w of n yields w, w + n, ... from its `i`-th item on; `__iter__` is a generator that takes a loaded `i`
    in its body, so the state applies at the first item, not at `iter()`."""

    def __init__(self, n: int) -> None:
        self.n, self.i, self._resume_at = n, 0, None

    def __iter__(self):
        info = get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        self.i, self._resume_at = self._resume_at or 0, None
        for v in range(w + self.i * k, self.n, k):
            self.i += 1
            yield v

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = state["i"]


def identity_collate(batch):
    """`collate_fn=lambda x: x`, importable by workers: the samples as the sampler drew them, a list per batch."""
    return batch


# ---------------------------------------------------------------- states reported by reference (NOTE [ raydl state by value ])


class LiveFlips(IterableDataset):
    """Yields bit `step % 4` after flipping it; `state_dict()` returns its live dict, as most datasets do, and
    `load_state_dict()` keeps a copy: a state recorded by reference is changed by the batches after it."""

    def __init__(self, n: int = 60) -> None:
        self.n = n
        self.bits, self.step = {0: 0, 1: 0, 2: 0, 3: 0}, 0

    def __iter__(self):
        while self.step < self.n:
            self.step += 1
            b = self.step % 4
            self.bits[b] = 1 - self.bits[b]
            yield self.bits[b]

    def state_dict(self) -> dict:
        return {"bits": self.bits, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.bits, self.step = dict(state["bits"]), state["step"]


class LiveCounter(Dataset):
    """Item i is [i, calls so far in this copy, the offset worker_init_fn set]; `state_dict()` returns its live
    box and `load_state_dict()` keeps the box it is given (torchdata's PeriodicStateIterableDataset does too)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.box = {"calls": 0, "offset": -1}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.box["calls"] += 1
        return torch.tensor([i, self.box["calls"], self.box["offset"]])

    def state_dict(self) -> dict:
        return {"box": self.box}

    def load_state_dict(self, state: dict) -> None:
        self.box = state["box"]


def live_counter_init(worker_id: int) -> None:
    """worker_init_fn: the worker's copy of LiveCounter starts from an offset of its own, in a new live box."""
    info = get_worker_info()
    info.dataset.box = {"calls": 0, "offset": 100 * worker_id}


class LiveSampler(torch.utils.data.Sampler):
    """Indices 0..n-1 in a fixed shuffle; its position lives in a dict that `state_dict()` returns as it is."""

    def __init__(self, n: int) -> None:
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
        self.pos = {"next": 0}

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        while self.pos["next"] < len(self.order):
            self.pos["next"] += 1
            yield self.order[self.pos["next"] - 1]
        self.pos["next"] = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = dict(state["pos"])


class IterCalls(IterableDataset):
    """Counts its `__iter__` calls, which is its whole state; `load_state_dict()` takes nothing back (a worker that
    called `__iter__` once after a load reports 1, not 2)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.iter_calls = 0

    def __iter__(self):
        self.iter_calls += 1
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(wid, self.n, nw))

    def state_dict(self) -> dict:
        return {"iter_calls": self.iter_calls}

    def load_state_dict(self, state: dict) -> None:
        pass


class InitCalls(Dataset):
    """Map-style: worker_init_fn counts into `inits` (its whole state), which `load_state_dict()` restores."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.inits = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return i

    def state_dict(self) -> dict:
        return {"inits": self.inits}

    def load_state_dict(self, state: dict) -> None:
        self.inits = state["inits"]


def count_init(worker_id: int) -> None:
    get_worker_info().dataset.inits += 1
