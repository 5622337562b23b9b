"""llama.cpp's expert cache (one shared LRU pool) and its `-ncmoe` layer split (docs/policies.md, Additions (5)).

The compiled pool (runtime/core/kernel/shared_pool.py, driven by runtime/core/llamacpp_cache.py) and the split
against tests/reference_llamacpp.py on random traces, driven every way a backend drives them (one call over the
trace, layer-major chunks, any interleaving of the layers' steps); two constructed traces on which the shared
LRU and the per-layer LRU at the same memory differ, each way round, with the counts worked by hand; the
policy fields' errors and presets; the simulator, the emulation and the engine (CPU device mode) exact under both.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.core.errors import InputError
from runtime.core.kernel import EV_DEV, EV_FETCH, EV_HOST, N_EV, PolicyCache
from runtime.core.llamacpp_cache import LayerSplitCache, SharedPoolCache, cache_for, ncmoe_layers
from runtime.core.policy import PRESETS, PolicyConfig
from tests.reference_llamacpp import ncmoe_reference, shared_pool_reference

LRU = PRESETS["llamacpp-lru"]
NCMOE = PRESETS["llamacpp-ncmoe"]


def random_trace(seed: int, T: int, L: int, E: int, k: int, invalid: float = 0.05):
    """ids int32 [T, L, k] (distinct per cell, skewed toward low ids), valid bool [T, L]."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** 1.1
    p /= p.sum()
    ids = np.stack([np.stack([rng.choice(E, size=k, replace=False, p=p) for _ in range(L)]) for _ in range(T)])
    valid = rng.random((T, L)) >= invalid
    return ids.astype(np.int32), valid


def warm(ids, E, caps):
    """Each layer's C_l most selected experts (ties lower id): the warm start's rule."""
    out = []
    for l_, c in enumerate(caps):
        counts = np.bincount(ids[:, l_].ravel(), minlength=E)
        out.append(np.lexsort((np.arange(E), -counts))[:c].astype(np.int32))
    return out


def drive(cache, ids, valid, how: str, seed: int = 0):
    """kind, served, slot [T, L, k] and events [T, L, N_EV] from the cache driven `how`: `layers` (step_layers),
    `chunks` (layer-major chunks of random sizes, every layer the same chunk: the emulation), `any` (random
    interleaving: a random layer gets its next 1..5 tokens), `tokens` (one token at a time, layers in order)."""
    T, L, k = ids.shape
    if how == "layers":
        ev = np.zeros((L, T, N_EV), np.int32)
        kind, served, slot = cache.step_layers(np.ascontiguousarray(ids.swapaxes(0, 1)), None, None,
                                               np.ascontiguousarray(valid.swapaxes(0, 1)), ev, decisions=True)
        return kind.swapaxes(0, 1), served.swapaxes(0, 1), slot.swapaxes(0, 1), ev.swapaxes(0, 1)
    rng = np.random.default_rng(seed)
    parts: list[list] = [[] for _ in range(L)]  # per layer its StepResults in order
    if how == "any":
        nxt = [0] * L
        while min(nxt) < T:
            l_ = int(rng.choice([x for x in range(L) if nxt[x] < T]))
            n = min(int(rng.integers(1, 6)), T - nxt[l_])
            parts[l_].append(cache.step(l_, ids[nxt[l_] : nxt[l_] + n, l_], None, valid=valid[nxt[l_] : nxt[l_] + n, l_]))
            nxt[l_] += n
    else:
        t = 0
        while t < T:
            n = 1 if how == "tokens" else min(int(rng.integers(1, 20)), T - t)
            for l_ in range(L):
                parts[l_].append(cache.step(l_, ids[t : t + n, l_], None, valid=valid[t : t + n, l_]))
            t += n
    out = [np.stack([np.concatenate([getattr(r, f) for r in parts[l_]]) for l_ in range(L)], axis=1)
           for f in ("kind", "served", "slot", "events")]
    return tuple(out)


CASES = [  # (seed, T, L, E, k, C per layer, warm)
    (0, 300, 3, 16, 2, 4, True),
    (1, 300, 4, 12, 3, 3, False),
    (2, 200, 2, 32, 4, [6, 9], True),
    (3, 250, 5, 8, 1, 1, True),
]


