"""One Ray session shared by the whole suite, on loopback, sized for a 2-core machine."""

from __future__ import annotations

import os

# Before Ray is imported: a local Ray then binds 127.0.0.1 only (see raydl/_ray_utils.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 2 CPUs, a 200 MB object store and the dashboard (for the state API leak checks)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=0,
            object_store_memory=200 * 1024**2,
            include_dashboard=True,
        )
    yield ray
    ray.shutdown()
