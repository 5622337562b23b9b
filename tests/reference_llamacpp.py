"""Plain, slow, obviously-correct pure-Python reference of llama.cpp's expert cache and layer split
(docs/policies.md, "Additions (5)").

Lists, dicts and sets only, the rules read literally one token-layer at a time; it imports nothing from the
project, so it stays independent of the compiled pool (runtime/core/kernel/shared_pool.py) and of
runtime/core/llamacpp_cache.py. The victim is found by scanning every resident key for the smallest
(stamp, key), not by a list, so a wrong list order in the kernel shows.
"""

from __future__ import annotations

HIT, FETCH, HOST = 0, 1, 4  # the decision codes of docs/policies.md ("Decision codes")


def shared_pool_reference(ids, valid, num_experts, capacities, initial_residency=None):
    """llama.cpp's expert cache: one pool of sum(capacities) slots, one LRU over keys layer * E + expert.

    ids [T][L][k] (expert ids in rank order), valid [T][L] (False: the cell is skipped), initial_residency
    [L][...] per-layer expert ids (None: cold). Returns (kind, slot, counters): kind and slot [T][L][k]
    (-1 at invalid cells), counters [L] of {"calls", "hits", "fetches"}."""
    T = len(ids)
    L = len(capacities)
    E = num_experts
    S = sum(int(c) for c in capacities)
    slot_of = {}  # key -> slot
    key_in = [None] * S  # slot -> key
    stamp = {}  # key -> the sequence number of its last touch (-1: never since the start)
    if initial_residency is not None:
        keys = sorted(layer * E + int(e) for layer in range(L) for e in initial_residency[layer] if int(e) >= 0)
        for i, key in enumerate(keys):
            slot_of[key] = i
            key_in[i] = key
            stamp[key] = -1
    seq = 0
    kind = [[[-1] * len(ids[t][layer]) for layer in range(L)] for t in range(T)]
    slot = [[[-1] * len(ids[t][layer]) for layer in range(L)] for t in range(T)]
    counters = [{"calls": 0, "hits": 0, "fetches": 0} for _ in range(L)]
    for t in range(T):
        for layer in range(L):
            if not valid[t][layer]:
                continue
            sel = [int(e) for e in ids[t][layer]]
            hits = [j for j, e in enumerate(sel) if layer * E + e in slot_of]
            misses = [j for j, e in enumerate(sel) if layer * E + e not in slot_of]
            for j in hits:  # the hits first, in rank order
                key = layer * E + sel[j]
                stamp[key] = seq
                seq += 1
                kind[t][layer][j] = HIT
                slot[t][layer][j] = slot_of[key]
            for j in sorted(misses, key=lambda j: sel[j]):  # then every miss, ascending id
                key = layer * E + sel[j]
                free = [s for s in range(S) if key_in[s] is None]
                if free:
                    s = free[0]
                else:
                    victim = min(slot_of, key=lambda v: (stamp[v], v))
                    s = slot_of.pop(victim)
                    del stamp[victim]
                key_in[s] = key
                slot_of[key] = s
                stamp[key] = seq
                seq += 1
                kind[t][layer][j] = FETCH
                slot[t][layer][j] = s
            counters[layer]["calls"] += len(sel)
            counters[layer]["hits"] += len(hits)
            counters[layer]["fetches"] += len(misses)
    return kind, slot, counters


def ncmoe_reference(ids, valid, num_experts, capacities):
    """llama.cpp's `-ncmoe N`: N the smallest with (L - N) * E <= sum(capacities); layers < N host-compute every
    selected expert, the others hit it in slot = its id. Returns (N, kind, slot, counters) as above, counters with
    "host_computes"."""
    L = len(capacities)
    S = sum(int(c) for c in capacities)
    N = next(n for n in range(L + 1) if (L - n) * num_experts <= S)
    kind = [[[-1] * len(ids[t][layer]) for layer in range(L)] for t in range(len(ids))]
    slot = [[[-1] * len(ids[t][layer]) for layer in range(L)] for t in range(len(ids))]
    counters = [{"calls": 0, "hits": 0, "host_computes": 0} for _ in range(L)]
    for t in range(len(ids)):
        for layer in range(L):
            if not valid[t][layer]:
                continue
            for j, e in enumerate(ids[t][layer]):
                counters[layer]["calls"] += 1
                if layer < N:
                    kind[t][layer][j] = HOST
                    counters[layer]["host_computes"] += 1
                else:
                    kind[t][layer][j] = HIT
                    slot[t][layer][j] = int(e)
                    counters[layer]["hits"] += 1
    return N, kind, slot, counters
