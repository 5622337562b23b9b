"""The policy kernel's background copies: admissions (steps 0 and 6 of docs/policies.md) and the prefetch of
the predicted list (step 0b, "Additions (3)"), each a stage of run_layer (run_layer.py's map).

Every stage is `inline="always"` (numba inlines it into run_layer as its own code) and takes the arrays it
uses by name (run_layer's borrowed views: no reference counts), or slots.py's `SlotTable` where it claims;
`setup` is run_layer.py's `Setup`. The arrays are LayerState's, Tokens' and Outputs' fields and run_layer's
work arrays (run_layer.py `Scratch`) of the same names. The admission ring (q_exp / q_due, ring_capacity entries) holds, from q_head,
`n_started` entries whose copies started (due at q_due) then the waiting ones (q_due: the token they were
queued at); its head, length and started count travel through run_layer's loop as scalars.
"""

from __future__ import annotations

from numba import njit

from runtime.core.kernel.plan import (
    C_ADM,
    C_ADM_SKIPPED,
    C_ADM_WAITED,
    C_PREF,
    C_PREF_UNBUF,
    C_PREF_USED,
    EV_ADM_POPPED,
    EV_ADM_QUEUED,
    EV_PREFETCH,
)
from runtime.core.kernel.primitives import _log
from runtime.core.kernel.slots import claim, protect, rekey_slot


@njit(cache=True, inline="always")
def prefetch_cut(setup, pred, expert_slot, counters, i, free_buffers):
    """Before step 0, with a bounded copy pool: the copies for token i's predicted list (pred [T, P]) are those
    of its first `free_buffers` members not resident now; returns the length of the list cut after the last of
    them, counting the non-resident members cut off (prefetch_unbuffered)."""
    n_not_resident = 0
    limit = setup.pred_width
    for p in range(setup.pred_width):
        e = pred[i, p]
        if e < 0:
            break
        if expert_slot[e] < 0:
            if n_not_resident < free_buffers:
                n_not_resident += 1
            else:
                if limit == setup.pred_width:
                    limit = p
                counters[C_PREF_UNBUF] += 1
    return limit


@njit(cache=True, inline="always")
def admit_due(setup, table, q_exp, q_due, queued, event_counts, adm_log, n_logs, candidates, counters, batch_slots,
              token_slots, i, t, q_head, q_len, n_started, stamp, n_cand):
    """Step 0: the admissions due before token t, batch by batch (a batch = same due token: copies started at
    one token, pinned against each other), taken from the ring's started entries. Returns (q_head, q_len,
    n_started, stamp, n_cand, n_token_slots): n_token_slots slots admitted at this token, in token_slots;
    evicted experts to queue again and unplaced ones join the candidates."""
    expert_slot, slot_expert, skey, key, acc = table.expert_slot, table.slot_expert, table.skey, table.key, table.acc
    n_token_slots = 0
    while n_started > 0 and q_due[q_head] <= t:
        due = q_due[q_head]
        stamp += 1
        batch_stamp = stamp
        n_batch = 0
        while n_started > 0 and q_due[q_head] == due:
            e = q_exp[q_head]
            q_head = (q_head + 1) % setup.ring_capacity
            q_len -= 1
            n_started -= 1
            queued[e] = False
            event_counts[i, EV_ADM_POPPED] += 1
            if expert_slot[e] >= 0:
                counters[C_ADM_SKIPPED] += 1
                continue
            s, requeue = claim(setup, table, e, batch_stamp)
            if s < 0:
                counters[C_ADM_SKIPPED] += 1
                if setup.use_admission:  # not resident, no longer queued: may be queued again after the token
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
        if setup.int_keys:  # re-key the batch's slots (they were pinned against each other)
            for b in range(n_batch):
                rekey_slot(setup, slot_expert, skey, key, batch_slots[b])
    return q_head, q_len, n_started, stamp, n_cand, n_token_slots


