"""Model shapes (`ModelShape`): the MoE geometry that sets expert and dense bytes, stored as YAML.

Presets in `runtime/data/models/` (`EXPERTSWEEP_MODELS_DIR` instead), or derived from a Hugging Face
`config.json` (`model_shape_from_hf_config`); the byte counts of an expert, a layer's dense part, the head,
the non-expert weights and a low-bit copy; `shape_for_trace` (the shape of a router trace).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml

from runtime.core.errors import InputError
from runtime.formats.costmodel.hosts import (
    _check_fields,
    _check_positive_int,
    _check_text,
    _list_presets,
    _read_yaml,
    _resolve,
    _where,
    _write_text,
)

log = logging.getLogger(__name__)

# Bits per weight of each storage format (ggml block layouts, see docs/cost_model.md):
#   bf16   : 2 bytes per weight.
#   q8_0   : blocks of 32 int8 quants + one fp16 scale = 34 bytes / 32 weights = 8.5 bpw.
#   q4_k_m : llama.cpp's Q4_K_M mix. Q4_K = 144-byte super-blocks of 256 weights (4.5 bpw),
#            Q6_K = 210 bytes / 256 (6.5625 bpw); Q4_K_M stores ffn_down as Q6_K in half of
#            the layers, gate/up as Q4_K: (2*4.5 + 0.5*6.5625 + 0.5*4.5) / 3 = 4.84 -> 4.85.
#   fp16 / fp32: the engine's own dtypes (a shape derived from a loaded model, runtime/backends/engine/core.py).
BITS_PER_WEIGHT: dict[str, float] = {"bf16": 16.0, "q8_0": 8.5, "q4_k_m": 4.85, "fp16": 16.0, "fp32": 32.0}
DTYPE_FORMATS = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
                 "float16": "fp16"}

_SHAPE_INTS = ("num_layers", "num_experts", "top_k", "hidden", "moe_intermediate",
               "dense_params_per_layer")


@dataclass(frozen=True)
class ModelShape:
    """MoE geometry. An expert is gate/up/down: 3 * hidden * moe_intermediate weights.

    `dense_params_per_layer` is everything else of a layer read per token at batch 1
    (attention or linear-attention mixer, shared expert and its gate, router, norms);
    embeddings and the LM head are not included: `vocab_size` (0 = unknown, head not charged)
    and `tie_word_embeddings` give them (the final norm and the LM head are read once per token).
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    dense_params_per_layer: int
    weight_format: str = "bf16"
    vocab_size: int = 0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        _validate_shape(self, None)

    def with_format(self, fmt: str) -> ModelShape:
        """The same shape stored as `fmt` (bf16 | q8_0 | q4_k_m)."""
        return dataclasses.replace(self, weight_format=fmt)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def bits_per_weight(self) -> float:
        return BITS_PER_WEIGHT[self.weight_format]


def _validate_shape(s: ModelShape, source: str | None) -> None:
    _check_text(s.name, "name", source)
    for f in _SHAPE_INTS:
        object.__setattr__(s, f, _check_positive_int(getattr(s, f), f, source))
    if s.top_k > s.num_experts:
        raise InputError(f"{_where(source)}field 'top_k' = {s.top_k}: exceeds num_experts = "
                         f"{s.num_experts}")
    v = s.vocab_size
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
        raise InputError(f"{_where(source)}field 'vocab_size' = {v!r}: expected a non-negative integer")
    object.__setattr__(s, "vocab_size", int(v))
    if not isinstance(s.tie_word_embeddings, bool):
        raise InputError(f"{_where(source)}field 'tie_word_embeddings' = {s.tie_word_embeddings!r}: expected "
                         "true or false")
    if s.weight_format not in BITS_PER_WEIGHT:
        raise InputError(f"{_where(source)}field 'weight_format' = {s.weight_format!r}: expected "
                         f"one of {', '.join(BITS_PER_WEIGHT)}")


def with_format(shape: ModelShape, fmt: str) -> ModelShape:
    """Module-level alias of `ModelShape.with_format`."""
    return shape.with_format(fmt)


def model_shape_from_dict(data: Any, source: str | None = None) -> ModelShape:
    """Build a validated `ModelShape` from a mapping of its fields."""
    _check_fields(data, ModelShape, source)
    probe = object.__new__(ModelShape)
    for f in dataclasses.fields(ModelShape):
        object.__setattr__(probe, f.name, data.get(f.name, f.default))
    _validate_shape(probe, source)
    return ModelShape(**{f.name: getattr(probe, f.name) for f in dataclasses.fields(ModelShape)})


def _hf_get(cfg: dict, key: str, source: str | None, default: Any = dataclasses.MISSING) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is dataclasses.MISSING:
        raise InputError(f"{_where(source)}HF config: missing field '{key}'")
    return default


