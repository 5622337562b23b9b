"""The one policy kernel: every miss rule, fallback, eviction key, admission and prefetch rule of docs/policies.md.

Compiled with numba. Caches are per layer and independent, so the kernel runs one
layer over a chunk of tokens at a time (`run_layer`); the simulator calls it once
per layer over a whole trace, the emulation once per layer per chunk, the engine
once per layer per decoded token. `PolicyCache` holds the state of every layer
and is the only way callers drive the kernel.

Per token (docs/policies.md, "Per token, per layer, in this order" and "Additions"):
  0. apply the admissions that are due (queued at t - d or earlier), batch by batch
  0b. prefetch: load the experts of this token's predicted list P that are not resident
      (victims: min key, never in P nor admitted at this token); no key changes
  1. hits   2. miss rule (fetch_all, threshold, first_choice, substitute_all, band; at most fetch_cap fetches)
  3. fetches in rank order (victim = min key, unpinned)
  4. fallback of the non-fetched misses: substitute (first resident, unused experts of the
     ranking, else drop), drop, host or lowbit
  5. bookkeeping (masses, frequency/recency keys, admission accumulator)
  6. queue admissions (a[e] >= beta, largest a first)

Shape of the code: `run_layer(tok, t0, pol, st, out)` takes the layer's input (`Tokens`), the policy as
one record (`runtime.core.policy.kernel_record`: one field per parameter-table row with a `kernel` encoding,
read here as `pol.<field>`), the layer's cache (`LayerState`, a row of the `CacheState` that PolicyCache
holds) and its outputs (`Outputs`). Every load into a slot (fetch, admission, prefetch) goes through
`claim`, a closure in run_layer (numba inlines it; the state arrays are not passed, so no reference counts).
A new policy field is one `_p(..., kernel=(name, encoder))` row in runtime/core/policy.py and its use here.
The one source is compiled twice (`_build_run_layer`): `run_layer` for every policy and `run_layer_lean`,
in which the paper's presets' features are constants (lfu with gamma 1, the substitute fallback, no fetch
cap, pinning, prefetch or router scores); `PolicyCache` picks the lean build when the policy allows it.
Python enters the kernel through `run_layers` (one build's run_layer over a range of layers): `step` for one
layer (emulation, engine), `step_layers` for every layer of a trace in one call (the simulator).

Where the time goes (docs/performance.md, issue 17): a replay streams its trace from memory, so run_layer
asks for the rows of token i + PF_AHEAD while it decides token i (`_prefetch`, a hint); per token the
hits pass lists the misses and the pinned slots, so the miss rule, the fallbacks and the re-keying visit
only those; on the integer fast paths a slot key carries its slot in its low bits (`_ikey`), so a victim
is one vectorised minimum over the slots; under lfu with gamma 1 a hit moves its slot key by one key step;
the simulator asks for no per-slot decisions (`step(decisions=False)`: one scratch row).

Input contract (checked by runtime/formats/trace.py for files, true by construction in the adapters):
a ranking row starts with the token's selection and holds distinct expert ids. Instead of a full
ranking the adapters pass the router scores it sorts (descending, ties lower id); the substitute
search then scans the resident slots for the best ones (`_best_resident`): the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from runtime.core.errors import InputError
from runtime.core.policy import (
    EVICT_CODE,
    FALLBACK_CODE,
    RULE_CODE,
    PolicyConfig,
    kernel_record,
    pinned_count,
)

# decision kinds, per token, layer and top-k slot j
HIT, FETCH, SUB, DROP, HOST, LOWBIT = 0, 1, 2, 3, 4, 5
KIND_NAMES = ("hit", "fetch", "substitute", "drop", "host", "lowbit")
_MISS = -1

# THE counter list: integer counters (column order of PolicyCache.counters), then the float counters
INT_COUNTERS = ("calls", "hits", "fetches", "substitutions", "drops", "host_computes", "lowbit_computes",
                "admissions", "admissions_skipped", "prefetches", "prefetch_used")
FLOAT_COUNTERS = ("substituted_mass", "lowbit_mass")
COUNTER_NAMES = INT_COUNTERS + FLOAT_COUNTERS
(C_CALLS, C_HITS, C_FETCHES, C_SUBS, C_DROPS, C_HOST, C_LOWBIT, C_ADM, C_ADM_SKIPPED, C_PREF,
 C_PREF_USED) = range(len(INT_COUNTERS))
N_INT = len(INT_COUNTERS)
M_SUB, M_LOWBIT = range(len(FLOAT_COUNTERS))
# per token-layer event columns (cost model input): full-precision device computes (hits, fetches,
# substitutes), sync fetches, host computes, admissions queued after / popped before the token,
# low-precision computes, prefetch loads issued for this token-layer
EV_DEV, EV_FETCH, EV_HOST, EV_ADM_QUEUED, EV_ADM_POPPED, EV_LOWBIT, EV_PREFETCH = range(7)
N_EV = 7

R_FETCH_ALL, R_THRESHOLD, R_FIRST_CHOICE, R_SUBSTITUTE_ALL, R_BAND = (RULE_CODE[r] for r in
    ("fetch_all", "threshold", "first_choice", "substitute_all", "band"))
F_SUBSTITUTE, F_DROP, F_HOST, F_LOWBIT = (FALLBACK_CODE[f] for f in ("substitute", "drop", "host", "lowbit"))
K_LFU, K_LRU, K_CRF, K_BELADY, K_LFUDA = (EVICT_CODE[e] for e in ("lfu", "lru", "crf", "belady", "lfuda"))
Q_AGE = 4  # LayerState.qstate[Q_AGE]: lfuda's inflation value A (an integer)


@intrinsic
def _prefetch(typingctx, arr, i, j):
    """`_prefetch(arr, i, j)` asks the CPU for the cache line of the 2-D array's element [i, j] ahead of its
    use (for reading); a hint only (no fault, no effect on any value)."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        idx = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:], strict=True)]
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, idx, wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, locality 3, data cache
        return context.get_dummy_value()

    return types.void(arr, i, j), codegen


# run_layer asks for token i + PF_AHEAD's input rows while deciding token i: a replay streams
# the trace from memory (tens of MB) and a token's decisions take ~100 ns, less than a miss to DRAM
PF_AHEAD = 8


@njit(cache=True)
def _victim(slot_expert, p0, cap, key, pin, stamp):
    """Slot of the resident with the smallest key (ties: lower id) whose pin != stamp among slots p0..cap-1
    (slots 0..p0-1 hold the pinned hot set); -1 if none."""
    best = -1
    bk = 0.0
    be = 0
    for s in range(p0, cap):
        if pin[s] == stamp:
            continue
        e = slot_expert[s]
        kk = key[e]
        if best < 0 or kk < bk or (kk == bk and e < be):
            best = s
            bk = kk
            be = e
    return best


_IMAX = np.iinfo(np.int64).max


