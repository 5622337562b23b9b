"""The findings' experiments on one checkpoint: the emulations and simulations behind each row, at one cache size
(a column), and each row's text. The statistics and verdicts come from `rows` (pure functions of the arrays
gathered here), the rules from `rules`.

Each column (`cli.run_column`) runs:

1. **Heavy experts**: substitute-all against the 0.15 rule: the share of its loss the rule removes and the share
   of its substituted calls the rule spares (emulation).
2. **Mass hypothesis**: (a) r across distinct first-choice-fetching policies (policies making the same decisions
   on the exact routing counted once: `trace_decisions`, `dedupe`); (b) per policy, r across the windows;
   (c, the page's own check, rendered below the paper's rows) with/without-admission pairs: does the loss follow
   the mass?
3. **Experiment B**: a heavy band and a light band matched on substituted mass; heavy minus light.
4. **Admission**: (a) Quality-First minus the 0.15 rule overall; (b) the same right after a topic switch, and
   that early gap minus the later one.
5. **Speed** (cost model on the recorded routing, Qwen3-Next's expert size, the LM head charged L/48 of its
   time so that it weighs what it weighs on the paper's 48-layer model); 5q and 5s, F5's perplexity:
   Quality-First minus the rule against 0.5-0.8 points below, Speed-First minus Quality-First.
6. **Greedy generation agreement** with the exact model (no paper figure: not testable here).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.core.policy import PRESETS, PolicyConfig
from runtime.core.spec import Result, RunSpec
from runtime.tools.findings import rows as R
from runtime.tools.findings import stats
from runtime.tools.findings.rules import PAPER_R, R_SMALL, RULES, UNTESTABLE
from runtime.tools.findings.stats import fmt_ci

log = logging.getLogger(__name__)

SUB, DROP = 2, 3  # runtime.core.kernel.KIND_NAMES
BAND_TOP = 1.01  # above every gate weight: band(tau, BAND_TOP) = every non-first miss with w >= tau
MASS_MATCH = 0.10  # Experiment B's bands count as matched when their masses differ by at most 10%
EOS = "<|endoftext|>"

# Qwen3-Next-80B-A3B as the paper runs it (the project's spec, docs/policies.md)
PAPER_LAYERS, PAPER_EXPERTS, PAPER_TOPK, PAPER_SLOTS = 48, 512, 10, 128
PAPER_SUB_ALL_SHARE = 0.085  # substitute-all's substituted share of calls at ~25% resident
LOSSY = ("substitute-all", "rule-0.15", "first-choice", "quality-first", "speed-first")


@dataclass
class Row:
    """One finding in one capacity column: the paper's claim, ours, the interval, the verdict and its rule."""

    id: str
    ours: str
    ci95: str
    verdict: str
    sample: str
    data: dict[str, Any] = field(default_factory=dict)
    column: str = ""

    def to_dict(self) -> dict[str, Any]:
        rule = RULES[self.id]
        return {"id": self.id, "column": self.column, "finding": rule.finding, "paper": rule.paper,
                "paper_source": rule.source, "ours": self.ours, "ci95": self.ci95, "verdict": self.verdict,
                "rule": rule.text(), "sample": self.sample, "paper_note": rule.note, "own_check": rule.own,
                "data": self.data}


@dataclass
class Setup:
    """What every finding of one column shares: the model, its texts, the cache size, the budgets."""

    model: Path
    eval_text: Path
    domains: dict[str, Path]  # eval text per domain ({} for one-domain models)
    capacity_fraction: float
    max_tokens: int | None
    segment: int
    early: int
    prompts_per_domain: int
    new_tokens: int
    seed: int
    tmp: Path
    m: Any  # runtime.backends.hfmodel.Loaded: the checkpoint every emulation here runs on
    progress: bool = False
    traces: dict = field(default_factory=dict)  # memo of exact_trace (shared by the columns)
    starts: np.ndarray | None = None  # first window of each bootstrap block of the eval text
    blocks: dict[str, Any] = field(default_factory=dict)  # how the block length was chosen


@dataclass
class PolicyRun:
    """One policy's emulation with per-window figures."""

    name: str
    result: Result
    dnll: np.ndarray  # [n] summed NLL difference to the exact model per window
    count: int  # scored tokens per window
    window: int  # tokens per window
    calls: np.ndarray | None = None  # [n] substituted or dropped calls per window (with `decisions`)
    all_calls: np.ndarray | None = None  # [n] expert calls per window
    mass: np.ndarray | None = None  # [n] substituted mass per window (with `mass`)
    nll: np.ndarray | None = None  # [n, W-1] per-token NLL
    nll_exact: np.ndarray | None = None

    @property
    def change(self) -> float:
        return float(self.result.ppl_change_pct)

    def share(self) -> float:
        c = self.result.counters
        return (c["substitutions"] + c["drops"]) / max(c["calls"], 1)


