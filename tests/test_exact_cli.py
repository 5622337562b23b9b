"""scripts/exact_cli_check.py, small: engine == emulation with each backend in its own process from the CLI
(`python -m runtime.emulate --backend engine|emulation --json`), two presets on a tiny checkpoint; and the check
fails when the two runs differ (here: the engine run at another capacity)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_hf import build_tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~35 s: make test runs it; make check keeps the in-process engine == emulation (test_contract)
def test_engine_equals_emulation_in_separate_processes(tmp_path, text):
    model = build_tiny("qwen3_moe", tmp_path / "m")
    out = tmp_path / "exact.json"
    r = subprocess.run([sys.executable, "scripts/exact_cli_check.py", "--model", str(model), "--text", str(text),
                        "--max-tokens", "96", "--window", "24", "--capacity-fraction", "0.4",
                        "--policies", "quality-first,fetch-every-miss", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["finished"] and list(res["policies"]) == ["quality-first", "fetch-every-miss"]
    for row in res["policies"].values():
        assert row["problems"] == [] and row["decode_path"] == "segments" and row["nll_max_abs_diff"] <= 1e-3
    assert res["policies"]["fetch-every-miss"]["counters"]["fetches"] > 0
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import exact_cli_check as ecc
    finally:
        sys.path.pop(0)
    import argparse

    a = argparse.Namespace(model=str(model), text=str(text), max_tokens=96, window=24, capacity_fraction=0.4,
                           device="cpu", calib_text=None, timeout=600)
    res_, nll, _ = ecc.run_cli("emulation", "substitute-all", a, tmp_path)
    assert abs(sum(nll) / len(nll) - __import__("math").log(res_["perplexity"])) < 1e-9  # the policy's NLL column


def test_the_check_sees_a_difference(tmp_path, text, monkeypatch):
    """compare() on two results that differ in a counter and in the NLL reports both (the check can fail)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import exact_cli_check as ecc
    finally:
        sys.path.pop(0)
    from runtime.core.kernel import COUNTER_NAMES

    a = {**dict.fromkeys(COUNTER_NAMES, 0), "fetches": 3, "substituted_mass": 0.5, "perplexity": 10.0}
    b = {**a, "fetches": 4}
    row = ecc.compare(a, b, [1.0, 2.0], [1.0, 2.1], 1e-3)
    assert any("int counters" in p for p in row["problems"]) and any("NLL" in p for p in row["problems"])
    assert ecc.compare(a, a, [1.0], [1.0], 1e-3)["problems"] == []


def _capture(T: int, L: int, k: int, E: int, seed: int = 0) -> tuple[dict, dict]:
    """A synthetic `exact_divergence.capture` result: packed rows whose selection is each row's top k by score."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = {}
    for lay in range(L):
        sc = rng.standard_normal((T, E)).astype(np.float32)
        ids = np.argsort(-sc, 1, kind="stable")[:, :k]
        w = np.full((T, k), 1.0 / k, np.float32)
        rows[lay] = np.concatenate([ids, w, sc, np.ones((T, 1))], 1).astype(np.float32)
    dec = {f: np.zeros((T, L, k), np.int32) for f in ("kind", "served", "slot")}
    per = [{"hits": 1} for _ in range(L)]
    return {"counters": {"hits": L}, "per_layer": per, "decisions": dec, "k": k, "E": E, "tokens": T}, rows


def _scripts_module(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def test_divergence_located_and_classified():
    """scripts/exact_divergence.py's verdicts, on captures built so that each case is large by construction:
    (1) the same routing and decisions: no difference; (2) at token 7, layer 1 the engine's two experts at ranks k
    and k + 1 are made equal (a rounding-sized change) and swapped in its selection, its decisions part only from
    there: a routing near-tie, located there, with the swapped experts and the gap; (3) the decisions part at
    token 3, layer 0 on identical routing: a fault, whatever follows; (4) the selection swapped at token 7 with a
    score gap of ~1: not a near-tie."""
    import copy

    import numpy as np

    ed = _scripts_module("exact_divergence")
    T, L, k, E, W = 20, 2, 3, 8, 10
    em = _capture(T, L, k, E)
    assert ed.compare(em, copy.deepcopy(em), W, 1e-5, 1e-4)["verdict"] == "no difference"

    def tie(gap: float):
        en = copy.deepcopy(em)
        rows = en[1][1]
        order = np.argsort(-rows[7, 2 * k : 2 * k + E], kind="stable")
        a, b = int(order[k - 1]), int(order[k])  # the last selected and the first unselected expert
        rows[7, 2 * k + b] = rows[7, 2 * k + a] + np.float32(gap)  # b now at or above a
        rows[7, :k][rows[7, :k] == a] = b  # the engine's model selects b instead of a
        en[0]["decisions"]["served"][7:, 1, 0] = 99  # its decisions part from there
        en[0]["counters"] = {"hits": L - 1}
        return en, a, b

    en, a, b = tie(0.0)
    d = ed.compare(em, en, W, 1e-5, 1e-4)
    assert d["verdict"] == "routing near-tie" and not d["int_counters_equal"]
    f = d["first_selection_diff"]
    assert (f["token"], f["window"], f["position"], f["layer"]) == (7, 0, 7, 1)
    assert f["emulation_only"] == [a] and f["engine_only"] == [b] and f["gap"] == 0.0 and d["score_diff_before"] == 0.0
    assert d["first_decision_diff"] == {"token": 7, "window": 0, "position": 7, "layer": 1}
    en[0]["decisions"]["kind"][3, 0, 2] = 1  # a decision parts BEFORE the routing does: a fault
    assert ed.compare(em, en, W, 1e-5, 1e-4)["verdict"] == "decisions differ on the same routing"
    en, _, _ = tie(1.0)
    assert ed.compare(em, en, W, 1e-5, 1e-4)["verdict"] == "routing differs (not a near-tie)"


def test_divergence_script_on_a_real_pair_of_runs(tmp_path, text):
    """scripts/exact_divergence.py end to end on a tiny checkpoint: both backends' routing rows and decisions are
    captured for the policy's run only (not the warm start's recording pass), one row per decided token, and the
    runs agree."""
    ed = _scripts_module("exact_divergence")
    model = build_tiny("qwen3_moe", tmp_path / "m")
    out = tmp_path / "div.json"
    rc = ed.main(["--policy", "speed-first", "--model", str(model), "--text", str(text), "--max-tokens", "96",
                  "--window", "24", "--capacity-fraction", "0.4", "--out", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["verdict"] == "no difference" and res["int_counters_equal"], res
    assert res["tokens_compared"] == 96 and res["first_selection_diff"] is None and res["first_decision_diff"] is None
