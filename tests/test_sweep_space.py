"""Unit tests of the sweep's pieces that need no Ray: spaces, configs, the journal, fronts, reports."""

from __future__ import annotations

import json
import pickle

import numpy as np
import optuna
import pandas as pd
import pytest
import yaml

from runtime.errors import InputError
from runtime.policy import PRESETS
from sweep import config as sweep_config
from sweep.recorder import Ledger
from sweep.remeasure import candidates
from sweep.report import pareto_mask, pearson, policy_key, trials_frame, write_report
from sweep.search import ORPHANED, HostSearch, HostStudy, journal_storage, make_sampler
from sweep.space import complete, parse_space, policy_of

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = {
    "rule": {"choices": ["threshold", "first_choice", "substitute_all"]},
    "tau": {"low": 0.05, "high": 0.5, "log": True},
    "evict": {"choices": ["lfu", "crf"]},
    "gamma": {"low": 0.9, "high": 1.0},
    "half_life": {"low": 4, "high": 64, "log": True},
    "beta": {"low": 0.1, "high": 2.0, "log": True, "off": True},
    "admission_delay": {"low": 1, "high": 3},
    "capacity_fraction": {"low": 0.15, "high": 0.4},
}


@pytest.mark.parametrize("spec, message", [
    ({**SPACE, "taus": 0.1}, "unknown parameter 'taus'"),
    ({**SPACE, "tau": {"low": 0.5, "high": 0.1}}, "empty range low = 0.5 >= high = 0.1"),
    ({**SPACE, "tau": {"low": 0.2, "high": 0.2}}, "empty range"),
    ({**SPACE, "evict": {"choices": []}}, "empty choices"),
    ({**SPACE, "tau": {"low": "a", "high": 0.3}}, "space.tau.low = 'a' must be a number"),
    ({**SPACE, "gamma": {"low": 0.5, "high": 1.5}}, "space.gamma.high = 1.5 must be in (0, 1]"),
    ({**SPACE, "rule": "thresh"}, "space.rule = 'thresh' is unknown (choose from fetch_all"),
    ({**SPACE, "admission_delay": {"low": 1.5, "high": 3}}, "must be an integer"),
    ({**SPACE, "tau": {"low": 0.1, "high": 0.3, "colour": 1}}, "unknown key 'colour'"),
    ({**SPACE, "gamma": {"low": 0.9, "high": 1.0, "off": True}}, "only beta and prefetch_n can be switched off"),
    ({k: v for k, v in SPACE.items() if k != "capacity_fraction"}, "exactly one of capacity_fraction"),
    ({k: v for k, v in SPACE.items() if k != "tau"}, "rule can be threshold but tau is not given"),
    ({**SPACE, "evict": {"choices": ["lfu", "belady"]}}, "belady is an offline bound"),
    ({"capacity_fraction": 0.25}, "nothing to search"),
])
def test_space_errors_are_one_line(spec, message):
    with pytest.raises(InputError) as e:
        parse_space(spec)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_yaml_off_reads_as_beta_off(tmp_path):
    text = "space:\n  beta: {choices: [off, 0.5]}\n  capacity_fraction: {low: 0.2, high: 0.3}\n"
    (tmp_path / "s.yaml").write_text(text)
    cfg = sweep_config.load_config(tmp_path / "s.yaml")
    assert cfg.space["beta"].choices == (None, 0.5)
    assert cfg.name == "s"
    space = parse_space(yaml.safe_load("beta: {low: 0.1, high: 1, off: true}\ncapacity_fraction: 0.25"))
    assert space["beta"].off


def test_conditional_sampling_follows_the_policy_semantics():
    space = parse_space(SPACE)
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(80):
        trial = study.ask()
        cfg = space.sample(trial)
        policy_of(cfg).validate()
        assert ("tau" in trial.params) == (cfg["rule"] == "threshold")
        assert ("gamma" in trial.params) == (cfg["evict"] == "lfu")
        assert ("half_life" in trial.params) == (cfg["evict"] == "crf")
        assert ("admission_delay" in trial.params) == (cfg["beta"] is not None)
        assert cfg["tau"] is None or 0.05 <= cfg["tau"] <= 0.5
        assert 0.15 <= cfg["capacity_fraction"] <= 0.4
        seen.add((cfg["rule"], cfg["evict"], cfg["beta"] is None))
        study.tell(trial, [cfg["capacity_fraction"], 1.0])
    assert len(seen) >= 8