def _hf_dense_params_per_layer(cfg: dict, source: str | None) -> int:
    """Non-expert weights of one decoder layer, exactly as the transformers modules hold them.

    Covers llama-style attention (mixtral, olmoe, qwen2_moe, qwen3_moe) and Qwen3-Next's
    mix of gated attention and Gated DeltaNet layers (averaged over the layers, rounded).
    """
    mt = str(cfg.get("model_type", ""))
    h = int(_hf_get(cfg, "hidden_size", source))
    L = int(_hf_get(cfg, "num_hidden_layers", source))
    E = int(_hf_get(cfg, "num_experts", source, cfg.get("num_local_experts")
                    or cfg.get("n_routed_experts") or dataclasses.MISSING))
    heads = int(_hf_get(cfg, "num_attention_heads", source))
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    q_out, kv_out = heads * hd, kv * hd

    q_mult = 2 if mt == "qwen3_next" else 1  # gated attention: q_proj also emits the gate
    full_attn = h * q_out * q_mult + 2 * h * kv_out + q_out * h
    if mt == "qwen2_moe" and cfg.get("qkv_bias", True):
        full_attn += q_out + 2 * kv_out
    elif cfg.get("attention_bias", False):
        full_attn += q_out * q_mult + 2 * kv_out + (h if mt != "qwen2_moe" else 0)
    if mt in ("qwen3_moe", "qwen3_next"):
        full_attn += 2 * hd  # q_norm, k_norm over the head dim
    elif mt == "olmoe":
        full_attn += q_out + kv_out  # q_norm, k_norm over the projected width

    per_layer_attn = [full_attn] * L
    if mt == "qwen3_next":
        nk = int(_hf_get(cfg, "linear_num_key_heads", source))
        nv = int(_hf_get(cfg, "linear_num_value_heads", source))
        dk = int(_hf_get(cfg, "linear_key_head_dim", source))
        dv = int(_hf_get(cfg, "linear_value_head_dim", source))
        conv_k = int(_hf_get(cfg, "linear_conv_kernel_dim", source))
        key_dim, value_dim = nk * dk, nv * dv
        linear = (h * (2 * key_dim + 2 * value_dim)  # in_proj_qkvz
                  + h * 2 * nv                      # in_proj_ba
                  + (2 * key_dim + value_dim) * conv_k  # depthwise conv1d
                  + 2 * nv + dv                     # dt_bias, A_log, gated norm
                  + value_dim * h)                  # out_proj
        types = cfg.get("layer_types")
        if not types:
            interval = int(_hf_get(cfg, "full_attention_interval", source))
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(L)]
        per_layer_attn = [full_attn if t == "full_attention" else linear for t in types[:L]]

    shared_i = int(cfg.get("shared_expert_intermediate_size") or 0)
    shared = 3 * h * shared_i + h if shared_i else 0  # shared expert + its sigmoid gate
    router = h * E
    norms = 2 * h
    total = sum(per_layer_attn) + L * (shared + router + norms)
    return int(round(total / L))


def model_shape_from_hf_config(config: dict, weight_format: str = "bf16",
                               name: str | None = None, source: str | None = None) -> ModelShape:
    """A `ModelShape` from the fields of a Hugging Face `config.json` (as a dict).

    Reads num_hidden_layers, num_experts | num_local_experts, num_experts_per_tok,
    hidden_size, moe_intermediate_size (else intermediate_size, as Mixtral) and the
    attention fields. Models whose layers are not all MoE are refused.
    """
    if not isinstance(config, dict):
        raise InputError(f"{_where(source)}HF config: expected a mapping")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1 \
            or config.get("first_k_dense_replace"):
        raise InputError(f"{_where(source)}HF config: models with dense (non-MoE) MLP layers "
                         "are not supported (mlp_only_layers / decoder_sparse_step / "
                         "first_k_dense_replace)")
    if config.get("kv_lora_rank"):
        raise InputError(f"{_where(source)}HF config: multi-head latent attention "
                         "(kv_lora_rank) is not supported")
    E = _hf_get(config, "num_experts", source, config.get("num_local_experts")
                or config.get("n_routed_experts") or dataclasses.MISSING)
    inter = config.get("moe_intermediate_size") or _hf_get(config, "intermediate_size", source)
    shape_name = name or str(config.get("_name_or_path") or config.get("model_type") or "hf-model")
    data = {
        "name": shape_name,
        "num_layers": _hf_get(config, "num_hidden_layers", source),
        "num_experts": E,
        "top_k": _hf_get(config, "num_experts_per_tok", source),
        "hidden": _hf_get(config, "hidden_size", source),
        "moe_intermediate": inter,
        "dense_params_per_layer": _hf_dense_params_per_layer(config, source),
        "weight_format": weight_format,
        "vocab_size": int(config.get("vocab_size") or 0),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }
    return model_shape_from_dict(data, source)


