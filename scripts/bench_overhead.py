"""The engine's per-layer overhead against the plain Hugging Face decode: aten ops and host time per token.

    python scripts/bench_overhead.py [--k 2,8] [--experts 16] [--layers 4] [--hidden 64] [--threads 1]
                                     [--clock thread|wall] [--device cpu] [--workdir DIR] [--out FILE.json]
                                     [--model DIR] [--profile]

Per top-k (`--k`), a random Qwen3-MoE checkpoint (runtime/tools/tinyhf.py's config and tokenizer, hidden
`--hidden`, `--experts` experts, `--layers` decoder layers, every one MoE, fp32) is decoded token by token
with a KV cache, batch 1, from a fresh cache each run:
- `plain`: the checkpoint through transformers itself (AutoModelForCausalLM, its default experts
  implementation), no wrapper;
- `engine`: runtime.backends.engine with fetch-every-miss and E - 1 of E experts resident (the first
  E - 1 ids in every layer), the experts offloaded, through the Hugging Face forward with the engine's
  executor (the path of generation and of families without a capture plan);
- `segments`: the same engine and cache through its teacher-forced decode step (runtime/backends/engine/
  graphs.py's StepProgram, eager: CPU device mode, or CUDA with no_cuda_graphs), the program built once
  for `--long` positions before anything is counted.
Counted: the aten ops dispatched (a TorchDispatchMode counting every call) and the host time (best of
`--repeats`; `--clock thread`, the default, is the main thread's CPU time, time.thread_time: with one
intra-op thread all of both decodes runs on it, and it leaves out the turns other processes take on a
shared host; `--clock wall`: perf_counter), each as the difference between a `--long`-token and a `--short`-token run divided by
the token difference (so loading, the first token and set-up cancel), then per decoder layer (divided by
`--layers`; embedding and LM head are shared out). Targets: engine ops per token per layer at most
1.2x the plain decode's, and the same at every k (no per-expert work); time per token at most the plain
decode's. Prints one line per (k, mode) and writes the JSON to `--out`.
The time is a host measurement beside whatever else runs on the machine: compare ratios from one run.

`--model DIR`: an existing checkpoint (e.g. the demo model, runtime.tools.tinymodel) instead of the random one
(`--k`, `--experts`, `--layers`, `--hidden` are then its own). `--profile`: also one `--long`-token segments
decode with each part timed per MoE layer and token (the segments' torch work, the host decision between
segments: read + decide + apply, the step's own copies), the plain decode per layer beside it, and cProfile's
top functions by own time of a segments decode; and the decision alone per MoE layer-call (`decide_us`: the
routing read, the kernel's step, the plan row and the fetch copies, perf_counter around each `_decide`).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench_overhead")


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def build(d: Path, k: int, experts: int, layers: int, hidden: int, positions: int) -> Path:
    """A random fp32 Qwen3-MoE checkpoint with tinyhf's tokenizer (built once per shape under `d`)."""
    spec = {"k": k, "experts": experts, "layers": layers, "hidden": hidden, "positions": positions}
    tag = d / "bench.json"
    if tag.is_file() and json.loads(tag.read_text()) == spec:
        return d
    from transformers import AutoModelForCausalLM

    from runtime.tools.tinyhf import build_tiny, tiny_config

    build_tiny("qwen3_moe", d, num_experts=experts, top_k=k)  # the tokenizer; the model is replaced below
    cfg = tiny_config("qwen3_moe", experts, k)
    cfg.hidden_size, cfg.num_hidden_layers, cfg.max_position_embeddings = hidden, layers, positions
    cfg.moe_intermediate_size, cfg.intermediate_size = hidden // 2, hidden * 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.shape[0] == experts:
                p.normal_(0, 1.0)  # varied routing: misses happen
    model.save_pretrained(d)
    tag.write_text(json.dumps(spec))
    return d


def decode(model, tokens: torch.Tensor, forward_cached) -> None:
    """Greedy-free decode: feed `tokens` [n] one by one with a KV cache (batch 1)."""
    past = None
    with torch.inference_mode():
        for t in range(len(tokens)):
            _, past = forward_cached(model, tokens[None, t : t + 1], past)


