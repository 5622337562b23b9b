"""One contract for every backend: the same RunSpec gives the same decision per token, layer and top-k slot.

The emulation is the reference. For every adapter family (tiny random checkpoints) and every
policy below, the emulation runs with `record_decisions` and writes the router trace it saw and
the warm start it used (so it hands the kernel the sorted candidate ranking); then
- the simulator replays that trace from that warm start,
- the emulation runs again without writing a trace (the kernel then orders the candidates from
  the router scores itself),
- the emulation runs with every layer streamed from the shards (`--max-memory` far below the
  model: a layer-major pass), and also agrees with the reference on the per-token NLL (1e-5),
  the trace it records and the warm start,
- the engine (CPU device mode) decodes the same text token by token,
and each must give the identical decision kind, served expert and slot at every token, layer and
top-k slot, for the presets and LRU, LFU aging, admission delays, every fallback (substitute,
drop, host, lowbit), the band rule, both prefetches, and the spec's Additions (2): lfuda with a pinned
hot set, calibrated per-layer capacities (the simulator replays them as explicit per-layer capacities
from the emulation's -1-padded residency file), a fetch cap with renormalised drops, and llama.cpp's expert cache
and layer split (the presets llamacpp-lru, llamacpp-ncmoe: the engine runs the pool as one slot array for every
layer and the split's first N layers on the host). Also: every
backend refuses, with a one-line InputError, a field it cannot honour.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from runtime.backends import BACKENDS, get_backend
from runtime.core.errors import InputError
from runtime.core.policy import PRESETS, PolicyConfig
from runtime.core.spec import RunSpec
from runtime.formats.trace import load_trace
from tests.tiny_hf import FAMILIES, build_tiny

TEXT = (Path(__file__).resolve().parent / "data" / "kernel_source.txt").read_text()[:6000]

POLICIES = {
    **PRESETS,
    "lru": PolicyConfig(rule="threshold", tau=0.15, evict="lru", beta=0.5),
    "gamma-0.9": PolicyConfig(rule="threshold", tau=0.15, gamma=0.9, beta=0.3),
    "delay-2": PolicyConfig(rule="first_choice", beta=0.3, admission_delay=2),
    "delay-3": PolicyConfig(rule="threshold", tau=0.3, beta=0.3, admission_delay=3),
    "drop": PolicyConfig(rule="threshold", tau=0.3, fallback="drop"),
    "host": PolicyConfig(rule="threshold", tau=0.3, fallback="host", beta=0.3),
    "lowbit-4": PolicyConfig(rule="first_choice", fallback="lowbit", lowbit_bits=4, lowbit_group=16, beta=0.5),
    "band": PolicyConfig(rule="band", tau=0.1, tau_high=0.4),
    "lookahead": PolicyConfig(rule="threshold", tau=0.3, prefetch="lookahead", prefetch_n=3),
    "oracle": PolicyConfig(rule="fetch_all", prefetch="oracle", evict="lru"),
    # Additions (2): lfuda with a pinned hot set, calibrated per-layer capacities, a fetch cap with renormalised drops
    "lfuda-pin": PolicyConfig(rule="threshold", tau=0.15, evict="lfuda", pin_fraction=0.34, beta=0.3),
    "calibrated": PolicyConfig(rule="first_choice", evict="lfuda", capacity_alloc="calibrated", beta=0.3),
    "cap-renorm": PolicyConfig(rule="fetch_all", fetch_cap=1, fallback="drop", drop_renorm=True),
    # Additions (4), cache-aware routing (the presets cache-prior and cache-route are above): with admission, lru
    "cache-route-alpha": PolicyConfig(rule="fetch_all", route="cache-route", route_keep=0, route_window=6,
                                      route_alpha=0.5, evict="lru", beta=0.3),
    # Additions (3): a bounded copy pool per layer (admissions wait for a buffer, prefetches are cut)
    "buffers-1-d3": PolicyConfig(rule="substitute_all", beta=0.05, admission_delay=3, copy_buffers=1),
    "lookahead-buffers-1": PolicyConfig(rule="threshold", tau=0.3, prefetch="lookahead", prefetch_n=3, beta=0.3,
                                        copy_buffers=1),
    # the admission presets carry one copy buffer per layer; their unbounded forms (`--copy-buffers unbounded`)
    "quality-first-unbounded": dataclasses.replace(PRESETS["quality-first"], copy_buffers=None),
    "speed-first-unbounded": dataclasses.replace(PRESETS["speed-first"], copy_buffers=None),
}
SIGMOID_FAMILIES = {"deepseek_v3"}  # Cache-Prior is refused there (docs/policies.md, Additions (4))
ENGINE_FAMILIES = {f for f in FAMILIES if f != "gpt_oss"}  # the engine needs bias-free fused experts
CAPACITY, WINDOW, TOKENS = 3, 16, 96


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract")
    text = d / "text.txt"
    text.write_text(TEXT)
    return d, text, {fam: build_tiny(fam, d / fam) for fam in FAMILIES}


_REF: dict = {}


def reference(inputs, family: str, name: str):
    """The emulation's result with decisions, the trace it saw and its warm start (cached per case)."""
    if (family, name) not in _REF:
        d, text, ckpts = inputs
        tr, res = d / f"{family}-{name}.parquet", d / f"{family}-{name}.npy"
        spec = RunSpec(policy=POLICIES[name], model=str(ckpts[family]), text=str(text), capacity=CAPACITY,
                       window=WINDOW, max_tokens=TOKENS, trace_out=str(tr), residency_out=str(res),
                       record_decisions=True, nll_out=str(d / f"{family}-{name}-nll.parquet"))
        _REF[family, name] = (spec, get_backend("emulation").evaluate(spec), tr, res)
    return _REF[family, name]


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["simulator", "emulation", "streamed", "engine"])
def test_same_decisions_as_emulation(inputs, backend, family, name):
    if POLICIES[name].route == "cache-prior" and family in SIGMOID_FAMILIES:
        d, text, ckpts = inputs
        with pytest.raises(InputError, match="cache-prior.*sigmoid"):
            get_backend("emulation").evaluate(RunSpec(policy=POLICIES[name], model=str(ckpts[family]),
                                                      text=str(text), capacity=CAPACITY, window=WINDOW,
                                                      max_tokens=TOKENS))
        return
    spec, emu, tr, res = reference(inputs, family, name)
    if backend == "streamed":  # the emulation with every layer streamed from the shards, layer-major
        tr2, res2, nll2 = (tr.with_name(f"{tr.stem}-streamed{suffix}") for suffix in (".parquet", ".npy", "-nll.parquet"))
        other = dataclasses.replace(spec, max_memory_GiB=1e-6, trace_out=str(tr2), residency_out=str(res2),
                                    nll_out=str(nll2))
        backend = "emulation"
    elif backend == "simulator":  # calibrated: the emulation's per-layer capacities, given explicitly
        calibrated = spec.policy.capacity_alloc == "calibrated"
        other = RunSpec(policy=dataclasses.replace(spec.policy, capacity_alloc="uniform"), trace=str(tr),
                        capacity=tuple(emu.capacity) if calibrated else CAPACITY, initial_residency=str(res),
                        record_decisions=True)
    elif backend == "emulation":  # without --trace-out: the kernel orders candidates from the scores
        other = RunSpec(policy=spec.policy, model=spec.model, text=spec.text, capacity=CAPACITY, window=WINDOW,
                        max_tokens=TOKENS, record_decisions=True)
    else:
        if family not in ENGINE_FAMILIES:
            with pytest.raises(InputError, match="fused expert layout"):
                get_backend("engine").evaluate(RunSpec(policy=spec.policy, model=spec.model, text=spec.text,
                                                       capacity=CAPACITY, window=WINDOW, max_tokens=TOKENS))
            return
        other = RunSpec(policy=spec.policy, model=spec.model, text=spec.text, capacity=CAPACITY, window=WINDOW,
                        max_tokens=TOKENS, record_decisions=True)
    got = get_backend(backend).evaluate(other)
    T, L, k = emu.decisions["kind"].shape
    assert T == TOKENS and emu.counters["calls"] == T * L * k
    for field in ("kind", "served", "slot"):
        a, b = emu.decisions[field], got.decisions[field]
        assert a.shape == b.shape, field
        diff = np.argwhere(a != b)
        assert diff.size == 0, f"{field} differs first at token, layer, slot {diff[0].tolist()}"
    for key in ("hits", "fetches", "substitutions", "drops", "host_computes", "admissions", "lowbit_computes",
                "prefetches", "prefetch_used", "reroutes", "admissions_waited", "prefetch_unbuffered",
                "admissions_skipped"):
        assert got.counters[key] == emu.counters[key], key
    # (the engine decodes token by token: the model's float32 gate weights round differently from the batched pass)
    assert got.counters["rerouted_mass"] == pytest.approx(emu.counters["rerouted_mass"], rel=1e-6, abs=1e-9)
    assert got.initial_residency and emu.initial_residency.startswith("held-out")
    if other.max_memory_GiB != "auto":  # streamed: per-token NLL, the recorded trace and the warm start agree
        assert got.extra["streamed"] and not emu.extra["streamed"]
        a, b = pq.read_table(spec.nll_out).to_pandas(), pq.read_table(other.nll_out).to_pandas()
        assert list(a.columns) == list(b.columns)
        for c in a.columns:
            assert np.abs(a[c].to_numpy() - b[c].to_numpy()).max() <= 1e-5, c
        ta, tb = load_trace(spec.trace_out), load_trace(other.trace_out)
        for f in ("topk_ids", "topk_weights", "ranking", "lookahead"):
            if getattr(ta, f) is not None:
                np.testing.assert_array_equal(getattr(ta, f), getattr(tb, f), err_msg=f)
        np.testing.assert_array_equal(np.load(spec.residency_out), np.load(other.residency_out))


