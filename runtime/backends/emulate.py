"""Exact emulation: teacher-forced perplexity of a Hugging Face MoE checkpoint under miss policies.

The text becomes one token stream cut into windows of `window` tokens (each window an
independent context; a trailing partial window is dropped). Windows run through the model
in stream order, several at a time; inside each MoE layer the policy kernel decides the
tokens of the batch in stream order, so every decision equals what a one-token-at-a-time
decode with a KV cache would make (tests/test_emulate.py checks it). The policy cache is
carried across windows and documents.

`evaluate_group(m, specs)` is the `emulation` backend (runtime/backends/__init__.py) for RunSpecs that
share one input: the exact pass runs once (and is kept for the next call), then each policy.
Per policy: perplexity, its change versus the exact model with a 95% bootstrap interval over
windows, the spec's counters and substituted mass; per-token NLLs go to Parquet. Warm start:
runtime/core/spec.py (the calibration never depends on `max_tokens`); each spec's capacities and warm
start come from runtime/backends/resolve.py (`resolve` on the text's `TextSource`: the emulation only
supplies the calibration ids of its held-out tokens or calibration text).
`python -m runtime.emulate --model DIR --text FILE --policy PRESET --capacity-fraction F --json`
(policy flags from runtime/core/policy.py's table; `--backend engine` decodes with the engine; the
command line is `runtime.cli.emulate_main`, also `expertsweep emulate`).
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from dataclasses import dataclass

import numpy as np

from runtime.backends.adapters import Recorder, decision_arrays, weight_norm_of
from runtime.backends.hfmodel import (  # noqa: F401 - re-exported for callers of runtime.backends.emulate
    Lane,
    Loaded,
    calib_windows_ids,
    calibration_ids,
    default_window,
    load,
    make_trace,
    read_tokens,
    record,
    record_routing,
    run_lanes,
    run_stream,
    to_windows,
    tokenize_file,
)
from runtime.backends.resolve import (
    Calibration,
    CalibrationSource,
    calibration,
    resolve,
    save_residency,
)
from runtime.core.errors import InputError, atomic_write
from runtime.core.llamacpp_cache import LayerSplitCache, cache_for
from runtime.core.policy import PolicyConfig
from runtime.core.spec import GROUP_FIELDS, Result, RunSpec
from runtime.formats import costmodel
from runtime.formats.trace import save_trace

log = logging.getLogger(__name__)


class TextSource(CalibrationSource):
    """A tokenized text on a loaded model as the resolver's input (runtime/backends/resolve.py): the model's
    dimensions and shape, and the calibration ids: the held-out last part of the text's tokens, or a
    calibration text (`--calib-text`, else calib.txt beside the model), each read up to `calib_max_tokens`
    tokens in windows of the evaluation's length and routed by the exact model."""

    backend = "emulation"

    def __init__(self, m: Loaded, spec: RunSpec, ids: np.ndarray, window: int, progress: bool = False) -> None:
        super().__init__(m.num_layers, m.E, m.k, model=f"{m.model.config.model_type}:{m.model_dir.resolve()}",
                         input_name="the model", tokens_name=str(spec.text))
        # the model by weak reference: an exact pass keeps its source, and _EXACT's entries must die with the model
        self._m = weakref.ref(m)
        self.ids, self.window, self.progress = ids, window, progress  # ids int64 [N]
        self.text, self.calib_max_tokens, self.batch_windows = spec.text, spec.calib_max_tokens, spec.batch_windows

    @property
    def m(self) -> Loaded:
        m = self._m()
        if m is None:
            raise InputError(f"--text {self.text}: the model this input was read with is no longer loaded")
        return m

    def held_out(self, fraction: float) -> Calibration:
        n = len(self.ids)
        cut = int(n * (1 - fraction))
        cwin = to_windows(self.ids[cut:], self.calib_max_tokens, self.window, f"--text {self.text} (held-out part)")
        return Calibration("held-out", f"held-out: text tokens {cut}..{n - 1} of {self.text}",
                           calib_windows_ids(self.m, cwin, self.batch_windows, self.progress), evaluated=cut)

    def calibration_text(self, path: str | None) -> Calibration | None:
        ids, source = calibration_ids(self.m, path, self.calib_max_tokens, self.window, self.batch_windows,
                                      self.progress)
        return None if ids is None else Calibration("text", source, ids)

    def model_shape(self, name: str | None) -> costmodel.ModelShape:
        """The loaded model's shape in the dtype loaded (auto resolved): a VRAM budget's slots."""
        return costmodel.model_shape_for(self.m.model.config.to_dict(), self.m.dtype)


