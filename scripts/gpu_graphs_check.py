"""The CUDA-graphs check: the same policies decoded with the captured segments and eagerly, which must agree.

    .venv/bin/python scripts/gpu_graphs_check.py [--model DIR | --tiny] [--device cuda|cpu] [--cpu]
        [--tokens N] [--out FILE.json]

The engine decodes a teacher-forced window as segments around each MoE layer's host decision
(runtime/backends/engine/graphs.py); on CUDA each segment is replayed from a CUDA graph unless
`--no-cuda-graphs`. For fetch-every-miss, quality-first and speed-first at 25% of the experts, warm
from the first tokens, this runs the engine twice on one window, graphs on and off, and requires the
NLL bit-identical and every counter equal; it reports the time per token of both and which decode
path ran, and the time per decoder layer with all but one expert resident (the step's floor). Exit status 1 on any difference, or when CUDA was asked for and nothing was captured.

`--cpu` (CPU device mode, where nothing is captured: both runs are the eager segments) also compares
the segments with the Hugging Face forward path (`hf_forward`), which must make the same decisions
(integer counters equal) with logits within 1e-4 (so run it in fp32: bf16's rounding of the static cache's
longer reductions moves logits by ~2e-3): what the first GPU run relies on before it
verifies the captured path. `--tiny` builds the 2-layer test model (runtime/tools/tinyhf.py) under the
output's folder instead of reading `--model`. gpu_checks.sh's `graphs` step runs it on the bench's model.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo's packages first

from runtime.core.threads import configure  # noqa: E402

configure()

import torch  # noqa: E402

from runtime.backends import emulate  # noqa: E402
from runtime.backends.engine import Engine, engine_cli  # noqa: E402
from runtime.core.errors import ArgumentParser, InputError  # noqa: E402
from runtime.core.kernel import COUNTER_NAMES, FLOAT_COUNTERS, PolicyCache, warm_residency  # noqa: E402
from runtime.core.policy import PRESETS  # noqa: E402

POLICIES = ("fetch-every-miss", "quality-first", "speed-first")


def run(eng: Engine, name: str, window: np.ndarray, caps: np.ndarray, init, *, graphs: bool = True,
        hf: bool = False) -> dict:
    """One teacher-forced run of preset `name`; `graphs` False: eager segments; `hf`: the Hugging Face forward."""
    eng.no_cuda_graphs = not graphs
    why = eng.no_segments_why
    if hf:
        eng.no_segments_why = "asked for (--cpu comparison)"
    try:
        cache = PolicyCache(PRESETS[name], eng.E, eng.k, caps, init)
        t0 = time.perf_counter()
        nll, rep = eng.teacher_forced(eng.m, window, cache, keep_logits=True)
        wall = time.perf_counter() - t0
    finally:
        eng.no_segments_why = why
    return {"nll": nll, "logits": torch.stack(eng.logits), "counters": cache.counter_totals(), "wall_s": wall,
            "time_per_token_s": rep["time_per_token_s"], "decode_path": rep["engine"]["decode_path"]}


def compare(a: dict, b: dict, exact: bool) -> list[str]:
    """What differs between two runs (empty: they agree): bit for bit, or decisions equal and logits within 1e-4."""
    bad = []
    if exact and not np.array_equal(a["nll"], b["nll"]):
        bad.append(f"NLL differs (max {np.abs(a['nll'] - b['nll']).max():.3g})")
    if not exact and (a["logits"] - b["logits"]).abs().max().item() > 1e-4:
        bad.append(f"logits differ by {(a['logits'] - b['logits']).abs().max().item():.3g} > 1e-4")
    for c in COUNTER_NAMES:
        x, y = a["counters"][c], b["counters"][c]
        same = (x == y) if exact or c not in FLOAT_COUNTERS else abs(x - y) <= 1e-5 * max(abs(x), 1.0)
        if not same:
            bad.append(f"counter {c}: {x} vs {y}")
    return bad


def save(path: str | None, out: dict) -> None:
    """The results so far to `path` (atomically: a reader never sees half a file); "finished" only at the end."""
    if path:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps({"finished": False, **out}, indent=1) + "\n")
        tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (gpu_checks.sh: the bench's model)")
    p.add_argument("--tiny", action="store_true", help="build the 2-layer test model instead of --model")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's) | fp32 | bf16 | fp16 (default auto)")
    p.add_argument("--cpu", action="store_true", help="CPU device mode; also compare with the Hugging Face forward")
    p.add_argument("--tokens", type=int, default=64, help="tokens in the window (default 64)")
    p.add_argument("--out", help="results JSON")
    a = p.parse_args(argv)
    if (a.model is None) == (not a.tiny):
        raise InputError("give --model DIR or --tiny")
    if a.tokens < 8:
        raise InputError(f"--tokens = {a.tokens}: at least 8")
    device = "cpu" if a.cpu else a.device
    model = a.model
    if a.tiny:
        from runtime.tools.tinyhf import build_tiny

        base = Path(a.out).resolve().parent if a.out else Path(tempfile.mkdtemp())
        model = str(build_tiny("qwen3_moe", base / "graphs_tiny_model", num_experts=16, top_k=4))
    eng = Engine(emulate.load(model, a.dtype), device)
    try:
        V = int(eng.m.model.config.vocab_size)
        rng = np.random.default_rng(0)
        window = rng.integers(0, V, size=(1, a.tokens)).astype(np.int64)
        warm = rng.integers(0, V, size=(1, a.tokens)).astype(np.int64)
        ids, _, _, _ = emulate.record(eng.m, warm, eng.k)
        caps = np.full(eng.L, max(eng.k, eng.E // 4))
        init = warm_residency(ids, None, eng.E, caps)
        out: dict = {"device": str(eng.device), "model": model, "tokens": a.tokens, "capacity": caps.tolist(),
                     "policies": {}, "ok": True}
        save(a.out, out)
        for name in POLICIES:
            on = run(eng, name, window, caps, init, graphs=True)
            off = run(eng, name, window, caps, init, graphs=False)
            row = {"decode_path_on": on["decode_path"], "decode_path_off": off["decode_path"],
                   "time_per_token_us_on": 1e6 * on["time_per_token_s"],
                   "time_per_token_us_off": 1e6 * off["time_per_token_s"],
                   "speedup": off["time_per_token_s"] / on["time_per_token_s"], "counters": on["counters"],
                   "problems": compare(on, off, exact=True)}
            if eng.cuda and on["decode_path"] != "cuda_graphs":
                row["problems"].append(f"CUDA: graphs on ran {on['decode_path']!r}, not cuda_graphs")
            if a.cpu:
                hf = run(eng, name, window, caps, init, hf=True)
                row["problems"] += [f"vs hf_forward: {x}" for x in compare(on, hf, exact=False)]
                row["time_per_token_us_hf"] = 1e6 * hf["time_per_token_s"]
            out["policies"][name] = row
            out["ok"] &= not row["problems"]
            save(a.out, out)  # per stage: a step cut by its timeout keeps what finished
            print(f"{name:17s} {row['decode_path_on']:12s} on {row['time_per_token_us_on']:9.1f} us/token, "
                  f"off {row['time_per_token_us_off']:9.1f} us/token ({row['speedup']:.2f}x)  "
                  + ("identical" if not row["problems"] else "DIFFERS: " + "; ".join(row["problems"])), flush=True)
        # all but one expert resident: the step's floor per decoder layer (the <= 150 us target on the bench shape)
        full = np.full(eng.L, eng.E - 1)
        res_init = warm_residency(ids, None, eng.E, full)
        n_dec = len(eng.m.model.model.layers)
        on = run(eng, "fetch-every-miss", window, full, res_init, graphs=True)
        off = run(eng, "fetch-every-miss", window, full, res_init, graphs=False)
        row = {"slots": int(eng.E - 1), "decoder_layers": n_dec, "us_per_layer_on": 1e6 * on["time_per_token_s"] / n_dec,
               "us_per_layer_off": 1e6 * off["time_per_token_s"] / n_dec, "decode_path_on": on["decode_path"],
               "problems": compare(on, off, exact=True)}
        out["all_resident"] = row
        out["ok"] &= not row["problems"]
        out["finished"] = True
        print(f"all-resident (E-1 slots): {row['us_per_layer_on']:.1f} us per decoder layer with {row['decode_path_on']}, "
              f"{row['us_per_layer_off']:.1f} without", flush=True)
    finally:
        eng.close()
    save(a.out, out)
    print("graphs check:", "ok" if out["ok"] else "FAILED")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    engine_cli(lambda: sys.exit(main()))
