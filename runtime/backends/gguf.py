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
GGUF_MAGIC = b"GGUF"
SUPPORTED = {"qwen3moe": "qwen3_moe"}  # GGUF general.architecture -> transformers model_type
GiB = 1024**3


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether a model path names a GGUF file (by its suffix, as `expertsweep record` decides)."""
    return str(path).lower().endswith(".gguf")


def model_folder(model: str | os.PathLike) -> Path:
    """Where the texts beside a model are looked for (eval.txt, calib.txt): a checkpoint folder itself, or the
    folder holding a GGUF file."""
    p = Path(model)
    return p.parent if is_gguf(p) else p


def open_gguf(path: str | os.PathLike, flag: str = "--model", missing: str = MISSING_GGUF):
    """The gguf package's reader of a GGUF file and its `general.architecture`: one-line InputErrors for a file
    that cannot be read, is not a GGUF, is unreadable as one, or has no architecture; `missing` when the gguf
    package is not installed. runtime/tools/llamacpp.py `read_info` reads the recorder's metadata through it."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise InputError(f"{flag} {p}: cannot be read ({type(exc).__name__})") from None
    if magic != GGUF_MAGIC:
        raise InputError(f"{flag} {p}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise InputError(missing) from None
    try:
        reader = GGUFReader(str(p))
    except Exception as exc:  # noqa: BLE001  (the reader raises what numpy and struct raise)
        raise InputError(f"{flag} {p}: unreadable GGUF ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None
    arch = field(reader, "general.architecture")
    if not arch:
        raise InputError(f"{flag} {p}: no general.architecture in the GGUF's metadata")
    return reader, str(arch)


def field(reader, key: str):
    """A metadata value of a GGUF reader (None when absent)."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def check(path: str | os.PathLike, flag: str = "--model"):
    """The reader and architecture of a GGUF the emulation loads: a file, a readable GGUF of a MoE model, an
    architecture in `SUPPORTED`, the gguf package installed (one-line InputErrors naming the file). No torch."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{flag} {p}: no such file")
    reader, arch = open_gguf(p, flag)
    if not field(reader, f"{arch}.expert_count") or not field(reader, f"{arch}.expert_used_count"):
        raise InputError(f"{flag} {p}: {arch}.expert_count / expert_used_count missing: not a mixture-of-experts "
                         "model")
    if arch not in SUPPORTED:
        raise InputError(f"{flag} {p}: GGUF architecture {arch!r}: the emulation loads "
                         f"{', '.join(SUPPORTED)} GGUFs (transformers' GGUF loader and the policy adapters)")
    return reader, arch


def gguf_config(path: str | os.PathLike, flag: str = "--model"):
    """The transformers config of a GGUF (the metadata's MoE fields transformers' map leaves out filled in)."""
    p = Path(path)
    reader, arch = check(p, flag)
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
        value = field(reader, f"{arch}.{key}")
        if value is not None:
            setattr(cfg, attr, value)
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
    reader, arch = check(p, flag)
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
