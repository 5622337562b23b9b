"""Cache-aware routing (docs/policies.md, "Additions (4)"): the kernel's route stage against tests/reference.py.

Random traces whose ranking is the descending order of random router logits (coarse, so ties happen: lower
id first), random routing policies composed with every eviction kind but belady, admission, prefetch and a
pinned hot set; the kernel driven in random chunks (`step`, with the logits as router scores) and in one
`step_layers` call must give the reference's decisions, routed selections, routed weights, counters and final
residency. Plus the properties that hold by construction (lambda = 0 and J = k are the model; J = 0 with a
window of E never fetches from a full cache) and the one-line configuration errors.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.core.errors import InputError
from runtime.core.kernel import N_EV, PolicyCache, predicted_layers, predicted_lists
from runtime.core.policy import PRESETS, PolicyConfig, pinned_count
from tests.reference import reference_replay
from tests.test_kernel import random_lookahead

EXAMPLES = int(os.environ.get("ES_EXAMPLES", "300"))


def logit_case(seed: int, T: int, L: int, E: int, k: int, M: int, p_valid: float, grid: float):
    """(ids, w, ranking, valid, logits): logits [T, L, E] float32 on a grid of `grid` (0: no rounding, else
    ties), skewed per layer; the ranking their descending order (ties lower id) to depth M, ids its first k,
    w the softmax of the top-k logits (float32)."""
    rng = np.random.default_rng(seed)
    bias = rng.normal(0.0, 1.5, size=(L, E))  # per-layer popularity
    z = rng.normal(0.0, 1.0, size=(T, L, E)) + bias[None]
    if grid:
        z = np.round(z / grid) * grid
    z = z.astype(np.float32).astype(np.float64)
    ranking = np.argsort(-z, axis=-1, kind="stable")[..., :M].astype(np.int32)
    ids = ranking[..., :k].copy()
    top = np.take_along_axis(z, ids.astype(np.int64), -1)
    ex = np.exp(top - top[..., :1])
    w = (ex / ex.sum(-1, keepdims=True)).astype(np.float32)
    valid = rng.random((T, L)) < p_valid
    return ids, w, ranking, valid, z


ROUTE_ARGS = dict(
    route=st.sampled_from(["cache-prior", "cache-route"]),
    lam=st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0]),
    keep=st.integers(0, 4),
    window=st.integers(1, 14),
    alpha=st.sampled_from([1.0, 1.0, 0.5, 0.8]),
    evict=st.sampled_from(["lfu", "lfu", "lru", "crf", "lfuda", "s3fifo"]),
    gamma=st.sampled_from([1.0, 0.9]),
    beta=st.sampled_from([None, None, 0.1, 0.4]),
    prefetch=st.sampled_from(["off", "off", "oracle", "lookahead"]),
    pin=st.sampled_from([0.0, 0.0, 0.34]),
    norm=st.sampled_from(["softmax_topk", "softmax_all"]),
    buffers=st.sampled_from([None, None, 1, 2]),  # Additions (3): routing beside a bounded copy pool
)


def _routing_policy(k, E, route, lam, keep, window, alpha, evict, gamma, beta, prefetch, pin, buffers):
    return PolicyConfig(rule="fetch_all", route=route, route_lambda=lam, route_keep=min(keep, k),
                        route_window=max(window, k), route_alpha=alpha, evict=evict, gamma=gamma, beta=beta,
                        prefetch=prefetch, prefetch_n=2 if prefetch == "lookahead" else None, pin_fraction=pin,
                        copy_buffers=buffers if beta is not None or prefetch != "off" else None)


def _setup(seed, T, L, E, data, args, grid):
    k = data.draw(st.integers(1, min(4, E - 1)))
    policy = _routing_policy(k, E, **{n: args[n] for n in args if n != "norm"})
    depth = min(policy.route_window, E) if policy.route == "cache-route" else k
    M = data.draw(st.integers(max(depth, k), E))
    caps = [data.draw(st.integers(k, E - 1)) for _ in range(L)]
    if policy.pin_fraction and any(c - pinned_count(policy.pin_fraction, c) < k for c in caps):
        policy = PolicyConfig(**{**policy.to_dict(), "pin_fraction": 0.0})
    ids, w, ranking, valid, z = logit_case(seed, T, L, E, k, M, data.draw(st.sampled_from([1.0, 0.8])), grid)
    rng = np.random.default_rng(seed + 1)
    init = [rng.choice(E, size=int(rng.integers(max(pinned_count(policy.pin_fraction, c), 0), c + 1)),
                       replace=False).astype(np.int32) for c in caps]
    look = random_lookahead(seed, ids, E, min(E, 5)) if policy.prefetch == "lookahead" else None
    return k, policy, caps, ids, w, ranking, valid, z, init, look


def _reference(policy, ids, w, ranking, valid, z, E, caps, init, look, norm):
    return reference_replay(
        ids.tolist(), w.tolist(), ranking.tolist(), valid.tolist(), E, caps, [list(map(int, x)) for x in init],
        policy.rule, beta=policy.beta, evict=policy.evict, gamma=policy.gamma, half_life=policy.half_life,
        prefetch=policy.prefetch, prefetch_n=policy.prefetch_n, lookahead=None if look is None else look.tolist(),
        pin_fraction=policy.pin_fraction, route=policy.route, route_lambda=policy.route_lambda,
        route_keep=policy.route_keep, route_window=policy.route_window, route_alpha=policy.route_alpha,
        router_scores=z.tolist(), weight_norm=norm, copy_buffers=policy.copy_buffers)


def _assert_counters(cache, ref):
    for l_, row in enumerate(cache.per_layer()):
        for key, val in ref["counters"][l_].items():
            if isinstance(val, float):
                assert row[key] == pytest.approx(val, rel=1e-12, abs=1e-12), (l_, key, row[key], val)
            else:
                assert row[key] == val, (l_, key, row[key], val)
        assert set(cache.resident(l_).tolist()) == set(ref["final_resident"][l_])


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 40), L=st.integers(1, 3), E=st.integers(3, 12),
       grid=st.sampled_from([0.0, 0.5]), data=st.data(), **ROUTE_ARGS)
def test_routing_matches_reference(seed, T, L, E, grid, data, norm, **args):
    """step() in random chunks, with the logits as router scores and the ranking: every decision, the routed
    selection and weights, every counter per layer and the final residency are the reference's."""
    k, policy, caps, ids, w, ranking, valid, z, init, look = _setup(seed, T, L, E, data, args, grid)
    chunks = sorted(set(data.draw(st.lists(st.integers(1, max(T - 1, 1)), max_size=3))))
    cache = PolicyCache(policy, E, k, np.array(caps), init, weight_norm=norm)
    ref = _reference(policy, ids, w, ranking, valid, z, E, caps, init, look, norm)
    for l_ in range(L):
        pred = predicted_lists(policy, l_, ids, valid, look)
        bounds = [0, *[c for c in chunks if 0 < c < T], T]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            r = cache.step(l_, ids[a:b, l_], w[a:b, l_], ranking[a:b, l_], valid[a:b, l_], t0=a,
                           predicted=None if pred is None else pred[a:b], scores=z[a:b, l_])
            for i in range(b - a):
                t = a + i
                if not valid[t, l_]:
                    continue
                assert r.ids[i].tolist() == ref["routed_ids"][t][l_], (t, l_)
                np.testing.assert_allclose(r.weights[i], ref["routed_weights"][t][l_], rtol=1e-12, atol=0)
                assert r.kind[i].tolist() == ref["kind"][t][l_], (t, l_)
                assert r.served[i].tolist() == ref["served"][t][l_], (t, l_)
    _assert_counters(cache, ref)


