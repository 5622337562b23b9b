"""The engine's one-call host decision (runtime/core/kernel/decide.py) against the step-by-step path it replaces:
the adapters' rank order + `PolicyCache.step` with router scores + `write_plan_row`, token by token, on random
routing rows for policies of every fallback and eviction kind (prefetch off); the model dtypes' rounding of a
gate weight against torch's conversion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.backends.adapters import rank_order
from runtime.backends.engine.plan import write_plan_row
from runtime.core.kernel import FETCH, PolicyCache, decide, drop_renorm_scale
from runtime.core.policy import PRESETS, PolicyConfig

POLICIES = {
    **{n: PRESETS[n] for n in ("fetch-every-miss", "quality-first", "speed-first", "substitute-all", "host-compute")},
    "drop-renorm-lru": PolicyConfig(rule="threshold", tau=0.2, fallback="drop", drop_renorm=True, evict="lru"),
    "lowbit-crf": PolicyConfig(rule="first_choice", fallback="lowbit", evict="crf", beta=0.3),
    "s3fifo-cap": PolicyConfig(rule="fetch_all", fetch_cap=1, evict="s3fifo"),
}


def rows(rng: np.random.Generator, T: int, E: int, k: int, dtype: torch.dtype) -> np.ndarray:
    """T packed routing rows [T, 2k + E + 1] float32 as the adapters pack them: the model's top-k ids (not in rank
    order), their gate weights (values of `dtype`), router scores with ties, the finiteness flag."""
    out = np.zeros((T, 2 * k + E + 1), np.float32)
    for t in range(T):
        score = rng.integers(0, 12, size=E).astype(np.float32) / 7  # [E] ties on purpose
        ids = rng.choice(E, size=k, replace=False)  # [k] any order
        w = torch.from_numpy(rng.random(k).astype(np.float32)).to(dtype).float().numpy()  # [k]
        out[t, :k], out[t, k : 2 * k], out[t, 2 * k : 2 * k + E], out[t, -1] = ids, w, score, 1.0
    return out


@pytest.mark.parametrize("name", list(POLICIES))
def test_one_call_equals_rank_order_kernel_step_and_plan_row(name):
    pol = POLICIES[name]
    E, k, L, T = 12, 3, 2, 60
    rng = np.random.default_rng(1)
    caps = np.full(L, 5)
    init = [np.arange(5)] * L
    ref, got = PolicyCache(pol, E, k, caps, init), PolicyCache(pol, E, k, caps, init)
    bufs = decide.decide_buffers(L, k, E, "bfloat16", cap=T)
    packed = {l_: rows(rng, T, E, k, torch.bfloat16) for l_ in range(L)}
    # layer 1 through the engine's entry (decide_layer: every array from an address table), layer 0 directly
    row1, plan1 = np.zeros((1, 2 * k + E + 1), np.float32), np.zeros((3, k), np.float32)
    tab = decide.address_table(got._state, got.next_t, bufs.tok, bufs.ev_tab, bufs.ev_n, bufs.fetches,
                               [(np.zeros_like(row1), np.zeros_like(plan1), bufs.out), (row1, plan1, bufs.out)],
                               got.params_array, decide.decide_consts(k, E, bufs.rnd, pol.drop_renorm))
    slow_seen = fast_seen = 0
    for t in range(T):
        for l_ in range(L):
            row = packed[l_][t : t + 1]  # [1, P]
            # the step-by-step path (adapters.PolicyExperts.decide, PlanRunner.apply's plan row)
            ids0 = row[:, :k].astype(np.int64)
            perm = rank_order(ids0, row[:, 2 * k : 2 * k + E])
            ids = ids0[0, perm[0]][None].astype(np.int32)  # [1, k]
            w = row[0, k : 2 * k][perm[0]][None]  # [1, k] float32
            res = ref.step(l_, ids, w.astype(np.float64), None, scores=row[:, 2 * k : 2 * k + E].astype(np.float64))
            wt = torch.from_numpy(w).to(torch.bfloat16)
            plan_ref = np.zeros((3, k), np.float32)
            write_plan_row(plan_ref, res.kind[0], res.slot[0], wt[0])
            # the one call
            if l_ == 1:
                row1[:] = row
                plan = plan1
                plan[:] = np.nan
                n = decide.decide_layer(tab, l_)
            else:
                plan = np.full((3, k), np.nan, np.float32)
                n = decide.decide_row(row, k, E, l_, got.next_t, got._params, got._state, bufs.tok, bufs.out,
                                      bufs.ev_tab, bufs.ev_n, bufs.rnd, bool(pol.drop_renorm), plan, bufs.fetches)
            o = bufs.out
            assert np.array_equal(o.kind[0], res.kind) and np.array_equal(o.served[0], res.served)
            assert np.array_equal(o.slot[0], res.slot) and np.array_equal(bufs.ev_tab[l_, t], res.events[0])
            assert np.array_equal(bufs.tok.ids[0], ids) and np.array_equal(bufs.tok.w[0], w.astype(np.float64))
            na, nq, npf = o.n_logs[0].tolist()
            assert np.array_equal(o.adm_log[0, :na], res.admitted) and np.array_equal(o.q_log[0, :nq], res.queued)
            assert npf == len(res.prefetched) == 0
            assert np.array_equal(plan, plan_ref)
            fetch = [(int(res.served[0, j]), int(res.slot[0, j])) for j in range(k) if res.kind[0, j] == FETCH]
            renorm = pol.drop_renorm and drop_renorm_scale(res.kind, w) is not None
            if na or nq or renorm or (res.kind >= 4).any():
                assert n == decide.SLOW
                slow_seen += 1
            else:
                assert n == len(fetch) and bufs.fetches[:n].tolist() == [list(f) for f in fetch]
                fast_seen += 1
    assert np.array_equal(got.next_t, ref.next_t) and bufs.ev_n.tolist() == [T] * L
    assert got.counter_totals() == ref.counter_totals()
    for f in ("key", "skey", "slot_expert", "expert_slot", "acc", "qstate", "q_exp", "q_due"):
        assert np.array_equal(getattr(got, f), getattr(ref, f)), f
    assert fast_seen > 0


def test_non_finite_scores_are_reported_not_decided():
    pc = PolicyCache(PRESETS["fetch-every-miss"], 4, 2, np.array([2]), [np.array([0, 1])])
    b = decide.decide_buffers(1, 2, 4)
    row = np.array([[1, 2, 0.5, 0.5, 0.1, 0.2, 0.3, 0.4, 0.0]], np.float32)  # flag 0: a logit was not finite
    n = decide.decide_row(row, 2, 4, 0, pc.next_t, pc._params, pc._state, b.tok, b.out, b.ev_tab, b.ev_n, b.rnd,
                          False, b.plan_scratch, b.fetches)
    assert n == decide.BAD_SCORES and pc.next_t[0] == 0 and b.ev_n[0] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_to_is_torchs_conversion(dtype):
    """Ties, subnormals, overflow and ordinary values: the same float as float32 -> dtype -> float32 in torch."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 6, 4000),
                        rng.random(2000), [0.0, -0.0, 1e-45, 6e-8, 3e-8, 65519.0, 65520.0, 3.4e38, np.inf, -np.inf],
                        [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11]]).astype(np.float32)
    want = torch.from_numpy(x).to(dtype).float().numpy()
    mant, emin, fmax = decide.DTYPE_ROUNDING[str(dtype).removeprefix("torch.")]
    got = np.array([decide.decide_round_to(float(v), mant, emin, fmax) for v in x], np.float32)
    assert np.array_equal(got, want)


def test_exercise_is_deterministic_plain_values():
    a, b = decide.exercise_tiny(), decide.exercise_tiny()
    assert a == b and a["returns"] == [1, 1, 1] and a["counters"]["fetches"] == 3
    assert all(isinstance(v, float) for p in a["plans"] for v in p)
