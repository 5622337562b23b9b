"""What a non-fetched miss becomes, and prefetch: perplexity and simulated speed of each family on one model.

For the 0.15 rule and first-choice with each fallback (substitute, lowbit 8/4/2, host, drop),
and fetch-every-miss with lookahead and oracle prefetch, at 25% residency and at an equal VRAM
budget (the budget that holds 25% of the experts for fetch-every-miss; low-bit copies then cost
full-precision slots): the exact emulation's perplexity change with its 95% interval, the shares
of substituted and low-bit calls, prefetch accuracy (prefetched experts then used), and the
simulated ms/token on each host preset, replaying the trace the emulation saw under the policy
from the same warm start. Simulated time uses Qwen3-Next-sized experts routed as the model routes
(runtime.formats.costmodel.shape_for_trace), since a tiny model's own experts cost microseconds.

    python scripts/fallbacks.py [--model demo|DIR] [--max-tokens 16384] [--out-md F] [--out-json F]

The Markdown goes into docs/emulation.md, "Fallbacks and prefetch".
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from runtime.backends import get_backend, hfmodel
from runtime.core.errors import InputError
from runtime.core.policy import PolicyConfig
from runtime.core.spec import RunSpec
from runtime.formats import costmodel

HOSTS = ("rtx3090", "rtx4090", "rtx5090")
FALLBACKS = [("substitute", {}), ("lowbit 8", {"fallback": "lowbit", "lowbit_bits": 8}),
             ("lowbit 4", {"fallback": "lowbit", "lowbit_bits": 4}), ("lowbit 2", {"fallback": "lowbit", "lowbit_bits": 2}),
             ("host", {"fallback": "host"}), ("drop", {"fallback": "drop"})]


def policies() -> dict[str, PolicyConfig]:
    out = {"fetch-every-miss": PolicyConfig(rule="fetch_all")}
    for rule, kw in (("0.15 rule", {"rule": "threshold", "tau": 0.15}), ("first-choice", {"rule": "first_choice"})):
        for fb, fkw in FALLBACKS:
            out[f"{rule} -> {fb}"] = PolicyConfig(**kw, **fkw)
    out["fetch-every-miss + lookahead prefetch"] = PolicyConfig(rule="fetch_all", prefetch="lookahead")
    out["fetch-every-miss + oracle prefetch"] = PolicyConfig(rule="fetch_all", prefetch="oracle")
    return out


def model_dir(name: str) -> tuple[Path, Path]:
    if name in ("demo", "test", "mix"):
        from runtime.tools.tinymodel import ensure_model

        d = Path(ensure_model(name))
        return d, d / "eval.txt"
    return Path(name), Path(name) / "eval.txt"


def run(model: str, max_tokens: int, fraction: float, tmp: Path) -> list[dict]:
    mdir, text = model_dir(model)
    m = hfmodel.load(mdir)
    shape = costmodel.model_shape_for(m.model.config.to_dict(), "fp32")
    C = int(round(fraction * m.E))
    budget = costmodel.budget_for_capacities(shape, C, PolicyConfig(rule="fetch_all"))
    emu, sim = get_backend("emulation"), get_backend("simulator")
    rows = []
    cases = [(n, p, {"capacity": C}, f"C = {C}") for n, p in policies().items()]
    cases += [(n, p, {"vram_budget_GiB": budget}, f"{budget:.3f} GiB") for n, p in policies().items()
              if p.fallback == "lowbit" or n == "fetch-every-miss"]
    for i, (name, pol, size, size_label) in enumerate(tqdm(cases, desc="fallbacks", unit="policy")):
        tr, res = tmp / f"{i}.parquet", tmp / f"{i}.npy"
        spec = RunSpec(policy=pol, name=name, model=str(mdir), text=str(text), max_tokens=max_tokens,
                       trace_out=str(tr), residency_out=str(res), **size)
        try:
            r = emu.evaluate(spec)
        except InputError as exc:  # e.g. the low-bit copies alone exceed the budget: a finding, not a crash
            rows.append({"policy": name, "size": size_label, "infeasible": str(exc)})
            _flush(rows)
            continue
        d = r.to_dict()
        row = {"policy": name, "size": size_label, "capacity": r.capacity[0], "ppl_change_pct": r.ppl_change_pct,
               "ppl_ci": [r.ppl_ci_low, r.ppl_ci_high], "substituted_calls_pct": 100 * d["substituted_call_fraction"],
               "lowbit_calls_pct": 100 * d.get("lowbit_computes", 0) / d["calls"],
               "prefetch_accuracy": (d["prefetch_used"] / d["prefetches"]) if d.get("prefetches") else None,
               "initial_residency": r.initial_residency}
        for host in HOSTS:
            s = sim.evaluate(RunSpec(policy=pol, trace=str(tr), capacity=r.capacity[0], initial_residency=str(res),
                                     host=host))
            row[f"ms_{host}"] = s.time_per_token_s * 1e3
            row[f"x_{host}"] = s.speed_ratio_vs_fetch_all
        rows.append(row)
        _flush(rows)
    return rows


_PARTIAL: Path | None = None


def _flush(rows: list[dict]) -> None:
    """Rows so far (a long run that is stopped still leaves what it measured)."""
    if _PARTIAL is not None:
        _PARTIAL.write_text(json.dumps(rows, indent=2))


def markdown(rows: list[dict], header: str) -> str:
    out = [header, "", "| policy | cache | ppl change % [95% CI] | substituted calls | low-bit calls | prefetch accuracy | "
           + " | ".join(f"{h} ms/token (x vs fetch-every-miss)" for h in HOSTS) + " |",
           "|---|---|---|---|---|---|" + "---|" * len(HOSTS)]
    for r in rows:
        if "infeasible" in r:
            out.append(f"| {r['policy']} | {r['size']} | does not fit: {r['infeasible']} | | | |" + " |" * len(HOSTS))
            continue
        acc = f"{100 * r['prefetch_accuracy']:.0f}%" if r["prefetch_accuracy"] is not None else ""
        cache = f"{r['size']}" + (f" (C = {r['capacity']})" if "GiB" in r["size"] else "")
        out.append(f"| {r['policy']} | {cache} | {r['ppl_change_pct']:+.2f} [{r['ppl_ci'][0]:+.2f}, {r['ppl_ci'][1]:+.2f}] | "
                   f"{r['substituted_calls_pct']:.1f}% | {r['lowbit_calls_pct']:.1f}% | {acc} | "
                   + " | ".join(f"{r[f'ms_{h}']:.2f} ({r[f'x_{h}']:.2f}x)" for h in HOSTS) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--capacity-fraction", type=float, default=0.25)
    ap.add_argument("--out-md", default=None)
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    global _PARTIAL
    _PARTIAL = Path(a.out_json).with_suffix(".partial.json") if a.out_json else None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        rows = run(a.model, a.max_tokens, a.capacity_fraction, Path(d))
    cmd = "python scripts/fallbacks.py " + " ".join(sys.argv[1:])
    md = markdown(rows, f"`{cmd}` ({time.perf_counter() - t0:.0f} s):")
    print(md)
    if a.out_md:
        Path(a.out_md).write_text(md)
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
