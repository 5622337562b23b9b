"""Tests for the findings page and command: the page's numbers are the JSON's (rows built by the experiments'
row functions from synthetic policy runs, rendered, parsed back), the command end to end on a trained test
model, the topic finding on two domains, bad input, and scripts/findings.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from runtime.core.errors import InputError
from runtime.tools import findings
from runtime.tools.findings import experiments as X
from runtime.tools.findings import memory as M
from runtime.tools.findings import render, stats
from runtime.tools.findings import routing as RT
from runtime.tools.findings.rules import DIFFERS, HOLDS, INCONCLUSIVE, UNTESTABLE, VERDICTS

REPO = Path(__file__).resolve().parents[1]
IDS = ["1", "2a", "2b", "3", "4a", "4a-mem", "4b", "4b-mem", "5", "5-mem", "5q", "5q-mem", "5s", "6", "2c", "7"]
N, CNT, W = 60, 127, 128
NUM = re.compile(r"(?:(?<![\w.])[-+])?\d+\.\d+")  # "0.03-0.31" is a range, not a negative number
PAPER_CONSTANTS = {"0.15", "0.92", "0.3"}  # the named policy, the paper's r, 2b's bound: text, not measurements


def _run(name: str, level: float, share: float, mass: float, rng: np.random.Generator, fetched: float = 0.1,
         slots: int = 16) -> X.PolicyRun:
    dn = (level + rng.normal(0, 0.003, N)) * CNT
    calls = np.full(N, 2048.0)
    lost = share * calls + rng.normal(0, 5, N)
    change = float(stats.pct_change(dn.sum(), CNT * N))
    counters = {"substitutions": float(lost.sum()), "drops": 0.0, "calls": float(calls.sum()),
                "fetches": fetched * float(calls.sum()), "reroutes": 0.05 * float(calls.sum()), "rerouted_mass": 3.0,
                "admissions": 900.0, "admissions_waited": 120.0}
    res = SimpleNamespace(ppl_change_pct=change, counters=counters, capacity=[slots, slots], tokens=N * W,
                          mass_per_token=mass, perplexity=50 * (1 + change / 100), exact_perplexity=50.0)
    return X.PolicyRun(name, res, dn, CNT, W, calls=lost, all_calls=calls,
                       mass=(mass + rng.normal(0, 0.005, N)) * W)


def _setup() -> X.Setup:
    s = X.Setup(None, None, {}, 0.25, None, 320, 64, 1, 1, 0, None, None)
    s.starts = stats.block_starts(N, 3)
    s.blocks = {"windows": N, "window": W, "blocks": len(s.starts), "block": 3, "stopped": True, "max_block": 6,
                "block_tokens": 3 * W, "document_tokens": 2900.0, "tolerance": stats.WIDTH_TOL,
                "check": {"rule-0.15": {"widths": [{"block": b, "blocks": N // b, "width": 0.1 + 0.0137 * b,
                                                    "method": "BCa"} for b in range(1, 7)],
                                        "block": 3, "stopped": True}}}
    return s


def _result() -> dict[str, Any]:
    """A small result dict whose rows 1, 2a-2c, 4a, 5q and 5s come from the experiments' row functions."""
    rng = np.random.default_rng(0)
    s = _setup()
    main = {"substitute-all": _run("substitute-all", 0.05, 0.085, 0.3, rng),
            "rule-0.15": _run("rule-0.15", 0.004, 0.075, 0.1, rng),
            "first-choice": _run("first-choice", 0.03, 0.09, 0.25, rng),
            "quality-first": _run("quality-first", 0.002, 0.07, 0.09, rng),
            "speed-first": _run("speed-first", 0.01, 0.1, 0.15, rng)}
    names = list(X.mass_policies())[:8]
    mp = {n: _run(n, 0.005 * (i + 1) - 0.0004 * (i % 2), 0.05, 0.04 * (i + 1) - 0.01 * (i % 2), rng)
          for i, n in enumerate(names)}
    mem = {"quality-first": _run("quality-first", 0.001, 0.07, 0.09, rng, slots=15),
           "speed-first": _run("speed-first", 0.012, 0.1, 0.15, rng, slots=15)}
    routed = {"cache-prior": _run("cache-prior", 0.001, 0.0, 0.0, rng, fetched=0.102),
              "cache-route": _run("cache-route", 0.009, 0.0, 0.0, rng, fetched=0.098)}
    rows = [X.finding_heavy(s, main), *X.finding_mass(s, mp), *X.finding_admission(s, main),
            *M.finding_admission_memory(s, main, mem, equal_memory_fixture()),
            RT.routing_row(s, main["rule-0.15"], routed, calibration_fixture(), 1.2345, 16)]
    for r in rows:
        r.column = "C=16 (25.0%)"
    cols = [{"label": "C=16 (25.0%)", "slots": 16, "experts": 64, "slots_per_top_k": 2.0, "c_over_k": 2.0,
             "warm_set_miss_rate": 0.3127,
             "substitute_all_share": 0.2861, "paper_regime": True, "blocks": s.blocks}]
    return {"setup": {"model": "m", "eval_text": "eval.txt", "num_layers": 2, "num_experts": 64, "top_k": 8,
                      "tokens": 4096, "exact_perplexity": 50.0, "initial_residency": "calib", "min_blocks": 10,
                      "bootstrap_resamples": 2000, "seed": 0, "block_width_tolerance": stats.WIDTH_TOL},
            "commit": {"commit": "a" * 40, "dirty": False}, "columns": cols, "format": 2,
            "paper_regime": {"model": "Qwen3-Next-80B-A3B", "slots": 128, "experts": 512, "top_k": 10,
                             "slots_per_top_k": 12.8, "substitute_all_share": 0.085, "layers": 48},
            "sweep": {"target_share": 0.085, "found": 0.25,
                      "points": [{"slots": 8, "substitute_all_share": 0.5}, {"slots": 63, "substitute_all_share": 0.01}]},
            "rows": [r.to_dict() for r in rows], "seconds": 60.0,
            "admission": {"model": {"source": "m (recorded)", "experts": 64, "top_k": 8, "layers": 2, "tokens": 4096,
                                    "warm_start": "calibration text", "points": [
                                        _adm_point(2.0, 0.96, 0.65, 0.60, 0.62, 0.7),
                                        _adm_point(8.0, 0.10, 0.12, 0.9, 0.88, 0.4)]},
                          "model_ppl": [{"column": "C=16 (25.0%)", "c_over_k": 2.0,
                                         "qf_minus_rule": {"point": 2.57, "ci95": [1.9, 3.2]},
                                         "sf_minus_fc": {"point": 5.82, "ci95": [4.4, 7.1]}}]}}


