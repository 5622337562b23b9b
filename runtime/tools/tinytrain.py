"""Training and evaluation of the tiny reference models (runtime.tools.tinymodel builds and caches them).

The tokenizer (byte-level BPE by ``tokenizers``), the Hugging Face config of a ``TinySpec``, the
training loop (fixed-step AdamW, linear warmup then cosine decay to ``min_lr_ratio``, packed windows
reshuffled every epoch, the router's load-balancing loss, gradients clipped at 1) and the
teacher-forced evaluation (perplexity over non-overlapping windows plus gate-weight statistics).
Everything here is deterministic given the spec's seed under ``tinymodel._torch_state``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from runtime.core.errors import InputError
from runtime.tools.corpus import EOS

if TYPE_CHECKING:
    from runtime.tools.tinyspec import TinySpec

logger = logging.getLogger(__name__)

GATE_THRESHOLD = 0.15
"""The gate weight the statistics count against (the paper's rule-0.15)."""


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE (``tokenizers``), ``<|endoftext|>`` as its only special token (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def hf_tokenizer(tok: Any, spec: TinySpec) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=spec.seq_len,
        clean_up_tokenization_spaces=False,
    )


def make_config(spec: TinySpec, vocab_size: int, eos_id: int) -> Any:
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=spec.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,  # training asks for them explicitly
        router_aux_loss_coef=spec.router_aux_loss_coef,
        max_position_embeddings=spec.seq_len,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    if spec.architecture == "qwen2_moe":  # carries a shared expert (qwen3_moe cannot)
        return Qwen2MoeConfig(**common, shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
    return Qwen3MoeConfig(**common, head_dim=spec.head_dim)


def _lr_factor(step: int, spec: TinySpec) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at the last step."""
    warm = min(spec.warmup_steps, max(spec.steps - 1, 1))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(spec.steps - warm, 1)
    return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _batches(tokens: Any, spec: TinySpec, generator: Any) -> Iterator[Any]:
    """Packed windows of ``seq_len`` tokens, reshuffled every epoch, ``batch_size`` at a time."""
    import torch

    n = tokens.numel() // spec.seq_len
    if n < 1:
        raise InputError(
            f"corpus: train split has {tokens.numel()} tokens < seq_len {spec.seq_len}"
        )
    windows = tokens[: n * spec.seq_len].view(n, spec.seq_len)
    order = torch.randperm(n, generator=generator)
    pos = 0
    while True:
        idx = []
        while len(idx) < spec.batch_size:
            if pos == n:
                order, pos = torch.randperm(n, generator=generator), 0
            take = min(spec.batch_size - len(idx), n - pos)
            idx.extend(order[pos : pos + take].tolist())
            pos += take
        yield windows[idx]


def train_model(model: Any, tokens: Any, spec: TinySpec, progress: bool = True) -> dict[str, Any]:
    """Fixed-step AdamW training with the router load-balancing loss; returns its log."""
    import torch
    from tqdm.auto import tqdm

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=spec.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, spec))
    gen = torch.Generator().manual_seed(spec.seed)
    batches = _batches(tokens, spec, gen)
    model.train()
    lm_losses: list[float] = []
    aux_losses: list[float] = []
    curve: list[dict[str, float]] = []
    every = max(spec.steps // 20, 1)
    t0 = time.perf_counter()
    bar = tqdm(
        range(spec.steps),
        desc=f"train {spec.name}",
        disable=not progress,
        unit="step",
        mininterval=1.0,
    )
    for step in bar:
        x = next(batches)
        out = model(input_ids=x, labels=x, output_router_logits=True)
        aux = out.aux_loss.detach().item()
        lm = out.loss.detach().item() - spec.router_aux_loss_coef * aux
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if not math.isfinite(lm):
            raise RuntimeError(f"train {spec.name}: loss became {lm} at step {step}")
        lm_losses.append(lm)
        aux_losses.append(aux)
        if step % every == 0 or step == spec.steps - 1:
            curve.append({"step": step + 1, "loss": round(lm, 4), "aux_loss": round(aux, 4)})
            bar.set_postfix(loss=f"{lm:.3f}", aux=f"{aux:.3f}", refresh=False)
    wall = time.perf_counter() - t0
    tail = max(min(20, spec.steps // 10), 1)
    return {
        "steps": spec.steps,
        "tokens_seen": spec.steps * spec.batch_size * spec.seq_len,
        "train_tokens": int(tokens.numel()),
        "final_train_loss": sum(lm_losses[-tail:]) / tail,
        "final_aux_loss": sum(aux_losses[-tail:]) / tail,
        "first_train_loss": lm_losses[0],
        "train_wall_s": wall,
        "steps_per_s": spec.steps / wall if wall > 0 else float("inf"),
        "tokens_per_s": spec.steps * spec.batch_size * spec.seq_len / wall
        if wall > 0
        else float("inf"),
        "epochs": spec.steps * spec.batch_size * spec.seq_len / max(int(tokens.numel()), 1),
        "loss_curve": curve,
    }


def evaluate(model: Any, tokens: Any, spec: TinySpec, batch: int = 8) -> dict[str, Any]:
    """Teacher-forced perplexity over non-overlapping ``seq_len`` windows, plus router statistics.

    Gate weights are the ones the model applies: softmax over all experts, top-k, renormalised
    over the top-k only when ``norm_topk_prob``. Also reported: what they would be if renormalised.
    """
    import torch

    model.eval()
    k, n_exp, n_layers = spec.num_experts_per_tok, spec.num_experts, spec.num_layers
    nll, count = 0.0, 0
    n_cells = 0
    ge = torch.zeros(k, dtype=torch.float64)
    ge_renorm = torch.zeros(k, dtype=torch.float64)
    rank_sum = torch.zeros(k, dtype=torch.float64)
    topk_sum = 0.0
    load = torch.zeros(n_layers, n_exp, dtype=torch.float64)
    full = tokens.numel() // spec.seq_len
    batches = [
        tokens[i * spec.seq_len : min(i + batch, full) * spec.seq_len].view(-1, spec.seq_len)
        for i in range(0, full, batch)
    ]
    if tokens.numel() - full * spec.seq_len >= 2:
        batches.append(tokens[full * spec.seq_len :][None])
    with torch.no_grad():
        for w in batches:
            out = model(input_ids=w, output_router_logits=True)
            logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
            nll -= float(logp.gather(-1, w[:, 1:, None]).sum())
            count += w[:, 1:].numel()
            for layer, logits in enumerate(out.router_logits):
                probs = torch.softmax(logits.float(), dim=-1)
                top, idx = torch.topk(probs, k, dim=-1)
                renorm = top / top.sum(-1, keepdim=True)
                weights = renorm if spec.norm_topk_prob else top
                ge += (weights >= GATE_THRESHOLD).double().sum(0)
                ge_renorm += (renorm >= GATE_THRESHOLD).double().sum(0)
                rank_sum += weights.double().sum(0)
                topk_sum += float(weights.sum())
                load[layer] += torch.bincount(idx.flatten(), minlength=n_exp).double()
                n_cells += weights.shape[0]
    share = load / load.sum(-1, keepdim=True)
    return {
        "val_ppl": math.exp(nll / count),
        "val_nll": nll / count,
        "val_tokens": count,
        "gate_stats": {
            "token_layers": n_cells,
            "threshold": GATE_THRESHOLD,
            "frac_topk_ge_threshold": float(ge.sum() / (n_cells * k)),
            "frac_nonfirst_ge_threshold": float(ge[1:].sum() / (n_cells * (k - 1)))
            if k > 1
            else 0.0,
            "frac_ge_threshold_by_rank": [round(float(v / n_cells), 4) for v in ge],
            "mean_weight_by_rank": [round(float(v / n_cells), 4) for v in rank_sum],
            "mean_first_choice_weight": float(rank_sum[0] / n_cells),
            "mean_topk_mass": topk_sum / n_cells,
            "if_renormalised_frac_topk_ge_threshold": float(ge_renorm.sum() / (n_cells * k)),
            "expert_share_max": float(share.max()),
            "expert_share_min": float(share.min()),
            "experts_never_selected": int((load == 0).sum()),
        },
    }


def _encode(tok: Any, texts: Sequence[str]) -> Any:
    import torch

    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)
