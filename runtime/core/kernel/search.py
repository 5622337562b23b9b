"""The searches over one layer's slots that the policy kernel (run_layer.py) calls: the victim with the smallest
key (float keys, and integer slot keys in one vectorised pass), the best resident substitutes by router score,
the first free slot. Each reads the arrays it is given and changes nothing; which one a kind uses is its
EVICT_KINDS row (evict.py `KEYS`)."""

from __future__ import annotations

import numpy as np
from numba import njit

from runtime.core.kernel.evict import IMAX


@njit(cache=True)
def victim(slot_expert, p0, cap, key, pin, stamp):
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


@njit(cache=True)
def victim_int(skey, p0, cap, sb):
    """Integer keys: slot of the smallest slot key among slots p0..cap-1 (slots protected for the token hold
    IMAX): one pass, as a slot key carries its slot in its low `sb` bits (evict.slot_key)."""
    m = IMAX
    if p0 == 0:
        for s in range(cap):
            v = skey[s]
            m = v if v < m else m
    else:
        for s in range(p0, cap):
            v = skey[s]
            m = v if v < m else m
    if m == IMAX:
        return -1
    return m & ((np.int64(1) << sb) - 1)


@njit(cache=True, inline="always")
def best_resident(score_row, sel_mark, i, slot_expert, cap, nneed, subs):
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
def free_slot(slot_expert, cap):
    """The first empty slot of 0..cap-1; -1 if none."""
    for s in range(cap):
        if slot_expert[s] < 0:
            return s
    return -1
