"""Size limits of the code: no module under runtime/ or sweep/ over 700 lines, no function over 120 (ast)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "sweep")
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 120

# A function's length runs from its `def` to its last line, the functions defined inside it included: the
# policy kernel's stages are module-level functions (runtime/core/kernel/run_layer.py's map), not closures
# hidden inside one long function.
def module_lines(source: str) -> int:
    return len(source.splitlines())


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function (methods and nested ones included) longer than `limit`
    lines: from its `def` to its last line (decorators not counted), the functions inside it included."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append((node.name, node.lineno, n))
    return sorted(out, key=lambda t: t[1])


def _modules() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def test_no_module_over_700_lines():
    big = {rel: module_lines(src) for rel, src in _modules().items()
           if module_lines(src) > MAX_MODULE_LINES}
    assert big == {}, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_no_function_over_120_lines():
    long = {f"{rel}:{line} {name}": n for rel, src in _modules().items() for name, line, n in long_functions(src)}
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_checks_see_a_long_module_and_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # def + 120 lines: 121
    src = f"def f():\n{body}\n\n\nclass C:\n    def g(self):\n        def inner():\n{body.replace('    ', '            ')}\n"
    assert [(name, n) for name, _, n in long_functions(src)] == [("f", 121), ("g", 122), ("inner", 121)]
    short = "\n".join(f"    x{i} = {i}" for i in range(40))
    two = f"def outer():\n{short}\n    def a():\n{short.replace('    ', '        ')}\n{short}\n"
    assert [(name, n) for name, _, n in long_functions(two)] == [("outer", 122)]  # closures count: def + 40 + 41 + 40
    assert long_functions("def f():\n" + "\n".join(f"    x{i} = {i}" for i in range(119))) == []
    assert module_lines("\n" * 700 + "x = 1\n") == 701
