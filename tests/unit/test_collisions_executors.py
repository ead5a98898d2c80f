"""Executors: in-process by default; Ray only when asked for, with a one-line error when it is not installed."""

from __future__ import annotations

import importlib.util

import pytest

from lminvert.errors import LminvertError
from lminvert.executors import InProcessExecutor, get_executor


def test_default_is_in_process_and_keeps_order():
    runner = get_executor(None)
    assert isinstance(runner, InProcessExecutor) and runner.name == "inprocess"
    assert runner.map(lambda x: x * x, [3, 1, 2]) == [9, 1, 4]
    assert get_executor(runner) is runner


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="ray is installed here")
def test_ray_without_ray_is_a_one_line_error():
    with pytest.raises(LminvertError, match=r"pip install 'lminvert\[ray\]'"):
        get_executor("ray")


def test_unknown_executor():
    with pytest.raises(LminvertError, match="unknown executor 'dask'"):
        get_executor("dask")
