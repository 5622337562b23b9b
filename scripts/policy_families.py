"""Policy families at equal device memory: hit rate, fetches per token and perplexity change, and LRU vs LFU.

`make families`. Each family (LRU, LFU, lfuda, a pinned hot set with LRU and with LFU, a fetch
cap with the substitute fallback, calibrated per-layer capacities, the 0.15 rule with `drop` and with
`drop_renorm`) and the paper's presets for reference, on

- the two real traces in ../shared/data/traces (Qwen1.5-MoE GSM8K, Mixtral HumanEval), replayed by the
  simulator backend; warm start `held-out` (the last 20% of each trace calibrates and is not evaluated);
- the tiny reference models `mix` and `test` (docs/tiny_models.md): the router trace of the exact model
  recorded on the first --max-tokens tokens of eval.txt and replayed by the simulator, warm start
  `warm:` a trace recorded on the first --max-tokens tokens of calib.txt; and the exact emulation's
  perplexity change (95% interval) on the same eval tokens, warm start from the same calib tokens
  (`calib_text`). Policies that compute every selected expert exactly (fetch every miss, whatever
  the eviction key, pinning or allocation) change no output: their perplexity change is 0 by
  construction and is not emulated (the table says "exact").

Equal memory: every family of a cell has the same number of full-precision expert slots, `C =
round(fraction * E)` per layer (calibrated capacities spread the same total `L * C` over the layers);
no family keeps low-bit copies, so each cell's expert memory is the same. Hit rate = hits / expert
calls; fetches per token = synchronous fetches per token summed over layers; loads per token adds
background admissions (Quality-First, Speed-First). LRU vs LFU (fetching every miss, and with a
pinned hot set) per cell: the hit-rate difference with a 95% block-bootstrap interval over the
evaluated tokens (blocks of 32 tokens, 2,000 resamples, seed 0). Fixed choices: pinned sets pin half the slots
(`pin_fraction = 0.5`), the fetch cap is `max(1, k // 4)` per token and layer, and the families that
are not about eviction (fetch cap, calibrated, drop) use the project's default eviction key, LFU.

    python scripts/policy_families.py [--fractions 0.25,0.5] [--max-tokens 2048] [--models mix,test]
        [--traces DIR] [--out-md F] [--out-json F] [--report NAME]

`--report policy_families` (what `make families` runs) writes reports/policy_families.md and .json
(runtime/tools/reports.py: command, commit, machine, date); docs/policies.md links to it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from runtime.backends import get_backend
from runtime.core.errors import InputError, atomic_write
from runtime.core.policy import PRESETS, PolicyConfig
from runtime.core.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger(__name__)

REAL_TRACES = {"qwen1.5-moe gsm8k": "qwen15moe-a2.7b-gsm8k.npz", "mixtral humaneval": "mixtral-8x7b-humaneval0.npz"}
PIN = 0.5
PAIRS = (("LRU", "LFU (= fetch-every-miss)"), (f"pinned {PIN:g} + LRU", f"pinned {PIN:g} + LFU"))
PAIRED = {f for pair in PAIRS for f in pair}
BLOCK, RESAMPLES = 32, 2000  # the interval's token blocks and bootstrap resamples (seed 0)
HIT = 0  # the kernel's decision code of a hit (docs/policies.md, "Decision codes")


def families(k: int) -> dict[str, PolicyConfig]:
    """{family: policy}; the fetch cap depends on top-k."""
    cap = max(1, k // 4)
    return {
        "LRU": PolicyConfig(rule="fetch_all", evict="lru"),
        "LFU (= fetch-every-miss)": PolicyConfig(rule="fetch_all", evict="lfu"),
        "lfuda": PolicyConfig(rule="fetch_all", evict="lfuda"),
        f"pinned {PIN:g} + LRU": PolicyConfig(rule="fetch_all", evict="lru", pin_fraction=PIN),
        f"pinned {PIN:g} + LFU": PolicyConfig(rule="fetch_all", evict="lfu", pin_fraction=PIN),
        f"fetch cap {cap} -> substitute": PolicyConfig(rule="fetch_all", fetch_cap=cap),
        "calibrated capacities": PolicyConfig(rule="fetch_all", capacity_alloc="calibrated"),
        "0.15 rule -> drop": PolicyConfig(rule="threshold", tau=0.15, fallback="drop"),
        "0.15 rule -> drop_renorm": PolicyConfig(rule="threshold", tau=0.15, fallback="drop", drop_renorm=True),
        "preset rule-0.15": PRESETS["rule-0.15"],
        "preset quality-first": PRESETS["quality-first"],
        "preset speed-first": PRESETS["speed-first"],
    }


def exact(pol: PolicyConfig) -> bool:
    """Every selected expert computed exactly: the output (and perplexity) is the model's own."""
    return pol.exact and pol.fetch_cap is None


