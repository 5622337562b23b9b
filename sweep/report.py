"""Sweep outputs from the ledger of trial rows: Pareto fronts, speed ratios, plots, summary.md.

Written under the sweep's `--out` folder (atomically, so a reader never sees half a file):
`pareto_<host>.csv` and `.parquet` (the host's front, fastest first), `speed_ratios.csv` (each
front policy against fetch-every-miss, host compute of misses and the all-resident bound, at
its capacity), `trials.csv` (every simulator trial), `pareto_<host>.png`, `pareto.png` (the
hosts' fronts together) and `summary.md`. The mass hypothesis check is `pearson` with a
percentile bootstrap interval over the re-measured policies that always fetch the first choice.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from runtime.errors import atomic_write
from sweep.space import PARAMETERS, policy_of

log = logging.getLogger(__name__)

RATIO_COLUMNS = ("speed_ratio_vs_fetch_all", "speed_ratio_vs_host_compute", "speed_ratio_vs_all_resident")


def policy_key(params: dict[str, Any]) -> str:
    """A canonical text for a policy at a capacity (joins simulator and emulation rows)."""
    return json.dumps({k: params.get(k) for k in PARAMETERS if params.get(k) is not None}, sort_keys=True)


def pareto_mask(points: np.ndarray) -> np.ndarray:
    """Non-dominated rows of `points` [n, m] for minimisation (equal points are all kept)."""
    n = len(points)
    keep = np.ones(n, dtype=bool)
    for i in range(n):
        if not keep[i]:
            continue
        dominated = np.all(points <= points[i], axis=1) & np.any(points < points[i], axis=1)
        if dominated.any():
            keep[i] = False
    return keep


def trials_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Simulator rows -> one flat table (params as columns)."""
    recs = []
    for r in rows:
        if r.get("fidelity") != "simulator":
            continue
        rec = {k: v for k, v in r.items() if k != "params"}
        rec.update({k: r["params"].get(k) for k in PARAMETERS if k in r["params"]})
        rec["policy_key"] = policy_key(r["params"])
        recs.append(rec)
    df = pd.DataFrame(recs)
    if not df.empty:
        df["time_per_token_ms"] = df.get("time_per_token_s", np.nan) * 1e3
    return df


def front(df: pd.DataFrame, host: str, objectives: tuple[str, ...]) -> pd.DataFrame:
    """The host's Pareto front over its ok trials, fastest first; one row per distinct policy."""
    d = df[(df["host"] == host) & (df["status"] == "ok")]
    if d.empty:
        return d
    d = d.drop_duplicates("policy_key")
    mask = pareto_mask(d[list(objectives)].to_numpy(dtype=float))
    return d[mask].sort_values(["time_per_token_s", "mass_per_token"]).reset_index(drop=True)