@pytest.mark.parametrize("how", ["layers", "chunks", "any", "tokens"])
@pytest.mark.parametrize("case", CASES)
def test_shared_pool_equals_reference(case, how):
    seed, T, L, E, k, C, is_warm = case
    caps = np.broadcast_to(np.asarray(C), (L,)).astype(np.int64)
    ids, valid = random_trace(seed, T, L, E, k)
    init = warm(ids[:60], E, caps) if is_warm else None
    cache = SharedPoolCache(LRU, E, k, caps, init)
    kind, served, slot, ev = drive(cache, ids, valid, how, seed)
    rkind, rslot, rcount = shared_pool_reference(ids.tolist(), valid.tolist(), E, caps.tolist(),
                                                 None if init is None else [x.tolist() for x in init])
    np.testing.assert_array_equal(kind, np.array(rkind))
    np.testing.assert_array_equal(slot, np.array(rslot))
    np.testing.assert_array_equal(served, np.where(valid[..., None], ids, -1))
    per = cache.per_layer()
    for l_ in range(L):
        for key in ("calls", "hits", "fetches"):
            assert per[l_][key] == rcount[l_][key], (l_, key)
        assert per[l_]["substitutions"] == per[l_]["drops"] == per[l_]["host_computes"] == 0
    np.testing.assert_array_equal(ev[..., EV_DEV], np.where(valid, k, 0))
    np.testing.assert_array_equal(ev[..., EV_FETCH], (kind == 1).sum(axis=2))
    tot = cache.counter_totals()
    assert tot["fetches"] > 0 and tot["hits"] > 0  # neither kind is vacuous on these traces
    assert sum(len(cache.resident(l_)) for l_ in range(L)) == int(caps.sum())  # the pool is full at the end


def per_layer_lru_fetches(ids, E, C):
    """Fetches per layer of the per-layer LRU (the kernel's `fetch_all + lru`) with C slots per layer, cold."""
    T, L, k = ids.shape
    pc = PolicyCache(PolicyConfig(rule="fetch_all", evict="lru"), E, k, np.full(L, C))
    for l_ in range(L):
        pc.step(l_, ids[:, l_], np.full((T, k), 1.0 / k))
    return [r["fetches"] for r in pc.per_layer()]


def test_shared_beats_per_layer_on_an_unbalanced_trace():
    """Layer 0 cycles through 3 experts, layer 1 repeats one; 2 slots per layer (a pool of 4). Per layer, LRU with 2
    slots misses every one of layer 0's 60 tokens; the shared pool holds all 4 keys after 3 tokens."""
    T = 60
    ids = np.stack([np.arange(T) % 3, np.zeros(T, int)], axis=1)[:, :, None].astype(np.int32)  # [T, 2, 1]
    valid = np.ones((T, 2), bool)
    assert per_layer_lru_fetches(ids, 8, 2) == [60, 1]
    cache = SharedPoolCache(LRU, 8, 1, np.array([2, 2]))
    drive(cache, ids, valid, "chunks")
    assert [r["fetches"] for r in cache.per_layer()] == [3, 1]
    assert shared_pool_reference(ids.tolist(), valid.tolist(), 8, [2, 2])[2] == [
        {"calls": 60, "hits": 57, "fetches": 3}, {"calls": 60, "hits": 59, "fetches": 1}]


def test_per_layer_beats_shared_when_one_layer_scans():
    """Layer 0 scans 64 experts (never a reuse within 64 tokens), layer 1 picks expert 0 every 5th token and expert
    1 otherwise; 2 slots per layer. Per layer, layer 1 keeps both (2 fetches); in the shared pool layer 0's scan
    pushes layer 1's expert 0 out between its uses: it misses at t = 0, 5, ..., 195 (40) plus expert 1 once."""
    T = 200
    ids = np.stack([np.arange(T) % 64, np.where(np.arange(T) % 5 == 0, 0, 1)], axis=1)[:, :, None].astype(np.int32)
    valid = np.ones((T, 2), bool)
    assert per_layer_lru_fetches(ids, 64, 2) == [200, 2]
    cache = SharedPoolCache(LRU, 64, 1, np.array([2, 2]))
    drive(cache, ids, valid, "tokens")
    assert [r["fetches"] for r in cache.per_layer()] == [200, 41]
    assert [c["fetches"] for c in shared_pool_reference(ids.tolist(), valid.tolist(), 64, [2, 2])[2]] == [200, 41]


