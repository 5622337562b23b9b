"""Random-initialised tiny Hugging Face checkpoints of every supported MoE family (a few layers, small dims,
a byte-level BPE tokenizer that fits the vocabulary): the models of the exactness and mechanics tests,
the GPU environment check (scripts/gpu_env.py) and the engine benchmark's model builder
(scripts/bench_engine.py).

`tiny_config(family)` is the config alone; `build_tiny(family, out)` saves a checkpoint with its tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128  # model vocabulary; the tokenizer is trained to fewer tokens


def tiny_config(family: str, num_experts: int = 8, top_k: int = 2):
    """A few-layer config of `family` with small dims (random weights are fine for exactness tests)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, eos_token_id=0, bos_token_id=0, pad_token_id=0, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_experts=num_experts,
                                 num_experts_per_tok=top_k, head_dim=8, norm_topk_prob=False, decoder_sparse_step=1,
                                 mlp_only_layers=[])
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_experts=num_experts,
                                 num_experts_per_tok=top_k, shared_expert_intermediate_size=24, norm_topk_prob=False,
                                 decoder_sparse_step=1, mlp_only_layers=[])
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=16, num_local_experts=num_experts, num_experts_per_tok=top_k)
    if family == "olmoe":
        return tf.OlmoeConfig(**common, intermediate_size=16, num_experts=num_experts, num_experts_per_tok=top_k)
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_experts=num_experts,
                                  num_experts_per_tok=top_k, shared_expert_intermediate_size=24, head_dim=8,
                                  linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                                  linear_value_head_dim=8, linear_conv_kernel_dim=4, decoder_sparse_step=1,
                                  mlp_only_layers=[], layer_types=["linear_attention", "full_attention"])
    if family == "deepseek_v3":
        common["num_key_value_heads"] = common["num_attention_heads"]
        return tf.DeepseekV3Config(**common, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=num_experts,
                                   num_experts_per_tok=top_k, n_shared_experts=1, n_group=2, topk_group=2,
                                   first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                   qk_nope_head_dim=8, v_head_dim=8, norm_topk_prob=True)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, intermediate_size=16, num_local_experts=num_experts, num_experts_per_tok=top_k,
                               head_dim=8, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    raise ValueError(family)


FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_next", "deepseek_v3", "gpt_oss")


def build_tiny(family: str, out: Path, seed: int = 0, num_experts: int = 8, top_k: int = 2) -> Path:
    """Save a random tiny checkpoint with a byte-level tokenizer that fits VOCAB."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    cfg = tiny_config(family, num_experts, top_k)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # spread the router so gate weights vary
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.shape[0] == num_experts:
                p.normal_(0, 1.0)
            if "e_score_correction_bias" in name:
                p.zero_()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=96, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:90])
    tok.train_from_iterator(["hello world " * 10], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return out
