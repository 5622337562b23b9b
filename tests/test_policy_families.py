"""scripts/policy_families.py (`make families`): its rows are the simulator backend's results at equal memory,
an infeasible pinned set is a row (not a crash), and the LRU-vs-LFU verdict counts what the rows say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tqdm import tqdm

from runtime.backends import get_backend
from runtime.core.spec import RunSpec
from runtime.formats.trace import save_trace, synthetic_trace

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("policy_families", REPO / "scripts" / "policy_families.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_are_the_backend_results(tmp_path: Path) -> None:
    pf = _script()
    path = tmp_path / "t.parquet"
    save_trace(synthetic_trace(600, 2, 16, 4, 16, seed=2), path)
    with tqdm(disable=True) as bar:
        rows = pf.simulate_source("syn", str(path), 4, [0.25, 0.5], "held-out", bar)
    fams = pf.families(4)
    # drop_renorm changes outputs only: not replayed, every other family once per fraction
    assert len(rows) == 2 * (len(fams) - 1)
    by = {(r["fraction"], r["family"]): r for r in rows}
    # C = 4 = k at 25%: pinning half the slots leaves 2 < k free slots, a one-line error kept as a row
    assert "--pin-fraction" in by[(0.25, "pinned 0.5 + LRU")]["infeasible"]
    for (f, fam), r in by.items():
        if "infeasible" in r:
            continue
        res = get_backend("simulator").evaluate(RunSpec(policy=fams[fam], trace=str(path), capacity_fraction=f,
                                                        initial_residency="held-out"))
        assert r["hit_rate"] == res.counters["hits"] / res.counters["calls"]
        assert r["fetches_per_token"] == res.counters["fetches"] / res.tokens
        assert r["slots"] == sum(res.capacity) == 2 * round(f * 16)  # equal memory: same total in every family
    ver = pf.verdict(rows)["LRU"]
    assert ver["n"] == 2
    wins = sum(by[(f, "LRU")]["hit_rate"] > by[(f, "LFU (= fetch-every-miss)")]["hit_rate"] for f in (0.25, 0.5))
    assert ver["lru_wins"] == wins
    for c in ver["cells"]:  # the bootstrap interval of the difference holds the difference itself
        assert c["ci95"][0] <= c["lru_minus_lfu_points"] <= c["ci95"][1]
    # the interval is of this pair's per-token hits: identical replays give [0, 0]
    same = pf.diff_interval(by[(0.5, "LRU")], by[(0.5, "LRU")])
    assert same == (0.0, 0.0)
    assert pf.verdict(rows)["pinned 0.5 + LRU"]["n"] == 1  # the infeasible cell is left out
    md = pf.markdown(rows, pf.verdict(rows), "h")
    assert f"{by[(0.5, 'lfuda')]['hit_rate']:.4f}" in md
