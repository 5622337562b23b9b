"""The compiled policy kernel: `run_layer`, one layer's cache over a chunk of tokens, built from stages.

Per token, in the order of docs/policies.md ("Per token, per layer, in this order", "Additions"): 0 `prefetch_cut`
(a bounded copy pool cuts the predicted list), `admit_due`; 0b `prefetch_list`; 0c `route` (route.py); 1 `hits`; 2-3
`miss_rule` (fetches; host / lowbit / drop); 4 `substitutes`; 5 `rekey` (the kind's touch: its rules on scalars in
evict.py); `count_events`; 6 `queue_admissions`, `start_copies`. Every load into a slot goes through `claim`;
`key_slots` runs before the chunk, `store` after it. Inlining is required for speed: the stages are closures, which
numba inlines reading the outer arrays afresh at each use; module-level stages, even inline="always", bind their
array arguments per call and ran the presets 15x slower (docs/simulator.md, reports/kernel_ab_module_stages.md).
`lean` is passed as a constant by `run_layers`, so run_layer compiles as two `Literal[bool]` specializations of one
module-level dispatcher (distinct symbols: no two cached objects share one, reports/compile_once.md). The input
contract: a ranking row starts with the token's selection and holds distinct ids, or router scores stand for it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from runtime.core.kernel import evict as ek
from runtime.core.kernel.evict import IMAX, K_LFU, KIND_KEYS, KIND_ON_LOAD, KIND_TOUCH
from runtime.core.kernel.plan import (
    C_ADM,
    C_ADM_SKIPPED,
    C_ADM_WAITED,
    C_CALLS,
    C_DROPS,
    C_FETCHES,
    C_HITS,
    C_HOST,
    C_LOWBIT,
    C_PREF,
    C_PREF_UNBUF,
    C_PREF_USED,
    C_REROUTES,
    C_SUBS,
    DROP,
    EV_ADM_POPPED,
    EV_ADM_QUEUED,
    EV_DEV,
    EV_FETCH,
    EV_HOST,
    EV_LOWBIT,
    EV_PREFETCH,
    FETCH,
    HIT,
    HOST,
    LOWBIT,
    M_LOWBIT,
    M_REROUTE,
    M_SUB,
    MISS,
    N_INT,
    SUB,
    Outputs,
    Tokens,
)
from runtime.core.kernel.primitives import (  # noqa: F401 - F_SUBSTITUTE: PolicyCache's lean test imports it here
    F_DROP,
    F_HOST,
    F_LOWBIT,
    F_SUBSTITUTE,
    KY_FLOAT,
    KY_INT_GAMMA1,
    KY_QUEUE,
    OL_LFUDA,
    OL_S3FIFO,
    PF_AHEAD,
    R_FETCH_ALL,
    RT_OFF,
    RT_PRIOR,
    T_BELADY,
    T_CRF,
    T_LFU,
    T_LFUDA,
    T_LRU,
    T_S3FIFO,
    _fetches,
    _index,
    _log,
    _prefetch,
)
from runtime.core.kernel.route import _prior_select, _routed_weights, _same_set, _window_select
from runtime.core.kernel.search import best_resident, free_slot, victim, victim_int
from runtime.core.kernel.state import Q_AGE, Q_HEAD, Q_LEN, Q_NSTART, Q_RES, Q_STAMP, layer_state


@njit(cache=True, error_model="numpy")
def run_layer(tokens, t0, pol, state, outputs, lean):
    """One layer's cache over tokens t0 .. t0+T-1 (`pol`: kernel_record; `state` mutated). `lean` (a constant):
    the paper's presets' features only (lfu with gamma 1, substitute, no cap, pins, prefetch or scores)."""
    ids, weights, rank, valid, score, next_use, pred = tokens  # [T, k] [T, k] [T, M] [T] [T, E] or [0, 0] [T, k] [T, P]
    out_kind, out_served, out_slot, event_counts, adm_log, q_log, pf_log, n_logs = outputs  # [T or 1, k] x3, [T, N_EV]
    rule, tau, tau_high, beta, decay, delay = pol.rule, pol.tau, pol.tau_high, pol.beta, pol.decay, pol.delay
    copy_buffers = pol.copy_buffers  # the layer's copy buffers (-1: unbounded)
    # the lean build knows these (PolicyCache.step picks it): lfu, gamma 1, substitute, no cap/pins/prefetch/scores
    evict = K_LFU if lean else pol.evict
    gamma = 1.0 if lean else pol.gamma
    fallback = F_SUBSTITUTE if lean else pol.fallback
    fetch_cap = -1 if lean else pol.fetch_cap
    capacity, age_count, s3_queue, ghost = state.caps, state.age_count, state.queue, state.ghost
    first_evictable = 0 if lean else state.npin
    # the kind's mechanisms, each from its row of evict.EVICT_KINDS (constants in the lean build)
    key_storage = KIND_KEYS[evict]  # the victim search: integer slot keys, float keys, S3-FIFO's queue walk
    on_load = KIND_ON_LOAD[evict]  # the claim's on-load / on-evict rule
    touch = KIND_TOUCH[evict]  # step 5's rule
    lfuda_aging = on_load == OL_LFUDA
    s3fifo = on_load == OL_S3FIFO
    slot_expert, expert_slot, key, skey, acc, queued, pin = (state.slot_expert, state.expert_slot, state.key,
                                                             state.skey, state.acc, state.queued, state.pin)
    qstate, q_exp, q_due = state.qstate, state.q_exp, state.q_due
    T, k = ids.shape
    M, E, ring_capacity = rank.shape[1], expert_slot.shape[0], q_exp.shape[0]
    score_mode = False if lean else score.shape[0] == T  # router scores stand for the full ranking
    output_rows = 1 if out_kind.shape[0] == T else 0  # per-slot outputs per token, or one scratch row (no decisions)
    pred_width = 0 if lean else (pred.shape[1] if pred.shape[0] == T else 0)  # predicted-list width (0: no prefetch)
    use_admission = beta > 0.0
    int_keys = ek.int_keys(evict, gamma)  # integer keys: skey mirrors them
    slot_bits = 0  # slot bits of a slot key (evict.slot_key): 2**slot_bits >= cap
    while (1 << slot_bits) < capacity:
        slot_bits += 1
    candidates = np.empty(k + ring_capacity + pred_width + 2 * k, np.int64)  # admission candidates [k+E+1+P+2k]
    route_family = RT_OFF if lean else pol.route  # cache-aware routing (never in the lean build)
    route_keep, route_window, route_lambda = pol.route_keep, min(pol.route_window, E), pol.route_lambda
    route_alpha, route_norm = pol.route_alpha, pol.route_norm
    routed_ids = np.empty(k, np.int64)  # [k] route: the routed selection of the token
    routed_weights = np.empty(k, np.float64)  # [k] route: its weights
    substitute_ids = np.empty(k, np.int64)  # [k] this token's substitutes, in rank order
    selected_mark = np.full(E if score_mode else 0, -1, np.int64)  # [E] score mode: e selected by token i
    batch_slots = np.empty(capacity, np.int64)  # [C] slots admitted in the current batch
    token_slots = np.empty(ring_capacity, np.int64)  # [E + 1] slots admitted at the current token (all batches)
    prefetched = np.empty(max(pred_width, 1), np.int64)  # [P] experts prefetched at the current token
    misses = np.empty(k, np.int64)  # [k] this token's misses (positions j), in rank order
    substituted = np.empty(k, np.int64)  # [k] those of them left to the substitute fallback, in rank order
    pinned_slots = np.empty(k, np.int64)  # [k] slots of this token's hits and fetches (pinned; re-keyed after it)
    pinned_keys = np.empty(k, np.int64)  # [k] lfu_int: the hits' slot keys while a fetch protects them
    walk = rule != R_FETCH_ALL and fallback == F_SUBSTITUTE and not score_mode  # the walk reads rank rows
    lfu_int = touch == T_LFU and int_keys  # lfu's touch on integer keys (gamma 1): a hit moves its slot key
    key_step = np.int64(E) << slot_bits  # lfu_int: a key's +1 in its slot key (evict.slot_key)
    counters = np.zeros(N_INT, np.int64)  # [N_INT] the rarer counters (the per-token ones: scalars of the loop)

    def claim(e, claim_stamp):
        """THE slot claim (fetch, admission, prefetch): put `e` in a free slot if the layer has one, else in
        the victim's (the kind's smallest key among the slots first_evictable.. whose pin != claim_stamp;
        integer keys: the smallest skey; s3fifo: its queue walk), evicting the victim, then the kind's on-load rule. The
        claimed slot is pinned with `claim_stamp`. Returns (slot, requeue): slot -1 when nothing is evictable
        (nothing changed); requeue the evicted expert when admission is on and its accumulator is at beta
        already (only after a prefetch: a is not reset by one), for the caller's admission candidates,
        else -1. A closure, so numba inlines it at each call with the state arrays as they are."""
        victim_expert = -1
        if qstate[Q_RES] < capacity:
            s = free_slot(slot_expert, capacity)
            qstate[Q_RES] += 1
        else:
            if int_keys:  # "int", or "int-gamma1" with gamma 1
                s = victim_int(skey, first_evictable, capacity, slot_bits)
            elif key_storage == KY_QUEUE:
                s = ek.s3_victim(slot_expert, first_evictable, capacity, key, pin, claim_stamp, s3_queue, age_count,
                                 qstate)
            elif key_storage == KY_FLOAT or key_storage == KY_INT_GAMMA1:  # (lfu with gamma < 1: float keys)
                s = victim(slot_expert, first_evictable, capacity, key, pin, claim_stamp)
            else:  # unreachable: the import check gives every KEYS entry its branch
                raise ValueError("run_layer: an eviction key storage without its victim search in claim")
            if s >= 0:
                victim_expert = slot_expert[s]
                expert_slot[victim_expert] = -1
        if s >= 0:
            slot_expert[s] = e
            expert_slot[e] = s
            pin[s] = claim_stamp
            if int_keys:
                skey[s] = IMAX
            if lfuda_aging:  # lfuda: the victim leaves first, then K[e] = A + c[e]
                if victim_expert >= 0:
                    qstate[Q_AGE], age_count[victim_expert] = ek.lfuda_evicted(qstate[Q_AGE], key[victim_expert],
                                                                               age_count[victim_expert])
                key[e] = ek.lfuda_loaded(qstate[Q_AGE], age_count[e])
            if s3fifo:
                ek.s3_moved(victim_expert, e, key, s3_queue, age_count, ghost, qstate)
        return s, (victim_expert if victim_expert >= 0 and use_admission and acc[victim_expert] >= beta else -1)

    def admit_due(i, t, q_head, q_len, n_started, stamp, n_cand):
        """Step 0: the admissions due before token t, batch by batch (a batch = same due token: copies started
        at one token), taken from the ring's `n_started` started entries; returns (q_head, q_len, n_started,
        stamp, n_cand, n_token_slots): n_token_slots slots admitted at this token, in token_slots."""
        n_token_slots = 0
        while n_started > 0 and q_due[q_head] <= t:
            due_token = q_due[q_head]
            stamp += 1
            batch_stamp = stamp
            n_batch = 0
            while n_started > 0 and q_due[q_head] == due_token:
                e = q_exp[q_head]
                q_head = (q_head + 1) % ring_capacity
                q_len -= 1
                n_started -= 1
                queued[e] = False
                event_counts[i, EV_ADM_POPPED] += 1
                if expert_slot[e] >= 0:
                    counters[C_ADM_SKIPPED] += 1
                    continue
                s, requeue = claim(e, batch_stamp)
                if s < 0:
                    counters[C_ADM_SKIPPED] += 1
                    if use_admission:  # not resident, no longer queued: may be queued again after the token
                        candidates[n_cand] = e
                        n_cand += 1
                    continue
                if requeue >= 0:
                    candidates[n_cand] = requeue
                    n_cand += 1
                acc[e] = 0.0
                counters[C_ADM] += 1
                batch_slots[n_batch] = s  # distinct pinned slots: at most cap of them
                n_batch += 1
                token_slots[n_token_slots] = s
                n_token_slots += 1
                _log(adm_log, n_logs, 0, t, e, s)
            if int_keys:  # re-key the batch's slots (they were pinned against each other)
                for b_ in range(n_batch):
                    s = batch_slots[b_]
                    skey[s] = ek.slot_key(key[slot_expert[s]], slot_expert[s], E, s, slot_bits)
        return q_head, q_len, n_started, stamp, n_cand, n_token_slots

    def prefetch_cut(i, free_buffers):
        """Before step 0, with a bounded copy pool: the copies for token i's predicted list are those of its
        first `free` members not resident now (the layer's free copy buffers); returns the length of P cut
        after the last of them, counting the non-resident members cut off (prefetch_unbuffered)."""
        n_not_resident = 0
        limit = pred_width
        for p in range(pred_width):
            e = pred[i, p]
            if e < 0:
                break
            if expert_slot[e] < 0:
                if n_not_resident < free_buffers:
                    n_not_resident += 1
                else:
                    if limit == pred_width:
                        limit = p
                    counters[C_PREF_UNBUF] += 1
        return limit

    def protect(s, prefetch_stamp):
        """Protect slot s for the prefetch step `prefetch_stamp`."""
        pin[s] = prefetch_stamp
        if int_keys:
            skey[s] = IMAX

    def prefetch_list(i, t, stamp, n_cand, n_token_slots, limit):
        """Step 0b: load token i's predicted list, its first limit members (no f, a or lru change), protecting
        the slots admitted at this token and the members of P; returns (stamp, n_cand, n_loaded): n_loaded
        experts loaded, in prefetched."""
        n_loaded = 0
        if limit == 0 or pred[i, 0] < 0:
            return stamp, n_cand, n_loaded
        stamp += 1
        prefetch_stamp = stamp
        for b_ in range(n_token_slots):
            protect(token_slots[b_], prefetch_stamp)
        for p in range(limit):
            e = pred[i, p]
            if e < 0:
                break
            if expert_slot[e] >= 0:
                protect(expert_slot[e], prefetch_stamp)
        for p in range(limit):
            e = pred[i, p]
            if e < 0:
                break
            if expert_slot[e] >= 0:
                continue
            s, requeue = claim(e, prefetch_stamp)
            if s < 0:
                continue  # nothing evictable: skipped
            if requeue >= 0:
                candidates[n_cand] = requeue
                n_cand += 1
            prefetched[n_loaded] = e
            n_loaded += 1
            _log(pf_log, n_logs, 2, t, e, s)
        if int_keys:  # re-key every protected slot
            for b_ in range(n_token_slots):
                s = token_slots[b_]
                skey[s] = ek.slot_key(key[slot_expert[s]], slot_expert[s], E, s, slot_bits)
            for p in range(limit):
                e = pred[i, p]
                if e < 0:
                    break
                s = expert_slot[e]
                if s >= 0:
                    skey[s] = ek.slot_key(key[e], e, E, s, slot_bits)
        counters[C_PREF] += n_loaded
        event_counts[i, EV_PREFETCH] += n_loaded
        for p in range(n_loaded):
            for j in range(k):
                if ids[i, j] == prefetched[p]:
                    counters[C_PREF_USED] += 1
                    break
        return stamp, n_cand, n_loaded

    def route(i, n_cand):
        """Step 0c (docs/policies.md, Additions (4)): cache-aware routing on the residency left by steps 0-0b.
        Cache-Prior updates D (the running mean of the valid tokens' logit ranges, this one included) and
        selects by the biased logits; CACHE_ROUTE by the true ranking's window. A routed set that is the
        model's keeps the model's order and weights; otherwise ids[i] and w[i] are rewritten (the caller's
        copies), the replacements counted as reroutes (resident by construction: never a hit) and the
        displaced experts' weights as the rerouted mass, each joining its accumulator as an admission
        candidate. Returns (n_cand, n_rerouted)."""
        selection = ids[i]
        if route_family == RT_PRIOR:
            z = score[i]
            z_low = z[0]
            z_high = z[0]
            for e in range(1, E):
                if z[e] < z_low:
                    z_low = z[e]
                if z[e] > z_high:
                    z_high = z[e]
            state.route_d[0] += z_high - z_low
            state.route_d[1] += 1.0
            _prior_select(z, selection, k, route_keep, route_lambda * (state.route_d[0] / state.route_d[1]),
                          expert_slot, routed_ids)
        else:
            z = score[i] if score_mode else weights[i]  # (unused by cache-route's weights)
            _window_select(rank[i], k, route_keep, route_window, expert_slot, routed_ids)
        if _same_set(selection, routed_ids, k):
            return n_cand, 0
        _routed_weights(route_family, z, route_norm, selection, weights[i], routed_ids, k, route_alpha, routed_weights)
        n_rerouted = 0
        moved_mass = 0.0
        for j in range(k):  # the displaced experts, in rank order
            if _index(routed_ids, k, selection[j]) < 0:
                n_rerouted += 1
                moved_mass += weights[i, j]
                acc[selection[j]] += weights[i, j]  # (as `candidate` does for a miss not fetched)
                candidates[n_cand] = selection[j]
                n_cand += 1
        counters[C_REROUTES] += n_rerouted
        state.mass[M_REROUTE] += moved_mass
        for q in range(k):
            ids[i, q] = routed_ids[q]
            weights[i, q] = routed_weights[q]
        return n_cand, n_rerouted

    def hits(i, oi, token_stamp):
        """Step 1: hits (pinned for the token: skey = IMAX on the integer-key paths, pin = the token's stamp
        otherwise; lfu with gamma 1 gives a hit its new key at once and protects the hits only if the
        token fetches, step 3); the misses are listed in misses in rank order, with served = the missed
        expert and slot = -1 until decided. Returns (n_miss misses, n_pinned pinned slots in pinned_slots)."""
        n_miss = 0
        n_pinned = 0
        if lfu_int:  # a hit's slot key moves up by one key step (skey holds every resident's composite key here)
            if output_rows:  # the per-slot outputs (without decisions nothing reads them under lfu)
                for j in range(k):
                    e = ids[i, j]
                    s = expert_slot[e]
                    out_served[oi, j] = e
                    out_slot[oi, j] = s
                    out_kind[oi, j] = HIT if s >= 0 else MISS
            for j in range(k):
                e = ids[i, j]
                s = expert_slot[np.uint32(e)]  # (unsigned indices: no wraparound code in the hot loop)
                key[np.uint32(e)] += 1.0  # f[e] += 1, hit or miss (a fetch's victim is chosen by slot keys)
                if s >= 0:
                    skey[np.uint32(s)] += key_step
                    pinned_slots[np.uint32(n_pinned)] = s
                    n_pinned += 1
                else:
                    misses[np.uint32(n_miss)] = j
                    n_miss += 1
            return n_miss, n_pinned
        for j in range(k):
            e = ids[i, j]
            s = expert_slot[e]
            out_served[oi, j] = e
            out_slot[oi, j] = s
            if s >= 0:
                out_kind[oi, j] = HIT
                if int_keys:
                    skey[s] = IMAX
                else:  # (pin is read only by the float keys' and the queues' victim searches)
                    pin[s] = token_stamp
                pinned_slots[n_pinned] = s
                n_pinned += 1
            else:
                out_kind[oi, j] = MISS
                misses[n_miss] = j
                n_miss += 1
        return n_miss, n_pinned

    def drop(oi, j):
        """A miss nothing serves: DROP, served -1 (its slot stays -1)."""
        out_kind[oi, j] = DROP
        out_served[oi, j] = -1

    def candidate(e, weight, n_cand):
        """A miss not fetched: its gate weight joins e's accumulator, e an admission candidate; returns n_cand."""
        acc[e] += weight
        candidates[n_cand] = e
        return n_cand + 1

    def miss_rule(i, oi, n_miss, n_pinned, n_cand, token_stamp):
        """Steps 2-3 and the fallbacks other than substitute: each miss's decision, the fetches in rank
        order through claim. Returns (n_fetch, n_host, n_lowbit, n_drop, n_need, token_mass, token_lowbit_mass,
        n_cand, n_pinned): n_need misses left to the substitute fallback (in substituted), token_mass /
        token_lowbit_mass the token's substituted / lowbit mass so far."""
        n_fetch = 0
        n_host = 0
        n_lowbit = 0
        n_drop = 0
        n_need = 0
        token_mass = 0.0
        token_lowbit_mass = 0.0
        for q_ in range(n_miss):
            j = misses[q_]
            e = ids[i, j]
            fetch = _fetches(rule, j, weights[i, j], tau, tau_high)
            if fetch and n_fetch == fetch_cap:  # fetch cap reached: the fallback, as if the rule had not fetched it
                fetch = False
            if fetch:
                if lfu_int and n_fetch == 0:  # the token's first fetch: protect its hits now (their slot keys kept)
                    for q in range(n_pinned):
                        sq = pinned_slots[q]
                        pinned_keys[q] = skey[sq]
                        skey[sq] = IMAX
                s, requeue = claim(e, token_stamp)  # a victim exists: C_l - P_l >= k
                if requeue >= 0:
                    candidates[n_cand] = requeue
                    n_cand += 1
                acc[e] = 0.0
                out_kind[oi, j] = FETCH
                out_slot[oi, j] = s
                pinned_slots[n_pinned] = s
                n_pinned += 1
                n_fetch += 1
            elif fallback == F_SUBSTITUTE:
                out_kind[oi, j] = SUB
                substituted[n_need] = j
                n_need += 1
            elif fallback == F_HOST:  # served e, slot -1 (as listed)
                out_kind[oi, j] = HOST
                n_host += 1
            elif fallback == F_LOWBIT:  # lowbit and drop: the accumulator and an admission candidate
                weight = weights[i, j]
                out_kind[oi, j] = LOWBIT
                n_lowbit += 1
                token_lowbit_mass += weight
                n_cand = candidate(e, weight, n_cand)
            elif fallback == F_DROP:
                weight = weights[i, j]
                drop(oi, j)
                n_drop += 1
                token_mass += weight
                n_cand = candidate(e, weight, n_cand)
            else:  # unreachable: the import check gives every FALLBACKS entry its branch
                raise ValueError("run_layer: a fallback without its branch in miss_rule")
        return n_fetch, n_host, n_lowbit, n_drop, n_need, token_mass, token_lowbit_mass, n_cand, n_pinned

    def substitutes(i, oi, n_need, n_cand):
        """Step 4: substitutes in rank order, after all fetches. ranking[:k] is the selection (each entry a
        hit, a fetch or a non-resident miss) and the ranking holds distinct ids, so "resident and not used
        by this token" is just "resident" from position k on: the substitutes are the first n_need resident
        entries of ranking[k:], collected branch-free (store every entry, advance on a resident one); with
        router scores, one pass over the resident slots (_best_resident). Returns (nsub, n_drop, mass, n_cand)."""
        n_found = 0
        if score_mode:
            for j in range(k):
                selected_mark[ids[i, j]] = i
            n_found = best_resident(score[i], selected_mark, i, slot_expert, capacity, n_need, substitute_ids)
        else:
            m = k
            while n_found < n_need and m < M:
                c = rank[i, m]
                substitute_ids[n_found] = c
                n_found += expert_slot[c] >= 0
                m += 1
        n_sub = 0
        n_drop = 0
        token_mass = 0.0
        for q_ in range(n_need):  # the q-th substitute (if found) serves the q-th of these misses
            j = substituted[q_]
            e = ids[i, j]
            weight = weights[i, j]
            if q_ < n_found:
                found = substitute_ids[q_]
                out_served[oi, j] = found
                out_slot[oi, j] = expert_slot[found]
                n_sub += 1
            else:
                drop(oi, j)
                n_drop += 1
            token_mass += weight
            n_cand = candidate(e, weight, n_cand)
        return n_sub, n_drop, token_mass, n_cand

    def rekey(i, oi, t, n_miss, n_pinned, n_fetch):
        """Step 5: the eviction kind's touch (evict.py; lru, crf and s3fifo: full-precision computes only);
        the integer-key paths also re-key this token's pinned slots."""
        if lfu_int:  # (every key and the hits' slot keys are up to date from step 1)
            if n_fetch > 0:  # unprotect the hits (their slot keys back) and key the fetched slots
                for q_ in range(k - n_miss):
                    skey[pinned_slots[q_]] = pinned_keys[q_]
                for q_ in range(k - n_miss, n_pinned):
                    s = pinned_slots[q_]
                    e = slot_expert[s]
                    skey[s] = ek.slot_key(key[e], e, E, s, slot_bits)
        elif touch == T_LFU:
            for e in range(E):
                key[e] = ek.lfu_decay(key[e], gamma)
            for j in range(k):
                key[ids[i, j]] = ek.lfu_touch(key[ids[i, j]])
        elif touch == T_LFUDA:
            age = qstate[Q_AGE]
            for j in range(k):
                e = ids[i, j]
                age_count[e], key[e] = ek.lfuda_touch(age, age_count[e])
            for q_ in range(n_pinned):
                s = pinned_slots[q_]
                e = slot_expert[s]
                skey[s] = ek.slot_key(key[e], e, E, s, slot_bits)
        elif touch == T_LRU:
            for j in range(k):
                if out_kind[oi, j] <= SUB:
                    e = out_served[oi, j]
                    key[e] = ek.lru_touch(t)
                    s = out_slot[oi, j]
                    skey[s] = ek.slot_key(t, e, E, s, slot_bits)
        elif touch == T_CRF:
            for e in range(E):
                key[e] = ek.crf_decay(key[e], decay)
            for j in range(k):
                if out_kind[oi, j] <= SUB:
                    key[out_served[oi, j]] = ek.crf_touch(key[out_served[oi, j]])
        elif touch == T_S3FIFO:  # hits and substitutes (a fetch is the load, freq 0)
            for j in range(k):
                if out_kind[oi, j] == HIT or out_kind[oi, j] == SUB:
                    e = out_served[oi, j]
                    age_count[e] = ek.s3_touch(age_count[e])
        elif touch == T_BELADY:  # minus the next use
            for j in range(k):
                key[ids[i, j]] = ek.belady_touch(next_use[i, j])
        else:  # unreachable: the import check below gives every TOUCHES entry its branch
            raise ValueError("run_layer: an eviction touch without its branch in rekey")

    def queue_admissions(i, t, n_cand, q_head, q_len):
        """Step 6: queue the candidates with a[e] >= beta, largest a first (ties lower id); returns q_len."""
        n_queued = 0
        for c_ in range(n_cand):
            e = candidates[c_]
            if acc[e] >= beta and not queued[e] and expert_slot[e] < 0:
                queued[e] = True  # (also de-duplicates the candidates)
                p = n_queued  # insertion sort by (-acc, id)
                while p > 0 and (acc[candidates[p - 1]] < acc[e]
                                 or (acc[candidates[p - 1]] == acc[e] and candidates[p - 1] > e)):
                    candidates[p] = candidates[p - 1]
                    p -= 1
                candidates[p] = e
                n_queued += 1
        for c_ in range(n_queued):
            e = candidates[c_]
            tail = (q_head + q_len) % ring_capacity
            q_exp[tail] = e
            q_due[tail] = t  # waiting (start_copies sets the due token when its copy starts)
            q_len += 1
            acc[e] = 0.0
        return q_len

    def start_copies(i, t, q_head, q_len, n_started):
        """Step 6, after the queueing: the ring's waiting entries (after its n_started started ones) start their copies
        in queue order while the layer has a free copy buffer (unbounded: all), each due d tokens later; a
        waiting expert that became resident meanwhile leaves the queue without a copy (admissions_skipped).
        The copies started go to the log and the event column. Returns (q_head, q_len, n_started)."""
        n_new = 0
        while q_len > n_started and (copy_buffers < 0 or n_started < copy_buffers):
            pos = (q_head + n_started) % ring_capacity
            e = q_exp[pos]
            if expert_slot[e] >= 0:  # out of the ring: the started entries move up one place
                queued[e] = False
                counters[C_ADM_SKIPPED] += 1
                for j_ in range(n_started - 1, -1, -1):
                    a_ = (q_head + j_) % ring_capacity
                    b_ = (a_ + 1) % ring_capacity
                    q_exp[b_] = q_exp[a_]
                    q_due[b_] = q_due[a_]
                q_head = (q_head + 1) % ring_capacity
                q_len -= 1
                continue
            if q_due[pos] < t:
                counters[C_ADM_WAITED] += 1
            q_due[pos] = t + delay
            n_started += 1
            n_new += 1
            _log(q_log, n_logs, 1, t, e, -1)
        event_counts[i, EV_ADM_QUEUED] += n_new
        return q_head, q_len, n_started

    def hint(ahead):
        """Hints only: the rows token ahead reads and writes, on their way while an earlier token is decided."""
        if ahead < T:
            _prefetch(ids, ahead, 0)
            _prefetch(weights, ahead, 0)
            _prefetch(weights, ahead, k - 1)  # a row of w may span two cache lines
            if walk:
                _prefetch(rank, ahead, k)  # where the substitute walk starts

    def count_events(i, n_fetch, n_host, n_lowbit, n_drop):
        """The token's cost-model events: device computes, fetches, host and low-bit computes."""
        event_counts[i, EV_DEV] += k - n_host - n_lowbit - n_drop
        event_counts[i, EV_FETCH] += n_fetch
        event_counts[i, EV_HOST] += n_host
        event_counts[i, EV_LOWBIT] += n_lowbit

    def key_slots():
        """The slot keys of every slot from the keys (integer-key kinds), before the chunk."""
        if int_keys:
            for s in range(capacity):
                e = slot_expert[s]
                skey[s] = ek.slot_key(key[e], e, E, s, slot_bits) if e >= 0 else IMAX

    def store(q_head, q_len, n_started, stamp, sub_mass, lowbit_mass, n_calls, n_hits, n_fetches, n_subs, n_drops):
        """After the chunk: the admission ring and stamp back into qstate, the masses and counters added."""
        qstate[Q_HEAD] = q_head
        qstate[Q_LEN] = q_len
        qstate[Q_NSTART] = n_started
        qstate[Q_STAMP] = stamp
        state.mass[M_SUB] += sub_mass
        state.mass[M_LOWBIT] += lowbit_mass
        counters[C_CALLS] += n_calls
        counters[C_HITS] += n_hits
        counters[C_FETCHES] += n_fetches
        counters[C_SUBS] += n_subs
        counters[C_DROPS] += n_drops
        for c_ in range(N_INT):
            state.counters[c_] += counters[c_]

    n_calls = n_hits = n_fetches = n_subs = n_drops = 0
    q_head, q_len, n_started, stamp = qstate[Q_HEAD], qstate[Q_LEN], qstate[Q_NSTART], qstate[Q_STAMP]
    sub_mass = lowbit_mass = 0.0
    key_slots()
    for i in range(T):
        hint(i + PF_AHEAD)
        oi = i * output_rows  # the outputs' row: the token's, or the one scratch row
        if not valid[i]:
            for j in range(k):
                out_kind[oi, j] = -1
                out_served[oi, j] = -1
                out_slot[oi, j] = -1
            continue
        t = t0 + i
        limit = pred_width
        if pred_width > 0 and copy_buffers >= 0:  # copies issued before the admissions due now: n_started buffers busy
            limit = prefetch_cut(i, copy_buffers - n_started)
        q_head, q_len, n_started, stamp, n_cand, n_token_slots = admit_due(i, t, q_head, q_len, n_started, stamp, 0)
        stamp, n_cand, n_loaded = prefetch_list(i, t, stamp, n_cand, n_token_slots, limit)
        n_rerouted = 0
        if route_family != RT_OFF:
            n_cand, n_rerouted = route(i, n_cand)
        stamp += 1
        token_stamp = stamp
        n_calls += k
        n_miss, n_pinned = hits(i, oi, token_stamp)
        n_hits += n_pinned - n_rerouted  # (a rerouted expert is resident: counted as a reroute, not a hit)
        n_fetch, n_host, n_lowbit, n_drop, n_need, token_mass, token_lowbit_mass, n_cand, n_pinned = miss_rule(
            i, oi, n_miss, n_pinned, n_cand, token_stamp)
        n_fetches += n_fetch
        counters[C_HOST] += n_host
        counters[C_LOWBIT] += n_lowbit
        if n_need > 0:
            n_sub, n_sub_drop, token_sub_mass, n_cand = substitutes(i, oi, n_need, n_cand)
            n_subs += n_sub
            n_drop += n_sub_drop
            token_mass += token_sub_mass
        n_drops += n_drop
        sub_mass += token_mass
        lowbit_mass += token_lowbit_mass
        rekey(i, oi, t, n_miss, n_pinned, n_fetch)
        count_events(i, n_fetch, n_host, n_lowbit, n_drop)
        if use_admission:
            if n_cand > 0:
                q_len = queue_admissions(i, t, n_cand, q_head, q_len)
            if q_len > n_started:
                q_head, q_len, n_started = start_copies(i, t, q_head, q_len, n_started)
    store(q_head, q_len, n_started, stamp, sub_mass, lowbit_mass, n_calls, n_hits, n_fetches, n_subs, n_drops)


@njit(cache=True)
def run_layers(tok, t0, pol, cs, out, l0, lean):
    """The kernel's one entry from Python (PolicyCache.step / step_layers, decide.py): layers l0 .. l0+n-1 in
    order over tokens t0.., through run_layer's lean specialization when `lean` is true, else its full one;
    `tok` / `out` arrays carry a leading layer axis ([n, T, k] ...), `cs` the CacheState (mutated). Module-level
    (a closure over a dispatcher never loaded from the cache); one signature (PolicyCache converts arrays)."""
    for i in range(tok.ids.shape[0]):
        lt = Tokens(tok.ids[i], tok.w[i], tok.rank[i], tok.valid[i], tok.score[i], tok.nxt[i], tok.pred[i])
        lo = Outputs(out.kind[i], out.served[i], out.slot[i], out.ev[i], out.adm_log[i], out.q_log[i],
                     out.pf_log[i], out.n_logs[i])
        if lean:  # a constant argument: its own specialization of run_layer (Literal[bool](True))
            run_layer(lt, t0, pol, layer_state(cs, l0 + i), lo, True)
        else:
            run_layer(lt, t0, pol, layer_state(cs, l0 + i), lo, False)
