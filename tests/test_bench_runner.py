"""`python -m benchmarks`: a run becomes a record, a record becomes the README's tables, a hang is stopped.

No Ray and no benchmark runs here: a stand-in script (tests/_bench_fake.py) prints a report, and the real
benchmarks/README.md is checked against the records committed beside it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.common import records
from benchmarks.registry import BENCHMARKS, Bench

FAKE = Bench("tests._bench_fake", "a stand-in", quick=("--quick-arg",), minutes=0.1, timeout=20)


@pytest.fixture
def folders(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RECORDS_DIR", str(tmp_path / "records"))
    monkeypatch.setattr(records, "RESULTS_DIR", str(tmp_path / "results"))
    return tmp_path


def test_tables_of_a_report_with_their_titles():
    report = '# t\n\n**Epochs**\n{"json": 1}\n| a | b |\n|---|---|\n| 1 | 2 |\ntext | with a pipe\n| not | a table |\n'
    (table,) = records.tables_of(report)
    assert table == {"title": "**Epochs**", "markdown": "| a | b |\n|---|---|\n| 1 | 2 |"}


def test_a_full_run_is_a_record_and_a_readme_block(folders, capsys):
    rec = records.run("fake", FAKE, [], quick=False)
    assert rec["rc"] == 0 and rec["path"].endswith("records/fake.json"), rec["path"]
    assert [t["title"] for t in rec["tables"]] == ["**Epochs**", "a line with | a pipe, not a table"]
    assert rec["command"] == "python -m benchmarks fake" and rec["argv"] == []
    assert "| raydl | 10 |" in capsys.readouterr().out  # the report passes through as it runs
    saved = records.latest("fake")
    assert saved is not None and saved["tables"] == rec["tables"] and saved["commit"] == rec["commit"]

    text = (
        "intro\n<!-- record:fake -->\nold\n<!-- /record:fake -->\n<!-- record:other -->\nkept\n<!-- /record:other -->\n"
    )
    new = records.render_readme({"fake": Bench("tests._bench_fake", "x", tables=(1,))}, text)
    block = new.split("<!-- record:fake -->\n")[1].split("<!-- /record:fake -->")[0]
    assert block.startswith(f"`python -m benchmarks fake` at raydl {rec['commit']}")
    assert "| quarter | 0.91 |" in block and "| raydl | 10 |" not in block  # only the table asked for
    assert "kept" in new and records.render_readme({"fake": FAKE}, new) != text


@pytest.mark.parametrize("how", ["quick", "fail"])
def test_a_quick_or_failed_run_never_replaces_the_record(folders, how):
    rec = records.run("fake", FAKE, ["--fail"] if how == "fail" else [], quick=how == "quick")
    assert rec["rc"] == (0 if how == "quick" else 3)
    assert rec["path"].startswith(os.path.relpath(str(folders / "results"), records.REPO)), rec["path"]
    assert records.latest("fake") is None
    if how == "quick":
        assert rec["argv"] == ["--quick-arg"] and rec["command"] == "python -m benchmarks fake --quick"


def test_a_hung_run_is_stopped_with_its_children(folders):
    pid_file = folders / "grandchild.pid"
    hung = Bench("tests._bench_fake", "hangs", timeout=3)
    t0 = time.monotonic()
    rec = records.run("fake", hung, ["--hang", "--child-pid-file", str(pid_file)], quick=False)
    assert rec["rc"] == "timeout" and time.monotonic() - t0 < 30
    assert len(rec["tables"]) == 2  # what it printed before it hung is kept, in results/
    assert records.latest("fake") is None
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "the benchmark's own child outlived the timeout"


def test_a_runner_stopped_by_sigterm_stops_the_benchmark(folders):
    """`timeout 270 python -m benchmarks gpu` (benchmarks/device_gpu_check.sh): the benchmark runs in a session of its
    own, so the runner must pass the stop on."""
    pid_file = folders / "grandchild.pid"
    code = (
        "import sys; from benchmarks.common import records; from benchmarks.registry import Bench; "
        f"records.RESULTS_DIR = {str(folders / 'results')!r}; records.RECORDS_DIR = {str(folders / 'records')!r}; "
        f"records.run('fake', Bench('tests._bench_fake', 'x', timeout=300), ['--hang', '--child-pid-file', "
        f"{str(pid_file)!r}], quick=False)"
    )
    runner = subprocess.Popen([sys.executable, "-c", code], cwd=records.REPO, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and runner.poll() is None, "the stand-in never started"
        time.sleep(0.05)
    time.sleep(0.3)
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=60) == 128 + signal.SIGTERM
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "the benchmark's child outlived its runner"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_record_from_a_report_written_by_hand(folders):
    report = folders / "bench_x-20261129-112928.md"
    report.write_text("Machine: 2 CPUs; raydl at e0d9e27; load average at start 0.95 / 1.8\n\n| a |\n|---|\n| 1 |\n")
    rec = records.from_report("fake", FAKE, str(report), "python -m benchmarks.bench_x --cap-s 240")
    assert (rec["commit"], rec["started_utc"], rec["loadavg_start"]) == ("e0d9e27", "2026-11-29 11:29", [0.95])
    assert rec["argv"] == ["--cap-s", "240"] and records.latest("fake")["tables"] == rec["tables"]


def test_the_readme_has_a_block_per_benchmark_made_from_its_latest_record():
    """A record committed without `python -m benchmarks readme`, or a benchmark with no block, fails here."""
    with open(records.README) as f:
        text = f.read()
    assert set(records.blocks_in(text)) >= set(BENCHMARKS), set(BENCHMARKS) - set(records.blocks_in(text))
    assert records.render_readme(BENCHMARKS, text) == text, "run `python -m benchmarks readme`"
    for name in BENCHMARKS:
        rec = records.latest(name)
        if rec is not None:
            assert rec["name"] == name and rec["rc"] == 0 and not rec["quick"] and rec["tables"], name
            json.dumps(rec)
