"""The host store: every MoE layer's expert weights in host memory, where the engine copies them from.

Two layouts (docs/engine.md, "Host store"):
- `ram`: per MoE layer ONE flat host buffer holding `gate_up [E, 2I, H]` and `down [E, H, I]`, with CUDA
  page-locked in place (`cudaHostRegister` on a page-aligned buffer: no power-of-two rounding, no
  second copy), so host -> device copies run in the background;
- `mmap`: views of the checkpoint's memory-mapped safetensors (`gate [I, H]`, `up [I, H]`, `down [H, I]`
  per expert; pageable: CUDA copies from it block the host thread).

`build_host_store` makes either from the loaded model's expert modules and empties those modules (the
store holds the only copy); `HostStore.copy_into` fills a device buffer (runtime/backends/engine/slots.py),
`HostStore.weights` gives an expert's host tensors for host compute.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import mmap
import os
import re
import weakref
from pathlib import Path

import torch
from torch import nn

from runtime.core.errors import InputError

log = logging.getLogger(__name__)

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_PER_EXPERT = re.compile(r"layers\.(\d+)\.(?:.*\.)?experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"layers\.(\d+)\.(?:.*\.)?experts\.(gate_up_proj|down_proj)$")
_ROLE = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def mmap_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors file as views of a copy-on-write memory map (pages load on first use)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    n = int.from_bytes(mm[:8], "little")
    header = json.loads(mm[8 : 8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__" or meta["dtype"] not in _ST_DTYPES:
            continue
        dt = _ST_DTYPES[meta["dtype"]]
        a, b = meta["data_offsets"]
        count = (b - a) // torch.empty((), dtype=dt).element_size()
        if count:
            out[name] = torch.frombuffer(mm, dtype=dt, count=count, offset=8 + n + a).view(meta["shape"])
    return out


def page_aligned_empty(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A host tensor of `numel` elements that starts on a page boundary and owns every page it touches
    (2 spare pages allocated around it), and the page-rounded byte length to register: a registration
    never shares a page with another buffer (cudaHostRegister refuses a page registered twice)."""
    page = mmap.PAGESIZE
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
    off = (-raw.data_ptr()) % page
    return raw[off : off + nbytes].view(dtype), -(-nbytes // page) * page


def pin_in_place(t: torch.Tensor, nbytes: int, what: str) -> bool:
    """Page-lock `nbytes` of host memory from `t`'s first byte where it is (cudaHostRegister): no copy and
    no power-of-two rounding (only to whole pages). On failure (not enough lockable memory, ulimit -l, a
    driver that refuses) a warning says what it costs and False is returned: the caller keeps the memory
    pageable (copies then block the host) instead of stopping. The refusal's error is taken off the thread
    first (`_take_last_error`), so that it is not reported by the next kernel launch."""
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    except (RuntimeError, AttributeError) as exc:
        rc, why = -1, str(exc).splitlines()[0][:160]
    else:
        why = f"cudaHostRegister error {rc}"
        with contextlib.suppress(Exception):
            why += f" ({torch.cuda.cudart().cudaGetErrorString(rc)})"
    if rc == 0:
        return True
    _take_last_error()
    log.warning("could not pin %s (%.3g GiB of host memory: %s): it stays pageable, so its host->device copies "
                "block the host thread", what, nbytes / 2**30, why)
    return False


def _launch() -> None:
    """One one-element kernel on the current CUDA device. PyTorch checks every launch with cudaGetLastError,
    which returns the thread's last runtime error (of any earlier call) and clears it."""
    torch.ones(1, device="cuda").add_(1)


def _take_last_error() -> None:
    """Clear the error a refused runtime call (cudaHostRegister) left as the thread's last CUDA error, which
    PyTorch's check after the next kernel launch would report as that kernel's failure. torch's binding
    exports no cudaGetLastError, so a probe launch takes it (its check reads and clears it; the error is
    swallowed); a second probe that fails too is a device fault, not a refused registration: raised."""
    try:
        _launch()
    except RuntimeError as exc:
        log.debug("cleared the CUDA error a refused cudaHostRegister left: %s", str(exc).splitlines()[0][:160])
        _launch()


def _unpin(ptrs: list[int]) -> None:
    for p in ptrs:
        with contextlib.suppress(Exception):
            torch.cuda.cudart().cudaHostUnregister(p)


class HostStore:
    """Expert weights of every MoE layer on the host.

    `fused[l] = (gate_up [E, 2I, H], down [E, H, I])`: views of ONE flat buffer per layer (`flat[l]`),
    pinned in place with CUDA; or `parts[l][e] = (gate [I, H], up [I, H], down [H, I])` views of
    memory-mapped safetensors (pageable).
    """

    def __init__(self, dtype: torch.dtype, fused: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 parts: list[list[tuple[torch.Tensor, ...]]] | None = None, kind: str = "ram",
                 flat: list[torch.Tensor] | None = None, pinned: bool = False) -> None:
        self.dtype, self.fused, self.parts, self.kind = dtype, fused, parts, kind
        self.flat = flat or []
        self.pinned = pinned

    @classmethod
    def from_experts(cls, experts: list[nn.Module], dtype: torch.dtype, pin: bool, weights=None,
                     units: list[str] | None = None) -> HostStore:
        """Move every layer's fused expert tensors into one flat host buffer per layer, layer by layer,
        freeing the model's originals as it goes (peak: the experts once plus one layer). With `weights`
        (runtime/backends/stream.py: a model above --max-memory), each layer's experts unit is read from the
        shards just before its copy: the model's experts are never all in memory besides the store."""
        fused, flat, ptrs = [], [], []
        all_pinned = pin
        for l_, ex in enumerate(experts):
            if weights is not None:
                weights.load(units[l_])
                weights.loaded.discard(units[l_])  # its tensors now live in the store
            gu, d = ex.gate_up_proj.data, ex.down_proj.data
            if pin:
                buf, nbytes = page_aligned_empty(gu.numel() + d.numel(), dtype)
                if pin_in_place(buf, nbytes, f"the host expert store (MoE layer {l_})"):
                    ptrs.append(buf.data_ptr())
                else:
                    all_pinned = pin = False  # the rest stays pageable too (one warning)
            else:
                buf = torch.empty(gu.numel() + d.numel(), dtype=dtype)
            fgu, fd = buf[: gu.numel()].view(gu.shape), buf[gu.numel():].view(d.shape)
            fgu.copy_(gu)
            fd.copy_(d)
            _empty_experts([ex], dtype)
            del gu, d
            fused.append((fgu, fd))
            flat.append(buf)
        store = cls(dtype, fused=fused, kind="ram", flat=flat, pinned=all_pinned)
        if ptrs:  # unregister before the buffers are freed
            weakref.finalize(store, _unpin, ptrs)
        return store

    def copy_into(self, layer: int, e: int, buf, non_blocking: bool = False) -> None:
        """Expert e of `layer` into a device buffer `buf` (runtime/backends/engine/slots.py's ExpertBuf: gate_up [2I, H],
        down [H, I]) on the current stream."""
        if self.fused is not None:
            gu, d = self.fused[layer]
            buf.gate_up.copy_(gu[e], non_blocking=non_blocking)
            buf.down.copy_(d[e], non_blocking=non_blocking)
        else:
            g, u, d = self.parts[layer][e]
            i = g.shape[0]
            buf.gate_up[:i].copy_(g, non_blocking=non_blocking)
            buf.gate_up[i:].copy_(u, non_blocking=non_blocking)
            buf.down.copy_(d, non_blocking=non_blocking)

    def weights(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) on the host, in the engine's dtype (for host compute)."""
        if self.fused is not None:
            gu, d = self.fused[layer]
            return gu[e], d[e]
        g, u, d = self.parts[layer][e]
        return torch.cat([g, u]).to(self.dtype), d.to(self.dtype)

    def nbytes(self) -> int:
        if self.fused is not None:
            return sum(gu.numel() * gu.element_size() + d.numel() * d.element_size() for gu, d in self.fused)
        return sum(t.numel() * t.element_size() for row in self.parts for ex in row for t in ex)


def mmap_expert_parts(model_dir: Path, layer_ids: tuple[int, ...], E: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """Per MoE layer (decoder-layer ids `layer_ids`), per expert, (gate [I, H], up [I, H], down [H, I]) views of
    the checkpoint's memory-mapped safetensors, from per-expert or fused tensor names."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InputError(f"--host-store mmap: no .safetensors files in {model_dir}")
    found: dict[int, dict[int, list]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [None] * 3))
    for f in files:
        for name, t in mmap_safetensors(f).items():
            if (mt := _PER_EXPERT.search(name)) is not None:
                found[int(mt.group(1))][int(mt.group(2))][_ROLE[mt.group(3)]] = t
            elif (mt := _FUSED.search(name)) is not None:
                lay, what = int(mt.group(1)), mt.group(2)
                for e in range(t.shape[0]):
                    if what == "gate_up_proj":
                        i = t.shape[1] // 2
                        found[lay][e][0], found[lay][e][1] = t[e, :i], t[e, i:]
                    else:
                        found[lay][e][2] = t[e]
    parts = []
    for lay in layer_ids:
        row = [tuple(found[lay][e]) for e in range(E)] if lay in found else []
        if len(row) != E or any(p is None for r in row for p in r):
            raise InputError(f"--host-store mmap: {model_dir}: layer {lay} does not have gate/up/down tensors "
                             f"for all {E} experts in the safetensors files")
        parts.append(row)
    return parts


def _empty_experts(experts: list[nn.Module], dtype: torch.dtype) -> None:
    """The model's expert parameters become empty: the host store holds the weights."""
    for ex in experts:
        ex.gate_up_proj = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        ex.down_proj = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


def build_host_store(kind: str, experts: list[nn.Module], dtype: torch.dtype, *, pin: bool, model_dir: Path,
                     layer_ids: tuple[int, ...], weights=None, units: list[str] | None = None) -> HostStore:
    """The host store of `kind` ('ram' | 'mmap') for the model's fused expert modules (one per MoE layer,
    `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`), whose parameters are emptied. `pin` (CUDA): page-lock
    the ram store. `weights`, `units` (a streamed model, runtime/backends/stream.py): each layer's experts
    unit is read from the shards when that layer is copied (ram) or checked (mmap), then let go."""
    if kind == "ram":
        return HostStore.from_experts(experts, dtype, pin=pin, weights=weights, units=units)
    if kind != "mmap":
        raise InputError(f"--host-store = {kind!r} must be ram or mmap")
    E = int(experts[0].gate_up_proj.shape[0])
    parts = mmap_expert_parts(model_dir, layer_ids, E)
    for l_, ex in enumerate(experts):  # the checkpoint's tensors must be the model's experts
        if weights is not None:
            weights.load(units[l_])
        for e in {0, E - 1}:
            g, u, d = parts[l_][e]
            if not (torch.equal(torch.cat([g, u]).to(dtype), ex.gate_up_proj.data[e])
                    and torch.equal(d.to(dtype), ex.down_proj.data[e])):
                raise InputError(f"--host-store mmap: {model_dir}: the safetensors experts of MoE layer {l_} "
                                 f"do not match the loaded model's (expert {e})")
        if weights is not None:
            weights.release(units[l_])
    _empty_experts(experts, dtype)
    return HostStore(dtype, parts=parts, kind="mmap")
