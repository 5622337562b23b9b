"""Tests for runtime/formats/costmodel/ (hosts, shapes, budget, timing): hand-computed timing cases, presets, YAML errors, bytes.

Timing cases use CostParams with small integers (fetch 10, device expert 1, host expert 3,
dense 2 seconds) so every expected value is exact and easy to check by hand against the
rules of docs/cost_model.md.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.core.errors import InputError
from runtime.formats import costmodel as cm
from runtime.formats.costmodel import (
    EV_ADM_POPPED,
    EV_ADM_QUEUED,
    EV_DEV,
    EV_FETCH,
    EV_HOST,
    CostParams,
    HostProfile,
    ModelShape,
)

log = logging.getLogger(__name__)

P = CostParams(fetch_s=10.0, device_expert_s=1.0, host_expert_s=3.0, dense_layer_s=2.0)


def ev(T: int, L: int, cells: dict[tuple[int, int], dict[int, int]]) -> np.ndarray:
    """Events [T, L, 5] from {(t, l): {column: count}}."""
    out = np.zeros((T, L, 5), np.int32)
    for (t, l_), cols in cells.items():
        for c, n in cols.items():
            out[t, l_, c] = n
    return out


def ones(T: int, L: int) -> np.ndarray:
    return np.ones((T, L), bool)


def check_identity(tb: cm.TimeBreakdown) -> None:
    parts = tb.dense_s + tb.head_s + tb.compute_s + tb.stall_fetch_s + tb.stall_admission_s + tb.stall_prefetch_s
    assert tb.total_s == pytest.approx(parts)
    assert tb.token_s.sum() == pytest.approx(tb.total_s)
    assert tb.per_token_s == pytest.approx(tb.total_s / tb.num_tokens)
    assert tb.link_busy_s == pytest.approx(tb.link_fetch_busy_s + tb.link_admission_busy_s
                                           + tb.link_prefetch_busy_s)


# ----------------------------------------------------------------------------- timing rules

def test_dense_plus_device_compute_no_misses():
    tb = cm.replay_time(ev(1, 1, {(0, 0): {EV_DEV: 3}}), ones(1, 1), P)
    assert tb.total_s == 2 + 3 * 1
    assert tb.stall_fetch_s == 0 and tb.stall_admission_s == 0 and tb.link_busy_s == 0
    check_identity(tb)


def test_sync_fetches_serialise_on_link_and_stall():
    # dense ends at 2; fetches 2->12, 12->22; compute 3 experts from 22 -> 25
    tb = cm.replay_time(ev(1, 1, {(0, 0): {EV_DEV: 3, EV_FETCH: 2}}), ones(1, 1), P)
    assert tb.total_s == 25
    assert tb.stall_fetch_s == 20
    assert tb.link_fetch_busy_s == 20
    check_identity(tb)


def test_admission_on_link_delays_a_later_fetch():
    # t0: dense 0->2, compute 2->4, admission copy 4->14.
    # t1: dense 4->6, fetch waits behind the copy: 14->24, stall 18, compute 24->26.
    e = ev(2, 1, {(0, 0): {EV_DEV: 2, EV_ADM_QUEUED: 1},
                  (1, 0): {EV_DEV: 2, EV_FETCH: 1}})
    tb = cm.replay_time(e, ones(2, 1), P)
    assert tb.total_s == 26
    assert tb.stall_fetch_s == 18
    assert tb.stall_admission_s == 0
    assert tb.link_admission_busy_s == 10 and tb.link_fetch_busy_s == 10
    assert tb.token_s.tolist() == [4, 22]
    check_identity(tb)


def test_admission_copies_start_when_link_free_behind_fetches():
    # t0: dense 0->2, fetch 2->12 (stall 10), compute 12->13, copies 13->23, 23->33.
    e = ev(1, 1, {(0, 0): {EV_DEV: 1, EV_FETCH: 1, EV_ADM_QUEUED: 2}})
    tb = cm.replay_time(e, ones(1, 1), P)
    assert tb.total_s == 13  # admissions never block the token that queued them
    # a second layer of the same token fetching one expert waits for both copies
    e2 = ev(1, 2, {(0, 0): {EV_DEV: 1, EV_FETCH: 1, EV_ADM_QUEUED: 2},
                   (0, 1): {EV_DEV: 1, EV_FETCH: 1}})
    tb2 = cm.replay_time(e2, ones(1, 2), P)
    # layer 1: dense 13->15, fetch max(33, 15) -> 43, stall 28, compute 43->44
    assert tb2.total_s == 44
    assert tb2.stall_fetch_s == 10 + 28


def test_admission_late_stall_at_pop():
    # t0: dense 0->2, compute 2->3, copies 3->13, 13->23.
    # t1: dense 3->5, then pops both (the engine waits after the dense part): latest 23 > 5 -> stall 18;
    # compute 23->24.
    e = ev(2, 1, {(0, 0): {EV_DEV: 1, EV_ADM_QUEUED: 2},
                  (1, 0): {EV_DEV: 1, EV_ADM_POPPED: 2}})
    tb = cm.replay_time(e, ones(2, 1), P)
    assert tb.total_s == 24
    assert tb.stall_admission_s == 18
    assert tb.stall_fetch_s == 0
    check_identity(tb)


def test_admission_fifo_pops_in_order_one_at_a_time():
    # copies complete at 13 and 23; t1: dense 3->5, pops the first (13): stall 8 -> 13, dev 14;
    # t2: dense 14->16, pops the second (23): stall 7 -> 23, dev 24.
    e = ev(3, 1, {(0, 0): {EV_DEV: 1, EV_ADM_QUEUED: 2},
                  (1, 0): {EV_DEV: 1, EV_ADM_POPPED: 1},
                  (2, 0): {EV_DEV: 1, EV_ADM_POPPED: 1}})
    tb = cm.replay_time(e, ones(3, 1), P)
    assert tb.stall_admission_s == 8 + 7
    assert tb.total_s == 24
    assert tb.token_s.tolist() == [3, 11, 10]


def test_admission_already_landed_costs_nothing_at_pop():
    # layer 0 queues at t=3 (copy lands 13); layer 1 ... many device calls push now past 13
    e = ev(2, 2, {(0, 0): {EV_DEV: 1, EV_ADM_QUEUED: 1},
                  (0, 1): {EV_DEV: 20},
                  (1, 0): {EV_DEV: 1, EV_ADM_POPPED: 1},
                  (1, 1): {EV_DEV: 1}})
    tb = cm.replay_time(e, ones(2, 2), P)
    # t0: 0->2->3 | 3->5->25 ; t1: pop (13 <= 25) no stall, 25->27->28 | 28->30->31
    assert tb.stall_admission_s == 0
    assert tb.total_s == 31


def test_fifos_are_per_layer():
    # layer 1 pops without anything queued on layer 1 (layer 0 queued): inconsistent events
    e = ev(2, 2, {(0, 0): {EV_DEV: 1, EV_ADM_QUEUED: 1},
                  (1, 1): {EV_DEV: 1, EV_ADM_POPPED: 1}})
    with pytest.raises(ValueError, match="token 1 layer 1"):
        cm.replay_time(e, ones(2, 2), P)


def test_host_compute_runs_in_parallel_with_device():
    # device 2*1 = 2, host 1*3 = 3 -> max 3; then device 5 vs host 3 -> 5
    e = ev(2, 1, {(0, 0): {EV_DEV: 2, EV_HOST: 1}, (1, 0): {EV_DEV: 5, EV_HOST: 1}})
    tb = cm.replay_time(e, ones(2, 1), P)
    assert tb.token_s.tolist() == [2 + 3, 2 + 5]
    assert tb.device_compute_s == 7 and tb.host_compute_s == 6 and tb.compute_s == 8
    assert tb.link_busy_s == 0
    check_identity(tb)


def test_invalid_cells_are_free_and_their_events_ignored():
    e = ev(2, 2, {(0, 0): {EV_DEV: 2, EV_FETCH: 1}, (0, 1): {EV_DEV: 9, EV_FETCH: 9, EV_HOST: 9},
                  (1, 0): {EV_DEV: 1}, (1, 1): {EV_DEV: 1}})
    valid = np.array([[True, False], [True, True]])
    tb = cm.replay_time(e, valid, P)
    # t0 l0: 0->2, fetch 2->12, 12->14 ; t1: 14->16->17 | 17->19->20
    assert tb.total_s == 20
    assert tb.num_token_layers == 3
    assert tb.per_token_s == 10
    none = cm.replay_time(e, np.zeros((2, 2), bool), P)
    assert none.total_s == 0 and none.num_token_layers == 0


def test_pop_beyond_queue_and_bad_arrays_are_errors():
    with pytest.raises(ValueError, match="pops more"):
        cm.replay_time(ev(1, 1, {(0, 0): {EV_ADM_POPPED: 1}}), ones(1, 1), P)
    with pytest.raises(ValueError):
        cm.replay_time(np.zeros((2, 3, 4), np.int32), ones(2, 3), P)
    with pytest.raises(ValueError):
        cm.replay_time(np.zeros((2, 3, 5), np.int32), ones(3, 2), P)
    with pytest.raises(ValueError):
        cm.replay_time(np.zeros((2, 3, 5), np.float64), ones(2, 3), P)


def test_empty_trace_and_int64_events():
    tb = cm.replay_time(np.zeros((0, 4, 5), np.int64), np.zeros((0, 4), bool), P)
    assert tb.total_s == 0 and tb.per_token_s == 0
    tb = cm.replay_time(ev(1, 1, {(0, 0): {EV_DEV: 1}}).astype(np.int64), ones(1, 1), P)
    assert tb.total_s == 3


def _random_consistent_events(T: int, L: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    e = np.zeros((T, L, 5), np.int32)
    e[:, :, EV_FETCH] = rng.integers(0, 3, (T, L))
    e[:, :, EV_HOST] = rng.integers(0, 2, (T, L))
    e[:, :, EV_DEV] = k - e[:, :, EV_HOST]
    e[:, :, EV_ADM_QUEUED] = rng.integers(0, 3, (T, L))
    e[1:, :, EV_ADM_POPPED] = e[:-1, :, EV_ADM_QUEUED]  # admission_delay 1
    return e


def test_large_trace_is_fast():
    T, L = 4000, 48
    e = _random_consistent_events(T, L, 10)
    valid = ones(T, L)
    real = cm.cost_params(cm.load_host_profile("rtx4090"), cm.load_model_shape("qwen3-next-80b-a3b"))
    cm.replay_time(e[:2], valid[:2], real)  # compile / load cache
    t0 = time.perf_counter()
    tb = cm.replay_time(e, valid, real)
    dt = time.perf_counter() - t0
    log.info("replay_time T=%d L=%d: %.2f ms", T, L, dt * 1e3)
    assert dt < 0.5
    check_identity(tb)
    assert tb.total_s > cm.all_resident_time(valid, real, 10) * T * 0.5


def test_all_resident_time_forms():
    valid = np.array([[True, True], [True, False]])
    per_cell = 2 + 4 * 1
    assert cm.all_resident_time(valid.sum(axis=1), P, 4) == pytest.approx(3 * per_cell / 2)
    assert cm.all_resident_time(valid, P, 4) == pytest.approx(3 * per_cell / 2)
    assert cm.all_resident_time(48, P, 4) == pytest.approx(48 * per_cell)
    # equals a replay where every call is a device hit
    e = ev(2, 2, {(0, 0): {EV_DEV: 4}, (0, 1): {EV_DEV: 4}, (1, 0): {EV_DEV: 4}})
    assert cm.replay_time(e, valid, P).per_token_s == pytest.approx(3 * per_cell / 2)


# ----------------------------------------------------------------------------- cost params

def _profile(**kw) -> HostProfile:
    base = dict(name="h", gpu="g", link_GBps=20.0, link_pageable_GBps=10.0, link_latency_us=5.0,
                device_mem_GBps=500.0, device_overhead_us=4.0, host_mem_GBps=50.0,
                host_overhead_us=10.0)
    base.update(kw)
    return HostProfile(**base)


SHAPE = ModelShape(name="s", num_layers=2, num_experts=8, top_k=2, hidden=1000,
                   moe_intermediate=1000, dense_params_per_layer=1_000_000)


def test_cost_params_formulas():
    p = cm.cost_params(_profile(), SHAPE)
    b = 3 * 1000 * 1000 * 2  # 6e6 bytes
    assert cm.expert_bytes(SHAPE) == b
    assert p.fetch_s == pytest.approx(5e-6 + b / 20e9)
    assert p.device_expert_s == pytest.approx(4e-6 + b / 500e9)
    assert p.host_expert_s == pytest.approx(10e-6 + b / 50e9)
    assert p.dense_layer_s == pytest.approx(cm.DENSE_CALLS_PER_LAYER * 4e-6 + 2e6 / 500e9)
    pageable = cm.cost_params(_profile(), SHAPE, pinned=False)
    assert pageable.fetch_s == pytest.approx(5e-6 + b / 10e9)


def test_calibration_overrides_formulas():
    p = cm.cost_params(_profile(device_expert_us=7.0, host_expert_us=70.0, dense_layer_us=30.0),
                       SHAPE)
    assert p.device_expert_s == pytest.approx(7e-6)
    assert p.host_expert_s == pytest.approx(70e-6)
    assert p.dense_layer_s == pytest.approx(30e-6)


def test_expert_bytes_per_format():
    s = cm.load_model_shape("qwen3-next-80b-a3b")
    n = 3 * 2048 * 512
    assert cm.expert_bytes(s) == n * 2 == 6_291_456
    assert cm.expert_bytes(s.with_format("q8_0")) == n * 34 // 32 == 3_342_336
    assert cm.expert_bytes(cm.with_format(s, "q4_k_m")) == 1_907_098  # ceil(n * 4.85 / 8)
    mix = cm.load_model_shape("mixtral-8x7b")
    assert cm.expert_bytes(mix) == 3 * 4096 * 14336 * 2
    with pytest.raises(InputError, match="weight_format"):
        s.with_format("fp8")


# ----------------------------------------------------------------------------- presets

def test_host_presets_load():
    assert {"rtx3090", "rtx4090", "rtx5090"} <= set(cm.list_host_profiles())
    p3, p4, p5 = (cm.load_host_profile(n) for n in ("rtx3090", "rtx4090", "rtx5090"))
    assert p3.device_mem_GBps == pytest.approx(0.75 * 936)
    assert p4.device_mem_GBps == pytest.approx(0.75 * 1008)
    assert p5.device_mem_GBps == pytest.approx(0.75 * 1792)
    assert p3.link_GBps == p4.link_GBps == 25.0 and p5.link_GBps == 50.0
    assert p5.vram_GiB == 32.0
    for p in (p3, p4, p5):
        assert p.sources and all(isinstance(s, str) for s in p.sources)
        assert p.link_pageable_GBps < p.link_GBps
        assert p.device_expert_us is None


HF_CONFIGS = {
    "qwen3-next-80b-a3b": dict(
        model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
        full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_value_head_dim=128,
        decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False, vocab_size=151936),
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_experts=60, num_experts_per_tok=4, decoder_sparse_step=1, vocab_size=151936),
    "mixtral-8x7b": dict(
        model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
        num_experts_per_tok=2, vocab_size=32000),
    "olmoe-1b-7b": dict(
        model_type="olmoe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, vocab_size=50304),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, vocab_size=151936),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_model_presets_match_transformers_parameter_counts(name):
    """The preset's geometry against the parameters transformers itself creates for the published config
    (the model is built on the meta device: no weights, no download)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kw = dict(HF_CONFIGS[name])
    cfg = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    preset = cm.load_model_shape(name)
    L = preset.num_layers
    per_layer = [0] * L
    experts = [0] * L
    other = 0
    for pname, p in model.named_parameters():
        parts = pname.split(".")
        if "layers" in parts:
            i = int(parts[parts.index("layers") + 1])
            if "experts" in parts:
                experts[i] += p.numel()
            else:
                per_layer[i] += p.numel()
        else:
            other += p.numel()
    assert preset.dense_params_per_layer == round(sum(per_layer) / L)
    assert experts == [preset.num_experts * preset.expert_params] * L
    emb = preset.vocab_size * preset.hidden * (1 if preset.tie_word_embeddings else 2)
    assert other == emb + preset.hidden  # embeddings, LM head, final norm
    assert cm.nonexpert_bytes(preset) == 2 * (sum(per_layer) + other) + (2 * L * preset.dense_params_per_layer
                                                                         - 2 * sum(per_layer))
    assert cm.model_shape_from_hf_config(HF_CONFIGS[name], "bf16", name=name) == preset


