"""Where a dataset's objects are: a brace pattern, a folder or prefix, or a list of URLs, on any pyarrow filesystem.

A brace pattern is WebDataset's notation (`train-{000000..000999}.tar`, `{a,b}`, several braces multiply):
numeric ranges keep the width of their first bound, as `braceexpand` (which WebDataset uses) does. A folder
or prefix gives every object under it whose name ends with one of the suffixes asked for, in name order.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional, Sequence, Union

__all__ = ["expand_braces", "list_objects", "path_of"]

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")


def _closing(text: str, start: int) -> int:
    """Index of the brace closing the one at `start`; -1 if it is never closed."""
    depth = 0
    for k in range(start, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return -1


def _split_top(body: str) -> list:
    """`body` split at the commas outside nested braces."""
    parts, depth, last = [], 0, 0
    for k, ch in enumerate(body):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[last:k])
            last = k + 1
    parts.append(body[last:])
    return parts


def expand_braces(pattern: str) -> list:
    """Every string a brace pattern names, in order: `a-{00..02}.tar` -> a-00.tar, a-01.tar, a-02.tar.

    Raises:
        ValueError: an unbalanced brace, or a range whose step is zero (the message quotes the pattern).
    """
    start = pattern.find("{")
    if start < 0:
        if "}" in pattern:
            raise ValueError(f"brace pattern {pattern!r}: a '}}' without its '{{'")
        return [pattern]
    end = _closing(pattern, start)
    if end < 0:
        raise ValueError(f"brace pattern {pattern!r}: the '{{' at position {start} is never closed")
    head, body, tail = pattern[:start], pattern[start + 1 : end], pattern[end + 1 :]
    if "}" in head:
        raise ValueError(f"brace pattern {pattern!r}: a '}}' without its '{{'")
    m = _RANGE.match(body)
    if m is not None:
        lo, hi = int(m.group(1)), int(m.group(2))
        step = abs(int(m.group(3))) if m.group(3) else 1
        if step == 0:
            raise ValueError(f"brace pattern {pattern!r}: a range's step cannot be 0")
        width = len(m.group(1)) if m.group(1).lstrip("-").startswith("0") else 0
        values = range(lo, hi + 1, step) if lo <= hi else range(lo, hi - 1, -step)
        options = [str(v).zfill(width) if width else str(v) for v in values]
    else:
        options = _split_top(body)
        if len(options) == 1:  # `{x}` alone is no choice: kept as written, as braceexpand keeps it
            options = ["{" + body + "}"]
            return [head + o + t for o in options for t in expand_braces(tail)]
    out = []
    for option in options:
        for rest in expand_braces(option + tail):
            out.append(head + rest)
    return out


def path_of(src: str, fs: Any) -> str:
    """The filesystem path of a URL: the scheme dropped (s3://bucket/key -> bucket/key), a local path made absolute
    (`file:data/x.tar`, webdataset's relative file URL, included)."""
    if "://" in src:
        return src.split("://", 1)[1]
    if src.startswith("file:"):
        src = src[len("file:") :]
    return os.path.abspath(src) if type(fs).__name__ == "LocalFileSystem" else src


def _url_of(src: str, path: str) -> str:
    """A listed object's URL in the form the source was given (scheme kept)."""
    if "://" in src:
        return src.split("://", 1)[0] + "://" + path
    return path


def list_objects(
    who: str, source: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]], filesystem: Any, suffixes: tuple
) -> tuple:
    """(filesystem, [(url, FileInfo)]) for a brace pattern, a folder or prefix, or a list of URLs.

    A folder gives the objects under it ending with one of `suffixes` (lower-cased comparison; `()` takes every
    object), in name order; a named object is taken whatever its name.

    Raises:
        FileNotFoundError: a named object or folder does not exist (each missing one is named, up to 5).
        ValueError: nothing given, a malformed brace pattern, or a folder with no object of the suffixes.
    """
    import pyarrow.fs as pafs

    sources = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not sources:
        raise ValueError(f"{who}: no source given: pass a brace pattern, a folder or prefix, or a list of URLs")
    urls: list = []
    for src in sources:
        src = os.fspath(src)
        urls.extend(expand_braces(src) if "{" in src or "}" in src else [src])
    fs: Optional[Any] = filesystem
    if fs is None:
        first = urls[0]
        fs, _ = pafs.FileSystem.from_uri(first if "://" in first else os.path.abspath(first.removeprefix("file:")))
    paths = [path_of(u, fs) for u in urls]
    infos = fs.get_file_info(paths)
    missing = [u for u, i in zip(urls, infos) if i.type == pafs.FileType.NotFound]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise FileNotFoundError(f"{who}: {', '.join(missing[:5])}{more} do(es) not exist")
    out: list = []
    for url, info in zip(urls, infos):
        if info.type != pafs.FileType.Directory:
            out.append((url, info))
            continue
        found = [
            i
            for i in fs.get_file_info(pafs.FileSelector(info.path, recursive=True))
            if i.type == pafs.FileType.File and (not suffixes or i.path.lower().endswith(suffixes))
        ]
        if not found:
            what = " or ".join(suffixes) if suffixes else "object"
            raise ValueError(f"{who}: no {what} under {url}")
        out.extend((_url_of(url, i.path), i) for i in sorted(found, key=lambda i: i.path))
    return fs, out
