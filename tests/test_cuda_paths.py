"""The engine's CUDA-only code paths, exercised on the CPU: the calls, budget arithmetic and
fallbacks that only a CUDA run takes, driven here with a CPU engine whose CUDA attributes are set by hand,
fake CUDA runtime functions (monkeypatched) or a device that holds no data ('meta').

Each test fails on the defect it guards (named in its docstring).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.backends import emulate
from runtime.backends.engine import Engine
from runtime.core.policy import PRESETS, PolicyConfig, resolve_capacities
from runtime.formats import costmodel
from tests.tiny_hf import build_tiny

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def load_script(name: str):
    """A module of scripts/ (not a package) by path."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny("qwen3_moe", tmp_path_factory.mktemp("cuda_paths") / "e8")


@pytest.fixture
def eng(tiny):
    e = Engine(emulate.load(tiny), "cpu")
    yield e
    e.close()


def as_cuda(eng: Engine, context_bytes: int) -> Engine:
    """A CPU engine that answers the budget questions as a CUDA engine does, with `context_bytes` measured."""
    eng.cuda, eng.context_bytes = True, context_bytes
    return eng


# ----------------------------------------------------------------------------- item 1: the bench's budget

def test_bench_sizes_a_cuda_budget_with_the_measured_context(eng):
    """bench_engine passed `context_bytes=` on CUDA only, which budget_for_capacities did not take: the bench
    died before round 1 on a GPU and never in CPU device mode. The CUDA branch's calls, on CPU."""
    bench = load_script("bench_engine")
    pols = [PRESETS["fetch-every-miss"], PRESETS["quality-first"],
            PolicyConfig(rule="fetch_all", prefetch="lookahead")]
    quarter = resolve_capacities(None, eng.L, eng.E, eng.k, 0.5)
    caps_cpu, cpu = bench.size_run(eng, pols, None, None, 0.5)
    ctx = 3 * 512 * MiB  # a context three times the cost model's constant
    caps, got = bench.size_run(as_cuda(eng, ctx), pols, None, None, 0.5)
    assert caps.tolist() == caps_cpu.tolist() == quarter.tolist() == got["capacity"]
    assert got["budget_context_bytes"] == ctx and cpu["budget_context_bytes"] == costmodel.CUDA_CONTEXT_BYTES
    want = costmodel.budget_for_capacities(eng.shape, quarter, pols, context_bytes=ctx)
    assert got["vram_budget_GiB"] == pytest.approx(want * (1 + 1e-9), rel=1e-12)
    extra = (ctx - costmodel.CUDA_CONTEXT_BYTES) / (1 - costmodel.RESERVE_FRACTION) / 2**30
    assert got["vram_budget_GiB"] - cpu["vram_budget_GiB"] == pytest.approx(extra, rel=1e-6)
    # the CPU run's budget on the CUDA engine does not hold the slots: the measured context is charged (the
    # tiny model's experts are a few KiB, so the 1 GiB more of context leaves none)
    with pytest.raises(costmodel.BudgetTooSmall, match="leaves 0 expert slots .* CUDA context 1.5"):
        eng.capacities_for_budget(cpu["vram_budget_GiB"], pols)
    # and an explicit --vram-budget goes through the same call
    caps_v, got_v = bench.size_run(eng, pols, None, got["vram_budget_GiB"], None)
    assert caps_v.tolist() == quarter.tolist() and got_v["budget_context_bytes"] == ctx


def test_budget_for_capacities_is_the_inverse_at_any_context():
    shape = costmodel.ModelShape(name="b", num_layers=4, num_experts=64, top_k=4, hidden=1024, moe_intermediate=512,
                                 dense_params_per_layer=2_000_000, vocab_size=32000)
    qf = PRESETS["quality-first"]
    for ctx in (0, 300 * MiB, costmodel.CUDA_CONTEXT_BYTES, 2000 * MiB):
        for ws in (0, costmodel.CUBLAS_WORKSPACE_BYTES):
            g = costmodel.budget_for_capacities(shape, 16, qf, context_bytes=ctx, workspace_bytes=ws)
            kw = {"context_bytes": ctx, "workspace_bytes": ws}
            assert costmodel.capacities_for_budget(shape, g * (1 + 1e-9), qf, **kw).tolist() == [16] * 4
            assert costmodel.capacities_for_budget(shape, g * (1 - 1e-4), qf, **kw).tolist() == [15] * 4
    assert costmodel.budget_for_capacities(shape, 16, qf) == costmodel.budget_for_capacities(
        shape, 16, qf, context_bytes=costmodel.CUDA_CONTEXT_BYTES)
    assert np.isclose(costmodel.budget_for_capacities(shape, 16, qf, context_bytes=1024 * MiB)
                      - costmodel.budget_for_capacities(shape, 16, qf), 512 / 1024 / 0.95)


