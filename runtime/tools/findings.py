"""The paper's findings, reproduced on any MoE checkpoint: one row per finding and cache regime, with a verdict.

`python -m runtime.findings --model DIR [--max-tokens N] [--capacity-fraction 0.25 --capacity-fraction paper]
 [--json] [--out-md FILE --out-json FILE]` (`make findings` runs it on the `mix` reference model and writes
docs/findings.md). Every row has `paper` (the paper's claim as the paper states it, from the project's spec),
`ours` (measured here), `ci95` (a 95% interval), `verdict`, `rule` (how the verdict follows from the interval)
and `sample` (what the interval rests on).

Verdicts follow one rule set (`verdict`): a finding is a statistic whose no-effect value is `null` and whose
paper direction is up or down (and, for the speed row, a paper value range):
`holds` when the interval excludes no-effect on the paper's side (and overlaps the paper's range, where there
is one), `differs` when it excludes the paper's direction or its value, `inconclusive here` when it contains
no-effect; `not testable here` when there is nothing to test. A row whose interval contains no-effect is
never `differs`.

Intervals: BCa bootstrap (`scipy.stats.bootstrap`, paired: every policy's figures resampled together) over
blocks of consecutive evaluation windows (the policy cache carries across windows and documents span several),
about one document long and at least `MIN_BLOCKS` blocks; the interval width at other block sizes is
recorded beside it (`block_check`). The topic rows resample the topic stream's segments. Correlations across
policies also get `scipy.stats.pearsonr(...).confidence_interval()` over the distinct policies (duplicates,
policies whose decisions coincide, are removed first).

Each capacity column (`--capacity-fraction`, repeatable; `paper` = the capacity at which substitute-all
substitutes about the paper's 8.5% of calls, found by a simulator sweep over the recorded routing) runs:

1. **Heavy experts**: substitute-all minus the 0.15 rule, perplexity change (emulation).
2. **Mass hypothesis**: (a) r across distinct first-choice-fetching policies; (b) that r minus the 0.15 rule's
   r across windows; (c) with/without-admission pairs whose substituted mass moves one way and loss the other.
3. **Experiment B**: a heavy band and a light band matched on substituted mass; heavy minus light.
4. **Admission**: (a) Quality-First minus the 0.15 rule overall; (b) the same early after a topic switch
   minus later.
5. **Speed** (cost model on the recorded routing, Qwen3-Next's expert size, the LM head charged L/48 of its
   time so that it weighs what it weighs on the paper's 48-layer model).
6. **Greedy generation agreement** with the exact model (no paper figure: not testable here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.core.errors import (
    ArgumentParser,
    InputError,
    atomic_write,
    check_output_path,
)
from runtime.core.policy import PRESETS, PolicyConfig
from runtime.core.spec import Result, RunSpec

log = logging.getLogger(__name__)

SUB, DROP = 2, 3  # runtime.core.kernel.KIND_NAMES
BAND_TOP = 1.01  # above every gate weight: band(tau, BAND_TOP) = every non-first miss with w >= tau
N_BOOT = 2000
MIN_BLOCKS = 10  # a block bootstrap needs enough blocks: the block is capped at n_windows // MIN_BLOCKS
MASS_MATCH = 0.10  # Experiment B's bands count as matched when their masses differ by at most 10%
EOS = "<|endoftext|>"

HOLDS, DIFFERS, INCONCLUSIVE, UNTESTABLE = "holds", "differs", "inconclusive here", "not testable here"
VERDICTS = (HOLDS, DIFFERS, INCONCLUSIVE, UNTESTABLE)

# Qwen3-Next-80B-A3B as the paper runs it (the project's spec, docs/policies.md)
PAPER_LAYERS, PAPER_EXPERTS, PAPER_TOPK, PAPER_SLOTS = 48, 512, 10, 128
PAPER_SUB_ALL_SHARE = 0.085  # substitute-all's substituted share of calls at ~25% resident
PAPER_SPEED = (2.5, 3.0)

# The paper's claims, as the paper (through the spec and the issues that quote it) states them.
PAPER = {
    "heavy": "the loss comes from a few heavy experts: the 0.15 rule cuts the perplexity increase of substituting "
             "every miss from +5.67% to +0.35% while still substituting 7.5% of calls (substitute-all 8.5%)",
    "mass_policies": "across policies that always fetch the first choice, substituted mass and perplexity increase "
                     "correlate, Pearson r ~ 0.92",
    "mass_windows": "the mass hypothesis fails per input: on single inputs substituted mass does not track the loss "
                    "as it does across policies (no figure in the spec)",
    "mass_pairs": "less substituted mass, less loss (the mass hypothesis, applied to each with/without-admission "
                  "pair)",
    "band": "Experiment B: at equal substituted mass a few heavy substitutions hurt more than many light ones",
    "admission": "the 0.15 rule +0.35%, Quality-First (the rule + admission beta 0.5) +0.7-1.5%: admission costs "
                 "perplexity overall, for speed",
    "topic": "admission (Quality-First) helps most right after topic changes (no figure in the spec)",
    "speed": "Quality-First and Speed-First 2.5-3.0x faster per token than fetch-every-miss at +0.7-1.5% "
             "perplexity (Qwen3-Next-80B-A3B, 48 layers, RTX-class hosts)",
    "generation": "agreement test on GSM8K/HumanEval prompts (no figure in the spec)",
}


@dataclass
class Row:
    """One finding in one capacity column: the paper's claim, ours, the interval, the verdict and its rule."""

    id: str
    finding: str
    paper: str
    ours: str
    ci95: str
    verdict: str
    rule: str
    sample: str
    data: dict[str, Any] = field(default_factory=dict)
    column: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "column": self.column, "finding": self.finding, "paper": self.paper,
                "ours": self.ours, "ci95": self.ci95, "verdict": self.verdict, "rule": self.rule,
                "sample": self.sample, "data": self.data}


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
    blocks: dict[str, Any] = field(default_factory=dict)  # how the block size was chosen


# --------------------------------------------------------------------------- statistics


def pct_change(dnll_sum: np.ndarray | float, count: np.ndarray | float) -> np.ndarray | float:
    """Perplexity change in percent from a summed NLL difference over `count` tokens."""
    return np.expm1(np.asarray(dnll_sum) / np.asarray(count)) * 100


def pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r over the last axis (nan when either side is constant)."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    xc = x - x.mean(-1, keepdims=True)
    yc = y - y.mean(-1, keepdims=True)
    den = np.sqrt((xc * xc).sum(-1) * (yc * yc).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (xc * yc).sum(-1) / np.where(den > 0, den, 1), np.nan)


def interval(samples: np.ndarray) -> tuple[float, float]:
    """Percentile 95% interval of bootstrap samples (non-finite ones dropped)."""
    s = np.asarray(samples, np.float64)
    s = s[np.isfinite(s)]
    if s.size == 0:
        return (math.nan, math.nan)
    lo, hi = np.percentile(s, [2.5, 97.5])
    return float(lo), float(hi)


