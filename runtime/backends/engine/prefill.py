"""Prefill: run a prompt exactly through the engine in chunks, before decoding under a policy.

With no policy cache attached, every MoE layer goes through the engine's exact streaming path
(`runtime.backends.engine.plan.stream_layer`: resident experts read their slots, the others stream host ->
device through two staging buffers, the next copy overlapping the current compute), so the
result equals the model's. The policy cache is not consulted or changed: after `prefill`
decoding starts from the cache's (warm) state.
"""

from __future__ import annotations

import torch

from runtime.backends.engine import Engine, forward_cached


@torch.inference_mode()
def prefill(eng: Engine, input_ids: torch.Tensor, chunk: int = 256, past=None):
    """Run prompt tokens [1, P] exactly in chunks of `chunk`; returns (last logits [V] on the host, KV cache)."""
    ctx = eng.m.ctx
    saved = ctx.cache
    ctx.cache = None
    out = None
    try:
        for a in range(0, input_ids.shape[1], chunk):
            out, past = forward_cached(eng.m.model, input_ids[:, a : a + chunk], past)
    finally:
        ctx.cache = saved
    if out is None:
        raise ValueError("prefill: empty prompt")
    return out.logits[0, -1], past