def equal_memory_fixture() -> dict[str, Any]:
    """`memory.equal_memory`'s result for a column of 16 slots: the admission policies keep 15."""
    slots = {"rule-0.15": 16, "fetch-every-miss": 16, "quality-first": 15, "speed-first": 15}
    return {"copy_buffers": 1, "emulation": {"shape": "m", "budget_gib": 1.2345, "slots": slots},
            "cost model": {"shape": "qwen3-next-80b-a3b[L=2,E=64,k=8]", "budget_gib": 2.3456, "slots": slots}}


def calibration_fixture() -> dict[str, Any]:
    """`routing.calibrated`'s result: each family calibrated to the rule's fetched-miss rate of 10%."""
    return {"target": 0.1, "slots": 16, "presets": {"cache-prior": 0.085, "cache-route": 0.072},
            "fetch_every_miss": 0.21,
            "cache-prior": {"strength": 0.75, "rate": 0.1004, "target": 0.1, "reached": True,
                            "tried": [[0.0, 0.21], [0.75, 0.1004], [1.0, 0.09]]},
            "cache-route": {"strength": 12, "rate": 0.0991, "target": 0.1, "reached": True,
                            "tried": [[8, 0.21], [12, 0.0991], [64, 0.05]]}}


def _adm_point(ck: float, m_with: float, m_without: float, h_with: float, h_without: float,
               regret: float) -> dict[str, Any]:
    out: dict[str, Any] = {"c_over_k": ck, "slots": int(ck * 8)}
    for a, b in (("quality-first", "rule-0.15"), ("speed-first", "first-choice")):
        out[a] = {"mass_per_token": m_with, "hit_rate": h_with, "substituted_share": 0.2,
                  "admissions_per_token_layer": 0.8,
                  "regret": {"admissions": 100, "regret_share": regret, "unused_share": regret / 2,
                             "regret_per_token_layer": regret * 0.8}}
        out[b] = {"mass_per_token": m_without, "hit_rate": h_without, "substituted_share": 0.2,
                  "admissions_per_token_layer": 0.0}
    return out


