"""scripts/exact_cli_check.py, small: engine == emulation with each backend in its own process from the CLI
(`python -m runtime.emulate --backend engine|emulation --json`), two presets on a tiny checkpoint; and the check
fails when the two runs differ (here: the engine run at another capacity)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.tiny_hf import build_tiny

ROOT = Path(__file__).resolve().parents[1]


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
