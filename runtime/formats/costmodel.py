"""Cost model: turn the policy kernel's per token-layer event counts into time per token.

Pieces (the formulas are fixed in docs/cost_model.md; keep the two in step):

- `HostProfile`: a GPU host (link, device, host-CPU figures), stored as YAML. Presets `rtx3090`,
  `rtx4090`, `rtx5090` are package data, `runtime/data/hosts/<name>.yaml`, found with
  `importlib.resources` (in a checkout and in an installed wheel alike; `EXPERTSWEEP_HOSTS_DIR`
  names another folder of presets instead).
- `ModelShape`: the MoE geometry that sets expert and dense bytes, stored as YAML: presets in
  `runtime/data/models/` (`EXPERTSWEEP_MODELS_DIR` instead), or derived from a Hugging Face
  `config.json` (`model_shape_from_hf_config`).
- `CostParams`: the per-(host, shape) times in seconds (`cost_params`).
- `capacities_for_budget`: THE meaning of a VRAM budget (slots per layer that the engine can
  really hold after the non-expert weights, the CUDA context, cuBLAS workspace, a reserve,
  staging buffers and, with fallback=lowbit, the low-bit copies); used by the engine, the
  simulator and the sweep alike.
- `replay_time`: the event replay, a numba loop over tokens in stream order and layers in
  order with one clock and one FIFO host->device link; returns a `TimeBreakdown`.
- `all_resident_time`: the every-call-is-a-hit reference time per token.

Event columns (shared with runtime/core/kernel.py): EV_DEV=0 device expert computations,
EV_FETCH=1 synchronous fetches, EV_HOST=2 host computes, EV_ADM_QUEUED=3 admissions queued
at the end of the token-layer, EV_ADM_POPPED=4 queue entries taken off the layer's admission
queue right before the token-layer is processed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from numba import njit

from runtime.core.errors import InputError, atomic_write

log = logging.getLogger(__name__)

EV_DEV, EV_FETCH, EV_HOST, EV_ADM_QUEUED, EV_ADM_POPPED, EV_LOWBIT, EV_PREFETCH = range(7)
N_EV = 5  # columns every event array has; EV_LOWBIT and EV_PREFETCH are read when present (kernel: 7)
N_EV_FULL = 7

# Bits per weight of each storage format (ggml block layouts, see docs/cost_model.md):
#   bf16   : 2 bytes per weight.
#   q8_0   : blocks of 32 int8 quants + one fp16 scale = 34 bytes / 32 weights = 8.5 bpw.
#   q4_k_m : llama.cpp's Q4_K_M mix. Q4_K = 144-byte super-blocks of 256 weights (4.5 bpw),
#            Q6_K = 210 bytes / 256 (6.5625 bpw); Q4_K_M stores ffn_down as Q6_K in half of
#            the layers, gate/up as Q4_K: (2*4.5 + 0.5*6.5625 + 0.5*4.5) / 3 = 4.84 -> 4.85.
#   fp16 / fp32: the engine's own dtypes (a shape derived from a loaded model, runtime/backends/engine.py).
BITS_PER_WEIGHT: dict[str, float] = {"bf16": 16.0, "q8_0": 8.5, "q4_k_m": 4.85, "fp16": 16.0, "fp32": 32.0}
DTYPE_FORMATS = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
                 "float16": "fp16"}

# VRAM budget (capacities_for_budget, docs/cost_model.md "VRAM budget"). The CUDA context is not
# allocated through PyTorch and is not in torch.cuda.memory_allocated; 512 MiB is a typical CUDA 12/13
# context with PyTorch's kernels loaded lazily (the engine measures the real one on CUDA and reports it
# as `cuda_context_bytes`). cuBLAS keeps one workspace per stream and handle: 32 MiB on sm90+ (PyTorch's
# default CUBLAS_WORKSPACE_CONFIG ":4096:8"), 8 MiB before; we charge 32 MiB per stream that runs
# matrix products (the compute stream only). RESERVE_FRACTION of the budget covers activations, the KV
# cache and what the caching allocator reserves but does not hand out.
CUDA_CONTEXT_BYTES = 512 * 2**20
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
RESERVE_FRACTION = 0.05
PREFILL_STAGING = 2  # the prefill's double buffer

# Device kernel-launch-sized calls charged per layer for the dense part when it is not
# calibrated (attention/mixer projections + attention, output projection, shared expert,
# norms + router): dense_layer_s = DENSE_CALLS_PER_LAYER * device_overhead + dense bytes / bw.
DENSE_CALLS_PER_LAYER = 4

_HOST_REQUIRED_FLOATS = (
    "link_GBps", "link_pageable_GBps", "link_latency_us", "device_mem_GBps",
    "device_overhead_us", "host_mem_GBps", "host_overhead_us",
)
_HOST_OPTIONAL_FLOATS = ("device_expert_us", "host_expert_us", "dense_layer_us", "head_us", "lowbit_expert_us")
_SHAPE_INTS = ("num_layers", "num_experts", "top_k", "hidden", "moe_intermediate",
               "dense_params_per_layer")


# ----------------------------------------------------------------------------- validation

def _where(source: str | None) -> str:
    return f"{source}: " if source else ""


def _check_positive_number(value: Any, fld: str, source: str | None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise InputError(f"{_where(source)}field '{fld}' = {value!r}: expected a positive number")
    return float(value)


def _check_positive_int(value: Any, fld: str, source: str | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise InputError(f"{_where(source)}field '{fld}' = {value!r}: expected a positive integer")
    return int(value)


def _check_text(value: Any, fld: str, source: str | None) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{_where(source)}field '{fld}' = {value!r}: expected a non-empty string")
    return value


def _check_fields(data: Any, cls: type, source: str | None) -> None:
    if not isinstance(data, dict):
        raise InputError(f"{_where(source)}expected a mapping of {cls.__name__} fields, "
                         f"got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise InputError(f"{_where(source)}unknown field '{key}' = {data[key]!r} "
                             f"(known: {', '.join(sorted(known))})")
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in data:
            raise InputError(f"{_where(source)}missing field '{f.name}'")


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{path}: invalid YAML{where}: {problem}") from exc


def _preset_dir(env: str, sub: str) -> Path:
    """The folder of `sub` presets: `$env` when set, else the package data `runtime/data/<sub>`
    (`importlib.resources`: the checkout's folder, or the installed package's; a zipped install is
    not supported)."""
    if os.environ.get(env):
        return Path(os.environ[env])
    return Path(str(resources.files("runtime") / "data" / sub))


def _resolve(name_or_path: str | os.PathLike, env: str, sub: str, what: str) -> Path:
    text = os.fspath(name_or_path)
    path = Path(text)
    looks_like_path = path.suffix.lower() in (".yaml", ".yml", ".json") or os.sep in text \
        or "/" in text
    if looks_like_path or path.is_file():
        if not path.is_file():
            raise InputError(f"{what} file '{text}' does not exist")
        return path
    preset = _preset_dir(env, sub) / f"{text}.yaml"
    if preset.is_file():
        return preset
    avail = ", ".join(_list_presets(env, sub)) or "none"
    raise InputError(f"unknown {what} '{text}': not a file and not a preset (presets: {avail})")


def _write_text(path: str | os.PathLike, text: str) -> None:
    def write(tmp: str) -> None:
        Path(tmp).write_text(text, encoding="utf-8")

    atomic_write(path, write)


def _list_presets(env: str, sub: str) -> list[str]:
    d = _preset_dir(env, sub)
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


# ----------------------------------------------------------------------------- host profiles

@dataclass(frozen=True)
class HostProfile:
    """One host: link, device and host-CPU figures. Field names are the YAML keys.

    GB/s are 1e9 bytes per second. The optional `*_us` calibration fields, when set,
    replace the bandwidth formulas of `cost_params`; they are measured at one model shape
    and are only meaningful with that shape.
    """

    name: str
    gpu: str
    link_GBps: float
    link_pageable_GBps: float
    link_latency_us: float
    device_mem_GBps: float
    device_overhead_us: float
    host_mem_GBps: float
    host_overhead_us: float
    device_expert_us: float | None = None
    host_expert_us: float | None = None
    dense_layer_us: float | None = None
    head_us: float | None = None  # final norm + LM head per token (calibrated)
    lowbit_expert_us: float | None = None  # one low-bit expert dequantized and computed on the device
    vram_GiB: float = 24.0
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _validate_host(self, None)


def _validate_host(p: HostProfile, source: str | None) -> None:
    _check_text(p.name, "name", source)
    _check_text(p.gpu, "gpu", source)
    for f in _HOST_REQUIRED_FLOATS:
        object.__setattr__(p, f, _check_positive_number(getattr(p, f), f, source))
    for f in _HOST_OPTIONAL_FLOATS:
        v = getattr(p, f)
        if v is not None:
            object.__setattr__(p, f, _check_positive_number(v, f, source))
    object.__setattr__(p, "vram_GiB", _check_positive_number(p.vram_GiB, "vram_GiB", source))
    src = p.sources
    if isinstance(src, str) or not isinstance(src, list | tuple) \
            or not all(isinstance(s, str) for s in src):
        raise InputError(f"{_where(source)}field 'sources' = {src!r}: expected a list of strings")
    object.__setattr__(p, "sources", tuple(src))


def host_profile_from_dict(data: Any, source: str | None = None) -> HostProfile:
    """Build a validated `HostProfile` from a mapping (errors name `source`)."""
    _check_fields(data, HostProfile, source)
    d = dict(data)
    if "sources" in d and d["sources"] is None:
        d["sources"] = ()
    # validate with the file name in the message before the dataclass validates again
    probe = object.__new__(HostProfile)
    for f in dataclasses.fields(HostProfile):
        object.__setattr__(probe, f.name, d.get(f.name, f.default))
    _validate_host(probe, source)
    return HostProfile(**{f.name: getattr(probe, f.name) for f in dataclasses.fields(HostProfile)})


def list_host_profiles() -> list[str]:
    """Names of the host presets (`runtime/data/hosts/`, or `$EXPERTSWEEP_HOSTS_DIR`)."""
    return _list_presets("EXPERTSWEEP_HOSTS_DIR", "hosts")


def load_host_profile(name_or_path: str | os.PathLike) -> HostProfile:
    """A preset name (`rtx3090`, `rtx4090`, `rtx5090`: `runtime/data/hosts/<name>.yaml`) or a YAML path."""
    path = _resolve(name_or_path, "EXPERTSWEEP_HOSTS_DIR", "hosts", "host profile")
    prof = host_profile_from_dict(_read_yaml(path), str(path))
    log.debug("host profile %s from %s", prof.name, path)
    return prof


def save_host_profile(profile: HostProfile, path: str | os.PathLike) -> None:
    """Write `profile` as YAML readable by `load_host_profile` (unset calibration fields omitted)."""
    data: dict[str, Any] = {}
    for f in dataclasses.fields(HostProfile):
        v = getattr(profile, f.name)
        if f.name in _HOST_OPTIONAL_FLOATS and v is None:
            continue
        data[f.name] = list(v) if f.name == "sources" else v
    _write_text(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


# ----------------------------------------------------------------------------- model shapes

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
    """Bytes of one expert's packed low-bit copy: `bits` per weight plus one fp16 scale and one fp16
    zero point per group of `group` weights (runtime/backends/lowbit.py's group-wise layout)."""
    n = shape.expert_params
    return math.ceil(n * bits / 8) + 4 * math.ceil(n / group)


def model_shape_for(config: dict, dtype: str = "bf16", name: str | None = None) -> ModelShape:
    """The shape of a Hugging Face config as the engine holds it in `dtype` (fp32 | bf16 | fp16)."""
    fmt = DTYPE_FORMATS.get(str(dtype).replace("torch.", ""))
    if fmt is None:
        raise InputError(f"--dtype = {dtype!r} must be one of fp32, bf16, fp16")
    return model_shape_from_hf_config(config, fmt, name=name)


@dataclass(frozen=True)
class BudgetBreakdown:
    """What a VRAM budget is spent on (bytes), as `capacities_for_budget` computed it."""

    budget: int
    nonexpert: int
    context: int
    workspace: int
    reserve: int
    staging: int
    lowbit: int
    slot: int  # bytes of one slot (one expert)
    slots_per_layer: int

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _as_policies(policy) -> list:
    if policy is None:
        return []
    return list(policy) if isinstance(policy, list | tuple) else [policy]


def budget_breakdown(shape: ModelShape, budget_gib: float, policy=None, *,
                     context_bytes: int = CUDA_CONTEXT_BYTES, workspace_bytes: int = CUBLAS_WORKSPACE_BYTES,
                     reserve_fraction: float = RESERVE_FRACTION, flag: str = "--vram-budget") -> BudgetBreakdown:
    """The arithmetic of `capacities_for_budget` (no check against k)."""
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, int | float) or not math.isfinite(budget_gib) \
            or budget_gib <= 0:
        raise InputError(f"{flag} = {budget_gib!r} must be a positive number of GiB")
    pols = _as_policies(policy)
    L, k = shape.num_layers, shape.top_k
    budget = int(budget_gib * 2**30)
    slot = expert_bytes(shape)
    # staging: the prefill's double buffer, plus the most background copies in flight at once: per layer
    # up to k admissions queued per token for d tokens, and up to prefetch_n prefetch loads
    in_flight = 0
    lowbit = 0
    for p in pols:
        adm = L * k * int(p.admission_delay) if getattr(p, "beta", None) is not None else 0
        pf = 0
        if getattr(p, "prefetch", "off") != "off":
            pf = L * int(getattr(p, "prefetch_n", None) or k)
        in_flight = max(in_flight, adm + pf)
        if getattr(p, "fallback", "substitute") == "lowbit":
            lowbit = max(lowbit, L * shape.num_experts * lowbit_expert_bytes(shape, int(p.lowbit_bits),
                                                                            int(p.lowbit_group)))
    staging = (PREFILL_STAGING + in_flight) * slot
    reserve = int(reserve_fraction * budget)
    avail = budget - nonexpert_bytes(shape) - context_bytes - workspace_bytes - reserve - staging - lowbit
    c = min(int(avail // (L * slot)) if avail > 0 else 0, shape.num_experts - 1)
    return BudgetBreakdown(budget, nonexpert_bytes(shape), context_bytes, workspace_bytes, reserve, staging, lowbit,
                           slot, c)


class BudgetTooSmall(InputError):
    """A VRAM budget that leaves fewer than k expert slots per layer under the policy (capacities_for_budget).

    An InputError (one line, exit 2 at a CLI); a sweep records such a trial as `infeasible` at its
    budget instead of failed (sweep/worker.py). `slots` is what the budget left."""

    def __init__(self, message: str, slots: int = 0):
        super().__init__(message)
        self.slots = slots


def capacities_for_budget(shape: ModelShape, budget_gib: float, policy=None, *,
                          context_bytes: int = CUDA_CONTEXT_BYTES, workspace_bytes: int = CUBLAS_WORKSPACE_BYTES,
                          reserve_fraction: float = RESERVE_FRACTION, flag: str = "--vram-budget") -> np.ndarray:
    """Slots per MoE layer (int64 [L]) that a device with `budget_gib` GiB really holds under `policy`
    (one PolicyConfig, a list of them: the most demanding, or None).

    C = floor((budget - non-expert weights - CUDA context - cuBLAS workspace - reserve - staging
    - low-bit copies) / (L * expert bytes)), clamped to E - 1; reserve = RESERVE_FRACTION * budget;
    staging = (2 + the most admission and prefetch copies in flight) expert buffers; low-bit copies
    of all L * E experts when a policy's fallback is lowbit. Fewer than k slots: a one-line
    `BudgetTooSmall` (an InputError) naming `flag`, the budget and what went into it.
    docs/cost_model.md, "VRAM budget"."""
    b = budget_breakdown(shape, budget_gib, policy, context_bytes=context_bytes, workspace_bytes=workspace_bytes,
                         reserve_fraction=reserve_fraction, flag=flag)
    if b.slots_per_layer < shape.top_k:
        gib = 2**30
        raise BudgetTooSmall(f"{flag} = {budget_gib:g} GiB leaves {b.slots_per_layer} expert slots per layer, fewer "
                             f"than k = {shape.top_k} (non-expert weights {b.nonexpert / gib:.3g} GiB, CUDA context "
                             f"{b.context / gib:.3g}, cuBLAS workspace {b.workspace / gib:.3g}, reserve {b.reserve / gib:.3g}, "
                             f"staging {b.staging / gib:.3g}, low-bit copies {b.lowbit / gib:.3g} GiB; one expert "
                             f"{b.slot / 2**20:.3g} MiB x {shape.num_layers} layers)", b.slots_per_layer)
    log.info("VRAM budget %g GiB: %d slots per layer (%s)", budget_gib, b.slots_per_layer, b)
    return np.full(shape.num_layers, b.slots_per_layer, np.int64)


def budget_for_capacities(shape: ModelShape, capacities, policy=None, *,
                          reserve_fraction: float = RESERVE_FRACTION) -> float:
    """The inverse of `capacities_for_budget`: the smallest VRAM budget (GiB) that holds `capacities`
    slots per layer under `policy`, counted the same way (the simulator's `device_memory_GiB`)."""
    b = budget_breakdown(shape, 1.0, policy, reserve_fraction=0.0)  # fixed parts (no reserve)
    fixed = b.nonexpert + b.context + b.workspace + b.staging + b.lowbit
    slots = int(np.sum(np.broadcast_to(np.asarray(capacities, np.int64), (shape.num_layers,))))
    return (fixed + slots * b.slot) / (1.0 - reserve_fraction) / 2**30


# ----------------------------------------------------------------------------- cost parameters

@dataclass(frozen=True)
class CostParams:
    """Per-(host, shape) times in seconds."""

    fetch_s: float          # one synchronous, background or prefetch expert copy on the link
    device_expert_s: float  # one expert computed on the device
    host_expert_s: float    # one expert computed on the host CPU
    dense_layer_s: float    # the dense part of one layer on the device
    head_s: float = 0.0     # final norm + LM head, once per token
    lowbit_expert_s: float = 0.0  # one low-bit expert dequantized and computed on the device
    copies_block_host: bool = False  # pageable host memory: every copy blocks the issuing host thread


def cost_params(profile: HostProfile, shape: ModelShape, pinned: bool = True, lowbit_bits: int = 4,
                lowbit_group: int = 64) -> CostParams:
    """Resolve `profile` x `shape` into `CostParams` (formulas in docs/cost_model.md).

    `pinned=False`: copies from pageable memory, at `link_pageable_GBps`, and they block the host
    (CUDA stages pageable memory synchronously), so background copies are not in the background."""
    b = expert_bytes(shape)
    link = profile.link_GBps if pinned else profile.link_pageable_GBps
    fetch = profile.link_latency_us * 1e-6 + b / (link * 1e9)
    if profile.device_expert_us is not None:
        dev = profile.device_expert_us * 1e-6
    else:
        dev = profile.device_overhead_us * 1e-6 + b / (profile.device_mem_GBps * 1e9)
    if profile.host_expert_us is not None:
        host = profile.host_expert_us * 1e-6
    else:
        host = profile.host_overhead_us * 1e-6 + b / (profile.host_mem_GBps * 1e9)
    if profile.dense_layer_us is not None:
        dense = profile.dense_layer_us * 1e-6
    else:
        dense = (DENSE_CALLS_PER_LAYER * profile.device_overhead_us * 1e-6
                 + dense_bytes_per_layer(shape) / (profile.device_mem_GBps * 1e9))
    if profile.head_us is not None:
        head = profile.head_us * 1e-6
    elif shape.vocab_size:
        head = HEAD_CALLS * profile.device_overhead_us * 1e-6 + head_bytes(shape) / (profile.device_mem_GBps * 1e9)
    else:
        head = 0.0
    if profile.lowbit_expert_us is not None:
        lowbit = profile.lowbit_expert_us * 1e-6
    else:  # read the packed copy, dequantize (one more launch), compute
        lowbit = (LOWBIT_CALLS * profile.device_overhead_us * 1e-6
                  + lowbit_expert_bytes(shape, lowbit_bits, lowbit_group) / (profile.device_mem_GBps * 1e9))
    params = CostParams(fetch_s=fetch, device_expert_s=dev, host_expert_s=host, dense_layer_s=dense, head_s=head,
                        lowbit_expert_s=lowbit, copies_block_host=not pinned)
    log.debug("cost params %s x %s (pinned=%s): %s", profile.name, shape.name, pinned, params)
    return params


HEAD_CALLS = 2  # final norm, LM head matmul
LOWBIT_CALLS = 2  # dequantize, expert


# ----------------------------------------------------------------------------- replay

@dataclass(frozen=True)
class TimeBreakdown:
    """Result of `replay_time`. Sums are over the whole trace, in seconds.

    total_s = dense_s + head_s + compute_s + stall_fetch_s + stall_admission_s + stall_prefetch_s exactly.
    """

    total_s: float
    per_token_s: float             # total_s / T
    stall_fetch_s: float           # waiting for synchronous fetches
    stall_admission_s: float       # waiting for admission copies still in flight (and, pageable, issuing them)
    link_busy_s: float             # link occupancy, sync + admission + prefetch copies
    link_fetch_busy_s: float
    link_admission_busy_s: float
    dense_s: float
    compute_s: float               # sum over token-layers of max(device + low-bit, host) expert time
    device_compute_s: float
    host_compute_s: float
    num_tokens: int
    num_token_layers: int          # valid cells
    token_s: np.ndarray = field(repr=False, compare=False)  # float64 [T] time of each token
    head_s: float = 0.0            # final norm + LM head, once per token with a valid cell
    lowbit_compute_s: float = 0.0
    stall_prefetch_s: float = 0.0  # waiting for prefetch copies still in flight (and, pageable, issuing them)
    link_prefetch_busy_s: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        """Scalar fields as a dict (no per-token array)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "token_s"}


# stats vector layout of the numba loop
(_S_STALL_FETCH, _S_STALL_ADM, _S_LINK_FETCH, _S_LINK_ADM, _S_DENSE, _S_COMPUTE, _S_DEV, _S_HOST, _S_CELLS,
 _S_HEAD, _S_LOWBIT, _S_STALL_PF, _S_LINK_PF) = range(13)
_N_STATS = 13


@njit(cache=True)
def _replay_loop(events, valid, fetch_s, dev_s, host_s, dense_s, head_s, lowbit_s, blocking, ring_cap,
                 token_s, stats, err):  # pragma: no cover - compiled
    T = events.shape[0]
    L = events.shape[1]
    ring = np.zeros((L, ring_cap), np.float64)
    head = np.zeros(L, np.int64)
    count = np.zeros(L, np.int64)
    pf_done = np.zeros(L, np.float64)  # completion of the prefetch copies issued for layer l of this token
    now = 0.0
    link_free = 0.0
    for t in range(T):
        t_start = now
        any_valid = False
        for l in range(L):  # noqa: E741
            if not valid[t, l]:
                continue
            any_valid = True
            stats[_S_CELLS] += 1.0
            # (1) dense part (attention, router): the routing of this layer is known after it
            now += dense_s
            stats[_S_DENSE] += dense_s
            # (2) admissions taken off this layer's queue: the compute waits for the latest copy
            npop = events[t, l, EV_ADM_POPPED]
            if npop > count[l]:
                err[0] = t
                err[1] = l
                return now
            latest = -1.0
            for _ in range(npop):
                c = ring[l, head[l]]
                head[l] = (head[l] + 1) % ring_cap
                count[l] -= 1
                if c > latest:
                    latest = c
            if npop > 0 and latest > now:
                stats[_S_STALL_ADM] += latest - now
                now = latest
            # (3) prefetch loads for this layer, issued when the previous layer's routing was known
            npf = events[t, l, EV_PREFETCH]
            if npf > 0 and pf_done[l] > now:
                stats[_S_STALL_PF] += pf_done[l] - now
                now = pf_done[l]
            # (4) synchronous fetches, queued on the link behind what is already there
            nf = events[t, l, EV_FETCH]
            if nf > 0:
                for _ in range(nf):
                    link_free = max(link_free, now) + fetch_s
                stats[_S_LINK_FETCH] += nf * fetch_s
                if link_free > now:
                    stats[_S_STALL_FETCH] += link_free - now
                    now = link_free
            # (5) prefetch copies for the next valid layer of this token start now, behind the fetches
            nl = l + 1
            while nl < L and not valid[t, nl]:
                nl += 1
            if nl < L:
                npn = events[t, nl, EV_PREFETCH]
                for _ in range(npn):
                    link_free = max(link_free, now) + fetch_s
                stats[_S_LINK_PF] += npn * fetch_s
                pf_done[nl] = link_free if npn > 0 else 0.0
                if blocking and npn > 0:  # pageable: the host issues them synchronously
                    stats[_S_STALL_PF] += link_free - now
                    now = link_free
            # (6) expert compute: device (full precision + low-bit) and host in parallel
            d = events[t, l, EV_DEV] * dev_s
            lb = events[t, l, EV_LOWBIT] * lowbit_s
            h = events[t, l, EV_HOST] * host_s
            m = d + lb if d + lb > h else h
            now += m
            stats[_S_COMPUTE] += m
            stats[_S_DEV] += d
            stats[_S_LOWBIT] += lb
            stats[_S_HOST] += h
            # (7) background admission copies start now, behind anything on the link
            nq = events[t, l, EV_ADM_QUEUED]
            for _ in range(nq):
                link_free = max(link_free, now) + fetch_s
                ring[l, (head[l] + count[l]) % ring_cap] = link_free
                count[l] += 1
            stats[_S_LINK_ADM] += nq * fetch_s
            if blocking and nq > 0:
                stats[_S_STALL_ADM] += link_free - now
                now = link_free
        if any_valid:  # (8) final norm + LM head
            now += head_s
            stats[_S_HEAD] += head_s
        token_s[t] = now - t_start
    return now


def _max_outstanding(events: np.ndarray, valid: np.ndarray) -> int:
    """Most admission copies ever outstanding on one layer (ring-buffer size)."""
    q = np.where(valid, events[:, :, EV_ADM_QUEUED], 0).astype(np.int64)
    p = np.where(valid, events[:, :, EV_ADM_POPPED], 0).astype(np.int64)
    if q.size == 0:
        return 1
    outstanding = np.cumsum(q - p, axis=0)  # after each cell's pops then pushes
    return max(1, int(outstanding.max()))


def replay_time(events: np.ndarray, valid: np.ndarray, params: CostParams) -> TimeBreakdown:
    """Replay kernel events ([T, L, 5 or 7] ints) over `valid` ([T, L] bool) on one clock and link.

    Rules per valid token-layer, tokens in stream order then layers in order (invalid cells
    cost nothing and their events are ignored): dense; pop admissions (stall until the latest
    completes); wait for this layer's prefetch copies; synchronous fetches on the FIFO link
    (stall until the last lands); prefetch copies of the token's next layer start on the link;
    max(device + low-bit, host) expert compute; background admission copies start on the link.
    After the token's last layer: final norm + LM head. docs/cost_model.md has the details.
    """
    ev = np.asarray(events)
    va = np.asarray(valid)
    if ev.ndim != 3 or ev.shape[2] not in (N_EV, N_EV_FULL) or not np.issubdtype(ev.dtype, np.integer):
        raise ValueError(f"events: expected an integer array [T, L, {N_EV} or {N_EV_FULL}], got "
                         f"{ev.dtype} {ev.shape}")
    if va.shape != ev.shape[:2]:
        raise ValueError(f"valid: shape {va.shape} does not match events {ev.shape[:2]}")
    if ev.shape[2] == N_EV:
        ev = np.concatenate([ev, np.zeros(ev.shape[:2] + (N_EV_FULL - N_EV,), ev.dtype)], axis=2)
    ev = np.ascontiguousarray(ev, dtype=np.int32)
    va = np.ascontiguousarray(va, dtype=np.bool_)
    if (ev < 0).any():
        raise ValueError("events: negative counts")
    T = ev.shape[0]
    ring_cap = _max_outstanding(ev, va)
    token_s = np.zeros(T, np.float64)
    stats = np.zeros(_N_STATS, np.float64)
    err = np.full(2, -1, np.int64)
    total = _replay_loop(ev, va, float(params.fetch_s), float(params.device_expert_s),
                         float(params.host_expert_s), float(params.dense_layer_s), float(params.head_s),
                         float(params.lowbit_expert_s), bool(params.copies_block_host), ring_cap,
                         token_s, stats, err)
    if err[0] >= 0:
        raise ValueError(f"events: token {err[0]} layer {err[1]} pops more admissions than "
                         "are queued on that layer")
    link_f, link_a, link_p = float(stats[_S_LINK_FETCH]), float(stats[_S_LINK_ADM]), float(stats[_S_LINK_PF])
    return TimeBreakdown(
        total_s=float(total),
        per_token_s=float(total) / T if T else 0.0,
        stall_fetch_s=float(stats[_S_STALL_FETCH]),
        stall_admission_s=float(stats[_S_STALL_ADM]),
        link_busy_s=link_f + link_a + link_p,
        link_fetch_busy_s=link_f,
        link_admission_busy_s=link_a,
        dense_s=float(stats[_S_DENSE]),
        compute_s=float(stats[_S_COMPUTE]),
        device_compute_s=float(stats[_S_DEV]),
        host_compute_s=float(stats[_S_HOST]),
        num_tokens=T,
        num_token_layers=int(stats[_S_CELLS]),
        token_s=token_s,
        head_s=float(stats[_S_HEAD]),
        lowbit_compute_s=float(stats[_S_LOWBIT]),
        stall_prefetch_s=float(stats[_S_STALL_PF]),
        link_prefetch_busy_s=link_p,
    )


def all_resident_time(valid_layers: np.ndarray | int, params: CostParams, top_k: int) -> float:
    """Time per token if every expert call were a device hit.

    `valid_layers`: per-token counts of valid layers ([T] ints, e.g. `valid.sum(axis=1)`),
    a [T, L] bool `valid` mask, or one int (layers of a fully valid token). Each valid
    token-layer costs dense_layer_s + top_k * device_expert_s, and each token with a valid
    layer head_s; the result is the mean over T.
    """
    per_cell = params.dense_layer_s + top_k * params.device_expert_s
    if isinstance(valid_layers, int | np.integer):
        return float(valid_layers) * per_cell + (params.head_s if valid_layers > 0 else 0.0)
    v = np.asarray(valid_layers)
    if v.ndim == 2:
        v = v.sum(axis=1)
    if v.ndim != 1:
        raise ValueError(f"valid_layers: expected [T] counts or a [T, L] mask, got {v.shape}")
    if v.size == 0:
        return 0.0
    return (float(v.sum()) * per_cell + float((v > 0).sum()) * params.head_s) / v.size


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
