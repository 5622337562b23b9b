"""The answer's "better than exact" flag (sweep.report): a recommended policy whose perplexity change
is negative beyond its 95% interval is marked in answer.csv and the answer table, and only such a one."""

from __future__ import annotations

import pandas as pd

from sweep.answer import BETTER_THAN_EXACT, answer, answer_text, better_than_exact


def _row(key: str, ms: float, change: float, lo: float, hi: float, baseline: str | None = None) -> dict:
    return {"policy_key": key, "policy": key, "baseline": baseline, "family": "test", "capacity_fraction": 0.25,
            "time_per_token_s": ms / 1e3, "time_per_token_ms": ms, "speed_ratio_vs_fetch_all": 1.0 / ms,
            "ppl_change_pct": change, "ppl_ci_low": lo, "ppl_ci_high": hi}


def _tables() -> dict[str, pd.DataFrame]:
    # the fastest policy lowers perplexity beyond its interval (the 360-step demo's threshold->drop);
    # the next straddles 0 (not flagged); fetch-every-miss is exact and slowest
    rows = [_row("drop-fast", 0.5, -0.57, -0.88, -0.28),
            _row("rule-mid", 0.7, -0.25, -1.10, 0.61),
            _row("fetch-all", 1.0, 0.0, 0.0, 0.0, baseline="fetch-every-miss")]
    return {"h": pd.DataFrame(rows)}


def test_better_than_exact_is_the_upper_bound_below_zero() -> None:
    assert better_than_exact({"ppl_ci_high": -0.28})
    assert not better_than_exact({"ppl_ci_high": 0.61})
    assert not better_than_exact({"ppl_ci_high": 0.0})
    assert not better_than_exact({"ppl_ci_high": None})
    assert not better_than_exact({"ppl_ci_high": float("nan")})


def test_answer_flags_a_policy_better_than_exact() -> None:
    ans = answer(_tables(), [0.5, 1.0]).set_index("ppl_budget_pct")
    assert list(ans["policy_key"]) == ["drop-fast", "drop-fast"]  # it is the fastest within both budgets
    assert ans["better_than_exact"].tolist() == [True, True]
    text = answer_text(ans.reset_index())
    rows = [ln for ln in text.splitlines() if ln.startswith("| h |")]
    assert len(rows) == 2 and all(r.rstrip(" |").endswith(BETTER_THAN_EXACT) for r in rows)
    assert "answer row(s) flagged" in text


def test_answer_does_not_flag_an_interval_that_reaches_zero() -> None:
    tables = _tables()
    tables["h"] = tables["h"][tables["h"]["policy_key"] != "drop-fast"]
    ans = answer(tables, [1.0])
    assert ans["policy_key"].tolist() == ["rule-mid"] and not ans["better_than_exact"].any()
    text = answer_text(ans)
    assert BETTER_THAN_EXACT not in text and "flagged" not in text
