"""A/B of the policy kernel between two git revisions in alternating processes: replay speed, counters, and
each side's cold compile; the result goes to reports/<--name>.md / .json (runtime.tools.reports).

    python scripts/bench_kernel_ab.py --before REV [--after REV] [--rounds 5] [--repeats 7]
        [--shape default|topics] [--policy NAME=FLAGS ...] [--name kernel_ab] [--no-report]

Both revisions are exported (`git archive`) to temporary trees; the trace of scripts/bench_simulator.py
(Qwen3-Next shape, 48 layers, E=512, k=10, C=128, M=64, 4,000 tokens, warm start from its calibration
twin) is generated once and saved. Each round runs one process per revision, the order alternating between
rounds (before/after, after/before, ...), each pinned to one core and importing only its own tree's
`runtime`, with its own numba cache folder: the first round's process of each side compiles the kernel
from an empty cache (its warmup's process CPU and wall time are the cold-compile figures), the later ones
load it. Each process times the replay loop as `runtime.backends.simulate.replay` runs it (one
`step_layers` call; a revision before it: one `step` per layer without decisions; no logs), best of
--repeats per policy by process CPU time, and returns the counters, checked against the other side's.
Separate processes avoid the bias of importing a second kernel module into one process
(`bench_simulator.py --against HEAD` measured the same kernel 1.6-2.3x slower as the second module at
load 8: reports/kernel_ab_revisions.md); alternating them spreads the shared machine's load over both sides.

The gate: the presets (the simulator's policy replay) must keep after / before >= 1 - --tolerance (0.05)
on the best of the rounds; the other default policies (every eviction kind's path, the fallbacks, a
bounded copy pool with prefetch) are reported beside them. Prints the table and the verdict; exit 0 either
way (the report carries the verdict).
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
# beside the presets: each eviction kind's touch / on-load path, the fallbacks, the copy pool (PolicyConfig fields)
EXTRA = {
    "lru beta 0.5": {"rule": "threshold", "tau": 0.15, "evict": "lru", "beta": 0.5},
    "lfu gamma 0.9": {"rule": "threshold", "tau": 0.15, "gamma": 0.9, "beta": 0.5},
    "lfuda": {"rule": "threshold", "tau": 0.15, "evict": "lfuda", "beta": 0.5},
    "crf": {"rule": "threshold", "tau": 0.15, "evict": "crf"},
    "s3fifo": {"rule": "threshold", "tau": 0.15, "evict": "s3fifo"},
    "drop beta 0.5": {"rule": "threshold", "tau": 0.15, "fallback": "drop", "beta": 0.5},
    "host": {"rule": "first_choice", "fallback": "host"},
    "copy buffers 2": {"rule": "threshold", "tau": 0.15, "beta": 0.5, "copy_buffers": 2, "admission_delay": 2},
}

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
w0, c0 = time.perf_counter(), time.process_time()
kernel.warmup()
warmup = {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0}
try:  # the optimized code's shape per run_layer specialization, where this process compiled it (the cold round)
    import re
    from runtime.core.kernel import run_layer as rl_mod
    shape = {}
    for sig in rl_mod.run_layer.signatures:
        body = max(re.split(r"\ndefine ", rl_mod.run_layer.inspect_llvm(sig)), key=len)  # run_layer's own function
        build = "lean" if "True" in str(sig[-1]) else "full"
        shape[build] = {"llvm_lines": body.count("\n"), "refcount_increments": body.count("@NRT_incref("),
                        "refcount_decrements": body.count("@NRT_decref(")}
        # the instructions without names (values, labels, metadata, symbols), sorted: equal multisets = the same
        # code up to order and naming
        norm = re.sub(r'%"[^"]*"|%[\w.\-]+', "%v", body)
        norm = re.sub(r"![\w.]+", "!m", re.sub(r"@[\w.$]+", "@f", norm))
        lines_ = sorted(ln.strip() for ln in norm.splitlines() if ln.strip() and not ln.strip().endswith(":")
                        and not re.match(r"^[\w.\-]+:", ln.strip()))
        open(os.path.join(os.environ["NUMBA_CACHE_DIR"], f"llvm-{build}.txt"), "w").write("\n".join(lines_))
    warmup["llvm"] = shape or None
except Exception:  # loaded from the cache: no IR in this process
    warmup["llvm"] = None
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
    out[name] = {"cpu_s": best, "counters": counters, "events": int(ev.sum())}
print(json.dumps({"warmup": warmup, "policies": out}))
"""


