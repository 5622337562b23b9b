"""The engine's CUDA-only code paths, exercised on the CPU (issue 29): the calls, budget arithmetic and
fallbacks that only a CUDA run takes, driven here with a CPU engine whose CUDA attributes are set by hand,
fake CUDA runtime functions (monkeypatched) or a device that holds no data ('meta').

Each test fails on the defect it guards (named in its docstring).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

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
