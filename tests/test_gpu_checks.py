"""scripts/gpu_checks.sh, the one prepared GPU run: its plan (the step limits add up within the device budget,
the most valuable unverified checks first), its options, and every step in CPU device mode (each printing its
progress, each after the kernel step loading the kernel from numba's cache)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"
CHECK_FILES = ["bench_pageable.json", "bench_pinned.json", "calibrate.json", "generate.json", "gpu_checks.log",
               "host.yaml", "summary.md", "versions.json"]
CHECK_STEPS = ["kernel", "versions", "oom", "stream", "bench-pinned", "fetch-exact", "lowbit", "generate", "graphs", "exactness",
               "calibrate", "engine-cpu", "bench-pageable"]
BUDGET = 420  # the CUDA run's device seconds
STEP_OVERHEAD = 2  # seconds a step costs beside its own work (bash, `timeout`, the summary rewritten after it)


STEP_LINE = r"^ *step ([\w-]+) (\d+) \w+"
LEFT_MARK = "# in what is left (the plan ends above):"


def plan() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The `step NAME LIMIT FUNCTION` lines of the script in run order: (the planned steps, those that run in
    what is left of the budget after them)."""
    text = SCRIPT.read_text()
    head, tail = text.split(LEFT_MARK)
    return ([(n, int(s)) for n, s in re.findall(STEP_LINE, head, flags=re.M)],
            [(n, int(s)) for n, s in re.findall(STEP_LINE, tail, flags=re.M)])


def test_the_cuda_plan_adds_up_most_valuable_unverified_first():
    """The planned steps' CUDA limits (the CUDA-graphs check's among them) and 2 s a step add up to at most the
    420 s budget (the first runs planned 420 s of limits with no overhead and a warm numba cache, and 8 of 11
    steps timed out); the kernel compiles first; the two checks that never completed (stream, fetch-exact) are
    planned, calibrate, bench-pageable and engine-cpu (CPU-only work, never on the device) run in what is left;
    the steps are ALL_STEPS in order; an empty ARGS expands under `set -u` on old bash."""
    text = SCRIPT.read_text()
    planned, left = plan()
    names = [n for n, _ in planned + left]
    assert names == CHECK_STEPS
    assert re.findall(r"^ALL_STEPS=\"(.*)\"", text, flags=re.M)[0].split() == names
    # every planned step at its limit (the CUDA-graphs check among them, after generate) and the overhead fit
    assert names.index("graphs") == names.index("generate") + 1 and "graphs" in dict(planned)
    assert sum(s for _, s in planned) + STEP_OVERHEAD * len(planned) <= BUDGET
    assert f"BUDGET=${{GPU_CHECKS_BUDGET:-{BUDGET}}}" in text
    assert names[0] == "kernel" and names[-1] == "bench-pageable"
    for unverified in ("stream", "fetch-exact"):  # never completed on CUDA: planned, not left to what is left
        assert unverified in dict(planned)
    assert {"calibrate", "bench-pageable", "engine-cpu"} <= set(dict(left))
    assert names.index("bench-pinned") < names.index("fetch-exact")  # it writes the model fetch-exact reads
    assert re.search(r'if \[ "\$MODE" = cpu \]; then\n\s+step engine-cpu', text)
    assert '"${ARGS[@]}"' not in text.replace('${ARGS[@]+"${ARGS[@]}"}', "")
    # the versions step installs the carried wheels before anything slow (its internals check runs the models)
    body = text[text.index("\nversions() {"):]
    body = body[: body.index("\n}\n")]
    assert body.index("offline_wheels") < body.index("gpu_env.py")


def test_cuda_sizes_are_the_cut_ones():
    """The sizes the limits were set for (reports/gpu_check_plan_rehearsal.md): one bench round, 1 window, 2 calibration
    repeats; fetch-exact 128 tokens; stream 512; generate 24 tokens. A larger size needs a new rehearsal."""
    text = SCRIPT.read_text()
    cuda = text[text.index("  BUDGET=${GPU_CHECKS_BUDGET:-420}"):text.index("\nfi\n", text.index("  BUDGET=${GPU_CHECKS_BUDGET:-420}"))]
    assert "--windows 1 --repeats 2" in cuda and "ROUNDS=${GPU_CHECKS_ROUNDS:-1}" in cuda
    assert "FE_TOKENS=128" in cuda and "--tokens 512)" in cuda and "GEN_TOKENS=24" in cuda


