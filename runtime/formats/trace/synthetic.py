"""Synthetic router traces with realistic MoE routing statistics, and their calibration twins.

The generator's model and parameters are documented in docs/traces.md.
"""

from __future__ import annotations

import numpy as np

from runtime.core.errors import InputError
from runtime.formats.trace.formats import Trace, TraceMeta


def _top_m_stable(scores: np.ndarray, M: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-M indices of each row in descending score order, ties to the lower index.

    scores [N, E] -> (idx int32 [N, M], vals [N, M]); argpartition, then an exact fix-up of rows
    with ties at the cut."""
    N, E = scores.shape
    if M < E:
        idx = np.argpartition(-scores, M - 1, axis=1)[:, :M]  # [N, M], unordered
    else:
        idx = np.broadcast_to(np.arange(E), (N, E)).copy()
    vals = np.take_along_axis(scores, idx, axis=1)  # [N, M]
    o = np.lexsort((idx, -vals), axis=1)  # descending score, then lower id
    idx, vals = np.take_along_axis(idx, o, axis=1), np.take_along_axis(vals, o, axis=1)
    if M < E:
        tied = (scores >= vals[:, -1:]).sum(1) > M  # [N] ties straddle the cut: argpartition may be off
        if tied.any():
            o = np.argsort(-scores[tied], axis=1, kind="stable")[:, :M]
            idx[tied] = o
            vals[tied] = np.take_along_axis(scores[tied], o, axis=1)
    return idx.astype(np.int32), vals


def synthetic_trace(num_tokens: int, num_layers: int, num_experts: int, top_k: int,
                    ranking_depth: int | None = None, *, seed: int = 0, sample: int = 0, skew: float = 1.62,
                    num_topics: int = 8, topic_locality: float = 0.7, switch_prob: float = 0.01,
                    seq_len: int = 512, weight_norm: str = "softmax_topk", temperature: float = 1.25,
                    noise: float = 1.0, lookahead_depth: int = 0, lookahead_noise: float = 0.5,
                    model: str = "synthetic") -> Trace:
    """A synthetic MoE routing trace (see docs/traces.md for the model and its parameters).

    Router scores per (token, layer, expert): Zipf popularity -skew*log(rank+1) (a random expert
    order per layer) + a topic boost for the current topic's experts + noise * Gumbel noise. The
    latent topic is shared by all layers of a token, redrawn at every sequence start (each
    `seq_len` tokens) and with probability `switch_prob` per token. topic_locality in [0, 1) is,
    for flat popularity and no noise scaling, the probability that a token's first choice lies in
    its topic's expert set. Selection = top-k by score (ties: lower id), ranking = first
    `ranking_depth` (default E) of the same order, gate weights = softmax(score / temperature) over
    the top-k ("softmax_topk") or over all E ("softmax_all").

    `seed` draws the model (each layer's popularity order and topic expert sets); `sample` draws the
    tokens (topic sequence and noise). Two traces with the same seed and different `sample` are a
    trace and its calibration twin: same routing statistics, different tokens (`calibration_twin`).
    `lookahead_depth` P > 0 adds the lookahead column: on layer l's row the top-P ids of layer l + 1's
    scores plus `lookahead_noise` * Gumbel noise (a pre-gating guess; the last layer -1).
    Deterministic for (seed, sample)."""
    T, L, E, k = num_tokens, num_layers, num_experts, top_k
    M = E if ranking_depth is None else ranking_depth
    P = lookahead_depth
    checks = [
        ("num_tokens", T, T >= 1, ">= 1"), ("num_layers", L, L >= 1, ">= 1"),
        ("num_experts", E, E >= 1, ">= 1"), ("top_k", k, 1 <= k <= E, "in [1, num_experts]"),
        ("ranking_depth", M, k <= M <= E, "in [top_k, num_experts]"), ("skew", skew, skew >= 0, ">= 0"),
        ("num_topics", num_topics, num_topics >= 1, ">= 1"),
        ("topic_locality", topic_locality, 0 <= topic_locality < 1, "in [0, 1)"),
        ("switch_prob", switch_prob, 0 <= switch_prob <= 1, "in [0, 1]"),
        ("seq_len", seq_len, seq_len >= 1, ">= 1"),
        ("weight_norm", weight_norm, weight_norm in ("softmax_topk", "softmax_all"),
         "'softmax_topk' or 'softmax_all'"),
        ("temperature", temperature, temperature > 0, "> 0"), ("noise", noise, noise >= 0, ">= 0"),
        ("sample", sample, isinstance(sample, int) and sample >= 0, "an integer >= 0"),
        ("lookahead_depth", P, isinstance(P, int) and 0 <= P <= E, "an integer in [0, num_experts]"),
        ("lookahead_noise", lookahead_noise, lookahead_noise >= 0, ">= 0"),
    ]
    for name, v, ok, need in checks:
        if not ok:
            raise InputError(f"synthetic trace: {name} = {v!r} must be {need}")
    rng = np.random.default_rng(seed)  # the model: popularity orders, topic sets
    srng = np.random.default_rng([seed, sample, 0x5EED])  # the tokens: topics, noise

    # latent topic per token: [T]
    t = np.arange(T)
    switch = srng.random(T) < switch_prob
    switch[::seq_len] = True  # every sequence starts with a fresh topic
    draws = srng.integers(num_topics, size=T)
    topic = draws[np.maximum.accumulate(np.where(switch, t, 0))]  # [T]
    seq_id = (t // seq_len).astype(np.int32)
    position = (t % seq_len).astype(np.int32)

    # topic expert sets: boost b such that (flat popularity) P(first choice in set) = topic_locality
    n_topic = min(E, max(k, -(-E // num_topics)))
    odds = topic_locality * (E - n_topic) / max((1.0 - topic_locality) * n_topic, 1e-30)
    boost = float(np.log(odds)) if odds > 1.0 and n_topic < E else 0.0

    ranks = np.log1p(np.arange(E, dtype=np.float64))
    ids = np.empty((T, L, k), dtype=np.int32)
    weights = np.empty((T, L, k), dtype=np.float32)
    ranking = np.empty((T, L, M), dtype=np.int32)
    look = np.full((T, L, P), -1, dtype=np.int32) if P else None
    tiny = np.float32(np.finfo(np.float32).tiny)

    def gumbel(shape) -> np.ndarray:
        u = srng.random(shape, dtype=np.float32)
        np.maximum(u, tiny, out=u)
        return -np.log(-np.log(u))

    for layer in range(L):
        pop = np.empty(E, dtype=np.float32)  # [E]
        pop[rng.permutation(E)] = -skew * ranks
        sets = np.zeros((num_topics, E), dtype=np.float32)  # [n_topics, E]
        for z in range(num_topics):
            sets[z, rng.choice(E, size=n_topic, replace=False)] = boost
        scores = sets[topic]  # [T, E]
        scores += pop
        if noise > 0:
            scores += np.float32(noise) * gumbel((T, E))
        idx, vals = _top_m_stable(scores, M)  # [T, M]
        z = (vals[:, :k] - vals[:, :1]) / np.float32(temperature)  # [T, k], <= 0
        ez = np.exp(z)
        if weight_norm == "softmax_topk":
            denom = ez.sum(1, keepdims=True)
        else:
            denom = np.exp((scores - vals[:, :1]) / np.float32(temperature)).sum(1, keepdims=True)
        ids[:, layer] = idx[:, :k]
        weights[:, layer] = ez / denom
        ranking[:, layer] = idx
        if P and layer > 0:  # the previous layer's guess at this layer's routing
            guess = scores + np.float32(lookahead_noise) * gumbel((T, E)) if lookahead_noise > 0 else scores
            look[:, layer - 1] = _top_m_stable(guess, P)[0]

    params = (f"seed={seed} sample={sample} skew={skew} num_topics={num_topics} topic_locality={topic_locality} "
              f"switch_prob={switch_prob} seq_len={seq_len} temperature={temperature} noise={noise}"
              + (f" lookahead_depth={P} lookahead_noise={lookahead_noise}" if P else ""))
    meta = TraceMeta(model=model, num_experts=E, top_k=k, ranking_depth=M,
                     layer_ids=tuple(range(L)), weight_norm=weight_norm, source=f"synthetic_trace({params})",
                     lookahead_depth=P)
    return Trace(ids, weights, ranking, np.ones((T, L), dtype=bool), seq_id, position, meta, look)


def calibration_twin(num_tokens: int, num_layers: int, num_experts: int, top_k: int,
                     ranking_depth: int | None = None, *, seed: int = 0, sample: int = 1, **kw) -> Trace:
    """The calibration twin of `synthetic_trace(..., seed=seed, **kw)`: the same model (popularity and
    topic draw), other tokens (`sample`, default 1; the evaluated trace uses sample 0)."""
    if sample == 0:
        raise InputError("calibration twin: sample = 0 is the evaluated trace's own token draw")
    return synthetic_trace(num_tokens, num_layers, num_experts, top_k, ranking_depth, seed=seed, sample=sample, **kw)


def synthetic_pair(num_tokens: int, num_layers: int, num_experts: int, top_k: int,
                   ranking_depth: int | None = None, *, calib_tokens: int | None = None, seed: int = 0,
                   **kw) -> tuple[Trace, Trace]:
    """(evaluated trace, calibration twin): same seed (model), token draws 0 and 1; the twin has
    `calib_tokens` tokens (default: half of num_tokens, at least 1)."""
    tr = synthetic_trace(num_tokens, num_layers, num_experts, top_k, ranking_depth, seed=seed, sample=0, **kw)
    n = max(num_tokens // 2, 1) if calib_tokens is None else calib_tokens
    return tr, calibration_twin(n, num_layers, num_experts, top_k, ranking_depth, seed=seed, sample=1, **kw)
