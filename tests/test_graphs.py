"""The engine's segmented decode step (runtime/backends/engine/graphs.py) on CPU, as far as CPU goes: the same
decisions and logits as the Hugging Face forward path on every family with a capture plan, the grouped call of
fixed shape equal to the per-token one bit for bit (empty slots never enter the sum), the capture plan's
segments and static buffers, `no_cuda_graphs` through the run-field table; the capture itself on CUDA only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.backends import emulate, get_backend
from runtime.backends.engine import Engine, graphs
from runtime.backends.engine.plan import grouped_experts
from runtime.core.kernel import (
    DROP,
    FETCH,
    FLOAT_COUNTERS,
    HIT,
    HOST,
    LOWBIT,
    SUB,
    PolicyCache,
    warm_residency,
)
from runtime.core.policy import PRESETS, PolicyConfig
from runtime.core.spec import RunSpec, backend_options
from runtime.tools.tinyhf import build_tiny

SEGMENTED = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    return {f: build_tiny(f, root / f) for f in [*SEGMENTED, "qwen3_next"]}


def runs(eng: Engine, pol: PolicyConfig, W: int = 12, cap: int = 3) -> dict:
    """The same teacher-forced run as segments and through the Hugging Face forward: {path: (logits, counters)}."""
    windows = np.random.default_rng(0).integers(0, 90, size=(1, W)).astype(np.int64)
    caps = np.full(eng.L, cap)
    init = warm_residency(emulate.record(eng.m, windows, eng.k)[0], None, eng.E, caps)
    out, why = {}, eng.no_segments_why
    for path in ("segments", "hf"):
        eng.no_segments_why = why if path == "segments" else "forced by the test"
        try:
            cache = PolicyCache(pol, eng.E, eng.k, caps, init)
            eng.teacher_forced(eng.m, windows, cache, keep_logits=True)
        finally:
            eng.no_segments_why = why
        out[path] = (torch.stack(eng.logits), cache.counter_totals(), eng.report()["decode_path"])
    return out


def assert_same(out: dict) -> None:
    (a, ca, pa), (b, cb, pb) = out["segments"], out["hf"]
    assert pa == "segments" and pb.startswith("hf_forward")
    assert (a - b).abs().max().item() <= 1e-5
    for key in FLOAT_COUNTERS:  # masses: float sums of the same weights in another rounding
        assert ca.pop(key) == pytest.approx(cb.pop(key), rel=1e-5, abs=1e-6)
    assert ca == cb


@pytest.mark.parametrize("family", SEGMENTED)
def test_segments_equal_the_hf_forward_path(ckpts, family):
    """Every family with a capture plan: identical decisions (counters), logits within 1e-5 (the static cache's
    masked keys and, with shared experts, one more rounding of the residual sum)."""
    eng = Engine(emulate.load(ckpts[family]), "cpu", debug=True)
    try:
        assert eng.no_segments_why is None
        out = runs(eng, PolicyConfig(rule="first_choice", beta=0.05))  # fetches, substitutes and admits
        c = out["segments"][1]
        assert c["fetches"] > 0 and c["substitutions"] > 0 and c["admissions"] > 0
        assert_same(out)
    finally:
        eng.close()


@pytest.mark.parametrize("pol", [PolicyConfig(rule="threshold", tau=0.15, fallback="host"),
                                 PolicyConfig(rule="threshold", tau=0.15, fallback="drop", drop_renorm=True),
                                 PolicyConfig(rule="threshold", tau=0.15, prefetch="lookahead", prefetch_n=2, beta=0.05)],
                         ids=["host", "drop-renorm", "lookahead-admission"])
def test_segments_carry_host_compute_drops_and_prefetch(ckpts, pol):
    """The host experts' output joins through `extra`, a drop's weight is shared out, lookahead copies start
    between segments: the same decisions and logits as the forward path."""
    eng = Engine(emulate.load(ckpts["qwen3_moe"]), "cpu", debug=True)
    try:
        out = runs(eng, pol)
        c = out["segments"][1]
        assert c["host_computes"] + c["drops"] + c["prefetches"] > 0
        assert_same(out)
    finally:
        eng.close()


def test_grouped_call_of_fixed_shape_is_the_per_token_sum_and_skips_empty_slots():
    """`grouped_masked` over all k ranks with a flag per rank equals the sum of the computed ranks alone, bit for
    bit, even when a rank not computed here points at a slot full of NaN (an empty slot)."""
    g = torch.Generator().manual_seed(0)
    C, H, inter, k = 4, 16, 8, 4
    gate_up, down = torch.randn(C, 2 * inter, H, generator=g), torch.randn(C, H, inter, generator=g)
    gate_up[3] = float("nan")  # an empty slot
    x, w = torch.randn(1, H, generator=g), torch.rand(k, generator=g)
    kind = np.array([HIT, SUB, DROP, FETCH])
    slot = np.array([1, 0, 3, 2])
    on = (kind == HIT) | (kind == SUB) | (kind == FETCH)
    plan = torch.from_numpy(np.stack([np.where(on, slot, 3), np.where(on, w.numpy(), 0), on]).astype(np.float32))
    got = graphs.grouped_masked(gate_up, down, x, plan, torch.nn.functional.silu, torch.float32)
    pos = torch.from_numpy(np.flatnonzero(on))
    y = grouped_experts(gate_up, down, x.expand(len(pos), -1), torch.from_numpy(slot)[pos], w[pos],
                        torch.nn.functional.silu)
    ref = y.new_zeros(k, H).index_copy_(0, pos, y).sum(dim=0, keepdim=True)
    assert torch.isfinite(got).all() and torch.equal(got, ref)


def test_capture_plan_segments_and_static_buffers(ckpts):
    """S MoE layers: S + 1 segments over the decoder layers in order; per MoE layer a [1, H] input, a packed
    routing of 2k + E + 1 floats, a [3, k] plan row; a family with linear attention has no plan and says why."""
    eng = Engine(emulate.load(ckpts["qwen3_moe"]), "cpu")
    try:
        cache = PolicyCache(PRESETS["quality-first"], eng.E, eng.k, np.full(eng.L, 3), None)
        eng.bind(cache)
        eng.m.ctx.cache = cache
        prog = graphs.StepProgram(eng.m.model, eng.m.ctx, eng.runner, 8, capture=False)
        n_dec = len(eng.m.model.model.layers)
        assert len(prog.ranges) == eng.L + 1 and prog.ranges[0][0] == 0 and prog.ranges[-1][1] == n_dec
        assert all(a[1] == b[0] for a, b in zip(prog.ranges, prog.ranges[1:], strict=False))
        assert [tuple(x.shape) for x in prog.x] == [(1, eng.H)] * eng.L
        assert [tuple(p.shape) for p in prog.packed] == [(1, 2 * eng.k + eng.E + 1)] * eng.L
        assert [tuple(s.plan.shape) for s in prog.staged] == [(3, eng.k)] * eng.L
        assert prog.graphs == [] and tuple(prog.logits.shape) == (1, eng.m.model.config.vocab_size)
        assert prog.mask_table["full_attention"].shape[0] == 8
    finally:
        eng.m.ctx.cache = eng.m.ctx.step = None
        eng.close()
    why = graphs.capture_plan(emulate.load(ckpts["qwen3_next"]).model)
    assert why is not None and "linear_attention" in why


def test_no_cuda_graphs_is_an_engine_option_from_the_field_table(ckpts, tmp_path):
    """The engine's options are the fields only it honours; `--no-cuda-graphs` reaches the Engine; the other
    backends refuse it (tests/test_contract.py's REFUSED)."""
    text = tmp_path / "t.txt"
    text.write_text("the policy kernel decides per token and layer " * 20)
    spec = RunSpec(policy=PRESETS["quality-first"], model=str(ckpts["qwen3_moe"]), text=str(text), capacity=3,
                   max_tokens=24, window=12, device="cpu", no_cuda_graphs=True, initial_residency="cold")
    assert backend_options(spec, "engine") == {"host_store": "ram", "no_cuda_graphs": True}
    res = get_backend("engine").evaluate(spec)
    assert res.extra["engine"]["decode_path"] == "segments" and res.counters["fetches"] > 0


def test_a_failed_capture_decodes_the_same_segments_eagerly(ckpts, caplog):
    """Capture raising (here: no CUDA at all) leaves a working program: no graphs, the error kept for the
    report, a warning, and the same logits as a program built without capture."""
    eng = Engine(emulate.load(ckpts["qwen3_moe"]), "cpu")
    tok = torch.tensor([[5]])
    try:
        logits = {}
        for capture in (False, True):
            cache = PolicyCache(PRESETS["quality-first"], eng.E, eng.k, np.full(eng.L, 3), None)
            eng.bind(cache)
            eng.m.ctx.cache = cache
            with caplog.at_level("WARNING", logger="runtime.backends.engine.graphs"):
                prog = graphs.StepProgram(eng.m.model, eng.m.ctx, eng.runner, 4, capture=capture)
            assert prog.graphs == [] and bool(prog.capture_error) == capture
            logits[capture] = prog.step(tok, 0).clone()
        assert "CUDA graph capture failed" in caplog.text and torch.equal(logits[False], logits[True])
        assert eng._path_name(prog, None).startswith("segments: capture failed: ")
    finally:
        eng.m.ctx.cache = eng.m.ctx.step = None
        eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_segments_equal_eager_ones_on_cuda(ckpts):
    """On CUDA: the captured segments give the eager segments' NLL bit for bit and the same counters."""
    eng = Engine(emulate.load(ckpts["qwen3_moe"]), "cuda")
    try:
        windows = np.random.default_rng(0).integers(0, 90, size=(1, 16)).astype(np.int64)
        res = {}
        for off in (False, True):
            eng.no_cuda_graphs = off
            cache = PolicyCache(PRESETS["quality-first"], eng.E, eng.k, np.full(eng.L, 3), None)
            nll, rep = eng.teacher_forced(eng.m, windows, cache)
            res[off] = (nll, cache.counter_totals(), rep["engine"]["decode_path"])
        assert res[False][2] == "cuda_graphs" and res[True][2] == "segments"
        assert np.array_equal(res[False][0], res[True][0]) and res[False][1] == res[True][1]
    finally:
        eng.close()


def test_kinds_cover_the_plan_rows():
    """The plan row's flag is exactly the device-computed kinds (HIT, FETCH, SUB); HOST, LOWBIT, DROP are not."""
    from runtime.backends.engine.plan import on_device

    kinds = np.array([HIT, FETCH, SUB, HOST, LOWBIT, DROP])
    assert on_device(kinds).tolist() == [True, True, True, False, False, False]


def test_mask_cache_argument_follows_the_installed_signature():
    """The mask functions get their cache under the name the installed transformers gives it (5.17:
    past_key_values; 5.24: cache), read from the signature; a function with neither is an error naming it."""
    import inspect

    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    for fn in (create_causal_mask, create_sliding_window_causal_mask):
        name = graphs.mask_cache_kwarg(fn)
        assert name in inspect.signature(fn).parameters

    def old(config, inputs_embeds, attention_mask, past_key_values, position_ids=None):
        return None

    def both(config, inputs_embeds, attention_mask, cache=None, past_key_values=None):
        return None

    def neither(config, inputs_embeds):
        return None

    assert graphs.mask_cache_kwarg(old) == "past_key_values" and graphs.mask_cache_kwarg(both) == "cache"
    with pytest.raises(TypeError, match="neither"):
        graphs.mask_cache_kwarg(neither)


def test_a_failed_capture_names_the_failed_op_and_returns_to_the_stream(ckpts, monkeypatch):
    """A capture raising torch's generic error raised during the op's own: the report names the op's error first,
    the stream current before the capture is made current again before the eager fallback runs."""
    eng = Engine(emulate.load(ckpts["qwen3_moe"]), "cpu")
    current = ["default"]
    monkeypatch.setattr(graphs, "_current_stream", lambda device: current[0])
    monkeypatch.setattr(graphs, "_set_stream", lambda s: current.__setitem__(0, s))

    def capture(self):
        current[0] = "capture-stream"  # what torch's graph context leaves current when capture_end raises
        try:
            raise RuntimeError("aten::nonzero: operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture") from None

    monkeypatch.setattr(graphs.StepProgram, "_capture", capture)
    try:
        cache = PolicyCache(PRESETS["quality-first"], eng.E, eng.k, np.full(eng.L, 3), None)
        eng.bind(cache)
        eng.m.ctx.cache = cache
        prog = graphs.StepProgram(eng.m.model, eng.m.ctx, eng.runner, 4, capture=True)
        assert current[0] == "default" and prog.graphs == []
        assert prog.capture_error.startswith("RuntimeError: aten::nonzero") and "previous error" in prog.capture_error
        assert eng._path_name(prog, None) == f"segments: capture failed: {prog.capture_error}"
        assert torch.isfinite(prog.step(torch.tensor([[5]]), 0)).all()
    finally:
        eng.m.ctx.cache = eng.m.ctx.step = None
        eng.close()


def test_value_branching_families_refuse_graphs(ckpts):
    """Sliding-window caches and dynamic / longrope RoPE are not captured: the reason is in decode_path, and the
    eager segments still run; a plain family is not refused."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpts["qwen3_moe"])
    assert graphs.graph_refusal(cfg, 2) is None
    cfg.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    assert "RoPE type dynamic" in graphs.graph_refusal(cfg, 2)
    cfg = AutoConfig.from_pretrained(ckpts["mixtral"])
    cfg.sliding_window = 4
    assert "sliding-window attention in 2 of 2 layers" in graphs.graph_refusal(cfg, 2)
    m = emulate.load(ckpts["mixtral"])
    m.model.config.sliding_window = 4
    eng = Engine(m, "cpu")
    try:
        cache = PolicyCache(PRESETS["quality-first"], eng.E, eng.k, np.full(eng.L, 3), None)
        eng.bind(cache)
        eng.m.ctx.cache = cache
        prog = graphs.StepProgram(eng.m.model, eng.m.ctx, eng.runner, 4, capture=True)
        assert prog.graphs == [] and not prog.capture_error
        assert eng._path_name(prog, None).startswith("segments: cuda graphs refused: sliding-window attention")
        assert torch.isfinite(prog.step(torch.tensor([[5]]), 0)).all()
    finally:
        eng.m.ctx.cache = eng.m.ctx.step = None
        eng.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_over_the_slots_equals_the_gathered_bmm(dtype):
    """`grouped_experts`' two calls: grouped_mm over the slot tensors in place (CUDA bf16's) and the gathered bmm;
    repeated slots, unsorted rows, empty slots full of NaN never read. Equal within one rounding of the model dtype
    (fp32: 1e-5 of the largest output; bf16: 2**-7 of it; on this CPU bf16 they agree bit for bit)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    C, H, inter = 7, 32, 16
    gu, dn = torch.randn(C, 2 * inter, H, generator=g).to(dtype), torch.randn(C, H, inter, generator=g).to(dtype)
    gu[2], dn[2] = float("nan"), float("nan")  # an empty slot: no call reads it
    x = torch.randn(1, H, generator=g).to(dtype).expand(6, -1)
    rows = torch.tensor([3, 0, 6, 3, 1, 5])
    w = torch.rand(6, generator=g).to(dtype)
    a = grouped_experts(gu, dn, x, rows, w, F.silu, "bmm")
    b = grouped_experts(gu, dn, x, rows, w, F.silu, "grouped_mm")
    assert torch.isfinite(b).all() and a.shape == b.shape == (6, H)
    tol = (1e-5 if dtype == torch.float32 else 2.0 ** -7) * a.float().abs().max().item()
    assert (a.float() - b.float()).abs().max().item() <= tol
    from runtime.backends.engine.plan import grouped_impl

    assert grouped_impl(x, gu) == "bmm"  # CPU: the gathered bmm (grouped_mm is CUDA bf16's)