def test_warm_pool_evicts_smallest_key_first():
    """Never-touched residents (stamp -1) go smallest key first: layer 1's first miss evicts layer 0's resident."""
    cache = SharedPoolCache(LRU, 4, 1, np.array([1, 1]), [np.array([2]), np.array([3])])
    res = cache.step(1, np.array([[0]]))  # layer 1 waits for layer 0's token 0
    assert res.kind[0, 0] == -1
    cache.step(0, np.array([[1]]))  # layer 0 misses: evicts the smallest key, its own 0 * 4 + 2 = 2
    assert res.kind[0, 0] == 1 and cache.resident(0).tolist() == [1] and cache.resident(1).tolist() == [0]


def test_hits_are_touched_in_rank_order():
    """llama.cpp's plan touches a token-layer's hits in the order of its selected ids (ffn_moe_topk: rank order),
    then fetches the misses by ascending id. One layer, a cold pool of 3, k = 2, by hand: t0 selects [0, 1] (both
    fetched, 1 newer), t1 [1, 0] (hits: 1 touched, then 0: 0 is now the newest), t2 [2, 3] (2 takes the free
    slot, 3 evicts the least recently used: 1), t3 [0, 2]: both hits. Touching the hits by ascending id instead
    leaves 0 the oldest at t2, and t3 fetches it again (5 fetches, not 4)."""
    ids = np.array([[0, 1], [1, 0], [2, 3], [0, 2]], np.int32)[:, None, :]  # [T=4, L=1, k=2]
    valid = np.ones((4, 1), bool)
    cache = SharedPoolCache(LRU, 4, 2, np.array([3]))
    drive(cache, ids, valid, "tokens")
    assert cache.per_layer()[0]["fetches"] == 4 and cache.resident(0).tolist() == [0, 2, 3]
    assert shared_pool_reference(ids.tolist(), valid.tolist(), 4, [3])[2] == [{"calls": 8, "hits": 4, "fetches": 4}]


@pytest.mark.parametrize("how", ["layers", "chunks", "any"])
def test_ncmoe_equals_reference(how):
    T, L, E, k = 120, 5, 8, 2
    ids, valid = random_trace(7, T, L, E, k)
    caps = np.full(L, 5)  # 25 slots: 3 layers of 8 fit, N = 2
    cache = LayerSplitCache(NCMOE, E, k, caps)
    kind, served, slot, ev = drive(cache, ids, valid, how)
    N, rkind, rslot, rcount = ncmoe_reference(ids.tolist(), valid.tolist(), E, caps.tolist())
    assert N == cache.ncmoe == ncmoe_layers(caps, E) == 2
    np.testing.assert_array_equal(kind, np.array(rkind))
    np.testing.assert_array_equal(slot, np.array(rslot))
    per = cache.per_layer()
    for l_ in range(L):
        for key in ("calls", "hits", "host_computes"):
            assert per[l_][key] == rcount[l_][key]
        assert per[l_]["fetches"] == 0
    assert [r["capacity"] for r in per] == [0, 0, 8, 8, 8]
    np.testing.assert_array_equal(ev[:, :2, EV_HOST], np.where(valid[:, :2], k, 0))
    np.testing.assert_array_equal(ev[:, 2:, EV_DEV], np.where(valid[:, 2:], k, 0))


@pytest.mark.parametrize("caps,E,N", [([3, 3], 8, 2), ([7, 7, 7, 7], 8, 1), ([4] * 48, 128, 47), ([6, 7], 8, 1)])
def test_ncmoe_is_the_smallest_split_that_fits(caps, E, N):
    assert ncmoe_layers(caps, E) == N
    L = len(caps)
    assert (L - N) * E <= sum(caps) < (L - N + 1) * E