def verdict(ci: Sequence[float], direction: int, null: float = 0.0,
            value: tuple[float, float] | None = None) -> str:
    """The one verdict rule: `direction` +1 (the paper says the statistic exceeds `null`) or -1 (below it).

    not testable here: no finite interval; inconclusive here: the interval contains `null`; differs: it
    lies wholly on the other side of `null`, or (with a paper `value` range) wholly outside that range;
    holds: wholly on the paper's side (and overlapping its range)."""
    lo, hi = float(ci[0]), float(ci[1])
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, got {direction}")
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return UNTESTABLE
    if lo > hi:
        raise ValueError(f"interval [{lo}, {hi}] is reversed")
    if lo <= null <= hi:
        return INCONCLUSIVE
    if (lo > null) != (direction > 0):
        return DIFFERS
    if value is not None and (hi < value[0] or lo > value[1]):
        return DIFFERS
    return HOLDS


def rule_text(what: str, direction: int, null: float = 0.0, value: tuple[float, float] | None = None,
              unit: str = "") -> str:
    """The verdict rule of `verdict`, in words, for one statistic."""
    side = ">" if direction > 0 else "<"
    other = "<" if direction > 0 else ">"
    s = (f"statistic: {what}; holds if its 95% interval lies wholly {side} {null:g}{unit}")
    if value is not None:
        s += f" and overlaps the paper's {value[0]:g}-{value[1]:g}{unit}"
    s += f"; differs if it lies wholly {other} {null:g}{unit}"
    if value is not None:
        s += f" or wholly outside {value[0]:g}-{value[1]:g}{unit}"
    return s + f"; inconclusive here if it contains {null:g}{unit}"


def combine(verdicts: Sequence[str]) -> str:
    """One verdict from several sub-claims: differs if any differs, holds if all hold, not testable if none is
    testable, else inconclusive here."""
    vs = [v for v in verdicts if v != UNTESTABLE]
    if not vs:
        return UNTESTABLE
    if DIFFERS in vs:
        return DIFFERS
    if all(v == HOLDS for v in vs):
        return HOLDS
    return INCONCLUSIVE


def block_starts(n: int, block: int) -> np.ndarray:
    """First unit of each block of `block` consecutive units out of `n`; a short last block (< half) joins the
    one before it."""
    if n < 1 or block < 1:
        raise ValueError(f"block_starts: n = {n}, block = {block} must be >= 1")
    starts = np.arange(0, n, block)
    if len(starts) > 1 and n - starts[-1] < (block + 1) // 2:
        starts = starts[:-1]
    return starts


def to_blocks(x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sums of `x` over the blocks that begin at `starts` (last axis)."""
    return np.add.reduceat(np.asarray(x, np.float64), starts, axis=-1)


def block_ci(samples: Sequence[np.ndarray], statistic: Callable[..., np.ndarray], seed: int,
             n_boot: int = N_BOOT) -> tuple[float, float, str]:
    """95% interval of `statistic(*samples, axis=-1)` by `scipy.stats.bootstrap` over the blocks (the samples'
    last axis, paired: one resample for all): BCa, else percentile where BCa is degenerate; (lo, hi, method)."""
    from scipy.stats import bootstrap

    if np.asarray(samples[0]).shape[-1] < 2:
        return math.nan, math.nan, "none (one block)"
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = bootstrap(tuple(samples), statistic, n_resamples=n_boot, paired=True, vectorized=True, axis=-1,
                            method=method, rng=np.random.default_rng(seed))
        lo, hi = (float(v) for v in res.confidence_interval)
        if math.isfinite(lo) and math.isfinite(hi):
            return lo, hi, method
    return math.nan, math.nan, "none"


def circular_block_idx(n: int, block: int, seed: int, n_boot: int = N_BOOT) -> np.ndarray:
    """Circular block bootstrap: int [n_boot, n] unit indices made of runs of `block` consecutive units (wrapping
    round) from uniformly drawn starts."""
    rng = np.random.default_rng(seed)
    nb = -(-n // block)
    starts = rng.integers(0, n, size=(n_boot, nb))
    idx = (starts[:, :, None] + np.arange(block)[None, None, :]) % n
    return idx.reshape(n_boot, nb * block)[:, :n]


def fmt_ci(lo: float, hi: float, spec: str = "+.2f", unit: str = "") -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "n/a"
    return f"[{lo:{spec}}{unit}, {hi:{spec}}{unit}]"


def change_stat(dn: np.ndarray, cnt: np.ndarray, axis: int = -1) -> np.ndarray:
    """Perplexity change (%) of summed NLL differences over summed token counts."""
    return pct_change(np.sum(dn, axis=axis), np.sum(cnt, axis=axis))


def diff_stat(a: np.ndarray, b: np.ndarray, cnt: np.ndarray, axis: int = -1) -> np.ndarray:
    """Perplexity change of `a` minus that of `b` (points), on the same tokens."""
    return change_stat(a, cnt, axis) - change_stat(b, cnt, axis)


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


# --------------------------------------------------------------------------- emulation helpers


@dataclass
class PolicyRun:
    """One policy's emulation with per-window figures."""

    name: str
    result: Result
    dnll: np.ndarray  # [n] summed NLL difference to the exact model per window
    count: int  # scored tokens per window
    mass: np.ndarray | None = None  # [n] substituted mass per window (None unless asked for)
    nll: np.ndarray | None = None  # [n, W-1] per-token NLL
    nll_exact: np.ndarray | None = None

    @property
    def change(self) -> float:
        return float(self.result.ppl_change_pct)

    def share(self) -> float:
        c = self.result.counters
        return (c["substitutions"] + c["drops"]) / max(c["calls"], 1)


def emulate_policies(s: Setup, policies: dict[str, PolicyConfig], text: Path, *, mass: bool = False,
                     nll: bool = False, max_tokens: int | None | str = "setup") -> dict[str, PolicyRun]:
    """Emulate named policies on one text (one exact pass); per-window NLL change, optional mass.

    With `mass`, the router's gate weights are recorded during each policy run (its trace, `trace_out`)
    and summed over the calls the decisions mark substituted or dropped; the total is checked against
    the kernel's own substituted-mass counter."""
    import pyarrow.parquet as pq

    from runtime.backends.emulate import evaluate_group
    from runtime.formats.trace import load_trace

    mt = s.max_tokens if max_tokens == "setup" else max_tokens
    m = s.m
    out: dict[str, PolicyRun] = {}
    for i, (name, pol) in enumerate(policies.items()):
        nll_path = s.tmp / f"nll-{i}.parquet"
        trace_path = s.tmp / f"trace-{i}.parquet" if mass else None  # the routing the policy run sees
        spec = RunSpec(policy=pol, name=name, capacity_fraction=s.capacity_fraction, model=str(s.model),
                       text=str(text), max_tokens=mt, nll_out=str(nll_path), record_decisions=mass,
                       trace_out=None if trace_path is None else str(trace_path))
        res = evaluate_group(m, [spec], progress=s.progress)[0]
        tab = pq.read_table(nll_path).to_pandas()
        nll_path.unlink()
        n = int(res.extra["windows"])
        W = int(res.extra["window"])
        ex = tab["nll_exact"].to_numpy().reshape(n, W - 1)
        po = tab[f"nll_{spec.label}"].to_numpy().reshape(n, W - 1)
        run = PolicyRun(name, res, (po - ex).sum(1), W - 1)
        if trace_path is not None:
            kind = res.decisions["kind"]  # [T, L, k]
            weights = load_trace(trace_path).topk_weights[..., : kind.shape[-1]]  # [T, L, k]
            trace_path.unlink()
            if weights.shape != kind.shape:
                raise RuntimeError(f"findings: recorded weights {weights.shape} != decisions {kind.shape} ({name})")
            per_tok = (weights.astype(np.float64) * ((kind == SUB) | (kind == DROP))).sum((1, 2))  # [T]
            total = float(per_tok.sum())
            if not math.isclose(total, res.counters["substituted_mass"], rel_tol=1e-4, abs_tol=1e-6):
                raise RuntimeError(f"findings: mass from decisions {total} != counter "
                                   f"{res.counters['substituted_mass']} ({name})")
            run.mass = per_tok.reshape(n, W).sum(1)
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
    m = s.m
    ex = exact_pass(m, spec)
    ids, w, rank, _ = hfmodel.record(m, ex.windows, depth or m.E, spec.batch_windows, s.progress, desc="record")
    trace = hfmodel.make_trace(m, ids, w, rank, ex.windows, ex.sha, "runtime.tools.findings")
    s.traces[key] = (trace, ex.calib_ids, ex.windows.shape[1])
    return s.traces[key]


def caps_and_warm(trace: Any, calib_ids: np.ndarray | None, capacity_fraction: float) -> tuple[np.ndarray, Any]:
    """Per-layer capacities at `capacity_fraction` and the warm start the emulation uses there."""
    from runtime.core.kernel import warm_residency
    from runtime.core.policy import resolve_capacities

    caps = resolve_capacities(None, trace.L, trace.E, trace.k, capacity_fraction)
    init = warm_residency(calib_ids, None, trace.E, caps) if calib_ids is not None else None
    return caps, init


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
            "slots_per_top_k": float(caps[0]) / trace.k, "warm_set_miss_rate": warm_miss_rate(trace, init),
            "substitute_all_share": (c["substitutions"] + c["drops"]) / max(c["calls"], 1)}