@njit(cache=True)
def _victim_int(skey, p0, cap, sb):
    """Fast path: slot of the smallest slot key among slots p0..cap-1 (slots protected for the token hold
    _IMAX): one pass, as a slot key carries its slot in its low `sb` bits (_ikey)."""
    m = _IMAX
    if p0 == 0:
        for s in range(cap):
            v = skey[s]
            m = v if v < m else m
    else:
        for s in range(p0, cap):
            v = skey[s]
            m = v if v < m else m
    if m == _IMAX:
        return -1
    return m & ((np.int64(1) << sb) - 1)


@njit(cache=True, inline="always")
def _ikey(evict, key, e, E, s, sb):
    """Slot key of slot `s` holding `e` for lfu (gamma=1), lfuda and lru: the composite key * E + id (smallest
    key, ties lower id, in one int64), shifted left by `sb` bits with the slot in them (2**sb >= C_l): the
    slots' order is the composite keys' (distinct per slot) and a minimum names its slot."""
    if evict == K_LRU:
        return (((np.int64(key[e]) + 1) * E + e) << sb) | s
    return ((np.int64(key[e]) * E + e) << sb) | s


@njit(cache=True, inline="always")
def _best_resident(score_row, sel_mark, i, slot_expert, cap, nneed, subs):
    """The first `nneed` entries of the full ranking's tail (every expert outside token i's selection,
    those with `sel_mark[e] == i`, by descending score, ties lower id) that are resident, found without
    sorting: one pass over the resident slots keeping the best `nneed` by (score desc, id asc).
    Returns how many were found."""
    nfound = 0
    for s in range(cap):
        e = slot_expert[s]
        if e < 0 or sel_mark[e] == i:
            continue
        v = score_row[e]
        pos = nfound  # insertion point in subs[:nfound], kept in rank order
        while pos > 0 and (score_row[subs[pos - 1]] < v or (score_row[subs[pos - 1]] == v and subs[pos - 1] > e)):
            pos -= 1
        if pos >= nneed:
            continue
        last = min(nfound, nneed - 1)
        for q in range(last, pos, -1):
            subs[q] = subs[q - 1]
        subs[pos] = e
        if nfound < nneed:
            nfound += 1
    return nfound


@njit(cache=True)
def _free_slot(slot_expert, cap):
    for s in range(cap):
        if slot_expert[s] < 0:
            return s
    return -1


class Tokens(NamedTuple):
    """One layer's input over a chunk of tokens."""

    ids: np.ndarray  # [T, k] int32 selection
    w: np.ndarray  # [T, k] float64 gate weights
    rank: np.ndarray  # [T, M] int32 candidate ranking (starts with the selection)
    valid: np.ndarray  # [T] bool
    score: np.ndarray  # [T, E] float64 router scores standing for the full ranking (adapters), or [0, 0]: use rank
    nxt: np.ndarray  # [T, k] float64 next use (belady), or [0, k]
    pred: np.ndarray  # [T, P] int32 predicted lists (-1 = none), or [0, 0]


class LayerState(NamedTuple):
    """One layer's cache (views of PolicyCache's [L, ...] arrays), mutated in place by run_layer."""

    cap: int  # C_l
    npin: int  # P_l: slots 0..P_l-1 hold the pinned hot set (never a victim)
    slot_expert: np.ndarray  # [C] int32 expert in each slot (-1 free)
    expert_slot: np.ndarray  # [E] int32 slot of each expert (-1 not resident)
    key: np.ndarray  # [E] float64 eviction key
    skey: np.ndarray  # [C] int64 composite integer key per slot (fast paths; _IMAX = protected)
    acc: np.ndarray  # [E] float64 admission accumulator a[e]
    queued: np.ndarray  # [E] bool
    pin: np.ndarray  # [C] int64 stamp of the step that protects the slot
    qstate: np.ndarray  # [5] int64 queue head, queue length, stamp, resident count, lfuda's A
    q_exp: np.ndarray  # [E + 1] int32 admission queue (ring)
    q_due: np.ndarray  # [E + 1] int64 due token of each queued expert
    counters: np.ndarray  # [N_INT] int64
    mass: np.ndarray  # [2] float64
    age_count: np.ndarray  # [E] int64 lfuda's count c[e]


class CacheState(NamedTuple):
    """Every layer's cache: PolicyCache's [L, ...] arrays (row l is layer l's LayerState, `_layer_state`)."""

    caps: np.ndarray  # [L] int64 C_l
    npin: np.ndarray  # [L] int64 P_l
    slot_expert: np.ndarray  # [L, Cmax] int32
    expert_slot: np.ndarray  # [L, E] int32
    key: np.ndarray  # [L, E] float64
    skey: np.ndarray  # [L, Cmax] int64
    acc: np.ndarray  # [L, E] float64
    queued: np.ndarray  # [L, E] bool
    pin: np.ndarray  # [L, Cmax] int64
    qstate: np.ndarray  # [L, 5] int64
    q_exp: np.ndarray  # [L, E + 1] int32
    q_due: np.ndarray  # [L, E + 1] int64
    counters: np.ndarray  # [L, N_INT] int64
    mass: np.ndarray  # [L, 2] float64
    age_count: np.ndarray  # [L, E] int64


class Outputs(NamedTuple):
    """What run_layer writes: per-slot decisions, per-token events, and the logs of the plan."""

    kind: np.ndarray  # [T, k] int8
    served: np.ndarray  # [T, k] int32
    slot: np.ndarray  # [T, k] int32
    ev: np.ndarray  # [T, N_EV] int32
    adm_log: np.ndarray  # [n, 3] int64 (token, expert, slot)
    q_log: np.ndarray  # [n, 2] int64 (token, expert)
    pf_log: np.ndarray  # [n, 3] int64 (token, expert, slot)
    n_logs: np.ndarray  # [3] int64 entries written (may exceed the logs' length)


