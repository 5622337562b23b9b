"""The answer of a sweep: per host and perplexity budget the fastest measured policy within it, its speed over
fetch-every-miss and over the faster of llama.cpp's two ways of holding experts at the same memory (docs/policies.md,
Additions (5)), the llama.cpp flags that run it where llama.cpp can, and the tables that print it. sweep/report.py
writes it (answer.csv, summary.md) beside the fronts and plots.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd

from sweep.plot import label
from sweep.space import policy_of


def capacity_text(r: pd.Series) -> str:
    if "vram_budget_GiB" in r and pd.notna(r.get("vram_budget_GiB")):
        return f"{r['vram_budget_GiB']:.3g} GiB"
    return f"{r['capacity_fraction']:.3g}"


BETTER_THAN_EXACT = "better than exact: the model, not the policy"
"""The answer table's flag on a policy whose whole interval lies below 0 (see `better_than_exact`)."""


def better_than_exact(r: pd.Series | dict[str, Any]) -> bool:
    """Whether a lossy policy's perplexity change is negative beyond its 95% interval (upper bound < 0).

    Skipping or substituting computation cannot make a well-trained model better, so such a row says
    the model is under-trained (or the text is odd), not that the policy is good; the answer flags it."""
    hi = r.get("ppl_ci_high")
    return bool(hi is not None and pd.notna(hi) and float(hi) < 0)


LLAMACPP_BASELINES = {"llamacpp-lru": "llama.cpp LRU cache", "llamacpp-ncmoe": "llama.cpp -ncmoe"}
"""llama.cpp's two ways of holding experts (docs/policies.md, Additions (5)): preset -> its name on the plots."""


def llamacpp_flags_of(policy_key_text: str, capacity_slots: Any, shape: Any) -> str:
    """llama.cpp's flags for the policy of `policy_key_text` at `capacity_slots` (slots per layer) on the cost-model
    `shape` (`runtime.tools.llamacpp_flags`), or the one line of what llama.cpp lacks to run it; "" without a shape
    or slots."""
    from runtime.tools.llamacpp_flags import llamacpp_flags

    if shape is None or capacity_slots is None or (isinstance(capacity_slots, float) and math.isnan(capacity_slots)):
        return ""
    return llamacpp_flags(policy_of(json.loads(policy_key_text)), shape, capacity_slots)


def llamacpp_baselines(source: pd.DataFrame, hosts: list[str], shape: Any = None) -> pd.DataFrame:
    """Per host, llama.cpp's two baselines as the sweep ran them (their baseline rows, status ok): the name on the
    plots ("llama.cpp LRU cache", "llama.cpp -ncmoe N"), their flags, device memory, ms/token and ratio over
    fetch-every-miss; a preset with no ok run on a host has a row with `missing` saying why."""
    recs = []
    for host in hosts:
        for preset, name in LLAMACPP_BASELINES.items():
            rec: dict[str, Any] = {"host": host, "baseline": preset, "name": name}
            runs = (source[(source["host"] == host) & (source["baseline"] == preset)]
                    if not source.empty and {"host", "baseline"} <= set(source) else source.iloc[:0])
            ok = runs[runs["status"] == "ok"] if "status" in runs else runs
            if ok.empty:
                rec["missing"] = (f"{preset} is not among this sweep's baselines (baselines.policies)" if runs.empty
                                  else f"{preset} ended {runs['status'].iloc[0]!r} on {host}")
                recs.append(rec)
                continue
            r = ok.iloc[0]
            flags = llamacpp_flags_of(r["policy_key"], r.get("capacity_slots"), shape)
            if preset == "llamacpp-ncmoe" and flags.startswith("-ncmoe "):
                rec["name"] = f"{name} {flags.split()[1]}"
            rec.update(flags=flags, vram_budget_GiB=r.get("vram_budget_GiB", np.nan),
                       device_memory_GiB=r.get("device_memory_GiB", np.nan), time_per_token_ms=r["time_per_token_ms"],
                       speed_ratio_vs_fetch_all=r.get("speed_ratio_vs_fetch_all", np.nan), missing=None)
            recs.append(rec)
    return pd.DataFrame(recs)


