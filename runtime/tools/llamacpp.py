"""Router traces recorded by llama.cpp itself, from a GGUF (`expertsweep record --model X.gguf`).

llama.cpp's MoE block (src/llama-graph.cpp `build_moe_ffn`) names its tensors per layer `il`:
`ffn_moe_logits-il` and `ffn_moe_probs-il` ([n_expert, n_tokens] f32), `ffn_moe_probs_biased-il` (a
selection bias, DeepSeek-V3), `ffn_moe_topk-il` ([n_expert_used, n_tokens] i32, a view of an argsort:
not contiguous), then the gate weights `ffn_moe_weights-il` and, where the architecture does so,
`ffn_moe_weights_norm-il` (renormalised over the top-k) and `ffn_moe_weights_scaled-il`. The
scheduler's eval callback (`llama_context_params.cb_eval`, llama-cpp-python's low-level bindings) is
asked for each graph node (ask = true: we ask for these names) and then handed it once computed
(ask = false: copied out with `ggml_backend_tensor_get`, honouring its strides), once per micro-batch.

`record_gguf` turns them into the project's trace exactly as runtime/tools/record.py does for a Hugging
Face checkpoint: the same windows (each window its own sequence from position 0, the text tokenized
without special tokens added), ids = the experts llama.cpp selected (`ffn_moe_topk`) in router order,
gate weights = the last weight tensor the graph applies (norm / scaled where it has them, so whatever
the architecture does, e.g. qwen3moe's renormalisation), ranking = every expert by descending selection
probability (ties: lower id), router scores = `ffn_moe_logits`. Every token's logits are requested
(otherwise the last layer runs only on the output rows). Flash attention off and an F32 KV cache by
default (then the routing of an F32 GGUF equals the checkpoint's; `exact=False` keeps llama.cpp's
defaults). docs/traces.md, "Recording with llama.cpp", says more; reports/llamacpp_routing.md has the
measured agreement.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.core.errors import InputError

log = logging.getLogger(__name__)

MISSING = "recording a .gguf needs llama.cpp's Python bindings: pip install 'expertsweep[llamacpp]'"
# the tensors of build_moe_ffn that the recorder reads
CAPTURED = ("ffn_moe_logits", "ffn_moe_probs", "ffn_moe_probs_biased", "ffn_moe_topk", "ffn_moe_weights",
            "ffn_moe_weights_softmax", "ffn_moe_weights_norm", "ffn_moe_weights_scaled")
# the weights the experts are multiplied with: the last of these the graph built
APPLIED = ("ffn_moe_weights_scaled", "ffn_moe_weights_norm", "ffn_moe_weights_softmax", "ffn_moe_weights")
_NAME = re.compile(r"^(" + "|".join(CAPTURED) + r")-(\d+)$")
GGML_F32, GGML_F16, GGML_I32 = 0, 1, 26
_NUMPY = {GGML_F32: np.float32, GGML_F16: np.float16, GGML_I32: np.int32}
GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}  # llama_expert_gating_func_type


def bindings():
    """llama_cpp's module, or the one-line hint to install the extra."""
    try:
        import llama_cpp
    except ImportError:
        raise InputError(MISSING) from None
    return llama_cpp


def is_gguf_path(path: str | os.PathLike) -> bool:
    """Whether a model path names a GGUF file (runtime/backends/gguf.py `is_gguf`)."""
    from runtime.backends.gguf import is_gguf

    return is_gguf(path)


class _TensorHead(ctypes.Structure):
    """The leading fields of ggml.h's `struct ggml_tensor` (type, buffer, ne[4], nb[4])."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4)]


@dataclass(frozen=True)
class _Ggml:
    """ggml's public C functions the callback uses, from the libraries llama_cpp loads."""

    get_name: object
    nbytes: object
    tensor_get: object

    @classmethod
    def load(cls, llama_cpp) -> _Ggml:
        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        candidates = sorted(lib_dir.glob("libggml-base.*")) + sorted(lib_dir.glob("libggml.*"))
        for path in candidates:
            try:
                lib = ctypes.CDLL(str(path))
                get_name, nbytes, tensor_get = lib.ggml_get_name, lib.ggml_nbytes, lib.ggml_backend_tensor_get
            except (OSError, AttributeError):
                continue
            get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
            nbytes.restype, nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
            tensor_get.restype = None
            tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
            return cls(get_name, nbytes, tensor_get)
        raise InputError(f"llama_cpp at {lib_dir}: no ggml library with ggml_backend_tensor_get there")

    def read(self, tensor: int) -> np.ndarray:
        """The tensor's elements as a C-ordered array [ne3, ne2, ne1, ne0], read through its strides nb
        (a view such as ffn_moe_topk is not contiguous)."""
        head = _TensorHead.from_address(tensor)
        if head.type not in _NUMPY:
            raise InputError(f"llama.cpp tensor {self.get_name(tensor).decode()}: ggml type {head.type} "
                             "is not f32, f16 or i32")
        size = int(self.nbytes(tensor))  # the span from the first to the last element, strides included
        raw = np.empty(size, np.uint8)
        self.tensor_get(tensor, raw.ctypes.data, 0, size)
        shape = tuple(int(head.ne[i]) for i in (3, 2, 1, 0))
        strides = tuple(int(head.nb[i]) for i in (3, 2, 1, 0))
        view = np.ndarray(shape, _NUMPY[head.type], buffer=raw, strides=strides)
        return np.ascontiguousarray(view)


