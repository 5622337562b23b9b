"""Hand-worked cases for the pure-Python policy reference (tests/reference.py).

Every expected decision below was worked out by hand from docs/policies.md and
docs/design.md; the comments show the working. These tests check the
reference itself, so that it can serve as the oracle for runtime/core/kernel/.

Notation in comments: R = resident set, f/last/c = LFU/LRU/CRF keys,
"cand" = eviction candidates (residents not pinned), "rk" = candidate ranking.
"""

import math
import random

import numpy as np
import pytest

from tests.reference import (
    DROP,
    FETCH,
    HIT,
    HOST,
    LOWBIT,
    SUB,
    reference_replay,
    warm_residency_reference,
)


def run1(tokens, E, C, init, rule, valid=None, **kw):
    """One-layer replay. ``tokens``: list of (sel, weights) or (sel, weights, ranking);
    the default ranking is sel followed by the other experts in ascending id order."""
    ids, ws, rks = [], [], []
    for tok in tokens:
        sel, w = list(tok[0]), list(tok[1])
        rk = list(tok[2]) if len(tok) > 2 else sel + [e for e in range(E) if e not in sel]
        ids.append([sel])
        ws.append([w])
        rks.append([rk])
    v = [[True] for _ in tokens] if valid is None else [[bool(x)] for x in valid]
    return reference_replay(ids, ws, rks, v, E, [C], [list(init)], rule, **kw)


def kinds(out):
    return [row[0] for row in out["kind"]]


def served(out):
    return [row[0] for row in out["served"]]


def cnt(out):
    return out["counters"][0]


def res(out):
    return out["final_resident"][0]


def state(out):
    return out["final_state"][0]


# --------------------------------------------------------------------------- fetch_all / LFU


