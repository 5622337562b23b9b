"""Tests for runtime.tools.findings' verdicts: the rule table, the statistics, and every row's statistic on
synthetic per-window (or per-segment) arrays built so that the paper's claim holds, fails, or cannot be told,
each checked to give "holds" / "differs" / "inconclusive here". A flipped direction in `rules.RULES` makes the
"holds" case of its row give another verdict (`test_flipped_direction_changes_the_holds_case`).

The command on a trained test model, the page and the script: tests/test_findings_page.py."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.tools.findings import admission as X_ADM
from runtime.tools.findings import experiments as X
from runtime.tools.findings import rows as R
from runtime.tools.findings import stats
from runtime.tools.findings.rules import (
    DIFFERS,
    HOLDS,
    INCONCLUSIVE,
    RULES,
    UNTESTABLE,
    Claim,
    combine,
    verdict,
)

H, D, INC, U = HOLDS, DIFFERS, INCONCLUSIVE, UNTESTABLE
N, CNT, W = 60, 127.0, 128.0  # windows, scored tokens per window, tokens per window
STARTS = stats.block_starts(N, 3)
ONES = np.ones(N)


def _noise(rng: np.random.Generator, sd: float, n: int = N, centred: bool = False) -> np.ndarray:
    x = rng.normal(0, sd, n)
    return x - x.mean() if centred else x


# --------------------------------------------------------------------------- the rule table


@pytest.mark.parametrize(("ci", "claim", "expected"), [
    ((0.4, 0.9), Claim("x", 1), H),
    ((-0.9, -0.4), Claim("x", -1), H),
    ((-0.9, -0.4), Claim("x", 1), D),
    ((0.4, 0.9), Claim("x", -1), D),
    ((-0.34, 0.62), Claim("x", -1), INC),
    ((0.0, 0.5), Claim("x", 1), INC),  # touching no effect is containing it
    ((2.6, 2.8), Claim("x", 1, 1.0, inside=(2.5, 3.0)), H),  # inside the paper's range
    ((2.4, 2.6), Claim("x", 1, 1.0, inside=(2.5, 3.0)), INC),  # overlaps it without lying inside
    ((1.8, 2.0), Claim("x", 1, 1.0, inside=(2.5, 3.0)), D),  # faster, but excludes the paper's range
    ((3.1, 3.4), Claim("x", 1, 1.0, inside=(2.5, 3.0)), D),
    ((0.8, 2.0), Claim("x", 1, 1.0, inside=(2.5, 3.0)), INC),  # contains no effect: never differs
    ((0.8, 0.95), Claim("r", 1, point=0.92), H),
    ((0.3, 0.6), Claim("r", 1, point=0.92), D),  # positive, but excludes the paper's 0.92
    ((math.nan, 1.0), Claim("x", 1), U),
])
def test_verdict_rule(ci: tuple[float, float], claim: Claim, expected: str) -> None:
    assert verdict(ci, claim) == expected


def test_interval_containing_no_effect_is_never_differs() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        null = float(rng.normal())
        lo, hi = null - abs(float(rng.normal())), null + abs(float(rng.normal()))
        inside = tuple(sorted(rng.normal(size=2) * 5)) if rng.random() < 0.5 else None
        assert verdict((lo, hi), Claim("x", int(rng.choice([-1, 1])), null, inside=inside)) == INC


def test_verdict_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="direction"):
        Claim("x", 0)
    with pytest.raises(ValueError, match="reversed"):
        verdict((0.3, 0.2), Claim("x", 1))
    with pytest.raises(ValueError, match="intervals"):
        RULES["1"].decide([(0.1, 0.2)])


def test_combine_and_rule_text() -> None:
    assert combine([H, H]) == H and combine([H, INC]) == INC and combine([H, D, INC]) == D
    assert combine([U, H]) == INC  # a claim that could not be tested keeps the row from holding
    assert combine([U, U]) == U and combine([]) == U
    t = RULES["5"].text()
    assert "wholly > 1x" in t and "inside the paper's 2.5-3x" in t and t.startswith("per host")
    assert "wholly < 0" in RULES["4a"].text()  # admission lowers perplexity: Quality-First minus the rule < 0
    assert "lowered perplexity" in RULES["4a"].paper
    assert RULES["6"].decide([]) == (U, [])


def test_every_row_has_a_rule() -> None:
    assert list(RULES) == ["1", "2a", "2b", "3", "4a", "4a-mem", "4b", "4b-mem", "5", "5-mem", "5q", "5q-mem", "5s",
                           "6", "2c", "7"]  # the admission rows at equal slots, then at equal device memory
    for r in RULES.values():
        assert r.paper and r.source and r.finding
    assert [r for r in RULES if RULES[r].own] == ["2c", "7"]  # the page's own check and finding, after the paper's
    assert "no verdict" in RULES["3"].note  # the paper's own hedge on Experiment B


# --------------------------------------------------------------------------- statistics


def test_block_ci_methods() -> None:
    rng = np.random.default_rng(0)
    a = (0.05 + _noise(rng, 0.01)) * CNT
    lo, hi, method = stats.block_ci((stats.to_blocks(a, STARTS), stats.to_blocks(CNT * ONES, STARTS)),
                                    stats.change_stat, 0)
    assert method == "BCa" and lo < float(stats.change_stat(a, CNT * ONES)) < hi
    z = np.zeros(10)
    lo, hi, method = stats.block_ci((z, z + 1.0), stats.change_stat, 0)  # constant: BCa is degenerate
    assert (lo, hi) == (0.0, 0.0) and method == "percentile"
    lo, hi, method = stats.block_ci((np.ones(1), np.ones(1)), stats.change_stat, 0)
    assert math.isnan(lo) and method.startswith("none")


def test_blocks_cover_every_window() -> None:
    for n in (1, 7, 32, 33, 64):
        for b in (1, 2, 3, 5, 8):
            st = stats.block_starts(n, b)
            assert st[0] == 0 and np.all(np.diff(st) == b)
            assert stats.to_blocks(np.ones(n), st).sum() == n
            assert np.diff(np.append(st, n)).min() >= min(b, n) // 2
    with pytest.raises(ValueError):
        stats.block_starts(0, 1)


def test_pearson_and_change() -> None:
    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert stats.pearson(x, 2 * x + 1) == pytest.approx(1.0)
    assert stats.pearson(x, -x) == pytest.approx(-1.0)
    assert math.isnan(float(stats.pearson(x, np.ones(4))))
    assert stats.pearson(np.stack([x, -x]), np.stack([x, x])) == pytest.approx([1.0, -1.0])
    assert stats.pct_change(0.0, 10) == 0.0
    assert stats.pct_change(10 * math.log(1.1), 10) == pytest.approx(10.0)


def test_stop_block() -> None:
    assert stats.stop_block([1.0, 1.5, 2.0, 2.05, 2.0]) == (2, True)  # stops growing at the third length
    assert stats.stop_block([1.0, 1.5, 2.0, 2.5]) == (3, False)  # still growing at the longest
    assert stats.stop_block([1.0, 1.0, 1.05]) == (0, True)


def _memory(n: int, mem: int, seed: int) -> np.ndarray:
    """Per-window losses sharing a level for `mem` consecutive windows (a cache's memory, by construction)."""
    rng = np.random.default_rng(seed)
    return (0.05 + np.repeat(rng.normal(0, 0.02, -(-n // mem)), mem)[:n] + rng.normal(0, 0.002, n)) * CNT


def test_choose_block_follows_the_data() -> None:
    """Windows correlated over 8 windows: the width grows to about that length and the block is chosen there
    (>= 4, with growth seen to stop); independent windows: a short block."""
    n = 240
    corr = stats.choose_block({"x": _memory(n, 8, 1)}, np.full(n, CNT), 0, n_boot=500)
    assert corr["block"] >= 4 and corr["stopped"] and corr["max_block"] == n // stats.MIN_BLOCKS
    ws = [w["width"] for w in corr["check"]["x"]["widths"]]
    assert max(ws[corr["block"]:]) <= ws[corr["block"] - 1] * (1 + stats.WIDTH_TOL)
    assert ws[corr["block"] - 1] > 1.5 * ws[0]
    iid = stats.choose_block({"x": _memory(n, 1, 2)}, np.full(n, CNT), 0, n_boot=500)
    assert iid["block"] <= 3


# --------------------------------------------------------------------------- row 1: a few heavy experts


def _heavy(sa_loss: float, rule_loss: float, sa_share: float, rule_share: float, seed: int = 0,
           same: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    calls = np.full(N, 2032.0)
    dn_sa = (sa_loss + _noise(rng, 0.005)) * CNT
    c_sa = sa_share * calls + _noise(rng, 10)
    if same:  # the rule is substitute-all up to zero-mean noise
        dn_rule, c_rule = dn_sa + _noise(rng, 0.005, centred=True) * CNT, c_sa + _noise(rng, 10, centred=True)
    else:
        dn_rule, c_rule = (rule_loss + _noise(rng, 0.005)) * CNT, rule_share * calls + _noise(rng, 10)
    return R.heavy(STARTS, dn_sa, dn_rule, c_sa, c_rule, calls, CNT * ONES, 0)


def test_row1_heavy() -> None:
    """Holds when the rule removes most (> 50%) of substitute-all's loss while sparing under half of its calls."""
    d = _heavy(0.055, 0.0035, 0.085, 0.075)  # the paper's: 94% of the loss removed, 12% of the calls spared
    assert d["verdict"] == H and d["claim_verdicts"] == [H, H]
    assert d["loss_removed"]["ci95"][0] > 90 and 5 < d["calls_spared"]["point"] < 20
    assert _heavy(0.055, 0.08, 0.085, 0.075)["claim_verdicts"][0] == D  # the rule loses more
    # the rule substitutes MORE calls than substitute-all while losing less: the paper's claim, a fortiori
    d = _heavy(0.055, 0.0035, 0.085, 0.095)
    assert d["verdict"] == H and d["calls_spared"]["ci95"][1] < 0
    d = _heavy(0.055, 0.0035, 0.085, 0.02)  # most of the loss removed, but by sparing 76% of the calls
    assert d["verdict"] == D and d["claim_verdicts"] == [H, D]
    d = _heavy(0.055, 0.044, 0.085, 0.08)  # about as many calls, but only 20% of the loss removed
    assert d["verdict"] == D and d["claim_verdicts"] == [D, H]
    d = _heavy(0.055, 0.0275, 0.085, 0.075)  # half the loss removed: "most" cannot be told
    assert d["claim_verdicts"][0] == INC


# --------------------------------------------------------------------------- row 2a: r across policies


def _across(r: float, P: int, seed: int = 0) -> dict:
    """P policies whose mass per token and perplexity change correlate with Pearson r = `r` exactly (before the
    windows' noise)."""
    rng = np.random.default_rng(seed)
    m = np.linspace(0.05, 0.5, P)
    x = (m - m.mean()) / np.linalg.norm(m - m.mean())
    e = rng.normal(size=P)
    e -= e.mean() + (e @ x) * x
    e /= np.linalg.norm(e)
    y = 0.02 + 0.01 * (r * x + math.sqrt(1 - r * r) * e)  # nats per token
    dn = (y[:, None] + rng.normal(0, 0.0005, (P, N))) * CNT
    mass = (m[:, None] + rng.normal(0, 0.005, (P, N))) * W
    return R.mass_across_policies(STARTS, dn, mass, CNT * ONES, W * ONES, 0)


def test_row2a_mass_across_policies() -> None:
    d = _across(0.92, 10)
    assert d["verdict"] == H and d["ci95"][0] <= 0.92 <= d["ci95"][1] and 0.85 < d["r"] < 0.97
    assert _across(-0.92, 10)["verdict"] == D  # more mass, less loss
    d = _across(0.5, 40)  # positive, but far from the paper's 0.92
    assert d["verdict"] == D and d["ci95"][0] > 0 and d["ci95"][1] < 0.92
    d = _across(0.0, 10)
    assert d["verdict"] == INC and d["ci95"][0] < 0 < d["ci95"][1]
    assert "ci95_fisher" not in d and "ci95_block" not in d  # one interval, no union


def _runs(dn: np.ndarray, mass: np.ndarray, names: list[str]) -> dict[str, X.PolicyRun]:
    return {n: X.PolicyRun(n, SimpleNamespace(ppl_change_pct=float(stats.pct_change(d.sum(), CNT * N))), d, int(CNT),
                           int(W), mass=m) for n, d, m in zip(names, dn, mass, strict=True)}


def _setup() -> X.Setup:
    s = X.Setup(None, None, {}, 0.25, None, 320, 64, 1, 1, 0, None, None)
    s.starts = STARTS
    s.blocks = {"windows": N, "window": int(W), "blocks": len(STARTS), "block": 3, "stopped": True}
    return s


def test_row2a_and_2c_count_duplicates_once() -> None:
    """Policies with the same decisions on the exact routing are one policy, however their emulations differ: r,
    2b and the pairs are those without the copies."""
    pols = list(X.mass_policies())
    rng = np.random.default_rng(0)
    P = 6
    lvl = np.linspace(0.01, 0.06, P)
    dn = (lvl[:, None] + rng.normal(0, 0.002, (P, N))) * CNT
    mass = (lvl[:, None] * 5 + rng.normal(0, 0.01, (P, N))) * W
    base = _runs(dn, mass, pols[:P])
    decisions = {n: (np.full((4, 2), i),) for i, n in enumerate(pols[:P])}
    dup = dict(base)
    for i in range(P, 2 * P):  # the second half decides as the first; its emulation differs by noise
        src = base[pols[i - P]]
        dup[pols[i]] = dataclasses.replace(src, name=pols[i], dnll=src.dnll + rng.normal(0, 0.01, N))
        decisions[pols[i]] = decisions[pols[i - P]]
    kept = X.dedupe(decisions)
    a0, b0, c0 = X.finding_mass(_setup(), base)
    a1, b1, c1 = X.finding_mass(_setup(), dup, kept)
    assert a1.data["r"] == pytest.approx(a0.data["r"]) and a1.data["ci95"] == pytest.approx(a0.data["ci95"])
    assert len(a1.data["duplicates"]) == P and len(a1.data["policies"]) == P
    assert b1.data["r_windows"] == pytest.approx(b0.data["r_windows"])
    assert sorted(c1.data["pairs"]) == sorted(c0.data["pairs"])
    a2 = X.finding_mass(_setup(), dup)[0]  # without the decisions, the copies count as policies
    assert len(a2.data["policies"]) == 2 * P


def test_row2c_two_pairs_sharing_a_policy_are_two_pairs() -> None:
    """Two distinct pairs whose policy without admission is the same (after duplicates are collapsed) are both
    counted: neither overwrites the other."""
    names = ["a", "b", "a2", "c"]  # pairs (a, b) and (a2, c); a2 decides as a, b and c differ
    rng = np.random.default_rng(1)
    dn = (np.array([0.02, 0.01, 0.02, 0.01])[:, None] + rng.normal(0, 0.001, (4, N))) * CNT
    mass = (np.array([0.3, 0.2, 0.3, 0.4])[:, None] + rng.normal(0, 0.005, (4, N))) * W
    runs = _runs(dn, mass, names)
    kept = {"a": "a", "b": "b", "a2": "a", "c": "c"}
    pairs = X.distinct_pairs([("a", "b"), ("a2", "c")], kept)
    assert pairs == [("a", "b"), ("a", "c")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(X, "admission_pairs", lambda pols: [("a", "b"), ("a2", "c")])
        row = X.finding_mass(_setup(), runs, kept)[2]
    assert len(row.data["pairs"]) == 2 and sum(row.data["counts"].values()) == 2
    assert {p["with_admission"] for p in row.data["pairs"].values()} == {"b", "c"}
    assert row.data["counts"][H] == 1 and row.data["counts"][D] == 1  # (a, b): less mass, less loss; (a, c): more mass, less loss
    assert row.ours.startswith("0 of 2 distinct pairs")


def test_distinct_pairs() -> None:
    kept = {"a": "a", "b": "b", "c": "a", "d": "b", "e": "e", "f": "e"}
    assert X.distinct_pairs([("a", "b"), ("c", "d"), ("e", "f")], kept) == [("a", "b")]


# --------------------------------------------------------------------------- row 2b: mass per input


N2B = 240  # windows: r across windows needs more of them than the other rows' statistics
STARTS_2B = stats.block_starts(N2B, 3)


def _per_input(kind: str, seed: int = 0) -> dict:
    """8 policies over N2B windows whose losses follow (`differs`) or do not follow (`holds`) the windows' mass,
    or follow it weakly (`neither`: r about R_SMALL)."""
    rng = np.random.default_rng(seed)
    P = 8
    base = np.linspace(0.05, 0.4, P)[:, None]
    u = rng.normal(0, 0.05, N2B)[None, :]  # the windows' own mass
    v = rng.normal(0, 0.01, N2B)[None, :]  # the windows' own loss
    eps = rng.normal(0, 0.001, (P, N2B))
    mass = (base + u + rng.normal(0, 0.002, (P, N2B))) * W
    if kind == "holds":  # across policies mass predicts loss; across windows it does not
        loss = 0.1 * base + v + eps
    elif kind == "differs":  # across windows the window with more mass loses more
        loss = 0.2 * u + eps
    else:  # r across windows about 0.3: cannot be told from the bound
        loss = 0.2 * u * 0.3 + rng.normal(0, 0.0095, (P, N2B))
    cnt, tok = np.full(N2B, CNT), np.full(N2B, W)
    return R.mass_per_input(STARTS_2B, (0.02 + loss) * CNT, mass, cnt, tok, 0)


def test_row2b_mass_per_input() -> None:
    """Per policy, r across the windows: holds when its interval lies below 0.3, differs above it."""
    d = _per_input("holds")
    assert d["verdict"] == H and d["counts"][H] == 8
    assert all(-0.3 < lo < 0 < hi < 0.3 for lo, hi in d["ci95_windows"])
    d = _per_input("differs")
    assert d["verdict"] == D and min(d["r_windows"]) > 0.9
    d = _per_input("neither")
    assert d["counts"][INC] >= 4 and d["verdict"] != H


# --------------------------------------------------------------------------- row 2c: admission pairs


def _pair(d_mass: float, d_loss: float, seed: int) -> tuple[np.ndarray, ...]:
    """(NLL differences, mass) per window without and with admission; with admission the mass moves by `d_mass`
    and the loss by `d_loss` per token (0: zero-mean noise only)."""
    rng = np.random.default_rng(seed)
    dn_a = (0.02 + _noise(rng, 0.005)) * CNT
    m_a = (0.3 + _noise(rng, 0.01)) * W
    dn_b = dn_a + (d_loss + _noise(rng, 0.001, centred=True)) * CNT
    m_b = m_a + (d_mass + _noise(rng, 0.002, centred=True)) * W
    return dn_a, m_a, dn_b, m_b


def _pairs(**spec: tuple[float, float]) -> dict:
    ev = {name: _pair(dm, dl, i) for i, (name, (dm, dl)) in enumerate(spec.items())}
    return R.admission_pairs(STARTS, ev, CNT * ONES, W * ONES, 0)


def test_row2c_admission_pairs() -> None:
    d = _pairs(lower=(-0.05, -0.01), higher=(0.05, 0.01))  # the loss follows the mass both ways
    assert d["verdict"] == H and d["counts"][H] == 2
    d = _pairs(lower=(-0.05, -0.01), wrong=(-0.05, 0.01))  # less mass, more loss
    assert d["verdict"] == D and d["counts"] == {H: 1, D: 1, INC: 0, U: 0}
    assert d["lower_mass_higher_loss"] == ["wrong"]
    d = _pairs(flat=(-0.05, 0.0))
    assert d["verdict"] == INC and d["pairs"]["flat"]["verdict"] == INC
    # a pair whose mass change interval contains 0 is not counted, whatever its loss does
    d = _pairs(lower=(-0.05, -0.01), nomass=(0.0, 0.01))
    assert d["verdict"] == H and d["pairs"]["nomass"]["verdict"] == U and d["lower_mass_higher_loss"] == []
    assert d["counts"] == {H: 1, D: 0, INC: 0, U: 1}
    assert _pairs(nomass=(0.0, 0.01))["verdict"] == U


# --------------------------------------------------------------------------- rows 3 and 4a: differences


def _diff(rid: str, effect: float, seed: int = 0, testable: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    b = (0.02 + _noise(rng, 0.005)) * CNT
    a = b + (effect + _noise(rng, 0.002, centred=True)) * CNT
    return R.difference(rid, STARTS, a, b, CNT * ONES, 0, testable=testable)


def test_row3_band() -> None:
    """Heavy band minus light band at equal mass: the paper says > 0."""
    assert _diff("3", 0.01)["verdict"] == H
    assert _diff("3", -0.01)["verdict"] == D
    assert _diff("3", 0.0)["verdict"] == INC
    assert _diff("3", 0.01, testable=False)["verdict"] == U  # masses not matched


def test_row5q_and_5s_perplexity() -> None:
    """5q: Quality-First minus the rule inside F5's -0.8..-0.5 points; 5s: Speed-First minus Quality-First < 0."""
    d = _diff("5q", -0.0065)
    assert d["verdict"] == H and -0.8 <= d["ci95"][0] and d["ci95"][1] <= -0.5
    assert _diff("5q", -0.02)["verdict"] == D  # lower, but beyond F5's range
    assert _diff("5q", 0.01)["verdict"] == D
    assert _diff("5s", -0.01)["verdict"] == H
    assert _diff("5s", 0.01)["verdict"] == D  # a significant increase
    assert _diff("5s", 0.0)["verdict"] == INC


def test_row4a_admission_lowers_perplexity() -> None:
    """Quality-First minus the 0.15 rule: the paper says admission lowers perplexity (< 0)."""
    d = _diff("4a", -0.01)
    assert d["verdict"] == H and d["ci95"][1] < 0
    assert _diff("4a", 0.01)["verdict"] == D
    assert _diff("4a", 0.0)["verdict"] == INC


# --------------------------------------------------------------------------- row 4b: topic changes


def _topic(gap_e: float, gap_l: float, seed: int = 0, S: int = 40) -> dict:
    rng = np.random.default_rng(seed)
    n_e, n_l = np.full(S, 64.0), np.full(S, 256.0)
    rule_e = (0.05 + _noise(rng, 0.005, S)) * n_e
    rule_l = (0.03 + _noise(rng, 0.005, S)) * n_l
    qf_e = rule_e + (gap_e + _noise(rng, 0.001, S, centred=True)) * n_e
    qf_l = rule_l + (gap_l + _noise(rng, 0.001, S, centred=True)) * n_l
    return R.topic(stats.block_starts(S, 2), [rule_e, rule_l, qf_e, qf_l, n_e, n_l], 0)


def test_row4b_topic() -> None:
    d = _topic(-0.02, 0.0)  # admission helps right after a switch, and more than later
    assert d["verdict"] == H and d["claim_verdicts"] == [H, H]
    assert _topic(0.02, 0.0)["verdict"] == D  # admission hurts after a switch
    d = _topic(0.01, 0.03)  # hurts less early than later: the gap falls, but admission does not help
    assert d["verdict"] == D and d["claim_verdicts"] == [D, H]
    d = _topic(0.0, 0.0)
    assert d["verdict"] == INC and d["claim_verdicts"] == [INC, INC]


def test_topic_segments_and_their_blocks() -> None:
    from runtime.tools.findings.topic import segment_blocks, segment_sums

    switches = [0, 100, 200, 300]  # 4 segments of 100 tokens; windows of 50 tokens (49 scored)
    d = np.ones((8, 49))
    sums = segment_sums(switches, d, 2 * d, 10)
    assert [len(x) for x in sums] == [3] * 6  # segment 0 has no switch before it
    n_e, n_l = sums[4], sums[5]
    # token 100 starts window 2 and is not scored: 9 early tokens; 2 windows of 49 scored tokens per segment
    assert np.all(n_e == 9) and np.all(n_e + n_l == [98, 98, 98])
    assert np.allclose(sums[2], 2 * sums[0])
    rng = np.random.default_rng(0)
    S = 200
    lvl = np.repeat(rng.normal(0, 0.02, S // 8), 8)  # gaps that persist over 8 segments
    e, la = np.full(S, 64.0), np.full(S, 256.0)
    starts, info = segment_blocks([np.zeros(S), np.zeros(S), (lvl + rng.normal(0, 0.001, S)) * e,
                                   (lvl + rng.normal(0, 0.001, S)) * la, e, la], 0)
    assert info["block"] >= 4 and len(starts) == info["blocks"] == len(stats.block_starts(S, info["block"]))


# --------------------------------------------------------------------------- row 5: speed


def _speed(ratio: float, noise: float = 0.01, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    pol = rng.uniform(0.9, 1.1, N)
    return R.speed(STARTS, pol * ratio * (1 + _noise(rng, noise)), pol, 0)


def test_row5_speed() -> None:
    """Holds only when the interval lies inside the paper's 2.5-3.0x."""
    d = _speed(2.75)
    assert d["verdict"] == H and 2.5 <= d["ci95"][0] and d["ci95"][1] <= 3.0
    assert _speed(1.5)["verdict"] == D  # faster, but excludes the paper's range
    assert _speed(3.5)["verdict"] == D
    assert _speed(0.5)["verdict"] == D  # slower
    d = _speed(2.5, noise=0.1)  # overlaps the range's edge
    assert d["ci95"][0] < 2.5 < d["ci95"][1] and d["verdict"] == INC
    assert _speed(1.0, noise=0.1)["verdict"] == INC


# --------------------------------------------------------------------------- every direction, flipped


HOLDS_CASES: dict[str, Callable[[], dict]] = {
    "1": lambda: _heavy(0.055, 0.0035, 0.085, 0.075),
    "2a": lambda: _across(0.92, 10),
    "2b": lambda: _per_input("holds"),
    "2c": lambda: _pairs(lower=(-0.05, -0.01), higher=(0.05, 0.01)),
    "3": lambda: _diff("3", 0.01),
    "4a": lambda: _diff("4a", -0.01),
    "4b": lambda: _topic(-0.02, 0.0),
    "5": lambda: _speed(2.75),
    "5q": lambda: _diff("5q", -0.0065),
    "5s": lambda: _diff("5s", -0.01),
    "4a-mem": lambda: _diff("4a-mem", -0.01),
    "5q-mem": lambda: _diff("5q-mem", -0.0065),
}


@pytest.mark.parametrize(("rid", "i"), [(rid, i) for rid in HOLDS_CASES for i in range(len(RULES[rid].claims))])
def test_flipped_direction_changes_the_holds_case(rid: str, i: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each claim's direction, flipped in the rule table, turns its row's holds case into differs."""
    assert HOLDS_CASES[rid]()["verdict"] == H
    rule = RULES[rid]
    claims = list(rule.claims)
    claims[i] = dataclasses.replace(claims[i], direction=-claims[i].direction)
    monkeypatch.setitem(RULES, rid, dataclasses.replace(rule, claims=tuple(claims)))
    assert HOLDS_CASES[rid]()["verdict"] == D


# --------------------------------------------------------------------------- admission against C/k


def _point(ck: float, m_with: float, m_without: float, hit_with: float = 0.5, hit_without: float = 0.5) -> dict:
    pols = {}
    for a, b in X_ADM.PAIRS:
        pols[a] = {"mass_per_token": m_with, "hit_rate": hit_with, "substituted_share": 0.1,
                   "admissions_per_token_layer": 0.2}
        pols[b] = {"mass_per_token": m_without, "hit_rate": hit_without, "substituted_share": 0.1,
                   "admissions_per_token_layer": 0.0}
    return {"c_over_k": ck, "slots": int(ck * 4), **pols}


def test_admission_starts_helping() -> None:
    """The smallest C/k from which admission lowers the mass at every larger C/k; None when it does not at the
    largest."""
    pair = X_ADM.PAIRS[0]
    pts = [_point(1, 0.9, 0.6), _point(2, 0.7, 0.6), _point(4, 0.5, 0.6), _point(8, 0.4, 0.5)]
    assert X_ADM.starts_helping(pts, pair) == 4
    assert X_ADM.starts_helping(pts[:2], pair) is None
    assert X_ADM.starts_helping([_point(2, 0.5, 0.6), _point(4, 0.7, 0.6), _point(8, 0.4, 0.5)], pair) == 8
    e = X_ADM.effects(pts)
    assert e[0][f"{pair[0]} - {pair[1]}"]["mass_per_token"] == pytest.approx(0.3)


def test_admission_regret_follows_the_kernels_admissions() -> None:
    """`regret` replays the kernel layer by layer and follows every slot from the warm start through its logs: each
    hit must find its expert where the logs put it (else it raises), the admissions counted are the simulator's,
    and a policy without admission admits nothing."""
    from runtime.backends.simulate import replay
    from runtime.formats.trace.synthetic import synthetic_trace

    tr = synthetic_trace(3000, 2, 32, 4, seed=5)
    caps = np.full(tr.L, 8)
    init = [np.arange(8) for _ in range(tr.L)]
    for pol in ("quality-first", "speed-first"):
        r = X_ADM.regret(tr, pol, caps, init)
        sim = replay(tr, X.paper_policy(pol), caps, init).cache.counter_totals()["admissions"]
        assert r["admissions"] == sim > 20
        assert 0 < r["regret_share"] < 1 and 0 < r["unused_share"] < 1
        assert r["regret_per_token_layer"] == pytest.approx(r["regret_share"] * sim / (tr.T * tr.L))
    assert X_ADM.regret(tr, "rule-0.15", caps, init)["admissions"] == 0


def test_admission_command_checks_its_flags_first(tmp_path) -> None:  # noqa: ANN001
    from runtime.core.errors import InputError

    with pytest.raises(InputError, match="--max-tokens = 100 must be >= 512"):
        X_ADM.main(["--model", "demo", "--max-tokens", "100"])
    with pytest.raises(InputError, match="--ck"):
        X_ADM.main(["--model", "demo", "--ck", "0"])
    with pytest.raises(InputError, match=f"--model {tmp_path}: not a tiny model's name"):
        X_ADM.main(["--model", str(tmp_path)])


def test_admission_curve_on_a_real_trace(tmp_path) -> None:  # noqa: ANN001
    """Mixtral's real trace (skipped without ../shared): the curve's slots follow C/k, the four policies are
    replayed at each, and the plot is written."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mixtral-8x7b-humaneval0.npz"
    if not path.is_file():
        pytest.skip(f"{path} absent (a checkout without ../shared)")
    c = X_ADM.trace_curve(path, grid=(1.0, 2.0, 3.0, 4.0))
    assert c["experts"] == 8 and c["top_k"] == 2 and [p["slots"] for p in c["points"]] == [2, 4, 6]  # C < E
    for p in c["points"]:
        for a, b in X_ADM.PAIRS:
            assert p[b]["admissions_per_token_layer"] == 0 and p[a]["admissions_per_token_layer"] > 0
            assert p[a]["regret"]["admissions"] == round(p[a]["admissions_per_token_layer"] * c["tokens"] * 32)
    mp = [{"c_over_k": 2.0, "qf_minus_rule": {"point": 0.1, "ci95": [0.0, 0.2]},
           "sf_minus_fc": {"point": 0.3, "ci95": [0.1, 0.5]}}]
    X_ADM.plot({"mixtral": c["points"]}, mp, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_r_from_moments_is_the_r_of_the_units() -> None:
    """Row 2b's r from block sums equals Pearson r of the units (and of any resample of whole blocks)."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=N), rng.normal(size=N)
    y += 0.5 * x
    b = [stats.to_blocks(v, STARTS) for v in (x, y, x * x, y * y, x * y, ONES)]
    assert float(R.r_from_moments(*b)) == pytest.approx(float(stats.pearson(x, y)), abs=1e-12)
    pick = np.array([0, 0, 3, 5])  # a resample of blocks: the units of blocks 0, 0, 3 and 5
    units = np.concatenate([np.arange(STARTS[i], STARTS[i] + 3) for i in pick])
    got = float(R.r_from_moments(*[v[pick] for v in b]))
    assert got == pytest.approx(float(stats.pearson(x[units], y[units])), abs=1e-12)
