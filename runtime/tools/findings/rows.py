"""Each finding's statistics and verdict from its evidence: plain per-unit arrays (per evaluation window, or per
topic segment), block sums over `starts`, intervals from `stats` and the verdict from `rules.RULES`.

Nothing here runs a model: `experiments` gathers the arrays and writes the rows' text; tests build the arrays
with effects that are large by construction and check every verdict both ways.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from runtime.tools.findings import stats
from runtime.tools.findings.rules import (
    DIFFERS,
    HOLDS,
    INCONCLUSIVE,
    RULES,
    UNTESTABLE,
    Claim,
    verdict,
)

Stat = Callable[..., np.ndarray]


def paired(samples: Sequence[np.ndarray], fns: Sequence[Stat], seed: int) -> list[dict[str, Any]]:
    """Point value, 95% interval and method of each statistic of the same block sums (paired resamples)."""
    out = []
    for fn in fns:
        lo, hi, method = stats.block_ci(samples, fn, seed)
        out.append({"point": float(fn(*samples)), "ci95": [lo, hi], "method": method})
    return out


def heavy(starts: np.ndarray, dn_sa: np.ndarray, dn_rule: np.ndarray, calls_sa: np.ndarray,
          calls_rule: np.ndarray, calls: np.ndarray, cnt: np.ndarray, seed: int) -> dict[str, Any]:
    """Finding 1 from per-window NLL-difference sums, substituted (or dropped) calls, all calls and scored
    tokens [n] of substitute-all and the 0.15 rule: (1) the share of substitute-all's perplexity change the rule
    removes, (2) the share of its substituted calls the rule spares (below 0 when the rule substitutes more);
    the loss and call differences are reported with their intervals, not tested."""
    b = [stats.to_blocks(x, starts) for x in (dn_sa, dn_rule, calls_sa, calls_rule, calls, cnt)]

    def d_loss(a, r, ca, cr, c, t, axis=-1):  # noqa: ANN001, ANN202
        return stats.diff_stat(a, r, t, axis)

    def d_calls(a, r, ca, cr, c, t, axis=-1):  # noqa: ANN001, ANN202
        return (ca.sum(axis) - cr.sum(axis)) / c.sum(axis) * 100

    def loss_removed(a, r, ca, cr, c, t, axis=-1):  # noqa: ANN001, ANN202
        with np.errstate(invalid="ignore", divide="ignore"):
            return (1 - stats.change_stat(r, t, axis) / stats.change_stat(a, t, axis)) * 100

    def calls_spared(a, r, ca, cr, c, t, axis=-1):  # noqa: ANN001, ANN202
        with np.errstate(invalid="ignore", divide="ignore"):
            return (1 - cr.sum(axis) / ca.sum(axis)) * 100

    res = paired(b, (loss_removed, calls_spared, d_loss, d_calls), seed)
    v, vs = RULES["1"].decide([r["ci95"] for r in res[:2]])
    return {"loss_removed": res[0], "calls_spared": res[1], "loss_difference": res[2], "calls_difference": res[3],
            "verdict": v, "claim_verdicts": vs, "method": "/".join(sorted({r["method"] for r in res}))}


def mass_across_policies(starts: np.ndarray, dn: np.ndarray, mass: np.ndarray, cnt: np.ndarray,
                         tokens: np.ndarray, seed: int) -> dict[str, Any]:
    """Finding 2a from per-window NLL-difference sums and substituted mass [P, n] of P distinct policies,
    scored and evaluated tokens per window [n]: r across the policies, its one interval the block bootstrap's
    over the windows (the policies are fixed; the text is the sample)."""
    P = dn.shape[0]
    samples = (*stats.to_blocks(dn, starts), *stats.to_blocks(mass, starts), stats.to_blocks(cnt, starts),
               stats.to_blocks(tokens, starts))

    def across(*arrs: np.ndarray, axis: int = -1) -> np.ndarray:
        d, m, c, t = np.stack(arrs[:P]), np.stack(arrs[P:2 * P]), arrs[2 * P], arrs[2 * P + 1]
        change = stats.pct_change(d.sum(axis), c.sum(axis))  # [P, ...]
        return stats.pearson(np.moveaxis(m.sum(axis) / t.sum(axis), 0, -1), np.moveaxis(change, 0, -1))

    change = stats.pct_change(dn.sum(1), cnt.sum())  # [P]
    mass_tok = mass.sum(1) / tokens.sum()  # [P]
    r = float(stats.pearson(mass_tok, change))
    lo, hi, method = stats.block_ci(samples, across, seed)
    v, _ = RULES["2a"].decide([(lo, hi)])
    return {"r": r, "ci95": [lo, hi], "method": method, "mass_per_token": mass_tok.tolist(),
            "ppl_change_pct": change.tolist(), "verdict": v}


def mass_per_input(starts: np.ndarray, dn: np.ndarray, mass: np.ndarray, cnt: np.ndarray, tokens: np.ndarray,
                   seed: int) -> dict[str, Any]:
    """Finding 2b from the same arrays as 2a: per policy, Pearson r of mass per token and perplexity change across
    the windows (does the window with more mass lose more?), each with its block-bootstrap interval; the row holds
    when every policy's interval lies below `rules.R_SMALL`."""
    change = stats.pct_change(dn, cnt)  # [P, n]
    m = mass / tokens  # [P, n]
    n = dn.shape[1]
    r_win = stats.pearson(m, change)  # [P]
    cis, methods = [], set()
    for p in range(dn.shape[0]):
        x, y = m[p] - m[p].mean(), change[p] - change[p].mean()  # r is shift-invariant; centring keeps sums exact
        samples = [stats.to_blocks(v, starts) for v in (x, y, x * x, y * y, x * y, np.ones(n))]
        lo, hi, method = stats.block_ci(samples, r_from_moments, seed)
        cis.append([lo, hi])
        methods.add(method)
    claims = [RULES["2b"].claims[0]] * len(cis)
    v, vs = RULES["2b"].decide(cis, claims) if cis else ("not testable here", [])
    counts = {k: vs.count(k) for k in (HOLDS, DIFFERS, INCONCLUSIVE, UNTESTABLE)}
    return {"r_windows": r_win.tolist(), "ci95_windows": cis, "claim_verdicts": vs, "counts": counts,
            "r_median": float(np.nanmedian(r_win)) if len(r_win) else math.nan, "method": "/".join(sorted(methods)), "verdict": v}


