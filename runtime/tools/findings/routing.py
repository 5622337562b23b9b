"""Row 7, the page's own finding: routing toward residents against the 0.15 rule's substitution, at equal device
memory and equal miss rate.

Neither routing family copies in the background, so at the column's device memory each holds the rule's C slots
(checked with `capacities_for_budget`: `memory.column_budget`). The target is the 0.15 rule's fetched-miss rate
at C on the exact model's routing (the simulator, the column's warm start): fetches / calls, the synchronous
transfers it pays for. Each family's strength is calibrated in the simulator on the same routing (its router
scores recorded) until its miss rate (misses of the routed selection, all fetched) is the rule's:

- Cache-Prior (`route = cache-prior`, the preset's J = 1): `route_lambda` by bisection;
- CACHE_ROUTE (`route = cache-route`, the preset's J = 1, alpha = 1): the window M (an integer in [k, E]) by
  bisection, the M whose rate is nearest the target.

Miss rate falls as lambda or M grows (more of the selection is drawn from residents); every point tried is kept.
Both calibrated policies are then emulated at the column's device memory, and each one's perplexity change minus
the rule's is the claim (points, the page's paired block bootstrap). A family whose emulated miss rate is more
than MATCH (relative) from the rule's emulated fetched-miss rate is not at equal miss rate: its claim is not
testable here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from runtime.core.policy import PRESETS, PolicyConfig
from runtime.tools.findings import rows as R
from runtime.tools.findings.experiments import (
    PolicyRun,
    Row,
    Setup,
    caps_and_warm,
    emulate_policies,
    exact_trace,
    policy_ci,
    sample_text,
)
from runtime.tools.findings.rules import RULES
from runtime.tools.findings.stats import fmt_ci

FAMILIES = ("cache-prior", "cache-route")
MATCH = 0.10  # equal miss rate: within 10% (relative) of the rule's, as row 3's masses
LAMBDA_MAX = 64.0  # Cache-Prior's bias searched up to 64 D
STEPS = 20  # bisection steps for lambda


def miss_rate(counters: dict[str, float]) -> float:
    """Fetched misses per expert call: misses of the selection served by a synchronous fetch."""
    return float(counters["fetches"]) / max(float(counters["calls"]), 1.0)


def calibrate(rate: Callable[[float], float], lo: float, hi: float, target: float, integer: bool,
              steps: int = STEPS) -> dict[str, Any]:
    """The strength x in [lo, hi] whose rate(x) is nearest `target`, rate falling with x: bisection (on integers
    when `integer`), hi doubled first (up to `LAMBDA_MAX`) while its rate is above the target. Every point tried
    is returned (`tried`: [x, rate])."""
    tried: dict[float, float] = {}

    def f(x: float) -> float:
        if x not in tried:
            tried[x] = rate(x)
        return tried[x]

    if not integer:
        while f(hi) > target and hi < LAMBDA_MAX:
            hi = min(hi * 2, LAMBDA_MAX)
    if f(lo) > target and f(hi) <= target:
        a, b = lo, hi  # f(a) > target >= f(b)
        for _ in range(steps):
            if (integer and b - a <= 1) or (not integer and b - a <= 1e-6):
                break
            mid = (a + b) // 2 if integer else 0.5 * (a + b)
            a, b = (mid, b) if f(mid) > target else (a, mid)
    best = min(tried, key=lambda x: (abs(tried[x] - target), x))
    return {"strength": best, "rate": tried[best], "target": target,
            "reached": min(tried.values()) <= target <= max(tried.values()),
            "tried": sorted([x, r] for x, r in tried.items())}


def family_policy(family: str, strength: float) -> PolicyConfig:
    """The preset of `family` at a calibrated strength (Cache-Prior's lambda, CACHE_ROUTE's window M)."""
    if family == "cache-prior":
        return dataclasses.replace(PRESETS[family], route_lambda=float(strength))
    return dataclasses.replace(PRESETS[family], route_window=int(strength))


def calibrated(s: Setup) -> dict[str, Any]:
    """The rule's fetched-miss rate on the exact routing at the column's C and each family's calibration."""
    from runtime.backends.simulate import replay

    trace, calib_ids, _ = exact_trace(s, s.eval_text)
    caps, init = caps_and_warm(trace, calib_ids, s.capacity_fraction)

    def sim(pol: PolicyConfig) -> float:
        return miss_rate(replay(trace, pol, caps, init).cache.counter_totals())

    target = sim(PRESETS["rule-0.15"])
    out: dict[str, Any] = {"target": target, "slots": int(caps[0]),
                           "presets": {f: sim(PRESETS[f]) for f in FAMILIES},
                           "fetch_every_miss": sim(PRESETS["fetch-every-miss"])}
    out["cache-prior"] = calibrate(lambda x: sim(family_policy("cache-prior", x)), 0.0, 1.0, target, False)
    out["cache-route"] = calibrate(lambda x: sim(family_policy("cache-route", x)), trace.k, trace.E, target, True)
    return out


