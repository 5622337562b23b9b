"""Hugging Face MoE checkpoints for every backend: load offline, tokenize a text into windows, run the stream.

`load` builds the model from its safetensors shards (runtime/backends/stream.py: whole when it fits
`max_memory`, else streamed) and attaches the policy wrappers of runtime/backends/adapters.py;
`run_lanes` forwards the windows in stream order once per lane (the exact model, or a policy
with its cache, recorder and decision log), one lane after the other in memory and layer-major
when streamed (each layer read once per pass); `run_stream` does it for whatever is attached;
`record` records the router (ids, weights, ranking); `calibration_ids` gives the warm start.
The emulation (runtime/backends/emulate.py), the engine (runtime/backends/engine/core.py), trace recording and
generation all build on this module; it imports none of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from runtime.backends import adapters, gguf, stream
from runtime.core.errors import InputError
from runtime.core.kernel import PolicyCache
from runtime.formats.trace import Trace, TraceMeta

log = logging.getLogger(__name__)


DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str, flag: str = "--dtype") -> torch.dtype | None:
    """A dtype name; `auto` is None: the checkpoint's own dtype (a bf16 checkpoint stays bf16)."""
    if name == "auto":
        return None
    if name not in DTYPES:
        raise InputError(f"{flag} = {name!r} must be one of auto, fp32, bf16, fp16")
    return DTYPES[name]


def add_model_flags(p, dtype_help: str = "the dtype the model runs in") -> None:
    """`--dtype` and `--max-memory`, the same on every command that loads a checkpoint (the run-field
    table's rows, runtime/core/spec.py: default and help written once)."""
    from runtime.core.spec import add_run_flags

    add_run_flags(p, ("emulation", "engine"), only=("dtype", "max_memory_GiB"), notes={"dtype": dtype_help})


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    ctx: adapters.Context
    num_layers: int  # MoE layers
    E: int
    k: int
    layer_ids: tuple[int, ...]
    model_dir: Path  # the checkpoint folder, or a GGUF file (runtime/backends/gguf.py)
    weights: stream.Weights | None = None  # where each tensor is in the shards, what is loaded (runtime/backends/stream.py)
    streamed: bool = False  # the weights do not fit max_memory (or the device): passes run layer-major (module doc)
    max_memory_GiB: float | None = None
    device: torch.device | None = None  # device mode (`--device`): where the layers compute; None: the host, plainly

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype


DEVICE_MARGIN_GiB = 1.0  # device memory left to activations, hidden states and the allocator under a resident model
DEVICE_MARGIN_FRACTION = 0.1
DEVICE_MEMORY_ENV = "EXPERTSWEEP_DEVICE_MEMORY_GIB"  # caps the device memory the weights may use (checks, tests)


