"""The sweep's plots: ms/token against perplexity change (with intervals) and the mass view, per host.

`plot_panels` draws one figure from per-host panels (`sweep.report.write_report` builds them: the
measured full-budget rows, the front, the screened trials, the screening front, the offline bounds,
llama.cpp's two baselines and the answer's policy keys) and writes it atomically as PNG (matplotlib's Agg backend).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from runtime.core.errors import atomic_write

logger = logging.getLogger(__name__)


def label(r: pd.Series) -> str:
    """A row's name: its `label` (sweep/report.py `trials_frame`: the baseline name of its policy on any host,
    else its policy), else its baseline's name when it is one, else its policy."""
    if isinstance(r.get("label"), str):
        return r["label"]
    return f"{r['baseline']}" if isinstance(r.get("baseline"), str) else r["policy"]


def edge_limits(panels: dict[str, dict[str, Any]], budgets: list[float]) -> tuple[float, float] | None:
    """The perplexity axis' limits when a measured policy lies far beyond the budgets (its interval
    reaches past 4x the largest): linear from just left of the measured points to 3x the largest
    budget, so the budgets' region fills a third of the panel; None when everything fits as it is."""
    ms = [p["measured"] for p in panels.values() if not p["measured"].empty]
    if not budgets or not ms:
        return None
    lo_all = float(min(np.nanmin(m["ppl_ci_low"].to_numpy(dtype=float)) for m in ms))
    hi_all = float(max(np.nanmax(np.abs(m["ppl_ci_high"].to_numpy(dtype=float))) for m in ms))
    b = max(budgets)
    if not hi_all > 4 * b:
        return None
    hi = 3 * b
    return max(min(-0.25 * b, lo_all - 0.1 * b), -hi), hi


