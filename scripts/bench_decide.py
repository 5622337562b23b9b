"""The engine's one compiled host decision per MoE layer-call alone (runtime/core/kernel/decide.py `decide_layer`).

    PYTHONPATH=<runtime> python scripts/bench_decide.py [--policy fetch-every-miss] [--experts 64] [--k 8] [--layers 4] [--resident E-1]
                                   [--calls 20000] [--repeats 5] [--out FILE.json]

The demo model's shape by default (4 MoE layers, E = 64, k = 8), fetch-every-miss with E - 1 of E experts resident
(the engine's bench case): per call a packed routing row (a fixed random sequence: ids, softmax top-k weights, the
E scores, the finite flag) is written into the layer's host row and `decide_layer` is called as the engine's
`OneCall.decide` calls it; perf_counter around each call, `--calls` calls per repeat, layers in turn. Reports
the minimum and the median per call (us) over all repeats, and `noop_us`: a compiled function taking the same
arguments that does nothing (the cost of entering compiled code with them). The time is a host measurement
beside whatever else runs: state the load average (printed) with every figure. `PYTHONPATH` picks the runtime
(a `git archive` of an earlier revision times that one: the call's arguments are this revision's or the earlier
`tab, layer, k, E, pol, rnd, drop_renorm`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def rows(n: int, k: int, E: int, seed: int = 0) -> np.ndarray:
    """n packed routing rows [n, 2k + E + 1] float32: top-k ids (model order), their renormalised softmax
    weights, the E scores, the finite flag."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n, E)).astype(np.float32) * 2
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-p, 1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, 1)
    w /= w.sum(1, keepdims=True)
    perm = rng.permuted(np.tile(np.arange(k), (n, 1)), axis=1)  # the model's order is not the rank order
    ids, w = np.take_along_axis(ids, perm, 1), np.take_along_axis(w, perm, 1)
    return np.concatenate([ids, w, p, np.ones((n, 1))], 1).astype(np.float32)


def call_args(decide, tab, k: int, E: int, pc, b):
    """`decide_layer`'s arguments for MoE layer `lay` as the engine's OneCall.decide passes them (this revision's
    signature, or the earlier one: `tab, layer, k, E, pol, rnd, drop_renorm`)."""
    if hasattr(decide, "decide_consts"):  # the table holds the policy record and the per-call constants
        return lambda lay: (tab, lay)
    pol, rnd = pc._params, b.rnd
    return lambda lay: (tab, lay, k, E, pol, rnd, False)


def noop_like(n: int):
    """A compiled function of n arguments that does nothing (compiled here, not cached)."""
    from numba import njit

    names = ", ".join(f"a{i}" for i in range(n))
    scope: dict = {}
    exec(f"def noop({names}):\n    return 0\n", scope)  # noqa: S102 - a fixed arity
    return njit(scope["noop"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--policy", default="fetch-every-miss")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--resident", type=int, default=None, help="experts resident per layer (default E - 1)")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from runtime.core.kernel import decide
    from runtime.core.kernel.cache import PolicyCache
    from runtime.core.policy import PRESETS

    E, k, L = a.experts, a.k, a.layers
    C = a.resident if a.resident is not None else E - 1
    R = rows(a.calls, k, E)
    noop = None
    times, tnoop = [], []
    clock = time.perf_counter
    for _ in range(a.repeats):  # a fresh cache and buffers per repeat
        pc = PolicyCache(PRESETS[a.policy], E, k, np.full(L, C), [np.arange(C) for _ in range(L)])
        b = decide.decide_buffers(L, k, E, "float32", cap=a.calls + 1)
        packed = [np.zeros((1, 2 * k + E + 1), np.float32) for _ in range(L)]
        plans = [np.zeros((3, k), np.float32) for _ in range(L)]
        outs = [b.out] + [decide.decide_buffers(1, k, E).out for _ in range(L - 1)]
        lays = list(zip(packed, plans, outs, strict=True))
        if hasattr(decide, "decide_consts"):  # this revision: the record and the constants in the table
            tab = decide.address_table(pc._state, pc.next_t, b.tok, b.ev_tab, b.ev_n, b.fetches, lays,
                                       pc.params_array, decide.decide_consts(k, E, b.rnd, False))
        else:
            tab = decide.address_table(pc._state, pc.next_t, b.tok, b.ev_tab, b.ev_n, b.fetches, lays)
        args = call_args(decide, tab, k, E, pc, b)
        fn = decide.decide_layer
        if noop is None:
            noop = noop_like(len(args(0)))
            noop(*args(0))
        for i in range(a.calls):
            lay = i % L
            packed[lay][0] = R[i]
            t0 = clock()
            fn(*args(lay))
            times.append(clock() - t0)
        for i in range(min(a.calls, 5000)):
            t0 = clock()
            noop(*args(i % L))
            tnoop.append(clock() - t0)
    us = np.array(times) * 1e6
    nus = np.array(tnoop) * 1e6
    res = {"policy": a.policy, "E": E, "k": k, "layers": L, "resident": C, "calls": a.calls, "repeats": a.repeats,
           "decide_us": {"min": float(us.min()), "p10": float(np.percentile(us, 10)), "median": float(np.median(us))},
           "noop_us": {"min": float(nus.min()), "median": float(np.median(nus))},
           "counters": {n: v for n, v in pc.counter_totals().items() if n in ("hits", "fetches", "substitutions")},
           "load": os.getloadavg()}
    print(f"decide_layer ({a.policy}, E={E}, k={k}, L={L}, C={C}): {res['decide_us']['min']:.2f} us min, "
          f"{res['decide_us']['p10']:.2f} us p10, {res['decide_us']['median']:.2f} us median; the same arguments into "
          f"a no-op: {res['noop_us']['min']:.2f} us min, {res['noop_us']['median']:.2f} us median; "
          f"load {res['load'][0]:.2f} {res['load'][1]:.2f} {res['load'][2]:.2f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