def admission_pairs(starts: np.ndarray, pairs: dict[str, tuple[np.ndarray, ...]], cnt: np.ndarray,
                    tokens: np.ndarray, seed: int) -> dict[str, Any]:
    """Row 2c (the page's own check) from per-window (NLL-difference sums, mass) without and with admission [n]
    per distinct pair, keyed by a name per pair (`pair_key`): per pair whose mass-change interval excludes 0, the
    loss change signed by the mass change."""
    claim = RULES["2c"].claims[0]
    c_b, t_b = stats.to_blocks(cnt, starts), stats.to_blocks(tokens, starts)
    out: dict[str, Any] = {}
    tested_cis, claims = [], []
    for name, (dn_a, m_a, dn_b, m_b) in pairs.items():
        da, db = stats.to_blocks(dn_a, starts), stats.to_blocks(dn_b, starts)
        ma, mb = stats.to_blocks(m_a, starts), stats.to_blocks(m_b, starts)
        loss = paired((db, da, c_b), (stats.diff_stat,), seed)[0]
        dmass = paired((mb, ma, t_b), (lambda x, y, t, axis=-1: (x.sum(axis) - y.sum(axis)) / t.sum(axis),),
                       seed)[0]
        mlo, mhi = dmass["ci95"]
        llo, lhi = loss["ci95"]
        if mlo > 0 or mhi < 0:
            sign = 1.0 if mlo > 0 else -1.0
            signed = sorted((sign * llo, sign * lhi))
            tested_cis.append(signed)
            claims.append(claim)
            v = verdict(signed, claim)
        else:
            v = UNTESTABLE
        out[name] = {"loss_change_points": loss["point"], "loss_ci95": [llo, lhi], "mass_change_per_token":
                     dmass["point"], "mass_ci95": [mlo, mhi], "verdict": v,
                     "methods": sorted({loss["method"], dmass["method"]}),
                     "lower_mass_higher_loss": bool(mhi < 0 and llo > 0)}
    row_v, _ = RULES["2c"].decide(tested_cis, claims) if claims else (UNTESTABLE, [])
    counts = {k: sum(p["verdict"] == k for p in out.values()) for k in (HOLDS, DIFFERS, INCONCLUSIVE, UNTESTABLE)}
    methods = sorted({m for p in out.values() for m in p["methods"]})
    return {"pairs": out, "verdict": row_v, "counts": counts, "method": "/".join(methods),
            "lower_mass_higher_loss": [n for n, p in out.items() if p["lower_mass_higher_loss"]]}