# ----------------------------------------------------------------------------- item 2: low-bit copies

class SpyQuantizer:
    """hqq's Quantizer, recording the device and dtype of every matrix it is asked to quantize."""

    calls: list[tuple[str, torch.dtype, str]] = []

    def __init__(self, real):
        self.real = real

    def quantize(self, tensor, **kw):
        SpyQuantizer.calls.append((tensor.device.type, tensor.dtype, kw["device"]))
        return self.real.quantize(tensor, **kw)

    def dequantize(self, *a, **kw):
        return self.real.dequantize(*a, **kw)


def test_lowbit_copies_quantized_once_on_the_host_and_equal_the_emulations(tiny, eng, monkeypatch):
    """The engine quantized on its device (hqq's optimizer runs in float16 when handed a CUDA device) while the
    emulation quantizes on the host in float32: other codes, the 1e-4 checks failed on a GPU; and it rebuilt
    the copies at every binding of a low-bit policy (the bench: ~7 times). Here the runner's device is 'meta'
    (no data), as a CUDA device is not the host: the quantizer must see host float32 matrices only, once."""
    pytest.importorskip("hqq")
    from runtime.backends import adapters, lowbit

    real = lowbit._quantizer()
    SpyQuantizer.calls = []
    monkeypatch.setattr(lowbit, "_quantizer", lambda: SpyQuantizer(real))
    run = eng.runner
    run.device = torch.device("meta")
    lb = PolicyConfig(rule="threshold", tau=0.15, fallback="lowbit", lowbit_bits=4, lowbit_group=16)
    base = run.pool.dev_bytes
    run.bind_lowbit(lb)
    n = 2 * eng.L * eng.E
    assert SpyQuantizer.calls == [("cpu", torch.float32, "cpu")] * n
    assert all(q.packed.device.type == "meta" for row in run.lowbit for pair in row for q in pair)
    assert run.pool.dev_bytes - base == run.lowbit_bytes > 0
    run.bind_lowbit(PRESETS["fetch-every-miss"])  # the copies leave the device ...
    assert run.lowbit is None and run.pool.dev_bytes == base
    run.bind_lowbit(lb)  # ... and come back from the host copies: nothing quantized again
    assert len(SpyQuantizer.calls) == n and run.pool.dev_bytes - base == run.lowbit_bytes
    run.build_lowbit(4, 16, experts=eng.k)  # calibration: k experts per layer, from the same host copies
    assert len(SpyQuantizer.calls) == n and len(run.lowbit[0]) == eng.k
    run.build_lowbit(8, 16, experts=1)  # another width: quantized (L matrices x 2) once
    assert len(SpyQuantizer.calls) == n + 2 * eng.L
    # the host copies dequantize to exactly the emulation's low-bit weights (runtime.backends.lowbit.dequantized_experts)
    me = emulate.load(tiny)
    mods = [mod.experts for mod in me.model.modules() if isinstance(mod, adapters.PolicyExperts)]
    for l_, ex in enumerate(mods):
        dup = lowbit.dequantized_experts(ex, eng.E, 4, 16)
        for e in range(eng.E):
            qgu, qd = run.lowbit_host[(4, 16)][(l_, e)]
            assert torch.equal(qgu.dequantize(eng.dtype), dup.gate_up_proj[e].detach())
            assert torch.equal(qd.dequantize(eng.dtype), dup.down_proj[e].detach())


# ----------------------------------------------------------------------------- item 3: bytes as held

def test_lowbit_scale_and_zero_are_counted_at_the_bytes_they_take():
    """scale and zero were float32 tensors (holding float16 values) counted as 2 bytes each: the device held
    more than the budget charged. They are float16 now, and an expert's copy takes what the cost model says."""
    pytest.importorskip("hqq")
    from runtime.backends import lowbit

    torch.manual_seed(0)
    H, inter = 128, 64
    shape = costmodel.ModelShape(name="t", num_layers=1, num_experts=2, top_k=1, hidden=H, moe_intermediate=inter,
                                 dense_params_per_layer=1)
    for bits, group in ((8, 16), (4, 16), (3, 16), (2, 32), (4, 64)):
        gu, d = lowbit.quantize(torch.randn(2 * inter, H), bits, group), lowbit.quantize(torch.randn(H, inter), bits, group)
        for q in (gu, d):
            assert q.meta["scale"].dtype == q.meta["zero"].dtype == torch.float16
            held = sum(t.untyped_storage().nbytes() for t in (q.packed, q.meta["scale"], q.meta["zero"]))
            assert q.nbytes == held
        counted = costmodel.lowbit_expert_bytes(shape, bits, group)
        if bits == 3:  # 10 codes per word: each matrix's last row of words may be partly empty
            assert 0 <= gu.nbytes + d.nbytes - counted <= 2 * 4 * group, (bits, group)
        else:
            assert gu.nbytes + d.nbytes == counted, (bits, group)


