"""The package's layout rules that code review alone would let slip: what runs in a worker never imports the driver."""

from __future__ import annotations

import ast
import pathlib

RAYDL = pathlib.Path(__file__).resolve().parent.parent / "raydl"


def _imported_modules(path: pathlib.Path, package: str = "") -> set:
    """Every module `path` (of `package`, by default where it lies) imports, as absolute dotted names."""
    package = package or ".".join(path.relative_to(RAYDL.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_worker_code_never_imports_driver_or_job():
    """Nothing under raydl/worker/ imports raydl.driver or raydl.job, at module level or inside a function."""
    offenders = {}
    for path in sorted((RAYDL / "worker").glob("*.py")):
        bad = sorted(m for m in _imported_modules(path) if m.startswith(("raydl.driver", "raydl.job")))
        if bad:
            offenders[path.name] = bad
    assert not offenders, (
        f"worker modules import the trainer's side: {offenders} (move shared code to raydl/_measures.py)"
    )


def test_the_rule_sees_a_relative_import(tmp_path):
    """The scan resolves `from ..driver.stats import x` inside raydl/worker/ to raydl.driver.stats."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..driver.stats import LoaderStats\n")
    assert "raydl.driver.stats" in _imported_modules(probe, package="raydl.worker")


def test_py_typed_ships():
    """raydl/py.typed exists and pyproject.toml ships it as package data."""
    assert (RAYDL / "py.typed").exists()
    assert '"py.typed"' in (RAYDL.parent / "pyproject.toml").read_text()


def test_importing_raydl_does_not_import_ray():
    """Ray reads its auth mode and loopback flag once, when first imported: raydl imports it only when it connects
    (NOTE [ raydl node Ray ]), so no module the driver imports may import Ray at import time (a worker module did:
    torchrun ranks joining the node's Ray lost their token)."""
    import subprocess
    import sys

    code = (
        "import sys, raydl, raydl.driver.iter, raydl.driver.coldstart.iter, raydl.worker.actor, raydl.worker.lane; "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "importing raydl imported Ray"
