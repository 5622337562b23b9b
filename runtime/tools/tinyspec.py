"""The spec of a tiny reference model (`TinySpec`): every field that determines it, all of them in its cache key.

runtime.tools.tinymodel names the specs (SPECS) and builds and caches them; runtime.tools.tinytrain trains
one. Both import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.core.errors import InputError

ARCHITECTURES = ("qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines a tiny model (all of it goes into the cache key)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (unused while every layer is sparse)
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    seed: int
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    router_aux_loss_coef: float = 0.01
    norm_topk_prob: bool = True
    corpus: str = "stdlib"
    train_bytes: int = 6_000_000
    heldout_bytes: int = 150_000
    eval_max_tokens: int = 0  # 0: the whole eval.txt
    # Fields added later: left out of the cache key while at their defaults (see model_digest).
    architecture: str = "qwen3_moe"  # or "qwen2_moe" (has a shared expert)
    shared_expert_intermediate_size: int = 0  # qwen2_moe only; 0 = no shared expert

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise InputError(f"TinySpec.name: invalid {self.name!r}")
        positive = (
            "num_layers",
            "hidden_size",
            "moe_intermediate_size",
            "num_experts",
            "num_experts_per_tok",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "seq_len",
            "batch_size",
        )
        for f in positive:
            if getattr(self, f) <= 0:
                raise InputError(f"TinySpec.{f}: must be > 0, got {getattr(self, f)}")
        if self.steps < 0:
            raise InputError(f"TinySpec.steps: must be >= 0 (0: random weights), got {self.steps}")
        if self.num_experts_per_tok > self.num_experts:
            raise InputError(
                f"TinySpec.num_experts_per_tok: {self.num_experts_per_tok} > num_experts "
                f"{self.num_experts}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise InputError(
                f"TinySpec.num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.architecture not in ARCHITECTURES:
            raise InputError(
                f"TinySpec.architecture: {self.architecture!r} (choose from {', '.join(ARCHITECTURES)})"
            )
        if self.shared_expert_intermediate_size and self.architecture != "qwen2_moe":
            raise InputError(
                "TinySpec.shared_expert_intermediate_size: only qwen2_moe has a shared expert"
            )
        if self.vocab_size < 257 + 1:
            raise InputError(f"TinySpec.vocab_size: must be >= 258, got {self.vocab_size}")
