"""Model adapters: put the policy kernel between a Hugging Face MoE router and its experts.

Every supported family (transformers 5.x) has a sparse block that calls
`router(x) -> (router_logits, weights, indices)` and then `experts(x, indices, weights)`.
`attach()` wraps both modules of every MoE layer: the router tap keeps the logits, the
experts wrapper sorts the selection by score (the spec's rank order), asks the shared
`PolicyCache` for the decisions of these tokens at this layer, and calls the original
experts module with the served experts and weights. The rest of the candidate ranking (the other
experts by descending score, ties lower id) goes to the kernel as the router scores themselves,
which it orders only as far as a substitution needs (no sort of E candidates per token); a
recording sorts it, to the trace's depth. Shared experts and their gates are
untouched. With no cache attached the wrapper is the identity (exact model), and it can
record the router's choices as a trace.

Decisions to tensors: HIT/FETCH/HOST compute the selected expert with `w_j` (exact); SUB
computes the substitute with `w_j` (or, with `substitute_weight="own"`, with the weight the
router would have given the substitute: `w_j * p[sub] / p[e_j]`); DROP computes nothing
(the slot's weight is 0); LOWBIT computes the missed expert from its low-precision copy
(runtime/backends/lowbit.py, built once per layer and (bits, group)) with `w_j`. With `drop_renorm` every computed
slot's weight of a token with drops is scaled by runtime.core.kernel.drop_renorm_scale (the engine's executor
gets the scaled weights too), so the dropped weight is shared out; no decision changes.

Prefetch: with `prefetch = lookahead` layer l forms the predicted list of layer l + 1 from layer
l + 1's router applied to layer l's router input (top prefetch_n by score, ties lower id) and the
kernel applies it before layer l + 1 decides the same tokens; with `oracle` each layer's own
selection is its predicted list (layer 0 none). The recorder writes the same lookahead lists
into a trace's lookahead column (`start_recording(depth, lookahead=P)`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from runtime.core.errors import InputError
from runtime.core.kernel import DROP, LOWBIT, SUB, PolicyCache, StepResult, drop_renorm_scale


@dataclass(frozen=True)
class Family:
    router_attr: str  # attribute of the sparse block holding the router
    experts_attr: str
    score: str  # how candidate scores derive from router_logits: softmax | sigmoid_bias
    weight_norm: str  # how the model's gate weights are normalised (trace metadata)
    experts_in_dim: int = -1  # input dim of each expert matrix: -1 for F.linear [out, in], -2 for x @ W [in, out]


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family("gate", "experts", "softmax", "softmax_all|topk"),
    "qwen2_moe": Family("gate", "experts", "softmax", "softmax_all|topk"),
    "qwen3_next": Family("gate", "experts", "softmax", "softmax_all|topk"),
    "mixtral": Family("gate", "experts", "softmax", "softmax_topk"),
    "olmoe": Family("gate", "experts", "softmax", "softmax_all|topk"),
    "deepseek_v3": Family("gate", "experts", "sigmoid_bias", "sigmoid_topk"),
    "gpt_oss": Family("router", "experts", "softmax", "softmax_topk", experts_in_dim=-2),
}


def family_of(config) -> Family:
    mt = getattr(config, "model_type", None)
    if mt not in FAMILIES:
        raise InputError(f"config.json: model_type = {mt!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[mt]


def weight_norm_of(config) -> str:
    fam = family_of(config)
    if "|" in fam.weight_norm:
        return "softmax_topk" if getattr(config, "norm_topk_prob", False) else "softmax_all"
    return fam.weight_norm


def moe_blocks(model: nn.Module, fam: Family) -> list[nn.Module]:
    """The sparse MoE blocks in layer order (modules holding both a router and an experts module)."""
    blocks = []
    for _, mod in model.named_modules():
        r, e = getattr(mod, fam.router_attr, None), getattr(mod, fam.experts_attr, None)
        if isinstance(r, nn.Module) and isinstance(e, nn.Module) and not isinstance(r, RouterTap):
            blocks.append(mod)
    return blocks


@dataclass
class Recorder:
    """Router choices as seen by the experts wrappers, per MoE layer, in stream order."""

    depth: int  # ranking depth M
    ids: list[list[np.ndarray]] = field(default_factory=list)  # [L] of list of [N, k]
    weights: list[list[np.ndarray]] = field(default_factory=list)
    ranking: list[list[np.ndarray]] = field(default_factory=list)
    lookahead_depth: int = 0  # P: also record the lookahead lists (0: no)
    lookahead: list[list[np.ndarray]] = field(default_factory=list)  # [L] of list of [N, P]
    keep_scores: bool = False  # also record every expert's router score (the trace's router_scores column)
    scores: list[list[np.ndarray]] = field(default_factory=list)  # [L] of list of [N, E] float32

    @classmethod
    def empty(cls, num_layers: int, depth: int, lookahead: int = 0, scores: bool = False) -> Recorder:
        """Record ids, weights, the ranking to `depth` and, when `lookahead` P > 0, the lookahead lists; with
        `scores` every expert's router score too."""
        L = num_layers
        return cls(depth, [[] for _ in range(L)], [[] for _ in range(L)], [[] for _ in range(L)], lookahead,
                   [[] for _ in range(L)], scores, [[] for _ in range(L)])

    def scores_array(self) -> np.ndarray | None:
        """float32 [T, L, E]: every expert's router score (None unless `keep_scores`)."""
        if not self.keep_scores:
            return None
        return np.stack([np.concatenate(x) for x in self.scores], axis=1).astype(np.float32)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids int32 [T, L, k], weights float32 [T, L, k], ranking int32 [T, L, M]."""
        cat = [np.stack([np.concatenate(x) for x in part], axis=1) for part in (self.ids, self.weights, self.ranking)]
        return cat[0].astype(np.int32), cat[1].astype(np.float32), cat[2].astype(np.int32)

    def lookahead_array(self) -> np.ndarray | None:
        """int32 [T, L, P]: on layer l's row layer l + 1's router on layer l's router input (last layer -1)."""
        if not self.lookahead_depth:
            return None
        return np.stack([np.concatenate(x) for x in self.lookahead], axis=1).astype(np.int32)


