"""Low-precision expert copies (runtime/backends/lowbit.py): error by bits, grouping, packing, expert modules."""

from __future__ import annotations

import pytest
import torch

from runtime.backends import lowbit
from runtime.core.errors import InputError


def rtn(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Plain asymmetric round-to-nearest with min/max scale and zero per group (the baseline HQQ refines)."""
    rows, n = w.shape
    g = w.reshape(rows, n // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-12) / (2**bits - 1)
    q = torch.round((g - lo) / scale).clamp(0, 2**bits - 1)
    return (q * scale + lo).reshape(rows, n)


def test_error_shrinks_with_bits_and_beats_round_to_nearest():
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    errs = {}
    for b in lowbit.BITS:
        q = lowbit.quantize(w, b, 64)
        d = q.dequantize()
        assert d.shape == w.shape and d.dtype == torch.float32
        errs[b] = (d - w).pow(2).mean().item()
        base = (rtn(w, b, 64) - w).pow(2).mean().item()
        assert errs[b] <= base * 1.001, (b, errs[b], base)  # HQQ is at least as good as plain RTN
        # each group holds at most 2^bits distinct values
        assert all(len(torch.unique(grp)) <= 2**b for grp in d.reshape(-1, 64)[:8])
    assert errs[8] < errs[4] < errs[3] < errs[2]
    assert errs[8] < 1e-4 and errs[2] > 0.05


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 64), (3, 64), (2, 64), (4, 32)])
def test_storage_matches_bits_per_weight(bits, group):
    w = torch.randn(40, 256)
    q = lowbit.quantize(w, bits, group)
    want = lowbit.bits_per_weight(bits, group) * w.numel() / 8
    assert q.nbytes == pytest.approx(want, rel=0.03)  # (3-bit words pad to 10 groups)
    assert q.packed.element_size() * q.packed.numel() < w.numel() * bits / 8 * 1.1


def test_rows_not_a_multiple_of_the_group_and_groups_larger_than_rows():
    torch.manual_seed(1)
    w = torch.randn(12, 40)
    q = lowbit.quantize(w, 4, 16)  # 40 = 2 * 16 + 8: the last group is padded by repetition
    d = q.dequantize()
    assert d.shape == (12, 40) and (d - w).abs().max() < 0.5
    whole = lowbit.quantize(w, 4, 64)  # group > row: one group per row
    assert whole.group == 40 and whole.dequantize().shape == (12, 40)
    # a group of one weight is exact up to the float16 scale/zero
    assert (lowbit.quantize(w, 2, 1).dequantize() - w).abs().max() < 1e-2


def test_bad_parameters():
    with pytest.raises(InputError, match="lowbit_bits"):
        lowbit.quantize(torch.zeros(2, 4), 5, 4)
    with pytest.raises(InputError, match="lowbit_group"):
        lowbit.quantize(torch.zeros(2, 4), 4, 0)
    with pytest.raises(InputError, match="no per-expert weight matrices"):
        lowbit.quantize_experts(torch.nn.Linear(3, 3), 4, 4, 64)


class LinearExperts(torch.nn.Module):
    """[E, out, in] matrices applied as F.linear (the Qwen/Mixtral/DeepSeek layout) plus a bias."""

    def __init__(self, E=4, h=32, i=16, in_dim=-1):
        super().__init__()
        shape_up = (E, 2 * i, h) if in_dim == -1 else (E, h, 2 * i)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(*shape_up))
        self.down_proj = torch.nn.Parameter(torch.randn(E, h, i) if in_dim == -1 else torch.randn(E, i, h))
        self.bias = torch.nn.Parameter(torch.randn(E, h))


@pytest.mark.parametrize("in_dim", [-1, -2])
def test_dequantized_experts_copy(in_dim):
    torch.manual_seed(2)
    mod = LinearExperts(in_dim=in_dim)
    before = mod.gate_up_proj.detach().clone()
    dup = lowbit.dequantized_experts(mod, 4, 4, 8, in_dim)
    assert torch.equal(mod.gate_up_proj, before)  # the original module is untouched
    assert torch.equal(dup.bias, mod.bias)  # biases stay in full precision
    for name in ("gate_up_proj", "down_proj"):
        a, b = getattr(mod, name), getattr(dup, name)
        assert a.shape == b.shape and not torch.equal(a, b)
        rel = ((a - b).pow(2).mean() / a.pow(2).mean()).item()
        assert rel < 0.02
        # groups run along the input dim: with 8 weights per group, every input row of 8 holds <= 16 values
        mats = b.detach() if in_dim == -1 else b.detach().transpose(1, 2)  # [E, rows, n_in]
        assert all(len(torch.unique(g)) <= 16 for g in mats.reshape(-1, 8)[:32])


def test_quantized_on_the_host_in_float32(monkeypatch):
    """HQQ's optimizer runs in float16 when handed a CUDA device: `quantize` hands it host float32 only, and the
    codes, scale and zero do not depend on the input's dtype or device (here: a float16 input)."""
    seen = []
    real = lowbit._quantizer()

    class Spy:
        @staticmethod
        def quantize(t, **kw):
            seen.append((t.device.type, t.dtype, kw["device"], kw["compute_dtype"]))
            return real.quantize(t, **kw)

    monkeypatch.setattr(lowbit, "_quantizer", lambda: Spy)
    torch.manual_seed(4)
    w = torch.randn(32, 64).half()
    a, b = lowbit.quantize(w, 4, 16), lowbit.quantize(w.float(), 4, 16)
    assert seen == [("cpu", torch.float32, "cpu", torch.float32)] * 2
    assert torch.equal(a.packed, b.packed) and torch.equal(a.meta["scale"], b.meta["scale"])
    assert a.meta["scale"].dtype == torch.float16 and a.meta["compute_dtype"] == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    """Quantized on the host whatever the input's device: the CUDA copy dequantizes to the host copy exactly."""
    torch.manual_seed(3)
    w = torch.randn(64, 128)
    cpu = lowbit.quantize(w, 3, 64).dequantize()
    gpu = lowbit.quantize(w.cuda(), 3, 64)
    assert gpu.packed.is_cuda
    assert torch.equal(gpu.dequantize().cpu(), cpu)
    moved = lowbit.quantize(w, 4, 64).to("cuda")
    assert torch.equal(moved.dequantize().cpu(), lowbit.quantize(w, 4, 64).dequantize())