def list_model_shapes() -> list[str]:
    """Names of the model-shape presets (`runtime/data/models/`, or `$EXPERTSWEEP_MODELS_DIR`)."""
    return _list_presets("EXPERTSWEEP_MODELS_DIR", "models")


def load_model_shape(name_or_path: str | os.PathLike) -> ModelShape:
    """A preset name (`runtime/data/models/<name>.yaml`), a ModelShape YAML path, or an HF config.json.

    A file whose mapping has `hidden_size` is read as an HF config (bf16; the name is the
    config's `_name_or_path`, else the file's folder name for `config.json`, else its stem).
    """
    path = _resolve(name_or_path, "EXPERTSWEEP_MODELS_DIR", "models", "model shape")
    data = _read_yaml(path)
    if isinstance(data, dict) and "hidden_size" in data:
        nm = data.get("_name_or_path") or (path.resolve().parent.name
                                          if path.name == "config.json" else path.stem)
        return model_shape_from_hf_config(data, "bf16", name=str(nm), source=str(path))
    return model_shape_from_dict(data, str(path))


def save_model_shape(shape: ModelShape, path: str | os.PathLike) -> None:
    """Write `shape` as YAML readable by `load_model_shape`."""
    _write_text(path, yaml.safe_dump(dataclasses.asdict(shape), sort_keys=False))


def expert_bytes(shape: ModelShape) -> int:
    """Bytes of one expert (gate, up, down) in the shape's weight format, rounded up."""
    return math.ceil(shape.expert_params * shape.bits_per_weight / 8)


def dense_bytes_per_layer(shape: ModelShape) -> int:
    """Bytes of the dense part of one layer in the shape's weight format, rounded up."""
    return math.ceil(shape.dense_params_per_layer * shape.bits_per_weight / 8)


def head_bytes(shape: ModelShape) -> int:
    """Bytes read once per token after the last layer: final norm + LM head (0 if vocab unknown)."""
    if not shape.vocab_size:
        return 0
    return math.ceil((shape.vocab_size + 1) * shape.hidden * shape.bits_per_weight / 8)


def nonexpert_bytes(shape: ModelShape) -> int:
    """Device bytes of every non-expert weight: the layers' dense parts, embeddings, final norm, LM head."""
    emb = shape.vocab_size * shape.hidden * (1 if shape.tie_word_embeddings else 2)
    return math.ceil((shape.num_layers * shape.dense_params_per_layer + emb + shape.hidden)
                     * shape.bits_per_weight / 8)


def lowbit_expert_bytes(shape: ModelShape, bits: int, group: int) -> int:
    """Bytes of one expert's packed low-bit copy: the codes (`bits` per weight; 3-bit codes are packed 10 per
    32-bit word: 3.2) plus one fp16 scale and one fp16 zero point per group of `group` weights
    (runtime/backends/lowbit.py's group-wise layout, which holds them as float16 tensors). Exactly the bytes
    the engine holds when `group` divides hidden and moe_intermediate (3-bit: up to one partial word row)."""
    n = shape.expert_params
    code_bits = 3.2 if int(bits) == 3 else float(bits)
    return math.ceil(n * code_bits / 8) + 4 * math.ceil(n / group)


def model_shape_for(config: dict, dtype: str = "bf16", name: str | None = None) -> ModelShape:
    """The shape of a Hugging Face config as the engine holds it in `dtype` (fp32 | bf16 | fp16)."""
    fmt = DTYPE_FORMATS.get(str(dtype).replace("torch.", ""))
    if fmt is None:
        raise InputError(f"--dtype = {dtype!r} must be one of fp32, bf16, fp16")
    return model_shape_from_hf_config(config, fmt, name=name)


def shape_for_trace(trace: Any, name: str | None) -> ModelShape:
    """A runtime.formats.trace.Trace's model shape: the one named, else the one matching the trace's model, else Qwen3-Next geometry
    with the trace's L, E, k (documented in docs/simulator.md)."""
    if name:
        shape = load_model_shape(name)
    else:
        shape = None
        model = trace.meta.model.lower()
        for cand in list_model_shapes():
            if cand.replace("-", "").replace(".", "") in model.replace("-", "").replace(".", "").replace("/", ""):
                shape = load_model_shape(cand)
        if shape is None:
            shape = load_model_shape("qwen3-next-80b-a3b")
    if (shape.num_experts, shape.top_k) != (trace.E, trace.k) or shape.num_layers != trace.L:
        shape = dataclasses.replace(shape, name=f"{shape.name}[L={trace.L},E={trace.E},k={trace.k}]",
                        num_layers=trace.L, num_experts=trace.E, top_k=trace.k)
    return shape
