"""The findings page: Markdown of a `cli.run` result (command, commit, regimes, the table, the rules, the intervals'
block check and a reading), every number taken from the result so that the page and its JSON agree.
"""

from __future__ import annotations

from typing import Any

from runtime.tools.findings.admission import admission_lines
from runtime.tools.findings.experiments import PAPER_LAYERS
from runtime.tools.findings.rules import PAPER_HEDGE, UNSTABLE, UNTESTABLE
from runtime.tools.findings.stats import fmt_ci


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def regime_lines(res: dict[str, Any]) -> list[str]:
    """The regime table: the paper's and each column's cache."""
    p = res["paper_regime"]
    out = ["| column | slots per layer | slots per top-k | warm-set miss rate | substitute-all substitutes | regime |",
           "|---|---|---|---|---|---|",
           f"| paper ({p['model']}, ~25%) | {p['slots']} of {p['experts']} | {p['slots_per_top_k']:.1f} | n/a | "
           f"{p['substitute_all_share']:.1%} | the paper's |"]
    for c in res["columns"]:
        where = ("the paper's (substitute-all share nearest 8.5%)" if c["paper_regime"] else
                 ("more misses than the paper's" if c["substitute_all_share"] > p["substitute_all_share"]
                  else "fewer misses than the paper's"))
        out.append(f"| {c['label']} | {c['slots']} of {c['experts']} | {c['slots_per_top_k']:.1f} | "
                   f"{c['warm_set_miss_rate']:.1%} | {c['substitute_all_share']:.1%} | {where} |")
    return out


def power_lines(res: dict[str, Any]) -> list[str]:
    """Substitute-all's perplexity cost per column on every build (`res["power_by_build"]`): whether the regime has
    the power the rows need (its loss is what row 1 and the admission rows rest on)."""
    builds = res.get("power_by_build") or []
    if not builds:
        return []
    reqs = [c["requested"] for c in res["columns"]]

    def head(req: Any) -> str:
        return "the paper's regime" if req == "paper" else f"{float(req):.2%} of the experts"

    out = ["### Power across build seeds", "",
           "Substitute-all's perplexity change (%, 95% interval: the block bootstrap of row 1) per column on each "
           "build of the model, with the column's C/k and substitute-all's share of substituted calls on that build "
           "(the paper: +5.67% at 8.5% of calls substituted, C/k = 12.8). A build marked 'power only' ran row 1 "
           "alone (`python -m runtime.findings --power-only`).", "",
           "| build | exact perplexity | " + " | ".join(head(q) for q in reqs) + " |",
           "|---|---|" + "---|" * len(reqs)]
    for b in builds:
        by = {str(c["requested"]): c for c in b["columns"]}
        cells = []
        for q in reqs:
            c = by.get(str(q))
            cells.append("-" if c is None else f"{c['ppl_change_pct']:+.2f}% {fmt_ci(*c['ci95'])} (C/k "
                         f"{c['c_over_k']:.1f}, {c['substitute_all_share']:.1%})")
        seed = "?" if b["build_seed"] is None else b["build_seed"]
        out.append(f"| seed {seed} (`{b['model']}`){', power only' if b['power_only'] else ''} | "
                   f"{b['exact_perplexity']:.2f} | " + " | ".join(cells) + " |")
    counts = []
    for q in reqs:
        cs = [c for b in builds for c in b["columns"] if str(c["requested"]) == str(q)]
        counts.append(f"{head(q)}: above 0 on {sum(c['ci95'][0] > 0 for c in cs)} of {len(cs)} builds "
                      f"(from {min(c['ppl_change_pct'] for c in cs):+.2f}% to "
                      f"{max(c['ppl_change_pct'] for c in cs):+.2f}%)")
    return out + ["", "Substitute-all's interval: " + "; ".join(counts) + ".", ""]


def claims_count_lines(res: dict[str, Any]) -> list[str]:
    """How many claims the page tests and what no correction for their number means for reading a verdict."""
    tested = [r for r in res["rows"] if r["verdict"] not in (UNTESTABLE,)]
    paper = [r for r in tested if not r.get("own_check")]
    ids = sorted({r["id"] for r in paper})
    n = len(paper)
    return [f"**Several claims, no correction.** The table tests {n} (row, column) pairs of the paper's claims "
            f"({len(ids)} rows x {len(res['columns'])} columns; {len(tested) - n} more of the page's own check), "
            "each against its own 95% interval, with no correction for their number (no Holm or Bonferroni). An "
            "interval excludes an effect that is not there about 1 time in 20, so if none of the claimed effects "
            f"were real here, about {0.05 * n:.1f} of the {n} verdicts could read 'holds' or 'differs' by chance "
            f"alone; a Bonferroni reading would need each interval at {100 - 5 / max(n, 1):.2f}%, which this page "
            "does not compute. A verdict shared by every column and by the second build is the one to rely on; one "
            "seen in a single column is weak evidence.", ""]