def emulate_policies(s: Setup, policies: dict[str, PolicyConfig], text: Path, *, mass: bool | Collection[str] = False,
                     nll: bool = False, max_tokens: int | None | str = "setup",
                     budget: dict[str, float] | None = None) -> dict[str, PolicyRun]:
    """Emulate named policies on one text (one exact pass); per-window NLL change, substituted calls, optional mass.

    `budget` ({name: GiB}): those policies run at that device memory (RunSpec.vram_budget_GiB: the slots
    `capacities_for_budget` gives them on the loaded model's shape) instead of the column's capacity fraction.

    With `mass` (True: every policy; a collection: the policies it names), the router's gate weights are recorded
    during each policy run (its trace, `trace_out`) and summed over the calls the decisions mark substituted or
    dropped; the total is checked against the kernel's own substituted-mass counter."""
    import pyarrow.parquet as pq

    from runtime.backends.emulate import evaluate_group
    from runtime.formats.trace import load_trace

    mt = s.max_tokens if max_tokens == "setup" else max_tokens
    out: dict[str, PolicyRun] = {}
    for i, (name, pol) in enumerate(policies.items()):
        nll_path = s.tmp / f"nll-{i}.parquet"
        # the routing the policy run sees; Arrow IPC, uncompressed: a third of the parquet round trip's time
        record = mass if isinstance(mass, bool) else name in mass
        trace_path = s.tmp / f"trace-{i}.arrow" if record else None
        size = ({"vram_budget_GiB": budget[name]} if budget and name in budget else
                {"capacity_fraction": s.capacity_fraction})
        spec = RunSpec(policy=pol, name=name, **size, model=str(s.model),
                       text=str(text), max_tokens=mt, nll_out=str(nll_path), record_decisions=True,
                       trace_out=None if trace_path is None else str(trace_path))
        res = evaluate_group(s.m, [spec], progress=s.progress)[0]
        tab = pq.read_table(nll_path).to_pandas()
        nll_path.unlink()
        n, W = int(res.extra["windows"]), int(res.extra["window"])
        ex = tab["nll_exact"].to_numpy().reshape(n, W - 1)
        po = tab[f"nll_{spec.label}"].to_numpy().reshape(n, W - 1)
        kind = res.decisions["kind"]  # [T, L, k]
        lost = (kind == SUB) | (kind == DROP)  # [T, L, k]
        run = PolicyRun(name, res, (po - ex).sum(1), W - 1, W,
                        calls=lost.reshape(n, -1).sum(1).astype(np.float64),
                        all_calls=(kind >= 0).reshape(n, -1).sum(1).astype(np.float64))
        if trace_path is not None:
            weights = load_trace(trace_path).topk_weights[..., : kind.shape[-1]]  # [T, L, k]
            trace_path.unlink()
            if weights.shape != kind.shape:
                raise RuntimeError(f"findings: recorded weights {weights.shape} != decisions {kind.shape} ({name})")
            per_tok = (weights.astype(np.float64) * lost).sum((1, 2))  # [T]
            total = float(per_tok.sum())
            if not math.isclose(total, res.counters["substituted_mass"], rel_tol=1e-4, abs_tol=1e-6):
                raise RuntimeError(f"findings: mass from decisions {total} != counter "
                                   f"{res.counters['substituted_mass']} ({name})")
            run.mass = per_tok.reshape(n, W).sum(1)
        res.decisions = None
        if nll:
            run.nll, run.nll_exact = po, ex
        out[name] = run
    return out


def exact_trace(s: Setup, text: Path, depth: int | None = None) -> tuple[Any, np.ndarray | None, int]:
    """The exact model's routing over the evaluated windows, the calibration routing the warm start comes from
    and the window length (memoised: the same for every capacity)."""
    key = (str(text), depth)
    if key in s.traces:
        return s.traces[key]
    from runtime.backends import hfmodel
    from runtime.backends.emulate import exact_pass

    spec = RunSpec(policy=PRESETS["fetch-every-miss"], capacity_fraction=s.capacity_fraction, model=str(s.model),
                   text=str(text), max_tokens=s.max_tokens)
    ex = exact_pass(s.m, spec)
    # the router scores too: Cache-Prior's replay reads them (row 7, `routing`)
    ids, w, rank, _, _, scores = hfmodel.record_routing(s.m, ex.windows, depth or s.m.E, 0, spec.batch_windows,
                                                        s.progress, desc="record", scores=True)
    trace = hfmodel.make_trace(s.m, ids, w, rank, ex.windows, ex.sha, "runtime.tools.findings",
                               router_scores=scores)
    s.traces[key] = (trace, ex.calib_ids, ex.windows.shape[1])
    return s.traces[key]