@dataclass
class Exact:
    """The exact model on one input: evaluated windows, NLL, and the input as the resolver reads it."""

    windows: np.ndarray  # [n, W] int64
    sha: str
    nll: np.ndarray | None  # [n, W-1] (None until a deferred exact pass ran)
    seconds: float
    source: TextSource  # the text's tokens and calibrations (resolve(spec, source) for each spec of the group)
    calibration: Calibration  # the warm-start source of the group

    @property
    def calib_ids(self) -> np.ndarray | None:
        """Router ids [T_c, L, k] of the calibration tokens; None: a cold start or a residency file."""
        return self.calibration.ids

    @property
    def init_source(self) -> str:
        return self.calibration.source


# kept between calls (a sweep worker evaluates many policies on one input), per loaded model and
# only while that model lives: keyed by the module itself, never by id(), which a later model reuses
_EXACT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bootstrap_change(nll_exact: np.ndarray, nll_pol: np.ndarray, n_boot: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """Perplexity change in percent with a 95% interval, resampling windows (rows) with replacement."""
    se, sp = nll_exact.sum(1), nll_pol.sum(1)  # [n]
    cnt = nll_exact.shape[1]
    point = math.expm1((sp.sum() - se.sum()) / (cnt * len(se))) * 100
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(se), size=(n_boot, len(se)))
    diffs = (sp[idx].sum(1) - se[idx].sum(1)) / (cnt * len(se))
    lo, hi = np.percentile(np.expm1(diffs) * 100, [2.5, 97.5])
    return point, float(lo), float(hi)


# what an exact pass depends on: the group's input fields, less the model (the cache is per model) and the
# per-token output path (nll_out)
EXACT_KEY = tuple(f for f in GROUP_FIELDS if f not in ("model", "nll_out"))


def exact_pass(m: Loaded, spec: RunSpec, progress: bool = False, defer_nll: bool = False) -> Exact:
    """Tokenize, split off the warm-start tokens, run the exact model; cached per input. `defer_nll`:
    leave `nll` None when it is not cached yet (the caller runs the exact model beside its policies,
    one pass for all: `evaluate_group`)."""
    cached = _EXACT.setdefault(m.model, {})
    key = tuple(getattr(spec, f) for f in EXACT_KEY)
    if key in cached:
        ex = cached[key]
        if ex.nll is None and not defer_nll:
            ex.nll = run_lanes(m, ex.windows, [Lane(desc="exact")], spec.batch_windows, progress)[0]
        return ex
    W = spec.window or default_window(m)
    ids, sha = read_tokens(m, spec.text)
    source = TextSource(m, spec, ids, W, progress)
    cal = calibration(spec, source)  # held-out: only the tokens before the calibrated part are evaluated
    windows = to_windows(ids[:cal.evaluated], spec.max_tokens, W, f"--text {spec.text}")
    lane = Lane(desc="exact")
    nll = None if defer_nll else run_lanes(m, windows, [lane], spec.batch_windows, progress)[0]
    ex = Exact(windows, sha, nll, lane.seconds, source, cal)
    if len(cached) >= 4:
        cached.pop(next(iter(cached)))
    cached[key] = ex
    return ex


