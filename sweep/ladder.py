"""The multi-fidelity ladder: where the expensive perplexity measurements go.

1. **Screening** (every candidate, per host): the simulator's time per token and substituted mass
   (the Tune + Optuna search, sweep/search.py).
2. **Short rungs** (`emulation.rungs`, token budgets): the screened candidates are emulated
   (`runtime.backends` "emulation": exact teacher-forced perplexity) on a short prefix of the text;
   each rung keeps the best 1/`eta` of its candidates (rounded up) for the next one.
3. **Full budget** (`max_tokens` of the sweep): the survivors (at most `emulation.max_full`) and
   the named baselines are emulated on the whole budget. Only these rows are placed on a front.
4. **Engine** (hosts with `profile: calibrate`): the full-budget set decoded by the offloading
   engine on that host, for a measured time per token beside the simulated one.

Quality does not depend on the host: each measurement (policy, capacity as emulated, model digest, text,
token budget, warm start: `measurement_key`) is emulated once and shared by all hosts (ledger rows with
host `all`). The candidates are each host's screening front in (time, mass), computed separately for
the policies that always fetch the first choice and for those that can substitute it (mass ranks only
within a family), plus the baselines.

Promotion is synchronous successive halving: a rung's candidates are all measured before any is
promoted, so each rung keeps the best `ceil(n / eta)` of its `n` candidates by score, ties broken by
policy key (`promote`): the same inputs always promote the same policies, whatever their order. At
most `max_full` survivors go on to the full budget. Every measurement is in the ledger, so a
resumed sweep replays the ladder without emulating anything twice. The score (lower is better)
asks "how much faster is this policy, on the sweep's hosts, for the perplexity budgets it meets?":

    score = -mean over hosts h and budgets B of  speed_ratio_vs_fetch_all[h] * [ppl_change_pct <= B]

with the rung's point estimate (the interval is too wide on a short budget); a policy that meets no
budget scores 0.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from runtime.core.policy import PRESETS
from sweep.report import is_bound, pareto_mask, policy_key
from sweep.space import policy_of

FULL = "full"


def measurement_key(spec: dict[str, Any], model_digest: str | None, budget: int | str,
                    host: str | None = None) -> str:
    """Ledger key of one measurement: `emulation:<budget>:<digest>` or `engine:<host>:<digest>`, the digest
    (SHA-1, 16 hex digits) over everything the measurement depends on: the RunSpec as evaluated (`spec`,
    `RunSpec.to_dict()`: the policy, its cache size as emulated (the simulator's slots for a budget, or the
    fraction), the model and text, the token budget, the warm start, dtype and memory) and the checkpoint's
    content digest (`data.checkpoint_digest`). Two measurements share a key only when they are the same."""
    material = json.dumps({"spec": spec, "model_digest": model_digest}, sort_keys=True, default=str)
    digest = hashlib.sha1(material.encode()).hexdigest()[:16]
    return f"engine:{host}:{digest}" if host else f"emulation:{budget}:{digest}"


def screening_candidates(rows: list[dict[str, Any]], hosts: list[str]) -> list[dict[str, Any]]:
    """Each host's (time, mass) front among its ok simulator trials, per family (policies that always
    fetch the first choice / that can substitute it); distinct policies over hosts, baselines and
    offline bounds (oracle prefetch, Belady eviction) excluded."""
    chosen: dict[str, dict[str, Any]] = {}
    for host in hosts:
        sims = [r for r in rows if r.get("fidelity") == "simulator" and r["host"] == host and r["status"] == "ok"
                and not r.get("baseline") and not is_bound(r["params"])]  # offline bounds are never answers
        for first in (True, False):
            group = [r for r in sims if policy_of(r["params"]).fetches_first_choice == first]
            if not group:
                continue
            pts = np.array([[r["time_per_token_s"], r["mass_per_token"]] for r in group], float)
            for r, keep in zip(group, pareto_mask(pts), strict=True):
                if keep:
                    chosen.setdefault(policy_key(r["params"]), r["params"])
    return list(chosen.values())


def speed_ratios(rows: list[dict[str, Any]], hosts: list[str]) -> dict[str, dict[str, float]]:
    """policy key -> host -> the simulator's speed ratio over fetch-every-miss at the same capacity."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("fidelity") == "simulator" and r["status"] == "ok" and r["host"] in hosts:
            out.setdefault(policy_key(r["params"]), {})[r["host"]] = r["speed_ratio_vs_fetch_all"]
    return out


def score(ppl_change_pct: float | None, ratios: dict[str, float], hosts: list[str], budgets: list[float]) -> float:
    if ppl_change_pct is None or not np.isfinite(ppl_change_pct):
        return 0.0
    vals = [ratios.get(h, 0.0) * (ppl_change_pct <= b) for h in hosts for b in budgets]
    return -float(np.mean(vals)) if vals else 0.0


Measure = Callable[[list[dict[str, Any]], int | None, str], dict[str, dict[str, Any]]]


def promote(scores: dict[str, float], eta: int) -> list[str]:
    """The best `ceil(n / eta)` of a rung's `n` scored candidates (lower is better), ties by key, best first."""
    order = sorted(scores, key=lambda pk: (scores[pk], pk))
    return order[:math.ceil(len(order) / eta)]


def run_ladder(cands: list[dict[str, Any]], baselines: list[dict[str, Any]], rows: list[dict[str, Any]],
               hosts: list[str], rungs: list[int], eta: int, max_full: int, full_tokens: int | None,
               budgets: list[float], measure: Measure) -> dict[str, Any]:
    """Screened candidates up the rungs to the full budget.

    `measure(params_list, tokens, budget_name)` emulates (or takes from the ledger) and returns
    {policy key: ledger row}. Returns per-rung statistics and the policy keys measured at full budget."""
    ratios = speed_ratios(rows, hosts)

    def scored(res: dict[str, dict[str, Any]], pk: str) -> float:
        r = res.get(pk)
        return score(r.get("ppl_change_pct") if r and r.get("status") == "ok" else None, ratios.get(pk, {}),
                     hosts, budgets)

    base_keys = {policy_key(b) for b in baselines}
    alive = {policy_key(c): c for c in cands if policy_key(c) not in base_keys}
    order = sorted(alive)
    stats: list[dict[str, Any]] = []
    for k, tokens in enumerate(rungs):
        if not alive:
            break
        t0 = time.time()
        res = measure(list(alive.values()), tokens, str(tokens))
        order = promote({pk: scored(res, pk) for pk in alive}, eta)
        alive = {pk: alive[pk] for pk in order}
        stats.append({"rung": k, "tokens": tokens, "candidates": len(res), "promoted": len(alive),
                      "seconds": time.time() - t0})
    # the survivors, best last score first, go on to the full budget, at most max_full of them
    full = order[:max_full]
    t0 = time.time()
    todo = [alive[pk] for pk in full] + list(baselines)
    res = measure(todo, full_tokens, FULL)
    stats.append({"rung": FULL, "tokens": full_tokens, "candidates": len(todo), "promoted": len(full),
                  "seconds": time.time() - t0, "baselines": len(baselines)})
    return {"rungs": stats, "full": [policy_key(p) for p in todo], "screened": len(cands)}


def baseline_params(names: list[str], capacity: dict[str, float]) -> list[dict[str, Any]]:
    from sweep.space import complete

    return [complete({**PRESETS[n].to_dict(), **capacity}) for n in names]