class _Capture:
    """The eval callback: asks for the CAPTURED names while `active` and keeps their data per layer, in the
    order the micro-batches compute (tokens outermost)."""

    def __init__(self, ggml: _Ggml, callback_type) -> None:
        self.ggml = ggml
        self.active = False
        self.error: str | None = None
        self.chunks: dict[tuple[str, int], list[np.ndarray]] = defaultdict(list)
        self.callback = callback_type(self._eval)  # kept referenced while the context lives

    def _eval(self, tensor: int, ask: bool, _user: int) -> bool:
        if not self.active or self.error is not None:
            return False if ask else True
        match = _NAME.match(self.ggml.get_name(tensor).decode("utf-8", "replace"))
        if ask:
            return match is not None
        if match is not None:
            try:
                data = self.ggml.read(tensor)
                rows = int(data.shape[-2]) if match.group(1) in ("ffn_moe_logits", "ffn_moe_probs",
                                                                 "ffn_moe_probs_biased", "ffn_moe_topk",
                                                                 "ffn_moe_weights_norm") else int(data.shape[-3])
                self.chunks[(match.group(1), int(match.group(2)))].append(data.reshape(rows, -1))
            except Exception as exc:  # noqa: BLE001  (an exception cannot cross the C callback)
                self.error = f"{type(exc).__name__}: {exc}"
                return False
        return True

    def take(self) -> dict[tuple[str, int], np.ndarray]:
        """What the last decode captured, each name and layer's chunks joined [n_tokens, ...]; cleared."""
        got = {key: np.concatenate(parts) for key, parts in self.chunks.items()}
        self.chunks = defaultdict(list)
        return got


@dataclass(frozen=True)
class GgufInfo:
    """What the recorder needs from a GGUF's metadata."""

    path: Path
    arch: str
    num_experts: int
    top_k: int
    context_length: int
    gating: str


def read_info(path: str | os.PathLike, flag: str = "--model") -> GgufInfo:
    """A GGUF's architecture and MoE geometry (one-line InputError: not a GGUF, not a MoE model)."""
    from runtime.backends.gguf import field, open_gguf

    p = Path(path)
    reader, arch = open_gguf(p, flag, MISSING)  # the file, its magic, a readable GGUF with an architecture

    def value(key: str):
        return field(reader, key)

    E, k = value(f"{arch}.expert_count"), value(f"{arch}.expert_used_count")
    if not E or not k:
        raise InputError(f"{flag} {p}: {arch}.expert_count = {E}, {arch}.expert_used_count = {k}: not a "
                         "mixture-of-experts model (nothing to record)")
    return GgufInfo(p, str(arch), int(E), int(k), int(value(f"{arch}.context_length") or 0),
                    GATING.get(int(value(f"{arch}.expert_gating_func") or 1), "unknown"))


@dataclass(frozen=True)
class LlamaSettings:
    """The llama.cpp context: `exact` (default) turns flash attention off and keeps the KV cache in F32,
    with which an F32 GGUF's routing equals the checkpoint's; False keeps llama.cpp's defaults (flash
    attention auto, F16 KV cache), what a llama.cpp user runs."""

    exact: bool = True
    threads: int = 0  # 0: the CPUs this process may use

    def describe(self) -> str:
        return "flash attention off, F32 KV cache" if self.exact else "llama.cpp defaults (flash attention auto, F16 KV cache)"


