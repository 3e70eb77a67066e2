"""`ray_seed="batch"`: each batch seeded from its position in the epoch, not from the worker making it.

NOTE [ raydl batch seeding ]
With torch's seeding (`ray_seed="worker"`, the default; NOTE [ raydl seeding ] in worker/actor.py)
a batch's random draws depend on which worker made it and what that worker made before: change
the pool (size, a replacement, a resize) and the data changes.
With `ray_seed="batch"`, right before task `idx` is made, the worker seeds Python's `random`,
torch's CPU generator (and CUDA's, when CUDA is already initialized there) and NumPy's global
generator from
    SeedSequence(entropy=base_seed, spawn_key=(epoch, idx))
(NumPy's way to derive independent child streams). `base_seed` is the iterator's, drawn from the
loader's `generator` as torch draws it; `idx` is the batch's position in the epoch's sampler
order; `epoch` counts one iterator's epochs (persistent workers must not repeat draws). Words 0-1
of the state seed `random` and torch, all four seed NumPy; `get_worker_info().seed` is untouched.
Invariant: a map-style batch's content depends only on the generator and its position: the same
with 1 or 64 workers, after a replacement, on any node (IterableDataset replicas still depend on
their worker through torch's sharding).
CUDA is seeded only when already initialized (its lazy seeding is far dearer than the rest): a
dataset that draws on CUDA should initialize it in `worker_init_fn`.
num_workers=0 applies the same seeding around each batch in the calling process, the caller's
own generators saved before and restored after. That path is raydl's own iterator
(`_InProcessIter`): the seeding must fall between the sampler draw and the fetch, which torch's
iterator does in one private method. Costs: docs/design-notes.md.

NOTE [ raydl sample seeding ]
`ray_seed="sample"` (map-style datasets): right before `dataset[i]`, the worker (or the calling
process with num_workers=0, its own generators restored after the batch) seeds `random`, torch's
CPU generator and NumPy's global generator from (key, epoch, i), so a sample's draws depend on
nothing but its index: not on its batch, worker, rank or the world size. That is what makes a
resume at another world size give the uninterrupted run's content (NOTE [ raydl global epoch ]).
With torch's `DistributedSampler` the key and epoch are the sampler's `seed` and `epoch` (the same
on every rank, as its permutation); otherwise the iterator's base seed and epoch, as for "batch".
The 64-bit seed is a splitmix64 chain over (key, epoch, i), not a SeedSequence: 8 us per sample
in all on this machine (chain 1.1, random 3.9, torch 1.1, NumPy 2.0; bench_seeding, retired at 3d9a662:
docs/benchmark-notes.md#retired-benchmarks),
against 25 us with a SeedSequence and NumPy's four-word seeding.
"""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch

__all__ = ["SEED_MODES", "batch_seed_words", "seed_batch", "sample_seed", "seed_sample"]

# The values of `ray_seed`: "worker" = torch's per-worker seeding, "batch" = NOTE [ raydl batch seeding ],
# "sample" = NOTE [ raydl sample seeding ].
SEED_MODES = ("worker", "batch", "sample")

_U32 = 0xFFFFFFFF


def batch_seed_words(base_seed: int, epoch: int, idx: int, stream: Optional[int] = None) -> np.ndarray:
    """Four uint32 words seeding batch `idx` of `epoch` under `base_seed` (NOTE [ raydl batch seeding ]);
    `stream`: the rank, for the batches of a job's ranks (NOTE [ raydl job pool ])."""
    key = (epoch, idx) if stream is None else (epoch, idx, stream)
    return np.random.SeedSequence(entropy=base_seed, spawn_key=key).generate_state(4)


def seed_batch(base_seed: int, epoch: int, idx: int, stream: Optional[int] = None) -> None:
    """Seed `random`, torch (CPU, and CUDA if initialized) and NumPy's global generator for one batch."""
    words = batch_seed_words(base_seed, epoch, idx, stream)
    seed = int(words[0]) | (int(words[1]) << 32)
    random.seed(seed)
    # torch.manual_seed also queues a lazy CUDA seeding with a stack trace (~0.1 ms); seed the CPU
    # generator directly and CUDA's only where it is in use.
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    np.random.seed(words)


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value for each 64-bit input."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sample_seed(key: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample `index` in `epoch` under `key` (NOTE [ raydl sample seeding ])."""
    return _mix64(_mix64(_mix64(key & _M64) ^ (epoch & _M64)) ^ (index & _M64))


def seed_sample(key: int, epoch: int, index: int) -> None:
    """Seed `random`, torch (CPU, and CUDA if initialized) and NumPy's global generator for one sample."""
    seed = sample_seed(key, epoch, index)
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    np.random.seed((seed ^ (seed >> 32)) & _U32)


class _SavedRNG:
    """The calling process's global generators, saved and restored around an in-process batch."""

    def __init__(self) -> None:
        self._random = random.getstate()
        self._torch = torch.default_generator.get_state()
        self._numpy = np.random.get_state(legacy=False)
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        random.setstate(self._random)
        torch.default_generator.set_state(self._torch)
        np.random.set_state(self._numpy)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
