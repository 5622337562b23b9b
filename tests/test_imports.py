"""How the project's modules import each other (deferred imports inside functions included): without a
cycle, runtime's subpackages in layers, and sweep/ and runtime/tools/ through the public API
(`runtime.__all__`) or an allowlist of runtime modules, each entry with its reason."""

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


# ---------------------------------------------------------------------------------------------------
# the public API: what sweep/ and runtime/tools/ may import from runtime

# module -> (the importers it is open to, why). A module under sweep/ or runtime/tools/ imports from
# runtime only (a) a name of runtime.__all__, from `runtime` or from the module that defines it
# (runtime.EXPORTS), (b) within runtime.tools, another tool, or (c) a module listed here for it.
SWEEP, TOOLS = "sweep", "runtime.tools"
ALLOWED: dict[str, tuple[tuple[str, ...], str]] = {
    "runtime.core.errors": ((SWEEP, TOOLS), "ArgumentParser, atomic_write, cli_main, check_output_path: the "
                                            "one-line-error command-line helpers every command shares"),
    "runtime.core.policy": ((SWEEP, TOOLS), "the policy table (PARAMS, PARAM_BY_NAME, PARAM_NAMES) the search "
                                            "space is built from; preset and resolve_capacities"),
    "runtime.core.llamacpp_cache": ((TOOLS,), "ncmoe_layers: -ncmoe N at a memory (llamacpp_flags)"),
    "runtime.core.threads": ((SWEEP, TOOLS), "configure: passive OpenMP waiting and thread counts, set by each "
                                             "CPU-heavy entry point before torch loads"),
    "runtime.core.spec": ((SWEEP, TOOLS), "the run-field table (RUN_FIELD_BY_NAME, add_run_flags) and HELD_OUT: "
                                          "sweep and tool options are run fields"),
    "runtime.formats.costmodel": ((SWEEP, TOOLS), "host profiles, model shapes and the VRAM budget: the sweep's "
                                                  "host axis and its budget-to-capacity mapping"),
    "runtime.formats.trace": ((SWEEP, TOOLS), "Trace, save_trace, synthetic_trace: the sweep builds and stores "
                                              "its traces; record writes one"),
    "runtime.backends": ((SWEEP,), "COUNTER_NAMES: the counter columns of a Result, the sweep's table columns"),
    "runtime.backends.hfmodel": ((TOOLS,), "the Hugging Face model adapter: record and the engine tools load "
                                           "a model through it"),
    "runtime.backends.engine": ((SWEEP, TOOLS), "load_engine, Engine, cpu_threads, engine_cli: calibrate and "
                                                "generate drive an engine; the sweep calibrates a host with one"),
    "runtime.backends.engine.plan": ((TOOLS,), "expert_forward: calibrate times one expert call"),
    "runtime.backends.engine.prefill": ((TOOLS,), "prefill: generate fills the cache from a prompt"),
    "runtime.backends.gguf": ((SWEEP, TOOLS), "a GGUF model: the sweep checks one, reads its config and digest "
                                              "(is_gguf, check, gguf_config, file_digest); llama.cpp's recorder reads "
                                              "a GGUF's metadata through open_gguf"),
    "runtime.backends.emulate": ((TOOLS,), "exact_pass, evaluate_group: the findings evaluate policies on text"),
    "runtime.backends.simulate": ((TOOLS,), "replay: the findings replay traces under many policies"),
    "runtime.backends.resolve": ((TOOLS,), "resolve, IdsSource: the findings size and warm their replays' caches as "
                                 "every backend resolves a run"),
    "runtime.core.kernel": ((TOOLS,), "PolicyCache, warm_residency: calibrate and generate bind a cache to an "
                                      "engine directly; the findings warm a cache"),
    "runtime.tools.record": ((SWEEP,), "record_trace: the sweep records the traces it replays"),
    "runtime.tools.tinymodel": ((SWEEP,), "ensure_model: the sweep builds its tiny reference model"),
    "runtime.tools.llamacpp_flags": ((SWEEP,), "llamacpp_flags: the answer table's llama.cpp flags for each policy, "
                                               "or what llama.cpp lacks to run it"),
}


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def runtime_imports(tree: ast.AST) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) for every import of runtime in `tree`, deferred and `__main__` ones
    included; `from runtime.x import y` with y a module is (line, "runtime.x.y", None)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "runtime"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "runtime":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub, None) if _is_module(sub) else (node.lineno, node.module, a.name))
    return out