def test_baselines_inside_the_space_become_optuna_trials():
    space = parse_space(SPACE)
    study = optuna.create_study(directions=["minimize", "minimize"])
    inside = complete({**PRESETS["quality-first"].to_dict(), "capacity_fraction": 0.25})
    outside = complete({**PRESETS["host-compute"].to_dict(), "capacity_fraction": 0.25})
    assert space.contains(inside) and not space.contains(outside)
    params, dists = space.optuna_params(inside)
    study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, values=[1.0, 2.0]))
    assert study.trials[0].params["tau"] == 0.15 and study.trials[0].params["beta"] == 0.5


def test_config_errors(tmp_path):
    base = {"trace": "t.parquet", "space": SPACE}
    for extra, message in [({"hosst": ["a"]}, "unknown key 'hosst'"),
                           ({"trials": -1}, "trials = -1 must be an integer >= 0"),
                           ({"sampler": "cmaes"}, "sampler = 'cmaes'"),
                           ({"objectives": ["mass_per_token"]}, "objectives"),
                           ({"hosts": ["a", "a"]}, "listed twice"),
                           ({"baselines": {"policies": ["nope"]}}, "baselines.policies")]:
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            sweep_config.from_dict({**base, **extra}, "x.yaml")
    cfg = sweep_config.from_dict({**base, "hosts": [{"name": "box", "profile": "preset:rtx3090"}]}, "x.yaml")
    assert cfg.hosts[0].resource == "host:box"
    assert cfg.baseline_capacity() == {"capacity_fraction": 0.25}


def test_journal_storage_round_trip_and_pickle(tmp_path):
    storage = journal_storage(tmp_path / "j.journal")
    study = optuna.create_study(storage=storage, study_name="s", directions=["minimize", "minimize"])
    for _ in range(5):
        t = study.ask()
        x = t.suggest_float("x", 0, 1)
        study.tell(t, [x, 1 - x])
    again = optuna.load_study(study_name="s", storage=journal_storage(tmp_path / "j.journal"))
    assert len(again.trials) == 5
    copy = pickle.loads(pickle.dumps(study))  # Tune pickles the searcher with its studies
    t = copy.ask()
    copy.tell(t, [0.5, 0.5])
    assert len(optuna.load_study(study_name="s", storage=journal_storage(tmp_path / "j.journal")).trials) == 6


def test_host_search_baselines_first_then_batches(tmp_path):
    space = parse_space(SPACE)
    storage = journal_storage(tmp_path / "o.journal")
    searchers = {h: HostStudy(space, ("time_per_token_s", "mass_per_token"), make_sampler("nsga2", 0, 4),
                              storage, f"t:{h}") for h in ("a", "b")}
    base = {h: [{"key": f"{h}:baseline:rule-0.15", "number": None, "baseline": "rule-0.15",
                 "params": complete({**PRESETS["rule-0.15"].to_dict(), "capacity_fraction": 0.25})}]
            for h in ("a", "b")}
    hs = HostSearch(searchers, base, trials=5, batch=2, task_seconds=1.0, parallelism=1)
    first = [hs.suggest("t0"), hs.suggest("t1")]
    assert [c["items"][0]["baseline"] for c in first] == ["rule-0.15", "rule-0.15"]
    configs = {}
    for i in range(2, 20):
        c = hs.suggest(f"t{i}")
        if c == "FINISHED":
            break
        configs[f"t{i}"] = c
    assert sum(len(c["items"]) for c in configs.values()) == 10  # 5 per host, in batches of <= 2
    tid, c = next(iter(configs.items()))
    rows = [{"number": it["number"], "baseline": None, "status": "ok", "time_per_token_s": 1.0,
             "mass_per_token": 0.1, "eval_seconds": 0.01} for it in c["items"]]
    hs.on_trial_result(tid, {"items": rows})
    hs.on_trial_result(tid, {"items": rows})  # a repeated report is told once
    hs.on_trial_complete(tid, {"items": []})
    study = searchers[c["host"]].study
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == len(rows)
    # the state is saved as JSON data; a restore fails the trials asked but held by no restored Tune
    # trial as orphans (not counted against the budget, so they are asked again)
    held = next(t for t, c2 in configs.items() if t != tid and c2["host"] == c["host"])
    state = tmp_path / "hs.json"
    hs.save(str(state))
    saved = json.loads(state.read_text())
    assert saved["asked"] == hs.asked and held in saved["pending"][c["host"]]
    before = hs.asked[c["host"]]
    extra = hs.searchers[c["host"]].study.ask()  # asked after the save: held by no Tune trial
    again = {h: HostStudy(space, ("time_per_token_s", "mass_per_token"), make_sampler("nsga2", 0, 4),
                          journal_storage(tmp_path / "o.journal"), f"t:{h}") for h in ("a", "b")}
    fresh = HostSearch(again, base, trials=5, batch=2, task_seconds=1.0, parallelism=1)
    fresh.restore(str(state))
    st = again[c["host"]].study
    assert extra.number in st.user_attrs[ORPHANED]
    assert st.trials[extra.number].state == optuna.trial.TrialState.FAIL
    assert fresh.asked[c["host"]] == before  # the orphan does not count
    assert all(st.trials[n].state == optuna.trial.TrialState.RUNNING for n in saved["pending"][c["host"]][held])