def versus_llamacpp(llama: pd.DataFrame, host: str, gib: Any, ms: float) -> dict[str, Any]:
    """The answer row's comparison with the faster of llama.cpp's two baselines on `host` at `gib` GiB (the same
    device memory): its ms/token over the policy's (`speed_ratio_vs_llamacpp`, >1 = the policy is faster) and
    which it is; or `llamacpp_missing`, why there is no ratio."""
    mine = llama[llama["host"] == host] if not llama.empty else llama
    gone = [m for m in mine.get("missing", pd.Series(dtype=object)).dropna()]
    if mine.empty or gone:
        return {"llamacpp_missing": "; ".join(gone) or f"no llama.cpp baseline on {host}"}
    if not (isinstance(gib, int | float) and math.isfinite(gib)) or not np.allclose(
            mine["vram_budget_GiB"].to_numpy(dtype=float), float(gib)):
        return {"llamacpp_missing": f"llama.cpp's baselines on {host} ran at another device memory than the answer's "
                                    f"({gib_text(gib) or 'a capacity, not a memory budget'})"}
    fast = mine.sort_values("time_per_token_ms").iloc[0]
    return {"speed_ratio_vs_llamacpp": float(fast["time_per_token_ms"]) / float(ms), "llamacpp_faster": fast["name"],
            "llamacpp_time_per_token_ms": float(fast["time_per_token_ms"]), "llamacpp_missing": None}


def answer(tables: dict[str, pd.DataFrame], budgets: list[float], trials: pd.DataFrame | None = None,
           shape: Any = None) -> pd.DataFrame:
    """Per host and budget: the fastest measured policy whose upper 95% bound stays within the budget
    (`better_than_exact` marks one whose interval lies wholly below 0), with its speed ratio over the faster of
    llama.cpp's two baselines on that host at the same device memory (`llamacpp_baselines` of `trials`, the
    screening rows; of the tables when None) and llama.cpp's flags for it at its capacity on the cost-model
    `shape` (or what llama.cpp lacks to run it)."""
    src = trials if trials is not None else pd.concat(
        [m.assign(host=h) for h, m in tables.items() if not m.empty] or [pd.DataFrame()])
    llama = llamacpp_baselines(src, list(tables), shape)
    recs = []
    for host, m in tables.items():
        for b in budgets:
            ok = m[m["ppl_ci_high"] <= b] if not m.empty else m
            rec: dict[str, Any] = {"host": host, "ppl_budget_pct": b}
            if ok.empty:
                rec["policy"] = None
            else:
                r = ok.sort_values(["time_per_token_s", "ppl_ci_high"]).iloc[0]
                rec.update(policy=label(r), family=r["family"], capacity=capacity_text(r),
                           device_memory_GiB=r.get("device_memory_GiB", np.nan),
                           vram_budget_GiB=r.get("vram_budget_GiB", np.nan), ratio_basis=r.get("ratio_basis"),
                           time_per_token_ms=r["time_per_token_ms"], speed_ratio_vs_fetch_all=r["speed_ratio_vs_fetch_all"],
                           ppl_change_pct=r["ppl_change_pct"], ppl_ci_low=r["ppl_ci_low"], ppl_ci_high=r["ppl_ci_high"],
                           policy_key=r["policy_key"], better_than_exact=better_than_exact(r))
                rec.update(versus_llamacpp(llama, host, r.get("vram_budget_GiB", np.nan), r["time_per_token_ms"]))
                rec["llamacpp_flags"] = llamacpp_flags_of(r["policy_key"], r.get("capacity_slots"), shape)
                if pd.notna(r.get("engine_time_per_token_ms", np.nan)):
                    rec["engine_time_per_token_ms"] = r["engine_time_per_token_ms"]
            recs.append(rec)
    return pd.DataFrame(recs)


def gib_text(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, int | float) and math.isfinite(v) else ""