@settings(max_examples=max(EXAMPLES // 2, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 30), L=st.integers(1, 3), E=st.integers(3, 12),
       data=st.data(), **ROUTE_ARGS)
def test_routing_step_layers_matches_reference(seed, T, L, E, data, norm, **args):
    """The simulator's one call over every layer (the trace's router_scores column as `scores`) routes as the
    reference: decisions, routed selections and weights, counters, residency."""
    k, policy, caps, ids, w, ranking, valid, z, init, look = _setup(seed, T, L, E, data, args, 0.5)
    cache = PolicyCache(policy, E, k, np.array(caps), init, weight_norm=norm)
    lay = [np.ascontiguousarray(np.asarray(a, dt).swapaxes(0, 1)) for a, dt in
           ((ids, np.int32), (w, np.float64), (ranking, np.int32), (valid, np.bool_), (z, np.float64))]
    kind, served, _ = cache.step_layers(*lay[:4], np.zeros((L, T, N_EV), np.int32), scores=lay[4],
                                        predicted=predicted_layers(policy, ids, valid, look), decisions=True)
    ref = _reference(policy, ids, w, ranking, valid, z, E, caps, init, look, norm)
    rid, rw = cache.routed
    for t in range(T):
        for l_ in range(L):
            if valid[t, l_]:
                assert rid[l_, t].tolist() == ref["routed_ids"][t][l_]
                np.testing.assert_allclose(rw[l_, t], ref["routed_weights"][t][l_], rtol=1e-12, atol=0)
                assert kind[l_, t].tolist() == ref["kind"][t][l_]
                assert served[l_, t].tolist() == ref["served"][t][l_]
    _assert_counters(cache, ref)


def _run(policy, E=12, k=3, C=4, T=200, seed=3, norm="softmax_topk"):
    ids, w, ranking, valid, z = logit_case(seed, T, 1, E, k, E, 1.0, 0.0)
    cache = PolicyCache(policy, E, k, np.array([C]), [np.arange(C, dtype=np.int32)], weight_norm=norm)
    r = cache.step(0, ids[:, 0], w[:, 0], ranking[:, 0], scores=z[:, 0])
    return cache.counter_totals(), r, ids[:, 0], w[:, 0]


def test_lambda_zero_and_keep_k_are_the_model():
    """Cache-Prior with lambda = 0 and CACHE_ROUTE with J = k change nothing: the model's selection and weights
    (bit for bit), no reroute, the counters of fetch_all."""
    base, _, _, _ = _run(PolicyConfig(rule="fetch_all"))
    for pol in (PolicyConfig(rule="fetch_all", route="cache-prior", route_lambda=0.0, route_keep=0),
                PolicyConfig(rule="fetch_all", route="cache-route", route_keep=3, route_window=12)):
        got, r, ids, w = _run(pol)
        assert np.array_equal(r.ids, ids) and np.array_equal(r.weights, w.astype(np.float64))
        assert got["reroutes"] == 0 and got["rerouted_mass"] == 0.0
        assert {n: got[n] for n in base} == base


def test_routing_cuts_fetches_by_construction():
    """CACHE_ROUTE with J = 0 and a window of E takes every expert from a full cache: no fetch at all, every
    call a hit or a reroute; Cache-Prior with a large lambda reroutes and fetches far less than fetch_all."""
    base, _, _, _ = _run(PolicyConfig(rule="fetch_all"))
    assert base["fetches"] > 100  # the fixture misses a lot: 4 of 12 experts resident
    got, r, _, _ = _run(PolicyConfig(rule="fetch_all", route="cache-route", route_keep=0, route_window=12))
    assert got["fetches"] == 0 and got["hits"] + got["reroutes"] == got["calls"] and got["reroutes"] > 0
    assert np.isin(r.ids, np.arange(4)).all()  # every routed expert is one of the initial residents
    prior, r, ids, w = _run(PolicyConfig(rule="fetch_all", route="cache-prior", route_lambda=5.0, route_keep=0))
    assert prior["fetches"] < base["fetches"] / 4 and prior["reroutes"] > 0
    assert prior["hits"] + prior["fetches"] + prior["reroutes"] == prior["calls"]
    # the routed weights: a softmax over the routed selection's logits (softmax_topk), sum 1
    np.testing.assert_allclose(r.weights.sum(1), 1.0, rtol=1e-12)


def test_route_alpha_scales_moved_mass_then_renormalises():
    """alpha < 1 lowers the replacements' share: the token's weights still sum to the model's sum."""
    _, r1, ids, w = _run(PolicyConfig(rule="fetch_all", route="cache-route", route_keep=1, route_window=12))
    _, r2, _, _ = _run(PolicyConfig(rule="fetch_all", route="cache-route", route_keep=1, route_window=12,
                                    route_alpha=0.5))
    moved = (r1.ids != ids).any(1)
    assert moved.sum() > 20
    np.testing.assert_allclose(r2.weights.sum(1), w.astype(np.float64).sum(1), rtol=1e-6)
    assert (r2.weights[moved, 0] > r1.weights[moved, 0]).all()  # the kept first choice gains share


@pytest.mark.parametrize("fields, match", [
    ({"rule": "threshold", "tau": 0.15, "route": "cache-route"}, "--route = 'cache-route' needs rule fetch_all"),
    ({"rule": "fetch_all", "route": "cache-prior", "fetch_cap": 1}, "--fetch-cap = 1 with route"),
    ({"rule": "fetch_all", "route": "cache-prior", "evict": "belady"}, "--evict = 'belady' with route"),
    ({"rule": "fetch_all", "route": "sticky"}, "--route = 'sticky' is unknown"),
    ({"rule": "fetch_all", "route": "cache-route", "route_alpha": 0.0}, "--route-alpha = 0.0 must be in"),
    ({"rule": "fetch_all", "route": "cache-prior", "route_lambda": -1.0}, "--route-lambda = -1.0 must be in"),
])
def test_policy_errors_name_the_flag(fields, match):
    with pytest.raises(InputError, match=match) as exc:
        PolicyConfig(**fields)
    assert "\n" not in str(exc.value)


def test_cache_errors_name_the_flag():
    ids, w, ranking, valid, z = logit_case(1, 5, 1, 8, 2, 3, 1.0, 0.0)
    prior = PolicyConfig(rule="fetch_all", route="cache-prior")
    pc = PolicyCache(prior, 8, 2, np.array([4]), [np.arange(4, dtype=np.int32)])
    with pytest.raises(InputError, match="needs the router scores \\(trace column router_scores"):
        pc.step(0, ids[:, 0], w[:, 0], ranking[:, 0])
    with pytest.raises(InputError, match="--route-keep = 3 must be <= k = 2"):
        PolicyCache(PolicyConfig(rule="fetch_all", route="cache-route", route_keep=3), 8, 2, np.array([4]))
    with pytest.raises(InputError, match="--route-window = 1 must be >= k = 2"):
        PolicyCache(PolicyConfig(rule="fetch_all", route="cache-route", route_window=1), 8, 2, np.array([4]))
    with pytest.raises(InputError, match="sigmoid"):
        PolicyCache(prior, 8, 2, np.array([4]), weight_norm="sigmoid_topk")
    deep = PolicyCache(PolicyConfig(rule="fetch_all", route="cache-route", route_window=6), 8, 2, np.array([4]))
    with pytest.raises(InputError, match="--route-window = 6 needs a ranking 6 deep; this one keeps 3"):
        deep.step(0, ids[:, 0], w[:, 0], ranking[:, 0])
    deep.step(0, ids[:, 0], w[:, 0], ranking[:, 0], scores=z[:, 0])  # the ranking from the scores: fine


def test_presets():
    assert PRESETS["cache-route"].route_keep == 1 and PRESETS["cache-route"].route_window == 16
    assert PRESETS["cache-prior"].route == "cache-prior" and PRESETS["cache-prior"].route_lambda > 0
    assert "cache-route(J=1,M=16)" in PRESETS["cache-route"].label()


def _trace(seed=5, T=120, L=2, E=10, k=2, scores=True, norm="softmax_topk"):
    from runtime.formats.trace import Trace, TraceMeta

    ids, w, ranking, valid, z = logit_case(seed, T, L, E, k, E, 1.0, 0.0)
    meta = TraceMeta(model="synthetic", num_experts=E, top_k=k, ranking_depth=E, layer_ids=tuple(range(L)),
                     weight_norm=norm)
    return Trace(ids, w, ranking, np.ones((T, L), bool), np.zeros(T, np.int32), np.arange(T, dtype=np.int32), meta,
                 None, z.astype(np.float32) if scores else None)


def test_trace_router_scores_round_trip(tmp_path):
    """The optional router_scores column survives a save and a load (Parquet and Arrow) bit for bit; a trace
    without it loads with None."""
    from runtime.formats.trace import load_trace, save_trace

    tr = _trace()
    for suffix in (".parquet", ".arrow"):
        save_trace(tr, tmp_path / f"t{suffix}")
        back = load_trace(tmp_path / f"t{suffix}")
        assert back.router_scores is not None and np.array_equal(back.router_scores, tr.router_scores)
    save_trace(_trace(scores=False), tmp_path / "plain.parquet")
    assert load_trace(tmp_path / "plain.parquet").router_scores is None


def test_simulator_routes_from_the_trace():
    """The simulator: CACHE_ROUTE from the ranking alone, Cache-Prior from the router_scores column (the same
    counters as the kernel driven per layer with the logits), and a one-line refusal naming the column."""
    from runtime.backends.simulate import simulate

    tr = _trace()
    init = [list(range(4)), list(range(4))]
    base = simulate(tr, PolicyConfig(rule="fetch_all"), 4, initial_residency=init, baselines=False)
    for pol in (PRESETS["cache-route"], PRESETS["cache-prior"]):
        got = simulate(tr, pol, 4, initial_residency=init, baselines=False)
        assert got.counters["reroutes"] > 0 and got.counters["fetches"] < base.counters["fetches"]
        pc = PolicyCache(pol, 10, 2, np.array([4, 4]), [np.arange(4, dtype=np.int32)] * 2)
        for l_ in range(2):
            pc.step(l_, tr.topk_ids[:, l_], tr.topk_weights[:, l_], tr.ranking[:, l_],
                    scores=tr.router_scores[:, l_].astype(np.float64))
        for key in ("hits", "fetches", "reroutes"):
            assert got.counters[key] == pc.counter_totals()[key], key
    with pytest.raises(InputError, match="needs the trace column router_scores") as exc:
        simulate(_trace(scores=False), PRESETS["cache-prior"], 4, initial_residency=init, baselines=False)
    assert "\n" not in str(exc.value)
    simulate(_trace(scores=False), PRESETS["cache-route"], 4, initial_residency=init, baselines=False)  # no scores needed


def test_bias_rounding_never_reorders_residents():
    """Two resident logits one ulp apart round to one biased value (1 + 6.5 == (1 + 2**-52) + 6.5 in float64):
    the higher logit still wins (the unbiased z breaks the tie, not the id), so no reroute happens."""
    z = np.array([[1.0, 1.0 + 2.0**-52, -5.0, -5.5]])
    assert z[0, 0] + 6.5 == z[0, 1] + 6.5  # the fixture's premise
    pol = PolicyConfig(rule="fetch_all", route="cache-prior", route_lambda=1.0, route_keep=0)  # lambda*D = 6.5
    pc = PolicyCache(pol, 4, 1, np.array([3]), [np.array([0, 1, 2], np.int32)])
    r = pc.step(0, np.array([[1]]), np.array([[1.0]]), scores=z)
    assert r.ids.tolist() == [[1]] and pc.counter_totals()["reroutes"] == 0
    ref = reference_replay([[[1]]], [[[1.0]]], [[[1, 0, 2, 3]]], [[True]], 4, [3], [[0, 1, 2]], "fetch_all",
                           route="cache-prior", route_lambda=1.0, route_keep=0, router_scores=z[None].tolist())
    assert ref["routed_ids"][0][0] == [1] and ref["counters"][0]["reroutes"] == 0


def test_unbiased_order_is_the_models_selection():
    """A model whose top-k disagrees with its logits' top-k (its softmax rounded two probabilities to one and
    it kept expert 0 over expert 1, whose logit is one ulp higher): lambda = 0, or every candidate resident,
    keeps the model's selection (no reroute); the kernel and the reference agree."""
    z = np.array([[1.0, 1.0 + 2.0**-52, -5.0, -5.5]])
    for lam, init in ((0.0, [3]), (1.0, [0, 1, 2])):
        pol = PolicyConfig(rule="fetch_all", route="cache-prior", route_lambda=lam, route_keep=0)
        pc = PolicyCache(pol, 4, 1, np.array([3]), [np.array(init, np.int32)])
        r = pc.step(0, np.array([[0]]), np.array([[1.0]]), scores=z)
        assert r.ids.tolist() == [[0]] and pc.counter_totals()["reroutes"] == 0, lam
        ref = reference_replay([[[0]]], [[[1.0]]], [[[0, 1, 2, 3]]], [[True]], 4, [3], [init], "fetch_all",
                               route="cache-prior", route_lambda=lam, route_keep=0, router_scores=z[None].tolist())
        assert ref["routed_ids"][0][0] == [0] and ref["counters"][0]["reroutes"] == 0, lam
