"""Unit tests of the sweep's pieces that need no Ray: spaces, configs, the journal, fronts, reports."""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import replace

import numpy as np
import optuna
import pandas as pd
import pytest
import yaml

from runtime.core.errors import InputError
from runtime.core.policy import PRESETS
from runtime.formats import costmodel
from sweep import config as sweep_config
from sweep.ladder import screening_candidates
from sweep.ledger import Ledger
from sweep.report import pareto_mask, pearson, policy_key, trials_frame, write_report
from sweep.search import HostSearch, HostStudy, journal_storage, make_sampler
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
    ({**SPACE, "gamma": {"low": 0.9, "high": 1.0, "off": True}}, "only beta and prefetch_n and copy_buffers can be switched off"),
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
                           ({"baselines": {"policies": ["nope"]}}, "baselines.policies"),
                           ({"emulation": {"rungs": [512, 256]}}, "emulation.rungs = [512, 256] must be increasing"),
                           ({"max_tokens": 1024, "emulation": {"rungs": [1024]}}, "below max_tokens = 1024"),
                           ({"emulation": {"max_full": 0}}, "emulation.max_full = 0"),
                           ({"emulation": {"sizes": 1}}, "expected false or"),
                           ({"ppl_budgets_pct": [1, -2]}, "ppl_budgets_pct"),
                           ({"text": "a.txt", "calib_text": "./a.txt"}, "is the evaluated text")]:
        with pytest.raises(InputError, match=re.escape(message)):
            sweep_config.from_dict({**base, **extra}, "x.yaml")
    cfg = sweep_config.from_dict({**base, "hosts": [{"name": "box", "profile": "preset:rtx3090"}]}, "x.yaml")
    assert cfg.hosts[0].resource == "host:box"
    assert cfg.baseline_capacity() == {"capacity_fraction": 0.25}
    assert cfg.emulation.enabled and cfg.ppl_budgets_pct == (0.5, 1.0, 2.0)
    off = sweep_config.from_dict({**base, "emulation": False, "ppl_budgets_pct": [2, 0.25]}, "x.yaml")
    assert not off.emulation.enabled and off.ppl_budgets_pct == (0.25, 2.0)


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
                              storage, f"t:{h}", h) for h in ("a", "b")}
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
    host = c["host"]
    rows = [{"key": it["key"], "number": it["number"], "baseline": None, "status": "ok", "time_per_token_s": 1.0,
             "mass_per_token": 0.1, "eval_seconds": 0.01} for it in c["items"]]
    hs.on_trial_result(tid, {"items": rows})
    hs.on_trial_result(tid, {"items": rows})  # a repeated report is told once
    hs.on_trial_complete(tid, {"items": []})
    done = [t for t in searchers[host].study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == len(rows)
    # each finished trial is one record in the journal, with its key
    record = optuna.load_study(study_name=f"t:{host}", storage=journal_storage(tmp_path / "o.journal"))
    assert sorted(t.user_attrs["key"] for t in record.trials) == sorted(r["key"] for r in rows)
    # the state is saved as JSON data; a restore rebuilds the studies from the records and asks the
    # still-pending trials again with the same values; trials asked after the save do not count
    held_tid, held = next((t, c2) for t, c2 in configs.items() if t != tid and c2["host"] == host)
    state = tmp_path / "hs.json"
    hs.save(str(state))
    saved = json.loads(state.read_text())
    assert saved["asked"] == hs.asked and set(saved["pending"][host][held_tid]) == {it["key"] for it in held["items"]}
    hs.searchers[host].ask_batch("after-the-save", 2)  # lost with the driver
    again = {h: HostStudy(space, ("time_per_token_s", "mass_per_token"), make_sampler("nsga2", 0, 4),
                          journal_storage(tmp_path / "o.journal"), f"t:{h}", h) for h in ("a", "b")}
    fresh = HostSearch(again, base, trials=5, batch=2, task_seconds=1.0, parallelism=1)
    fresh.restore(str(state))
    assert fresh.asked == saved["asked"]
    st = again[host].study
    pending = [it for t, c2 in configs.items() if t != tid and c2["host"] == host for it in c2["items"]]
    assert len(st.trials) == len(rows) + len(pending)
    running = [t for t in st.trials if t.state == optuna.trial.TrialState.RUNNING]
    assert sorted(t.params["capacity_fraction"] for t in running) == sorted(
        it["params"]["capacity_fraction"] for it in pending)
    # the restored pending trials are told by key, then recorded
    late = [{"key": it["key"], "number": it["number"], "baseline": None, "status": "ok", "time_per_token_s": 2.0,
             "mass_per_token": 0.2, "eval_seconds": 0.01} for it in held["items"]]
    fresh.on_trial_complete(held_tid, {"items": late})
    assert len(again[host].journal.trials) == len(rows) + len(late)
    assert again[host].next_index > max(int(it["key"].split(":")[1]) for it in held["items"])


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
                     "speed_ratio_vs_all_resident": 0.5, "policy": policy_of(params).label(),
                     "device_memory_GiB": 2.0 + cf})
    rows.append({**rows[1], "key": f"{host}:x", "status": "failed", "error": "boom"})
    return rows


