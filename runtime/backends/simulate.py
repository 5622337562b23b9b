"""Trace simulator: replay router traces through the policy kernel and a host cost model.

`evaluate(spec) -> Result` is the `simulator` backend (runtime/backends/__init__.py); `simulate()` is the
same for a trace already in memory; `python -m runtime.simulate` is the command line (policy
flags from runtime/core/policy.py's parameter table). The spec's capacities, warm start, host profile and
model shape come from runtime/backends/resolve.py (`resolve`, on the trace's `TraceSource`: the simulator
only supplies its held-out rows); `simulate_run` replays the resolved run. Every run also replays
fetch-every-miss and host-compute at the same capacity and start, and reports the all-resident bound, so
speed ratios come with every result. Warm start: runtime/core/spec.py (never the evaluated rows).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.backends.resolve import Calibration, CalibrationSource, Run, resolve, save_residency
from runtime.core.errors import (
    ArgumentParser,
    InputError,
    atomic_write,
    check_output_path,
)
from runtime.core.kernel import (
    N_EV,
    PolicyCache,
    next_use,
    predicted_layers,
)
from runtime.core.llamacpp_cache import LayerSplitCache, SharedPoolCache, cache_for
from runtime.core.policy import (
    PRESETS,
    PolicyConfig,
    add_policy_flags,
    gate_weight_readers,
    policies_from_flags,
)
from runtime.core.spec import (
    Result,
    RunSpec,
    add_run_flags,
    honoured_by,
    run_kwargs,
)
from runtime.formats import costmodel
from runtime.formats.trace import Trace, calibration_split, load_trace

log = logging.getLogger(__name__)


@dataclass
class Replay:
    cache: PolicyCache | SharedPoolCache | LayerSplitCache
    events: np.ndarray  # int32 [T, L, N_EV]
    seconds: float  # the kernel loop alone
    decisions: dict[str, np.ndarray] | None = None  # kind / served / slot [T, L, k] when asked for


def layer_major(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The trace's selections, gate weights, rankings and validity layer-major ([L, T, ...], C-contiguous, the
    dtypes the kernel reads): `PolicyCache.step_layers`' inputs, one call replaying every layer."""
    return tuple(np.ascontiguousarray(np.asarray(a, dt).swapaxes(0, 1)) for a, dt in
                 ((trace.topk_ids, np.int32), (trace.topk_weights, np.float64), (trace.ranking, np.int32),
                  (trace.valid, np.bool_)))


def check_gate_weights(policy: PolicyConfig, trace: Trace) -> None:
    """A trace without gate weights (imported routing ids, TraceMeta.gate_weights False) replays only the policies
    that read none (runtime/core/policy.py GATE_WEIGHT_READERS): any other is a one-line InputError naming the
    policy, the field that reads them and the missing column."""
    readers = [] if trace.meta.gate_weights else gate_weight_readers(policy)
    if readers:
        field, why = readers[0]
        raise InputError(f"policy {policy.label()!r} needs the trace column topk_weights (gate weights), which this "
                         f"trace ({trace.meta.source or 'imported routing'}) lacks: {field} = {getattr(policy, field)!r}"
                         f" ({why}); without gate weights: fetch_all, or first_choice / substitute_all / a fetch "
                         f"cap with fallback host; any eviction, prefetch oracle; no beta, no route")