def test_cache_for_and_policy_errors():
    assert isinstance(cache_for(LRU, 8, 2, np.array([3, 3])), SharedPoolCache)
    assert isinstance(cache_for(NCMOE, 8, 2, np.array([3, 3])), LayerSplitCache)
    assert isinstance(cache_for(PRESETS["fetch-every-miss"], 8, 2, np.array([3, 3])), PolicyCache)
    for bad, flag in ((dict(pool="shared"), "--evict"), (dict(pool="shared", evict="lru", beta=0.5), "--beta"),
                      (dict(rule="threshold", tau=0.1, layer_split="ncmoe"), "--rule"),
                      (dict(layer_split="ncmoe", prefetch="oracle"), "--prefetch"),
                      (dict(pool="shared", evict="lru", layer_split="ncmoe"), "--layer-split")):
        with pytest.raises(InputError, match=f"needs {flag} = ") as exc:
            PolicyConfig(**bad)
        assert "\n" not in str(exc.value)
    with pytest.raises(InputError, match="--pool = 'per-layer' is unknown"):
        PolicyConfig(pool="per-layer")
    assert LRU.label() == "fetch_all + lru + pool=shared" and NCMOE.label() == "fetch_all + ncmoe"
    assert "pool" in LRU.active_params() and "pool" not in PRESETS["rule-0.15"].active_params()
    with pytest.raises(InputError, match="k=2 <= C < E=8"):
        SharedPoolCache(LRU, 8, 2, np.array([1, 3]))


@pytest.mark.parametrize("name", ["llamacpp-lru", "llamacpp-ncmoe"])
def test_a_per_layer_cache_refuses_llamacpps_policies(name):
    """PolicyCache would run the shared pool as per-layer LRU and the split as an all-device cache: it refuses."""
    with pytest.raises(ValueError, match="cache_for builds its cache"):
        PolicyCache(PRESETS[name], 8, 2, np.array([4, 4]))
    assert isinstance(cache_for(PRESETS[name], 8, 2, np.array([4, 4])), SharedPoolCache | LayerSplitCache)


def test_all_resident_pool_hits_everything():
    """A pool of L * E slots (allow_full, as the emulation's exactness check uses) holds every key: only hits."""
    ids, valid = random_trace(5, 50, 2, 6, 2, invalid=0.0)
    cache = cache_for(LRU, 6, 2, np.full(2, 6), [np.arange(6)] * 2, allow_full=True)
    drive(cache, ids, valid, "chunks")
    assert cache.counter_totals()["hits"] == cache.counter_totals()["calls"] == 200
    split = cache_for(NCMOE, 6, 2, np.full(2, 6), allow_full=True)
    drive(split, ids, valid, "chunks")
    assert split.ncmoe == 0 and split.counter_totals()["hits"] == 200


# --- the backends ---------------------------------------------------------------------------------------------------

def test_simulator_is_exact_and_charges_host_layers():
    """The simulator's counters are the reference's on a synthetic trace; -ncmoe's host layers are charged as host
    computes (k host calls per host token-layer: all-resident time + N * k * (host - device) per token)."""
    from runtime.backends.simulate import simulate
    from runtime.formats import costmodel
    from runtime.formats.trace import synthetic_trace

    T, L, E, k, C = 200, 4, 64, 6, 16
    tr = synthetic_trace(T, L, E, k, 16, seed=3)
    init = warm(np.asarray(tr.topk_ids)[:50], E, [C] * L)
    r = simulate(tr, LRU, C, initial_residency=init, record_decisions=True, baselines=False)
    rkind, rslot, rcount = shared_pool_reference(np.asarray(tr.topk_ids).tolist(), np.asarray(tr.valid).tolist(), E,
                                                 [C] * L, [x.tolist() for x in init])
    np.testing.assert_array_equal(r.decisions["kind"], np.array(rkind))
    np.testing.assert_array_equal(r.decisions["slot"], np.array(rslot))
    assert [p["fetches"] for p in r.per_layer] == [c["fetches"] for c in rcount]
    assert r.counters["fetches"] > 0 and r.counters["substitutions"] == r.counters["host_computes"] == 0
    params = costmodel.cost_params(costmodel.load_host_profile(r.extra["host"]),
                                   costmodel.load_model_shape(r.extra["model_shape"])
                                   if r.extra["model_shape"] in costmodel.list_model_shapes()
                                   else costmodel.shape_for_trace(tr, None))
    resident = costmodel.all_resident_time(np.asarray(tr.valid), params, k)
    assert r.time_per_token_s > resident  # the fetches stall
    s = simulate(tr, NCMOE, C, initial_residency=init, baselines=False)
    N = s.extra["ncmoe"]
    assert N == L - (L * C) // E == 3
    assert s.counters["host_computes"] == int(np.asarray(tr.valid)[:, :N].sum()) * k
    assert s.counters["hits"] + s.counters["host_computes"] == s.counters["calls"] and s.counters["fetches"] == 0
    assert np.asarray(tr.valid).all()
    assert s.time_per_token_s == pytest.approx(resident + N * k * (params.host_expert_s - params.device_expert_s),
                                               rel=1e-12)
    slot_bytes = costmodel.expert_bytes(costmodel.load_model_shape(s.extra["model_shape"])
                                        if s.extra["model_shape"] in costmodel.list_model_shapes()
                                        else costmodel.shape_for_trace(tr, None))
    assert s.extra["expert_slots_GiB"] == pytest.approx((L - N) * E * slot_bytes / 2**30)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pathlib import Path

    from tests.tiny_hf import build_tiny

    d = tmp_path_factory.mktemp("llamacpp")
    text = d / "text.txt"
    text.write_text((Path(__file__).resolve().parent / "data" / "kernel_source.txt").read_text()[:6000])
    return d, text, build_tiny("qwen3_moe", d / "qwen3_moe", num_experts=8, top_k=2)


