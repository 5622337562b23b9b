"""Greedy generation under a miss policy versus the exact model: token agreement per prompt.

`python -m runtime.tools.generate --model DIR --prompt TEXT|--prompts FILE --policy PRESET
 (--capacity-fraction F | --capacity C | --vram-budget GiB) --max-new-tokens N [--device cpu|cuda] [--json]`

Each prompt is prefilled exactly (runtime/backends/engine/prefill.py) and then N tokens are generated greedily,
once by the exact model (every selected expert streamed, no cache decisions) and once by the
engine under the policy (batch 1, KV cache). Reported per prompt: the token agreement rate (the
fraction of the N positions where both chose the same token), the first divergence position (0-based
index into the generated tokens; null when identical) and time per decoded token; the analogue of
the paper's GSM8K/HumanEval agreement test. Exactly N tokens are generated (EOS does not stop a
run, so both runs have the same length). The policy cache starts warm (calib.txt beside the model or
--calib-text, else the prompts' own exact routing) and is carried from prompt to prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from runtime.backends import hfmodel
from runtime.backends.engine import Engine, cpu_threads, engine_cli, load_engine
from runtime.backends.engine.prefill import prefill
from runtime.core.errors import ArgumentParser, InputError, atomic_write
from runtime.core.kernel import PolicyCache, warm_residency
from runtime.core.llamacpp_cache import cache_for
from runtime.core.policy import PRESETS, preset, resolve_capacities
from runtime.core.spec import (
    DEFAULT_CAPACITY_FRACTION,
    HOST_STORES,
    RUN_FIELD_BY_NAME,
    SIZE_FIELDS,
    add_run_flags,
)

log = logging.getLogger(__name__)


@torch.inference_mode()
def greedy(eng: Engine, prompt_ids: list[int], max_new: int, cache: PolicyCache | None, chunk: int = 256) -> dict:
    """Prefill (exact) then `max_new` greedy tokens under `cache` (None = exact). Times in seconds."""
    m = eng.m
    x = torch.tensor([prompt_ids], dtype=torch.long)
    eng.sync()
    t0 = time.perf_counter()
    logits, past = prefill(eng, x, chunk)
    eng.sync()
    t1 = time.perf_counter()
    toks = [int(logits.argmax())]
    m.ctx.cache = cache
    try:
        for _ in range(max_new - 1):
            logits, past = eng.decode_step(torch.tensor([[toks[-1]]]), past)
            toks.append(int(logits.argmax()))
        eng.sync()
    finally:
        m.ctx.cache = None
    t2 = time.perf_counter()
    return {"tokens": toks, "prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": max_new - 1}


def agreement(a: list[int], b: list[int]) -> tuple[float, int | None]:
    """(fraction of positions with equal tokens, first position where they differ or None)."""
    eq = [x == y for x, y in zip(a, b, strict=True)]
    first = next((i for i, same in enumerate(eq) if not same), None)
    return float(np.mean(eq)) if eq else 1.0, first


def run_generate(eng: Engine, prompts: list[str], policy_name: str, max_new: int, capacity=None,
                 capacity_fraction: float | None = None, vram_budget: float | None = None,
                 calib_text: str | os.PathLike | None = None, chunk: int = 256) -> dict:
    """Exact and policy greedy generation over `prompts`; the report dict (see the module doc)."""
    m = eng.m
    pol = preset(policy_name)
    if max_new < 1:
        raise InputError(f"--max-new-tokens = {max_new} must be >= 1")
    ids = [m.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise InputError(f"prompt {i}: empty after tokenization")
        if len(p) + max_new > getattr(m.model.config, "max_position_embeddings", 1 << 30):
            raise InputError(f"prompt {i}: {len(p)} tokens + --max-new-tokens {max_new} exceed the model's "
                             f"max_position_embeddings {m.model.config.max_position_embeddings}")
    if vram_budget is not None:
        caps = eng.capacities_for_budget(vram_budget, [pol])
    else:
        caps = resolve_capacities(capacity, m.num_layers, m.E, m.k, capacity_fraction)
    exact = [greedy(eng, p, max_new, None, chunk) for p in ids]
    cids, init_src = hfmodel.calibration_ids(m, calib_text, RUN_FIELD_BY_NAME["calib_max_tokens"].default,
                                             hfmodel.default_window(m))
    if cids is None:  # never warm from the evaluated prompts (runtime/core/spec.py)
        log.warning("no calibration text (--calib-text, or calib.txt beside the model): the cache starts cold")
        init_src = "cold"
    # llama.cpp's shared pool and layer split run too (cache_for: runtime/core/llamacpp_cache.py)
    cache = cache_for(pol, m.E, m.k, caps, warm_residency(cids, None, m.E, caps) if cids is not None else None)
    eng.bind(cache)
    try:
        runs = [greedy(eng, p, max_new, cache, chunk) for p in ids]
    finally:
        eng.drain()
    rows = []
    for i, (ex, po) in enumerate(zip(exact, runs, strict=True)):
        rate, first = agreement(ex["tokens"], po["tokens"])
        rows.append({"prompt": i, "prompt_tokens": len(ids[i]), "agreement": rate, "first_divergence": first,
                     "exact_tokens": ex["tokens"], "policy_tokens": po["tokens"],
                     "time_per_token_s": po["decode_s"] / max(po["decode_steps"], 1),
                     "exact_time_per_token_s": ex["decode_s"] / max(ex["decode_steps"], 1),
                     "prefill_s": po["prefill_s"]})
    steps = sum(r["decode_steps"] for r in runs)
    tot = cache.counter_totals()
    return {"policy": policy_name, "policy_label": pol.label(), "capacity": caps.tolist(), "initial_residency": init_src,
            "device": str(eng.device), "max_new_tokens": max_new, "prompts": len(prompts),
            "agreement": float(np.mean([r["agreement"] for r in rows])),
            "identical_prompts": sum(r["first_divergence"] is None for r in rows),
            "time_per_token_s": sum(r["decode_s"] for r in runs) / max(steps, 1),
            "exact_time_per_token_s": sum(r["decode_s"] for r in exact) / max(steps, 1),
            "peak_device_bytes": eng.peak_device_bytes(),
            "counters": tot, "engine": eng.report(), "per_prompt": rows}


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    if (prompt is None) == (prompts_file is None):
        raise InputError("give exactly one of --prompt TEXT and --prompts FILE")
    if prompt is not None:
        return [prompt]
    p = Path(prompts_file)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--prompts {p}: cannot be read as UTF-8 text ({type(exc).__name__})") from None
    out = [ln for ln in lines if ln.strip()]
    if not out:
        raise InputError(f"--prompts {p}: no non-empty lines (one prompt per line)")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m runtime.tools.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", default=None)
    src.add_argument("--prompts", default=None, help="text file, one prompt per line")
    p.add_argument("--policy", required=True, help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--max-new-tokens", type=int, default=32)
    # the run-field table's rows (runtime/core/spec.py): --capacity C or C0,C1,..., --capacity-fraction, --vram-budget,
    # --device, --dtype, --max-memory, --host-store, --calib-text
    add_run_flags(p, ("engine",), only=(*SIZE_FIELDS, "device", "dtype", "max_memory_GiB", "host_store", "calib_text"),
                  size_default=f"--capacity-fraction {DEFAULT_CAPACITY_FRACTION}")
    p.add_argument("--pageable", action="store_true", help="CUDA: keep the host store in pageable memory")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="CPU device mode: intra-op threads of the 'device'")
    p.add_argument("--out", default=None, help="write the JSON report here (atomically)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    prompts = read_prompts(a.prompt, a.prompts)
    if a.capacity is None and a.capacity_fraction is None and a.vram_budget is None:
        a.capacity_fraction = DEFAULT_CAPACITY_FRACTION
    if a.host_store not in HOST_STORES:
        raise InputError(f"--host-store = {a.host_store!r} must be one of {', '.join(HOST_STORES)}")
    if a.prefill_chunk < 1:
        raise InputError(f"--prefill-chunk = {a.prefill_chunk} must be >= 1")
    eng = load_engine(a.model, a.device, a.dtype, a.host_store, pinned=not a.pageable, max_memory=a.max_memory)
    try:
        with cpu_threads(eng.device, a.threads):
            res = run_generate(eng, prompts, a.policy, a.max_new_tokens, a.capacity, a.capacity_fraction,
                               a.vram_budget, a.calib_text, a.prefill_chunk)
    finally:
        eng.close()
    text = json.dumps(res, indent=2)
    if a.out:
        atomic_write(a.out, lambda tmp: Path(tmp).write_text(text + "\n"))
    if a.json:
        print(text)
    else:
        for r in res["per_prompt"]:
            print(f"prompt {r['prompt']}: agreement {r['agreement']:.3f}  first divergence "
                  f"{r['first_divergence'] if r['first_divergence'] is not None else '-'}  "
                  f"{r['time_per_token_s'] * 1e3:.2f} ms/token (exact {r['exact_time_per_token_s'] * 1e3:.2f})")
        print(f"{res['policy']}: agreement {res['agreement']:.3f} over {res['prompts']} prompts, "
              f"{res['identical_prompts']} identical, {res['time_per_token_s'] * 1e3:.2f} ms/token, "
              f"peak device {res['peak_device_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    engine_cli(main)