def measure(run, short: int, long: int, repeats: int, clock=time.thread_time) -> dict:
    """ops and seconds per token: (long run - short run) / (long - short); `run(n)` decodes n tokens afresh."""
    ops = {}
    for n in (short, long):
        with CountOps() as c:
            run(n)
        ops[n] = c.n
    secs = {}
    for n in (short, long):
        best = float("inf")
        for _ in range(repeats):
            t0 = clock()
            run(n)
            best = min(best, clock() - t0)
        secs[n] = best
    d = long - short
    return {"ops_per_token": (ops[long] - ops[short]) / d, "s_per_token": (secs[long] - secs[short]) / d,
            "ops": ops, "seconds": secs}


def profile(run_segments, run_plain, prog, n: int, L: int, clock=time.perf_counter) -> dict:
    """Where a segments decode step's time goes, per MoE layer and token: the segments' torch work, the host
    decision between them (`_decide`), the rest of the step (token, position and mask copies, Python), beside
    the plain decode; each the minimum over 3 runs of `n` tokens, wall clock (perf_counter: one clock for every
    part; time.thread_time costs ~0.5 ms a call on the loaded development VM). Then cProfile of one such run (top functions
    by own time) and the `_decide` calls' own durations (min and median, us)."""
    import cProfile
    import io
    import pstats

    acc = {"segments": 0.0, "decide": 0.0}
    calls: list[float] = []
    seg0, dec0 = prog._segment, prog._decide

    def seg(j):
        t = clock()
        seg0(j)
        acc["segments"] += clock() - t

    def dec(layer):
        t = clock()
        dec0(layer)
        dt = clock() - t
        calls.append(dt)
        acc["decide"] += dt

    prog._segment, prog._decide = seg, dec
    best: dict[str, float] = {}
    try:
        for _ in range(3):
            acc.update(segments=0.0, decide=0.0)
            t = clock()
            run_segments(n)
            tot = clock() - t
            parts = {"segments_torch": acc["segments"], "decide": acc["decide"],
                     "step_rest": tot - acc["segments"] - acc["decide"], "segments_total": tot}
            for key, v in parts.items():
                best[key] = min(best.get(key, float("inf")), v)
        timed = list(calls)  # (the profiled run's calls carry the profiler's cost)
    finally:
        prog._segment, prog._decide = seg0, dec0
    pr = cProfile.Profile()
    pr.enable()
    run_segments(n)
    pr.disable()
    t_plain = float("inf")
    for _ in range(3):
        t = clock()
        run_plain(n)
        t_plain = min(t_plain, clock() - t)
    best["plain_total"] = t_plain
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
    top = [ln.strip() for ln in buf.getvalue().splitlines() if ln.strip() and ln.strip()[0].isdigit()][:20]
    us = sorted(c * 1e6 for c in timed)
    return {"us_per_layer_token": {key: v * 1e6 / (n * L) for key, v in best.items()},
            "decide_us": {"min": us[0], "median": us[len(us) // 2], "calls": len(us)}, "cprofile_top": top}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--k", default="2,8", help="top-k values, comma-separated")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--short", type=int, default=64)
    p.add_argument("--long", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", default="thread", choices=["thread", "wall"],
                   help="thread: the main thread's CPU time (default); wall: perf_counter")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--workdir", default="/tmp/expertsweep-bench-overhead")
    p.add_argument("--out", default=None)
    p.add_argument("--model", default=None, help="an existing checkpoint instead of the random one")
    p.add_argument("--profile", action="store_true", help="also time the segments' parts and cProfile them")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from runtime.backends.engine import forward_cached, graphs, load_engine
    from runtime.core.kernel import PolicyCache
    from runtime.core.policy import PRESETS

    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(1, 90, size=a.long).astype(np.int64)).to(a.device)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {"command": " ".join(["scripts/bench_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
           "commit": commit, "runtime": str(Path(__import__("runtime").__file__).parent), "torch": torch.__version__,
           "threads": a.threads, "device": a.device, "clock": a.clock, "rows": []}
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    ks = [int(x) for x in a.k.split(",")]
    if a.model:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(a.model)
        ks, a.layers = [int(cfg.num_experts_per_tok)], int(cfg.num_hidden_layers)
    for k in ks:
        d = Path(a.model) if a.model else build(Path(a.workdir) / f"k{k}", k, a.experts, a.layers, a.hidden, a.long + 8)
        plain = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(a.device).eval()
        def run_plain(n: int, model=plain) -> None:
            decode(model, tokens[:n], forward_cached)

        eng = load_engine(d, device=a.device, dtype="fp32")
        E, L = eng.E, eng.L
        caps = np.full(L, E - 1)

        def run_engine(n: int, eng=eng, caps=caps, E=E, L=L, k=k) -> None:
            cache = PolicyCache(PRESETS["fetch-every-miss"], E, k, caps, [np.arange(E - 1)] * L)
            eng.bind(cache)
            eng.m.ctx.cache = cache
            try:
                decode(eng.m.model, tokens[:n], forward_cached)
            finally:
                eng.m.ctx.cache = None

        # the engine's teacher-forced path (what its runs time): the segmented step program of graphs.py, built
        # once for `--long` positions (its set-up, once per run of many windows, is not a per-token cost);
        # each run binds a fresh cache to the same slots and steps through the tokens
        first = PolicyCache(PRESETS["fetch-every-miss"], E, k, caps, [np.arange(E - 1)] * L)
        eng.bind(first)
        eng.m.ctx.cache = first
        with torch.inference_mode():
            prog = graphs.StepProgram(eng.m.model, eng.m.ctx, eng.runner, a.long, capture=False)
        eng.m.ctx.cache = eng.m.ctx.step = None

        def run_segments(n: int, eng=eng, caps=caps, E=E, L=L, k=k, prog=prog) -> None:
            cache = PolicyCache(PRESETS["fetch-every-miss"], E, k, caps, [np.arange(E - 1)] * L)
            eng.bind(cache)
            eng.m.ctx.cache, eng.m.ctx.step = cache, prog
            try:
                with torch.inference_mode():
                    prog.begin()
                    for t in range(n):
                        prog.step(tokens[None, t : t + 1], t)
            finally:
                eng.m.ctx.cache = eng.m.ctx.step = None

        run_plain(4)
        run_engine(4)  # compiled / warmed before anything is counted
        run_segments(4)
        res = {"plain": measure(run_plain, a.short, a.long, a.repeats, clock),
               "engine": measure(run_engine, a.short, a.long, a.repeats, clock),
               "segments": measure(run_segments, a.short, a.long, a.repeats, clock)}
        fetches = int(eng.stats["fetch_copies"])
        prof = profile(run_segments, run_plain, prog, a.long, L) if a.profile else None
        eng.close()
        for mode, r in res.items():
            row = {"k": k, "mode": mode, "ops_per_token_per_layer": r["ops_per_token"] / a.layers,
                   "us_per_token": r["s_per_token"] * 1e6, "us_per_token_per_layer": r["s_per_token"] * 1e6 / a.layers,
                   "raw": r}
            if mode == "segments":
                row["fetches_last_run"] = fetches
                if prof:
                    row["profile"] = prof
            out["rows"].append(row)
            print(f"k={k} {mode:8s} ops/token/layer {row['ops_per_token_per_layer']:7.1f}  "
                  f"host {row['us_per_token']:8.0f} us/token", flush=True)
        if prof:
            print(f"k={k} profile per MoE layer and token (us): " + ", ".join(
                f"{n} {v:.1f}" for n, v in prof["us_per_layer_token"].items()), flush=True)
            print(f"k={k} decide (read + one call + apply) per MoE layer-call: {prof['decide_us']['min']:.1f} us min, "
                  f"{prof['decide_us']['median']:.1f} us median", flush=True)
            for line in prof["cprofile_top"][:12]:
                print("   ", line, flush=True)
        pl = res["plain"]
        for mode in ("engine", "segments"):
            en = res[mode]
            print(f"k={k} {mode}/plain: ops {en['ops_per_token'] / pl['ops_per_token']:.2f}x, "
                  f"time {en['s_per_token'] / pl['s_per_token']:.2f}x", flush=True)
    if a.out:
        from runtime.core.errors import atomic_write

        atomic_write(a.out, lambda tmp: Path(tmp).write_text(json.dumps(out, indent=1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