def test_report_files_candidates_and_answer(tmp_path):
    rows = _rows("a", 12) + _rows("b", 9)
    # two policies measured at the full budget: the slower one is exact, the faster costs 1.5%
    fast, slow = rows[2], rows[4]
    for r, (ppl, lo, hi) in ((fast, (1.5, 1.0, 2.0)), (slow, (0.0, 0.0, 0.0))):
        rows.append({"key": f"emulation:full:{r['key']}", "params": r["params"], "host": "all",
                     "fidelity": "emulation", "budget": "full", "status": "ok", "ppl_change_pct": ppl,
                     "ppl_ci_low": lo, "ppl_ci_high": hi, "mass_per_token": 0.3})
    rep = write_report(tmp_path, rows, ["a", "b"], ("time_per_token_s", "mass_per_token"),
                       {"name": "t", "objectives": ("time_per_token_s", "mass_per_token"), "budgets": [1.0, 2.0]})
    for f in ("pareto_a.csv", "pareto_a.parquet", "pareto_b.csv", "screening_a.csv", "speed_ratios.csv",
              "pareto.png", "pareto_a.png", "summary.md", "trials.csv", "answer.csv"):
        assert (tmp_path / f).stat().st_size > 0, f
    scr = pd.read_csv(tmp_path / "screening_a.csv")
    df = trials_frame(rows)
    for first in (True, False):  # nothing in a family's screening front is dominated within the family
        ok = df[(df.host == "a") & (df.status == "ok") & (df.fetches_first_choice == first)]
        for _, r in scr[scr.fetches_first_choice == first].iterrows():
            assert not ((ok.time_per_token_s <= r.time_per_token_s) & (ok.mass_per_token <= r.mass_per_token)
                        & ((ok.time_per_token_s < r.time_per_token_s) | (ok.mass_per_token < r.mass_per_token))).any()
    # the reported front is in perplexity: only the two measured policies can be on it
    fr = pd.read_csv(tmp_path / "pareto_a.csv")
    assert set(fr["policy_key"]) <= {policy_key(fast["params"]), policy_key(slow["params"])}
    assert fr[["ppl_change_pct", "ppl_ci_low", "ppl_ci_high"]].notna().all().all()
    ans = rep["answer"].set_index(["host", "ppl_budget_pct"])
    t_fast, t_slow = fast["time_per_token_s"], slow["time_per_token_s"]
    assert ans.loc[("a", 1.0), "policy"] == slow["policy"]  # the 1.5% policy's upper bound (2%) exceeds 1%
    assert ans.loc[("a", 2.0), "policy"] == (fast["policy"] if t_fast < t_slow else slow["policy"])
    summary = (tmp_path / "summary.md").read_text()
    assert summary.index("## The answer") < summary.index("## Mass hypothesis")
    # policy x host: the baseline on both hosts, each answer policy where it was screened, with its perplexity
    pbh = pd.read_csv(tmp_path / "policy_by_host.csv")
    base = pbh[pbh["policy_key"] == policy_key(rows[0]["params"])]
    assert sorted(base["host"]) == ["a", "b"] and not base["in_answer"].any()
    for pk in set(ans["policy_key"].dropna()):
        mine = pbh[pbh["policy_key"] == pk]
        assert mine["in_answer"].all() and set(mine["host"]) == set(mine["screened_on"].iloc[0].split(","))
        assert mine["ppl_ci_high"].notna().all()
    assert "## Policy x host" in summary and summary.index("## The answer") < summary.index("## Policy x host")
    # without any perplexity, the reported front holds only first-choice-fetching policies (never by mass alone)
    sim_only = [r for r in rows if r.get("fidelity") == "simulator"]
    (tmp_path / "sim").mkdir()
    rep2 = write_report(tmp_path / "sim", sim_only, ["a", "b"], ("time_per_token_s", "mass_per_token"), {"name": "t"})
    assert rep2["answer"].empty and "No perplexity was measured" in (tmp_path / "sim" / "summary.md").read_text()
    for h in ("a", "b"):
        f2 = pd.read_csv(tmp_path / "sim" / f"pareto_{h}.csv")
        assert len(f2) >= 1 and f2["fetches_first_choice"].all()
        assert (pd.read_csv(tmp_path / "sim" / f"screening_{h}.csv")["fetches_first_choice"] == False).any()  # noqa: E712
    cands = screening_candidates(rows, ["a", "b"])
    assert cands and all(policy_key(c) in set(df["policy_key"]) for c in cands)


def test_ledger_writes_each_key_once(tmp_path):
    led = Ledger(tmp_path / "l.jsonl")
    assert led.add({"key": "a", "x": 1}) and not led.add({"key": "a", "x": 2})
    led.close()
    with open(tmp_path / "l.jsonl", "a") as f:
        f.write('{"key": "b", "x"')  # a line cut short by a killed driver
    again = Ledger(tmp_path / "l.jsonl")
    assert [r["key"] for r in again.rows] == ["a"]
    again.close()


