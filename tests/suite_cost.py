"""Where the test suite's CPU goes, by process: `python -m tests.suite_cost [pytest arguments]`.

NOTE [ tests suite cost ]
The suite is CPU-bound on a 2-core machine (issue 37), so what a cut saves is core-seconds, and
RAYDL_TEST_PROFILE=1 (tests/conftest.py) only sees them per test, for the whole machine: a background
driver running beside a test is charged to that test. This runs pytest (RAYDL_TEST_PROFILE=1, every
test's end time written to a file) while a thread samples every process's CPU time from /proc twice a
second, then charges each process to what started it:
  * pytest's own process;
  * the suite's Ray (the `ray_session` fixture's GCS, raylet and the rest, children of pytest): its
    daemons, and its actors by class (the process title Ray gives an actor, `ray::<Class>`), with
    the test during which each started;
  * each other command pytest started (a fresh driver, an example, a `ray start`, a launcher), with
    every process under it (its own Ray, torch's forked workers);
  * anything else on the machine (the kernel's threads, other users).
A process that lived less than one sample (0.5 s) is missed; its parent's share is not affected. The
report goes to stdout and, with every process's record, to `--out` (JSON).

    python -m tests.suite_cost                      # the whole suite (as long as the suite: ~30 min here)
    python -m tests.suite_cost tests/test_job.py    # one module
    # or beside a run started otherwise (e.g. `.ci/run` with RAYDL_TEST_PROFILE=1 and RAYDL_TEST_PROFILE_FILE=F):
    python -m tests.suite_cost --attach <pytest's pid> --tests-file F
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

_TICK = os.sysconf("SC_CLK_TCK")
# what a Ray daemon's command line holds (its executable or script), and the name the report gives it
_RAY_DAEMONS = (
    ("/gcs_server ", "gcs_server"),
    ("/raylet ", "raylet"),
    ("dashboard/dashboard.py", "dashboard"),
    ("ray-dashboard-", "dashboard"),
    ("dashboard/agent.py", "dashboard agent"),
    ("runtime_env/agent/main.py", "runtime env agent"),
    ("log_monitor.py", "log monitor"),
    ("autoscaler/_private/monitor.py", "autoscaler monitor"),
)


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class Sampler:
    """Every process's CPU time, parent and most telling title, sampled until `stop()`."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.seen: dict[tuple[int, str], dict] = {}  # (pid, start time in ticks) -> record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="suite-cost-sampler", daemon=True)

    def start(self) -> None:
        self._scan()  # what ran before: its CPU so far is not the suite's
        for record in self.seen.values():
            record["before"] = record["cpu"]
        self._thread.start()

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        self._scan()
        return list(self.seen.values())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._scan()

    def _scan(self) -> None:
        now = time.time()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            stat = _read(f"/proc/{name}/stat")
            if not stat:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            key = (int(name), fields[19])
            record = self.seen.get(key)
            if record is None:
                record = self.seen[key] = {"pid": int(name), "ppid": int(fields[1]), "first": now, "before": 0.0}
                record["cmd"] = _read(f"/proc/{name}/cmdline").replace("\0", " ").strip()[:300]
            elif record["cmd"].startswith("ray::IDLE") or "default_worker.py" in record["cmd"]:
                # a Ray worker process is titled by the actor it became (ray::Worker, ray::NodeCache, ...)
                title = _read(f"/proc/{name}/cmdline").replace("\0", " ").strip()[:300]
                if title and not title.startswith("ray::IDLE"):
                    record["cmd"] = title
            record["cpu"] = (int(fields[11]) + int(fields[12])) / _TICK
            record["last"] = now


def _kind(cmd: str) -> str:
    """A process's role from its title: a Ray actor's class, a Ray daemon, or its command."""
    if cmd.startswith("ray::"):
        # `ray::Class`, `ray::Class.method` or, for a named actor, `ray::<name>:Class.method`
        title = cmd[len("ray::") :].split()[0] if cmd[len("ray::") :].strip() else "?"
        name = title.rsplit(":", 1)[-1].split(".")[0]
        return f"actor {name}" if name != "IDLE" else "Ray worker, never an actor"
    for marker, daemon in _RAY_DAEMONS:
        if marker in cmd + " ":
            return f"Ray daemon {daemon}"
    return "other"


