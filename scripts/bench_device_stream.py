"""Streamed emulation through a device (`--device`, stream.LayerPipe) versus the plain streamed pass.

    python scripts/bench_device_stream.py --model DIR --text FILE [--tokens 4096] [--repeats 3]
        [--device cpu|cuda] [--dtype fp32] [--policy quality-first]

Both runs stream every layer from the shards (`--max-memory` far below the model) and evaluate the
exact model and one policy at 25% residency together in one layer-major pass (the emulation's
evaluation pass), over the same windows from the same warm start; best of --repeats, the two
alternating so a shared host's load drifts into both alike. `--device cpu` (CPU device mode)
prices the LayerPipe's staging copy and worker thread against the plain read; on CUDA the same
command shows the GPU pass (copies overlapped with compute) against the CPU one. The decisions
of the two runs are checked equal and the NLL within 1e-5 before anything is reported.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from runtime.backends import hfmodel, stream
from runtime.core.kernel import PolicyCache, warm_residency, warmup
from runtime.core.policy import PRESETS, resolve_capacities


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-windows", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--policy", default="quality-first")
    a = ap.parse_args()
    plain = hfmodel.load(a.model, a.dtype, max_memory=1e-6)
    dev = hfmodel.load(a.model, a.dtype, max_memory=1e-6, device=a.device)
    W = hfmodel.default_window(plain)
    windows, _ = hfmodel.tokenize_file(plain, a.text, a.tokens, W)
    caps = resolve_capacities(None, plain.num_layers, plain.E, plain.k, 0.25)
    ids, _, _, _ = hfmodel.record(plain, windows[: max(1, len(windows) // 4)], plain.k, a.batch_windows)
    init = warm_residency(ids, None, plain.E, caps)
    warmup()

    def run(m):
        lanes = [hfmodel.Lane(desc="exact"), hfmodel.Lane(cache=PolicyCache(PRESETS[a.policy], m.E, m.k, caps, init),
                                                          decisions=[[] for _ in range(m.num_layers)])]
        t0 = time.perf_counter()
        nll = hfmodel.run_lanes(m, windows, lanes, a.batch_windows)
        return time.perf_counter() - t0, nll, lanes[1].cache.counter_totals()

    times = {"plain": [], "device": []}
    for _ in range(a.repeats):
        tp, nll_p, c_p = run(plain)
        td, nll_d, c_d = run(dev)
        times["plain"].append(tp)
        times["device"].append(td)
        if c_p != c_d or max(np.abs(x - y).max() for x, y in zip(nll_p, nll_d, strict=True)) > 1e-5:
            raise SystemExit("the device-mode pass differs from the plain streamed pass")
    tp, td = min(times["plain"]), min(times["device"])
    n = windows.size
    layer = max(sum(plain.weights.nbytes(u) for u in stream.units_of_layer(plain.weights, i))
                for i in range(len(plain.model.get_decoder().layers)))
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, load "
          f"{open('/proc/loadavg').read().split()[:3]}; model {a.model} ({plain.weights.nbytes() / 2**30:.3f} GiB "
          f"{a.dtype}, largest layer {layer / 2**20:.1f} MiB); {n} tokens in {len(windows)} windows of {W}; "
          f"exact + {a.policy} in one pass; best of {a.repeats}")
    print("| pass | seconds (best) | all runs | tokens/s |")
    print("|---|---|---|---|")
    for name, t, k in (("streamed, plain (host)", tp, "plain"), (f"streamed through --device {a.device}", td, "device")):
        print(f"| {name} | {t:.2f} | {', '.join(f'{x:.2f}' for x in times[k])} | {n / t:,.0f} |")
    print(f"device / plain: {td / tp:.3f}x; decisions identical, NLL within 1e-5")


if __name__ == "__main__":
    main()
