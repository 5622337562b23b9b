"""Router-trace recording: the exact model's top-k, gate weights and candidate ranking for a text.

`python -m runtime.record --model DIR --text FILE --out TRACE.parquet [--depth M] [--max-tokens N]
[--lookahead P] [--router-scores] [--dtype auto|fp32|bf16|fp16] [--max-memory GIB] [--device cpu|cuda]` writes the trace format of docs/traces.md (one row per token and MoE layer), with a
progress bar; `--lookahead P` adds the lookahead column (layer l + 1's router applied to layer l's
router input, first P ids) that `--prefetch lookahead` replays. `--device cuda` computes on the GPU:
a model that fits is moved there, a larger one has each layer streamed through it
(runtime/backends/stream.py's LayerPipe; docs/emulation.md).
A `--model` ending in `.gguf` is recorded by llama.cpp itself (runtime/tools/llamacpp.py; the extra
`expertsweep[llamacpp]`): same windows, same columns; flags that only a Hugging Face checkpoint has are
refused (docs/traces.md, "Recording with llama.cpp").

`--routing FILE --routing-format vllm|sglang|sglang-pt|llamacpp-csv|pos-csv --experts E --out T.parquet` imports
an engine's routing dump instead (runtime/formats/trace/imports.py): a trace without gate weights.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime.backends.hfmodel import (
    add_model_flags,
    default_window,
    load,
    make_trace,
    record_routing,
    tokenize_file,
)
from runtime.core.errors import ArgumentParser, InputError
from runtime.core.spec import add_run_flags
from runtime.formats.trace import add_routing_flags, import_main, save_trace, trace_output_path
from runtime.tools import llamacpp


def record_trace(model_dir: str | os.PathLike, text_path: str | os.PathLike, out_path: str | os.PathLike,
                 max_tokens: int | None = None, depth: int | None = None, window: int | None = None,
                 batch_windows: int = 8, progress: bool = False, lookahead: int = 0, dtype: str = "auto",
                 max_memory: float | str = "auto", device: str | None = None, router_scores: bool = False) -> Path:
    """Record the exact model's routing over a text into `out_path` (.parquet or .arrow); `lookahead` P > 0
    also records the lookahead lists, `router_scores` every expert's router score (Cache-Prior replays it).
    A `.gguf` model is recorded by llama.cpp (runtime/tools/llamacpp.py)."""
    if llamacpp.is_gguf_path(model_dir):
        llamacpp.refuse_flags({"--lookahead": (lookahead, 0), "--dtype": (dtype, "auto"),
                               "--max-memory": (max_memory, "auto"), "--device": (device, None),
                               "--batch-windows": (batch_windows, 8)})
        return llamacpp.record_gguf(model_dir, text_path, out_path, max_tokens, depth, window, progress,
                                    router_scores)
    out = trace_output_path(out_path)
    m = load(model_dir, dtype, max_memory, device=device)  # above max_memory: streamed, each layer read once
    M = m.E if depth is None else depth
    if not (m.k <= M <= m.E):
        raise InputError(f"--depth = {M} must be between k={m.k} and E={m.E}")
    if not (0 <= lookahead <= m.E):
        raise InputError(f"--lookahead = {lookahead} must be between 0 (none) and E={m.E}")
    windows, sha = tokenize_file(m, text_path, max_tokens, window or default_window(m))
    got = record_routing(m, windows, M, lookahead, batch_windows, progress, scores=router_scores)
    ids, w, rank, look = got[:4]
    save_trace(make_trace(m, ids, w, rank, windows, sha, f"runtime.tools.record {Path(text_path).name}", look,
                          got[5] if router_scores else None), out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="python -m runtime.record", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face checkpoint directory, or a .gguf file (recorded by llama.cpp: "
                   "pip install 'expertsweep[llamacpp]'); --model and --text, or --routing (import_main checks which)")
    p.add_argument("--text")
    p.add_argument("--out", required=True)
    p.add_argument("--depth", type=int, default=None, help="ranking depth M (default: E, exact)")
    add_run_flags(p, ("emulation",), only=("max_tokens", "window", "batch_windows"))  # RunSpec's rows
    p.add_argument("--lookahead", type=int, default=0,
                   help="also record per token and layer the first P ids of the next layer's router on this "
                        "layer's router input (for --prefetch lookahead); default 0: none")
    p.add_argument("--router-scores", action="store_true",
                   help="also record every expert's router score per token and layer (the router_scores column "
                        "that --route cache-prior replays; E floats per row)")
    p.add_argument("--device", default=None, help="cpu | cuda: where the layers compute (default: the host, plainly); "
                   "a model larger than the device is streamed through it layer by layer")
    add_model_flags(p)
    llamacpp.add_flags(p)
    add_routing_flags(p)
    a = p.parse_args(argv)
    if import_main(a, {"--model": a.model, "--text": a.text, "--depth": a.depth, "--lookahead": a.lookahead,
                       "--router-scores": a.router_scores, "--device": a.device, "--max-tokens": a.max_tokens,
                       "--llamacpp-defaults": a.llamacpp_defaults}):
        return  # --routing: an engine's routing dump imported (runtime/formats/trace/imports.py)
    if llamacpp.is_gguf_path(a.model) or a.llamacpp_defaults:
        out = llamacpp.record_main(p, a, progress=True)
        print(out)
        return
    out = record_trace(a.model, a.text, a.out, a.max_tokens, a.depth, a.window, a.batch_windows, progress=True,
                       lookahead=a.lookahead, dtype=a.dtype, max_memory=a.max_memory,
                       device=a.device, router_scores=a.router_scores)
    print(out)