def export(rev: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def rev_name(rev: str) -> str:
    """`rev (short hash)`."""
    short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    return f"{rev} ({short})" if short != rev else rev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shape", default="default", choices=("default", "topics"))
    ap.add_argument("--policy", action="append", default=[],
                    help="NAME=JSON of PolicyConfig fields (both revisions must know them); default: the presets "
                         "and the EXTRA policies")
    ap.add_argument("--tolerance", type=float, default=0.05, help="the presets' largest slowdown that passes")
    ap.add_argument("--name", default="kernel_ab", help="the report's name under reports/")
    ap.add_argument("--no-report", action="store_true", help="print only")
    a = ap.parse_args()
    policies: dict = {n: None for n in PRESETS}
    if a.policy:
        for p in a.policy:
            name, _, fields = p.partition("=")
            policies[name] = json.loads(fields)
    else:
        policies.update(EXTRA)
    tmp = Path(tempfile.mkdtemp())
    revs = {"before": rev_name(a.before), "after": rev_name(a.after)}
    trees = {side: export(rev, tmp / side) for side, rev in (("before", a.before), ("after", a.after))}
    sys.path.insert(0, str(ROOT))  # this checkout's trace generator and report writer (the sides: their own trees)
    from runtime.formats.trace import save_trace, synthetic_pair
    from runtime.tools.reports import write_report

    shape = {"default": {"calib_tokens": 2000}, "topics": {"calib_tokens": 4000, "seq_len": 1000, "switch_prob": 0.0}}
    trace, calib = synthetic_pair(4000, 48, 512, 10, 64, seed=1, model="Qwen/Qwen3-Next-80B-A3B (synthetic)",
                                  **shape[a.shape])
    save_trace(trace, tmp / "t.parquet")
    save_trace(calib, tmp / "c.parquet")
    best: dict = {side: {} for side in trees}
    per_round: dict = {side: {} for side in trees}  # policy -> cpu_s per round
    counters: dict = {}
    warmups: dict = {side: [] for side in trees}
    loads = []
    for r in range(a.rounds):
        for side, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            env = {**os.environ, "PYTHONPATH": str(tree), "NUMBA_CACHE_DIR": str(tmp / f"nbc-{side}")}
            la = os.getloadavg()[0]
            res = json.loads(subprocess.run([sys.executable, "-c", CHILD, str(tmp / "t.parquet"), str(tmp / "c.parquet"),
                                             str(a.repeats), json.dumps(policies)], cwd=tree, env=env,
                                            capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            loads.append({"round": r, "side": side, "load": round(la, 2)})
            warmups[side].append(res["warmup"])
            for name, v in res["policies"].items():
                best[side][name] = min(best[side].get(name, float("inf")), v["cpu_s"])
                per_round[side].setdefault(name, []).append(v["cpu_s"])
                counters.setdefault(name, {}).setdefault(side, []).append((v["counters"], v["events"]))
    tl = trace.T * trace.L
    rows, worst = [], float("inf")
    for name in policies:
        b, f = best["before"][name], best["after"][name]
        seen = counters[name]["before"] + counters[name]["after"]
        same = all(s == seen[0] for s in seen)
        ratio = b / f
        if name in PRESETS:
            worst = min(worst, ratio)
        rows.append({"policy": name, "preset": name in PRESETS, "before_Mtl_s": tl / b / 1e6, "after_Mtl_s": tl / f / 1e6,
                     "after_over_before": ratio, "counters_equal": same,
                     "before_cpu_s_rounds": per_round["before"][name], "after_cpu_s_rounds": per_round["after"][name]})
    passed = worst >= 1.0 - a.tolerance and all(r["counters_equal"] for r in rows)
    lines = [f"shape {a.shape!r}, {trace.T} tokens x {trace.L} layers, E={trace.E}, k={trace.k}, C=128; {a.rounds} "
             f"rounds x {a.repeats} repeats, alternating processes, best process CPU time; before = "
             f"{revs['before']}, after = {revs['after']}.", "",
             "| policy | before token-layers/s | after token-layers/s | after / before | counters and events equal |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']}{'' if r['preset'] else ' (not gated)'} | {r['before_Mtl_s']:.2f} M | "
                     f"{r['after_Mtl_s']:.2f} M | {r['after_over_before']:.3f} | "
                     f"{'yes' if r['counters_equal'] else 'NO'} |")
    lines += ["", f"Gate (presets, after / before >= {1 - a.tolerance:.2f}, counters equal): "
              f"{'PASS' if passed else 'FAIL'} (worst preset {worst:.3f}).", "",
              "Kernel warmup per process (round 1: a cold compile into an empty numba cache; later rounds: a load "
              "from it), process CPU / wall seconds:", "", "| side | cold compile | later loads (median CPU) |",
              "|---|---|---|"]
    for side in trees:
        w = warmups[side]
        later = sorted(x["cpu_s"] for x in w[1:])
        med = f"{later[len(later) // 2]:.2f} s" if later else "-"
        lines.append(f"| {side} | {w[0]['cpu_s']:.1f} s CPU / {w[0]['wall_s']:.1f} s wall | {med} |")
    lines += ["", "run_layer's optimized LLVM per specialization, from each side's cold-compile process (lines, "
              "reference-count increments / decrements in its code):", "", "| side | lean | full |", "|---|---|---|"]
    same_code = {}
    for build in ("lean", "full"):
        texts = [(tmp / f"nbc-{side}" / f"llvm-{build}.txt") for side in trees]
        if all(t.exists() for t in texts):
            a_, b_ = (t.read_text().splitlines() for t in texts)
            same_code[build] = a_ == b_
    for side in trees:
        llvm = warmups[side][0].get("llvm") or {}
        cells = [f"{v['llvm_lines']} lines, {v['refcount_increments']} / {v['refcount_decrements']}"
                 if (v := llvm.get(b)) else "-" for b in ("lean", "full")]
        lines.append(f"| {side} | {cells[0]} | {cells[1]} |")
    lines += ["", "The same instructions on both sides (run_layer's LLVM, names dropped, as a sorted multiset of lines): "
              + (", ".join(f"{b} {'yes' if v else 'no'}" for b, v in same_code.items()) or "not compared") + "."]
    lines += ["", "Load average (1 min) at each process start: "
              + ", ".join(f"{x['side']} {x['load']}" for x in loads) + "."]
    body = "\n".join(lines)
    print(body)
    if not a.no_report:
        data = {"before": revs["before"], "after": revs["after"], "shape": a.shape, "rounds": a.rounds,
                "repeats": a.repeats, "token_layers": tl, "tolerance": a.tolerance, "gate_passed": passed,
                "worst_preset_ratio": worst, "policies": rows, "warmup": warmups, "loads": loads,
                "same_instructions": same_code}
        print(write_report(a.name, "Policy kernel A/B: replay speed, counters and cold compile", data, body))


if __name__ == "__main__":
    main()
