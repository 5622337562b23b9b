"""llama.cpp's two ways of holding experts as caches the backends drive like `PolicyCache` (docs/policies.md,
"Additions (5)"): `SharedPoolCache` (its expert cache, `--moe-cache-mib`: one pool and one LRU over (layer,
expert) for every MoE layer) and `LayerSplitCache` (its static split `-ncmoe N`). `cache_for` picks the cache
of a policy (`pool`, `layer_split`; every other policy: `PolicyCache`).

Both give what `PolicyCache` gives: `step` (one layer over a chunk of tokens: a `StepResult` of HIT / FETCH /
HOST decisions), `step_layers` (every layer of a trace in one call), the counters of `COUNTER_NAMES` per layer
and in total. Every decision computes the selected expert itself at full precision, so a step's `served` is its
selection, known at once. The shared pool couples the layers and is decided token-major (each token, each
layer in order; runtime/core/kernel/shared_pool.py): a layer-major caller (the emulation) gets a step's kinds
and slots filled in, in the arrays of the `StepResult` it was given, once every earlier token-layer has been
stepped (at the latest after the batch's last MoE layer). The engine decodes token-major, so each of its steps
is decided at once; it runs the pool's slots as one slot array for every layer and the split's host layers on the
host (runtime/backends/engine/slots.py, docs/engine.md).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import NamedTuple

import numpy as np

from runtime.core.compiled import ensure
from runtime.core.errors import InputError
from runtime.core.kernel import shared_pool as sp
from runtime.core.kernel.cache import PolicyCache
from runtime.core.kernel.plan import (
    C_CALLS,
    C_HITS,
    C_HOST,
    EV_DEV,
    EV_HOST,
    FLOAT_COUNTERS,
    HIT,
    HOST,
    N_EV,
    N_INT,
    StepResult,
)
from runtime.core.policy import PolicyConfig
from runtime.core.units import KERNEL as UNIT

log = logging.getLogger(__name__)

__all__ = ["LayerSplitCache", "SharedPoolCache", "cache_for", "ncmoe_layers"]


def ncmoe_layers(capacities, num_experts: int) -> int:
    """`-ncmoe N` at the memory of `capacities` (slots per layer, their sum S): the smallest N whose (L - N) * E
    resident experts fit S slots, N = L - floor(S / E) (docs/policies.md, Additions (5))."""
    caps = np.atleast_1d(np.asarray(capacities, np.int64))
    return int(len(caps) - int(caps.sum()) // int(num_experts))


def cache_for(policy: PolicyConfig, num_experts: int, top_k: int, capacities: np.ndarray,
              initial_residency: list[np.ndarray] | np.ndarray | None = None, **kw) -> PolicyCache | SharedPoolCache | LayerSplitCache:
    """The cache that runs `policy`: llama.cpp's shared pool or layer split, else the per-layer `PolicyCache`."""
    if policy.pool == "shared":
        return SharedPoolCache(policy, num_experts, top_k, capacities, initial_residency,
                               allow_full=kw.get("allow_full", False))
    if policy.layer_split == "ncmoe":
        return LayerSplitCache(policy, num_experts, top_k, capacities, allow_full=kw.get("allow_full", False))
    return PolicyCache(policy, num_experts, top_k, capacities, initial_residency, **kw)


class _Family:
    """What both caches share: dimensions, counters and their reports (PolicyCache's own)."""

    prefetch_width = 0  # no prefetch
    route_depth = 0  # no routing
    routed = None

    def __init__(self, policy: PolicyConfig, num_experts: int, top_k: int, capacities, allow_full: bool) -> None:
        policy.validate()
        ensure(UNIT)  # the compiled kernel checked once per process (runtime/core/compiled.py)
        self.policy, self.E, self.k = policy, int(num_experts), int(top_k)
        self.caps = np.atleast_1d(np.asarray(capacities, dtype=np.int64)).copy()
        self.L = len(self.caps)
        for l_, c in enumerate(self.caps.tolist()):
            if not (self.k <= c < self.E or (allow_full and c == self.E)):
                raise InputError(f"capacity = {c} (layer {l_}) must satisfy k={self.k} <= C < E={self.E}")
        self.next_t = np.zeros(self.L, np.int64)
        self.counters = np.zeros((self.L, N_INT), np.int64)
        self.mass = np.zeros((self.L, len(FLOAT_COUNTERS)), np.float64)
        self.npin = np.zeros(self.L, np.int64)

    def _inputs(self, layer: int, ids, valid, t0) -> tuple[np.ndarray, np.ndarray, int]:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        T = ids.shape[0]
        if ids.ndim != 2 or ids.shape[1] != self.k:
            raise ValueError(f"step: ids {ids.shape}, expected [T, k={self.k}] (layer {layer})")
        valid = np.ones(T, np.bool_) if valid is None else np.ascontiguousarray(valid, dtype=np.bool_)
        start = int(self.next_t[layer])
        if t0 is not None and int(t0) != start:
            raise ValueError(f"step: t0 = {t0} at layer {layer}, whose next token is {start} (tokens in stream order)")
        if T and (ids.min() < 0 or ids.max() >= self.E):
            raise InputError(f"selection: expert id outside [0, {self.E}) at layer {layer}")
        return ids, valid, start

    _row = PolicyCache._row
    counter_totals = PolicyCache.counter_totals
    per_layer = PolicyCache.per_layer