class LlamaModel:
    """A GGUF loaded by llama.cpp with a context that records `CAPTURED`; `route(window)` decodes one window
    as its own sequence. Use as a context manager (frees the context and the model)."""

    def __init__(self, info: GgufInfo, window: int, settings: LlamaSettings = LlamaSettings()) -> None:
        from runtime.core import threads

        self.lib = llama_cpp = bindings()
        self.info, self.window, self.settings = info, window, settings
        quiet(llama_cpp)
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(info.path).encode(), mparams)
        if not self.model:
            raise InputError(f"--model {info.path}: llama.cpp could not load this GGUF (its log: "
                             f"{_last_error() or 'nothing'})")
        self.capture = _Capture(_Ggml.load(llama_cpp), llama_cpp.ggml_backend_sched_eval_callback)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = window
        cparams.n_seq_max = 1
        n_threads = settings.threads or threads.available_cpus()
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.cb_eval = self.capture.callback
        cparams.cb_eval_user_data = None
        if settings.exact:
            cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            cparams.type_k = cparams.type_v = llama_cpp.GGML_TYPE_F32
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise InputError(f"--model {info.path}: llama.cpp could not create a context of {window} tokens "
                             f"({_last_error() or 'no log line'})")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.batch = llama_cpp.llama_batch_init(window, 0, 1)

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None
            self.lib.llama_model_free(self.model)

    def tokenize(self, text: bytes) -> np.ndarray:
        """llama.cpp's token ids int64 [N] of a text, no special tokens added, special-token text parsed (as
        the Hugging Face tokenizer does by default)."""
        n_max = len(text) + 16
        buf = (self.lib.llama_token * n_max)()
        n = self.lib.llama_tokenize(self.vocab, text, len(text), buf, n_max, False, True)
        if n < 0:
            raise InputError(f"--text: llama.cpp's tokenizer needs {-n} tokens for {len(text)} bytes")
        return np.ctypeslib.as_array(buf)[:n].astype(np.int64)

    def route(self, tokens: np.ndarray) -> dict[tuple[str, int], np.ndarray]:
        """Decode one window (its own sequence, positions 0..W-1, every token's logits requested): the
        captured tensors per (name, layer), each [W, ...]."""
        lib, batch, W = self.lib, self.batch, len(tokens)
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        for i, token in enumerate(tokens.tolist()):
            batch.token[i] = token
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1  # every row computed: else the last layer's MoE runs on output rows only
        batch.n_tokens = W
        self.capture.active = True
        try:
            rc = lib.llama_decode(self.ctx, batch)
        finally:
            self.capture.active = False
        if self.capture.error is not None:
            raise RuntimeError(f"llama.cpp eval callback failed: {self.capture.error}")
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} on a window of {W} tokens")
        return self.capture.take()


_LOG_TAIL: list[str] = []
_LOG_CALLBACK: list = []  # the one callback llama.cpp logs to: referenced for the life of the process


def quiet(llama_cpp) -> None:
    """llama.cpp's (and its quantizer's) log lines to logging.debug instead of stderr; the last few kept
    for error messages."""
    if not _LOG_CALLBACK:
        _LOG_CALLBACK.append(llama_cpp.llama_log_callback(_llama_log))
    llama_cpp.llama_log_set(_LOG_CALLBACK[0], ctypes.c_void_p(0))


def _llama_log(level: int, text: bytes, _user: int) -> None:
    line = text.decode("utf-8", "replace").rstrip()
    if line:
        _LOG_TAIL[:] = [*_LOG_TAIL[-4:], line]
        log.debug("llama.cpp: %s", line)


def _last_error() -> str:
    return " | ".join(_LOG_TAIL[-2:])[:300]


@dataclass
class LayerRouting:
    """One MoE layer's routing over a window, in the trace's conventions."""

    ids: np.ndarray  # int32 [W, k], router order
    weights: np.ndarray  # float32 [W, k], as the graph applied them
    ranking: np.ndarray  # int32 [W, E], descending selection probability, ties lower id, the top-k first
    probs: np.ndarray  # float32 [W, E], ffn_moe_probs
    logits: np.ndarray | None  # float32 [W, E], ffn_moe_logits
    normalised: bool  # the graph renormalised the top-k weights (ffn_moe_weights_norm)