def caps_and_warm(trace: Any, calib_ids: np.ndarray | None, capacity_fraction: float | None,
                  calib_valid: np.ndarray | None = None, capacity: int | None = None) -> tuple[np.ndarray, Any]:
    """Per-layer capacities at `capacity_fraction` (or `capacity` slots per layer) and the warm start the
    emulation uses there (from the calibration ids [T_c, L, k], valid cells `calib_valid` [T_c, L] (default all);
    cold without them), resolved as every backend resolves a run (runtime/backends/resolve.py)."""
    from runtime.backends.resolve import IdsSource, resolve

    size = {"capacity": int(capacity)} if capacity is not None else {"capacity_fraction": capacity_fraction}
    spec = RunSpec(policy=PRESETS["fetch-every-miss"], trace="the exact pass's routing", **size,
                   initial_residency="cold" if calib_ids is None else None)
    run = resolve(spec, IdsSource(trace.L, trace.E, trace.k, calib_ids, calib_valid, source="calibration text"))
    return run.capacities, None if run.initial_residency is None else list(run.initial_residency)


def warm_miss_rate(trace: Any, init: Any) -> float:
    """Share of the trace's valid expert calls whose expert is not in the warm-start set."""
    if init is None:
        return 1.0
    miss, calls = 0, 0
    for l_ in range(trace.L):
        ids = trace.topk_ids[trace.valid[:, l_], l_, :]
        resident = np.zeros(trace.E, bool)
        resident[np.asarray(init[l_], np.int64)] = True
        miss += int((~resident[ids]).sum())
        calls += ids.size
    return miss / max(calls, 1)


def regime(trace: Any, calib_ids: np.ndarray | None, capacity_fraction: float) -> dict[str, Any]:
    """Where a capacity puts the model: slots, slots per top-k, warm-set miss rate, substitute-all's share."""
    from runtime.backends.simulate import replay

    caps, init = caps_and_warm(trace, calib_ids, capacity_fraction)
    c = replay(trace, PRESETS["substitute-all"], caps, init).cache.counter_totals()
    return {"capacity_fraction": capacity_fraction, "slots": int(caps[0]), "experts": trace.E, "top_k": trace.k,
            "slots_per_top_k": float(caps[0]) / trace.k, "c_over_k": float(caps[0]) / trace.k, "warm_set_miss_rate": warm_miss_rate(trace, init),
            "substitute_all_share": (c["substitutions"] + c["drops"]) / max(c["calls"], 1)}


def paper_capacity(trace: Any, calib_ids: np.ndarray | None,
                   target: float = PAPER_SUB_ALL_SHARE) -> tuple[float, list[dict[str, Any]]]:
    """The simulator sweep: substitute-all over every slot count k..E-1 on the recorded routing; the capacity
    fraction whose substituted share is nearest `target` (ties: fewer slots), and the sweep."""
    sweep = [regime(trace, calib_ids, c / trace.E) for c in range(trace.k, trace.E)]
    best = min(sweep, key=lambda r: (abs(r["substitute_all_share"] - target), r["slots"]))
    return best["capacity_fraction"], sweep


def document_tokens(s: Setup, text: Path) -> float:
    """Mean tokens per document of `text` (documents end with <|endoftext|>; a text without it is one)."""
    raw = text.read_text(encoding="utf-8")
    docs = max(sum(1 for d in raw.split(EOS) if d.strip()), 1)
    return len(s.m.tokenizer(raw, add_special_tokens=False)["input_ids"]) / docs


def choose_blocks(s: Setup, main: dict[str, PolicyRun]) -> tuple[np.ndarray, dict[str, Any]]:
    """Bootstrap blocks of the eval text's windows, the length chosen by the data (`stats.choose_block`) over
    every lossy preset's per-window loss and the two differences the rows test."""
    ref = main["rule-0.15"]
    n = len(ref.dnll)
    series = {name: main[name].dnll for name in LOSSY}
    series["substitute-all - rule-0.15"] = main["substitute-all"].dnll - ref.dnll
    series["quality-first - rule-0.15"] = main["quality-first"].dnll - ref.dnll
    info = stats.choose_block(series, np.full(n, ref.count, np.float64), s.seed)
    starts = stats.block_starts(n, info["block"])
    info.update({"windows": n, "window": ref.window, "blocks": len(starts), "block_tokens": info["block"] * ref.window,
                 "document_tokens": document_tokens(s, s.eval_text)})
    return starts, info


def sample_text(s: Setup, method: str) -> str:
    b = s.blocks
    return (f"{b['windows']} windows of {b['window']} tokens in {b['blocks']} blocks of {b['block']} windows "
            f"(length chosen by the data{'' if b['stopped'] else ', width still growing at the longest length'}), "
            f"{method}, {stats.N_BOOT} resamples")


def _blk(s: Setup, x: np.ndarray) -> np.ndarray:
    return stats.to_blocks(x, s.starts)


def policy_ci(s: Setup, run: PolicyRun) -> tuple[float, float]:
    lo, hi, _ = stats.block_ci((_blk(s, run.dnll), _blk(s, np.full(len(run.dnll), run.count))), stats.change_stat,
                               s.seed)
    return lo, hi


