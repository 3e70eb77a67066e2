"""Indexes a tar corpus ships with it, read instead of scanning its shards: DALI's `.idx` files, webdataset's `wids`.

NOTE [ raydl shipped indexes ]
  * DALI's `wds2idx` writes, beside each shard, a text file: `v1.2 <samples>`, then one line a sample of
    `<ext> <data offset> <size> <member name>` per member. `TarDataset(..., index="dali")` reads
    `<shard name>.idx` beside each shard (one small GET, where the scan reads the whole shard), groups the
    members by WebDataset's rule as a scan would (the extension lower-cased, `__*__` members skipped), and
    checks each range against the shard's size: a stale index fails naming the file, never serves other bytes.
  * A `wids` shard index (JSON with `"shardlist": [{"url", "nsamples"}, ...]`) names the shards and their
    sample counts, not where samples lie: given as the source, its shards are indexed as usual and each
    count is checked against what the shard holds (a mismatch names the shard and both counts).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any, Iterator

from .tar_index import TarFormatError, group_samples

__all__ = ["dali_reader", "wids_shards", "is_wids"]


def _idx_path(shard_path: str) -> str:
    base = shard_path[: -len(".tar")] if shard_path.endswith(".tar") else shard_path
    return base + ".idx"


def dali_reader(fs: Any) -> Any:
    """`shipped(url, info)` for `index_shards`: the samples of a shard from DALI's `.idx` file beside it."""

    def read(url: str, info: Any) -> list:
        idx = _idx_path(info.path)
        try:
            with fs.open_input_stream(idx) as f:
                text = f.read().decode("utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"TarDataset(index='dali'): {url} has no DALI index {idx} beside it") from None
        lines = text.splitlines()
        head = lines[0].split() if lines else []
        if len(head) != 2 or not head[0].startswith("v1."):
            raise TarFormatError(
                f"{idx}: not a DALI webdataset index (first line {lines[0]!r})" if lines else f"{idx}: empty"
            )
        size = int(info.size)
        samples: list = []
        for n, line in enumerate(lines[1:], start=2):
            parts = line.split()
            if not parts:
                continue
            if len(parts) % 4:
                raise TarFormatError(f"{idx}: line {n} is not groups of 'ext offset size name'")
            # a line holds one sample's members; grouped by the scan's own rule anyway (NOTE [ raydl tar index ])
            samples.extend(group_samples(_line_members(parts, idx, url, size), idx))
        if int(head[1]) != len(lines[1:]) - sum(1 for ln in lines[1:] if not ln.split()):
            raise TarFormatError(f"{idx}: says {head[1]} samples, lists {len(lines) - 1}")
        return samples

    return read


def _line_members(parts: list, idx: str, url: str, size: int) -> Iterator[tuple]:
    """(name, offset, size) of each member a DALI index line lists ('ext offset size name' groups), checked to lie
    within the shard's `size` bytes."""
    for _ext, off, nbytes, name in zip(parts[0::4], parts[1::4], parts[2::4], parts[3::4]):
        off, nbytes = int(off), int(nbytes)
        if off < 0 or off + nbytes > size:
            raise TarFormatError(
                f"{idx}: member {name} at bytes {off}-{off + nbytes} lies outside {url} ({size} bytes): the "
                "index does not belong to this shard (re-run wds2idx, or drop index='dali')"
            )
        yield name, off, nbytes


def is_wids(source: Any) -> bool:
    return isinstance(source, str) and source.lower().endswith(".json")


def wids_shards(fs: Any, url: str, path: str) -> list:
    """[(shard URL, samples it should hold)] of a wids shard index; relative URLs against the index's folder."""
    with fs.open_input_stream(path) as f:
        doc = json.loads(f.read().decode("utf-8"))
    shards = doc.get("shardlist") if isinstance(doc, dict) else None
    if not isinstance(shards, list) or not shards:
        raise ValueError(f"TarDataset: {url} is not a wids shard index (no 'shardlist' of shards)")
    base = url.rsplit("/", 1)[0] if "/" in url else "."
    out = []
    for s in shards:
        u = s["url"]
        if "://" not in u and not u.startswith("/"):
            u = posixpath.join(base, u)
        out.append((u, int(s["nsamples"])))
    return out