# ----------------------------------------------------------------------------- item 3: the measured context

class FakeGPU:
    """cudaMemGetInfo and the caching allocator of a device whose context grows by `CUBLAS` bytes when the first
    matrix product runs (cuBLAS loading its kernels), as a real one does."""

    TOTAL, CONTEXT, CUBLAS, RESERVED = 80 * 2**30, 500 * MiB, 300 * MiB, 40 * MiB

    def __init__(self):
        self.products = 0

    def mem_get_info(self, device=None):
        used = self.CONTEXT + (self.CUBLAS if self.products else 0) + self.RESERVED
        return self.TOTAL - used, self.TOTAL


def test_cuda_context_is_measured_after_cublas_loads(monkeypatch):
    """The engine measured the context right after torch.cuda.init, before cuBLAS loaded, but the peak it
    reports includes cuBLAS's share: a budget sized with the early figure was exceeded by it."""
    from runtime.backends import engine as engine_mod

    gpu = FakeGPU()
    real_linear = torch.nn.functional.linear

    def linear(*a, **kw):
        gpu.products += 1
        return real_linear(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    monkeypatch.setattr(torch.cuda, "mem_get_info", gpu.mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: gpu.RESERVED)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    dev = torch.device("cpu")
    assert engine_mod.cuda_context_bytes(dev) == gpu.CONTEXT  # nothing run yet: what the old code saw
    got = engine_mod.cuda_context_bytes(dev, lambda: engine_mod.load_cublas(dev, torch.bfloat16))
    assert got == gpu.CONTEXT + gpu.CUBLAS and gpu.products == 2  # with and without a bias (cuBLASLt)


def test_warm_up_runs_the_exact_path_and_leaves_no_trace(eng):
    """Engine.warm_up (run before the context is measured on CUDA) decodes through the exact path with no policy
    bound and leaves the counters and the policy context as they were."""
    before = dict(eng.stats)
    eng.warm_up(3)
    assert eng.stats == before and eng.m.ctx.cache is None
    assert eng.pool.n_staging == 2  # the exact path streamed the experts through its two staging buffers
    assert eng.budget_context_bytes == costmodel.CUDA_CONTEXT_BYTES  # CPU device mode: the constant


# ----------------------------------------------------------------------------- item 4: a refused pin

class FakeCudart:
    """torch.cuda.cudart() of a driver that refuses (or accepts) cudaHostRegister, with the runtime's per-thread
    last error; like torch's binding, it has no cudaGetLastError."""

    def __init__(self, refuse: bool):
        self.refuse, self.last_error, self.registered, self.unregistered = refuse, 0, [], []

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the runtime's name
        if self.refuse:
            self.last_error = 2  # cudaErrorMemoryAllocation, left as the thread's last error
            return 2
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, rc):  # noqa: N802
        return "out of memory"

    def launch(self):
        """A kernel launch as PyTorch checks it: cudaGetLastError after it, raised if set (and cleared)."""
        err, self.last_error = self.last_error, 0
        if err:
            raise RuntimeError(f"CUDA error: out of memory (error {err})")


class TwoExperts(torch.nn.Module):
    def __init__(self, E=4, H=16, inter=8):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * inter, H), requires_grad=False)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, inter), requires_grad=False)


def fake_runtime(monkeypatch, refuse: bool) -> FakeCudart:
    from runtime.backends.engine import store as hoststore

    rt = FakeCudart(refuse)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(hoststore, "_launch", rt.launch)
    return rt


