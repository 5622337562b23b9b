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
    tokens [n] of substitute-all and the 0.15 rule."""
    b = [stats.to_blocks(x, starts) for x in (dn_sa, dn_rule, calls_sa, calls_rule, calls, cnt)]

    def d_loss(a, r, ca, cr, c, t, axis=-1):  # noqa: ANN001, ANN202
        return stats.diff_stat(a, r, t, axis)

    def d_calls(a, r, ca, cr, c, t, axis=-1):  # noqa: ANN001, ANN202
        return (ca.sum(axis) - cr.sum(axis)) / c.sum(axis) * 100

    def disproportion(a, r, ca, cr, c, t, axis=-1):  # noqa: ANN001, ANN202
        ch_a, ch_r = stats.change_stat(a, t, axis), stats.change_stat(r, t, axis)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (cr.sum(axis) / ca.sum(axis) - ch_r / ch_a) * 100

    res = paired(b, (d_loss, d_calls, disproportion), seed)
    v, vs = RULES["1"].decide([r["ci95"] for r in res])
    return {"loss_difference": res[0], "calls_difference": res[1], "disproportion": res[2], "verdict": v,
            "claim_verdicts": vs, "method": "/".join(sorted({r["method"] for r in res}))}


def mass_across_policies(starts: np.ndarray, dn: np.ndarray, mass: np.ndarray, cnt: np.ndarray,
                         tokens: np.ndarray, seed: int) -> dict[str, Any]:
    """Finding 2a from per-window NLL-difference sums and substituted mass [P, n] of P distinct policies,
    scored and evaluated tokens per window [n]: r across the policies; the interval is the union of Fisher's
    (over the policies) and the block bootstrap's (over the windows)."""
    from scipy.stats import pearsonr

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
    blo, bhi, method = stats.block_ci(samples, across, seed)
    if P >= 4 and np.ptp(mass_tok) > 0 and np.ptp(change) > 0:
        f = pearsonr(mass_tok, change).confidence_interval(0.95)
        flo, fhi = float(f.low), float(f.high)
    else:
        flo = fhi = math.nan
    lo, hi = (min(blo, flo), max(bhi, fhi)) if math.isfinite(flo) else (blo, bhi)
    v, _ = RULES["2a"].decide([(lo, hi)])
    return {"r": r, "ci95": [lo, hi], "ci95_fisher": [flo, fhi], "ci95_block": [blo, bhi], "method": method,
            "mass_per_token": mass_tok.tolist(), "ppl_change_pct": change.tolist(), "verdict": v}


def mass_per_input(starts: np.ndarray, dn: np.ndarray, mass: np.ndarray, cnt: np.ndarray, tokens: np.ndarray,
                   seed: int) -> dict[str, Any]:
    """Finding 2b from the same arrays as 2a, at one granularity (the window) on both sides: r across the
    policies on each window (does the policy with more mass lose more on this input?) against r across the
    windows for each policy (does the input with more mass lose more?), each averaged."""
    change = stats.pct_change(dn, cnt)  # [P, n]
    m = mass / tokens  # [P, n]
    r_pol = stats.pearson(m.T, change.T)  # [n]: across the policies, per window

    def stat(idx: np.ndarray) -> float:
        return float(np.nanmean(r_pol[idx]) - np.nanmean(stats.pearson(m[:, idx], change[:, idx])))

    n = dn.shape[1]
    r_win = stats.pearson(m, change)  # [P]: across the windows, per policy
    lo, hi, method = stats.unit_ci(n, starts, stat, seed)
    v, _ = RULES["2b"].decide([(lo, hi)])
    return {"r_across_policies_per_window": float(np.nanmean(r_pol)),
            "r_across_windows_per_policy": float(np.nanmean(r_win)), "difference": stat(np.arange(n)),
            "ci95": [lo, hi], "method": method, "r_windows": r_win.tolist(), "verdict": v}


def admission_pairs(starts: np.ndarray, pairs: dict[str, tuple[np.ndarray, ...]], cnt: np.ndarray,
                    tokens: np.ndarray, seed: int) -> dict[str, Any]:
    """Finding 2c from per-window (NLL-difference sums, mass) without and with admission [n] per distinct pair:
    per pair whose mass-change interval excludes 0, the loss change signed by the mass change."""
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


def topic(starts: np.ndarray, sums: Sequence[np.ndarray], seed: int) -> dict[str, Any]:
    """Finding 4b from per-segment sums [S] (TOPIC_KEYS), resampled in blocks of consecutive segments: admission
    helps right after a switch (gap_e < 0) and more than later (dd < 0)."""
    b = [stats.to_blocks(x, starts) for x in sums]
    point = {k: float(v) for k, v in topic_stats(*b).items()}
    ci, methods = {}, {}
    for k in ("gap_e", "gap_l", "dd"):
        lo, hi, methods[k] = stats.block_ci(b, lambda *a, axis=-1, k=k: topic_stats(*a, axis=axis)[k], seed)
        ci[k] = [lo, hi]
    v, vs = RULES["4b"].decide([ci["gap_e"], ci["dd"]])
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