class LayerSplitCache(_Family):
    """llama.cpp's `-ncmoe N`: layers 0..N-1 compute every selected expert on the host (HOST), the others hold all
    E experts (HIT, slot = the expert id). `caps` here is what each layer holds on the device (0 or E; the run's
    capacities decide N); `ncmoe` is N."""

    def __init__(self, policy: PolicyConfig, num_experts: int, top_k: int, capacities, *, allow_full: bool = False):
        super().__init__(policy, num_experts, top_k, capacities, allow_full)
        self.ncmoe = ncmoe_layers(self.caps, self.E)
        self.caps = np.where(np.arange(self.L) < self.ncmoe, 0, self.E).astype(np.int64)

    def _decide(self, layer: int, ids: np.ndarray, valid: np.ndarray, ev: np.ndarray):
        """kind, served, slot [T, k] of one layer; counters and events [T, N_EV] added."""
        host = layer < self.ncmoe
        kind = np.where(valid[:, None], np.int8(HOST if host else HIT), np.int8(-1)) * np.ones_like(ids, np.int8)  # [T, k]
        served = np.where(valid[:, None], ids, -1).astype(np.int32)  # [T, k]
        slot = (np.full_like(served, -1) if host else served.copy())  # a device layer holds expert e in slot e
        n = int(valid.sum())
        self.counters[layer, C_CALLS] += n * self.k
        self.counters[layer, C_HOST if host else C_HITS] += n * self.k
        ev[valid, EV_HOST if host else EV_DEV] += self.k
        return kind, served, slot

    def step(self, layer: int, ids: np.ndarray, weights: np.ndarray | None = None, ranking=None, valid=None,
             t0: int | None = None, nxt=None, events: np.ndarray | None = None, logs: bool = True, predicted=None,
             scores=None, decisions: bool = True) -> StepResult:
        """Decide tokens of one layer (PolicyCache.step's arguments; the ranking, scores, next uses and predicted
        lists are not used: nothing is substituted, evicted or prefetched)."""
        ids, valid, start = self._inputs(layer, ids, valid, t0)
        self.next_t[layer] = start + len(ids)
        ev = np.zeros((len(ids), N_EV), np.int32)
        kind, served, slot = self._decide(layer, ids, valid, ev)
        if events is not None:
            events[...] += ev
        if not decisions:
            kind = served = slot = None
        return StepResult(kind, served, slot, ev, np.zeros((0, 3), np.int64), np.zeros((0, 2), np.int64),
                          np.zeros((0, 3), np.int64))

    def step_layers(self, ids, weights, ranking, valid, events, nxt=None, predicted=None, decisions: bool = False,
                    scores=None):
        """Every layer over the same tokens (PolicyCache.step_layers' arrays, [L, T, ...]); events added."""
        out = [self.step(l_, ids[l_], None, valid=valid[l_], events=events[l_]) for l_ in range(self.L)]
        if not decisions:
            return None
        return tuple(np.stack([getattr(r, f) for r in out]) for f in ("kind", "served", "slot"))

    def resident(self, layer: int) -> np.ndarray:
        """Sorted ids of the experts on the device at `layer` (all E, or none on a host layer)."""
        return np.arange(self.E) if layer >= self.ncmoe else np.zeros(0, np.int64)