def test_a_refused_pin_falls_back_to_pageable_without_poisoning_the_next_launch(monkeypatch, caplog):
    """hoststore cleared the refusal with cudaGetLastError, which torch's binding does not export (the
    AttributeError was suppressed): the error stayed, and the next kernel launch failed with it."""
    from runtime.backends.engine import store as hoststore

    rt = fake_runtime(monkeypatch, refuse=True)
    torch.manual_seed(0)
    mods = [TwoExperts(), TwoExperts()]
    want = [(m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for m in mods]
    with caplog.at_level("WARNING", logger="runtime.backends.engine.store"):
        store = hoststore.HostStore.from_experts(mods, torch.float32, pin=True)
    rt.launch()  # the program's next kernel launch: no error left over
    assert not store.pinned and rt.registered == []
    assert [r.getMessage() for r in caplog.records if "could not pin" in r.getMessage()][0].count("out of memory") == 1
    assert sum("could not pin" in r.getMessage() for r in caplog.records) == 1  # once, the rest stays pageable
    for l_, (gu, d) in enumerate(want):
        assert torch.equal(store.fused[l_][0], gu) and torch.equal(store.fused[l_][1], d)
        assert mods[l_].gate_up_proj.numel() == 0  # the store holds the only copy


def test_a_device_fault_during_the_fallback_is_not_hidden(monkeypatch):
    from runtime.backends.engine import store as hoststore

    rt = fake_runtime(monkeypatch, refuse=True)

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(hoststore, "_launch", broken)
    buf, nbytes = hoststore.page_aligned_empty(1024, torch.float32)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        hoststore.pin_in_place(buf, nbytes, "a test buffer")
    assert rt.last_error == 2


def test_an_accepted_pin_registers_whole_pages_and_unregisters_them(monkeypatch):
    import gc
    import mmap

    from runtime.backends.engine import store as hoststore

    rt = fake_runtime(monkeypatch, refuse=False)
    store = hoststore.HostStore.from_experts([TwoExperts(), TwoExperts()], torch.float32, pin=True)
    assert store.pinned and len(rt.registered) == 2
    assert [p for p, _ in rt.registered] == [b.data_ptr() for b in store.flat]
    assert all(p % mmap.PAGESIZE == 0 and n % mmap.PAGESIZE == 0 for p, n in rt.registered)
    ptrs = [p for p, _ in rt.registered]
    del store
    gc.collect()
    assert rt.unregistered == ptrs


# ----------------------------------------------------------------------------- items 5-6: the device run's plan

def test_generate_runs_at_the_bench_budget_with_the_measured_context(eng, monkeypatch):
    """generate re-sized the bench's budget with the cost model's default context (on a GPU whose measured
    context is larger it ran at ~50% of the experts, labelled 25%): at the bench's budget it binds the
    bench's slots on a CUDA-answering engine."""
    from runtime.tools import generate

    bench = load_script("bench_engine")
    qf = PRESETS["quality-first"]
    as_cuda(eng, 3 * 512 * MiB)
    caps, got = bench.size_run(eng, [qf], None, None, 0.5)
    bound = []
    monkeypatch.setattr(generate, "greedy", lambda eng_, p, n, cache, chunk: {"tokens": [1] * n, "prefill_s": 0.0,
                                                                          "decode_s": 0.0, "decode_steps": n - 1})
    real = generate.cache_for
    monkeypatch.setattr(generate, "cache_for", lambda pol, E, k, caps_, init: bound.append(np.asarray(caps_).tolist())
                        or real(pol, E, k, caps_, init))
    # once the slots are sized the run goes on as the CPU engine it is (the report's CUDA queries: no device here)
    monkeypatch.setattr(eng, "bind", lambda cache: setattr(eng, "cuda", False))
    monkeypatch.setattr(eng, "drain", lambda: None)
    generate.run_generate(eng, ["def f(x):"], "quality-first", 2, vram_budget=got["vram_budget_GiB"])
    assert bound == [caps.tolist()] and caps.tolist() == resolve_capacities(None, eng.L, eng.E, eng.k, 0.5).tolist()


def test_fetch_exact_fails_on_any_pair_that_differs_or_moved_nothing():
    """The no-debug exactness verdict (scripts/gpu_exact_check.py): each pair bit for bit, each run moved copies."""
    ex = load_script("gpu_exact_check")
    nll = np.linspace(1.0, 2.0, 12).reshape(2, 6)

    def run(fetches=3, prefetch=2, admit=1, nll_=nll):
        return {"nll": nll_.copy(), "counters": {"fetches": fetches},
                "engine": {"prefetch_copies": prefetch, "admission_copies": admit}}

    class E:
        device, dtype = "cpu", torch.bfloat16

    names = ("quarter", "E-1", "lookahead", "admissions", "admissions, debug")
    good = {n: run() for n in names}
    assert ex.fetch_exact_record(good, nll, E, 12, False)["ok"]
    for n in names[1:]:
        bad = {**good, n: run(nll_=nll + np.eye(2, 6) * 1e-7)}
        rec = ex.fetch_exact_record(bad, nll, E, 12, False)
        assert not rec["ok"] and not all(p["bit_identical"] for p in rec["pairs"].values()), n
    assert not ex.fetch_exact_record({**good, "admissions": run(fetches=4)}, nll, E, 12, False)["ok"]
    for kw in ({"prefetch": 0}, {"admit": 0}):
        assert not ex.fetch_exact_record({**good, **{n: run(**kw) for n in names}}, nll, E, 12, False)["ok"], kw