def _leaves(x: Any) -> list[float]:
    if isinstance(x, dict):
        return [v for y in x.values() for v in _leaves(y)]
    if isinstance(x, list | tuple):
        return [v for y in x for v in _leaves(y)]
    if isinstance(x, bool) or not isinstance(x, int | float):
        return []
    return [float(x)]


def _shown(token: str, values: list[float]) -> bool:
    """Whether the page's `token` is one of `values` as printed (at its decimals, or in percent)."""
    d = len(token.split(".")[1])
    t = float(token)
    return any(abs(round(v, d) - t) < 0.6 * 10 ** -d or abs(round(v * 100, d) - t) < 0.6 * 10 ** -d
               for v in values if np.isfinite(v))


def _table(md: str) -> dict[str, list[str]]:
    """The findings table's cells by row id (unescaped)."""
    out = {}
    for line in md.splitlines():
        if re.match(r"\| (1|2a|2b|2c|3|4a|4b|5|5q|5s|6|7)(-mem)? \|", line):
            cells = [c.replace("\\|", "|").strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            out[cells[0]] = cells
    return out


def test_page_numbers_are_the_json_numbers() -> None:
    res = json.loads(json.dumps(_result()))  # as written to findings.json
    md = render.to_markdown(res, "python -m runtime.findings --model m")
    table = _table(md)
    assert sorted(table) == sorted(r["id"] for r in res["rows"])
    checked = 0
    for r in res["rows"]:
        cells = table[r["id"]]
        assert cells[3:] == [r["column"], r["ours"], r["ci95"], f"**{r['verdict']}**"]
        values = _leaves(r["data"])
        text = r["ours"] + " " + r["ci95"]
        for label in sorted(X.mass_policies(), key=len, reverse=True):  # policy names hold thresholds
            text = text.replace(label, "")
        for token in NUM.findall(text):
            if token.lstrip("+-") not in PAPER_CONSTANTS:
                assert _shown(token, values), (r["id"], token)
                checked += 1
        assert f"**{r['verdict']}** at {r['column']} (interval {r['ci95']})" in md  # the reading
    assert checked >= 30  # the rows' measured numbers were parsed back
    by = {r["id"]: r["data"] for r in res["rows"]}
    lo, hi = by["4a"]["ci95"]
    assert table["4a"][5] == f"[{lo:+.2f}, {hi:+.2f}] points"
    assert f"{by['4a']['difference']:+.2f} points" in table["4a"][4]
    assert f"r = {by['2a']['r']:.3f}" in table["2a"][4]
    c = by["2c"]["counts"]
    assert table["2c"][5].startswith(f"per pair: {c[HOLDS]} hold, {c[DIFFERS]} differ, {c[INCONCLUSIVE]} "
                                     f"inconclusive, {c[UNTESTABLE]} ")
    # the page's own check sits below the paper's rows, in its own table; the paper's hedges are on the page
    assert md.index("| 5s |") < md.index("### The page's own checks") < md.index("| 2c |")
    assert "calls its conclusions modest" in md
    # admission against C/k: the mass change, where it starts helping, why it hurts at C/k = 2, the perplexity
    assert "## Admission against the cache size" in md
    assert "| 2.00 | 16 | +47.7% (0.650 -> 0.960) | -2.00 | 5.00% | 70% / 35% |" in md
    assert "QF vs the rule: from C/k = 8.00 on" in md
    assert "there 70%-70% of its admissions are regrets, against 40%-40% where it lowers the mass" in md
    assert "C/k = 2.0: QF - rule +2.57 [+1.90, +3.20], SF - first-choice +5.82 [+4.40, +7.10]" in md
    # the regime table and the block check
    col = res["columns"][0]
    assert (f"| {col['label']} | 16 of 64 | 2.0 | {col['warm_set_miss_rate']:.1%} | "
            f"{col['substitute_all_share']:.1%} |") in md
    line = next(x for x in md.splitlines() if x.strip().startswith("- rule-0.15: width by length"))
    shown = [float(v) for v in re.findall(r"\d+: (\d+\.\d+)", line)]
    assert shown == [round(w["width"], 3) for w in col["blocks"]["check"]["rule-0.15"]["widths"]]


def _script() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("findings_script", REPO / "scripts" / "findings.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_power_across_builds_is_row_1s_substitute_all_on_each_build() -> None:
    """Each build's power entries are its row 1's substitute-all figures; the page counts the builds whose interval
    lies above 0, per column (a build whose interval contains 0 is not counted)."""
    res = _result()
    res["columns"][0]["requested"] = 0.25
    sa = next(r for r in res["rows"] if r["id"] == "1")["data"]["substitute-all"]
    p = findings.power(res)
    assert len(p) == 1 and p[0]["ppl_change_pct"] == sa["ppl_change_pct"] and p[0]["ci95"] == sa["ci95"]
    assert p[0]["c_over_k"] == res["columns"][0]["c_over_k"] and p[0]["above_zero"] is (sa["ci95"][0] > 0)
    assert sa["ci95"][0] > 0  # the fixture's substitute-all loses 5% per token: large by construction
    weak = {**res, "power": [{**p[0], "ppl_change_pct": 0.4, "ci95": [-0.3, 1.1], "above_zero": False}],
            "setup": {**res["setup"], "model": "ref-weak"}}
    res["power"] = p
    res["power_by_build"] = _script().power_by_build([(0, res), (2, {**weak, "power_only": True})])
    md = render.to_markdown(json.loads(json.dumps(res)))
    assert "### Power across build seeds" in md
    assert (f"| seed 0 (`m`) | 50.00 | {sa['ppl_change_pct']:+.2f}% [{sa['ci95'][0]:+.2f}, {sa['ci95'][1]:+.2f}] "
            f"(C/k 2.0, 28.6%) |") in md
    assert "| seed 2 (`ref-weak`), power only | 50.00 | +0.40% [-0.30, +1.10] (C/k 2.0, 28.6%) |" in md
    assert "25.00% of the experts: above 0 on 1 of 2 builds" in md
    assert "### Power across build seeds" not in render.to_markdown(_result())


def test_page_says_how_many_claims_and_that_none_is_corrected() -> None:
    res = _result()
    n = sum(1 for r in res["rows"] if r["verdict"] != UNTESTABLE and not r.get("own_check"))
    md = render.to_markdown(res)
    assert f"The table tests {n} (row, column) pairs of the paper's claims" in md
    assert f"about {0.05 * n:.1f} of the {n} verdicts" in md and "no Holm or Bonferroni" in md


def test_script_seed_flags_are_checked_before_any_work(tmp_path: Path) -> None:
    script = _script()
    with pytest.raises(InputError, match=re.escape("--power-seed = ['x']: an integer build seed is needed")):
        script.main(["--power-seed", "x"])
    with pytest.raises(InputError, match="only with the ref model"):
        script.main(["--model", str(tmp_path), "--power-seed", "2"])
    with pytest.raises(InputError, match="--jobs = 0 must be >= 1"):
        script.main(["--jobs", "0"])


def test_script_jobs_report_a_failed_build(tmp_path: Path) -> None:
    """A build's findings process that fails stops the run with its own one-line error."""
    script = _script()
    job = script.Job("first build", tmp_path / "none", [], tmp_path / "o.json", tmp_path / "o.log", None)
    with pytest.raises(RuntimeError, match=r"findings on none \(first build\) failed with exit status 2: "
                                           r"expertsweep: error: --model"):
        script.run_jobs([job], 1, 1)


def test_bca_printed_only_where_used() -> None:
    res = _result()
    for r in res["rows"]:
        methods = {v for k, v in _walk(r["data"]) if k == "method"}
        if "BCa" in r["sample"]:
            assert any("BCa" in m for m in methods), r["id"]
        if methods and all("BCa" not in m for m in methods):
            assert "BCa" not in r["sample"], r["id"]


def _walk(x: Any) -> list[tuple[str, Any]]:
    if isinstance(x, dict):
        return [kv for k, v in x.items() for kv in ([(k, v)] if isinstance(v, str) else []) + _walk(v)]
    if isinstance(x, list):
        return [kv for y in x for kv in _walk(y)]
    return []


def test_capacity_fraction_values() -> None:
    assert findings.parse_capacity_fraction("paper") == "paper"
    assert findings.parse_capacity_fraction("0.25") == 0.25
    for bad in ("0", "1", "x", "-0.1"):
        with pytest.raises(InputError, match=re.escape(f"--capacity-fraction = {bad!r}")):
            findings.parse_capacity_fraction(bad)


def test_scrub_and_commit(tmp_path: Path) -> None:
    m = tmp_path / "mix-abc"
    assert findings.scrub(f"calib text {m}/calib.txt", m) == "calib text <model>/calib.txt"
    assert findings.scrub(f"{Path.home()}/x", m) == "~/x"
    c = findings.git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}", c["commit"]) and isinstance(c["dirty"], bool)


def test_mass_policies_fetch_first_choice() -> None:
    from runtime.core.policy import PRESETS

    pols = X.mass_policies()
    assert len(pols) >= 20
    assert all(p.fetches_first_choice and p.rule in ("threshold", "first_choice") for p in pols.values())
    assert PRESETS["rule-0.15"].label() in pols
    pairs = X.admission_pairs(pols)
    assert len(pairs) == len(pols) // 2 and all(pols[a].beta is None and pols[b].beta == 0.5 for a, b in pairs)


def test_band_policy() -> None:
    heavy = X.band_policy(0.15, X.BAND_TOP)
    assert heavy.rule == "band" and heavy.fetches_first_choice
    with pytest.raises(InputError, match="tau-high"):
        X.band_policy(0.2, 0.1)


class _CharTok:
    """A character-level tokenizer with offsets (the topic stream only needs these calls)."""

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False) -> dict:
        out: dict[str, list] = {"input_ids": [ord(c) for c in text]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out


def test_topic_stream_switches(tmp_path: Path) -> None:
    from runtime.tools.findings.topic import topic_stream

    doms = {}
    for d, ch in (("code", "c"), ("prose", "p"), ("verse", "v")):
        doms[d] = tmp_path / f"eval_{d}.txt"
        doms[d].write_text("".join(f"{ch * 9}\n" for _ in range(100)))
    s = X.Setup(tmp_path, tmp_path / "eval.txt", doms, 0.25, 900, 50, 10, 1, 1, 0, tmp_path, None)
    stream, switches, names = topic_stream(s, _CharTok())
    assert names[:4] == ["code", "prose", "verse", "code"]
    assert switches[0] == 0 and all(b - a == 50 for a, b in zip(switches, switches[1:], strict=False))
    for pos, d in zip(switches, names, strict=True):
        assert stream[pos] == d[0]
    assert 900 <= len(stream) < 900 + 50


# --------------------------------------------------------------------------- the command on the test model


@pytest.fixture(scope="module")
def test_model() -> Path:
    """The `test` reference model's shape, corpus and tokenizer (2 layers, 64 experts, top-8), trained 400 steps at a
    peak learning rate of 5e-3 (~45 s on one core), built once into the shared test-model cache (tests/fixture_cache.py:
    keyed by its spec, corpus and the builder's sources; a later run reuses it): its heavy-expert effect is large
    (docs/testing.md)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from runtime.tools import tinymodel
    from tests.fixture_cache import cached_model

    spec = dataclasses.replace(tinymodel.SPECS["test"], name="findingstest", steps=400, warmup_steps=30, lr=5e-3)
    return cached_model(spec)


@pytest.mark.slow
def test_cli_on_test_model(test_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out_md, out_json = tmp_path / "f.md", tmp_path / "f.json"
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.findings", "--model", str(test_model), "--max-tokens", "4096", "--json",
         "--prompts", "2", "--new-tokens", "4", "--out-md", str(out_md), "--out-json", str(out_json)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert json.loads(out_json.read_text()) == res
    text = out_json.read_text() + out_md.read_text()
    assert str(test_model) not in text and str(Path.home()) not in text  # no machine paths
    cols = [c["label"] for c in res["columns"]]
    assert len(cols) in (1, 2) and any(c["paper_regime"] for c in res["columns"])
    assert [r["id"] for r in res["rows"]] == IDS * len(cols)
    for r in res["rows"]:
        for key in ("paper", "paper_source", "ours", "ci95", "verdict", "rule", "sample"):
            assert isinstance(r[key], str) and r[key], (r["id"], key)
        assert r["verdict"] in VERDICTS
    by = {(r["id"], r["column"]): r for r in res["rows"]}
    first = cols[0]
    for rid in ("3", "4a"):
        d = by[(rid, first)]["data"]
        assert d["ci95"][0] <= d["difference"] <= d["ci95"][1]
    assert by[("4b", first)]["verdict"] == UNTESTABLE  # the test model has one domain
    assert first.endswith("(25.0%)") and by[("1", first)]["data"]["claim_verdicts"][0] == HOLDS
    heavy = by[("1", first)]["data"]
    assert heavy["fetch-every-miss"]["ppl_change_pct"] == pytest.approx(0.0, abs=1e-9)
    mass = by[("2a", first)]["data"]
    assert len(mass["policies"]) + len(mass["duplicates"]) == len(X.mass_policies())
    assert len(mass["policies"]) < len(X.mass_policies())  # tau 0.05 with/without admission coincide
    assert mass["ci95"][0] <= mass["r"] <= mass["ci95"][1]
    band = by[("3", first)]["data"]
    assert band["heavy"]["substitutions"] < band["light"]["substitutions"]
    shares = [p["substitute_all_share"] for p in res["sweep"]["points"]]
    assert all(a >= b - 1e-12 for a, b in zip(shares, shares[1:], strict=False))
    speed = by[("5", first)]["data"]
    assert speed["head_scale"] == pytest.approx(2 / 48)
    # at equal device memory: the admission policies with one copy buffer per layer hold one slot fewer than the rule
    eq = by[("4a-mem", first)]["data"]["equal_memory"]
    assert eq["emulation"]["slots"] == {"rule-0.15": 16, "fetch-every-miss": 16, "quality-first": 15,
                                        "speed-first": 15}
    sm = by[("5-mem", first)]["data"]["slots"]
    assert sm["quality-first"] == sm["speed-first"] == sm["fetch-every-miss"] - 1
    assert by[("4b-mem", first)]["verdict"] == UNTESTABLE  # one domain
    # row 7: both routing families at the rule's slots, calibrated to its fetched-miss rate in the simulator
    r7 = by[("7", first)]["data"]
    for f in ("cache-prior", "cache-route"):
        cal = r7[f]["calibration"]
        assert cal["reached"] and abs(cal["rate"] - cal["target"]) <= 0.1 * cal["target"], (f, cal)
        assert r7[f]["reroutes_per_call"] > 0 and np.isfinite(r7[f]["difference"])
    b = res["columns"][0]["blocks"]
    ws = b["check"]["rule-0.15"]["widths"]
    assert ws[0]["block"] == 1 and b["blocks"] >= 2 and b["block"] >= b["check"]["rule-0.15"]["block"]
    md = out_md.read_text()
    assert "### Block length of the intervals" in md
    assert md.count("\n| ") >= len(res["rows"]) + 1


@pytest.mark.slow
def test_shared_runs_are_the_runs_they_stand_for(test_model: Path, tmp_path: Path) -> None:
    """A mass policy served by its preset's run (the same PolicyConfig, mass recorded) and a copy left out (the same
    decisions on the exact routing) have the figures their own emulations would have; --power-only keeps row 1."""
    from runtime.backends import hfmodel
    from runtime.tools.findings.cli import timer

    s = X.Setup(test_model, test_model / "eval.txt", {}, 0.25, 2048, 320, 64, 1, 1, 0, tmp_path,
                hfmodel.load(test_model))
    X.exact_trace(s, s.eval_text)
    main, mp, kept = X.emulate_column(s, timer("c", {}))
    pols = X.mass_policies()
    assert set(mp) == {n for n in pols if kept[n] == n} and len(kept) == len(pols)
    shared = "threshold(0.15) + lfu + beta=0.5"  # quality-first
    assert mp[shared] is main["quality-first"]
    copy = next(n for n in pols if kept[n] != n)
    solo = X.emulate_policies(s, {n: pols[n] for n in (shared, copy)}, s.eval_text, mass=True)
    for n, run in ((shared, mp[shared]), (copy, mp[kept[copy]])):
        assert np.array_equal(solo[n].dnll, run.dnll) and np.array_equal(solo[n].mass, run.mass), n
    res = findings.run(test_model, 2048, [0.25], prompts_per_domain=1, new_tokens=1, power_only=True)
    assert [r["id"] for r in res["rows"]] == ["1"] and res["power_only"] and res["admission"] is None
    assert res["power"][0]["ci95"] == res["rows"][0]["data"]["substitute-all"]["ci95"]


@pytest.mark.slow
def test_topic_finding_on_two_domains(test_model: Path, tmp_path: Path) -> None:
    from runtime.backends import hfmodel
    from runtime.tools.findings.topic import finding_topic

    folder = tmp_path / "model"
    folder.mkdir()
    for f in test_model.iterdir():
        (folder / f.name).symlink_to(f)
    text = (test_model / "eval.txt").read_text()
    (folder / "eval_code.txt").write_text(text[: len(text) // 2])
    (folder / "eval_prose.txt").write_text(Path(X.__file__).read_text())  # English-heavy docstrings
    s = X.Setup(folder, folder / "eval.txt", {"code": folder / "eval_code.txt", "prose": folder / "eval_prose.txt"},
                0.25, 2048, 160, 32, 1, 1, 0, tmp_path, hfmodel.load(folder))
    row = finding_topic(s)
    assert row.verdict in (HOLDS, DIFFERS, INCONCLUSIVE)
    assert row.data["switches"] >= 8 and row.data["domains"] == ["code", "prose"]
    assert row.data["dd_ci95"][0] <= row.data["dd"] <= row.data["dd_ci95"][1]
    assert row.data["blocks"]["block"] >= 1 and "segments" in row.sample


def test_bad_inputs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runtime.findings", "--model", str(tmp_path / "none")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("expertsweep: error: --model") and proc.stdout == ""
    out = tmp_path / "o.json"
    proc = subprocess.run([sys.executable, "-m", "runtime.findings", "--model", str(tmp_path),
                           "--capacity-fraction", "1.5", "--out-json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip() == "expertsweep: error: --capacity-fraction = '1.5' must be a number in (0, 1) or 'paper'"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "eval.txt").write_text("x")
    with pytest.raises(InputError, match="--max-tokens"):
        findings.run(tmp_path, max_tokens=100)


def test_script_page_is_whole_and_checks_flags_first() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("findings_script", REPO / "scripts" / "findings.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    md = script.page(_result(), "python scripts/findings.py")
    assert md.startswith(script.INTRO) and md.count("## Reading the table") == 1
    before = (REPO / "reports" / "findings" / "findings.md").stat().st_mtime_ns
    proc = subprocess.run([sys.executable, "scripts/findings.py", "--capacity-fraction", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "expertsweep: error: --capacity-fraction = '2' must be a number in (0, 1) or 'paper'"]
    assert (REPO / "reports" / "findings" / "findings.md").stat().st_mtime_ns == before


def test_stability_marks_rows_whose_verdict_differs_between_builds() -> None:
    """Rows matched by id and requested capacity (labels differ between builds); a differing verdict reads
    unstable on the page, with both verdicts."""
    res, res2 = _result(), _result()
    for c in (*res["columns"], *res2["columns"]):
        c["requested"] = 0.25
    res2["columns"][0]["label"] = "C=17 (26.6%)"  # another build, another paper column
    for r in res2["rows"]:
        r["column"] = "C=17 (26.6%)"
    flip = next(r for r in res2["rows"] if r["id"] == "4a")
    before = next(r for r in res["rows"] if r["id"] == "4a")["verdict"]
    flip["verdict"] = DIFFERS if before != DIFFERS else HOLDS
    out = findings.stability(res, res2)
    by = {r["id"]: r for r in out["rows"]}
    assert by["4a"]["verdict"] == "unstable" and by["4a"]["verdict_by_build"] == [before, flip["verdict"]]
    assert all(r["verdict"] != "unstable" for r in out["rows"] if r["id"] != "4a")
    md = render.to_markdown(out)
    assert f"**unstable** ({before} on the first build, {flip['verdict']} on the second)" in md
    assert "also computed on a second build" in md
    assert "one build of the model only" in render.to_markdown(_result())


def test_an_older_result_says_so() -> None:
    """A result of the findings before one interval per statistic (no `format`) renders with a line saying its
    rules are older."""
    res = _result()
    assert "older version of the findings" not in render.to_markdown(res)
    del res["format"]
    assert "older version of the findings" in render.to_markdown(res)


def test_script_skips_real_traces_without_shared(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("findings_script", REPO / "scripts" / "findings.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    res = {"admission": {"model": {}}}
    script.add_traces(res, tmp_path / "absent")
    assert res == {"admission": {"model": {}}}
    with pytest.raises(InputError, match="--admission-only: no .npz traces in"):
        script.admission_only("cmd", tmp_path / "absent")


def test_the_committed_page_is_its_json_rendered() -> None:
    """reports/findings/findings.md is its findings.json rendered by scripts/findings.py's page(), byte for byte
    (nothing hand-edited), generated at a clean commit (commit.dirty false)."""
    import importlib.util

    res = json.loads((REPO / "reports" / "findings" / "findings.json").read_text())
    assert res["commit"]["dirty"] is False and len(res["commit"]["commit"]) == 40
    spec = importlib.util.spec_from_file_location("findings_script", REPO / "scripts" / "findings.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.page(res, res["command"]) == (REPO / "reports" / "findings" / "findings.md").read_text()
    assert "lowered perplexity" in next(r["paper"] for r in res["rows"] if r["id"] == "4a")
