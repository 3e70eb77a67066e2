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
        names |= _names_imported(node, package)
    return names


def _names_imported(node: ast.AST, package: str) -> set:
    """What an import statement in `package` imports, as absolute dotted names (empty for any other node)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return {module} | {f"{module}.{alias.name}" for alias in node.names}


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


def test_the_worker_shell_has_every_public_method_of_the_body():
    """Ray sees worker/shell.py's `Worker`, which forwards each call to worker/actor.py's `WorkerBody` (NOTE [ raydl
    worker shell ]): a public method of the body missing from the shell could never be called on an actor."""
    import inspect

    from raydl.worker.actor import WorkerBody
    from raydl.worker.shell import Worker

    def public(cls) -> dict:
        # (once `ray.remote` wrapped the shell's methods, Ray's tracing adds a `_ray_trace_ctx` keyword)
        return {
            name: [p for p in inspect.signature(fn).parameters if p != "_ray_trace_ctx"]
            for name, fn in vars(cls).items()
            if callable(fn) and not name.startswith("_")
        }

    body, shell = public(WorkerBody), public(Worker)
    assert set(shell) == set(body), set(body) ^ set(shell)
    for name, params in shell.items():  # the body's own parameters, or all of them passed on as they come
        assert params == body[name] or params == ["self", "args", "kwargs"], (name, params, body[name])


def test_the_code_that_creates_worker_actors_imports_no_torch():
    """A job's coordinator actor creates and replaces the job's workers (cluster/pool.py) without importing torch:
    the worker's body, which needs it, is imported in the worker actor only (NOTE [ raydl worker shell ])."""
    import subprocess
    import sys

    code = (
        "import sys, raydl.job.coordinator, raydl.cluster.pool, raydl.cluster.elastic, raydl.cluster.placement; "
        "print(sorted(m for m in ('torch', 'numpy', 'raydl.worker.actor') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(RAYDL.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(module_level: bool) -> dict:
    """raydl's modules and, for each, the raydl modules it imports: at module level only, or inside functions too.
    Imports under `if TYPE_CHECKING:` never count: they are type hints, not run."""
    paths = {_module_name(p): p for p in RAYDL.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        names: set = set()
        pending = list(ast.parse(path.read_text()).body)
        while pending:
            node = pending.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                pending.extend(node.orelse)
                continue
            if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            names |= _names_imported(node, package)
            pending.extend(ast.iter_child_nodes(node))
        graph[name] = {m for m in names if m in paths and m != name}
    return graph


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_at_module_level():
    """No circle of module-level imports inside raydl/ (imports under `if TYPE_CHECKING:` and inside functions aside)."""
    assert not _circles(_import_graph(module_level=True))


def test_no_import_circle_counting_function_level_imports():
    """No circle inside raydl/ even counting imports inside functions: a function-level import that closes a circle
    hides a dependency both ways (use TYPE_CHECKING for a type hint, or move the shared function down a layer)."""
    assert not _circles(_import_graph(module_level=False))


def test_the_circle_check_sees_a_circle():
    """Two modules importing each other make one circle; a chain without a way back makes none."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _circles(graph) == [["a", "b"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _defined_names(path: pathlib.Path) -> set:
    """The names a module's top level binds (definitions, assignments, imports, also under if/try), read from its
    source: nothing is imported (a benchmark module may set torch's threads when imported)."""
    names: set = set()

    def visit(body: list) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                    visit(part)

    visit(ast.parse(path.read_text()).body)
    return names


def _missing_imported_names(paths: list) -> list:
    """(file, module, name) for each `from X import name` of the project's own packages (raydl, tests, benchmarks,
    cluster) in `paths` that does not resolve: a script a refactor left behind fails only when someone runs it. A
    module with a module-level `__getattr__` (raydl's lazy names) is imported to ask it."""
    import importlib

    missing = []
    for path in paths:
        for node in ast.walk(ast.parse(pathlib.Path(path).read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module.split(".")[0] not in ("raydl", "tests", "benchmarks", "cluster"):
                continue
            base = RAYDL.parent.joinpath(*node.module.split("."))
            source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if not source.is_file() and not base.is_dir():
                missing.append((str(path), node.module, "*"))
                continue
            names = _defined_names(source) if source.is_file() else set()  # (a folder without __init__: its files)
            for alias in node.names:
                if alias.name in names or (base / f"{alias.name}.py").is_file() or (base / alias.name).is_dir():
                    continue
                if "__getattr__" in names and hasattr(importlib.import_module(node.module), alias.name):
                    continue
                missing.append((str(path), node.module, alias.name))
    return missing


def test_benchmarks_examples_and_cluster_scripts_import_names_that_exist():
    """The scripts no test runs whole (the benchmarks, the cluster tools; the examples too) import only names their
    modules still have."""
    root = RAYDL.parent
    paths = [p for d in ("benchmarks", "examples", "cluster") for p in sorted((root / d).rglob("*.py"))]
    assert len(paths) > 20
    assert _missing_imported_names(paths) == []


def test_the_import_check_sees_a_name_gone(tmp_path):
    script = tmp_path / "old_bench.py"
    script.write_text("from tests._netns_driver import state_cluster, _cluster\nfrom raydl.nowhere import x\n")
    assert _missing_imported_names([script]) == [
        (str(script), "tests._netns_driver", "_cluster"),
        (str(script), "raydl.nowhere", "*"),
    ]
