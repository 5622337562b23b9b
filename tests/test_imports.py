"""The project's modules import each other without a cycle (deferred imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "sweep")


def _is_main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def imports_of(path: Path) -> set[str]:
    """Project modules imported anywhere in `path`, except in its `if __name__ == "__main__":` block."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for top in tree.body if _is_main_guard(top) for n in ast.walk(top)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def graph() -> dict[str, set[str]]:
    mods = {f"{p.parent.name}.{p.stem}": p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py") if p.stem != "__init__"}
    return {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_simulator_side_never_imports_torch():
    """A simulator-only sweep worker (and the simulator CLI) starts without torch: importing it costs
    ~1.3 s of CPU per worker process, charged to every sweep (docs/sweep.md, overhead)."""
    import subprocess
    import sys

    code = ("import sys, sweep.worker, runtime.simulate, runtime.backends; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


PRIVATE = ("runtime.simulate", "runtime.kernel")  # the sweep reaches them only through runtime.backends
# modules owned elsewhere that still import a private one: exactly these imports (fails if one grows or goes)
PENDING = {"sweep.pareto": {"runtime.simulate"}, "sweep.remeasure": {"runtime.kernel"}}


def test_sweep_uses_the_public_runtime_api():
    """sweep/ evaluates trials through runtime.backends: no sweep module imports the simulator or the kernel."""
    found = {}
    for p in sorted((ROOT / "sweep").glob("*.py")):
        mod = f"sweep.{p.stem}"
        bad = {m for m in imports_of(p) if m in PRIVATE}
        if bad:
            found[mod] = bad
    assert found == PENDING
    assert "sweep.worker" not in found