def _row(source: str, fraction: float, family: str, pol: PolicyConfig, r) -> dict:  # noqa: ANN001 - a Result
    c, T = r.counters, max(r.tokens, 1)
    calls = max(c["calls"], 1)
    return {"source": source, "fraction": fraction, "family": family, "policy": pol.label(),
            "capacity": r.capacity, "slots": int(sum(r.capacity)), "tokens": r.tokens,
            "initial_residency": r.initial_residency, "hit_rate": c["hits"] / calls,
            "fetches_per_token": c["fetches"] / T, "loads_per_token": (c["fetches"] + c["admissions"]) / T,
            "not_fetched_share": (c["substitutions"] + c["drops"]) / calls, "drop_share": c["drops"] / calls}


def simulate_source(source: str, trace: str, k: int, fractions: list[float], init: str, bar: tqdm) -> list[dict]:
    sim = get_backend("simulator")  # one instance: the trace, warm starts and baselines are kept
    rows = []
    for f in fractions:
        for fam, pol in families(k).items():
            if pol.drop_renorm:  # outputs only: the counters are the drop row's (the spec), nothing to replay
                bar.update()
                continue
            paired = fam in PAIRED  # per-token hits kept for the LRU-vs-LFU interval
            try:
                r = sim.evaluate(RunSpec(policy=pol, trace=trace, capacity_fraction=f, initial_residency=init,
                                         record_decisions=paired))
                rows.append(_row(source, f, fam, pol, r))
                if paired:
                    kind = r.decisions["kind"]  # [T, L, k], -1 at lost cells
                    rows[-1]["_hits"] = (kind == HIT).sum(axis=(1, 2))  # [T]
                    rows[-1]["_calls"] = (kind >= 0).sum(axis=(1, 2))  # [T]
            except InputError as exc:  # e.g. a pinned set that leaves fewer than k free slots: a finding
                rows.append({"source": source, "fraction": f, "family": fam, "policy": pol.label(),
                             "infeasible": str(exc)})
            bar.update()
    return rows


def emulate_model(source: str, mdir: Path, k: int, fractions: list[float], max_tokens: int) -> dict:
    """{(fraction, family): (ppl change %, ci low, ci high)} for the families that are not exact."""
    specs, keys = [], []
    for f in fractions:
        for fam, pol in families(k).items():
            if exact(pol):
                continue
            specs.append(RunSpec(policy=pol, model=str(mdir), text=str(mdir / "eval.txt"), max_tokens=max_tokens,
                                 calib_text=str(mdir / "calib.txt"), calib_max_tokens=max_tokens, capacity_fraction=f))
            keys.append((f, fam))
    res = get_backend("emulation").evaluate_many(specs, progress=True)
    return {key: (r.ppl_change_pct, r.ppl_ci_low, r.ppl_ci_high, r.counters["hits"] / max(r.counters["calls"], 1))
            for key, r in zip(keys, res, strict=True)}


