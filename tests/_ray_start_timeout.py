"""Ray's node start timing out as on an overloaded host, on demand: for the tests of the retries around it.

Ray waits a fixed 30 s (on `time.monotonic`) for a new node's raylet to register with the GCS, then gives up with "The
current node timed out during startup" (ray/_private/node.py, Ray 2.60). raydl's local start (NOTE [ raydl local start
retry ]) and cluster/local_launcher.sh (NOTE [ launcher start retry ]) retry once after it. `time_out_node_starts`
makes that wait run out for real in this process: the node's GCS and raylet start, then its clock jumps 40 s per reading
and the GCS "does not list" the raylet yet, so Ray kills nothing and raises its own error, exactly as on a busy host.
Used by tests/test_startup.py's retry script (in the driver) and tests/test_cluster_configs.py's launcher test (in a
sitecustomize that only the first `ray start --head` acts on).
"""

from __future__ import annotations

import time
import types


def time_out_node_starts(active=lambda: True, on_time_out=lambda: None) -> None:
    """While `active()` holds, Ray's raylet wait in this process runs out; `on_time_out()` is called as it does."""
    import ray._private.node as node_mod

    class JumpingClock(types.ModuleType):
        readings = 0

        def __getattr__(self, name):
            return getattr(time, name)

        def monotonic(self):
            if not active():
                return time.monotonic()
            JumpingClock.readings += 1
            return time.monotonic() + 40.0 * JumpingClock.readings

    real_get_node = node_mod.ray._private.services.get_node

    def get_node(*args, **kwargs):
        if not active():
            return real_get_node(*args, **kwargs)
        on_time_out()  # the raylet registered, but too late for Ray
        raise RuntimeError("not registered yet")

    node_mod.time = JumpingClock("time")
    node_mod.ray._private.services.get_node = get_node
