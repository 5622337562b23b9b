"""GGUF export of a Qwen3-MoE Hugging Face checkpoint, for llama.cpp (and `expertsweep record --model X.gguf`).

`export_gguf(model_dir, out_path, dtype="f32")` writes a GGUF of architecture `qwen3moe` with the `gguf`
package's writer (tensor names from its QWEN3MOE map, each layer's experts stacked into one tensor per
projection) and the tokenizer's metadata (`tokenizer.ggml.model = gpt2`, tokens, types, merges and the
`gpt-2` pre-tokenizer, which is the byte-level GPT-2 split the project's tokenizers use), so that
llama.cpp tokenizes a text into the checkpoint's own token ids. `quantize_gguf(in, out, "q8_0")` runs
llama.cpp's own quantizer (`llama_model_quantize`) on such a file.

`python -m runtime.tools.gguf_export --model DIR --out X.gguf [--dtype f32|f16] [--quantize q8_0|q4_0]`
is its command line (docs/traces.md, "Recording with llama.cpp"). llama.cpp's converter
(convert_hf_to_gguf.py) needs torch's checkpoint loader and refuses the project's tokenizers (its
pre-tokenizer hash check), hence this writer. Only what llama.cpp's `qwen3moe` graph computes is
accepted: a checkpoint it would run differently (e.g. `norm_topk_prob: false`, which llama.cpp's
qwen3moe graph ignores: it always renormalises the top-k weights) is refused in one line.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np

from runtime.core.errors import ArgumentParser, InputError, atomic_write, check_output_path

log = logging.getLogger(__name__)

ARCH = "qwen3moe"
DTYPES = ("f32", "f16")
QUANT_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
               "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
MISSING_GGUF = "writing a .gguf needs the gguf package: pip install 'expertsweep[llamacpp]'"


def _config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"--model {path}: cannot be read as JSON ({type(exc).__name__})") from None
    checks = {
        "model_type": (cfg.get("model_type"), cfg.get("model_type") == "qwen3_moe",
                       "only qwen3_moe checkpoints are exported"),
        "norm_topk_prob": (cfg.get("norm_topk_prob"), bool(cfg.get("norm_topk_prob")),
                           "llama.cpp's qwen3moe graph always renormalises the top-k gate weights "
                           "(build_moe_ffn norm_w = true), so its GGUF would be another model"),
        "mlp_only_layers": (cfg.get("mlp_only_layers"), not cfg.get("mlp_only_layers"),
                            "llama.cpp's qwen3moe has a MoE block in every layer"),
        "decoder_sparse_step": (cfg.get("decoder_sparse_step", 1), cfg.get("decoder_sparse_step", 1) == 1,
                                "llama.cpp's qwen3moe has a MoE block in every layer"),
        "attention_bias": (cfg.get("attention_bias"), not cfg.get("attention_bias"),
                           "llama.cpp's qwen3moe has no attention biases"),
        "rope_scaling": (cfg.get("rope_scaling"), not cfg.get("rope_scaling"), "rope scaling is not exported"),
    }
    for field, (value, ok, why) in checks.items():
        if not ok:
            raise InputError(f"--model {path}: {field} = {value!r}: {why}")
    return cfg


def _num_experts(cfg: dict) -> int:
    """E: `num_experts`, saved by transformers 5 as `num_local_experts`."""
    return int(cfg.get("num_experts") or cfg["num_local_experts"])


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise InputError(f"--model config.json: rope_parameters.rope_type = {params['rope_type']!r}: only the "
                         "default rotary embedding is exported")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint's safetensors shards, as float32 numpy arrays."""
    from safetensors import safe_open

    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise InputError(f"--model {model_dir}: no .safetensors shards there")
    out: dict[str, np.ndarray] = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:  # torch: bf16 shards have no numpy dtype
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = f.get_tensor(name).float().numpy()
    return out


