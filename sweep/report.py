"""Sweep outputs from the ledger of trial rows: the answer, perplexity fronts, plots, summary.md.

Written under the sweep's `--out` folder (atomically, so a reader never sees half a file):

- `answer.csv`: per host and perplexity budget (`ppl_budgets_pct`), the fastest policy whose upper
  95% bound of the perplexity change stays within the budget, with its speed ratio over
  fetch-every-miss (at its capacity): the question the sweep answers;
- `pareto_<host>.csv` / `.parquet`: the host's front in (time per token, perplexity change) over the
  policies emulated at the full budget, fastest first (every row has `ppl_change_pct`,
  `ppl_ci_low`, `ppl_ci_high`; `engine_time_per_token_ms` on calibrated hosts); without emulation,
  the screening front (`front_kind` says which);
- `screening_<host>.csv`: the simulator's (time, mass) front, per family (policies that always fetch
  the first choice / that can substitute it: mass ranks only within a family);
- `speed_ratios.csv`, `trials.csv`, `pareto_<host>.png` (perplexity panel and mass panel),
  `pareto.png` (the hosts together) and `summary.md` (the answer first).

Offline bounds are not answers: a policy that needs the future (prefetch `oracle`, eviction
`belady`; `is_bound`) is never in the answer, a front, the ladder's candidates or the speed-ratio
table. The fastest screened bound of each kind per host is drawn as a horizontal line on the
plots ("bound: ...", its ms/token) and listed under "Offline bounds" in summary.md and `bounds.csv`.

The mass hypothesis check is `pearson` with a percentile bootstrap interval over the full-budget
policies that always fetch the first choice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from runtime.core.errors import atomic_write
from sweep.answer import (
    answer,
    answer_text,
    basis_text,
    capacity_text,
    gib_text,
    llamacpp_baselines,
    llamacpp_text,
    policy_by_host,
    policy_by_host_text,
)
from sweep.plot import label, plot_panels
from sweep.space import PARAMETERS, policy_of

RATIO_COLUMNS = ("speed_ratio_vs_fetch_all", "speed_ratio_vs_host_compute", "speed_ratio_vs_all_resident")


def policy_key(params: dict[str, Any]) -> str:
    """A canonical text for a policy at a capacity (joins simulator and emulation rows)."""
    return json.dumps({k: params.get(k) for k in PARAMETERS if params.get(k) is not None}, sort_keys=True)


def pareto_mask(points: np.ndarray) -> np.ndarray:
    """Non-dominated rows of `points` [n, m] for minimisation (equal points are all kept)."""
    pts = np.asarray(points, float)
    n = len(pts)
    keep = np.ones(n, dtype=bool)
    for i0 in range(0, n, 256):  # [b, n, m] comparisons a block of rows at a time
        blk = pts[i0:i0 + 256]
        le = np.all(pts[None, :, :] <= blk[:, None, :], axis=2)  # [b, n]: row j is <= row i everywhere
        lt = np.any(pts[None, :, :] < blk[:, None, :], axis=2)  # [b, n]: and < somewhere
        keep[i0:i0 + 256] = ~np.any(le & lt, axis=1)
    return keep


_KIND: dict[str, tuple[str, bool]] = {}


BOUND_KINDS = {"oracle prefetch": lambda p: p.prefetch == "oracle", "Belady eviction": lambda p: p.evict == "belady"}


def bound_kind(params: dict[str, Any]) -> str | None:
    """The kind of offline bound the policy is (it needs the future), or None for a real policy."""
    p = policy_of(params)
    return next((k for k, test in BOUND_KINDS.items() if test(p)), None)


def is_bound(params: dict[str, Any]) -> bool:
    """True for an offline bound (prefetch oracle, eviction belady): never an answer or on a front."""
    return bound_kind(params) is not None


def trials_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Simulator rows -> one flat table (params as columns)."""
    recs = []
    for r in rows:
        if r.get("fidelity") != "simulator":
            continue
        rec = {k: v for k, v in r.items() if k != "params"}
        rec.update({k: r["params"].get(k) for k in PARAMETERS if k in r["params"]})
        rec["policy_key"] = pk = policy_key(r["params"])
        if pk not in _KIND:  # a policy's family, computed once per policy (the tables are rebuilt often)
            _KIND[pk] = (family(r["params"]), policy_of(r["params"]).fetches_first_choice, bound_kind(r["params"]))
        rec["family"], rec["fetches_first_choice"], rec["bound"] = _KIND[pk]
        recs.append(rec)
    df = pd.DataFrame(recs)
    if not df.empty:
        # one name per policy on every host: a baseline's name wherever its policy appears (a search trial on
        # one host may draw the policy a baseline is on another), else the policy's label
        if "baseline" in df:
            names = df[df["baseline"].map(lambda b: isinstance(b, str))].groupby("policy_key")["baseline"].first()
            df["label"] = df["policy_key"].map(names)
            if "policy" in df:
                df["label"] = df["label"].fillna(df["policy"])
        df["time_per_token_ms"] = df.get("time_per_token_s", np.nan) * 1e3
        df = equal_memory_ratios(df)
    return df


