"""Simulator-versus-engine agreement: calibrate this host, then compare measured and simulated time per token.

    .venv/bin/python scripts/bench_engine.py [--device cpu|cuda] [--clock wall|thread] [--out FILE.json]

1. Builds (once, under --workdir) a random Qwen3-MoE checkpoint big enough that expert copies and
   computes matter (default 4 layers, 16 experts of 3 x 256 x 4096, top-4, fp32: a small hidden size
   keeps the dense part, mostly Python overhead on a CPU, from hiding the experts; the tokenizer and
   config come from runtime/tools/tinyhf.py), with a calibration text and an evaluation text.
2. Calibrates the host with the engine (runtime/tools/calibrate.py) and writes host.yaml.
3. Per policy a recorded engine run (the router trace the engine saw, ranking depth E); then
   --rounds rounds of [calibrate; one timed run of every policy] (same teacher-forced decode, same
   capacity, same warm start; the decisions are deterministic, so every run sees the same trace).
   Each round's measurement is compared with the simulator (runtime.backends.simulate.simulate) on the trace
   with that round's calibration and the model's shape; a shared host's load drifts, so
   calibration and measurement are paired in time. The reported error is the median round's.
   Reports measured and simulated time per token, their difference, and the measured speedups of
   quality-first and speed-first over fetch-every-miss and over host-compute at the same capacity.
The target is |simulated - measured| / measured <= 15% for fetch-every-miss, rule-0.15, quality-first.
`--out` is rewritten after EVERY round (with `rounds_done` and `complete`), so a run stopped by a
timeout keeps what it measured. On CUDA the VRAM budget (`--budget-for-fraction`, `--vram-budget`)
is sized with the CUDA context the engine measured after start and cuBLAS loaded (`size_run`:
Engine.budget_context_bytes), not the cost model's CUDA_CONTEXT_BYTES; admission stalls are the
device time measured between CUDA events.
`--clock thread` (CPU device mode) times calibration and decoding with the main thread's CPU time
(time.thread_time) instead of the wall clock, which leaves out the turns other processes take on a
shared host (it also leaves out time blocked on the link thread: admission stalls).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from runtime.backends import hfmodel
from runtime.backends.engine import Engine, cpu_threads, load_engine
from runtime.backends.simulate import simulate
from runtime.core.errors import atomic_write
from runtime.core.kernel import PolicyCache, warm_residency
from runtime.core.policy import PRESETS, PolicyConfig, resolve_capacities
from runtime.formats import costmodel
from runtime.tools.calibrate import calibrate

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench_engine")

AGREEMENT_POLICIES = ("fetch-every-miss", "rule-0.15", "quality-first")
EXTRA_POLICIES = ("speed-first", "host-compute")
# the prefetch and fallback families (--families): a prefetching and two fallback policies beside the paper's presets
FAMILY_POLICIES = {
    "fetch-all+lookahead": PolicyConfig(rule="fetch_all", prefetch="lookahead"),
    "rule-0.15+host": PolicyConfig(rule="threshold", tau=0.15, fallback="host"),
    "rule-0.15+lowbit4": PolicyConfig(rule="threshold", tau=0.15, fallback="lowbit", lowbit_bits=4, lowbit_group=64),
}
POLICIES: dict[str, PolicyConfig] = {}  # name -> config of this run (PRESETS plus the families)
TARGET = 0.15
COUNTERS = ("calls", "hits", "fetches", "substitutions", "drops", "host_computes", "admissions", "lowbit_computes",
            "prefetches")


def build_model(d: Path, hidden: int, inter: int, experts: int, top_k: int, layers: int) -> Path:
    """A random Qwen3-MoE checkpoint (bf16) with runtime/tools/tinyhf.py's tokenizer and config family."""
    tag = d / "bench.json"
    spec = {"hidden": hidden, "inter": inter, "experts": experts, "top_k": top_k, "layers": layers}
    if tag.is_file() and json.loads(tag.read_text()) == spec:
        return d
    from transformers import AutoModelForCausalLM

    from runtime.tools.tinyhf import build_tiny, tiny_config

    build_tiny("qwen3_moe", d, num_experts=experts, top_k=top_k)  # tokenizer + a tiny model, replaced below
    cfg = tiny_config("qwen3_moe", experts, top_k)
    cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_hidden_layers = hidden, inter, layers
    cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads = 64, hidden // 64, max(1, hidden // 256)
    cfg.max_position_embeddings = 512
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.shape[0] == experts:
                p.normal_(0, 2.0 / hidden**0.5)  # router logits with std ~2: varied gate weights
    model.to(torch.bfloat16).save_pretrained(d)
    src = sorted((ROOT / "runtime").rglob("*.py"))  # every runtime module, subpackages included
    (d / "calib.txt").write_text("\n".join(p.read_text() for p in src[: len(src) // 2]))
    (d / "eval.txt").write_text("\n".join(p.read_text() for p in src[len(src) // 2 :]))
    tag.write_text(json.dumps(spec))
    return d


def record_policy(eng: Engine, name: str, windows: np.ndarray, caps: np.ndarray, init, sha: str) -> dict:
    """One engine run with the recorder on: the trace the engine saw, its counters and kernel events."""
    m = eng.m
    cache = PolicyCache(POLICIES[name], m.E, m.k, caps, init)
    P = cache.prefetch_width if POLICIES[name].prefetch == "lookahead" else 0
    rec = m.ctx.start_recording(m.E, lookahead=P)
    try:
        eng.teacher_forced(m, windows, cache)
    finally:
        m.ctx.recorder = None
    ids, w, rank = rec.arrays()
    return {"trace": hfmodel.make_trace(m, ids, w, rank, windows, sha, f"bench_engine policy={name}",
                                        lookahead=rec.lookahead_array()),
            "counters": {key: int(cache.counter_totals()[key]) for key in COUNTERS}, "events": eng.trace_events(),
            "times": [], "reports": []}


def timed_run(eng: Engine, name: str, windows: np.ndarray, caps: np.ndarray, init, row: dict) -> float:
    m = eng.m
    cache = PolicyCache(POLICIES[name], m.E, m.k, caps, init)
    _, rep = eng.teacher_forced(m, windows, cache)
    if any(int(cache.counter_totals()[key]) != row["counters"][key] for key in COUNTERS):
        raise RuntimeError(f"{name}: a timed run made different decisions than the recorded one")
    row["reports"].append(rep)
    return rep["time_per_token_s"]


def params_for(name: str, profile, shape, pinned: bool) -> costmodel.CostParams:
    pol = POLICIES[name]
    return costmodel.cost_params(profile, shape, pinned=pinned, lowbit_bits=pol.lowbit_bits,
                                 lowbit_group=pol.lowbit_group)


def simulated(name: str, row: dict, caps, init, profile, shape, pinned: bool) -> float:
    """The simulator on the engine's recorded trace (its counters must equal the engine's). A pageable
    store: the simulator's kernel events (the same decisions) replayed with cost_params(pinned=False),
    whose copies block the host (runtime.backends.simulate models a pinned store)."""
    sim = simulate(row["trace"], POLICIES[name], caps, initial_residency=init, host=profile, model_shape=shape,
                   baselines=False)
    for key in COUNTERS:
        if sim.counters[key] != row["counters"][key]:
            raise RuntimeError(f"{name}: simulator {key} = {sim.counters[key]} != engine {row['counters'][key]}")
    if pinned:
        return sim.time_per_token_s
    ev = row["events"]
    return costmodel.replay_time(ev, np.ones(ev.shape[:2], bool), params_for(name, profile, shape, False)).per_token_s


def summarize(name: str, row: dict, rounds: list[dict], caps, init, shape, pinned: bool = True) -> dict:
    """Per round: measured vs simulated with that round's calibration; the verdict is the median error."""
    meas = [r["measured"][name] for r in rounds]
    sims = [simulated(name, row, caps, init, r["profile"], shape, pinned) for r in rounds]
    errs = [(s_ - m_) / m_ for s_, m_ in zip(sims, meas, strict=True)]
    i = int(np.argsort(errs)[len(errs) // 2])  # the median round
    ev = row["events"]
    timing = costmodel.replay_time(ev, np.ones(ev.shape[:2], bool), params_for(name, rounds[i]["profile"], shape, pinned))
    rep = row["reports"][-1]
    return {"policy": name, "measured_time_per_token_s": meas[i], "simulated_time_per_token_s": sims[i],
            "rel_error": errs[i], "rounds_measured_s": meas, "rounds_simulated_s": sims, "rounds_rel_error": errs,
            "simulated_breakdown_per_token_s": {k_: v / timing.num_tokens for k_, v in timing.as_dict().items()
                                                if k_.endswith("_s") and k_ != "per_token_s"},
            "counters": row["counters"], "admission_stalls": rep["engine"]["admission_stalls"],
            "admission_stall_s_per_token": rep["engine"]["admission_stall_s"] / ev.shape[0],
            "peak_device_bytes": rep["peak_device_bytes"],
            "decode_path": rep["engine"].get("decode_path", "")}  # cuda_graphs | segments[: why] | hf_forward: why


def size_run(eng: Engine, policies: list[PolicyConfig], capacity_fraction: float | None, vram_budget: float | None,
             budget_for_fraction: float | None) -> tuple[np.ndarray, dict]:
    """Slots per layer of the bench and the result keys saying how they were sized: a capacity fraction, a
    VRAM budget, or the budget that holds `budget_for_fraction` of E slots per layer under every policy.
    Budgets are the engine's (Engine.budget_for_capacities / capacities_for_budget): on CUDA with the
    context it measured after cuBLAS loaded, not the cost model's CUDA_CONTEXT_BYTES."""
    m = eng.m
    if budget_for_fraction is not None:
        c = resolve_capacities(None, m.num_layers, m.E, m.k, budget_for_fraction)
        vram_budget = eng.budget_for_capacities(c, policies) * (1 + 1e-9)
    if vram_budget is None:
        caps = resolve_capacities(None, m.num_layers, m.E, m.k, capacity_fraction or 0.25)
        return caps, {"capacity": caps.tolist()}
    caps = eng.capacities_for_budget(vram_budget, policies)
    return caps, {"capacity": caps.tolist(), "vram_budget_GiB": vram_budget,
                  "budget_context_bytes": eng.budget_context_bytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--workdir", default="/tmp/expertsweep-bench")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-intermediate", type=int, default=4096)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--capacity-fraction", type=float, default=None)
    cap.add_argument("--vram-budget", type=float, default=None)
    cap.add_argument("--budget-for-fraction", type=float, default=None,
                     help="use the VRAM budget (runtime.formats.costmodel) that holds this fraction of E slots per layer")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7, help="calibrate + one timed run per policy, repeated")
    p.add_argument("--repeats", type=int, default=5, help="calibration repeats")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pageable", action="store_true", help="CUDA: host store in pageable memory")
    p.add_argument("--clock", default="wall", choices=["wall", "thread"],
                   help="thread: the main thread's CPU time (CPU device mode; leaves out other processes' turns)")
    p.add_argument("--families", action="store_true",
                   help="also lookahead prefetch, host and 4-bit low-bit fallbacks, reported beside")
    p.add_argument("--out", default=None, help="write the JSON results here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    d = build_model(work / "model", a.hidden, a.moe_intermediate, a.experts, a.top_k, a.layers)
    eng = load_engine(d, a.device, a.dtype, pinned=not a.pageable)
    m = eng.m
    if a.clock == "thread":
        if eng.cuda:
            raise SystemExit("--clock thread is for CPU device mode only")
        eng.clock = time.thread_time
    results: dict = {"device": str(eng.device), "dtype": a.dtype, "model": {"hidden": a.hidden, "moe_intermediate":
                     a.moe_intermediate, "experts": a.experts, "top_k": a.top_k, "layers": a.layers,
                     "expert_bytes": eng.expert_bytes}, "torch_threads": a.threads, "pinned": eng.store.pinned,
                     "clock": a.clock, "cuda_context_bytes": eng.context_bytes,
                     "copies_block_host": eng.copies_block_host}
    names = AGREEMENT_POLICIES + EXTRA_POLICIES
    POLICIES.update({n: PRESETS[n] for n in names})
    if a.families:
        fams = dict(FAMILY_POLICIES)
        if importlib.util.find_spec("hqq") is None:
            log.warning("no hqq: the low-bit family is left out")
            fams = {n: p for n, p in fams.items() if p.fallback != "lowbit"}
        POLICIES.update(fams)
        names = names + tuple(fams)
    try:
        with cpu_threads(eng.device, a.threads):
            shape = costmodel.model_shape_from_hf_config(m.model.config.to_dict(), name="bench")
            caps, sizing = size_run(eng, [POLICIES[n] for n in names], a.capacity_fraction, a.vram_budget,
                                    a.budget_for_fraction)
            results.update(sizing)
            windows, sha = hfmodel.tokenize_file(m, d / "eval.txt", a.window * a.windows, a.window)
            cids, _ = hfmodel.calibration_ids(m, None, 4096, a.window)
            init = warm_residency(cids, None, m.E, caps)
            recorded = {n: record_policy(eng, n, windows, caps, init, sha) for n in names}
            rounds = []
            pinned = not (eng.cuda and not eng.store.pinned)
            for r_ in range(a.rounds):  # calibration and every policy close together in time: load drifts
                prof, det = calibrate(eng, a.repeats)
                rounds.append({"profile": prof, "calibration": det,
                               "measured": {n: timed_run(eng, n, windows, caps, init, recorded[n]) for n in names}})
                if a.out and r_ + 1 < a.rounds:  # a timeout later keeps the rounds measured so far
                    results["cuda_context_bytes"] = eng.context_bytes
                    write_results(a.out, finish(results, rounds, recorded, names, caps, init, shape, pinned, a.rounds),
                                  quiet=True)
    finally:
        eng.close()
    results["cuda_context_bytes"] = eng.context_bytes  # the largest measured during the runs (CUDA)
    costmodel.save_host_profile(rounds[-1]["profile"], work / "host.yaml")
    results = finish(results, rounds, recorded, names, caps, init, shape, pinned, a.rounds)
    write_results(a.out, results)
    return 0


def finish(results: dict, rounds: list[dict], recorded: dict, names, caps, init, shape, pinned: bool,
           planned: int) -> dict:
    """The results over the rounds measured so far (`complete` once all `planned` rounds are in)."""
    results = dict(results, rounds_done=len(rounds), rounds_planned=planned, complete=len(rounds) == planned)
    results["calibration_rounds"] = [r["calibration"] for r in rounds]
    rows = {n: summarize(n, recorded[n], rounds, caps, init, shape, pinned) for n in names}
    results["policies"] = rows
    pairs = [(a_, b_) for a_ in ("quality-first", "speed-first") for b_ in ("fetch-every-miss", "host-compute")]
    for what, key in (("measured", "rounds_measured_s"), ("simulated", "rounds_simulated_s")):
        results[f"speedups_{what}"] = {f"{a_} vs {b_}": float(np.median(np.divide(rows[b_][key], rows[a_][key])))
                                       for a_, b_ in pairs}  # median over rounds of the same-round ratio
    results["target_met"] = all(abs(rows[n]["rel_error"]) <= TARGET for n in AGREEMENT_POLICIES)
    return results


def write_results(out: str | None, results: dict, quiet: bool = False) -> None:
    if not quiet:
        rows = results["policies"]
        for n, r in rows.items():
            print(f"{n:17s} [{r['decode_path']}] measured {r['measured_time_per_token_s'] * 1e3:7.3f} ms/token  simulated "
                  f"{r['simulated_time_per_token_s'] * 1e3:7.3f}  error {r['rel_error'] * 100:+6.1f}% (rounds "
                  f"{', '.join(f'{e * 100:+.0f}%' for e in r['rounds_rel_error'])})  fetches "
                  f"{r['counters']['fetches']}  admissions {r['counters']['admissions']} (stalls {r['admission_stalls']})")
        for k_, v in results["speedups_measured"].items():
            print(f"speedup {k_}: measured {v:.2f}x, simulated {results['speedups_simulated'][k_]:.2f}x")
        for i, r in enumerate(results["calibration_rounds"]):
            print(f"calibration round {i}: " + ", ".join(f"{k_} {v:.1f}" for k_, v in r.items() if k_.endswith("_us")))
        print(f"target |error| <= {TARGET:.0%} for {', '.join(AGREEMENT_POLICIES)}: "
              f"{'met' if results['target_met'] else 'NOT met'}")
    if out:
        atomic_write(out, lambda tmp: Path(tmp).write_text(json.dumps(results, indent=2) + "\n"))


if __name__ == "__main__":
    sys.exit(main())