def _build_run_layer(lean: bool):
    """run_layer for every policy (`lean` False), or compiled for the paper's presets' features only (`lean`
    True: lfu with gamma 1, the substitute fallback, admission or none, no fetch cap, pinning, prefetch or
    router scores). The same source: `lean` is a constant to numba, so the lean build drops the other
    branches and their live values (a smaller function whose hot loops keep their pointers in registers)."""

    @njit(cache=True, error_model="numpy")
    def run_layer(tok, t0, pol, st, out):
        """Run one layer's cache over tokens t0 .. t0+T-1: `tok` Tokens, `pol` the policy record
        (runtime.core.policy.kernel_record), `st` LayerState (mutated in place), `out` Outputs."""
        ids, w, rank, valid, score, nxt, pred = tok
        out_kind, out_served, out_slot, ev, adm_log, q_log, pf_log, n_logs = out
        rule, tau, tau_high, beta, decay, delay = pol.rule, pol.tau, pol.tau_high, pol.beta, pol.decay, pol.delay
        # the lean build (`lean`, a compile-time constant) knows these: lfu with gamma 1, the substitute fallback,
        # no fetch cap (-1), no pinned slots, no prefetch, no router scores (PolicyCache.step picks it)
        evict = K_LFU if lean else pol.evict
        gamma = 1.0 if lean else pol.gamma
        fallback = F_SUBSTITUTE if lean else pol.fallback
        fcap = -1 if lean else pol.fetch_cap
        cap, age_count = st.cap, st.age_count
        p0 = 0 if lean else st.npin
        aging = evict == K_LFUDA
        slot_expert, expert_slot, key, skey, acc, queued, pin = (st.slot_expert, st.expert_slot, st.key, st.skey, st.acc,
                                                                 st.queued, st.pin)
        qstate, q_exp, q_due = st.qstate, st.q_exp, st.q_due
        T, k = ids.shape
        M = rank.shape[1]
        E = expert_slot.shape[0]
        qcap = q_exp.shape[0]
        smode = False if lean else score.shape[0] == T  # router scores stand for the full ranking
        orow = 1 if out_kind.shape[0] == T else 0  # per-slot outputs per token, or one scratch row (no decisions)
        npw = 0 if lean else (pred.shape[1] if pred.shape[0] == T else 0)  # predicted-list width (0: no prefetch)
        use_adm = beta > 0.0
        fast = (evict == K_LFU and gamma == 1.0) or evict == K_LRU or aging  # integer keys: skey mirrors them
        sb = 0  # slot bits of a slot key (_ikey): 2**sb >= cap
        while (1 << sb) < cap:
            sb += 1
        cand = np.empty(k + qcap + npw + k, np.int64)  # admission candidates: non-fetched misses, evicted experts
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
        lfu1 = evict == K_LFU and gamma == 1.0
        kstep = np.int64(E) << sb  # lfu1: a key's +1 in its slot key (_ikey)

        def claim(e, stamp_):
            """THE slot claim (fetch, admission, prefetch): put `e` in a free slot if the layer has one, else in
            the victim's (smallest key among the slots p0.. whose pin != stamp_; fast: smallest skey), evicting
            the victim; counts the resident (qstate[3]); under lfuda the load ages the keys. The
            claimed slot is pinned with `stamp_`. Returns (slot, requeue): slot -1 when nothing is evictable
            (nothing changed); requeue the evicted expert when admission is on and its accumulator is at beta
            already (only after a prefetch: a is not reset by one), for the caller's admission candidates,
            else -1. A closure, so numba inlines it at each call with the state arrays as they are: a helper
            taking the arrays as arguments paid 10-12 atomic reference-count updates per claim, about 45% of
            fetch-every-miss's time (docs/performance.md, "The claim without reference counts")."""
            v = -1
            if qstate[3] < cap:
                s = _free_slot(slot_expert, cap)
                qstate[3] += 1
            else:
                s = _victim_int(skey, p0, cap, sb) if fast else _victim(slot_expert, p0, cap, key, pin, stamp_)
                if s >= 0:
                    v = slot_expert[s]
                    expert_slot[v] = -1
            if s >= 0:
                slot_expert[s] = e
                expert_slot[e] = s
                pin[s] = stamp_
                if fast:
                    skey[s] = _IMAX
                if aging:  # lfuda: the victim leaves first (A = max(A, K[v]), c[v] = floor(c[v] / 2)), then K[e] = A + c[e]
                    if v >= 0:
                        kv = np.int64(key[v])
                        if kv > qstate[Q_AGE]:
                            qstate[Q_AGE] = kv
                        age_count[v] //= 2
                    key[e] = np.float64(qstate[Q_AGE] + age_count[e])
            return s, (v if v >= 0 and use_adm and acc[v] >= beta else -1)

        cnt = np.zeros(N_INT, np.int64)  # the rarer counters (the per-token ones are the scalars below)
        n_calls = 0
        n_hits = 0
        n_fetch = 0
        n_subs = 0
        n_drops = 0
        q_head = qstate[0]
        q_len = qstate[1]
        stamp = qstate[2]
        msum = 0.0
        lsum = 0.0
        if fast:
            for s in range(cap):
                e = slot_expert[s]
                skey[s] = _ikey(evict, key, e, E, s, sb) if e >= 0 else _IMAX
        for i in range(T):
            ia = i + PF_AHEAD
            if ia < T:  # hints only: the rows token ia reads and writes, on their way while token i is decided
                _prefetch(ids, ia, 0)
                _prefetch(w, ia, 0)
                _prefetch(w, ia, k - 1)  # a row of w may span two cache lines
                if walk:
                    _prefetch(rank, ia, k)  # where the substitute walk starts
            oi = i * orow  # the outputs' row: the token's, or the one scratch row
            if not valid[i]:
                for j in range(k):
                    out_kind[oi, j] = -1
                    out_served[oi, j] = -1
                    out_slot[oi, j] = -1
                continue
            t = t0 + i
            nc = 0  # admission candidates of this token
            nts = 0
            # 0. admissions due before this token, batch by batch (a batch = same due token)
            while q_len > 0 and q_due[q_head] <= t:
                due = q_due[q_head]
                stamp += 1
                bstamp = stamp
                nb = 0
                while q_len > 0 and q_due[q_head] == due:
                    e = q_exp[q_head]
                    q_head = (q_head + 1) % qcap
                    q_len -= 1
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
                    n = n_logs[0]
                    if n < adm_log.shape[0]:
                        adm_log[n, 0] = t
                        adm_log[n, 1] = e
                        adm_log[n, 2] = s
                    n_logs[0] = n + 1
                if fast:  # re-key the batch's slots (they were pinned against each other)
                    for b_ in range(nb):
                        s = bslots[b_]
                        skey[s] = _ikey(evict, key, slot_expert[s], E, s, sb)
            # 0b. prefetch this token's predicted list (no f, a or lru change)
            npl = 0
            if npw > 0 and pred[i, 0] >= 0:
                stamp += 1
                ps = stamp
                for b_ in range(nts):  # protected: admitted at this token ...
                    s = tslots[b_]
                    pin[s] = ps
                    if fast:
                        skey[s] = _IMAX
                for p in range(npw):  # ... and the members of P
                    e = pred[i, p]
                    if e < 0:
                        break
                    s = expert_slot[e]
                    if s >= 0:
                        pin[s] = ps
                        if fast:
                            skey[s] = _IMAX
                for p in range(npw):
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
                    n = n_logs[2]
                    if n < pf_log.shape[0]:
                        pf_log[n, 0] = t
                        pf_log[n, 1] = e
                        pf_log[n, 2] = s
                    n_logs[2] = n + 1
                if fast:  # re-key every protected slot
                    for b_ in range(nts):
                        s = tslots[b_]
                        skey[s] = _ikey(evict, key, slot_expert[s], E, s, sb)
                    for p in range(npw):
                        e = pred[i, p]
                        if e < 0:
                            break
                        s = expert_slot[e]
                        if s >= 0:
                            skey[s] = _ikey(evict, key, e, E, s, sb)
                cnt[C_PREF] += npl
                ev[i, EV_PREFETCH] += npl
            stamp += 1
            st_ = stamp
            n_calls += k
            # 1. hits (pinned for the token: skey = _IMAX on the fast paths, pin = the token's stamp otherwise;
            # lfu with gamma = 1 gives a hit its new key at once and protects the hits only if the token
            # fetches, step 3); the misses are listed in rank order, with served = the missed expert and
            # slot = -1 until decided
            nm = 0
            npn = 0  # pinned slots in pslots
            if lfu1:  # a hit's slot key moves up by one key step (skey holds every resident's composite key here)
                if orow:  # the per-slot outputs (without decisions nothing reads them under lfu)
                    for j in range(k):
                        e = ids[i, j]
                        s = expert_slot[e]
                        out_served[oi, j] = e
                        out_slot[oi, j] = s
                        out_kind[oi, j] = HIT if s >= 0 else _MISS
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
            else:
                for j in range(k):
                    e = ids[i, j]
                    s = expert_slot[e]
                    out_served[oi, j] = e
                    out_slot[oi, j] = s
                    if s >= 0:
                        out_kind[oi, j] = HIT
                        if fast:
                            skey[s] = _IMAX
                        else:  # (pin is read only by the float keys' _victim)
                            pin[s] = st_
                        pslots[npn] = s
                        npn += 1
                    else:
                        out_kind[oi, j] = _MISS
                        mj[nm] = j
                        nm += 1
            n_hits += npn
            if npl > 0:
                for p in range(npl):
                    e = pfe[p]
                    for j in range(k):
                        if ids[i, j] == e:
                            cnt[C_PREF_USED] += 1
                            break
            # 2.+3. miss rule; fetches in rank order; 4. fallbacks other than substitute
            nf = 0
            nh = 0
            nlow = 0
            ndrop = 0
            nneed = 0
            mtok = 0.0  # substituted mass of this token-layer
            ltok = 0.0  # lowbit mass of this token-layer
            for q_ in range(nm):
                j = mj[q_]
                e = ids[i, j]
                if rule == R_FETCH_ALL:
                    fetch = True
                elif rule == R_SUBSTITUTE_ALL:
                    fetch = False
                elif rule == R_BAND:
                    fetch = j == 0 or w[i, j] < tau or w[i, j] >= tau_high
                else:  # threshold, first_choice (tau = +inf)
                    fetch = j == 0 or w[i, j] >= tau
                if fetch and nf == fcap:  # fetch cap reached: the fallback, as if the rule had not fetched it
                    fetch = False
                if fetch:
                    if lfu1 and nf == 0:  # the token's first fetch: protect its hits now (their slot keys kept)
                        for q in range(npn):
                            sq = pslots[q]
                            psk[q] = skey[sq]
                            skey[sq] = _IMAX
                    # a victim exists: C_l - P_l >= k
                    s, vq = claim(e, st_)
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
                elif fallback == F_LOWBIT:
                    wj = w[i, j]
                    out_kind[oi, j] = LOWBIT
                    nlow += 1
                    ltok += wj
                    acc[e] += wj
                    cand[nc] = e
                    nc += 1
                else:  # drop
                    wj = w[i, j]
                    out_kind[oi, j] = DROP
                    out_served[oi, j] = -1
                    ndrop += 1
                    mtok += wj
                    acc[e] += wj
                    cand[nc] = e
                    nc += 1
            n_fetch += nf
            cnt[C_HOST] += nh
            cnt[C_LOWBIT] += nlow
            # 4. substitutes in rank order, after all fetches
            nsub = 0
            if nneed > 0:
                # ranking[:k] is the selection (each entry a hit, a fetch or a non-resident miss) and the ranking
                # holds distinct ids, so "resident and not used by this token" is just "resident" from position k
                # on, and the substitutes are the first nneed resident entries of ranking[k:], in rank order.
                # Collect them branch-free: store every entry, advance only on a resident one.
                # With `score` (the full ranking, E entries, given as the scores it sorts) the same entries
                # come from one pass over the resident slots instead (_best_resident).
                nfound = 0
                if smode:
                    for j in range(k):
                        sel_mark[ids[i, j]] = i
                    nfound = _best_resident(score[i], sel_mark, i, slot_expert, cap, nneed, subs)
                else:
                    m = k
                    while nfound < nneed and m < M:
                        c = rank[i, m]
                        subs[nfound] = c
                        nfound += expert_slot[c] >= 0
                        m += 1
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
                        out_kind[oi, j] = DROP
                        out_served[oi, j] = -1
                        ndrop += 1
                    mtok += wj
                    acc[e] += wj
                    cand[nc] = e
                    nc += 1
            n_subs += nsub
            n_drops += ndrop
            msum += mtok
            lsum += ltok
            # 5. keys (the fast paths also re-key this token's pinned slots); lru/crf: full-precision computes only
            if lfu1:  # (every key and the hits' slot keys are up to date from step 1)
                if nf > 0:  # unprotect the hits (their slot keys back) and key the fetched slots
                    for q_ in range(k - nm):
                        skey[pslots[q_]] = psk[q_]
                    for q_ in range(k - nm, npn):
                        s = pslots[q_]
                        e = slot_expert[s]
                        skey[s] = ((np.int64(key[e]) * E + e) << sb) | s
            elif evict == K_LFU:
                for e in range(E):
                    key[e] = gamma * key[e]
                for j in range(k):
                    key[ids[i, j]] += 1.0
            elif aging:  # lfuda: c[e] += 1, then K[e] = A + c[e]
                age = qstate[Q_AGE]
                for j in range(k):
                    e = ids[i, j]
                    age_count[e] += 1
                    key[e] = np.float64(age + age_count[e])
                for q_ in range(npn):
                    s = pslots[q_]
                    e = slot_expert[s]
                    skey[s] = (((age + age_count[e]) * E + e) << sb) | s
            elif evict == K_LRU:
                for j in range(k):
                    if out_kind[oi, j] <= SUB:
                        e = out_served[oi, j]
                        key[e] = t
                        s = out_slot[oi, j]
                        skey[s] = ((np.int64(t + 1) * E + e) << sb) | s
            elif evict == K_CRF:
                for e in range(E):
                    key[e] = decay * key[e]
                for j in range(k):
                    if out_kind[oi, j] <= SUB:
                        key[out_served[oi, j]] += 1.0
            else:  # belady: minus the next use
                for j in range(k):
                    key[ids[i, j]] = -nxt[i, j]
            ev[i, EV_DEV] += k - nh - nlow - ndrop
            ev[i, EV_FETCH] += nf
            ev[i, EV_HOST] += nh
            ev[i, EV_LOWBIT] += nlow
            # 6. queue admissions: largest a first, ties lower id
            if use_adm and nc > 0:
                nq = 0
                for c_ in range(nc):
                    e = cand[c_]
                    if acc[e] >= beta and not queued[e] and expert_slot[e] < 0:
                        queued[e] = True  # (also de-duplicates the candidates)
                        # insertion sort by (-acc, id)
                        p = nq
                        while p > 0 and (acc[cand[p - 1]] < acc[e] or (acc[cand[p - 1]] == acc[e] and cand[p - 1] > e)):
                            cand[p] = cand[p - 1]
                            p -= 1
                        cand[p] = e
                        nq += 1
                for c_ in range(nq):
                    e = cand[c_]
                    tail = (q_head + q_len) % qcap
                    q_exp[tail] = e
                    q_due[tail] = t + delay
                    q_len += 1
                    acc[e] = 0.0
                    n = n_logs[1]
                    if n < q_log.shape[0]:
                        q_log[n, 0] = t
                        q_log[n, 1] = e
                    n_logs[1] = n + 1
                ev[i, EV_ADM_QUEUED] += nq
        qstate[0] = q_head
        qstate[1] = q_len
        qstate[2] = stamp
        st.mass[M_SUB] += msum
        st.mass[M_LOWBIT] += lsum
        cnt[C_CALLS] += n_calls
        cnt[C_HITS] += n_hits
        cnt[C_FETCHES] += n_fetch
        cnt[C_SUBS] += n_subs
        cnt[C_DROPS] += n_drops
        for c_ in range(N_INT):
            st.counters[c_] += cnt[c_]

    return run_layer


