"""The same text's routing recorded from a Hugging Face checkpoint and by llama.cpp from its GGUF, compared.

`build_checkpoint(out)` saves a small random Qwen3-MoE checkpoint with the project's byte-level BPE
tokenizer (runtime/tools/tinytrain.py `train_tokenizer`, every byte in its alphabet) and routers of
logit spread about 2 (N(0, 4 / hidden) rows, as a trained router's); `compare(hf, gguf)` compares two traces of
the same windows cell by cell (token, layer): the top-k sets, how many of the differing ones are
router near-ties (the checkpoint's k-th and (k+1)-th probabilities within `NEAR_TIE`), the largest
probability difference (softmax of both traces' router_scores) and the largest gate-weight
difference. tests/test_llamacpp.py and scripts/llamacpp_routing.py use both.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from runtime.formats.trace import Trace

log = logging.getLogger(__name__)

NEAR_TIE = 1e-3
"""A cell is a router near-tie when the checkpoint's k-th and (k+1)-th gate probabilities p_k >= p_k+1 are
within this, relative: p_k - p_k+1 <= NEAR_TIE * p_k (about a logit gap below 1e-3)."""

SAMPLE_TEXT = (
    "Mixture-of-experts models route each token to a few experts; 42 of 128 experts may be cached.\n"
    "The quick brown fox jumps over the lazy dog.  Numbers: 3.14159, 2718, 1e-9!\n"
    "Tabs\tand  double  spaces,   newlines\n\nand unicode: caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c, \U0001f600.\n"
    "It's what we'll say: they've done it, I'm sure, you'd agree.\n"
)


def build_checkpoint(out: Path, seed: int = 0, layers: int = 2, hidden: int = 64, experts: int = 16,
                     top_k: int = 4, moe_intermediate: int = 32, vocab_size: int = 320,
                     texts: tuple[str, ...] = (SAMPLE_TEXT,)) -> Path:
    """Save a random Qwen3-MoE checkpoint (norm_topk_prob true, as llama.cpp's qwen3moe runs it) with the
    project's tokenizer trained on `texts`; the routers' logits spread about 2."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from runtime.tools.tinytrain import EOS, train_tokenizer

    tok = train_tokenizer(list(texts) * 4, vocab_size)
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
                                   clean_up_tokenization_spaces=False)
    eos = tok.token_to_id(EOS)
    cfg = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                         moe_intermediate_size=moe_intermediate, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=eos,
                         eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 2.0 / hidden**0.5)  # router logits of spread about 2, as in a trained model
            elif p.ndim == 1 and "norm" in name:
                p.uniform_(0.5, 1.5)  # not all ones: an exporter that drops a norm weight shows
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float64."""
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


@dataclass(frozen=True)
class Agreement:
    """How far two recordings of the same windows agree."""

    cells: int  # (token, layer) cells compared
    topk_equal: int  # cells whose top-k sets are equal
    differ: int  # cells whose sets differ
    differ_near_tie: int  # of those, router near-ties of the checkpoint (k-th, (k+1)-th within near_tie)
    near_ties: int  # near-tie cells in all
    near_tie: float
    max_prob_diff: float  # over all cells and experts (softmax of router_scores)
    max_weight_diff: float  # over cells with equal sets, expert by expert
    first_differ: list  # up to 5 (token, layer) cells whose sets differ

    def as_dict(self) -> dict:
        return asdict(self)


def compare(hf: Trace, other: Trace, near_tie: float = NEAR_TIE) -> Agreement:
    """Cell-by-cell agreement of `other` (llama.cpp) with `hf` (the checkpoint), both with router_scores."""
    if hf.topk_ids.shape != other.topk_ids.shape:
        raise ValueError(f"traces of shapes {hf.topk_ids.shape} and {other.topk_ids.shape}")
    if not (np.array_equal(hf.seq_id, other.seq_id) and np.array_equal(hf.position, other.position)):
        raise ValueError("the traces cover different windows")
    T, L, k = hf.topk_ids.shape
    E = hf.E
    p_hf, p_other = softmax(hf.router_scores), softmax(other.router_scores)  # [T, L, E]
    top = -np.sort(-p_hf, axis=-1)
    tie = ((top[..., k - 1] - top[..., k]) <= near_tie * top[..., k - 1]) if k < E else np.zeros((T, L), bool)

    def member(ids: np.ndarray) -> np.ndarray:  # [T, L, E] bool
        m = np.zeros((T, L, E), bool)
        np.put_along_axis(m, ids.astype(np.int64), True, axis=-1)
        return m

    m_hf, m_other = member(hf.topk_ids), member(other.topk_ids)
    equal = (m_hf == m_other).all(axis=-1)  # [T, L]

    def dense(trace: Trace) -> np.ndarray:  # [T, L, E] weights by expert id
        d = np.zeros((T, L, E), np.float64)
        np.put_along_axis(d, trace.topk_ids.astype(np.int64), trace.topk_weights.astype(np.float64), axis=-1)
        return d

    wdiff = np.abs(dense(hf) - dense(other))[equal]
    where = np.argwhere(~equal)[:5]
    return Agreement(cells=T * L, topk_equal=int(equal.sum()), differ=int((~equal).sum()),
                     differ_near_tie=int((~equal & tie).sum()), near_ties=int(tie.sum()), near_tie=near_tie,
                     max_prob_diff=float(np.abs(p_hf - p_other).max()),
                     max_weight_diff=float(wdiff.max()) if wdiff.size else 0.0,
                     first_differ=[[int(t), int(layer)] for t, layer in where])


def dump(agreement: Agreement) -> str:
    return json.dumps(agreement.as_dict())
