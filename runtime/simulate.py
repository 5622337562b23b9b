"""Trace simulator: replay router traces through the policy kernel and a host cost model.

`simulate()` is the library entry (the sweep calls it per trial); `python -m runtime.simulate`
is the command line. Every run also replays fetch-every-miss and host-compute at the same
capacity and start, and reports the all-resident bound, so speed ratios come with every result.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from runtime import costmodel
from runtime.errors import InputError, cli_main
from runtime.kernel import N_EV, PolicyCache, next_use, warm_residency, warmup
from runtime.policy import PRESETS, PolicyConfig, preset, resolve_capacities
from runtime.trace import Trace, load_trace

log = logging.getLogger(__name__)

COUNTER_KEYS = ("calls", "hits", "fetches", "substitutions", "drops", "host_computes", "admissions")


@dataclass
class Replay:
    cache: PolicyCache
    events: np.ndarray  # int32 [T, L, 5]
    seconds: float  # the kernel loop alone


def replay(trace: Trace, policy: PolicyConfig, capacities: np.ndarray, initial_residency) -> Replay:
    """Run the kernel over every layer of a trace (layers are independent caches)."""
    T, L = trace.T, trace.L
    first_use, nxts = None, [None] * L
    if policy.evict == "belady":
        first_use = []
        for l_ in range(L):
            nxt, first = next_use(trace.topk_ids[:, l_], trace.valid[:, l_], trace.E, 0)
            nxts[l_] = nxt
            first_use.append(first)
    cache = PolicyCache(policy, trace.E, trace.k, capacities, initial_residency, belady_first_use=first_use)
    events = np.zeros((L, T, N_EV), np.int32)
    ids = [np.ascontiguousarray(trace.topk_ids[:, l_]) for l_ in range(L)]
    ws = [np.ascontiguousarray(trace.topk_weights[:, l_], dtype=np.float64) for l_ in range(L)]
    ranks = [np.ascontiguousarray(trace.ranking[:, l_]) for l_ in range(L)]
    valids = [np.ascontiguousarray(trace.valid[:, l_]) for l_ in range(L)]
    warmup()
    t_start = time.perf_counter()
    for l_ in range(L):
        cache.step(l_, ids[l_], ws[l_], ranks[l_], valids[l_], t0=0, nxt=nxts[l_], events=events[l_], logs=False)
    seconds = time.perf_counter() - t_start
    return Replay(cache, np.ascontiguousarray(events.transpose(1, 0, 2)), seconds)


def initial_residency_for(spec: str | None, trace: Trace, capacities: np.ndarray, flag: str = "--initial-residency"):
    """'warm:TRACE' | 'warm:self' | 'cold' | FILE.npy (int [L, C]) -> per-layer resident ids."""
    spec = spec or "warm:self"
    if spec == "cold":
        return None
    if spec == "warm:self":
        return warm_residency(trace.topk_ids, trace.valid, trace.E, capacities)
    if spec.startswith("warm:"):
        calib = load_trace(spec[5:], num_experts=trace.E if spec.endswith(".npz") else None)
        known = {calib.meta.model, trace.meta.model}.isdisjoint({"", "unknown"})
        if known and calib.meta.model.split(":")[0] != trace.meta.model.split(":")[0]:
            raise InputError(f"{flag}: calibration trace {spec[5:]} is from model {calib.meta.model!r}; "
                             f"the trace is from {trace.meta.model!r}")
        if (calib.E, calib.k, calib.L) != (trace.E, trace.k, trace.L):
            raise InputError(f"{flag}: calibration trace {spec[5:]} has E={calib.E}, k={calib.k}, L={calib.L}; "
                             f"the trace has E={trace.E}, k={trace.k}, L={trace.L}")
        return warm_residency(calib.topk_ids, calib.valid, trace.E, capacities)
    path = Path(spec)
    if path.suffix != ".npy":
        raise InputError(f"{flag} = {spec!r}: expected warm:TRACE, warm:self, cold or a .npy file")
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"{flag}: cannot read {spec}: {str(exc).splitlines()[0]}") from None
    if arr.ndim != 2 or arr.shape[0] != trace.L or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{flag}: {spec} has shape {arr.shape} dtype {arr.dtype}; expected int [L={trace.L}, C]")
    if arr.shape[1] > capacities.max() or np.any((arr < 0) | (arr >= trace.E)):
        raise InputError(f"{flag}: {spec} has shape {arr.shape} with ids in [{arr.min()}, {arr.max()}]; "
                         f"expected ids in [0, {trace.E}) and at most C={int(capacities.max())} columns")
    for l_ in range(trace.L):
        if arr.shape[1] > capacities[l_] or len(np.unique(arr[l_])) != arr.shape[1]:
            raise InputError(f"{flag}: {spec} row {l_} = {arr[l_].tolist()[:12]} repeats an id or exceeds C={capacities[l_]}")
    return [arr[l_] for l_ in range(trace.L)]


def _summary(rep: Replay, trace: Trace, params) -> dict:
    tot = rep.cache.counter_totals()
    T = trace.T
    tl = int(trace.valid.sum())
    timing = costmodel.replay_time(rep.events, trace.valid, params)
    out = {key: tot[key] for key in COUNTER_KEYS}
    out["admissions_skipped"] = tot["admissions_skipped"]
    out["substituted_mass"] = tot["substituted_mass"]
    out["mass_per_token_layer"] = tot["substituted_mass"] / max(tl, 1)
    out["mass_per_token"] = tot["substituted_mass"] / max(T, 1)
    out["substituted_call_fraction"] = (tot["substitutions"] + tot["drops"]) / max(tot["calls"], 1)
    out["time_per_token_s"] = timing.per_token_s
    out["stall_fetch_s"] = timing.stall_fetch_s / max(T, 1)
    out["stall_admission_s"] = timing.stall_admission_s / max(T, 1)
    return out


def simulate(
    trace: Trace,
    policy: PolicyConfig,
    capacity=None,
    *,
    capacity_fraction: float | None = None,
    initial_residency: str | list | None = None,
    host: str | costmodel.HostProfile = "rtx4090",
    model_shape: str | costmodel.ModelShape | None = None,
    baselines: bool = True,
) -> dict:
    """Replay `trace` under `policy`; returns the spec's counters, times and speed ratios."""
    policy.validate()
    caps = resolve_capacities(capacity, trace.L, trace.E, trace.k, capacity_fraction)
    init = initial_residency if not isinstance(initial_residency, str | None) else initial_residency_for(initial_residency, trace, caps)
    profile = host if isinstance(host, costmodel.HostProfile) else costmodel.load_host_profile(host)
    shape = model_shape if isinstance(model_shape, costmodel.ModelShape) else shape_for_trace(trace, model_shape)
    params = costmodel.cost_params(profile, shape)
    rep = replay(trace, policy, caps, init)
    out = {"policy": policy.label(), "policy_config": policy.to_dict(), "host": profile.name,
           "model_shape": shape.name, "weight_format": shape.weight_format,
           "tokens": trace.T, "layers": trace.L, "num_experts": trace.E, "top_k": trace.k,
           "capacity": caps.tolist() if len(set(caps.tolist())) > 1 else int(caps[0])}
    out.update(_summary(rep, trace, params))
    out["replay_seconds"] = rep.seconds
    out["token_layers_per_second"] = int(trace.valid.sum()) / max(rep.seconds, 1e-12)
    valid_per_token = trace.valid.sum(axis=1)
    out["all_resident_time_per_token_s"] = costmodel.all_resident_time(valid_per_token, params, trace.k)
    if baselines:
        for name, base in (("fetch_all", PRESETS["fetch-every-miss"]), ("host_compute", PRESETS["host-compute"])):
            if base == policy:
                t_base = out["time_per_token_s"]
            else:
                t_base = _summary(replay(trace, base, caps, init), trace, params)["time_per_token_s"]
            out[f"{name}_time_per_token_s"] = t_base
            out[f"speed_ratio_vs_{name}"] = t_base / out["time_per_token_s"]
        out["speed_ratio_vs_all_resident"] = out["all_resident_time_per_token_s"] / out["time_per_token_s"]
    out["per_layer"] = rep.cache.per_layer()
    return out