run_layer = _build_run_layer(False)
run_layer_lean = _build_run_layer(True)


@njit(cache=True, inline="always")
def _layer_state(cs, l_):
    """Layer l_'s LayerState: views of row l_ of CacheState `cs`'s arrays."""
    return LayerState(cs.caps[l_], cs.npin[l_], cs.slot_expert[l_], cs.expert_slot[l_], cs.key[l_], cs.skey[l_],
                      cs.acc[l_], cs.queued[l_], cs.pin[l_], cs.qstate[l_], cs.q_exp[l_], cs.q_due[l_],
                      cs.counters[l_], cs.mass[l_], cs.age_count[l_])


def _build_run_layers(layer_fn):
    """run_layers over one build of run_layer: the kernel's one entry from Python (PolicyCache.step for one
    layer, PolicyCache.step_layers for a whole trace), so a replay of L layers is one call, not L."""

    @njit(cache=True)
    def run_layers(tok, t0, pol, cs, out, l0):
        """Layers l0 .. l0+n-1 in order over tokens t0..: `tok` Tokens and `out` Outputs whose arrays carry a
        leading layer axis ([n, T, k] ...: row i is layer l0 + i), `cs` the CacheState (mutated in place)."""
        for i in range(tok.ids.shape[0]):
            layer_fn(Tokens(tok.ids[i], tok.w[i], tok.rank[i], tok.valid[i], tok.score[i], tok.nxt[i], tok.pred[i]), t0,
                     pol, _layer_state(cs, l0 + i),
                     Outputs(out.kind[i], out.served[i], out.slot[i], out.ev[i], out.adm_log[i], out.q_log[i],
                             out.pf_log[i], out.n_logs[i]))

    return run_layers


