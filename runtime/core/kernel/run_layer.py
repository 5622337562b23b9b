"""The compiled policy kernel: `run_layer`, one layer's cache over a chunk of tokens, as a loop over stages.

The stages, per token, in the order of docs/policies.md ("Per token, per layer, in this order" and
"Additions"); every load into a slot goes through slots.py `claim`:

    step  stage                                 module        what
    0     prefetch_cut                          copies.py     a bounded copy pool cuts the predicted list
    0     admit_due                             copies.py     admissions due now, batch by batch
    0b    prefetch_list                         copies.py     the predicted list's loads
    0c    route_token                           decisions.py  cache-aware routing (route.py's selections)
    1     hits                                  decisions.py  hits pinned, misses listed
    2-3   miss_rule                             decisions.py  each miss's rule, fetches through claim,
                                                              fallbacks host / lowbit / drop
    4     substitutes                           decisions.py  the substitute fallback
    5     touch_token                           decisions.py  the eviction kind's touch (evict.py touch_*)
    -     count_events                          run_layer.py  the token's cost-model events
    6     queue_admissions, start_copies        copies.py     admission queue and its copies

Before the chunk `key_slots` (slots.py) keys the slots; after it `store` writes the ring, the stamp, the
masses and the counters back. The stages are module-level functions with `inline="always"` (numba inlines
each into run_layer as its own code: inlining is required for speed, a called stage per token costs more than
the token's decisions). Each takes the arrays it uses as arguments, and run_layer hands them `borrowed` views
(primitives.py: no reference held), so binding an array at each stage call costs nothing; with the arrays
themselves the atomic reference counts stayed in the token loop and the presets ran 10-15x slower
(reports/kernel_ab_module_stages.md; the split against the former closures: reports/kernel_stages_ab.md, from
scripts/bench_kernel_ab.py). Their arguments: `setup` (`Setup`, the layer's fixed parameters for the call),
`state` (the layer's `LayerState`, mutated), `tokens` / `outputs` (plan.py's records) and `scratch`
(`Scratch`, the per-call work arrays); the scalars that change per token (the admission ring's head,
length and started count, the stamp, the candidate count) go in and come back as return values.

`lean` is passed as a constant by `run_layers`, so run_layer compiles as two `Literal[bool]` specializations
of one module-level dispatcher (distinct symbols: no two cached objects share one, reports/compile_once.md).
docs/architecture.md and docs/simulator.md hold the rest; the input contract: a ranking row starts with the
token's selection and holds distinct ids, or router scores stand for it (ties lower id).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from runtime.core.kernel import evict as ek
from runtime.core.kernel.copies import (
    admit_due,
    prefetch_cut,
    prefetch_list,
    queue_admissions,
    start_copies,
)
from runtime.core.kernel.decisions import hits, miss_rule, route_token, substitutes, touch_token
from runtime.core.kernel.evict import K_LFU, KIND_KEYS, KIND_ON_LOAD, KIND_TOUCH
from runtime.core.kernel.plan import (
    C_CALLS,
    C_DROPS,
    C_FETCHES,
    C_HITS,
    C_HOST,
    C_LOWBIT,
    C_SUBS,
    EV_DEV,
    EV_FETCH,
    EV_HOST,
    EV_LOWBIT,
    M_LOWBIT,
    M_SUB,
    N_INT,
    Outputs,
    Tokens,
)
from runtime.core.kernel.primitives import (  # noqa: F401 - F_SUBSTITUTE: PolicyCache's lean test imports it here
    F_SUBSTITUTE,
    PF_AHEAD,
    R_FETCH_ALL,
    RT_OFF,
    T_LFU,
    _prefetch,
    borrowed,
)
from runtime.core.kernel.slots import SlotTable, key_slots
from runtime.core.kernel.state import Q_HEAD, Q_LEN, Q_NSTART, Q_STAMP, layer_state


class Setup(NamedTuple):
    """The layer's fixed parameters for one run_layer call (the policy record's fields, the lean build's
    constants, the kind's mechanisms from its EVICT_KINDS row, the shapes), read by every stage."""

    cap: int  # C_l, the layer's slots
    first_evictable: int  # P_l: slots 0..P_l-1 hold the pinned hot set (never a victim)
    num_experts: int  # E
    top_k: int  # k
    rank_width: int  # M, a ranking row's length
    ring_capacity: int  # the admission ring's entries (E + 1)
    slot_bits: int  # the slot bits of a slot key (evict.slot_key): 2**slot_bits >= cap
    key_step: int  # lfu_int: a key's +1 in its slot key
    int_keys: bool  # the kind keeps composite integer slot keys (skey mirrors the keys)
    lfu_int: bool  # lfu's touch on integer keys (gamma 1): a hit moves its slot key at step 1
    key_storage: int  # the kind's KEYS code (victim search)
    on_load: int  # its ON_LOADS code (claim's rule)
    touch: int  # its TOUCHES code (step 5)
    use_admission: bool  # beta > 0
    beta: float
    rule: int  # RULES code
    tau: float
    tau_high: float
    fallback: int  # FALLBACKS code
    fetch_cap: int  # -1: no cap
    gamma: float
    decay: float  # crf's 2**(-1/h)
    delay: int  # admission delay d
    copy_buffers: int  # -1: unbounded
    score_mode: bool  # router scores stand for the full ranking
    output_rows: int  # 1: per-slot outputs per token; 0: one scratch row (no decisions)
    pred_width: int  # the predicted lists' width (0: no prefetch)
    route_family: int  # ROUTES code (RT_OFF in the lean build)
    route_keep: int
    route_window: int
    route_lambda: float
    route_alpha: float
    route_norm: int


