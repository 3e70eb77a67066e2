"""raydl's benchmarks: one script per measurement, run as a module from the repository root.

    python -m benchmarks.bench_throughput --quick

benchmarks/README.md lists every script, its command, where it writes and the published runs.
The code the scripts share is in `benchmarks.common`.

Importing this package (which `python -m benchmarks.<script>` does before the script's first line)
sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, so any local Ray a benchmark starts listens on 127.0.0.1
only, and turns Ray's usage stats off; both before anything imports Ray.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
