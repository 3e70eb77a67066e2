"""Where a benchmark writes, and the helpers its tables are made with.

Every script writes to one place: `Results("<script>", quick)` opens
benchmarks/results/<script>[-quick]-<stamp>.jsonl (one JSON object per measurement) and writes the
report next to it as .md; a script's figure goes to `figure_path("<script>", quick)`:
benchmarks/figures/<script>.png for a full run (the tracked, published picture), next to the
run's report in results/ for a `--quick` one (a smoke run never replaces a published figure).
benchmarks/results/ is git-ignored: the published tables are in benchmarks/README.md, each with
the command and the commit of its run.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Iterator

import numpy as np

from benchmarks.common import BENCHMARKS_DIR

RESULTS_DIR = os.path.join(BENCHMARKS_DIR, "results")
FIGURES_DIR = os.path.join(BENCHMARKS_DIR, "figures")


def figure_path(script: str, quick: bool = False) -> str:
    """figures/<script>.png for a full run; results/<script>-quick-<stamp>.png for a smoke run."""
    folder = RESULTS_DIR if quick else FIGURES_DIR
    os.makedirs(folder, exist_ok=True)
    name = f"{script}-quick-{time.strftime('%Y%m%d-%H%M%S')}" if quick else script
    return os.path.join(folder, name + ".png")


class Results:
    """JSON lines to benchmarks/results/<name>[-quick]-<stamp>.jsonl, one per measurement; `name` is the script's."""

    def __init__(self, name: str, quick: bool) -> None:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        self.name, self.quick = name, quick
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.prefix = os.path.join(RESULTS_DIR, f"{name}{'-quick' if quick else ''}-{self.stamp}")
        self.jsonl_path = self.prefix + ".jsonl"
        self._f = open(self.jsonl_path, "w")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, default=_jsonable) + "\n")
        self._f.flush()

    def write_text(self, suffix: str, text: str) -> str:
        path = self.prefix + suffix
        with open(path, "w") as f:
            f.write(text)
        return path

    def figure_path(self) -> str:
        """figures/<name>.png for a full run, <prefix>.png (beside this run's report) for a quick one."""
        return self.prefix + ".png" if self.quick else figure_path(self.name)

    def close(self) -> None:
        self._f.close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return str(x)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return float(np.percentile(np.asarray(xs), q))


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class _Tee:
    """A text stream writing to two others (stdout and a report file)."""

    def __init__(self, *streams: Any) -> None:
        self._streams = streams

    def write(self, text: str) -> int:
        for s in self._streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self._streams:
            s.flush()

    def isatty(self) -> bool:  # (progress bars ask: Ray Data's did, and failed without it)
        return False

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, ...: the terminal's
        return getattr(self._streams[0], name)


@contextlib.contextmanager
def printed_report(script: str, quick: bool = False, enabled: bool = True) -> Iterator[str]:
    """For a script that prints its report: what it prints meanwhile also goes to results/<script>[-quick]-<stamp>.md.

    Yields the report's path ("" and nothing written when not `enabled`, a script's own child process, or
    for --help); stdout is restored on exit, whatever happened.
    """
    if not enabled or "-h" in sys.argv or "--help" in sys.argv:
        yield ""
        return
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{script}{'-quick' if quick else ''}-{time.strftime('%Y%m%d-%H%M%S')}.md")
    stdout = sys.stdout
    with open(path, "w") as f:
        sys.stdout = _Tee(stdout, f)
        try:
            yield path
        finally:
            sys.stdout = stdout
    print(f"\nreport: {path}", file=sys.stderr)