def test_mlflow_progress_counts_infeasible_trials_apart_from_failed(tmp_path):
    """trials_failed_<host> counts only failed trials; one that did not fit the budget is trials_infeasible_<host>."""
    from sweep.ledger import Session

    class Tracker:
        def log_parent_metrics(self, metrics, step=None):
            self.metrics, self.step = metrics, step

    led = Ledger(tmp_path / "l.jsonl")
    for i, status in enumerate(["ok", "ok", "infeasible", "infeasible", "infeasible", "failed"]):
        led.add({"key": f"a:{i}", "host": "a", "fidelity": "simulator", "status": status})
    led.add({"key": "emulation:full:x", "host": "all", "fidelity": "emulation", "status": "failed"})
    tr = Tracker()
    Session(tmp_path, led, tr, ["a"], {"a": "gpu"}, ("time_per_token_s",)).refresh()
    assert tr.metrics == {"trials_ok_a": 2, "trials_infeasible_a": 3, "trials_failed_a": 1} and tr.step == 6
    led.close()


def test_policy_families_from_the_table_in_a_space():
    """The fields added to the parameter table (fallback, lowbit, prefetch) are searchable with no
    sweep-side list; a string choice named off (prefetch) stays a value, beta off stays None."""
    space = parse_space(yaml.safe_load("""
rule: {choices: [threshold, substitute_all]}
tau: {low: 0.1, high: 0.4}
fallback: {choices: [substitute, drop, host, lowbit]}
lowbit_bits: {choices: [8, 4]}
beta: {choices: [off, 0.5]}
prefetch: {choices: [off, oracle]}
prefetch_n: {low: 1, high: 8, off: true}
capacity_fraction: 0.25
"""))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(60):
        trial = study.ask()
        cfg = space.sample(trial)
        pol = policy_of(cfg)
        assert cfg["prefetch"] in ("off", "oracle") and cfg["beta"] in (None, 0.5)
        assert ("lowbit_bits" in trial.params) == (cfg["fallback"] == "lowbit")
        assert ("prefetch_n" in trial.params or "prefetch_n_off" in trial.params) == (cfg["prefetch"] != "off")
        assert space.contains(cfg)
        seen.add((pol.fallback, pol.prefetch))
        study.tell(trial, 1.0)
    assert len(seen) == 8
    with pytest.raises(InputError, match="space.fallback.choices\\[0\\] = 'cpu' is unknown"):
        parse_space({"fallback": {"choices": ["cpu"]}, "capacity_fraction": 0.25, "rule": "threshold", "tau": 0.2})


def test_resumed_nsga2_search_continues_its_generations(tmp_path):
    """The journal keeps each trial's sampler state: a study rebuilt from it (what --resume does) has the
    same generation numbers and asks its next trial in the generation an uninterrupted study would."""
    space = parse_space(SPACE)
    objectives = ("time_per_token_s", "mass_per_token")

    def host_study() -> HostStudy:
        return HostStudy(space, objectives, make_sampler("nsga2", 0, 4), journal_storage(tmp_path / "o.journal"),
                         "t:a", "a")

    first = host_study()
    for i in range(10):
        [(key, _, params)] = first.ask_batch(f"t{i}", 1)
        first.tell_row(f"t{i}", {"key": key, "status": "ok", "time_per_token_s": params["capacity_fraction"],
                                 "mass_per_token": 1.0 - params["capacity_fraction"]})
    sampler = first.sampler

    def generations(study: optuna.Study) -> list[int]:
        return [sampler.get_trial_generation(study, t) for t in study.get_trials(deepcopy=False)]

    before = generations(first.study)
    assert before == [0] * 4 + [1] * 4 + [2] * 2
    resumed = host_study()
    assert [t.user_attrs["key"] for t in resumed.study.trials] == [f"a:{i}" for i in range(10)]
    assert [t.system_attrs for t in resumed.study.trials] == [t.system_attrs for t in first.study.trials]
    assert generations(resumed.study) == before
    resumed.ask_batch("next", 1)
    first.ask_batch("next", 1)
    assert generations(resumed.study)[-1] == generations(first.study)[-1] == 2