def shape_for_trace(trace: Trace, name: str | None) -> costmodel.ModelShape:
    """The model shape named, else the one matching the trace's model, else Qwen3-Next geometry
    with the trace's L, E, k (documented in docs/simulator.md)."""
    if name:
        shape = costmodel.load_model_shape(name)
    else:
        shape = None
        model = trace.meta.model.lower()
        for cand in costmodel.list_model_shapes():
            if cand.replace("-", "").replace(".", "") in model.replace("-", "").replace(".", "").replace("/", ""):
                shape = costmodel.load_model_shape(cand)
        if shape is None:
            shape = costmodel.load_model_shape("qwen3-next-80b-a3b")
    if (shape.num_experts, shape.top_k) != (trace.E, trace.k) or shape.num_layers != trace.L:
        shape = replace(shape, name=f"{shape.name}[L={trace.L},E={trace.E},k={trace.k}]",
                        num_layers=trace.L, num_experts=trace.E, top_k=trace.k)
    return shape


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.simulate", description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="router trace: .parquet, .arrow or .npz")
    p.add_argument("--num-experts", type=int, default=None, help="E for .npz files without num_experts")
    p.add_argument("--policy", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--rule", help="fetch_all | threshold | first_choice | substitute_all | cpu")
    p.add_argument("--tau", type=float)
    p.add_argument("--beta", type=float)
    p.add_argument("--evict", help="lfu | lru | crf | belady")
    p.add_argument("--gamma", type=float)
    p.add_argument("--half-life", type=float)
    p.add_argument("--delay", type=int, help="admission delay d >= 1")
    cap = p.add_mutually_exclusive_group(required=True)
    cap.add_argument("--capacity", type=str, help="slots per layer: C, or C0,C1,... per layer")
    cap.add_argument("--capacity-fraction", type=float)
    p.add_argument("--initial-residency", default=None, help="warm:CALIB_TRACE | warm:self (default) | cold | FILE.npy")
    p.add_argument("--host", default="rtx4090", help="host profile preset or YAML file")
    p.add_argument("--model-shape", default=None, help="model shape preset or YAML (default: from the trace)")
    p.add_argument("--weight-format", default=None, help="bf16 | q8_0 | q4_k_m")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--out", help="also write the JSON to this file")
    return p


def policy_from_args(a: argparse.Namespace) -> PolicyConfig:
    if a.policy and a.rule:
        raise InputError(f"--policy {a.policy!r} and --rule {a.rule!r}: give one of them")
    if not a.policy and not a.rule:
        raise InputError("--policy or --rule is required")
    base = preset(a.policy) if a.policy else PolicyConfig(rule=a.rule)
    kw = {"tau": a.tau, "beta": a.beta, "evict": a.evict, "gamma": a.gamma, "half_life": a.half_life,
          "admission_delay": a.delay}
    pol = replace(base, **{k: v for k, v in kw.items() if v is not None})
    for flag, v in (("--tau", a.tau), ("--beta", a.beta), ("--gamma", a.gamma), ("--half-life", a.half_life)):
        if v is not None and not math.isfinite(v):
            raise InputError(f"{flag} = {v!r} must be finite")
    try:
        return pol.validate(where="flags")
    except InputError as exc:
        raise InputError(str(exc).replace("flags: ", "--", 1).replace("admission_delay", "delay")
                         .replace("half_life", "half-life")) from None


def parse_capacity(text: str | None):
    if text is None:
        return None
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"--capacity = {text!r} must be an integer or a comma-separated list of integers") from None
    return vals[0] if len(vals) == 1 else vals


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    pol = policy_from_args(a)
    trace = load_trace(a.trace, num_experts=a.num_experts)
    shape = shape_for_trace(trace, a.model_shape)
    if a.weight_format:
        shape = costmodel.with_format(shape, a.weight_format)
    res = simulate(trace, pol, parse_capacity(a.capacity), capacity_fraction=a.capacity_fraction,
                   initial_residency=a.initial_residency, host=a.host, model_shape=shape)
    res["trace"] = str(a.trace)
    text = json.dumps(res, indent=2)
    if a.out:
        from runtime.errors import atomic_write

        atomic_write(a.out, lambda tmp: Path(tmp).write_text(text))
    if a.json:
        print(text)
    else:
        print(f"{res['policy']}: {res['time_per_token_s'] * 1e3:.3f} ms/token, "
              f"{res['speed_ratio_vs_fetch_all']:.2f}x vs fetch-every-miss, "
              f"substituted mass {res['mass_per_token']:.4f}/token")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cli_main(main)