class _Chunk(NamedTuple):
    """One step's tokens of one layer, waiting for their token-major turn; its output arrays are the StepResult's."""

    t0: int
    ids: np.ndarray  # [T, k] int32
    valid: np.ndarray  # [T] bool
    kind: np.ndarray  # [T, k] int8, -1 until decided
    slot: np.ndarray  # [T, k] int32
    events: np.ndarray  # [T, N_EV] int32


class SharedPoolCache(_Family):
    """llama.cpp's expert cache: one pool of S = sum C_l slots and one LRU over the keys layer * E + expert, shared
    by every layer; every miss fetched (docs/policies.md, Additions (5)). The decisions' slots are pool slots."""

    def __init__(self, policy: PolicyConfig, num_experts: int, top_k: int, capacities,
                 initial_residency: list[np.ndarray] | np.ndarray | None = None, *, allow_full: bool = False):
        super().__init__(policy, num_experts, top_k, capacities, allow_full)
        L, E = self.L, self.E
        self.S = int(self.caps.sum())
        self.pool = sp.allocate(L, E, self.S, N_INT)
        self.counters = self.pool.counters  # the kernel's, [L, N_INT]
        keys = np.zeros(0, np.int64)
        if initial_residency is not None:
            if len(initial_residency) != L:
                raise InputError(f"initial residency has {len(initial_residency)} layers, expected {L}")
            rows = []
            for l_ in range(L):
                res = np.asarray(initial_residency[l_], np.int64).ravel()
                res = res[res >= 0]
                if len(res) > self.caps[l_]:
                    raise InputError(f"initial residency: layer {l_} holds {len(res)} experts > capacity {self.caps[l_]}")
                if len(res) and res.max() >= E:
                    raise InputError(f"initial residency: layer {l_} has expert id {int(res.max())} outside [0, {E})")
                if len(np.unique(res)) != len(res):
                    raise InputError(f"initial residency: layer {l_} repeats an expert id")
                rows.append(l_ * E + res)
            keys = np.sort(np.concatenate(rows))
        p = self.pool
        sp.place(keys, p.slot_key, p.key_slot, p.prev, p.nxt, p.ends, p.free)
        self._pending: list[deque[_Chunk]] = [deque() for _ in range(L)]
        self._cell = 0  # the next token-major cell (token * L + layer) to decide

    def resident(self, layer: int) -> np.ndarray:
        """Sorted ids of the layer's experts in the pool."""
        return np.flatnonzero(self.pool.key_slot[layer * self.E : (layer + 1) * self.E] >= 0)

    def _run(self, ids, valid, t_base: int, p0: int, p1: int, kind, slot, events) -> None:
        p = self.pool
        sp.run_pool(ids, valid, t_base, p0, p1, self.E, p.slot_key, p.key_slot, p.prev, p.nxt, p.ends, p.free,
                    p.counters, kind, slot, events)

    def step(self, layer: int, ids: np.ndarray, weights: np.ndarray | None = None, ranking=None, valid=None,
             t0: int | None = None, nxt=None, events: np.ndarray | None = None, logs: bool = True, predicted=None,
             scores=None, decisions: bool = True) -> StepResult:
        """Give one layer's next tokens (PolicyCache.step's arguments; ranking, scores, next uses and predicted lists
        are not used). The result's `served` is the selection; its `kind`, `slot` and `events` hold -1 / 0 until the
        token-layers are decided, which is at once when every earlier token-layer (token-major) has been stepped."""
        ids, valid, start = self._inputs(layer, ids, valid, t0)
        T = len(ids)
        if events is not None and (events.dtype != np.int32 or not events.flags.c_contiguous or events.shape != (T, N_EV)):
            raise ValueError(f"step: events {events.shape} {events.dtype}: the shared pool writes int32 [T, {N_EV}] in place")
        ev = np.zeros((T, N_EV), np.int32) if events is None else events
        chunk = _Chunk(start, ids, valid, np.full((T, self.k), -1, np.int8), np.full((T, self.k), -1, np.int32), ev)
        served = np.where(valid[:, None], ids, -1).astype(np.int32)
        self._pending[layer].append(chunk)
        self.next_t[layer] = start + T
        self._advance()
        if not decisions:
            return StepResult(None, None, None, ev, np.zeros((0, 3), np.int64), np.zeros((0, 2), np.int64),
                              np.zeros((0, 3), np.int64))
        return StepResult(chunk.kind, served, chunk.slot, ev, np.zeros((0, 3), np.int64), np.zeros((0, 2), np.int64),
                          np.zeros((0, 3), np.int64))

    def _advance(self) -> None:
        """Decide every token-layer whose token-major predecessors all have been stepped."""
        L, k = self.L, self.k
        t_min = int(self.next_t.min())
        p1 = t_min * L + int(np.flatnonzero(self.next_t == t_min)[0])
        p0 = self._cell
        if p1 <= p0:
            return
        t_lo, t_hi = p0 // L, (p1 - 1) // L + 1  # tokens [t_lo, t_hi) hold the cells
        n = t_hi - t_lo
        ids = np.zeros((L, n, k), np.int32)
        valid = np.zeros((L, n), np.bool_)
        kind = np.full((L, n, k), -1, np.int8)
        slot = np.full((L, n, k), -1, np.int32)
        ev = np.zeros((L, n, N_EV), np.int32)
        for l_ in range(L):
            for c in self._pending[l_]:
                a, b = max(c.t0, t_lo), min(c.t0 + len(c.ids), t_hi)
                if a < b:
                    ids[l_, a - t_lo : b - t_lo] = c.ids[a - c.t0 : b - c.t0]
                    valid[l_, a - t_lo : b - t_lo] = c.valid[a - c.t0 : b - c.t0]
        self._run(ids, valid, t_lo, p0, p1, kind, slot, ev)
        for l_ in range(L):
            first, stop = (p0 - l_ + L - 1) // L, (p1 - 1 - l_) // L + 1  # this layer's decided tokens [first, stop)
            q = self._pending[l_]
            for c in q:
                a, b = max(c.t0, first), min(c.t0 + len(c.ids), stop)
                if a < b:
                    c.kind[a - c.t0 : b - c.t0] = kind[l_, a - t_lo : b - t_lo]
                    c.slot[a - c.t0 : b - c.t0] = slot[l_, a - t_lo : b - t_lo]
                    c.events[a - c.t0 : b - c.t0] += ev[l_, a - t_lo : b - t_lo]
            while q and q[0].t0 + len(q[0].ids) <= stop:
                q.popleft()
        self._cell = p1

    @property
    def pending(self) -> int:
        """Token-layers stepped and not decided yet (a later layer's step decides them)."""
        return sum(int(self.next_t[l_]) - (self._cell - l_ + self.L - 1) // self.L for l_ in range(self.L))

    def step_layers(self, ids, weights, ranking, valid, events, nxt=None, predicted=None, decisions: bool = False,
                    scores=None):
        """Every layer over the same tokens in one kernel call (the simulator's replay): ids [L, T, k], valid [L, T],
        events [L, T, N_EV] int32 C-contiguous (added to). Returns (kind, served, slot) [L, T, k] with `decisions`."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        valid = np.ascontiguousarray(valid, dtype=np.bool_)
        L, T, k = ids.shape
        if (L, k) != (self.L, self.k) or valid.shape != (L, T) or events.shape != (L, T, N_EV) \
                or events.dtype != np.int32 or not events.flags.c_contiguous or len(set(self.next_t.tolist())) != 1:
            raise ValueError(f"step_layers: ids {ids.shape}, valid {valid.shape}, events {events.shape} for L={self.L}, "
                             f"k={self.k} caches at one token (next tokens {sorted(set(self.next_t.tolist()))})")
        t0 = int(self.next_t[0])
        kind = np.full((L, T, k), -1, np.int8)
        slot = np.full((L, T, k), -1, np.int32)
        self._run(ids, valid, t0, t0 * L, (t0 + T) * L, kind, slot, events)
        self.next_t[:] = t0 + T
        self._cell = (t0 + T) * L
        if not decisions:
            return None
        return kind, np.where(valid[..., None], ids, -1).astype(np.int32), slot

    def counter_totals(self) -> dict:
        """Every counter of COUNTER_NAMES summed over layers; every stepped token-layer must be decided."""
        self._check_decided()
        return PolicyCache.counter_totals(self)

    def per_layer(self) -> list[dict]:
        """Every counter per layer, with the run's C_l (`capacity`) and `pinned` 0."""
        self._check_decided()
        return PolicyCache.per_layer(self)

    def _check_decided(self) -> None:
        if self.pending:
            raise RuntimeError(f"shared pool: {self.pending} token-layers stepped and not decided (a layer's steps "
                               f"stopped short of the others: next tokens {self.next_t.tolist()})")