def replay(trace: Trace, policy: PolicyConfig, capacities: np.ndarray, initial_residency,
           decisions: bool = False) -> Replay:
    """Run the kernel over every layer of a trace (per-layer caches; llama.cpp's shared pool token-major, its layer
    split per layer: runtime/core/llamacpp_cache.py)."""
    T, L = trace.T, trace.L
    check_gate_weights(policy, trace)
    first_use, nxt = None, None
    if policy.evict == "belady":
        first_use, nxt = [], np.zeros((L, T, trace.k))
        for l_ in range(L):
            nxt[l_], first = next_use(trace.topk_ids[:, l_], trace.valid[:, l_], trace.E, 0)
            first_use.append(first)
    # cache-aware routing (docs/policies.md, Additions (4)): Cache-Prior reads the trace's router_scores column
    # and follows its weight normalisation; CACHE_ROUTE needs only the ranking
    scores, norm = None, "softmax_topk"
    if policy.route == "cache-prior":
        if getattr(trace, "router_scores", None) is None:
            raise InputError("--route = 'cache-prior' needs the trace column router_scores, which this trace lacks "
                             "(record it with `record --router-scores` or `emulate --trace-out` under the policy)")
        if trace.meta.weight_norm not in ("softmax_topk", "softmax_all"):
            raise InputError(f"--route = 'cache-prior' needs a softmax router; the trace's weight_norm is "
                             f"{trace.meta.weight_norm!r}")
        scores = np.ascontiguousarray(np.asarray(trace.router_scores, np.float64).swapaxes(0, 1))
        norm = trace.meta.weight_norm
    cache = cache_for(policy, trace.E, trace.k, capacities, initial_residency, belady_first_use=first_use,
                      weight_norm=norm)
    # written here, so its pages are faulted in before the timed loop (np.zeros maps them lazily: the first
    # write to each page inside the kernel cost ~15% of a replay's time)
    events = np.full((L, T, N_EV), 0, np.int32)
    ids, ws, ranks, valids = layer_major(trace)
    # prefetch: per layer the predicted lists (lookahead column of the previous layer, or oracle: own selection)
    pred = predicted_layers(policy, trace.topk_ids, trace.valid, getattr(trace, "lookahead", None))
    # compile (or load from numba's cache) the one kernel build this replay takes, on a one-token copy of its
    # inputs, before timing: not every build (warmup()), which a fresh process, e.g. a sweep worker, pays in full
    first = [np.ascontiguousarray(a[:, :1]) for a in (ids, ws, ranks, valids)]
    cache_for(policy, trace.E, trace.k, capacities, initial_residency, belady_first_use=first_use,
              weight_norm=norm).step_layers(
        *first, np.zeros((L, min(T, 1), N_EV), np.int32), nxt=None if nxt is None else np.ascontiguousarray(nxt[:, :1]),
        predicted=None if pred is None else np.ascontiguousarray(pred[:, :1]), decisions=decisions,
        scores=None if scores is None else np.ascontiguousarray(scores[:, :1]))
    t_start = time.perf_counter()
    dec = cache.step_layers(ids, ws, ranks, valids, events, nxt=nxt, predicted=pred, decisions=decisions,
                            scores=scores)
    seconds = time.perf_counter() - t_start
    if dec is not None:  # [T, L, k] per field
        dec = {f: np.ascontiguousarray(a.transpose(1, 0, 2)) for f, a in zip(("kind", "served", "slot"), dec, strict=True)}
    return Replay(cache, np.ascontiguousarray(events.transpose(1, 0, 2)), seconds, dec)


class TraceSource(CalibrationSource):
    """A router trace as the resolver's input (runtime/backends/resolve.py): its dimensions, its model shape
    and its held-out rows (the last part, cut at the sequence boundary nearest 80%)."""

    backend = "simulator"

    def __init__(self, trace: Trace, shape: costmodel.ModelShape | None = None) -> None:
        super().__init__(trace.L, trace.E, trace.k, model=trace.meta.model, input_name="the trace",
                         tokens_name="the trace")
        self.trace = trace
        self.shape = shape  # a loaded shape (library); else from RunSpec.model_shape / the trace's model

    def held_out(self, fraction: float) -> Calibration:
        evaluated, calib = calibration_split(self.trace, 1.0 - fraction)
        return Calibration("held-out", f"held-out: trace tokens {evaluated.T}..{self.trace.T - 1}", calib.topk_ids,
                           calib.valid, evaluated=evaluated.T)

    def model_shape(self, name: str | None) -> costmodel.ModelShape:
        return self.shape if self.shape is not None else costmodel.shape_for_trace(self.trace, name)