def _experts(w: dict[str, np.ndarray], layer: int, num_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """gate, up [E, F, H] and down [E, H, F] of a layer, from per-expert or fused (gate_up_proj) tensors."""
    pre = f"model.layers.{layer}.mlp.experts"
    if f"{pre}.gate_up_proj" in w:
        gate_up = w[f"{pre}.gate_up_proj"]  # [E, 2F, H]
        half = gate_up.shape[1] // 2
        return gate_up[:, :half], gate_up[:, half:], w[f"{pre}.down_proj"]
    try:
        stack = [np.stack([w[f"{pre}.{e}.{proj}.weight"] for e in range(num_experts)])
                 for proj in ("gate_proj", "up_proj", "down_proj")]
    except KeyError as exc:
        raise InputError(f"--model: tensor {exc.args[0]} is missing from the shards") from None
    return stack[0], stack[1], stack[2]


def _tokenizer(model_dir: Path, vocab_size: int) -> dict:
    """The GGUF tokenizer fields of a byte-level BPE tokenizer.json: tokens, types, merges, specials."""
    path = model_dir / "tokenizer.json"
    try:
        tok = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"--model {path}: cannot be read as JSON ({type(exc).__name__})") from None
    model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        raise InputError(f"--model {path}: model.type = {model.get('type')!r}: only BPE tokenizers are exported")
    # llama.cpp's `gpt-2` pre-tokenizer is the GPT-2 regex split of a ByteLevel pre-tokenizer with use_regex
    if (pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space")
            or tok.get("normalizer")):
        raise InputError(f"--model {path}: pre_tokenizer = {json.dumps(pre)} (normalizer "
                         f"{json.dumps(tok.get('normalizer'))}): only a byte-level GPT-2 split (ByteLevel, "
                         "use_regex, no prefix space, no normalizer) is exported")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    vocab.update(special)
    if max(vocab.values()) >= vocab_size:
        raise InputError(f"--model {path}: token id {max(vocab.values())} >= the model's vocab_size {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size  # gguf.TokenType.UNUSED
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = 3 if text in special else 1  # CONTROL, NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"tokens": tokens, "types": types, "merges": merges}


def export_gguf(model_dir: str | os.PathLike, out_path: str | os.PathLike, dtype: str = "f32") -> Path:
    """Write `out_path` (.gguf): the qwen3moe GGUF of a Qwen3-MoE checkpoint, weights in `dtype`
    (f32 or f16; norms and the router stay f32, as llama.cpp's converter keeps them)."""
    try:
        import gguf
    except ImportError:
        raise InputError(MISSING_GGUF) from None
    src, out = Path(model_dir), Path(out_path)
    if out.suffix != ".gguf":
        raise InputError(f"--out {out}: use a .gguf file name")
    if dtype not in DTYPES:
        raise InputError(f"--dtype = {dtype!r} must be one of {', '.join(DTYPES)}")
    check_output_path(out, "--out")
    cfg = _config(src)
    vocab_size, L, E = int(cfg["vocab_size"]), int(cfg["num_hidden_layers"]), _num_experts(cfg)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    tok = _tokenizer(src, vocab_size)
    rope_theta = _rope_theta(cfg)
    w = _tensors(src)
    big = np.float16 if dtype == "f16" else np.float32

    def name(tensor: gguf.MODEL_TENSOR, layer: int | None = None) -> str:
        base = gguf.TENSOR_NAMES[tensor]
        return (base if layer is None else base.format(bid=layer)) + ".weight"

    T = gguf.MODEL_TENSOR
    tensors: list[tuple[str, np.ndarray]] = [(name(T.TOKEN_EMBD), w["model.embed_tokens.weight"].astype(big)),
                                             (name(T.OUTPUT_NORM), w["model.norm.weight"])]
    if not cfg.get("tie_word_embeddings"):
        tensors.append((name(T.OUTPUT), w["lm_head.weight"].astype(big)))
    for layer in range(L):
        pre = f"model.layers.{layer}"
        gate, up, down = _experts(w, layer, E)
        tensors += [
            (name(T.ATTN_NORM, layer), w[f"{pre}.input_layernorm.weight"]),
            (name(T.ATTN_Q, layer), w[f"{pre}.self_attn.q_proj.weight"].astype(big)),
            (name(T.ATTN_K, layer), w[f"{pre}.self_attn.k_proj.weight"].astype(big)),
            (name(T.ATTN_V, layer), w[f"{pre}.self_attn.v_proj.weight"].astype(big)),
            (name(T.ATTN_OUT, layer), w[f"{pre}.self_attn.o_proj.weight"].astype(big)),
            (name(T.ATTN_Q_NORM, layer), w[f"{pre}.self_attn.q_norm.weight"]),
            (name(T.ATTN_K_NORM, layer), w[f"{pre}.self_attn.k_norm.weight"]),
            (name(T.FFN_NORM, layer), w[f"{pre}.post_attention_layernorm.weight"]),
            (name(T.FFN_GATE_INP, layer), w[f"{pre}.mlp.gate.weight"]),  # [E, H]: the router, f32
            (name(T.FFN_GATE_EXP, layer), gate.astype(big)),  # [E, F, H]
            (name(T.FFN_UP_EXP, layer), up.astype(big)),  # [E, F, H]
            (name(T.FFN_DOWN_EXP, layer), down.astype(big)),  # [E, H, F]
        ]

    def write(tmp: str) -> None:
        writer = gguf.GGUFWriter(tmp, ARCH)
        writer.add_name(src.name)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
        writer.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
        writer.add_embedding_length(int(cfg["hidden_size"]))
        writer.add_block_count(L)
        writer.add_feed_forward_length(int(cfg["intermediate_size"]))
        writer.add_head_count(int(cfg["num_attention_heads"]))
        writer.add_head_count_kv(int(cfg["num_key_value_heads"]))
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(rope_theta)
        writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
        writer.add_expert_count(E)
        writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
        writer.add_expert_weights_norm(True)  # what llama.cpp's qwen3moe graph does (checked in _config)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tok["tokens"])
        writer.add_token_types(tok["types"])
        writer.add_token_merges(tok["merges"])
        for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                         ("pad_token_id", writer.add_pad_token_id)):
            if cfg.get(key) is not None:
                add(int(cfg[key]))
        writer.add_add_bos_token(False)  # the project tokenizes without special tokens (hfmodel.read_tokens)
        for tensor_name, array in tensors:
            writer.add_tensor(tensor_name, np.ascontiguousarray(array))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(out, write)
    log.info("wrote %s: %d layers, %d experts, %s", out, L, E, dtype)
    return out


