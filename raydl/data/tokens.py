"""Token sequences of varying length made into padded or packed tensors, a whole batch at a time.

NOTE [ raydl token batches ]
A column of token ids (Arrow `list<int>`) has a different length per row, so torch's collate cannot
stack it and a batch transform cannot return it as one column (NOTE [ raydl batch transforms ] in
data/columnar.py). `pad_tokens` and `pack_tokens` turn the batch's sequences into rectangular tensors
without a Python loop over tokens: the sequences are read as one flat array of values and one of
lengths (straight from Arrow's buffers for a pyarrow array), and each output token is placed by one
vectorized gather (`pad_tokens`) or scatter (`pack_tokens`). Both are plain functions of the batch:
the same sequences give the same tensors in any process, at any worker count.
  * `pad_tokens`: row i holds sequence i, padded to the longest of the batch (or to `max_length`),
    with an attention mask (1 on tokens) and the lengths.
  * `pack_tokens`: the sequences, in order, laid end to end into rows of `max_length` tokens; a
    sequence that does not fit in the row's space left starts the next row (none is split), so rows
    keep whole sequences and a batch has fewer rows than sequences. `segment_ids` (1, 2, ... per
    sequence of a row, 0 on padding) and `position_ids` (0, 1, ... within each sequence) let a model
    keep the sequences of a row apart (a block-diagonal attention mask, per-sequence positions).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

__all__ = ["pad_tokens", "pack_tokens"]


def pad_tokens(
    sequences: Any,
    *,
    max_length: Optional[int] = None,
    pad_value: int = 0,
    truncate: bool = False,
    side: str = "right",
    dtype: torch.dtype = torch.int64,
) -> dict:
    """Sequences of token ids as one padded tensor, its attention mask and the lengths.

    Example (in a dataset's ``batch_transform``, over a ``list<int>`` column ``"tokens"``)::

        ds = raydl.ArrowDataset(table, batch_transform=lambda b: raydl.pad_tokens(b["tokens"], max_length=512))

    Args:
        sequences: the batch's sequences: a pyarrow list array (or chunked array) of integers,
            a NumPy object array of 1-D integer arrays (what a batch transform receives for a
            ``list<int>`` column), a 2-D integer array or tensor, or a list of lists / arrays /
            tensors of integers.
        max_length (int, optional): the width of the result. Defaults to ``None`` (the longest
            sequence of the batch).
        pad_value (int): the id written after (or before) each sequence. Defaults to ``0``.
        truncate (bool): keep the first `max_length` tokens of a longer sequence instead of
            raising. Defaults to ``False``.
        side (str): ``"right"`` (tokens first, then padding) or ``"left"``. Defaults to ``"right"``.
        dtype (torch.dtype): the integer dtype of ``input_ids``. Defaults to ``torch.int64``.

    Returns:
        dict: ``input_ids`` (n, L) of `dtype`, ``attention_mask`` (n, L) int64 (1 on tokens, 0 on
        padding) and ``lengths`` (n,) int64 (tokens kept per sequence).

    Raises:
        TypeError: sequences that are not sequences of integers (the row is named).
        ValueError: no sequence, a null, a bad `max_length` or `side`, a sequence longer than
            `max_length` without `truncate`, or ids that `dtype` cannot hold.
    """
    if side not in ("right", "left"):
        raise ValueError(f"pad_tokens: side should be 'right' or 'left', got {side!r}")
    values, lengths = _ragged(sequences, "pad_tokens")
    width = int(lengths.max()) if max_length is None else _check_length(max_length, "pad_tokens")
    kept = _kept(lengths, width, truncate, "pad_tokens")
    np_dtype = _np_dtype(dtype, values, pad_value, "pad_tokens")
    cols = np.arange(width, dtype=np.int64)
    mask = cols < kept[:, None] if side == "right" else cols >= (width - kept)[:, None]
    if (kept < lengths).any():  # truncated: only the first `kept` tokens of each sequence stay
        values = values[_places(lengths) < np.repeat(kept, lengths)]
    ids = np.full((len(lengths), width), pad_value, dtype=np_dtype)
    ids[mask] = values  # the mask's cells, row by row, are the kept tokens in order
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(mask.astype(np.int64)),
        "lengths": torch.from_numpy(kept),
    }


def pack_tokens(
    sequences: Any,
    max_length: int,
    *,
    pad_value: int = 0,
    truncate: bool = False,
    dtype: torch.dtype = torch.int64,
) -> dict:
    """Sequences of token ids laid end to end in rows of `max_length` tokens, in order (NOTE [ raydl token batches ]).

    Example (a batch transform: its batches have as many rows as the packing needs)::

        ds = raydl.ArrowDataset(table, batch_transform=lambda b: raydl.pack_tokens(b["tokens"], 2048))

    Args:
        sequences: as for `pad_tokens`.
        max_length (int): tokens per row.
        pad_value (int): the id written after the last sequence of a row. Defaults to ``0``.
        truncate (bool): keep the first `max_length` tokens of a longer sequence instead of
            raising. Defaults to ``False``.
        dtype (torch.dtype): the integer dtype of ``input_ids``. Defaults to ``torch.int64``.

    Returns:
        dict: ``input_ids`` (m, max_length) of `dtype`; ``segment_ids`` (m, max_length) int64,
        1, 2, ... for the sequences of a row and 0 on padding; ``position_ids`` (m, max_length)
        int64, each token's place in its sequence (0 on padding); ``attention_mask`` (m,
        max_length) int64, 1 on tokens. Empty sequences take no place; m is 0 when all are.

    Raises:
        TypeError, ValueError: as `pad_tokens`.
    """
    values, lengths = _ragged(sequences, "pack_tokens")
    width = _check_length(max_length, "pack_tokens")
    kept = _kept(lengths, width, truncate, "pack_tokens")
    np_dtype = _np_dtype(dtype, values, pad_value, "pack_tokens")
    # Each sequence's row, column and number within its row: next-fit, one step per sequence (not per token).
    row, col, seg = (np.zeros(len(kept), dtype=np.int64) for _ in range(3))
    r, fill, s = 0, 0, 0
    for i, k in enumerate(kept.tolist()):
        if k == 0:
            continue
        if fill + k > width:
            r, fill, s = r + 1, 0, 0
        s += 1
        row[i], col[i], seg[i] = r, fill, s
        fill += k
    rows = r + 1 if kept.any() else 0
    if (kept < lengths).any():  # truncated: only the first `kept` tokens of each sequence stay
        values = values[_places(lengths) < np.repeat(kept, lengths)]
    # Every kept token, in order: its sequence, its place in it, and where it goes.
    owner = np.repeat(np.arange(len(kept)), kept)
    place = _places(kept)
    at = (row[owner], col[owner] + place)
    ids = np.full((rows, width), pad_value, dtype=np_dtype)
    ids[at] = values
    segment_ids = np.zeros((rows, width), dtype=np.int64)
    segment_ids[at] = seg[owner]
    position_ids = np.zeros((rows, width), dtype=np.int64)
    position_ids[at] = place
    return {
        "input_ids": torch.from_numpy(ids),
        "segment_ids": torch.from_numpy(segment_ids),
        "position_ids": torch.from_numpy(position_ids),
        "attention_mask": torch.from_numpy((segment_ids > 0).astype(np.int64)),
    }


def _places(lengths: np.ndarray) -> np.ndarray:
    """Each token's place in its sequence (0, 1, ...), for sequences of `lengths` laid end to end."""
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)