def evaluate_group(m: Loaded, specs: list[RunSpec], runner=None, backend: str = "emulation",
                   progress: bool = False) -> list[Result]:
    """Evaluate RunSpecs that share one input (GROUP_FIELDS) on a loaded model.

    `runner(m, windows, cache, name) -> (nll [n, W-1], extra)`, when given, replaces the batched
    forward of each policy (the engine backend decodes token by token)."""
    first = specs[0]
    for s in specs[1:]:
        for f in GROUP_FIELDS:
            if getattr(s, f) != getattr(first, f):
                raise InputError(f"one evaluation group: {f} differs between policies ({getattr(first, f)!r} vs "
                                 f"{getattr(s, f)!r})")
    ex = exact_pass(m, first, progress, defer_nll=runner is None)
    windows = ex.windows
    T = int(windows.size)
    lanes, runs = [], []
    for spec in specs:
        run = resolve(spec, ex.source)  # slots per layer (after capacity_alloc), the warm start, its source
        # (llama.cpp's shared pool and layer split: runtime/core/llamacpp_cache.py, exact decisions only)
        cache = cache_for(spec.policy, m.E, m.k, run.capacities, run.initial_residency,
                          weight_norm=weight_norm_of(m.model.config))
        lane = Lane(cache=cache, substitute_weight=spec.substitute_weight, desc=spec.label,
                    decisions=[[] for _ in range(m.num_layers)] if spec.record_decisions else None)
        if spec.trace_out is not None:  # with the lookahead column (P = max(k, prefetch width))
            # (+ the router_scores column when the policy routes by them: Cache-Prior, docs/policies.md Additions (4))
            lane.recorder = Recorder.empty(m.num_layers, m.E, max(m.k, cache.prefetch_width),
                                           scores=spec.policy.route == "cache-prior")
        lanes.append(lane)
        runs.append(run)
    extras: list[dict] = [{} for _ in specs]
    if runner is None:  # one pass: the exact model (unless cached) beside every policy
        exact = [Lane(desc="exact")] if ex.nll is None else []
        nlls = run_lanes(m, windows, exact + lanes, first.batch_windows, progress)
        if exact:
            ex.nll, ex.seconds = nlls.pop(0), exact[0].seconds
    else:  # the engine decodes token by token, one policy after the other
        nlls = []
        for spec, lane, extra in zip(specs, lanes, extras, strict=True):
            m.ctx.substitute_weight = spec.substitute_weight
            m.ctx.decisions = lane.decisions
            t0 = time.perf_counter()
            try:
                nll, more = runner(m, windows, lane.cache, spec.label)
            finally:
                m.ctx.decisions = None
                m.ctx.substitute_weight = "missed"
            lane.seconds = time.perf_counter() - t0
            extra.update(more)
            nlls.append(nll)
    nll_exact = ex.nll
    exact_ppl = float(math.exp(nll_exact.mean()))
    out, nll_cols = [], {"nll_exact": nll_exact.ravel()}
    for spec, lane, run, nll, extra in zip(specs, lanes, runs, nlls, extras, strict=True):
        pol, cache = spec.policy, lane.cache
        if spec.trace_out is not None:
            r = lane.recorder
            pids, pw, prank = r.arrays()
            save_trace(make_trace(m, pids, pw, prank, windows, ex.sha, f"runtime.backends.emulate policy={pol.label()}",
                                  r.lookahead_array(), r.scores_array()), spec.trace_out)
        decisions = decision_arrays(lane.decisions) if spec.record_decisions else None
        point, lo, hi = bootstrap_change(nll_exact, nll)
        if isinstance(cache, LayerSplitCache):
            extra["ncmoe"] = cache.ncmoe
        extra.update({"seconds": lane.seconds, "exact_seconds": ex.seconds, "streamed": m.streamed, "substitute_weight":
                      spec.substitute_weight, "windows": int(windows.shape[0]), "window": int(windows.shape[1]),
                      "scored_tokens": int(nll.size)})
        out.append(Result(backend=backend, policy=pol.label(), policy_config=pol.to_dict(), capacity=run.capacities.tolist(),
                          initial_residency=run.residency_source, tokens=T, num_layers=m.num_layers, num_experts=m.E,
                          top_k=m.k, counters=cache.counter_totals(), per_layer=cache.per_layer(),
                          perplexity=float(math.exp(nll.mean())), exact_perplexity=exact_ppl, ppl_change_pct=point,
                          ppl_ci_low=lo, ppl_ci_high=hi, extra=extra, decisions=decisions))
        nll_cols[f"nll_{spec.label}"] = nll.ravel()
        save_residency(run, spec.residency_out)  # [L, max C_l], -1 padded
    if first.nll_out is not None:
        _write_nll(first.nll_out, windows, nll_cols)
    return out


def emulate(model_dir: str | os.PathLike | Loaded, text_path: str | os.PathLike, policies: dict[str, PolicyConfig],
            capacity_fraction: float | None = 0.25, capacity=None, max_tokens: int | None = None, **spec_fields) -> dict:
    """Library shorthand: {"exact": {...}, name: Result.to_dict()} for named policies on one text."""
    m = model_dir if isinstance(model_dir, Loaded) else load(model_dir)
    progress = spec_fields.pop("progress", False)
    specs = [RunSpec(policy=p, name=name, capacity=capacity, capacity_fraction=None if capacity is not None else capacity_fraction,
                     model=str(m.model_dir), text=str(text_path), max_tokens=max_tokens, **spec_fields)
             for name, p in policies.items()]
    res = evaluate_group(m, specs, progress=progress)
    ex = exact_pass(m, specs[0])
    out: dict = {"exact": {"perplexity": res[0].exact_perplexity, "tokens": res[0].tokens,
                           "scored_tokens": int(ex.nll.size), "windows": int(ex.windows.shape[0]),
                           "window": int(ex.windows.shape[1]), "seconds": ex.seconds,
                           "initial_residency": ex.init_source}}
    for name, r in zip(policies, res, strict=True):
        out[name] = r.to_dict()
    return out


def _write_nll(path, windows: np.ndarray, cols: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, W = windows.shape
    table = pa.table({"window": np.repeat(np.arange(n, dtype=np.int32), W - 1),
                      "position": np.tile(np.arange(1, W, dtype=np.int32), n),
                      "token_id": windows[:, 1:].ravel().astype(np.int32),
                      **{k: v.astype(np.float64) for k, v in cols.items()}})
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))
