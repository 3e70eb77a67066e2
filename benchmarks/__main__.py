"""`python -m benchmarks`: one command per comparison (benchmarks/registry.py), each run recorded.

    python -m benchmarks                      # the benchmarks, what each needs, its latest record
    python -m benchmarks NAME [--quick] [ARGS ...]   # run one; ARGS go to its script (`--help` lists them)
    python -m benchmarks readme [--check]     # benchmarks/README.md's tables from the latest records
    python -m benchmarks record NAME REPORT.md "COMMAND"   # a record from the report of a script run by hand

A full run that ends well writes benchmarks/records/NAME.json (commit it with the README it updates); `--quick` and
failed runs go to benchmarks/results/ (ignored). See benchmarks/common/records.py.
"""

from __future__ import annotations

import sys

from benchmarks.common import records
from benchmarks.registry import BENCHMARKS


def _list() -> None:
    print("| name | what | needs | full run | --quick | latest record |")
    print("|---|---|---|---|---|---|")
    for name, b in BENCHMARKS.items():
        rec = records.latest(name)
        when = f"{rec['commit']}, {rec['started_utc']}" if rec else "none"
        quick = " ".join(b.quick) or "-"
        print(f"| {name} | {b.what} | {b.needs or '-'} | ~{b.minutes:g} min | `{quick}` | {when} |")


def _readme(check: bool) -> int:
    with open(records.README) as f:
        text = f.read()
    missing = [n for n in BENCHMARKS if n not in records.blocks_in(text)]
    new = records.render_readme(BENCHMARKS, text)
    if check:
        stale = new != text
        for what, bad in (("without a block in the README", missing), ("out of date", ["a block"] if stale else [])):
            if bad:
                print(f"benchmarks/README.md: {', '.join(bad)} {what}; run `python -m benchmarks readme`")
        return 1 if missing or stale else 0
    with open(records.README, "w") as f:
        f.write(new)
    if missing:
        print(
            f"note: no README block for {', '.join(missing)} (add `<!-- record:NAME -->` ... `<!-- /record:NAME -->`)"
        )
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__)
        _list()
        return 0
    if argv[0] == "readme":
        return _readme("--check" in argv[1:])
    if argv[0] == "record":
        if len(argv) != 4 or argv[1] not in BENCHMARKS:
            print('usage: python -m benchmarks record NAME REPORT.md "python -m benchmarks.<script> ARGS"')
            return 2
        rec = records.from_report(argv[1], BENCHMARKS[argv[1]], argv[2], argv[3])
        print(f"[benchmarks] {len(rec['tables'])} tables -> {rec['path']}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"no benchmark named {name!r}; the names: {', '.join(BENCHMARKS)} (python -m benchmarks lists them)")
        return 2
    quick = "--quick" in rest
    rest = [a for a in rest if a != "--quick"]
    rec = records.run(name, BENCHMARKS[name], rest, quick)
    print(
        f"\n[benchmarks] {name}: exit {rec['rc']}, {rec['wall_s']:.0f} s, {len(rec['tables'])} tables -> {rec['path']}"
    )
    if rec["path"].startswith("benchmarks/records/"):
        print("[benchmarks] python -m benchmarks readme   # to put its tables in benchmarks/README.md")
    return 0 if rec["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
