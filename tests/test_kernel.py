"""The compiled kernel against the plain reference of the spec (tests/reference.py) on random traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from runtime.core.errors import InputError
from runtime.core.kernel import (
    COUNTER_NAMES,
    N_EV,
    PolicyCache,
    next_use,
    predicted_layers,
    predicted_lists,
    warm_residency,
)
from runtime.core.policy import PRESETS, PolicyConfig, pinned_count, resolve_capacities
from tests.reference import reference_replay, warm_residency_reference


def random_case(seed: int, T: int, L: int, E: int, k: int, M: int, p_valid: float):
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(E, 0.5), size=L)  # skewed popularity per layer
    ranking = np.empty((T, L, M), np.int32)
    for t in range(T):
        for l_ in range(L):
            ranking[t, l_] = rng.choice(E, size=M, replace=False, p=pop[l_])
    ids = ranking[:, :, :k].copy()
    w = rng.dirichlet(np.full(k + 2, 0.7), size=(T, L))[..., :k]
    w = -np.sort(-w, axis=-1)
    w = w.astype(np.float32)
    valid = rng.random((T, L)) < p_valid
    return ids, w, ranking, valid


def random_lookahead(seed: int, ids, E: int, P: int):
    """[T, L, P] distinct ids: on layer l's row a guess at layer l + 1's selection (half of it right)."""
    rng = np.random.default_rng(seed + 7)
    T, L, k = ids.shape
    out = np.empty((T, L, P), np.int32)
    for t in range(T):
        for l_ in range(L):
            nxt = ids[t, min(l_ + 1, L - 1)]
            keep = [int(e) for e in nxt[: rng.integers(0, min(k, P) + 1)]]
            rest = [int(e) for e in rng.permutation(E) if e not in keep]
            row = keep + rest[: P - len(keep)]
            out[t, l_] = rng.permutation(row) if rng.random() < 0.5 else row
    return out


def drive_kernel(policy, ids, w, ranking, valid, E, caps, init, chunks, lookahead=None):
    T, L, k = ids.shape
    first_use, nxts = None, [None] * L
    if policy.evict == "belady":
        first_use = []
        for l_ in range(L):
            nxt, first = next_use(np.ascontiguousarray(ids[:, l_]), np.ascontiguousarray(valid[:, l_]), E, 0)
            nxts[l_] = nxt
            first_use.append(first)
    cache = PolicyCache(policy, E, k, caps, init, belady_first_use=first_use)
    kind = np.full((T, L, k), -1)
    served = np.full((T, L, k), -1)
    for l_ in range(L):
        bounds = [0, *sorted(set(chunks)), T] if chunks else [0, T]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if b <= a:
                continue
            nxt = None if nxts[l_] is None else nxts[l_][a:b]
            pred = predicted_lists(policy, l_, ids, valid, lookahead)
            r = cache.step(l_, ids[a:b, l_], w[a:b, l_], ranking[a:b, l_], valid[a:b, l_], t0=a, nxt=nxt,
                           predicted=None if pred is None else pred[a:b])
            kind[a:b, l_] = r.kind
            served[a:b, l_] = r.served
    return cache, kind, served


def _policy(rule, tau, beta, evict, gamma, h, d, fallback, prefetch, n, cap, pin=0.0, s3=0.1, buffers=None):
    if evict == "belady":
        rule = "fetch_all"
        cap = None
    return PolicyConfig(
        rule=rule, tau=tau if rule in ("threshold", "band") else None,
        tau_high=tau + 0.2 if rule == "band" else None,
        fallback="substitute" if rule == "cpu" else fallback,
        beta=beta, evict=evict, gamma=gamma, half_life=h, admission_delay=d, prefetch=prefetch, prefetch_n=n,
        fetch_cap=cap, pin_fraction=pin, s3_small=s3, copy_buffers=buffers)


POLICY_ARGS = dict(
    rule=st.sampled_from(["fetch_all", "threshold", "first_choice", "substitute_all", "cpu", "band"]),
    tau=st.sampled_from([0.0, 0.05, 0.15, 0.3, 0.9]),
    beta=st.sampled_from([None, None, 0.05, 0.2, 0.5, 1.0]),
    evict=st.sampled_from(["lfu", "lfu", "lru", "crf", "belady", "lfuda", "lfuda", "s3fifo", "s3fifo"]),
    gamma=st.sampled_from([1.0, 1.0, 0.5, 0.9, 0.73]),
    h=st.sampled_from([1.0, 4.0, 32.0]),
    d=st.integers(1, 3),
    fallback=st.sampled_from(["substitute", "substitute", "drop", "host", "lowbit"]),
    prefetch=st.sampled_from(["off", "off", "lookahead", "oracle"]),
    n=st.sampled_from([None, 1, 2, 5]),
    cap=st.sampled_from([None, None, None, 1, 2]),
    pin=st.sampled_from([0.0, 0.0, 0.0, 0.25, 0.5, 0.34]),
    s3=st.sampled_from([0.1, 0.1, 0.3, 0.6]),
    buffers=st.sampled_from([None, None, 1, 1, 2, 3]),  # copy_buffers: 1-3 per layer make copies wait
)
policies = st.builds(_policy, **POLICY_ARGS)


def policies_of(evict: str):
    """The random policies with one eviction kind (tests/test_evict_contract.py)."""
    return st.builds(_policy, **{**POLICY_ARGS, "evict": st.just(evict)})


def _pinnable(policy, caps, k):
    """The policy with pin_fraction 0 where some layer would keep fewer than k free slots (an error)."""
    if policy.pin_fraction and any(c - pinned_count(policy.pin_fraction, c) < k for c in caps):
        return replace(policy, pin_fraction=0.0)
    return policy


@settings(max_examples=int(os.environ.get("ES_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    T=st.integers(1, 40),
    L=st.integers(1, 3),
    E=st.integers(3, 12),
    data=st.data(),
    policy=policies,
)
def test_kernel_matches_reference(seed, T, L, E, data, policy):
    check_against_reference(seed, T, L, E, data, policy)


def check_against_reference(seed, T, L, E, data, policy):
    """The kernel (driven in random chunks) and tests/reference.py on one random case: every decision, every
    counter per layer and the final residency."""
    k = data.draw(st.integers(1, min(4, E - 1)))
    M = data.draw(st.integers(k, E))
    caps = [data.draw(st.integers(k, E - 1)) for _ in range(L)]
    p_valid = data.draw(st.sampled_from([1.0, 1.0, 0.8]))
    ids, w, ranking, valid = random_case(seed, T, L, E, k, M, p_valid)
    rng = np.random.default_rng(seed + 1)
    policy = _pinnable(policy, caps, k)
    # a pinned hot set needs at least P_l initial residents
    init = [rng.choice(E, size=int(rng.integers(pinned_count(policy.pin_fraction, c), c + 1)), replace=False)
            .astype(np.int32) for c in caps]
    chunks = data.draw(st.lists(st.integers(1, max(T - 1, 1)), max_size=3))
    look = None
    if policy.prefetch == "lookahead":
        look = random_lookahead(seed, ids, E, min(E, 5))
        if (policy.prefetch_n or k) > look.shape[2]:
            policy = replace(policy, prefetch_n=look.shape[2])
    cache, kind, served = drive_kernel(policy, ids, w, ranking, valid, E, np.array(caps), init, chunks, look)
    ref = reference_replay(
        ids.tolist(), w.tolist(), ranking.tolist(), valid.tolist(), E, caps, [list(map(int, x)) for x in init],
        policy.rule, tau=policy.tau, beta=policy.beta, evict=policy.evict, gamma=policy.gamma,
        half_life=policy.half_life, admission_delay=policy.admission_delay, fallback=policy.fallback,
        tau_high=policy.tau_high, prefetch=policy.prefetch, prefetch_n=policy.prefetch_n,
        lookahead=None if look is None else look.tolist(), fetch_cap=policy.fetch_cap,
        pin_fraction=policy.pin_fraction, s3_small=policy.s3_small, copy_buffers=policy.copy_buffers,
    )
    for t in range(T):
        for l_ in range(L):
            if not valid[t, l_]:
                continue
            assert list(kind[t, l_]) == list(ref["kind"][t][l_]), (t, l_)
            assert list(served[t, l_]) == list(ref["served"][t][l_]), (t, l_)
    for l_, row in enumerate(cache.per_layer()):
        assert set(ref["counters"][l_]) <= set(COUNTER_NAMES)
        for key, val in ref["counters"][l_].items():
            assert row[key] == val, (l_, key, row[key], val)
        assert set(cache.resident(l_).tolist()) == set(ref["final_resident"][l_])


@settings(max_examples=int(os.environ.get("ES_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 40), E=st.integers(3, 12), data=st.data(), policy=policies)
def test_no_decisions_changes_nothing_else(seed, T, E, data, policy):
    """step(decisions=False), the simulator's call (per-slot decisions to one scratch row), gives the same
    counters, events, logs and cache state as the full call, for every family (lru and crf read the row);
    and where the lean build decides (the presets' features), the full build decides the same."""
    assume(policy.evict != "belady")
    k = data.draw(st.integers(1, min(4, E - 1)))
    M = data.draw(st.integers(k, E))
    cap = data.draw(st.integers(k, E - 1))
    ids, w, ranking, valid = random_case(seed, T, 1, E, k, M, data.draw(st.sampled_from([1.0, 0.8])))
    policy = _pinnable(policy, [cap], k)
    lean = data.draw(st.booleans())
    if lean:  # the features the lean build fixes; the rule, admission and delay stay drawn
        policy = replace(policy, evict="lfu", gamma=1.0, fallback="substitute", prefetch="off", prefetch_n=None,
                         fetch_cap=None, pin_fraction=0.0)
    rng = np.random.default_rng(seed + 1)
    init = [rng.choice(E, size=int(rng.integers(pinned_count(policy.pin_fraction, cap), cap + 1)), replace=False)
            .astype(np.int32)]
    if policy.prefetch == "lookahead" and (policy.prefetch_n or k) > min(E, 5):
        policy = replace(policy, prefetch_n=min(E, 5))
    pred = predicted_lists(policy, 1, np.concatenate([ids, ids], axis=1), np.concatenate([valid, valid], axis=1),
                           random_lookahead(seed, np.concatenate([ids, ids], axis=1), E, min(E, 5)))
    got = []
    for decisions, build in ((True, "picked"), (False, "picked"), (True, "full")):
        cache = PolicyCache(policy, E, k, np.array([cap]), init)
        assert cache._lean or not lean  # a lean draw takes the lean build
        if build == "full":
            cache._lean = False  # the full build, whatever the policy
        r = cache.step(0, ids[:, 0], w[:, 0], ranking[:, 0], valid[:, 0], predicted=pred, decisions=decisions)
        got.append((r, cache.counter_totals(), cache.expert_slot.copy(), cache.key.copy()))
    (full, c_full, es_full, key_full), (lean, c_lean, es_lean, key_lean), (ref, c_ref, es_ref, key_ref) = got
    assert lean.kind is None and lean.served is None and lean.slot is None
    assert c_full == c_lean == c_ref
    for a, b in ((full.events, lean.events), (full.admitted, lean.admitted), (full.queued, lean.queued),
                 (full.prefetched, lean.prefetched), (es_full, es_lean), (key_full, key_lean),
                 (full.kind, ref.kind), (full.served, ref.served), (full.slot, ref.slot), (full.events, ref.events),
                 (full.admitted, ref.admitted), (full.queued, ref.queued), (es_full, es_ref), (key_full, key_ref)):
        assert np.array_equal(a, b)


@settings(max_examples=int(os.environ.get("ES_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 30), L=st.integers(1, 3), E=st.integers(3, 12), data=st.data(),
       policy=policies)
def test_step_layers_equals_a_step_per_layer(seed, T, L, E, data, policy):
    """step_layers (the simulator's one call over every layer) decides exactly as one step per layer, for every
    family, with per-layer capacities (rows padded to the widest layer), invalid cells, belady's next uses and
    prefetch lists (a row of -1 at layer 0): decisions, events, counters and the final cache state."""
    k = data.draw(st.integers(1, min(4, E - 1)))
    M = data.draw(st.integers(k, E))
    caps = [data.draw(st.integers(k, E - 1)) for _ in range(L)]
    ids, w, ranking, valid = random_case(seed, T, L, E, k, M, data.draw(st.sampled_from([1.0, 0.8])))
    policy = _pinnable(policy, caps, k)
    rng = np.random.default_rng(seed + 1)
    init = [rng.choice(E, size=int(rng.integers(pinned_count(policy.pin_fraction, c), c + 1)), replace=False)
            .astype(np.int32) for c in caps]
    if policy.prefetch == "lookahead" and (policy.prefetch_n or k) > min(E, 5):
        policy = replace(policy, prefetch_n=min(E, 5))
    look = random_lookahead(seed, ids, E, min(E, 5))
    preds = [predicted_lists(policy, l_, ids, valid, look) for l_ in range(L)]
    nxt, first = (list(x) for x in zip(*(next_use(np.ascontiguousarray(ids[:, l_]), np.ascontiguousarray(valid[:, l_]),
                                                  E, 0) for l_ in range(L)), strict=True))
    belady = first if policy.evict == "belady" else None
    per = PolicyCache(policy, E, k, np.array(caps), init, belady_first_use=belady)
    ev_per = np.zeros((L, T, N_EV), np.int32)
    kinds = [per.step(l_, ids[:, l_], w[:, l_], ranking[:, l_], valid[:, l_], nxt=nxt[l_] if belady else None,
                      events=ev_per[l_], predicted=preds[l_]) for l_ in range(L)]
    one = PolicyCache(policy, E, k, np.array(caps), init, belady_first_use=belady)
    ev_one = np.zeros((L, T, N_EV), np.int32)
    pred = predicted_layers(policy, ids, valid, look)
    lay = [np.ascontiguousarray(np.asarray(a, dt).swapaxes(0, 1)) for a, dt in
           ((ids, np.int32), (w, np.float64), (ranking, np.int32), (valid, np.bool_))]
    kind, served, slot = one.step_layers(*lay, ev_one, nxt=np.stack(nxt) if belady else None, predicted=pred,
                                         decisions=True)
    for l_, r in enumerate(kinds):
        m = valid[:, l_]
        for a, b in ((r.kind, kind[l_]), (r.served, served[l_]), (r.slot, slot[l_])):
            assert np.array_equal(a[m], b[m]), l_
    assert np.array_equal(ev_per, ev_one)
    assert per.per_layer() == one.per_layer()
    for name in ("slot_expert", "expert_slot", "key", "acc", "queued", "qstate", "age_count"):
        assert np.array_equal(getattr(per, name), getattr(one, name)), name
    with pytest.raises(ValueError, match="step_layers"):  # one layer too many for the caches
        per.step_layers(np.concatenate([lay[0], lay[0][:1]]), *lay[1:], ev_one)


def test_warm_residency_matches_reference():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 9, size=(50, 2, 3)).astype(np.int32)
    caps = np.array([4, 6])
    ours = warm_residency(ids, None, 9, caps)
    ref = warm_residency_reference(ids.tolist(), [[True, True]] * 50, 9, caps.tolist())
    assert [list(x) for x in ours] == [list(x) for x in ref]


def test_rule_invariants_on_a_skewed_trace():
    ids, w, ranking, valid = random_case(0, 200, 2, 16, 4, 16, 1.0)
    caps = np.array([6, 6])
    init = warm_residency(ids[:50], valid[:50], 16, caps)
    got = {}
    for name, pol in PRESETS.items():
        if pol.route != "off":  # cache-aware routing: tests/test_routing.py (it needs router scores)
            continue
        if pol.pool != "per_layer" or pol.layer_split != "none":  # llama.cpp's: tests/test_llamacpp_family.py
            continue
        cache, kind, _ = drive_kernel(pol, ids, w, ranking, valid, 16, caps, init, [])
        got[name] = tot = cache.counter_totals()
        assert tot["calls"] == 200 * 2 * 4
        assert tot["hits"] + tot["fetches"] + tot["substitutions"] + tot["drops"] + tot["host_computes"] == tot["calls"]
        if name == "host-compute":  # no cache change at all
            assert [set(cache.resident(l_)) for l_ in range(2)] == [set(x.tolist()) for x in init]
    assert got["fetch-every-miss"]["substitutions"] == got["fetch-every-miss"]["drops"] == 0
    assert got["substitute-all"]["fetches"] == 0
    assert got["first-choice"]["fetches"] < got["rule-0.15"]["fetches"] < got["fetch-every-miss"]["fetches"]
    assert got["quality-first"]["admissions"] > 0 and got["rule-0.15"]["admissions"] == 0


@pytest.mark.parametrize("bad", [dict(capacity=1), dict(capacity=8), dict(capacity=[3, 3, 3])])
def test_capacity_errors(bad):
    with pytest.raises(InputError, match="capacity"):
        resolve_capacities(bad["capacity"], 2, 8, 2)


@pytest.mark.parametrize("field,value", [("tau", -0.1), ("beta", 0.0), ("beta", -1.0), ("admission_delay", 0),
                                         ("gamma", 0.0), ("gamma", 1.5), ("rule", "nope"), ("evict", "mru")])
def test_policy_errors_name_the_field(field, value):
    base = {"rule": "threshold", "tau": 0.15}
    base[field] = value
    with pytest.raises(InputError, match=field):
        PolicyConfig(**base).validate()


def test_prefetch_requeue_case_matches_reference():
    """The hand-worked case of tests/test_reference_cases.py where a prefetched expert keeps a >= beta and
    is queued again after its eviction (rare in random traces)."""
    from tests.test_reference_cases import lookahead_requeue_case, run_layers

    layers, kw = lookahead_requeue_case()
    ref = run_layers(layers, **kw)
    ids = np.array([[layers[l_][t][0] for l_ in range(2)] for t in range(8)], np.int32)
    w = np.array([[layers[l_][t][1] for l_ in range(2)] for t in range(8)], np.float32)
    E = kw["E"]
    ranking = np.array([[list(r) + [e for e in range(E) if e not in r] for r in row] for row in ids], np.int32)
    look = np.array(kw["lookahead"], np.int32).transpose(1, 0, 2)  # [T, L, P]
    pol = PolicyConfig(rule="substitute_all", beta=0.5, admission_delay=3, evict="lru", prefetch="lookahead", prefetch_n=1)
    cache, kind, _ = drive_kernel(pol, ids, w, ranking, np.ones((8, 2), bool), E, np.array(kw["caps"]),
                                  [np.array(x) for x in kw["inits"]], [3], look)
    for l_, row in enumerate(cache.per_layer()):
        for key, val in ref["counters"][l_].items():
            assert row[key] == pytest.approx(val, rel=1e-6), (l_, key)  # the kernel saw float32 weights
    assert set(cache.resident(1).tolist()) == ref["final_resident"][1] == {0, 2}


def test_step_returns_the_prefetch_plan():
    """StepResult.prefetched lists (token, expert, slot) loads; the slots are where the experts now live."""
    pol = PolicyConfig(rule="fetch_all", prefetch="oracle")
    cache = PolicyCache(pol, 6, 2, np.array([3, 3]), [np.arange(3), np.arange(3)])
    ids = np.array([[3, 4], [0, 3]], np.int32)
    r = cache.step(1, ids, np.full((2, 2), 0.5), predicted=ids)
    assert r.prefetched[:, :2].tolist() == [[0, 3], [0, 4], [1, 0]]
    assert (r.kind == 0).all()  # every call a hit
    for t, e, s in r.prefetched.tolist():
        assert cache.slot_expert[1, s] in (e, -1) or t == 0
    assert cache.counter_totals()["prefetches"] == cache.counter_totals()["prefetch_used"] == 3


@pytest.mark.parametrize("caps", [[1, 3], [3, 6], [3, 7]])
def test_policy_cache_validates_capacity(caps):
    with pytest.raises(InputError, match=r"capacity = \d+ \(layer \d\) must satisfy k=2 <= C < E=6"):
        PolicyCache(PRESETS["rule-0.15"], 6, 2, np.array(caps))


def test_predicted_lists_errors():
    ids = np.zeros((4, 2, 2), np.int32)
    valid = np.ones((4, 2), bool)
    with pytest.raises(InputError, match="lookahead column"):
        predicted_lists(PolicyConfig(prefetch="lookahead"), 1, ids, valid, None)
    with pytest.raises(InputError, match="prefetch_n"):
        predicted_lists(PolicyConfig(prefetch="lookahead", prefetch_n=4), 1, ids, valid, np.zeros((4, 2, 3), np.int32))
    assert predicted_lists(PolicyConfig(prefetch="oracle"), 0, ids, valid) is None
    valid[2, 0] = False
    assert predicted_lists(PolicyConfig(prefetch="oracle", prefetch_n=1), 1, ids, valid)[:, 0].tolist() == [0, 0, -1, 0]


@settings(max_examples=int(os.environ.get("ES_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 40), E=st.integers(3, 12), data=st.data(), policy=policies)
def test_scores_decide_like_the_full_ranking(seed, T, E, data, policy):
    """Router scores given instead of the full ranking (the adapters' path: no sort of E candidates per
    token) decide exactly like the ranking they sort into: the selection, then every other expert by
    descending score, ties lower id. Integer-valued scores make ties common. Given with a full ranking,
    the ranking is walked; with a truncated one, the scores decide: the same decisions either way."""
    assume(policy.evict != "belady")  # belady needs next-use times; the ranking path covers it above
    k = data.draw(st.integers(1, min(4, E - 1)))
    cap = data.draw(st.integers(k, E - 1))
    rng = np.random.default_rng(seed)
    score = rng.integers(-3, 4, size=(T, E)).astype(np.float64)  # [T, E]
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)  # [T, k]
    w = -np.sort(-rng.dirichlet(np.full(k + 2, 0.7), size=T)[:, :k], axis=1)
    rest = score.copy()
    np.put_along_axis(rest, ids.astype(np.int64), -np.inf, axis=1)
    tail = np.lexsort((np.broadcast_to(np.arange(E), (T, E)), -rest), axis=1)[:, : E - k]  # [T, E-k]
    ranking = np.concatenate([ids, tail.astype(np.int32)], axis=1)  # [T, E]
    policy = _pinnable(policy, [cap], k)
    init = [rng.choice(E, size=int(rng.integers(pinned_count(policy.pin_fraction, cap), cap + 1)), replace=False)
            .astype(np.int32)]
    pred = ids if policy.prefetch != "off" else None
    out = []
    # also both (the full ranking is walked) and a truncated ranking beside the scores (the scores decide)
    for kw in ({"ranking": ranking}, {"scores": score}, {"ranking": ranking, "scores": score},
               {"ranking": ranking[:, :k], "scores": score}):
        cache = PolicyCache(policy, E, k, np.array([cap]), init)
        r = cache.step(0, ids, w, predicted=pred, **kw)
        out.append((r.kind, r.served, r.slot, cache.counter_totals()))
    for other in out[1:]:
        for a, b in zip(out[0][:3], other[:3], strict=True):
            assert np.array_equal(a, b)
        assert out[0][3] == other[3]


def test_scores_shape_is_checked():
    cache = PolicyCache(PRESETS["rule-0.15"], 6, 2, np.array([3]))
    with pytest.raises(InputError, match="router scores: shape"):
        cache.step(0, np.array([[0, 1]]), np.array([[0.6, 0.4]]), scores=np.zeros((1, 5)))


# ---- Additions (2): every combination the checks list, run by run against the reference ----
ADDITIONS2 = {
    "lfuda": dict(rule="threshold", tau=0.1, evict="lfuda"),
    "lfuda+admission": dict(rule="first_choice", evict="lfuda", beta=0.2),
    "pin+lfu": dict(rule="threshold", tau=0.1, evict="lfu", pin_fraction=0.5),
    "pin+lru": dict(rule="first_choice", evict="lru", pin_fraction=0.5, beta=0.2),
    "cap+substitute": dict(rule="fetch_all", fetch_cap=1, fallback="substitute"),
    "cap+drop": dict(rule="fetch_all", fetch_cap=1, fallback="drop"),
    "cap+host": dict(rule="fetch_all", fetch_cap=1, fallback="host"),
    "calibrated+lfuda": dict(rule="first_choice", evict="lfuda", beta=0.2, capacity_alloc="calibrated"),
    "calibrated+pin": dict(rule="threshold", tau=0.1, evict="lfu", pin_fraction=0.25, capacity_alloc="calibrated"),
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(ADDITIONS2))
def test_additions2_combinations_match_reference(name, seed):
    """The kernel's decisions, counters, residency and lfuda state equal the reference's for each
    combination of the issue's checks; the warm start and (calibrated) capacities come from a calibration
    part of the stream, computed by both sides independently. Each case is checked to exercise its feature."""
    from runtime.core.kernel import calibrated_capacities, calibration_counts, warm_start
    from tests.reference import calibrated_capacities_reference

    pol = PolicyConfig(**ADDITIONS2[name])
    E, k, L, T_cal = 12, 3, 3, 60
    ids, w, ranking, valid = random_case(seed, 160 + T_cal, L, E, k, E, 1.0)
    cids, cvalid = ids[:T_cal], valid[:T_cal]
    ids, w, ranking, valid = ids[T_cal:], w[T_cal:], ranking[T_cal:], valid[T_cal:]
    uniform = np.full(L, 6)
    caps, init = warm_start(pol, uniform, k, E, cids, cvalid)
    if pol.capacity_alloc == "calibrated":
        ref_caps = calibrated_capacities_reference(cids.tolist(), cvalid.tolist(), E, uniform.tolist(), k)
        assert caps.tolist() == ref_caps and caps.sum() == uniform.sum()
        assert calibrated_capacities(calibration_counts(cids, cvalid, E), uniform, k).tolist() == ref_caps
    else:
        assert caps.tolist() == uniform.tolist()
    ref_init = warm_residency_reference(cids.tolist(), cvalid.tolist(), E, caps.tolist())
    assert [x.tolist() for x in init] == ref_init  # count order: the pinned hot set is its head
    cache, kind, served = drive_kernel(pol, ids, w, ranking, valid, E, caps, init, [50, 100])
    ref = reference_replay(ids.tolist(), w.tolist(), ranking.tolist(), valid.tolist(), E, caps.tolist(), ref_init,
                           pol.rule, tau=pol.tau, beta=pol.beta, evict=pol.evict, fallback=pol.fallback,
                           fetch_cap=pol.fetch_cap, pin_fraction=pol.pin_fraction)
    for t in range(len(ids)):
        for l_ in range(L):
            assert list(kind[t, l_]) == ref["kind"][t][l_], (t, l_)
            assert list(served[t, l_]) == ref["served"][t][l_], (t, l_)
    rows = cache.per_layer()
    for l_, row in enumerate(rows):
        for key, val in ref["counters"][l_].items():
            assert row[key] == pytest.approx(val, rel=1e-9), (l_, key)
        assert set(cache.resident(l_).tolist()) == ref["final_resident"][l_]
        assert row["capacity"] == caps[l_] and row["pinned"] == pinned_count(pol.pin_fraction, caps[l_])
        if pol.evict == "lfuda":  # the aging state itself: K, c and A
            assert cache.key[l_].tolist() == ref["final_state"][l_]["K"]
            assert cache.age_count[l_].tolist() == ref["final_state"][l_]["c"]
            assert int(cache.qstate[l_, 4]) == ref["final_state"][l_]["A"]
    tot = cache.counter_totals()
    assert tot["fetches"] > 0
    if pol.evict == "lfuda":
        assert max(int(cache.qstate[l_, 4]) for l_ in range(L)) > 0  # evictions raised A
    if pol.pin_fraction:
        for l_ in range(L):  # the hot set never left
            assert set(init[l_][: rows[l_]["pinned"]].tolist()) <= set(cache.resident(l_).tolist())
        assert sum(r["pinned"] for r in rows) > 0
    if pol.fetch_cap:  # the cap turned fetches into the fallback
        assert tot["substitutions"] + tot["drops"] + tot["host_computes"] > 0
    if pol.beta is not None:
        assert tot["admissions"] > 0


def test_calibrated_capacities_follow_the_counts():
    """By construction: layer 0's router uses 4 experts, layer 1 spreads over all 12; calibrated gives layer 1
    the slots (every layer keeps at least k) and keeps the total."""
    from runtime.core.kernel import calibrated_capacities

    counts = np.zeros((2, 12), np.int64)
    counts[0, :4] = 100
    counts[1, :] = 10
    caps = calibrated_capacities(counts, np.array([6, 6]), 2)
    assert caps.tolist() == [4, 8]  # layer 0: its 5th expert has share 0, so it stops at 4 (all its calls covered)


def test_simulate_reports_calibrated_capacities_per_layer(tmp_path):
    """The simulator's JSON: per_layer[l].capacity is C_l (calibrated: the reference's allocation of the same
    total), and the counters equal the reference replay at those capacities from the same warm start."""
    from runtime.backends.simulate import simulate
    from runtime.formats.trace import calibration_twin, save_trace, synthetic_trace
    from tests.reference import calibrated_capacities_reference

    tr, cal = synthetic_trace(120, 3, 16, 2, 16, seed=3), calibration_twin(200, 3, 16, 2, 16, seed=3)
    save_trace(cal, tmp_path / "cal.parquet")
    pol = PolicyConfig(rule="threshold", tau=0.2, evict="lfuda", pin_fraction=0.25, capacity_alloc="calibrated")
    res = simulate(tr, pol, 6, initial_residency=f"warm:{tmp_path / 'cal.parquet'}", baselines=False).to_dict()
    caps = calibrated_capacities_reference(cal.topk_ids.tolist(), cal.valid.tolist(), 16, [6, 6, 6], 2)
    assert res["capacity"] == caps == [r["capacity"] for r in res["per_layer"]] and sum(caps) == 18
    init = warm_residency_reference(cal.topk_ids.tolist(), cal.valid.tolist(), 16, caps)
    ref = reference_replay(tr.topk_ids.tolist(), tr.topk_weights.tolist(), tr.ranking.tolist(), tr.valid.tolist(), 16,
                           caps, init, "threshold", tau=0.2, evict="lfuda", pin_fraction=0.25)
    for l_, row in enumerate(res["per_layer"]):
        for key, val in ref["counters"][l_].items():
            assert row[key] == pytest.approx(val, rel=1e-6), (l_, key)
    uniform = simulate(tr, replace(pol, capacity_alloc="uniform"), 6, initial_residency=f"warm:{tmp_path / 'cal.parquet'}",
                       baselines=False)
    assert uniform.capacity == [6, 6, 6] and [r["capacity"] for r in uniform.per_layer] == [6, 6, 6]


@pytest.mark.parametrize("bad,needle", [
    (dict(pin_fraction=0.6), "pins P=3 of C=5 slots at layer 0, leaving 2 < k=3"),
    (dict(pin_fraction=0.25, cold=True), "needs a warm start"),
])
def test_pinning_errors(bad, needle):
    cold = bad.get("cold", False)
    with pytest.raises(InputError, match=needle) as exc:
        PolicyCache(PolicyConfig(pin_fraction=bad["pin_fraction"]), 12, 3, np.array([5, 5]), None if cold else [np.arange(5), np.arange(5)])
    assert "\n" not in str(exc.value)


def test_calibrated_capacities_need_counts():
    from runtime.core.kernel import warm_start

    pol = PolicyConfig(capacity_alloc="calibrated")
    for ids, source in ((None, "cold"), ([np.arange(4)], "res.npy")):
        with pytest.raises(InputError, match=f"--capacity-alloc = 'calibrated' needs calibration counts.*{source}"):
            warm_start(pol, np.array([4]), 2, 8, given=ids, source=source)


def test_second_process_loads_the_kernel_from_the_cache():
    """warmup() compiles (or loads) the kernel here; a second process with the same numba cache then compiles
    nothing (its dispatchers report no cache miss) and adds no cache file. A closure over a dispatcher (the
    former run_layers) or a strided signature compiled again in every process (reports/compile_once.md)."""
    from runtime.core.kernel import warmup
    from runtime.core.kernel.cache import kernel_signatures

    warmup()
    # every path warmup takes, decide.py's one call included (it passes `lean` as a runtime bool: a literal False
    # typed Literal[bool](False) compiled a second run_layers signature): one signature
    assert kernel_signatures()["run_layers"] == 1
    from runtime.core.compiled import cache_dirs
    from runtime.core.units import KERNEL

    root = Path(__file__).resolve().parents[1]

    def files():
        return sorted(str(p) for d in cache_dirs(KERNEL) if d.is_dir() for p in d.rglob("*.nb[ic]"))

    before = files()
    code = ("import json; from runtime.core.kernel import warmup; from runtime.core.kernel.cache import "
            "kernel_signatures; warmup(); print(json.dumps(kernel_signatures()))")
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    sig = json.loads(r.stdout.strip().splitlines()[-1])
    assert sig["compiled"] == 0, sig
    assert sig["run_layers"] == 1, sig
    assert files() == before