def _command(cmd: str) -> str:
    """A started command, shortened for the report: the interpreter's path and the checkout's dropped."""
    cmd = re.sub(r"\S*/bin/python\d*(\.\d+)?", "python", cmd)
    cmd = cmd.replace(os.getcwd() + "/", "")
    return " ".join(cmd.split())[:110]  # a `python -c` program's first lines, on one line


def report(records: list[dict], tests: list[dict], pytest_pid: int) -> str:
    by_pid = {r["pid"]: r for r in records}
    ends = [t["t1"] for t in tests]

    def during(t: float) -> str:
        i = next((i for i, end in enumerate(ends) if end >= t), None)
        return tests[i]["nodeid"] if i is not None else "(after the last test)"

    def top(record: dict) -> dict | None:
        """The child of pytest this process descends from (None: not started by the suite)."""
        hops = 0
        while record["ppid"] != pytest_pid:
            record = by_pid.get(record["ppid"])
            hops += 1
            if record is None or hops > 64:
                return None
        return record

    def cost(record: dict) -> float:
        return record.get("cpu", 0.0) - record["before"]

    roles: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    commands: collections.Counter = collections.Counter()
    command_procs: collections.Counter = collections.Counter()
    actors: collections.Counter = collections.Counter()
    actor_tests: collections.Counter = collections.Counter()
    for record in records:
        c = cost(record)
        if record["pid"] == pytest_pid:
            role = "pytest's process"
        else:
            origin = top(record)
            if origin is None:
                role = "not the suite's (kernel threads, other processes)"
            elif _kind(origin["cmd"]).startswith("Ray daemon"):  # the suite's own Ray, started by `ray.init`
                kind = _kind(record["cmd"])
                role = f"the suite's Ray: {kind}"
                if kind.startswith("actor") or kind.startswith("Ray worker"):
                    actors[kind] += c
                    actor_tests[during(record["first"])] += 1
            else:
                role = "commands pytest started (whole process trees)"
                commands[_command(origin["cmd"])] += c
                command_procs[_command(origin["cmd"])] += 1
        roles[role] += c
        counts[role] += 1
    total = sum(roles.values())
    lines = [f"{total:8.1f} core-s in all, {len(records)} processes; by role:"]
    for role, c in roles.most_common():
        lines.append(f"{c:8.1f} core-s {counts[role]:5d} processes  {role}")
    lines.append("\nthe suite's Ray: actors by class, and core-seconds a process on average")
    for kind, c in actors.most_common():
        n = counts[f"the suite's Ray: {kind}"]
        lines.append(f"{c:8.1f} core-s {n:5d} processes ({c / max(n, 1):4.1f} each)  {kind}")
    lines.append("\ncommands pytest started, each with its whole process tree (top 30)")
    for command, c in commands.most_common(30):
        lines.append(f"{c:8.1f} core-s {command_procs[command]:5d} processes  {command}")
    lines.append("\nactor processes of the suite's Ray started during a test (top 20)")
    for nodeid, n in actor_tests.most_common(20):
        lines.append(f"{n:5d}  {nodeid}")
    return "\n".join(lines)


def _new_file(prefix: str, suffix: str) -> str:
    """The path of a new, empty temporary file (made here, so no other process can take its name first)."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON with the report's inputs (default: a temporary file)")
    parser.add_argument("--attach", type=int, default=None, help="sample beside this running pytest until it exits")
    parser.add_argument("--tests-file", default=None, help="with --attach: its RAYDL_TEST_PROFILE_FILE")
    args, pytest_args = parser.parse_known_args()
    out = args.out or _new_file("raydl-suite-cost-", ".json")
    tests_file = args.tests_file or _new_file("raydl-suite-tests-", ".jsonl")
    sampler = Sampler()
    sampler.start()
    if args.attach is not None:
        pid, rc = args.attach, None
        while os.path.exists(f"/proc/{pid}"):
            time.sleep(1.0)
    else:
        env = dict(os.environ, RAYDL_TEST_PROFILE="1", RAYDL_TEST_PROFILE_FILE=tests_file)
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", *pytest_args], env=env)
        pid, rc = proc.pid, proc.wait()
    records = sampler.stop()
    tests = []
    if os.path.exists(tests_file):
        with open(tests_file) as f:
            tests = [json.loads(line) for line in f if line.strip()]
        if args.tests_file is None:
            os.remove(tests_file)
    with open(out, "w") as f:
        json.dump({"pytest_pid": pid, "records": records, "tests": tests}, f)
    print("\n" + report(records, tests, pid))
    print(f"\n(records: {out}; pytest exited with {rc})")
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
