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
    return {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}


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
    total = {k: sum(layer[k] for n, row in ref.items() if n != "decide" for layer in row["counters"])
             for k in selfcheck.COUNTER_KEYS}
    assert all(total[k] > 0 for k in ("hits", "fetches", "substitutions", "drops", "host_computes", "lowbit_computes",
                                      "admissions", "prefetches", "prefetch_used")), total
    assert compiled.exercise(UNIT) == ref  # this process's kernel (pytest's own compile) too
    assert ref["decide"]["returns"] == [1, 1, 1] and ref["decide"]["kinds"][0] == [1, 0]  # fetches, a hit


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
    assert "CompiledCheckError: cost model replay: freshly compiled, it disagrees with" in r.stderr
    assert "pinned.total" in r.stderr


def test_guard_drops_stale_kernels(tmp_path, monkeypatch):
    """numba keys a cache entry on its own file only: the guard removes the unit's cache files (and a killed
    write's temporary file) when any of its sources' hash differs from the stored one, and keeps them while it
    is the same; other packages' files in the folder stay."""
    from runtime.core import compiled
    from runtime.core.kernel.cache import UNIT

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    d = compiled.cache_dirs(UNIT)[1]
    d.mkdir(parents=True)
    (d / "run_layer.x.nbi").write_text("stale")
    (d / "run_layer.x.nbc.tmp.0123").write_text("half")
    (d / "other.y.nbi").write_text("not ours")
    (d / "kernel-sources.sha256").write_text("an older hash")
    compiled.guard(UNIT)
    assert not (d / "run_layer.x.nbi").exists() and not (d / "run_layer.x.nbc.tmp.0123").exists()
    assert (d / "other.y.nbi").exists() and (d / "kernel-sources.sha256").read_text() == compiled.sources_digest(UNIT)
    (d / "run_layer.y.nbi").write_text("current")
    compiled.guard(UNIT)
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
