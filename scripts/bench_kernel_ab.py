"""A/B of the policy kernel between two git revisions, each in its own process, by process CPU time.

    python scripts/bench_kernel_ab.py --before REV [--after REV] [--rounds 3] [--repeats 7] [--shape default|topics]
        [--policy NAME=FLAGS ...]

Both revisions are exported (`git archive`) to temporary trees; the trace of scripts/bench_simulator.py
(Qwen3-Next shape, 48 layers, E=512, k=10, C=128, M=64, 4,000 tokens, warm start from its calibration
twin) is generated once and saved. Each round runs one process per revision, alternating, pinned to one
core; each process imports only its own tree's `runtime` and times the replay loop as
`runtime.backends.simulate.replay` runs it (one `step_layers` call; a revision before it: one `step` per
layer without decisions; no logs), best of --repeats per policy by process CPU time, and checks the
counters against the other side's. Separate processes avoid the bias of importing a second kernel module
into one process (`bench_simulator.py --against HEAD` measured the same kernel 1.6-2.3x slower as the
second module at load 8: reports/kernel_ab_revisions.md). Prints per policy the best over rounds for each side and
the ratio after / before (> 1: the after revision is faster), and the load average per round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("fetch-every-miss", "rule-0.15", "quality-first", "speed-first")

CHILD = r"""
import inspect, json, os, sys, time
import numpy as np
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
try:  # the layout since the runtime subpackages; a revision before them has flat modules
    from runtime.core import kernel
    from runtime.core.policy import PRESETS, PolicyConfig
    from runtime.formats.trace import load_trace
except ImportError:
    from runtime import kernel
    from runtime.policy import PRESETS, PolicyConfig
    from runtime.trace import load_trace
trace, calib = load_trace(sys.argv[1]), load_trace(sys.argv[2])
repeats, policies = int(sys.argv[3]), json.loads(sys.argv[4])
caps = np.full(trace.L, 128)
init = kernel.warm_residency(calib.topk_ids, calib.valid, trace.E, caps)
kernel.warmup()
args = [(np.ascontiguousarray(trace.topk_ids[:, l]), np.ascontiguousarray(trace.topk_weights[:, l], dtype=np.float64),
         np.ascontiguousarray(trace.ranking[:, l]), np.ascontiguousarray(trace.valid[:, l])) for l in range(trace.L)]
stacked = [np.ascontiguousarray(np.stack(a)) for a in zip(*args)]  # [L, T, ...]: step_layers' inputs
kw = {"decisions": False} if "decisions" in inspect.signature(kernel.PolicyCache.step).parameters else {}
out = {}
for name, fields in policies.items():
    pol = PRESETS[name] if fields is None else PolicyConfig(**fields)
    best, counters = float("inf"), None
    for _ in range(repeats):
        cache = kernel.PolicyCache(pol, trace.E, trace.k, caps, init)
        ev = np.zeros((trace.L, trace.T, kernel.N_EV), np.int32)
        c0 = time.process_time()
        if hasattr(cache, "step_layers"):  # as runtime.backends.simulate.replay: one call for every layer
            cache.step_layers(*stacked, ev)
        else:
            for l in range(trace.L):
                cache.step(l, *args[l], t0=0, events=ev[l], logs=False, **kw)
        best = min(best, time.process_time() - c0)
        counters = {k: v for k, v in cache.counter_totals().items()}
    out[name] = {"cpu_s": best, "counters": counters}
print(json.dumps(out))
"""


def export(rev: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shape", default="default", choices=("default", "topics"))
    ap.add_argument("--policy", action="append", default=[],
                    help="NAME=JSON of PolicyConfig fields (both revisions must know them); default: the presets")
    a = ap.parse_args()
    # (llama.cpp's shared pool and layer split are not the per-layer kernel: runtime/core/llamacpp_cache.py)
    policies: dict = {n: None for n, p in PRESETS.items()
                      if getattr(p, "pool", "per_layer") == "per_layer" and getattr(p, "layer_split", "none") == "none"}
    for p in a.policy:
        name, _, fields = p.partition("=")
        policies[name] = json.loads(fields)
    tmp = Path(tempfile.mkdtemp())
    trees = {side: export(rev, tmp / side) for side, rev in (("before", a.before), ("after", a.after))}
    sys.path.insert(0, str(trees["after"]))
    from runtime.formats.trace import save_trace, synthetic_pair

    shape = {"default": {"calib_tokens": 2000}, "topics": {"calib_tokens": 4000, "seq_len": 1000, "switch_prob": 0.0}}
    trace, calib = synthetic_pair(4000, 48, 512, 10, 64, seed=1, model="Qwen/Qwen3-Next-80B-A3B (synthetic)",
                                  **shape[a.shape])
    save_trace(trace, tmp / "t.parquet")
    save_trace(calib, tmp / "c.parquet")
    best: dict = {side: {} for side in trees}
    counters: dict = {}
    loads = []
    for r in range(a.rounds):
        for side, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            env = {**os.environ, "PYTHONPATH": str(tree), "NUMBA_CACHE_DIR": str(tmp / f"nbc-{side}")}
            la = os.getloadavg()[0]
            res = json.loads(subprocess.run([sys.executable, "-c", CHILD, str(tmp / "t.parquet"), str(tmp / "c.parquet"),
                                             str(a.repeats), json.dumps(policies)], cwd=tree, env=env,
                                            capture_output=True, text=True, check=True).stdout)
            loads.append(f"{side} {la:.1f}")
            for name, v in res.items():
                best[side][name] = min(best[side].get(name, float("inf")), v["cpu_s"])
                counters.setdefault(name, {})[side] = v["counters"]
    tl = trace.T * trace.L
    print(f"shape {a.shape!r}; {a.rounds} rounds x {a.repeats} repeats, best process CPU time; before = {a.before}, "
          f"after = {a.after}; load average at each process start: {', '.join(loads)}")
    print("")
    print("| policy | before token-layers/s | after token-layers/s | after / before | counters equal |")
    print("|---|---|---|---|---|")
    for name in policies:
        b, f = best["before"][name], best["after"][name]
        same = counters[name]["before"] == counters[name]["after"]
        print(f"| {name} | {tl / b / 1e6:.2f} M | {tl / f / 1e6:.2f} M | {b / f:.3f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