class Scratch(NamedTuple):
    """run_layer's work arrays for one call (allocated once per call, reused per token)."""

    candidates: np.ndarray  # [k + ring + P + 2k] admission candidates: misses, evicted, displaced (route)
    batch_slots: np.ndarray  # [C] slots admitted in the current batch
    token_slots: np.ndarray  # [ring] slots admitted at the current token (all batches)
    prefetched: np.ndarray  # [max(P, 1)] experts prefetched at the current token
    misses: np.ndarray  # [k] this token's misses (positions j), in rank order
    substituted: np.ndarray  # [k] those of them left to the substitute fallback, in rank order
    pinned_slots: np.ndarray  # [k] slots of this token's hits and fetches (pinned; re-keyed after the token)
    pinned_keys: np.ndarray  # [k] lfu_int: the hits' slot keys while a fetch protects them
    substitutes: np.ndarray  # [k] this token's substitutes, in rank order
    selected_mark: np.ndarray  # [E] score mode: e selected by token i ([0] otherwise)
    routed_ids: np.ndarray  # [k] route: the routed selection of the token
    routed_weights: np.ndarray  # [k] route: its weights
    counters: np.ndarray  # [N_INT] the rarer counters (the per-token ones are scalars of the loop)


@njit(cache=True, inline="always")
def _setup(tokens, pol, state, outputs, lean):
    """The call's Setup and Scratch. `lean` (a constant): the paper's presets' features only (lfu with gamma 1,
    substitute, no cap, pins, prefetch, scores or routing): those fields are constants in the lean build."""
    T, k = tokens.ids.shape
    E = state.expert_slot.shape[0]
    cap = state.caps
    ring_capacity = state.q_exp.shape[0]
    evict = K_LFU if lean else pol.evict
    gamma = 1.0 if lean else pol.gamma
    int_keys = ek.int_keys(evict, gamma)
    slot_bits = 0
    while (1 << slot_bits) < cap:
        slot_bits += 1
    score_mode = False if lean else tokens.score.shape[0] == T
    pred_width = 0 if lean else (tokens.pred.shape[1] if tokens.pred.shape[0] == T else 0)
    # (each value named before the constructor calls: numba rejects control flow inside a long argument list)
    first_evictable = 0 if lean else state.npin
    lfu_int = KIND_TOUCH[evict] == T_LFU and int_keys
    fallback = F_SUBSTITUTE if lean else pol.fallback
    fetch_cap = -1 if lean else pol.fetch_cap
    output_rows = 1 if outputs.kind.shape[0] == T else 0
    route_family = RT_OFF if lean else pol.route
    route_window = min(pol.route_window, E)
    marks = E if score_mode else 0
    setup = Setup(
        cap, first_evictable, E, k, tokens.rank.shape[1], ring_capacity, slot_bits, np.int64(E) << slot_bits,
        int_keys, lfu_int, KIND_KEYS[evict], KIND_ON_LOAD[evict], KIND_TOUCH[evict], pol.beta > 0.0, pol.beta,
        pol.rule, pol.tau, pol.tau_high, fallback, fetch_cap, gamma, pol.decay, pol.delay, pol.copy_buffers,
        score_mode, output_rows, pred_width, route_family, pol.route_keep, route_window, pol.route_lambda,
        pol.route_alpha, pol.route_norm)
    n_prefetched = max(pred_width, 1)
    scratch = Scratch(
        np.empty(k + ring_capacity + pred_width + 2 * k, np.int64), np.empty(cap, np.int64),
        np.empty(ring_capacity, np.int64), np.empty(n_prefetched, np.int64), np.empty(k, np.int64),
        np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.int64),
        np.full(marks, -1, np.int64), np.empty(k, np.int64), np.empty(k, np.float64), np.zeros(N_INT, np.int64))
    return setup, scratch