def run_checks(tmp_path, *args, budget: int | None = None, **extra_env: str):
    env = {**os.environ, "WORK": str(tmp_path / "work"), **extra_env}
    if budget is not None:
        env["GPU_CHECKS_BUDGET"] = str(budget)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_gpu_checks_script_options_and_budget(tmp_path):
    r = run_checks(tmp_path, "--cpu", "--bogus", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "expertsweep: error: scripts/gpu_checks.sh: unknown option --bogus (use --cpu, --tiny, --steps, RESULTS_DIR)"]
    r = run_checks(tmp_path, "--cpu", "--steps", "kernel,bogus", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "expertsweep: error: scripts/gpu_checks.sh: --steps: unknown step bogus (steps: kernel,versions,")
    # no budget left: every step is recorded as skipped, the summary still written, exit status 1
    r = run_checks(tmp_path, "--cpu", str(tmp_path / "out"), budget=10)
    assert r.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "all ok: NO" in summary
    for s in CHECK_STEPS:
        assert f"| {s} | skipped | 0 |" in summary
    # --steps: only the named steps run (the oom step, a few seconds), the others are left out of the summary
    r = run_checks(tmp_path, "--cpu", "--steps", "oom", str(tmp_path / "sub"))
    assert r.returncode == 0, (tmp_path / "sub" / "gpu_checks.log").read_text()[-3000:]
    summary = (tmp_path / "sub" / "summary.md").read_text()
    assert "Steps run: 1; all ok: yes" in summary and "| oom | ok |" in summary
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["gpu_checks.log", "summary.md"]
    log = (tmp_path / "sub" / "gpu_checks.log").read_text()
    assert all(f"=== {s}: not selected (--steps)" in log for s in CHECK_STEPS if s != "oom")


def sections(log: str) -> dict[str, list[str]]:
    """Each step's lines of gpu_checks.log, between its `=== NAME (limit` line and its `--- STATUS: NAME` line,
    with the line the script adds after it (kernel loaded or compiled)."""
    out: dict[str, list[str]] = {}
    cur = None
    for ln in log.splitlines():
        m = re.match(r"=== ([\w-]+) \(limit", ln)
        if m:
            cur = m.group(1)
            out[cur] = []
        elif cur is not None:
            out[cur].append(ln)
    return out