run_layers = _build_run_layers(run_layer)
run_layers_lean = _build_run_layers(run_layer_lean)


@njit(cache=True)
def next_use(ids, valid, E, t0):
    """Belady helper for one layer. ids [T, k], valid [T]. Returns nxt [T, k] (next valid token index
    > t selecting ids[t, j], inf if none) and first [E] (first valid token selecting e, inf if none)."""
    T, k = ids.shape
    nxt = np.full((T, k), np.inf)
    last = np.full(E, np.inf)
    for i in range(T - 1, -1, -1):
        if not valid[i]:
            continue
        for j in range(k):
            nxt[i, j] = last[ids[i, j]]
        for j in range(k):
            last[ids[i, j]] = t0 + i
    return nxt, last


def warmup() -> None:
    """Compile (or load from numba's cache) the kernel before anything is timed."""
    pc = PolicyCache(PolicyConfig(rule="threshold", tau=0.1, beta=0.5, prefetch="lookahead"), 4, 1, np.array([1]),
                     [np.array([0])])
    pc.step(0, np.array([[1], [2]]), np.array([[0.9], [0.1]]), np.array([[1, 0], [2, 0]]), nxt=np.zeros((2, 1)),
            predicted=np.array([[3], [-1]]))
    pc.step(0, np.array([[1], [2]]), np.array([[0.9], [0.1]]), scores=np.zeros((2, 4)))
    pc.step(0, np.array([[1], [2]]), np.array([[0.9], [0.1]]), scores=np.zeros((2, 6))[:, 1:5])  # strided
    lean = PolicyCache(PolicyConfig(rule="threshold", tau=0.1, beta=0.5), 4, 1, np.array([1]), [np.array([0])])
    lean.step(0, np.array([[1], [2]]), np.array([[0.9], [0.1]]), np.array([[1, 0], [2, 0]]))
    lean.step(0, np.array([[1], [2]]), np.array([[0.9], [0.1]]), np.array([[1, 0], [2, 0]]), decisions=False)
    ids, w, rk = np.array([[[1], [2]]], np.int32), np.array([[[0.9], [0.1]]]), np.array([[[1, 0], [2, 0]]], np.int32)
    for c in (pc, lean):
        c.next_t[:] = 0
        c.step_layers(ids, w, rk, np.ones((1, 2), np.bool_), np.zeros((1, 2, N_EV), np.int32))


def predicted_lists(policy: PolicyConfig, layer: int, topk_ids: np.ndarray, valid: np.ndarray,
                    lookahead: np.ndarray | None = None) -> np.ndarray | None:
    """The predicted lists for `layer` from a whole trace's arrays, as `PolicyCache.step` takes them.

    topk_ids [T, L, k], valid [T, L], lookahead [T, L, P] (on layer l's row: layer l + 1's router applied
    to layer l's router input) -> int32 [T, n] or None (prefetch off, or layer 0). Formed after layer
    l - 1 processed the token: rows where layer l - 1's cell is invalid are -1 (no prefetch).
    `lookahead`: its first prefetch_n ids; `oracle`: the first min(prefetch_n, k) ids of the layer's
    own selection."""
    if policy.prefetch == "off" or layer == 0:
        return None
    k = topk_ids.shape[2]
    n = int(policy.prefetch_n or k)
    if policy.prefetch == "oracle":
        pred = np.array(topk_ids[:, layer, : min(n, k)], dtype=np.int32)
    else:
        if lookahead is None:
            raise InputError("prefetch = 'lookahead' (--prefetch) needs a trace with a lookahead column "
                             "(record it with runtime.tools.record --lookahead P)")
        if lookahead.shape[2] < n:
            raise InputError(f"prefetch_n (--prefetch-n) = {n} exceeds the trace's lookahead depth {lookahead.shape[2]}")
        pred = np.array(lookahead[:, layer - 1, :n], dtype=np.int32)
    pred[~np.asarray(valid[:, layer - 1], dtype=bool)] = -1
    return pred


