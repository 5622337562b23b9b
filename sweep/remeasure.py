"""Multi-fidelity: re-measure the simulator's Pareto candidates by exact emulation (and engine).

The candidates are the union of the hosts' fronts (quality does not depend on the host), thinned
evenly along the mass axis to `max_policies`, plus the sweep's named baselines. They are grouped
by capacity and each group runs `runtime.emulate.emulate` (exact teacher-forced perplexity with
bootstrap intervals) as one Ray task. Each result becomes a ledger row with fidelity
`emulation`, host `all`, keyed by the policy, so a resumed sweep does not emulate a policy twice.
Engine measurements (real time per token) need a host with a GPU and the engine of issue 4; where
either is missing the summary says so.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import pandas as pd

from runtime.errors import InputError
from sweep.report import policy_key
from sweep.space import PARAMETERS, policy_of

log = logging.getLogger(__name__)


def candidates(fronts: dict[str, pd.DataFrame], baselines: list[dict[str, Any]], max_policies: int
               ) -> list[dict[str, Any]]:
    """Policy configs (with capacity) to re-measure: thinned fronts + baselines, distinct."""
    pool = pd.concat([f for f in fronts.values() if not f.empty], ignore_index=True) if fronts else pd.DataFrame()
    chosen: dict[str, dict[str, Any]] = {}
    for b in baselines:
        chosen.setdefault(policy_key(b["params"]), b["params"])
    if not pool.empty:
        pool = pool.drop_duplicates("policy_key").sort_values("mass_per_token").reset_index(drop=True)
        pool = pool[~pool["policy_key"].isin(chosen)]
        n = min(max_policies, len(pool))
        if n:
            picks = sorted({round(i * (len(pool) - 1) / max(n - 1, 1)) for i in range(n)})
            for i in picks:
                r = pool.iloc[i]
                chosen[r["policy_key"]] = {k: _clean(k, r[k]) for k in PARAMETERS if k in r and _present(r[k])}
    return list(chosen.values())


def _present(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and v != v)


def _clean(name: str, v: Any) -> Any:
    """A table cell back to a config value (pandas turns integer columns with gaps into floats)."""
    if hasattr(v, "item"):
        v = v.item()
    return int(v) if name == "admission_delay" else v


def _capacity_fraction(params: dict[str, Any], slots_of) -> float:  # noqa: ANN001 - callable
    if params.get("capacity_fraction") is not None:
        return float(params["capacity_fraction"])
    return slots_of(params)


def _emulate_task(model_dir: str, text: str, policies: dict[str, dict[str, Any]], capacity_fraction: float,
                  max_tokens: int | None, calib_text: str | None) -> dict[str, dict[str, Any]]:
    """Ray task body: one emulation pass per policy at one capacity."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    from runtime.emulate import emulate

    pols = {name: policy_of(p) for name, p in policies.items()}
    return emulate(model_dir, text, pols, capacity_fraction=capacity_fraction, max_tokens=max_tokens,
                   calib_text=calib_text)


def emulation_key(params: dict[str, Any]) -> str:
    return "emulation:" + hashlib.sha1(policy_key(params).encode()).hexdigest()[:16]


def run_emulation(cands: list[dict[str, Any]], done: set[str], model_dir: str, text: str, calib_text: str | None,
                  max_tokens: int | None, slots_of, record) -> int:  # noqa: ANN001 - callables
    """Emulate the candidates not yet `done`, grouped by capacity, as parallel Ray tasks; `record(rows)`."""
    try:
        import runtime.emulate  # noqa: F401
    except ImportError:
        raise InputError("remeasure.emulation needs runtime.emulate, which this checkout lacks "
                         "(set remeasure: {emulation: false})") from None
    import ray

    groups: dict[float, dict[str, dict[str, Any]]] = {}
    for p in cands:
        key = emulation_key(p)
        if key not in done:
            groups.setdefault(round(_capacity_fraction(p, slots_of), 6), {})[key] = p
    task = ray.remote(_emulate_task).options(num_cpus=1, max_retries=1)
    refs = {task.remote(model_dir, text, pols, cf, max_tokens, calib_text): pols for cf, pols in groups.items()}
    n = 0
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1)
        pols = refs.pop(ready[0])
        try:
            res = ray.get(ready[0])
            err = None
        except Exception as exc:  # noqa: BLE001 - recorded as failed rows
            res, err = {}, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        rows = []
        for key, params in pols.items():
            row = {"key": key, "number": None, "baseline": None, "params": params, "host": "all",
                   "fidelity": "emulation", "policy": policy_of(params).label(), "finished_at": time.time()}
            r = res.get(key)
            if r is None:
                row.update(status="failed", error=err or "no result")
            else:
                ci = r.get("ppl_change_ci95") or [None, None]
                row.update(status="ok", perplexity=r.get("perplexity"), exact_perplexity=r.get("exact_perplexity"),
                           ppl_change_pct=r.get("ppl_change_pct"), ppl_ci_low=ci[0], ppl_ci_high=ci[1],
                           mass_per_token=r.get("mass_per_token"), substituted_mass=r.get("substituted_mass"))
                row.update({k: r[k] for k in ("calls", "hits", "fetches", "substitutions", "drops",
                                              "host_computes", "admissions") if k in r})
            rows.append(row)
            n += 1
        record(rows)
    return n
