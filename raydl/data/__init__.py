"""What is shipped to the workers and the data sources: the payload put once in the object store, shared
Arrow memory, checks of what cannot be pickled, raydl.ArrowDataset, and the token helpers of batch transforms
(`raydl.data.pad_tokens`, `raydl.data.pack_tokens`, also `raydl.pad_tokens` / `raydl.pack_tokens`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["pad_tokens", "pack_tokens"]


def __getattr__(name: str) -> Any:
    # On first use (PEP 562): a worker imports this package for data/share.py and needs none of these.
    if name in __all__:
        from . import tokens

        return getattr(tokens, name)
    raise AttributeError(f"module 'raydl.data' has no attribute {name!r}")
