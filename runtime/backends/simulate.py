"""Trace simulator: replay router traces through the policy kernel and a host cost model.

`evaluate(spec) -> Result` is the `simulator` backend (runtime/backends/__init__.py); `simulate()` is the
same for a trace already in memory; `python -m runtime.simulate` is the command line (policy
flags from runtime/core/policy.py's parameter table). Every run also replays fetch-every-miss and
host-compute at the same capacity and start, and reports the all-resident bound, so speed
ratios come with every result. Warm start: runtime/core/spec.py (never the evaluated rows).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
    residency_array,
    warm_start,
)
from runtime.core.policy import (
    PRESETS,
    PolicyConfig,
    add_policy_flags,
    policies_from_flags,
    resolve_capacities,
)
from runtime.core.spec import (
    HELD_OUT,
    HELD_OUT_FRACTION,
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
    cache: PolicyCache
    events: np.ndarray  # int32 [T, L, N_EV]
    seconds: float  # the kernel loop alone
    decisions: dict[str, np.ndarray] | None = None  # kind / served / slot [T, L, k] when asked for


def layer_major(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The trace's selections, gate weights, rankings and validity layer-major ([L, T, ...], C-contiguous, the
    dtypes the kernel reads): `PolicyCache.step_layers`' inputs, one call replaying every layer."""
    return tuple(np.ascontiguousarray(np.asarray(a, dt).swapaxes(0, 1)) for a, dt in
                 ((trace.topk_ids, np.int32), (trace.topk_weights, np.float64), (trace.ranking, np.int32),
                  (trace.valid, np.bool_)))


def replay(trace: Trace, policy: PolicyConfig, capacities: np.ndarray, initial_residency,
           decisions: bool = False) -> Replay:
    """Run the kernel over every layer of a trace (layers are independent caches)."""
    T, L = trace.T, trace.L
    first_use, nxt = None, None
    if policy.evict == "belady":
        first_use, nxt = [], np.zeros((L, T, trace.k))
        for l_ in range(L):
            nxt[l_], first = next_use(trace.topk_ids[:, l_], trace.valid[:, l_], trace.E, 0)
            first_use.append(first)
    cache = PolicyCache(policy, trace.E, trace.k, capacities, initial_residency, belady_first_use=first_use)
    # written here, so its pages are faulted in before the timed loop (np.zeros maps them lazily: the first
    # write to each page inside the kernel cost ~15% of a replay's time)
    events = np.full((L, T, N_EV), 0, np.int32)
    ids, ws, ranks, valids = layer_major(trace)
    # prefetch: per layer the predicted lists (lookahead column of the previous layer, or oracle: own selection)
    pred = predicted_layers(policy, trace.topk_ids, trace.valid, getattr(trace, "lookahead", None))
    # compile (or load from numba's cache) the one kernel build this replay takes, on a one-token copy of its
    # inputs, before timing: not every build (warmup()), which a fresh process, e.g. a sweep worker, pays in full
    first = [np.ascontiguousarray(a[:, :1]) for a in (ids, ws, ranks, valids)]
    PolicyCache(policy, trace.E, trace.k, capacities, initial_residency, belady_first_use=first_use).step_layers(
        *first, np.zeros((L, min(T, 1), N_EV), np.int32), nxt=None if nxt is None else np.ascontiguousarray(nxt[:, :1]),
        predicted=None if pred is None else np.ascontiguousarray(pred[:, :1]), decisions=decisions)
    t_start = time.perf_counter()
    dec = cache.step_layers(ids, ws, ranks, valids, events, nxt=nxt, predicted=pred, decisions=decisions)
    seconds = time.perf_counter() - t_start
    if dec is not None:  # [T, L, k] per field
        dec = {f: np.ascontiguousarray(a.transpose(1, 0, 2)) for f, a in zip(("kind", "served", "slot"), dec, strict=True)}
    return Replay(cache, np.ascontiguousarray(events.transpose(1, 0, 2)), seconds, dec)


