"""The sweep driver end to end on an embedded Ray, and its one-line errors for bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sweep.bounds import BOUNDS, bound_of
from tests.sweep_fixtures import REPO, driver_cmd, env, free_port, ledger, run_driver, write_config


def _one_line_error(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("expertsweep: error: "), proc.stderr[-3000:]
    assert not any("Traceback" in ln for ln in lines), proc.stderr[-3000:]
    return lines[-1]


@pytest.mark.parametrize("case", ["unknown parameter", "empty range", "missing trace", "missing model",
                                  "unreachable mlflow", "calib is the text", "bad flag"])
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
    elif case == "calib is the text":
        kw.update(trace=None, calib_trace=None, model="test", text=str(tmp_path / "t.txt"),
                  calib_text=str(tmp_path / "t.txt"))
        (tmp_path / "t.txt").write_text("some text")
        expect = "is the evaluated text"
    else:
        extra = ["--trials", "many"]
        expect = "--trials"
    cfg = write_config(tmp_path, **kw)
    out = tmp_path / "out"
    proc = run_driver(cfg, out, "--ray-address", "local", "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}",
                      *extra, timeout=120, **env)
    assert expect in _one_line_error(proc)
    assert not ledger(out) and not (out / "tune").exists()


@pytest.fixture(scope="module")
def embedded_sweep(tmp_path_factory):
    """One sweep on an embedded Ray (8 trials, five baselines, two hosts), read by the end-to-end test and resumed
    by the copy test: (config, out folder, MLflow database, the driver's process)."""
    tmp_path = tmp_path_factory.mktemp("embedded")
    cfg = write_config(tmp_path, trials=8, baselines={"policies": ["fetch-every-miss", "rule-0.15", "substitute-all",
                                                                   "host-compute", "quality-first"]})
    out = tmp_path / "out"
    db = tmp_path / "mlflow.db"
    # RAY_AUTH_MODE unset, as for a user: the embedded cluster takes token authentication with a token of
    # this run (sweep.driver's prepare_ray_auth)
    proc = run_driver(cfg, out, "--ray-address", "local", "--num-cpus", "2", "--mlflow-uri", f"sqlite:///{db}",
                      RAY_AUTH_MODE="")
    return cfg, out, db, proc


@pytest.mark.slow  # an end-to-end sweep on Ray; the fast loop keeps its in-process parts (test_sweep_space, test_report_llamacpp)
def test_embedded_sweep_end_to_end(embedded_sweep):
    from mlflow.tracking import MlflowClient

    cfg, out, db, proc = embedded_sweep
    tmp_path = db.parent
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "token authentication" not in proc.stderr  # no warning that it runs without
    for f in ("pareto_rtx3090.csv", "pareto_rtx3090.parquet", "pareto_rtx4090.csv", "pareto_rtx4090.parquet",
              "speed_ratios.csv", "pareto.png", "pareto_rtx3090.png", "pareto_rtx4090.png", "summary.md",
              "trials.csv", "stats.json"):
        assert (out / f).stat().st_size > 0, f
    assert "### rtx3090" in proc.stdout and "pareto.png" in proc.stdout
    assert f"MLflow runs: in sqlite:///{db}; open them with mlflow ui --backend-store-uri sqlite:///{db}" in proc.stdout
    assert "#/experiments/" in proc.stdout
    rows = ledger(out)
    keys = [r["key"] for r in rows]
    # beside the baselines, the offline bounds computed once per host (sweep/bounds.py): never sampled
    bound_rows = [r for r in rows if bound_of(r.get("baseline")) is not None]
    assert {bound_of(r["baseline"]) for r in bound_rows} == set(BOUNDS) and len(bound_rows) % 2 == 0
    assert len(keys) == len(set(keys)) == 2 * (5 + 8) + len(bound_rows)
    assert all(r["status"] == "ok" for r in rows)
    assert "## Offline bounds" in (out / "summary.md").read_text() and (out / "bounds.csv").stat().st_size > 0
    for host in ("rtx3090", "rtx4090"):
        order = [r["baseline"] is not None for r in rows if r["host"] == host]
        assert order == sorted(order, reverse=True), f"{host}: a search trial finished before a baseline"
    summary = (out / "summary.md").read_text()
    for host in ("rtx3090", "rtx4090"):  # each host's front as a table, one line per front policy
        front = pd.read_csv(out / f"pareto_{host}.csv")
        table = summary.split(f"### {host}")[1].split("\n\n")[1].splitlines()
        assert len(table) == 2 + len(front) and len(front) >= 1
        labels = [line.split("|")[1].strip() for line in table[2:]]
        assert labels == [b if isinstance(b, str) else p for b, p in zip(front["baseline"], front["policy"], strict=True)]
    assert "held-out" not in summary and "warm start" in summary.lower()
    # llama.cpp's two baselines are not among this config's: its section says so, per host
    assert "## llama.cpp" in summary and "- on rtx3090: llamacpp-ncmoe is not among this sweep's baselines" in summary

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
    assert child.info.run_name == f"{child.data.tags['host']} · rule-0.15"  # the two hosts' runs differ by name
    assert child.data.tags["host"] in ("rtx3090", "rtx4090") and "GeForce" in child.data.tags["gpu"]
    assert child.data.tags["fidelity"] == "simulator" and child.data.tags["policy"] == "threshold(0.15) + lfu"
    assert child.data.params["rule"] == "threshold" and child.data.params["tau"] == "0.15"
    # only the parameters active for the policy (the policy table's rule): no low-bit, band or prefetch fields
    assert not {"lowbit_bits", "lowbit_group", "tau_high", "prefetch_n", "half_life"} & set(child.data.params)
    assert "admission_delay" not in child.data.params and "gamma" in child.data.params  # beta off; LFU
    assert child.data.metrics["time_per_token_s"] > 0 and "speed_ratio_vs_fetch_all" in child.data.metrics
    arts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert {"summary.md", "pareto.png", "speed_ratios.csv", "pareto_rtx3090.csv", "tables"} <= arts
    tables = {a.path for a in client.list_artifacts(parents[0].info.run_id, "tables")}
    assert tables == {"tables/trials.json", "tables/front_rtx3090.json", "tables/front_rtx4090.json",
                      "tables/policy_by_host.json"}
    # the trials table holds every screened trial
    table = json.loads(Path(client.download_artifacts(parents[0].info.run_id, "tables/trials.json",
                                                      str(tmp_path))).read_text())
    assert sorted(r[table["columns"].index("key")] for r in table["data"]) == sorted(keys)


@pytest.mark.slow
def test_a_copy_of_a_finished_sweep_resumes_elsewhere(embedded_sweep, tmp_path):
    """The end-to-end sweep's folder copied elsewhere and resumed there (_resume_a_copy)."""
    from mlflow.tracking import MlflowClient

    cfg, out, db, proc = embedded_sweep
    assert proc.returncode == 0, proc.stderr[-4000:]
    client = MlflowClient(f"sqlite:///{db}")
    parents = client.search_runs([client.get_experiment_by_name("expertsweep").experiment_id], "tags.fidelity = 'sweep'")
    _resume_a_copy(cfg, out, db, tmp_path, parents[0].info.run_id, [r["key"] for r in ledger(out)])


def _tree(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under a folder: (sha256 of its bytes, its modification time in ns), by relative path."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() or p.is_symlink()}


def _resume_a_copy(cfg: Path, out: Path, db: Path, tmp_path: Path, parent_id: str, keys: list[str]) -> None:
    """A finished sweep copied elsewhere and resumed there with more trials: the copy goes on, the original folder
    stays byte for byte (and its MLflow parent run as it was); a flag that differs from the saved sweep is one
    line naming both values, and nothing changes."""
    from mlflow.tracking import MlflowClient

    copy = tmp_path / "copy"
    shutil.copytree(out, copy, symlinks=True)
    assert (copy / "config.yaml").read_bytes() == cfg.read_bytes()  # the config's content, saved in --out
    state = json.loads((copy / "state.json").read_text())
    assert state["args"]["config"] == "config.yaml" and state["out"] == str(out)
    assert not (out / "logs" / "ray").exists() and not any(p.is_symlink() for p in out.rglob("*"))
    client = MlflowClient(f"sqlite:///{db}")
    before, run_before = _tree(out), client.get_run(parent_id).info
    other = tmp_path / "other.yaml"
    other.write_text(cfg.read_text().replace("trials: 8", "trials: 9"))
    for flags, expect in ((["--hosts", "rtx3090"], f"--resume: --hosts rtx3090 differs from the sweep in {copy} "
                                                   "(not given)"),
                          (["--trials", "3"], "--resume: --trials 3 is fewer than the 8"),
                          (["--config", str(other)], f"--resume: --config {other} differs from the config")):
        proc = subprocess.run([*driver_cmd(cfg, copy, "--resume"), *flags], cwd=REPO, env=env(), capture_output=True,
                              text=True, timeout=120)
        assert expect in _one_line_error(proc), (flags, proc.stderr[-500:])
    proc = run_driver(cfg, copy, "--resume", "--trials", "10", "--ray-address", "local", "--num-cpus", "2",
                      RAY_AUTH_MODE="")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _tree(out) == before, "resuming a copy changed the original folder"
    run_after = client.get_run(parent_id).info
    assert (run_after.status, run_after.end_time) == (run_before.status, run_before.end_time)
    rows = ledger(copy, bounds=False)
    assert set(keys) < {r["key"] for r in ledger(copy)} and len(rows) == 2 * (5 + 10)  # more trials: applied
    state = json.loads((copy / "state.json").read_text())
    assert state["out"] == str(copy) and state["trials"] == 10 and state["parent_run_id"] != parent_id
    assert state["copied_from"] == {"out": str(out), "run": parent_id}
    new = client.get_run(state["parent_run_id"])
    assert new.info.status == "FINISHED" and new.data.tags["copied_from_run"] == parent_id


@pytest.mark.slow
def test_calibrated_host_is_measured_and_remeasured_by_the_engine(tmp_path, micro_model):
    """`profile: calibrate`: the engine's calibration runs as a Ray task on the host (CPU device mode
    here), the sweep simulates with that profile, and the front is re-measured by the engine."""
    pytest.importorskip("runtime.tools.calibrate")
    cfg = write_config(tmp_path, trace=None, calib_trace=None, model=str(micro_model), max_tokens=512, trials=3,
                       hosts=[{"name": "box", "profile": "calibrate"}],
                       baselines={"policies": ["fetch-every-miss", "rule-0.15"]},
                       emulation={"rungs": [128], "max_full": 1, "engine": True},
                       space={"rule": {"choices": ["threshold", "first_choice"]}, "tau": {"low": 0.1, "high": 0.4},
                              "capacity_fraction": 0.25})
    out = tmp_path / "out"
    proc = run_driver(cfg, out, "--ray-address", "local", "--num-cpus", "2", "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}",
                      timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = ledger(out)
    sim = [r for r in ledger(out, bounds=False) if r["fidelity"] == "simulator"]
    assert len(sim) == 2 + 3 and all(r["status"] == "ok" for r in sim)
    engine = [r for r in rows if r["fidelity"] == "engine"]
    assert engine and all(r["host"] == "box" and r["status"] == "ok" and r["time_per_token_s"] > 0 for r in engine)
    assert any(r["fidelity"] == "emulation" for r in rows)
    assert "engine ms/token" in (out / "summary.md").read_text()


BUDGETS = [0.5, 1.0, 2.0, 50.0]
MAX_FULL = 3


@pytest.fixture(scope="module")
def equal_memory_sweep(tmp_path_factory, micro_model):
    """One sweep on the micro model, checked by the ladder test and the equal-memory test (each assertion of theirs
    holds for any such sweep; one embedded Ray and one ladder instead of two): screening -> a 256-token rung -> the
    full budget, at `vram_budget_GiB: auto` (one device-memory budget for every policy), perplexity budgets
    0.5-50%. Returns (the driver's completed process, --out)."""
    tmp_path = tmp_path_factory.mktemp("equal_memory")
    cfg = write_config(tmp_path, trace=None, calib_trace=None, model=str(micro_model), max_tokens=768, trials=12,
                       emulation={"rungs": [256], "eta": 2, "max_full": MAX_FULL}, ppl_budgets_pct=BUDGETS,
                       baselines={"policies": ["fetch-every-miss", "rule-0.15", "substitute-all", "quality-first"]},
                       space={"rule": {"choices": ["threshold", "first_choice", "substitute_all"]},
                              "tau": {"low": 0.05, "high": 0.5, "log": True}, "evict": {"choices": ["lfu", "lru"]},
                              "fallback": {"choices": ["substitute", "lowbit"]}, "lowbit_bits": {"choices": [4, 2]},
                              "beta": {"choices": ["off", 0.5]}, "admission_delay": {"low": 1, "high": 4},
                              "prefetch": {"choices": ["off", "oracle"]}, "vram_budget_GiB": "auto"})
    out = tmp_path / "out"
    proc = run_driver(cfg, out, "--ray-address", "local", "--num-cpus", "2", "--mlflow-uri",
                      f"sqlite:///{tmp_path / 'm.db'}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, out


@pytest.mark.slow
def test_ladder_fronts_in_perplexity_and_the_answer(equal_memory_sweep):
    """Screening -> a short rung -> the full budget on a micro model: the fronts are in perplexity space
    (every row measured at the full budget, nothing dominated in time and perplexity), and the answer
    exists per host and budget."""
    proc, out = equal_memory_sweep
    budgets = BUDGETS
    rows = ledger(out)
    full = {r["key"]: r for r in rows if r["fidelity"] == "emulation" and r["budget"] == "full"}
    short = [r for r in rows if r["fidelity"] == "emulation" and r["budget"] == "256"]
    assert short and all(r["status"] == "ok" for r in list(full.values()) + short)
    # emulation.cpus auto: every CPU of the model's node (the embedded one: 2), as torch threads (Ray alone: 1)
    assert {r["torch_threads"] for r in list(full.values()) + short} == {2}
    assert len(full) <= MAX_FULL + 7  # max_full survivors + the named baselines
    stats = json.loads((out / "stats.json").read_text())
    rungs = stats["ladder"]["rungs"]
    assert [r["rung"] for r in rungs] == [0, "full"] and rungs[0]["candidates"] == len(short)
    assert rungs[1]["candidates"] == len(full)
    from sweep.report import pareto_mask, policy_key

    full_keys = {policy_key(r["params"]): r for r in full.values()}
    for host in ("rtx3090", "rtx4090"):
        front = pd.read_csv(out / f"pareto_{host}.csv")
        assert len(front) >= 1 and set(front["front_kind"]) == {"perplexity"}
        assert front[["ppl_change_pct", "ppl_ci_low", "ppl_ci_high"]].notna().all().all()
        assert set(front["policy_key"]) <= set(full_keys)  # every front row was measured at the full budget
        sims = {policy_key(r["params"]): r for r in rows if r["fidelity"] == "simulator" and r["host"] == host}
        pts = [(sims[pk]["time_per_token_s"], f["ppl_change_pct"], pk) for pk, f in full_keys.items() if pk in sims]
        # the front is the non-dominated set in (time, perplexity) over the full-budget policies ...
        keep = pareto_mask(np.array([(t, p) for t, p, _ in pts]))
        assert sorted(front["policy_key"]) == sorted(pk for (_, _, pk), k in zip(pts, keep, strict=True) if k)
        # ... so a policy off it (whatever its mass) is beaten in both time and perplexity by a front row
        on = set(front["policy_key"])
        for t, p, pk in pts:
            if pk not in on:
                assert any(t2 <= t and p2 <= p for t2, p2, pk2 in pts if pk2 in on), pk
    ans = pd.read_csv(out / "answer.csv")
    assert sorted(ans["host"].unique()) == ["rtx3090", "rtx4090"]
    assert sorted(ans["ppl_budget_pct"].unique()) == budgets
    loose = ans[ans["ppl_budget_pct"] == 50.0]
    assert loose["policy"].notna().all()  # fetch-every-miss (+0%) always fits a loose budget
    assert (loose["ppl_ci_high"] <= 50.0).all() and (loose["speed_ratio_vs_fetch_all"] >= 1.0 - 1e-9).all()
    summary = (out / "summary.md").read_text()
    assert summary.index("## The answer") < summary.index("## Fronts (perplexity)")
    tail = proc.stdout[proc.stdout.index("The answer"):]  # printed last
    assert all(f"| {h} | {b:g}% |" in tail for h in ("rtx3090", "rtx4090") for b in budgets)


@pytest.mark.slow
def test_equal_memory_answer(equal_memory_sweep):
    """`vram_budget_GiB: auto` end to end on a micro model: one device-memory budget for every policy.
    The low-bit fallback, whose copies of every expert leave fewer than k slots in that budget, is left
    out of the search (named in the summary), the admission delay's range ends at 1; admission beside an
    oracle prefetch, whose staging does not fit, is an `infeasible` trial, not a failure; every answer row
    uses at most the budget, gives its device memory, is no offline bound, and its speed ratio is over
    fetch-every-miss at the same budget."""
    proc, out = equal_memory_sweep
    rows = ledger(out)
    sim = [r for r in rows if r["fidelity"] == "simulator"]
    gib = {r["params"]["vram_budget_GiB"] for r in sim}
    assert len(gib) == 1  # one budget for every trial and baseline
    gib = gib.pop()
    assert not any(r["params"]["fallback"] == "lowbit" for r in sim)  # left out of the space: never drawn
    assert all(r["params"]["admission_delay"] == 1 for r in sim)  # the range cut where staging leaves < k slots
    bad = [r for r in sim if r["status"] not in ("ok", "infeasible")]
    assert not bad, bad[:2]
    infeasible = [r for r in sim if r["status"] == "infeasible"]
    # the budget is fetch-every-miss's 16 slots; admission staging takes L x k x delay buffers (8 slots per layer
    # per token of delay), an oracle prefetch L x k (8 more): admission fits only with delay 1 and no prefetch
    assert infeasible and all(r["params"]["beta"] is not None and "fewer than k = 8" in r["error"]
                              and (r["params"]["admission_delay"] >= 2 or r["params"]["prefetch"] != "off")
                              and r["capacity_slots"] < 8 for r in infeasible)
    ok = [r for r in sim if r["status"] == "ok"]
    assert all(r["params"]["admission_delay"] == 1 and r["params"]["prefetch"] == "off"
               for r in ok if r["params"]["beta"] is not None)
    assert all(r["device_memory_GiB"] <= gib * (1 + 1e-9) for r in ok)
    # perplexity is measured at the slots the simulator gave the policy in that budget (not the micro model's own
    # GiB, in which it would fit whole)
    from sweep.report import policy_key

    slots = {policy_key(r["params"]): r["capacity_slots"] for r in ok}
    emu = [r for r in rows if r["fidelity"] == "emulation" and r["status"] == "ok"]
    assert emu and all(r["capacity"] == slots[policy_key(r["params"])] for r in emu)
    assert any(r["capacity"] == [15, 15] for r in emu)  # quality-first: its one copy buffer per layer, one slot
    ans = pd.read_csv(out / "answer.csv")
    assert "device_memory_GiB" in ans and ans["policy"].notna().any()
    chosen = ans[ans["policy"].notna()]
    assert (chosen["device_memory_GiB"] <= 1.01 * gib).all() and (chosen["vram_budget_GiB"] == gib).all()
    assert set(chosen["ratio_basis"]) == {"same device memory"}
    assert not chosen["policy_key"].str.contains('"oracle"|"belady"').any()
    # the ratio is over fetch-every-miss at the same budget: its own time / the answer's time, per host
    for _, a in chosen.iterrows():
        fe = next(r for r in ok if r["host"] == a["host"] and r["baseline"] == "fetch-every-miss")
        assert a["speed_ratio_vs_fetch_all"] == pytest.approx(fe["time_per_token_s"] * 1e3 / a["time_per_token_ms"])
    summary = (out / "summary.md").read_text()
    assert "at the same device memory" in summary and "fallback = lowbit: no policy with it fits" in summary
    assert "| host | trials ok | infeasible at the budget | failed | front size |" in summary
    tail = proc.stdout[proc.stdout.index("The answer"):]
    assert "device GiB" in tail


def test_mlflow_as_users_read_it(tmp_path):
    """The experiment carries the classic-view runs table (a shared view with the key metrics as columns) and the
    printed runs page opens it; a child is named by its host and policy, with only its active parameters."""
    from runtime.core.policy import PRESETS
    from sweep import tracking
    from sweep.space import complete

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    t = tracking.Tracker(uri, "x")
    exp = t.client.get_experiment(t.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(exp.tags[tracking.VIEW_TAG])
    assert view["orderByKey"] == "metrics.`time_per_token_s`" and view["orderByAsc"] is True
    assert {f"metrics.`{m}`" for m in ("time_per_token_s", "speed_ratio_vs_fetch_all", "ppl_change_pct",
                                       "ppl_ci_low", "ppl_ci_high")} <= set(view["selectedColumns"])
    page = tracking.runs_page("http://127.0.0.1:5000", t.experiment_id)
    assert page.endswith(f"/runs?workflowType=machine_learning&viewStateShareKey={tracking.VIEW_KEY}")
    assert tracking.VIEW_TAG == f"mlflow.sharedViewState.{tracking.VIEW_KEY}"
    for preset, absent, present in (("speed-first", {"lowbit_bits", "lowbit_group", "tau_high"}, {"rule"}),
                                    ("rule-0.15", {"lowbit_bits", "admission_delay", "prefetch_n"}, {"tau"})):
        params = {**complete(PRESETS[preset].to_dict()), "capacity_fraction": 0.25}
        rec = {"key": "k", "host": "rtx4090", "policy": "label", "baseline": preset, "params": params}
        name, tags, logged, _ = tracking.child_payload(rec, "GeForce RTX 4090")
        assert name == f"rtx4090 · {preset}" and tags["mlflow.runName"] == name
        assert not absent & set(logged) and present <= set(logged) and "capacity_fraction" in logged
        active = {p for p in logged if p in params} - {"capacity_fraction"}
        assert active == set(PRESETS[preset].active_params()) & set(params)
    lowbit = {**complete({**PRESETS["rule-0.15"].to_dict(), "fallback": "lowbit"}), "capacity_fraction": 0.25}
    assert "lowbit_bits" in tracking.active_params(lowbit)  # active with a low-bit fallback