def test_model_preset_geometry():
    q = cm.load_model_shape("qwen3-next-80b-a3b")
    assert (q.num_layers, q.num_experts, q.top_k, q.hidden, q.moe_intermediate) == \
        (48, 512, 10, 2048, 512)
    q15 = cm.load_model_shape("qwen1.5-moe-a2.7b")
    assert (q15.num_layers, q15.num_experts, q15.top_k, q15.moe_intermediate) == (24, 60, 4, 1408)
    # decoder-layer parameters (published totals 80B, 14.3B, 46.7B, 6.9B, 30.5B less embeddings)
    for name, billions in (("qwen3-next-80b-a3b", 79.05), ("qwen1.5-moe-a2.7b", 13.69),
                           ("mixtral-8x7b", 46.44), ("olmoe-1b-7b", 6.71), ("qwen3-30b-a3b", 29.91)):
        s = cm.load_model_shape(name)
        total = s.num_layers * (s.num_experts * s.expert_params + s.dense_params_per_layer)
        assert total / 1e9 == pytest.approx(billions, rel=0.005), name
    assert set(HF_CONFIGS) <= set(cm.list_model_shapes())


def test_hf_config_file_and_errors(tmp_path: Path):
    d = tmp_path / "OLMoE-1B-7B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIGS["olmoe-1b-7b"]))
    s = cm.load_model_shape(d / "config.json")
    assert s.name == "OLMoE-1B-7B"
    assert s.dense_params_per_layer == cm.load_model_shape("olmoe-1b-7b").dense_params_per_layer
    bad = dict(HF_CONFIGS["qwen3-30b-a3b"], mlp_only_layers=[0])
    with pytest.raises(InputError, match="not supported"):
        cm.model_shape_from_hf_config(bad)
    missing = {k: v for k, v in HF_CONFIGS["mixtral-8x7b"].items() if k != "num_experts_per_tok"}
    with pytest.raises(InputError, match="num_experts_per_tok"):
        cm.model_shape_from_hf_config(missing)