@njit(cache=True, inline="always")
def prefetch_list(setup, table, pred, ids, event_counts, pf_log, n_logs, token_slots, candidates, prefetched, counters, i, t,
                  stamp, n_cand, n_token_slots, limit):
    """Step 0b: load token i's predicted list (pred [T, P]), its first `limit` members (no f, a or lru change),
    protecting the slots admitted at this token and the members of the list. Returns (stamp, n_cand)."""
    if limit == 0 or pred[i, 0] < 0:
        return stamp, n_cand
    expert_slot, slot_expert, pin, skey, key = table.expert_slot, table.slot_expert, table.pin, table.skey, table.key
    stamp += 1
    prefetch_stamp = stamp
    for b in range(n_token_slots):
        protect(setup, pin, skey, token_slots[b], prefetch_stamp)
    for p in range(limit):
        e = pred[i, p]
        if e < 0:
            break
        if expert_slot[e] >= 0:
            protect(setup, pin, skey, expert_slot[e], prefetch_stamp)
    n_loaded = 0
    for p in range(limit):
        e = pred[i, p]
        if e < 0:
            break
        if expert_slot[e] >= 0:
            continue
        s, requeue = claim(setup, table, e, prefetch_stamp)
        if s < 0:
            continue  # nothing evictable: skipped
        if requeue >= 0:
            candidates[n_cand] = requeue
            n_cand += 1
        prefetched[n_loaded] = e
        n_loaded += 1
        _log(pf_log, n_logs, 2, t, e, s)
    if setup.int_keys:  # re-key every protected slot
        for b in range(n_token_slots):
            rekey_slot(setup, slot_expert, skey, key, token_slots[b])
        for p in range(limit):
            e = pred[i, p]
            if e < 0:
                break
            if expert_slot[e] >= 0:
                rekey_slot(setup, slot_expert, skey, key, expert_slot[e])
    counters[C_PREF] += n_loaded
    event_counts[i, EV_PREFETCH] += n_loaded
    for p in range(n_loaded):
        for j in range(setup.top_k):
            if ids[i, j] == prefetched[p]:
                counters[C_PREF_USED] += 1
                break
    return stamp, n_cand


@njit(cache=True, inline="always")
def queue_admissions(setup, acc, queued, expert_slot, q_exp, q_due, candidates, t, n_cand, q_head, q_len):
    """Step 6: queue the candidates with a[e] >= beta, not queued and not resident, largest a first (ties lower
    id), waiting at the ring's tail (start_copies starts their copies); returns q_len."""
    n_queued = 0
    for c in range(n_cand):
        e = candidates[c]
        if acc[e] >= setup.beta and not queued[e] and expert_slot[e] < 0:
            queued[e] = True  # (also de-duplicates the candidates)
            p = n_queued  # insertion sort by (-acc, id)
            while p > 0 and (acc[candidates[p - 1]] < acc[e]
                             or (acc[candidates[p - 1]] == acc[e] and candidates[p - 1] > e)):
                candidates[p] = candidates[p - 1]
                p -= 1
            candidates[p] = e
            n_queued += 1
    for c in range(n_queued):
        e = candidates[c]
        tail = (q_head + q_len) % setup.ring_capacity
        q_exp[tail] = e
        q_due[tail] = t  # waiting (start_copies sets the due token when its copy starts)
        q_len += 1
        acc[e] = 0.0
    return q_len


@njit(cache=True, inline="always")
def start_copies(setup, q_exp, q_due, expert_slot, queued, counters, event_counts, q_log, n_logs, i, t, q_head, q_len,
                 n_started):
    """Step 6, after the queueing: the ring's waiting entries start their copies in queue order while the layer
    has a free copy buffer (unbounded: all), each due `delay` tokens later; a waiting expert that became
    resident meanwhile leaves the ring without a copy (admissions_skipped). The copies started go to the log
    and the event column. Returns (q_head, q_len, n_started)."""
    ring_capacity = setup.ring_capacity
    n_new = 0
    while q_len > n_started and (setup.copy_buffers < 0 or n_started < setup.copy_buffers):
        pos = (q_head + n_started) % ring_capacity
        e = q_exp[pos]
        if expert_slot[e] >= 0:  # out of the ring: the started entries move up one place
            queued[e] = False
            counters[C_ADM_SKIPPED] += 1
            for j in range(n_started - 1, -1, -1):
                src = (q_head + j) % ring_capacity
                dst = (src + 1) % ring_capacity
                q_exp[dst] = q_exp[src]
                q_due[dst] = q_due[src]
            q_head = (q_head + 1) % ring_capacity
            q_len -= 1
            continue
        if q_due[pos] < t:
            counters[C_ADM_WAITED] += 1
        q_due[pos] = t + setup.delay
        n_started += 1
        n_new += 1
        _log(q_log, n_logs, 1, t, e, -1)
    event_counts[i, EV_ADM_QUEUED] += n_new
    return q_head, q_len, n_started
