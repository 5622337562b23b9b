"""Admission against the cache size: what background admission (`beta` 0.5) does to the substituted mass, the hit
rate and the churn of the cache as slots per top-k (C/k) grow, on a routing trace (the simulator's replay).

Two pairs differ only in admission: Quality-First against the 0.15 rule, Speed-First against first-choice
(docs/policies.md). `curve` replays the four on one trace at each C/k of `CK_GRID` that the trace's experts allow,
with a warm start from calibration ids (the recorded model's calibration routing, or a real trace's held-out last
20%, as `held-out` means everywhere: runtime/backends/resolve.py); `trace_curve` does it for a trace file;
`regret` follows each admission's evicted and admitted experts forward (is the evicted one wanted first?);
`effects` reads the pairs' differences off a curve; `starts_helping` the smallest C/k from which admission lowers
the mass at every larger C/k tried; `plot` draws the curves and the model's perplexity effects (PNG).

`python scripts/findings.py --admission-only` runs it on the real traces alone (reports/findings/admission.md); a findings
run adds the reference model's routing and perplexity to its page. `python -m runtime.tools.findings.admission
--model demo` (a tiny model's name or a checkpoint folder with eval.txt and calib.txt) prints the same table for
that model's exact routing of its eval text (e.g. the demo model, where admission costs perplexity at C/k = 2).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from runtime.core.policy import PRESETS
from runtime.core.spec import HELD_OUT_FRACTION
from runtime.tools.findings.stats import fmt_ci

log = logging.getLogger(__name__)

PAIRS = (("quality-first", "rule-0.15"), ("speed-first", "first-choice"))  # (with admission, without)
CK_GRID = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.8, 16.0, 24.0)  # slots per top-k; 12.8: the paper's


def curve(trace: Any, calib_ids: np.ndarray | None, grid: tuple[float, ...] = CK_GRID,
          calib_valid: np.ndarray | None = None) -> list[dict[str, Any]]:
    """Per C/k of `grid` with k <= C < E (each C once): per policy of PAIRS, the substituted mass per token, the
    substituted share of calls, the hit rate and the admissions per token and layer, from the simulator's replay
    warm-started from `calib_ids` [T_c, L, k] (valid cells `calib_valid` [T_c, L]); for the policies with
    admission also `regret` (which experts the admissions evict)."""
    from runtime.backends.simulate import replay
    from runtime.tools.findings.experiments import caps_and_warm

    out, seen = [], set()
    for ck in grid:
        c = int(round(ck * trace.k))
        if not trace.k <= c < trace.E or c in seen:
            continue
        seen.add(c)
        caps, init = caps_and_warm(trace, calib_ids, c / trace.E, calib_valid)
        point: dict[str, Any] = {"slots": int(caps[0]), "c_over_k": float(caps[0]) / trace.k}
        for name in {n for pair in PAIRS for n in pair}:
            t = replay(trace, PRESETS[name], caps, init).cache.counter_totals()
            calls = max(t["calls"], 1)
            point[name] = {"mass_per_token": t["substituted_mass"] / trace.T,
                           "substituted_share": (t["substitutions"] + t["drops"]) / calls,
                           "hit_rate": t["hits"] / calls,
                           "admissions_per_token_layer": t["admissions"] / (trace.T * trace.L)}
        for name, _ in PAIRS:  # the policies with admission: which experts their admissions evict
            point[name]["regret"] = regret(trace, name, caps, init)
        out.append(point)
    return out


def regret(trace: Any, policy: str, caps: np.ndarray, init: Any) -> dict[str, float]:
    """How often admission evicts the wrong expert: `policy` (one with admission) replayed layer by layer on `trace`
    (capacities `caps`, warm start `init`), each applied admission's evicted expert and the admitted one followed
    forward. An admission is a *regret* when the tokens route to the evicted expert before they route to the
    admitted one (from the admitting token on: admissions apply before the token's own calls); *unused* when the
    admitted expert is not routed to before it is evicted itself. {"admissions", "regret_share", "unused_share",
    "regret_per_token_layer"}. The slots' contents are followed from the warm start through the kernel's own logs
    (admissions, then each call's fetch), and every hit is checked against them."""
    from runtime.core.kernel import FETCH, HIT, PolicyCache

    cache = PolicyCache(PRESETS[policy], trace.E, trace.k, caps, init)
    n_adm = n_regret = n_unused = 0
    for l_ in range(trace.L):
        occ = cache.slot_expert[l_].copy()  # [C_max] expert per slot, -1 empty
        ids, valid = trace.topk_ids[:, l_], trace.valid[:, l_]  # [T, k], [T]
        r = cache.step(l_, ids, trace.topk_weights[:, l_], trace.ranking[:, l_], valid, logs=True, decisions=True)
        used = np.full((trace.E,), trace.T, np.int64)  # walking back: each expert's next routed token from t on
        nxt_use = np.empty((trace.T, trace.E), np.int64) if len(r.admitted) else None
        if nxt_use is not None:
            for t in range(trace.T - 1, -1, -1):
                if valid[t]:
                    used[ids[t]] = t
                nxt_use[t] = used
        adm = r.admitted[np.argsort(r.admitted[:, 0], kind="stable")]  # [n, 3] (token, expert, slot)
        last_admit: dict[int, tuple[int, int]] = {}  # slot -> (expert admitted there, token) while it stays
        a = 0
        for t in range(trace.T):
            while a < len(adm) and adm[a, 0] == t:
                e, sl = int(adm[a, 1]), int(adm[a, 2])
                v = int(occ[sl])
                if sl in last_admit and last_admit[sl][0] == v:  # an admitted expert evicted: was it used?
                    n_unused += int(nxt_use[last_admit[sl][1], v] >= t)
                n_adm += 1
                if v >= 0:
                    n_regret += int(nxt_use[t, v] < nxt_use[t, e])
                occ[sl] = e
                last_admit[sl] = (e, t)
                a += 1
            if not valid[t]:
                continue
            for j in range(trace.k):
                kind, srv, sl = int(r.kind[t, j]), int(r.served[t, j]), int(r.slot[t, j])
                if kind == HIT and occ[sl] != srv:
                    raise RuntimeError(f"admission regret: layer {l_} token {t}: hit on expert {srv} in slot {sl}, "
                                       f"which holds {occ[sl]} by the logs")
                if kind == FETCH:
                    if sl in last_admit and last_admit[sl][0] == occ[sl]:
                        n_unused += int(nxt_use[last_admit[sl][1], occ[sl]] >= t)
                        del last_admit[sl]
                    occ[sl] = srv
    return {"admissions": n_adm, "regret_share": n_regret / max(n_adm, 1), "unused_share": n_unused / max(n_adm, 1),
            "regret_per_token_layer": n_regret / (trace.T * trace.L)}


def trace_curve(path: str | Path, grid: tuple[float, ...] = CK_GRID) -> dict[str, Any]:
    """`curve` of a trace file: its first 80% evaluated, its last 20% the calibration (held-out)."""
    from runtime.formats.trace import load_trace

    tr = load_trace(path)
    cut = int(round(tr.T * (1 - HELD_OUT_FRACTION)))
    cal = tr.slice_tokens(cut, tr.T)
    return {"source": Path(path).stem, "experts": tr.E, "top_k": tr.k, "layers": tr.L, "tokens": cut,
            "warm_start": "held-out (last 20% of the trace)",
            "points": curve(tr.slice_tokens(0, cut), cal.topk_ids, grid, cal.valid)}


def effects(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point and pair: the admission effect (with minus without) on mass per token, hit rate and share."""
    out = []
    for p in points:
        row: dict[str, Any] = {"c_over_k": p["c_over_k"], "slots": p["slots"]}
        for a, b in PAIRS:
            row[f"{a} - {b}"] = {k: p[a][k] - p[b][k] for k in ("mass_per_token", "hit_rate", "substituted_share")}
            row[f"{a} - {b}"]["admissions_per_token_layer"] = p[a]["admissions_per_token_layer"]
        out.append(row)
    return out


def starts_helping(points: list[dict[str, Any]], pair: tuple[str, str]) -> float | None:
    """The smallest C/k of `points` from which admission lowers the mass per token at every larger C/k tried
    (None: at no C/k, or not at the largest)."""
    a, b = pair
    lower = [p[a]["mass_per_token"] < p[b]["mass_per_token"] for p in points]
    if not lower or not lower[-1]:
        return None
    i = len(lower)
    while i > 0 and lower[i - 1]:
        i -= 1
    return points[i]["c_over_k"]


def plot(curves: dict[str, list[dict[str, Any]]], model_ppl: list[dict[str, Any]], out: str | Path) -> None:
    """PNG: admission's effect on the substituted mass against C/k per source (left; relative to the policy without
    admission), and on the reference model's perplexity per findings column (right; points with 95% intervals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if model_ppl else 1, figsize=(11, 4.2) if model_ppl else (6.5, 4.2), squeeze=False)
    axes = axes[0]
    styles = {PAIRS[0]: "-", PAIRS[1]: "--"}
    for src, pts in curves.items():
        x = [p["c_over_k"] for p in pts]
        color = None
        for pair in PAIRS:
            a, b = pair
            y = [(p[a]["mass_per_token"] / p[b]["mass_per_token"] - 1) * 100 if p[b]["mass_per_token"] > 0
                 else math.nan for p in pts]
            (line,) = axes[0].plot(x, y, styles[pair], marker="o", ms=3, color=color,
                                   label=f"{src}: {'QF vs rule' if a == 'quality-first' else 'SF vs FC'}")
            color = line.get_color()
    axes[0].axhline(0, color="k", lw=0.8)
    axes[0].axvline(12.8, color="grey", lw=0.8, ls=":")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("slots per top-k (C/k); dotted: the paper's 12.8")
    axes[0].set_ylabel("substituted mass with admission, change %")
    axes[0].set_title("admission's effect on substituted mass (simulator)")
    axes[0].legend(fontsize=6.5)
    for j, key in enumerate(("qf_minus_rule", "sf_minus_fc") if model_ppl else ()):
        xs = [m["c_over_k"] * (1 + 0.03 * j) for m in model_ppl]
        ys = [m[key]["point"] for m in model_ppl]
        err = [[y - m[key]["ci95"][0] for y, m in zip(ys, model_ppl, strict=True)],
               [m[key]["ci95"][1] - y for y, m in zip(ys, model_ppl, strict=True)]]
        axes[1].errorbar(xs, ys, yerr=err, fmt="o", capsize=3,
                         label=("QF - rule" if j == 0 else "SF - FC") + " (equal slots)")
        em = [m for m in model_ppl if m.get("equal_memory")]
        if em:  # the same at equal device memory: hollow markers, shifted right
            xs = [m["c_over_k"] * (1.06 + 0.03 * j) for m in em]
            ys = [m["equal_memory"][key]["point"] for m in em]
            err = [[y - m["equal_memory"][key]["ci95"][0] for y, m in zip(ys, em, strict=True)],
                   [m["equal_memory"][key]["ci95"][1] - y for y, m in zip(ys, em, strict=True)]]
            axes[1].errorbar(xs, ys, yerr=err, fmt="o", mfc="none", capsize=3,
                             label=("QF - rule" if j == 0 else "SF - FC") + " (equal memory)")
    if model_ppl:
        axes[1].axhline(0, color="k", lw=0.8)
        axes[1].set_xscale("log")
        axes[1].set_xlabel("slots per top-k (C/k)")
        axes[1].set_ylabel("perplexity change, points")
        axes[1].set_title("reference model: admission's effect on perplexity (emulation)")
        axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)



def model_curve(model: str | Path, max_tokens: int | None = 16384,
                grid: tuple[float, ...] = CK_GRID) -> dict[str, Any]:
    """`curve` of a checkpoint's exact routing of its eval.txt (warm start: its calibration routing), as a source of
    the findings page's admission section."""
    import tempfile

    from runtime.backends import hfmodel
    from runtime.tools.findings.experiments import Setup, exact_trace

    model = Path(model)
    with tempfile.TemporaryDirectory(prefix="admission-") as tmp:
        s = Setup(model, model / "eval.txt", {}, 0.25, max_tokens, 320, 64, 1, 1, 0, Path(tmp), hfmodel.load(model))
        trace, calib_ids, _ = exact_trace(s, s.eval_text)
    return {"source": f"{model.name} (recorded exact routing of eval.txt)", "experts": trace.E, "top_k": trace.k,
            "layers": trace.L, "tokens": trace.T, "warm_start": "calibration text",
            "points": curve(trace, calib_ids, grid)}


def _pair_tag(a: str) -> str:
    return "QF vs the rule" if a == "quality-first" else "SF vs first-choice"


def admission_lines(res: dict[str, Any]) -> list[str]:
    """Admission against C/k: per source the mass effect of each pair at each C/k, where it starts to help, the
    churn behind it, and the reference model's perplexity effect per column (all from `res["admission"]`)."""
    adm = res.get("admission")
    if not adm:
        return []
    out = ["## Admission against the cache size", "",
           "Background admission (beta 0.5) against the same policy without it: Quality-First (QF) against the 0.15 "
           "rule, Speed-First (SF) against first-choice. Substituted mass per token from the simulator's replay of "
           "each routing at each C/k (slots per top-k), with its warm start; churn: admissions per token and layer "
           "as a share of the slots; regret: the share of admissions whose evicted expert the following tokens route "
           "to before the admitted one; unused: the share whose admitted expert is evicted again before any token "
           f"routes to it (`admission.regret`). The plot: {adm.get('plot', 'reports/findings/admission_ck.png')}.", ""]
    sources = [x for x in (adm.get("model"), *adm.get("traces", [])) if x]
    for src in sources:
        pts = src["points"]
        out += [f"**{src['source']}** ({src['experts']} experts, top-{src['top_k']}, {src['layers']} layers, "
                f"{src['tokens']} tokens; warm start: {src['warm_start']})", "",
                "| C/k | slots | " + " | ".join(f"{_pair_tag(a)}: mass change | hit-rate change (points) | "
                                                 "admissions per token-layer / slots | admissions: regret / unused"
                                                 for a, _ in PAIRS) + " |",
                "|---|---|" + "---|---|---|---|" * len(PAIRS)]
        for p in pts:
            cells = [f"{p['c_over_k']:.2f}", str(p["slots"])]
            for a, b in PAIRS:
                mb = p[b]["mass_per_token"]
                rel = f"{(p[a]['mass_per_token'] / mb - 1) * 100:+.1f}%" if mb > 0 else "n/a"
                reg = p[a].get("regret")
                cells += [f"{rel} ({mb:.3f} -> {p[a]['mass_per_token']:.3f})",
                          f"{(p[a]['hit_rate'] - p[b]['hit_rate']) * 100:+.2f}",
                          f"{p[a]['admissions_per_token_layer'] / p['slots']:.2%}",
                          f"{reg['regret_share']:.0%} / {reg['unused_share']:.0%}" if reg else "n/a"]
            out.append("| " + " | ".join(cells) + " |")
        helps = []
        for pair in PAIRS:
            x = starts_helping(pts, pair)
            helps.append(f"{_pair_tag(pair[0])}: " + (f"from C/k = {x:.2f} on (every C/k tried)" if x is not None
                                                       else "not at the largest C/k tried"))
        out += ["", "Admission lowers the substituted mass " + "; ".join(helps) + "."]
        for a, b in PAIRS:
            hurt = [p for p in pts if p[a]["mass_per_token"] > p[b]["mass_per_token"]]
            if not hurt:
                continue
            line = (f"Where {_pair_tag(a)} raises the mass (C/k " + ", ".join(f"{p['c_over_k']:.2f}" for p in hurt)
                    + "), the hit rate changes by " + ", ".join(
                        f"{(p[a]['hit_rate'] - p[b]['hit_rate']) * 100:+.2f}" for p in hurt)
                    + " points while each token's admissions replace " + ", ".join(
                        f"{p[a]['admissions_per_token_layer'] / p['slots']:.1%}" for p in hurt) + " of a layer's slots")
            helped = [p for p in pts if p[a]["mass_per_token"] < p[b]["mass_per_token"] and p[a].get("regret")]
            if all(p[a].get("regret") for p in hurt) and helped:
                rh = [p[a]["regret"]["regret_share"] for p in hurt]
                rl = [p[a]["regret"]["regret_share"] for p in helped]
                line += (f"; there {min(rh):.0%}-{max(rh):.0%} of its admissions are regrets, against "
                         f"{min(rl):.0%}-{max(rl):.0%} where it lowers the mass")
            out.append(line + ".")
        out.append("")
    mp = adm.get("model_ppl") or []
    if mp:
        em = [m for m in mp if m.get("equal_memory")]  # a result from before the rows at equal memory has none
        out += ["Reference model, perplexity (emulation, per findings column; points, 95% interval)"
                + (", at equal slots: " if em else ": ") + "; ".join(
                    f"C/k = {m['c_over_k']:.1f}: QF - rule {m['qf_minus_rule']['point']:+.2f} "
                    f"{fmt_ci(*m['qf_minus_rule']['ci95'])}, SF - first-choice {m['sf_minus_fc']['point']:+.2f} "
                    f"{fmt_ci(*m['sf_minus_fc']['ci95'])}" for m in mp) + ".", ""]
        if em:
            out += ["At equal device memory (QF and SF with a pool of copy buffers, at the slots the column's budget "
                    "leaves them; the rule and first-choice at the column's): " + "; ".join(
                        f"C/k = {m['c_over_k']:.1f} ({e['copy_buffers']} buffer(s) per layer, QF "
                        f"{e['slots']['quality-first']} slots, SF {e['slots']['speed-first']}, the rule "
                        f"{e['slots']['rule-0.15']}): QF - rule {e['qf_minus_rule']['point']:+.2f} "
                        f"{fmt_ci(*e['qf_minus_rule']['ci95'])}, SF - first-choice {e['sf_minus_fc']['point']:+.2f} "
                        f"{fmt_ci(*e['sf_minus_fc']['ci95'])}" for m in em for e in (m["equal_memory"],)) + ".", ""]
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m runtime.tools.findings.admission --model NAME|DIR [--max-tokens N] [--ck X ...]`: the admission
    table of one model's routing (Markdown, as on the findings page)."""
    from runtime.core.errors import ArgumentParser, InputError
    from runtime.core.threads import configure
    from runtime.tools.tinymodel import SPECS, ensure_model

    configure()
    p = ArgumentParser(prog="python -m runtime.tools.findings.admission", description=main.__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help=f"a tiny model's name ({', '.join(SPECS)}) or a checkpoint folder")
    p.add_argument("--max-tokens", type=int, default=16384, help="evaluated tokens of eval.txt")
    p.add_argument("--ck", type=float, action="append", default=None, help="slots per top-k (repeatable)")
    a = p.parse_args(argv)
    if a.max_tokens < 512:
        raise InputError(f"--max-tokens = {a.max_tokens} must be >= 512")
    if any(not x > 0 for x in a.ck or ()):
        raise InputError(f"--ck = {a.ck}: each must be > 0")
    folder = ensure_model(a.model, progress=False) if a.model in SPECS else Path(a.model)
    if not (folder / "config.json").is_file() or not (folder / "eval.txt").is_file():
        raise InputError(f"--model {a.model}: not a tiny model's name nor a folder with config.json and eval.txt")
    src = model_curve(folder, a.max_tokens, tuple(a.ck) if a.ck else CK_GRID)
    print("\n".join(admission_lines({"admission": {"model": src, "plot": "(none: this command draws no plot)"}})))


if __name__ == "__main__":
    from runtime.core.errors import cli_main

    cli_main(main)