def predicted_layers(policy: PolicyConfig, topk_ids: np.ndarray, valid: np.ndarray,
                     lookahead: np.ndarray | None = None) -> np.ndarray | None:
    """Every layer's predicted lists (`predicted_lists`) as `PolicyCache.step_layers` takes them: int32 [L, T, P],
    layer 0's rows -1 (no previous layer: no prefetch there); None when the policy prefetches nothing."""
    T, L = topk_ids.shape[:2]
    out = None
    for l_ in range(1, L):
        p = predicted_lists(policy, l_, topk_ids, valid, lookahead)
        if p is None:
            return None
        if out is None:
            out = np.full((L, T, p.shape[1]), -1, np.int32)
        out[l_] = p
    return out


@dataclass
class StepResult:
    """The kernel's plan for one layer over a chunk of tokens; the engine applies it in this order per
    token: admissions (`admitted`), prefetch loads (`prefetched`), then the per-slot decisions."""

    # (kind, served and slot are None when step was asked for no decisions)
    kind: np.ndarray | None  # int8 [T, k]: HIT/FETCH/SUB/DROP/HOST/LOWBIT, -1 for invalid cells
    served: np.ndarray | None  # int32 [T, k]: expert that computes slot j (the missed expert for HOST/LOWBIT; -1 drop/invalid)
    slot: np.ndarray | None  # int32 [T, k]: device slot used (-1 drop/host/lowbit/invalid)
    events: np.ndarray  # int32 [T, N_EV]: EV_* counts per token
    admitted: np.ndarray  # int64 [n, 3]: (token, expert, slot) admissions applied
    queued: np.ndarray  # int64 [n, 2]: (token, expert) admissions queued
    prefetched: np.ndarray  # int64 [n, 3]: (token, expert, slot) prefetch loads, applied after that token's admissions


def warm_residency(topk_ids: np.ndarray, valid: np.ndarray | None, num_experts: int, capacities: np.ndarray) -> list[np.ndarray]:
    """Per layer the C_l most frequently selected experts of a calibration trace (ties: lower id). topk_ids [T, L, k]."""
    T, L, k = topk_ids.shape
    out = []
    for l_ in range(L):
        ids = topk_ids[:, l_, :] if valid is None else topk_ids[valid[:, l_], l_, :]
        counts = np.bincount(ids.ravel(), minlength=num_experts)[:num_experts]
        order = np.lexsort((np.arange(num_experts), -counts))
        out.append(order[: int(capacities[l_])].astype(np.int32))
    return out


