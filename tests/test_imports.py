"""The project's modules import each other without a cycle (deferred imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "sweep")


def _is_main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _imports(nodes) -> set[str]:
    out = set()
    for top in nodes:
        for node in ast.walk(top):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module)
                out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def imports_of(path: Path, main: bool = False) -> set[str]:
    """Project modules imported anywhere in `path` (deferred imports inside functions included), outside
    its `if __name__ == "__main__":` block; with `main`, those of that block alone."""
    tree = ast.parse(path.read_text())
    return _imports([top for top in tree.body if _is_main_guard(top) == main])


def module_name(path: Path) -> str:
    """runtime/core/kernel.py -> runtime.core.kernel; a package's __init__.py -> the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports. A file's `__main__` block is its own node `M:__main__`:
    `python -m M` runs it as the module `__main__`, which nothing imports, so it is checked (its imports
    must exist) but cannot close a cycle; nothing is skipped."""
    mods = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    # a module's own parent packages are imported before it by Python itself: not an edge
    g = {m: {i for i in imports_of(p) if i in mods and i != m and not m.startswith(i + ".")} for m, p in mods.items()}
    for m, p in mods.items():
        if main := {i for i in imports_of(p, main=True) if i in mods}:
            g[f"{m}:__main__"] = main
    return g


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


def test_emulation_command_line_is_not_in_the_backend_registry():
    """The emulation's command line is runtime/cli.py's; `python -m runtime.emulate` delegates to it, and
    the backend registry imports neither the command line nor argparse."""
    g = graph()
    assert g["runtime.emulate"] == {"runtime.cli"} and "runtime.emulate:__main__" not in g
    assert "runtime.cli" not in g["runtime.backends"] and "runtime.cli" not in g["runtime.backends.emulate"]
    assert "argparse" not in imports_of(ROOT / "runtime" / "backends" / "__init__.py")


# runtime's subpackages by job, each importing only those before it (tools: applications of the rest)
LAYERS = ("runtime.core", "runtime.formats", "runtime.backends", "runtime.tools")


def _layer(mod: str) -> str:
    return next((p for p in LAYERS if mod == p or mod.startswith(p + ".")), mod)


def test_runtime_subpackages_are_layered():
    """core imports only core; formats core; backends core and formats; tools any of them; nothing
    in core, formats or backends imports a tool, the command line or the sweep."""
    g = graph()
    bad = {}
    for m, deps in g.items():
        if _layer(m) not in LAYERS:
            continue
        allowed = set(LAYERS[:LAYERS.index(_layer(m)) + 1])
        if out := {d for d in deps if _layer(d) not in allowed}:
            bad[m] = out
    assert bad == {}
    assert {m for m in g if _layer(m) == "runtime.core"} >= {"runtime.core.policy", "runtime.core.spec",
                                                                "runtime.core.kernel", "runtime.core.errors"}


def test_python_m_forms_are_the_console_commands():
    """`python -m runtime.simulate | emulate | record | findings` (the documented forms) run `expertsweep X`."""
    for name in ("simulate", "emulate", "record", "findings"):
        path = ROOT / "runtime" / f"{name}.py"
        assert imports_of(path) == {"runtime.cli", "runtime.cli.main", "sys"}
        assert f'main(["{name}", *sys.argv[1:]])' in path.read_text()


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_simulator_side_never_imports_torch():
    """A simulator-only sweep worker (and the simulator CLI, `expertsweep simulate`) starts without torch: importing it costs
    ~1.3 s of CPU per worker process, charged to every sweep (docs/sweep.md, overhead)."""
    import subprocess
    import sys

    code = ("import sys, sweep.worker, runtime.backends.simulate, runtime.backends, runtime.cli, sweep.config; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


PRIVATE = ("runtime.backends.simulate", "runtime.core.kernel")  # the sweep reaches them only through runtime.backends


def test_sweep_uses_the_public_runtime_api():
    """sweep/ evaluates trials through runtime.backends: no sweep module imports the simulator or the kernel."""
    found = {}
    for p in sorted((ROOT / "sweep").glob("*.py")):
        mod = f"sweep.{p.stem}"
        bad = {m for m in imports_of(p) if m in PRIVATE}
        if bad:
            found[mod] = bad
    assert found == {}