class Context:
    """What the wrappers share: the cache (None = exact model), the recorder, options."""

    def __init__(self, num_layers: int) -> None:
        self.cache: PolicyCache | None = None
        self.recorder: Recorder | None = None
        self.substitute_weight = "missed"
        self.num_layers = num_layers
        self.last: list[dict | None] = [None] * num_layers  # last step's decisions per layer (tests)
        # per layer, the (kind, served, slot) [N, k] of every step in stream order, when recording
        self.decisions: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] | None = None
        # engine hook (runtime/backends/engine/plan.py, PlanRunner.run_experts): executor(layer, hidden [N, H], ids [N, k], weights [N, k],
        # decisions: StepResult | None) computes the experts instead of the Hugging Face module
        self.executor = None
        # the engine's segmented decode step (runtime/backends/engine/graphs.py, StepProgram): when set, a MoE
        # layer hands its packed routing to it and returns; the decision comes between two segments
        self.step = None
        self.experts: list[PolicyExperts] = []  # the wrappers, in layer order
        # lookahead lists waiting for each layer's next steps, oldest first
        self.pending: list[deque[np.ndarray]] = [deque() for _ in range(num_layers)]
        self.lowbit_key: tuple[int, int] | None = None  # (bits, group) of the cached low-precision copies
        self.lowbit_modules: dict[int, nn.Module] = {}  # layer -> experts module holding dequantized copies

    def decision_arrays(self) -> dict[str, np.ndarray]:
        """The recorded decisions as {"kind", "served", "slot"}: int [T, L, k] each."""
        return decision_arrays(self.decisions)

    def start_recording(self, depth: int, lookahead: int = 0) -> Recorder:
        """Record ids, weights, the ranking to `depth` and, when `lookahead` P > 0, the lookahead lists."""
        self.recorder = Recorder.empty(self.num_layers, depth, lookahead)
        return self.recorder

    def lowbit_experts(self, layer: int, bits: int, group: int) -> nn.Module:
        """The experts module of `layer` with its low-precision copies (built once per (bits, group))."""
        from runtime.backends import lowbit

        if self.lowbit_key != (bits, group):
            self.lowbit_modules, self.lowbit_key = {}, (bits, group)
        if layer not in self.lowbit_modules:
            pe = self.experts[layer]
            self.lowbit_modules[layer] = lowbit.dequantized_experts(pe.experts, pe.num_experts, bits, group,
                                                                    pe.fam.experts_in_dim)
        return self.lowbit_modules[layer]


def decision_arrays(decisions: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]) -> dict[str, np.ndarray]:
    """Per-layer decision logs as {"kind", "served", "slot"}: int [T, L, k] each."""
    return {name: np.stack([np.concatenate([step[i] for step in per_layer]) for per_layer in decisions], axis=1)
            for i, name in enumerate(("kind", "served", "slot"))}