@njit(cache=True, inline="always")
def hint(setup, ids, weights, rank, ahead, walk):
    """Hints only: the rows token `ahead` reads and writes, on their way while an earlier token is decided."""
    if ahead < ids.shape[0]:
        _prefetch(ids, ahead, 0)
        _prefetch(weights, ahead, 0)
        _prefetch(weights, ahead, setup.top_k - 1)  # a row of weights may span two cache lines
        if walk:
            _prefetch(rank, ahead, setup.top_k)  # where the substitute walk starts


@njit(cache=True, inline="always")
def count_events(setup, event_counts, i, n_fetch, n_host, n_lowbit, n_drop):
    """The token's cost-model events (runtime/core/events.py; event_counts [T, N_EV]): device computes, fetches, host and
    low-bit computes."""
    event_counts[i, EV_DEV] += setup.top_k - n_host - n_lowbit - n_drop
    event_counts[i, EV_FETCH] += n_fetch
    event_counts[i, EV_HOST] += n_host
    event_counts[i, EV_LOWBIT] += n_lowbit


@njit(cache=True, inline="always")
def store(qstate, mass, layer_counters, counters, ring, sub_mass, lowbit_mass, totals):
    """After the chunk: the admission ring and stamp (ring: q_head, q_len, n_started, stamp) back into qstate,
    the masses and the counters added to the layer's (totals: calls, hits, fetches, substitutions, drops)."""
    qstate[Q_HEAD], qstate[Q_LEN], qstate[Q_NSTART], qstate[Q_STAMP] = ring
    mass[M_SUB] += sub_mass
    mass[M_LOWBIT] += lowbit_mass
    counters[C_CALLS] += totals[0]
    counters[C_HITS] += totals[1]
    counters[C_FETCHES] += totals[2]
    counters[C_SUBS] += totals[3]
    counters[C_DROPS] += totals[4]
    for c in range(N_INT):
        layer_counters[c] += counters[c]