def test_fetch_all_lfu_ties_lower_id():
    # E=6, k=2, C=3, R={0,1,2}, all f=0.
    # t0 (3,0): 0 HIT; 3 FETCH, cand {1,2} f 0,0 -> tie -> evict 1. R={0,2,3}. f0=f3=1.
    # t1 (1,2): 2 HIT; 1 FETCH, cand {0,3} f 1,1 -> evict 0. R={1,2,3}. f0..3 = 1.
    # t2 (4,3): 3 HIT; 4 FETCH, cand {1,2} f 1,1 -> evict 1. R={2,3,4}.
    toks = [((3, 0), (0.5, 0.5)), ((1, 2), (0.5, 0.5)), ((4, 3), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "fetch_all")
    assert kinds(out) == [[FETCH, HIT], [FETCH, HIT], [FETCH, HIT]]
    assert served(out) == [[3, 0], [1, 2], [4, 3]]
    assert res(out) == {2, 3, 4}
    c = cnt(out)
    assert (c["calls"], c["hits"], c["fetches"]) == (6, 3, 3)
    assert (c["substitutions"], c["drops"], c["host_computes"], c["admissions"]) == (0, 0, 0, 0)
    assert c["substituted_mass"] == 0.0
    assert state(out)["f"] == [1.0, 1.0, 1.0, 2.0, 1.0, 0.0]


def test_pinned_hit_with_lowest_key_is_not_evicted():
    # E=6, k=2, C=3, R={0,1,2}.
    # t0 (1,2): both HIT. f1=f2=1, f0=0.
    # t1 (0,3): 0 HIT (pinned, f0=0 is the lowest key); 3 FETCH, cand {1,2} f 1,1 -> evict 1.
    #    Without pinning the victim would have been 0. R={0,2,3}.
    toks = [((1, 2), (0.5, 0.5)), ((0, 3), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "fetch_all")
    assert kinds(out) == [[HIT, HIT], [HIT, FETCH]]
    assert res(out) == {0, 2, 3}


def test_already_fetched_expert_is_pinned():
    # E=6, k=2, C=2, R={2,3}.
    # t0 (0,1): both miss. FETCH 0: cand {2,3} f 0,0 -> evict 2, R={0,3}.
    #    FETCH 1: pinned {0}; cand {3} -> evict 3, R={0,1}.
    #    (Unpinned, cand {0,3} f 0,0 would have evicted 0.)
    out = run1([((0, 1), (0.5, 0.5))], 6, 2, [2, 3], "fetch_all")
    assert kinds(out) == [[FETCH, FETCH]]
    assert res(out) == {0, 1}


def test_lfu_gamma_aging_changes_victim():
    # E=6, k=2, C=3, R={0,1,2}, fetch_all.
    # plain (gamma=1):     t0 (0,1): f0=1 f1=1; t1 (0,1): f0=2 f1=2; t2 (2,1): f1=3 f2=1.
    #   t3 (3,1): 1 HIT; FETCH 3, cand {0,2} f 2,1 -> evict 2. R={0,1,3}.
    # gamma=0.5:           t0: f0=1 f1=1; t1: f0=1.5 f1=1.5; t2: f0=.75 f1=1.75 f2=1.
    #   t3: cand {0,2} f .75,1 -> evict 0. R={1,2,3}.
    toks = [((0, 1), (0.5, 0.5)), ((0, 1), (0.5, 0.5)), ((2, 1), (0.5, 0.5)), ((3, 1), (0.5, 0.5))]
    plain = run1(toks, 6, 3, [0, 1, 2], "fetch_all")
    aged = run1(toks, 6, 3, [0, 1, 2], "fetch_all", gamma=0.5)
    assert res(plain) == {0, 1, 3}
    assert res(aged) == {1, 2, 3}
    # after t3 (gamma .5): f0=.375 f1=1.875 f2=.5 f3=1
    assert state(aged)["f"] == [0.375, 1.875, 0.5, 1.0, 0.0, 0.0]
    assert state(plain)["f"] == [2.0, 4.0, 1.0, 1.0, 0.0, 0.0]


# --------------------------------------------------------------------------- LRU


def test_lru_victims_differ_from_lfu():
    # E=6, k=2, C=3, R={0,1,2}, all last=-1.
    # t0 (0,3): 0 HIT; FETCH 3, cand {1,2} last -1,-1 -> evict 1. last0=last3=0. R={0,2,3}.
    # t1 (2,4): 2 HIT; FETCH 4, cand {0,3} last 0,0 -> evict 0. last2=last4=1. R={2,3,4}.
    # t2 (5,4): 4 HIT; FETCH 5, cand {2,3} last 1,0 -> evict 3. R={2,4,5}.
    #    (LFU: f2=1, f3=1 -> tie -> would evict 2.)
    toks = [((0, 3), (0.5, 0.5)), ((2, 4), (0.5, 0.5)), ((5, 4), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "fetch_all", evict="lru")
    assert kinds(out) == [[HIT, FETCH], [HIT, FETCH], [FETCH, HIT]]
    assert res(out) == {2, 4, 5}
    assert state(out)["last"] == [0, -1, 1, 0, 2, 2]
    assert res(run1(toks, 6, 3, [0, 1, 2], "fetch_all", evict="lfu")) == {3, 4, 5}


def test_lru_never_used_counts_as_minus_one():
    # E=6, k=2, C=3, R={0,1,2}.
    # t0 (0,1): hits, last0=last1=0 (token 0!). last2=-1 (never used).
    # t1 (3,0): 0 HIT; FETCH 3, cand {1,2} last 0,-1 -> evict 2.
    #    (If never-used counted as 0 the tie would evict 1.)
    toks = [((0, 1), (0.5, 0.5)), ((3, 0), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "fetch_all", evict="lru")
    assert res(out) == {0, 1, 3}


def test_lru_counts_substitutes_as_use():
    # E=6, k=2, C=3, R={0,1,2}, threshold tau=0.3, lru.
    # t0 (5,4) w (.8,.2) rk (5,4,1,2,0,3): FETCH 5 (j=0): cand {0,1,2} last -1 -> evict 0.
    #    R={1,2,5}. 4: w .2 < .3 -> SUB: rk 5 used, 4 not resident, 1 -> served 1.
    #    last5=0, last1=0.
    # t1 (3,5) w (.9,.1): 5 HIT; FETCH 3, cand {1,2} last 0,-1 -> evict 2. R={1,3,5}.
    #    (If substitutes did not count as use: tie -1,-1 -> evict 1.)
    toks = [((5, 4), (0.8, 0.2), (5, 4, 1, 2, 0, 3)), ((3, 5), (0.9, 0.1))]
    out = run1(toks, 6, 3, [0, 1, 2], "threshold", tau=0.3, evict="lru")
    assert kinds(out) == [[FETCH, SUB], [FETCH, HIT]]
    assert served(out) == [[5, 1], [3, 5]]
    assert res(out) == {1, 3, 5}
    assert out["mass"][0][0] == 0.2 and out["mass"][1][0] == 0.0


# --------------------------------------------------------------------------- CRF


def test_crf_decay_changes_victim():
    # E=6, k=2, C=3, R={0,1,2}, fetch_all, crf h=1 -> decay 0.5 (same arithmetic as
    # LFU gamma=.5 here since every selected expert is a hit).
    # t0 (0,1): c0=1 c1=1; t1 (0,1): c0=1.5 c1=1.5; t2 (2,1): c0=.75 c1=1.75 c2=1.
    # t3 (3,1): 1 HIT; FETCH 3, cand {0,2} c .75,1 -> evict 0. R={1,2,3}.
    # After t3: c0=.375 c1=1.875 c2=.5 c3=1.
    toks = [((0, 1), (0.5, 0.5)), ((0, 1), (0.5, 0.5)), ((2, 1), (0.5, 0.5)), ((3, 1), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "fetch_all", evict="crf", half_life=1)
    assert res(out) == {1, 2, 3}
    assert state(out)["crf"] == [0.375, 1.875, 0.5, 1.0, 0.0, 0.0]


def test_crf_counts_use_not_router_demand():
    # E=6, k=2, C=3, R={0,1,2}, threshold tau=.5.
    # t0 (1,4) w (.9,.1) rk (1,4,0,2,3,5): 1 HIT; 4 SUB -> served 0.
    #    crf: c1=1, c0=1 (substitute used). lfu: f1=1, f4=1 (router demand).
    # t1 (5,1) w (.6,.4): 1 HIT; FETCH 5, cand {0,2}:
    #    crf: c0=1, c2=0 -> evict 2. R={0,1,5}.   lfu: f0=0, f2=0 -> evict 0. R={1,2,5}.
    toks = [((1, 4), (0.9, 0.1), (1, 4, 0, 2, 3, 5)), ((5, 1), (0.6, 0.4))]
    crf = run1(toks, 6, 3, [0, 1, 2], "threshold", tau=0.5, evict="crf", half_life=4)
    lfu = run1(toks, 6, 3, [0, 1, 2], "threshold", tau=0.5, evict="lfu")
    assert kinds(crf) == kinds(lfu) == [[HIT, SUB], [FETCH, HIT]]
    assert res(crf) == {0, 1, 5}
    assert res(lfu) == {1, 2, 5}
    # crf h=4: after t0 c0=c1=1; after t1 c0=c1*? : c0=q, c1=q+1, c5=1 with q=2**-.25
    q = 2.0 ** (-1.0 / 4)
    assert state(crf)["crf"] == [q, q + 1.0, 0.0, 0.0, 0.0, 1.0]


# --------------------------------------------------------------------------- Belady


def test_belady_evicts_furthest_next_use():
    # E=6, k=2, C=3, R={0,1,2}, fetch_all, belady.
    # trace: t0 (3,0), t1 (1,3), t2 (2,0), t3 (3,5).
    # t0: 0 HIT; FETCH 3, cand {1,2}: next use of 1 = t1 (key -1), of 2 = t2 (key -2)
    #     -> evict 2 (furthest). R={0,1,3}.   (LFU would evict 1.)
    # t1: 1, 3 HIT.
    # t2: 0 HIT; FETCH 2, cand {1,3}: 1 never again (-inf), 3 at t3 (-3) -> evict 1. R={0,2,3}.
    # t3: 3 HIT; FETCH 5, cand {0,2}: both never (-inf, -inf) -> tie -> evict 0. R={2,3,5}.
    toks = [((3, 0), (0.5, 0.5)), ((1, 3), (0.5, 0.5)), ((2, 0), (0.5, 0.5)), ((3, 5), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "fetch_all", evict="belady")
    assert kinds(out) == [[FETCH, HIT], [HIT, HIT], [FETCH, HIT], [HIT, FETCH]]
    assert res(out) == {2, 3, 5}
    assert (cnt(out)["hits"], cnt(out)["fetches"]) == (5, 3)


def test_belady_next_use_ignores_invalid_cells():
    # E=6, k=2, C=3, R={0,1,2}.
    # t0 (3,0): 0 HIT; FETCH 3, cand {1,2}. t1 (1,4) is INVALID, so 1's next use is
    #    t3 (key -3); 2's next use is t2 (key -2) -> evict 1. R={0,2,3}.
    #    (Counting the invalid cell, 1 would be next used at t1 and 2 evicted.)
    # t2 (2,3): hits. t3 (1,0): 0 HIT; FETCH 1, cand {2,3} both never -> evict 2. R={0,1,3}.
    toks = [((3, 0), (0.5, 0.5)), ((1, 4), (0.5, 0.5)), ((2, 3), (0.5, 0.5)), ((1, 0), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "fetch_all", valid=[1, 0, 1, 1], evict="belady")
    assert kinds(out) == [[FETCH, HIT], None, [HIT, HIT], [FETCH, HIT]]
    assert res(out) == {0, 1, 3}


def test_belady_requires_fetch_all():
    with pytest.raises(ValueError):
        run1([((0, 1), (0.5, 0.5))], 6, 3, [0, 1, 2], "first_choice", evict="belady")


# --------------------------------------------------------------------------- miss rules

RK8 = (4, 5, 6, 2, 7, 0, 1, 3)


def test_threshold_fetches_first_and_heavy_substitutes_light():
    # E=8, k=3, C=4, R={0,1,2,3}, tau=.25, lfu (all f=0).
    # t0 (4,5,6) w (.5,.25,.125) rk (4,5,6,2,7,0,1,3):
    #   4: j=0 FETCH; cand {0,1,2,3} -> evict 0. R={1,2,3,4}.
    #   5: w=.25 >= tau FETCH; pinned {4}, cand {1,2,3} -> evict 1. R={2,3,4,5}.
    #   6: w=.125 < tau SUB: rk 4 used, 5 used, 6 not resident, 2 -> served 2.
    #   m = .125, a6 = .125.
    out = run1([((4, 5, 6), (0.5, 0.25, 0.125), RK8)], 8, 4, [0, 1, 2, 3], "threshold", tau=0.25)
    assert kinds(out) == [[FETCH, FETCH, SUB]]
    assert served(out) == [[4, 5, 2]]
    assert res(out) == {2, 3, 4, 5}
    c = cnt(out)
    assert (c["calls"], c["fetches"], c["substitutions"], c["substituted_mass"]) == (3, 2, 1, 0.125)
    assert state(out)["a"] == [0, 0, 0, 0, 0, 0, 0.125, 0]


def test_threshold_first_choice_fetched_even_below_tau():
    # E=6, k=2, C=3, R={0,1,2}, tau=.75. t0 (4,5) w (.5,.5):
    #   4: j=0 -> FETCH (although .5 < .75); cand {0,1,2} -> evict 0. R={1,2,4}.
    #   5: .5 < .75 -> SUB; default rk (4,5,0,1,2,3): 4 used, 5, 0 not resident, 1 -> served 1.
    out = run1([((4, 5), (0.5, 0.5))], 6, 3, [0, 1, 2], "threshold", tau=0.75)
    assert kinds(out) == [[FETCH, SUB]]
    assert served(out) == [[4, 1]]


def test_first_choice_substitutes_skip_used_experts():
    # E=8, k=3, C=4, R={0,1,2,3}. t0 (4,5,6) w (.5,.25,.125) rk (4,5,6,2,7,0,1,3):
    #   4: FETCH, cand {0,1,2,3} f=0 -> evict 0. R={1,2,3,4}.
    #   5: SUB: rk 4 (used by fetch), 5, 6 (not resident), 2 -> served 2.
    #   6: SUB: 4 used, 5, 6 no, 2 used (earlier substitute), 7, 0 not resident, 1 -> served 1.
    #   m = .25 + .125 = .375.
    out = run1([((4, 5, 6), (0.5, 0.25, 0.125), RK8)], 8, 4, [0, 1, 2, 3], "first_choice")
    assert kinds(out) == [[FETCH, SUB, SUB]]
    assert served(out) == [[4, 2, 1]]
    assert res(out) == {1, 2, 3, 4}
    assert out["mass"] == [[0.375]]
    assert state(out)["a"] == [0, 0, 0, 0, 0, 0.25, 0.125, 0]


def test_first_choice_equals_threshold_inf():
    rng = random.Random(7)
    E, k, C = 8, 3, 4
    toks = []
    for _ in range(40):
        perm = rng.sample(range(E), E)
        toks.append((perm[:k], sorted((rng.random() for _ in range(k)), reverse=True), perm))
    a = run1(toks, E, C, [0, 1, 2, 3], "first_choice", beta=0.6)
    b = run1(toks, E, C, [0, 1, 2, 3], "threshold", tau=math.inf, beta=0.6)
    assert a["kind"] == b["kind"] and a["served"] == b["served"]
    assert a["counters"] == b["counters"] and a["final_resident"] == b["final_resident"]


def test_substitute_all_substitutes_first_choice_and_skips_hits():
    # E=8, k=3, C=4, R={0,1,2,3}. t0 (4,1,5) w (.5,.375,.125) rk (4,1,5,6,3,7,0,2):
    #   1 HIT. 4 SUB: rk 4 no, 1 used (hit), 5, 6 no, 3 -> served 3.
    #   5 SUB: 4 no, 1 used, 5, 6 no, 3 used, 7 no, 0 -> served 0. No cache change.
    #   m = .5 + .125 = .625.
    toks = [((4, 1, 5), (0.5, 0.375, 0.125), (4, 1, 5, 6, 3, 7, 0, 2))]
    out = run1(toks, 8, 4, [0, 1, 2, 3], "substitute_all")
    assert kinds(out) == [[SUB, HIT, SUB]]
    assert served(out) == [[3, 1, 0]]
    assert res(out) == {0, 1, 2, 3}
    assert cnt(out)["substituted_mass"] == 0.625


def test_substitutes_come_after_all_fetches():
    # Non-monotone weights so a SUB (j=1) precedes a FETCH (j=2) in rank order.
    # E=8, k=3, C=4, R={0,1,2,3}, tau=.25. t0 (4,5,6) w (.5,.125,.375) rk (4,5,6,0,1,2,3,7):
    #   FETCH 4: evict 0 -> R={1,2,3,4}.  FETCH 6 (j=2): pinned {4}, cand {1,2,3} -> evict 1.
    #   R={2,3,4,6}. Then SUB 5: rk 4 used, 5 no, 6 used, 0, 1 not resident, 2 -> served 2.
    #   (Substituting inline before fetching 6 would have served 1.)
    toks = [((4, 5, 6), (0.5, 0.125, 0.375), (4, 5, 6, 0, 1, 2, 3, 7))]
    out = run1(toks, 8, 4, [0, 1, 2, 3], "threshold", tau=0.25)
    assert kinds(out) == [[FETCH, SUB, FETCH]]
    assert served(out) == [[4, 2, 6]]
    assert res(out) == {2, 3, 4, 6}


def test_drop_on_truncated_ranking():
    # E=6, k=2, C=2, R={0,1}, substitute_all, rk truncated to the top-k (M == k).
    # t0 (2,0) w (.75,.25) rk (2,0): 0 HIT; 2 SUB: rk 2 not resident, 0 used -> DROP.
    #   m = .75, a2 = .75, served -1.
    out = run1([((2, 0), (0.75, 0.25), (2, 0))], 6, 2, [0, 1], "substitute_all")
    assert kinds(out) == [[DROP, HIT]]
    assert served(out) == [[-1, 0]]
    c = cnt(out)
    assert (c["drops"], c["substitutions"], c["hits"], c["substituted_mass"]) == (1, 0, 1, 0.75)
    assert state(out)["a"][2] == 0.75
    # The full ranking (2,0,1,3,4,5) finds 1 instead.
    out = run1([((2, 0), (0.75, 0.25))], 6, 2, [0, 1], "substitute_all")
    assert kinds(out) == [[SUB, HIT]] and served(out) == [[1, 0]]


def test_drop_with_fewer_initial_residents_than_capacity():
    # E=6, k=2, C=2, R={0} (one free slot), substitute_all, full ranking (2,3,0,1,4,5).
    # 2 SUB -> served 0. 3 SUB: 2, 3 no, 0 used, 1, 4, 5 not resident -> DROP.
    out = run1([((2, 3), (0.5, 0.5), (2, 3, 0, 1, 4, 5))], 6, 2, [0], "substitute_all")
    assert kinds(out) == [[SUB, DROP]]
    assert served(out) == [[0, -1]]


def test_fetch_into_free_slot_evicts_nothing():
    # E=6, k=2, C=3, R={0}: t0 (1,2) both FETCH into the two free slots; t1 (3,0):
    # 0 HIT, FETCH 3: R full, cand {1,2} f 1,1 -> evict 1.
    toks = [((1, 2), (0.5, 0.5)), ((3, 0), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0], "fetch_all")
    assert kinds(out) == [[FETCH, FETCH], [FETCH, HIT]]
    assert res(out) == {0, 2, 3}


def test_cpu_rule_counters_and_no_cache_change():
    # E=6, k=2, C=3, R={0,1,2}, cpu, lru, beta=.1 (never triggers: cpu adds nothing to a).
    # t0 (3,0): HOST, HIT. t1 (4,5): HOST, HOST. t2 (1,2): HIT, HIT.
    # f counts every selection (router demand): all six experts 1.
    # LRU only sees device computes: last0=0, last1=last2=2, hosts stay -1.
    toks = [((3, 0), (0.5, 0.5)), ((4, 5), (0.5, 0.5)), ((1, 2), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "cpu", evict="lru", beta=0.1)
    assert kinds(out) == [[HOST, HIT], [HOST, HOST], [HIT, HIT]]
    assert served(out) == [[3, 0], [4, 5], [1, 2]]
    assert res(out) == {0, 1, 2}
    c = cnt(out)
    assert (c["calls"], c["hits"], c["host_computes"], c["fetches"]) == (6, 3, 3, 0)
    assert (c["substitutions"], c["drops"], c["admissions"], c["substituted_mass"]) == (
        0,
        0,
        0,
        0.0,
    )
    st = state(out)
    assert st["f"] == [1.0] * 6
    assert st["a"] == [0.0] * 6
    assert st["last"] == [0, 2, 2, -1, -1, -1]


def test_cpu_rule_crf_ignores_host_computes():
    # crf h=1: t0 (3,0): 0 HIT -> c0=1. t1 (3,1): 1 HIT -> c0=.5, c1=1. 3 never on device.
    toks = [((3, 0), (0.5, 0.5)), ((3, 1), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "cpu", evict="crf", half_life=1)
    assert state(out)["crf"] == [0.5, 1.0, 0.0, 0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- invalid cells


def test_invalid_cells_skipped_entirely():
    # E=6, k=2, C=3, R={0,1,2}, fetch_all, lfu gamma=.5.
    # t0 (0,1): f0=1 f1=1.  t1 INVALID (5,4): nothing happens, no decay.
    # t2 (3,0): 0 HIT; FETCH 3, cand {1,2} f 1,0 -> evict 2. f0=.5+1=1.5, f1=.5, f3=1.
    toks = [((0, 1), (0.5, 0.5)), ((5, 4), (0.5, 0.5)), ((3, 0), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "fetch_all", valid=[1, 0, 1], gamma=0.5)
    assert kinds(out) == [[HIT, HIT], None, [FETCH, HIT]]
    assert served(out) == [[0, 1], None, [3, 0]]
    assert out["mass"] == [[0.0], [None], [0.0]]
    assert res(out) == {0, 1, 3}
    assert cnt(out)["calls"] == 4
    assert state(out)["f"] == [1.5, 0.5, 0.0, 1.0, 0.0, 0.0]


def test_lru_uses_stream_index_across_invalid_cells():
    # t0 (0,1) hits; t1 invalid; t2 (2,0) hits -> last = [2, 0, 2, -1, ...].
    toks = [((0, 1), (0.5, 0.5)), ((3, 4), (0.5, 0.5)), ((2, 0), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "fetch_all", valid=[1, 0, 1], evict="lru")
    assert state(out)["last"] == [2, 0, 2, -1, -1, -1]


# --------------------------------------------------------------------------- admission


def test_admission_threshold_and_reset_when_queued():
    # E=6, k=2, C=3, R={0,1,2}, first_choice, lfu, beta=.5, d=1.
    # t0 (0,4) w (.75,.25) rk (0,4,1,2,3,5): 0 HIT; 4 SUB -> 1. a4=.25 < .5: not queued.
    # t1 (1,4) w (.625,.375) rk (1,4,0,2,3,5): 1 HIT; 4 SUB -> 0. a4=.625 >= .5:
    #    queued [4]@t1, a4 reset to 0. f: f0=1 f1=1 f4=2 f2=0.
    # before t2: admit 4: R full, keys f {0:1,1:1,2:0} -> evict 2. R={0,1,4}.
    # t2 (4,5) w (.5,.5) rk (4,5,0,1,2,3): 4 HIT; 5 SUB -> 0. a5=.5 >= .5 (equality)
    #    -> queued [5]@t2, a5=0; never applied (trace ends).
    toks = [
        ((0, 4), (0.75, 0.25), (0, 4, 1, 2, 3, 5)),
        ((1, 4), (0.625, 0.375), (1, 4, 0, 2, 3, 5)),
        ((4, 5), (0.5, 0.5), (4, 5, 0, 1, 2, 3)),
    ]
    out = run1(toks, 6, 3, [0, 1, 2], "first_choice", beta=0.5)
    assert kinds(out) == [[HIT, SUB], [HIT, SUB], [HIT, SUB]]
    assert served(out) == [[0, 1], [1, 0], [4, 0]]
    assert out["admission_log"][0] == [(2, 4, 2)]
    assert cnt(out)["admissions"] == 1
    assert res(out) == {0, 1, 4}
    assert state(out)["a"] == [0.0] * 6  # a4 reset (queued, admitted), a5 reset when queued

    # Stopping after t1: 4 is queued (a4 reset to 0) but never admitted.
    out = run1(toks[:2], 6, 3, [0, 1, 2], "first_choice", beta=0.5)
    assert state(out)["a"] == [0.0] * 6
    assert res(out) == {0, 1, 2} and cnt(out)["admissions"] == 0

    # beta=.75: nothing is queued at t1 (a4=.625), so at t2 4 is a j=0 miss -> FETCH
    # (cand {0,1,2} f 1,1,0 -> evict 2), which resets a4 to 0; 5 SUB -> 0, a5=.5 < .75.
    out = run1(toks, 6, 3, [0, 1, 2], "first_choice", beta=0.75)
    assert kinds(out)[2] == [FETCH, SUB]
    assert cnt(out)["admissions"] == 0
    assert res(out) == {0, 1, 4}
    assert state(out)["a"] == [0.0, 0.0, 0.0, 0.0, 0.0, 0.5]
    # Without t2, a4 keeps accumulating: .25 + .375.
    out = run1(toks[:2], 6, 3, [0, 1, 2], "first_choice", beta=0.75)
    assert state(out)["a"] == [0.0, 0.0, 0.0, 0.0, 0.625, 0.0]


def test_admission_queue_order_and_same_batch_protection():
    # E=8, k=3, C=4, R={0,1,2,3}, substitute_all, lru, beta=.25.
    # t0 (5,4,6) w (.5,.25,.25) rk (5,4,6,0,1,2,3,7): 5 -> 0, 4 -> 1, 6 -> 2 (all SUB).
    #    last0=last1=last2=0, last3=-1. a5=.5, a4=.25, a6=.25: queue by a desc, ties
    #    lower id: [5, 4, 6].
    # before t1: admit 5: R {0,1,2,3} last 0,0,0,-1 -> evict 3. R={0,1,2,5}.
    #    admit 4: 5 (last -1, the lowest) is protected (same batch); cand {0,1,2} -> evict 0.
    #    admit 6: 4, 5 protected; cand {1,2} -> evict 1. R={2,4,5,6}.
    # t1 (2,7,3) w (.5,.25,.25): 2 HIT; 7, 3 SUB: rk default (2,7,3,0,1,4,5,6):
    #    7 -> 4, 3 -> 5.
    toks = [
        ((5, 4, 6), (0.5, 0.25, 0.25), (5, 4, 6, 0, 1, 2, 3, 7)),
        ((2, 7, 3), (0.5, 0.25, 0.25)),
    ]
    out = run1(toks, 8, 4, [0, 1, 2, 3], "substitute_all", evict="lru", beta=0.25)
    assert out["admission_log"][0] == [(1, 5, 3), (1, 4, 0), (1, 6, 1)]
    assert kinds(out)[1] == [HIT, SUB, SUB]
    assert served(out)[1] == [2, 4, 5]
    # after t1: a7=.25, a3=.25 queued [3, 7]@t1 (never applied)
    assert res(out) == {2, 4, 5, 6}
    assert cnt(out)["admissions"] == 3


def test_admission_delay_one_vs_two():
    # E=6, k=2, C=3, R={0,1,2}, first_choice, lfu, beta=.5.
    # t0 (0,4) w (.5,.5) rk (0,4,1,2,3,5): 0 HIT; 4 SUB -> 1. a4=.5 -> queued [4]@t0.
    #    f0=f4=1.
    # d=1: before t1 admit 4: keys f {0:1,1:0,2:0} -> evict 1. R={0,2,4}.
    #   t1 (1,4) w (.75,.25): 4 HIT; 1 j=0 FETCH, cand {0,2} f 1,0 -> evict 2. R={0,1,4}.
    #   t2 (4,5) w (.75,.25) rk (4,5,0,1,2,3): 4 HIT; 5 SUB -> 0.
    # d=2: t1: 1 HIT; 4 SUB -> rk (1,4,0,2,3,5): 0. a4 = 0 + .25 (already queued: not re-queued).
    #   before t2 admit 4: f {0:1,1:1,2:0} -> evict 2. R={0,1,4}, a4 reset to 0.
    #   t2: 4 HIT; 5 SUB -> 0.
    toks = [
        ((0, 4), (0.5, 0.5), (0, 4, 1, 2, 3, 5)),
        ((1, 4), (0.75, 0.25), (1, 4, 0, 2, 3, 5)),
        ((4, 5), (0.75, 0.25), (4, 5, 0, 1, 2, 3)),
    ]
    d1 = run1(toks, 6, 3, [0, 1, 2], "first_choice", beta=0.5, admission_delay=1)
    d2 = run1(toks, 6, 3, [0, 1, 2], "first_choice", beta=0.5, admission_delay=2)
    assert kinds(d1) == [[HIT, SUB], [FETCH, HIT], [HIT, SUB]]
    assert kinds(d2) == [[HIT, SUB], [HIT, SUB], [HIT, SUB]]
    assert d1["admission_log"][0] == [(1, 4, 1)]
    assert d2["admission_log"][0] == [(2, 4, 2)]
    assert res(d1) == res(d2) == {0, 1, 4}
    assert state(d1)["a"] == state(d2)["a"] == [0.0, 0.0, 0.0, 0.0, 0.0, 0.25]


def test_admission_skipped_when_already_resident():
    # E=6, k=2, C=3, R={0,1,2}, threshold tau=.5, lfu, beta=.25, d=2.
    # t0 (0,4) w (.75,.25) rk (0,4,1,2,3,5): 0 HIT; 4 SUB -> 1. a4=.25 -> queued [4]@t0.
    # t1 (4,1) w (.75,.25): 1 HIT; 4 j=0 FETCH, cand {0,2} f 1,0 -> evict 2. R={0,1,4}.
    # before t2: batch [4]@t0 due (0+2 <= 2): 4 already resident -> skipped, nothing evicted.
    # t2 (0,1): hits.
    toks = [
        ((0, 4), (0.75, 0.25), (0, 4, 1, 2, 3, 5)),
        ((4, 1), (0.75, 0.25)),
        ((0, 1), (0.5, 0.5)),
    ]
    out = run1(toks, 6, 3, [0, 1, 2], "threshold", tau=0.5, beta=0.25, admission_delay=2)
    assert kinds(out) == [[HIT, SUB], [FETCH, HIT], [HIT, HIT]]
    assert cnt(out)["admissions"] == 0
    assert out["admission_log"][0] == []
    assert res(out) == {0, 1, 4}


def test_admission_due_batches_across_invalid_cell_oldest_first():
    # E=8, k=2, C=3, R={0,1,2}, substitute_all, lru, beta=.25, d=2.
    # t0 (3,0) w (.75,.25) rk (3,0,1,2,4,5,6,7): 0 HIT; 3 SUB -> 1. last0=last1=0.
    #    a3=.75 -> [3]@t0.
    # t1 (4,0) w (.75,.25) rk (4,0,1,2,3,5,6,7): 0 HIT; 4 SUB -> 1. last0=last1=1.
    #    a4=.75 -> [4]@t1.
    # t2 INVALID: nothing applied.
    # before t3: both batches due (0+2<=3, 1+2<=3), oldest first.
    #    [3]: R {0,1,2} last 1,1,-1 -> evict 2. R={0,1,3}.
    #    [4]: a different batch, so 3 (last -1) is not protected -> evict 3. R={0,1,4}.
    # t3 (0,1): hits.
    toks = [
        ((3, 0), (0.75, 0.25), (3, 0, 1, 2, 4, 5, 6, 7)),
        ((4, 0), (0.75, 0.25), (4, 0, 1, 2, 3, 5, 6, 7)),
        ((5, 6), (0.5, 0.5)),
        ((0, 1), (0.5, 0.5)),
    ]
    kw = dict(evict="lru", beta=0.25, admission_delay=2, valid=[1, 1, 0, 1])
    out = run1(toks, 8, 3, [0, 1, 2], "substitute_all", **kw)
    assert out["admission_log"][0] == [(3, 3, 2), (3, 4, 3)]
    assert res(out) == {0, 1, 4}
    assert kinds(out)[3] == [HIT, HIT]
    assert cnt(out)["calls"] == 6


def test_admission_delay_counts_stream_index_through_invalid_cells():
    # d=2, queued at t0, t1 invalid: applied right before t2 (0+2 <= 2), not t3.
    # E=6, k=2, C=3, R={0,1,2}, substitute_all, lfu, beta=.5.
    # t0 (3,0) w (.5,.5) rk (3,0,1,...): 0 HIT; 3 SUB -> 1. a3=.5 -> [3]@t0. f0=f3=1.
    # before t2: admit 3: f {0:1,1:0,2:0} -> evict 1. R={0,2,3}.
    # t2 (3,2): both HIT.
    toks = [((3, 0), (0.5, 0.5), (3, 0, 1, 2, 4, 5)), ((4, 5), (0.5, 0.5)), ((3, 2), (0.5, 0.5))]
    out = run1(
        toks, 6, 3, [0, 1, 2], "substitute_all", beta=0.5, admission_delay=2, valid=[1, 0, 1]
    )
    assert out["admission_log"][0] == [(2, 3, 1)]
    assert kinds(out)[2] == [HIT, HIT]


def test_admission_uses_free_slot():
    # E=6, k=2, C=3, R={0,1} (one free slot), substitute_all, beta=.5.
    # t0 (2,0) w (.5,.5) rk (2,0,1,3,4,5): 2 SUB -> 1. a2=.5 -> [2]@t0.
    # before t1: R has 2 < 3 residents -> 2 takes the free slot, no eviction.
    toks = [((2, 0), (0.5, 0.5), (2, 0, 1, 3, 4, 5)), ((2, 1), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1], "substitute_all", beta=0.5)
    assert out["admission_log"][0] == [(1, 2, -1)]
    assert kinds(out) == [[SUB, HIT], [HIT, HIT]]
    assert res(out) == {0, 1, 2}


# --------------------------------------------------------------------------- layers, inputs


def test_layers_are_independent_with_own_capacities():
    # E=6, k=2, L=2, capacities [2,3], fetch_all, lfu. Same selections on both layers.
    # layer 0, C=2, R={0,1}: t0 (2,0): 0 HIT; FETCH 2, cand {1} -> evict 1. R={0,2}.
    #                        t1 (1,2): 2 HIT; FETCH 1, cand {0} -> evict 0. R={1,2}.
    # layer 1, C=3, R={0,1,2}: t0 (2,0) hits; t1 (1,2) hits.
    # t2: layer 0 invalid, layer 1 (3,4): FETCH 3 cand {0,1,2} f 1,1,2 -> evict 0;
    #     FETCH 4 pinned {3}, cand {1,2} f 1,2 -> evict 1. R={2,3,4}.
    ids = [[[2, 0], [2, 0]], [[1, 2], [1, 2]], [[3, 4], [3, 4]]]
    ws = [[[0.5, 0.5]] * 2] * 3
    rks = [[list(sel) + [e for e in range(6) if e not in sel] for sel in row] for row in ids]
    valid = [[True, True], [True, True], [False, True]]
    out = reference_replay(ids, ws, rks, valid, 6, [2, 3], [[0, 1], [0, 1, 2]], "fetch_all")
    assert out["kind"][0] == [[FETCH, HIT], [HIT, HIT]]
    assert out["kind"][1] == [[FETCH, HIT], [HIT, HIT]]
    assert out["kind"][2] == [None, [FETCH, FETCH]]
    assert out["final_resident"] == [{1, 2}, {2, 3, 4}]
    assert [c["calls"] for c in out["counters"]] == [4, 6]
    assert [c["fetches"] for c in out["counters"]] == [2, 2]


def test_numpy_float32_inputs_are_exact():
    # w = float32(0.1): the reference uses its exact float64 value, not 0.1.
    w32 = np.array([[[0.9, 0.1]]], dtype=np.float32)
    ids = np.array([[[3, 4]]], dtype=np.int32)
    rk = np.array([[[3, 4, 0, 1, 2, 5]]], dtype=np.int32)
    valid = np.ones((1, 1), dtype=bool)
    out = reference_replay(ids, w32, rk, valid, 6, np.array([3]), [[0, 1, 2]], "substitute_all")
    assert out["kind"] == [[[SUB, SUB]]]
    assert out["served"] == [[[0, 1]]]
    assert out["mass"][0][0] == float(np.float32(0.9)) + float(np.float32(0.1))
    # threshold compares the float32 weight exactly: float32(0.1) > 0.1
    out = reference_replay(ids, w32, rk, valid, 6, [3], [[0, 1, 2]], "threshold", tau=0.1)
    assert out["kind"] == [[[FETCH, FETCH]]]


@pytest.mark.parametrize("cap", [1, 6, 7])
def test_capacity_outside_range_is_a_configuration_error(cap):
    with pytest.raises(ValueError):
        run1([((0, 1), (0.5, 0.5))], 6, cap, [0], "fetch_all")


def test_ranking_must_start_with_topk():
    with pytest.raises(ValueError):
        run1([((0, 1), (0.5, 0.5), (1, 0, 2, 3, 4, 5))], 6, 3, [0], "fetch_all")


# --------------------------------------------------------------------------- warm residency


def test_warm_residency_ties_lower_id_and_valid_only():
    # layer 0 (C=2): (0,1), (1,2), (2,3), (3,4), invalid (3,5).
    #   counts 0:1 1:2 2:2 3:2 4:1 -> top-2 by count, ties lower id: [1, 2].
    #   (counting the invalid cell 3 would lead with 3 and give [3, 1].)
    # layer 1 (C=3): (5,4), (4,3), (3,5), (0,1) all valid -> 3,4,5 at 2 each: [3, 4, 5].
    calib = [
        [[0, 1], [5, 4]],
        [[1, 2], [4, 3]],
        [[2, 3], [3, 5]],
        [[3, 4], [0, 1]],
        [[3, 5], [0, 2]],
    ]
    valid = [[True, True]] * 4 + [[False, False]]
    assert warm_residency_reference(calib, valid, 6, [2, 3]) == [[1, 2], [3, 4, 5]]
    # all experts tied at 0 -> lowest ids
    assert warm_residency_reference(calib, [[False, False]] * 5, 6, [2, 3]) == [[0, 1], [0, 1, 2]]


# --------------------------------------------------------------------------- invariants


COMBOS = [
    (rule, evict)
    for rule in ("fetch_all", "threshold", "first_choice", "substitute_all", "cpu")
    for evict in ("lfu", "lru", "crf", "belady")
    if evict != "belady" or rule == "fetch_all"
]


@pytest.mark.parametrize(("rule", "evict"), COMBOS)
def test_invariants_on_random_traces(rule, evict):
    """Not hand-worked: structural invariants of the spec on small random traces."""
    rng = random.Random(f"{rule}-{evict}")
    E, k, L, T = 8, 3, 2, 30
    caps = [3, 5]
    ids, ws, rks, valid = [], [], [], []
    for _ in range(T):
        perms = [rng.sample(range(E), E) for _ in range(L)]
        M = rng.choice([k, 5, E])
        ids.append([p[:k] for p in perms])
        ws.append([sorted((rng.random() for _ in range(k)), reverse=True) for _ in range(L)])
        rks.append([p[:M] for p in perms])
        valid.append([rng.random() > 0.1 for _ in range(L)])
    init = [[0, 1], [0, 1, 2, 3, 4]]
    out = reference_replay(
        ids,
        ws,
        rks,
        valid,
        E,
        caps,
        init,
        rule,
        tau=0.3,
        beta=0.4,
        evict=evict,
        gamma=0.9,
        half_life=3,
        admission_delay=2,
    )
    for layer in range(L):
        c = out["counters"][layer]
        n_valid = sum(valid[t][layer] for t in range(T))
        assert c["calls"] == k * n_valid
        parts = ("hits", "fetches", "substitutions", "drops", "host_computes")
        assert sum(c[p] for p in parts) == c["calls"]
        assert len(out["final_resident"][layer]) <= caps[layer]
        total = 0.0
        for t in range(T):
            kd, sv = out["kind"][t][layer], out["served"][t][layer]
            if not valid[t][layer]:
                assert kd is None and sv is None
                continue
            sel = ids[t][layer]
            used = [s for s in sv if s != -1]
            assert len(set(used)) == len(used)  # no expert computes two slots on device
            for j in range(k):
                if kd[j] in (HIT, FETCH, HOST):
                    assert sv[j] == sel[j]
                elif kd[j] == SUB:
                    assert sv[j] not in sel and sv[j] in rks[t][layer]
                else:
                    assert kd[j] == DROP and sv[j] == -1
            total += out["mass"][t][layer]
        assert total == pytest.approx(c["substituted_mass"])
        if rule == "fetch_all":
            assert c["substitutions"] == c["drops"] == c["admissions"] == 0
        if rule == "cpu":
            assert out["final_resident"][layer] == set(init[layer])
            assert c["fetches"] == c["substitutions"] == c["admissions"] == 0


# --------------------------------------------------------------------------- additions: band, fallbacks, prefetch


def run_layers(layers, E, caps, inits, rule, valid=None, lookahead=None, **kw):
    """Several layers. ``layers[l]``: list over tokens of (sel, weights); default rankings as in run1.
    ``valid[l]``: per-token flags of layer l; ``lookahead[l]``: per-token lists on layer l's rows."""
    T, L = len(layers[0]), len(layers)
    ids = [[list(layers[l_][t][0]) for l_ in range(L)] for t in range(T)]
    ws = [[list(layers[l_][t][1]) for l_ in range(L)] for t in range(T)]
    rks = [[row + [e for e in range(E) if e not in row] for row in ids[t]] for t in range(T)]
    v = [[True] * L for _ in range(T)] if valid is None else [[bool(valid[l_][t]) for l_ in range(L)] for t in range(T)]
    look = None if lookahead is None else [[list(lookahead[l_][t]) for l_ in range(L)] for t in range(T)]
    return reference_replay(ids, ws, rks, v, E, caps, inits, rule, lookahead=look, **kw)


def test_band_fetches_first_choice_light_and_heavy_misses():
    # E=10, k=4, C=5, R={0,1,2,3,8}, band(.2, .4), lfu (all f=0).
    # t0 (4,5,6,7) w (.3,.25,.05,.4): 4 j=0 FETCH (first choice, although .2 <= .3 < .4);
    #   5 .25 in [.2,.4) -> not fetched -> fallback SUB; 6 .05 < .2 -> FETCH; 7 .4 >= .4 -> FETCH.
    #   FETCH 4: evict 0 (ties lower id) -> R={1,2,3,4,8}; FETCH 6: pinned {4} -> evict 1;
    #   FETCH 7: pinned {4,6} -> evict 2. R={3,4,6,7,8}.
    #   SUB 5: rk 4,5,6,7 used/not resident, 0,1,2 gone, 3 -> served 3. m = .25, a5 = .25.
    toks = [((4, 5, 6, 7), (0.3, 0.25, 0.05, 0.4))]
    out = run1(toks, 10, 5, [0, 1, 2, 3, 8], "band", tau=0.2, tau_high=0.4)
    assert kinds(out) == [[FETCH, SUB, FETCH, FETCH]]
    assert served(out) == [[4, 3, 6, 7]]
    assert res(out) == {3, 4, 6, 7, 8}
    assert (cnt(out)["fetches"], cnt(out)["substitutions"], cnt(out)["substituted_mass"]) == (3, 1, 0.25)
    assert state(out)["a"][5] == 0.25
    with pytest.raises(ValueError, match="tau_high"):
        run1(toks, 10, 5, [0, 1, 2, 3, 8], "band", tau=0.2, tau_high=0.2)


def test_fallback_drop_counts_mass_and_feeds_admission():
    # E=6, k=2, C=3, R={0,1,2}, threshold(.3) + drop, beta .2.
    # t0 (3,4) w (.6,.25): FETCH 3 (evict 0, ties lower id) -> R={1,2,3}; 4 below tau -> DROP although
    #   a substitute (1) is resident. m = .25, a4 = .25 >= .2 -> queued (due t1), a4 = 0.
    # t1: admit 4: victims {1,2,3} f 0,0,1 -> evict 1. R={2,3,4}. (1,2) w (.5,.5): 2 HIT;
    #   1 j=0 FETCH: pinned {2}, cand {3,4} f 1,1 -> evict 3. R={1,2,4}.
    toks = [((3, 4), (0.6, 0.25)), ((1, 2), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "threshold", tau=0.3, fallback="drop", beta=0.2)
    assert kinds(out) == [[FETCH, DROP], [FETCH, HIT]]
    assert served(out) == [[3, -1], [1, 2]]
    c = cnt(out)
    assert (c["drops"], c["substitutions"], c["fetches"], c["admissions"], c["substituted_mass"]) == (1, 0, 2, 1, 0.25)
    assert out["admission_log"][0] == [(1, 4, 1)]
    assert res(out) == {1, 2, 4}


def test_fallback_host_is_exact_and_adds_nothing_to_a():
    # E=6, k=2, C=3, R={0,1,2}, threshold(.3) + host, beta .1 (would trigger if a grew).
    # t0 (3,4) w (.6,.25): FETCH 3 (evict 0) -> R={1,2,3}; 4 HOST (served 4, no cache change, a4 stays 0).
    # t1 (4,3) w (.5,.5): 3 HIT; 4 j=0 FETCH: pinned {3}, cand {1,2} f 0,0 -> evict 1. R={2,3,4}.
    toks = [((3, 4), (0.6, 0.25)), ((4, 3), (0.5, 0.5))]
    out = run1(toks, 6, 3, [0, 1, 2], "threshold", tau=0.3, fallback="host", beta=0.1)
    assert kinds(out) == [[FETCH, HOST], [FETCH, HIT]]
    assert served(out) == [[3, 4], [4, 3]]
    c = cnt(out)
    assert (c["host_computes"], c["admissions"], c["substituted_mass"], c["drops"]) == (1, 0, 0.0, 0)
    assert state(out)["a"] == [0.0] * 6
    assert res(out) == {2, 3, 4}


def test_fallback_lowbit_mass_admission_and_lru_untouched():
    # E=6, k=2, C=3, R={0,1,2}, first_choice + lowbit, lru, beta .3.
    # t0 (3,4) w (.7,.3): FETCH 3 (lru all -1 -> evict 0) -> R={1,2,3}; 4 LOWBIT (served 4, no slot).
    #   lowbit_mass .3, a4 = .3 >= .3 -> queued (due t1), a4 = 0. last3 = 0; last4 stays -1 (lowbit is
    #   not a full-precision compute).
    # t1: admit 4: victims {1,2,3} last -1,-1,0 -> evict 1. R={2,3,4}. (4,5) w (.6,.4): 4 HIT (last4=1);
    #   5 LOWBIT; lowbit_mass .7; a5 = .4 -> queued at t1 (never applied: the trace ends).
    toks = [((3, 4), (0.7, 0.3)), ((4, 5), (0.6, 0.4))]
    out = run1(toks, 6, 3, [0, 1, 2], "first_choice", fallback="lowbit", evict="lru", beta=0.3)
    assert kinds(out) == [[FETCH, LOWBIT], [HIT, LOWBIT]]
    assert served(out) == [[3, 4], [4, 5]]
    c = cnt(out)
    assert (c["lowbit_computes"], c["admissions"], c["substitutions"], c["drops"]) == (2, 1, 0, 0)
    assert c["lowbit_mass"] == pytest.approx(0.7, abs=1e-15) and c["substituted_mass"] == 0.0
    assert out["mass"] == [[0.0], [0.0]]
    assert state(out)["last"] == [-1, -1, -1, 0, 1, -1]
    assert res(out) == {2, 3, 4}


def test_prefetch_oracle_loads_the_next_selection():
    # Two layers, E=6, k=2, C=3, fetch_all, lfu, prefetch oracle (n = k). Layer 0 always hits (0,1).
    # Layer 1, R={0,1,2}:
    # t0 P = (3,4): load 3: protected {3,4}, victims {0,1,2} f 0 -> evict 0; load 4: evict 1. R={2,3,4}.
    #   (3,4) both HIT: no sync fetch. prefetches 2, used 2. f3 = f4 = 1.
    # t1 P = (0,3): load 0: protected {0,3}, victims {2,4} f 0,1 -> evict 2. R={0,3,4}. (0,3) HIT HIT.
    # t2 layer 0 invalid -> no list for layer 1. (5,0): 0 HIT; FETCH 5: cand {3,4} f 2,1 -> evict 4.
    layer0 = [((0, 1), (0.5, 0.5))] * 3
    layer1 = [((3, 4), (0.5, 0.5)), ((0, 3), (0.5, 0.5)), ((5, 0), (0.5, 0.5))]
    out = run_layers([layer0, layer1], 6, [3, 3], [[0, 1, 2], [0, 1, 2]], "fetch_all",
                     valid=[[1, 1, 0], [1, 1, 1]], prefetch="oracle")
    assert [out["kind"][t][1] for t in range(3)] == [[HIT, HIT], [HIT, HIT], [FETCH, HIT]]
    c0, c1 = out["counters"]
    assert (c0["prefetches"], c0["prefetch_used"]) == (0, 0)  # layer 0 gets no prefetch
    assert (c1["prefetches"], c1["prefetch_used"], c1["fetches"]) == (3, 3, 1)
    assert out["final_resident"][1] == {0, 3, 5}
    # prefetch_n = 1: only the first entry of each selection is loaded
    out = run_layers([layer0, layer1], 6, [3, 3], [[0, 1, 2], [0, 1, 2]], "fetch_all",
                     valid=[[1, 1, 0], [1, 1, 1]], prefetch="oracle", prefetch_n=1)
    assert out["counters"][1]["prefetches"] == 2  # expert 3 at t0, expert 0 at t1


def test_prefetch_lookahead_protects_same_token_admissions_and_skips():
    # Two layers, E=6, k=1, C=2, substitute_all, beta .5, lfu, lookahead P of width 2 (prefetch_n 2).
    # Layer 0 always hits (0). Layer 1, R={0,1}:
    # t0 P=[0,1] (both resident: nothing). (2) w .6: SUB -> served 0. a2 = .6 -> queued (due t1). f2 = 1.
    # t1 admit 2: victims {0,1} f 0,0 -> evict 0. R={1,2}. P=[3,1]: protected {3,1} and {2} (admitted
    #   at this token): no victim left -> the load of 3 is skipped. (1): HIT. f1 = 1.
    # t2 P=[3,4]: load 3: victims {1,2} f 1,1 -> evict 1; load 4: protected {3,4}: evict 2. R={3,4}.
    #   (3): HIT. prefetches 2, used 1. No f, a or lru change from the loads: f4 stays 0.
    layer0 = [((0,), (1.0,))] * 3
    layer1 = [((2,), (0.6,)), ((1,), (1.0,)), ((3,), (1.0,))]
    look0 = [[0, 1], [3, 1], [3, 4]]
    out = run_layers([layer0, layer1], 6, [2, 2], [[0, 1], [0, 1]], "substitute_all", beta=0.5,
                     prefetch="lookahead", prefetch_n=2, lookahead=[look0, [[0, 1]] * 3])
    assert [out["kind"][t][1] for t in range(3)] == [[SUB], [HIT], [HIT]]
    c1 = out["counters"][1]
    assert (c1["admissions"], c1["prefetches"], c1["prefetch_used"]) == (1, 2, 1)
    assert out["final_resident"][1] == {3, 4}
    assert out["final_state"][1]["f"] == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="prefetch_n"):
        run_layers([layer0, layer1], 6, [2, 2], [[0, 1], [0, 1]], "substitute_all", prefetch="lookahead",
                   prefetch_n=3, lookahead=[look0, [[0, 1]] * 3])


def lookahead_requeue_case():
    """Layer 1 of this case: an expert made resident by a prefetch keeps its a (>= beta); once evicted
    it is queued again after that token (step 6: every expert ... not resident, not queued, a >= beta)."""
    layer0 = [((0,), (1.0,))] * 8
    layer1 = [((2,), (0.6,)), ((2,), (0.6,)), ((3,), (0.1,)), ((4,), (0.1,))] + [((0,), (0.5,))] * 4
    look0 = [[0], [0], [2], [0], [3], [0], [0], [0]]
    kw = dict(E=5, caps=[2, 2], inits=[[0, 1], [0, 1]], rule="substitute_all", beta=0.5, admission_delay=3,
              evict="lru", prefetch="lookahead", prefetch_n=1, lookahead=[look0, [[0]] * 8])
    return [layer0, layer1], kw


def test_prefetched_expert_keeps_a_and_is_requeued_after_eviction():
    # Layer 1, E=5, k=1, C=2, R={0,1}, substitute_all, beta .5, d = 3, lru, lookahead n = 1.
    # t0 (2) .6: SUB -> 0; a2 = .6 -> queued at t0 (due t3), a2 = 0. last0 = 0.
    # t1 (2) .6: SUB -> 0; a2 = .6 (already queued: not queued again). last0 = 1.
    # t2 P=[2]: victims {0,1} last 1,-1 -> evict 1; 2 resident, a2 stays .6. (3) .1: SUB -> 0. last0 = 2.
    # t3 admission of 2 skipped (resident). (4) .1: SUB -> 0. last0 = 3.
    # t4 P=[3]: victims {0,2} last 3,-1 -> evict 2. (0): HIT. After t4: 2 is not resident, not queued,
    #   a2 = .6 >= .5 -> queued at t4 (due t7).
    # t7 admit 2: victims {0,3} last 6,-1 -> evict 3. R={0,2}.
    layers, kw = lookahead_requeue_case()
    out = run_layers(layers, **kw)
    c1 = out["counters"][1]
    assert (c1["substitutions"], c1["prefetches"], c1["prefetch_used"], c1["admissions"]) == (4, 2, 0, 1)
    assert out["admission_log"][1] == [(7, 2, 3)]
    assert out["final_resident"][1] == {0, 2}


def test_fetch_cap_hand_case():
    """Additions (2), fetch cap: of the misses the rule fetches, the first fetch_cap in rank order are
    fetched, the others get the fallback exactly as if the rule had not fetched them."""
    # E = 8, C = 4, resident {0, 1, 2, 3}; token selects 4, 5, 6 (all misses), ranking 4 5 6 0 1 ...
    toks = [([4, 5, 6], [0.5, 0.3, 0.2])]
    capped = run1(toks, 8, 4, [0, 1, 2, 3], "fetch_all", fetch_cap=1)
    assert kinds(capped) == [[FETCH, SUB, SUB]]
    # the fetch of 4 evicts 0 (all f = 0: lower id); the substitutes are the next resident ranking entries
    assert capped["served"][0][0][1:] == [1, 2]
    assert run1(toks, 8, 4, [0, 1, 2, 3], "fetch_all", fetch_cap=2, fallback="drop")["kind"][0][0] == [FETCH, FETCH, DROP]
    assert kinds(run1(toks, 8, 4, [0, 1, 2, 3], "fetch_all", fetch_cap=3)) == [[FETCH, FETCH, FETCH]]
    # threshold: the light miss is not fetched by the rule and does not use up the cap
    assert run1(toks, 8, 4, [0, 1, 2, 3], "threshold", tau=0.25, fetch_cap=1, fallback="host")["kind"][0][0] == \
        [FETCH, HOST, HOST]


def test_fetch_cap_kernel_hand_case():
    from runtime.core.kernel import FETCH as K_FETCH
    from runtime.core.kernel import SUB as K_SUB
    from runtime.core.kernel import PolicyCache
    from runtime.core.policy import PolicyConfig

    cache = PolicyCache(PolicyConfig(rule="fetch_all", fetch_cap=1), 8, 3, np.array([4]), [np.arange(4)])
    r = cache.step(0, np.array([[4, 5, 6]]), np.array([[0.5, 0.3, 0.2]]), np.array([[4, 5, 6, 0, 1, 2, 3, 7]]))
    assert r.kind[0].tolist() == [K_FETCH, K_SUB, K_SUB]
    assert cache.counter_totals()["fetches"] == 1 and cache.counter_totals()["substitutions"] == 2


def test_lfuda_hand_case():
    """Additions (2), lfuda, worked by hand. E=8, k=2, C=4, R={0,1,2,3}, pin_fraction 0.5 -> P=2: {0, 1} pinned.
    t0 (4,5): fetch 4: victims {2,3} K 0,0 -> 2 (lower id); A = max(0, K2=0) = 0, c2 = 0; K4 = A + c4 = 0.
              fetch 5: victim 3 (2's slot now holds the pinned-for-the-token 4); K5 = 0.
              bookkeeping: c4 = c5 = 1, K4 = K5 = 0 + 1 = 1.
    t1 (6,7): fetch 6: victims {4,5} K 1,1 -> 4; A = 1, c4 = floor(1/2) = 0; K6 = 1 + 0 = 1.
              fetch 7: victim 5; A = 1, c5 = 0; K7 = 1. bookkeeping: c6 = c7 = 1, K6 = K7 = 2.
    t2 (0,4): 0 HIT (pinned); fetch 4: victims {6,7} K 2,2 -> 6; A = 2, c6 = 0; K4 = 2 + c4 (0) = 2.
              bookkeeping: c0 = 1, K0 = 3; c4 = 1, K4 = 3."""
    toks = [([4, 5], [0.5, 0.5]), ([6, 7], [0.5, 0.5]), ([0, 4], [0.5, 0.5])]
    out = run1(toks, 8, 4, [0, 1, 2, 3], "fetch_all", evict="lfuda", pin_fraction=0.5)
    assert kinds(out) == [[FETCH, FETCH], [FETCH, FETCH], [HIT, FETCH]]
    assert res(out) == {0, 1, 4, 7}
    st = state(out)
    assert st["A"] == 2 and st["K"] == [3, 0, 0, 0, 3, 1, 2, 2] and st["c"] == [1, 0, 0, 0, 1, 0, 0, 1]
    # the same without pinning: t0's fetches evict 0 and 1 (lower ids), t1's evict 2 and 3 (K 0 < K4 = K5 = 1),
    # so at t2 expert 0 is a miss and 4 a hit
    assert kinds(run1(toks, 8, 4, [0, 1, 2, 3], "fetch_all", evict="lfuda"))[2] == [FETCH, HIT]


def test_lfuda_kernel_hand_case():
    from runtime.core.kernel import PolicyCache
    from runtime.core.policy import PolicyConfig

    cache = PolicyCache(PolicyConfig(evict="lfuda", pin_fraction=0.5), 8, 2, np.array([4]), [np.arange(4)])
    r = cache.step(0, np.array([[4, 5], [6, 7], [0, 4]]), np.full((3, 2), 0.5))
    assert r.kind.tolist() == [[1, 1], [1, 1], [0, 1]]
    assert cache.key[0].tolist() == [3, 0, 0, 0, 3, 1, 2, 2] and int(cache.qstate[0, 4]) == 2
    assert cache.per_layer()[0]["pinned"] == 2 and set(cache.resident(0).tolist()) == {0, 1, 4, 7}


def test_pinned_hot_set_errors():
    with pytest.raises(ValueError, match="C - P = 1 < k = 2"):
        run1([([4, 5], [0.5, 0.5])], 8, 3, [0, 1, 2], "fetch_all", pin_fraction=0.67)  # P = 2 of C = 3
    with pytest.raises(ValueError, match="cold start"):
        run1([([4, 5], [0.5, 0.5])], 8, 4, [], "fetch_all", pin_fraction=0.25)


def test_calibrated_capacities_hand_case():
    """L=2, E=6, k=2, uniform C=3 (S=6). Calibration counts: layer 0 [5,5,0,0,0,0] (10 calls), layer 1
    [3,3,2,2,0,0] (10 calls). Start (2,2); the 2 spare slots: next experts have shares layer 0: 0/10,
    layer 1: 2/10 -> layer 1 (C=3); then layer 1's next is 2/10 again -> layer 1 (C=4). Result (2, 4)."""
    from tests.reference import calibrated_capacities_reference

    calib = [[[0, 1], [0, 1]]] * 3 + [[[0, 1], [2, 3]]] * 2
    assert calibrated_capacities_reference(calib, [[True, True]] * 5, 6, [3, 3], 2) == [2, 4]
    from runtime.core.kernel import calibrated_capacities, calibration_counts

    assert calibrated_capacities(calibration_counts(np.array(calib), None, 6), np.array([3, 3]), 2).tolist() == [2, 4]
