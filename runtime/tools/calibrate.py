"""Calibrate the cost model on this host: measure the engine's primitives and write a HostProfile YAML.

`python -m runtime.tools.calibrate --model DIR --out host.yaml [--device cpu|cuda] [--dtype auto|bf16|fp32] [--max-memory GIB]`

Measured with the engine itself (runtime/backends/engine/core.py), at the model's shape and dtype, means of
`--repeats` runs (means, like the engine's time per token, so both see a shared host's average load):
- link bandwidth host -> device for a large buffer, from pinned and from pageable host memory
  (CPU device mode: host -> host tensor copies; there is no pinned memory, both figures are plain
  memcpy bandwidth);
- one synchronous expert fetch, isolated (the engine's fetch path, host store -> slot, synchronised)
  and *in context*: a fetch-every-miss decode with k slots minus the substitute-all decode, per
  fetch (both report; the in-context one sets `link_latency_us` when it lies within 0.25x-4x of
  the isolated one, else it is taken for noise and the isolated one is used, with a warning);
- how long a "non-blocking" copy holds the issuing thread, from pinned and from pageable memory;
- the final norm + LM head once (`head_us`);
- one expert computed from its packed 4-bit copy (group 64: dequantize on the device, then compute),
  when the `hqq` quantizer is installed (`lowbit_expert_us`, used for every bit width);
- one expert computed on the device from a slot, and on the host from the host store (CUDA: with
  the activation's round trip), batch 1;
- the dense time per layer *in context*: a teacher-forced decode with k slots per layer under
  substitute-all (exactly k device experts per token-layer, nothing copied), minus L * k device expert
  times and the head, divided by the layers. It includes attention, norms, router, shared experts, the LM head, the
  engine's per-layer bookkeeping (kernel call, decisions) and what streaming the experts' weights
  through the CPU caches costs the rest. The same decode with the expert math switched off
  (`Engine.null_compute`) is reported as `dense_isolated_layer_us` (and used if the difference is not
  positive).

The profile's calibrated fields (`device_expert_us`, `host_expert_us`, `dense_layer_us`) replace the
cost model's formulas; `link_latency_us` is set so that the cost model's fetch time for this model's
shape (runtime.formats.costmodel.expert_bytes, bf16) equals the measured fetch. The profile is therefore only
meaningful for this model and dtype: `python -m runtime.simulate --host host.yaml --model-shape DIR/config.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from runtime.backends.engine import Engine, cpu_threads, engine_cli, load_engine
from runtime.backends.engine.plan import expert_forward
from runtime.backends.hfmodel import add_model_flags
from runtime.core.errors import ArgumentParser, InputError
from runtime.core.kernel import PolicyCache
from runtime.core.policy import PRESETS
from runtime.formats import costmodel

log = logging.getLogger(__name__)

# the in-context fetch is used when it lies within this band around the isolated one (else: noise)
FETCH_CONTEXT_BAND = (0.25, 4.0)
LOWBIT_BITS, LOWBIT_GROUP = 4, 64  # the low-bit expert time is measured at these (HostProfile.lowbit_expert_us)


def _mean_s(fn, repeats: int, sync, inner: int = 1, clock=time.perf_counter) -> float:
    """Mean over `repeats` of the time of `inner` calls of fn (synchronised), per call, in seconds.

    The mean, like the engine's time per token (total / tokens): on a shared host both then see the
    same average load (the minimum of short bursts would see the quietest moments only)."""
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(inner):
            fn()
        sync()
        out.append((clock() - t0) / inner)
    return sum(out) / len(out)


def link_bandwidth(device: torch.device, nbytes: int, repeats: int, clock=time.perf_counter) -> dict:
    """Host -> device copy bandwidth (GB/s) of an `nbytes` buffer from pinned and pageable memory."""
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    pinned = pageable.pin_memory() if cuda else pageable
    res = {}
    for name, src in (("pinned", pinned), ("pageable", pageable)):
        s = _mean_s(lambda src=src: dst.copy_(src, non_blocking=True), repeats, sync, clock=clock)
        res[f"{name}_GBps"] = nbytes / s / 1e9
        # how long the issuing thread is held by a "non-blocking" copy: ~0 from pinned memory on CUDA; the
        # whole copy from pageable memory (CUDA stages it synchronously), so such copies are not background
        issue = []
        for _ in range(max(2, repeats)):
            sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            issue.append(time.perf_counter() - t0)
        sync()
        res[f"{name}_issue_us"] = sum(issue) / len(issue) * 1e6
        res[f"{name}_issue_fraction"] = (sum(issue) / len(issue)) / s
    res["pinned_available"] = cuda
    return res


def _head_modules(model) -> tuple:
    """(final norm, LM head) of a causal LM (transformers' `model.norm` and `lm_head`), or None."""
    inner = getattr(model, "model", None)
    norm, head = getattr(inner, "norm", None), getattr(model, "lm_head", None)
    return (norm, head) if norm is not None and head is not None else None


@torch.inference_mode()
def calibrate(eng: Engine, repeats: int = 20, tokens: int = 48, link_mib: int = 64, seed: int = 0,
              windows_n: int = 3) -> tuple:
    """Measure this host with `eng`; returns (HostProfile, details dict)."""
    m, L, E, k = eng.m, eng.L, eng.E, eng.k
    sync = eng.sync
    link = link_bandwidth(eng.device, link_mib * 2**20, max(3, repeats // 4), eng.clock)
    # a bound run: k slots per layer, substitute-all -> every call computes from a slot, no copies
    cache = PolicyCache(PRESETS["substitute-all"], E, k, np.full(L, k), [np.arange(k)] * L)
    eng.bind(cache)
    rng = np.random.default_rng(seed)
    cycle = iter(range(1 << 30))

    def fetch():
        i = next(cycle)
        eng.runner.fetch(i % L, (i // L) % E, 0)

    fetch_s = _mean_s(fetch, repeats, sync, clock=eng.clock)  # isolated: copy + synchronize
    eng.bind(cache)  # restore slot 0 of every layer
    x = torch.randn(1, eng.H, dtype=eng.dtype, device=eng.device)
    w = torch.tensor(0.5, dtype=eng.dtype, device=eng.device)
    out = torch.zeros(eng.H, dtype=eng.dtype, device=eng.device)
    # cycle over the L * k slots and the L * E host experts, as a decode touches each expert once per token
    # (a hot loop over one expert would measure it from the CPU caches)

    def dev():
        i = next(cycle)
        buf = eng.pool.slots[i % L][(i // L) % k]
        out.add_((expert_forward(x, buf.gate_up, buf.down, eng.act[0]) * w)[0])

    def host():  # as the engine does it: the activation to the host, the expert there, the result back
        i = next(cycle)
        y = eng.runner.host_expert(i % L, (i // L) % E, x.to("cpu"))
        out.add_((eng.runner.result_to_device(y) * w)[0])

    dev_s = _mean_s(dev, repeats, sync, inner=L * k, clock=eng.clock)
    host_s = _mean_s(host, repeats, sync, inner=L * k, clock=eng.clock)
    lowbit_s = None
    try:  # one expert from its packed 4-bit copy (group 64): dequantize on the device + compute; the copies of
        # k experts per layer (quantized on the host: L * k, not L * E), cycled over as the slots are
        eng.runner.build_lowbit(LOWBIT_BITS, LOWBIT_GROUP, experts=k)
    except InputError as exc:
        log.warning("no low-bit calibration: %s", exc)
    else:
        def low():
            i = next(cycle)
            out.add_((eng.runner.lowbit_expert(i % L, (i // L) % k, x) * w)[0])

        lowbit_s = _mean_s(low, repeats, sync, inner=L * k, clock=eng.clock)
        eng.bind(cache)  # the low-bit copies leave the device again
    head_s = 0.0
    hm = _head_modules(m.model)
    if hm is not None:
        h = torch.randn(1, 1, eng.H, dtype=eng.dtype, device=eng.device)
        head_s = _mean_s(lambda: hm[1](hm[0](h)), repeats, sync, inner=4, clock=eng.clock)
    tiny = (torch.randn(1, 8, dtype=eng.dtype, device=eng.device), torch.randn(2, 8, dtype=eng.dtype, device=eng.device),
            torch.randn(8, 1, dtype=eng.dtype, device=eng.device))
    dev_over = _mean_s(lambda: expert_forward(tiny[0], tiny[1], tiny[2], eng.act[0]), repeats, sync, inner=8, clock=eng.clock)
    host_over = _mean_s(lambda: expert_forward(tiny[0].cpu(), tiny[1].cpu(), tiny[2].cpu(), eng.act[0]), repeats,
                          lambda: None, inner=8)
    vocab = min(int(m.model.config.vocab_size), len(m.tokenizer))
    W = max(4, min(tokens, int(getattr(m.model.config, "max_position_embeddings", tokens))))
    windows = rng.integers(0, vocab, size=(1 + windows_n, W)).astype(np.int64)  # the first one warms up
    full_s, isolated_s, fetch_decode_s, nf = _decode_times(eng, windows)
    fetch_ctx_s = (fetch_decode_s - full_s) / nf if nf > 0 else float("nan")
    if not FETCH_CONTEXT_BAND[0] * fetch_s <= fetch_ctx_s <= FETCH_CONTEXT_BAND[1] * fetch_s:
        # the difference of two decodes is noise when fetches are a small part of them (a loaded host)
        log.warning("fetch in context %.3g s is outside [%g, %g] x the isolated fetch %.3g s (noise): using the "
                    "isolated one", fetch_ctx_s, *FETCH_CONTEXT_BAND, fetch_s)
        fetch_used_s = fetch_s
    else:
        fetch_used_s = fetch_ctx_s
    dense_s = (full_s - L * k * dev_s - head_s) / L  # the dense part in context (caches shared with the experts)
    if dense_s <= 0:
        log.warning("dense time per layer in context measured <= 0 (%.3g s): using the isolated %.3g s",
                    dense_s, isolated_s)
        dense_s = isolated_s
    shape_bytes, shape_note = _shape_bytes(eng)
    latency_s = max(fetch_used_s - shape_bytes / (link["pinned_GBps"] * 1e9), 1e-8)
    dev_name, vram = _device_name_and_memory(eng)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    details = {"link": link, "fetch_us": fetch_used_s * 1e6, "fetch_isolated_us": fetch_s * 1e6,
               "fetch_in_context_us": fetch_ctx_s * 1e6 if fetch_ctx_s == fetch_ctx_s else None, "fetch_every_miss_time_per_token_us": fetch_decode_s * 1e6,
               "fetches_per_token": nf, "head_us": head_s * 1e6,
               "lowbit_expert_us": None if lowbit_s is None else lowbit_s * 1e6, "device_expert_us": dev_s * 1e6, "host_expert_us": host_s * 1e6,
               "dense_layer_us": dense_s * 1e6, "dense_isolated_layer_us": isolated_s * 1e6,
               "all_device_time_per_token_us": full_s * 1e6,
               "device_overhead_us": dev_over * 1e6, "host_overhead_us": host_over * 1e6,
               "expert_bytes_engine": eng.expert_bytes, "expert_bytes_cost_model": shape_bytes, "dtype": str(eng.dtype),
               "device": str(eng.device), "model": str(m.model_dir), "layers": L, "experts": E, "top_k": k}
    prof = costmodel.HostProfile(
        name=f"calibrated-{platform.node() or 'host'}-{eng.device.type}", gpu=dev_name,
        link_GBps=link["pinned_GBps"], link_pageable_GBps=link["pageable_GBps"], link_latency_us=latency_s * 1e6,
        device_mem_GBps=eng.expert_bytes / dev_s / 1e9, device_overhead_us=dev_over * 1e6,
        host_mem_GBps=eng.expert_bytes / host_s / 1e9, host_overhead_us=host_over * 1e6,
        device_expert_us=dev_s * 1e6, host_expert_us=host_s * 1e6, dense_layer_us=dense_s * 1e6,
        head_us=head_s * 1e6 if head_s > 0 else None,
        lowbit_expert_us=None if lowbit_s is None else lowbit_s * 1e6, vram_GiB=vram,
        sources=(f"measured by runtime.tools.calibrate on {when}, model {m.model_dir} ({eng.dtype}, L={L}, E={E}, k={k}), "
                 f"device {eng.device}, means of {repeats} runs",
                 f"link: {link_mib} MiB host->device copies; pinned memory {'used' if link['pinned_available'] else 'not available (CPU device mode): both figures are plain memcpy'}",
                 f"link_latency_us = measured expert fetch in context ({fetch_used_s * 1e6:.1f} us: fetch-every-miss "
                 f"minus substitute-all decode per fetch; isolated copy + synchronize {fetch_s * 1e6:.1f} us; "
                 f"{eng.expert_bytes} B) minus "
                 f"{shape_bytes} B ({shape_note}) / link_GBps",
                 "device_mem_GBps / host_mem_GBps: expert bytes / measured expert time (effective, overhead included)",
                 f"dense_layer_us: substitute-all decode with k slots ({full_s * 1e6:.1f} us/token) minus "
                 f"L*k*device_expert and head_us (final norm + LM head, {head_s * 1e6:.1f} us), / L (isolated, "
                 f"expert math off: {isolated_s * 1e6:.1f} us)"))
    return prof, details


def _decode_times(eng: Engine, windows: np.ndarray) -> tuple[float, float, float, float]:
    """(substitute-all decode s/token, isolated dense s/layer, fetch-every-miss decode s/token, fetches/token)
    over `windows` [1 + n, W] (the first warms up)."""
    m, L, E, k = eng.m, eng.L, eng.E, eng.k
    # decode with k slots under substitute-all: exactly k device experts per token-layer and no copies;
    # once as it is, once with the expert math switched off, and once under fetch-every-miss (the same k
    # device experts per token-layer, plus a synchronous fetch for every miss), alternating, to share the
    # host's load. The fetch-every-miss decode minus the substitute-all decode, per fetch, is the fetch
    # *in context*: what a fetch adds to a decode, overlapping the host's launches of the rest of the layer
    per_tok: dict[str, list[float]] = {"full": [], "null": [], "fetch": []}
    fetches_per_tok: list[float] = []
    pol = {"full": PRESETS["substitute-all"], "null": PRESETS["substitute-all"], "fetch": PRESETS["fetch-every-miss"]}
    try:
        for r in range(windows.shape[0]):
            for what in ("full", "null", "fetch"):
                eng.runner.null_compute = what == "null"
                cache = PolicyCache(pol[what], E, k, np.full(L, k), [np.arange(k)] * L)
                _, rep = eng.teacher_forced(m, windows[r : r + 1], cache)
                if r > 0:
                    per_tok[what].append(rep["time_per_token_s"])
                    if what == "fetch":
                        fetches_per_tok.append(cache.counter_totals()["fetches"] / windows.shape[1])
    finally:
        eng.runner.null_compute = False
    full_s = sum(per_tok["full"]) / len(per_tok["full"])
    isolated_s = sum(per_tok["null"]) / len(per_tok["null"]) / L
    fetch_decode_s = sum(per_tok["fetch"]) / len(per_tok["fetch"])
    nf = sum(fetches_per_tok) / len(fetches_per_tok)
    return full_s, isolated_s, fetch_decode_s, nf


def _device_name_and_memory(eng: Engine) -> tuple[str, float]:
    """The device's name and its memory in GiB (CPU device mode: the host's processor and RAM)."""
    if eng.cuda:
        return (torch.cuda.get_device_name(eng.device),
                torch.cuda.get_device_properties(eng.device).total_memory / 2**30)
    name = f"CPU device mode ({platform.processor() or platform.machine()}, {torch.get_num_threads()} intra-op threads)"
    return name, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _shape_bytes(eng: Engine) -> tuple[int, str]:
    """Bytes of one expert as the cost model counts it for this model (bf16 shape from config.json)."""
    try:
        shape = costmodel.model_shape_from_hf_config(eng.m.model.config.to_dict(), name=str(eng.m.model_dir))
        return costmodel.expert_bytes(shape), "the cost model's bf16 expert bytes for this shape"
    except InputError as exc:
        log.warning("no cost-model shape for this model (%s): latency from the engine's expert bytes", exc)
        return eng.expert_bytes, "the engine's expert bytes"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m runtime.tools.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="HostProfile YAML to write (atomically)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    add_model_flags(p, "the dtype the engine will run in")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tokens", type=int, default=48, help="decoded tokens per dense-time window")
    p.add_argument("--link-mib", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="CPU device mode: intra-op threads of the 'device'")
    p.add_argument("--pageable", action="store_true", help="CUDA: host store in pageable memory")
    p.add_argument("--clock", default="wall", choices=["wall", "thread"],
                   help="thread: the main thread's CPU time (CPU device mode only)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    for flag, v in (("--repeats", a.repeats), ("--tokens", a.tokens), ("--link-mib", a.link_mib)):
        if v < 1:
            raise InputError(f"{flag} = {v} must be >= 1")
    eng = load_engine(a.model, a.device, a.dtype, pinned=not a.pageable, max_memory=a.max_memory)
    if a.clock == "thread":
        if eng.cuda:
            raise InputError("--clock thread is for CPU device mode only (--device cpu)")
        eng.clock = time.thread_time
    try:
        with cpu_threads(eng.device, a.threads):
            prof, details = calibrate(eng, a.repeats, a.tokens, a.link_mib)
    finally:
        eng.close()
    costmodel.save_host_profile(prof, a.out)
    if a.json:
        print(json.dumps(details, indent=2))
    # the one-line summary: on stdout, or beside the JSON on stderr (a log of the run shows what was measured)
    print(f"wrote {Path(a.out)}: link {details['link']['pinned_GBps']:.2f} GB/s pinned, "
          f"{details['link']['pageable_GBps']:.2f} GB/s pageable; fetch {details['fetch_us']:.1f} us, "
          f"expert {details['device_expert_us']:.1f} us device / {details['host_expert_us']:.1f} us host, "
          f"dense {details['dense_layer_us']:.1f} us per layer", file=sys.stderr if a.json else sys.stdout)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    engine_cli(main)
