"""A stand-in benchmark for tests/test_bench_runner.py: prints a report with two tables, exits as told.

python -m tests._bench_fake [--fail] [--hang] [--child-pid-file F]
"""

import subprocess
import sys
import time

if "--child-pid-file" in sys.argv:  # a grandchild the runner's timeout must stop too
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[sys.argv.index("--child-pid-file") + 1], "w") as f:
        f.write(str(child.pid))
print("# fake bench\n\nMachine: raydl at 0123abc; load average at start 0.5 / 0.4\n")
print("**Epochs**\n\n| loader | samples/s |\n|---|---|\n| raydl | 10 |\n| torch | 5 |\n")
print("a line with | a pipe, not a table\n\n| cache | bytes |\n|:--|--:|\n| quarter | 0.91 |")
sys.stdout.flush()
if "--hang" in sys.argv:
    time.sleep(600)
sys.exit(3 if "--fail" in sys.argv else 0)
