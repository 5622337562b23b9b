"""Tests for runtime.tools.findings: the verdict rule, the block bootstrap, the statistics, the topic stream,
and every finding on the test model."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.core.errors import InputError
from runtime.core.policy import PRESETS
from runtime.tools import findings

REPO = Path(__file__).resolve().parents[1]
IDS = ["1", "2a", "2b", "2c", "3", "4a", "4b", "5", "6"]
H, D, INC, U = findings.HOLDS, findings.DIFFERS, findings.INCONCLUSIVE, findings.UNTESTABLE


# --------------------------------------------------------------------------- the verdict rule


@pytest.mark.parametrize(("ci", "direction", "null", "value", "expected"), [
    ((0.4, 0.9), 1, 0.0, None, H),  # paper's direction, excludes no-effect
    ((-0.9, -0.4), -1, 0.0, None, H),
    ((-0.9, -0.4), 1, 0.0, None, D),  # excludes the paper's direction
    ((0.4, 0.9), -1, 0.0, None, D),
    ((-0.34, 0.62), -1, 0.0, None, INC),  # contains no effect (issue 18's finding 4)
    ((-0.34, 0.62), 1, 0.0, None, INC),
    ((0.0, 0.5), 1, 0.0, None, INC),  # touching no effect is containing it
    ((2.6, 2.8), 1, 1.0, (2.5, 3.0), H),  # inside the paper's range
    ((1.8, 2.0), 1, 1.0, (2.5, 3.0), D),  # faster, but excludes the paper's value
    ((2.4, 2.6), 1, 1.0, (2.5, 3.0), H),  # overlaps it
    ((0.8, 2.0), 1, 1.0, (2.5, 3.0), INC),  # contains no effect: never differs
    ((math.nan, 1.0), 1, 0.0, None, U),
])
def test_verdict_rule(ci, direction, null, value, expected) -> None:
    assert findings.verdict(ci, direction, null, value) == expected


def test_interval_containing_no_effect_is_never_differs() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        null = float(rng.normal())
        lo = null - abs(float(rng.normal()))
        hi = null + abs(float(rng.normal()))
        value = tuple(sorted(rng.normal(size=2) * 5)) if rng.random() < 0.5 else None
        assert findings.verdict((lo, hi), int(rng.choice([-1, 1])), null, value) == INC


def test_verdict_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="direction"):
        findings.verdict((0.1, 0.2), 0)
    with pytest.raises(ValueError, match="reversed"):
        findings.verdict((0.3, 0.2), 1)


def test_combine_and_rule_text() -> None:
    assert findings.combine([H, H]) == H
    assert findings.combine([H, INC]) == INC
    assert findings.combine([H, D, INC]) == D
    assert findings.combine([U, H]) == H
    assert findings.combine([U, U]) == U and findings.combine([]) == U
    t = findings.rule_text("x", 1, 1.0, (2.5, 3.0), "x")
    assert "wholly > 1x" in t and "2.5-3x" in t and "inconclusive here if it contains 1x" in t


# --------------------------------------------------------------------------- synthetic rows, one per verdict


def _windows(effect: float, n: int = 60, noise: float = 0.05, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-window NLL-difference sums of two policies whose true gap is `effect` nats per token."""
    rng = np.random.default_rng(seed)
    cnt = 127
    base = rng.normal(0.02, noise, n) * cnt
    return base + effect * cnt + rng.normal(0, noise, n) * cnt, base


@pytest.mark.parametrize(("effect", "expected"), [(0.2, H), (-0.2, D), (0.0, INC)])
def test_block_bootstrap_verdicts_on_synthetic_rows(effect: float, expected: str) -> None:
    """A large paired effect holds, a large opposite one differs, none is inconclusive (by construction: the
    effect is 4 x the per-window noise, or exactly 0 with identical policies)."""
    a, b = _windows(effect)
    if effect == 0.0:
        a = b + np.random.default_rng(1).normal(0, 0.02, len(b)) * 127 * np.where(np.arange(len(b)) % 2, 1, -1)
    st = findings.block_starts(len(a), 3)
    cnt = findings.to_blocks(np.full(len(a), 127), st)
    lo, hi, method = findings.block_ci((findings.to_blocks(a, st), findings.to_blocks(b, st), cnt),
                                       findings.diff_stat, 0)
    assert method == "BCa" and lo < float(findings.diff_stat(a, b, np.full(len(a), 127))) < hi
    assert findings.verdict((lo, hi), 1) == expected


