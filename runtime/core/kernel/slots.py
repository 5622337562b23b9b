"""The slot mechanism of the policy kernel: `claim`, THE load of an expert into a slot (fetch, admission,
prefetch), and the slot-key helpers the stages share. Which victim a claim evicts is the eviction kind's
(its EVICT_KINDS row: the key storage's victim search, search.py / evict.py); the mechanism is here.

Every function is `inline="always"` (numba inlines it into run_layer as its own code) and takes the arrays
it uses as arguments: run_layer's borrowed views (primitives.borrowed), so binding them per call costs no
reference count. `SlotTable` groups the ten arrays a claim reads and writes; `setup` is run_layer.py's
`Setup` (scalars only).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from runtime.core.kernel import evict as ek
from runtime.core.kernel.evict import IMAX
from runtime.core.kernel.primitives import KY_FLOAT, KY_INT_GAMMA1, KY_QUEUE, OL_LFUDA, OL_S3FIFO
from runtime.core.kernel.search import free_slot, victim, victim_int
from runtime.core.kernel.state import Q_RES


class SlotTable(NamedTuple):
    """The arrays of a layer's LayerState that a claim reads and writes (views of the same arrays)."""

    slot_expert: np.ndarray  # [C] expert in each slot (-1 free)
    expert_slot: np.ndarray  # [E] slot of each expert (-1 not resident)
    pin: np.ndarray  # [C] stamp of the step that protects the slot
    qstate: np.ndarray  # [Q] the layer's scalars (state.py Q_*)
    skey: np.ndarray  # [C] composite integer slot keys (integer-key kinds)
    key: np.ndarray  # [E] eviction keys
    queue: np.ndarray  # [E] s3fifo's queue of each expert
    age_count: np.ndarray  # [E] lfuda's c[e], s3fifo's freq[e]
    ghost: np.ndarray  # [E+1] s3fifo's ghost ring
    acc: np.ndarray  # [E] admission accumulators


@njit(cache=True, inline="always")
def claim(setup, table, e, stamp):
    """Put `e` in a free slot if the layer has one, else in the victim's (the kind's smallest key among the
    slots first_evictable.. whose pin != stamp; integer keys: the smallest skey; s3fifo: its queue walk),
    evicting the victim, then the kind's on-load rule. The claimed slot is pinned with `stamp`. Returns
    (slot, requeue): slot -1 when nothing is evictable (nothing changed); requeue the evicted expert when
    admission is on and its accumulator is at beta already (only after a prefetch: a is not reset by one),
    for the caller's admission candidates, else -1."""
    slot_expert, expert_slot, pin, qstate = table.slot_expert, table.expert_slot, table.pin, table.qstate
    skey, key, queue, age_count, ghost, acc = table.skey, table.key, table.queue, table.age_count, table.ghost, table.acc
    victim_expert = -1
    if qstate[Q_RES] < setup.cap:
        s = free_slot(slot_expert, setup.cap)
        qstate[Q_RES] += 1
    else:
        if setup.int_keys:  # "int", or "int-gamma1" with gamma 1
            s = victim_int(skey, setup.first_evictable, setup.cap, setup.slot_bits)
        elif setup.key_storage == KY_QUEUE:
            s = ek.s3_victim(slot_expert, setup.first_evictable, setup.cap, key, pin, stamp, queue, age_count, qstate)
        elif setup.key_storage == KY_FLOAT or setup.key_storage == KY_INT_GAMMA1:  # (lfu with gamma < 1: float)
            s = victim(slot_expert, setup.first_evictable, setup.cap, key, pin, stamp)
        else:  # unreachable: the import check gives every KEYS entry its branch
            raise ValueError("run_layer: an eviction key storage without its victim search in claim")
        if s >= 0:
            victim_expert = slot_expert[s]
            expert_slot[victim_expert] = -1
    if s >= 0:
        slot_expert[s] = e
        expert_slot[e] = s
        pin[s] = stamp
        if setup.int_keys:
            skey[s] = IMAX
        if setup.on_load == OL_LFUDA:
            ek.on_load_lfuda(victim_expert, e, key, age_count, qstate)
        elif setup.on_load == OL_S3FIFO:
            ek.s3_moved(victim_expert, e, key, queue, age_count, ghost, qstate)
    requeue = victim_expert >= 0 and setup.use_admission and acc[victim_expert] >= setup.beta
    return s, (victim_expert if requeue else -1)


@njit(cache=True, inline="always")
def rekey_slot(setup, slot_expert, skey, key, s):
    """Integer-key kinds: slot s's composite key from its expert's key (evict.slot_key), after a protection."""
    e = slot_expert[s]
    skey[s] = ek.slot_key(key[e], e, setup.num_experts, s, setup.slot_bits)


@njit(cache=True, inline="always")
def protect(setup, pin, skey, s, stamp):
    """Protect slot s for the step `stamp` (never a victim of it): pinned, and on integer keys the key IMAX."""
    pin[s] = stamp
    if setup.int_keys:
        skey[s] = IMAX


@njit(cache=True, inline="always")
def key_slots(setup, slot_expert, skey, key):
    """Before the chunk, integer-key kinds: every slot's key from its expert's key (IMAX: free)."""
    if setup.int_keys:
        for s in range(setup.cap):
            if slot_expert[s] >= 0:
                rekey_slot(setup, slot_expert, skey, key, s)
            else:
                skey[s] = IMAX
