"""The examples in the public docstrings run as written (doctest), as Ray's ActorPool runs its own."""

from __future__ import annotations

import doctest

import pytest

import raydl


def _run_examples(obj) -> None:
    """Run every `>>>` example in `obj`'s docstring; fail with doctest's report if one differs."""
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(obj, name=f"raydl.{obj.__qualname__}", globs={}) if t.examples]
    assert tests, f"raydl.{obj.__qualname__} has no runnable example in its docstring"
    report: list = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


@pytest.mark.parametrize("name", ["ArrowDataset", "ParquetDataset", "TarDataset", "FileDataset"])
def test_dataset_examples_run(name):
    """The dataset examples run in this process, with no Ray (num_workers=0)."""
    _run_examples(getattr(raydl, name))


def test_patch_example_runs():
    """raydl.patch()'s example patches torch's DataLoader and undoes it."""
    try:
        _run_examples(raydl.patch)
    finally:
        raydl.unpatch()


def test_start_example_runs(ray_session):
    """raydl.start()'s example starts a worker that the next loader takes, on the suite's Ray."""
    _run_examples(raydl.start)


def test_dataloader_example_runs(ray_session):
    """DataLoader's example loads with two Ray workers (the suite's Ray) and with num_workers=0."""
    _run_examples(raydl.DataLoader)


def test_stats_example_runs(ray_session):
    """DataLoader.stats()'s example reads an epoch's figures and prints its table, on the suite's Ray."""
    _run_examples(raydl.DataLoader.stats)