def finding_heavy(s: Setup, runs: dict[str, PolicyRun]) -> Row:
    sa, rule, fc = runs["substitute-all"], runs["rule-0.15"], runs["first-choice"]
    n = len(sa.dnll)
    d = R.heavy(s.starts, sa.dnll, rule.dnll, sa.calls, rule.calls, sa.all_calls, np.full(n, sa.count), s.seed)
    ci = {name: policy_ci(s, r) for name, r in runs.items()}
    dl, dc, lr, cs = d["loss_difference"], d["calls_difference"], d["loss_removed"], d["calls_spared"]
    ours = (f"0.15 rule {rule.change:+.2f}% {fmt_ci(*ci['rule-0.15'])} vs substitute-all {sa.change:+.2f}% "
            f"{fmt_ci(*ci['substitute-all'])} (first-choice {fc.change:+.2f}%); substituted calls "
            f"{rule.share() * 100:.1f}% vs {sa.share() * 100:.1f}%: (1) the rule removes {lr['point']:.0f}% of "
            f"substitute-all's loss ({dl['point']:+.2f} points); (2) it spares {cs['point']:.0f}% of its "
            f"substituted calls ({dc['point']:+.2f} points of all calls)")
    data = {name: {"ppl_change_pct": r.change, "ci95": list(ci[name]), "substituted_call_fraction": r.share(),
                   "mass_per_token": r.result.mass_per_token, "perplexity": r.result.perplexity}
            for name, r in runs.items()}
    data.update(d)
    data["exact_perplexity"] = sa.result.exact_perplexity
    cis = (f"(1) {fmt_ci(*lr['ci95'], '.0f', '%')}; (2) {fmt_ci(*cs['ci95'], '.0f', '%')} (loss difference "
           f"{fmt_ci(*dl['ci95'])} points, calls {fmt_ci(*dc['ci95'])} points)")
    return Row("1", ours, cis, d["verdict"], sample_text(s, d["method"]), data)


def mass_policies() -> dict[str, PolicyConfig]:
    """28 policies that always fetch the first choice: thresholds 0.05, 0.1, 0.15, 0.2, 0.3, 0.5 and
    first-choice x {lfu, lru} x admission {off, beta 0.5} (some coincide; `finding_mass` removes those)."""
    out = {}
    for tau in (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, None):
        for evict in ("lfu", "lru"):
            for beta in (None, 0.5):
                pol = (PolicyConfig(rule="first_choice", evict=evict, beta=beta) if tau is None else
                       PolicyConfig(rule="threshold", tau=tau, evict=evict, beta=beta))
                out[pol.label()] = pol
    return out


def preset_policies() -> dict[str, PolicyConfig]:
    """fetch-every-miss (the exact model's figures) and the lossy presets (`LOSSY`), by preset name."""
    return {n: PRESETS[n] for n in ("fetch-every-miss", *LOSSY)}


def emulate_column(s: Setup, timed: Callable[..., Any]) -> tuple[dict[str, PolicyRun], dict[str, PolicyRun],
                                                                   dict[str, str]]:
    """The column's emulations, each distinct policy once: the presets (`LOSSY` and fetch-every-miss), and the mass
    policies (`mass_policies`) without their copies (`kept`: the same decisions on the exact routing as an earlier
    one, `trace_decisions`) and without those that are presets (the same PolicyConfig: the preset's run, its mass
    recorded, serves both). (presets' runs, the distinct mass policies' runs, kept); `timed(name, fn, *args)`
    runs and times each of the two groups."""
    presets = preset_policies()
    pols = mass_policies()
    kept = dedupe(trace_decisions(s, pols))
    distinct = [n for n in pols if kept[n] == n]
    as_preset = {p.label(): n for n, p in presets.items() if p.label() in distinct}
    main = timed("presets", lambda: emulate_policies(s, presets, s.eval_text, mass=set(as_preset.values())))
    todo = {n: pols[n] for n in distinct if n not in as_preset}
    ran = timed("mass", lambda: emulate_policies(s, todo, s.eval_text, mass=True))
    return main, {n: ran[n] if n in ran else main[as_preset[n]] for n in distinct}, kept


def admission_pairs(policies: dict[str, PolicyConfig]) -> list[tuple[str, str]]:
    """(without, with admission) label pairs of `policies` that differ only in beta."""
    out = []
    for n, p in policies.items():
        if p.beta is None:
            q = dataclasses.replace(p, beta=0.5)
            if q.label() in policies:
                out.append((n, q.label()))
    return out


def dedupe(arrays: dict[str, tuple[np.ndarray, ...]]) -> dict[str, str]:
    """{name: the first name with identical arrays}: policies whose figures coincide are one policy."""
    kept: dict[str, str] = {}
    firsts: list[str] = []
    for n, arrs in arrays.items():
        for f in firsts:
            if all(np.array_equal(a, b) for a, b in zip(arrs, arrays[f], strict=True)):
                kept[n] = f
                break
        else:
            kept[n] = n
            firsts.append(n)
    return kept