# ----------------------------------------------------------------------------- YAML I/O

def test_host_profile_round_trip(tmp_path: Path):
    p = cm.load_host_profile("rtx4090")
    out = tmp_path / "h.yaml"
    cm.save_host_profile(p, out)
    assert cm.load_host_profile(out) == p
    cal = _profile(device_expert_us=9.5, sources=["x"])
    cm.save_host_profile(cal, tmp_path / "c.yml")
    assert cm.load_host_profile(str(tmp_path / "c.yml")) == cal


def test_model_shape_round_trip(tmp_path: Path):
    s = cm.load_model_shape("mixtral-8x7b").with_format("q8_0")
    cm.save_model_shape(s, tmp_path / "m.yaml")
    assert cm.load_model_shape(tmp_path / "m.yaml") == s


def _write_host(tmp_path: Path, **changes) -> Path:
    data = dict(name="h", gpu="g", link_GBps=20.0, link_pageable_GBps=10.0, link_latency_us=5.0,
                device_mem_GBps=500.0, device_overhead_us=4.0, host_mem_GBps=50.0,
                host_overhead_us=10.0)
    for k, v in changes.items():
        if v is _DROP:
            data.pop(k)
        else:
            data[k] = v
    path = tmp_path / "bad.yaml"
    import yaml
    path.write_text(yaml.safe_dump(data))
    return path


