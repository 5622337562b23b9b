"""Eviction kinds as key contracts: per kind its initial keys, its touch (the key update of step 5) and its
on-load / on-evict rules; the mechanism that picks a victim and claims a slot lives in slots.py.

As in sglang's mem_cache/evict_policy.py, a kind is its key: the victim of a load is the resident with the
smallest key among those the step allows (docs/policies.md, step 3), ties lower id. `EVICT_KINDS` is the
table: per kind how its keys are held (`int`: a composite integer slot key, one vectorised minimum per
victim; `float`: a scan of the float keys; `queue`: S3-FIFO's queue walk), which experts its touch updates,
and the rule in words. The functions below are the kinds' rules on scalars, then each kind's touch (step 5)
and on-load rule on the arrays, which run_layer's stages call by the kind's codes; S3-FIFO's queue walk and
ghost FIFO take the arrays, on its own path.

S3-FIFO (Yang et al., SOSP'23; bigrig_engine.policies.s3fifo): a small FIFO (target `s3_small` of the
evictable slots), a main FIFO and a ghost FIFO of evicted ids (capacity: the evictable slots). A load
enters main if its id is in the ghost (removed from it), else small, with freq 0; a hit or a substitute
adds 1 to freq (at most 3). A victim: while the small FIFO holds at least its target, its oldest
unprotected entry leaves (to the ghost) unless its freq > 1 (then it moves to main's tail with freq 0 and
the walk goes on); otherwise main's oldest unprotected entry leaves unless its freq > 0 (then freq - 1 and
back to main's tail). The key of an entry is its queue position (a sequence number).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from runtime.core.kernel.plan import HIT, SUB
from runtime.core.kernel.state import (
    Q_AGE,
    Q_GHEAD,
    Q_GLEN,
    Q_GMAX,
    Q_SEQ,
    Q_SLEN,
    Q_STARGET,
    CacheState,
)
from runtime.core.policy import EVICT_CODE, PolicyConfig

K_LFU, K_LRU, K_CRF, K_BELADY, K_LFUDA, K_S3FIFO = (EVICT_CODE[e] for e in ("lfu", "lru", "crf", "belady", "lfuda",
                                                                             "s3fifo"))
IMAX = np.iinfo(np.int64).max
S3_FREQ_MAX = 3  # freq saturates here
S3_PROMOTE = 1  # a small-FIFO entry with freq > this moves to main (bigrig's PROMOTE_THRESHOLD)
S3_NONE, S3_SMALL, S3_MAIN, S3_GHOST = 0, 1, 2, 3


class EvictKind(NamedTuple):
    """One row of the eviction table: the kernel picks each of the kind's mechanisms from its row (never from
    its name), each among the ones run_layer.py implements (KEYS, ON_LOADS, TOUCHES below)."""

    name: str
    keys: str  # how keys are held and a victim found (KEYS): "int" composite slot keys, one vectorised minimum;
    #            "int-gamma1" as "int" when gamma == 1, else as "float"; "float" a scan of the float keys;
    #            "queue" S3-FIFO's queue walk
    on_load: str  # the claim's rule when a load evicts v and e becomes resident (ON_LOADS): "none", "lfuda"
    #               (A = max(A, K[v]), c[v] halved, K[e] = A + c[e]), "s3fifo" (s3_moved)
    touch: str  # step 5, the bookkeeping after the token (TOUCHES): the rule of the kind that introduced it
    experts: str  # which experts step 5 updates: "selected" (router demand) or "computed" (full precision)
    rule: str  # the key in words (docs/policies.md, "Eviction kinds: the table")


# What run_layer.py implements: a row may name only these (checked below, at import). A new mechanism is a new
# name here and its branch in run_layer.py (whose import checks that it has one branch per name).
KEYS = ("int", "int-gamma1", "float", "queue")
ON_LOADS = ("none", "lfuda", "s3fifo")
TOUCHES = ("lfu", "lru", "crf", "belady", "lfuda", "s3fifo")

EVICT_KINDS: tuple[EvictKind, ...] = (
    EvictKind("lfu", "int-gamma1", "none", "lfu", "selected", "f[e] = gamma * f[e] + selected"),
    EvictKind("lru", "int", "none", "lru", "computed", "the last token e was computed (never: -1)"),
    EvictKind("crf", "float", "none", "crf", "computed", "c[e] = 2**(-1/h) * c[e] + computed"),
    EvictKind("belady", "float", "none", "belady", "selected", "minus the next use (offline bound)"),
    EvictKind("lfuda", "int", "lfuda", "lfuda", "selected",
              "K[e] = A + c[e]; an eviction sets A = max(A, K[v]), halves c[v]"),
    EvictKind("s3fifo", "queue", "s3fifo", "s3fifo", "computed",
              "small / main / ghost FIFOs, freq up to 3 (module docstring)"),
)


def check_kinds(kinds: tuple[EvictKind, ...], evicts: tuple[str, ...]) -> None:
    """The eviction table against the policy table's kinds (runtime.core.policy.EVICTS): one row per kind, in
    code order, each naming mechanisms the kernel implements; a ValueError naming the kind and the field
    otherwise (run at import, so a half-added kind never reaches the kernel)."""
    names = tuple(k.name for k in kinds)
    if names != tuple(evicts):
        missing = [e for e in evicts if e not in names]
        extra = [n for n in names if n not in evicts]
        raise ValueError(f"runtime/core/kernel/evict.py: EVICT_KINDS names {list(names)} but runtime.core.policy.EVICTS "
                         f"is {list(evicts)} (no row: {missing}, no policy entry: {extra}; same order): a kind is "
                         "its EVICTS entry, its row and rules here, its reference in tests/reference.py and its "
                         "row in docs/policies.md")
    for k in kinds:
        for field, allowed in (("keys", KEYS), ("on_load", ON_LOADS), ("touch", TOUCHES),
                               ("experts", ("selected", "computed"))):
            if getattr(k, field) not in allowed:
                raise ValueError(f"runtime/core/kernel/evict.py: EVICT_KINDS row {k.name!r}: {field} = "
                                 f"{getattr(k, field)!r} is not one the kernel implements ({', '.join(allowed)})")
        if not k.rule:
            raise ValueError(f"runtime/core/kernel/evict.py: EVICT_KINDS row {k.name!r}: no rule in words")


check_kinds(EVICT_KINDS, tuple(EVICT_CODE))

# per kind code, the index of its row's mechanism in KEYS / ON_LOADS / TOUCHES: tuples, constants to numba
KIND_KEYS = tuple(KEYS.index(k.keys) for k in EVICT_KINDS)
KIND_ON_LOAD = tuple(ON_LOADS.index(k.on_load) for k in EVICT_KINDS)
KIND_TOUCH = tuple(TOUCHES.index(k.touch) for k in EVICT_KINDS)
_KEYS_INT, _KEYS_INT_GAMMA1 = KEYS.index("int"), KEYS.index("int-gamma1")  # (int_keys)


@njit(cache=True, inline="always")
def int_keys(evict, gamma):
    """The kind keeps composite integer slot keys (the fast victim path): its row's keys are "int", or
    "int-gamma1" with gamma 1."""
    kk = KIND_KEYS[evict]
    return kk == _KEYS_INT or (kk == _KEYS_INT_GAMMA1 and gamma == 1.0)


@njit(cache=True, inline="always")
def slot_key(kval, e, E, s, slot_bits):
    """Slot key of slot `s` holding `e` whose integer key is `kval` >= -1 (the "int" keys: lfu with gamma 1,
    lfuda, lru, whose never-used residents hold -1): the composite (key + 1) * E + id (smallest key, ties
    lower id, in one int64), shifted left by `slot_bits` bits holding the slot (2**slot_bits >= C_l): the slots' order is
    the composite keys' and a minimum names its slot."""
    return (((np.int64(kval) + 1) * E + e) << slot_bits) | s


