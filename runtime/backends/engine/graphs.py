"""The decode step as segments around each MoE layer's host decision; on CUDA each segment one CUDA graph.

One decode step of batch 1 (teacher-forced evaluation, the engine's measured path) runs as S + 1
segments for S MoE layers, cut where the policy kernel decides on the host:

  segment 0:  embed, rotary, decoder layers up to MoE layer 0's router -> packed routing of layer 0
  host:       read layer 0's routing (one float32 read), the kernel's step, the copies it issues
  segment l:  MoE layer l-1's experts (ONE grouped call from the slot tensors, `grouped_masked`) and
              residual, the decoder layers up to MoE layer l's router -> packed routing of layer l
  ...
  segment S:  MoE layer S-1's experts and residual, the rest, final norm, lm_head -> logits

Each segment reads and writes only static tensors: the token and position, the attention mask, a
static KV cache (transformers' `StaticCache`, reset per window), the hidden state between segments,
per MoE layer its input, its packed routing and its plan row `[3, k]` float32 (slot, gate weight,
computed-on-device flag per rank: the host writes it, one host -> device copy) and the host or
low-bit experts' output (`extra`, zero unless the plan computed some). So on CUDA each segment is
captured once per binding (`torch.cuda.CUDAGraph`, one memory pool) and replayed; eagerly it is the
same code, which is what CPU device mode and `no_cuda_graphs` run. Inside a decoder layer the MoE
block's routed experts return zeros (the adapters hand the routing to `StepProgram.routed`); their
output joins the residual in the next segment: `h + (experts + extra)`, which for a block without
shared experts is the model's own sum, bit for bit (adding 0 changes nothing).

A family has a capture plan when every decoder layer's attention is full or sliding-window causal
(`capture_plan`): qwen3_next's linear-attention layers keep their own recurrent cache, so that
family decodes through the Hugging Face forward (`Engine.teacher_forced` says which path ran).
"""

from __future__ import annotations

import functools
import inspect
import logging

import numpy as np
import torch
from torch import nn

from runtime.backends.engine.plan import Staged, grouped_masked
from runtime.core.errors import InputError
from runtime.core.kernel import EV_DEV, PolicyCache, StepResult, decide, drop_renorm_scale

log = logging.getLogger(__name__)

MASK_KINDS = ("full_attention", "sliding_attention")


@functools.cache
def kv_cache_kwarg(cls: type) -> str:
    """The name a model class's forward gives its KV cache argument (and its output's field):
    transformers >= 5.2x `cache`, earlier 5.x `past_key_values`."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def mask_cache_kwarg(fn) -> str:
    """The name transformers' mask function `fn` (masking_utils.create_causal_mask and kin) gives its cache
    argument, read from the installed function's signature: `cache` (transformers >= 5.2x) or
    `past_key_values` (earlier 5.x, e.g. 5.17). Both accepted: `cache`."""
    params = inspect.signature(fn).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{getattr(fn, '__qualname__', fn)}: neither `cache` nor `past_key_values` in its signature "
                    f"{list(params)}")


# RoPE types whose inv_freq depends on the position reached (a host branch on a value): capture would freeze one
VALUE_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_types(config) -> set[str]:
    """Every RoPE type the config names (rope_parameters / rope_scaling, flat or per layer type)."""
    out: set[str] = set()
    for attr in ("rope_parameters", "rope_scaling"):
        v = getattr(config, attr, None)
        if not isinstance(v, dict):
            continue
        for d in [v, *[x for x in v.values() if isinstance(x, dict)]]:
            t = d.get("rope_type", d.get("type"))
            if isinstance(t, str):
                out.add(t)
    return out


def graph_refusal(config, n_layers: int) -> str | None:
    """Why the segments of a model with `config` (and `n_layers` decoder layers) must not be captured as CUDA
    graphs (a capture records one branch of a Python test on values, and replays it forever), or None:
    sliding-window attention (the static cache's sliding layers branch on whether the window is full), a
    RoPE whose frequencies depend on the position (dynamic, longrope: a host sync and a branch per step).
    Such a family decodes the same segments eagerly (`Engine.decode_path` says why)."""
    why = []
    sliding = [i for i in range(n_layers) if mask_kind(config, i) == "sliding_attention"]
    if sliding:
        why.append(f"sliding-window attention in {len(sliding)} of {n_layers} layers (the cache branches on is_full)")
    rope = sorted(rope_types(config) & set(VALUE_DEPENDENT_ROPE))
    if rope:
        why.append(f"RoPE type {', '.join(rope)} (its frequencies branch on the position)")
    return "; ".join(why) or None


def mask_kind(config, i: int) -> str:
    """The attention mask decoder layer i takes: the config's `layer_types[i]`, else sliding-window causal when
    the config sets `sliding_window` (the Qwen3-MoE / Mixtral models' own rule), else full causal."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return types[i]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def capture_plan(model: nn.Module) -> str | None:
    """None when `model` (a causal LM with `.model.layers`) decodes as segments; else why not (one line)."""
    base = getattr(model, "model", None)
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, a) for a in need) or not hasattr(model, "lm_head"):
        return f"model_type {model.config.model_type!r}: no embed / layers / norm / rotary / lm_head to run as segments"
    kinds = {mask_kind(model.config, i) for i in range(len(base.layers))}
    if not kinds <= set(MASK_KINDS):
        return (f"model_type {model.config.model_type!r}: layer types {sorted(kinds - set(MASK_KINDS))} have no static "
                "KV cache (linear attention keeps a recurrent state)")
    return None