_DROP = object()


@pytest.mark.parametrize("changes, words", [
    ({"link_gbps": 3.0}, ["unknown field", "link_gbps", "3.0"]),
    ({"link_GBps": _DROP}, ["missing field", "link_GBps"]),
    ({"link_GBps": -25.0}, ["link_GBps", "-25.0", "positive"]),
    ({"device_overhead_us": 0}, ["device_overhead_us", "0", "positive"]),
    ({"host_mem_GBps": "fast"}, ["host_mem_GBps", "fast"]),
    ({"link_latency_us": True}, ["link_latency_us", "True"]),
    ({"device_expert_us": -1.0}, ["device_expert_us", "-1.0"]),
    ({"vram_GiB": 0.0}, ["vram_GiB", "0.0"]),
    ({"sources": "one string"}, ["sources", "one string"]),
    ({"name": ""}, ["name"]),
])
def test_bad_host_yaml_fields(tmp_path: Path, changes, words):
    path = _write_host(tmp_path, **changes)
    with pytest.raises(InputError) as ei:
        cm.load_host_profile(path)
    msg = str(ei.value)
    assert "\n" not in msg
    assert str(path) in msg
    for w in words:
        assert w in msg


def test_bad_host_files(tmp_path: Path):
    with pytest.raises(InputError, match="presets: .*rtx4090"):
        cm.load_host_profile("rtx9090")
    with pytest.raises(InputError, match="does not exist"):
        cm.load_host_profile(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(InputError, match="invalid YAML"):
        cm.load_host_profile(broken)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(InputError, match="mapping"):
        cm.load_host_profile(lst)


def test_bad_model_shape_yaml(tmp_path: Path):
    import yaml
    good = dict(name="m", num_layers=2, num_experts=8, top_k=2, hidden=64, moe_intermediate=32,
                dense_params_per_layer=100)
    cases = [(dict(good, top_k=9), "top_k"), (dict(good, hidden=0), "hidden"),
             (dict(good, num_layers=2.5), "num_layers"), (dict(good, weight_format="q3"), "q3"),
             (dict(good, extra=1), "unknown field")]
    for data, word in cases:
        path = tmp_path / "m.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(InputError, match=word) as ei:
            cm.load_model_shape(path)
        assert str(path) in str(ei.value)
    with pytest.raises(InputError, match="unknown model shape"):
        cm.load_model_shape("gpt-5")


# ----------------------------------------------------------------------------- head, low-bit, prefetch, pageable

def test_head_once_per_token_with_a_valid_layer():
    Ph = cm.CostParams(fetch_s=10.0, device_expert_s=1.0, host_expert_s=3.0, dense_layer_s=2.0, head_s=5.0)
    e = ev(3, 2, {(0, 0): {EV_DEV: 1}, (0, 1): {EV_DEV: 1}, (1, 0): {EV_DEV: 1}})
    valid = np.array([[True, True], [True, False], [False, False]])
    tb = cm.replay_time(e, valid, Ph)
    assert tb.token_s.tolist() == [3 + 3 + 5, 3 + 5, 0]
    assert tb.head_s == 10
    check_identity(tb)
    assert cm.all_resident_time(valid, Ph, 1) == pytest.approx((3 * 3 + 2 * 5) / 3)
    assert cm.all_resident_time(2, Ph, 1) == pytest.approx(2 * 3 + 5)


def test_lowbit_computes_on_the_device_beside_host():
    Pl = cm.CostParams(fetch_s=10.0, device_expert_s=1.0, host_expert_s=3.0, dense_layer_s=2.0, lowbit_expert_s=0.5)
    e = np.zeros((2, 1, cm.N_EV_FULL), np.int32)
    e[0, 0, [EV_DEV, cm.EV_LOWBIT, EV_HOST]] = (1, 2, 2)  # device 1 + 1, host 6 -> 6
    e[1, 0, [EV_DEV, cm.EV_LOWBIT]] = (3, 4)  # 3 + 2 -> 5
    tb = cm.replay_time(e, ones(2, 1), Pl)
    assert tb.token_s.tolist() == [2 + 6, 2 + 5]
    assert tb.lowbit_compute_s == 3 and tb.compute_s == 11
    check_identity(tb)


def _pf(cells: dict) -> np.ndarray:
    e = np.zeros((1, 2, cm.N_EV_FULL), np.int32)
    for (l_, col), n in cells.items():
        e[0, l_, col] = n
    return e


def test_prefetch_overlaps_previous_layer_and_stalls_what_has_not_arrived():
    # l0: dense 0->2, layer 1's prefetch copy starts on the link 2->12, compute 2->4;
    # l1: dense 4->6, waits for the prefetch until 12 (stall 6), compute 12->14
    tb = cm.replay_time(_pf({(0, EV_DEV): 2, (1, EV_DEV): 2, (1, cm.EV_PREFETCH): 1}), ones(1, 2), P)
    assert tb.total_s == 14 and tb.stall_prefetch_s == 6 and tb.link_prefetch_busy_s == 10
    check_identity(tb)
    # enough compute in layer 0 hides the copy completely
    tb = cm.replay_time(_pf({(0, EV_DEV): 20, (1, EV_DEV): 2, (1, cm.EV_PREFETCH): 1}), ones(1, 2), P)
    assert tb.total_s == 2 + 20 + 2 + 2 and tb.stall_prefetch_s == 0
    # a sync fetch of layer 1 queues behind the prefetch: 12 -> 22, compute 22 -> 24
    tb = cm.replay_time(_pf({(0, EV_DEV): 2, (1, EV_DEV): 2, (1, cm.EV_PREFETCH): 1, (1, EV_FETCH): 1}),
                        ones(1, 2), P)
    assert tb.total_s == 24 and tb.stall_prefetch_s == 6 and tb.stall_fetch_s == 10
    # layer 0's own fetch goes first on the link: 2->12, then the prefetch 12->22
    tb = cm.replay_time(_pf({(0, EV_DEV): 2, (0, EV_FETCH): 1, (1, EV_DEV): 2, (1, cm.EV_PREFETCH): 1}),
                        ones(1, 2), P)
    # l0: dense 2, fetch 12, compute 14; l1: dense 16, prefetch lands 22 (stall 6), compute 24
    assert tb.total_s == 24 and tb.stall_prefetch_s == 6
    check_identity(tb)


def test_pageable_copies_block_the_host():
    Pp = cm.CostParams(fetch_s=10.0, device_expert_s=1.0, host_expert_s=3.0, dense_layer_s=2.0, copies_block_host=True)
    # dense 0->2, compute 2->4, the admission copy 4->14 blocks the host
    tb = cm.replay_time(ev(1, 1, {(0, 0): {EV_DEV: 2, EV_ADM_QUEUED: 1}}), ones(1, 1), Pp)
    assert tb.total_s == 14 and tb.stall_admission_s == 10
    check_identity(tb)
    assert cm.cost_params(_profile(), SHAPE, pinned=False).copies_block_host
    assert not cm.cost_params(_profile(), SHAPE).copies_block_host


def test_head_and_lowbit_params():
    s = ModelShape(name="s", num_layers=2, num_experts=8, top_k=2, hidden=1000, moe_intermediate=1000,
                   dense_params_per_layer=1_000_000, vocab_size=5000)
    p = cm.cost_params(_profile(), s)
    assert cm.head_bytes(s) == (5000 + 1) * 1000 * 2
    assert p.head_s == pytest.approx(cm.HEAD_CALLS * 4e-6 + cm.head_bytes(s) / 500e9)
    assert cm.cost_params(_profile(), SHAPE).head_s == 0  # vocabulary unknown: not charged
    assert cm.cost_params(_profile(head_us=9.0, lowbit_expert_us=3.0), s).head_s == pytest.approx(9e-6)
    assert cm.cost_params(_profile(head_us=9.0, lowbit_expert_us=3.0), s).lowbit_expert_s == pytest.approx(3e-6)
    assert cm.lowbit_expert_bytes(s, 4, 64) == 3 * 1000 * 1000 // 2 + 4 * math.ceil(3e6 / 64)
    assert cm.lowbit_expert_bytes(s, 8, 64) > cm.lowbit_expert_bytes(s, 2, 64)


# ----------------------------------------------------------------------------- VRAM budget

BSHAPE = ModelShape(name="b", num_layers=4, num_experts=64, top_k=4, hidden=1024, moe_intermediate=512,
                    dense_params_per_layer=2_000_000, vocab_size=32000)


def test_capacities_for_budget_counts_everything_the_device_holds():
    from runtime.core.policy import PolicyConfig

    slot = cm.expert_bytes(BSHAPE)
    base = cm.nonexpert_bytes(BSHAPE) + cm.CUDA_CONTEXT_BYTES + cm.CUBLAS_WORKSPACE_BYTES
    assert base == 2 * (4 * 2_000_000 + 2 * 32000 * 1024 + 1024) + cm.CUDA_CONTEXT_BYTES + cm.CUBLAS_WORKSPACE_BYTES

    def budget_for(c: int, staging: int, extra: int = 0) -> float:  # GiB that hold exactly c slots per layer
        need = base + staging * slot + extra + c * 4 * slot
        return (need / (1 - cm.RESERVE_FRACTION) + 4096) / 2**30

    fe = PolicyConfig(rule="fetch_all")
    assert cm.capacities_for_budget(BSHAPE, budget_for(10, 2), fe).tolist() == [10] * 4
    assert cm.capacities_for_budget(BSHAPE, budget_for(10, 2) - 2 * slot / 2**30, fe).tolist() == [9] * 4
    qf = PolicyConfig(rule="threshold", tau=0.15, beta=0.5, admission_delay=2)
    assert cm.capacities_for_budget(BSHAPE, budget_for(10, 2 + 4 * 4 * 2), qf).tolist() == [10] * 4
    assert cm.budget_breakdown(BSHAPE, budget_for(10, 2), qf).slots_per_layer == 2  # 32 staging buffers charged
    lb = PolicyConfig(rule="threshold", tau=0.15, fallback="lowbit", lowbit_bits=4, lowbit_group=64)
    low = 4 * 64 * cm.lowbit_expert_bytes(BSHAPE, 4, 64)
    assert cm.capacities_for_budget(BSHAPE, budget_for(10, 2, low), lb).tolist() == [10] * 4
    assert cm.capacities_for_budget(BSHAPE, 1000.0).tolist() == [63] * 4  # clamped to E - 1
    for pol, c in ((fe, 10), (qf, 7), (lb, 12)):  # the inverse: the budget that holds c slots gives c back
        g = cm.budget_for_capacities(BSHAPE, [c] * 4, pol)
        assert cm.capacities_for_budget(BSHAPE, g * (1 + 1e-9), pol).tolist() == [c] * 4
        assert cm.budget_breakdown(BSHAPE, g * (1 - 1e-6), pol).slots_per_layer == c - 1
    with pytest.raises(InputError, match=r"--vram-budget = 0\.6 GiB leaves \d+ expert slots per layer, fewer than k = 4"):
        cm.capacities_for_budget(BSHAPE, 0.6, fe)
    # too small a budget is its own InputError (a sweep records the trial infeasible), with the slots it left
    with pytest.raises(cm.BudgetTooSmall) as info:
        cm.capacities_for_budget(BSHAPE, budget_for(10, 2), qf)
    assert info.value.slots == 2 and isinstance(info.value, InputError)
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(InputError, match="--vram-budget"):
            cm.capacities_for_budget(BSHAPE, bad)
