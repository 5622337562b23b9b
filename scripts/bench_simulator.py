"""Simulator benchmark: replay a Qwen3-Next-shaped synthetic trace under the paper's policies.

48 layers, E=512, k=10, C=128, M=64, 4,000 tokens, with the generator's defaults; the warm start
comes from the trace's 2,000-token calibration twin (same popularity and topic draw, other tokens:
runtime.trace.synthetic_pair). Reports the kernel's token-layers per second (best of --repeats, the
replay loop alone, pinned to one core), the machine's load average, the cost model's time per token
and the share of substituted calls (docs/traces.md quotes it).
    python scripts/bench_simulator.py [--repeats 5] [--host rtx4090] [--against GIT_REV]

`--against REV` also times runtime/kernel.py as of git revision REV on the same trace, interleaved
with the current kernel (so both see the same machine load), by process CPU time (less sensitive
to other jobs than wall time) and wall time, and prints the speed ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from runtime import costmodel, kernel
from runtime.kernel import warm_residency, warmup
from runtime.policy import PRESETS
from runtime.simulate import replay, shape_for_trace, simulate
from runtime.trace import synthetic_pair

POLICIES = ("fetch-every-miss", "rule-0.15", "quality-first", "speed-first")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--host", default="rtx4090")
    ap.add_argument("--against", default=None, help="also time runtime/kernel.py of this git revision")
    a = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    t0 = time.perf_counter()
    trace, calib = synthetic_pair(a.tokens, 48, 512, 10, 64, calib_tokens=2000, seed=1,
                                  model="Qwen/Qwen3-Next-80B-A3B (synthetic)")
    gen_s = time.perf_counter() - t0
    caps = np.full(48, 128)
    init = warm_residency(calib.topk_ids, calib.valid, 512, caps)
    warmup()
    rows = []
    shape = shape_for_trace(trace, "qwen3-next-80b-a3b")
    for name in POLICIES:
        best = min(replay(trace, PRESETS[name], caps, init).seconds for _ in range(a.repeats))
        res = simulate(trace, PRESETS[name], 128, initial_residency=init, host=a.host, model_shape=shape)
        res = res.to_dict() if hasattr(res, "to_dict") else res
        rows.append((name, trace.T * trace.L / best, best, res))
    cpu = platform.processor() or platform.machine()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    lines = [
        f"machine: {os.cpu_count()} cores ({cpu}), load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
        f"python {platform.python_version()}, numpy {np.__version__}; "
        f"one core; trace generation {gen_s:.1f} s; host profile {a.host}, shape {shape.name} bf16 "
        f"(expert {costmodel.expert_bytes(shape) / 2**20:.2f} MiB)",
        "",
        f"| policy | token-layers/s (best of {a.repeats}) | replay s | time/token (ms) | vs fetch-every-miss | "
        "vs host compute | substituted calls | mass/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, tls, best, r in rows:
        lines.append(f"| {name} | {tls / 1e6:.2f} M | {best:.4f} | {r['time_per_token_s'] * 1e3:.2f} | "
                     f"{r['speed_ratio_vs_fetch_all']:.2f}x | {r['speed_ratio_vs_host_compute']:.2f}x | "
                     f"{r['substituted_call_fraction'] * 100:.1f}% | {r['mass_per_token']:.3f} |")
    lines.append("")
    lines.append(f"all-resident bound: {rows[0][3]['all_resident_time_per_token_s'] * 1e3:.2f} ms/token")
    if a.against:
        ref = _kernel_at(a.against)
        lines += ["", f"token-layers/s, best of {a.repeats} interleaved runs, by process CPU time (wall time in brackets):",
                  "", f"| policy | current kernel | kernel at {a.against} | ratio (CPU time) |", "|---|---|---|---|"]
        for name in POLICIES:
            cur, old = [], []
            for _ in range(a.repeats):  # interleaved: both see the same load
                cur.append(_time_layers(kernel, trace, PRESETS[name], caps, init))
                old.append(_time_layers(ref, trace, PRESETS[name], caps, init))
            tl = trace.T * trace.L
            (cc, cw), (oc, ow) = (min(x[0] for x in cur), min(x[1] for x in cur)), (min(x[0] for x in old), min(x[1] for x in old))
            lines.append(f"| {name} | {tl / cc / 1e6:.2f} M ({tl / cw / 1e6:.2f} M) | {tl / oc / 1e6:.2f} M "
                         f"({tl / ow / 1e6:.2f} M) | {oc / cc:.3f} |")
    print("\n".join(lines))
    if min(r[1] for r in rows) < 5e6:
        print("\nBELOW TARGET: at least one policy under 5 M token-layers/s")


def _kernel_at(rev: str):
    """runtime/kernel.py as of a git revision, imported as a separate module."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:runtime/kernel.py"], cwd=root, capture_output=True, text=True,
                         check=True).stdout
    path = Path(tempfile.mkdtemp()) / "kernel_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kernel_ref", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kernel_ref"] = mod
    spec.loader.exec_module(mod)
    mod.warmup()
    return mod


def _time_layers(mod, trace, policy, caps, init) -> tuple[float, float]:
    """(process CPU s, wall s) of the replay loop of runtime.simulate.replay with a given kernel module."""
    cache = mod.PolicyCache(policy, trace.E, trace.k, caps, init)
    L, T = trace.L, trace.T
    ev = np.zeros((L, T, mod.N_EV), np.int32)
    args = [(np.ascontiguousarray(trace.topk_ids[:, l_]), np.ascontiguousarray(trace.topk_weights[:, l_], dtype=np.float64),
             np.ascontiguousarray(trace.ranking[:, l_]), np.ascontiguousarray(trace.valid[:, l_])) for l_ in range(L)]
    c0, t0 = time.process_time(), time.perf_counter()
    for l_ in range(L):
        cache.step(l_, *args[l_], t0=0, events=ev[l_], logs=False)
    return time.process_time() - c0, time.perf_counter() - t0


if __name__ == "__main__":
    main()
