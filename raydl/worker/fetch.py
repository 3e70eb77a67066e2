"""Turn one unit of work (a list of indices, or one index) into one batch, inside a worker.

raydl's own fetchers: torch's are private. Their behaviour is torch's, to the bit:
  * map-style: `dataset.__getitems__(indices)` when the dataset defines it, else
    `[dataset[i] for i in indices]`, then `collate_fn`; without auto-batching,
    `collate_fn(dataset[index])`.
  * iterable-style: the worker's own iterator over its replica; a batch takes up to
    `batch_size` items; an empty batch, or a short one with drop_last, ends the stream.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

__all__ = ["MapFetcher", "IterableFetcher", "StreamEnd", "StartFailed", "warn_if_length_exceeded"]


def warn_if_length_exceeded(dataset: Any, len_called: Any, num_yielded: int, multiprocess: bool) -> None:
    """torch's warning, with its text, when an IterableDataset yields more than the len() it reported.

    Called from an iterator's `__next__`: the warning points at the caller of `next()`.
    """
    if len_called is None or num_yielded <= len_called:
        return
    import warnings

    hint = (
        "For multiprocessing data-loading, this could be caused by not properly configuring the "
        "IterableDataset replica at each worker. Please see "
        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
        if multiprocess
        else ""
    )
    warnings.warn(
        f"Length of IterableDataset {dataset} was reported to be {len_called}"
        f"(when accessing len(dataloader)), but {num_yielded} samples have been fetched. " + hint,
        stacklevel=3,
    )


class _WorkerSignal:
    """A worker's answer to `fetch` that is not a batch; it names the worker."""

    __slots__ = ("worker_id",)

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id

    def __reduce__(self):
        return (type(self), (self.worker_id,))


class StreamEnd(_WorkerSignal):
    """Returned by an iterable worker whose replica is exhausted (torch's `_IterableDatasetStopIteration`)."""

    __slots__ = ()


class StartFailed(_WorkerSignal):
    """Returned by `fetch` on a worker whose `configure` failed.

    The driver has already raised configure's error (it waits for every worker to start before
    reading a batch); raising it again from each queued fetch would only make Ray print it once
    per prefetched batch as an unhandled error.
    """

    __slots__ = ()


class MapFetcher:
    """Fetch from a map-style dataset by index or by list of indices.

    With `threads > 1`, the samples of one batch are fetched by that many threads (for datasets
    that wait on I/O or release the GIL); results keep the batch's index order.
    """

    def __init__(
        self, dataset: Any, auto_collation: bool, collate_fn: Callable, threads: int = 1, columnar: bool = False
    ) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        # the loader's collate_fn is torch's default_collate: a dataset that can build that batch by column does
        # (NOTE [ raydl columnar batches ] in data/columnar.py)
        self._by_column = getattr(dataset, "raydl_collate", None) if columnar and auto_collation else None

    def fetch(self, index: Any, before_item: Optional[Callable[[Any], None]] = None) -> Any:
        """The batch for `index`; `before_item(i)` runs right before each `dataset[i]` (one at a time then)."""
        if before_item is not None:
            if self.auto_collation and getattr(self.dataset, "raydl_batch_transform", None) is not None:
                raise ValueError(
                    "ray_seed='sample' seeds each sample before its own dataset[i], but this "
                    f"{type(self.dataset).__name__}'s batch_transform makes a whole batch at once: use "
                    "ray_seed='batch' (the same batches at any worker count) or the default ray_seed"
                )
            if not self.auto_collation:
                before_item(index)
                return self.collate_fn(self.dataset[index])
            data = []
            for i in index:
                before_item(i)
                data.append(self.dataset[i])
            return self.collate_fn(data)
        if self._by_column is not None:
            batch = self._by_column(index)
            if batch is not None:
                return batch
        if self.auto_collation:
            getitems = getattr(self.dataset, "__getitems__", None)
            if getitems:
                data = getitems(index)
            elif self.threads > 1 and len(index) > 1:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="raydl_fetch")
                data = list(self._executor.map(self.dataset.__getitem__, index))
            else:
                data = [self.dataset[i] for i in index]
        else:
            data = self.dataset[index]
        return self.collate_fn(data)


class IterableFetcher:
    """Fetch the next batch (or item) from this worker's iterator over its dataset replica."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable, drop_last: bool) -> None:
        self.dataset_iter: Iterator = iter(dataset)
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.ended = False
        self.last_count = 0  # samples in the last batch returned (for stats)

    def fetch(self, batch_len: int | None) -> Any:
        """Return the next batch; raise StopIteration once the replica is exhausted."""
        if self.ended:
            raise StopIteration
        if self.auto_collation:
            assert batch_len is not None
            data = []
            for _ in range(batch_len):
                try:
                    data.append(next(self.dataset_iter))
                except StopIteration:
                    self.ended = True
                    break
            if not data or (self.drop_last and len(data) < batch_len):
                raise StopIteration
            self.last_count = len(data)
        else:
            data = next(self.dataset_iter)
            self.last_count = 1
        return self.collate_fn(data)