def test_policies_exercise_every_decision(inputs):
    """The cases above are not vacuous: across them every decision kind occurs."""
    kinds = set()
    for name in POLICIES:
        kinds |= set(np.unique(reference(inputs, "qwen3_moe", name)[1].decisions["kind"]).tolist())
    assert kinds >= {0, 1, 2, 3, 4, 5}  # HIT, FETCH, SUB, DROP, HOST, LOWBIT
    counters = {name: reference(inputs, "qwen3_moe", name)[1].counters for name in POLICIES}
    assert counters["delay-2"]["admissions"] > 0 and counters["delay-3"]["admissions"] > 0
    assert counters["lookahead"]["prefetches"] > 0 and counters["oracle"]["prefetch_used"] > 0
    res = {name: reference(inputs, "qwen3_moe", name)[1] for name in ("lfuda-pin", "calibrated", "cap-renorm")}
    assert [r["pinned"] for r in res["lfuda-pin"].per_layer] == [1, 1]
    assert sum(res["calibrated"].capacity) == 2 * CAPACITY
    assert [r["capacity"] for r in res["calibrated"].per_layer] == res["calibrated"].capacity
    assert res["cap-renorm"].counters["drops"] > 0
    for name in ("cache-prior", "cache-route", "cache-route-alpha"):  # routing happens, and is its own counter
        c = counters[name]
        assert c["reroutes"] > 0 and c["rerouted_mass"] > 0 and c["hits"] + c["fetches"] + c["reroutes"] == c["calls"]
    # the bounded copy pool is exercised: admissions waited for a buffer, prefetches were cut
    assert counters["buffers-1-d3"]["admissions_waited"] > 0 and counters["buffers-1-d3"]["admissions"] > 0
    assert counters["lookahead-buffers-1"]["prefetch_unbuffered"] > 0


