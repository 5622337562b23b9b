"""Compiled code checked like code (runtime/core/compiled.py), the way users run it: in separate processes.

A first compile of the policy kernel killed at several points, then four processes starting together on what
it left (one compiles the rest, under the lock; three load), then one that only loads: their decisions equal the
reference's (a cache left by an interrupted first compile made every later process drop what it should
substitute). A cache whose files are truncated or garbage, or whose objects load but compute something else,
is detected, removed and compiled again with one warning; a fresh compile that disagrees with the golden table
is an error. Those last ones run on the cost model's replay, whose compile takes seconds (the mechanism is the
same `ensure`); the kernel's golden table is checked against tests/reference.py here too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.golden import kernel_golden, timing_golden

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ("import json, logging; logging.basicConfig(level=logging.WARNING); "
          "from runtime.core.kernel import selfcheck, warmup; from runtime.core.kernel.cache import kernel_signatures; "
          "warmup(); print(json.dumps({'got': selfcheck.exercise(), 'compiled': kernel_signatures()['compiled']}))")
COSTMODEL = ("import json, logging; logging.basicConfig(level=logging.WARNING); from runtime.core import compiled; "
             "from runtime.formats.costmodel import selfcheck as sc, timing; compiled.ensure(timing.UNIT); "
             "print(json.dumps({'got': sc.exercise(), 'compiled': compiled.compiled_here(timing.UNIT)}))")


def _env(cache: Path) -> dict:
    # a cold kernel compile on a loaded machine can take minutes of wall time: the processes that wait for it here
    # must not give up on the lock (EXPERTSWEEP_COMPILE_LOCK_TIMEOUT, default 300 s) and compile in memory
    return {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), "EXPERTSWEEP_COMPILE_LOCK_TIMEOUT": "900"}


def _start(code: str, cache: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, timeout: float = 900) -> tuple[dict, str]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _run(code: str, cache: Path) -> tuple[dict, str]:
    return _finish(_start(code, cache))


def _files(cache: Path, pattern: str) -> list[Path]:
    return sorted(cache.rglob(pattern))


def _kill_after(code: str, cache: Path, pattern: str, n: int) -> list[str]:
    """Start a compile, SIGKILL it as soon as `n` files match `pattern` in the cache; the files then there."""
    p = _start(code, cache)
    deadline = time.monotonic() + 900
    while len(_files(cache, pattern)) < n:
        assert p.poll() is None, f"finished before {n} x {pattern}: {p.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    return [f.name for f in _files(cache, "*.nb[ic]")]


def test_kernel_golden_table_is_the_reference():
    """runtime/core/kernel/selfcheck.json holds what tests/reference.py decides on the fixed case (`python -m
    tests.golden` writes it), and the case reaches every decision kind, admission and prefetch."""
    from runtime.core import compiled
    from runtime.core.kernel import selfcheck
    from runtime.core.kernel.cache import UNIT

    stored = json.loads(UNIT.golden.read_text())["expected"]
    ref = kernel_golden()
    assert stored == ref
    total = {k: sum(layer[k] for n, row in ref.items() if n not in ("decide", "next_use", "shared_pool")
                 for layer in row["counters"])
             for k in selfcheck.COUNTER_KEYS}
    assert all(total[k] > 0 for k in ("hits", "fetches", "substitutions", "drops", "host_computes", "lowbit_computes",
                                      "admissions", "prefetches", "prefetch_used")), total
    assert compiled.exercise(UNIT) == ref  # this process's kernel (pytest's own compile) too
    tiny = ref["decide"]["tiny"]
    assert tiny["returns"] == [1, 1, 1] and tiny["kinds"][0] == [1, 0]  # fetches, a hit
    # the engine's call on the trace: every return (SLOW, BAD_SCORES, fetch counts) and plan row kind it can give
    cases = [row for name, row in ref["decide"].items() if name != "tiny"]
    returns = {x for row in cases for x in row["returns"]} | {row["bad_scores"] for row in cases}
    kinds = {x for row in cases for call in row["kinds"] for x in call}
    assert returns >= {-2, -1, 0, 1, 2, 3} and kinds == {0, 1, 2, 3, 4, 5}, (returns, kinds)


def test_costmodel_golden_table_is_the_interpreted_replay():
    from runtime.formats.costmodel import selfcheck
    from runtime.formats.costmodel.timing import UNIT

    assert json.loads(UNIT.golden.read_text())["expected"] == timing_golden()
    assert selfcheck.exercise() == timing_golden()


def test_interrupted_first_compiles_then_four_at_once_then_a_loader_decide_as_the_reference(tmp_path):
    """The interrupted-compile sequence at three points: a first compile into an empty cache killed after its first file, a
    second killed after the first specialization of run_layer, a third killed after run_layers (before its
    last file); then four processes start together on what they left: one compiles the rest (under the lock),
    three wait and load what it wrote; a last one only loads (compiles nothing), warns of nothing, and every one
    decides every case of the fixed table as tests/reference.py does. (One kernel compile in all: the suite's
    slowest step, so the lock's test shares it.)"""
    cache = tmp_path / "numba"
    seen = [_kill_after(KERNEL, cache, "*.nbc", 1), _kill_after(KERNEL, cache, "run_layer.run_layer-*.nbc", 1),
            _kill_after(KERNEL, cache, "run_layer.run_layers-*.nbc", 1)]
    assert seen[0] and len(seen[2]) > len(seen[0]), seen
    procs = [_start(KERNEL, cache) for _ in range(4)]
    results = [_finish(p) for p in procs]
    compiled = sorted(r["compiled"] for r, _ in results)
    assert compiled[:3] == [0, 0, 0] and compiled[3] > 0, compiled
    last, err = _run(KERNEL, cache)
    assert last["compiled"] == 0, last["compiled"]
    assert "WARNING" not in err, err[-2000:]
    want = kernel_golden()
    assert all(r["got"] == want for r, _ in [*results, (last, err)])


@pytest.fixture()
def costmodel_cache(tmp_path) -> Path:
    cache = tmp_path / "numba"
    first, err = _run(COSTMODEL, cache)
    assert first["compiled"] > 0 and "WARNING" not in err
    return cache


@pytest.mark.parametrize("damage", ["truncated", "garbage-index", "poisoned"])
def test_a_damaged_cache_is_recovered_with_one_warning(costmodel_cache, damage):
    """A data file cut short, an index of garbage, or objects that load and compute something else (compiled
    with a changed constant, same sources): the next process warns once, removes the cache, compiles again and
    computes the golden results; the process after it loads the new cache silently."""
    cache = costmodel_cache
    if damage == "truncated":
        for f in _files(cache, "timing.*.nbc"):
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    elif damage == "garbage-index":
        for f in _files(cache, "timing.*.nbi"):
            f.write_bytes(f.read_bytes()[:20] + b"not a numba index" * 10)
    else:  # compile with a global the replay reads changed, bypassing the check: same sources, wrong code
        for f in _files(cache, "timing.*.nb[ic]"):
            f.unlink()
        poison = ("from runtime.core import compiled; from runtime.formats.costmodel import selfcheck as sc, timing; "
                  "compiled._checked.add(timing.UNIT.slug); timing._S_DENSE, timing._S_HOST = timing._S_HOST, "
                  "timing._S_DENSE; sc.exercise(); print('{}')")
        _run(poison, cache)
        assert _files(cache, "timing.*.nbc")
    got, err = _run(COSTMODEL, cache)
    assert err.count("WARNING") == 1 and "cost model replay" in err and "compiled it again" in err, err[-2000:]
    assert got["compiled"] > 0 and got["got"] == timing_golden()
    again, err = _run(COSTMODEL, cache)
    assert again["compiled"] == 0 and "WARNING" not in err and again["got"] == timing_golden()


def test_a_fresh_compile_that_disagrees_is_an_error(tmp_path):
    """A golden table the compiled code cannot meet (here: one value changed): after removing the cache and
    compiling again it still disagrees, so the process exits non-zero naming the value, never runs silently."""
    golden = json.loads((ROOT / "runtime/formats/costmodel/selfcheck.json").read_text())
    golden["expected"]["pinned"]["total"] += 1.0
    bad = tmp_path / "golden.json"
    bad.write_text(json.dumps(golden))
    code = ("import dataclasses; from runtime.core import compiled; from runtime.formats.costmodel import timing; "
            f"compiled.ensure(dataclasses.replace(timing.UNIT, golden=__import__('pathlib').Path({str(bad)!r})))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(tmp_path / "numba"), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode != 0
    assert "CompiledCheckError: cost model replay: compiled in this process, it disagrees with its golden" in r.stderr
    assert "pinned.total" in r.stderr and "python -m tests.golden" in r.stderr and "constraints.txt" in r.stderr
    assert "WARNING" not in r.stderr  # nothing came from numba's cache: no warning blaming it, no second compile


def test_guard_drops_stale_kernels(tmp_path):
    """numba keys a cache entry on its own file only: the guard removes the unit's cache files (and a killed
    write's temporary file) when any of its sources' hash differs from the stored one, and keeps them while it
    is the same; other packages' files in the folder stay."""
    from runtime.core import compiled
    from runtime.core.kernel.cache import UNIT

    d = tmp_path / "cache"
    d.mkdir(parents=True)
    (d / "run_layer.x.nbi").write_text("stale")
    (d / "run_layer.x.nbc.tmp.0123").write_text("half")
    (d / "other.y.nbi").write_text("not ours")
    (d / "kernel-sources.sha256").write_text("an older hash")
    compiled.guard(UNIT, [d])
    assert not (d / "run_layer.x.nbi").exists() and not (d / "run_layer.x.nbc.tmp.0123").exists()
    assert (d / "other.y.nbi").exists() and (d / "kernel-sources.sha256").read_text() == compiled.sources_digest(UNIT)
    (d / "run_layer.y.nbi").write_text("current")
    compiled.guard(UNIT, [d])
    assert (d / "run_layer.y.nbi").exists()


def test_the_same_sources_anywhere_load_one_compile(tmp_path):
    """numba's own locators key a cache on the source file's path, so an installed wheel, each Ray node's unpacked
    `--working-dir` and every other checkout compiled the kernel again (~85 s of CPU each). UnitCacheLocator
    (runtime/core/numba_locator.py) keys it on the unit's sources: a copy of runtime/ at another path, its files
    written now, loads this run's compile (nothing compiled, no cache file written) and passes the golden check;
    with one kernel file changed its folder is another; without NUMBA_CACHE_DIR the folder is under
    $EXPERTSWEEP_CACHE/numba; a numba function in any other file is left to numba's own locators."""
    import shutil

    from runtime.core import compiled
    from runtime.core.kernel import warmup
    from runtime.core.units import KERNEL as UNIT

    warmup()  # this process: compiled or loaded, and checked
    here = compiled.unit_dir(UNIT)
    before = sorted(p.name for p in here.iterdir())
    assert any(n.startswith("run_layer.run_layers-") and n.endswith(".nbc") for n in before), before
    copy = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "runtime", copy / "runtime", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(copy)}
    where = "; from runtime.core import compiled, units; print(compiled.__file__, compiled.unit_dir(units.KERNEL))"
    r = subprocess.run([sys.executable, "-c", KERNEL + where], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result, where = r.stdout.strip().splitlines()[-2:]
    assert json.loads(result) == {"got": kernel_golden(), "compiled": 0}
    assert where == f"{copy / 'runtime' / 'core' / 'compiled.py'} {here}"
    assert sorted(p.name for p in here.iterdir()) == before
    route = copy / "runtime" / "core" / "kernel" / "route.py"
    route.write_text(route.read_text() + "\n# changed\n")
    look = ("from runtime.core import compiled; from runtime.core.kernel import run_layer; "
            "from runtime.core.numba_locator import UnitCacheLocator as L\n"
            "def other(): pass\n"
            "f = run_layer.run_layers.py_func\n"
            "print(L.from_function(f, f.__code__.co_filename).get_cache_path(), L.from_function(other, 'x.py'))")
    r = subprocess.run([sys.executable, "-c", look], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    changed, other = r.stdout.split()
    assert Path(changed).parent == here.parent and Path(changed).name.startswith("kernel-") and Path(changed) != here
    assert other == "None"
    env = {k: v for k, v in env.items() if k != "NUMBA_CACHE_DIR"} | {"EXPERTSWEEP_CACHE": str(tmp_path / "c")}
    r = subprocess.run([sys.executable, "-c", look], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.split()[0]) == tmp_path / "c" / "numba" / Path(changed).name


# --- the lock, the locator setting and the cache folders: safe whatever the machine gives -----------------------------


def test_a_lock_held_elsewhere_is_waited_for_then_the_unit_compiles_in_memory(tmp_path):
    """Another process holds the unit's lock (here: this one) past EXPERTSWEEP_COMPILE_LOCK_TIMEOUT: the process
    says so in one WARNING naming the lock file and the wait, compiles the unit in memory (nothing saved), checks it
    and goes on; a timeout that is not a number is a one-line error naming the variable."""
    from filelock import FileLock

    from runtime.core import compiled
    from runtime.core.errors import InputError
    from runtime.core.units import COSTMODEL as UNIT

    cache = tmp_path / "numba"
    env = {**_env(cache), compiled.LOCK_TIMEOUT_ENV: "1"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NUMBA_CACHE_DIR", str(cache))
        path = compiled.lock_path(UNIT)
        mp.setenv(compiled.LOCK_TIMEOUT_ENV, "soon")
        with pytest.raises(InputError, match="EXPERTSWEEP_COMPILE_LOCK_TIMEOUT = 'soon' must be a number"):
            compiled.lock_timeout_s()
    with FileLock(str(path)):
        r = subprocess.run([sys.executable, "-c", COSTMODEL], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["got"] == timing_golden() and got["compiled"] > 0
    assert r.stderr.count("WARNING") == 1 and f"gave up after 1 s waiting for the compile lock {path}" in r.stderr
    assert "compiling it in memory" in r.stderr and compiled.LOCK_TIMEOUT_ENV in r.stderr
    assert not _files(cache, "timing.*.nb[ic]")  # nothing saved


def test_the_locator_setting_stays_in_the_process_and_a_users_is_honoured(tmp_path):
    """Importing the units sets nothing in os.environ (a child process, Python or not, inherits nothing); a user's
    NUMBA_CACHE_LOCATOR_CLASSES is honoured (numba's own locator picks the folder) with one WARNING that the
    content key is off, and the guard and the lock cover the folder it picked."""
    look = ("import os; import runtime.core.kernel, runtime.formats.costmodel; "
            "print(os.environ.get('NUMBA_CACHE_LOCATOR_CLASSES'))")
    r = subprocess.run([sys.executable, "-c", look], cwd=ROOT, env=_env(tmp_path / "a"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "None" and "WARNING" not in r.stderr, r.stderr[-2000:]
    cache = tmp_path / "numba"
    env = {**_env(cache), "NUMBA_CACHE_LOCATOR_CLASSES": "UserProvidedCacheLocator"}
    code = COSTMODEL + ("; from runtime.core import units; "
                        "print(json.dumps([str(d) for d in compiled.cache_dirs(units.COSTMODEL)]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result, dirs = r.stdout.strip().splitlines()[-2:]
    assert json.loads(result)["got"] == timing_golden()
    assert r.stderr.count("WARNING") == 1 and "NUMBA_CACHE_LOCATOR_CLASSES=UserProvidedCacheLocator is set" in r.stderr
    numba_dir, unit_dir = (Path(d) for d in json.loads(dirs))  # numba's own locator's folder, the lock's
    assert numba_dir != unit_dir and numba_dir.is_relative_to(cache) and unit_dir.parent == cache
    assert list(numba_dir.glob("timing.*.nbc")) and (numba_dir / "costmodel-sources.sha256").is_file()
    assert (unit_dir / "costmodel.lock").exists() and not list(unit_dir.glob("*.nb[ic]"))


def test_with_nothing_writable_the_units_compile_in_memory(tmp_path):
    """No NUMBA_CACHE_DIR, EXPERTSWEEP_CACHE and HOME where nothing can be written (below a file: unwritable for
    root too): the kernel imports, and the cost model's replay compiles in memory with one WARNING naming the folder
    and why, passes its check, and writes no cache file anywhere (numba's fallback folders included: the
    package's __pycache__, its user-wide folder)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in _env(tmp_path).items() if k not in ("NUMBA_CACHE_DIR", "EXPERTSWEEP_CACHE")}
    env |= {"HOME": str(blocker / "home"), "XDG_CACHE_HOME": str(blocker / "xdg")}
    before = sorted(p.name for p in (ROOT / "runtime" / "formats" / "costmodel").rglob("*.nb[ic]"))
    code = "import runtime.core.kernel; " + COSTMODEL + "; print(timing._replay_loop.stats.cache_path)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result, path = r.stdout.strip().splitlines()[-2:]
    assert json.loads(result) == {"got": timing_golden(), "compiled": 1}
    assert path == "None"  # numba's NullCache: nothing loaded, nothing saved
    assert r.stderr.count("WARNING") == 1 and "cost model replay: numba cannot save it in " in r.stderr
    assert str(blocker / "home") in r.stderr and "NotADirectoryError" in r.stderr
    assert sorted(p.name for p in (ROOT / "runtime" / "formats" / "costmodel").rglob("*.nb[ic]")) == before


# --- each entry point's check fails on a wrong build of that entry point ------------------------------------------------

# name -> (kernel file, text, its replacement, the kernel modules whose cached code stays valid (they do not call
# the changed file: their cache files are copied, so only the changed code compiles), what the first difference names)
MUTATIONS = {
    "none": ("decide.py", "", "", ("search", "evict", "primitives", "route", "run_layer", "cache", "decide",
                                   "shared_pool"), None),
    # the engine's call: a drop under drop_renorm no longer makes the plan slow (the engine then skips the renorm)
    "decide-drop-renorm-fast": ("decide.py", "c == HOST or c == LOWBIT or (c == DROP and drop_renorm)",
                                "c == HOST or c == LOWBIT", ("search", "evict", "primitives", "route", "run_layer",
                                                             "cache", "shared_pool"),
                                "decide.threshold-drop-renorm-lfuda.returns["),
    # the engine's call takes run_layer's lean build for every policy
    "decide-lean-build": ("decide.py", "run_layers(tok, t0, pol, cs, out, layer, layer < 0)",
                          "run_layers(tok, t0, pol, cs, out, layer, layer >= 0)",
                          ("search", "evict", "primitives", "route", "run_layer", "cache", "shared_pool"), "decide."),
    # Belady's next uses count invalid tokens as uses
    "next_use-counts-invalid": ("cache.py", "        if not valid[i]:\n            continue\n", "",
                                ("search", "evict", "primitives", "route", "run_layer", "decide", "shared_pool"),
                                ("belady.", "next_use[")),
    # llama.cpp's shared pool no longer touches a hit: FIFO instead of LRU
    "shared_pool-fifo": ("shared_pool.py", "                _unlink(s, prev, nxt, ends)\n                _append(s, prev, nxt, ends)\n"
                         "                kind[l_, i, j] = HIT", "                kind[l_, i, j] = HIT",
                         ("search", "evict", "primitives", "route", "run_layer", "cache", "decide"), "shared_pool."),
    # run_layers swaps its two builds: the lean one for the full policies (a full kernel compile: the slow case)
    "run_layers-swapped-builds": ("run_layer.py", "if lean:", "if not lean:",
                                  ("search", "evict", "primitives", "route", "cache", "shared_pool"), ""),
}


@pytest.mark.parametrize("mutation", [pytest.param(m, marks=pytest.mark.slow) if m == "run_layers-swapped-builds" else m
                                      for m in MUTATIONS])  # the swapped builds compile the whole kernel: `make test`
def test_each_entry_points_check_fails_on_a_wrong_build_of_it(tmp_path, mutation):
    """A copy of runtime/ with one kernel file changed on purpose, in a separate process: the post-load check
    (`compiled._check`, the fixed cases against the golden table) names a difference in the changed entry point's
    own cases. The copy's cache holds this checkout's compiled code of the modules that do not call the changed
    file (numba stamps each file's content: they load), so only the changed code compiles. "none": the same
    copy unchanged passes (the harness itself is sound)."""
    import shutil

    from runtime.core import compiled
    from runtime.core.kernel import warmup
    from runtime.core.units import KERNEL as UNIT

    warmup()  # this checkout's kernel compiled (or loaded) and checked: its cache files are complete
    here = compiled.numba_dirs(UNIT)[0]
    name, old, new, keep, names = MUTATIONS[mutation]
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "runtime", copy / "runtime", ignore=shutil.ignore_patterns("__pycache__"))
    f = copy / "runtime" / "core" / "kernel" / name
    if old:
        text = f.read_text()
        assert text.count(old) == 1, f"{name}: the mutation's text {old!r} is not there once: update MUTATIONS"
        f.write_text(text.replace(old, new))
    env = {**os.environ, "PYTHONPATH": str(copy), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    where = ("from runtime.core import compiled; from runtime.core.units import KERNEL; "
             "print(compiled.unit_dir(KERNEL), compiled.sources_digest(KERNEL))")
    r = subprocess.run([sys.executable, "-c", where], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    folder, digest = r.stdout.split()
    folder = Path(folder)
    folder.mkdir(parents=True)
    for p in here.iterdir():
        if p.name.split(".")[0] in keep and p.suffix in (".nbi", ".nbc"):
            shutil.copy2(p, folder / p.name)
    (folder / f"{UNIT.slug}-sources.sha256").write_text(digest)
    check = ("import json; from runtime.core import compiled; from runtime.core.units import KERNEL; "
             "compiled._active.add(KERNEL.slug); want = json.loads(KERNEL.golden.read_text())['expected']; "
             "print(json.dumps({'diff': compiled._check(KERNEL, want), 'compiled': compiled.compiled_here(KERNEL)}))")
    r = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if names is None:
        assert got == {"diff": None, "compiled": 0}
    else:
        assert got["diff"] is not None and got["diff"].startswith(names) and "raised" not in got["diff"], got
        assert got["compiled"] > 0


SIGNATURES = """
import json, sys
from pathlib import Path
from runtime.core import compiled
from runtime.core.units import COSTMODEL, KERNEL
from runtime.core.kernel import warmup

def signatures():
    return {d.py_func.__module__ + "." + d.py_func.__name__: sorted(str(s) for s in d.signatures)
            for unit in (KERNEL, COSTMODEL) for d in compiled.dispatchers(unit)}

warmup()
compiled.ensure(COSTMODEL)
out = {"checked": signatures()}
from runtime.backends.simulate import simulate
from runtime.core.policy import PolicyConfig
from runtime.formats.trace.synthetic import synthetic_trace
trace = synthetic_trace(1200, 3, 32, 4, seed=0)  # the sweep tests' trace
for fields in ({"rule": "threshold", "tau": 0.15, "beta": 0.1}, {"rule": "fetch_all", "evict": "belady"},
               {"rule": "first_choice", "evict": "lru", "prefetch": "oracle", "prefetch_n": 2},
               {"rule": "threshold", "tau": 0.15, "fallback": "drop", "evict": "s3fifo", "copy_buffers": 1},
               {"rule": "fetch_all", "route": "cache-route", "route_keep": 1, "route_window": 4},
               {"rule": "fetch_all", "evict": "lru", "pool": "shared"}, {"rule": "fetch_all", "layer_split": "ncmoe"}):
    simulate(trace, PolicyConfig(**fields), capacity_fraction=0.5, record_decisions=True)
out["simulation"] = signatures()
from runtime import cli
from runtime.tools.tinyhf import build_tiny
tmp, text = Path(sys.argv[1]), sys.argv[2]
model = build_tiny("qwen3_moe", tmp / "e8")
args = ["--model", str(model), "--text", text, "--policy", "quality-first", "--policy", "host-compute", "--policy",
        "cache-route", "--window", "24", "--max-tokens", "48", "--capacity", "3", "--json"]
cli.emulate_main(args + ["--policy", "llamacpp-lru"])
out["emulation"] = signatures()
cli.emulate_main(args + ["--backend", "engine"])
out["engine"] = signatures()
print(json.dumps(out))
"""


def test_production_compiles_no_signature_the_check_did_not_run(tmp_path, text):
    """After the post-load checks, a sweep-sized simulation (Belady's replay, prefetch, routing, llama.cpp's pool and
    layer split, decisions kept), an emulation of a tiny model (llama.cpp's pool among its policies) and the
    engine's CPU run of it (its one compiled call) add no signature to any
    compiled function of either unit: every entry point converts its arguments to the signature the check ran."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the session's numba cache: the units load, nothing compiles
    r = subprocess.run([sys.executable, "-c", SIGNATURES, str(tmp_path), str(text)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    checked = got.pop("checked")
    assert any(checked.values()), checked
    for where, sigs in got.items():
        assert sigs == checked, (where, {k: v for k, v in sigs.items() if v != checked[k]})
