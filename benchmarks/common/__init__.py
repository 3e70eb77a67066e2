"""What raydl's benchmarks share, one concern a module:

    machine     what the results depend on (machine, versions, commit) and the load other processes add
    results     where a run writes (results/<script>-<stamp>.jsonl and .md, figures/<script>.png), tables
    workloads   the synthetic datasets torch, raydl and Ray Data all run
    clusters    multi-node Rays on this machine (cluster/local_launcher.sh), stopped on exit
    processes   measurements in child processes (`python -m benchmarks.<script>` from the repository root)
    peers       the loaders raydl is measured against (torch, Ray Data, SPDL, torchdata.nodes)
    offload     the offload shape: the trainer pinned to one core, the workers on a node of another

This package imports nothing heavy (`processes` neither: no torch, no Ray, for parents that time
a cold start); the loopback setting is made by `benchmarks` itself, before any of this.
"""

from __future__ import annotations

import os

BENCHMARKS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCHMARKS_DIR)