def pearson(x: np.ndarray, y: np.ndarray, n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """Pearson r with a 95% percentile bootstrap interval (resampling the points)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    n = len(x)
    out = {"n": n, "r": math.nan, "ci_low": math.nan, "ci_high": math.nan}
    if n < 3 or np.std(x) == 0 or np.std(y) == 0:
        return out
    out["r"] = float(np.corrcoef(x, y)[0, 1])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    xs, ys = x[idx], y[idx]
    xm, ym = xs - xs.mean(1, keepdims=True), ys - ys.mean(1, keepdims=True)
    den = np.sqrt((xm**2).sum(1) * (ym**2).sum(1))
    ok = den > 0
    rs = (xm * ym).sum(1)[ok] / den[ok]
    if len(rs):
        out["ci_low"], out["ci_high"] = (float(v) for v in np.percentile(rs, [2.5, 97.5]))
    return out


def _write_csv(df: pd.DataFrame, path: Path) -> None:
    atomic_write(path, lambda tmp: df.to_csv(tmp, index=False))


def _write_parquet(df: pd.DataFrame, path: Path) -> None:
    atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def _capacity_text(r: pd.Series) -> str:
    if "vram_budget_GiB" in r and pd.notna(r.get("vram_budget_GiB")):
        return f"{r['vram_budget_GiB']:.3g} GiB"
    return f"{r['capacity_fraction']:.3g}"


def _label(r: pd.Series) -> str:
    return f"{r['baseline']}" if isinstance(r.get("baseline"), str) else r["policy"]


def _plot(fronts: dict[str, pd.DataFrame], df: pd.DataFrame, path: Path, title: str, all_points: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (host, fr) in enumerate(fronts.items()):
        c = colors[i % len(colors)]
        if all_points:
            d = df[(df["host"] == host) & (df["status"] == "ok")]
            ax.scatter(d["mass_per_token"], d["time_per_token_ms"], s=12, alpha=0.35, color=c, label=f"{host} trials")
        if not fr.empty:
            st = fr.sort_values(["mass_per_token", "time_per_token_ms"])  # the staircase bounding the front
            ax.step(st["mass_per_token"], st["time_per_token_ms"], where="post", color=c, lw=1.5)
            ax.scatter(fr["mass_per_token"], fr["time_per_token_ms"], s=30, color=c, edgecolor="k",
                       label=f"{host} front ({len(fr)})")
        base = df[(df["host"] == host) & df["baseline"].notna() & (df["status"] == "ok")] if "baseline" in df else []
        for _, r in (base.iterrows() if len(base) else []):
            ax.scatter([r["mass_per_token"]], [r["time_per_token_ms"]], marker="x", color=c)
            if all_points or i == 0:
                ax.annotate(r["baseline"], (r["mass_per_token"], r["time_per_token_ms"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("substituted mass per token (simulator)")
    ax.set_ylabel("time per token (ms, simulated)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def write_tables(out: Path, rows: list[dict[str, Any]], hosts: list[str],
                 objectives: tuple[str, ...]) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """Rewrite trials.csv and the per-host Pareto tables (cheap; called as trials finish)."""
    df = trials_frame(rows)
    fronts = {}
    if df.empty:
        return df, fronts
    remeasured = _remeasured(rows)
    for host in hosts:
        fr = front(df, host, objectives)
        if not fr.empty and remeasured is not None:
            fr = fr.merge(remeasured, on="policy_key", how="left")
        engine = _engine(rows, host)
        if not fr.empty and engine is not None:
            fr = fr.merge(engine, on="policy_key", how="left")
        fronts[host] = fr
        _write_csv(fr, out / f"pareto_{host}.csv")
        _write_parquet(fr, out / f"pareto_{host}.parquet")
    _write_csv(df, out / "trials.csv")
    return df, fronts


def _remeasured(rows: list[dict[str, Any]]) -> pd.DataFrame | None:
    recs = []
    for r in rows:
        if r.get("fidelity") == "emulation" and r["status"] == "ok":
            recs.append({"policy_key": policy_key(r["params"]), "ppl_change_pct": r.get("ppl_change_pct"),
                         "ppl_ci_low": r.get("ppl_ci_low"), "ppl_ci_high": r.get("ppl_ci_high"),
                         "perplexity": r.get("perplexity"), "emulated_mass_per_token": r.get("mass_per_token")})
    if not recs:
        return None
    return pd.DataFrame(recs).drop_duplicates("policy_key", keep="last")


def _engine(rows: list[dict[str, Any]], host: str) -> pd.DataFrame | None:
    recs = [{"policy_key": policy_key(r["params"]), "engine_time_per_token_ms": 1e3 * r["time_per_token_s"]}
            for r in rows if r.get("fidelity") == "engine" and r["host"] == host and r["status"] == "ok"
            and r.get("time_per_token_s") is not None]
    return pd.DataFrame(recs).drop_duplicates("policy_key", keep="last") if recs else None


def policy_records(rows: list[dict[str, Any]], fronts: dict[str, pd.DataFrame], hosts: list[str]
                   ) -> list[dict[str, Any]]:
    """One record per (host, policy) that matters: a baseline, a front member or a re-measured policy,
    with its simulated figures and, where measured, the emulation's and the engine's (MLflow children)."""
    import hashlib

    emu = {policy_key(r["params"]): r for r in rows if r.get("fidelity") == "emulation" and r["status"] == "ok"}
    eng = {(r["host"], policy_key(r["params"])): r for r in rows
           if r.get("fidelity") == "engine" and r["status"] == "ok"}
    out = []
    for host in hosts:
        on_front = set(fronts[host]["policy_key"]) if host in fronts and not fronts[host].empty else set()
        seen = set()
        for r in rows:
            if r.get("fidelity") != "simulator" or r["host"] != host:
                continue
            pk = policy_key(r["params"])
            if pk in seen or not (r.get("baseline") or pk in on_front or pk in emu or (host, pk) in eng):
                continue
            seen.add(pk)
            rec = {k: v for k, v in r.items() if k not in ("key", "number", "node", "pid")}
            rec.update(key=f"{host}:{hashlib.sha1(pk.encode()).hexdigest()[:16]}", on_front=pk in on_front,
                       policy=r.get("policy") or policy_of(r["params"]).label())
            if pk in emu:
                e = emu[pk]
                rec.update(fidelity="emulation", **{k: e.get(k) for k in (
                    "perplexity", "exact_perplexity", "ppl_change_pct", "ppl_ci_low", "ppl_ci_high")},
                    emulated_mass_per_token=e.get("mass_per_token"))
            if (host, pk) in eng:
                rec.update(fidelity="engine", engine_time_per_token_s=eng[(host, pk)].get("time_per_token_s"))
            out.append(rec)
    return out


def mass_hypothesis(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Pearson r (substituted mass vs perplexity change) over re-measured first-choice-fetching policies."""
    pts = [(r["mass_per_token"], r["ppl_change_pct"]) for r in rows
           if r.get("fidelity") == "emulation" and r["status"] == "ok"
           and policy_of(r["params"]).fetches_first_choice and r.get("ppl_change_pct") is not None]
    if not pts:
        return pearson(np.array([]), np.array([]))
    x, y = np.array(pts).T
    return pearson(x, y)


def speed_ratios(fronts: dict[str, pd.DataFrame]) -> pd.DataFrame:
    recs = []
    for host, fr in fronts.items():
        for _, r in fr.iterrows():
            recs.append({"host": host, "policy": _label(r), "capacity": _capacity_text(r),
                         "time_per_token_ms": r["time_per_token_ms"], "mass_per_token": r["mass_per_token"],
                         **{c: r[c] for c in RATIO_COLUMNS}})
    return pd.DataFrame(recs)


def host_table_text(host: str, fr: pd.DataFrame, gpu: str = "") -> str:
    """A Markdown table of a host's front."""
    has_ppl = "ppl_change_pct" in fr and fr["ppl_change_pct"].notna().any()
    has_engine = "engine_time_per_token_ms" in fr and fr["engine_time_per_token_ms"].notna().any()
    head = "| policy | capacity | ms/token | x fetch-all | x host-compute | x all-resident | mass/token |"
    sep = "|---|---|---|---|---|---|---|"
    if has_engine:
        head += " engine ms/token |"
        sep += "---|"
    if has_ppl:
        head += " ppl change % [95% CI] |"
        sep += "---|"
    lines = [f"### {host}" + (f" ({gpu})" if gpu else ""), "", head, sep]
    for _, r in fr.iterrows():
        line = (f"| {_label(r)} | {_capacity_text(r)} | {r['time_per_token_ms']:.3f} | "
                f"{r['speed_ratio_vs_fetch_all']:.2f} | {r['speed_ratio_vs_host_compute']:.2f} | "
                f"{r['speed_ratio_vs_all_resident']:.2f} | {r['mass_per_token']:.4f} |")
        if has_engine:
            v = r.get("engine_time_per_token_ms")
            line += f" {v:.3f} |" if pd.notna(v) else " |"
        if has_ppl:
            line += (f" {r['ppl_change_pct']:+.2f} [{r['ppl_ci_low']:+.2f}, {r['ppl_ci_high']:+.2f}] |"
                     if pd.notna(r.get("ppl_change_pct")) else " |")
        lines.append(line)
    return "\n".join(lines)


def write_report(out: Path, rows: list[dict[str, Any]], hosts: list[str], objectives: tuple[str, ...],
                 meta: dict[str, Any]) -> dict[str, Any]:
    """Every output file; returns their paths, the fronts and the mass-hypothesis figures."""
    df, fronts = write_tables(out, rows, hosts, objectives)
    paths: dict[str, Any] = {"trials": out / "trials.csv"}
    sr = speed_ratios(fronts)
    _write_csv(sr, out / "speed_ratios.csv")
    paths["speed_ratios"] = out / "speed_ratios.csv"
    for host in hosts:
        paths[f"pareto_{host}"] = out / f"pareto_{host}.csv"
        if not df.empty:
            _plot({host: fronts.get(host, df.iloc[:0])}, df, out / f"pareto_{host}.png", f"{host}: simulated sweep",
                  all_points=True)
            paths[f"plot_{host}"] = out / f"pareto_{host}.png"
    if not df.empty:
        _plot(fronts, df, out / "pareto.png", "Pareto fronts by host", all_points=False)
    paths["plot"] = out / "pareto.png"
    hyp = mass_hypothesis(rows)
    summary = _summary(df, fronts, hyp, meta, paths)
    atomic_write(out / "summary.md", lambda tmp: Path(tmp).write_text(summary))
    paths["summary"] = out / "summary.md"
    return {"paths": paths, "fronts": fronts, "hypothesis": hyp, "trials": df}


def _summary(df: pd.DataFrame, fronts: dict[str, pd.DataFrame], hyp: dict[str, float], meta: dict[str, Any],
             paths: dict[str, Any]) -> str:
    lines = [f"# Sweep {meta.get('name', '')}", ""]
    lines.append(f"- trace: `{meta.get('trace')}`" + (f", model: `{meta['model']}`" if meta.get("model") else ""))
    lines.append(f"- objectives: {', '.join(meta.get('objectives', []))} (all minimised; quality = substituted "
                 f"mass per token at simulator fidelity)")
    lines.append(f"- sampler: {meta.get('sampler')}, {meta.get('trials')} trials per host after the baselines")
    if meta.get("mlflow_uri"):
        lines.append(f"- MLflow: `{meta['mlflow_uri']}`, parent run `{meta.get('parent_run_id')}`")
    lines.append("")
    if not df.empty:
        lines += ["| host | trials ok | failed | front size |", "|---|---|---|---|"]
        for host, fr in fronts.items():
            d = df[df["host"] == host]
            lines.append(f"| {host} | {(d['status'] == 'ok').sum()} | {(d['status'] != 'ok').sum()} | {len(fr)} |")
        lines.append("")
    lines += ["## Pareto fronts and speed ratios", "",
              "Speed ratios compare each policy with fetch-every-miss, with computing misses on the host, "
              "and with the all-resident bound, on the same host at the same capacity (>1 = faster).", ""]
    for host, fr in fronts.items():
        lines += [host_table_text(host, fr, meta.get("gpus", {}).get(host, "")), ""]
    lines += ["## Mass hypothesis", ""]
    if math.isnan(hyp["r"]):
        lines.append(f"Not enough re-measured policies that fetch the first choice ({hyp['n']} with distinct "
                     f"values; 3 needed) for a correlation.")
    else:
        lines.append(f"Pearson r between substituted mass per token and perplexity change (exact emulation) over "
                     f"{hyp['n']} re-measured policies that always fetch the first choice: **r = {hyp['r']:.3f}** "
                     f"(95% bootstrap interval [{hyp['ci_low']:.3f}, {hyp['ci_high']:.3f}]). The paper reports "
                     f"r ~ 0.92 on Qwen3-Next-80B-A3B.")
    for note in meta.get("notes", []):
        lines += ["", f"- {note}"]
    lines += ["", "## Files", ""]
    lines += [f"- `{p}`" for k, p in paths.items() if k != "summary"]
    return "\n".join(lines) + "\n"