def block_lines(res: dict[str, Any]) -> list[str]:
    """How each column's block length was chosen: the interval width at every length tried, per series."""
    tol = res["setup"]["block_width_tolerance"]
    out = ["### Block length of the intervals", "",
           "Each interval resamples blocks of consecutive evaluation windows (the cache carries across windows). "
           "Per series, the 95% interval of its perplexity change (points) is computed at every block length "
           f"from 1 window to windows / {res['setup']['min_blocks']}; the series' length is the shortest one "
           f"beyond which no longer block widens the interval by more than {tol:.0%}; the column uses the "
           "longest of these. 'stopped' says whether a longer length was tried and found no wider; where it was "
           "not, the width was still growing at the longest length tried and the intervals may be too narrow.", ""]
    for c in res["columns"]:
        b = c["blocks"]
        out.append(f"- **{c['label']}**: blocks of {b['block']} windows ({b['block_tokens']} tokens, {b['blocks']} "
                   f"blocks; a document averages {b['document_tokens']:.0f} tokens); "
                   f"{'stopped' if b['stopped'] else 'NOT stopped (still growing at the longest length)'}.")
        for name, ch in b["check"].items():
            ws = ", ".join(f"{w['block']}: {w['width']:.3f}" for w in ch["widths"])
            out.append(f"  - {name}: width by length {ws}; chosen {ch['block']}"
                       f"{'' if ch['stopped'] else ' (not stopped)'}")
        t = next((r["data"].get("blocks") for r in res["rows"] if r["id"] == "4b" and r["column"] == c["label"]
                  and isinstance(r["data"].get("blocks"), dict)), None)
        if t:
            out.append(f"  - topic segments (4b): blocks of {t['block']} segments ({t['blocks']} blocks); "
                       f"{'stopped' if t['stopped'] else 'NOT stopped'}; " + "; ".join(
                           f"{name}: " + ", ".join(f"{w['block']}: {w['width']:.3f}" for w in ch["widths"])
                           for name, ch in t["check"].items()))
    return out


def reading(res: dict[str, Any]) -> list[str]:
    """The page's reading of the table, every number taken from `res`."""
    cols, sw = res["columns"], res["sweep"]
    pts = sw["points"]
    lines = ["## Reading the table", "",
             "(Generated with the table from the same run: every figure below is in findings.json, beside this page.)", ""]
    found = next((c for c in cols if c["paper_regime"]), None)
    lines.append(f"- **Regime.** Sweeping substitute-all over {pts[0]['slots']}-{pts[-1]['slots']} slots on the "
                 f"recorded routing, its substituted share runs from {pts[0]['substitute_all_share']:.1%} to "
                 f"{pts[-1]['substitute_all_share']:.1%}; the paper's {sw['target_share']:.1%} is nearest at "
                 f"{sw['found']:.1%} of the experts" +
                 (f" ({found['slots']} slots, {found['slots_per_top_k']:.1f} per top-k against the paper's "
                  f"{res['paper_regime']['slots_per_top_k']:.1f}; substitute-all there "
                  f"{found['substitute_all_share']:.1%})." if found else "."))
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in res["rows"]:
        by_id.setdefault(r["id"], []).append(r)
    for rid, rs in by_id.items():
        parts = [f"**{r['verdict']}** at {r['column']} (interval {r['ci95']})" for r in rs]
        lines.append(f"- **{rid}. {rs[0]['finding']}**: " + "; ".join(parts) + ".")
    for r in by_id.get("5", []):
        d = r["data"]
        h = min((k for k in d if isinstance(d[k], dict) and "head_share_all_resident" in d[k]), default=None)
        if h is not None:
            lines.append(
                f"- **Speed, the head ({r['column']}).** The simulated model has {d['layers']} MoE layers but the "
                f"paper's 152k-token LM head; uncharged, the head is {d[h]['head_share_all_resident_uncharged']:.0%} "
                f"of an all-resident token on {h} (QF {d[h]['quality-first']['speed_ratio_head_uncharged']:.2f}x "
                f"uncharged). Charged {d['layers']}/{PAPER_LAYERS} of its time, as on the 48-layer model, it is "
                f"{d[h]['head_share_all_resident']:.0%} and QF reaches {d[h]['quality-first']['speed_ratio']:.2f}x; "
                f"fetch-every-miss spends {d[h]['fetch_every_miss_stall_share']:.0%} of its time waiting for fetches.")
    st = res["setup"]
    lines += ["", f"Model `{st['model']}` (exact perplexity {st['exact_perplexity']:.3f} on {st['tokens']} tokens): a "
              "tiny model, so magnitudes are a weak model's; the verdicts test directions, 2a also the paper's 0.92, "
              "5q F5's 0.5-0.8 points, and 5 the paper's 2.5-3.0x, simulated with Qwen3-Next's expert size on this "
              f"model's routing ({st['num_layers']} layers, {st['num_experts']} experts, top-{st['top_k']}): not "
              "the paper's shape."]
    return lines