def test_ladder_promotes_the_best_third_of_each_rung_ties_by_key():
    """Synchronous halving: every rung keeps the best ceil(n / eta) by score, ties by policy key, and the
    result does not depend on the order the candidates come in."""
    from sweep import ladder

    cands = [complete({**PRESETS["rule-0.15"].to_dict(), "tau": 0.05 + 0.01 * i, "capacity_fraction": 0.25})
             for i in range(10)]
    keys = {policy_key(c): i for i, c in enumerate(cands)}
    # the speed ratio is the same for every policy; the rung's perplexity decides: policies 3, 7 and 5 (and
    # the tie 2 ~ 8) meet the budget at rung 0, the others do not
    rows = [{"fidelity": "simulator", "status": "ok", "host": "a", "params": c, "speed_ratio_vs_fetch_all": 2.0}
            for c in cands]
    ppl = {3: 0.1, 7: 0.2, 5: 0.3, 2: 0.4, 8: 0.4}
    seen: list[tuple[int, list[int]]] = []

    def measure(params: list[dict], tokens: int | None, name: str) -> dict[str, dict]:
        idx = sorted(keys[policy_key(p)] for p in params if policy_key(p) in keys)
        seen.append((tokens, idx))
        # rung 1 (200 tokens): only policy 5 meets the budget
        pct = {i: (ppl.get(i, 5.0) if tokens == 100 else (0.1 if i == 5 else 5.0)) for i in idx}
        return {policy_key(cands[i]): {"status": "ok", "ppl_change_pct": pct[i]} for i in idx}

    def run(order: list[dict]) -> dict:
        seen.clear()
        return ladder.run_ladder(order, [], rows, ["a"], [100, 200], eta=3, max_full=8, full_tokens=None,
                                 budgets=[0.3], measure=measure)

    out = run(cands)
    assert [s["promoted"] for s in out["rungs"][:2]] == [4, 2]  # ceil(10 / 3), ceil(4 / 3)
    assert seen[0] == (100, list(range(10)))
    # rung 0: 3, 7, 5 meet 0.3 (score -2), then the ties at score 0 by policy key: the smallest key goes on
    rest = sorted((k for k, i in keys.items() if i not in (3, 7, 5)))
    assert seen[1] == (200, sorted([3, 7, 5, keys[rest[0]]]))
    # rung 1: 5 alone scores -2; the second of ceil(4 / 3) = 2 is the smallest key of the rest
    second = min((k for k, i in keys.items() if i in (3, 7, keys[rest[0]])))
    assert out["full"] == [policy_key(cands[5]), second]
    shuffled = [cands[i] for i in np.random.default_rng(1).permutation(10)]
    assert run(shuffled)["full"] == out["full"]
    assert ladder.promote({"b": 1.0, "a": 1.0, "c": 0.5}, 2) == ["c", "a"]


