"""The sweep driver end to end on an embedded Ray, and its one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests.sweep_fixtures import free_port, ledger, micro_model_fixture, run_driver, write_config  # noqa: F401


def _one_line_error(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("expertsweep: error: "), proc.stderr[-3000:]
    assert not any("Traceback" in ln for ln in lines), proc.stderr[-3000:]
    return lines[-1]


@pytest.mark.parametrize("case", ["unknown parameter", "empty range", "missing trace", "missing model",
                                  "unreachable mlflow", "bad faults"])
def test_bad_input_is_one_line_before_any_trial(tmp_path, case):
    extra: list[str] = []
    env: dict[str, str] = {}
    space = {"rule": {"choices": ["threshold", "first_choice"]}, "tau": {"low": 0.1, "high": 0.3},
             "capacity_fraction": {"low": 0.15, "high": 0.4}}
    kw: dict = {"space": space}
    if case == "unknown parameter":
        kw["space"] = {**space, "thau": 0.3}
        expect = "unknown parameter 'thau'"
    elif case == "empty range":
        kw["space"] = {**space, "capacity_fraction": {"low": 0.4, "high": 0.15}}
        expect = "empty range low = 0.4 >= high = 0.15"
    elif case == "missing trace":
        kw["trace"] = str(tmp_path / "nope.parquet")
        expect = "nope.parquet: no such file"
    elif case == "missing model":
        extra = ["--model", str(tmp_path / "no_model")]
        expect = "no such folder"
    elif case == "unreachable mlflow":
        extra = ["--mlflow-uri", f"http://127.0.0.1:{free_port()}"]
        expect = "unreachable"
    else:
        env["EXPERTSWEEP_FAULTS"] = "{not json"
        expect = "EXPERTSWEEP_FAULTS"
    cfg = write_config(tmp_path, **kw)
    out = tmp_path / "out"
    proc = run_driver(cfg, out, "--ray-address", "local", "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}",
                      *extra, timeout=120, **env)
    assert expect in _one_line_error(proc)
    assert not ledger(out) and not (out / "tune").exists()


def test_embedded_sweep_end_to_end(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = write_config(tmp_path, trials=8, baselines={"policies": ["fetch-every-miss", "rule-0.15", "substitute-all",
                                                                   "host-compute", "quality-first"]})
    out = tmp_path / "out"
    db = tmp_path / "mlflow.db"
    proc = run_driver(cfg, out, "--ray-address", "local", "--num-cpus", "2", "--mlflow-uri", f"sqlite:///{db}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for f in ("pareto_rtx3090.csv", "pareto_rtx3090.parquet", "pareto_rtx4090.csv", "pareto_rtx4090.parquet",
              "speed_ratios.csv", "pareto.png", "pareto_rtx3090.png", "pareto_rtx4090.png", "summary.md",
              "trials.csv", "stats.json"):
        assert (out / f).stat().st_size > 0, f
    assert "### rtx3090" in proc.stdout and "pareto.png" in proc.stdout
    rows = ledger(out)
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)) == 2 * (5 + 8)
    assert all(r["status"] == "ok" for r in rows)
    for host in ("rtx3090", "rtx4090"):
        order = [r["baseline"] is not None for r in rows if r["host"] == host]
        assert order == sorted(order, reverse=True), f"{host}: a search trial finished before a baseline"
    summary = (out / "summary.md").read_text()
    assert "fetch-every-miss" in summary or "x fetch-all" in summary

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("expertsweep")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    parents = client.search_runs([exp.experiment_id], "tags.fidelity = 'sweep'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'",
                                  max_results=1000)
    # one child per (host, policy) that matters: every baseline and every front member of each host
    for host in ("rtx3090", "rtx4090"):
        mine = [c for c in children if c.data.tags["host"] == host]
        assert {c.data.tags.get("baseline") for c in mine} >= {"fetch-every-miss", "rule-0.15", "substitute-all",
                                                               "host-compute", "quality-first"}
        front = pd.read_csv(out / f"pareto_{host}.csv")
        assert sum(c.data.tags.get("on_front") == "True" for c in mine) == len(front)
        assert len({c.data.tags["key"] for c in mine}) == len(mine)
    child = next(c for c in children if c.data.tags.get("baseline") == "rule-0.15")
    assert child.info.run_name == "rule-0.15: threshold(0.15) + lfu"
    assert child.data.tags["host"] in ("rtx3090", "rtx4090") and "GeForce" in child.data.tags["gpu"]
    assert child.data.tags["fidelity"] == "simulator" and child.data.tags["policy"] == "threshold(0.15) + lfu"
    assert child.data.params["rule"] == "threshold" and child.data.params["tau"] == "0.15"
    assert child.data.metrics["time_per_token_s"] > 0 and "speed_ratio_vs_fetch_all" in child.data.metrics
    arts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert {"summary.md", "pareto.png", "speed_ratios.csv", "pareto_rtx3090.csv", "tables"} <= arts
    tables = {a.path for a in client.list_artifacts(parents[0].info.run_id, "tables")}
    assert tables == {"tables/trials.json", "tables/front_rtx3090.json", "tables/front_rtx4090.json"}
    # the trials table holds every screened trial
    table = json.loads(Path(client.download_artifacts(parents[0].info.run_id, "tables/trials.json",
                                                      str(tmp_path))).read_text())
    assert sorted(r[table["columns"].index("key")] for r in table["data"]) == sorted(keys)


@pytest.mark.slow
def test_calibrated_host_is_measured_and_remeasured_by_the_engine(tmp_path, micro_model):
    """`profile: calibrate`: issue 4's calibration runs as a Ray task on the host (CPU device mode
    here), the sweep simulates with that profile, and the front is re-measured by the engine."""
    pytest.importorskip("runtime.calibrate")
    cfg = write_config(tmp_path, trace=None, calib_trace=None, model=str(micro_model), max_tokens=512, trials=3,
                       hosts=[{"name": "box", "profile": "calibrate"}],
                       baselines={"policies": ["fetch-every-miss", "rule-0.15"]},
                       remeasure={"emulation": True, "engine": True, "max_policies": 1},
                       space={"rule": {"choices": ["threshold", "first_choice"]}, "tau": {"low": 0.1, "high": 0.4},
                              "capacity_fraction": 0.25})
    out = tmp_path / "out"
    proc = run_driver(cfg, out, "--ray-address", "local", "--num-cpus", "2", "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}",
                      timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = ledger(out)
    sim = [r for r in rows if r["fidelity"] == "simulator"]
    assert len(sim) == 2 + 3 and all(r["status"] == "ok" for r in sim)
    engine = [r for r in rows if r["fidelity"] == "engine"]
    assert engine and all(r["host"] == "box" and r["status"] == "ok" and r["time_per_token_s"] > 0 for r in engine)
    assert any(r["fidelity"] == "emulation" for r in rows)
    assert "engine ms/token" in (out / "summary.md").read_text()