@njit(cache=True, inline="always")
def lfu_decay(f, gamma):
    """lfu, every expert at the end of a token: gamma * f[e] (then + 1 if selected)."""
    return gamma * f


@njit(cache=True, inline="always")
def crf_decay(c, decay):
    """crf, every expert at the end of a token: 2**(-1/h) * c[e] (then + 1 if computed)."""
    return decay * c


@njit(cache=True, inline="always")
def lfuda_touch(age, c):
    """lfuda, a selected expert: (c[e] + 1, K[e] = A + c[e] + 1)."""
    return c + 1, np.float64(age + c + 1)


@njit(cache=True, inline="always")
def lfuda_evicted(age, kv, cv):
    """lfuda, victim v leaving: (A = max(A, K[v]), c[v] = floor(c[v] / 2))."""
    return max(age, np.int64(kv)), cv // 2


@njit(cache=True, inline="always")
def lfuda_loaded(age, c):
    """lfuda, e becoming resident: K[e] = A + c[e]."""
    return np.float64(age + c)


@njit(cache=True, inline="always")
def s3_touch(freq):
    """s3fifo: a computed resident's freq, saturating at S3_FREQ_MAX."""
    return freq + 1 if freq < S3_FREQ_MAX else freq


@njit(cache=True)
def _s3_oldest(slot_expert, p0, cap, key, pin, stamp, queue, q):
    """Slot of the oldest (smallest position) entry of FIFO `q` whose slot pin != stamp; -1 if none."""
    best = -1
    bk = 0.0
    for s in range(p0, cap):
        e = slot_expert[s]
        if e < 0 or queue[e] != q or pin[s] == stamp:
            continue
        if best < 0 or key[e] < bk:
            best = s
            bk = key[e]
    return best