def policy_by_host(df: pd.DataFrame, quality: pd.DataFrame, ans: pd.DataFrame, hosts: list[str]) -> pd.DataFrame:
    """The per-host comparison: the named baselines and every answer policy, one row per (policy, host),
    each at the capacity it was screened at (one budget for all with `vram_budget_GiB: auto`): device
    memory, ms/token, speed ratio over fetch-every-miss and the full-budget perplexity change. A policy
    the sweep did not screen on a host has no row for it (`screened_on` names the hosts it has)."""
    if df.empty:
        return pd.DataFrame()
    ok = df[(df["status"] == "ok") & df["bound"].isna()]
    keys = list(dict.fromkeys(list(ok.loc[ok["baseline"].notna(), "policy_key"]) +
                              (list(ans["policy_key"].dropna()) if "policy_key" in ans else [])))
    q = quality.set_index("policy_key") if not quality.empty else None
    in_answer = set(ans["policy_key"].dropna()) if "policy_key" in ans else set()
    recs = []
    for pk in keys:
        rows = ok[ok["policy_key"] == pk].drop_duplicates("host")
        on = [h for h in hosts if h in set(rows["host"])]
        for _, r in rows.iterrows():
            if r["host"] not in hosts:
                continue
            rec = {"policy": label(r), "family": r["family"], "host": r["host"], "capacity": capacity_text(r),
                   "device_memory_GiB": r.get("device_memory_GiB", np.nan), "time_per_token_ms": r["time_per_token_ms"],
                   "speed_ratio_vs_fetch_all": r["speed_ratio_vs_fetch_all"], "in_answer": pk in in_answer,
                   "screened_on": ",".join(on), "policy_key": pk}
            if q is not None and pk in q.index:
                rec.update({c: q.loc[pk, c] for c in ("ppl_change_pct", "ppl_ci_low", "ppl_ci_high")})
            recs.append(rec)
    out = pd.DataFrame(recs)
    return out.sort_values(["in_answer", "policy", "host"], ascending=[False, True, True]).reset_index(drop=True) \
        if not out.empty else out


def policy_by_host_text(pbh: pd.DataFrame, hosts: list[str]) -> str:
    """policy x host as Markdown: per host, ms/token and x fetch-every-miss; device GiB; perplexity."""
    head = "| policy | device GiB | " + " | ".join(f"{h} ms/token (x fetch-all)" for h in hosts) + \
        " | ppl change % [95% CI] |"
    lines = [head, "|" + "---|" * (3 + len(hosts))]
    for _, g in pbh.groupby("policy_key", sort=False):
        by = g.set_index("host")
        r0 = g.iloc[0]
        cells = [f"{by.loc[h, 'time_per_token_ms']:.3f} ({by.loc[h, 'speed_ratio_vs_fetch_all']:.2f})"
                 if h in by.index else "not screened" for h in hosts]
        ppl = (f"{r0['ppl_change_pct']:+.2f} [{r0['ppl_ci_low']:+.2f}, {r0['ppl_ci_high']:+.2f}]"
               if "ppl_change_pct" in g and pd.notna(r0.get("ppl_change_pct")) else "")
        name = ("**" + r0["policy"] + "**") if r0["in_answer"] else r0["policy"]
        lines.append(f"| {name} | {gib_text(r0.get('device_memory_GiB'))} | " + " | ".join(cells) + f" | {ppl} |")
    return "\n".join(lines)


def basis_text(ans: pd.DataFrame) -> str:
    """What the answer's speed ratios compare at: one device-memory budget, or one capacity."""
    if "ratio_basis" in ans and (ans["ratio_basis"] == "same device memory").any():
        gib = sorted({round(float(v), 4) for v in ans["vram_budget_GiB"].dropna()})
        return (f"at the same device memory ({', '.join(f'{g:g}' for g in gib)} GiB for every policy: low-bit "
                "copies, prefetch and admission buffers and staging are charged to it)")
    return "at the same capacity (slots per layer; a policy's low-bit copies and staging come on top)"


def cell_text(v: Any, fmt: str) -> str:
    """A number as `fmt`, or "-" where there is none (a missing baseline)."""
    return format(float(v), fmt) if isinstance(v, int | float) and math.isfinite(v) else "-"


