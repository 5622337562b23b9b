"""The compiled policy kernel: `run_layer`, one layer's cache over a chunk of tokens, built from stages.

Per token (docs/policies.md, "Per token, per layer, in this order" and "Additions"): 0 `prefetch_cut` and
`admit_due`, 0b `prefetch_list`, 0c `route` (route.py), 1 `hits`, 2-3 `miss_rule`, 4 `substitutes`, 5
`rekey`, 6 `queue_admissions` and `start_copies`; every load into a slot goes through `claim`. The stages
are closures that numba inlines with the state arrays as they are (module-level stages taking the arrays
pay reference counts: 17-30% slower). `lean` is passed as a constant by `run_layers`, so run_layer compiles
as two `Literal[bool]` specializations of one module-level dispatcher (distinct symbols: no two cached
objects share one, reports/compile_once.md). docs/architecture.md ("kernel") and
docs/simulator.md ("How the kernel is fast") hold the rest; the input contract: a ranking row starts with
the token's selection and holds distinct ids, or router scores stand for it (ties lower id).
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
def run_layer(tok, t0, pol, st, out, lean):
    """One layer's cache over tokens t0 .. t0+T-1 (`pol`: kernel_record; `st` mutated). `lean` (a constant):
    the paper's presets' features only (lfu with gamma 1, substitute, no cap, pins, prefetch or scores)."""
    ids, w, rank, valid, score, nxt, pred = tok
    out_kind, out_served, out_slot, ev, adm_log, q_log, pf_log, n_logs = out
    rule, tau, tau_high, beta, decay, delay = pol.rule, pol.tau, pol.tau_high, pol.beta, pol.decay, pol.delay
    nbuf = pol.copy_buffers  # the layer's copy buffers (-1: unbounded)
    # the lean build knows these (PolicyCache.step picks it): lfu, gamma 1, substitute, no cap/pins/prefetch/scores
    evict = K_LFU if lean else pol.evict
    gamma = 1.0 if lean else pol.gamma
    fallback = F_SUBSTITUTE if lean else pol.fallback
    fcap = -1 if lean else pol.fetch_cap
    cap, age_count, s3q, ghost = st.caps, st.age_count, st.queue, st.ghost
    p0 = 0 if lean else st.npin
    # the kind's mechanisms, each from its row of evict.EVICT_KINDS (constants in the lean build)
    keys = KIND_KEYS[evict]  # the victim search: integer slot keys, float keys, S3-FIFO's queue walk
    on_load = KIND_ON_LOAD[evict]  # the claim's on-load / on-evict rule
    touch = KIND_TOUCH[evict]  # step 5's rule
    aging = on_load == OL_LFUDA
    s3 = on_load == OL_S3FIFO
    slot_expert, expert_slot, key, skey, acc, queued, pin = (st.slot_expert, st.expert_slot, st.key, st.skey,
                                                             st.acc, st.queued, st.pin)
    qstate, q_exp, q_due = st.qstate, st.q_exp, st.q_due
    T, k = ids.shape
    M = rank.shape[1]
    E = expert_slot.shape[0]
    qcap = q_exp.shape[0]
    smode = False if lean else score.shape[0] == T  # router scores stand for the full ranking
    orow = 1 if out_kind.shape[0] == T else 0  # per-slot outputs per token, or one scratch row (no decisions)
    npw = 0 if lean else (pred.shape[1] if pred.shape[0] == T else 0)  # predicted-list width (0: no prefetch)
    use_adm = beta > 0.0
    fast = ek.int_keys(evict, gamma)  # integer keys: skey mirrors them
    sb = 0  # slot bits of a slot key (evict.slot_key): 2**sb >= cap
    while (1 << sb) < cap:
        sb += 1
    cand = np.empty(k + qcap + npw + 2 * k, np.int64)  # admission candidates: misses, evicted, displaced (route)
    rfam = RT_OFF if lean else pol.route  # cache-aware routing (never in the lean build)
    rkeep, rwin, rlam, ralpha, rnorm = pol.route_keep, min(pol.route_window, E), pol.route_lambda, pol.route_alpha, \
        pol.route_norm
    rnew = np.empty(k, np.int64)  # route: the routed selection of the token
    rw = np.empty(k, np.float64)  # route: its weights
    subs = np.empty(k, np.int64)  # this token's substitutes, in rank order
    sel_mark = np.full(E if smode else 0, -1, np.int64)  # score mode: e selected by token i
    bslots = np.empty(cap, np.int64)  # slots admitted in the current batch
    tslots = np.empty(qcap, np.int64)  # slots admitted at the current token (all batches)
    pfe = np.empty(max(npw, 1), np.int64)  # experts prefetched at the current token
    mj = np.empty(k, np.int64)  # this token's misses (positions j), in rank order
    sj = np.empty(k, np.int64)  # those of them left to the substitute fallback, in rank order
    pslots = np.empty(k, np.int64)  # slots of this token's hits and fetches (pinned; re-keyed after the token)
    psk = np.empty(k, np.int64)  # lfu1: the hits' slot keys while a fetch protects them
    walk = rule != R_FETCH_ALL and fallback == F_SUBSTITUTE and not smode  # the walk reads rank rows
    lfu1 = touch == T_LFU and fast  # lfu's touch on integer keys (gamma 1): a hit moves its slot key
    kstep = np.int64(E) << sb  # lfu1: a key's +1 in its slot key (evict.slot_key)
    cnt = np.zeros(N_INT, np.int64)  # the rarer counters (the per-token ones are scalars of the loop)

    def claim(e, stamp_):
        """THE slot claim (fetch, admission, prefetch): put `e` in a free slot if the layer has one, else in
        the victim's (the kind's smallest key among the slots p0.. whose pin != stamp_; integer keys: the
        smallest skey; s3fifo: its queue walk), evicting the victim, then the kind's on-load rule. The
        claimed slot is pinned with `stamp_`. Returns (slot, requeue): slot -1 when nothing is evictable
        (nothing changed); requeue the evicted expert when admission is on and its accumulator is at beta
        already (only after a prefetch: a is not reset by one), for the caller's admission candidates,
        else -1. A closure, so numba inlines it at each call with the state arrays as they are."""
        v = -1
        if qstate[Q_RES] < cap:
            s = free_slot(slot_expert, cap)
            qstate[Q_RES] += 1
        else:
            if fast:  # "int", or "int-gamma1" with gamma 1
                s = victim_int(skey, p0, cap, sb)
            elif keys == KY_QUEUE:
                s = ek.s3_victim(slot_expert, p0, cap, key, pin, stamp_, s3q, age_count, qstate)
            elif keys == KY_FLOAT or keys == KY_INT_GAMMA1:  # (lfu with gamma < 1: float keys)
                s = victim(slot_expert, p0, cap, key, pin, stamp_)
            else:  # unreachable: the import check gives every KEYS entry its branch
                raise ValueError("run_layer: an eviction key storage without its victim search in claim")
            if s >= 0:
                v = slot_expert[s]
                expert_slot[v] = -1
        if s >= 0:
            slot_expert[s] = e
            expert_slot[e] = s
            pin[s] = stamp_
            if fast:
                skey[s] = IMAX
            if aging:  # lfuda: the victim leaves first, then K[e] = A + c[e]
                if v >= 0:
                    qstate[Q_AGE], age_count[v] = ek.lfuda_evicted(qstate[Q_AGE], key[v], age_count[v])
                key[e] = ek.lfuda_loaded(qstate[Q_AGE], age_count[e])
            if s3:
                ek.s3_moved(v, e, key, s3q, age_count, ghost, qstate)
        return s, (v if v >= 0 and use_adm and acc[v] >= beta else -1)

    def admit_due(i, t, q_head, q_len, ns, stamp, nc):
        """Step 0: the admissions due before token t, batch by batch (a batch = same due token: copies started
        at one token), taken from the ring's `ns` started entries; returns (q_head, q_len, ns, stamp, nc,
        nts): nts slots admitted at this token, in tslots."""
        nts = 0
        while ns > 0 and q_due[q_head] <= t:
            due = q_due[q_head]
            stamp += 1
            bstamp = stamp
            nb = 0
            while ns > 0 and q_due[q_head] == due:
                e = q_exp[q_head]
                q_head = (q_head + 1) % qcap
                q_len -= 1
                ns -= 1
                queued[e] = False
                ev[i, EV_ADM_POPPED] += 1
                if expert_slot[e] >= 0:
                    cnt[C_ADM_SKIPPED] += 1
                    continue
                s, vq = claim(e, bstamp)
                if s < 0:
                    cnt[C_ADM_SKIPPED] += 1
                    if use_adm:  # not resident, no longer queued: may be queued again after the token
                        cand[nc] = e
                        nc += 1
                    continue
                if vq >= 0:
                    cand[nc] = vq
                    nc += 1
                acc[e] = 0.0
                cnt[C_ADM] += 1
                bslots[nb] = s  # distinct pinned slots: at most cap of them
                nb += 1
                tslots[nts] = s
                nts += 1
                _log(adm_log, n_logs, 0, t, e, s)
            if fast:  # re-key the batch's slots (they were pinned against each other)
                for b_ in range(nb):
                    s = bslots[b_]
                    skey[s] = ek.slot_key(key[slot_expert[s]], slot_expert[s], E, s, sb)
        return q_head, q_len, ns, stamp, nc, nts

    def prefetch_cut(i, free):
        """Before step 0, with a bounded copy pool: the copies for token i's predicted list are those of its
        first `free` members not resident now (the layer's free copy buffers); returns the length of P cut
        after the last of them, counting the non-resident members cut off (prefetch_unbuffered)."""
        nnr = 0
        plim = npw
        for p in range(npw):
            e = pred[i, p]
            if e < 0:
                break
            if expert_slot[e] < 0:
                if nnr < free:
                    nnr += 1
                else:
                    if plim == npw:
                        plim = p
                    cnt[C_PREF_UNBUF] += 1
        return plim

    def protect(s, ps):
        """Protect slot s for the prefetch step `ps`."""
        pin[s] = ps
        if fast:
            skey[s] = IMAX

    def prefetch_list(i, t, stamp, nc, nts, plim):
        """Step 0b: load token i's predicted list, its first plim members (no f, a or lru change), protecting
        the slots admitted at this token and the members of P; returns (stamp, nc, npl): npl experts loaded,
        in pfe."""
        npl = 0
        if plim == 0 or pred[i, 0] < 0:
            return stamp, nc, npl
        stamp += 1
        ps = stamp
        for b_ in range(nts):
            protect(tslots[b_], ps)
        for p in range(plim):
            e = pred[i, p]
            if e < 0:
                break
            if expert_slot[e] >= 0:
                protect(expert_slot[e], ps)
        for p in range(plim):
            e = pred[i, p]
            if e < 0:
                break
            if expert_slot[e] >= 0:
                continue
            s, vq = claim(e, ps)
            if s < 0:
                continue  # nothing evictable: skipped
            if vq >= 0:
                cand[nc] = vq
                nc += 1
            pfe[npl] = e
            npl += 1
            _log(pf_log, n_logs, 2, t, e, s)
        if fast:  # re-key every protected slot
            for b_ in range(nts):
                s = tslots[b_]
                skey[s] = ek.slot_key(key[slot_expert[s]], slot_expert[s], E, s, sb)
            for p in range(plim):
                e = pred[i, p]
                if e < 0:
                    break
                s = expert_slot[e]
                if s >= 0:
                    skey[s] = ek.slot_key(key[e], e, E, s, sb)
        cnt[C_PREF] += npl
        ev[i, EV_PREFETCH] += npl
        for p in range(npl):
            for j in range(k):
                if ids[i, j] == pfe[p]:
                    cnt[C_PREF_USED] += 1
                    break
        return stamp, nc, npl

    def route(i, nc):
        """Step 0c (docs/policies.md, Additions (4)): cache-aware routing on the residency left by steps 0-0b.
        Cache-Prior updates D (the running mean of the valid tokens' logit ranges, this one included) and
        selects by the biased logits; CACHE_ROUTE by the true ranking's window. A routed set that is the
        model's keeps the model's order and weights; otherwise ids[i] and w[i] are rewritten (the caller's
        copies), the replacements counted as reroutes (resident by construction: never a hit) and the
        displaced experts' weights as the rerouted mass, each joining its accumulator as an admission
        candidate. Returns (nc, nrr)."""
        sel = ids[i]
        if rfam == RT_PRIOR:
            z = score[i]
            zlo = z[0]
            zhi = z[0]
            for e in range(1, E):
                if z[e] < zlo:
                    zlo = z[e]
                if z[e] > zhi:
                    zhi = z[e]
            st.route_d[0] += zhi - zlo
            st.route_d[1] += 1.0
            _prior_select(z, sel, k, rkeep, rlam * (st.route_d[0] / st.route_d[1]), expert_slot, rnew)
        else:
            z = score[i] if smode else w[i]  # (unused by cache-route's weights)
            _window_select(rank[i], k, rkeep, rwin, expert_slot, rnew)
        if _same_set(sel, rnew, k):
            return nc, 0
        _routed_weights(rfam, z, rnorm, sel, w[i], rnew, k, ralpha, rw)
        nrr = 0
        moved = 0.0
        for j in range(k):  # the displaced experts, in rank order
            if _index(rnew, k, sel[j]) < 0:
                nrr += 1
                moved += w[i, j]
                acc[sel[j]] += w[i, j]  # (as `candidate` does for a miss not fetched)
                cand[nc] = sel[j]
                nc += 1
        cnt[C_REROUTES] += nrr
        st.mass[M_REROUTE] += moved
        for q in range(k):
            ids[i, q] = rnew[q]
            w[i, q] = rw[q]
        return nc, nrr

    def hits(i, oi, st_):
        """Step 1: hits (pinned for the token: skey = IMAX on the integer-key paths, pin = the token's stamp
        otherwise; lfu with gamma 1 gives a hit its new key at once and protects the hits only if the
        token fetches, step 3); the misses are listed in mj in rank order, with served = the missed
        expert and slot = -1 until decided. Returns (nm misses, npn pinned slots in pslots)."""
        nm = 0
        npn = 0
        if lfu1:  # a hit's slot key moves up by one key step (skey holds every resident's composite key here)
            if orow:  # the per-slot outputs (without decisions nothing reads them under lfu)
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
                    skey[np.uint32(s)] += kstep
                    pslots[np.uint32(npn)] = s
                    npn += 1
                else:
                    mj[np.uint32(nm)] = j
                    nm += 1
            return nm, npn
        for j in range(k):
            e = ids[i, j]
            s = expert_slot[e]
            out_served[oi, j] = e
            out_slot[oi, j] = s
            if s >= 0:
                out_kind[oi, j] = HIT
                if fast:
                    skey[s] = IMAX
                else:  # (pin is read only by the float keys' and the queues' victim searches)
                    pin[s] = st_
                pslots[npn] = s
                npn += 1
            else:
                out_kind[oi, j] = MISS
                mj[nm] = j
                nm += 1
        return nm, npn

    def drop(oi, j):
        """A miss nothing serves: DROP, served -1 (its slot stays -1)."""
        out_kind[oi, j] = DROP
        out_served[oi, j] = -1

    def candidate(e, wj, nc):
        """A miss not fetched: its gate weight joins e's accumulator, e an admission candidate; returns nc."""
        acc[e] += wj
        cand[nc] = e
        return nc + 1

    def miss_rule(i, oi, nm, npn, nc, st_):
        """Steps 2-3 and the fallbacks other than substitute: each miss's decision, the fetches in rank
        order through claim. Returns (nf, nh, nlow, ndrop, nneed, mtok, ltok, nc, npn): nneed misses left
        to the substitute fallback (in sj), mtok / ltok the token's substituted / lowbit mass so far."""
        nf = 0
        nh = 0
        nlow = 0
        ndrop = 0
        nneed = 0
        mtok = 0.0
        ltok = 0.0
        for q_ in range(nm):
            j = mj[q_]
            e = ids[i, j]
            fetch = _fetches(rule, j, w[i, j], tau, tau_high)
            if fetch and nf == fcap:  # fetch cap reached: the fallback, as if the rule had not fetched it
                fetch = False
            if fetch:
                if lfu1 and nf == 0:  # the token's first fetch: protect its hits now (their slot keys kept)
                    for q in range(npn):
                        sq = pslots[q]
                        psk[q] = skey[sq]
                        skey[sq] = IMAX
                s, vq = claim(e, st_)  # a victim exists: C_l - P_l >= k
                if vq >= 0:
                    cand[nc] = vq
                    nc += 1
                acc[e] = 0.0
                out_kind[oi, j] = FETCH
                out_slot[oi, j] = s
                pslots[npn] = s
                npn += 1
                nf += 1
            elif fallback == F_SUBSTITUTE:
                out_kind[oi, j] = SUB
                sj[nneed] = j
                nneed += 1
            elif fallback == F_HOST:  # served e, slot -1 (as listed)
                out_kind[oi, j] = HOST
                nh += 1
            elif fallback == F_LOWBIT:  # lowbit and drop: the accumulator and an admission candidate
                wj = w[i, j]
                out_kind[oi, j] = LOWBIT
                nlow += 1
                ltok += wj
                nc = candidate(e, wj, nc)
            elif fallback == F_DROP:
                wj = w[i, j]
                drop(oi, j)
                ndrop += 1
                mtok += wj
                nc = candidate(e, wj, nc)
            else:  # unreachable: the import check gives every FALLBACKS entry its branch
                raise ValueError("run_layer: a fallback without its branch in miss_rule")
        return nf, nh, nlow, ndrop, nneed, mtok, ltok, nc, npn

    def substitutes(i, oi, nneed, nc):
        """Step 4: substitutes in rank order, after all fetches. ranking[:k] is the selection (each entry a
        hit, a fetch or a non-resident miss) and the ranking holds distinct ids, so "resident and not used
        by this token" is just "resident" from position k on: the substitutes are the first nneed resident
        entries of ranking[k:], collected branch-free (store every entry, advance on a resident one); with
        router scores, one pass over the resident slots (_best_resident). Returns (nsub, ndrop, mass, nc)."""
        nfound = 0
        if smode:
            for j in range(k):
                sel_mark[ids[i, j]] = i
            nfound = best_resident(score[i], sel_mark, i, slot_expert, cap, nneed, subs)
        else:
            m = k
            while nfound < nneed and m < M:
                c = rank[i, m]
                subs[nfound] = c
                nfound += expert_slot[c] >= 0
                m += 1
        nsub = 0
        ndrop = 0
        mtok = 0.0
        for q_ in range(nneed):  # the q-th substitute (if found) serves the q-th of these misses
            j = sj[q_]
            e = ids[i, j]
            wj = w[i, j]
            if q_ < nfound:
                found = subs[q_]
                out_served[oi, j] = found
                out_slot[oi, j] = expert_slot[found]
                nsub += 1
            else:
                drop(oi, j)
                ndrop += 1
            mtok += wj
            nc = candidate(e, wj, nc)
        return nsub, ndrop, mtok, nc

    def rekey(i, oi, t, nm, npn, nf):
        """Step 5: the eviction kind's touch (evict.py; lru, crf and s3fifo: full-precision computes only);
        the integer-key paths also re-key this token's pinned slots."""
        if lfu1:  # (every key and the hits' slot keys are up to date from step 1)
            if nf > 0:  # unprotect the hits (their slot keys back) and key the fetched slots
                for q_ in range(k - nm):
                    skey[pslots[q_]] = psk[q_]
                for q_ in range(k - nm, npn):
                    s = pslots[q_]
                    e = slot_expert[s]
                    skey[s] = ek.slot_key(key[e], e, E, s, sb)
        elif touch == T_LFU:
            for e in range(E):
                key[e] = ek.lfu_decay(key[e], gamma)
            for j in range(k):
                key[ids[i, j]] += 1.0
        elif touch == T_LFUDA:
            age = qstate[Q_AGE]
            for j in range(k):
                e = ids[i, j]
                age_count[e], key[e] = ek.lfuda_touch(age, age_count[e])
            for q_ in range(npn):
                s = pslots[q_]
                e = slot_expert[s]
                skey[s] = ek.slot_key(key[e], e, E, s, sb)
        elif touch == T_LRU:
            for j in range(k):
                if out_kind[oi, j] <= SUB:
                    e = out_served[oi, j]
                    key[e] = t
                    s = out_slot[oi, j]
                    skey[s] = ek.slot_key(t, e, E, s, sb)
        elif touch == T_CRF:
            for e in range(E):
                key[e] = ek.crf_decay(key[e], decay)
            for j in range(k):
                if out_kind[oi, j] <= SUB:
                    key[out_served[oi, j]] += 1.0
        elif touch == T_S3FIFO:  # hits and substitutes (a fetch is the load, freq 0)
            for j in range(k):
                if out_kind[oi, j] == HIT or out_kind[oi, j] == SUB:
                    e = out_served[oi, j]
                    age_count[e] = ek.s3_touch(age_count[e])
        elif touch == T_BELADY:  # minus the next use
            for j in range(k):
                key[ids[i, j]] = -nxt[i, j]
        else:  # unreachable: the import check below gives every TOUCHES entry its branch
            raise ValueError("run_layer: an eviction touch without its branch in rekey")

    def queue_admissions(i, t, nc, q_head, q_len):
        """Step 6: queue the candidates with a[e] >= beta, largest a first (ties lower id); returns q_len."""
        nq = 0
        for c_ in range(nc):
            e = cand[c_]
            if acc[e] >= beta and not queued[e] and expert_slot[e] < 0:
                queued[e] = True  # (also de-duplicates the candidates)
                p = nq  # insertion sort by (-acc, id)
                while p > 0 and (acc[cand[p - 1]] < acc[e] or (acc[cand[p - 1]] == acc[e] and cand[p - 1] > e)):
                    cand[p] = cand[p - 1]
                    p -= 1
                cand[p] = e
                nq += 1
        for c_ in range(nq):
            e = cand[c_]
            tail = (q_head + q_len) % qcap
            q_exp[tail] = e
            q_due[tail] = t  # waiting (start_copies sets the due token when its copy starts)
            q_len += 1
            acc[e] = 0.0
        return q_len

    def start_copies(i, t, q_head, q_len, ns):
        """Step 6, after the queueing: the ring's waiting entries (after its ns started ones) start their copies
        in queue order while the layer has a free copy buffer (unbounded: all), each due d tokens later; a
        waiting expert that became resident meanwhile leaves the queue without a copy (admissions_skipped).
        The copies started go to the log and the event column. Returns (q_head, q_len, ns)."""
        nst = 0
        while q_len > ns and (nbuf < 0 or ns < nbuf):
            pos = (q_head + ns) % qcap
            e = q_exp[pos]
            if expert_slot[e] >= 0:  # out of the ring: the started entries move up one place
                queued[e] = False
                cnt[C_ADM_SKIPPED] += 1
                for j_ in range(ns - 1, -1, -1):
                    a_ = (q_head + j_) % qcap
                    b_ = (a_ + 1) % qcap
                    q_exp[b_] = q_exp[a_]
                    q_due[b_] = q_due[a_]
                q_head = (q_head + 1) % qcap
                q_len -= 1
                continue
            if q_due[pos] < t:
                cnt[C_ADM_WAITED] += 1
            q_due[pos] = t + delay
            ns += 1
            nst += 1
            _log(q_log, n_logs, 1, t, e, -1)
        ev[i, EV_ADM_QUEUED] += nst
        return q_head, q_len, ns

    def hint(ia):
        """Hints only: the rows token ia reads and writes, on their way while an earlier token is decided."""
        if ia < T:
            _prefetch(ids, ia, 0)
            _prefetch(w, ia, 0)
            _prefetch(w, ia, k - 1)  # a row of w may span two cache lines
            if walk:
                _prefetch(rank, ia, k)  # where the substitute walk starts

    def events(i, nf, nh, nlow, ndrop):
        """The token's cost-model events: device computes, fetches, host and low-bit computes."""
        ev[i, EV_DEV] += k - nh - nlow - ndrop
        ev[i, EV_FETCH] += nf
        ev[i, EV_HOST] += nh
        ev[i, EV_LOWBIT] += nlow

    def key_slots():
        """The slot keys of every slot from the keys (integer-key kinds), before the chunk."""
        if fast:
            for s in range(cap):
                e = slot_expert[s]
                skey[s] = ek.slot_key(key[e], e, E, s, sb) if e >= 0 else IMAX

    def store(q_head, q_len, ns, stamp, msum, lsum, n_calls, n_hits, n_fetch, n_subs, n_drops):
        """After the chunk: the admission ring and stamp back into qstate, the masses and counters added."""
        qstate[Q_HEAD] = q_head
        qstate[Q_LEN] = q_len
        qstate[Q_NSTART] = ns
        qstate[Q_STAMP] = stamp
        st.mass[M_SUB] += msum
        st.mass[M_LOWBIT] += lsum
        cnt[C_CALLS] += n_calls
        cnt[C_HITS] += n_hits
        cnt[C_FETCHES] += n_fetch
        cnt[C_SUBS] += n_subs
        cnt[C_DROPS] += n_drops
        for c_ in range(N_INT):
            st.counters[c_] += cnt[c_]

    n_calls = n_hits = n_fetch = n_subs = n_drops = 0
    q_head, q_len, ns, stamp = qstate[Q_HEAD], qstate[Q_LEN], qstate[Q_NSTART], qstate[Q_STAMP]
    msum = lsum = 0.0
    key_slots()
    for i in range(T):
        hint(i + PF_AHEAD)
        oi = i * orow  # the outputs' row: the token's, or the one scratch row
        if not valid[i]:
            for j in range(k):
                out_kind[oi, j] = -1
                out_served[oi, j] = -1
                out_slot[oi, j] = -1
            continue
        t = t0 + i
        plim = npw
        if npw > 0 and nbuf >= 0:  # the copies were issued before the admissions due now: ns buffers busy
            plim = prefetch_cut(i, nbuf - ns)
        q_head, q_len, ns, stamp, nc, nts = admit_due(i, t, q_head, q_len, ns, stamp, 0)
        stamp, nc, npl = prefetch_list(i, t, stamp, nc, nts, plim)
        nrr = 0
        if rfam != RT_OFF:
            nc, nrr = route(i, nc)
        stamp += 1
        st_ = stamp
        n_calls += k
        nm, npn = hits(i, oi, st_)
        n_hits += npn - nrr  # (a rerouted expert is resident: counted as a reroute, not a hit)
        nf, nh, nlow, ndrop, nneed, mtok, ltok, nc, npn = miss_rule(i, oi, nm, npn, nc, st_)
        n_fetch += nf
        cnt[C_HOST] += nh
        cnt[C_LOWBIT] += nlow
        if nneed > 0:
            nsub, nd, ms, nc = substitutes(i, oi, nneed, nc)
            n_subs += nsub
            ndrop += nd
            mtok += ms
        n_drops += ndrop
        msum += mtok
        lsum += ltok
        rekey(i, oi, t, nm, npn, nf)
        events(i, nf, nh, nlow, ndrop)
        if use_adm:
            if nc > 0:
                q_len = queue_admissions(i, t, nc, q_head, q_len)
            if q_len > ns:
                q_head, q_len, ns = start_copies(i, t, q_head, q_len, ns)
    store(q_head, q_len, ns, stamp, msum, lsum, n_calls, n_hits, n_fetch, n_subs, n_drops)


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