@njit(cache=True)
def s3_victim(slot_expert, p0, cap, key, pin, stamp, queue, freq, qstate):
    """s3fifo's victim slot among slots p0..cap-1 whose pin != stamp (-1 if none), after the promotions and
    second chances of the walk (module docstring)."""
    while True:
        s = -1
        if qstate[Q_SLEN] >= qstate[Q_STARGET]:
            s = _s3_oldest(slot_expert, p0, cap, key, pin, stamp, queue, S3_SMALL)
        if s < 0:
            m = _s3_oldest(slot_expert, p0, cap, key, pin, stamp, queue, S3_MAIN)
            if m >= 0:
                e = slot_expert[m]
                if freq[e] == 0:
                    return m
                freq[e] -= 1  # second chance: back to main's tail
                key[e] = np.float64(qstate[Q_SEQ])
                qstate[Q_SEQ] += 1
                continue
            s = _s3_oldest(slot_expert, p0, cap, key, pin, stamp, queue, S3_SMALL)
            if s < 0:
                return -1
        e = slot_expert[s]
        if freq[e] <= S3_PROMOTE:
            return s
        freq[e] = 0  # promoted to main's tail
        queue[e] = S3_MAIN
        key[e] = np.float64(qstate[Q_SEQ])
        qstate[Q_SEQ] += 1
        qstate[Q_SLEN] -= 1


@njit(cache=True)
def s3_moved(v, e, key, queue, freq, ghost, qstate):
    """s3fifo after a load of `e` that evicted `v` (-1: a free slot): v leaves its FIFO (from small: into the
    ghost FIFO, whose oldest entry drops when it is full), then e enters main if it is in the ghost (and
    leaves it), else small, with freq 0 at the tail."""
    gcap = ghost.shape[0]
    if v >= 0:
        if queue[v] == S3_SMALL:
            qstate[Q_SLEN] -= 1
            if qstate[Q_GLEN] >= qstate[Q_GMAX]:
                queue[ghost[qstate[Q_GHEAD]]] = S3_NONE
                qstate[Q_GHEAD] = (qstate[Q_GHEAD] + 1) % gcap
                qstate[Q_GLEN] -= 1
            ghost[(qstate[Q_GHEAD] + qstate[Q_GLEN]) % gcap] = v
            qstate[Q_GLEN] += 1
            queue[v] = S3_GHOST
        else:
            queue[v] = S3_NONE
    if queue[e] == S3_GHOST:  # out of the ghost ring (the entries after it move up one place)
        h, n = qstate[Q_GHEAD], qstate[Q_GLEN]
        q = 0
        while ghost[(h + q) % gcap] != e:
            q += 1
        for r in range(q, n - 1):
            ghost[(h + r) % gcap] = ghost[(h + r + 1) % gcap]
        qstate[Q_GLEN] -= 1
        queue[e] = S3_MAIN
    else:
        queue[e] = S3_SMALL
        qstate[Q_SLEN] += 1
    freq[e] = 0
    key[e] = np.float64(qstate[Q_SEQ])
    qstate[Q_SEQ] += 1


def s3_targets(policy: PolicyConfig, capacity: int, pinned: int) -> tuple[int, int]:
    """(small-FIFO target, ghost capacity) of a layer with `capacity` slots, `pinned` of them the hot set:
    max(1, round(s3_small * (C - P))) and C - P (bigrig: round(0.1 * C), C)."""
    n = int(capacity) - int(pinned)
    return max(1, int(round(policy.s3_small * n))), max(1, n)


def init_state(policy: PolicyConfig, cs: CacheState, belady_first_use: list[np.ndarray] | None) -> None:
    """The kind's initial keys, after the initial residency is in place: lru -1 (never used), belady minus the
    first use, s3fifo the residents outside the hot set in main, the last of the residency list the oldest."""
    L, E = cs.key.shape
    if policy.evict == "lru":
        cs.key[:] = -1.0
    elif policy.evict == "belady":
        for l_ in range(L):
            cs.key[l_] = -np.asarray(belady_first_use[l_], dtype=np.float64)[:E]
    elif policy.evict == "s3fifo":
        for l_ in range(L):
            p_, c = int(cs.npin[l_]), int(cs.caps[l_])
            res = [int(e) for e in cs.slot_expert[l_, p_:c] if e >= 0]
            for pos, e in enumerate(reversed(res)):
                cs.queue[l_, e] = S3_MAIN
                cs.key[l_, e] = float(pos)
            cs.qstate[l_, Q_SEQ] = len(res)
            cs.qstate[l_, Q_STARGET], cs.qstate[l_, Q_GMAX] = s3_targets(policy, c, p_)