def initial_residency_for(spec: str | None, trace: Trace, capacities: np.ndarray,
                          flag: str = "--initial-residency", policy: PolicyConfig | None = None,
                          ) -> tuple[list | None, Trace, str, np.ndarray]:
    """Warm start of a replay: (per-layer resident ids or None for cold, the trace to evaluate, source,
    slots per layer: `capacities`, or with the policy's `capacity_alloc = calibrated` the same total spread
    by the calibration counts, runtime.core.kernel.warm_start).

    'warm:TRACE' | 'cold' | FILE.npy (int [L, C]) | 'held-out' (runtime/core/spec.py: the last 20% of the
    trace calibrates and is not evaluated). Unset: held-out, with a warning (never the evaluated rows)."""
    policy = PRESETS["fetch-every-miss"] if policy is None else policy
    caps = np.asarray(capacities, np.int64)
    if spec is None:
        log.warning("no --initial-residency: warm start from the held-out last %d%% of the trace (not evaluated)",
                    round(HELD_OUT_FRACTION * 100))
        spec = HELD_OUT
    if spec == "cold":
        return None, trace, "cold", warm_start(policy, caps, trace.k, trace.E, source="cold")[0]
    if spec == HELD_OUT:
        evaluated, calib = calibration_split(trace, 1.0 - HELD_OUT_FRACTION)
        caps, init = warm_start(policy, caps, trace.k, trace.E, calib.topk_ids, calib.valid)
        return init, evaluated, f"held-out: trace tokens {evaluated.T}..{trace.T - 1}", caps
    if spec.startswith("warm:"):
        calib = load_trace(spec[5:], num_experts=trace.E if spec.endswith(".npz") else None)
        known = {calib.meta.model, trace.meta.model}.isdisjoint({"", "unknown"})
        if known and calib.meta.model.split(":")[0] != trace.meta.model.split(":")[0]:
            raise InputError(f"{flag}: calibration trace {spec[5:]} is from model {calib.meta.model!r}; "
                             f"the trace is from {trace.meta.model!r}")
        if (calib.E, calib.k, calib.L) != (trace.E, trace.k, trace.L):
            raise InputError(f"{flag}: calibration trace {spec[5:]} has E={calib.E}, k={calib.k}, L={calib.L}; "
                             f"the trace has E={trace.E}, k={trace.k}, L={trace.L}")
        caps, init = warm_start(policy, caps, trace.k, trace.E, calib.topk_ids, calib.valid)
        return init, trace, spec, caps
    path = Path(spec)
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"{flag}: cannot read {spec}: {str(exc).splitlines()[0]}") from None
    if arr.ndim != 2 or arr.shape[0] != trace.L or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{flag}: {spec} has shape {arr.shape} dtype {arr.dtype}; expected int [L={trace.L}, C]")
    if arr.shape[1] > capacities.max() or np.any((arr < -1) | (arr >= trace.E)):
        raise InputError(f"{flag}: {spec} has shape {arr.shape} with ids in [{arr.min()}, {arr.max()}]; "
                         f"expected ids in [0, {trace.E}) (-1: an empty slot) and at most C={int(capacities.max())} columns")
    rows = [arr[l_][arr[l_] >= 0] for l_ in range(trace.L)]  # -1 pads a layer with fewer slots
    for l_, row in enumerate(rows):
        if len(row) > capacities[l_] or len(np.unique(row)) != len(row):
            raise InputError(f"{flag}: {spec} row {l_} = {arr[l_].tolist()[:12]} repeats an id or exceeds C={capacities[l_]}")
    warm_start(policy, caps, trace.k, trace.E, source=spec)  # calibrated capacities: an error here
    return rows, trace, spec, caps