def test_mlflow_tracking_uri_is_honoured_and_runs_carry_their_source(tmp_path, monkeypatch):
    """Without --mlflow-uri the store is MLFLOW_TRACKING_URI; a bad one is a one-line error naming the
    variable; the parent and child runs carry MLflow's source and git tags; metrics queued through MLflow's
    async logging are in the store after flush; the runs page is the experiment's #/runs."""
    from mlflow.tracking import MlflowClient

    from sweep import tracking

    db = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", db)
    assert tracking.resolve_uri(None) == db
    assert tracking.resolve_uri(f"sqlite:///{tmp_path / 'flag.db'}") == f"sqlite:///{tmp_path / 'flag.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:/nowhere")
    with pytest.raises(InputError, match=r"^MLFLOW_TRACKING_URI 'file:/nowhere': expected"):
        tracking.resolve_uri(None)

    tr = tracking.Tracker(db)
    parent = tr.start_parent("t", params={"trials": 3}, tags={"sweep": "t"})
    for step in range(1, 4):
        tr.log_parent_metrics({"trials_ok_a": float(step)}, step=step)
    rec = {"key": "a:0", "host": "a", "policy": "threshold(0.15) + lfu", "fidelity": "simulator", "status": "ok",
           "params": {"rule": "threshold", "tau": 0.15}, "time_per_token_s": 0.01, "finished_at": 1.0}
    tr.log_children([rec], {"a": "RTX 4090"})
    tr.close()
    client = MlflowClient(db)
    assert [m.value for m in client.get_metric_history(parent, "trials_ok_a")] == [1.0, 2.0, 3.0]
    [child] = client.search_runs([tr.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert child.data.metrics["time_per_token_s"] == 0.01 and child.data.params["tau"] == "0.15"
    import subprocess

    commit = subprocess.run(["git", "-C", str(tracking.REPO), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    for run in (client.get_run(parent), child):
        tags = run.data.tags
        assert tags["mlflow.source.name"] == "sweep/pareto.py" and tags["mlflow.source.type"] == "LOCAL"
        assert tags["mlflow.source.git.commit"] == commit and tags["mlflow.source.git.dirty"] in ("true", "false")
    assert client.get_run(parent).info.status == "FINISHED" and tr.errors == 0
    assert tracking.runs_page("http://127.0.0.1:5000/", tr.experiment_id) == \
        f"http://127.0.0.1:5000/#/experiments/{tr.experiment_id}/runs?{tracking.RUNS_VIEW}"
    assert tracking.experiment_id_of(db) == tr.experiment_id
    assert tracking.experiment_id_of(f"sqlite:///{tmp_path / 'empty.db'}") is None


def test_offline_bounds_are_drawn_never_answered(tmp_path):
    """Oracle prefetch and Belady eviction, the fastest and exact here, are neither in the answer, a front,
    the speed-ratio table nor the ladder's candidates; they are listed (and drawn) as bounds."""
    rows = _rows("a", 9)
    real = rows[4]
    oracle = complete({"rule": "fetch_all", "prefetch": "oracle", "capacity_fraction": 0.25})
    belady = complete({"rule": "fetch_all", "evict": "belady", "capacity_fraction": 0.25})
    for i, (params, name) in enumerate(((oracle, "bound:oracle prefetch B=1"), (belady, "bound:Belady eviction"))):
        rows.append({**real, "key": f"a:bound{i}", "params": params, "baseline": name, "mass_per_token": 0.0,
                     "time_per_token_s": 1e-5 * (1 + i), "policy": policy_of(params).label()})
    # a sampled trial that happens to use the future, faster than the computed bound: screened, not a bound
    sampled = complete({"rule": "fetch_all", "prefetch": "oracle", "prefetch_n": 1, "capacity_fraction": 0.25})
    rows.append({**real, "key": "a:sampled-oracle", "params": sampled, "baseline": None, "mass_per_token": 0.0,
                 "time_per_token_s": 5e-6, "policy": policy_of(sampled).label()})
    for r in (real, rows[-2], rows[-1]):  # all three measured exact at the full budget
        rows.append({"key": f"emulation:full:{r['key']}", "params": r["params"], "host": "all",
                     "fidelity": "emulation", "budget": "full", "status": "ok", "ppl_change_pct": 0.0,
                     "ppl_ci_low": 0.0, "ppl_ci_high": 0.0, "mass_per_token": r["mass_per_token"]})
    rep = write_report(tmp_path, rows, ["a"], ("time_per_token_s", "mass_per_token"),
                       {"name": "t", "objectives": ("time_per_token_s", "mass_per_token"), "budgets": [1.0]})
    bound_keys = {policy_key(oracle), policy_key(belady), policy_key(sampled)}
    ans = pd.read_csv(tmp_path / "answer.csv")
    assert list(ans["policy_key"]) == [policy_key(real["params"])]
    # the answer gives the device memory the policy uses beside its time
    assert ans["device_memory_GiB"].tolist() == [pytest.approx(real["device_memory_GiB"])]
    assert "| device GiB |" in (tmp_path / "summary.md").read_text().split("## Offline bounds")[0]
    from sweep.pareto import _answer_metrics

    assert _answer_metrics(rep["answer"])["answer_a_within_1pct_device_memory_GiB"] == pytest.approx(
        real["device_memory_GiB"])
    for f in ("pareto_a.csv", "screening_a.csv"):
        assert not set(pd.read_csv(tmp_path / f)["policy_key"]) & bound_keys, f
    assert not set(pd.read_csv(tmp_path / "speed_ratios.csv")["policy"]) & {policy_of(oracle).label(),
                                                                            policy_of(belady).label()}
    assert not {policy_key(c) for c in screening_candidates(rows, ["a"])} & bound_keys
    bd = pd.read_csv(tmp_path / "bounds.csv")
    assert sorted(bd["bound"]) == ["Belady eviction", "oracle prefetch"]
    assert bd.set_index("bound").loc["oracle prefetch", "time_per_token_ms"] == pytest.approx(1e-2)
    summary = (tmp_path / "summary.md").read_text()
    assert "## Offline bounds" in summary and summary.index("## The answer") < summary.index("## Offline bounds")
    assert not rep["bounds"].empty and (tmp_path / "pareto_a.png").stat().st_size > 0
    assert rep["plot_xscale"] == {"a": "linear"}  # every measured policy within 4x the largest budget
    # a policy far beyond the budgets (+120%): the perplexity axis ends at 3x the largest budget, the far one at its edge
    far = rows[6]
    rows.append({"key": f"emulation:full:{far['key']}", "params": far["params"], "host": "all", "fidelity": "emulation",
                 "budget": "full", "status": "ok", "ppl_change_pct": 120.0, "ppl_ci_low": 110.0, "ppl_ci_high": 130.0,
                 "mass_per_token": 0.9})
    (tmp_path / "far").mkdir()
    rep2 = write_report(tmp_path / "far", rows, ["a"], ("time_per_token_s", "mass_per_token"),
                        {"name": "t", "objectives": ("time_per_token_s", "mass_per_token"), "budgets": [1.0]})
    assert rep2["plot_xscale"] == {"a": "clipped at 3%"}  # ends at 3x the largest budget; +120% drawn at the edge


def test_vram_budget_auto_is_fetch_every_miss_at_a_quarter_residency():
    """`vram_budget_GiB: auto`: one device-memory budget for every policy, the one fetch-every-miss needs at
    25% residency; a low-bit policy, whose copies are charged to the same budget, holds fewer slots."""
    from dataclasses import replace as dc_replace

    from runtime.formats import costmodel

    shape = dc_replace(costmodel.load_model_shape("qwen3-next-80b-a3b"), num_layers=4, num_experts=64, top_k=8)
    base = {"name": "t", "hosts": ["rtx3090"], "baselines": {"policies": ["fetch-every-miss", "rule-0.15"]},
            "space": {"rule": {"choices": ["threshold", "first_choice"]}, "tau": {"low": 0.1, "high": 0.4},
                      "fallback": {"choices": ["substitute", "lowbit"]}, "lowbit_bits": {"choices": [2]},
                      "vram_budget_GiB": "auto"}}
    cfg = sweep_config.from_dict(base, "x.yaml")
    assert cfg.vram_budget_auto
    done = sweep_config.resolve_vram_budget(cfg, shape)
    gib = done.space["vram_budget_GiB"].value
    assert done.baseline_capacity() == {"vram_budget_GiB": gib}
    fetch = PRESETS["fetch-every-miss"]
    assert costmodel.capacities_for_budget(shape, gib, fetch).tolist() == [16] * 4  # 25% of 64
    assert costmodel.budget_for_capacities(shape, 16, fetch) <= gib < costmodel.budget_for_capacities(shape, 17, fetch)
    low = policy_of({"rule": "first_choice", "fallback": "lowbit", "lowbit_bits": 2, "lowbit_group": 128})
    assert costmodel.budget_for_capacities(shape, 16, low) > gib  # its copies take device memory: no 16 slots
    # a budget given as a number is kept as it is; nothing else is rewritten
    fixed = sweep_config.from_dict({**base, "space": {**base["space"], "vram_budget_GiB": 3.0}}, "x.yaml")
    assert not fixed.vram_budget_auto and sweep_config.resolve_vram_budget(fixed, shape) is fixed
    # a budget that leaves a baseline fewer than k slots is one line naming the field and the value
    tight = dc_replace(shape, num_experts=16, top_k=8)  # 25% of 16 experts is fewer than k: k slots
    with pytest.raises(InputError, match=r"space\.vram_budget_GiB = auto .*baseline quality-first"):
        sweep_config.resolve_vram_budget(dc_replace(cfg, baseline_policies=("quality-first",)), tight)


def _demo_shape():
    from dataclasses import replace as dc_replace

    from runtime.formats import costmodel

    return dc_replace(costmodel.load_model_shape("qwen3-next-80b-a3b"), num_layers=4, num_experts=64, top_k=8)


def test_fit_to_budget_drops_the_values_no_policy_fits():
    """At one budget, a value with which no policy leaves k slots is taken out of the space (and named), an
    integer range ends at the last value that fits; the cost model refuses a policy over it (BudgetTooSmall)."""
    from runtime.formats import costmodel

    shape = _demo_shape()
    space = {"rule": {"choices": ["threshold", "first_choice"]}, "tau": {"low": 0.1, "high": 0.4},
             "fallback": {"choices": ["substitute", "lowbit"]}, "lowbit_bits": {"choices": [8, 2]},
             "lowbit_group": {"choices": [32, 128]}, "beta": {"choices": ["off", 0.5]},
             "admission_delay": {"low": 1, "high": 4}, "vram_budget_GiB": "auto"}
    base = {"name": "t", "hosts": ["rtx3090"], "baselines": {"policies": ["fetch-every-miss", "rule-0.15"]},
            "space": space}
    # fetch-every-miss's 16 slots: a copy of every expert, even at 2 bits in groups of 128 (9 slots' worth), leaves < 8
    cfg = sweep_config.resolve_vram_budget(sweep_config.from_dict(base, "x.yaml"), shape)
    fit = sweep_config.fit_to_budget(cfg, shape)
    assert fit.space["fallback"].kind == "fixed" and fit.space["fallback"].value == "substitute"
    assert "lowbit_bits" not in fit.space.names and "lowbit_group" not in fit.space.names
    assert any("fallback = lowbit" in n for n in fit.budget_notes)
    # an admission delay of 2 stages 2 x L x k = 64 buffers (16 slots per layer): none left, so the range ends at 1
    assert fit.space["admission_delay"].kind == "fixed" and fit.space["admission_delay"].value == 1
    assert any(n.startswith("admission_delay above 1: no policy with it fits") for n in fit.budget_notes)
    gib = fit.space["vram_budget_GiB"].value
    late = policy_of({"rule": "threshold", "tau": 0.2, "beta": 0.5, "admission_delay": 4})
    with pytest.raises(costmodel.BudgetTooSmall, match="fewer than k = 8"):
        costmodel.capacities_for_budget(shape, gib, late)
    # a budget with room for the 2-bit copies at group 128 and 16 slots: lowbit stays, 8-bit copies (32 slots' worth) go
    two = policy_of({"rule": "threshold", "tau": 0.2, "fallback": "lowbit", "lowbit_bits": 2, "lowbit_group": 128})
    roomy = round(costmodel.budget_for_capacities(shape, 16, two) + 1e-3, 4)
    cfg = sweep_config.from_dict({**base, "space": {**space, "vram_budget_GiB": roomy}}, "x.yaml")
    fit = sweep_config.fit_to_budget(cfg, shape)
    assert fit.space["fallback"].values() == ("substitute", "lowbit")
    assert fit.space["lowbit_bits"].values() == (2,) and fit.space["lowbit_group"].values() == (32, 128)
    assert [n for n in fit.budget_notes if "lowbit_bits" in n] == [f"lowbit_bits = 8: no policy with it fits the budget "
                                                                 f"at vram_budget_GiB = {roomy:g}"]
    # a capacity fraction (low-bit copies on top of the slots) is left as it is
    by_fraction = {k: v for k, v in space.items() if k != "vram_budget_GiB"} | {"capacity_fraction": 0.25}
    frac = sweep_config.from_dict({**base, "space": by_fraction}, "x.yaml")
    assert sweep_config.fit_to_budget(frac, shape) is frac
    # nothing fits at all: one line naming the space and the budget
    small = dict(space, rule="first_choice", fallback="lowbit", lowbit_bits=8, lowbit_group=32,
                 vram_budget_GiB=2.3)
    small.pop("tau")
    with pytest.raises(InputError, match=r"x\.yaml: space \(vram_budget_GiB = 2\.3\): no policy of the space fits"):
        sweep_config.fit_to_budget(sweep_config.from_dict({**base, "space": small}, "x.yaml"), shape)


def test_the_main_job_compares_policies_at_equal_memory():
    """search_spaces/demo.yaml (make pareto) and smoke.yaml run every policy at one device-memory budget;
    every shipped config parses."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "search_spaces"
    for f in sorted(root.glob("*.yaml")):
        sweep_config.load_config(f)
    for name in ("demo", "smoke"):
        cfg = sweep_config.load_config(root / f"{name}.yaml")
        assert cfg.vram_budget_auto and cfg.space.capacity_field == "vram_budget_GiB", name
    demo = sweep_config.fit_to_budget(sweep_config.resolve_vram_budget(
        sweep_config.load_config(root / "demo.yaml"), _demo_shape()), _demo_shape())
    assert demo.space["vram_budget_GiB"].value == pytest.approx(2.4713)
    assert "lowbit" not in demo.space["fallback"].values()  # its copies of every expert do not fit 2.47 GiB
    # a bounded copy pool (copy_buffers B per layer, charged L x B) fits every admission delay and
    # prefetch width; unbounded (off), admission is charged L x k x delay buffers, prefetch L x n
    assert demo.space["admission_delay"].high == 4 and demo.space["prefetch_n"].high == 16
    assert demo.space["copy_buffers"].off and demo.space["copy_buffers"].low == 1
    shape, gib = _demo_shape(), demo.space["vram_budget_GiB"].value
    qf = PRESETS["quality-first"]
    slots = {b: int(costmodel.capacities_for_budget(shape, gib, replace(qf, copy_buffers=b))[0]) for b in (None, 1, 2)}
    assert slots == {None: 8, 1: 15, 2: 14}  # unbounded: 32 buffers, half the 16 slots fetch-every-miss gets
    assert int(costmodel.capacities_for_budget(shape, gib, PRESETS["fetch-every-miss"])[0]) == 16


def test_speed_ratios_at_equal_memory_divide_by_fetch_every_miss_in_the_same_budget(tmp_path):
    """In one budget an admission policy holds fewer slots (its staging is charged to it): its ratio is over
    fetch-every-miss on the budget's most slots, not over fetch-every-miss on its own, smaller, cache."""
    gib = 2.5

    def row(key, params, slots, t, t_fetch_own):  # t_fetch_own: fetch-every-miss on this row's slots
        return {"key": key, "number": None, "baseline": "fetch-every-miss" if key == "a:fe" else None,
                "params": complete({**params, "vram_budget_GiB": gib}), "host": "a", "fidelity": "simulator",
                "status": "ok", "time_per_token_s": t, "mass_per_token": 0.1, "capacity_slots": [slots] * 4,
                "fetch_all_time_per_token_s": t_fetch_own, "host_compute_time_per_token_s": 2 * t_fetch_own,
                "speed_ratio_vs_fetch_all": t_fetch_own / t, "speed_ratio_vs_host_compute": 2 * t_fetch_own / t,
                "speed_ratio_vs_all_resident": 0.5, "device_memory_GiB": gib * 0.99, "policy": "p"}

    rows = [row("a:fe", {"rule": "fetch_all"}, 16, 4e-3, 4e-3),
            row("a:rule", {"rule": "threshold", "tau": 0.15}, 16, 2e-3, 4e-3),
            # 8 slots after its staging: the simulator compares it with fetch-every-miss on 8 slots (8 ms)
            row("a:adm", {"rule": "threshold", "tau": 0.15, "beta": 0.5}, 8, 3e-3, 8e-3),
            {"key": "a:low", "number": 3, "baseline": None, "host": "a", "fidelity": "simulator",
             "params": complete({"rule": "first_choice", "fallback": "lowbit", "vram_budget_GiB": gib}),
             "status": "infeasible", "error": "leaves 7 expert slots per layer, fewer than k = 8", "capacity_slots": 7}]
    df = trials_frame(rows).set_index("key")
    assert df.loc["a:adm", "speed_ratio_vs_fetch_all_same_slots"] == pytest.approx(8 / 3)
    assert df.loc["a:adm", "speed_ratio_vs_fetch_all"] == pytest.approx(4 / 3)  # 4 ms: fetch-every-miss's own
    assert df.loc["a:adm", "speed_ratio_vs_host_compute"] == pytest.approx(8 / 3)
    assert df.loc["a:rule", "speed_ratio_vs_fetch_all"] == pytest.approx(2.0)
    assert set(df.loc[["a:fe", "a:rule", "a:adm"], "ratio_basis"]) == {"same device memory"}
    # a capacity-fraction sweep keeps the simulator's ratio at the same capacity
    frac = trials_frame(_rows("b", 3)).set_index("key")
    assert set(frac["ratio_basis"]) == {"same capacity"} and (frac.loc[frac["status"] == "ok",
                                                                      "speed_ratio_vs_fetch_all"] == 1.5).all()
    # the summary counts the infeasible trial as such, not as failed
    write_report(tmp_path, rows, ["a"], ("time_per_token_s", "mass_per_token"), {"name": "t", "budgets": [1.0]})
    assert "| a | 3 | 1 | 0 |" in (tmp_path / "summary.md").read_text()


def test_emulation_runs_at_the_slots_the_simulator_gave_a_budget():
    """A budget's GiB mean slots on the sweep's cost-model shape; the emulation of a tiny checkpoint (which
    would fit whole in those GiB) runs the policy at those same slots."""
    from sweep.remeasure import emulation_spec

    by_budget = complete({"rule": "threshold", "tau": 0.15, "beta": 0.5, "vram_budget_GiB": 2.47})
    spec = emulation_spec(by_budget, "/m", "/t.txt", 2048, None, [8, 8, 8, 8])
    assert spec.capacity == (8, 8, 8, 8) and spec.vram_budget_GiB is None
    assert emulation_spec(by_budget, "/m", "/t.txt", 2048, None).vram_budget_GiB == 2.47  # no slots known
    by_fraction = complete({"rule": "threshold", "tau": 0.15, "capacity_fraction": 0.25})
    spec = emulation_spec(by_fraction, "/m", "/t.txt", 2048, None, [16, 16, 16, 16])
    assert spec.capacity_fraction == 0.25 and spec.capacity is None


def test_a_submitted_job_needs_a_durable_mlflow_store_and_says_where_its_runs_are(tmp_path, monkeypatch):
    """Under `ray job submit` (Ray's job supervisor sets RAY_JOB_CONFIG_JSON_ENV_VAR) the default store would
    be inside Ray's temporary copy of the submitted folder: --mlflow-uri is required, and a SQLite path in
    that copy is refused; the closing line names the store and how to open it (make mlflow-ui only for a
    checkout's own store)."""
    from sweep import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    default = f"sqlite:///{tracking.DEFAULT_DB}"
    assert f"open them with make mlflow-ui, then http://127.0.0.1:5000/#/experiments/3/runs?{tracking.RUNS_VIEW}" in \
        tracking.where_runs_are(default, "3")
    other = f"sqlite:///{tmp_path / 'm.db'}"
    assert tracking.where_runs_are(other, "3") == (
        f"MLflow runs: in {other}; open them with mlflow ui --backend-store-uri {other} --host 127.0.0.1 "
        f"--port 5000, then http://127.0.0.1:5000/#/experiments/3/runs?{tracking.RUNS_VIEW}")
    assert tracking.where_runs_are("http://h:5000", "3") == \
        f"MLflow runs: http://h:5000/#/experiments/3/runs?{tracking.RUNS_VIEW}"
    monkeypatch.setenv(tracking.RAY_JOB_ENV, "{}")
    with pytest.raises(InputError, match=r"^--mlflow-uri: required under ray job submit") as e:
        tracking.resolve_uri(None)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="inside Ray's temporary copy"):
        tracking.resolve_uri("sqlite:///mlflow/mlflow.db", create=False)  # relative: in the job's folder
    assert tracking.resolve_uri(other, create=False) == other
    assert "make mlflow-ui" not in tracking.where_runs_are(default, "3")  # a job's copy is no checkout


def test_one_label_per_policy_across_hosts():
    """A policy that is a baseline on one host and a search trial on another is named by the baseline on both."""
    from sweep.plot import label

    rows = _rows("a", 3) + _rows("b", 3)
    b0 = next(r for r in rows if r["key"] == "b:0")
    b0["baseline"] = None  # host b drew rule-0.15's policy as a search trial
    df = trials_frame(rows).set_index("key")
    assert label(df.loc["a:0"]) == label(df.loc["b:0"]) == "rule-0.15"
    assert label(df.loc["b:1"]) == df.loc["b:1", "policy"]  # no baseline anywhere: its policy