def test_segments_decide_in_one_call(ckpts):
    """The segments' decisions go through the one compiled call (runtime/core/kernel/decide.py): fetch-every-miss
    entirely (fetches copied from its list), an admission policy partly (plans with copies via PlanRunner.apply);
    the same logits and counters as the Hugging Face path either way (test_segments_equal_the_hf_forward_path)."""
    eng = Engine(emulate.load(ckpts["qwen3_moe"]), "cpu", debug=True)
    try:
        for pol, slow in ((PRESETS["fetch-every-miss"], False), (PolicyConfig(rule="first_choice", beta=0.05), True)):
            cache = PolicyCache(pol, eng.E, eng.k, np.full(eng.L, 3), None)
            eng.bind(cache)
            eng.m.ctx.cache = cache
            prog = graphs.StepProgram(eng.m.model, eng.m.ctx, eng.runner, 12, capture=False)
            prog.begin()
            for t in range(12):
                prog.step(torch.tensor([[(7 * t) % 90]]), t)
            f = prog.fused
            assert f is not None and f.n_fast > 0 and (f.n_slow > 0) == slow
            assert f.n_fast + f.n_slow == 12 * eng.L and eng.runner.events_array().shape[:2] == (12, eng.L)
            eng.m.ctx.cache = eng.m.ctx.step = None
    finally:
        eng.m.ctx.cache = eng.m.ctx.step = None
        eng.close()
