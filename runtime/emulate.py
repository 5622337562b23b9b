"""Exact emulation: teacher-forced perplexity of a Hugging Face MoE checkpoint under miss policies.

The text becomes one token stream cut into windows of `window` tokens (each window an
independent context; a trailing partial window is dropped). Windows run through the model
in stream order, several at a time; inside each MoE layer the policy kernel decides the
tokens of the batch in stream order, so every decision equals what a one-token-at-a-time
decode with a KV cache would make (tests/test_emulate.py checks it). The policy cache is
carried across windows and documents.

Per policy: perplexity, its change versus the exact model with a 95% bootstrap interval
over windows, the spec's counters and substituted mass; per-token NLLs go to Parquet.
`python -m runtime.emulate --model DIR --text FILE --policy PRESET --capacity-fraction F --json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time

import numpy as np

from runtime.errors import InputError, atomic_write, cli_main
from runtime.hfmodel import (  # noqa: F401 - re-exported for callers of runtime.emulate
    Loaded,
    calibration_ids,
    default_window,
    load,
    make_trace,
    record,
    run_stream,
    tokenize_file,
)
from runtime.kernel import PolicyCache, warm_residency
from runtime.policy import PRESETS, PolicyConfig, preset, resolve_capacities
from runtime.trace import save_trace

log = logging.getLogger(__name__)

COUNTER_KEYS = ("calls", "hits", "fetches", "substitutions", "drops", "host_computes", "admissions")


def bootstrap_change(nll_exact: np.ndarray, nll_pol: np.ndarray, n_boot: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """Perplexity change in percent with a 95% interval, resampling windows (rows) with replacement."""
    se, sp = nll_exact.sum(1), nll_pol.sum(1)  # [n]
    cnt = nll_exact.shape[1]
    point = math.expm1((sp.sum() - se.sum()) / (cnt * len(se))) * 100
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(se), size=(n_boot, len(se)))
    diffs = (sp[idx].sum(1) - se[idx].sum(1)) / (cnt * len(se))
    lo, hi = np.percentile(np.expm1(diffs) * 100, [2.5, 97.5])
    return point, float(lo), float(hi)


def emulate(
    model_dir: str | os.PathLike | Loaded,
    text_path: str | os.PathLike,
    policies: dict[str, PolicyConfig],
    capacity_fraction: float | None = 0.25,
    capacity=None,
    max_tokens: int | None = None,
    window: int | None = None,
    batch_windows: int = 8,
    calib_text: str | os.PathLike | None = None,
    substitute_weight: str = "missed",
    nll_out: str | os.PathLike | None = None,
    trace_out: str | os.PathLike | None = None,
    residency_out: str | os.PathLike | None = None,
    progress: bool = False,
    policy_runner=None,
) -> dict:
    """Exact perplexity and per-policy perplexity/counters. Returns {"exact": {...}, name: {...}}.

    `policy_runner(m, windows, cache, name) -> (nll [n, window-1], extra keys)`, when given, replaces
    the batched forward of each policy (the engine backend decodes token by token instead).
    """
    m = model_dir if isinstance(model_dir, Loaded) else load(model_dir)
    if substitute_weight not in ("missed", "own"):
        raise InputError(f"--substitute-weight = {substitute_weight!r} must be 'missed' or 'own'")
    W = window or default_window(m)
    windows, sha = tokenize_file(m, text_path, max_tokens, W)
    caps = resolve_capacities(capacity, m.num_layers, m.E, m.k, capacity_fraction)
    cids, init_src = calibration_ids(m, calib_text, max_tokens, W, batch_windows, progress)
    t0 = time.perf_counter()
    ids, w, rank, nll_exact = record(m, windows, m.k, batch_windows, progress, desc="exact")
    exact_seconds = time.perf_counter() - t0
    init = warm_residency(cids if cids is not None else ids, None, m.E, caps)
    exact_ppl = float(math.exp(nll_exact.mean()))
    results: dict = {"exact": {"perplexity": exact_ppl, "tokens": int(windows.size), "scored_tokens": int(nll_exact.size),
                               "windows": int(windows.shape[0]), "window": W, "seconds": exact_seconds}}
    nll_cols = {"nll_exact": nll_exact.ravel()}
    for name, pol in policies.items():
        pol.validate(where=f"policy {name}")
        cache = PolicyCache(pol, m.E, m.k, caps, init)
        m.ctx.substitute_weight = substitute_weight
        t0 = time.perf_counter()
        extra: dict = {}
        try:
            if policy_runner is not None:
                nll, extra = policy_runner(m, windows, cache, name)
            elif trace_out is not None and len(policies) == 1:
                pids, pw, prank, nll = record(m, windows, m.E, batch_windows, progress, cache=cache, desc=name)
                tr = make_trace(m, pids, pw, prank, windows, sha, f"runtime.emulate policy={name}")
                save_trace(tr, trace_out)
            else:
                m.ctx.cache = cache
                nll = run_stream(m, windows, batch_windows, progress, desc=name)
        finally:
            m.ctx.cache = None
            m.ctx.substitute_weight = "missed"
        secs = time.perf_counter() - t0
        point, lo, hi = bootstrap_change(nll_exact, nll)
        tot = cache.counter_totals()
        T = int(windows.size)
        r = {"policy": pol.label(), "policy_config": pol.to_dict(), "perplexity": float(math.exp(nll.mean())),
             "exact_perplexity": exact_ppl, "ppl_change_pct": point, "ppl_change_ci95": [lo, hi]}
        r.update({key: tot[key] for key in COUNTER_KEYS})
        r["substituted_mass"] = tot["substituted_mass"]
        r["mass_per_token"] = tot["substituted_mass"] / T
        r["mass_per_token_layer"] = tot["substituted_mass"] / (T * m.num_layers)
        r["substituted_call_fraction"] = (tot["substitutions"] + tot["drops"]) / max(tot["calls"], 1)
        r["per_layer"] = cache.per_layer()
        r.update({"capacity": caps.tolist(), "num_experts": m.E, "top_k": m.k, "tokens": T, "seconds": secs, "initial_residency": init_src,
                  "substitute_weight": substitute_weight})
        r.update(extra)
        results[name] = r
        nll_cols[f"nll_{name}"] = nll.ravel()
    if residency_out is not None:
        res_arr = np.stack([np.asarray(x, np.int64) for x in init]) if len(set(caps.tolist())) == 1 else None
        if res_arr is None:
            raise InputError("--residency-out needs the same capacity in every layer")
        atomic_write(residency_out, lambda tmp: np.save(open(tmp, "wb"), res_arr))
    if nll_out is not None:
        _write_nll(nll_out, windows, nll_cols)
    return results


def _write_nll(path, windows: np.ndarray, cols: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, W = windows.shape
    table = pa.table({"window": np.repeat(np.arange(n, dtype=np.int32), W - 1),
                      "position": np.tile(np.arange(1, W, dtype=np.int32), n),
                      "token_id": windows[:, 1:].ravel().astype(np.int32),
                      **{k: v.astype(np.float64) for k, v in cols.items()}})
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.emulate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--text", required=True, help="UTF-8 text file to evaluate")
    p.add_argument("--policy", action="append", required=True,
                   help=f"preset (repeatable), or 'all': {', '.join(PRESETS)}")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--capacity-fraction", type=float, default=None)
    cap.add_argument("--capacity", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--window", type=int, default=None, help="tokens per context window (default: min(max positions, 512))")
    p.add_argument("--batch-windows", type=int, default=8)
    p.add_argument("--calib-text", default=None, help="text for the warm start (default: calib.txt beside the model)")
    p.add_argument("--substitute-weight", default="missed", choices=["missed", "own"])
    p.add_argument("--backend", default="emulation", choices=["emulation", "engine"])
    p.add_argument("--nll-out", default=None, help="per-token NLLs (Parquet)")
    p.add_argument("--trace-out", default=None, help="router trace seen under the (single) policy")
    p.add_argument("--residency-out", default=None, help="initial residency used (.npy int [L, C])")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    names = list(PRESETS) if a.policy == ["all"] else a.policy
    pols = {n: preset(n) for n in names}
    if a.capacity is None and a.capacity_fraction is None:
        a.capacity_fraction = 0.25
    for flag, v in (("--max-tokens", a.max_tokens), ("--window", a.window), ("--batch-windows", a.batch_windows)):
        if v is not None and v < 2:
            raise InputError(f"{flag} = {v} must be >= 2")
    if a.backend == "engine":
        from runtime.engine import emulate_engine

        res = emulate_engine(a.model, a.text, pols, capacity_fraction=a.capacity_fraction, capacity=a.capacity,
                             max_tokens=a.max_tokens, window=a.window, calib_text=a.calib_text)
    else:
        res = emulate(a.model, a.text, pols, capacity_fraction=a.capacity_fraction, capacity=a.capacity,
                      max_tokens=a.max_tokens, window=a.window, batch_windows=a.batch_windows,
                      calib_text=a.calib_text, substitute_weight=a.substitute_weight, nll_out=a.nll_out,
                      trace_out=a.trace_out, residency_out=a.residency_out, progress=sys.stderr.isatty())
    if a.json:
        out = res[names[0]] if len(names) == 1 else res
        if len(names) == 1:
            out = {**out, "exact": res["exact"]}
        print(json.dumps(out, indent=2))
    else:
        print(f"exact perplexity {res['exact']['perplexity']:.4f} over {res['exact']['tokens']} tokens")
        for n in names:
            r = res[n]
            print(f"{n:18s} ppl {r['perplexity']:.4f}  change {r['ppl_change_pct']:+.2f}% "
                  f"[{r['ppl_change_ci95'][0]:+.2f}, {r['ppl_change_ci95'][1]:+.2f}]  "
                  f"mass/token {r['mass_per_token']:.4f}  fetches {r['fetches']}  subs {r['substitutions']}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cli_main(main)