def plot_panels(panels: dict[str, dict[str, Any]], path: Path, title: str, budgets: list[float]) -> str:
    """Left: ms/token against perplexity change (interval bars, front drawn, baselines labelled) over
    the full-budget policies; right: the screening fidelity's mass view. One colour per host. Offline bounds
    and llama.cpp's two baselines ("llama.cpp LRU cache", "llama.cpp -ncmoe N") are labelled horizontal lines.

    A policy far beyond the budgets would squeeze their region into a few pixels: then the axis ends
    at 3x the largest budget (`edge_limits`) and such a policy is drawn at the edge as a triangle
    pointing out, labelled with its perplexity change. Returns "linear" or "clipped at X%"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lim = edge_limits(panels, budgets)

    def clip(v: Any) -> Any:
        return v if lim is None else np.clip(np.asarray(v, dtype=float), lim[0], lim[1])

    one = len(panels) == 1
    edge_n = 0
    for i, (host, p) in enumerate(panels.items()):
        c = colors[i % len(colors)]
        m, fr, trials, scr = p["measured"], p["front"], p["trials"], p["screening"]
        trials = trials[trials["bound"].isna()] if "bound" in trials else trials
        for j, (_, b) in enumerate(p.get("bounds", pd.DataFrame()).iterrows()):
            for a in (ax, bx):  # an offline bound: a line at its time, not a point among the policies
                a.axhline(b["time_per_token_ms"], color=c, ls=(0, (4, 2 + 2 * j)), lw=0.9)
                a.annotate(f"bound ({'with' if 'prefetch' in b['bound'] else 'no'} prefetch), {b['bound']}"
                           + (f" ({host})" if not one else "") +
                           f" {b['time_per_token_ms']:.3f} ms", (0.01 + 0.33 * (j % 3), b["time_per_token_ms"]),
                           xycoords=("axes fraction", "data"), fontsize=7, color=c, xytext=(0, 2),
                           textcoords="offset points")
        for j, (_, b) in enumerate(p.get("llamacpp", pd.DataFrame()).iterrows()):
            for a in (ax, bx):  # llama.cpp's two baselines at the same memory: a labelled line at each one's time
                a.axhline(b["time_per_token_ms"], color=c, ls="-.", lw=1.0)
                a.annotate(f"{b['name']}" + (f" ({host})" if not one else "") + f" {b['time_per_token_ms']:.3f} ms",
                           (0.99 - 0.33 * (j % 2), b["time_per_token_ms"]), xycoords=("axes fraction", "data"),
                           fontsize=7, color=c, ha="right", xytext=(0, 2), textcoords="offset points")
        if not m.empty:
            x = m["ppl_change_pct"].to_numpy(dtype=float)
            inside = np.ones(len(m), bool) if lim is None else (x >= lim[0]) & (x <= lim[1])
            mi = m[inside]
            if not mi.empty:
                lo_e = clip(mi["ppl_ci_low"])
                hi_e = clip(mi["ppl_ci_high"])
                err = np.vstack([mi["ppl_change_pct"] - lo_e, hi_e - mi["ppl_change_pct"]])
                ax.errorbar(mi["ppl_change_pct"], mi["time_per_token_ms"], xerr=np.clip(err, 0, None), fmt="o", ms=4,
                            color=c, alpha=0.45 if not one else 0.6, elinewidth=0.8, capsize=2,
                            label=f"{host}: measured ({len(m)})")
            for _, r in m[~inside].iterrows():  # far off: at the edge, pointing out, with its value
                right = r["ppl_change_pct"] > 0
                ax.scatter([lim[1] if right else lim[0]], [r["time_per_token_ms"]], marker=">" if right else "<",
                           s=40, color=c, edgecolor="k", zorder=3, clip_on=False)
                ax.annotate(f"{r['ppl_change_pct']:+.3g}%", (lim[1] if right else lim[0], r["time_per_token_ms"]),
                            fontsize=7, color=c, ha="right" if right else "left", va="center",
                            xytext=(-7 if right else 7, 0), textcoords="offset points",
                            annotation_clip=False)
                edge_n += 1
            if not fr.empty:
                st = fr.sort_values(["ppl_change_pct", "time_per_token_ms"])
                ax.step(clip(st["ppl_change_pct"]), st["time_per_token_ms"], where="post", color=c, lw=1.5)
                ax.scatter(clip(fr["ppl_change_pct"]), fr["time_per_token_ms"], s=36, color=c, edgecolor="k",
                           zorder=3, label=f"{host}: front ({len(fr)})")
            for _, r in m[m["baseline"].notna()].iterrows() if "baseline" in m else []:
                if one or i == 0:
                    ax.annotate(r["baseline"], (float(clip(r["ppl_change_pct"])), r["time_per_token_ms"]),
                                fontsize=7, xytext=(3, 3), textcoords="offset points",
                                ha="right" if lim is not None and r["ppl_change_pct"] > lim[1] else "left")
            picked = m[m["policy_key"].isin(p.get("answer_keys", ()))]
            for _, r in picked.iterrows():  # the answer's policies, labelled in bold
                px = float(clip(r["ppl_change_pct"]))
                ax.scatter([px], [r["time_per_token_ms"]], s=90, facecolor="none", edgecolor=c,
                           lw=1.6, zorder=4)
                ax.annotate(f"answer: {label(r)}", (px, r["time_per_token_ms"]), fontsize=7,
                            fontweight="bold", color=c, xytext=(4, -10), textcoords="offset points")
        if one and not trials.empty:
            bx.scatter(trials["mass_per_token"], trials["time_per_token_ms"], s=10, alpha=0.3, color=c,
                       label=f"{host}: screened ({len(trials)})")
        if not scr.empty:
            bx.scatter(scr["mass_per_token"], scr["time_per_token_ms"], s=24, color=c, edgecolor="k",
                       label=f"{host}: screening front ({len(scr)})")
        base = trials[trials["baseline"].notna()] if "baseline" in trials and not trials.empty else trials.iloc[:0]
        for _, r in base.iterrows():
            bx.scatter([r["mass_per_token"]], [r["time_per_token_ms"]], marker="x", color=c)
            if one or i == 0:
                bx.annotate(r["baseline"], (r["mass_per_token"], r["time_per_token_ms"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
    for b in budgets:
        ax.axvline(b, color="grey", ls=":", lw=0.8)
    if budgets:  # the budgets' region shaded: where the answer lives
        ax.axvspan(min(0.0, lim[0] if lim else 0.0), max(budgets), color="grey", alpha=0.07, lw=0)
    if lim is not None:
        ax.set_xlim(*lim)
    ax.set_xlabel("perplexity change % (exact emulation, full budget)\nbars: 95% CI; dotted: budgets (shaded: within)"
                  + (f"; triangles: beyond {lim[1]:g}%, value beside" if lim is not None and edge_n else ""))
    ax.set_ylabel("time per token (ms, simulated)")
    ax.set_title(f"{title}: speed vs perplexity")
    bx.set_xlabel("substituted mass per token (simulator)")
    bx.set_ylabel("time per token (ms, simulated)")
    bx.set_title("screening fidelity (mass ranks only within a family)")
    for a in (ax, bx):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return "linear" if lim is None else f"clipped at {lim[1]:g}%"
