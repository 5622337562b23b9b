"""The policy kernel's per-token decisions, steps 0c-5 of docs/policies.md, each a stage of run_layer
(run_layer.py's map): `route_token` (0c, cache-aware routing), `hits` (1), `miss_rule` (2-3 and the fallbacks
other than substitute), `substitutes` (4), `touch_token` (5: the eviction kind's touch, evict.py).

Every stage is `inline="always"` (numba inlines it into run_layer as its own code) and takes the arrays it
uses by name (run_layer's borrowed views: no reference counts), or slots.py's `SlotTable` where it claims;
`setup` is run_layer.py's `Setup`. The arrays are LayerState's, Tokens' and Outputs' fields and run_layer's
work arrays (run_layer.py `Scratch`) of the same names; i the token's input row, oi its output row (i, or the
one scratch row). Shapes: ids, weights, next_use [T, k]; rank [T, M]; score [T, E] (or [0, 0]); kind, served, slot
[T or 1, k]; the per-token work arrays [k].
"""

from __future__ import annotations

import numpy as np
from numba import njit

from runtime.core.kernel import evict as ek
from runtime.core.kernel.evict import IMAX
from runtime.core.kernel.plan import (
    C_REROUTES,
    DROP,
    FETCH,
    HIT,
    HOST,
    LOWBIT,
    M_REROUTE,
    MISS,
    SUB,
)
from runtime.core.kernel.primitives import (
    F_DROP,
    F_HOST,
    F_LOWBIT,
    F_SUBSTITUTE,
    RT_PRIOR,
    T_BELADY,
    T_CRF,
    T_LFU,
    T_LFUDA,
    T_LRU,
    T_S3FIFO,
    _fetches,
    _index,
)
from runtime.core.kernel.route import _prior_select, _routed_weights, _same_set, _window_select
from runtime.core.kernel.search import best_resident
from runtime.core.kernel.slots import claim


@njit(cache=True, inline="always")
def route_token(setup, ids, weights, score, rank, expert_slot, acc, route_d, mass, routed, routed_weights, candidates,
                counters, i, n_cand):
    """Step 0c (docs/policies.md, Additions (4)): cache-aware routing on the residency left by steps 0-0b.
    Cache-Prior updates D (the running mean of the valid tokens' logit ranges, this one included) and selects
    by the biased logits; CACHE_ROUTE by the true ranking's window. A routed set that is the model's keeps the
    model's order and weights; otherwise ids[i] and weights[i] are rewritten (the caller's copies), the replacements
    counted as reroutes (resident by construction: never a hit) and the displaced experts' weights as the
    rerouted mass, each joining its accumulator as an admission candidate. Returns (n_cand, n_rerouted)."""
    k = setup.top_k
    selection = ids[i]  # [k]
    if setup.route_family == RT_PRIOR:
        z = score[i]  # [E]
        z_low = z[0]
        z_high = z[0]
        for e in range(1, setup.num_experts):
            if z[e] < z_low:
                z_low = z[e]
            if z[e] > z_high:
                z_high = z[e]
        route_d[0] += z_high - z_low
        route_d[1] += 1.0
        _prior_select(z, selection, k, setup.route_keep, setup.route_lambda * (route_d[0] / route_d[1]), expert_slot,
                      routed)
    else:
        z = score[i] if setup.score_mode else weights[i]  # (unused by cache-route's weights)
        rank_row = rank[i]  # [M]
        _window_select(rank_row, k, setup.route_keep, setup.route_window, expert_slot, routed)
    if _same_set(selection, routed, k):
        return n_cand, 0
    token_weights = weights[i]  # [k]
    _routed_weights(setup.route_family, z, setup.route_norm, selection, token_weights, routed, k, setup.route_alpha,
                    routed_weights)
    n_rerouted = 0
    moved = 0.0
    for j in range(k):  # the displaced experts, in rank order
        if _index(routed, k, selection[j]) < 0:
            n_rerouted += 1
            moved += weights[i, j]
            acc[selection[j]] += weights[i, j]  # (as `candidate` does for a miss not fetched)
            candidates[n_cand] = selection[j]
            n_cand += 1
    counters[C_REROUTES] += n_rerouted
    mass[M_REROUTE] += moved
    for q in range(k):
        ids[i, q] = routed[q]
        weights[i, q] = routed_weights[q]
    return n_cand, n_rerouted


