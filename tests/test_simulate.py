"""The simulator and its command line: keys, speed ratios, Belady bound, real traces, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.backends.simulate import main, simulate
from runtime.core.errors import cli_main
from runtime.core.kernel import COUNTER_NAMES
from runtime.core.policy import PRESETS, PolicyConfig
from runtime.formats.trace import calibration_twin, load_trace, save_trace, synthetic_trace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
REPO = Path(__file__).resolve().parents[1]
KEYS = COUNTER_NAMES + ("mass_per_token", "time_per_token_s", "speed_ratio_vs_fetch_all", "replay_seconds", "per_layer",
                        "initial_residency")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    ev, cal = d / "eval.parquet", d / "calib.parquet"
    save_trace(synthetic_trace(300, 4, 64, 6, 16, seed=1), ev)
    save_trace(calibration_twin(200, 4, 64, 6, 16, seed=1), cal)  # same routing model, other tokens
    return ev, cal


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(lambda: main(argv))
        raise SystemExit(0)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_cli_json_keys_and_ratios(traces, capsys, tmp_path):
    ev, cal = traces
    out_file = tmp_path / "r.json"
    code, out, err = run_cli(["--trace", str(ev), "--policy", "quality-first", "--capacity", "16",
                              "--initial-residency", f"warm:{cal}", "--json", "--out", str(out_file)], capsys)
    assert code == 0, err
    res = json.loads(out)
    for key in KEYS:
        assert key in res, key
    assert res["calls"] == 300 * 4 * 6
    assert res["hits"] + res["fetches"] + res["substitutions"] + res["drops"] + res["host_computes"] == res["calls"]
    assert len(res["per_layer"]) == 4 and sum(r["fetches"] for r in res["per_layer"]) == res["fetches"]
    assert res["speed_ratio_vs_fetch_all"] == pytest.approx(res["fetch_all_time_per_token_s"] / res["time_per_token_s"])
    assert res["all_resident_time_per_token_s"] <= res["time_per_token_s"] <= res["fetch_all_time_per_token_s"]
    assert json.loads(out_file.read_text())["fetches"] == res["fetches"]


def test_rule_flags_equal_preset(traces, capsys):
    ev, _ = traces
    a = run_cli(["--trace", str(ev), "--policy", "rule-0.15", "--capacity", "16", "--json"], capsys)
    b = run_cli(["--trace", str(ev), "--rule", "threshold", "--tau", "0.15", "--capacity", "16", "--json"], capsys)
    ra, rb = json.loads(a[1]), json.loads(b[1])
    assert {k: ra[k] for k in KEYS[:8]} == {k: rb[k] for k in KEYS[:8]}


def test_belady_is_a_lower_bound_on_fetches(traces):
    tr = load_trace(traces[0])
    fetches = {ev: simulate(tr, PolicyConfig(rule="fetch_all", evict=ev), 16, baselines=False).counters["fetches"]
               for ev in ("lfu", "lru", "crf", "belady")}
    assert fetches["belady"] <= min(fetches.values())


def test_explicit_residency_npy(traces, tmp_path, capsys):
    ev, _ = traces
    res = np.tile(np.arange(16), (4, 1))
    np.save(tmp_path / "res.npy", res)
    code, out, _ = run_cli(["--trace", str(ev), "--policy", "fetch-every-miss", "--capacity", "16",
                            "--initial-residency", str(tmp_path / "res.npy"), "--json"], capsys)
    assert code == 0
    cold = simulate(load_trace(ev), PRESETS["fetch-every-miss"], 16, initial_residency="cold", baselines=False)
    assert json.loads(out)["fetches"] < cold.counters["fetches"]  # a filled cache misses less than an empty one


BAD_FLAGS = [
    (["--capacity", "5"], "--capacity = 5"),
    (["--capacity", "64"], "--capacity = 64"),
    (["--rule", "threshold", "--tau", "-0.5"], "--tau = -0.5"),
    (["--beta", "0"], "--beta = 0.0"),
    (["--beta", "-1"], "--beta = -1.0"),
    (["--delay", "0"], "--delay = 0"),
    (["--fetch-cap", "0"], "--fetch-cap = 0"),
    (["--fetch-cap", "1.5"], "--fetch-cap = '1.5' is not an integer"),
    (["--pin-fraction", "0.7"], "--pin-fraction = 0.7 pins P=11 of C=16 slots at layer 0, leaving 5 < k=6"),
    (["--pin-fraction", "0.25", "--initial-residency", "cold"], "--pin-fraction = 0.25 needs a warm start"),
    (["--pin-fraction", "1"], "--pin-fraction = 1.0 must be in [0, 1)"),
    (["--capacity-alloc", "calibrated", "--initial-residency", "cold"], "--capacity-alloc = 'calibrated' needs"),
    (["--capacity-alloc", "even"], "--capacity-alloc = 'even' is unknown"),
    (["--drop-renorm", "maybe"], "--drop-renorm = 'maybe' is not true or false"),
    (["--evict", "lfu-da"], "--evict = 'lfu-da' is unknown"),
    (["--gamma", "0"], "--gamma = 0.0"),
    (["--gamma", "1.5"], "--gamma = 1.5"),
    (["--rule", "sometimes"], "--rule = 'sometimes'"),
    (["--policy", "fastest"], "--policy = 'fastest'"),
]


@pytest.mark.parametrize("extra,needle", BAD_FLAGS)
def test_bad_flags(traces, tmp_path, capsys, extra, needle):
    ev, _ = traces
    argv = ["--trace", str(ev), "--out", str(tmp_path / "o.json")]
    if "--rule" not in extra and "--policy" not in extra:
        argv += ["--policy", "rule-0.15"]
    if "--capacity" not in extra:
        argv += ["--capacity", "16"]
    code, out, err = run_cli(argv + extra, capsys)
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.json").exists() and out == ""


def _npz(tmp_path, **over):
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(10 * 2)]).reshape(10, 2, 2).astype(np.int32)
    d = {"topk_ids": ids, "topk_weights": np.tile(np.array([0.7, 0.3], np.float32), (10, 2, 1)), "num_experts": np.int64(8)}
    d.update(over)
    p = tmp_path / "bad.npz"
    np.savez(p, **d)
    return p


@pytest.mark.parametrize("case,needle", [
    ("nan", "topk_weights"), ("inf", "topk_weights"), ("range", "out of range"), ("repeat", "topk_ids"),
    ("ranking", "ranking"), ("truncated", "bad"), ("corrupt", "bad"), ("residency", "--initial-residency"),
])
def test_bad_files(tmp_path, capsys, case, needle):
    p = _npz(tmp_path)
    extra = []
    if case in ("nan", "inf"):
        w = np.tile(np.array([0.7, 0.3], np.float32), (10, 2, 1))
        w[3, 1, 1] = np.nan if case == "nan" else np.inf
        p = _npz(tmp_path, topk_weights=w)
    elif case == "range":
        ids = np.load(p)["topk_ids"].copy()
        ids[2, 0, 1] = 9
        p = _npz(tmp_path, topk_ids=ids)
    elif case == "repeat":
        ids = np.load(p)["topk_ids"].copy()
        ids[2, 0, 1] = ids[2, 0, 0]
        p = _npz(tmp_path, topk_ids=ids)
    elif case == "ranking":
        ids = np.load(p)["topk_ids"]
        rank = np.concatenate([ids[..., ::-1], (ids[..., :1] + 1) % 8], axis=-1).astype(np.int32)
        p = _npz(tmp_path, ranking=rank)
    elif case == "truncated":
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
    elif case == "corrupt":
        p.write_bytes(b"PK\x03\x04 not really a zip file")
    elif case == "residency":
        np.save(tmp_path / "res.npy", np.zeros((3, 2), np.int64))
        extra = ["--initial-residency", str(tmp_path / "res.npy")]
    code, out, err = run_cli(["--trace", str(p), "--policy", "rule-0.15", "--capacity", "3",
                              "--out", str(tmp_path / "o.json"), *extra], capsys)
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.json").exists()


def test_calibration_trace_from_another_model(traces, tmp_path, capsys):
    other = tmp_path / "other.parquet"
    save_trace(synthetic_trace(50, 4, 32, 6, 16, seed=3), other)
    code, _, err = run_cli(["--trace", str(traces[0]), "--policy", "rule-0.15", "--capacity", "16",
                            "--initial-residency", f"warm:{other}"], capsys)
    assert code == 2 and "E=32" in err and "E=64" in err


def test_subprocess_exit_status(tmp_path):
    p = _npz(tmp_path)
    r = subprocess.run([sys.executable, "-m", "runtime.simulate", "--trace", str(p), "--policy", "rule-0.15",
                        "--capacity", "1"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.startswith("expertsweep: error: --capacity = 1"), r.stderr


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data absent")
@pytest.mark.parametrize("name,cap", [("qwen15moe-a2.7b-gsm8k.npz", 15), ("mixtral-8x7b-humaneval0.npz", 4)])
def test_real_traces(name, cap):
    tr = load_trace(SHARED / name)
    half = tr.T // 2
    calib, ev = tr.slice_tokens(0, half), tr.slice_tokens(half, tr.T)
    from runtime.core.kernel import warm_residency

    init = warm_residency(calib.topk_ids, calib.valid, tr.E, np.full(tr.L, cap))
    res = {n: simulate(ev, PRESETS[n], cap, initial_residency=init).to_dict() for n in PRESETS
           if PRESETS[n].route == "off"}  # (routing: tests/test_routing.py; these traces have no router scores)
    calls = int(ev.valid.sum()) * tr.k
    for n, r in res.items():
        assert r["calls"] == calls, n
    # truncated ranking (M == k): every substituted miss is a drop
    assert res["substitute-all"]["substitutions"] == 0 and res["substitute-all"]["drops"] > 0
    assert res["fetch-every-miss"]["fetches"] > res["rule-0.15"]["fetches"] > res["first-choice"]["fetches"]
    assert res["speed-first"]["speed_ratio_vs_fetch_all"] > 1.0
    assert res["speed-first"]["admissions"] > 0 and res["rule-0.15"]["admissions"] == 0


@pytest.mark.parametrize("calib", [True, False])
def test_sweep_trial_equals_the_backend(traces, calib):
    """A sweep trial (sweep.worker.Evaluator) is the simulator backend's result for the same RunSpec, and
    a second trial on the same worker (warm start and baselines from the backend's cache) still is."""
    from runtime.backends import get_backend
    from sweep.worker import Evaluator, run_spec

    ev_path, cal_path = (str(p) for p in traces)
    evaluator = Evaluator(ev_path, cal_path if calib else None, None)
    from dataclasses import asdict

    from runtime.formats.costmodel import load_host_profile

    base = asdict(load_host_profile("rtx4090"))
    host = {**{k: v for k, v in base.items() if v is not None}, "name": "rtx4090-calibrated",
            "link_GBps": base["link_GBps"] * 0.5}
    for cfg in ({"rule": "threshold", "tau": 0.15, "beta": 0.5, "capacity_fraction": 0.25},
                {"rule": "first_choice", "capacity_fraction": 0.25},
                {"rule": "fetch_all", "evict": "lru", "capacity_fraction": 0.3}):
        row = evaluator.evaluate(cfg, host)
        # a fresh backend, the host profile by value in the spec (nothing registered with the backend)
        res = get_backend("simulator").evaluate(run_spec(cfg, ev_path, evaluator.initial_residency, host,
                                                         None)).to_dict()
        assert res["host"] == "rtx4090-calibrated"
        for k in COUNTER_NAMES + ("time_per_token_s", "speed_ratio_vs_fetch_all", "speed_ratio_vs_host_compute",
                                  "fetch_all_time_per_token_s", "mass_per_token", "initial_residency"):
            assert row[k] == res[k], k
        assert row["capacity_slots"] == res["capacity"]
        # the calibrated host is the one used: a slower link gives a different time than the preset
        preset = get_backend("simulator").evaluate(run_spec(cfg, ev_path, evaluator.initial_residency, "rtx4090",
                                                            None))
        assert preset.time_per_token_s != row["time_per_token_s"]