@njit(cache=True, error_model="numpy")
def run_layer(tokens, t0, pol, state, outputs, lean):
    """One layer's cache over tokens t0 .. t0+T-1 (`pol`: kernel_record; `state` mutated). `lean` (a constant):
    the paper's presets' features only (lfu with gamma 1, substitute, no cap, pins, prefetch or scores)."""
    setup, scratch = _setup(tokens, pol, state, outputs, lean)
    # every array borrowed once, here: the views hold no reference, so a stage binds them at each call at no cost
    # (primitives.borrowed). `tokens`, `outputs` and `state` are held by the caller; `scratch` is this call's own
    # (fresh allocations: LLVM knows they alias nothing) and numba releases a variable at its last use, so it is
    # used again after the loop (`store`), or its arrays would be freed under their views
    ids, weights, rank = borrowed(tokens.ids), borrowed(tokens.w), borrowed(tokens.rank)  # [T, k] [T, k] [T, M]
    valid, score, next_use = borrowed(tokens.valid), borrowed(tokens.score), borrowed(tokens.nxt)  # [T] [T, E] [T, k]
    pred = borrowed(tokens.pred)  # [T, P]
    kind, served, slot = borrowed(outputs.kind), borrowed(outputs.served), borrowed(outputs.slot)  # [T or 1, k]
    event_counts, n_logs = borrowed(outputs.ev), borrowed(outputs.n_logs)  # [T, N_EV], [3]
    adm_log, q_log, pf_log = borrowed(outputs.adm_log), borrowed(outputs.q_log), borrowed(outputs.pf_log)
    key, skey, acc, queued = borrowed(state.key), borrowed(state.skey), borrowed(state.acc), borrowed(state.queued)
    slot_expert, expert_slot, pin = borrowed(state.slot_expert), borrowed(state.expert_slot), borrowed(state.pin)
    qstate, q_exp, q_due = borrowed(state.qstate), borrowed(state.q_exp), borrowed(state.q_due)
    age_count, route_d, mass = borrowed(state.age_count), borrowed(state.route_d), borrowed(state.mass)
    candidates, batch_slots = borrowed(scratch.candidates), borrowed(scratch.batch_slots)
    token_slots, prefetched = borrowed(scratch.token_slots), borrowed(scratch.prefetched)
    misses, substituted = borrowed(scratch.misses), borrowed(scratch.substituted)
    pinned_slots, pinned_keys = borrowed(scratch.pinned_slots), borrowed(scratch.pinned_keys)
    found, selected_mark = borrowed(scratch.substitutes), borrowed(scratch.selected_mark)
    routed_ids, routed_weights = borrowed(scratch.routed_ids), borrowed(scratch.routed_weights)
    counters = borrowed(scratch.counters)
    table = SlotTable(slot_expert, expert_slot, pin, qstate, skey, key, borrowed(state.queue), age_count,
                      borrowed(state.ghost), acc)
    k, pred_width, copy_buffers = setup.top_k, setup.pred_width, setup.copy_buffers
    walk = setup.rule != R_FETCH_ALL and setup.fallback == F_SUBSTITUTE and not setup.score_mode  # reads rank
    n_calls = n_hits = n_fetches = n_subs = n_drops = 0
    q_head, q_len, n_started, stamp = qstate[Q_HEAD], qstate[Q_LEN], qstate[Q_NSTART], qstate[Q_STAMP]
    sub_mass = lowbit_mass = 0.0
    key_slots(setup, slot_expert, skey, key)
    for i in range(ids.shape[0]):
        hint(setup, ids, weights, rank, i + PF_AHEAD, walk)
        oi = i * setup.output_rows  # the outputs' row: the token's, or the one scratch row
        if not valid[i]:
            for j in range(k):
                kind[oi, j] = -1
                served[oi, j] = -1
                slot[oi, j] = -1
            continue
        t = t0 + i
        limit = pred_width
        if pred_width > 0 and copy_buffers >= 0:  # the copies were issued before the admissions due now
            limit = prefetch_cut(setup, pred, expert_slot, counters, i, copy_buffers - n_started)
        q_head, q_len, n_started, stamp, n_cand, n_token_slots = admit_due(
            setup, table, q_exp, q_due, queued, event_counts, adm_log, n_logs, candidates, counters, batch_slots, token_slots,
            i, t, q_head, q_len, n_started, stamp, 0)
        stamp, n_cand = prefetch_list(setup, table, pred, ids, event_counts, pf_log, n_logs, token_slots, candidates,
                                      prefetched, counters, i, t, stamp, n_cand, n_token_slots, limit)
        n_rerouted = 0
        if setup.route_family != RT_OFF:
            n_cand, n_rerouted = route_token(setup, ids, weights, score, rank, expert_slot, acc, route_d, mass, routed_ids,
                                             routed_weights, candidates, counters, i, n_cand)
        stamp += 1
        n_calls += k
        n_miss, n_pinned = hits(setup, ids, expert_slot, key, skey, pin, kind, served, slot, misses, pinned_slots, i,
                                oi, stamp)
        n_hits += n_pinned - n_rerouted  # (a rerouted expert is resident: counted as a reroute, not a hit)
        n_fetch, n_host, n_lowbit, n_drop, n_need, token_mass, token_lowbit, n_cand, n_pinned = miss_rule(
            setup, table, ids, weights, kind, served, slot, misses, pinned_slots, pinned_keys, substituted, candidates, i,
            oi, n_miss, n_pinned, n_cand, stamp)
        n_fetches += n_fetch
        counters[C_HOST] += n_host
        counters[C_LOWBIT] += n_lowbit
        if n_need > 0:
            n_sub, n_sub_drop, token_sub_mass, n_cand = substitutes(
                setup, ids, weights, rank, score, slot_expert, expert_slot, acc, kind, served, slot, found, selected_mark,
                substituted, candidates, i, oi, n_need, n_cand)
            n_subs += n_sub
            n_drop += n_sub_drop
            token_mass += token_sub_mass
        n_drops += n_drop
        sub_mass += token_mass
        lowbit_mass += token_lowbit
        touch_token(setup, key, skey, slot_expert, age_count, qstate, ids, next_use, kind, served, slot, pinned_slots,
                    pinned_keys, i, oi, t, n_miss, n_pinned, n_fetch)
        count_events(setup, event_counts, i, n_fetch, n_host, n_lowbit, n_drop)
        if setup.use_admission:
            if n_cand > 0:
                q_len = queue_admissions(setup, acc, queued, expert_slot, q_exp, q_due, candidates, t, n_cand, q_head,
                                         q_len)
            if q_len > n_started:
                q_head, q_len, n_started = start_copies(setup, q_exp, q_due, expert_slot, queued, counters, event_counts, q_log,
                                                        n_logs, i, t, q_head, q_len, n_started)
    store(qstate, mass, borrowed(state.counters), scratch.counters, (q_head, q_len, n_started, stamp), sub_mass,
          lowbit_mass, (n_calls, n_hits, n_fetches, n_subs, n_drops))  # scratch's last use: after the loop


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