def quantize_gguf(in_path: str | os.PathLike, out_path: str | os.PathLike, qtype: str = "q8_0",
                  threads: int = 0) -> Path:
    """llama.cpp's quantizer (`llama_model_quantize`) from `in_path` to `out_path`, type `qtype` (q8_0,
    q4_0, q4_k_m); a tensor whose rows do not divide into the type's blocks gets llama.cpp's own fallback
    type, and the router (`ffn_gate_inp`) is never quantized (llama.cpp's rule)."""
    from runtime.tools.llamacpp import bindings, quiet

    llama_cpp = bindings()
    quiet(llama_cpp)
    src, out = Path(in_path), Path(out_path)
    key = qtype.lower()
    if key not in QUANT_TYPES:
        raise InputError(f"--quantize = {qtype!r} must be one of {', '.join(QUANT_TYPES)}")
    if out.suffix != ".gguf":
        raise InputError(f"--out {out}: use a .gguf file name")
    check_output_path(out, "--out")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_TYPES[key])
    params.nthread = threads

    def write(tmp: str) -> None:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), tmp.encode(), params)
        if rc != 0:
            raise InputError(f"--model {src}: llama.cpp's quantizer failed (return code {rc})")

    atomic_write(out, write)
    return out


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="python -m runtime.tools.gguf_export", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Qwen3-MoE Hugging Face checkpoint directory")
    p.add_argument("--out", required=True, help="the GGUF to write (.gguf)")
    p.add_argument("--dtype", default="f32", choices=DTYPES,
                   help="weights' type in the GGUF (default f32: llama.cpp's routing then equals the checkpoint's)")
    p.add_argument("--quantize", default=None, choices=tuple(QUANT_TYPES),
                   help="also quantize with llama.cpp's quantizer: writes OUT with the type before .gguf "
                        "(X.q8_0.gguf) beside the f32/f16 file")
    a = p.parse_args(argv)
    out = export_gguf(a.model, a.out, a.dtype)
    print(out)
    if a.quantize:
        print(quantize_gguf(out, quantized_path(out, a.quantize), a.quantize))


def quantized_path(path: str | os.PathLike, qtype: str) -> Path:
    """X.gguf -> X.q8_0.gguf (any earlier type tag of the same form replaced)."""
    p = Path(path)
    stem = re.sub(r"\.(f32|f16|q\d\w*)$", "", p.stem)
    return p.with_name(f"{stem}.{qtype}.gguf")


if __name__ == "__main__":
    from runtime.core.errors import cli_main

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    cli_main(lambda: main())
