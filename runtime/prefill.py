"""Exact expert compute through a double-buffered staging area: prefill and the engine's exact mode.

For a chunk of tokens at one MoE layer, every selected expert is computed exactly: a resident expert
reads its slot; the others stream host -> device through two staging buffers (pinned store on
CUDA), the copy of the next expert overlapping the compute of the current one (CUDA: copy stream +
events; CPU device mode: the engine's link thread). Tokens are accumulated in the Hugging Face
eager order (ascending expert id, then rank-major token order), so the result equals the model's.
The policy cache is not consulted or changed: after `prefill` decoding starts from the cache's
(warm) state.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from runtime.engine import Engine, expert_forward, forward_cached

log = logging.getLogger(__name__)


def stream_layer(eng: Engine, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact experts' output for x [N, H], selection ids [N, k] and gate weights w [N, k] -> [N, H].

    One device -> host read of the selection per call (which experts, which tokens); the token lists
    go back to the device in one pinned, asynchronous copy; no other synchronisation."""
    out = torch.zeros_like(x)
    ids_h = ids.cpu().numpy()  # [N, k]
    experts = np.unique(ids_h).tolist()  # ascending
    N, k = ids_h.shape
    # per expert, (token, rank) pairs in rank-major order, as the HF eager loop accumulates them
    pos_l, tok_l, bounds = [], [], [0]
    for e in experts:
        pos, tok = np.nonzero((ids_h == e).T)  # [k, N] mask: rank-major
        pos_l.append(pos)
        tok_l.append(tok)
        bounds.append(bounds[-1] + len(tok))
    idx = torch.from_numpy(np.concatenate([np.concatenate(tok_l), np.concatenate(pos_l)]).astype(np.int64))
    if eng.cuda:
        idx = idx.pin_memory().to(eng.device, non_blocking=True)
    M = bounds[-1]
    toks, poss = idx[:M], idx[M:]
    slots = {e: eng.resident_slot(layer, e) for e in experts}
    stream = [e for e in experts if slots[e] < 0]
    bufs = [eng.take_staging() for _ in range(min(2, len(stream)))]
    handles: list = [None, None]

    def issue(n: int) -> None:
        handles[n % 2] = eng.copy_async(layer, stream[n], bufs[n % 2], stream="copy")
        eng.stats["prefill_copies"] += 1

    if stream:
        issue(0)
    n = 0
    act = eng.act[layer]
    for a, e in enumerate(experts):
        if slots[e] >= 0:
            buf = eng.slots[layer][slots[e]]
        else:
            eng.wait_copy(handles[n % 2])
            buf = bufs[n % 2]
            if n + 1 < len(stream):
                issue(n + 1)  # into the other buffer, whose last reader (expert n-1) was marked below
        tok, pos = toks[bounds[a] : bounds[a + 1]], poss[bounds[a] : bounds[a + 1]]
        y = expert_forward(x[tok], buf.gate_up, buf.down, act) * w[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
        if slots[e] < 0:
            eng.mark_read(buf)  # the next copy into this buffer waits for this compute
            n += 1
    for b in bufs:
        eng.give_staging(b)
    return out


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
