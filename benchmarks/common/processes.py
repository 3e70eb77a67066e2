"""Measurements in child processes: start a script again as a child, read its `RESULT {json}` line.

A child is `python -m benchmarks.<script> ...` (`script_command`), as the scripts themselves are
run, with the repository root on its path (its working directory, or REPO in its PYTHONPATH). Imports nothing heavy
(no torch, no Ray).
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.common import REPO

__all__ = ["REPO", "child_result", "script_command"]

RESULT_PREFIX = "RESULT "


def script_command(script: str, *args: str) -> list[str]:
    """The command that runs benchmarks/<script>.py as a module with `args` (REPO on the child's path)."""
    return [sys.executable, "-m", f"benchmarks.{script}", *args]


def child_result(proc: subprocess.CompletedProcess, what: str) -> dict:
    """The last `RESULT {json}` line a child printed; a RuntimeError with its output if it failed."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])