class ReplayCache:
    """What repeated simulator runs share (the simulator backend keeps one; a sweep worker's trials hit it):
    the loaded trace as a `TraceSource` by path (with the calibrations, calibration traces and host presets
    resolved on it), and the fetch-every-miss and host-compute baseline times by everything they depend on."""

    def __init__(self) -> None:
        self.sources: dict[str, TraceSource] = {}
        self.memo: dict[tuple, object] = {}

    def source(self, path: str) -> TraceSource:
        if path not in self.sources:
            self.sources.clear()  # one trace at a time (a sweep evaluates one)
            self.memo.clear()
            self.sources[path] = TraceSource(load_trace(path))
        return self.sources[path]

    def trace(self, path: str) -> Trace:
        return self.source(path).trace

    def get(self, key: tuple, make):  # noqa: ANN001, ANN201 - a memo of any value
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


def _timing(rep: Replay, trace: Trace, params) -> dict:
    timing = costmodel.replay_time(rep.events, trace.valid, params)
    T = max(trace.T, 1)
    return {"time_per_token_s": timing.per_token_s, "stall_fetch_s": timing.stall_fetch_s / T,
            "stall_admission_s": timing.stall_admission_s / T}


def simulate(
    trace: Trace,
    policy: PolicyConfig,
    capacity=None,
    *,
    capacity_fraction: float | None = None,
    vram_budget_GiB: float | None = None,
    initial_residency: str | list | None = None,
    host: str | dict | costmodel.HostProfile = RunSpec.host,  # the run-field table's default (rtx4090)
    model_shape: str | costmodel.ModelShape | None = None,
    max_tokens: int | None = None,
    baselines: bool = True,
    record_decisions: bool = False,
    cache: ReplayCache | None = None,
    trace_key: str | None = None,
) -> Result:
    """Replay a trace in memory under `policy` (the library form of `evaluate`; `initial_residency` may
    also be per-layer id arrays, `host` / `model_shape` loaded objects). With `cache` and `trace_key`
    (the trace's identity, e.g. its path) baseline times are computed once."""
    given = None if isinstance(initial_residency, str | None) else initial_residency
    spec = RunSpec(policy=policy, trace=trace_key or "(in memory)", capacity=capacity,
                   capacity_fraction=capacity_fraction, vram_budget_GiB=vram_budget_GiB,
                   initial_residency=None if given is not None else initial_residency, host=host,
                   model_shape=model_shape if isinstance(model_shape, str) else None, max_tokens=max_tokens,
                   record_decisions=record_decisions)
    source = TraceSource(trace, model_shape if isinstance(model_shape, costmodel.ModelShape) else None)
    run = resolve(spec, source, initial_residency=given)
    return simulate_run(trace, run, max_tokens=max_tokens, baselines=baselines, record_decisions=record_decisions,
                        cache=cache if given is None else None, trace_key=trace_key)


def simulate_run(trace: Trace, run: Run, *, max_tokens: int | None = None, baselines: bool = True,
                 record_decisions: bool = False, cache: ReplayCache | None = None,
                 trace_key: str | None = None) -> Result:
    """Replay `trace` under a resolved run (runtime/backends/resolve.py: its capacities, warm start, host and
    shape); held-out: only its evaluated tokens. With `cache` and `trace_key` baseline times are computed once."""
    policy, caps, init, source, shape = run.policy, run.capacities, run.initial_residency, run.residency_source, run.shape
    if run.evaluated_tokens is not None:
        trace = trace.slice_tokens(0, run.evaluated_tokens)
    if max_tokens is not None:
        trace = trace.slice_tokens(0, max_tokens)
    memo = cache is not None and trace_key is not None
    profile = run.host
    params = costmodel.cost_params(profile, shape, lowbit_bits=policy.lowbit_bits, lowbit_group=policy.lowbit_group)
    rep = replay(trace, policy, caps, init, decisions=record_decisions)
    timing = _timing(rep, trace, params)
    extra = {"host": profile.name, "model_shape": shape.name, "weight_format": shape.weight_format,
             "stall_fetch_s": timing["stall_fetch_s"], "stall_admission_s": timing["stall_admission_s"],
             "replay_seconds": rep.seconds,
             "token_layers_per_second": int(trace.valid.sum()) / max(rep.seconds, 1e-12),
             # the experts the device holds: the slots, or under -ncmoe the (L - N) * E resident experts
             "device_memory_GiB": costmodel.budget_for_capacities(shape, rep.cache.caps, policy),
             "expert_slots_GiB": float(rep.cache.caps.sum()) * costmodel.expert_bytes(shape) / 2**30}
    if isinstance(rep.cache, LayerSplitCache):
        extra["ncmoe"] = rep.cache.ncmoe
    extra["all_resident_time_per_token_s"] = costmodel.all_resident_time(trace.valid.sum(axis=1), params, trace.k)
    t = timing["time_per_token_s"]
    ratio = None
    if baselines:
        for name, base in (("fetch_all", PRESETS["fetch-every-miss"]), ("host_compute", PRESETS["host-compute"])):
            def base_time(base=base):  # noqa: ANN001, ANN202
                return _timing(replay(trace, base, caps, init), trace, params)["time_per_token_s"]

            if base == policy:
                t_base = t
            elif memo:
                t_base = cache.get(("base", trace_key, name, source, tuple(caps.tolist()), max_tokens, profile, shape),
                                   base_time)
            else:
                t_base = base_time()
            extra[f"{name}_time_per_token_s"] = t_base
            extra[f"speed_ratio_vs_{name}"] = t_base / t
        ratio = extra.pop("speed_ratio_vs_fetch_all")
        extra["speed_ratio_vs_all_resident"] = extra["all_resident_time_per_token_s"] / t
    return Result(backend="simulator", policy=policy.label(), policy_config=policy.to_dict(), capacity=caps.tolist(),
                  initial_residency=source, tokens=trace.T, num_layers=trace.L, num_experts=trace.E, top_k=trace.k,
                  counters=rep.cache.counter_totals(), per_layer=rep.cache.per_layer(), time_per_token_s=t,
                  time_kind="simulated", speed_ratio_vs_fetch_all=ratio, extra=extra, decisions=rep.decisions)