def run(a: argparse.Namespace, tmp: Path) -> list[dict]:
    fractions = [float(x) for x in a.fractions.split(",")]
    models = [m for m in a.models.split(",") if m]
    traces_dir = Path(a.traces)
    real = {name: traces_dir / f for name, f in REAL_TRACES.items() if (traces_dir / f).exists()}
    if len(real) < len(REAL_TRACES):
        log.warning("real traces missing under %s: %s", traces_dir, ", ".join(sorted(set(REAL_TRACES) - set(real))))
    n_fam = len(families(4))
    bar = tqdm(total=(len(real) + len(models)) * len(fractions) * n_fam, desc="policy families", unit="run")
    rows: list[dict] = []
    for name, path in real.items():
        from runtime.formats.trace import load_trace

        k = load_trace(path).k
        rows += simulate_source(name, str(path), k, fractions, "held-out", bar)
    for m in models:
        from runtime.tools.record import record_trace
        from runtime.tools.tinymodel import ensure_model

        mdir = Path(ensure_model(m, progress=False))
        ev, cal = tmp / f"{m}-eval.parquet", tmp / f"{m}-calib.parquet"
        record_trace(mdir, mdir / "eval.txt", ev, max_tokens=a.max_tokens)
        record_trace(mdir, mdir / "calib.txt", cal, max_tokens=a.max_tokens)
        k = json.loads((mdir / "config.json").read_text())["num_experts_per_tok"]
        mrows = simulate_source(f"{m} (recorded)", str(ev), k, fractions, f"warm:{cal}", bar)
        for r in mrows:
            r["initial_residency"] = f"warm: calib.txt, first {a.max_tokens} tokens (recorded)"
        ppl = emulate_model(m, mdir, k, fractions, a.max_tokens)
        for r in mrows:
            pol = families(k)[r["family"]]
            if "infeasible" in r:
                continue
            if (r["fraction"], r["family"]) in ppl:
                p = ppl[(r["fraction"], r["family"])]
                r.update(ppl_change_pct=p[0], ppl_ci=[p[1], p[2]], emulation_hit_rate=p[3])
            elif exact(pol):
                r.update(ppl_change_pct=0.0, ppl_ci=[0.0, 0.0], exact=True)
        # drop_renorm: the drop row's counters (outputs only), its own perplexity
        for f in fractions:
            base = next((r for r in mrows if r["fraction"] == f and r["family"] == "0.15 rule -> drop"), None)
            key = (f, "0.15 rule -> drop_renorm")
            if base is not None and key in ppl and "infeasible" not in base:
                p = ppl[key]
                mrows.append({**base, "family": key[1], "policy": families(k)[key[1]].label(),
                              "ppl_change_pct": p[0], "ppl_ci": [p[1], p[2]], "emulation_hit_rate": p[3]})
        order = list(families(k))
        rows += sorted(mrows, key=lambda r: (r["fraction"], order.index(r["family"])))
    bar.close()
    return rows


def diff_interval(a: dict, b: dict) -> tuple[float, float]:
    """95% block-bootstrap interval (blocks of BLOCK tokens, RESAMPLES resamples, seed 0) of the hit-rate
    difference a - b, in points, from the two replays' per-token hits on the same tokens."""
    ha, hb, calls = a["_hits"], b["_hits"], a["_calls"]
    n = max(1, len(calls) // BLOCK)
    starts = np.arange(n) * BLOCK
    rng = np.random.default_rng(0)
    pick = starts[rng.integers(0, n, size=(RESAMPLES, n))]  # [R, n] block starts
    idx = (pick[:, :, None] + np.arange(BLOCK)).reshape(RESAMPLES, -1) % len(calls)  # [R, n * BLOCK]
    d = 100 * (ha[idx].sum(1) - hb[idx].sum(1)) / np.maximum(calls[idx].sum(1), 1)  # [R]
    return float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))


def verdict(rows: list[dict]) -> dict:
    """LRU vs LFU (fetch every miss, and with a pinned hot set) per source x budget cell, by hit rate, with a
    95% block-bootstrap interval of the difference over tokens."""
    out = {}
    for pair in PAIRS:
        cells = []
        for src in dict.fromkeys(r["source"] for r in rows):
            for f in dict.fromkeys(r["fraction"] for r in rows if r["source"] == src):
                get = {r["family"]: r for r in rows if r["source"] == src and r["fraction"] == f}
                a, b = get.get(pair[0]), get.get(pair[1])
                if a is None or b is None or "infeasible" in a or "infeasible" in b:
                    continue
                lo, hi = diff_interval(a, b) if "_hits" in a and "_hits" in b else (None, None)
                cells.append({"source": src, "fraction": f, "lru": a["hit_rate"], "lfu": b["hit_rate"],
                              "lru_minus_lfu_points": 100 * (a["hit_rate"] - b["hit_rate"]), "ci95": [lo, hi]})
        sure = [c for c in cells if c["ci95"][0] is not None]
        out[pair[0]] = {"cells": cells, "lru_wins": sum(c["lru_minus_lfu_points"] > 0 for c in cells),
                        "ties": sum(c["lru_minus_lfu_points"] == 0 for c in cells), "n": len(cells),
                        "lru_wins_ci": sum(c["ci95"][0] > 0 for c in sure),
                        "lfu_wins_ci": sum(c["ci95"][1] < 0 for c in sure)}
    return out


