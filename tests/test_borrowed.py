"""primitives.borrowed, the views run_layer hands its stages: the same data, shape and strides as the array, and
no reference count left where an inlined stage binds them (the reason the kernel's stages can be module-level
functions: docs/simulator.md)."""

from __future__ import annotations

import numpy as np
from numba import njit

from runtime.core.kernel.primitives import borrowed


@njit
def _smallest_from(values, start):
    """A called (not inlined) function taking the array: where reference counts stay after refprune."""
    best = start
    for position in range(start, values.shape[0]):
        if values[position] < values[best]:
            best = position
    return best


@njit(inline="always")
def _stage(values, counts, i):
    if values[_smallest_from(values, i)] > 0:
        counts[i % 3] += 1
        return 1
    return 0


@njit
def _loop_on_arrays(values, counts):
    n_positive = 0
    for i in range(values.shape[0]):
        n_positive += _stage(values, counts, i)
    return n_positive


@njit
def _loop_on_views(values, counts):
    values_view, counts_view = borrowed(values), borrowed(counts)
    n_positive = 0
    for i in range(values.shape[0]):
        n_positive += _stage(values_view, counts_view, i)
    return n_positive


def _increfs(dispatcher) -> list[int]:
    """The reference-count increments in the optimized code of each of the dispatcher's signatures."""
    return [llvm.count("call void @NRT_incref") for llvm in dispatcher.inspect_llvm().values()]


def test_a_view_reads_and_writes_the_array_itself_with_its_strides():
    values = np.arange(-6.0, 14.0)[::2]  # strided: 10 values, -6 .. 12
    counts_arrays, counts_views = np.zeros(3, np.int64), np.zeros(3, np.int64)
    assert _loop_on_arrays(values, counts_arrays) == _loop_on_views(values, counts_views) == 6
    assert counts_views.tolist() == counts_arrays.tolist() == [2, 2, 2]  # the writes reached the caller's array


def test_views_leave_no_reference_count_in_the_loop():
    values, counts = np.arange(-5.0, 10.0), np.zeros(3, np.int64)
    _loop_on_arrays(values, counts), _loop_on_views(values, counts)
    assert min(_increfs(_loop_on_arrays)) > 0  # the fixture provokes the counts borrowed views remove
    assert max(_increfs(_loop_on_views)) == 0