def distinct_pairs(pairs: list[tuple[str, str]], kept: dict[str, str]) -> list[tuple[str, str]]:
    """Pairs mapped to their kept policies, each distinct pair once, pairs whose two sides coincide dropped."""
    out: list[tuple[str, str]] = []
    for a, b in pairs:
        p = (kept[a], kept[b])
        if p[0] != p[1] and p not in out:
            out.append(p)
    return out


def trace_decisions(s: Setup, policies: dict[str, PolicyConfig]) -> dict[str, tuple[np.ndarray, ...]]:
    """Each policy's decisions (kind, serving expert [T, L, k]) replayed by the simulator on the exact model's
    routing of the eval text at the column's cache size and warm start: two policies with the same decisions there
    are one policy (their emulations differ only through the routing their own substitutions perturb)."""
    from runtime.backends.simulate import replay

    trace, calib_ids, _ = exact_trace(s, s.eval_text)
    caps, init = caps_and_warm(trace, calib_ids, s.capacity_fraction)
    out = {}
    for name, pol in policies.items():
        dec = replay(trace, pol, caps, init, decisions=True).decisions
        out[name] = (dec["kind"], dec["served"])
    return out


def finding_mass(s: Setup, runs: dict[str, PolicyRun], kept: dict[str, str] | None = None) -> tuple[Row, Row, Row]:
    """Rows 2a, 2b and 2c from the mass policies' emulations; `kept` maps each policy to the first one with its
    decisions on the exact routing (`dedupe(trace_decisions(...))`; default: every policy of `runs` its own).
    `runs` needs only the distinct policies (the values of `kept`): the copies are counted, not used."""
    kept = dict(kept) if kept else {n: n for n in runs}
    missing = sorted({k for k in kept.values() if k not in runs})
    if missing:
        raise ValueError(f"finding_mass: no emulation of the distinct policies {missing}")
    names = [n for n in kept if kept[n] == n]  # copies need no emulation of their own (`run_column`)
    dups = {n: k for n, k in kept.items() if n != k}
    P, first = len(names), runs[names[0]]
    n_win = len(first.dnll)
    cnt, tok = np.full(n_win, first.count, np.float64), np.full(n_win, first.window, np.float64)
    dn = np.stack([runs[n].dnll for n in names])  # [P, n]
    ms = np.stack([runs[n].mass for n in names])  # [P, n]
    a = R.mass_across_policies(s.starts, dn, ms, cnt, tok, s.seed)
    mt, ch = np.asarray(a["mass_per_token"]), np.asarray(a["ppl_change_pct"])
    lo, hi = a["ci95"]
    inside = "inside" if lo <= PAPER_R <= hi else "outside"
    row_p = Row("2a", f"r = {a['r']:.3f} over {P} distinct first-choice-fetching policies ({len(dups)} with the "
                f"decisions of another on the exact routing counted once; mass/token {mt.min():.3f}-{mt.max():.3f}, "
                f"change {ch.min():+.2f}% to {ch.max():+.2f}%); the paper's {PAPER_R} is {inside} the interval",
                f"{fmt_ci(lo, hi, '.3f')}", a["verdict"], f"{P} distinct policies; " + sample_text(s, a["method"]),
                {**a, "duplicates": dups, "policies": {n: {"mass_per_token": float(m), "ppl_change_pct": float(c)}
                                                       for n, m, c in zip(names, mt, ch, strict=True)}})

    w = R.mass_per_input(s.starts, dn, ms, cnt, tok, s.seed)
    c = w["counts"]
    r_w = np.asarray(w["r_windows"], np.float64)
    widest = max(range(P), key=lambda i: w["ci95_windows"][i][1] - w["ci95_windows"][i][0]) if P else 0
    row_w = Row("2b", f"r across the {n_win} windows, per policy: median {w['r_median']:.3f} (from "
                f"{np.nanmin(r_w):.3f} to {np.nanmax(r_w):.3f}) over {P} distinct policies; {c['holds']} below "
                f"{R_SMALL:g}, {c['differs']} above it, {c['inconclusive here']} straddling it",
                "per policy: " + "; ".join(f"{n} {fmt_ci(*ci, '+.2f')}" for n, ci in
                                           zip(names, w["ci95_windows"], strict=True)),
                w["verdict"], f"{P} distinct policies (widest interval: {names[widest]}); " +
                sample_text(s, w["method"]),
                {**w, "r_windows": dict(zip(names, w["r_windows"], strict=True)),
                 "ci95_windows": dict(zip(names, w["ci95_windows"], strict=True)), "windows": n_win})

    pairs = distinct_pairs([(x, y) for x, y in admission_pairs(mass_policies()) if x in kept and y in kept], kept)
    ev = {R.pair_key(x, y): (runs[x].dnll, runs[x].mass, runs[y].dnll, runs[y].mass) for x, y in pairs}
    pr = R.admission_pairs(s.starts, ev, cnt, tok, s.seed)
    for x, y in pairs:
        pr["pairs"][R.pair_key(x, y)].update({"without_admission": x, "with_admission": y,
                                              "ppl_change_pct": runs[x].change,
                                              "ppl_change_pct_with_admission": runs[y].change})
    c = pr["counts"]
    raise_ = [f"{k}: {runs[pr['pairs'][k]['without_admission']].change:+.2f}% -> "
              f"{runs[pr['pairs'][k]['with_admission']].change:+.2f}% {fmt_ci(*pr['pairs'][k]['loss_ci95'])}"
              for k in pr["lower_mass_higher_loss"]]
    row_a = Row("2c", f"{len(pr['lower_mass_higher_loss'])} of {len(pairs)} distinct pairs: admission lowers "
                "substituted mass and raises the loss, both intervals excluding 0" +
                (f" ({'; '.join(raise_)})" if raise_ else ""),
                f"per pair: {c['holds']} hold, {c['differs']} differ, {c['inconclusive here']} inconclusive, "
                f"{c['not testable here']} with a mass-change interval containing 0", pr["verdict"],
                f"{len(pairs)} distinct pairs; " + sample_text(s, pr["method"] or "no interval"), pr)
    return row_p, row_w, row_a


