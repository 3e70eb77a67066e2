"""Multi-node Rays for a benchmark: a driver run in the head's namespace of a namespace cluster.

`run_in_netns_head` starts `python -m benchmarks.<script>` there (cluster/netns_testbed.py's cluster) and reads its
`RESULT {json}` line. (The loopback clusters of cluster/local_launcher.sh that the retired offload and multi-node
benchmarks started, `LocalCluster`, live at commit 3d9a662: docs/benchmark-notes.md, Retired benchmarks.)
"""

from __future__ import annotations

import subprocess
from typing import Any

from benchmarks.common import REPO


def run_in_netns_head(cluster: Any, script: str, *args: str, timeout_s: float = 900, **env: str) -> dict:
    """`python -m benchmarks.<script> *args` as a driver in the head's namespace of a namespace cluster
    (cluster/netns_testbed.py), with the cluster's driver environment plus `env`; its `RESULT {json}` line, or
    SystemExit with its output when it failed."""
    from benchmarks.common.processes import child_result, script_command

    cmd = [*cluster.exec_prefix(0), *script_command(script, *args)]
    proc = subprocess.run(
        cmd, env=dict(cluster.driver_env(), PYTHONPATH=REPO, **env), capture_output=True, text=True, timeout=timeout_s
    )
    try:
        return child_result(proc, f"{script} {' '.join(args)}")
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