def test_emulation_is_exact_and_the_simulator_replays_it(tiny):
    """Under both presets the emulation's per-token NLL is fetch-every-miss's (which computes every selected expert
    exactly) bit for bit, every cell is decided (HIT / FETCH, or HOST / HIT), and the simulator replaying the
    emulation's own trace from its warm start makes the same decision at every token, layer and rank."""
    import pyarrow.parquet as pq

    from runtime.backends import get_backend
    from runtime.core.spec import RunSpec

    d, text, ckpt = tiny
    common = dict(model=str(ckpt), text=str(text), window=16, max_tokens=96, record_decisions=True)
    cap = {"llamacpp-lru": 3, "llamacpp-ncmoe": 5, "fetch-every-miss": 3}  # ncmoe: 10 slots hold 1 layer of E = 8
    specs = [RunSpec(policy=PRESETS[n], name=n, trace_out=str(d / f"{n}.parquet"), residency_out=str(d / f"{n}.npy"),
                     nll_out=str(d / "nll.parquet"), capacity=c, **common) for n, c in cap.items()]
    lru, ncmoe, exact = get_backend("emulation").evaluate_many(specs)
    nll = pq.read_table(d / "nll.parquet").to_pandas()
    for name, res, kinds in (("llamacpp-lru", lru, {0, 1}), ("llamacpp-ncmoe", ncmoe, {0, 4})):
        np.testing.assert_array_equal(nll[f"nll_{name}"].to_numpy(), nll["nll_fetch-every-miss"].to_numpy())
        assert res.perplexity == exact.perplexity
        assert set(np.unique(res.decisions["kind"]).tolist()) == kinds, name
        sim = get_backend("simulator").evaluate(RunSpec(policy=PRESETS[name], trace=str(d / f"{name}.parquet"),
                                                        capacity=cap[name], initial_residency=str(d / f"{name}.npy"),
                                                        record_decisions=True))
        for f in ("kind", "served", "slot"):
            np.testing.assert_array_equal(sim.decisions[f], res.decisions[f], err_msg=f"{name} {f}")
        assert sim.counters == res.counters
    assert lru.counters["fetches"] > 0 and lru.counters["hits"] > 0
    assert ncmoe.extra["ncmoe"] == 1 and 2 * ncmoe.per_layer[0]["host_computes"] == ncmoe.counters["calls"]


def test_policy_all_on_the_engine_runs_every_preset(tiny, capsys):
    """`--policy all --backend engine` runs every preset, llama.cpp's two included (nothing left out), as the
    emulation does; both backends give the presets' decision counters alike."""
    import json

    from runtime.cli import emulate_main

    d, text, ckpt = tiny
    argv = ["--model", str(ckpt), "--text", str(text), "--window", "16", "--max-tokens", "48", "--capacity", "3",
            "--policy", "all", "--json"]
    emulate_main([*argv, "--backend", "engine"])
    captured = capsys.readouterr()
    eng = json.loads(captured.out)
    assert set(eng) == set(PRESETS) and "--policy all" not in captured.err, captured.err
    emulate_main([*argv, "--backend", "emulation"])
    captured = capsys.readouterr()
    emu = json.loads(captured.out)
    assert set(emu) == set(PRESETS) and "--policy all" not in captured.err
    for name in ("llamacpp-lru", "llamacpp-ncmoe"):
        for key in ("calls", "hits", "fetches", "host_computes"):
            assert eng[name][key] == emu[name][key], (name, key)
    assert eng["llamacpp-lru"]["fetches"] > 0 and eng["llamacpp-ncmoe"]["host_computes"] > 0