class ReplayCache:
    """What repeated simulator runs share (the simulator backend keeps one; a sweep worker's trials hit it):
    loaded traces by path, warm starts by (trace, initial_residency, capacities), the fetch-every-miss and
    host-compute baseline times by everything they depend on, and host profiles registered in memory
    (`add_host`: by name, ahead of the presets)."""

    def __init__(self) -> None:
        self.traces: dict[str, Trace] = {}
        self.memo: dict[tuple, object] = {}
        self.hosts: dict[str, costmodel.HostProfile] = {}

    def trace(self, path: str) -> Trace:
        if path not in self.traces:
            self.traces.clear()  # one trace at a time (a sweep evaluates one)
            self.memo.clear()
            self.traces[path] = load_trace(path)
        return self.traces[path]

    def get(self, key: tuple, make):  # noqa: ANN001, ANN201 - a memo of any value
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def add_host(self, data: dict) -> costmodel.HostProfile:
        """A host profile from its mapping (the sweep's calibrated hosts), used for `host = its name`."""
        prof = costmodel.host_profile_from_dict(data, f"host {data.get('name')}")
        self.hosts[prof.name] = prof
        return prof

    def host(self, name: str | costmodel.HostProfile) -> costmodel.HostProfile:
        if isinstance(name, costmodel.HostProfile):
            return name
        return self.hosts[name] if name in self.hosts else self.get(("host", name), lambda: costmodel.load_host_profile(name))


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
    host: str | costmodel.HostProfile = RunSpec.host,  # the run-field table's default (rtx4090)
    model_shape: str | costmodel.ModelShape | None = None,
    max_tokens: int | None = None,
    baselines: bool = True,
    record_decisions: bool = False,
    cache: ReplayCache | None = None,
    trace_key: str | None = None,
) -> Result:
    """Replay a trace in memory under `policy` (the library form of `evaluate`; `initial_residency` may
    also be per-layer id arrays, `host` / `model_shape` loaded objects). With `cache` and `trace_key`
    (the trace's identity, e.g. its path) warm starts and baseline times are computed once."""
    shape = model_shape if isinstance(model_shape, costmodel.ModelShape) else costmodel.shape_for_trace(trace, model_shape)
    if vram_budget_GiB is not None:
        caps = costmodel.capacities_for_budget(shape, vram_budget_GiB, policy)
        caps = resolve_capacities(caps, trace.L, trace.E, trace.k, flag=f"--vram-budget {vram_budget_GiB!r} GiB: capacity")
    else:
        caps = resolve_capacities(capacity, trace.L, trace.E, trace.k, capacity_fraction)
    memo = cache is not None and trace_key is not None
    if isinstance(initial_residency, str | None):
        if memo:
            init, trace, source, caps = cache.get(
                ("warm", trace_key, initial_residency, tuple(caps.tolist()), policy.capacity_alloc),
                lambda: initial_residency_for(initial_residency, trace, caps, policy=policy))
        else:
            init, trace, source, caps = initial_residency_for(initial_residency, trace, caps, policy=policy)
    else:
        init, source = initial_residency, "given"
        caps = warm_start(policy, caps, trace.k, trace.E, given=init, source="given per-layer ids")[0]
    if max_tokens is not None:
        trace = trace.slice_tokens(0, max_tokens)
    profile = cache.host(host) if cache is not None else (
        host if isinstance(host, costmodel.HostProfile) else costmodel.load_host_profile(host))
    params = costmodel.cost_params(profile, shape, lowbit_bits=policy.lowbit_bits, lowbit_group=policy.lowbit_group)
    rep = replay(trace, policy, caps, init, decisions=record_decisions)
    timing = _timing(rep, trace, params)
    extra = {"host": profile.name, "model_shape": shape.name, "weight_format": shape.weight_format,
             "stall_fetch_s": timing["stall_fetch_s"], "stall_admission_s": timing["stall_admission_s"],
             "replay_seconds": rep.seconds,
             "token_layers_per_second": int(trace.valid.sum()) / max(rep.seconds, 1e-12),
             "device_memory_GiB": costmodel.budget_for_capacities(shape, caps, policy),
             "expert_slots_GiB": float(caps.sum()) * costmodel.expert_bytes(shape) / 2**30}
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
    warm starts, baselines and host profiles are kept between calls)."""
    key = None
    if trace is None:
        trace = load_trace(spec.trace) if cache is None else cache.trace(spec.trace)
        key = spec.trace
    shape = costmodel.shape_for_trace(trace, spec.model_shape)
    if spec.weight_format:
        shape = costmodel.with_format(shape, spec.weight_format)
    res = simulate(trace, spec.policy, spec.capacity, capacity_fraction=spec.capacity_fraction,
                   vram_budget_GiB=spec.vram_budget_GiB, initial_residency=spec.initial_residency, host=spec.host,
                   model_shape=shape, max_tokens=spec.max_tokens, record_decisions=spec.record_decisions,
                   cache=cache, trace_key=key)
    if spec.residency_out is not None:
        init = initial_residency_for(spec.initial_residency, trace, np.asarray(res.capacity))[0]  # (uniform: C_l kept)
        save_residency(spec.residency_out, init, res.capacity)
    return res


def save_residency(path: str, init: list | None, caps: list[int]) -> None:
    """The initial residency used, as .npy int [L, max C_l] (rows padded with -1 where a layer has fewer slots)."""
    arr = residency_array(init, caps, f"--residency-out {path}")
    atomic_write(path, lambda tmp: np.save(open(tmp, "wb"), arr))

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
              f"substituted mass {res['mass_per_token']:.4f}/token (warm start: {res['initial_residency']})")
