"""`ray_seed="batch"`: each batch seeded from its position in the epoch, not from the worker making it.

NOTE [ raydl batch seeding ]
With torch's seeding (`ray_seed="worker"`, the default; NOTE [ raydl seeding ] in worker/actor.py)
worker `i` is seeded once, from `base_seed + i`, and every batch it makes draws from where the
previous one left its generators: a random augmentation depends on which worker made the batch
and on what that worker made before. Change the pool (1 worker instead of 5, a replacement after
a death, a resize) and the data changes.

With `ray_seed="batch"`, right before task `idx` is made (`Worker.fetch(epoch, idx, work)`), the
worker seeds Python's `random`, torch's CPU generator (and CUDA's, when CUDA is initialized in
that process) and NumPy's global generator from
    SeedSequence(entropy=base_seed, spawn_key=(epoch, idx))
(NumPy's documented way to derive independent child streams: this is child `(epoch, idx)` of
the iterator's base seed). `base_seed` is the iterator's, drawn from the loader's `generator` as
torch draws it; `idx` is the batch's position in the epoch's sampler order; `epoch` counts the
epochs of one iterator (0 unless `persistent_workers`, whose later epochs must not repeat the
first one's draws). A map-style batch's content then depends only on the generator and its
position: the same with 1 or 64 workers, after a worker is replaced, on any node.
From the state, four words are generated: words 0-1 are the 64-bit seed of `random` and torch,
all four seed NumPy (as torch seeds NumPy in workers). `get_worker_info()` is untouched: its
`seed` is still the worker's `base_seed + id`.
Cost: one SeedSequence, three seedings, measured by benchmarks/bench_seeding.py (a few tens of
microseconds, see benchmarks/README.md). CUDA's generators are seeded only when CUDA is already
initialized in the worker (`torch.manual_seed`'s lazy CUDA seeding records a stack trace per
call, ~100x the rest): a dataset that draws on CUDA should initialize it in `worker_init_fn`.

num_workers=0 (torch's in-process loading): the same per-batch seeding is applied around each
batch in the calling process, so the batches equal the workers' ones. The caller's own
generators (the training loop draws from the same global `random`, torch and NumPy generators)
are saved before the batch and restored after it: the loop's random stream is the one it would
have had without raydl's seeding. That save/restore costs some 0.1 ms per batch.
IterableDataset: each batch is seeded the same way, but a replica's content depends on its
worker (torch's sharding by `get_worker_info()`), so the pool independence holds for map-style
datasets only.

The in-process path is raydl's own iterator (`_InProcessIter` in driver/inprocess.py), not torch's: the
seeding must happen between the sampler draw and the fetch (a RandomSampler without a generator
draws its permutation's seed from torch's global generator on its first draw), and torch's
iterator does both in one private method.

NOTE [ raydl sample seeding ]
`ray_seed="sample"` (map-style datasets): right before `dataset[i]`, the worker (or the calling
process with num_workers=0, its own generators restored after the batch) seeds `random`, torch's
CPU generator and NumPy's global generator from (key, epoch, i), so a sample's draws depend on
nothing but its index: not on its batch, worker, rank or the world size. That is what makes a
resume at another world size give the uninterrupted run's content (NOTE [ raydl global epoch ]).
With torch's `DistributedSampler` the key and epoch are the sampler's `seed` and `epoch` (the same
on every rank, as its permutation); otherwise the iterator's base seed and epoch, as for "batch".
The 64-bit seed is a splitmix64 chain over (key, epoch, i), not a SeedSequence: 8 us per sample
in all on this machine (chain 1.1, random 3.9, torch 1.1, NumPy 2.0; benchmarks/bench_seeding.py),
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
