"""A sweep that never answers wrong: a failed start leaves --out as it was, SIGINT/SIGTERM stop the driver
(non-zero, a resume line, no answer), a resume reuses only what was measured under the same key."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.sweep_fixtures import REPO, driver_cmd, env, ledger, run_driver, write_config

FINISHED = {"state.json": '{"args": {}}', "trials.jsonl": '{"key": "rtx3090:0"}\n', "optuna.journal": "j",
            "answer.csv": "host,policy\nrtx3090,p\n", "summary.md": "# old answer\n", "stats.json": "{}",
            "tune/experiment_state.json": "{}"}


def _folder_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", ["unknown host", "dense model", "missing trace", "mlflow under a file"])
def test_a_failed_start_leaves_a_finished_folder_as_it_was(tmp_path, case):
    """Every check the driver can make runs before anything in --out (or the MLflow folder) is created or
    deleted, and before Ray starts: one line naming the flag or path and the value, exit 2."""
    cfg = write_config(tmp_path)
    out = tmp_path / "out"
    for name, text in FINISHED.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    before = _folder_bytes(out)
    mlflow_dir = tmp_path / "mlflow"
    uri = f"sqlite:///{mlflow_dir / 'm.db'}"
    if case == "unknown host":
        extra, expect = ["--hosts", "rtx9999"], ["--hosts rtx9999", "no preset named 'rtx9999'"]
    elif case == "dense model":
        dense = tmp_path / "llama"
        dense.mkdir()
        (dense / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
        extra, expect = ["--model", str(dense)], [f"{dense / 'config.json'}", "'llama'", "not a mixture-of-experts"]
    elif case == "missing trace":
        extra, expect = ["--trace", "nope.parquet"], ["--trace", "nope.parquet: no such file"]
    else:
        (tmp_path / "ro").write_text("a file")
        uri = f"sqlite:///{tmp_path / 'ro' / 'sub' / 'm.db'}"
        extra, expect = [], ["--mlflow-uri", f"{tmp_path / 'ro'} is not a writable folder"]
    t0 = time.time()
    proc = run_driver(cfg, out, "--ray-address", "local", "--mlflow-uri", uri, *extra, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("expertsweep: error: "), proc.stderr[-3000:]
    assert all(e in lines[0] for e in expect), lines[0]
    assert _folder_bytes(out) == before  # nothing deleted, rewritten or added (no logs/, no traces/)
    assert sorted(p.name for p in out.iterdir()) == sorted({n.split("/")[0] for n in FINISHED})
    assert not mlflow_dir.exists()
    print(f"{case}: refused in {time.time() - t0:.1f} s")


def _start(cfg: Path, out: Path, db: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(driver_cmd(cfg, out, "--ray-address", "local", "--num-cpus", "2", "--mlflow-uri", db,
                                       *extra), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _stopped(proc: subprocess.Popen, sig: int, out: Path, timeout: float = 300) -> str:
    """Send `sig` to the driver alone (as a terminal's Ctrl-C or a scheduler's SIGTERM would reach it) and check
    how it ends: non-zero (128 + the signal), a last line telling how to resume, no answer in --out."""
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 128 + sig, err[-4000:]
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert last.startswith(f"expertsweep: stopped by {signal.Signals(sig).name}"), err[-4000:]
    assert f"--out {out} --resume" in last and "Traceback" not in err
    for name in ("answer.csv", "summary.md", "pareto.png", "stats.json"):
        assert not (out / name).exists(), name
    assert not list(out.glob("pareto_*"))
    return err


@pytest.mark.slow
def test_sigint_stops_the_sweep_and_a_resume_finishes_it(tmp_path):
    """SIGINT mid-screening: Tune stops (Ray Tune would otherwise swallow it and the driver report a partial
    answer, exit 0), trials in flight are left for the resume, every recorded row is whole; the MLflow parent
    is KILLED; --resume records every trial once and finishes."""
    from mlflow.tracking import MlflowClient

    cfg = write_config(tmp_path, trials=12, batch=2, baselines={"policies": ["fetch-every-miss", "rule-0.15"]})
    out = tmp_path / "out"
    db = f"sqlite:///{tmp_path / 'm.db'}"
    proc = _start(cfg, out, db)
    try:
        deadline = time.time() + 240
        while len(ledger(out)) < 4 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        _stopped(proc, signal.SIGINT, out)
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = ledger(out)
    assert 4 <= len(rows) < 2 * 14 and all(r["status"] == "ok" for r in rows)
    parent = json.loads((out / "state.json").read_text())["parent_run_id"]
    assert MlflowClient(db).get_run(parent).info.status == "KILLED"
    proc2 = run_driver(cfg, out, "--resume", timeout=300)
    assert proc2.returncode == 0, proc2.stderr[-4000:]
    keys = [r["key"] for r in ledger(out, bounds=False)]
    assert len(keys) == len(set(keys)) == 2 * (12 + 2)
    assert (out / "summary.md").is_file() and MlflowClient(db).get_run(parent).info.status == "FINISHED"


def test_measurement_key_is_everything_the_measurement_depends_on():
    from sweep.ladder import measurement_key
    from sweep.remeasure import emulation_spec
    from sweep.space import complete

    p = complete({"rule": "substitute_all", "vram_budget_GiB": 2.5})

    def key(params=p, slots=(16, 16), tokens=2048, calib=None, digest="d1", budget="full", host=None):
        spec = emulation_spec(params, "/m", "/t.txt", tokens, calib, list(slots) if slots else None).to_dict()
        return measurement_key(spec, digest, budget, host)

    k = key()
    assert k.startswith("emulation:full:") and key() == k
    others = [key(slots=(63, 63)), key(slots=None), key(tokens=512), key(calib="/c.txt"), key(digest="d2"),
              key(params=complete({"rule": "fetch_all", "vram_budget_GiB": 2.5}))]
    assert len({k, *others}) == 1 + len(others)
    assert key(host="box").startswith("engine:box:") and key(host="box") != key(host="other")


def test_a_resume_refuses_rows_measured_under_another_key(tmp_path):
    from runtime.core.errors import InputError
    from sweep.ladder import measurement_key
    from sweep.remeasure import check_rows, emulation_spec
    from sweep.space import complete

    p = complete({"rule": "substitute_all", "vram_budget_GiB": 2.5})
    spec = emulation_spec(p, "/m", "/t.txt", 2048, None, [16, 16]).to_dict()
    good = {"key": measurement_key(spec, "d1", "full"), "fidelity": "emulation", "host": "all", "budget": "full",
            "params": p, "spec": spec, "model_digest": "d1", "status": "ok"}
    sim = {"key": "rtx3090:0", "fidelity": "simulator", "host": "rtx3090"}
    check_rows([sim, good], "d1", "L")  # the same key: reused
    old = {k: v for k, v in good.items() if k not in ("spec", "model_digest")} | {"key": "emulation:full:abc"}
    edited = {**good, "spec": {**spec, "max_tokens": 512}}
    for row, digest, expect in ((old, "d1", "measured under another key"), (edited, "d1", "not the digest"),
                                (good, "d2", "checkpoint digest d1, this sweep's is d2")):
        with pytest.raises(InputError, match=expect) as e:
            check_rows([sim, row], digest, "L")
        assert "\n" not in str(e.value) and str(e.value).startswith("--resume: L: row ")


def test_a_resume_refuses_a_sweep_whose_inputs_changed(tmp_path):
    from runtime.core.errors import InputError
    from sweep import remeasure

    fp = {"trace_sha256": "a", "model_digest": None, "max_tokens": 2048, "profiles": {"rtx3090": {"x": 1}}}
    (tmp_path / "trials.jsonl").write_text("")
    remeasure.check_resume(tmp_path, {"fingerprint": fp}, fp)
    for k, v, expect in (("trace_sha256", "b", "another trace_sha256 ('a' -> 'b')"),
                         ("profiles", {"rtx3090": {"x": 2}}, "another profiles (changed)")):
        with pytest.raises(InputError, match=expect.replace("(", r"\(").replace(")", r"\)")):
            remeasure.check_resume(tmp_path, {"fingerprint": fp}, {**fp, k: v})
    with pytest.raises(InputError, match="no fingerprint"):
        remeasure.check_resume(tmp_path, {}, fp)


@pytest.mark.slow
def test_a_resume_after_a_stop_before_screening_gives_the_clean_answer(tmp_path, micro_model):
    """The issue's wrong answer: a sweep at equal device memory stopped before any screening row, then resumed.
    The resumed answer (every policy and its perplexity change) is the clean run's."""
    kw = dict(trace=None, calib_trace=None, model=str(micro_model), max_tokens=384, trials=0,
              emulation={"rungs": [], "max_full": 1}, ppl_budgets_pct=[1.0, 50.0],
              baselines={"policies": ["fetch-every-miss", "substitute-all"]},
              space={"rule": {"choices": ["threshold", "substitute_all"]}, "tau": 0.15, "vram_budget_GiB": "auto"})
    clean, stopped = tmp_path / "clean", tmp_path / "stopped"
    clean.mkdir()
    stopped.mkdir()
    db = f"sqlite:///{tmp_path / 'm.db'}"
    proc = run_driver(write_config(clean, **kw), clean / "out", "--ray-address", "local", "--num-cpus", "2",
                      "--mlflow-uri", db, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cfg = write_config(stopped, **kw)
    out = stopped / "out"
    proc = _start(cfg, out, db)
    try:
        deadline = time.time() + 400
        while not (out / "state.json").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        _stopped(proc, signal.SIGINT, out)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [r for r in ledger(out) if r["fidelity"] != "simulator"]  # nothing emulated after the stop
    proc = run_driver(cfg, out, "--resume", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cols = ["host", "ppl_budget_pct", "policy", "ppl_change_pct"]
    a, b = pd.read_csv(clean / "out" / "answer.csv")[cols], pd.read_csv(out / "answer.csv")[cols]
    pd.testing.assert_frame_equal(a, b)
    emu = [r for r in ledger(out) if r["fidelity"] == "emulation"]
    sims = {r["params"]["rule"]: r["capacity_slots"] for r in ledger(out, bounds=False) if r["fidelity"] == "simulator"}
    assert emu and all(r["capacity"] == sims[r["params"]["rule"]] for r in emu)  # at the budget's slots


def test_the_stop_handler_asks_tune_first_then_stops_at_once():
    """SIGTERM (as SIGINT) inside tuner.fit(): Tune's own interrupt (SIGUSR1) once, the driver raises Stopped when
    fit returns; a second signal, or one outside fit, raises Stopped at once."""
    from sweep.pareto import Stopped, _Stop

    got = []
    old = signal.signal(signal.SIGUSR1, lambda *_: got.append("usr1"))
    try:
        stop = _Stop()
        stop.in_fit = True
        stop(signal.SIGTERM, None)
        assert got == ["usr1"] and stop.signal == "SIGTERM"
        with pytest.raises(Stopped, match="SIGTERM"):
            stop.check()
        with pytest.raises(Stopped, match="SIGINT"):
            stop(signal.SIGINT, None)
        assert got == ["usr1"]
        outside = _Stop()
        with pytest.raises(Stopped, match="SIGINT"):
            outside(signal.SIGINT, None)
        assert got == ["usr1"]
    finally:
        signal.signal(signal.SIGUSR1, old)