def band_policy(lo: float, hi: float) -> PolicyConfig:
    return PolicyConfig(rule="band", tau=lo, tau_high=hi)


def matched_bands(s: Setup) -> tuple[float, float]:
    """(heavy band's low edge, light band's high edge): [0.15, 1] against [0, 0.15), the wider one narrowed by
    bisection on the simulator's substituted mass until the two match."""
    from runtime.backends.simulate import replay

    trace, calib_ids, _ = exact_trace(s, s.eval_text)
    caps, init = caps_and_warm(trace, calib_ids, s.capacity_fraction)

    def sim_mass(pol: PolicyConfig) -> float:
        return replay(trace, pol, caps, init).cache.counter_totals()["substituted_mass"] / trace.T

    heavy_lo, light_hi = 0.15, 0.15
    m_heavy = sim_mass(band_policy(heavy_lo, BAND_TOP))
    m_light_max = sim_mass(band_policy(0.0, light_hi))
    if m_light_max >= m_heavy:
        lo_, hi_ = 1e-4, light_hi
        for _ in range(18):
            mid = 0.5 * (lo_ + hi_)
            lo_, hi_ = (mid, hi_) if sim_mass(band_policy(0.0, mid)) < m_heavy else (lo_, mid)
        light_hi = 0.5 * (lo_ + hi_)
    else:
        lo_, hi_ = heavy_lo, 1.0
        for _ in range(18):
            mid = 0.5 * (lo_ + hi_)
            lo_, hi_ = (mid, hi_) if sim_mass(band_policy(mid, BAND_TOP)) > m_light_max else (lo_, mid)
        heavy_lo = 0.5 * (lo_ + hi_)
    return heavy_lo, light_hi


def finding_band(s: Setup) -> Row:
    heavy_lo, light_hi = matched_bands(s)
    runs = emulate_policies(s, {"heavy": band_policy(heavy_lo, BAND_TOP), "light": band_policy(0.0, light_hi)},
                            s.eval_text)
    h, li = runs["heavy"], runs["light"]
    mh, ml = h.result.mass_per_token, li.result.mass_per_token
    sh, sl = h.result.counters["substitutions"], li.result.counters["substitutions"]
    matched = abs(mh - ml) <= MASS_MATCH * max(mh, ml) and sh < sl
    d = R.difference("3", s.starts, h.dnll, li.dnll, np.full(len(h.dnll), h.count), s.seed, testable=matched)
    ours = (f"heavy band [{heavy_lo:.3f}, 1]: {sh} substitutions, mass/token {mh:.4f}, {h.change:+.2f}%; "
            f"light band [0, {light_hi:.3f}): {sl} substitutions, mass/token {ml:.4f}, {li.change:+.2f}%; "
            f"heavy minus light {d['difference']:+.2f} points (masses {'matched' if matched else 'NOT matched'} "
            f"within {abs(mh - ml) / max(mh, ml, 1e-12) * 100:.1f}%)")
    sample = sample_text(s, d["method"]) + (f"; not testable if the masses differ by more than {MASS_MATCH:.0%} or "
                                            "the heavy band does not substitute fewer calls")
    return Row("3", ours, f"{fmt_ci(*d['ci95'])} points", d["verdict"], sample,
               {**d, "matched": matched,
                "heavy": {"band": [heavy_lo, BAND_TOP], "mass_per_token": mh, "substitutions": sh,
                          "ppl_change_pct": h.change},
                "light": {"band": [0.0, light_hi], "mass_per_token": ml, "substitutions": sl,
                          "ppl_change_pct": li.change}})