def equal_memory_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Speed ratios at equal device memory for rows sized by `vram_budget_GiB`.

    The simulator divides by fetch-every-miss (and host-compute) on the trial's own slots; a policy
    whose staging or low-bit copies are charged to the budget holds fewer slots than fetch-every-miss
    does in that budget, so that ratio flatters it. Here, per host and budget, the reference is the
    baselines' time on the most slots any ok trial of that budget got (what a policy without staging,
    fetch-every-miss itself, holds): `speed_ratio_vs_fetch_all` / `_vs_host_compute` become ratios at
    the same budget (`ratio_basis` "same device memory"), the simulator's are kept as
    `speed_ratio_vs_fetch_all_same_slots` / `speed_ratio_vs_host_compute_same_slots`. Rows sized by
    `capacity_fraction` keep the simulator's ("same capacity")."""
    df = df.copy()
    df["ratio_basis"] = "same capacity"
    if "vram_budget_GiB" not in df or "capacity_slots" not in df or "fetch_all_time_per_token_s" not in df:
        return df
    for name in ("fetch_all", "host_compute"):
        df[f"speed_ratio_vs_{name}_same_slots"] = df.get(f"speed_ratio_vs_{name}", np.nan)
    ok = df[(df["status"] == "ok") & df["vram_budget_GiB"].notna() & df["capacity_slots"].notna()]
    if ok.empty:
        return df
    slots = ok["capacity_slots"].map(lambda c: int(np.sum(c)))  # slots over all layers
    for (host, gib), g in ok.groupby(["host", "vram_budget_GiB"]):
        most = g[slots[g.index] == slots[g.index].max()]
        rows = (df["host"] == host) & (df["vram_budget_GiB"] == gib) & (df["status"] == "ok")
        for name in ("fetch_all", "host_compute"):
            ref = float(most[f"{name}_time_per_token_s"].median())
            df.loc[rows, f"speed_ratio_vs_{name}"] = ref / df.loc[rows, "time_per_token_s"]
        df.loc[rows, "ratio_basis"] = "same device memory"
    return df


def family(params: dict[str, Any]) -> str:
    """The policy's family: its rule, what a non-fetched miss becomes, admission, prefetch, routing and llama.cpp's
    capacity structures (shared pool, layer split)."""
    p = policy_of(params)
    if p.rule == "substitute_all" and p.fallback == "host":
        out = "host-compute"
    else:
        out = p.rule + ("" if p.rule == "fetch_all" or p.fallback == "substitute" else
                        f"->{p.fallback}" + (str(p.lowbit_bits) if p.fallback == "lowbit" else ""))
    if p.beta is not None:
        out += "+admission"
    if p.prefetch != "off":
        out += f"+prefetch:{p.prefetch}"
    if p.route != "off":  # cache-aware routing (docs/policies.md, Additions (4))
        out += f"+route:{p.route}"
    if p.pool != "per_layer":  # llama.cpp's expert cache and layer split (docs/policies.md, Additions (5))
        out += f"+pool:{p.pool}"
    if p.layer_split != "none":
        out += f"+split:{p.layer_split}"
    return out