def drop_renorm_scale(kind: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
    """`drop_renorm` (docs/policies.md, "Renormalised drop"): per token the factor (sum of w_j over the
    selection) / (sum of w_j over the hits and the non-dropped misses) for the gate weights of the experts it
    computes; 1 for a token without drops (or with every call dropped: nothing is computed). kind [N, k],
    weights [N, k] -> float64 [N], or None when no call of the chunk is dropped (nothing changes)."""
    drop = np.asarray(kind) == DROP  # [N, k]
    if not drop.any():
        return None
    w = np.asarray(weights, np.float64)
    kept = np.where(drop, 0.0, w).sum(axis=1)  # [N]
    return np.where(drop.any(axis=1) & (kept > 0), w.sum(axis=1) / np.where(kept > 0, kept, 1.0), 1.0)


def residency_array(init: list | None, capacities, flag: str = "--residency-out") -> np.ndarray:
    """A run's initial residency as a residency file holds it: int64 [L, max C_l], each row in its order (a
    warm start: count order), padded with -1 where a layer has fewer slots (calibrated capacities)."""
    if init is None:
        raise InputError(f"{flag}: needs a warm start (this run starts cold)")
    caps = [int(c) for c in capacities]
    arr = np.full((len(caps), max(caps)), -1, np.int64)
    for l_, row in enumerate(init):
        row = np.asarray(row, np.int64)
        row = row[row >= 0]
        arr[l_, : len(row)] = row
    return arr


def calibration_counts(topk_ids: np.ndarray, valid: np.ndarray | None, num_experts: int) -> np.ndarray:
    """n_l[e]: how often the router selected e at layer l over a calibration trace; topk_ids [T, L, k] -> int64 [L, E]."""
    T, L, k = topk_ids.shape
    out = np.zeros((L, num_experts), np.int64)
    for l_ in range(L):
        ids = topk_ids[:, l_, :] if valid is None else topk_ids[np.asarray(valid[:, l_], bool), l_, :]
        out[l_] = np.bincount(ids.ravel().astype(np.int64), minlength=num_experts)[:num_experts]
    return out


def calibrated_capacities(counts: np.ndarray, capacities: np.ndarray, top_k: int) -> np.ndarray:
    """`capacity_alloc = calibrated` (docs/policies.md, "Per-layer capacities"): the total S of `capacities`
    spread over the layers. Every layer starts with k slots; each remaining slot goes to the layer whose next
    expert in count order (position C_l) has the largest share n_l[e] / sum_e n_l[e] of the layer's calls
    (ties: lower layer; a layer stops at E - 1). counts int [L, E] -> int64 [L]."""
    L, E = counts.shape
    total = int(np.asarray(capacities).sum())
    order = np.lexsort((np.broadcast_to(np.arange(E), (L, E)), -counts), axis=1)  # [L, E] count order
    sums = counts.sum(axis=1)
    share = np.take_along_axis(counts, order, axis=1) / np.maximum(sums, 1)[:, None]  # [L, E] in count order
    caps = np.full(L, top_k, np.int64)
    for _ in range(total - L * top_k):
        nxt = np.where(caps < E - 1, share[np.arange(L), np.minimum(caps, E - 1)], -1.0)  # [L]
        caps[int(np.argmax(nxt))] += 1  # argmax: the first (lowest) layer among equal shares
    return caps


def warm_start(policy: PolicyConfig, capacities: np.ndarray, top_k: int, num_experts: int,
               calib_ids: np.ndarray | None = None, calib_valid: np.ndarray | None = None,
               given: list | None = None, source: str = "") -> tuple[np.ndarray, list[np.ndarray] | None]:
    """A run's slots per layer and initial residency: from calibration selections `calib_ids` [T, L, k] the
    warm start (with `capacity_alloc = calibrated`, the capacities spread by the counts first), else `given`
    per-layer ids (a residency file), else cold (None). Calibrated capacities need calibration counts: with
    a residency file or a cold start they are a one-line InputError naming `source`."""
    caps = np.asarray(capacities, np.int64)
    if calib_ids is not None:
        if policy.capacity_alloc == "calibrated":
            caps = calibrated_capacities(calibration_counts(calib_ids, calib_valid, num_experts), caps, top_k)
        return caps, warm_residency(calib_ids, calib_valid, num_experts, caps)
    if policy.capacity_alloc == "calibrated":
        raise InputError(f"--capacity-alloc = 'calibrated' needs calibration counts (a warm start from a calibration "
                         f"trace or text, or held-out); the initial residency is {source or 'cold'!s}")
    return caps, given


class PolicyCache:
    """State of every layer's cache under one policy; `step` drives the kernel for one layer.

    Capacities must satisfy k <= C_l < E (docs/policies.md); `allow_full=True` also accepts C_l = E
    (every expert resident), for exactness checks only."""

    def __init__(
        self,
        policy: PolicyConfig,
        num_experts: int,
        top_k: int,
        capacities: np.ndarray,
        initial_residency: list[np.ndarray] | np.ndarray | None = None,
        belady_first_use: list[np.ndarray] | None = None,
        *,
        allow_full: bool = False,
    ) -> None:
        policy.validate()
        self.policy = policy
        self.E, self.k = int(num_experts), int(top_k)
        self.caps = np.atleast_1d(np.asarray(capacities, dtype=np.int64))
        L = self.L = len(self.caps)
        E = self.E
        for l_, c in enumerate(self.caps.tolist()):
            if not (self.k <= c < E or (allow_full and c == E)):
                raise InputError(f"capacity = {c} (layer {l_}) must satisfy k={self.k} <= C < E={E}")
        cmax = int(self.caps.max())
        self.slot_expert = np.full((L, cmax), -1, np.int32)
        self.expert_slot = np.full((L, E), -1, np.int32)
        self.key = np.zeros((L, E))
        self.skey = np.zeros((L, cmax), np.int64)
        if policy.evict == "lru":
            self.key[:] = -1.0
        if policy.evict == "belady":
            if belady_first_use is None:
                raise InputError("evict = 'belady' needs the whole trace in advance (simulator only)")
            for l_ in range(L):
                self.key[l_] = -np.asarray(belady_first_use[l_], dtype=np.float64)[:E]
        self.acc = np.zeros((L, E))
        self.queued = np.zeros((L, E), np.bool_)
        self.pin = np.zeros((L, cmax), np.int64)
        self.qstate = np.zeros((L, 5), np.int64)  # head, len, stamp, n_resident, lfuda's A
        self.age_count = np.zeros((L, E), np.int64)  # lfuda's c[e]
        self.q_exp = np.zeros((L, E + 1), np.int32)
        self.q_due = np.zeros((L, E + 1), np.int64)
        self.counters = np.zeros((L, N_INT), np.int64)
        self.mass = np.zeros((L, len(FLOAT_COUNTERS)))
        self.next_t = np.zeros(L, np.int64)
        if initial_residency is not None:
            if len(initial_residency) != L:
                raise InputError(f"initial residency has {len(initial_residency)} layers, expected {L}")
            for l_ in range(L):
                res = np.asarray(initial_residency[l_]).ravel()
                res = res[res >= 0]
                if len(res) > self.caps[l_]:
                    raise InputError(f"initial residency: layer {l_} holds {len(res)} experts > capacity {self.caps[l_]}")
                if len(res) and (res.min() < 0 or res.max() >= E):
                    raise InputError(f"initial residency: layer {l_} has expert id {int(res.max())} outside [0, {E})")
                if len(np.unique(res)) != len(res):
                    raise InputError(f"initial residency: layer {l_} repeats an expert id")
                self.slot_expert[l_, : len(res)] = res
                self.expert_slot[l_, res] = np.arange(len(res), dtype=np.int32)
                self.qstate[l_, 3] = len(res)
        # the pinned hot set (docs/policies.md, Additions (2)): the first P_l entries of each layer's initial
        # residency (count order for a warm start, file order for a residency file) sit in slots 0..P_l-1
        self.npin = np.array([pinned_count(policy.pin_fraction, c) for c in self.caps.tolist()], np.int64)
        if policy.pin_fraction > 0:
            if initial_residency is None:
                raise InputError(f"--pin-fraction = {policy.pin_fraction!r} needs a warm start (the pinned experts "
                                 "are the first of the initial residency); this run starts cold")
            for l_, (c, p_) in enumerate(zip(self.caps.tolist(), self.npin.tolist(), strict=True)):
                if c - p_ < self.k:
                    raise InputError(f"--pin-fraction = {policy.pin_fraction!r} pins P={p_} of C={c} slots at layer "
                                     f"{l_}, leaving {c - p_} < k={self.k} for fetches (need C - P >= k)")
                if int(self.qstate[l_, 3]) < p_:
                    raise InputError(f"--pin-fraction = {policy.pin_fraction!r} pins P={p_} experts at layer {l_}; "
                                     f"its initial residency holds only {int(self.qstate[l_, 3])}")
        p = policy
        self.prefetch_width = 0 if p.prefetch == "off" else int(p.prefetch_n or self.k)
        if p.prefetch == "oracle":
            self.prefetch_width = min(self.prefetch_width, self.k)
        # every layer's cache as the kernel takes it (run_layers: row l is layer l's LayerState)
        self._state = CacheState(self.caps, self.npin, self.slot_expert, self.expert_slot, self.key, self.skey,
                                 self.acc, self.queued, self.pin, self.qstate, self.q_exp, self.q_due, self.counters,
                                 self.mass, self.age_count)
        self._params = kernel_record(p)[0]  # the policy record the kernel reads (runtime.core.policy.KERNEL_DTYPE)
        r = self._params  # the lean build decides it (step: unless router scores are given)
        self._lean = bool(r["evict"] == K_LFU and r["gamma"] == 1.0 and r["fallback"] == F_SUBSTITUTE
                          and r["fetch_cap"] == -1 and self.prefetch_width == 0 and not self.npin.any())

    def step(
        self,
        layer: int,
        ids: np.ndarray,
        weights: np.ndarray,
        ranking: np.ndarray | None = None,
        valid: np.ndarray | None = None,
        t0: int | None = None,
        nxt: np.ndarray | None = None,
        events: np.ndarray | None = None,
        logs: bool = True,
        predicted: np.ndarray | None = None,
        scores: np.ndarray | None = None,
        decisions: bool = True,
    ) -> StepResult:
        """Decide tokens t0.. of one layer. ids [T, k], weights [T, k], ranking [T, M] (defaults to ids).

        `predicted` [T, P] int: per token the predicted list of this layer's experts, formed after the
        previous layer processed the token (lookahead: its router input through this layer's router;
        oracle: this layer's own selection); -1 entries end a row early (a row starting with -1: no
        prefetch for that token). Only its first `prefetch_n` (oracle: min(prefetch_n, k)) columns are
        used; ignored when the policy's prefetch is off; None (e.g. layer 0) = no prefetch.

        `scores` [T, E]: the router scores whose order (descending, ties lower id) is the token's full
        ranking; given instead of a full `ranking`, they decide the same substitutes without sorting
        E candidates per token (the adapters pass them). A full ranking (E columns) given beside them is
        walked instead (the same decisions; the walk stops at the first resident entries where the scores
        pass visits every slot); a truncated one is then ignored.

        `decisions=False` (the simulator: counters and events only): the per-slot decisions go to one
        scratch row, rewritten per token, and the result's kind, served and slot are None; every counter,
        event and log is the same."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        T, k = ids.shape
        w = np.ascontiguousarray(weights, dtype=np.float64)
        rank = ids if ranking is None else np.ascontiguousarray(ranking, dtype=np.int32)
        valid = np.ones(T, np.bool_) if valid is None else np.ascontiguousarray(valid, dtype=np.bool_)
        if scores is None or rank.shape[1] == self.E:  # a full ranking: walk it (stops after a few entries)
            sc = np.zeros((0, 0))
        else:
            sc = np.asarray(scores, dtype=np.float64)  # rows may be strided (a slice of the adapters' pack)
            if sc.shape != (T, self.E):
                raise InputError(f"router scores: shape {sc.shape}, expected [T={T}, E={self.E}] (layer {layer})")
            rank = ids
        t0 = int(self.next_t[layer]) if t0 is None else int(t0)
        self.next_t[layer] = t0 + T
        nxt = np.zeros((0, k)) if nxt is None else nxt
        if predicted is None or self.prefetch_width == 0:
            pred = np.zeros((0, 0), np.int32)
        else:
            pred = self._predicted(np.asarray(predicted)[:, : self.prefetch_width], (T,), f" (layer {layer})")
        l_ = layer
        rows = T if decisions else 1
        kind = np.empty((rows, k), np.int8)
        served = np.empty((rows, k), np.int32)
        slot = np.empty((rows, k), np.int32)
        ev = np.zeros((T, N_EV), np.int32) if events is None else events
        n_adm = min(T * k, 1 << 20) + self.E if logs else 0  # the simulator needs no logs
        adm_log = np.empty((n_adm, 3), np.int64)
        q_log = np.empty((max(n_adm - self.E, 0), 2), np.int64)
        pf_log = np.empty((T * pred.shape[1] if logs else 0, 3), np.int64)
        n_logs = np.zeros(3, np.int64)
        fn = run_layers_lean if self._lean and sc.shape[0] == 0 else run_layers
        fn(Tokens(ids[None], w[None], rank[None], valid[None], sc[None], nxt[None], pred[None]), t0, self._params,
           self._state, Outputs(kind[None], served[None], slot[None], ev[None], adm_log[None], q_log[None],
                                pf_log[None], n_logs[None]), l_)
        na, nq, npf = (int(x) for x in n_logs)
        if not decisions:
            kind = served = slot = None
        return StepResult(kind, served, slot, ev, adm_log[: min(na, len(adm_log))], q_log[: min(nq, len(q_log))],
                          pf_log[: min(npf, len(pf_log))])

    def _predicted(self, pred: np.ndarray, lead: tuple[int, ...], where: str) -> np.ndarray:
        """Predicted lists as the kernel takes them (int32, C-contiguous), their leading shape `lead` and ids
        checked: a one-line InputError otherwise."""
        pred = np.ascontiguousarray(pred, dtype=np.int32)
        if pred.shape[: len(lead)] != lead:
            raise InputError(f"predicted lists: shape {pred.shape}, expected {list(lead)} + [P]{where}")
        if pred.size and int(pred.max()) >= self.E:
            raise InputError(f"predicted lists: expert id {int(pred.max())} outside [0, {self.E}){where}")
        return pred

    def step_layers(
        self,
        ids: np.ndarray,
        weights: np.ndarray,
        ranking: np.ndarray,
        valid: np.ndarray,
        events: np.ndarray,
        nxt: np.ndarray | None = None,
        predicted: np.ndarray | None = None,
        decisions: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Decide every layer over the same tokens in one kernel call (the simulator's replay; `step` per layer
        makes the same decisions). ids [L, T, k] int32, weights [L, T, k] float64, ranking [L, T, M] int32,
        valid [L, T] bool (converted if need be), events [L, T, N_EV] int32 C-contiguous (added to); nxt [L, T, k] (belady) or
        None; predicted [L, T, P] int32 (as `step`'s, a row of -1 at layer 0) or None. Writes no logs.
        Returns (kind, served, slot), each [L, T, k], with `decisions`, else None."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        weights = np.ascontiguousarray(weights, dtype=np.float64)
        ranking = np.ascontiguousarray(ranking, dtype=np.int32)
        valid = np.ascontiguousarray(valid, dtype=np.bool_)
        L, T, k = ids.shape
        shapes_ok = (weights.shape == ids.shape and ranking.shape[:2] == (L, T) and ranking.shape[2] >= k
                     and valid.shape == (L, T) and events.shape == (L, T, N_EV) and events.dtype == np.int32
                     and events.flags.c_contiguous)
        if L != self.L or k != self.k or not shapes_ok or len(set(self.next_t.tolist())) != 1:
            raise ValueError(f"step_layers: ids {ids.shape}, weights {weights.shape}, ranking {ranking.shape}, "
                             f"valid {valid.shape}, events {events.shape} {events.dtype} for L={self.L}, k={self.k} "
                             f"caches at one token (next tokens {sorted(set(self.next_t.tolist()))})")
        t0 = int(self.next_t[0])
        self.next_t[:] = t0 + T
        nxt = np.zeros((L, 0, k)) if nxt is None else np.ascontiguousarray(nxt, dtype=np.float64)
        if nxt.shape[0] != L or nxt.shape[1] not in (0, T) or nxt.shape[2] != k:
            raise ValueError(f"step_layers: nxt {nxt.shape}, expected [L={L}, T={T}, k={k}]")
        if predicted is None or self.prefetch_width == 0:
            pred = np.zeros((L, 0, 0), np.int32)
        else:
            pred = self._predicted(np.asarray(predicted)[:, :, : self.prefetch_width], (L, T), "")
        rows = T if decisions else 1
        out = Outputs(np.empty((L, rows, k), np.int8), np.empty((L, rows, k), np.int32),
                      np.empty((L, rows, k), np.int32), events, np.empty((L, 0, 3), np.int64),
                      np.empty((L, 0, 2), np.int64), np.empty((L, 0, 3), np.int64), np.zeros((L, 3), np.int64))
        fn = run_layers_lean if self._lean else run_layers
        fn(Tokens(ids, weights, ranking, valid, np.zeros((L, 0, 0)), nxt, pred), t0, self._params, self._state, out, 0)
        return (out.kind, out.served, out.slot) if decisions else None

    def resident(self, layer: int) -> np.ndarray:
        """Sorted ids of the experts resident in one layer."""
        return np.flatnonzero(self.expert_slot[layer] >= 0)

    def _row(self, ints: np.ndarray, floats: np.ndarray) -> dict:
        row: dict = {n: int(ints[i]) for i, n in enumerate(INT_COUNTERS)}
        row.update({n: float(floats[i]) for i, n in enumerate(FLOAT_COUNTERS)})
        return row

    def counter_totals(self) -> dict:
        """Every counter of COUNTER_NAMES summed over layers (ints, then the float masses)."""
        return self._row(self.counters.sum(axis=0), self.mass.sum(axis=0))

    def per_layer(self) -> list[dict]:
        """Every counter of COUNTER_NAMES per layer, with the layer's slot count `capacity` (C_l) and its
        pinned hot set's size `pinned` (P_l)."""
        return [{**self._row(self.counters[l_], self.mass[l_]), "capacity": int(self.caps[l_]),
                 "pinned": int(self.npin[l_])} for l_ in range(self.L)]