@pytest.fixture(scope="module")
def engine(tiny):
    """The engine in CPU device mode with its debug check (after every layer's plan, each slot holds the weights of
    the expert the cache's own table puts there)."""
    from runtime.backends import emulate
    from runtime.backends.engine import Engine

    eng = Engine(emulate.load(tiny[2]), "cpu", debug=True)
    yield eng
    eng.close()


def test_engine_runs_both_presets_exactly(engine):
    """The engine decodes under both presets and decides at every token, layer and rank what
    tests/reference_llamacpp.py decides for the selections it saw, with the same counters per layer: the shared
    pool from a warm start (one slot array of S = L x C rows that every layer's grouped call addresses by the
    pool's slot ids), the split with its first N layers on the host. It copies exactly the fetched experts,
    computes the host layers' experts on the host and the others from slots, holds S (split: (L - N) x E) slots,
    and its NLL under the pool is fetch-every-miss's bit for bit (the same grouped call over the same weights)."""
    eng = engine
    L, E, k = eng.L, eng.E, eng.k
    windows = np.random.default_rng(3).integers(0, 90, size=(3, 24)).astype(np.int64)
    C = {"llamacpp-lru": 3, "llamacpp-ncmoe": 5}  # ncmoe: 10 slots hold one layer of E = 8: N = 1
    warm_start = [np.array([(2 * j + l_) % E for j in range(C["llamacpp-lru"])]) for l_ in range(L)]
    runs = {name: eng.evaluate(windows, PRESETS[name], capacities=C[name],
                               initial_residency=warm_start if name == "llamacpp-lru" else None, record_decisions=True)
            for name in C}
    fem = eng.evaluate(windows, PRESETS["fetch-every-miss"], capacities=3)
    for name, r in runs.items():
        dec = r["decisions"]
        T = windows.size
        assert dec["kind"].shape == (T, L, k)
        sel, valid = dec["served"].tolist(), np.ones((T, L), bool).tolist()
        if name == "llamacpp-lru":
            kind, slot, ref = shared_pool_reference(sel, valid, E, [C[name]] * L, warm_start)
        else:
            N, kind, slot, ref = ncmoe_reference(sel, valid, E, [C[name]] * L)
            assert N == 1
        np.testing.assert_array_equal(dec["kind"], np.array(kind), err_msg=name)
        np.testing.assert_array_equal(dec["slot"], np.array(slot), err_msg=name)
        for l_ in range(L):
            for key, value in ref[l_].items():
                assert r["per_layer"][l_][key] == value, (name, l_, key)
        c, rep = r["counters"], r["engine"]
        assert rep["fetch_copies"] == c["fetches"] and rep["host_computes"] == c["host_computes"]
        assert rep["device_computes"] == c["hits"] + c["fetches"]
        assert c["hits"] + c["fetches"] + c["host_computes"] == c["calls"] == T * L * k
    lru, ncmoe = runs["llamacpp-lru"], runs["llamacpp-ncmoe"]
    assert lru["counters"]["fetches"] > 0 and lru["counters"]["hits"] > 0
    assert lru["engine"]["slot_layout"] == "shared" and ncmoe["engine"]["slot_layout"] == "per_layer"
    assert lru["engine"]["slot_bytes"] == L * C["llamacpp-lru"] * eng.expert_bytes
    assert ncmoe["engine"]["slot_bytes"] == (L - 1) * E * eng.expert_bytes
    np.testing.assert_array_equal(lru["nll"], fem["nll"])
    # the split's host layer sums its experts on the host, in ascending id: the same math, summed in another order
    np.testing.assert_allclose(ncmoe["nll"], fem["nll"], rtol=0, atol=1e-5)


# --- llama.cpp's flags ------------------------------------------------------------------------------------------------