def screening_front(df: pd.DataFrame, host: str, objectives: tuple[str, ...]) -> pd.DataFrame:
    """The host's (time, mass) front over its ok simulator trials, computed within each family group
    (always fetches the first choice / can substitute it), fastest first; one row per policy."""
    d = df[(df["host"] == host) & (df["status"] == "ok") & df["bound"].isna()]
    if d.empty:
        return d
    d = d.drop_duplicates("policy_key")
    parts = []
    for first in (True, False):
        g = d[d["fetches_first_choice"] == first]
        if not g.empty:
            parts.append(g[pareto_mask(g[list(objectives)].to_numpy(dtype=float))])
    return pd.concat(parts).sort_values(["time_per_token_s", "mass_per_token"]).reset_index(drop=True)


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


def quality_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Full-budget emulation rows (host independent): policy key -> perplexity change and interval."""
    recs = [{"policy_key": policy_key(r["params"]), "ppl_change_pct": r.get("ppl_change_pct"),
             "ppl_ci_low": r.get("ppl_ci_low"), "ppl_ci_high": r.get("ppl_ci_high"),
             "perplexity": r.get("perplexity"), "exact_perplexity": r.get("exact_perplexity"),
             "emulated_mass_per_token": r.get("mass_per_token"), "emulated_tokens": r.get("tokens"),
             "emulation_initial_residency": r.get("initial_residency")}
            for r in rows if r.get("fidelity") == "emulation" and r.get("budget") == "full" and r["status"] == "ok"
            and r.get("ppl_change_pct") is not None]
    cols = ["policy_key", "ppl_change_pct", "ppl_ci_low", "ppl_ci_high"]
    return pd.DataFrame(recs).drop_duplicates("policy_key", keep="last") if recs else pd.DataFrame(columns=cols)


def _engine(rows: list[dict[str, Any]], host: str) -> pd.DataFrame | None:
    recs = [{"policy_key": policy_key(r["params"]), "engine_time_per_token_ms": 1e3 * r["time_per_token_s"]}
            for r in rows if r.get("fidelity") == "engine" and r["host"] == host and r["status"] == "ok"
            and r.get("time_per_token_s") is not None]
    return pd.DataFrame(recs).drop_duplicates("policy_key", keep="last") if recs else None


def measured(df: pd.DataFrame, quality: pd.DataFrame, rows: list[dict[str, Any]], host: str) -> pd.DataFrame:
    """The host's simulator rows of the policies emulated at the full budget, with their quality
    (and the engine's time on a calibrated host)."""
    d = df[(df["host"] == host) & (df["status"] == "ok") & df["bound"].isna()] if not df.empty else df
    if d.empty or quality.empty:
        return d.iloc[:0]
    d = d.drop_duplicates("policy_key").merge(quality, on="policy_key", how="inner")
    eng = _engine(rows, host)
    if eng is not None:
        d = d.merge(eng, on="policy_key", how="left")
    return d


def ppl_front(m: pd.DataFrame, objectives: tuple[str, ...]) -> pd.DataFrame:
    """The front in (time per token, perplexity change [, device memory]) over `measured` rows."""
    if m.empty:
        return m
    cols = ["time_per_token_s", "ppl_change_pct"] + [o for o in objectives if o == "device_memory_GiB"]
    return m[pareto_mask(m[cols].to_numpy(dtype=float))].sort_values(
        ["time_per_token_s", "ppl_change_pct"]).reset_index(drop=True)


def bounds(df: pd.DataFrame, hosts: list[str]) -> pd.DataFrame:
    """Per host and kind of offline bound, the computed one (sweep/bounds.py: fetch-every-miss with the future
    known, run at the budget beside the baselines; the oracle kinds the fastest of their copy pools): its
    ms/token, speed ratio and what it bounds. Sampled trials that happen to use the future are not bounds."""
    from sweep.bounds import BOUNDS, bound_of

    if df.empty or "baseline" not in df:
        return pd.DataFrame()
    kinds = df["baseline"].map(bound_of)
    recs = []
    for host in hosts:
        d = df[(df["host"] == host) & (df["status"] == "ok") & kinds.notna()]
        for kind, g in d.groupby(kinds[d.index]):
            r = g.sort_values("time_per_token_s").iloc[0]
            recs.append({"host": host, "bound": kind, "bounds": BOUNDS[kind],
                         "policy": r["policy"] if isinstance(r.get("policy"), str) else label(r),
                         "capacity": capacity_text(r), "time_per_token_ms": r["time_per_token_ms"],
                         "speed_ratio_vs_fetch_all": r["speed_ratio_vs_fetch_all"], "runs": len(g)})
    return pd.DataFrame(recs)


def write_tables(out: Path, rows: list[dict[str, Any]], hosts: list[str],
                 objectives: tuple[str, ...]) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """Rewrite trials.csv and the screening fronts (cheap; called as trials finish)."""
    df = trials_frame(rows)
    fronts = {}
    if df.empty:
        return df, fronts
    for host in hosts:
        fronts[host] = screening_front(df, host, objectives[:2] + tuple(o for o in objectives[2:]))
        _write_csv(fronts[host], out / f"screening_{host}.csv")
    _write_csv(df, out / "trials.csv")
    return df, fronts


def policy_records(rows: list[dict[str, Any]], fronts: dict[str, pd.DataFrame], hosts: list[str]
                   ) -> list[dict[str, Any]]:
    """One record per (host, policy) that matters: a baseline, a front member or a policy measured
    beyond the simulator, with its simulated figures and, where measured, the emulation's and the
    engine's (the MLflow child runs)."""
    import hashlib

    emu = {policy_key(r["params"]): r for r in rows
           if r.get("fidelity") == "emulation" and r.get("budget") == "full" and r["status"] == "ok"}
    eng = {(r["host"], policy_key(r["params"])): r for r in rows
           if r.get("fidelity") == "engine" and r["status"] == "ok"}
    df = trials_frame(rows)  # the speed ratios at equal device memory (equal_memory_ratios)
    ratio_cols = [c for c in df.columns if c.startswith("speed_ratio_vs_") or c == "ratio_basis"]
    ratios = ({} if df.empty else df[df["status"] == "ok"].drop_duplicates(["host", "policy_key"])
              .set_index(["host", "policy_key"])[ratio_cols].to_dict("index"))
    out = []
    for host in hosts:
        on_front = set(fronts[host]["policy_key"]) if host in fronts and not fronts[host].empty else set()
        seen = set()
        for r in rows:
            if r.get("fidelity") != "simulator" or r["host"] != host or r["status"] != "ok":
                continue
            pk = policy_key(r["params"])
            if pk in seen or not (r.get("baseline") or pk in on_front or pk in emu):
                continue
            seen.add(pk)
            rec = {k: v for k, v in r.items() if k not in ("key", "number", "node", "pid")}
            rec.update(key=f"{host}:{hashlib.sha1(pk.encode()).hexdigest()[:16]}", on_front=pk in on_front,
                       policy=r.get("policy") or policy_of(r["params"]).label(), family=family(r["params"]),
                       **ratios.get((host, pk), {}))
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
    """Pearson r (substituted mass vs perplexity change) over full-budget first-choice-fetching policies."""
    pts = [(r["mass_per_token"], r["ppl_change_pct"]) for r in rows
           if r.get("fidelity") == "emulation" and r.get("budget") == "full" and r["status"] == "ok"
           and policy_of(r["params"]).fetches_first_choice and r.get("ppl_change_pct") is not None]
    if not pts:
        return pearson(np.array([]), np.array([]))
    x, y = np.array(pts).T
    return pearson(x, y)


def speed_ratios(fronts: dict[str, pd.DataFrame]) -> pd.DataFrame:
    recs = []
    for host, fr in fronts.items():
        for _, r in fr.iterrows():
            recs.append({"host": host, "policy": label(r), "family": r["family"], "capacity": capacity_text(r),
                         "device_memory_GiB": r.get("device_memory_GiB", np.nan),
                         "time_per_token_ms": r["time_per_token_ms"], "mass_per_token": r["mass_per_token"],
                         **{c: r[c] for c in RATIO_COLUMNS},
                         **({"ppl_change_pct": r["ppl_change_pct"]} if "ppl_change_pct" in r else {})})
    return pd.DataFrame(recs)


def host_table_text(host: str, fr: pd.DataFrame, gpu: str = "") -> str:
    """A Markdown table of a host's front."""
    has_ppl = "ppl_change_pct" in fr and fr["ppl_change_pct"].notna().any()
    has_engine = "engine_time_per_token_ms" in fr and fr["engine_time_per_token_ms"].notna().any()
    head = "| policy | family | capacity | device GiB | ms/token |"
    sep = "|---|---|---|---|---|"
    if has_engine:
        head += " engine ms/token |"
        sep += "---|"
    head += " x fetch-all | x host-compute | x all-resident |"
    sep += "---|---|---|"
    if has_ppl:
        head += " ppl change % [95% CI] |"
        sep += "---|"
    head += " mass/token |"
    sep += "---|"
    lines = [f"### {host}" + (f" ({gpu})" if gpu else ""), "", head, sep]
    for _, r in fr.iterrows():
        line = (f"| {label(r)} | {r['family']} | {capacity_text(r)} | {gib_text(r.get('device_memory_GiB'))} | "
                f"{r['time_per_token_ms']:.3f} |")
        if has_engine:
            v = r.get("engine_time_per_token_ms")
            line += f" {v:.3f} |" if pd.notna(v) else " |"
        line += (f" {r['speed_ratio_vs_fetch_all']:.2f} | {r['speed_ratio_vs_host_compute']:.2f} | "
                 f"{r['speed_ratio_vs_all_resident']:.2f} |")
        if has_ppl:
            line += f" {r['ppl_change_pct']:+.2f} [{r['ppl_ci_low']:+.2f}, {r['ppl_ci_high']:+.2f}] |"
        line += f" {r['mass_per_token']:.4f} |"
        lines.append(line)
    return "\n".join(lines)


def write_report(out: Path, rows: list[dict[str, Any]], hosts: list[str], objectives: tuple[str, ...],
                 meta: dict[str, Any]) -> dict[str, Any]:
    """Every output file; returns their paths, the fronts, the answer and the mass-hypothesis figures."""
    df, screening = write_tables(out, rows, hosts, objectives)
    quality = quality_frame(rows)
    budgets = list(meta.get("budgets", (0.5, 1.0, 2.0)))
    tables = {h: measured(df, quality, rows, h) for h in hosts}
    fronts = {}
    for h in hosts:
        if quality.empty:  # no emulation: the screening front of the policies that always fetch the first
            # choice (mass ranks them); one that can substitute it is never placed on a front by mass alone
            scr = screening.get(h, df.iloc[:0])
            scr = scr[scr["fetches_first_choice"].astype(bool)] if not scr.empty else scr
            fronts[h] = scr.assign(front_kind="screening (mass, first-choice fetching)")
        else:
            fronts[h] = ppl_front(tables[h], objectives).assign(front_kind="perplexity")
        _write_csv(fronts[h], out / f"pareto_{h}.csv")
        _write_parquet(fronts[h], out / f"pareto_{h}.parquet")
    paths: dict[str, Any] = {"trials": out / "trials.csv"}
    shape = meta.get("shape")  # the cost model's shape of the trace's model: llama.cpp's flags
    ans = answer(tables, budgets, df, shape) if not quality.empty else pd.DataFrame()
    llama = llamacpp_baselines(df, hosts, shape) if not df.empty else pd.DataFrame()
    if not llama.empty:
        _write_csv(llama, out / "llamacpp.csv")
        paths["llamacpp"] = out / "llamacpp.csv"
    if not ans.empty:
        _write_csv(ans, out / "answer.csv")
        paths["answer"] = out / "answer.csv"
    sr = speed_ratios(fronts)
    _write_csv(sr, out / "speed_ratios.csv")
    paths["speed_ratios"] = out / "speed_ratios.csv"
    bd = bounds(df, hosts)
    if not bd.empty:
        _write_csv(bd, out / "bounds.csv")
        paths["bounds"] = out / "bounds.csv"
    panels, xscale = {}, {}
    for h in hosts:
        paths[f"pareto_{h}"] = out / f"pareto_{h}.csv"
        panels[h] = {"measured": tables[h], "front": fronts[h] if not quality.empty else df.iloc[:0],
                     "trials": df[(df["host"] == h) & (df["status"] == "ok")] if not df.empty else df,
                     "screening": screening.get(h, df.iloc[:0]),
                     "bounds": bd[bd["host"] == h] if not bd.empty else bd,
                     "llamacpp": llama[(llama["host"] == h) & llama["time_per_token_ms"].notna()]
                     if not llama.empty and "time_per_token_ms" in llama else pd.DataFrame(),
                     "answer_keys": set(ans.loc[ans["host"] == h, "policy_key"].dropna())
                     if not ans.empty and "policy_key" in ans else set()}
        if not df.empty:
            xscale[h] = plot_panels({h: panels[h]}, out / f"pareto_{h}.png", h, budgets)
            paths[f"plot_{h}"] = out / f"pareto_{h}.png"
    if not df.empty:
        plot_panels(panels, out / "pareto.png", "all hosts", budgets)
        paths["plot"] = out / "pareto.png"
    pbh = policy_by_host(df, quality, ans, hosts)
    if not pbh.empty:
        _write_csv(pbh, out / "policy_by_host.csv")
        paths["policy_by_host"] = out / "policy_by_host.csv"
    hyp = mass_hypothesis(rows)
    summary = _summary(df, fronts, screening, ans, hyp, meta, paths, bd, pbh, llama)
    atomic_write(out / "summary.md", lambda tmp: Path(tmp).write_text(summary))
    paths["summary"] = out / "summary.md"
    return {"paths": paths, "fronts": fronts, "screening": screening, "answer": ans, "hypothesis": hyp,
            "trials": df, "measured": tables, "bounds": bd, "policy_by_host": pbh, "plot_xscale": xscale,
            "llamacpp": llama}


def _summary(df: pd.DataFrame, fronts: dict[str, pd.DataFrame], screening: dict[str, pd.DataFrame],
             ans: pd.DataFrame, hyp: dict[str, float], meta: dict[str, Any], paths: dict[str, Any],
             bd: pd.DataFrame | None = None, pbh: pd.DataFrame | None = None,
             llama: pd.DataFrame | None = None) -> str:
    lines = [f"# Sweep {meta.get('name', '')}", ""]
    if not ans.empty:
        lines += ["## The answer", "",
                  "Per host and perplexity budget: the fastest policy whose upper 95% bound of the perplexity "
                  "change (exact emulation at the full token budget) stays within the budget, the device memory "
                  "it uses, and its speed ratio over fetch-every-miss " + basis_text(ans) +
                  " (simulated time per token); `x llama.cpp`: its speed ratio over the faster of llama.cpp's "
                  "two ways of holding experts (its LRU expert cache `--moe-cache-mib`, its layer split `-ncmoe`) "
                  "on that host at the same device memory; `llama.cpp flags`: the policy in llama.cpp's flags, "
                  "or what llama.cpp lacks to run it.", "", answer_text(ans), ""]
    else:
        lines += ["No perplexity was measured (emulation off or no model), so there is no answer in perplexity; "
                  "the tables below are the simulator's screening fronts (time and substituted mass).", ""]
    llama = llama if llama is not None else pd.DataFrame()
    if not llama.empty:
        lines += ["## llama.cpp", "",
                  "llama.cpp's two ways of holding experts as the sweep ran them (named baselines `llamacpp-lru`, "
                  "`llamacpp-ncmoe`), per host at the same device memory as every policy: its LRU expert cache "
                  "(one pool of slots shared by all layers, every miss fetched) and its static split (the first N "
                  "layers' experts computed on the host, the rest resident).", "",
                  llamacpp_text(ans, llama), ""]
    if pbh is not None and not pbh.empty:
        hosts_ = list(dict.fromkeys(pbh["host"]))
        lines += ["## Policy x host", "",
                  "The named policies and every answer policy (bold) on every host, each at the capacity it was "
                  "screened at (`device GiB`): simulated ms/token and its ratio over fetch-every-miss on that host; "
                  "the perplexity change does not depend on the host.", "", policy_by_host_text(pbh, hosts_), ""]
    lines.append(f"- trace: `{meta.get('trace')}`" + (f", model: `{meta['model']}`" if meta.get("model") else ""))
    if meta.get("warm_start"):
        lines.append(f"- warm start (initial residency; never the evaluated tokens): {meta['warm_start']}")
    lines.append(f"- screening: {', '.join(meta.get('objectives', []))} (simulator), sampler {meta.get('sampler')}, "
                 f"{meta.get('trials')} trials per host after the baselines")
    for r in (meta.get("ladder") or {}).get("rungs", []):
        lines.append(f"- rung {r['rung']}: {r['candidates']} policies emulated at "
                     f"{r['tokens'] or 'all'} tokens in {r['seconds']:.0f} s, {r['promoted']} went on")
    if meta.get("mlflow_uri"):
        lines.append(f"- MLflow: `{meta['mlflow_uri']}`, parent run `{meta.get('parent_run_id')}`")
    lines.append("")
    if not df.empty:
        lines += ["| host | trials ok | infeasible at the budget | failed | front size |", "|---|---|---|---|---|"]
        for host, fr in fronts.items():
            d = df[df["host"] == host]
            inf = int((d["status"] == "infeasible").sum())
            lines.append(f"| {host} | {(d['status'] == 'ok').sum()} | {inf} | "
                         f"{(~d['status'].isin(['ok', 'infeasible'])).sum()} | {len(fr)} |")
        lines.append("")
    kind = "perplexity" if not ans.empty else "screening"
    lines += [f"## Fronts ({kind})", "",
              ("Each host's front in (simulated time per token, perplexity change) over the policies emulated at "
               "the full budget." if kind == "perplexity" else
               "Each host's (time, mass) front within each family (mass ranks policies only among those that "
               "fetch the same way)."),
              "Speed ratios compare each policy with fetch-every-miss and with computing misses on the host "
              "on the same host " + ("at the same device memory" if "ratio_basis" in df and
                                     (df["ratio_basis"] == "same device memory").any() else "at the same capacity")
              + ", and with the all-resident bound (>1 = faster).", ""]
    for host, fr in fronts.items():
        lines += [host_table_text(host, fr, meta.get("gpus", {}).get(host, "")), ""]
    if bd is not None and not bd.empty:
        lines += ["## Offline bounds", "",
                  "Fetch-every-miss with the future known (Belady eviction, oracle prefetch, both), computed once "
                  "per host at the budget (sweep/bounds.py; the oracle kinds at copy pools of 1, 2 and k buffers "
                  "per layer, the fastest shown): how fast a cache of this memory could be, not policies to run; "
                  "never in the answer or a front. Sampled trials that use the future are not bounds.",
                  "", "| host | bound | what it bounds | policy | capacity | ms/token | x fetch-every-miss | runs |",
                  "|---|---|---|---|---|---|---|---|"]
        for _, r in bd.iterrows():
            lines.append(f"| {r['host']} | {r['bound']} | {r['bounds']} | {r['policy']} | {r['capacity']} | "
                         f"{r['time_per_token_ms']:.3f} | {r['speed_ratio_vs_fetch_all']:.2f} | {r['runs']} |")
        lines.append("")
    lines += ["## Mass hypothesis", ""]
    if math.isnan(hyp["r"]):
        lines.append(f"Not enough full-budget policies that fetch the first choice ({hyp['n']} with distinct "
                     f"values; 3 needed) for a correlation.")
    else:
        lines.append(f"Pearson r between substituted mass per token and perplexity change (exact emulation) over "
                     f"{hyp['n']} full-budget policies that always fetch the first choice: **r = {hyp['r']:.3f}** "
                     f"(95% bootstrap interval [{hyp['ci_low']:.3f}, {hyp['ci_high']:.3f}]). The paper reports "
                     f"r ~ 0.92 on Qwen3-Next-80B-A3B.")
    for note in meta.get("notes", []):
        lines += ["", f"- {note}"]
    lines += ["", "## Files", ""]
    lines += [f"- `{p}`" for k, p in paths.items() if k != "summary"]
    return "\n".join(lines) + "\n"