# Each kind's touch (step 5) and on-load rule on the kernel's arrays, called by run_layer's stages (decisions.py
# `touch_token`, slots.py `claim`) by the codes of the kind's EVICT_KINDS row: one place per kind's behaviour.
# inline="always": numba inlines them into run_layer as its own code, on its borrowed array views. oi / i: the token's output row and input row; ids [T, k], out_* [T or 1, k].

@njit(cache=True, inline="always")
def touch_lfu_int(skey, key, slot_expert, pinned_slots, pinned_keys, n_pinned, n_hits, n_fetched, E, slot_bits):
    """lfu with gamma 1 on integer slot keys: the keys and the hits' slot keys moved at step 1 (decisions.py
    `hits`); a token that fetched protected its hits (pinned_keys), so their slot keys come back and the
    fetched slots get theirs."""
    if n_fetched > 0:
        for q in range(n_hits):
            skey[pinned_slots[q]] = pinned_keys[q]
        for q in range(n_hits, n_pinned):
            s = pinned_slots[q]
            e = slot_expert[s]
            skey[s] = slot_key(key[e], e, E, s, slot_bits)


@njit(cache=True, inline="always")
def touch_lfu(key, ids, i, k, gamma):
    """lfu (float keys, gamma < 1): every expert's f decays, then + 1 per selected expert."""
    for e in range(key.shape[0]):
        key[e] = lfu_decay(key[e], gamma)
    for j in range(k):
        key[ids[i, j]] += 1.0


@njit(cache=True, inline="always")
def touch_lfuda(qstate, age_count, key, skey, slot_expert, ids, i, k, pinned_slots, n_pinned, E, slot_bits):
    """lfuda: each selected expert's count + 1 and K = A + c; the token's pinned slots re-keyed."""
    age = qstate[Q_AGE]
    for j in range(k):
        e = ids[i, j]
        age_count[e], key[e] = lfuda_touch(age, age_count[e])
    for q in range(n_pinned):
        s = pinned_slots[q]
        e = slot_expert[s]
        skey[s] = slot_key(key[e], e, E, s, slot_bits)


@njit(cache=True, inline="always")
def touch_lru(key, skey, out_kind, out_served, out_slot, oi, k, t, E, slot_bits):
    """lru: each full-precision compute (hit, fetch, substitute) of token t: its last use t, its slot re-keyed."""
    for j in range(k):
        if out_kind[oi, j] <= SUB:
            e = out_served[oi, j]
            key[e] = t
            s = out_slot[oi, j]
            skey[s] = slot_key(t, e, E, s, slot_bits)


@njit(cache=True, inline="always")
def touch_crf(key, out_kind, out_served, oi, k, decay):
    """crf: every expert's c decays, then + 1 per full-precision compute."""
    for e in range(key.shape[0]):
        key[e] = crf_decay(key[e], decay)
    for j in range(k):
        if out_kind[oi, j] <= SUB:
            key[out_served[oi, j]] += 1.0


@njit(cache=True, inline="always")
def touch_s3fifo(age_count, out_kind, out_served, oi, k):
    """s3fifo: hits and substitutes add 1 to freq (a fetch is the load, freq 0)."""
    for j in range(k):
        if out_kind[oi, j] == HIT or out_kind[oi, j] == SUB:
            e = out_served[oi, j]
            age_count[e] = s3_touch(age_count[e])


@njit(cache=True, inline="always")
def touch_belady(key, ids, next_use, i, k):
    """belady: minus the next use of each selected expert."""
    for j in range(k):
        key[ids[i, j]] = -next_use[i, j]


@njit(cache=True, inline="always")
def on_load_lfuda(victim_expert, e, key, age_count, qstate):
    """lfuda's on-load rule: the victim (if any) leaves first (A = max(A, K[v]), c[v] halved), then
    K[e] = A + c[e]."""
    if victim_expert >= 0:
        qstate[Q_AGE], age_count[victim_expert] = lfuda_evicted(qstate[Q_AGE], key[victim_expert],
                                                                age_count[victim_expert])
    key[e] = lfuda_loaded(qstate[Q_AGE], age_count[e])