def resolve_device(device: str | torch.device | None, flag: str = "--device") -> torch.device | None:
    """None (the plain host path), or the device of device mode: cpu, cuda, cuda:N."""
    if device is None or isinstance(device, torch.device):
        return device
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise InputError(f"{flag} = {device!r} must be cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"{flag} = {device}: no CUDA device is available (torch.cuda.is_available() is False)")
    return torch.device(device)


def device_budget_GiB(device: torch.device) -> float:
    """CUDA: the device memory the weights may use: free memory after the context is up, less
    max(1 GiB, 10%), capped by $EXPERTSWEEP_DEVICE_MEMORY_GIB when set."""
    torch.cuda.init()
    free, _ = torch.cuda.mem_get_info(device)
    free_g = free / stream.GiB
    budget = max(free_g - max(DEVICE_MARGIN_GiB, DEVICE_MARGIN_FRACTION * free_g), 0.0)
    cap = os.environ.get(DEVICE_MEMORY_ENV)
    if cap:
        budget = min(budget, stream.resolve_max_memory(cap, flag=f"${DEVICE_MEMORY_ENV}"))
    return budget


def load(model_dir: str | os.PathLike, dtype: str | torch.dtype | None = "auto",
         max_memory: float | str | None = "auto", device: str | torch.device | None = None) -> Loaded:
    """A checkpoint and its tokenizer, offline, with the policy wrappers attached. The model is built
    on the meta device and its weights read from the safetensors shards (runtime/backends/stream.py): all of
    them when they fit `max_memory` GiB (`auto`: available memory less a margin), else one unit at a
    time during each pass (`streamed`). `dtype`: `auto` (the checkpoint's own), a name or a torch dtype.
    `device` (device mode): `cuda` moves a model that fits the device there, unit by unit (nothing
    streams), and otherwise streams every layer through the device in each pass (stream.LayerPipe);
    `cpu` runs the same streaming code path on the host when the model is streamed. A `.gguf` file is
    dequantized whole by transformers (runtime/backends/gguf.py; `auto` is float32 there, nothing streams)."""
    from transformers import AutoConfig, AutoTokenizer

    d = Path(model_dir)
    if gguf.is_gguf(d):
        return _load_gguf(d, dtype, max_memory, device)
    if not (d / "config.json").is_file():
        raise InputError(f"--model {d}: no config.json there (not a Hugging Face checkpoint directory)")
    try:
        cfg = AutoConfig.from_pretrained(d, local_files_only=True)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise InputError(f"--model {d}/config.json: cannot be read: {str(exc).splitlines()[0][:200]}") from None
    fam = adapters.family_of(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"--model {d}: no usable tokenizer ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    if len(tok) > cfg.vocab_size:
        raise InputError(f"--model {d}: tokenizer has {len(tok)} tokens but the model's vocab_size is {cfg.vocab_size} "
                         "(tokenizer does not match the model)")
    dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    budget = stream.resolve_max_memory(max_memory)
    shards = stream.Shards(d)
    dt = dt or stream.checkpoint_dtype(shards, cfg)
    model = stream.skeleton(cfg, dt)
    blocks = adapters.moe_blocks(model, fam)
    w = stream.build_weights(model, shards, [getattr(b, fam.router_attr) for b in blocks],
                             [getattr(b, fam.experts_attr) for b in blocks])
    need = w.nbytes() / stream.GiB
    dev = resolve_device(device)
    streamed = need > budget
    resident = False  # the whole model on a CUDA device
    if dev is not None and dev.type == "cuda":
        dev_budget = device_budget_GiB(dev)
        resident = need <= dev_budget
        log.warning("--device %s: weights %.3g GiB %s the device budget %.3g GiB: %s", dev, need,
                    "within" if resident else "above", dev_budget,
                    "moved there unit by unit, nothing streams" if resident else "every layer streamed through it")
        streamed = not resident
    if resident:
        for u in w.units:  # one unit on the host at a time
            w.load(u)
            w.to_device(u, dev)
        _buffers_to(model, dev)
    elif streamed:
        n_layers = len(model.get_decoder().layers)
        layer = max(sum(w.nbytes(u) for u in stream.units_of_layer(w, i)) for i in range(n_layers)) / stream.GiB
        log.warning("--model %s: weights %.3g GiB (%s) > --max-memory %.3g GiB: streamed layer by layer (largest layer "
                    "%.3g GiB%s)", d, need, str(dt).removeprefix("torch."), budget, layer,
                    ", above the budget: one layer at a time is the least a pass holds" if layer > budget else "")
        w.load("routers")
    else:
        w.load_all()
    ctx = adapters.attach(model)
    L, E, k = adapters.moe_geometry(model)
    names = [n for n, mod in model.named_modules() if isinstance(mod, adapters.PolicyExperts)]
    layer_ids = tuple(_layer_index(n, i) for i, n in enumerate(names))
    if streamed and dev is not None:
        w.to_device("routers", dev)  # resident beside each layer (lookahead needs the next layer's router)
        _buffers_to(model, dev)
    return Loaded(model, tok, ctx, L, E, k, layer_ids, d, w, streamed, budget, dev)


def _load_gguf(path: Path, dtype: str | torch.dtype | None, max_memory: float | str | None,
               device: str | torch.device | None) -> Loaded:
    """A GGUF file, dequantized whole into memory by transformers (runtime/backends/gguf.py), with the policy
    wrappers attached; `device` cuda moves it there."""
    dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    budget = stream.resolve_max_memory(max_memory)
    model, tok = gguf.load_model(path, dt, budget)
    adapters.family_of(model.config)  # a family the adapters take (SUPPORTED's are)
    dev = resolve_device(device)
    if dev is not None:
        model.to(dev)
    ctx = adapters.attach(model)
    L, E, k = adapters.moe_geometry(model)
    names = [n for n, mod in model.named_modules() if isinstance(mod, adapters.PolicyExperts)]
    return Loaded(model, tok, ctx, L, E, k, tuple(_layer_index(n, i) for i, n in enumerate(names)), path,
                  max_memory_GiB=budget, device=dev)


def _buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """The skeleton's computed (non-persistent) buffers, e.g. rotary frequencies, to `device`."""
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                mod._buffers[name] = b.to(device)


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


@dataclass
class Lane:
    """One stream of the windows through the model: its cache (None = exact), recorder, decision log and
    lookahead lists. A pass advances several lanes over the same windows (the exact model and every
    policy of an evaluation group): one after the other when the model is in memory, layer by layer
    together when it is streamed, so each layer is read once per pass."""

    cache: PolicyCache | None = None
    recorder: adapters.Recorder | None = None
    decisions: list | None = None
    substitute_weight: str = "missed"
    desc: str = "forward"
    pending: list = None  # type: ignore[assignment]  # per layer, FIFO of lookahead lists
    seconds: float = 0.0  # wall time spent on this lane in the last pass

    FIELDS = ("cache", "recorder", "decisions", "substitute_weight", "pending")

    @classmethod
    def current(cls, ctx: adapters.Context, desc: str = "forward") -> Lane:
        """What is attached to `ctx` now, as a lane."""
        return cls(ctx.cache, ctx.recorder, ctx.decisions, ctx.substitute_weight, desc)

    def enter(self, ctx: adapters.Context) -> None:
        if self.pending is None:
            self.pending = [deque() for _ in range(ctx.num_layers)]
        for f in self.FIELDS:
            setattr(ctx, f, getattr(self, f))

    def leave(self, ctx: adapters.Context) -> None:
        for f in self.FIELDS:
            setattr(self, f, getattr(ctx, f))
        ctx.cache, ctx.recorder, ctx.decisions, ctx.substitute_weight = None, None, None, "missed"


def _nll(logits: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, W-1, V]
    x = x.to(lp.device)
    return (-torch.gather(lp, 2, x[:, 1:, None])[..., 0]).double().cpu().numpy()  # [B, W-1]


@torch.inference_mode()
def run_lanes(m: Loaded, windows: np.ndarray, lanes: list[Lane], batch_windows: int = 8,
              progress: bool = False) -> list[np.ndarray]:
    """Forward all windows in stream order once per lane; the NLL per token [n, window-1] of each lane."""
    if m.streamed:
        return _layer_major(m, windows, lanes, batch_windows, progress)
    n, W = windows.shape
    outs = []
    for lane in lanes:
        out = np.empty((n, W - 1), np.float64)
        lane.pending = None
        t0 = time.perf_counter()
        lane.enter(m.ctx)
        try:
            for a in tqdm(range(0, n, batch_windows), desc=lane.desc, disable=not progress, unit="batch"):
                x = torch.from_numpy(windows[a : a + batch_windows])
                if m.device is not None:
                    x = x.to(m.device)
                out[a : a + batch_windows] = _nll(m.model(input_ids=x, use_cache=False).logits, x)
        finally:
            lane.leave(m.ctx)
        lane.seconds = time.perf_counter() - t0
        outs.append(out)
    return outs


class _Capture(torch.nn.Module):
    """Stands in for a decoder layer while the model's own forward computes each layer's arguments
    (masks, rotary embeddings): keeps them and passes the hidden states through."""

    def __init__(self) -> None:
        super().__init__()
        self.args: tuple = ()
        self.kwargs: dict = {}
        self.hidden: torch.Tensor | None = None

    def forward(self, hidden_states, *args, **kwargs):
        self.hidden, self.args, self.kwargs = hidden_states, args, kwargs
        return hidden_states


def _layer_major(m: Loaded, windows: np.ndarray, lanes: list[Lane], batch_windows: int,
                 progress: bool) -> list[np.ndarray]:
    """The streamed pass: every window of every lane through decoder layer l before layer l + 1, each
    layer read from the shards once. Each layer's policy cache still sees the tokens in stream order, so
    every decision equals the in-memory pass (tests/test_contract.py, the `streamed` column).

    Device mode (`m.device`): the hidden states of all windows stay on the device in the compute dtype,
    the embeddings, final norm, head and routers are moved there when used, and each decoder layer
    comes through a `stream.LayerPipe` (layer l + 1 read and copied while layer l computes, layer l's
    device copy dropped when it is done). The policy kernel still runs on the host: the adapters read
    each layer's router scores back once per batch, as in every pass."""
    w, model, dev = m.weights, m.model, m.device
    to_dev = (lambda *us: [w.to_device(u, dev) for u in us]) if dev is not None else (lambda *us: None)
    base = model.get_decoder()
    layers = base.layers
    n, W = windows.shape
    spans = [(a, min(a + batch_windows, n)) for a in range(0, n, batch_windows)]
    out_units = stream.output_units(model, w)
    pre = [u for u in w.units if not u.startswith(("layer.", "experts.")) and u not in out_units and u != "routers"]
    # 1. embeddings and each layer's arguments from the model's own forward, layers replaced by captures
    first = [*pre, *[u for u in out_units if u == "embed"]]
    w.load(*first)
    to_dev(*first)
    caps = [_Capture() for _ in layers]
    real = list(layers)
    kw: dict[int, list[tuple[tuple, dict]]] = {}  # batch size -> per layer (args, kwargs)
    h0 = torch.empty((n, W, model.config.hidden_size), dtype=m.dtype, device=dev)
    if dev is not None and dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        for i, c in enumerate(caps):
            layers[i] = c
        for a, b in spans:
            x = torch.from_numpy(windows[a:b])
            base(input_ids=x if dev is None else x.to(dev), use_cache=False)
            h0[a:b] = caps[0].hidden
            kw.setdefault(b - a, [(c.args, c.kwargs) for c in caps])
    finally:
        for i, lay in enumerate(real):
            layers[i] = lay
    w.release("embed")
    hs = [h0] + [h0.clone() for _ in lanes[1:]]  # per lane [n, W, H]
    for lane in lanes:
        lane.pending, lane.seconds = None, 0.0
    bar = tqdm(total=len(layers) * len(lanes), desc=" + ".join(la.desc for la in lanes)[:40], disable=not progress,
               unit="layer")
    pipe = stream.LayerPipe(w, dev, [stream.units_of_layer(w, i) for i in range(len(layers))]) if dev is not None else None
    try:
        for i, lay in enumerate(layers):
            units = stream.units_of_layer(w, i)
            if pipe is None:
                w.load(*units)
            else:
                pipe.acquire(i)  # layer i on the device, then layer i + 1 read and copied while it computes
                pipe.start(i + 1)
            for lane, h in zip(lanes, hs, strict=True):
                t0 = time.perf_counter()
                lane.enter(m.ctx)
                try:
                    for a, b in spans:
                        args, kwargs = kw[b - a][i]
                        h[a:b] = lay(h[a:b], *args, **kwargs)
                finally:
                    lane.leave(m.ctx)
                lane.seconds += time.perf_counter() - t0
                bar.update(1)
            w.release(*units)
            m.ctx.lowbit_modules.pop(i, None)  # a low-bit copy built from this layer's experts goes with them
        if pipe is not None:
            pipe.close()
        # 2. the head: final norm and output embeddings, lane by lane, batch by batch
        w.load(*out_units)
        to_dev(*out_units)
        outs = []
        for lane, h in zip(lanes, hs, strict=True):
            t0 = time.perf_counter()
            out = np.empty((n, W - 1), np.float64)
            for a, b in spans:
                logits = model.get_output_embeddings()(base.norm(h[a:b]))
                out[a:b] = _nll(logits, torch.from_numpy(windows[a:b]))
            outs.append(out)
            lane.seconds += time.perf_counter() - t0
    finally:
        bar.close()
        if pipe is not None:
            pipe.close()
        for u in out_units:
            w.release(u)
    if dev is not None and dev.type == "cuda":
        log.info("layer-major pass on %s: peak device memory %.3f GiB allocated (%d layers streamed, staging %s "
                 "%.3f GiB)", dev, torch.cuda.max_memory_allocated(dev) / stream.GiB, len(layers),
                 "pinned" if pipe.pinned else "pageable", pipe.staged_bytes / stream.GiB)
    return outs


def run_stream(m: Loaded, windows: np.ndarray, batch_windows: int = 8, progress: bool = False,
               desc: str = "forward") -> np.ndarray:
    """Forward all windows in stream order under whatever is attached; NLL per token [n, window-1]."""
    lane = Lane.current(m.ctx, desc)
    try:
        return run_lanes(m, windows, [lane], batch_windows, progress)[0]
    finally:
        lane.enter(m.ctx)  # leave the attachments as they were
        m.ctx.pending = [deque() for _ in range(m.ctx.num_layers)]


def record_routing(m: Loaded, windows: np.ndarray, depth: int, lookahead: int = 0, batch_windows: int = 8,
                   progress: bool = False, cache: PolicyCache | None = None, desc: str = "record",
                   scores: bool = False):
    """Run the stream under `cache` (None: the exact model) recording the routing. Returns ids [T, L, k],
    weights, ranking [T, L, depth], lookahead [T, L, P] (None when `lookahead` is 0) and the NLL [n, W-1];
    with `scores` also every expert's router score [T, L, E] (the trace's router_scores column), sixth."""
    rec = adapters.Recorder.empty(m.num_layers, depth, lookahead, scores)
    nll = run_lanes(m, windows, [Lane(cache=cache, recorder=rec, desc=desc)], batch_windows, progress)[0]
    ids, w, rank = rec.arrays()
    if scores:
        return ids, w, rank, rec.lookahead_array(), nll, rec.scores_array()
    return ids, w, rank, rec.lookahead_array(), nll


def record(m: Loaded, windows: np.ndarray, depth: int, batch_windows: int = 8, progress: bool = False,
           cache: PolicyCache | None = None, desc: str = "record") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`record_routing` without lookahead lists: ids [T, L, k], weights, ranking [T, L, M], nll."""
    ids, w, rank, _, nll = record_routing(m, windows, depth, 0, batch_windows, progress, cache, desc)
    return ids, w, rank, nll


def make_trace(m: Loaded, ids, w, rank, windows: np.ndarray, text_sha: str, source: str,
               lookahead: np.ndarray | None = None, router_scores: np.ndarray | None = None) -> Trace:
    """The Trace of a recording (with its lookahead column [T, L, P] and router_scores [T, L, E] when given)."""
    T = ids.shape[0]
    n, W = windows.shape
    meta = TraceMeta(model=f"{m.model.config.model_type}:{m.model_dir.resolve()}", num_experts=m.E, top_k=m.k,
                     ranking_depth=rank.shape[2], layer_ids=m.layer_ids,
                     weight_norm=adapters.weight_norm_of(m.model.config), text_sha256=text_sha, source=source,
                     lookahead_depth=0 if lookahead is None else int(lookahead.shape[2]))
    return Trace(topk_ids=ids, topk_weights=w, ranking=rank, valid=np.ones((T, m.num_layers), bool),
                 seq_id=np.repeat(np.arange(n, dtype=np.int32), W), position=np.tile(np.arange(W, dtype=np.int32), n),
                 meta=meta, lookahead=lookahead, router_scores=router_scores)


def calibration_ids(m: Loaded, calib_text: str | os.PathLike | None, calib_max_tokens: int, window: int,
                    batch_windows: int = 8, progress: bool = False) -> tuple[np.ndarray | None, str]:
    """Router ids [T, L, k] of the warm-start text (`calib_text`, else calib.txt beside the model), read
    up to `calib_max_tokens` tokens, and its name; (None, "") when there is none (the caller then holds
    out part of the evaluated text: runtime/core/spec.py)."""
    calib = Path(calib_text) if calib_text else (gguf.model_folder(m.model_dir) / "calib.txt")
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
