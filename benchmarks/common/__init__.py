"""What raydl's benchmarks share, one concern a module:

    machine     what the results depend on (machine, versions, commit) and the load other processes add
    results     where a run writes (results/<script>-<stamp>.jsonl and .md, figures/<script>.png), tables
    workloads   the synthetic datasets torch, raydl and Ray Data all run
    clusters    a driver in the head's namespace of a namespace cluster (cluster/netns_testbed.py)
    processes   measurements in child processes (`python -m benchmarks.<script>` from the repository root)
    peers       the local Ray raydl starts, for the peers that run on Ray (Ray Data)
    peer_envs   the peers that need a virtual environment of their own (bench_peers)

This package imports nothing heavy (`processes` neither: no torch, no Ray); the loopback setting is made by
`benchmarks` itself, before any of this. What the retired benchmarks shared (local loopback clusters, the image
loaders, the offload shape) is at commit 3d9a662: docs/benchmark-notes.md#retired-benchmarks.
"""

from __future__ import annotations

import os

BENCHMARKS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCHMARKS_DIR)
