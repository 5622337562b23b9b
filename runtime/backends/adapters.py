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
from runtime.core.kernel import DROP, LOWBIT, SUB, PolicyCache, drop_renorm_scale


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

    @classmethod
    def empty(cls, num_layers: int, depth: int, lookahead: int = 0) -> Recorder:
        """Record ids, weights, the ranking to `depth` and, when `lookahead` P > 0, the lookahead lists."""
        L = num_layers
        return cls(depth, [[] for _ in range(L)], [[] for _ in range(L)], [[] for _ in range(L)], lookahead,
                   [[] for _ in range(L)])

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
        # engine hook (runtime/backends/plan.py, PlanRunner.run_experts): executor(layer, hidden [N, H], ids [N, k], weights [N, k],
        # decisions: StepResult | None) computes the experts instead of the Hugging Face module
        self.executor = None
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


class PolicyExperts(nn.Module):
    def __init__(self, experts: nn.Module, tap: RouterTap, layer: int, ctx: Context, fam: Family) -> None:
        super().__init__()
        self.experts, self.tap, self.layer, self.ctx, self.fam = experts, tap, layer, ctx, fam
        self.num_experts = 0  # E, known after the first call

    def next_layer_lookahead(self, P: int) -> np.ndarray:
        """[N, P] int32: the top-P experts (by score, ties lower id) of the next layer's router applied to
        this layer's router input; -1 for the last layer."""
        ctx = self.ctx
        x = self.tap.input
        N = self.tap.logits.reshape(-1, self.tap.logits.shape[-1]).shape[0]
        if self.layer + 1 >= ctx.num_layers:
            return np.full((N, P), -1, np.int32)
        nxt = ctx.experts[self.layer + 1]
        logits = nxt.tap.router(x)[0].reshape(N, -1)  # (the router itself: the tap keeps its own state)
        order = torch.sort(-nxt.scores(logits), dim=1, stable=True).indices[:, :P]
        return order.cpu().numpy().astype(np.int32)
    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Candidate scores [N, E] whose order is the router's preference."""
        if self.fam.score == "sigmoid_bias":
            return logits.float().sigmoid() + self.tap.router.e_score_correction_bias
        return logits.float()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        ctx = self.ctx
        if ctx.cache is None and ctx.recorder is None:
            return self.compute(hidden_states, top_k_index, top_k_weights, None)
        logits = self.tap.logits.reshape(top_k_index.shape[0], -1)
        score = self.scores(logits)  # [N, E]
        sel = torch.gather(score, 1, top_k_index)  # [N, k]
        # rank order: descending score, ties lower id (stable sort over ids sorted ascending)
        ids_sorted_by_id, perm_id = torch.sort(top_k_index, dim=1)
        order = torch.sort(-torch.gather(sel, 1, perm_id), dim=1, stable=True).indices
        perm = torch.gather(perm_id, 1, order)
        ids = torch.gather(top_k_index, 1, perm)  # [N, k]
        w = torch.gather(top_k_weights, 1, perm)  # [N, k]
        N, k = ids.shape
        E = self.num_experts = score.shape[1]
        if ctx.recorder is not None:
            # a trace stores the candidate ranking itself: the selection, then the others by descending
            # score (stable: lower id first), to the recorder's depth (E under a cache)
            depth = ctx.recorder.depth if ctx.cache is None else E
            rest = score.scatter(1, ids, float("-inf"))
            others = torch.sort(-rest, dim=1, stable=True).indices[:, : max(depth - k, 0)]
            cand = torch.cat([ids, others], dim=1).double()  # [N, M]
        else:
            # the kernel orders the candidates itself from the scores (PolicyCache.step `scores`): the
            # same decisions as that full ranking without sorting E candidates per token
            cand = score.double()  # [N, E]
        # ONE device -> host read per layer (the kernel runs on the host): ids, weights, the ranking or
        # the scores and a finiteness flag per token, packed as float64 (exact for these ids and
        # float32/bf16 weights and scores)
        # a row's sum is finite only if every entry is (inf, -inf and nan all propagate); a non-finite
        # sum of finite entries (overflow) is told apart below, on the rare rows concerned
        rowsum = logits.float().sum(dim=1, keepdim=True)  # [N, 1]
        packed = torch.cat([ids.double(), w.detach().double(), cand, rowsum.double()], 1).cpu().numpy()
        if not np.isfinite(packed[:, -1]).all():
            rows = np.flatnonzero(~np.isfinite(packed[:, -1]))
            bad = rows[~torch.isfinite(logits[torch.from_numpy(rows).to(logits.device)]).all(dim=1).cpu().numpy()]
            if len(bad):
                raise InputError(f"router scores: non-finite value at MoE layer {self.layer}, token {int(bad[0])} "
                                 f"of this batch")
        ids_np = packed[:, :k].astype(np.int32)
        w_np = packed[:, k : 2 * k].astype(np.float32)
        tail = packed[:, 2 * k : -1]
        rank_np, score_np = (tail.astype(np.int32), None) if ctx.recorder is not None else (None, tail)  # [N, M] / [N, E]
        pol = ctx.cache.policy if ctx.cache is not None else None
        P_rec = ctx.recorder.lookahead_depth if ctx.recorder is not None else 0
        P_pol = ctx.cache.prefetch_width if pol is not None and pol.prefetch == "lookahead" else 0
        look = self.next_layer_lookahead(max(P_rec, P_pol)) if max(P_rec, P_pol) else None  # [N, P]
        if ctx.recorder is not None:
            r = ctx.recorder
            r.ids[self.layer].append(ids_np)
            r.weights[self.layer].append(w_np.astype(np.float32))
            r.ranking[self.layer].append(rank_np[:, : r.depth])
            if P_rec:
                r.lookahead[self.layer].append(look[:, :P_rec])
        if ctx.cache is None:
            return self.compute(hidden_states, top_k_index, top_k_weights, None)
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
                ctx.pending[self.layer + 1].append(look[:, :P_pol])
        res = ctx.cache.step(self.layer, ids_np, w_np.astype(np.float64), rank_np, predicted=predicted, scores=score_np)
        ctx.last[self.layer] = {"kind": res.kind, "served": res.served}
        if ctx.decisions is not None:
            ctx.decisions[self.layer].append((res.kind, res.served, res.slot))
        if pol.drop_renorm:  # a dropped miss's weight shared out over the computed experts (outputs only)
            scale = drop_renorm_scale(res.kind, w_np)  # [N] or None (no drop)
            if scale is not None:
                w = w * torch.from_numpy(scale).to(device=w.device, dtype=w.dtype)[:, None]
        if ctx.executor is not None and ctx.substitute_weight == "missed":
            # the engine applies the plan itself (DROP computes nothing, LOWBIT from its copies): no
            # decision tensors on the device, no further host-device synchronisation
            return ctx.executor(self.layer, hidden_states, ids, w, res)
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