def test_pareto_mask_and_front():
    pts = np.array([[1, 5], [2, 2], [3, 3], [5, 1], [2, 2]], float)
    assert pareto_mask(pts).tolist() == [True, True, False, True, True]


def test_pearson_with_bootstrap_interval():
    rng = np.random.default_rng(0)
    x = rng.random(30)
    y = 2 * x + 0.05 * rng.standard_normal(30)
    r = pearson(x, y)
    assert r["r"] > 0.95 and r["ci_low"] <= r["r"] <= r["ci_high"] <= 1
    assert np.isnan(pearson(x[:2], y[:2])["r"])


def _rows(host: str, n: int) -> list[dict]:
    rng = np.random.default_rng(len(host))
    rows = []
    for i in range(n):
        cf = 0.15 + 0.02 * i
        rule = ["threshold", "first_choice", "substitute_all"][i % 3]
        params = complete({"rule": rule, "tau": 0.15 if rule == "threshold" else None, "capacity_fraction": cf})
        t = float(rng.random())
        rows.append({"key": f"{host}:{i}", "number": i, "baseline": "rule-0.15" if i == 0 else None,
                     "params": params, "host": host, "fidelity": "simulator", "status": "ok",
                     "time_per_token_s": 1e-3 * (1 + t), "mass_per_token": 1 - t + 0.01 * i,
                     "speed_ratio_vs_fetch_all": 1.5, "speed_ratio_vs_host_compute": 1.2,
                     "speed_ratio_vs_all_resident": 0.5, "policy": policy_of(params).label()})
    rows.append({**rows[1], "key": f"{host}:x", "status": "failed", "error": "boom"})
    return rows


def test_report_files_and_candidates(tmp_path):
    rows = _rows("a", 12) + _rows("b", 9)
    rows.append({"key": "emulation:1", "params": rows[2]["params"], "host": "all", "fidelity": "emulation",
                 "status": "ok", "ppl_change_pct": 1.5, "ppl_ci_low": 1.0, "ppl_ci_high": 2.0, "mass_per_token": 0.3})
    rep = write_report(tmp_path, rows, ["a", "b"], ("time_per_token_s", "mass_per_token"),
                       {"name": "t", "objectives": ("time_per_token_s", "mass_per_token")})
    for f in ("pareto_a.csv", "pareto_a.parquet", "pareto_b.csv", "speed_ratios.csv", "pareto.png",
              "pareto_a.png", "summary.md", "trials.csv"):
        assert (tmp_path / f).stat().st_size > 0, f
    fr = pd.read_csv(tmp_path / "pareto_a.csv")
    df = trials_frame(rows)
    ok = df[(df.host == "a") & (df.status == "ok")]
    for _, r in fr.iterrows():  # nothing in the front is dominated by an ok trial
        assert not ((ok.time_per_token_s <= r.time_per_token_s) & (ok.mass_per_token <= r.mass_per_token)
                    & ((ok.time_per_token_s < r.time_per_token_s) | (ok.mass_per_token < r.mass_per_token))).any()
    assert "## Mass hypothesis" in (tmp_path / "summary.md").read_text()
    cands = candidates(rep["fronts"], [rows[0]], 3)
    assert policy_key(cands[0]) == policy_key(rows[0]["params"]) and len(cands) <= 4


def test_ledger_writes_each_key_once(tmp_path):
    led = Ledger(tmp_path / "l.jsonl")
    assert led.add({"key": "a", "x": 1}) and not led.add({"key": "a", "x": 2})
    led.close()
    with open(tmp_path / "l.jsonl", "a") as f:
        f.write('{"key": "b", "x"')  # a line cut short by a killed driver
    again = Ledger(tmp_path / "l.jsonl")
    assert [r["key"] for r in again.rows] == ["a"]
    again.close()
