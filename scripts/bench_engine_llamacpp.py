"""What the engine pays to run llama.cpp's two presets (CPU device mode): writes reports/engine_llamacpp.md and .json.

At the same memory (C slots per layer; the shared pool: L x C slots) on a tiny random Qwen3-MoE checkpoint
(runtime/tools/tinyhf.py), teacher-forced decoding of random windows under
- `fetch_all + lru` per layer (the per-layer twin of llama.cpp's cache), once more with the one-call host decision
  off (the step-by-step path llama.cpp's presets take), and `fetch-every-miss`,
- `llamacpp-lru` (one slot array of L x C rows, decided step by step: no one-call decision),
- `llamacpp-ncmoe` (its first N layers' experts computed on the host),
and, without a model, the host decision alone per token and layer when driven one token at a time (the engine's
order): `SharedPoolCache.step`, `LayerSplitCache.step` and `PolicyCache.step` (the step-by-step path every other
policy falls back to). Reports the engine's time per token, its fetch copies, host and device expert computes per
token, its slot bytes and its decode path; every run's decisions come from the same caches the simulator and the
emulation drive. In CPU device mode the "device" is this CPU, so the times show the host-side costs (decisions,
Python), not a GPU's; the copies and slot bytes are what a GPU run copies and holds.

    PYTHONPATH=. .venv/bin/python scripts/bench_engine_llamacpp.py [--tokens 2048] [--window 64] [--capacity 8]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def decision_us(cache, ids: np.ndarray, repeats: int = 3) -> float:
    """Microseconds per token and layer of `cache.step`, one token at a time, layers in order (ids [T, L, k])."""
    T, L, _ = ids.shape
    best = float("inf")
    for _ in range(repeats):
        c = cache()
        t0 = time.perf_counter()
        for t in range(T):
            for l_ in range(L):
                c.step(l_, ids[t : t + 1, l_], np.ones((1, ids.shape[2])), scores=None)
        best = min(best, time.perf_counter() - t0)
    return best / (T * L) * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--capacity", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)

    import torch

    from runtime.backends import emulate
    from runtime.backends.engine import Engine, graphs
    from runtime.core.kernel import PolicyCache
    from runtime.core.llamacpp_cache import LayerSplitCache, SharedPoolCache
    from runtime.core.policy import PRESETS, PolicyConfig
    from runtime.tools.reports import write_report
    from runtime.tools.tinyhf import build_tiny

    torch.set_num_threads(1)
    one_call_build = graphs.OneCall.build  # the one-call host decision (the step-by-step row turns it off)
    policies = {"fetch_all+lru (per layer)": PolicyConfig(rule="fetch_all", evict="lru"),
                "fetch-every-miss": PRESETS["fetch-every-miss"], "llamacpp-lru": PRESETS["llamacpp-lru"],
                "llamacpp-ncmoe": PRESETS["llamacpp-ncmoe"]}
    n = max(a.tokens // a.window, 1)
    windows = np.random.default_rng(0).integers(0, 90, size=(n, a.window)).astype(np.int64)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_tiny("qwen3_moe", Path(tmp) / "m", num_experts=a.experts, top_k=a.top_k)
        eng = Engine(emulate.load(ckpt), "cpu")
        try:
            L, E, k = eng.L, eng.E, eng.k
            eng.evaluate(windows[:1], policies["fetch-every-miss"], capacities=a.capacity)  # warm-up (compiles)
            runs = [(name, pol, True) for name, pol in policies.items()]
            runs.insert(1, ("fetch_all+lru (per layer), step by step", policies["fetch_all+lru (per layer)"], False))
            for name, pol, one_call in runs:
                graphs.OneCall.build = one_call_build if one_call else (lambda prog: None)
                r = min((eng.evaluate(windows, pol, capacities=a.capacity, record_decisions=True)
                         for _ in range(a.repeats)), key=lambda x: x["time_per_token_s"])
                graphs.OneCall.build = one_call_build
                T = windows.size
                rep, c = r["engine"], r["counters"]
                rows[name] = {"time_per_token_ms": r["time_per_token_s"] * 1e3,
                              "fetch_copies_per_token": rep["fetch_copies"] / T,
                              "host_computes_per_token": rep["host_computes"] / T,
                              "device_computes_per_token": rep["device_computes"] / T,
                              "hits": c["hits"], "fetches": c["fetches"], "slot_bytes": rep["slot_bytes"],
                              "slot_layout": rep["slot_layout"], "decode_path": rep["decode_path"]}
                log.info("%s: %s", name, rows[name])
            ids = r["decisions"]["served"]  # [T, L, k] the model's selections (the same under every policy here)
        finally:
            eng.close()
    caps = np.full(L, a.capacity)
    decide = {"PolicyCache.step (fetch_all+lru)": decision_us(lambda: PolicyCache(policies["fetch_all+lru (per layer)"],
                                                                                   E, k, caps), ids),
              "SharedPoolCache.step (llamacpp-lru)": decision_us(lambda: SharedPoolCache(PRESETS["llamacpp-lru"],
                                                                                         E, k, caps), ids),
              "LayerSplitCache.step (llamacpp-ncmoe)": decision_us(lambda: LayerSplitCache(PRESETS["llamacpp-ncmoe"],
                                                                                           E, k, caps), ids)}
    N = L - int(caps.sum()) // E
    body = [f"Tiny random Qwen3-MoE: L = {L} MoE layers, E = {E}, k = {k}, C = {a.capacity} slots per layer "
            f"(llamacpp-lru: one array of {L * a.capacity} slots; llamacpp-ncmoe: N = {N} host layers), "
            f"{windows.size} tokens in windows of {a.window}, CPU device mode, one thread, best of {a.repeats} runs. "
            "Step by step: the same policy with the one-call host decision (runtime/core/kernel/decide.py) turned "
            "off, the path llama.cpp's presets take.", "",
            "| policy | time per token (ms) | fetch copies / token | host computes / token | device computes / token "
            "| slot bytes | slot layout | decode path |", "|---|---|---|---|---|---|---|---|"]
    for name, x in rows.items():
        body.append(f"| {name} | {x['time_per_token_ms']:.3f} | {x['fetch_copies_per_token']:.3f} | "
                    f"{x['host_computes_per_token']:.3f} | {x['device_computes_per_token']:.3f} | {x['slot_bytes']} | "
                    f"{x['slot_layout']} | {x['decode_path']} |")
    body += ["", "Host decision alone, one token at a time (best of 3):", "", "| cache | us per token and layer |",
             "|---|---|"]
    body += [f"| {name} | {us:.1f} |" for name, us in decide.items()]
    write_report("engine_llamacpp", "The engine under llama.cpp's two presets (CPU device mode)",
                 {"layers": L, "experts": E, "top_k": k, "capacity": a.capacity, "ncmoe": N, "tokens": int(windows.size),
                  "window": a.window, "runs": rows, "decision_us_per_token_layer": decide}, "\n".join(body))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
