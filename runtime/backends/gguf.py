"""A GGUF file as the emulation's model: loaded by transformers' public GGUF loader, dequantized to float.

`load_model(path, dtype, max_memory)` returns (model, tokenizer) of a `.gguf` file through
`AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)` and `AutoTokenizer.from_pretrained(folder,
gguf_file=name)`: every tensor, quantized or not, is dequantized to float and the whole model is held in
memory (nothing streams), so a quantized GGUF's perplexity here is that of its dequantized weights in float
arithmetic, not llama.cpp's (which multiplies quantized blocks, e.g. Q8_0 weights with Q8_0 activations).
`gguf_config(path)` is the transformers config, with what transformers' GGUF config map leaves out read
from the GGUF's own metadata (`{arch}.expert_feed_forward_length` -> moe_intermediate_size,
`{arch}.expert_weights_norm` -> norm_topk_prob). Architectures: `SUPPORTED` (GGUF general.architecture ->
transformers model_type), those both transformers' loader and the policy adapters (runtime/backends/adapters.py)
take. Bad input (no such file, not a GGUF, another architecture, the gguf package missing, the load estimate
`load_GiB` above --max-memory) is a one-line InputError naming the file. runtime/backends/hfmodel.py `load` calls
this for a `.gguf` path; docs/emulation.md ("A GGUF file") documents it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from runtime.core.errors import InputError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MISSING_GGUF = "emulating a .gguf needs the gguf package: pip install 'expertsweep[llamacpp]'"
SUPPORTED = {"qwen3moe": "qwen3_moe"}  # GGUF general.architecture -> transformers model_type
GiB = 1024**3


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether a model path names a GGUF file (by its suffix, as `expertsweep record` decides)."""
    return str(path).lower().endswith(".gguf")


def check(path: str | os.PathLike, flag: str = "--model") -> str:
    """The GGUF's architecture after the checks every load makes: a file, a readable GGUF of a MoE model, an
    architecture in `SUPPORTED`, the gguf package installed (one-line InputErrors naming the file). No torch."""
    from runtime.tools.llamacpp import read_info

    try:
        import gguf  # noqa: F401 - transformers' GGUF loader needs it too
    except ImportError:
        raise InputError(MISSING_GGUF) from None
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{flag} {p}: no such file")
    info = read_info(p, flag)  # the magic, a readable GGUF, a MoE geometry
    if info.arch not in SUPPORTED:
        raise InputError(f"{flag} {p}: GGUF architecture {info.arch!r}: the emulation loads "
                         f"{', '.join(SUPPORTED)} GGUFs (transformers' GGUF loader and the policy adapters)")
    return info.arch


def _reader(path: Path, flag: str):
    """The gguf package's reader of `path` after `check`, and the architecture."""
    arch = check(path, flag)
    from gguf import GGUFReader

    return GGUFReader(str(path)), arch


def gguf_config(path: str | os.PathLike, flag: str = "--model"):
    """The transformers config of a GGUF (the metadata's MoE fields transformers' map leaves out filled in)."""
    p = Path(path)
    reader, arch = _reader(p, flag)
    return _config(p, reader, arch, flag)


def _config(p: Path, reader, arch: str, flag: str):
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, KeyError, RuntimeError here
        raise InputError(f"{flag} {p}: transformers cannot read its config ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160]})") from None
    fields = {"expert_feed_forward_length": "moe_intermediate_size", "expert_weights_norm": "norm_topk_prob"}
    for key, attr in fields.items():
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None:
            setattr(cfg, attr, field.contents())
    return cfg


def load_GiB(path: Path, reader, dtype: torch.dtype) -> float:
    """An upper estimate of what loading the GGUF holds in memory at its peak, in GiB: the file (mapped and read
    whole), every tensor dequantized to float32 (transformers' loader dequantizes to float32 arrays, then casts)
    and the model in `dtype` (reports/gguf_emulation.md measures the peak beside this)."""
    import torch

    elements = sum(int(np.prod([int(d) for d in t.shape])) for t in reader.tensors)
    size = torch.empty((), dtype=dtype).element_size()
    return (path.stat().st_size + elements * (4 + size)) / GiB


def load_model(path: str | os.PathLike, dtype: torch.dtype | None, max_memory_GiB: float,
               flag: str = "--model") -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) of a GGUF, dequantized to `dtype` (None: float32) and held whole in memory;
    refused (nothing loaded) when `load_GiB` exceeds `max_memory_GiB`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    reader, arch = _reader(p, flag)
    cfg = _config(p, reader, arch, flag)
    dt = dtype or torch.float32
    name = str(dt).removeprefix("torch.")
    need = load_GiB(p, reader, dt)
    if need > max_memory_GiB:
        raise InputError(f"{flag} {p}: loading it dequantized to {name} needs about {need:.3g} GiB, above --max-memory "
                         f"{max_memory_GiB:.3g} GiB (a GGUF is loaded whole, never streamed)")
    del reader
    log.info("--model %s: a %s GGUF, dequantized by transformers to %s (load estimate %.3g GiB)", p, arch, name, need)
    try:
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, config=cfg, dtype=dt,
                                                     local_files_only=True)
        tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a tensor transformers cannot map or dequantize
        raise InputError(f"{flag} {p}: transformers cannot load it ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160]})") from None
    model.eval()
    return model, tok


def file_digest(path: str | os.PathLike) -> str:
    """A cheap digest of a GGUF file: SHA-256 of its name, size and modification time (ns), no weight read
    (as sweep/data.py `checkpoint_digest` does for a folder's shards)."""
    import hashlib

    st = Path(path).stat()
    return hashlib.sha256(f"{Path(path).name}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
