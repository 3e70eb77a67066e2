"""A run's record, and the README's tables made from the latest records.

`run()` starts a registered benchmark as its own process, passes its report through, and keeps what a reader of a
table needs to trust it: the command, raydl's commit (and whether the tree was clean), the machine, the load before
and after, the wall time, the exit status, and every Markdown table the report printed with the line above it as
its title. A full run that ends well becomes benchmarks/records/<name>.json (tracked: the README's tables come from
it); a `--quick` or failed run goes to benchmarks/results/ (ignored) and never replaces a record.

`render_readme()` rewrites each block between `<!-- record:NAME -->` and `<!-- /record:NAME -->` in
benchmarks/README.md from records/NAME.json; `--check` (and tests/test_bench_runner.py) says when they differ.
Imports nothing heavy: no torch, no Ray (a benchmark's own process imports them).
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator, Optional

from benchmarks.common import BENCHMARKS_DIR, REPO

RECORDS_DIR = os.path.join(BENCHMARKS_DIR, "records")
RESULTS_DIR = os.path.join(BENCHMARKS_DIR, "results")
README = os.path.join(BENCHMARKS_DIR, "README.md")
_NOT_CODE = (":!benchmarks/records", ":!benchmarks/README.md")
_BLOCK = re.compile(r"(<!-- record:([a-z0-9_]+) -->\n)(.*?)(<!-- /record:\2 -->)", re.S)


# --------------------------------------------------------------------------- what a record holds


def git_commit() -> tuple[str, bool]:
    """raydl's short commit and whether its code differs from it (raydl/ or benchmarks/ edited, not committed; the
    records and the README a run writes are not code: a chain of runs would otherwise call all but the first dirty)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") or "unknown", bool(
            git("status", "--porcelain", "--", "raydl", "benchmarks", *_NOT_CODE)
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown", False


def machine_facts() -> dict:
    """The machine and the versions, read without importing them (importlib.metadata, /proc)."""
    from importlib import metadata

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "-"

    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = None
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        **{pkg: version(pkg) for pkg in ("torch", "ray", "numpy", "pyarrow")},
    }


def tables_of(report: str) -> list[dict]:
    """Every Markdown table in `report`, with the nearest text line above it (within three lines; not a JSON line, which
    a script prints for its records) as its title."""
    lines = report.splitlines()
    tables: list[dict] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            above = [ln.strip() for ln in lines[max(0, i - 3) : i] if ln.strip() and ln[0] not in "|{["]
            tables.append({"title": above[-1] if above else "", "markdown": "\n".join(lines[i:j])})
            i = j
        else:
            i += 1
    return tables


# --------------------------------------------------------------------------- a run


def _stream(proc: subprocess.Popen) -> Iterator[str]:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        yield line