REFUSED = [
    ("simulator", dict(model="M", text="T"), "--model"),
    ("simulator", dict(trace="t.parquet", nll_out="n.parquet"), "--nll-out"),
    ("simulator", dict(trace="t.parquet", substitute_weight="own"), "--substitute-weight"),
    ("emulation", dict(trace="t.parquet"), "--trace"),
    ("emulation", dict(model="M", text="T", host_store="mmap"), "--host-store"),
    ("emulation", dict(model="M", text="T", host="rtx3090"), "--host"),
    ("emulation", dict(model="M", text="T", no_cuda_graphs=True), "--no-cuda-graphs"),
    ("simulator", dict(trace="t.parquet", no_cuda_graphs=True), "--no-cuda-graphs"),
    ("engine", dict(model="M", text="T", trace_out="t.parquet"), "--trace-out"),
    ("engine", dict(model="M", text="T", weight_format="q8_0"), "--weight-format"),
]


@pytest.mark.parametrize("backend,fields,flag", REFUSED)
def test_backend_refuses_what_it_cannot_honour(backend, fields, flag):
    spec = RunSpec(policy=PRESETS["rule-0.15"], capacity=4, **fields)
    with pytest.raises(InputError, match=f"backend {backend}: cannot honour {flag} = ") as exc:
        get_backend(backend).evaluate(spec)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("backend", ["emulation", "engine"])
def test_offline_bound_is_simulator_only(backend):
    spec = RunSpec(policy=PolicyConfig(rule="fetch_all", evict="belady"), model="M", text="T", capacity=4)
    with pytest.raises(InputError, match="evict = 'belady' is not supported"):
        get_backend(backend).evaluate(spec)


def test_registry_names():
    assert set(BACKENDS) == {"simulator", "emulation", "engine"}
    with pytest.raises(InputError, match="backend = 'gpu' is unknown"):
        get_backend("gpu")