def markdown(rows: list[dict], ver: dict, header: str) -> str:
    out = [header, ""]
    for src in dict.fromkeys(r["source"] for r in rows):
        sr = [r for r in rows if r["source"] == src]
        ok = next(r for r in sr if "infeasible" not in r)
        models = any("ppl_change_pct" in r for r in sr)
        out += [f"**{src}** ({ok['tokens']} evaluated tokens; warm start {ok['initial_residency']})", "",
                "| residency | family | policy | slots (C per layer) | hit rate | fetches/token | loads/token | "
                "dropped or substituted calls |" + (" ppl change % [95% CI] |" if models else ""),
                "|---|---|---|---|---|---|---|---|" + ("---|" if models else "")]
        for r in sr:
            if "infeasible" in r:
                out.append(f"| {r['fraction']:.0%} | {r['family']} | {r['policy']} | infeasible: {r['infeasible']} "
                           "| | | | |" + (" |" if models else ""))
                continue
            caps = r["capacity"]
            c_txt = str(caps[0]) if len(set(caps)) == 1 else ",".join(map(str, caps))
            line = (f"| {r['fraction']:.0%} | {r['family']} | {r['policy']} | {r['slots']} ({c_txt}) | "
                    f"{r['hit_rate']:.4f} | {r['fetches_per_token']:.3f} | {r['loads_per_token']:.3f} | "
                    f"{100 * r['not_fetched_share']:.2f}% |")
            if models:
                if r.get("exact"):
                    line += " 0 (exact) |"
                elif "ppl_change_pct" in r:
                    line += f" {r['ppl_change_pct']:+.2f} [{r['ppl_ci'][0]:+.2f}, {r['ppl_ci'][1]:+.2f}] |"
                else:
                    line += " |"
            out.append(line)
        out.append("")
    for name, v in ver.items():
        cells = "; ".join(f"{c['source']} {c['fraction']:.0%}: {c['lru_minus_lfu_points']:+.2f}"
                          + (f" [{c['ci95'][0]:+.2f}, {c['ci95'][1]:+.2f}]" if c["ci95"][0] is not None else "")
                          for c in v["cells"])
        out.append(f"- {name} vs its LFU twin: LRU has the higher hit rate in {v['lru_wins']} of {v['n']} cells "
                   f"({v['ties']} ties; the 95% interval excludes 0 for LRU in {v['lru_wins_ci']}, for LFU in "
                   f"{v['lfu_wins_ci']}); LRU minus LFU, hit-rate points [95% block-bootstrap interval over "
                   f"{BLOCK}-token blocks]: {cells}")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--fractions", default="0.25,0.5", help="residencies (slots / experts per layer), comma-separated")
    ap.add_argument("--max-tokens", type=int, default=2048, help="evaluated (and calibration) tokens on the models")
    ap.add_argument("--models", default="mix,test", help="tiny reference models, comma-separated ('' for none)")
    ap.add_argument("--traces", default=str(ROOT.parent / "shared" / "data" / "traces"))
    ap.add_argument("--out-md", default=None)
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--report", default=None, metavar="NAME",
                    help="write reports/NAME.md and .json (runtime/tools/reports.py)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr, format="policy_families: %(message)s")
    try:
        for f in a.fractions.split(","):
            if not 0 < float(f) < 1:
                raise ValueError
    except ValueError:
        print(f"policy_families: error: --fractions = {a.fractions!r} must be numbers in (0, 1)", file=sys.stderr)
        sys.exit(2)
    t0 = time.perf_counter()
    load = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory() as d:
            rows = run(a, Path(d))
    except InputError as exc:
        print(f"policy_families: error: {exc}", file=sys.stderr)
        sys.exit(2)
    ver = verdict(rows)
    cmd = "python scripts/policy_families.py " + " ".join(sys.argv[1:])
    load_end = os.getloadavg()
    md = markdown(rows, ver, f"`{cmd}` ({time.perf_counter() - t0:.0f} s on {os.cpu_count()} cores, load average "
                  f"{load[0]:.2f} at the start, {load_end[0]:.2f} at the end):")
    print(md)
    if a.out_md:
        atomic_write(a.out_md, lambda tmp: Path(tmp).write_text(md))
    doc = {"command": cmd, "seconds": time.perf_counter() - t0, "load_average": [load, load_end],
           "pin_fraction": PIN, "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
           "lru_vs_lfu": ver}
    if a.out_json:
        atomic_write(a.out_json, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=2)))
    if a.report:
        from runtime.tools.reports import write_report

        write_report(a.report, "Policy families at equal device memory", doc, md, command=cmd)


if __name__ == "__main__":
    main()