def layer_routing(got: dict[tuple[str, int], np.ndarray], layer: int) -> LayerRouting:
    """The routing of `layer` from one window's captured tensors."""
    probs = got[("ffn_moe_probs", layer)].astype(np.float32)  # [W, E]
    select = got.get(("ffn_moe_probs_biased", layer), probs)  # what the top-k is taken over
    topk = got[("ffn_moe_topk", layer)].astype(np.int64)  # [W, k], llama.cpp's selection
    applied = next(name for name in APPLIED if (name, layer) in got)
    weights_topk = got[(applied, layer)].astype(np.float32)  # [W, k], in topk's order
    W, E = probs.shape
    chosen = np.zeros((W, E), bool)
    np.put_along_axis(chosen, topk, True, axis=1)
    expert = np.broadcast_to(np.arange(E), (W, E))
    # the selected experts first (llama.cpp's set, also at an exact tie), each part by descending probability,
    # ties lower id
    ranking = np.lexsort((expert, -select.astype(np.float64), ~chosen), axis=1)  # [W, E]
    k = topk.shape[1]
    ids = ranking[:, :k]
    full = np.zeros((W, E), np.float32)
    np.put_along_axis(full, topk, weights_topk, axis=1)
    weights = np.take_along_axis(full, ids, axis=1)
    logits = got.get(("ffn_moe_logits", layer))
    return LayerRouting(ids.astype(np.int32), weights, ranking.astype(np.int32), probs,
                        None if logits is None else logits.astype(np.float32),
                        ("ffn_moe_weights_norm", layer) in got)


def weight_norm(info: GgufInfo, normalised: bool) -> str:
    """The trace's weight_norm of a GGUF's MoE: its gating function and whether the graph renormalised."""
    if info.gating == "softmax":
        return "softmax_topk" if normalised else "softmax_all"
    if info.gating == "sigmoid" and normalised:
        return "sigmoid_topk"
    return "unknown"


def read_text(text_path: str | os.PathLike, flag: str = "--text") -> tuple[bytes, str]:
    """The text file's bytes (checked to be UTF-8) and their sha256."""
    p = Path(text_path)
    try:
        raw = p.read_bytes()
        raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{flag} {p}: cannot be read as UTF-8 text ({type(exc).__name__})") from None
    return raw, hashlib.sha256(raw).hexdigest()


def default_window(info: GgufInfo) -> int:
    """As for a checkpoint (hfmodel.default_window): the model's context length, at most 512."""
    return int(min(info.context_length or 512, 512))


@dataclass
class Recording:
    """A GGUF's routing over a text: trace arrays [T, L, ...], the windows and provenance."""

    ids: np.ndarray  # int32 [T, L, k]
    weights: np.ndarray  # float32 [T, L, k]
    ranking: np.ndarray  # int32 [T, L, M]
    probs: np.ndarray  # float32 [T, L, E]
    logits: np.ndarray | None  # float32 [T, L, E]
    windows: np.ndarray  # int64 [n, W]
    layer_ids: tuple[int, ...]
    weight_norm: str
    info: GgufInfo
    settings: LlamaSettings


def record_windows(model: LlamaModel, windows: np.ndarray, depth: int | None = None,
                   progress: bool = False) -> Recording:
    """Decode every window (its own sequence) and gather the routing of every MoE layer."""
    from tqdm import tqdm

    info = model.info
    M = info.num_experts if depth is None else depth
    per_window: list[list[LayerRouting]] = []
    layer_ids: tuple[int, ...] = ()
    for row in tqdm(windows, desc="record (llama.cpp)", disable=not progress, unit="window"):
        got = model.route(row)
        seen = tuple(sorted({layer for name, layer in got if name == "ffn_moe_probs"}))
        if not seen:
            raise InputError(f"--model {info.path}: llama.cpp's graph has no ffn_moe_probs tensor (arch "
                             f"{info.arch}): its MoE layers cannot be recorded")
        if layer_ids and seen != layer_ids:
            raise RuntimeError(f"MoE layers {seen} in one window, {layer_ids} in another")
        layer_ids = seen
        routed = [layer_routing(got, layer) for layer in layer_ids]
        for layer, r in zip(layer_ids, routed, strict=True):
            if r.ids.shape != (len(row), info.top_k):
                raise RuntimeError(f"layer {layer}: top-k of shape {r.ids.shape}, expected {(len(row), info.top_k)}")
        per_window.append(routed)

    def stack(field: str) -> np.ndarray:  # [T, L, ...]
        return np.concatenate([np.stack([getattr(r, field) for r in rs], axis=1) for rs in per_window])

    logits = None if any(r.logits is None for rs in per_window for r in rs) else stack("logits")
    norms = {r.normalised for rs in per_window for r in rs}
    return Recording(stack("ids"), stack("weights"), stack("ranking")[:, :, :M], stack("probs"), logits,
                     windows, layer_ids, weight_norm(info, norms == {True}), info, model.settings)