def r_from_moments(sx: np.ndarray, sy: np.ndarray, sxx: np.ndarray, syy: np.ndarray, sxy: np.ndarray,
                   n: np.ndarray, axis: int = -1) -> np.ndarray:
    """Pearson r of the units whose block sums of x, y, x^2, y^2, xy and count are given: the r of the
    concatenated blocks, so that a resample of blocks is a resample of their units."""
    N = n.sum(axis)
    Sx, Sy = sx.sum(axis), sy.sum(axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sxy.sum(axis) - Sx * Sy / N) / np.sqrt((sxx.sum(axis) - Sx * Sx / N) * (syy.sum(axis) - Sy * Sy / N))


def pair_key(without: str, with_: str) -> str:
    """The one name of a with/without-admission pair: two pairs may share their policy without admission."""
    return f"{without} vs {with_}"


def difference(rid: str, starts: np.ndarray, dn_a: np.ndarray, dn_b: np.ndarray, cnt: np.ndarray,
               seed: int, testable: bool = True) -> dict[str, Any]:
    """Rows 3 and 4a: perplexity change of `a` minus `b` (points) from per-window NLL-difference sums [n]."""
    r = paired([stats.to_blocks(x, starts) for x in (dn_a, dn_b, cnt)], (stats.diff_stat,), seed)[0]
    v = RULES[rid].decide([r["ci95"]])[0] if testable else UNTESTABLE
    return {"difference": r["point"], "ci95": r["ci95"], "method": r["method"], "verdict": v}


TOPIC_KEYS = ("rule_e", "rule_l", "qf_e", "qf_l", "n_e", "n_l")


def topic_stats(*a: np.ndarray, axis: int = -1) -> dict[str, np.ndarray]:
    """Row 4b's statistics from per-unit sums in TOPIC_KEYS' order (NLL differences early / later after a
    switch for the rule and Quality-First, and the token counts)."""
    g = dict(zip(TOPIC_KEYS, (x.sum(axis) for x in a), strict=True))
    out = {f"{p}_{w}": stats.pct_change(g[f"{p}_{w}"], g[f"n_{w}"]) for p in ("rule", "qf") for w in ("e", "l")}
    out["gap_e"] = out["qf_e"] - out["rule_e"]
    out["gap_l"] = out["qf_l"] - out["rule_l"]
    out["dd"] = out["gap_e"] - out["gap_l"]
    return out


def topic(starts: np.ndarray, sums: Sequence[np.ndarray], seed: int, rid: str = "4b") -> dict[str, Any]:
    """Finding 4b from per-segment sums [S] (TOPIC_KEYS), resampled in blocks of consecutive segments: admission
    helps right after a switch (gap_e < 0) and more than later (dd < 0)."""
    b = [stats.to_blocks(x, starts) for x in sums]
    point = {k: float(v) for k, v in topic_stats(*b).items()}
    ci, methods = {}, {}
    for k in ("gap_e", "gap_l", "dd"):
        lo, hi, methods[k] = stats.block_ci(b, lambda *a, axis=-1, k=k: topic_stats(*a, axis=axis)[k], seed)
        ci[k] = [lo, hi]
    v, vs = RULES[rid].decide([ci["gap_e"], ci["dd"]])
    return {**point, **{f"{k}_ci95": c for k, c in ci.items()}, "methods": methods, "verdict": v,
            "claim_verdicts": vs}


def speed(starts: np.ndarray, fetch_all: np.ndarray, policy: np.ndarray, seed: int) -> dict[str, Any]:
    """One host and policy of finding 5 from per-window simulated seconds [n]: fetch-every-miss's over the
    policy's."""
    def ratio(f: np.ndarray, p: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.sum(f, axis) / np.sum(p, axis)

    r = paired((stats.to_blocks(fetch_all, starts), stats.to_blocks(policy, starts)), (ratio,), seed)[0]
    claim: Claim = RULES["5"].claims[0]
    return {"speed_ratio": r["point"], "ci95": r["ci95"], "method": r["method"], "verdict": verdict(r["ci95"], claim)}
