"""Every ```python block of README.md and docs/*.md runs, and every relative link points to a file.

Each block is executed with exec() in a fresh namespace inside this process, on the suite's shared
Ray (`ray_session`): a new interpreter per block would start a new Ray each time. Blocks are
self-contained with tiny data where that reads naturally. A block that is a fragment has a hidden
set-up named in an HTML comment on the line right before its fence:

    <!-- doc-test: setup=NAME (what it provides) -->   run SETUPS[NAME] first, in the same namespace
    <!-- doc-test: syntax-only (why) -->                only compile() it (needs a cluster, a GPU, a launcher)

A block must end its loaders (`loader.shutdown()`, `with loader:` or an exhausted iterator): a
persistent loader left with live workers fails its test.
"""

from __future__ import annotations

import contextlib
import gc
import re
import socket
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED_FILES = [*DOC_FILES, REPO / "benchmarks" / "README.md"]

# A fence, possibly indented (a block inside a list item), with the line before it (a directive or not).
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*(?P<body>.*?)\s*-->")
# The namespace's module name: not in sys.modules, so cloudpickle ships the blocks' classes and
# functions to Ray's workers by value, as it does for a script's __main__.
_BLOCK_MODULE = "raydl_doc_block"


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code (dedented) and its directive, if any."""

    path: Path
    line: int
    code: str
    directive: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def syntax_only(self) -> bool:
        return self.directive.startswith("syntax-only")

    @property
    def setup(self) -> str | None:
        m = re.match(r"setup=(\w+)", self.directive)
        return m.group(1) if m else None


def _blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        d = _DIRECTIVE.fullmatch(before)
        out.append(Block(path, line, textwrap.dedent(m.group("code")), d.group("body") if d else ""))
    return out


BLOCKS = [b for path in DOC_FILES for b in _blocks(path)]


# ---------------------------------------------------------------------------- hidden set-ups

_DATASET = """
import torch
from torch.utils.data import TensorDataset

dataset = TensorDataset(torch.arange(32))
"""

_DECODE = """
import torch


def decode(row):
    return torch.zeros(3), row["label"]  # stands for reading and decoding the image at row["path"]
"""

_LOAD = """
import torch

paths = [f"images/{i:08d}.jpg" for i in range(32)]


def load(path):
    return torch.tensor(len(path))  # stands for reading the file
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _ddp_rank(ns: dict, monkeypatch):
    """A 1-rank gloo process group, as a DDP script has, with MASTER_ADDR/MASTER_PORT naming the job."""
    import torch.distributed as dist

    port = _free_port()
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        exec(_DATASET, ns)
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _metadata_folder(ns: dict, monkeypatch):
    """meta/part-0.parquet (64 rows of path, label, caption) in the current directory, and `decode`."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs("meta", exist_ok=True)
    n = 64
    table = pa.table(
        {
            "path": [f"images/{i:08d}.jpg" for i in range(n)],
            "label": [i % 10 for i in range(n)],
            "caption": [f"picture {i}" for i in range(n)],
        }
    )
    pq.write_table(table, "meta/part-0.parquet")
    exec(_DECODE, ns)
    yield


@contextlib.contextmanager
def _image_paths(ns: dict, monkeypatch):
    """`paths` (32 file names) and `load(path)`."""
    exec(_LOAD, ns)
    yield


SETUPS = {"ddp_rank": _ddp_rank, "metadata_folder": _metadata_folder, "image_paths": _image_paths}


# ---------------------------------------------------------------------------- tests


def test_the_docs_have_python_blocks():
    """The extraction finds blocks: README.md, at least six pages in docs/, and runnable blocks in most."""
    assert (REPO / "README.md") in DOC_FILES
    assert len(DOC_FILES) >= 7, [p.name for p in DOC_FILES]
    assert len(BLOCKS) >= 10, [b.name for b in BLOCKS]
    assert sum(not b.syntax_only for b in BLOCKS) >= 8
    assert any(b.path.name == "README.md" and not b.syntax_only for b in BLOCKS)


def test_every_directive_is_known_and_sits_on_a_fence():
    """A doc-test comment names a known set-up or says syntax-only, on the line right before a ```python fence."""
    for path in DOC_FILES:
        text = path.read_text()
        on_fences = sum(1 for b in BLOCKS if b.path == path and b.directive)
        assert len(_DIRECTIVE.findall(text)) == on_fences, f"{path.name}: a doc-test comment not right before a fence"
    for b in BLOCKS:
        if b.directive:
            assert b.syntax_only or b.setup in SETUPS, f"{b.name}: unknown doc-test directive {b.directive!r}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.syntax_only], ids=lambda b: b.name)
def test_syntax_only_block_compiles(block):
    """A block that needs a cluster, a GPU or a launcher at least compiles."""
    compile(block.code, block.name, "exec")


@pytest.mark.usefixtures("release_warm_workers_after_module")
@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.syntax_only], ids=lambda b: b.name)
def test_block_runs(block, ray_session, tmp_path, monkeypatch):
    """The block runs to its end on the local Ray (in a temporary directory) and releases its workers."""
    import raydl

    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": _BLOCK_MODULE}
    setup = SETUPS[block.setup](ns, monkeypatch) if block.setup else contextlib.nullcontext()
    try:
        with setup:
            exec(compile(block.code, block.name, "exec"), ns)
            # Private by necessity: whether a persistent loader still holds its workers.
            held = [k for k, v in ns.items() if isinstance(v, raydl.DataLoader) and v._iterator is not None]
            for k in held:
                ns[k].shutdown()
            assert not held, f"{block.name} leaves persistent workers running: call {held[0]}.shutdown() or use `with`"
    finally:
        raydl.unpatch()
        ns.clear()
        gc.collect()


# ---------------------------------------------------------------------------- links

_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced blocks and inline code, where Markdown links live."""
    text = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (outside fenced blocks)."""
    text = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("path", LINKED_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_files_that_exist(path):
    """Every relative link (and its #anchor, for a Markdown file) in README.md, docs/ and benchmarks/README.md resolves."""
    broken = []
    relative = 0
    for m in _LINK.finditer(_prose(path.read_text())):
        target = m.group("target")
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        relative += 1
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{path.relative_to(REPO)}: {broken}"
    if path.name == "README.md" and path.parent == REPO:
        assert relative >= 10, "the link extraction found almost no links in README.md"
