"""Low-precision copies of expert weights for the `lowbit` fallback (docs/policies.md, "Additions").

Quantizer: HQQ (half-quadratic quantization, the maintained `hqq` package on PyPI; its pure-torch
backend runs on CPU and CUDA). Per weight matrix of one expert, along the matrix's **input**
dimension, groups of `group` weights (`lowbit_group`) are quantized asymmetrically to `bits` in
{8, 4, 3, 2}: w ~ (q - zero) * scale with an integer code q in [0, 2^bits) and a scale and zero
per group (stored as float16 tensors, 2 bytes each; dequantized in float32). HQQ starts from round-to-nearest (min/max
scale and zero) and refines the zero point with its half-quadratic solver (20 iterations), which
lowers the weight error against plain round-to-nearest at the same storage (tests/test_lowbit.py
checks it for every width). Codes are bit-packed by HQQ (8 bits: 1 per byte, 4: 2 per byte,
2: 4 per byte, 3: 10 per int32); `QWeight.dequantize` unpacks.

Quantization always runs on the host in float32, whatever device the weights or the copy live on: HQQ's
optimizer works in float16 when it is handed a CUDA device, which would give the engine on a GPU other
codes than the emulation on the host. `quantize` returns the copy on the input's device; the engine
quantizes each expert once per (bits, group) and keeps the host copies (runtime/backends/engine/plan.py).

Why HQQ: it has every width the spec names (8, 4, 3, 2 bits, any group size) and a pure-torch path
that runs the same on CPU and CUDA, and it installs beside torch 2.13.0 CPU without replacing it
(new dependencies: accelerate, einops, psutil, termcolor). optimum-quanto 0.2.7 has no 3-bit
weights; torchao 0.18 was not tried further (its low-bit layouts are backend-specific).

A row whose length is not a multiple of the group is padded by repeating its last weight (the
statistics of the last group are unchanged; the padding is dropped after dequantization); a group
larger than the row is the row. Storage per weight: `bits_per_weight(bits, group)`.

`quantize_experts` quantizes every expert matrix of a Hugging Face experts module (3-D parameters
`[E, ...]`; biases stay in full precision); `dequantized_experts` returns a copy of the module whose
expert matrices are the dequantized low-precision copies, which the emulation uses to compute a
LOWBIT decision exactly as a device holding those copies would.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from runtime.core.errors import InputError

BITS = (8, 4, 3, 2)
HQQ_ITERS = 20  # HQQ's default number of half-quadratic iterations


def _quantizer():
    try:
        from hqq.core.quantize import Quantizer
    except ImportError as exc:  # a declared dependency; a clear message if an install lacks it
        raise InputError(f"fallback = 'lowbit' needs the hqq package (pip install hqq): {exc}") from None
    return Quantizer


def bits_per_weight(bits: int, group: int) -> float:
    """Stored bits per weight: the code (3-bit codes: 10 per 32-bit word) plus a float16 scale and zero per group."""
    code = 3.2 if bits == 3 else float(bits)
    return code + 32.0 / group


@dataclass
class QWeight:
    """One quantized matrix [rows, n_in] (groups along n_in)."""

    packed: torch.Tensor  # HQQ's packed codes
    meta: dict  # HQQ's metadata: scale, zero ([n_groups, 1] float16), compute_dtype float32, shape, nbits, ...
    shape: tuple[int, int]  # (rows, n_in) of the original matrix
    bits: int
    group: int  # effective group (min(lowbit_group, n_in))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The low-precision copy as a dense [rows, n_in] tensor on the device of `packed` (computed in float32:
        the float16 scale and zero are widened exactly, so the result is the same on every device)."""
        w = _quantizer().dequantize(self.packed, self.meta)  # [rows, n_in_padded]
        return w.reshape(self.shape[0], -1)[:, : self.shape[1]].to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored form as held: packed codes plus the scale and zero tensors (float16)."""
        return int(sum(t.numel() * t.element_size() for t in (self.packed, self.meta["scale"], self.meta["zero"])))

    def to(self, device: torch.device | str) -> QWeight:
        meta = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.meta.items()}
        return QWeight(self.packed.to(device), meta, self.shape, self.bits, self.group)


def check_params(bits: int, group: int) -> None:
    if bits not in BITS:
        raise InputError(f"lowbit_bits (--lowbit-bits) = {bits!r} must be one of {', '.join(map(str, BITS))}")
    if not (isinstance(group, int) and group >= 1):
        raise InputError(f"lowbit_group (--lowbit-group) = {group!r} must be an integer >= 1")


def quantize(w: torch.Tensor, bits: int, group: int) -> QWeight:
    """Quantize a matrix w [rows, n_in] group-wise along n_in (see the module docstring): on the host in
    float32, whatever `w`'s device; the copy is returned on `w`'s device."""
    check_params(bits, group)
    if w.ndim != 2:
        raise ValueError(f"quantize: expected a matrix [rows, n_in], got shape {tuple(w.shape)}")
    rows, n_in = w.shape
    g = min(group, n_in)
    pad = -n_in % g
    x = w.detach().to("cpu", torch.float32)
    if pad:
        x = torch.cat([x, x[:, -1:].expand(rows, pad)], dim=1)  # [rows, n_in + pad]
    packed, meta = _quantizer().quantize(x.contiguous(), nbits=bits, group_size=g, optimize=True, axis=1,
                                         compute_dtype=torch.float32, device="cpu")
    for key in ("scale", "zero"):  # stored in float16 (2 bytes each, as counted); widened exactly to dequantize
        meta[key] = meta[key].half()
    meta["compute_dtype"] = torch.float32  # codes unpacked to float32: (q - zero) * scale computed in float32
    q = QWeight(packed, meta, (rows, n_in), bits, g)
    return q if w.device.type == "cpu" else q.to(w.device)


def expert_matrices(experts: nn.Module, num_experts: int) -> list[str]:
    """Names of the experts module's per-expert weight matrices: 3-D parameters [E, a, b]."""
    names = [n for n, p in experts.named_parameters(recurse=False) if p.ndim == 3 and p.shape[0] == num_experts]
    if not names:
        raise InputError(f"{type(experts).__name__}: no per-expert weight matrices [E={num_experts}, ., .] to quantize")
    return names


def quantize_experts(experts: nn.Module, num_experts: int, bits: int, group: int,
                     in_dim: int = -1) -> dict[str, list[QWeight]]:
    """Every expert matrix of `experts`, quantized per expert: {param name: [QWeight] * E}.

    `in_dim` is the input dimension of each [a, b] matrix: -1 for `F.linear(x, W)` layouts ([out, in]),
    -2 for `x @ W` layouts ([in, out], gpt_oss)."""
    out: dict[str, list[QWeight]] = {}
    for name in expert_matrices(experts, num_experts):
        p = getattr(experts, name)
        mats = p.detach() if in_dim == -1 else p.detach().transpose(1, 2)  # [E, rows, n_in]
        out[name] = [quantize(mats[e], bits, group) for e in range(num_experts)]
    return out


def dequantized_experts(experts: nn.Module, num_experts: int, bits: int, group: int, in_dim: int = -1) -> nn.Module:
    """A copy of `experts` whose expert matrices are their dequantized low-precision copies (biases kept)."""
    q = quantize_experts(experts, num_experts, bits, group, in_dim)
    dup = copy.deepcopy(experts)
    for name, per_expert in q.items():
        p = getattr(dup, name)
        mats = torch.stack([qw.dequantize(p.dtype) for qw in per_expert])  # [E, rows, n_in]
        with torch.no_grad():
            p.copy_(mats if in_dim == -1 else mats.transpose(1, 2))
    return dup
