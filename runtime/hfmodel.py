"""Hugging Face MoE checkpoints for every backend: load offline, tokenize a text into windows, run the stream.

`load` attaches the policy wrappers of runtime/adapters.py; `run_stream` forwards the windows in
stream order under whatever cache is attached (per-token NLL); `record` does the same while the
router is recorded (ids, weights, ranking); `calibration_windows` gives the warm-start text.
The emulation (runtime/emulate.py), the engine (runtime/engine.py), trace recording and
generation all build on this module; it imports none of them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from runtime import adapters
from runtime.errors import InputError
from runtime.kernel import PolicyCache
from runtime.trace import Trace, TraceMeta


def parse_dtype(name: str, flag: str = "--dtype") -> torch.dtype:
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise InputError(f"{flag} = {name!r} must be one of fp32, bf16, fp16")
    return table[name]


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    ctx: adapters.Context
    num_layers: int  # MoE layers
    E: int
    k: int
    layer_ids: tuple[int, ...]
    model_dir: Path


def load(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Loaded:
    """Load a checkpoint and its tokenizer offline and attach the policy wrappers."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise InputError(f"--model {d}: no config.json there (not a Hugging Face checkpoint directory)")
    try:
        cfg = AutoConfig.from_pretrained(d, local_files_only=True)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise InputError(f"--model {d}/config.json: cannot be read: {str(exc).splitlines()[0][:200]}") from None
    adapters.family_of(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"--model {d}: no usable tokenizer ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    if len(tok) > cfg.vocab_size:
        raise InputError(f"--model {d}: tokenizer has {len(tok)} tokens but the model's vocab_size is {cfg.vocab_size} "
                         "(tokenizer does not match the model)")
    try:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - safetensors/torch raise many types for a corrupt file
        raise InputError(f"--model {d}: the weights cannot be loaded ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    model.eval()
    ctx = adapters.attach(model)
    L, E, k = adapters.moe_geometry(model)
    names = [n for n, m in model.named_modules() if isinstance(m, adapters.PolicyExperts)]
    layer_ids = tuple(_layer_index(n, i) for i, n in enumerate(names))
    return Loaded(model, tok, ctx, L, E, k, layer_ids, d)


def _layer_index(name: str, default: int) -> int:
    parts = name.split(".")
    for a, b in zip(parts[:-1], parts[1:], strict=False):
        if a == "layers" and b.isdigit():
            return int(b)
    return default


def read_tokens(m: Loaded, text_path: str | os.PathLike, flag: str = "--text") -> tuple[np.ndarray, str]:
    """The whole text file as one token stream int64 [N], and the text's sha256."""
    p = Path(text_path)
    try:
        raw = p.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{flag} {p}: cannot be read as UTF-8 text ({type(exc).__name__})") from None
    m.tokenizer.model_max_length = int(1e12)  # the stream is cut into windows later
    ids = np.asarray(m.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    if ids.size and ids.max() >= m.model.config.vocab_size:
        raise InputError(f"{flag} {p}: token id {int(ids.max())} >= vocab_size {m.model.config.vocab_size}")
    return ids, hashlib.sha256(raw).hexdigest()


def to_windows(ids: np.ndarray, max_tokens: int | None, window: int, where: str) -> np.ndarray:
    """The first `max_tokens` tokens cut into windows [n, window] (a trailing partial window dropped)."""
    ids = ids[:max_tokens] if max_tokens is not None else ids
    n = len(ids) // window
    if n == 0:
        raise InputError(f"{where}: {len(ids)} tokens, fewer than one window of {window}")
    return np.ascontiguousarray(ids[: n * window].reshape(n, window))


def tokenize_file(m: Loaded, text_path: str | os.PathLike, max_tokens: int | None, window: int,
                  flag: str = "--text") -> tuple[np.ndarray, str]:
    """Token stream [n_windows, window] (int64) of a text file, and the text's sha256."""
    ids, sha = read_tokens(m, text_path, flag)
    return to_windows(ids, max_tokens, window, f"{flag} {text_path}"), sha


def default_window(m: Loaded) -> int:
    return int(min(getattr(m.model.config, "max_position_embeddings", 512) or 512, 512))


@torch.inference_mode()
def run_stream(m: Loaded, windows: np.ndarray, batch_windows: int = 8, progress: bool = False,
               desc: str = "forward") -> np.ndarray:
    """Forward all windows in stream order under whatever is attached; NLL per token [n, window-1]."""
    n, W = windows.shape
    out = np.empty((n, W - 1), np.float64)
    it = range(0, n, batch_windows)
    for a in tqdm(it, desc=desc, disable=not progress, unit="batch"):
        x = torch.from_numpy(windows[a : a + batch_windows])
        logits = m.model(input_ids=x, use_cache=False).logits.float()  # [B, W, V]
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll = -torch.gather(lp, 2, x[:, 1:, None])[..., 0]
        out[a : a + batch_windows] = nll.double().numpy()
    return out


def record_routing(m: Loaded, windows: np.ndarray, depth: int, lookahead: int = 0, batch_windows: int = 8,
                   progress: bool = False, cache: PolicyCache | None = None, desc: str = "record"):
    """Run the stream under `cache` (None: the exact model) recording the routing. Returns ids [T, L, k],
    weights, ranking [T, L, depth], lookahead [T, L, P] (None when `lookahead` is 0) and the NLL [n, W-1]."""
    m.ctx.cache = cache
    rec = m.ctx.start_recording(depth, lookahead=lookahead)
    try:
        nll = run_stream(m, windows, batch_windows, progress, desc)
    finally:
        m.ctx.recorder = None
        m.ctx.cache = None
    ids, w, rank = rec.arrays()
    return ids, w, rank, rec.lookahead_array(), nll


def record(m: Loaded, windows: np.ndarray, depth: int, batch_windows: int = 8, progress: bool = False,
           cache: PolicyCache | None = None, desc: str = "record") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`record_routing` without lookahead lists: ids [T, L, k], weights, ranking [T, L, M], nll."""
    ids, w, rank, _, nll = record_routing(m, windows, depth, 0, batch_windows, progress, cache, desc)
    return ids, w, rank, nll


def make_trace(m: Loaded, ids, w, rank, windows: np.ndarray, text_sha: str, source: str,
               lookahead: np.ndarray | None = None) -> Trace:
    """The Trace of a recording (with its lookahead column [T, L, P] when given)."""
    T = ids.shape[0]
    n, W = windows.shape
    meta = TraceMeta(model=f"{m.model.config.model_type}:{m.model_dir.resolve()}", num_experts=m.E, top_k=m.k,
                     ranking_depth=rank.shape[2], layer_ids=m.layer_ids,
                     weight_norm=adapters.weight_norm_of(m.model.config), text_sha256=text_sha, source=source,
                     lookahead_depth=0 if lookahead is None else int(lookahead.shape[2]))
    return Trace(topk_ids=ids, topk_weights=w, ranking=rank, valid=np.ones((T, m.num_layers), bool),
                 seq_id=np.repeat(np.arange(n, dtype=np.int32), W), position=np.tile(np.arange(W, dtype=np.int32), n),
                 meta=meta, lookahead=lookahead)


def calibration_ids(m: Loaded, calib_text: str | os.PathLike | None, calib_max_tokens: int, window: int,
                    batch_windows: int = 8, progress: bool = False) -> tuple[np.ndarray | None, str]:
    """Router ids [T, L, k] of the warm-start text (`calib_text`, else calib.txt beside the model), read
    up to `calib_max_tokens` tokens, and its name; (None, "") when there is none (the caller then holds
    out part of the evaluated text: runtime/spec.py)."""
    calib = Path(calib_text) if calib_text else (m.model_dir / "calib.txt")
    if not calib.is_file():
        if calib_text:
            raise InputError(f"--calib-text {calib}: no such file")
        return None, ""
    cwin, _ = tokenize_file(m, calib, calib_max_tokens, window, flag="--calib-text")
    return calib_windows_ids(m, cwin, batch_windows, progress), f"calib text {calib} (first {cwin.size} tokens)"


def calib_windows_ids(m: Loaded, windows: np.ndarray, batch_windows: int = 8, progress: bool = False) -> np.ndarray:
    """Router ids [T, L, k] of the exact model over calibration windows."""
    cids, _, _, _ = record(m, windows, m.k, batch_windows, progress, desc="calibration")
    return cids
