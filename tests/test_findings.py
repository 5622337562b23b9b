"""Tests for runtime.findings: the statistics, the topic stream, and every finding on the test model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime import findings  # noqa: E402
from runtime.errors import InputError  # noqa: E402
from runtime.policy import PRESETS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VERDICTS = {"holds", "differs", "not testable here"}
IDS = ["1", "2a", "2b", "3", "4", "5", "6"]


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


def test_markdown_row_per_finding() -> None:
    res = {"setup": {"model": "m", "eval_text": "/x/eval.txt", "num_layers": 2, "num_experts": 64, "top_k": 8,
                     "capacity": 16, "capacity_fraction": 0.25, "tokens": 4096, "exact_perplexity": 50.0,
                     "initial_residency": "calib", "bootstrap_resamples": 1000, "seed": 0},
           "rows": [{"id": i, "finding": f"f{i}", "paper": "p|q", "ours": "o", "ci95": "[1, 2]",
                     "verdict": "holds", "basis": "b"} for i in IDS],
           "seconds": 60.0}
    md = findings.to_markdown(res, "python -m runtime.findings --model m")
    assert md.startswith("`python -m runtime.findings --model m` (1.0 min")
    assert sum(line.startswith("| 2a |") for line in md.splitlines()) == 1
    assert "p\\|q" in md


@pytest.fixture(scope="module")
def test_model() -> Path:
    from runtime.tinymodel import ensure_model

    return ensure_model("test", progress=False)


def _check_rows(rows: list[dict]) -> None:
    assert [r["id"] for r in rows] == IDS
    for r in rows:
        for key in ("paper", "ours", "ci95", "verdict"):
            assert isinstance(r[key], str) and r[key], (r["id"], key)
        assert r["verdict"] in VERDICTS


def test_cli_on_test_model(test_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out_md, out_json = tmp_path / "f.md", tmp_path / "f.json"
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.findings", "--model", str(test_model), "--max-tokens", "4096", "--json",
         "--prompts", "3", "--new-tokens", "8", "--out-md", str(out_md), "--out-json", str(out_json)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    _check_rows(res["rows"])
    assert json.loads(out_json.read_text()) == res
    assert out_md.read_text().count("\n| ") == len(IDS) + 1  # header and one row per finding
    by_id = {r["id"]: r for r in res["rows"]}
    assert by_id["4"]["verdict"] == "not testable here"  # the test model has one domain
    assert res["setup"]["tokens"] == 4096 - 4096 % 128 and res["setup"]["num_experts"] == 64
    heavy = by_id["1"]["data"]
    assert heavy["fetch-every-miss"]["ppl_change_pct"] == pytest.approx(0.0, abs=1e-9)
    assert heavy["substitute-all"]["substituted_call_fraction"] > heavy["rule-0.15"]["substituted_call_fraction"]
    mass = by_id["2a"]["data"]
    assert len(mass["policies"]) >= 20 and -1 <= mass["r"] <= 1
    assert mass["ci95"][0] <= mass["ci95"][1]
    band = by_id["3"]["data"]
    assert band["heavy"]["substitutions"] < band["light"]["substitutions"]  # few heavy vs many light


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
    from runtime import hfmodel

    s = findings.Setup(folder, folder / "eval.txt", {"code": folder / "eval_code.txt",
                                                     "prose": folder / "eval_prose.txt"},
                       0.25, 2048, 160, 32, 1, 1, 0, tmp_path, hfmodel.load(folder))
    row = findings.finding_topic(s)
    assert row.verdict in ("holds", "differs")
    assert row.data["switches"] >= 8 and row.data["domains"] == ["code", "prose"]
    lo, hi = row.data["dd_ci95"]
    assert lo <= row.data["dd"] <= hi


def test_bad_inputs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runtime.findings", "--model", str(tmp_path / "none")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("expertsweep: error: --model") and proc.stdout == ""
    with pytest.raises(InputError, match="--max-tokens"):
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "eval.txt").write_text("x")
        findings.run(tmp_path, max_tokens=100)