def test_block_ci_degenerate_and_single_block() -> None:
    z = np.zeros(10)
    lo, hi, method = findings.block_ci((z, z + 1.0), findings.change_stat, 0)
    assert (lo, hi) == (0.0, 0.0) and method == "percentile"
    lo, hi, method = findings.block_ci((np.ones(1), np.ones(1)), findings.change_stat, 0)
    assert math.isnan(lo) and method.startswith("none")


def test_blocks_cover_every_window() -> None:
    for n in (1, 7, 32, 33, 64):
        for b in (1, 2, 3, 5, 8):
            st = findings.block_starts(n, b)
            assert st[0] == 0 and np.all(np.diff(st) == b)
            assert findings.to_blocks(np.ones(n), st).sum() == n
            sizes = np.diff(np.append(st, n))
            assert sizes.min() >= min(b, n) // 2
    with pytest.raises(ValueError):
        findings.block_starts(0, 1)


def test_block_bootstrap_widens_with_correlated_windows() -> None:
    """Windows that share a slowly varying effect (a cache's memory of 16 windows, by construction): the interval
    from 1-window blocks is narrower than from blocks longer than the memory."""
    rng = np.random.default_rng(3)
    n, mem = 256, 16
    level = np.repeat(rng.normal(0, 1.0, n // mem), mem)
    dn = (level + rng.normal(0, 0.1, n)) * 10
    cnt = np.full(n, 100)
    width = {}
    for b in (1, 32):
        st = findings.block_starts(n, b)
        lo, hi, _ = findings.block_ci((findings.to_blocks(dn, st), findings.to_blocks(cnt, st)),
                                      findings.change_stat, 0)
        width[b] = hi - lo
    assert width[32] > 2 * width[1]


def test_circular_block_idx() -> None:
    idx = findings.circular_block_idx(10, 4, 0, n_boot=50)
    assert idx.shape == (50, 10) and idx.min() >= 0 and idx.max() < 10
    d = np.diff(idx[:, :4], axis=1) % 10
    assert np.all(d == 1)  # each block is a run of consecutive windows (wrapping round)


def test_dedupe_and_pairs() -> None:
    a, b = np.arange(3.0), np.arange(3.0) + 1
    kept = findings.dedupe({"x": (a, b), "y": (a.copy(), b.copy()), "z": (b, a)})
    assert kept == {"x": "x", "y": "x", "z": "z"}
    pols = findings.mass_policies()
    pairs = findings.admission_pairs(pols)
    assert len(pairs) == len(pols) // 2
    assert all(pols[w].beta is None and pols[a_].beta == 0.5 for w, a_ in pairs)


def test_pearson_and_change() -> None:
    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert findings.pearson(x, 2 * x + 1) == pytest.approx(1.0)
    assert findings.pearson(x, -x) == pytest.approx(-1.0)
    assert math.isnan(float(findings.pearson(x, np.ones(4))))
    rows = np.stack([x, -x])
    assert findings.pearson(rows, np.stack([x, x])) == pytest.approx([1.0, -1.0])
    assert findings.pct_change(0.0, 10) == 0.0
    assert findings.pct_change(10 * math.log(1.1), 10) == pytest.approx(10.0)
    lo, hi = findings.interval(np.arange(1001.0))
    assert lo == pytest.approx(25.0) and hi == pytest.approx(975.0)


def test_mass_policies_fetch_first_choice() -> None:
    pols = findings.mass_policies()
    assert len(pols) >= 20
    assert all(p.fetches_first_choice and p.rule in ("threshold", "first_choice") for p in pols.values())
    assert PRESETS["rule-0.15"].label() in pols  # the per-window reference policy
    assert len({p.label() for p in pols.values()}) == len(pols)


def test_band_policy() -> None:
    heavy = findings.band_policy(0.15, findings.BAND_TOP)
    assert heavy.rule == "band" and heavy.fetches_first_choice
    with pytest.raises(InputError, match="tau-high"):
        findings.band_policy(0.2, 0.1)


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
    c = findings.git_commit(REPO)
    assert c["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", c["commit"])


class _Trace:
    """The fields of a Trace that the regime helpers read."""

    def __init__(self, ids: np.ndarray, E: int) -> None:
        self.topk_ids = ids
        self.T, self.L, self.k = ids.shape
        self.E = E
        self.valid = np.ones((self.T, self.L), bool)


def test_warm_miss_rate() -> None:
    ids = np.array([[[0, 1]], [[1, 2]], [[3, 0]]], np.int32)  # [T=3, L=1, k=2]
    tr = _Trace(ids, 8)
    assert findings.warm_miss_rate(tr, [np.array([0, 1])]) == pytest.approx(2 / 6)
    assert findings.warm_miss_rate(tr, None) == 1.0


class _CharTok:
    """A character-level tokenizer with offsets (the topic stream only needs these calls)."""

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False):
        out = {"input_ids": [ord(c) for c in text]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out


def test_topic_stream_switches(tmp_path: Path) -> None:
    doms = {}
    for d, ch in (("code", "c"), ("prose", "p"), ("verse", "v")):
        doms[d] = tmp_path / f"eval_{d}.txt"
        doms[d].write_text("".join(f"{ch * 9}\n" for _ in range(100)))
    s = findings.Setup(tmp_path, tmp_path / "eval.txt", doms, 0.25, 900, 50, 10, 1, 1, 0, tmp_path, None)
    stream, switches, names = findings.topic_stream(s, _CharTok())
    assert names[:4] == ["code", "prose", "verse", "code"]
    assert switches[0] == 0 and all(b - a == 50 for a, b in zip(switches, switches[1:], strict=False))
    for pos, d in zip(switches, names, strict=True):
        assert stream[pos] == d[0]  # each switch starts a segment of its domain
    assert 900 <= len(stream) < 900 + 50


def test_choose_blocks_document_sized(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text(("x" * 999 + findings.EOS) * 8)  # 8 documents of 1000 characters (+ the separator's)
    s = findings.Setup(tmp_path, text, {}, 0.25, None, 50, 10, 1, 1, 0, tmp_path, type("M", (), {"tokenizer": _CharTok()}))
    starts, info = findings.choose_blocks(s, text, 200, 100)
    assert info["documents"] == 8 and info["document_windows"] == 11 and info["block_windows"] == 11
    assert not info["capped"] and len(starts) == info["blocks"]
    starts, info = findings.choose_blocks(s, text, 40, 100)  # 40 windows: capped at 40 // MIN_BLOCKS
    assert info["capped"] and info["block_windows"] == 40 // findings.MIN_BLOCKS


def _res(rows: list[dict]) -> dict:
    cols = [{"label": "C=16 (25.0%)", "slots": 16, "experts": 64, "slots_per_top_k": 2.0, "warm_set_miss_rate": 0.3,
             "substitute_all_share": 0.3, "paper_regime": False,
             "blocks": {"block_windows": 2, "block_tokens": 256, "document_tokens": 2900.0, "capped": True,
                        "check": [{"block_windows": 1, "blocks": 32, "width": 0.5},
                                                                        {"block_windows": 2, "blocks": 16, "width": 0.7}]}}]
    return {"setup": {"model": "m", "eval_text": "eval.txt", "num_layers": 2, "num_experts": 64, "top_k": 8,
                      "tokens": 4096, "exact_perplexity": 50.0, "initial_residency": "calib", "min_blocks": 10,
                      "bootstrap_resamples": 1000, "seed": 0},
            "commit": {"commit": "a" * 40, "dirty": False}, "columns": cols,
            "paper_regime": {"model": "Qwen3-Next-80B-A3B", "slots": 128, "experts": 512, "top_k": 10,
                             "slots_per_top_k": 12.8, "substitute_all_share": 0.085, "layers": 48},
            "sweep": {"target_share": 0.085, "found": 0.5,
                      "points": [{"slots": 8, "substitute_all_share": 0.5}, {"slots": 63, "substitute_all_share": 0.01}]},
            "rows": rows, "seconds": 60.0}


def test_markdown_row_per_finding_and_column() -> None:
    rows = [{"id": i, "column": c, "finding": f"f{i}", "paper": "p|q", "ours": f"o{c}", "ci95": "[1, 2]",
             "verdict": H, "rule": "r", "sample": "s", "data": {}} for c in ("A", "B") for i in IDS]
    md = findings.to_markdown(_res(rows), "python -m runtime.findings --model m")
    assert md.startswith("`python -m runtime.findings --model m` (1.0 min")
    lines = md.splitlines()
    i2a = [n for n, line in enumerate(lines) if line.startswith("| 2a |")]
    assert len(i2a) == 2 and i2a[1] == i2a[0] + 1  # the two columns side by side
    assert "p\\|q" in md and "Commit `aaaaaaaaaaaa`" in md and "## Reading the table" in md
    assert "12.8" in md and "8.5%" in md


# --------------------------------------------------------------------------- the command on the test model


@pytest.fixture(scope="module")
def test_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `test` reference model's shape, corpus and tokenizer (2 layers, 64 experts, top-8), trained 400 steps at a
    peak learning rate of 5e-3 instead of 2400 at 3e-3 (~45 s instead of ~220 s on one core), into a private cache.
    Its router is the `test` model's (gate weights >= 0.15 by rank 0-3: 97.6/61/16/1.1% against 97.6/65/17/0.7%)
    and its heavy-expert effect is large (substitute-all minus the 0.15 rule at 25%: about +14 points, interval
    about [+12, +17]; on random weights it is [-0.02, +0.01]): docs/testing.md."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from runtime.tools import tinymodel

    spec = dataclasses.replace(tinymodel.SPECS["test"], name="findingstest", steps=400, warmup_steps=30, lr=5e-3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXPERTSWEEP_CACHE", str(tmp_path_factory.mktemp("models")))
        return tinymodel.ensure_model(spec, progress=False)


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
    assert res["commit"]["commit"] and re.fullmatch(r"[0-9a-f]{40}", res["commit"]["commit"])
    text = out_json.read_text() + out_md.read_text()
    assert str(test_model) not in text and str(Path.home()) not in text  # no machine paths
    cols = [c["label"] for c in res["columns"]]
    assert len(cols) in (1, 2) and any(c["paper_regime"] for c in res["columns"])
    assert [r["id"] for r in res["rows"]] == IDS * len(cols)
    for r in res["rows"]:
        for key in ("paper", "ours", "ci95", "verdict", "rule", "sample"):
            assert isinstance(r[key], str) and r[key], (r["id"], key)
        assert r["verdict"] in findings.VERDICTS
    by = {(r["id"], r["column"]): r for r in res["rows"]}
    first = cols[0]
    for rid in ("1", "3", "4a"):  # difference rows: the verdict follows the interval
        d = by[(rid, first)]["data"]
        lo, hi = d.get("difference_ci95") or d["ci95"]
        assert lo <= d["difference"] <= hi
        if by[(rid, first)]["verdict"] == D:
            assert not lo <= 0 <= hi
    assert by[("4b", first)]["verdict"] == U  # the test model has one domain
    # the trained router's heavy experts (the fixture): at 25% substituting every miss costs clearly more than
    # the 0.15 rule (inconclusive on random weights)
    assert first.endswith("(25.0%)") and by[("1", first)]["verdict"] == H
    heavy = by[("1", first)]["data"]
    assert heavy["fetch-every-miss"]["ppl_change_pct"] == pytest.approx(0.0, abs=1e-9)
    assert heavy["substitute-all"]["substituted_call_fraction"] > heavy["rule-0.15"]["substituted_call_fraction"]
    mass = by[("2a", first)]["data"]
    assert len(mass["policies"]) + len(mass["duplicates"]) == len(findings.mass_policies())
    assert len(mass["policies"]) < len(findings.mass_policies())  # tau 0.05 with/without admission coincide
    assert mass["ci95"][0] <= mass["r"] <= mass["ci95"][1]
    band = by[("3", first)]["data"]
    assert band["heavy"]["substitutions"] < band["light"]["substitutions"]  # few heavy vs many light
    # the regime sweep: substitute-all's share falls as the cache grows, and the paper column is nearest 8.5%
    pts = res["sweep"]["points"]
    shares = [p["substitute_all_share"] for p in pts]
    assert all(a >= b - 1e-12 for a, b in zip(shares, shares[1:], strict=False))
    paper_col = next(c for c in res["columns"] if c["paper_regime"])
    assert abs(paper_col["substitute_all_share"] - 0.085) == pytest.approx(min(abs(x - 0.085) for x in shares))
    speed = by[("5", first)]["data"]
    assert speed["head_scale"] == pytest.approx(2 / 48)
    h = speed["rtx4090"]
    assert h["head_share_all_resident"] < h["head_share_all_resident_uncharged"]
    # the block check: one-window blocks first
    blocks = res["columns"][0]["blocks"]
    assert blocks["check"][0]["block_windows"] == 1 and blocks["blocks"] >= 2
    assert out_md.read_text().count("\n| ") >= len(res["rows"]) + 1


def test_topic_finding_on_two_domains(test_model: Path, tmp_path: Path) -> None:
    """A copy of the test model with two domain texts: the topic-switch finding runs and has intervals."""
    folder = tmp_path / "model"
    folder.mkdir()
    for f in test_model.iterdir():
        (folder / f.name).symlink_to(f)
    text = (test_model / "eval.txt").read_text()
    half = len(text) // 2
    (folder / "eval_code.txt").write_text(text[:half])
    (folder / "eval_prose.txt").write_text(Path(findings.__file__).read_text())  # English-heavy docstrings
    from runtime.backends import hfmodel

    s = findings.Setup(folder, folder / "eval.txt", {"code": folder / "eval_code.txt",
                                                     "prose": folder / "eval_prose.txt"},
                       0.25, 2048, 160, 32, 1, 1, 0, tmp_path, hfmodel.load(folder))
    row = findings.finding_topic(s)
    assert row.verdict in (H, D, INC)
    assert row.data["switches"] >= 8 and row.data["domains"] == ["code", "prose"]
    lo, hi = row.data["dd_ci95"]
    assert lo <= row.data["dd"] <= hi
    if row.verdict == D:
        assert not lo <= 0 <= hi


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
    with pytest.raises(InputError, match="--max-tokens"):
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "eval.txt").write_text("x")
        findings.run(tmp_path, max_tokens=100)


def test_script_page_is_whole_and_checks_flags_first() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("findings_script", REPO / "scripts" / "findings.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    rows = [{"id": i, "column": "A", "finding": f"f{i}", "paper": "p", "ours": "o", "ci95": "[1, 2]",
             "verdict": H, "rule": "r", "sample": "s", "data": {}} for i in IDS]
    md = script.page(_res(rows), "python scripts/findings.py")
    assert md.startswith(script.INTRO) and md.count("## Reading the table") == 1
    before = (REPO / "docs" / "findings.md").stat().st_mtime_ns
    proc = subprocess.run([sys.executable, "scripts/findings.py", "--capacity-fraction", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "expertsweep: error: --capacity-fraction = '2' must be a number in (0, 1) or 'paper'"]
    assert (REPO / "docs" / "findings.md").stat().st_mtime_ns == before