def finding_admission(s: Setup, runs: dict[str, PolicyRun]) -> tuple[Row, Row, Row]:
    """Rows 4a (Quality-First minus the 0.15 rule, against "admission lowers perplexity"), 5q (the same difference
    against F5's 0.5-0.8% below the rule) and 5s (Speed-First minus Quality-First: F5's "no significant
    increase")."""
    qf, rule, sf = runs["quality-first"], runs["rule-0.15"], runs["speed-first"]
    cnt = np.full(len(qf.dnll), qf.count)
    out = []
    for rid, a, b in (("4a", qf, rule), ("5q", qf, rule), ("5s", sf, qf)):
        d = R.difference(rid, s.starts, a.dnll, b.dnll, cnt, s.seed)
        la, lb = ("Quality-First", "the 0.15 rule") if b is rule else ("Speed-First", "Quality-First")
        out.append(Row(rid, f"{la} {a.change:+.2f}% vs {lb} {b.change:+.2f}%: {d['difference']:+.2f} points",
                       f"{fmt_ci(*d['ci95'])} points", d["verdict"], sample_text(s, d["method"]),
                       {**d, a.name: a.change, b.name: b.change}))
    fc = runs["first-choice"]
    sf_fc = R.paired([stats.to_blocks(x, s.starts) for x in (sf.dnll, fc.dnll, cnt)], (stats.diff_stat,), s.seed)[0]
    out[0].data["speed_first_minus_first_choice"] = sf_fc  # admission's other pair (reported: reports/findings/findings.md)
    out[0].data["first-choice"] = fc.change
    return out[0], out[1], out[2]


def finding_speed(s: Setup, runs: dict[str, PolicyRun], rid: str = "5",
                  policies: dict[str, tuple[PolicyConfig, int]] | None = None) -> Row:
    """Row 5 (`rid`): fetch-every-miss's simulated time per token over Quality-First's and Speed-First's, per host.
    `policies` ({"quality-first" | "speed-first": (policy, slots per layer)}) replaces those presets (row 5-mem:
    with a bounded copy pool, at the slots the column's device memory leaves them); `runs` gives the perplexity
    reported beside."""
    from runtime.backends.simulate import replay
    from runtime.formats import costmodel

    trace, calib_ids, W = exact_trace(s, s.eval_text)
    caps, init = caps_and_warm(trace, calib_ids, s.capacity_fraction)
    shape = costmodel.shape_for_trace(trace, None)
    hosts = costmodel.list_host_profiles()  # the presets, in name order
    scale = trace.L / PAPER_LAYERS  # the head's share of a token as on the paper's 48-layer model
    n_win = trace.T // W
    pols: dict[str, tuple[PolicyConfig, int | None]] = {
        n: (PRESETS[n], None) for n in ("fetch-every-miss", "quality-first", "speed-first")}
    pols.update(policies or {})
    events = {}
    for n, (p, slots) in pols.items():
        c, i = (caps, init) if slots is None else caps_and_warm(trace, calib_ids, None, capacity=slots)
        events[n] = replay(trace, p, c, i).events  # [T, L, N_EV]
    data: dict[str, Any] = {"model_shape": shape.name, "head_scale": scale, "layers": trace.L,
                            "slots": {n: int(caps[0]) if sl is None else int(sl) for n, (_, sl) in pols.items()},
                            "policies": {n: p.label() for n, (p, _) in pols.items()}}
    parts, cis, sub, methods = [], [], [], set()
    for host in hosts:
        raw = costmodel.cost_params(costmodel.load_host_profile(host), shape)
        params = dataclasses.replace(raw, head_s=raw.head_s * scale)
        resident_raw = costmodel.all_resident_time(trace.valid, raw, trace.k)
        resident = costmodel.all_resident_time(trace.valid, params, trace.k)
        per_win, whole_raw, stall = {}, {}, {}
        for n, ev in events.items():
            tb = costmodel.replay_time(ev, trace.valid, params)
            per_win[n] = tb.token_s[: n_win * W].reshape(n_win, W).sum(1)  # [n]
            whole_raw[n] = costmodel.replay_time(ev, trace.valid, raw).per_token_s
            stall[n] = tb.stall_fetch_s / max(tb.total_s, 1e-30)
        data[host] = {"head_share_all_resident_uncharged": raw.head_s / resident_raw,
                      "head_share_all_resident": params.head_s / resident,
                      "fetch_every_miss_stall_share": stall["fetch-every-miss"]}
        for n in ("quality-first", "speed-first"):
            tag = "QF" if n == "quality-first" else "SF"
            d = R.speed(s.starts, per_win["fetch-every-miss"], per_win[n], s.seed)
            sub.append(d["verdict"])
            methods.add(d["method"])
            d["speed_ratio_head_uncharged"] = whole_raw["fetch-every-miss"] / whole_raw[n]
            data[host][n] = d
            parts.append(f"{host} {tag} {d['speed_ratio']:.2f}x")
            cis.append(f"{host} {tag} {fmt_ci(*d['ci95'], '.2f', 'x')}")
    costs = []
    for n in ("quality-first", "speed-first"):
        lo, hi = policy_ci(s, runs[n])
        costs.append(f"{'QF' if n == 'quality-first' else 'SF'} {runs[n].change:+.2f}% {fmt_ci(lo, hi)}")
        data[n] = {"ppl_change_pct": runs[n].change, "ci95": [lo, hi]}
    h0 = data[hosts[0]]
    ours = ("; ".join(parts) + f" (simulated: {shape.name}, head charged {trace.L}/{PAPER_LAYERS}: "
            f"{h0['head_share_all_resident']:.1%} of an all-resident token on {hosts[0]}, uncharged "
            f"{h0['head_share_all_resident_uncharged']:.1%}); perplexity (reported, not tested) " + ", ".join(costs))
    if policies:
        sl = data["slots"]
        ours = (f"at equal device memory, fetch-every-miss {sl['fetch-every-miss']} slots per layer, " + ", ".join(
            f"{'QF' if n == 'quality-first' else 'SF'} ({data['policies'][n]}) {sl[n]}" for n in policies) + ": "
            + ours)
    verdict = RULES[rid].decide([data[h][n]["ci95"] for h in hosts for n in ("quality-first", "speed-first")],
                                [RULES[rid].claims[0]] * (2 * len(hosts)))[0]
    return Row(rid, ours, "; ".join(cis), verdict,
               sample_text(s, "/".join(sorted(methods)) + " on the cost model's per-window times"), data)