def run(name: str, bench: Any, args: list[str], quick: bool) -> dict:
    """Run benchmark `name` (a registry.Bench) with `args`, stop it at its timeout, and write its record."""
    argv = [*bench.args, *(bench.quick if quick else ()), *args]
    command = " ".join(["python -m benchmarks", name, *(["--quick"] if quick else []), *args])
    commit, dirty = git_commit()
    record: dict[str, Any] = {
        "name": name,
        "script": bench.script,
        "command": command,
        "argv": argv,
        "quick": quick,
        "commit": commit,
        "dirty": dirty,
        "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": machine_facts(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", bench.module, *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout stops its children too
    )
    out: list[str] = []
    timer = _Deadline(proc, bench.timeout_s)
    on_term = _raise_on_sigterm()  # a `timeout` or kill around the runner reaches the benchmark's group too
    try:
        out.extend(_stream(proc))
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            _stop(proc)
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    record.update(
        rc=rc if not timer.fired else "timeout",
        wall_s=round(time.monotonic() - t0, 1),
        loadavg_end=[round(x, 2) for x in os.getloadavg()],
    )
    report = "".join(out)
    record["tables"] = tables_of(report)
    record["report"] = report
    record["path"] = save(record)
    return record


def _raise_on_sigterm() -> Any:
    """SIGTERM ends the runner through its `finally` (which stops the benchmark); the previous handler, to restore."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


class _Deadline:
    """Stops `proc`'s process group after `timeout_s` (a thread timer; `fired` tells the record)."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float) -> None:
        self.fired = False

        def fire() -> None:
            self.fired = True
            print(f"\n[benchmarks] stopped after {timeout_s:.0f} s (the registry's timeout)", file=sys.stderr)
            _stop(proc)

        self._t = threading.Timer(timeout_s, fire)
        self._t.daemon = True
        self._t.start()

    def cancel(self) -> None:
        self._t.cancel()


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def from_report(name: str, bench: Any, report_path: str, command: str) -> dict:
    """A record of a run made with the script itself (`python -m benchmarks.<script> ...`), from the report it wrote.

    The report gives the tables and, where its machine line has them, raydl's commit and the load average at the
    start; its file name gives the time. The machine facts are read now: make the record on the machine of the run.
    """
    with open(report_path) as f:
        report = f.read()
    commit = re.search(r"raydl at ([0-9a-f]{7,}(?:\+dirty[^;\s]*)?)", report)
    load = re.search(r"load average at start ([0-9.]+)", report)
    stamp = re.search(r"(\d{8})-(\d{6})", os.path.basename(report_path))
    started = time.strftime("%Y-%m-%d %H:%M", time.strptime("".join(stamp.groups()), "%Y%m%d%H%M%S")) if stamp else "-"
    record = {
        "name": name,
        "script": bench.script,
        "command": command,
        "argv": command.split()[3:],
        "quick": False,
        "commit": commit.group(1) if commit else "unknown",
        "dirty": False,
        "started_utc": started,
        "machine": machine_facts(),
        "loadavg_start": [float(load.group(1))] if load else None,
        "loadavg_end": None,
        "rc": 0,
        "wall_s": None,
        "tables": tables_of(report),
        "report": report,
        "source": f"Made from the report of a run of the script itself ({os.path.basename(report_path)}).",
    }
    record["path"] = save(record)
    return record


def save(record: dict) -> str:
    """records/<name>.json for a full run that ended well; else results/<name>[-quick]-<stamp>.json."""
    if record["rc"] == 0 and not record["quick"] and record["tables"]:
        os.makedirs(RECORDS_DIR, exist_ok=True)
        path = os.path.join(RECORDS_DIR, f"{record['name']}.json")
    else:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(RESULTS_DIR, f"{record['name']}{'-quick' if record['quick'] else ''}-{stamp}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return os.path.relpath(path, REPO)


def latest(name: str) -> Optional[dict]:
    path = os.path.join(RECORDS_DIR, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# --------------------------------------------------------------------------- the README's tables


def render_block(record: Optional[dict], shown: tuple[int, ...] = ()) -> str:
    """A README block: the run line (command, commit, date, machine, load), then the record's tables."""
    if record is None:
        return "No record yet: run the command above.\n"
    m = record["machine"]
    took = f", {record['wall_s'] / 60:.1f} min" if record.get("wall_s") else ""
    load = [f"{record[k][0]} at the {k[8:]}" for k in ("loadavg_start", "loadavg_end") if record.get(k)]
    head = (
        f"`{record['command']}` at raydl {record['commit']}{' (uncommitted changes)' if record['dirty'] else ''}, "
        f"{record['started_utc']} UTC{took}; {m['cpus']} CPUs ({m['cpu_model']}), {m['mem_gib']} GiB, "
        f"Python {m['python']}, torch {m['torch']}, ray {m['ray']}"
        + (f"; load average {' and '.join(load)}." if load else ".")
    )
    if record.get("source"):
        head += f" {record['source']}"
    tables = [t for i, t in enumerate(record["tables"]) if not shown or i in shown]
    parts = [head]
    for t in tables:
        parts.append((f"{t['title']}\n\n" if t["title"] else "") + t["markdown"])
    return "\n\n".join(parts) + "\n"


def render_readme(registry: dict, text: str) -> str:
    """`text` (the README) with each record block made anew from the latest record; unknown names left as they are."""

    def block(m: re.Match) -> str:
        name = m.group(2)
        if name not in registry:
            return m.group(0)
        return m.group(1) + render_block(latest(name), registry[name].tables) + m.group(4)

    return _BLOCK.sub(block, text)


def blocks_in(text: str) -> list[str]:
    return [m.group(2) for m in _BLOCK.finditer(text)]