# ---------------------------------------------------------------------- the sequences as (values, lengths)


def _ragged(sequences: Any, who: str) -> tuple:
    """(every token id in order, as one integer array; each sequence's length) of `sequences`."""
    import sys

    pa = sys.modules.get("pyarrow")  # a pyarrow array can only come from a process that imported pyarrow
    if pa is not None and isinstance(sequences, (pa.Array, pa.ChunkedArray)):
        values, lengths = _from_arrow(sequences, pa, who)
    elif isinstance(sequences, (np.ndarray, torch.Tensor)) and sequences.ndim == 2:
        rows = sequences.numpy() if isinstance(sequences, torch.Tensor) else sequences
        values = _integers(rows.reshape(-1), who, "the array")
        lengths = np.full(rows.shape[0], rows.shape[1], dtype=np.int64)
    elif isinstance(sequences, (np.ndarray, list, tuple)) and (
        not isinstance(sequences, np.ndarray) or sequences.ndim == 1
    ):
        values, lengths = _joined(sequences)
        if values is None:  # not every row a 1-D array of integers: row by row, to name the first bad one
            parts = [_row(s, i, who) for i, s in enumerate(sequences)]
            lengths = np.array([len(p) for p in parts], dtype=np.int64)
            values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    else:
        raise TypeError(
            f"{who}: expected the batch's sequences of token ids (a pyarrow list array, a NumPy array of arrays, a "
            f"2-D array or tensor, or a list of lists), got {type(sequences).__name__}{_shape(sequences)}"
        )
    if len(lengths) == 0:
        raise ValueError(f"{who}: no sequence given")
    return values, lengths