def paper_capacity(trace: Any, calib_ids: np.ndarray | None,
                   target: float = PAPER_SUB_ALL_SHARE) -> tuple[float, list[dict[str, Any]]]:
    """The simulator sweep: substitute-all over every slot count k..E-1 on the recorded routing; the capacity
    fraction whose substituted share is nearest `target` (ties: fewer slots), and the sweep."""
    sweep = [regime(trace, calib_ids, c / trace.E) for c in range(trace.k, trace.E)]
    best = min(sweep, key=lambda r: (abs(r["substitute_all_share"] - target), r["slots"]))
    return best["capacity_fraction"], sweep


def choose_blocks(s: Setup, text: Path, n: int, W: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Bootstrap blocks over `n` windows of `W` tokens: about one document of `text` (documents end with
    <|endoftext|>; a text without it is one document), capped so that there are >= MIN_BLOCKS blocks."""
    raw = text.read_text(encoding="utf-8")
    docs = max(sum(1 for d in raw.split(EOS) if d.strip()), 1)
    tok = len(s.m.tokenizer(raw, add_special_tokens=False)["input_ids"])
    doc_windows = max(1, math.ceil(tok / docs / W))
    cap = max(1, n // MIN_BLOCKS)
    block = min(doc_windows, cap)
    starts = block_starts(n, block)
    return starts, {"block_windows": block, "block_tokens": block * W, "blocks": len(starts),
                    "document_tokens": tok / docs, "documents": docs, "document_windows": doc_windows,
                    "capped": doc_windows > cap, "windows": n, "window": W}


def sample_text(s: Setup) -> str:
    b = s.blocks
    return (f"{b['windows']} windows of {b['window']} tokens in {b['blocks']} blocks of {b['block_windows']} "
            f"windows ({b['block_tokens']} tokens; a document is {b['document_tokens']:.0f} tokens"
            f"{f', block capped for >= {MIN_BLOCKS} blocks' if b['capped'] else ''}), BCa, {N_BOOT} resamples")


def block_check(s: Setup, run: PolicyRun) -> list[dict[str, Any]]:
    """Width of `run`'s perplexity-change interval at block sizes 1, 2, 4, ... windows (while there are at least
    MIN_BLOCKS // 2 blocks): it should grow until blocks outlast the cache's memory."""
    n = len(run.dnll)
    out = []
    b = 1
    while n // b >= max(MIN_BLOCKS // 2, 2):
        st = block_starts(n, b)
        lo, hi, method = block_ci((to_blocks(run.dnll, st), to_blocks(np.full(n, run.count), st)), change_stat,
                                  s.seed)
        out.append({"block_windows": b, "blocks": len(st), "width": hi - lo, "method": method})
        b *= 2
    return out


# --------------------------------------------------------------------------- findings


def _blocks(s: Setup, run: PolicyRun) -> tuple[np.ndarray, np.ndarray]:
    """(NLL-difference sums, token counts) per block."""
    n = len(run.dnll)
    return to_blocks(run.dnll, s.starts), to_blocks(np.full(n, run.count), s.starts)


def policy_ci(s: Setup, run: PolicyRun) -> tuple[float, float]:
    lo, hi, _ = block_ci(_blocks(s, run), change_stat, s.seed)
    return lo, hi


def finding_heavy(s: Setup, runs: dict[str, PolicyRun]) -> Row:
    sa, rule, fc = runs["substitute-all"], runs["rule-0.15"], runs["first-choice"]
    a, cnt = _blocks(s, sa)
    b, _ = _blocks(s, rule)
    point = float(diff_stat(a, b, cnt))
    lo, hi, method = block_ci((a, b, cnt), diff_stat, s.seed)
    ci = {n: policy_ci(s, r) for n, r in runs.items()}
    removed = (1 - rule.change / sa.change) * 100 if sa.change != 0 else math.nan
    ours = (f"0.15 rule {rule.change:+.2f}% {fmt_ci(*ci['rule-0.15'])} vs substitute-all {sa.change:+.2f}% "
            f"{fmt_ci(*ci['substitute-all'])} (first-choice {fc.change:+.2f}%): substitute-all minus the rule "
            f"{point:+.2f} points, the rule removes {removed:.0f}% of the loss; substituted calls "
            f"{rule.share() * 100:.1f}% vs {sa.share() * 100:.1f}%")
    data = {n: {"ppl_change_pct": r.change, "ci95": list(ci[n]), "substituted_call_fraction": r.share(),
                "mass_per_token": r.result.mass_per_token, "perplexity": r.result.perplexity}
            for n, r in runs.items()}
    data.update({"exact_perplexity": sa.result.exact_perplexity, "difference": point, "difference_ci95": [lo, hi],
                 "loss_removed_pct": removed, "method": method,
                 "share_ratio": rule.share() / max(sa.share(), 1e-12)})
    return Row("1", "Loss comes from a few heavy experts", PAPER["heavy"], ours,
               f"{fmt_ci(lo, hi)} points", verdict((lo, hi), 1),
               rule_text("substitute-all's perplexity change minus the 0.15 rule's (points)", 1),
               sample_text(s), data)


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


def admission_pairs(policies: dict[str, PolicyConfig]) -> list[tuple[str, str]]:
    """(without, with admission) label pairs of `policies` that differ only in beta."""
    out = []
    for n, p in policies.items():
        if p.beta is None:
            q = dataclasses.replace(p, beta=0.5)
            if q.label() in policies:
                out.append((n, q.label()))
    return out


def finding_mass(s: Setup, runs: dict[str, PolicyRun]) -> tuple[Row, Row, Row]:
    from scipy.stats import pearsonr

    kept = dedupe({n: (r.dnll, r.mass) for n, r in runs.items()})
    names = [n for n in runs if kept[n] == n]
    dups = {n: k for n, k in kept.items() if n != k}
    P = len(names)
    n_win = len(runs[names[0]].dnll)
    cnt = runs[names[0]].count
    W = cnt + 1
    dn = np.stack([runs[n].dnll for n in names])  # [P, n]
    ms = np.stack([runs[n].mass for n in names])  # [P, n]
    dn_b, ms_b = to_blocks(dn, s.starts), to_blocks(ms, s.starts)
    cnt_b = to_blocks(np.full(n_win, cnt), s.starts)
    tok_b = to_blocks(np.full(n_win, W), s.starts)

    def across(*arrs: np.ndarray, axis: int = -1) -> np.ndarray:
        d, m, c, t = np.stack(arrs[:P]), np.stack(arrs[P:2 * P]), arrs[2 * P], arrs[2 * P + 1]
        change = pct_change(d.sum(axis), c.sum(axis))  # [P, ...]
        mass = m.sum(axis) / t.sum(axis)
        return pearson(np.moveaxis(mass, 0, -1), np.moveaxis(change, 0, -1))

    samples = (*dn_b, *ms_b, cnt_b, tok_b)
    change = pct_change(dn.sum(1), cnt * n_win)
    mass_tok = ms.sum(1) / (W * n_win)
    r = float(pearson(mass_tok, change))
    blo, bhi, method = block_ci(samples, across, s.seed)
    pr = pearsonr(mass_tok, change)
    fci = pr.confidence_interval(0.95)
    lo, hi = min(blo, fci.low), max(bhi, fci.high)
    row_p = Row("2a", "Mass hypothesis across policies", PAPER["mass_policies"],
                f"r = {r:.3f} over {P} distinct first-choice-fetching policies ({len(dups)} duplicates removed; "
                f"mass/token {mass_tok.min():.3f}-{mass_tok.max():.3f}, change {change.min():+.2f}% to "
                f"{change.max():+.2f}%); paper's 0.92 {'inside' if lo <= 0.92 <= hi else 'outside'} the interval",
                f"{fmt_ci(lo, hi, '.3f')} (Fisher over policies {fmt_ci(fci.low, fci.high, '.3f')}, block bootstrap "
                f"{fmt_ci(blo, bhi, '.3f')})", verdict((lo, hi), 1),
                rule_text("Pearson r across the distinct policies; interval: the union of Fisher's over the policies "
                          "and the block bootstrap's", 1),
                f"{P} distinct policies; " + sample_text(s),
                {"r": r, "ci95": [lo, hi], "ci95_fisher": [fci.low, fci.high], "ci95_block": [blo, bhi],
                 "method": method, "duplicates": dups,
                 "policies": {n: {"mass_per_token": float(m), "ppl_change_pct": float(c)}
                              for n, m, c in zip(names, mass_tok, change, strict=True)}})

    # per input: the across-policy r minus the 0.15 rule's r across windows, one circular block resample
    win_change = pct_change(dn, cnt)  # [P, n]
    win_mass = ms / W
    per_pol = pearson(win_mass, win_change)  # [P]
    ref = names.index(kept[PRESETS["rule-0.15"].label()])
    r_win = float(per_pol[ref])
    block = s.blocks["block_windows"]
    idx = circular_block_idx(n_win, block, s.seed)  # [B, n]
    b_across = pearson(ms[:, idx].sum(2).T / (W * n_win), pct_change(dn[:, idx].sum(2), cnt * n_win).T)
    b_win = pearson(win_mass[ref][idx], win_change[ref][idx])
    dlo, dhi = interval(b_across - b_win)
    rlo, rhi = interval(b_win)
    row_w = Row("2b", "Mass hypothesis per input (window)", PAPER["mass_windows"],
                f"0.15 rule: r across {n_win} windows {r_win:.3f} {fmt_ci(rlo, rhi, '.3f')} against r across "
                f"policies {r:.3f}: difference {r - r_win:+.3f}; median per-window r over the {P} policies "
                f"{float(np.nanmedian(per_pol)):.3f}", f"{fmt_ci(dlo, dhi, '+.3f')} (difference)",
                verdict((dlo, dhi), 1),
                rule_text("r across policies minus the 0.15 rule's r across windows", 1),
                f"{n_win} windows; circular block bootstrap, blocks of {block} windows, percentile, {N_BOOT} resamples",
                {"r_rule_windows": r_win, "ci95_rule_windows": [rlo, rhi], "difference": r - r_win,
                 "difference_ci95": [dlo, dhi], "median_r": float(np.nanmedian(per_pol)),
                 "per_policy": {n: float(v) for n, v in zip(names, per_pol, strict=True)}, "windows": n_win})

    # with/without-admission pairs: does the loss follow the mass?
    pairs = [(a, b) for a, b in admission_pairs(mass_policies()) if a in runs and b in runs and kept[a] != kept[b]]
    sub, parts, pdata, raise_pairs = [], [], {}, []
    for a, b in pairs:
        ra, rb = runs[a], runs[b]
        da, c_b = _blocks(s, ra)
        db, _ = _blocks(s, rb)
        ma_, mb_ = to_blocks(ra.mass, s.starts), to_blocks(rb.mass, s.starts)
        dloss = float(diff_stat(db, da, c_b))
        dmass = (rb.mass.sum() - ra.mass.sum()) / (W * n_win)
        llo, lhi, _ = block_ci((db, da, c_b), diff_stat, s.seed)
        mlo, mhi, _ = block_ci((mb_, ma_, tok_b), lambda x, y, t, axis=-1: (x.sum(axis) - y.sum(axis)) / t.sum(axis),
                               s.seed)
        v = verdict((llo, lhi), 1 if mlo > 0 else -1) if (mlo > 0 or mhi < 0) else UNTESTABLE
        sub.append(v)
        if dmass < 0 < dloss:
            raise_pairs.append(a)
            parts.append(f"{a}: {ra.change:+.2f}% -> {rb.change:+.2f}% {fmt_ci(llo, lhi)}")
        pdata[a] = {"with_admission": b, "mass_change_per_token": dmass, "mass_ci95": [mlo, mhi],
                    "loss_change_points": dloss, "loss_ci95": [llo, lhi], "verdict": v}
    n_diff = sum(v == DIFFERS for v in sub)
    row_a = Row("2c", "Admission pairs: does the loss follow the mass?", PAPER["mass_pairs"],
                f"{len(raise_pairs)} of {len(pairs)} distinct pairs: admission lowers substituted mass yet raises the "
                f"loss" + (f" ({'; '.join(parts)})" if parts else "") +
                f"; {n_diff} with the loss interval on the wrong side",
                f"per pair: {sum(v == HOLDS for v in sub)} hold, {n_diff} differ, "
                f"{sum(v == INCONCLUSIVE for v in sub)} inconclusive, {sum(v == UNTESTABLE for v in sub)} with no clear "
                "mass change", combine(sub),
                "per pair whose mass-change interval excludes 0, statistic: loss with admission minus without "
                "(points); holds if its interval lies on the side of the mass change, differs if on the other side, "
                "inconclusive if it contains 0; the row: differs if any pair differs, holds if all hold",
                f"{len(pairs)} pairs; " + sample_text(s), {"pairs": pdata, "raise_loss_lower_mass": raise_pairs})
    return row_p, row_w, row_a


def band_policy(lo: float, hi: float) -> PolicyConfig:
    return PolicyConfig(rule="band", tau=lo, tau_high=hi)


def finding_band(s: Setup) -> Row:
    from runtime.backends.simulate import replay

    trace, calib_ids, W = exact_trace(s, s.eval_text)
    caps, init = caps_and_warm(trace, calib_ids, s.capacity_fraction)

    def sim_mass(pol: PolicyConfig) -> float:
        return replay(trace, pol, caps, init).cache.counter_totals()["substituted_mass"] / trace.T

    heavy_lo, light_hi = 0.15, 0.15
    m_heavy = sim_mass(band_policy(heavy_lo, BAND_TOP))
    m_light_max = sim_mass(band_policy(0.0, light_hi))
    # match on mass: shrink the light band's top edge, or raise the heavy band's low edge
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
    pols = {"heavy": band_policy(heavy_lo, BAND_TOP), "light": band_policy(0.0, light_hi)}
    runs = emulate_policies(s, pols, s.eval_text)
    h, li = runs["heavy"], runs["light"]
    a, cnt = _blocks(s, h)
    b, _ = _blocks(s, li)
    point = float(diff_stat(a, b, cnt))
    dlo, dhi, method = block_ci((a, b, cnt), diff_stat, s.seed)
    mh, ml = h.result.mass_per_token, li.result.mass_per_token
    sh, sl = h.result.counters["substitutions"], li.result.counters["substitutions"]
    matched = abs(mh - ml) <= MASS_MATCH * max(mh, ml) and sh < sl
    ours = (f"heavy band [{heavy_lo:.3f}, 1]: {sh} substitutions, mass/token {mh:.4f}, {h.change:+.2f}%; "
            f"light band [0, {light_hi:.3f}): {sl} substitutions, mass/token {ml:.4f}, {li.change:+.2f}%; "
            f"heavy minus light {point:+.2f} points (masses {'matched' if matched else 'NOT matched'} within "
            f"{abs(mh - ml) / max(mh, ml, 1e-12) * 100:.1f}%)")
    return Row("3", "Experiment B: few heavy vs many light substitutions at equal mass", PAPER["band"], ours,
               f"{fmt_ci(dlo, dhi)} points", verdict((dlo, dhi), 1) if matched else UNTESTABLE,
               rule_text("heavy band's perplexity change minus the light band's (points)", 1) +
               f"; not testable if the masses differ by more than {MASS_MATCH:.0%} or the heavy band does not "
               "substitute fewer calls", sample_text(s),
               {"heavy": {"band": [heavy_lo, BAND_TOP], "mass_per_token": mh, "substitutions": sh,
                          "ppl_change_pct": h.change},
                "light": {"band": [0.0, light_hi], "mass_per_token": ml, "substitutions": sl,
                          "ppl_change_pct": li.change},
                "difference": point, "difference_ci95": [dlo, dhi], "matched": matched, "method": method})


def finding_admission(s: Setup, runs: dict[str, PolicyRun]) -> Row:
    qf, rule = runs["quality-first"], runs["rule-0.15"]
    a, cnt = _blocks(s, qf)
    b, _ = _blocks(s, rule)
    point = float(diff_stat(a, b, cnt))
    lo, hi, method = block_ci((a, b, cnt), diff_stat, s.seed)
    return Row("4a", "Admission overall: Quality-First vs the 0.15 rule", PAPER["admission"],
               f"Quality-First {qf.change:+.2f}% vs the 0.15 rule {rule.change:+.2f}%: {point:+.2f} points",
               f"{fmt_ci(lo, hi)} points", verdict((lo, hi), 1),
               rule_text("Quality-First's perplexity change minus the 0.15 rule's (points)", 1), sample_text(s),
               {"difference": point, "ci95": [lo, hi], "method": method,
                "quality-first": qf.change, "rule-0.15": rule.change})


def topic_stream(s: Setup, tokenizer: Any) -> tuple[str, list[int], list[str]]:
    """Text that switches domain every ~`segment` tokens; token index of each switch and its domain.

    Segments are whole lines taken in turn from each domain's eval text (code, prose, verse,
    code, ...); switch positions come from the stream's own tokenization (character offsets)."""
    lines = {d: p.read_text(encoding="utf-8").splitlines(keepends=True) for d, p in s.domains.items()}
    pos = dict.fromkeys(lines, 0)
    budget = s.max_tokens or 10**9
    parts: list[str] = []
    starts: list[int] = []  # character offsets of segment starts
    doms: list[str] = []
    total_chars, total_tok = 0, 0
    order = list(lines)
    while total_tok < budget:
        progressed = False
        for d in order:
            seg, n_tok = [], 0
            while pos[d] < len(lines[d]) and n_tok < s.segment:
                ln = lines[d][pos[d]]
                pos[d] += 1
                seg.append(ln)
                n_tok += len(tokenizer(ln, add_special_tokens=False)["input_ids"])
            if n_tok < s.segment // 2:
                continue
            text = "".join(seg)
            starts.append(total_chars)
            doms.append(d)
            parts.append(text)
            total_chars += len(text)
            total_tok += n_tok
            progressed = True
            if total_tok >= budget:
                break
        if not progressed:
            break
    stream = "".join(parts)
    enc = tokenizer(stream, add_special_tokens=False, return_offsets_mapping=True)
    offs = np.asarray([o[0] for o in enc["offset_mapping"]])
    switch_tok = [int(np.searchsorted(offs, c, side="left")) for c in starts]
    return stream, switch_tok, doms


def finding_topic(s: Setup) -> Row:
    if len(s.domains) < 2:
        return Row("4b", "Admission around topic changes", PAPER["topic"], "one-domain model: no topic changes",
                   "n/a", UNTESTABLE, "needs eval_<domain>.txt for >= 2 domains beside the model", "none")
    stream, switches, doms = topic_stream(s, s.m.tokenizer)
    path = s.tmp / "topic_stream.txt"
    path.write_text(stream, encoding="utf-8")
    runs = emulate_policies(s, {"rule-0.15": PRESETS["rule-0.15"], "quality-first": PRESETS["quality-first"]},
                            path, nll=True, max_tokens=None)
    rule, qf = runs["rule-0.15"], runs["quality-first"]
    n, Wm1 = rule.nll.shape
    W = Wm1 + 1
    T = n * W
    # stream index of every scored token (position p >= 1 of window w is token w*W + p)
    tok = (np.arange(n)[:, None] * W + np.arange(1, W)[None, :]).ravel()
    seg = np.searchsorted(np.asarray(switches), tok, side="right") - 1  # segment of each scored token
    dist = tok - np.asarray(switches)[np.clip(seg, 0, None)]
    ok = seg >= 1  # tokens after the first switch (segment 0 has no switch before it)
    d_rule = (rule.nll - rule.nll_exact).ravel()
    d_qf = (qf.nll - qf.nll_exact).ravel()
    early = ok & (dist < s.early)
    late = ok & (dist >= s.early)
    n_seg = int(seg.max()) + 1

    def per_seg(x: np.ndarray, mask: np.ndarray) -> np.ndarray:  # per-segment sums: segments are the units
        return np.bincount(seg[mask], weights=x[mask], minlength=n_seg)[1:]

    keys = ("rule_e", "rule_l", "qf_e", "qf_l", "n_e", "n_l")
    one = np.ones_like(d_rule)
    sums = [per_seg(v, msk) for v, msk in ((d_rule, early), (d_rule, late), (d_qf, early), (d_qf, late),
                                           (one, early), (one, late))]

    def stats(*a: np.ndarray, axis: int = -1) -> dict[str, np.ndarray]:
        g = dict(zip(keys, (x.sum(axis) for x in a), strict=True))
        out = {f"{p}_{w}": pct_change(g[f"{p}_{w}"], g[f"n_{w}"]) for p in ("rule", "qf") for w in ("e", "l")}
        out["gap_e"] = out["qf_e"] - out["rule_e"]
        out["gap_l"] = out["qf_l"] - out["rule_l"]
        out["dd"] = out["gap_e"] - out["gap_l"]
        return out

    point = {k: float(v) for k, v in stats(*sums).items()}
    ci = {k: block_ci(sums, lambda *a, axis=-1, k=k: stats(*a, axis=axis)[k], s.seed)[:2]
          for k in ("gap_e", "gap_l", "dd")}
    ours = (f"{n_seg - 1} switches every ~{s.segment} tokens ({T} tokens); first {s.early} tokens after a "
            f"switch: 0.15 rule {point['rule_e']:+.2f}%, Quality-First {point['qf_e']:+.2f}% (QF - rule "
            f"{point['gap_e']:+.2f}); later: rule {point['rule_l']:+.2f}%, QF {point['qf_l']:+.2f}% (QF - rule "
            f"{point['gap_l']:+.2f}); early - later {point['dd']:+.2f} points")
    ci95 = (f"early - later {fmt_ci(*ci['dd'])} points (QF - rule early {fmt_ci(*ci['gap_e'])}, later "
            f"{fmt_ci(*ci['gap_l'])})")
    data: dict[str, Any] = dict(point)
    data.update({f"{k}_ci95": list(v) for k, v in ci.items()})
    data.update({"switches": n_seg - 1, "segment_tokens": s.segment, "early_tokens": s.early, "tokens": T,
                 "domains": sorted(set(doms))})
    return Row("4b", "Admission around topic changes", PAPER["topic"], ours, ci95, verdict(ci["dd"], -1),
               rule_text("(QF - rule) in the first tokens after a switch minus (QF - rule) later (points)", -1),
               f"{n_seg - 1} topic segments of ~{s.segment} tokens resampled whole, BCa, {N_BOOT} resamples", data)


def finding_speed(s: Setup, runs: dict[str, PolicyRun]) -> Row:
    from runtime.backends.simulate import replay
    from runtime.formats import costmodel

    trace, calib_ids, W = exact_trace(s, s.eval_text)
    caps, init = caps_and_warm(trace, calib_ids, s.capacity_fraction)
    shape = costmodel.shape_for_trace(trace, None)
    hosts = costmodel.list_host_profiles()  # the presets, in name order
    scale = trace.L / PAPER_LAYERS  # the head's share of a token as on the paper's 48-layer model
    n_win = trace.T // W
    pols = {n: PRESETS[n] for n in ("fetch-every-miss", "quality-first", "speed-first")}
    events = {n: replay(trace, p, caps, init).events for n, p in pols.items()}  # [T, L, N_EV]
    data: dict[str, Any] = {"model_shape": shape.name, "head_scale": scale, "layers": trace.L}
    parts, cis, sub = [], [], []

    def ratio(f: np.ndarray, p: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.sum(f, axis) / np.sum(p, axis)

    for host in hosts:
        raw = costmodel.cost_params(costmodel.load_host_profile(host), shape)
        params = dataclasses.replace(raw, head_s=raw.head_s * scale)
        resident_raw = costmodel.all_resident_time(trace.valid, raw, trace.k)
        resident = costmodel.all_resident_time(trace.valid, params, trace.k)
        per_blk, whole, whole_raw, stall = {}, {}, {}, {}
        for n, ev in events.items():
            tb = costmodel.replay_time(ev, trace.valid, params)
            per_blk[n] = to_blocks(tb.token_s[: n_win * W].reshape(n_win, W).sum(1), s.starts)
            whole[n] = tb.per_token_s
            whole_raw[n] = costmodel.replay_time(ev, trace.valid, raw).per_token_s
            stall[n] = tb.stall_fetch_s / max(tb.total_s, 1e-30)
        data[host] = {"head_share_all_resident_uncharged": raw.head_s / resident_raw,
                      "head_share_all_resident": params.head_s / resident,
                      "fetch_every_miss_stall_share": stall["fetch-every-miss"]}
        for n in ("quality-first", "speed-first"):
            tag = "QF" if n == "quality-first" else "SF"
            r = whole["fetch-every-miss"] / whole[n]
            lo, hi, method = block_ci((per_blk["fetch-every-miss"], per_blk[n]), ratio, s.seed)
            v = verdict((lo, hi), 1, null=1.0, value=PAPER_SPEED)
            sub.append(v)
            data[host][n] = {"speed_ratio": r, "ci95": [lo, hi], "verdict": v, "time_per_token_s": whole[n],
                             "speed_ratio_head_uncharged": whole_raw["fetch-every-miss"] / whole_raw[n]}
            parts.append(f"{host} {tag} {r:.2f}x")
            cis.append(f"{host} {tag} {fmt_ci(lo, hi, '.2f', 'x')}")
    costs = []
    for n in ("quality-first", "speed-first"):
        r_ = runs[n]
        lo, hi = policy_ci(s, r_)
        costs.append(f"{'QF' if n == 'quality-first' else 'SF'} {r_.change:+.2f}% {fmt_ci(lo, hi)}")
        data[n] = {"ppl_change_pct": r_.change, "ci95": [lo, hi]}
    h0 = data[hosts[0]]
    ours = ("; ".join(parts) + f" (simulated: {shape.name}, head charged {trace.L}/{PAPER_LAYERS}: "
            f"{h0['head_share_all_resident']:.1%} of an all-resident token on {hosts[0]}, uncharged "
            f"{h0['head_share_all_resident_uncharged']:.1%}); perplexity " + ", ".join(costs))
    return Row("5", "Quality-First / Speed-First speed over fetch-every-miss", PAPER["speed"], ours,
               "; ".join(cis), combine(sub),
               rule_text("time per token of fetch-every-miss over the policy's, per host and policy", 1, null=1.0,
                         value=PAPER_SPEED, unit="x") + "; the row: differs if any differs, holds if all hold "
               "(the perplexity cost is reported, not tested: a tiny model's losses are not the paper's)",
               sample_text(s).replace("BCa", "BCa on the cost model's per-token times"), data)


def prompts_for(s: Setup, tokenizer: Any, max_positions: int) -> dict[str, list[str]]:
    """`prompts_per_domain` prompts per domain: line-aligned chunks of its eval text of about 48
    tokens (fewer when the model's positions cannot hold them and the generated tokens), spread
    evenly over the text."""
    limit = max(min(48, max_positions - s.new_tokens - 4), 1)
    texts = s.domains or {"all": s.eval_text}
    out = {}
    for d, p in texts.items():
        lines = p.read_text(encoding="utf-8").replace("<|endoftext|>", "\n").splitlines(keepends=True)
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
    parts, cis = [], []
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
                    rates = np.array([r["agreement"] for r in res["per_prompt"]])
                    n_prompts = max(n_prompts, len(ps))
                    idx = np.random.default_rng(s.seed).integers(0, len(rates), size=(N_BOOT, len(rates)))
                    lo, hi = interval(rates[idx].mean(1))
                    data[f"{pol}/{d}"] = {"agreement": float(rates.mean()), "ci95": [lo, hi],
                                          "prompts": len(ps), "identical": res["identical_prompts"]}
                    tag = "QF" if pol == "quality-first" else "SF"
                    parts.append(f"{tag} {d} {rates.mean() * 100:.0f}% ({res['identical_prompts']}/{len(ps)} identical)")
                    cis.append(f"{tag} {d} {fmt_ci(lo * 100, hi * 100, '.0f', '%')}")
    finally:
        eng.close()
    return Row("6", "Greedy generation agreement with the exact model", PAPER["generation"],
               f"{s.new_tokens} greedy tokens per prompt: " + ", ".join(parts), "; ".join(cis), UNTESTABLE,
               "the spec gives no paper figure to compare with: no verdict",
               f"up to {n_prompts} prompts per domain, resampled (percentile, {N_BOOT} resamples)", data)


# --------------------------------------------------------------------------- driver


def git_commit(repo: Path | None = None) -> dict[str, Any]:
    """The commit this code runs at, and whether tracked files differ from it ({"commit": None} outside git)."""
    repo = repo or Path(__file__).resolve().parents[2]
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


def run_column(s: Setup, label: str, timings: dict[str, float]) -> tuple[list[Row], Result]:
    """Every finding at `s.capacity_fraction`, and the fetch-every-miss result (the exact model's figures)."""
    def timed(name: str, fn: Callable[..., Any], *a: Any) -> Any:
        t = time.perf_counter()
        out = fn(*a)
        timings[f"{label}/{name}"] = round(time.perf_counter() - t, 1)
        log.info("finding %s (%s): %.0f s", name, label, timings[f"{label}/{name}"])
        return out

    presets = {n: PRESETS[n] for n in ("fetch-every-miss", "substitute-all", "rule-0.15", "first-choice",
                                       "quality-first", "speed-first")}
    main = timed("presets", emulate_policies, s, presets, s.eval_text)
    ref = main["rule-0.15"]
    s.starts, s.blocks = choose_blocks(s, s.eval_text, len(ref.dnll), ref.count + 1)
    s.blocks["check"] = block_check(s, ref)
    rows = [finding_heavy(s, main)]
    mp = timed("mass", lambda: emulate_policies(s, mass_policies(), s.eval_text, mass=True))
    rows.extend(finding_mass(s, mp))
    rows.append(timed("band", finding_band, s))
    rows.append(finding_admission(s, main))
    rows.append(timed("topic", finding_topic, s))
    rows.append(timed("speed", finding_speed, s, main))
    rows.append(timed("generation", finding_generation, s))
    for r in rows:
        r.column = label
    return rows, main["fetch-every-miss"].result


def run(model: str | Path, max_tokens: int | None = None,
        capacity_fractions: Sequence[float | str] = (0.25, "paper"), segment: int = 320, early: int = 64,
        prompts_per_domain: int = 8, new_tokens: int = 32, seed: int = 0, progress: bool = False) -> dict[str, Any]:
    """Every finding on `model` at each capacity; {"rows", "columns", "setup", "sweep", "commit", ...}."""
    from runtime.backends import hfmodel
    from runtime.tools.tinymodel import domain_texts

    model = Path(model)
    if not (model / "config.json").is_file():
        raise InputError(f"--model {model}: no config.json there (not a Hugging Face checkpoint directory)")
    eval_text = model / "eval.txt"
    if not eval_text.is_file():
        raise InputError(f"--model {model}: no eval.txt beside the model (the evaluated text)")
    if max_tokens is not None and max_tokens < 512:
        raise InputError(f"--max-tokens = {max_tokens} must be >= 512")
    fracs = [parse_capacity_fraction(str(c)) for c in capacity_fractions]
    if not fracs:
        raise InputError("--capacity-fraction: at least one value is needed")
    if segment < 2 * early or early < 1:
        raise InputError(f"--segment = {segment} must be >= 2 x --early = {early} (and --early >= 1)")
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
            col_rows, ex = run_column(s, label, timings)
            reg.update({"label": label, "requested": f, "blocks": s.blocks})
            columns.append(reg)
            rows.extend(col_rows)
    return {"commit": git_commit(),
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
                      "seed": seed, "bootstrap_resamples": N_BOOT, "min_blocks": MIN_BLOCKS},
            "seconds": round(time.perf_counter() - t0, 1), "seconds_by_finding": timings}


def _cell(text: str) -> str:
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


def reading(res: dict[str, Any]) -> list[str]:
    """The page's reading of the table, every number taken from `res`."""
    cols = res["columns"]
    sw = res["sweep"]
    pts = sw["points"]
    lines = ["## Reading the table", "",
             "(Generated with the table from the same run: every figure below is in docs/findings.json.)", ""]
    found = next(c for c in cols if c["paper_regime"]) if any(c["paper_regime"] for c in cols) else None
    lines.append(f"- **Regime.** Sweeping substitute-all over {pts[0]['slots']}-{pts[-1]['slots']} slots on the "
                 f"recorded routing, its substituted share runs from {pts[0]['substitute_all_share']:.1%} to "
                 f"{pts[-1]['substitute_all_share']:.1%}; the paper's {sw['target_share']:.1%} is nearest at "
                 f"{sw['found']:.1%} of the experts" +
                 (f" ({found['slots']} slots, {found['slots_per_top_k']:.1f} per top-k against the paper's "
                  f"{res['paper_regime']['slots_per_top_k']:.1f}; substitute-all there "
                  f"{found['substitute_all_share']:.1%})." if found else "."))
    for c in cols:
        b = c["blocks"]
        chk = ", ".join(f"{x['block_windows']} ({x['blocks']} blocks): {x['width']:.2f}" for x in b.get("check", []))
        lines.append(f"- **Intervals at {c['label']}.** Blocks of {b['block_windows']} windows "
                     f"({b['block_tokens']} tokens; a document averages {b['document_tokens']:.0f} tokens"
                     f"{', capped to keep >= ' + str(res['setup']['min_blocks']) + ' blocks' if b['capped'] else ''}). "
                     f"Width of the 0.15 rule's perplexity-change interval (points) by block size in windows: "
                     f"{chk}" + (f"; widest at {max(b['check'], key=lambda x: x['width'])['block_windows']} windows, "
                                 f"{max(x['width'] for x in b['check']) / b['check'][0]['width']:.2f}x the one-window "
                                 "width (wider than at the chosen block: the cache's memory may outlast a document; "
                                 f"only {max(b['check'], key=lambda x: x['width'])['blocks']} blocks of that size)"
                                 if b.get("check") and b["check"][0]["width"] > 0
                                 and max(b["check"], key=lambda x: x["width"])["block_windows"] > b["block_windows"]
                                 else "") + ".")
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in res["rows"]:
        by_id.setdefault(r["id"], []).append(r)
    for rid, rs in by_id.items():
        parts = [f"**{r['verdict']}** at {r['column']} (interval {r['ci95']})" for r in rs]
        lines.append(f"- **{rid}. {rs[0]['finding']}**: " + "; ".join(parts) + ".")
    speed = [r for r in res["rows"] if r["id"] == "5"]
    for r in speed:
        d = r["data"]
        h = min((k for k in d if isinstance(d[k], dict) and "head_share_all_resident" in d[k]), default=None)
        if h is not None:
            lines.append(
                f"- **Speed, why ({r['column']}).** The simulated model has {d['layers']} MoE layers but the "
                f"paper's 152k-token LM head; uncharged, the head is {d[h]['head_share_all_resident_uncharged']:.0%} "
                f"of an all-resident token on {h}, which dilutes every ratio (QF "
                f"{d[h]['quality-first']['speed_ratio_head_uncharged']:.2f}x uncharged). Charged "
                f"{d['layers']}/{PAPER_LAYERS} of its time, as on the 48-layer model, it is "
                f"{d[h]['head_share_all_resident']:.0%} and QF reaches {d[h]['quality-first']['speed_ratio']:.2f}x. "
                f"Fetch-every-miss spends {d[h]['fetch_every_miss_stall_share']:.0%} of its time waiting for "
                "fetches; more misses would raise the ratios, not lower them.")
    lines += ["", f"Model `{res['setup']['model']}` (exact perplexity {res['setup']['exact_perplexity']:.3f} on "
              f"{res['setup']['tokens']} tokens): a tiny model, so magnitudes are a weak model's; the verdicts test "
              "directions (the speed row also the paper's 2.5-3.0x, on the paper's shape)."]
    return lines


def to_markdown(res: dict[str, Any], command: str | None = None) -> str:
    """The whole page body: command, commit, regimes, the table, the rules and the reading."""
    st = res["setup"]
    head = []
    if command:
        head += [f"`{command}` ({res['seconds'] / 60:.1f} min on this machine)", ""]
    c = res.get("commit") or {}
    if c.get("commit"):
        head += [f"Commit `{c['commit'][:12]}`{' (with uncommitted changes)' if c.get('dirty') else ''}.", ""]
    head.append(f"Model `{st['model']}`: {st['num_layers']} MoE layers, {st['num_experts']} experts, "
                f"top-{st['top_k']}; evaluated text `{st['eval_text']}`, {st['tokens']} tokens, exact perplexity "
                f"{st['exact_perplexity']:.3f}; warm start: {st['initial_residency']}. Intervals: "
                f"{st['bootstrap_resamples']} bootstrap resamples, seed {st['seed']}.")
    head += ["", "### Cache regimes", ""] + regime_lines(res) + ["", "### Findings", ""]
    lines = ["| # | finding | paper (Qwen3-Next-80B-A3B) | column | ours | 95% interval | verdict |",
             "|---|---|---|---|---|---|---|"]
    rows = sorted(res["rows"], key=lambda r: [r2["id"] for r2 in res["rows"]].index(r["id"]))  # side by side
    for r in rows:
        cells = [r["id"], r["finding"], r["paper"], r["column"], r["ours"], r["ci95"], f"**{r['verdict']}**"]
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    rules = ["", "### How each verdict is decided", ""]
    seen = set()
    for r in res["rows"]:
        if r["id"] not in seen:
            seen.add(r["id"])
            rules.append(f"- {r['id']}: {r['rule']}. Sample: {r['sample']}.")
    return "\n".join(head + lines + rules + [""] + reading(res)) + "\n"


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--json", action="store_true", help="print the JSON result")
    p.add_argument("--out-md", default=None, help="write the Markdown page here")
    p.add_argument("--out-json", default=None, help="write the JSON result here")
    p.add_argument("--command", default=None, help="command line to print above the Markdown table")
    return p


def checked_args(argv: list[str] | None) -> argparse.Namespace:
    """Parsed and checked flags (every check before any work)."""
    a = build_parser().parse_args(argv)
    check_output_path(a.out_md, "--out-md")
    check_output_path(a.out_json, "--out-json")
    for flag, v in (("--prompts", a.prompts), ("--new-tokens", a.new_tokens)):
        if v < 1:
            raise InputError(f"{flag} = {v} must be >= 1")
    a.capacity_fraction = [parse_capacity_fraction(v) for v in (a.capacity_fraction or ["0.25", "paper"])]
    return a


def main(argv: list[str] | None = None) -> None:
    a = checked_args(argv)
    res = run(a.model, a.max_tokens, a.capacity_fraction, a.segment, a.early, a.prompts, a.new_tokens, a.seed,
              progress=sys.stderr.isatty())
    md = to_markdown(res, a.command)
    text = json.dumps(res, indent=2)
    if a.out_json:
        atomic_write(a.out_json, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"))
    if a.out_md:
        atomic_write(a.out_md, lambda tmp: Path(tmp).write_text(md, encoding="utf-8"))
    print(text if a.json else md)
