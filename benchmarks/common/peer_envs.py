"""One virtual environment per streaming peer (Mosaic Streaming, litdata), built once and reused, for bench_peers.

Neither peer installs beside raydl's own environment (its torch and NumPy), so each gets a venv of its own under
`cache_root()` (~/.cache/raydl-bench-peers/<peer>-<pin>, or $RAYDL_BENCH_PEERS_CACHE): the peer pinned, beside the
same CPU torch as this process's (pip's configured indexes and find-links; a `torch==<this torch's version>`
constraint keeps pip from pulling a CUDA build and its GPU libraries). A venv is marked ready by a `.ready` file
written after its last install, so an interrupted build is redone, not reused. The peer's measurement then runs in a
child process with that venv's python (`child_command`).

Known traps, handled here and in bench_peers:
  * mosaicml-streaming imports torchvision (`streaming.vision`) at `import streaming`; a torchvision wheel built for
    another torch fails to load its operators, so a venv whose `import torchvision` fails gets a stand-in package
    (`stub/torchvision`, put first on the child's path) with just the names `streaming.vision` imports.
  * litdata's S3 client refuses a plain-http endpoint unless its storage options name one (bench_peers passes
    `endpoint_url`).

Imports nothing heavy: the parent that uses it runs raydl's own environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from benchmarks.common import REPO


@dataclass(frozen=True)
class Peer:
    name: str  # the name bench_peers uses: "mosaic", "litdata"
    requirement: str  # what pip installs
    dist: str  # its distribution name (for the version it reports)
    module: str  # what the child imports
    pin: str  # the folder's suffix


PEERS = {
    "mosaic": Peer("mosaic", "mosaicml-streaming==0.13.*", "mosaicml-streaming", "streaming", "0.13"),
    "litdata": Peer("litdata", "litdata==0.2.76", "litdata", "litdata", "0.2.76"),
}

# What `import streaming` takes from torchvision (streaming.vision's datasets): classes it subclasses or names only.
_TORCHVISION_STUB = {
    "__init__.py": '"""A stand-in torchvision for bench_peers\' Mosaic venv (its wheel does not load on CPU torch)."""\n'
    "from . import datasets, transforms  # noqa: F401\n__version__ = '0.0-stub'\n",
    "datasets/__init__.py": "from .vision import VisionDataset  # noqa: F401\n"
    "class CIFAR10:\n    pass\nclass ImageFolder:\n    pass\n",
    "datasets/vision.py": "import torch.utils.data\n"
    "class VisionDataset(torch.utils.data.Dataset):\n"
    "    def __init__(self, root=None, transforms=None, transform=None, target_transform=None):\n"
    "        self.root, self.transforms, self.transform = root, transforms, transform\n"
    "        self.target_transform = target_transform\n"
    "class StandardTransform:\n"
    "    def __init__(self, transform=None, target_transform=None):\n"
    "        self.transform, self.target_transform = transform, target_transform\n",
    "transforms/__init__.py": "from . import functional  # noqa: F401\n"
    "class Compose:\n    def __init__(self, ts):\n        self.ts = ts\n"
    "class ToTensor:\n    pass\n",
    "transforms/functional.py": "def to_tensor(pic):\n    raise NotImplementedError('bench_peers stand-in torchvision')\n",
}


def _write_stub(root: str) -> None:
    """The stand-in torchvision under <venv>/stub (rewritten on each use: cheap, and follows this file)."""
    for rel, text in _TORCHVISION_STUB.items():
        path = os.path.join(root, "stub", "torchvision", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def cache_root() -> str:
    return os.environ.get("RAYDL_BENCH_PEERS_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "raydl-bench-peers"
    )


def venv_dir(peer: str) -> str:
    p = PEERS[peer]
    return os.path.join(cache_root(), f"{p.name}-{p.pin}")


def venv_python(peer: str) -> str:
    return os.path.join(venv_dir(peer), "bin", "python")


def _torch_version() -> str:
    """This environment's torch version (read from its metadata, without importing torch)."""
    from importlib.metadata import version

    return version("torch")


def _run(cmd: list, log, timeout_s: float) -> None:
    log(f"$ {' '.join(cmd)}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:4])}... failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )


def ensure_venv(peer: str, log=print, timeout_s: float = 1200.0) -> str:
    """The peer's venv (built now unless a ready one is there); returns its python."""
    p = PEERS[peer]
    root = venv_dir(peer)
    py = venv_python(peer)
    ready = os.path.join(root, ".ready")
    if os.path.exists(ready):
        if os.path.isdir(os.path.join(root, "stub")):
            _write_stub(root)
        return py
    t0 = time.perf_counter()
    os.makedirs(cache_root(), exist_ok=True)
    if not os.path.exists(py):
        _run([sys.executable, "-m", "venv", root], log, 120)
    constraints = os.path.join(root, "constraints.txt")
    with open(constraints, "w") as f:
        f.write(f"torch=={_torch_version()}\n")
    pip = [py, "-m", "pip", "install", "-q", "--prefer-binary", "-c", constraints]
    _run([*pip, f"torch=={_torch_version()}"], log, timeout_s)  # the CPU build first (find-links, or the index)
    _run([*pip, p.requirement], log, timeout_s)
    if peer == "mosaic":
        probe = subprocess.run([py, "-c", "import torchvision"], capture_output=True, text=True, timeout=120)
        if probe.returncode != 0:
            log(f"{peer}: its torchvision does not import ({probe.stderr.strip().splitlines()[-1:]}); a stand-in")
            _write_stub(root)
    with open(ready, "w") as f:
        f.write(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    log(f"{peer}: venv built in {time.perf_counter() - t0:.0f} s at {root}")
    return py


def child_env(peer: str) -> dict:
    """The child's environment: the repository (and a stand-in torchvision, if the venv has one) on its path."""
    env = dict(os.environ)
    paths = [REPO]
    stub = os.path.join(venv_dir(peer), "stub")
    if os.path.isdir(stub):
        paths.insert(0, stub)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("VIRTUAL_ENV", None)
    return env


def peer_version(peer: str, timeout_s: float = 60.0) -> dict:
    """The versions the peer's venv holds: the peer, torch, numpy, python."""
    p = PEERS[peer]
    code = (
        "import json, sys\nfrom importlib.metadata import version\n"
        f"print(json.dumps({{'{p.dist}': version('{p.dist}'), 'torch': version('torch'), "
        "'numpy': version('numpy'), 'python': sys.version.split()[0]}))"
    )
    out = subprocess.run(
        [venv_python(peer), "-c", code], capture_output=True, text=True, timeout=timeout_s, env=child_env(peer)
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def child_command(peer: str, script: str, *args: str) -> list:
    """`python -m benchmarks.<script> *args` with the peer's venv python (run it with cwd=REPO, env=child_env)."""
    return [venv_python(peer), "-m", f"benchmarks.{script}", *args]


if __name__ == "__main__":
    for name in sys.argv[1:] or list(PEERS):
        ensure_venv(name)
        print(name, peer_version(name))