def test_flags_of_the_two_presets():
    """qwen3-30b-a3b: one expert is 3 * 2048 * 768 bf16 weights = 9 MiB; C = 32 of 48 layers is a pool of 1,536
    slots + 1 padding slot = 13,833 MiB, and 1,536 slots hold 12 layers of 128 experts: -ncmoe 36."""
    from runtime.formats import costmodel
    from runtime.tools.llamacpp_flags import (
        llamacpp_args,
        llamacpp_flags,
        moe_cache_mib,
        moe_cache_slots,
    )

    shape = costmodel.load_model_shape("qwen3-30b-a3b")
    assert costmodel.expert_bytes(shape) == 9 * 2**20
    assert llamacpp_flags(LRU, shape, 32) == "--moe-cache-mib 13833"
    assert llamacpp_args(NCMOE, shape, 32) == ["-ncmoe", "36"]
    assert llamacpp_flags(NCMOE, shape, [32] * 47 + [33]) == "-ncmoe 36"  # 1,537 slots: still 12 layers
    for name in costmodel.list_model_shapes():  # every shape: the smallest budget that llama.cpp splits into S slots
        sh = costmodel.load_model_shape(name)
        for C in (sh.top_k, sh.num_experts // 4, sh.num_experts - 1):
            S = sh.num_layers * C
            mib = moe_cache_mib(sh, S)
            assert moe_cache_slots(sh, mib) == S and moe_cache_slots(sh, mib - 1) < S, (name, C)


@pytest.mark.parametrize("name,needle", [
    ("rule-0.15", "llama.cpp has no substitution of a missed expert"),
    ("fetch-every-miss", "not a cache per layer"),
    ("host-compute", "compute its misses on the host"),
    ("quality-first", "no background admission"),
    ("cache-prior", "no cache-aware routing"),
])
def test_flags_say_what_llamacpp_lacks(name, needle):
    from runtime.formats import costmodel
    from runtime.tools.llamacpp_flags import llamacpp_args, llamacpp_flags

    shape = costmodel.load_model_shape("qwen3-30b-a3b")
    line = llamacpp_flags(PRESETS[name], shape, 32)
    assert llamacpp_args(PRESETS[name], shape, 32) is None and needle in line and "\n" not in line
    assert ("evicts by LRU only" in line) == (name != "host-compute")  # host-compute never evicts


def test_flags_command_line(capsys):
    from runtime.core.errors import cli_main
    from runtime.tools.llamacpp_flags import main

    cli_main(lambda: main(["--policy", "llamacpp-ncmoe", "--model-shape", "mixtral-8x7b", "--capacity", "4"]))
    assert capsys.readouterr().out == "-ncmoe 16\n"  # 32 layers x 4 slots hold 16 layers of 8 experts
    with pytest.raises(SystemExit) as exc:
        cli_main(lambda: main(["--policy", "llamacpp-lru", "--model-shape", "mixtral-8x7b", "--capacity", "x"]))
    assert exc.value.code == 2 and "--capacity = 'x'" in capsys.readouterr().err


def test_sweep_measures_llamacpp_presets_on_the_engine(monkeypatch):
    """The sweep's baselines include both presets (every preset without routing), and its engine batch on a
    calibrated host measures them with every other policy of the batch."""
    import sys
    from types import SimpleNamespace

    from sweep.config import DEFAULT_BASELINES
    from sweep.remeasure import Measurer

    assert {"llamacpp-lru", "llamacpp-ncmoe"} <= set(DEFAULT_BASELINES)
    sent = []

    def remote(fn):
        return SimpleNamespace(options=lambda **kw: SimpleNamespace(
            remote=lambda specs, backend: sent.append((backend, [s["policy"] for s in specs])) or len(specs)))

    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(remote=remote, get=lambda n: [None] * n))
    m = Measurer("M", "T", None, SimpleNamespace(rows=[], keys=set()), lambda rows: None, progress=False)
    names = ("llamacpp-lru", "fetch-every-miss", "llamacpp-ncmoe")
    m.engine([{**PRESETS[n].to_dict(), "capacity_fraction": 0.25} for n in names], 64, "h", 0)
    assert len(sent) == 1 and sent[0][0] == "engine"
    assert [PolicyConfig(**p) for p in sent[0][1]] == [PRESETS[n] for n in names]


def test_sweep_family_names_the_structure():
    from sweep.report import family

    assert family(PRESETS["llamacpp-lru"].to_dict()) == "fetch_all+pool:shared"
    assert family(PRESETS["llamacpp-ncmoe"].to_dict()) == "fetch_all+split:ncmoe"
    assert family(PRESETS["fetch-every-miss"].to_dict()) == "fetch_all"
