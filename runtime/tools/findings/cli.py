"""`python -m runtime.findings` (`expertsweep findings`): every finding on a checkpoint at each cache size, as
JSON and as the Markdown page (`render`).

    python -m runtime.findings --model DIR [--max-tokens N] [--capacity-fraction 0.25 --capacity-fraction paper]
        [--json] [--out-md FILE --out-json FILE]

Each `--capacity-fraction` is a column: a fraction in (0, 1), or `paper`, the capacity at which substitute-all
substitutes about the paper's 8.5% of calls (found by a simulator sweep over the recorded routing). Every flag
is checked before any work; bad input is one line naming the flag and its value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runtime.core.errors import ArgumentParser, InputError, atomic_write, check_output_path
from runtime.core.spec import Result
from runtime.core.threads import configure as configure_threads
from runtime.tools.findings import admission, memory, stats
from runtime.tools.findings import experiments as X
from runtime.tools.findings.experiments import (
    PAPER_EXPERTS,
    PAPER_LAYERS,
    PAPER_SLOTS,
    PAPER_SUB_ALL_SHARE,
    PAPER_TOPK,
    Row,
    Setup,
    exact_trace,
    paper_capacity,
    regime,
)
from runtime.tools.findings.render import to_markdown
from runtime.tools.findings.routing import finding_routing
from runtime.tools.findings.rules import MEMORY, UNSTABLE
from runtime.tools.findings.topic import finding_topic

log = logging.getLogger(__name__)

FORMAT = 2  # the result's format: 2 = one interval per statistic, the paper's claims as made


def git_commit(repo: Path | None = None) -> dict[str, Any]:
    """The commit this code runs at, and whether tracked files differ from it ({"commit": None} outside git)."""
    repo = repo or Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": head, "dirty": dirty}


def scrub(text: str, model: Path) -> str:
    """`text` with the model folder written `<model>` and the home folder `~`: no machine paths in outputs."""
    for p in sorted({str(model.resolve()), str(model)}, key=len, reverse=True):
        text = text.replace(p, "<model>")
    return text.replace(str(Path.home()), "~")


def parse_capacity_fraction(value: str) -> float | str:
    """A --capacity-fraction value: a fraction in (0, 1) or `paper`."""
    if value == "paper":
        return value
    try:
        f = float(value)
    except ValueError:
        f = math.nan
    if not 0 < f < 1:
        raise InputError(f"--capacity-fraction = {value!r} must be a number in (0, 1) or 'paper'")
    return f


def timer(label: str, timings: dict[str, float]) -> Callable[..., Any]:
    """`timed(name, fn, *args)`: fn(*args), its seconds kept in `timings` under "label/name" and logged."""
    def timed(name: str, fn: Callable[..., Any], *a: Any) -> Any:
        t = time.perf_counter()
        out = fn(*a)
        timings[f"{label}/{name}"] = round(time.perf_counter() - t, 1)
        log.info("finding %s (%s): %.0f s", name, label, timings[f"{label}/{name}"])
        return out
    return timed


def run_column(s: Setup, label: str, timings: dict[str, float]) -> tuple[list[Row], Result]:
    """Every finding at `s.capacity_fraction`, and the fetch-every-miss result (the exact model's figures)."""
    timed = timer(label, timings)
    main, mp, kept = X.emulate_column(s, timed)
    s.starts, s.blocks = X.choose_blocks(s, main)
    r2a, r2b, r2c = X.finding_mass(s, mp, kept)
    r4a, r5q, r5s = X.finding_admission(s, main)
    # the admission rows again at equal device memory (`memory`), and row 7 (`routing`) at the same memory
    trace, calib_ids, _ = exact_trace(s, s.eval_text)
    slots = int(X.caps_and_warm(trace, calib_ids, s.capacity_fraction)[0][0])
    eq = memory.equal_memory(s, trace, slots)
    mem = timed("memory", memory.emulate_memory, s, eq, trace.k)
    r4am, r5qm = memory.finding_admission_memory(s, main, mem, eq)
    r4bm = (timed("topic-memory", finding_topic, s, "4b" + MEMORY, memory.pooled("quality-first"),
                  eq["emulation"]["budget_gib"]) if mem else memory.untestable("4b", eq))
    r5m = (timed("speed-memory", X.finding_speed, s, mem, "5" + MEMORY, memory.speed_policies(eq))
           if memory.fits(eq, "cost model", trace.k) and mem else memory.untestable("5", eq))
    r7 = timed("routing", finding_routing, s, main, eq["emulation"]["budget_gib"], slots)
    rows = [X.finding_heavy(s, main), r2a, r2b, timed("band", X.finding_band, s), r4a, r4am,
            timed("topic", finding_topic, s), r4bm, timed("speed", X.finding_speed, s, main), r5m, r5q, r5qm, r5s,
            timed("generation", X.finding_generation, s), r2c, r7]  # the paper's rows in order, then the page's own
    for r in rows:
        r.column = label
    return rows, main["fetch-every-miss"].result


def run_power_column(s: Setup, label: str, timings: dict[str, float]) -> tuple[list[Row], Result]:
    """`--power-only`: row 1 alone at `s.capacity_fraction` (the presets' emulations, the column's blocks chosen as
    in `run_column`), for substitute-all's cost on another build (`power`); the fetch-every-miss result."""
    main = timer(label, timings)("presets", lambda: X.emulate_policies(s, X.preset_policies(), s.eval_text))
    s.starts, s.blocks = X.choose_blocks(s, main)
    row = X.finding_heavy(s, main)
    row.column = label
    return [row], main["fetch-every-miss"].result


def power(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per column of a result: substitute-all's perplexity change and its 95% interval (row 1's data), its share of
    substituted calls and the column's C/k: the power of the findings' regime on this build."""
    out = []
    for c in res["columns"]:
        r = next(r for r in res["rows"] if r["id"] == "1" and r["column"] == c["label"])
        sa = r["data"]["substitute-all"]
        out.append({"column": c["label"], "requested": c["requested"], "c_over_k": c["c_over_k"],
                    "substitute_all_share": c["substitute_all_share"], "ppl_change_pct": sa["ppl_change_pct"],
                    "ci95": sa["ci95"], "above_zero": sa["ci95"][0] > 0, "row1_verdict": r["verdict"]})
    return out


def admission_ppl(rows: Sequence[Row], columns: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per column: C/k and admission's perplexity effects with their intervals (Quality-First minus the 0.15 rule,
    Speed-First minus first-choice; points), from row 4a's data; `equal_memory`: the same at equal device memory
    (row 4a-mem's data: the admission policies with a bounded copy pool, at the slots the budget leaves them)."""
    out = []
    for c in columns:
        d = next(r.data for r in rows if r.id == "4a" and r.column == c["label"])
        p = {"column": c["label"], "c_over_k": c["c_over_k"],
             "qf_minus_rule": {"point": d["difference"], "ci95": d["ci95"]},
             "sf_minus_fc": {k: d["speed_first_minus_first_choice"][k] for k in ("point", "ci95")}}
        m = next((r.data for r in rows if r.id == "4a" + MEMORY and r.column == c["label"]), {})
        if "speed_first_minus_first_choice" in m:  # at equal device memory (row 4a-mem)
            p["equal_memory"] = {"slots": m["equal_memory"]["emulation"]["slots"],
                                 "copy_buffers": m["equal_memory"]["copy_buffers"],
                                 "qf_minus_rule": {"point": m["difference"], "ci95": m["ci95"]},
                                 "sf_minus_fc": {k: m["speed_first_minus_first_choice"][k] for k in ("point", "ci95")}}
        out.append(p)
    return out


def stability(res: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """`res` with every row's verdict checked on a second build's result `second` (the same command on another
    build seed): rows are matched by id and requested capacity (the columns' `requested`); a row whose verdicts
    differ becomes `unstable` (both kept: `verdict_by_build`), one without a match in `second` keeps its verdict
    with `verdict_by_build` [its own, None]. `res["second_build"]` names the second model."""
    def key(r: dict[str, Any], cols: list[dict[str, Any]]) -> tuple[str, str]:
        req = next(c["requested"] for c in cols if c["label"] == r["column"])
        return r["id"], str(req)

    other = {key(r, second["columns"]): r["verdict"] for r in second["rows"]}
    for r in res["rows"]:
        v2 = other.get(key(r, res["columns"]))
        r["verdict_by_build"] = [r["verdict"], v2]
        if v2 is not None and v2 != r["verdict"]:
            r["verdict"] = UNSTABLE
    res["second_build"] = {"model": second["setup"]["model"],
                           "exact_perplexity": second["setup"]["exact_perplexity"], "commit": second["commit"]}
    return res


def check_run_args(model: Path, max_tokens: int | None, capacity_fractions: Sequence[float | str], segment: int,
                   early: int) -> list[float | str]:
    """The checks `run` makes before any work; the parsed capacity fractions."""
    if not (model / "config.json").is_file():
        raise InputError(f"--model {model}: no config.json there (not a Hugging Face checkpoint directory)")
    if not (model / "eval.txt").is_file():
        raise InputError(f"--model {model}: no eval.txt beside the model (the evaluated text)")
    if max_tokens is not None and max_tokens < 512:
        raise InputError(f"--max-tokens = {max_tokens} must be >= 512")
    fracs = [parse_capacity_fraction(str(c)) for c in capacity_fractions]
    if not fracs:
        raise InputError("--capacity-fraction: at least one value is needed")
    if segment < 2 * early or early < 1:
        raise InputError(f"--segment = {segment} must be >= 2 x --early = {early} (and --early >= 1)")
    return fracs


def run(model: str | Path, max_tokens: int | None = None,
        capacity_fractions: Sequence[float | str] = (0.25, "paper"), segment: int = 320, early: int = 64,
        prompts_per_domain: int = 8, new_tokens: int = 32, seed: int = 0, progress: bool = False,
        power_only: bool = False) -> dict[str, Any]:
    """Every finding on `model` at each capacity; {"rows", "columns", "setup", "sweep", "commit", "power", ...}.
    `power_only`: row 1 alone per column (`run_power_column`), no admission curve."""
    from runtime.backends import hfmodel
    from runtime.tools.tinymodel import domain_texts

    model = Path(model)
    fracs = check_run_args(model, max_tokens, capacity_fractions, segment, early)
    eval_text = model / "eval.txt"
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    rows: list[Row] = []
    columns: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="findings-") as tmp:
        first = next((f for f in fracs if f != "paper"), 0.25)
        s0 = Setup(model, eval_text, domain_texts(model), float(first), max_tokens, segment, early,
                   prompts_per_domain, new_tokens, seed, Path(tmp), hfmodel.load(model), progress)
        trace, calib_ids, _ = exact_trace(s0, eval_text)
        paper_frac, sweep = paper_capacity(trace, calib_ids)
        adm_curve = None if power_only else admission.curve(trace, calib_ids)
        seen: list[float] = []
        for f in fracs:
            frac = paper_frac if f == "paper" else float(f)
            if any(math.isclose(frac, x) for x in seen):
                continue
            seen.append(frac)
            reg = regime(trace, calib_ids, frac)
            reg["paper_regime"] = math.isclose(frac, paper_frac)
            label = f"C={reg['slots']} ({frac:.1%})"
            s = dataclasses.replace(s0, capacity_fraction=frac, starts=None, blocks={})
            col_rows, ex = (run_power_column if power_only else run_column)(s, label, timings)
            reg.update({"label": label, "requested": f, "blocks": s.blocks})
            columns.append(reg)
            rows.extend(col_rows)
    res = {"commit": git_commit(), "format": FORMAT, "power_only": power_only,
            "rows": [r.to_dict() for r in rows],
            "columns": columns,
            "paper_regime": {"model": "Qwen3-Next-80B-A3B", "slots": PAPER_SLOTS, "experts": PAPER_EXPERTS,
                             "top_k": PAPER_TOPK, "slots_per_top_k": PAPER_SLOTS / PAPER_TOPK,
                             "substitute_all_share": PAPER_SUB_ALL_SHARE, "layers": PAPER_LAYERS},
            "sweep": {"policy": "substitute-all", "backend": "simulator (recorded exact routing, warm start from "
                      "the calibration routing)", "target_share": PAPER_SUB_ALL_SHARE, "found": paper_frac,
                      "points": [{k: p[k] for k in ("slots", "substitute_all_share", "warm_set_miss_rate")}
                                 for p in sweep]},
            "setup": {"model": model.name, "eval_text": eval_text.name, "domains": sorted(domain_texts(model)),
                      "num_experts": ex.num_experts, "top_k": ex.top_k, "num_layers": ex.num_layers,
                      "tokens": ex.tokens, "max_tokens": max_tokens, "exact_perplexity": ex.exact_perplexity,
                      "initial_residency": scrub(str(ex.initial_residency), model), "segment": segment,
                      "early": early, "prompts_per_domain": prompts_per_domain, "new_tokens": new_tokens,
                      "seed": seed, "bootstrap_resamples": stats.N_BOOT, "min_blocks": stats.MIN_BLOCKS,
                      "block_width_tolerance": stats.WIDTH_TOL},
            "admission": None if power_only else {
                "model": {"source": f"{model.name} (recorded exact routing of {eval_text.name})", "experts": trace.E,
                          "top_k": trace.k, "layers": trace.L, "tokens": trace.T, "warm_start": "calibration text",
                          "points": adm_curve},
                "model_ppl": admission_ppl(rows, columns)},
            "seconds": round(time.perf_counter() - t0, 1), "seconds_by_finding": timings,
            "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    res["power"] = power(res)
    return res


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = ArgumentParser(prog="python -m runtime.findings", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory with eval.txt (and calib.txt)")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluated tokens per text (default: all)")
    p.add_argument("--capacity-fraction", action="append", default=None,
                   help="a column's cache size: a fraction in (0, 1), or 'paper' (where substitute-all substitutes "
                        "~8.5%% of calls); repeatable (default: 0.25 and paper)")
    p.add_argument("--segment", type=int, default=320, help="tokens between topic switches")
    p.add_argument("--early", type=int, default=64, help="tokens after a switch counted as 'early'")
    p.add_argument("--prompts", type=int, default=8, help="generation prompts per domain")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--power-only", action="store_true",
                   help="row 1 alone per column: substitute-all's cost and interval (the power check of another build)")
    p.add_argument("--json", action="store_true", help="print the JSON result")
    p.add_argument("--out-md", default=None, help="write the Markdown page here")
    p.add_argument("--out-json", default=None, help="write the JSON result here")
    p.add_argument("--command", default=None, help="command line to print above the Markdown table")
    return p


def checked_args(argv: list[str] | None) -> argparse.Namespace:
    """Parsed and checked flags (every check before any work)."""
    configure_threads()  # first, before torch loads: also for scripts/findings.py (runtime/core/threads.py)
    a = build_parser().parse_args(argv)
    check_output_path(a.out_md, "--out-md")
    check_output_path(a.out_json, "--out-json")
    for flag, v in (("--prompts", a.prompts), ("--new-tokens", a.new_tokens)):
        if v < 1:
            raise InputError(f"{flag} = {v} must be >= 1")
    a.capacity_fraction = [parse_capacity_fraction(v) for v in (a.capacity_fraction or ["0.25", "paper"])]
    return a


def main(argv: list[str] | None = None) -> None:
    """Run the findings and print (and optionally write) the page or the JSON."""
    a = checked_args(argv)
    res = run(a.model, a.max_tokens, a.capacity_fraction, a.segment, a.early, a.prompts, a.new_tokens, a.seed,
              progress=sys.stderr.isatty(), power_only=a.power_only)
    md = to_markdown(res, a.command)
    text = json.dumps(res, indent=2)
    if a.out_json:
        atomic_write(a.out_json, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"))
    if a.out_md:
        atomic_write(a.out_md, lambda tmp: Path(tmp).write_text(md, encoding="utf-8"))
    print(text if a.json else md)