def prompts_for(s: Setup, tokenizer: Any, max_positions: int) -> dict[str, list[str]]:
    """`prompts_per_domain` prompts per domain: line-aligned chunks of its eval text of about 48
    tokens (fewer when the model's positions cannot hold them and the generated tokens), spread
    evenly over the text."""
    limit = max(min(48, max_positions - s.new_tokens - 4), 1)
    texts = s.domains or {"all": s.eval_text}
    out = {}
    for d, p in texts.items():
        lines = p.read_text(encoding="utf-8").replace(EOS, "\n").splitlines(keepends=True)
        chunks, cur, n = [], [], 0
        for ln in lines:
            if not cur and not ln.strip():
                continue
            cur.append(ln)
            n += len(tokenizer(ln, add_special_tokens=False)["input_ids"])
            if n >= limit:
                ids = tokenizer("".join(cur), add_special_tokens=False)["input_ids"][:limit]
                chunks.append(tokenizer.decode(ids))
                cur, n = [], 0
        step = max(len(chunks) // max(s.prompts_per_domain, 1), 1)
        out[d] = chunks[::step][: s.prompts_per_domain]
    return out


def finding_generation(s: Setup) -> Row:
    from runtime.backends.engine import cpu_threads, load_engine
    from runtime.tools.generate import run_generate

    eng = load_engine(s.model, "cpu")
    data: dict[str, Any] = {}
    parts, cis, methods = [], [], set()
    n_prompts = 0
    try:
        with cpu_threads(eng.device, None):
            max_pos = int(getattr(eng.m.model.config, "max_position_embeddings", 1 << 30))
            prompts = prompts_for(s, eng.m.tokenizer, max_pos)
            for pol in ("quality-first", "speed-first"):
                for d, ps in prompts.items():
                    if not ps:
                        continue
                    res = run_generate(eng, ps, pol, s.new_tokens, capacity_fraction=s.capacity_fraction)
                    rates = np.array([r["agreement"] for r in res["per_prompt"]], np.float64)  # [prompts]
                    n_prompts = max(n_prompts, len(ps))
                    lo, hi, method = stats.block_ci((rates,), np.mean, s.seed)  # prompts are independent
                    methods.add(method)
                    data[f"{pol}/{d}"] = {"agreement": float(rates.mean()), "ci95": [lo, hi], "method": method,
                                          "prompts": len(ps), "identical": res["identical_prompts"]}
                    tag = "QF" if pol == "quality-first" else "SF"
                    parts.append(f"{tag} {d} {rates.mean() * 100:.0f}% ({res['identical_prompts']}/{len(ps)} "
                                 "identical)")
                    cis.append(f"{tag} {d} {fmt_ci(lo * 100, hi * 100, '.0f', '%')}")
    finally:
        eng.close()
    return Row("6", f"{s.new_tokens} greedy tokens per prompt: " + ", ".join(parts), "; ".join(cis), UNTESTABLE,
               f"up to {n_prompts} prompts per domain, resampled ({'/'.join(sorted(methods))}, {stats.N_BOOT} "
               "resamples)", data)