def _joined(sequences: Any) -> tuple:
    """(values, lengths) in one concatenation when every row is a 1-D NumPy array of integers (what a batch
    transform receives for a list column); (None, None) otherwise."""
    if not len(sequences) or not all(isinstance(s, np.ndarray) and s.ndim == 1 for s in sequences):
        return None, None
    values = np.concatenate(sequences)
    if values.dtype.kind not in "iu" or (
        values.dtype.kind == "u" and values.size and values.max() > np.iinfo(np.int64).max
    ):
        return None, None
    return values, np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))


def _from_arrow(sequences: Any, pa: Any, who: str) -> tuple:
    import pyarrow.compute as pc

    array = sequences.combine_chunks() if isinstance(sequences, pa.ChunkedArray) else sequences
    t = array.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        raise TypeError(f"{who}: expected a pyarrow list array of token ids, got one of {t}")
    if array.null_count:
        raise ValueError(f"{who}: sequence {_first_null(array)} is null; drop or fill it first")
    flat = array.flatten()
    if flat.null_count:
        raise ValueError(f"{who}: a sequence holds a null token id (in sequence {_first_null_inside(array, pc)})")
    values = _integers(flat.to_numpy(zero_copy_only=False), who, "the array")
    return values, pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)


def _first_null(array: Any) -> int:
    return int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])


def _first_null_inside(array: Any, pc: Any) -> int:
    """The sequence that holds the first null token id."""
    first = _first_null(array.flatten())
    ends = np.cumsum(pc.list_value_length(array).to_numpy(zero_copy_only=False))
    return int(np.searchsorted(ends, first, side="right"))


def _row(seq: Any, i: int, who: str) -> np.ndarray:
    if isinstance(seq, torch.Tensor):
        seq = seq.numpy()
    try:
        a = np.asarray(seq)
    except ValueError:
        a = None
    if seq is None or a is None or a.ndim != 1:
        raise TypeError(f"{who}: sequence {i} is not a 1-D sequence of token ids: {seq!r:.80}")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    return _integers(a, who, f"sequence {i}")


def _integers(a: np.ndarray, who: str, what: str) -> np.ndarray:
    if a.dtype.kind not in "iu":
        raise TypeError(f"{who}: token ids should be integers; {what} holds {a.dtype}")
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{who}: {what} holds ids past int64's range")
    return a  # in its own dtype: written into the result as it is


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f" of shape {tuple(shape)}" if shape is not None else ""


def _check_length(max_length: Any, who: str) -> int:
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 1:
        raise ValueError(f"{who}: max_length should be a positive int, got {max_length!r}")
    return int(max_length)


def _kept(lengths: np.ndarray, width: int, truncate: bool, who: str) -> np.ndarray:
    """Tokens kept of each sequence; a sequence longer than `width` raises unless `truncate`."""
    if not truncate and (lengths > width).any():
        i = int(np.flatnonzero(lengths > width)[0])
        raise ValueError(
            f"{who}: sequence {i} has {int(lengths[i])} tokens, more than max_length={width}: raise max_length, or "
            "pass truncate=True to keep the first max_length tokens"
        )
    return np.minimum(lengths, width)


def _np_dtype(dtype: torch.dtype, values: np.ndarray, pad_value: int, who: str) -> np.dtype:
    """`dtype` as NumPy's; refuses a non-integer dtype and ids (or `pad_value`) it cannot hold."""
    if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"{who}: dtype should be an integer torch dtype (e.g. torch.int64), got {dtype!r}")
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    info = np.iinfo(np_dtype)
    low = min(int(values.min()), pad_value) if values.size else pad_value
    high = max(int(values.max()), pad_value) if values.size else pad_value
    if low < info.min or high > info.max:
        raise ValueError(
            f"{who}: ids (and pad_value) span {low}..{high}, which {dtype} cannot hold; pass a wider dtype"
        )
    return np_dtype