def record_gguf(model_path: str | os.PathLike, text_path: str | os.PathLike, out_path: str | os.PathLike,
                max_tokens: int | None = None, depth: int | None = None, window: int | None = None,
                progress: bool = False, router_scores: bool = False,
                settings: LlamaSettings = LlamaSettings()) -> Path:
    """`record_trace` for a GGUF: llama.cpp's routing over a text into `out_path` (.parquet or .arrow)."""
    from runtime.backends.hfmodel import to_windows
    from runtime.formats.trace import Trace, TraceMeta, save_trace, trace_output_path

    out = trace_output_path(out_path)
    bindings()
    info = read_info(model_path)
    M = info.num_experts if depth is None else depth
    if not (info.top_k <= M <= info.num_experts):
        raise InputError(f"--depth = {M} must be between k={info.top_k} and E={info.num_experts}")
    raw, sha = read_text(text_path)
    W = window or default_window(info)
    with LlamaModel(info, W, settings) as model:
        ids = model.tokenize(raw)
        windows = to_windows(ids, max_tokens, W, f"--text {text_path}")
        rec = record_windows(model, windows, M, progress)
    n, _ = windows.shape
    T, L = rec.ids.shape[:2]
    meta = TraceMeta(model=f"{info.arch}:{info.path.resolve()}", num_experts=info.num_experts, top_k=info.top_k,
                     ranking_depth=M, layer_ids=rec.layer_ids, weight_norm=rec.weight_norm, text_sha256=sha,
                     source=f"runtime.tools.record {Path(text_path).name} (llama.cpp, {settings.describe()})")
    trace = Trace(topk_ids=rec.ids, topk_weights=rec.weights, ranking=rec.ranking, valid=np.ones((T, L), bool),
                  seq_id=np.repeat(np.arange(n, dtype=np.int32), W), position=np.tile(np.arange(W, dtype=np.int32), n),
                  meta=meta, router_scores=rec.logits if router_scores else None)
    if router_scores and rec.logits is None:
        raise InputError(f"--router-scores: llama.cpp's graph of {info.arch} has no ffn_moe_logits tensor")
    save_trace(trace, out)
    return out


# ---------------------------------------------------------------------------- `expertsweep record --model X.gguf`

# the record flags a GGUF takes (runtime/tools/record.py `main`); any other set to a non-default value is refused
GGUF_FLAGS = ("model", "text", "out", "depth", "max_tokens", "window", "router_scores", "llamacpp_defaults")
NOT_FOR_GGUF = {
    "--lookahead": "llama.cpp's graph has no lookahead router to record",
    "--dtype": "a GGUF runs in its own tensor types (export another: python -m runtime.tools.gguf_export --dtype)",
    "--max-memory": "llama.cpp memory-maps the GGUF and holds what it needs",
    "--device": "llama.cpp's own build decides where it computes",
    "--batch-windows": "llama.cpp decodes one window per call",
}


def add_flags(p) -> None:
    """The record command's llama.cpp flag."""
    p.add_argument("--llamacpp-defaults", action="store_true",
                   help="with a .gguf model: keep llama.cpp's default context (flash attention auto, F16 KV "
                        "cache), what its users run; default: flash attention off and an F32 KV cache, with "
                        "which an F32 GGUF's routing equals the checkpoint's")


def refuse_flags(values: dict[str, tuple[object, object]]) -> None:
    """One-line InputError for the first flag (name -> (value, default)) set away from its default."""
    for flag, (value, default) in values.items():
        if value != default:
            why = NOT_FOR_GGUF.get(flag, "it applies to a Hugging Face checkpoint only")
            raise InputError(f"{flag} = {value}: does not apply to a .gguf --model (recorded by llama.cpp): {why}")


def peak_rss_mib() -> float:
    """This process's peak resident set (ru_maxrss, KiB on Linux), in MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def record_main(p, a, progress: bool = True) -> Path:
    """`record` with a .gguf `--model` (or `--llamacpp-defaults`): refuse the flags it does not take, record,
    state the peak RSS on stderr."""
    import sys

    if not is_gguf_path(a.model):
        raise InputError(f"--llamacpp-defaults: applies to a .gguf --model only, not {a.model}")
    refuse_flags({"--" + dest.replace("_", "-"): (value, p.get_default(dest))
                  for dest, value in vars(a).items() if dest not in GGUF_FLAGS})
    out = record_gguf(a.model, a.text, a.out, a.max_tokens, a.depth, a.window, progress, a.router_scores,
                      LlamaSettings(exact=not a.llamacpp_defaults))
    print(f"expertsweep record: peak RSS {peak_rss_mib():.0f} MiB (this process, llama.cpp included)",
          file=sys.stderr)
    return out