@njit(cache=True, inline="always")
def hits(setup, ids, expert_slot, key, skey, pin, kind, served, slot, misses, pinned_slots, i, oi, stamp):
    """Step 1: hits (pinned for the token: skey = IMAX on the integer-key paths, pin = the token's stamp
    otherwise; lfu with gamma 1 gives a hit its new key at once and protects the hits only if the token
    fetches, step 3); the misses are listed in `misses` in rank order, with served = the missed expert and
    slot = -1 until decided. Returns (n_miss, n_pinned slots in pinned_slots)."""
    n_miss = 0
    n_pinned = 0
    if setup.lfu_int:  # a hit's slot key moves up by one key step (skey holds every resident's composite key)
        if setup.output_rows:  # the per-slot outputs (without decisions nothing reads them under lfu)
            for j in range(setup.top_k):
                e = ids[i, j]
                s = expert_slot[e]
                served[oi, j] = e
                slot[oi, j] = s
                kind[oi, j] = HIT if s >= 0 else MISS
        for j in range(setup.top_k):
            e = ids[i, j]
            s = expert_slot[np.uint32(e)]  # (unsigned indices: no wraparound code in the hot loop)
            key[np.uint32(e)] += 1.0  # f[e] += 1, hit or miss (a fetch's victim is chosen by slot keys)
            if s >= 0:
                skey[np.uint32(s)] += setup.key_step
                pinned_slots[np.uint32(n_pinned)] = s
                n_pinned += 1
            else:
                misses[np.uint32(n_miss)] = j
                n_miss += 1
        return n_miss, n_pinned
    for j in range(setup.top_k):
        e = ids[i, j]
        s = expert_slot[e]
        served[oi, j] = e
        slot[oi, j] = s
        if s >= 0:
            kind[oi, j] = HIT
            if setup.int_keys:
                skey[s] = IMAX
            else:  # (pin is read only by the float keys' and the queues' victim searches)
                pin[s] = stamp
            pinned_slots[n_pinned] = s
            n_pinned += 1
        else:
            kind[oi, j] = MISS
            misses[n_miss] = j
            n_miss += 1
    return n_miss, n_pinned


@njit(cache=True, inline="always")
def drop(kind, served, oi, j):
    """A miss nothing serves: DROP, served -1 (its slot stays -1)."""
    kind[oi, j] = DROP
    served[oi, j] = -1


@njit(cache=True, inline="always")
def candidate(acc, candidates, e, weight, n_cand):
    """A miss not fetched: its gate weight joins e's accumulator, e an admission candidate; returns n_cand."""
    acc[e] += weight
    candidates[n_cand] = e
    return n_cand + 1


@njit(cache=True, inline="always")
def miss_rule(setup, table, ids, weights, kind, served, slot, misses, pinned_slots, pinned_keys, substituted, candidates,
              i, oi, n_miss, n_pinned, n_cand, stamp):
    """Steps 2-3 and the fallbacks other than substitute: each miss's decision, the fetches in rank order
    through claim. Returns (n_fetch, n_host, n_lowbit, n_drop, n_need, dropped_mass, lowbit_mass, n_cand,
    n_pinned): n_need misses left to the substitute fallback (in `substituted`), the token's dropped (so far)
    and low-bit mass."""
    skey, acc, fallback = table.skey, table.acc, setup.fallback
    n_fetch = n_host = n_lowbit = n_drop = n_need = 0
    dropped_mass = 0.0
    lowbit_mass = 0.0
    for q in range(n_miss):
        j = misses[q]
        e = ids[i, j]
        fetch = _fetches(setup.rule, j, weights[i, j], setup.tau, setup.tau_high)
        if fetch and n_fetch == setup.fetch_cap:  # fetch cap reached: the fallback, as if the rule had not fetched
            fetch = False
        if fetch:
            if setup.lfu_int and n_fetch == 0:  # the token's first fetch: protect its hits now (keys kept)
                for p in range(n_pinned):
                    s = pinned_slots[p]
                    pinned_keys[p] = skey[s]
                    skey[s] = IMAX
            s, requeue = claim(setup, table, e, stamp)  # a victim exists: C_l - P_l >= k
            if requeue >= 0:
                candidates[n_cand] = requeue
                n_cand += 1
            acc[e] = 0.0
            kind[oi, j] = FETCH
            slot[oi, j] = s
            pinned_slots[n_pinned] = s
            n_pinned += 1
            n_fetch += 1
        elif fallback == F_SUBSTITUTE:
            kind[oi, j] = SUB
            substituted[n_need] = j
            n_need += 1
        elif fallback == F_HOST:  # served e, slot -1 (as listed)
            kind[oi, j] = HOST
            n_host += 1
        elif fallback == F_LOWBIT:  # lowbit and drop: the accumulator and an admission candidate
            kind[oi, j] = LOWBIT
            n_lowbit += 1
            lowbit_mass += weights[i, j]
            n_cand = candidate(acc, candidates, e, weights[i, j], n_cand)
        elif fallback == F_DROP:
            drop(kind, served, oi, j)
            n_drop += 1
            dropped_mass += weights[i, j]
            n_cand = candidate(acc, candidates, e, weights[i, j], n_cand)
        else:  # unreachable: the import check gives every FALLBACKS entry its branch
            raise ValueError("run_layer: a fallback without its branch in miss_rule")
    return n_fetch, n_host, n_lowbit, n_drop, n_need, dropped_mass, lowbit_mass, n_cand, n_pinned


