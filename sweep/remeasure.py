"""Multi-fidelity: re-measure the simulator's Pareto candidates by exact emulation (and engine).

The candidates are the union of the hosts' fronts (quality does not depend on the host), thinned
evenly along the mass axis to `max_policies`, plus the sweep's named baselines. They are grouped
by capacity and each group runs `runtime.emulate.emulate` (exact teacher-forced perplexity with
bootstrap intervals) as one Ray task. Each result becomes a ledger row with fidelity
`emulation`, host `all`, keyed by the policy, so a resumed sweep does not emulate a policy twice.
On hosts whose profile was calibrated (real machines), the same candidates are also run by the
engine of issue 4 (`runtime.engine.emulate_engine`: every policy decoded with real expert
offloading) as Ray tasks pinned to that host: rows with fidelity `engine`, that host, the measured
time per token.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import pandas as pd

from runtime.errors import InputError
from runtime.policy import PARAM_BY_NAME
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
    prm = PARAM_BY_NAME.get(name)
    return int(v) if prm is not None and prm.type is int and isinstance(v, float) else v


def _capacity_fraction(params: dict[str, Any], slots_of) -> float:  # noqa: ANN001 - callable
    if params.get("capacity_fraction") is not None:
        return float(params["capacity_fraction"])
    return slots_of(params)


def _emulate_task(model_dir: str, text: str, policies: dict[str, dict[str, Any]], capacity_fraction: float,
                  max_tokens: int | None, calib_text: str | None, engine: bool = False) -> dict[str, dict[str, Any]]:
    """Ray task body: one emulation pass per policy at one capacity (by the engine when `engine`)."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    pols = {name: policy_of(p) for name, p in policies.items()}
    if engine:
        from runtime.backends import get_backend
        from runtime.spec import RunSpec

        specs = [RunSpec(policy=p, name=n, capacity_fraction=capacity_fraction, model=str(model_dir), text=str(text),
                         max_tokens=max_tokens, calib_text=calib_text) for n, p in pols.items()]
        res = get_backend("engine").evaluate_many(specs)
        return {"exact": {"perplexity": res[0].exact_perplexity}, **{n: r.to_dict() for n, r in zip(pols, res, strict=True)}}
    from runtime.emulate import emulate

    return emulate(model_dir, text, pols, capacity_fraction=capacity_fraction, max_tokens=max_tokens,
                   calib_text=calib_text)


def emulation_key(params: dict[str, Any], host: str | None = None) -> str:
    digest = hashlib.sha1(policy_key(params).encode()).hexdigest()[:16]
    return f"engine:{host}:{digest}" if host else f"emulation:{digest}"


def run_emulation(cands: list[dict[str, Any]], done: set[str], model_dir: str, text: str, calib_text: str | None,
                  max_tokens: int | None, slots_of, record, host: str | None = None,  # noqa: ANN001 - callables
                  gpus: int = 0) -> int:
    """Emulate the candidates not yet `done`, grouped by capacity, as parallel Ray tasks; `record(rows)`.

    With `host`, the engine runs them on that host (pinned by its `host:NAME` resource)."""
    module = "runtime.engine" if host else "runtime.emulate"
    try:
        __import__(module)
    except ImportError:
        raise InputError(f"remeasure needs {module}, which this checkout lacks "
                         f"(set remeasure: {{{'engine' if host else 'emulation'}: false}})") from None
    import ray

    from sweep.hosts import HOST_SLIVER, resource

    groups: dict[float, dict[str, dict[str, Any]]] = {}
    for p in cands:
        key = emulation_key(p, host)
        if key not in done:
            groups.setdefault(round(_capacity_fraction(p, slots_of), 6), {})[key] = p
    opts: dict[str, Any] = {"num_cpus": 1, "max_retries": 1}
    if host:
        opts.update(num_gpus=gpus, resources={resource(host): HOST_SLIVER})
    task = ray.remote(_emulate_task).options(**opts)
    refs = {task.remote(model_dir, text, pols, cf, max_tokens, calib_text, bool(host)): pols
            for cf, pols in groups.items()}
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
            row = {"key": key, "number": None, "baseline": None, "params": params, "host": host or "all",
                   "fidelity": "engine" if host else "emulation", "policy": policy_of(params).label(),
                   "finished_at": time.time()}
            r = res.get(key)
            if r is None:
                row.update(status="failed", error=err or "no result")
            else:
                ci = r.get("ppl_change_ci95") or [None, None]
                row.update(status="ok", perplexity=r.get("perplexity"), exact_perplexity=r.get("exact_perplexity"),
                           ppl_change_pct=r.get("ppl_change_pct"), ppl_ci_low=ci[0], ppl_ci_high=ci[1],
                           mass_per_token=r.get("mass_per_token"), substituted_mass=r.get("substituted_mass"))
                row.update({k: r[k] for k in ("calls", "hits", "fetches", "substitutions", "drops",
                                              "host_computes", "admissions", "time_per_token_s",
                                              "peak_device_bytes") if k in r})
            rows.append(row)
            n += 1
        record(rows)
    return n