def answer_text(ans: pd.DataFrame, flags_below: bool = False) -> str:
    """The answer as Markdown: a row per host and budget, `x llama.cpp` beside `x fetch-every-miss` and the column
    `llama.cpp flags`; with `flags_below` (the terminal), the flags go on a line under each row instead."""
    cols = ["host", "perplexity budget", "fastest policy within it (upper 95% bound)", "family", "device GiB",
            "ms/token", "x fetch-every-miss", "x llama.cpp", "ppl change % [95% CI]", "flag"]
    cols += [] if flags_below else ["llama.cpp flags"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    flagged = 0
    for _, r in ans.iterrows():
        if r["policy"] is None or (isinstance(r["policy"], float) and math.isnan(r["policy"])):
            lines.append(f"| {r['host']} | {r['ppl_budget_pct']:g}% | none measured within it |" + " |" * (len(cols) - 3))
            continue
        flag = better_than_exact(r)
        flagged += flag
        line = (f"| {r['host']} | {r['ppl_budget_pct']:g}% | {r['policy']} | {r['family']} | "
                f"{gib_text(r.get('device_memory_GiB'))} | {r['time_per_token_ms']:.3f} | "
                f"{r['speed_ratio_vs_fetch_all']:.2f} | {cell_text(r.get('speed_ratio_vs_llamacpp'), '.2f')} | "
                f"{r['ppl_change_pct']:+.2f} [{r['ppl_ci_low']:+.2f}, {r['ppl_ci_high']:+.2f}] | "
                f"{BETTER_THAN_EXACT if flag else ''} |")
        flags = r.get("llamacpp_flags") if isinstance(r.get("llamacpp_flags"), str) else ""
        lines.append(line if flags_below else line + f" {flags} |")
        if flags_below and flags:
            lines.append(f"  llama.cpp: {flags}")
    if flagged:
        lines += ["", f"{flagged} answer row(s) flagged '{BETTER_THAN_EXACT}': the policy's whole 95% interval "
                  "lies below 0, i.e. dropping or substituting experts lowered perplexity; that is the model "
                  "(under-trained, or the text), not a policy worth recommending."]
    return "\n".join(lines)


def llamacpp_text(ans: pd.DataFrame, llama: pd.DataFrame) -> str:
    """Which llama.cpp baseline `x llama.cpp` divides by on each host, or why it is `-`; then, per host, llama.cpp's
    two baselines (name, flags, device GiB, ms/token, x fetch-every-miss)."""
    lines = []
    if not ans.empty and "llamacpp_faster" in ans:
        for host, g in ans[ans["llamacpp_faster"].notna()].groupby("host", sort=False):
            r = g.iloc[0]
            lines.append(f"- `x llama.cpp` on {host}: over {r['llamacpp_faster']} "
                         f"({r['llamacpp_time_per_token_ms']:.3f} ms/token), the faster of llama.cpp's two at "
                         f"{gib_text(r.get('vram_budget_GiB'))} GiB")
    if not ans.empty and "llamacpp_missing" in ans:
        for host, why in ans[["host", "llamacpp_missing"]].dropna().drop_duplicates().itertuples(index=False):
            lines.append(f"- `x llama.cpp` on {host} is `-`: {why}")
    if (ans.empty or "llamacpp_missing" not in ans) and not llama.empty:  # no answer: what did not run, per host
        for host, why in llama[["host", "missing"]].dropna().itertuples(index=False):
            lines.append(f"- on {host}: {why}")
    if not llama.empty and "time_per_token_ms" in llama:
        ran = llama[llama["time_per_token_ms"].notna()]
        if not ran.empty:
            lines += ["", "| host | llama.cpp | flags | device GiB | ms/token | x fetch-every-miss |",
                      "|---|---|---|---|---|---|"]
            for _, r in ran.iterrows():
                lines.append(f"| {r['host']} | {r['name']} | `{r['flags']}` | {gib_text(r.get('device_memory_GiB'))} | "
                             f"{r['time_per_token_ms']:.3f} | {cell_text(r.get('speed_ratio_vs_fetch_all'), '.2f')} |")
    return "\n".join(lines)