@njit(cache=True, inline="always")
def substitutes(setup, ids, weights, rank, score, slot_expert, expert_slot, acc, kind, served, slot, found, selected_mark,
                substituted, candidates, i, oi, n_need, n_cand):
    """Step 4: substitutes in rank order, after all fetches. ranking[:k] is the selection (each entry a hit, a
    fetch or a non-resident miss) and the ranking holds distinct ids, so "resident and not used by this
    token" is just "resident" from position k on: the substitutes are the first n_need resident entries of
    ranking[k:], collected branch-free (store every entry, advance on a resident one) into `found`; with
    router scores, one pass over the resident slots (best_resident). Returns (n_sub, n_drop, mass, n_cand)."""
    n_found = 0
    if setup.score_mode:
        for j in range(setup.top_k):
            selected_mark[ids[i, j]] = i
        score_row = score[i]  # [E]
        n_found = best_resident(score_row, selected_mark, i, slot_expert, setup.cap, n_need, found)
    else:
        m = setup.top_k
        while n_found < n_need and m < setup.rank_width:
            c = rank[i, m]
            found[n_found] = c
            n_found += expert_slot[c] >= 0
            m += 1
    n_sub = 0
    n_drop = 0
    mass = 0.0
    for q in range(n_need):  # the q-th substitute (if found) serves the q-th of these misses
        j = substituted[q]
        if q < n_found:
            served[oi, j] = found[q]
            slot[oi, j] = expert_slot[found[q]]
            n_sub += 1
        else:
            drop(kind, served, oi, j)
            n_drop += 1
        mass += weights[i, j]
        n_cand = candidate(acc, candidates, ids[i, j], weights[i, j], n_cand)
    return n_sub, n_drop, mass, n_cand


@njit(cache=True, inline="always")
def touch_token(setup, key, skey, slot_expert, age_count, qstate, ids, next_use, kind, served, slot, pinned_slots,
                pinned_keys, i, oi, t, n_miss, n_pinned, n_fetch):
    """Step 5: the eviction kind's touch (its TOUCHES rule, evict.py `touch_*`; lru, crf and s3fifo:
    full-precision computes only); the integer-key paths also re-key this token's pinned slots."""
    E, slot_bits, k = setup.num_experts, setup.slot_bits, setup.top_k
    if setup.lfu_int:  # (every key and the hits' slot keys are up to date from step 1)
        ek.touch_lfu_int(skey, key, slot_expert, pinned_slots, pinned_keys, n_pinned, k - n_miss, n_fetch, E, slot_bits)
    elif setup.touch == T_LFU:
        ek.touch_lfu(key, ids, i, k, setup.gamma)
    elif setup.touch == T_LFUDA:
        ek.touch_lfuda(qstate, age_count, key, skey, slot_expert, ids, i, k, pinned_slots, n_pinned, E, slot_bits)
    elif setup.touch == T_LRU:
        ek.touch_lru(key, skey, kind, served, slot, oi, k, t, E, slot_bits)
    elif setup.touch == T_CRF:
        ek.touch_crf(key, kind, served, oi, k, setup.decay)
    elif setup.touch == T_S3FIFO:
        ek.touch_s3fifo(age_count, kind, served, oi, k)
    elif setup.touch == T_BELADY:
        ek.touch_belady(key, ids, next_use, i, k)
    else:  # unreachable: the import check gives every TOUCHES entry its branch
        raise ValueError("run_layer: an eviction touch without its branch in touch_token")
