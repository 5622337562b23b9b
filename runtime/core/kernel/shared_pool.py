"""llama.cpp's expert cache, compiled: one pool of slots and one LRU over (layer, expert), shared by every MoE layer.

docs/policies.md, "Additions (5)". The pool couples the layers (a fetch at layer l evicts the least recently used
key of any layer), so the kernel runs token-major: for each token, each layer in order. It writes the same
per-(token, layer, rank) decision kinds (HIT / FETCH of runtime/core/kernel/plan.py), events and counters as the
per-layer kernel, so the backends' result plumbing is reused; `runtime.core.llamacpp_cache.SharedPoolCache` is
the only caller.

The LRU is a doubly linked list over the pool's slots, least recently used first: a touch moves a slot to the
tail, a victim is the head. Keys never touched since the start (stamp -1) sit at the head in ascending key
order, so the list's order is the spec's "smallest (stamp, key)" (tests/reference_llamacpp.py scans for it).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from runtime.core.kernel.plan import C_CALLS, C_FETCHES, C_HITS, EV_DEV, EV_FETCH, FETCH, HIT

NONE = -1  # no slot (list ends, free markers), no key


class PoolState(NamedTuple):
    """The shared pool (arrays mutated in place by `run_pool`)."""

    slot_key: np.ndarray  # int64 [S]: key layer * E + expert held by each slot (-1 free)
    key_slot: np.ndarray  # int32 [L * E]: slot of each key (-1 not resident)
    prev: np.ndarray  # int32 [S]: the LRU list, toward the least recently used (-1 at the head)
    nxt: np.ndarray  # int32 [S]: toward the most recently used (-1 at the tail)
    ends: np.ndarray  # int64 [4]: head (LRU), tail (MRU), number of free slots, -
    free: np.ndarray  # int32 [S]: free slots, the next one taken last (a stack: lowest index on top)
    counters: np.ndarray  # int64 [L, N_INT]


def allocate(num_layers: int, num_experts: int, slots: int, n_int: int) -> PoolState:
    """An empty pool of `slots` slots over `num_layers * num_experts` keys (every slot free, lowest on top)."""
    return PoolState(np.full(slots, NONE, np.int64), np.full(num_layers * num_experts, NONE, np.int32),
                     np.full(slots, NONE, np.int32), np.full(slots, NONE, np.int32),
                     np.array([NONE, NONE, slots, 0], np.int64), np.arange(slots - 1, -1, -1, dtype=np.int32),
                     np.zeros((num_layers, n_int), np.int64))


@njit(cache=True)
def _append(slot, prev, nxt, ends):
    """Put `slot` at the tail (most recently used) of the list."""
    tail = ends[1]
    prev[slot] = tail
    nxt[slot] = NONE
    if tail == NONE:
        ends[0] = slot
    else:
        nxt[tail] = slot
    ends[1] = slot


@njit(cache=True)
def _unlink(slot, prev, nxt, ends):
    """Take `slot` out of the list."""
    p, n = prev[slot], nxt[slot]
    if p == NONE:
        ends[0] = n
    else:
        nxt[p] = n
    if n == NONE:
        ends[1] = p
    else:
        prev[n] = p


@njit(cache=True)
def place(keys, slot_key, key_slot, prev, nxt, ends, free):
    """The initial residency: `keys` (ascending, distinct) in the lowest slots, in that order at the head of the
    list (never touched: stamp -1, evicted smallest key first); the other slots stay free."""
    S = slot_key.shape[0]
    for i in range(keys.shape[0]):
        slot_key[i] = keys[i]
        key_slot[keys[i]] = i
        _append(i, prev, nxt, ends)
    nfree = 0
    for s in range(S - 1, keys.shape[0] - 1, -1):  # the lowest free slot on top of the stack
        free[nfree] = s
        nfree += 1
    ends[2] = nfree


@njit(cache=True)
def run_pool(ids, valid, t_base, p0, p1, E, slot_key, key_slot, prev, nxt, ends, free, counters, kind, slot, events):
    """Decide the token-layer cells p0 <= p < p1 in token-major order (cell p = token t, layer l with
    p = t * L + l), every layer sharing the pool. ids int32 [L, n, k] and valid bool [L, n] hold tokens
    t_base..t_base + n - 1; kind int8 / slot int32 [L, n, k] and events int32 [L, n, N_EV] are written for the
    decided cells (kind -1, slot -1 at an invalid cell; served is the selection itself, written by the caller).

    Per cell (docs/policies.md, Additions (5)): the hits are touched in rank order (the selection's order, as
    llama.cpp's plan walks its selected ids), then every miss is fetched in ascending expert id into the lowest
    free slot or the least recently used key's slot, and touched."""
    L, n, k = ids.shape
    order = np.empty(k, np.int64)  # [k] rank positions by ascending expert id (the misses' order)
    hit = np.empty(k, np.bool_)
    for p in range(p0, p1):
        t = p // L
        l_ = p - t * L
        i = t - t_base
        if not valid[l_, i]:
            for j in range(k):
                kind[l_, i, j] = -1
                slot[l_, i, j] = -1
            continue
        for j in range(k):  # insertion sort of the k ranks by expert id
            order[j] = j
            q = j
            while q > 0 and ids[l_, i, order[q - 1]] > ids[l_, i, order[q]]:
                order[q - 1], order[q] = order[q], order[q - 1]
                q -= 1
        base = l_ * E
        nf = 0
        for j in range(k):
            s = key_slot[base + ids[l_, i, j]]
            hit[j] = s != NONE
        for j in range(k):  # the hits first, in rank order: touched
            if hit[j]:
                s = key_slot[base + ids[l_, i, j]]
                _unlink(s, prev, nxt, ends)
                _append(s, prev, nxt, ends)
                kind[l_, i, j] = HIT
                slot[l_, i, j] = s
        for q in range(k):  # then every miss, ascending id: a free slot, else the LRU key's
            j = order[q]
            if hit[j]:
                continue
            key = base + ids[l_, i, j]
            if ends[2] > 0:
                ends[2] -= 1
                s = free[ends[2]]
            else:
                s = ends[0]
                key_slot[slot_key[s]] = NONE
                _unlink(s, prev, nxt, ends)
            slot_key[s] = key
            key_slot[key] = s
            _append(s, prev, nxt, ends)
            kind[l_, i, j] = FETCH
            slot[l_, i, j] = s
            nf += 1
        counters[l_, C_CALLS] += k
        counters[l_, C_HITS] += k - nf
        counters[l_, C_FETCHES] += nf
        events[l_, i, EV_DEV] += k
        events[l_, i, EV_FETCH] += nf
