"""What the peers raydl is measured against need from raydl: the local Ray raydl starts, for Ray Data to run on.

(The image benchmarks' loaders behind one interface, torch, Ray Data, SPDL and torchdata.nodes, went with
bench_images; they live at commit 3d9a662: docs/benchmark-notes.md, Retired benchmarks.)
"""

from __future__ import annotations


def _start_local_ray_like_raydl() -> None:
    """The local Ray raydl starts for itself (loopback, no dashboard, workers at the driver's niceness,
    dropped objects freed every 100 ms), so Ray Data runs on the same Ray."""
    import ray

    from raydl.cluster import connect

    if not ray.is_initialized():
        connect._start_local_ray()