@pytest.mark.slow
def test_gpu_checks_script_cpu_mode(tmp_path):
    """The one-shot GPU script, in CPU device mode at its smallest size, from an empty numba cache: every
    step passes and prints progress; the kernel step compiles and every later step loads the kernel from the
    cache (none writes a cache file); fetch-exact and stream print a line per stage. Its two pytest steps
    run tests the suite runs anyway, so here each selects one cheap test (GPU_CHECKS_CPU_K,
    GPU_CHECKS_EXACT_K): the step, its device variable, its junit file and the summary's counts are checked."""
    cheap = {"GPU_CHECKS_CPU_K": "test_pinned_store_buffers_own_their_pages",
             "GPU_CHECKS_EXACT_K": "test_oom_is_a_one_line_error"}
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}  # the script's own, empty cache
    r = subprocess.run(["bash", str(SCRIPT), "--cpu", "--tiny", str(tmp_path / "out")], cwd=ROOT,
                       env={**env, "WORK": str(tmp_path / "work"), **cheap}, capture_output=True, text=True,
                       timeout=1200)
    out = tmp_path / "out"
    steps = (tmp_path / "work" / "steps.tsv").read_text() if (tmp_path / "work" / "steps.tsv").is_file() else ""
    log = (out / "gpu_checks.log").read_text()
    assert r.returncode == 0, steps + log[-4000:]
    assert sorted(p.name for p in out.iterdir()) == CHECK_FILES  # the device tool returns at most 8 files
    summary = (out / "summary.md").read_text()
    assert f"Steps run: {len(CHECK_STEPS)}; all ok: yes" in summary
    for s in CHECK_STEPS:
        assert f"| {s} | ok |" in summary
    sec = sections(log)
    assert list(sec) == CHECK_STEPS
    for s, lines in sec.items():  # progress: a line of the step's own besides the script's markers
        own = [ln for ln in lines if ln.strip() and not ln.startswith(("--- ", "=== ")) and "kernel loaded from" not in ln]
        assert own, f"step {s} printed nothing"
        if s != "kernel":
            assert f"{s}: kernel loaded from cache (no numba cache file written in this step)" in lines, (s, lines)
    assert any(re.match(r"kernel: \{.*'run_layers': 1, .*'compiled': [1-9]", ln) for ln in sec["kernel"]), sec["kernel"]
    # the graphs step (CPU: the eager segments twice, and against the Hugging Face path): its summary section
    graphs = summary[summary.index("## CUDA graphs on vs off"):]
    assert graphs.count("identical NLL and counters") == 3 and "all-resident" in graphs and "- ok: True" in graphs
    fe = "\n".join(sec["fetch-exact"])
    for stage in ("model loaded", "run quarter: started", "run quarter: finished in", "run E-1: finished in",
                  "run lookahead: finished in", "run admissions: finished in", "run admissions, debug: finished in",
                  "exact pass: finished in", "compare E-1 vs quarter: bit-identical True",
                  "compare admissions vs their debug run: bit-identical True"):
        assert re.search(rf"^\[fetch-exact \+[\d.]+s\] {re.escape(stage)}", fe, flags=re.M), stage
    st = "\n".join(sec["stream"])
    for stage in ("write the checkpoint (scripts/bigmodel.py): finished in", "emulate streamed (", "emulate resident (",
                  "compare streamed vs resident", "record streamed (", "record cpu (", "compare recorded top-k ids"):
        assert re.search(rf"^\[stream \+[\d.]+s\] {re.escape(stage)}", st, flags=re.M), stage
    for tag in ("cpu", "exact"):  # each pytest step ran exactly its one selected test, which passed
        junit = (tmp_path / "work" / f"junit_{tag}.xml").read_text()
        assert 'tests="1"' in junit and 'failures="0"' in junit and 'errors="0"' in junit, junit[:500]
    assert "test_pinned_store_buffers_own_their_pages" in (tmp_path / "work" / "junit_cpu.xml").read_text()
    assert "test_oom_is_a_one_line_error" in (tmp_path / "work" / "junit_exact.xml").read_text()
    bench = json.loads((out / "bench_pinned.json").read_text())
    assert bench["capacity"] == [4, 4] and bench["vram_budget_GiB"] > 0
    assert json.loads((out / "versions.json").read_text())["ok"]
    assert json.loads((out / "generate.json").read_text())["agreement"] >= 0


def test_versions_step_replaces_preinstalled_packages_and_fails_loudly_on_a_mismatch(tmp_path):
    """The carried wheels go in with --force-reinstall (a preinstalled transformers that imports is replaced, not
    skipped), and the pinned-set check after them fails with a VERSION MISMATCH line when an installed version is
    not constraints.txt's (here: a constraints file pinning a transformers that does not exist)."""
    import sys

    text = SCRIPT.read_text()
    body = text[text.index("\noffline_wheels() {"):]
    body = body[: body.index("\n}\n")]
    assert "--no-deps --force-reinstall" in body and '"$p" -c "import' not in body
    fn = text[text.index("\npinned_check() {"):]
    fn = fn[: fn.index("\n}\n") + 3]
    (tmp_path / "pc.sh").write_text(fn)
    (tmp_path / "constraints.txt").write_text("transformers==0.0.1\neinops==0.0.1\n")
    r = subprocess.run(["bash", "-c", "source pc.sh; pinned_check"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PY": sys.executable, "LOWBIT_PKGS": "einops"}, timeout=120)
    assert r.returncode == 1 and "VERSION MISMATCH" in r.stdout and "transformers" in r.stdout, r.stdout + r.stderr
    (tmp_path / "constraints.txt").write_text(f"transformers=={__import__('transformers').__version__}\n")
    r = subprocess.run(["bash", "-c", "source pc.sh; pinned_check"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PY": sys.executable, "LOWBIT_PKGS": ""}, timeout=120)
    assert r.returncode == 0 and "VERSION MISMATCH" not in r.stdout, r.stdout + r.stderr