def _current_stream(device: torch.device):
    """The current CUDA stream of `device` (None off CUDA)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _set_stream(stream) -> None:
    """Make `stream` current again (nothing off CUDA)."""
    if stream is not None:
        torch.cuda.set_stream(stream)


def capture_failure(exc: BaseException) -> str:
    """One line saying why a capture failed: torch's generic capture error ("operation failed due to a previous
    error during capture", ...) last, the exceptions it was raised during or from (`__context__` /
    `__cause__`: the op that failed) first, the first line of each, innermost first."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    parts = [f"{type(x).__name__}: {str(x).splitlines()[0] if str(x) else ''}".strip() for x in reversed(chain)]
    return " <- ".join(parts)[:400]


class StepProgram:
    """The segmented decode step of one engine binding (see the module doc). `runner`: the engine's
    PlanRunner (its pool's slot tensors are read by the segments, so a new binding builds a new program);
    `W`: the longest window (the static cache's length); `capture`: record each segment as a CUDA graph."""

    def __init__(self, model: nn.Module, ctx, runner, W: int, capture: bool) -> None:
        from transformers import StaticCache
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        self.model, self.base, self.ctx, self.runner, self.W = model, model.model, ctx, runner, int(W)
        self.device, self.cuda, self.dtype = runner.device, runner.cuda, runner.dtype
        cfg = model.config
        self.layers = list(self.base.layers)
        self.S = len(ctx.experts)
        self.k = int(cfg.num_experts_per_tok)
        H = int(cfg.hidden_size)
        # the decoder layer holding each MoE layer's experts, and the segments' decoder-layer ranges
        owner = []
        for pe in ctx.experts:
            owner.append(next(i for i, lay in enumerate(self.layers) if any(m is pe for m in lay.modules())))
        bounds = [0, *[o + 1 for o in owner], len(self.layers)]
        self.ranges = [(bounds[j], bounds[j + 1]) for j in range(self.S + 1)]  # segment j: decoder layers [a, b)
        self.kinds = [mask_kind(cfg, i) for i in range(len(self.layers))]
        self.cache_kw = kv_cache_kwarg(type(self.layers[0]))
        dev = self.device
        self.cache = StaticCache(config=cfg, max_cache_len=self.W)
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.h = torch.zeros(1, 1, H, dtype=self.dtype, device=dev)  # the hidden state between segments
        self.x = [torch.zeros(1, H, dtype=self.dtype, device=dev) for _ in range(self.S)]  # MoE inputs
        self.packed: list[torch.Tensor | None] = [None] * self.S  # [1, P_l] float32, sized by the first call
        self.packed_host: list[torch.Tensor | None] = [None] * self.S
        self.packed_np: list[np.ndarray | None] = [None] * self.S  # the host views read() returns
        host_plans = torch.zeros(self.S, 3, self.k, dtype=torch.float32, pin_memory=self.cuda)
        self.staged = [Staged(host_plans[l_], torch.zeros(1, H, dtype=self.dtype, device=dev)) for l_ in range(self.S)]
        self.plan_dev = [p.plan.to(dev) if self.cuda else p.plan for p in self.staged]  # [3, k] each
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) of this position
        self.logits: torch.Tensor | None = None  # [1, V]
        self.events = [torch.cuda.Event() for _ in range(self.S)] if self.cuda else []
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.masks: dict[str, torch.Tensor | None] = {}
        self.mask_table: dict[str, torch.Tensor | None] = {}
        # one eager pass (no decisions: every rank's flag is 0) sizes the buffers and initialises the cache
        ctx.step = self  # the adapters hand each MoE layer's routing to `routed` (the engine unsets it after the run)
        self.begin()
        self._run_segments()
        self.fused = OneCall.build(self)  # the host decision in one compiled call, or None
        self._build_masks(create_causal_mask, create_sliding_window_causal_mask, H)
        self.capture_error = ""  # why capturing failed (the segments then run eagerly), or ""
        self.refused = graph_refusal(cfg, len(self.layers)) if capture else None  # why not captured at all, or None
        if capture and self.refused:
            log.warning("CUDA graphs refused (%s); decoding the same segments eagerly", self.refused)
        elif capture:
            prev = _current_stream(self.device)  # the stream to return to, whatever the capture leaves current
            try:
                self._capture()
            except RuntimeError as exc:  # e.g. a host synchronisation inside a module: say so, decode eagerly
                self.graphs = []
                self.capture_error = capture_failure(exc)
                _set_stream(prev)  # torch's graph context leaves the capture stream current when capture_end raises
                log.warning("CUDA graph capture failed (%s); decoding the same segments eagerly", self.capture_error)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
        self.begin()

    def _build_masks(self, full, sliding, H: int) -> None:
        """The attention mask of every position 0..W-1 and mask kind, from the model's own mask functions:
        they read how many tokens the cache holds, so the cache is filled one position at a time (zeros,
        through `Cache.update`) and emptied after."""
        fns = {"full_attention": full, "sliding_attention": sliding}
        cfg, dev = self.model.config, self.device
        emb = torch.zeros(1, 1, H, dtype=self.dtype, device=dev)
        kv = [(torch.zeros_like(lay.keys[:, :, :1]), torch.zeros_like(lay.values[:, :, :1])) for lay in self.cache.layers]
        rows: dict[str, list] = {kind: [] for kind in set(self.kinds)}
        self.begin()
        for t in range(self.W):
            for kind in rows:
                rows[kind].append(fns[kind](config=cfg, inputs_embeds=emb, attention_mask=None,
                                            position_ids=torch.tensor([[t]], device=dev),
                                            **{mask_cache_kwarg(fns[kind]): self.cache}))
            for i, (k_, v_) in enumerate(kv):
                self.cache.update(k_, v_, i)
        for kind, r in rows.items():
            self.mask_table[kind] = None if r[0] is None else torch.stack(r)  # [W, ...]
            self.masks[kind] = None if r[0] is None else r[0].clone()
        self.begin()

    # ------------------------------------------------------------------ the parts

    def routed(self, layer: int, hidden: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """The adapters' hook inside a segment: keep MoE layer `layer`'s input [1, H] and packed routing; its
        routed experts contribute 0 here (they join in the next segment)."""
        self.x[layer].copy_(hidden)
        if self.packed[layer] is None:
            self.packed[layer] = torch.empty_like(packed)
            self.packed_host[layer] = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=self.cuda)
        self.packed[layer].copy_(packed)
        return torch.zeros_like(hidden)

    def _segment(self, j: int) -> None:
        base = self.base
        if j == 0:
            h = base.embed_tokens(self.tok)  # [1, 1, H]
            cos, sin = base.rotary_emb(h, self.pos)
            if self.rope is None:
                self.rope = (torch.empty_like(cos), torch.empty_like(sin))
            self.rope[0].copy_(cos)
            self.rope[1].copy_(sin)
        else:
            l_ = j - 1
            pool = self.runner.pool
            if pool.gate_up[l_].shape[0]:
                y = grouped_masked(pool.gate_up[l_], pool.down[l_], self.x[l_], self.plan_dev[l_],
                                   self.runner.act[l_], self.dtype)  # [1, H]
                h = self.h + (y + self.staged[l_].extra).view_as(self.h)
            else:  # a layer with no device slots (llama.cpp's -ncmoe host layers): its experts are all in `extra`
                h = self.h + self.staged[l_].extra.view_as(self.h)
        a, b = self.ranges[j]
        for i in range(a, b):
            h = self.layers[i](h, attention_mask=self.masks.get(self.kinds[i]), position_ids=self.pos,
                               use_cache=True, position_embeddings=self.rope, **{self.cache_kw: self.cache})
        if j < self.S:
            self.h.copy_(h)
            return
        logits = self.model.lm_head(base.norm(h))[:, -1]  # [1, V]
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        self.logits.copy_(logits)

    def _capture(self) -> None:
        """Each segment as one CUDA graph (after the eager pass above: lazy initialisations done), one pool."""
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):  # warm-up on a side stream, as torch.cuda.graphs asks
            self.begin()
            self._run_segments()
        torch.cuda.current_stream(self.device).wait_stream(s)
        self.begin()
        pool = torch.cuda.graph_pool_handle()
        for j in range(self.S + 1):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):  # checks this thread
                self._segment(j)
            self.graphs.append(g)
        log.info("CUDA graphs: %d segments captured (%d MoE layers)", len(self.graphs), self.S)

    def _run_segments(self) -> None:
        for j in range(self.S + 1):
            self._segment(j)

    # ------------------------------------------------------------------ a step

    def begin(self) -> None:
        """A new window: the static KV cache emptied in place (its addresses stay: the graphs read them); room
        for its W tokens' kernel events."""
        self.cache.reset()
        self.runner.reserve_events(self.W)

    def step(self, token: torch.Tensor, t: int) -> torch.Tensor:
        """Token [1, 1] on the device at position t of the window -> logits [1, V] (a static buffer: copy it
        before the next step)."""
        self.tok.copy_(token)
        self.pos.fill_(t)
        for kind, m in self.masks.items():
            if m is not None:
                m.copy_(self.mask_table[kind][t])
        for j in range(self.S + 1):
            if self.graphs:
                self.graphs[j].replay()
            else:
                self._segment(j)
            if j < self.S:
                self._decide(j)
        return self.logits

    def read(self, layer: int) -> np.ndarray:
        """MoE layer `layer`'s packed routing on the host, [1, 2k + E + 1 (+ E')] float32: the step's ONE device ->
        host read of the layer (CUDA: into a pinned buffer, waited for on an event; CPU device mode: as is).
        The host view is made once per layer (its buffer's address never changes)."""
        if self.cuda:
            self.packed_host[layer].copy_(self.packed[layer], non_blocking=True)
            self.events[layer].record()
            self.events[layer].synchronize()
        return self.read_view(layer)

    def read_view(self, layer: int) -> np.ndarray:
        """The host buffer `read` fills for MoE layer `layer` [1, P] float32 (its view made once)."""
        if self.packed_np[layer] is None:
            self.packed_np[layer] = (self.packed_host if self.cuda else self.packed)[layer].numpy()
        return self.packed_np[layer]

    def _decide(self, layer: int) -> None:
        """Between segments: MoE layer `layer`'s routing read (one float32 copy), the kernel's step, the plan
        applied (copies, host and low-bit experts into `extra`), the plan row to the device. With `fused`
        (runtime/core/kernel/decide.py) the read row goes to the plan row in one compiled call, and Python
        only copies the fetched experts, unless the plan holds more (then `PlanRunner.apply`, as below)."""
        st = self.staged[layer]
        st.begin()
        if self.fused is not None and self.fused.ready():
            self.read(layer)  # into the host row the compiled call reads
            self.fused.decide(layer, self.x[layer], st)
        else:
            d = self.ctx.experts[layer].decide(self.read(layer), self.k, self.dtype)
            self.runner.apply(layer, self.x[layer], d.weights, d.res, staged=st)
        if self.cuda:
            self.plan_dev[layer].copy_(st.plan, non_blocking=True)


