"""primitives.borrowed, the views run_layer hands its stages: the same data, shape and strides as the array, and
no reference count left where an inlined stage binds them (the reason the kernel's stages can be module-level
functions: docs/simulator.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
from numba import njit

from runtime.core.kernel.primitives import borrowed

ROOT = Path(__file__).resolve().parents[1]


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


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def borrowed_roots(source: str, function: str) -> set[str | None]:
    """The variables whose arrays `function` (in `source`) borrows: the root name of each `borrowed(...)`."""
    tree = ast.parse(source)
    (func,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
    return {_root_name(call.args[0]) for call in ast.walk(func)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "borrowed"}


def test_run_layer_borrows_only_what_outlives_its_loop():
    """A view holds no reference, and numba releases a function's own variable at its last use: an array
    run_layer allocated itself would be freed while its views are still read and written. So run_layer borrows
    from its parameters (its caller holds them for the whole call) or from a variable of its own that its last
    statement uses again (`scratch`, passed to `store` after the token loop)."""
    source = (ROOT / "runtime" / "core" / "kernel" / "run_layer.py").read_text()
    tree = ast.parse(source)
    (func,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "run_layer"]
    held = {a.arg for a in func.args.args} | {n.id for n in ast.walk(func.body[-1]) if isinstance(n, ast.Name)}
    roots = borrowed_roots(source, "run_layer")
    assert roots and roots <= held, roots - held
    local = "def run_layer(tokens):\n    scratch = make(tokens)\n    view = borrowed(scratch.misses)\n    use(view)\n"
    assert borrowed_roots(local, "run_layer") == {"scratch"}  # what the check refuses: not held to the end