def finding_routing(s: Setup, main: dict[str, PolicyRun], budget_gib: float, slots: int) -> Row:
    """Row 7 at the column's device memory `budget_gib` (the rule's `slots` per layer): calibration, emulation of
    the calibrated families at that memory, and `routing_row`."""
    cal = calibrated(s)
    pols = {f: family_policy(f, cal[f]["strength"]) for f in FAMILIES}
    runs = emulate_policies(s, pols, s.eval_text, budget=dict.fromkeys(FAMILIES, budget_gib))
    return routing_row(s, main["rule-0.15"], runs, cal, budget_gib, slots)


def routing_row(s: Setup, rule: PolicyRun, runs: dict[str, PolicyRun], cal: dict[str, Any], budget_gib: float,
                slots: int) -> Row:
    """Row 7 from the rule's run, the calibrated families' runs (each at `slots` per layer) and their calibration
    (`calibrated`): per family its perplexity change minus the rule's, testable where its emulated miss rate is
    within MATCH of the rule's."""
    for f, r in runs.items():
        if int(r.result.capacity[0]) != slots:
            raise RuntimeError(f"findings: {f} got {r.result.capacity} slots at the column's memory, not {slots}")
    pols = {f: family_policy(f, cal[f]["strength"]) for f in FAMILIES}
    r_rule = miss_rate(rule.result.counters)
    cnt = np.full(len(rule.dnll), rule.count)
    cis, data, parts = [], {}, []
    for f in FAMILIES:
        run = runs[f]
        rate = miss_rate(run.result.counters)
        equal = abs(rate - r_rule) <= MATCH * r_rule
        d = R.difference("7", s.starts, run.dnll, rule.dnll, cnt, s.seed, testable=False)
        cis.append(d["ci95"] if equal else [math.nan, math.nan])
        c = run.result.counters
        data[f] = {"policy": pols[f].label(), "strength": cal[f]["strength"], "calibration": cal[f],
                   "miss_rate": rate, "miss_rate_simulated": cal[f]["rate"], "equal_miss_rate": equal,
                   "ppl_change_pct": run.change, "ci95": list(policy_ci(s, run)), "difference": d["difference"],
                   "difference_ci95": d["ci95"], "method": d["method"], "reroutes_per_call": c["reroutes"] /
                   max(c["calls"], 1), "rerouted_mass_per_token": c["rerouted_mass"] / max(run.result.tokens, 1),
                   "preset_miss_rate_simulated": cal["presets"][f]}
        what = "lambda" if f == "cache-prior" else "M"
        strength = f"{cal[f]['strength']:.3g}" if f == "cache-prior" else f"{int(cal[f]['strength'])}"
        parts.append(f"{pols[f].label()} ({what} = {strength}; miss rate {rate:.1%} emulated, "
                     f"{cal[f]['rate']:.1%} simulated{'' if equal else ', NOT equal'}): {run.change:+.2f}% "
                     f"{fmt_ci(*data[f]['ci95'])}, minus the rule {d['difference']:+.2f} points")
    v, vs = RULES["7"].decide(cis)
    for f, cv in zip(FAMILIES, vs, strict=True):
        data[f]["verdict"] = cv
    data.update({"rule-0.15": {"ppl_change_pct": rule.change, "ci95": list(policy_ci(s, rule)), "miss_rate": r_rule,
                               "miss_rate_simulated": cal["target"]},
                 "budget_gib": budget_gib, "slots": slots, "fetch_every_miss_rate_simulated": cal["fetch_every_miss"],
                 "match": MATCH})
    ours = (f"{slots} slots per layer for each at {budget_gib:.4f} GiB; the 0.15 rule {rule.change:+.2f}% "
            f"{fmt_ci(*data['rule-0.15']['ci95'])} at fetched-miss rate {r_rule:.1%} emulated ({cal['target']:.1%} "
            f"simulated; fetch-every-miss {cal['fetch_every_miss']:.1%}); " + "; ".join(parts)
            + f"; the presets' own miss rates (simulated): cache-prior {cal['presets']['cache-prior']:.1%}, "
            f"cache-route {cal['presets']['cache-route']:.1%}")
    ci = "; ".join(f"{f} - rule {fmt_ci(*data[f]['difference_ci95'])} points ({data[f]['verdict']})"
                   for f in FAMILIES)
    sample = sample_text(s, "/".join(sorted({data[f]["method"] for f in FAMILIES}))) + (
        f"; a family's claim not testable if its emulated miss rate is more than {MATCH:.0%} from the rule's")
    return Row("7", ours, ci, v, sample, data)