class OneCall:
    """The host decision of one MoE layer and token in one compiled call (`decide.decide_row`) over buffers made
    once per program: the packed routing row -> the kernel's decisions, events and plan row; Python then
    copies the fetched experts, or, when the plan holds admissions, queued or prefetch copies, host or low-bit
    experts or a drop under drop_renorm, hands the same outputs to `PlanRunner.apply` (exactly what the
    step-by-step path does with them). `build` returns None where it does not apply (a recording, a policy
    that prefetches or routes toward residents, a model dtype without its rounding): that run decides step by
    step."""

    def __init__(self, ctx, runner, S: int, k: int, E: int, dtype_name: str, packed: list[np.ndarray],
                 plans: list[np.ndarray]) -> None:
        self.ctx, self.runner, self.S, self.k, self.E = ctx, runner, S, k, E
        self.packed, self.plans = packed, plans  # per MoE layer: the host routing row [1, P], the plan row [3, k]
        self.tab: np.ndarray | None = None  # decide_layer's address table (decide.address_table), per cache
        self.tab_ev = None  # the event table the address table points at
        b = decide.decide_buffers(1, k, E, dtype_name, cap=1)
        self.tok, self.rnd, self.fetches = b.tok, b.rnd, b.fetches
        self.outs = [b.out] + [decide.decide_buffers(1, k, E, dtype_name, cap=1).out for _ in range(S - 1)]
        self.dtype = runner.dtype
        self.cache = None  # the PolicyCache the checks below were made for
        self.ok = self.drop_renorm = False
        self.n_fast = self.n_slow = 0  # decisions done in the call alone / handed on to PlanRunner.apply

    @classmethod
    def build(cls, prog: StepProgram) -> OneCall | None:
        """`prog`'s one-call decision (after its first eager pass: the routing rows exist), or None when the model
        dtype has no rounding here (float32, bfloat16, float16 have) or a row was not packed."""
        ctx, runner = prog.ctx, prog.runner
        name = str(runner.dtype).removeprefix("torch.")
        E = ctx.experts[0].num_experts if ctx.experts else 0
        if name not in decide.DTYPE_ROUNDING or E <= 0 or any(p is None for p in prog.packed):
            return None
        packed = [prog.read_view(l_) for l_ in range(prog.S)]
        return cls(ctx, runner, prog.S, prog.k, E, name, packed, [st.rows for st in prog.staged])

    def ready(self) -> bool:
        """Whether the context's cache (checked once per cache) decides through the one call: a cache of this
        program's layers and E, no prefetch (its predicted lists are the step-by-step path's), no recording."""
        c = self.ctx.cache
        if c is not self.cache:
            self.cache = c
            # cache-aware routing decides step by step: it rewrites the selection and its weights (StepResult.ids /
            # .weights) and reads up to route_window ranks, which the call's rank-ordered selection does not hold
            # llama.cpp's shared pool and layer split (runtime/core/llamacpp_cache.py) have no per-layer kernel
            # state for the call to address: they decide step by step
            self.ok = (isinstance(c, PolicyCache) and c.prefetch_width == 0 and c.L == self.S and c.E == self.E
                       and c.k == self.k and c.policy.route == "off")
            self.drop_renorm = bool(c is not None and c.policy.drop_renorm)
            if self.ok:
                for l_, o in enumerate(self.outs):  # each layer's last decision (views: rewritten per step)
                    self.ctx.last[l_] = {"kind": o.kind[0], "served": o.served[0]}
                r = self.runner
                self.tab = decide.address_table(c._state, c.next_t, self.tok, r.ev_tab, r.ev_n, self.fetches,
                                                list(zip(self.packed, self.plans, self.outs, strict=True)),
                                                c.params_array, decide.decide_consts(self.k, self.E, self.rnd,
                                                                                     self.drop_renorm))
                self.tab_ev = r.ev_tab
        if self.ok and self.runner.ev_tab is not self.tab_ev:  # the runner grew its event table
            self.tab_ev = self.runner.ev_tab
            decide.set_row(self.tab, decide.R_SHARED + 1, self.tab_ev)
        return self.ok and self.ctx.recorder is None

    def decide(self, layer: int, x: torch.Tensor, st: Staged) -> None:
        """MoE layer `layer`'s decision for the step's token from its packed routing row (read into the host
        buffer `packed[layer]` already), into `st` (whose plan row is `plans[layer]`)."""
        r, out = self.runner, self.outs[layer]
        n = decide.decide_layer(self.tab, layer)
        if n == decide.BAD_SCORES:
            raise InputError(f"router scores: non-finite value at MoE layer {layer}, token 0 of this batch")
        if self.ctx.decisions is not None:
            self.ctx.decisions[layer].append((out.kind[0].copy(), out.served[0].copy(), out.slot[0].copy()))
        cp = r.copies
        if n >= 0 and not cp.pending[layer] and not cp.prefetch[layer]:  # the plan is its fetches alone
            r.stats["device_computes"] += int(out.ev[0, 0, EV_DEV])
            for e, s in self.fetches[:n].tolist() if n else ():
                r.fetch(layer, e, s)
            if r.debug:
                r.pool.check(layer)
            self.n_fast += 1
            return
        self.n_slow += 1
        na, nq, npf = out.n_logs[0].tolist()
        ev = r.ev_tab[layer, r.ev_n[layer] - 1 : r.ev_n[layer]]
        res = StepResult(out.kind[0], out.served[0], out.slot[0], ev, out.adm_log[0, :na], out.q_log[0, :nq],
                         out.pf_log[0, :npf])
        w_np = self.tok.w[0].astype(np.float32)  # [1, k] rank order (float32 values: exact)
        w = torch.from_numpy(w_np).to(self.dtype)
        scale = drop_renorm_scale(res.kind, w_np) if self.drop_renorm else None
        if scale is not None:  # as PolicyExperts.decide: a dropped miss's weight shared out
            w = w * torch.from_numpy(scale).to(dtype=w.dtype)[:, None]
        r.apply(layer, x, w, res, staged=st, events_recorded=True)
