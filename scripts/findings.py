"""Findings table: the paper's policies on the tiny demo model at 25% residency, by exact emulation.

    python scripts/findings.py [--model DIR] [--text FILE] [--max-tokens 16384] [--capacity-fraction 0.25]
Prints a Markdown table (perplexity change with 95% bootstrap intervals over windows,
substituted calls and mass) and the paper's figures beside it.
"""

from __future__ import annotations

import argparse
import os
import time

from runtime import emulate
from runtime.policy import PRESETS

ORDER = ("fetch-every-miss", "host-compute", "substitute-all", "rule-0.15", "first-choice", "quality-first",
         "speed-first")
OWN = ("substitute-all", "rule-0.15", "quality-first")
PAPER = {"fetch-every-miss": "0 (reference)", "host-compute": "0 (exact)", "substitute-all": "+5.67%",
         "rule-0.15": "+0.35%", "first-choice": "-", "quality-first": "+0.7 to +1.5%", "speed-first": "+0.7 to +1.5%"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default=None)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--capacity-fraction", type=float, default=0.25)
    ap.add_argument("--own-weight", action="store_true", help="also run substitutes with their own router weight")
    a = ap.parse_args()
    if a.model is None:
        from runtime.tinymodel import ensure_model

        a.model = str(ensure_model("demo"))
    text = a.text or os.path.join(a.model, "eval.txt")
    t0 = time.perf_counter()
    res = emulate.emulate(a.model, text, {n: PRESETS[n] for n in ORDER}, capacity_fraction=a.capacity_fraction,
                          max_tokens=a.max_tokens, progress=True)
    ex = res["exact"]
    print(f"model {a.model}; text {text}; {ex['tokens']} tokens ({ex['scored_tokens']} scored) in {ex['windows']} "
          f"windows of {ex['window']}; capacity fraction {a.capacity_fraction} "
          f"(C = {res[ORDER[0]]['capacity'][0]} of E = {res[ORDER[0]]['num_experts']} per layer, "
          f"top-{res[ORDER[0]]['top_k']}); "
          f"warm start from {res[ORDER[0]]['initial_residency']}; exact perplexity {ex['perplexity']:.3f}; "
          f"{time.perf_counter() - t0:.0f} s")
    print()
    print("| policy | perplexity | change | 95% CI | substituted calls | drops | mass/token | fetches/token | paper (Qwen3-Next) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in ORDER:
        print(row(n, res[n], PAPER[n]))
    if a.own_weight:
        own = emulate.emulate(a.model, text, {n: PRESETS[n] for n in OWN}, capacity_fraction=a.capacity_fraction,
                              max_tokens=a.max_tokens, substitute_weight="own", progress=True)
        for n in OWN:
            print(row(f"{n} (own weight)", own[n], "-"))


def row(name: str, r: dict, paper: str) -> str:
    lo, hi = r["ppl_change_ci95"]
    return (f"| {name} | {r['perplexity']:.3f} | {r['ppl_change_pct']:+.2f}% | [{lo:+.2f}, {hi:+.2f}] | "
            f"{r['substituted_call_fraction'] * 100:.2f}% | {r['drops']} | {r['mass_per_token']:.4f} | "
            f"{r['fetches'] / r['tokens']:.2f} | {paper} |")


if __name__ == "__main__":
    main()