class RouterTap(nn.Module):
    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.router = router
        self.logits: torch.Tensor | None = None
        self.input: torch.Tensor | None = None  # the router's input (lookahead of the next layer)

    def forward(self, hidden_states):
        out = self.router(hidden_states)
        self.logits = out[0]
        self.input = hidden_states
        return out


@dataclass
class Decision:
    """One layer's host-side step (`PolicyExperts.decide`): the selection in rank order, its gate weights in
    the model's dtype (drop_renorm applied), the kernel's plan, the model-order -> rank-order permutation
    and the drop_renorm scale (None: no drop)."""

    ids: np.ndarray  # [N, k] int32, rank order
    weights: torch.Tensor  # [N, k] on the host, the model's dtype
    res: StepResult
    perm: np.ndarray  # [N, k]
    scale: np.ndarray | None  # [N]


class PolicyExperts(nn.Module):
    def __init__(self, experts: nn.Module, tap: RouterTap, layer: int, ctx: Context, fam: Family) -> None:
        super().__init__()
        self.experts, self.tap, self.layer, self.ctx, self.fam = experts, tap, layer, ctx, fam
        self.num_experts = 0  # E, known after the first call

    def next_layer_scores(self) -> torch.Tensor | None:
        """[N, E] float32 on the device: the next layer's router scores on this layer's router input (the
        lookahead's input; None for the last layer). Its top P by score, ties lower id, is the next layer's
        predicted list (`lookahead_lists`, on the host)."""
        if self.layer + 1 >= self.ctx.num_layers:
            return None
        nxt = self.ctx.experts[self.layer + 1]
        logits = nxt.tap.router(self.tap.input)[0]  # (the router itself: the tap keeps its own state)
        return nxt.scores(logits.reshape(-1, logits.shape[-1]))

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Candidate scores [N, E] whose order is the router's preference."""
        if self.fam.score == "sigmoid_bias":
            return logits.float().sigmoid() + self.tap.router.e_score_correction_bias
        return logits.float()

    def pack(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """What the host needs of this layer's routing, as ONE float32 device tensor [N, 2k + E + 1 (+ E')]:
        the model's top-k ids and weights, the router scores, a finiteness flag per token (1: every logit
        finite) and, with lookahead, the next layer's router scores. Exact in float32 for these ids, for
        fp32 / bf16 / fp16 weights and for the float32 scores; no float64 on the device."""
        N = top_k_index.shape[0]
        logits = self.tap.logits.reshape(N, -1)
        score = self.scores(logits)  # [N, E] float32
        self.num_experts = score.shape[1]
        nxt = self.next_layer_scores() if max(self.lookahead_widths()) else None  # [N, E'] or None
        parts = [top_k_index.float(), top_k_weights.detach().float(), score,
                 torch.isfinite(logits).all(dim=1, keepdim=True).float()]
        return torch.cat(parts if nxt is None else [*parts, nxt], 1)

    def lookahead_widths(self) -> tuple[int, int]:
        """(the recorder's P, the policy's lookahead P): how many of the next layer's experts each wants (0: none)."""
        ctx = self.ctx
        pol = ctx.cache.policy if ctx.cache is not None else None
        return (ctx.recorder.lookahead_depth if ctx.recorder is not None else 0,
                ctx.cache.prefetch_width if pol is not None and pol.prefetch == "lookahead" else 0)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        ctx = self.ctx
        if ctx.step is not None:
            # the engine's segmented decode step (runtime/backends/engine/graphs.py): this segment ends here;
            # the read, the decision and the experts come after it, the experts' output joins in the next
            return ctx.step.routed(self.layer, hidden_states, self.pack(top_k_index, top_k_weights))
        if ctx.cache is None and ctx.recorder is None:
            return self.compute(hidden_states, top_k_index, top_k_weights, None)
        # ONE device -> host read per layer (the kernel runs on the host)
        k = top_k_index.shape[1]
        d = self.decide(self.pack(top_k_index, top_k_weights).cpu().numpy(), k, top_k_weights.dtype)
        if d is None:  # recording only
            return self.compute(hidden_states, top_k_index, top_k_weights, None)
        if ctx.executor is not None and ctx.substitute_weight == "missed":
            # the engine applies the plan itself (DROP computes nothing, LOWBIT from its copies) with the
            # gate weights formed on the host in the model's dtype (the same values and roundings as on
            # the device): no decision tensors on the device, no further device -> host read
            return ctx.executor(self.layer, hidden_states, torch.from_numpy(d.ids), d.weights, d.res)
        return self.apply_on_device(hidden_states, top_k_index, top_k_weights, d)

    def decide(self, packed: np.ndarray, k: int, dtype: torch.dtype) -> Decision | None:
        """The host side of one layer's step from its packed routing [N, 2k + E + 1 (+ E')] (`pack`, k the top-k): the rank
        order, the trace's ranking and the lookahead lists, the recording, the kernel's step. None when
        only recording (no cache)."""
        ctx = self.ctx
        N = packed.shape[0]
        E = self.num_experts
        fin = packed[:, 2 * k + E]
        if not (fin == 1).all():
            raise InputError(f"router scores: non-finite value at MoE layer {self.layer}, token "
                             f"{int(np.flatnonzero(fin != 1)[0])} of this batch")
        pol = ctx.cache.policy if ctx.cache is not None else None
        P_rec, P_pol = self.lookahead_widths()
        P = max(P_rec, P_pol)
        score_np = packed[:, 2 * k : 2 * k + E]  # [N, E] float32
        r = np.arange(N)[:, None]  # [N, 1] row index
        ids0 = packed[:, :k].astype(np.int64)  # [N, k] the model's order
        perm = rank_order(ids0, score_np)  # [N, k]: model order -> rank order
        ids_np = ids0[r, perm].astype(np.int32)  # [N, k]
        w_np = packed[:, k : 2 * k][r, perm]  # [N, k] float32
        look = None
        if P:  # [N, P]: the next layer's top P by score, ties lower id (-1 for the last layer)
            look = (np.full((N, P), -1, np.int32) if self.layer + 1 >= ctx.num_layers
                    else np.argsort(-packed[:, 2 * k + E + 1 :], axis=1, kind="stable")[:, :P].astype(np.int32))
        rank_np = None
        if ctx.recorder is not None:
            # a trace stores the candidate ranking itself: the selection, then the others by descending
            # score (stable: lower id first), to the recorder's depth (E under a cache)
            depth = ctx.recorder.depth if ctx.cache is None else E
            rest = score_np.copy()
            rest[r, ids_np] = -np.inf
            others = np.argsort(-rest, axis=1, kind="stable")[:, : max(depth - k, 0)]
            rank_np = np.concatenate([ids_np, others.astype(np.int32)], 1)  # [N, M]
            rec = ctx.recorder
            rec.ids[self.layer].append(ids_np)
            rec.weights[self.layer].append(w_np.astype(np.float32))
            rec.ranking[self.layer].append(rank_np[:, : rec.depth])
            if P_rec:
                rec.lookahead[self.layer].append(look[:, :P_rec])
            if rec.keep_scores:
                rec.scores[self.layer].append(np.array(score_np, np.float32))
        if ctx.cache is None:
            return None
        predicted = None
        if pol.prefetch == "oracle" and self.layer > 0:
            predicted = ids_np  # this layer's own selection (the kernel keeps its first min(prefetch_n, k))
        elif pol.prefetch == "lookahead":
            # a FIFO per layer: in a layer-major pass (runtime/backends/hfmodel.py) layer l forms the lists of all
            # batches before layer l + 1 takes them, in the same stream order
            q = ctx.pending[self.layer]
            pend = q.popleft() if q else None
            predicted = pend if pend is not None and pend.shape[0] == N else None
            if self.layer + 1 < ctx.num_layers:
                ctx.pending[self.layer + 1].append(np.ascontiguousarray(look[:, :P_pol]))
        res = ctx.cache.step(self.layer, ids_np, w_np.astype(np.float64), rank_np, predicted=predicted,
                             scores=score_np.astype(np.float64))
        if res.ids is not None:  # cache-aware routing: the routed selection and weights (docs/policies.md, Additions (4))
            ids_np, w_np = res.ids, res.weights
        ctx.last[self.layer] = {"kind": res.kind, "served": res.served}
        if ctx.decisions is not None:
            ctx.decisions[self.layer].append((res.kind, res.served, res.slot))
        scale = drop_renorm_scale(res.kind, w_np) if pol.drop_renorm else None  # [N] or None (no drop)
        w = torch.from_numpy(w_np).to(dtype)  # [N, k] rank order, host, in the model's dtype
        if scale is not None:  # a dropped miss's weight shared out over the computed experts
            w = w * torch.from_numpy(scale).to(dtype=w.dtype)[:, None]
        return Decision(ids_np, w, res, perm, scale)

    def apply_on_device(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        d: Decision) -> torch.Tensor:
        """The emulation's experts under a decision: the Hugging Face module with the served experts and
        weights (the low-bit copies for LOWBIT, the substitute's own weight with `substitute_weight` own)."""
        ctx, res, perm, scale = self.ctx, d.res, d.perm, d.scale
        pol = ctx.cache.policy
        logits = self.tap.logits.reshape(top_k_index.shape[0], -1)
        perm_d = torch.from_numpy(perm).to(top_k_index.device)
        ids = torch.gather(top_k_index, 1, perm_d)  # [N, k] rank order
        w = torch.gather(top_k_weights, 1, perm_d)  # [N, k]
        if res.ids is not None:  # cache-aware routing: the routed selection, its weights in the model's dtype
            ids = torch.from_numpy(res.ids.astype(np.int64)).to(ids.device)
            w = d.weights.to(device=w.device)
        if scale is not None:  # a dropped miss's weight shared out over the computed experts (outputs only)
            w = w * torch.from_numpy(scale).to(device=w.device, dtype=w.dtype)[:, None]
        kind = torch.from_numpy(res.kind.astype(np.int64)).to(ids.device)
        served = torch.from_numpy(res.served.astype(np.int64)).to(ids.device)
        new_w = w.clone()
        if ctx.substitute_weight == "own":
            sub = kind == SUB
            if sub.any():
                p = torch.softmax(logits.float(), dim=-1) if self.fam.score == "softmax" else logits.float().sigmoid()
                ratio = torch.gather(p, 1, served.clamp(min=0)) / torch.gather(p, 1, ids)
                new_w = torch.where(sub, w * ratio.to(w.dtype), w)
        drop = kind == DROP
        if drop.any():
            new_w = new_w.masked_fill(drop, 0.0)
            served = torch.where(drop, ids, served)
        low = kind == LOWBIT
        if ctx.executor is None and low.any():  # the emulation computes LOWBIT from the low-precision copies
            low_w = torch.where(low, w, torch.zeros_like(w))
            out = self.compute(hidden_states, served, new_w.masked_fill(low, 0.0), res)
            lb = ctx.lowbit_experts(self.layer, pol.lowbit_bits, pol.lowbit_group)
            return out + lb(hidden_states, ids, low_w)
        return self.compute(hidden_states, served, new_w, res)

    def compute(self, hidden_states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, decisions):
        """The experts' output: the Hugging Face module, or the engine's executor when one is attached."""
        if self.ctx.executor is not None:
            return self.ctx.executor(self.layer, hidden_states, ids, weights, decisions)
        return self.experts(hidden_states, ids, weights)


def rank_order(ids: np.ndarray, score: np.ndarray) -> np.ndarray:
    """[N, k] permutation of the model's top-k `ids` [N, k] into rank order: descending score (`score` [N, E]),
    ties lower id. One `lexsort` per call (primary key: -score, then the id)."""
    r = np.arange(len(ids))[:, None]  # [N, 1] row index (fancy indexing: take_along_axis costs ~10x more per call)
    return np.lexsort((ids, -score[r, ids]), axis=-1)


def attach(model: nn.Module) -> Context:
    """Wrap every MoE layer of `model` once; returns the shared context (cache None = exact)."""
    if hasattr(model, "_expertsweep_ctx"):
        return model._expertsweep_ctx
    fam = family_of(model.config)
    blocks = moe_blocks(model, fam)
    if not blocks:
        raise InputError(f"model {type(model).__name__}: no MoE layers found")
    ctx = Context(len(blocks))
    for layer, blk in enumerate(blocks):
        tap = RouterTap(getattr(blk, fam.router_attr))
        setattr(blk, fam.router_attr, tap)
        pe = PolicyExperts(getattr(blk, fam.experts_attr), tap, layer, ctx, fam)
        setattr(blk, fam.experts_attr, pe)
        ctx.experts.append(pe)
    model._expertsweep_ctx = ctx
    return ctx


def moe_geometry(model: nn.Module) -> tuple[int, int, int]:
    """(num MoE layers, E, k) of an attached model."""
    ctx = attach(model)
    cfg = model.config
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or cfg.n_routed_experts
    return ctx.num_layers, int(E), int(cfg.num_experts_per_tok)
