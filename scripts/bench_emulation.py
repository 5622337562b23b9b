"""Emulation overhead benchmark: emulation under a policy and trace recording versus the plain forward.

On N tokens of the demo model (default 16,384): the plain transformers forward (a separately
loaded, unwrapped model), the emulation under `quality-first` (the policy pass alone), the same
emulation with every layer streamed from the shards (`--max-memory` far below the model: the
layer-major pass of a checkpoint larger than RAM, on a model that fits, so against the in-memory
emulation it prices streaming alone), and trace recording at full ranking depth, all over the same
windows, best of --repeats.
    python scripts/bench_emulation.py [--model DIR] [--tokens 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
import torch

from runtime.backends import emulate
from runtime.core.kernel import PolicyCache, warm_residency, warmup
from runtime.core.policy import PRESETS, resolve_capacities


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo tiny model, built if absent)")
    ap.add_argument("--text", default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-windows", type=int, default=8)
    ap.add_argument("--policy", default="quality-first")
    a = ap.parse_args()
    if a.model is None:
        from runtime.tools.tinymodel import ensure_model

        a.model = str(ensure_model("demo"))
    text = a.text or os.path.join(a.model, "eval.txt")
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, local_files_only=True).eval()
    m = emulate.load(a.model, "fp32")
    ms = emulate.load(a.model, "fp32", max_memory=1e-6)  # every layer streamed
    W = emulate.default_window(m)
    windows, _ = emulate.tokenize_file(m, text, a.tokens, W)
    caps = resolve_capacities(None, m.num_layers, m.E, m.k, 0.25)
    ids, _, _, _ = emulate.record(m, windows, m.k, a.batch_windows)
    init = warm_residency(ids, None, m.E, caps)
    warmup()

    @torch.inference_mode()
    def run_plain():
        for s in range(0, len(windows), a.batch_windows):
            plain(input_ids=torch.from_numpy(windows[s : s + a.batch_windows]), use_cache=False)

    def run_policy(mm=m):
        mm.ctx.cache = PolicyCache(PRESETS[a.policy], mm.E, mm.k, caps, init)
        try:
            emulate.run_stream(mm, windows, a.batch_windows)
        finally:
            mm.ctx.cache = None

    def run_streamed():
        run_policy(ms)

    def run_record():
        emulate.record(m, windows, m.E, a.batch_windows)

    run_plain()  # warm-up
    t_plain = best_of(run_plain, a.repeats)
    t_pol = best_of(run_policy, a.repeats)
    t_str = best_of(run_streamed, a.repeats)
    t_rec = best_of(run_record, a.repeats)
    n = windows.size
    print(f"machine: {os.cpu_count()} cores ({platform.machine()}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; model {a.model}; {n} tokens in {len(windows)} windows of {W}, "
          f"batches of {a.batch_windows} windows; best of {a.repeats}")
    print()
    print("| pass | seconds | tokens/s | vs plain forward |")
    print("|---|---|---|---|")
    for name, t in (("plain transformers forward", t_plain), (f"emulation ({a.policy}, 25% resident)", t_pol),
                    ("the same, every layer streamed from the shards", t_str),
                    (f"trace recording (M = E = {m.E})", t_rec)):
        print(f"| {name} | {t:.2f} | {n / t:,.0f} | {t / t_plain:.3f}x |")
    print()
    print(f"targets: emulation <= 1.25x ({'met' if t_pol <= 1.25 * t_plain else 'NOT met'}), "
          f"recording <= 1.1x ({'met' if t_rec <= 1.1 * t_plain else 'NOT met'}), "
          f"streamed <= 1.3x the in-memory emulation: {t_str / t_pol:.3f}x "
          f"({'met' if t_str <= 1.3 * t_pol else 'NOT met'})")
    np.set_printoptions(precision=3)


if __name__ == "__main__":
    main()
