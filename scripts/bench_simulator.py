"""Simulator benchmark: replay a Qwen3-Next-shaped synthetic trace under the paper's policies.

48 layers, E=512, k=10, C=128, M=64, 4,000 tokens, with the generator's defaults; the warm start
comes from the trace's 2,000-token calibration twin (same popularity and topic draw, other tokens:
runtime.formats.trace.synthetic_pair). Reports the kernel's token-layers per second (best of --repeats, the
replay loop alone, pinned to one core), the machine's load average, the cost model's time per token
and the share of substituted calls (docs/traces.md quotes it).
    python scripts/bench_simulator.py [--repeats 5] [--host rtx4090] [--against GIT_REV] [--shape topics] [--cpp]

`--shape topics` is the issue-17 shape: the same geometry with the topic switching every 1,000 tokens
(seq_len 1000, no random switches) and a 4,000-token calibration twin (another token stream).
`--cpp` also replays the trace with the straightforward C++ replay of scripts/replay_ref.cpp (built
here with g++ -O2), checks that its counters equal the simulator's, and prints the simulator's speed
as a multiple of it: per policy --repeats rounds, each one simulator replay then one C++ replay (paired,
so both see the same machine phase: this VM's speed drifts 30-40% over seconds), the median and the
lowest of the rounds' ratios, and each side's best speed (one core).

`--against REV` (a revision before runtime/core/kernel/ became a package; otherwise scripts/bench_kernel_ab.py)
also times runtime/core/kernel.py as of git revision REV on the same trace, interleaved
with the current kernel (so both see the same machine load), by process CPU time (less sensitive
to other jobs than wall time) and wall time, and prints the speed ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from runtime.backends.simulate import layer_major, replay, simulate
from runtime.core import kernel
from runtime.core.kernel import warm_residency, warmup
from runtime.core.policy import PRESETS, RULE_CODE
from runtime.formats import costmodel
from runtime.formats.trace import synthetic_pair

POLICIES = ("fetch-every-miss", "rule-0.15", "quality-first", "speed-first")
SHAPES = {"default": {"calib_tokens": 2000},
          "topics": {"calib_tokens": 4000, "seq_len": 1000, "switch_prob": 0.0}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--host", default="rtx4090")
    ap.add_argument("--against", default=None, help="also time runtime/core/kernel.py of this git revision")
    ap.add_argument("--shape", default="default", choices=tuple(SHAPES), help="trace shape (see the module doc)")
    ap.add_argument("--cpp", action="store_true", help="also time the C++ replay (scripts/replay_ref.cpp)")
    a = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    t0 = time.perf_counter()
    trace, calib = synthetic_pair(a.tokens, 48, 512, 10, 64, seed=1, model="Qwen/Qwen3-Next-80B-A3B (synthetic)",
                                  **SHAPES[a.shape])
    gen_s = time.perf_counter() - t0
    caps = np.full(48, 128)
    init = warm_residency(calib.topk_ids, calib.valid, 512, caps)
    warmup()
    rows = []
    shape = costmodel.shape_for_trace(trace, "qwen3-next-80b-a3b")
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
        f"one core; trace shape {a.shape!r}, generation {gen_s:.1f} s; host profile {a.host}, shape {shape.name} bf16 "
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
    if a.cpp:
        lines += ["", _cpp_table(trace, caps, init, a.repeats, _kernel_at(a.against) if a.against else None, a.against)]
    print("\n".join(lines))
    if min(r[1] for r in rows) < 5e6:
        print("\nBELOW TARGET: at least one policy under 5 M token-layers/s")


def _cpp_table(trace, caps, init, repeats: int, ref=None, rev: str | None = None) -> str:
    """The simulator (and the kernel at `rev`, module `ref`) beside the C++ replay, per policy, timed back
    to back by process CPU time (wall time in brackets); counters checked equal."""
    assert trace.valid.all() and len(set(caps.tolist())) == 1
    root = Path(__file__).resolve().parent
    tmp = Path(tempfile.mkdtemp())
    exe = tmp / "replay_ref"
    subprocess.run(["g++", "-O2", "-std=c++17", "-o", str(exe), str(root / "replay_ref.cpp")], check=True)
    T, L, k = trace.topk_ids.shape
    M, C = trace.ranking.shape[2], int(caps[0])
    ini = np.full((L, C), -1, np.int32)
    for l_, r in enumerate(init):
        ini[l_, : len(r)] = r
    data = tmp / "trace.bin"
    with open(data, "wb") as f:
        f.write(np.array([T, L, trace.E, k, M, C], np.int64).tobytes())
        for arr, dt in ((trace.topk_ids, np.int32), (trace.topk_weights, np.float64), (trace.ranking, np.int32)):
            f.write(np.ascontiguousarray(np.asarray(arr, dt).transpose(1, 0, 2)).tobytes())  # [L, T, .]
        f.write(ini.tobytes())
    old_col = f" kernel at {rev} / C++ |" if ref is not None else ""
    out = [f"simulator vs the straightforward C++ replay (scripts/replay_ref.cpp, g++ -O2), {repeats} paired rounds per "
           "policy (a simulator replay, then a C++ replay), by process CPU time (best speed of each side; the ratio "
           "is the median of the rounds' ratios, the lowest in brackets), load average before/after:", "",
           f"| policy | simulator token-layers/s | C++ replay token-layers/s | simulator / C++ |{old_col} counters equal |",
           "|---|---|---|---|" + ("---|" if ref is not None else "") + "---|"]
    tl = T * L
    for name in POLICIES:
        pol = PRESETS[name]
        la0 = os.getloadavg()[0]
        sim, old, cpp_t = [], [], []
        for _ in range(repeats):  # paired rounds: the simulator, then the C++ replay (one replay each)
            sim.append(_time_layers(kernel, trace, pol, caps, init))
            if ref is not None:
                old.append(_time_layers(ref, trace, pol, caps, init))
            cpp = subprocess.run([str(exe), str(data), str(RULE_CODE[pol.rule]), repr(pol.tau_value),
                                  repr(pol.beta or 0.0), "1"], capture_output=True, text=True, check=True)
            h, fe, su, dr, ad, mass, cpp_c, _ = cpp.stdout.split()
            cpp_t.append(float(cpp_c))
        c = replay(trace, pol, caps, init).cache.counter_totals()
        same = (int(h), int(fe), int(su), int(dr), int(ad)) == (c["hits"], c["fetches"], c["substitutions"],
                                                                 c["drops"], c["admissions"])
        same = same and abs(float(mass) - c["substituted_mass"]) <= 1e-6 * max(1.0, c["substituted_mass"])
        sc, cc = min(x[0] for x in sim), min(cpp_t)
        ratios = [cp / x[0] for x, cp in zip(sim, cpp_t, strict=True)]
        row = (f"| {name} | {tl / sc / 1e6:.2f} M | {tl / cc / 1e6:.2f} M | "
               f"{np.median(ratios):.2f}x ({min(ratios):.2f}x) |")
        if ref is not None:
            ro = [cp / x[0] for x, cp in zip(old, cpp_t, strict=True)]
            row += f" {np.median(ro):.2f}x ({min(ro):.2f}x) |"
        out.append(row + f" {'yes' if same else 'NO'} (load {la0:.1f}/{os.getloadavg()[0]:.1f}) |")
    return "\n".join(out)


def _kernel_at(rev: str):
    """runtime/core/kernel.py as of a git revision, imported as a separate module."""
    root = Path(__file__).resolve().parents[1]
    for rel in ("runtime/core/kernel.py", "runtime/kernel.py"):  # a revision before the subpackages: flat
        got = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=root, capture_output=True, text=True)
        if got.returncode == 0:
            break
    else:  # the kernel is a package from 708c76b on: one module cannot stand in for it
        sys.exit(f"expertsweep: error: --against {rev}: no single-module kernel at that revision (runtime/core/kernel/ "
                 "is a package); compare kernels with scripts/bench_kernel_ab.py --before REV --after REV")
    # the old kernel imports its helpers by their old names; they live in runtime.core now
    src = got.stdout.replace("from runtime.errors", "from runtime.core.errors").replace(
        "from runtime.policy", "from runtime.core.policy")
    path = Path(tempfile.mkdtemp()) / "kernel_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kernel_ref", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kernel_ref"] = mod
    spec.loader.exec_module(mod)
    mod.warmup()
    return mod


def _time_layers(mod, trace, policy, caps, init) -> tuple[float, float]:
    """(process CPU s, wall s) of the replay loop of runtime.backends.simulate.replay with a given kernel module:
    one `step_layers` call over every layer, or (a revision before it) one `step` per layer."""
    cache = mod.PolicyCache(policy, trace.E, trace.k, caps, init)
    L, T = trace.L, trace.T
    ev = np.full((L, T, mod.N_EV), 0, np.int32)  # written here: its pages are in before the timed loop, as in replay()
    if hasattr(cache, "step_layers"):
        args = layer_major(trace)  # as replay() builds them
        c0, t0 = time.process_time(), time.perf_counter()
        cache.step_layers(*args, ev)
        return time.process_time() - c0, time.perf_counter() - t0
    args = [(np.ascontiguousarray(trace.topk_ids[:, l_]), np.ascontiguousarray(trace.topk_weights[:, l_], dtype=np.float64),
             np.ascontiguousarray(trace.ranking[:, l_]), np.ascontiguousarray(trace.valid[:, l_])) for l_ in range(L)]
    kw = {"decisions": False} if "decisions" in inspect.signature(cache.step).parameters else {}  # as replay()
    c0, t0 = time.process_time(), time.perf_counter()
    for l_ in range(L):
        cache.step(l_, *args[l_], t0=0, events=ev[l_], logs=False, **kw)
    return time.process_time() - c0, time.perf_counter() - t0


if __name__ == "__main__":
    main()
