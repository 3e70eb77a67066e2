"""A batch of Arrow rows collated column by column: torch's `default_collate` of the rows, without the rows.

NOTE [ raydl columnar batches ]
`ArrowDataset` and `ParquetDataset` hand torch's DataLoader a list of row dicts, which
`default_collate` stacks back into one tensor per column: per-row Python both ways (95,000 rows/s
for 16 float columns, an int label and a 64-float embedding at batch 1024, issue 38). Where the
loader's `collate_fn` is torch's `default_collate` and the dataset has no per-row `transform`, a
raydl worker asks the dataset for the whole batch instead (`raydl_collate(indices)`): one `take`,
then each column converted as a whole through NumPy, giving exactly what `default_collate` of the
rows gives, key for key (the columns, in order), dtype for dtype and value for value:
  * integers -> int64 tensors, floats -> float64 tensors, booleans -> bool tensors (the rows hold
    Python ints, floats and bools, which torch collates so);
  * strings and binary -> the list of the batch's values (torch's collate leaves them as a list);
  * for `ArrowDataset` (rows hold lists of numbers as 1-D NumPy arrays): a list column whose rows
    all have one length -> a 2-D tensor of the list's own dtype (float32 stays float32).
Anything else, or anything the rows would not collate the same way (a null, rows of different
list lengths, uint64, nested or temporal types, duplicate column names, an empty batch): `None`,
and the worker takes the per-row path, which gives the batch (or raises the error) it always did.
`tests/test_columnar.py` compares the two paths over every Arrow type the datasets accept.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

__all__ = ["collate_columns"]


def collate_columns(table: pa.Table, lists_as_arrays: bool) -> Optional[dict]:
    """`default_collate` of `table`'s rows as dicts, built per column; None where only the rows give it exactly.

    `lists_as_arrays`: the rows hold lists of numbers as NumPy arrays (`ArrowDataset`), not Python lists."""
    names = table.column_names
    if table.num_rows == 0 or not names or len(set(names)) != len(names):
        return None
    out = {}
    for name, column in zip(names, table.columns):
        value = _collate_column(column, lists_as_arrays)
        if value is None:
            return None
        out[name] = value
    return out


def _fresh(array: np.ndarray, dtype: np.dtype) -> torch.Tensor:
    """A tensor over a private, writable copy of `array` as `dtype` (Arrow's own buffers are read-only)."""
    return torch.from_numpy(np.array(array, dtype=dtype, copy=True))


def _collate_column(column: pa.ChunkedArray, lists_as_arrays: bool) -> Optional[object]:
    t = column.type
    if column.null_count:
        return None
    if pa.types.is_boolean(t):
        return _fresh(column.to_numpy(), np.bool_)
    if pa.types.is_integer(t):
        if pa.types.is_uint64(t):  # Python ints past int64's range make torch's collate raise: rows decide
            return None
        return _fresh(column.to_numpy(), np.int64)
    if pa.types.is_floating(t):
        return _fresh(column.to_numpy(), np.float64)
    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return column.to_pylist()
    if lists_as_arrays and (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return _collate_lists(column)
    return None


def _collate_lists(column: pa.ChunkedArray) -> Optional[torch.Tensor]:
    """A list column whose rows are 1-D arrays of one length: stacked, as `default_collate` stacks them."""
    v = column.type.value_type
    if not (pa.types.is_integer(v) or pa.types.is_floating(v) or pa.types.is_boolean(v)):
        return None
    array = column.combine_chunks()
    lengths = pc.list_value_length(array)
    low, high = pc.min_max(lengths).values()
    if low.as_py() != high.as_py():
        return None  # rows of different lengths: torch's stack raises, as the rows' path shows
    values = array.flatten()  # the rows' values, offsets applied
    if values.null_count:
        return None
    dtype = np.dtype(v.to_pandas_dtype())
    return _fresh(values.to_numpy(zero_copy_only=False), dtype).reshape(len(array), high.as_py())