def evaluate(spec: RunSpec, trace: Trace | None = None, cache: ReplayCache | None = None) -> Result:
    """The simulator backend: replay `spec.trace` (loaded here unless given; with `cache`, the loaded trace,
    its calibrations, host presets and the baselines are kept between calls)."""
    key = None
    if trace is None:
        source = TraceSource(load_trace(spec.trace)) if cache is None else cache.source(spec.trace)
        key = spec.trace
    else:
        source = TraceSource(trace)
    run = resolve(spec, source)
    res = simulate_run(source.trace, run, max_tokens=spec.max_tokens, record_decisions=spec.record_decisions,
                       cache=cache, trace_key=key)
    save_residency(run, spec.residency_out)
    return res


SIM_FLAGS = tuple(sorted(n for n in honoured_by("simulator") if n != "record_decisions"))  # library only


def build_parser() -> argparse.ArgumentParser:
    """The simulator's flags: the policy table's, the run-field table's rows the simulator honours
    (runtime/core/spec.py: flag, default and help written once), --num-experts, --json and --out."""
    p = ArgumentParser(prog="python -m runtime.simulate", description=__doc__.splitlines()[0], allow_abbrev=False)
    add_policy_flags(p)
    add_run_flags(p, ("simulator",), size_required=True)
    p.add_argument("--num-experts", type=int, default=None, help="E for .npz files without num_experts")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--out", help="also write the JSON to this file")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.trace is None:
        raise InputError("--trace is required (a router trace: .parquet, .arrow or .npz)")
    pols = policies_from_flags(a)
    check_output_path(a.out, "--out")
    if len(pols) > 1:
        raise InputError(f"--policy: one policy per simulator run ({len(pols)} given)")
    (pol,) = pols.values()
    spec = RunSpec(policy=pol, **run_kwargs(a, SIM_FLAGS))
    r = evaluate(spec, load_trace(a.trace, num_experts=a.num_experts))
    res = r.to_dict()
    res["trace"] = str(a.trace)
    text = json.dumps(res, indent=2)
    if a.out:
        atomic_write(a.out, lambda tmp: Path(tmp).write_text(text))
    if a.json:
        print(text)
    else:
        print(f"{res['policy']}: {res['time_per_token_s'] * 1e3:.3f} ms/token, "
              f"{res['speed_ratio_vs_fetch_all']:.2f}x vs fetch-every-miss, "
              f"mass {res['mass_per_token']:.4f}/token (substituted + rerouted) (warm start: {res['initial_residency']})")
