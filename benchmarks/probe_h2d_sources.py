"""Where a transfer-bound loop's bytes/s can come from on a GPU machine: a probe, not a loader comparison.

bench_gpu.py found raydl's transfer-bound loop bound by the trainer's copy into pinned memory (NOTE [ raydl pin
copy ]). This measures, on the same kind of machine, what lies beyond that copy:
  * memcpy into pinned memory with 1 to 12 threads (how far splitting the copy can go there);
  * H2D from a /dev/shm mapping registered with cudaHostRegister (no host copy at all): the registration's cost and
    the copy engine's rate from such memory;
  * the same for an array in Ray's object store, as the trainer gets it (the mapping holding it, found in
    /proc/self/maps, registered once): whether torch then sees it pinned and how fast it goes to the GPU;
  * a raydl loader's delivery rate (no pinning) with 8 and 12 workers, and ray_device with 8 copy threads.

    python -m benchmarks.probe_h2d_sources --json out.json      # needs CUDA and Ray
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import time

import numpy as np
import torch

from benchmarks.bench_gpu import Chunks, h2d_rate

MiB = 1024 * 1024


def register(addr: int, size: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    err = torch.cuda.cudart().cudaHostRegister(addr, size, 0)
    return int(err), time.perf_counter() - t0


def unregister(addr: int) -> float:
    t0 = time.perf_counter()
    torch.cuda.cudart().cudaHostUnregister(addr)
    return time.perf_counter() - t0


def memcpy_threads(out: dict) -> None:
    from raydl import _constants
    from raydl.worker import transfer

    n = 256 * MiB
    src = np.random.default_rng(0).random(n // 8)
    dst = torch.empty(n // 8, dtype=torch.float64, pin_memory=True).numpy()
    saved = _constants.PIN_COPY_THREADS
    for threads in (1, 2, 4, 6, 8, 12):
        _constants.PIN_COPY_THREADS = threads
        transfer.copy_array(dst, src)
        t0 = time.perf_counter()
        for _ in range(10):
            transfer.copy_array(dst, src)
        out[f"memcpy_to_pinned_{threads}t_GBps"] = round(n * 10 / (time.perf_counter() - t0) / 1e9, 2)
    _constants.PIN_COPY_THREADS = saved
    # pageable to pageable, for comparison (is it the pinned destination or memory itself?)
    plain = np.empty_like(src)
    np.copyto(plain, src)
    t0 = time.perf_counter()
    for _ in range(10):
        np.copyto(plain, src)
    out["memcpy_pageable_1t_GBps"] = round(n * 10 / (time.perf_counter() - t0) / 1e9, 2)


def shm_registered(out: dict) -> None:
    size = 1024 * MiB
    path = "/dev/shm/raydl_probe"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    arr = np.frombuffer(m, dtype=np.float32)
    arr[:] = 1.0  # pages present
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    err, reg_s = register(addr, size)
    out["shm_register_err"], out["shm_register_s_per_GiB"] = err, round(reg_s, 4)
    if err == 0:
        t = torch.from_numpy(arr)
        out["shm_registered_is_pinned"] = bool(t.is_pinned())
        out["h2d_from_registered_shm_GBps"] = round(h2d_rate(t, 10) / 1e9, 2)
        out["shm_unregister_s"] = round(unregister(addr), 4)
    out["h2d_from_pageable_shm_GBps"] = round(h2d_rate(torch.from_numpy(arr), 10) / 1e9, 2)
    t = None  # every view of the mapping gone before it closes
    del arr, t
    m.close()
    os.close(fd)
    os.unlink(path)


def ray_store(out: dict) -> None:
    import ray

    ray.init(address="local", num_cpus=4, object_store_memory=4 * 1024 * MiB, include_dashboard=False)
    try:
        ref = ray.put(np.ones(32 * MiB // 4, dtype=np.float32))
        arr = ray.get(ref)
        addr = arr.ctypes.data
        mapping = None
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= addr < hi:
                    mapping = (lo, hi, " ".join(line.split()[5:]))
        out["store_mapping_GiB"] = round((mapping[1] - mapping[0]) / 2**30, 2) if mapping else None
        out["store_mapping_file"] = mapping[2] if mapping else None
        out["h2d_from_store_unregistered_GBps"] = round(h2d_rate(torch.from_numpy(arr), 10) / 1e9, 2)
        if mapping:
            err, reg_s = register(mapping[0], mapping[1] - mapping[0])
            out["store_register_err"], out["store_register_s"] = err, round(reg_s, 3)
            if err == 0:
                t = torch.from_numpy(arr)
                out["store_registered_is_pinned"] = bool(t.is_pinned())
                out["h2d_from_registered_store_GBps"] = round(h2d_rate(t, 10) / 1e9, 2)
                unregister(mapping[0])
        del arr
    finally:
        ray.shutdown()


def loaders(out: dict) -> None:
    import raydl
    from raydl import _constants

    def rate(loader, to_gpu: bool) -> float:
        best = 0.0
        for _ in range(3):
            t0, nbytes = time.perf_counter(), 0
            for x in loader:
                if to_gpu:
                    x.sum()
                nbytes += x.numel() * 4
            torch.cuda.synchronize()
            best = max(best, nbytes / (time.perf_counter() - t0))
        return best

    ds = Chunks(160, 32)
    for workers in (8, 12):
        with raydl.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True) as loader:
            out[f"raydl_host_only_{workers}w_GBps"] = round(rate(loader, False) / 1e9, 2)
    for threads in (4, 8):
        _constants.PIN_COPY_THREADS = threads
        with raydl.DataLoader(
            ds, batch_size=None, num_workers=12, persistent_workers=True, ray_device="cuda"
        ) as loader:
            out[f"raydl_ray_device_12w_{threads}t_GBps"] = round(rate(loader, True) / 1e9, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    out: dict = {"device": torch.cuda.get_device_name(), "cpus": os.cpu_count()}
    for name, step in (("memcpy", memcpy_threads), ("shm", shm_registered), ("ray", ray_store), ("loaders", loaders)):
        try:
            step(out)
        except Exception as e:  # a probe: one step failing must not hide the others
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