def table(rows: list[dict[str, Any]], order: list[str]) -> list[str]:
    """The findings table of `rows`, the columns side by side; a row's paper hedge follows its quotation."""
    out = ["| # | finding | paper (Qwen3-Next-80B-A3B), quoted from | column | ours | 95% interval | verdict |",
           "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: order.index(r["id"])):
        note = r.get("paper_note", "")
        paper = f"{r['paper']} ({r['paper_source']})" + (f"; the paper's hedge: {note}" if note else "")
        v = f"**{r['verdict']}**"
        if r["verdict"] == UNSTABLE:
            v += " ({} on the first build, {} on the second)".format(*r["verdict_by_build"])
        cells = [r["id"], r["finding"], paper, r["column"], r["ours"], r["ci95"], v]
        out.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return out


def to_markdown(res: dict[str, Any], command: str | None = None) -> str:
    """The whole page body: command, commit, regimes, the table, the rules, the block check and the reading."""
    st = res["setup"]
    head = []
    if command:
        pr = res.get("processes")
        took = (f"{res['wall_seconds'] / 60:.1f} min on this machine for every build's findings, "
                f"{pr['workers']} process(es) at a time with {pr['threads_each']} thread(s) each: " + ", ".join(
                    f"{j['name']} {j['seconds'] / 60:.1f} min" for j in pr["jobs"])
                if pr else f"{res['seconds'] / 60:.1f} min on this machine")
        head += [f"`{command}` ({took})", ""]
    c = res.get("commit") or {}
    if c.get("commit"):
        head += [f"Commit `{c['commit'][:12]}`{' (with uncommitted changes)' if c.get('dirty') else ''}.", ""]
    head.append(f"Model `{st['model']}`: {st['num_layers']} MoE layers, {st['num_experts']} experts, "
                f"top-{st['top_k']}; evaluated text `{st['eval_text']}`, {st['tokens']} tokens, exact perplexity "
                f"{st['exact_perplexity']:.3f}; warm start: {st['initial_residency']}. Intervals: "
                f"{st['bootstrap_resamples']} bootstrap resamples, seed {st['seed']}.")
    if res.get("format", 1) < 2:
        head += ["", "**This result was computed by an older version of the findings (before one interval per statistic): its rows "
                 "follow that version's rules (2a's interval a union of two, row 1 and 2b as tested then), not the "
                 "rules listed in runtime/tools/findings/rules.py now.**"]
    head += ["", f"{PAPER_HEDGE[0].upper()}{PAPER_HEDGE[1:]}. The rows below test what it claimed"
             + (", each against one 95% interval fixed before the data." if res.get("format", 1) >= 2 else "."), ""]
    sb = res.get("second_build")
    head += [f"Every verdict was also computed on a second build of the model (`{sb['model']}`, exact perplexity "
             f"{sb['exact_perplexity']:.3f}): a row whose verdicts differ between the builds reads **unstable**.", ""
             ] if sb else ["Verdicts on one build of the model only (no second build compared).", ""]
    head += claims_count_lines(res)
    head += ["### Cache regimes", ""] + regime_lines(res) + [""] + power_lines(res) + ["### Findings", ""]
    order = [r["id"] for r in res["rows"]]
    own = [r for r in res["rows"] if r.get("own_check")]
    lines = table([r for r in res["rows"] if r not in own], order)
    if own:
        lines += ["", "### The page's own checks (not claims of the paper's)", ""] + table(own, order)
    rules = ["", "### How each verdict is decided", ""]
    seen: set[str] = set()
    for r in res["rows"]:
        if r["id"] not in seen:
            seen.add(r["id"])
            rules.append(f"- {r['id']}: {r['rule']}.")
    samples = ["", "Samples:", ""] + [f"- {r['id']} at {r['column']}: {r['sample']}." for r in res["rows"]]
    return "\n".join(head + lines + rules + samples + [""] + block_lines(res) + [""] + reading(res) + [""]
                     + admission_lines(res)) + "\n"