def api_violations(importer: str, source: str, allowed=None) -> list[str]:
    """The imports of runtime in `source` (the module `importer`, under sweep or runtime.tools) that are
    outside the public API and the allowlist, as 'importer:line: module[.name]'."""
    import runtime

    allowed = ALLOWED if allowed is None else allowed
    scope = TOOLS if importer.startswith(TOOLS + ".") else SWEEP
    bad = []
    for line, mod, name in runtime_imports(ast.parse(source)):
        if name is not None and name in runtime.__all__ and mod in ("runtime", runtime.EXPORTS[name]):
            continue
        if scope == TOOLS and (mod == TOOLS or mod.startswith(TOOLS + ".")):
            continue
        if scope in allowed.get(mod, ((), ""))[0]:
            continue
        bad.append(f"{importer}:{line}: {mod}" + (f".{name}" if name else ""))
    return bad


def _api_importers() -> dict[str, Path]:
    return {module_name(p): p for d in ("sweep", "runtime/tools") for p in sorted((ROOT / d).rglob("*.py"))}


def test_public_api_is_declared_and_lazy():
    """`runtime.__all__` lists the public API; each name is the object its defining module holds, and
    `import runtime` alone loads none of them (nor numpy, numba, pyarrow, torch)."""
    import importlib
    import subprocess
    import sys

    import runtime

    assert runtime.__all__ == list(runtime.EXPORTS)
    assert {"PolicyConfig", "PRESETS", "RunSpec", "Result", "get_backend", "load_trace", "HostProfile",
            "load_host_profile", "list_host_profiles", "calibrate"} <= set(runtime.__all__)
    for name, mod in runtime.EXPORTS.items():
        assert getattr(runtime, name) is getattr(importlib.import_module(mod), name), name
    code = ("import sys, runtime; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('numpy', 'numba', 'pyarrow', 'torch') or m.startswith('runtime.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_sweep_and_tools_import_only_the_public_api_or_the_allowlist():
    bad = [v for m, p in _api_importers().items() for v in api_violations(m, p.read_text())]
    assert bad == [], "imports outside runtime.__all__ and ALLOWED:\n" + "\n".join(bad)


def test_allowlist_has_no_stale_entry():
    """Every allowlist entry is used by an importer it is open to (a stale entry would widen the API)."""
    used: dict[str, set[str]] = {}
    for m, p in _api_importers().items():
        scope = TOOLS if m.startswith(TOOLS + ".") else SWEEP
        for _, mod, _ in runtime_imports(ast.parse(p.read_text())):
            used.setdefault(mod, set()).add(scope)
    stale = {mod: sorted(set(scopes) - used.get(mod, set())) for mod, (scopes, _) in ALLOWED.items()}
    assert {m: s for m, s in stale.items() if s} == {}
    assert all(reason.strip() for _, reason in ALLOWED.values())


def test_api_check_fails_on_an_import_outside_it():
    src = ("from runtime import RunSpec, get_backend\n"
           "from runtime.core.spec import Result\n"
           "from runtime.formats import costmodel\n"
           "def f():\n"
           "    from runtime.core.kernel import PolicyCache\n"
           "    import runtime.backends.simulate\n"
           "    from runtime import cli\n"
           "    from runtime.core.policy import PolicyConfig as P, preset\n")
    assert api_violations("sweep.synthetic", src) == [
        "sweep.synthetic:5: runtime.core.kernel.PolicyCache", "sweep.synthetic:6: runtime.backends.simulate",
        "sweep.synthetic:7: runtime.cli"]
    # a tool may import the kernel and other tools, not the command line
    assert api_violations("runtime.tools.synthetic", src + "from runtime.tools.record import main\n") == [
        "runtime.tools.synthetic:7: runtime.cli"]
    # with an empty allowlist only the public names pass
    assert api_violations("sweep.synthetic", src, allowed={}) == [
        "sweep.synthetic:3: runtime.formats.costmodel", "sweep.synthetic:5: runtime.core.kernel.PolicyCache",
        "sweep.synthetic:6: runtime.backends.simulate", "sweep.synthetic:7: runtime.cli",
        "sweep.synthetic:8: runtime.core.policy.preset"]
