"""`PolicyCache`: every layer's cache under one policy, the only way callers drive the kernel.

It allocates the state table (runtime/core/kernel/state.py), places the initial residency and the pinned
hot set, lets the eviction kind set its initial keys (evict.init_state), and enters the compiled kernel
through `run_layers` (run_layer.py): `step` for one layer over a chunk of tokens (emulation, engine),
`step_layers` for every layer of a trace in one call (the simulator). Also here: the inputs a step takes
beside the trace (Belady's next uses, the prefetch's predicted lists) and `warmup`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from runtime.core.compiled import compiled_here, dispatchers, ensure
from runtime.core.errors import InputError
from runtime.core.kernel import evict as ek
from runtime.core.kernel.plan import (
    COUNTER_NAMES,
    FLOAT_COUNTERS,
    INT_COUNTERS,
    N_EV,
    Outputs,
    StepResult,
    Tokens,
)
from runtime.core.kernel.run_layer import F_SUBSTITUTE, run_layers
from runtime.core.kernel.state import FIELDS, Q_RES, allocate
from runtime.core.policy import WEIGHT_NORM_CODE, PolicyConfig, kernel_record, pinned_count
from runtime.core.units import KERNEL as UNIT

__all__ = ["COUNTER_NAMES", "PolicyCache", "kernel_signatures", "next_use", "predicted_layers", "predicted_lists",
           "warmup"]


def next_use(ids: np.ndarray, valid: np.ndarray, E: int, t0: int) -> tuple[np.ndarray, np.ndarray]:
    """Belady helper for one layer. ids [T, k], valid [T]. Returns nxt [T, k] (next valid token index
    > t selecting ids[t, j], inf if none) and first [E] (first valid token selecting e, inf if none).

    The arguments are converted to the one signature the post-load check runs (int32 [T, k] and bool [T],
    C-contiguous; the simulator passes strided views of its trace): no other is ever compiled."""
    ensure(UNIT)
    return _next_use(np.ascontiguousarray(ids, dtype=np.int32), np.ascontiguousarray(valid, dtype=np.bool_),
                     int(E), int(t0))


@njit(cache=True)
def _next_use(ids, valid, E, t0):
    """next_use, compiled."""
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
    """Compile (or load from numba's cache) the kernel and check it (runtime/core/compiled.py `ensure`: the
    fixed case of selfcheck.py against its golden table) before anything is timed.

    `run_layers` has one signature (PolicyCache converts every array it passes: C-contiguous, fixed dtypes) and
    compiles both builds of run_layer with it, so one step of each build would do; the calls below also go
    through every path a caller takes (ranking, router scores, predicted lists, next uses, no decisions,
    step_layers) so that a new signature, should one appear, is compiled here and not in a timed run."""
    ensure(UNIT)
    pc = PolicyCache(PolicyConfig(rule="threshold", tau=0.1, beta=0.5, prefetch="lookahead"), 4, 1, np.array([1]),
                     [np.array([0])])
    pc.step(0, np.array([[1], [2]]), np.array([[0.9], [0.1]]), np.array([[1, 0], [2, 0]]), nxt=np.zeros((2, 1)),
            predicted=np.array([[3], [-1]]))
    pc.step(0, np.array([[1], [2]]), np.array([[0.9], [0.1]]), scores=np.zeros((2, 6))[:, 1:5])  # strided: copied
    lean = PolicyCache(PolicyConfig(rule="threshold", tau=0.1, beta=0.5), 4, 1, np.array([1]), [np.array([0])])
    lean.step(0, np.array([[1], [2]]), np.array([[0.9], [0.1]]), np.array([[1, 0], [2, 0]]), decisions=False)
    ids, w, rk = np.array([[[1], [2]]], np.int32), np.array([[[0.9], [0.1]]]), np.array([[[1, 0], [2, 0]]], np.int32)
    for c in (pc, lean):
        c.next_t[:] = 0
        c.step_layers(ids, w, rk, np.ones((1, 2), np.bool_), np.zeros((1, 2, N_EV), np.int32))


def kernel_signatures() -> dict[str, int]:
    """How many signatures each of the kernel's dispatchers holds in this process (compiled here or loaded from
    numba's cache; a caller's cached object carries its callees, so they stay at 0 when it loaded), and how
    many of them this process compiled: {"run_layers": n, ..., "compiled": c}. `warmup()` in a process whose
    cache a previous one filled leaves "compiled" at 0 (tests/test_kernel.py, scripts/gpu_checks.sh's steps)."""
    out = {d.py_func.__name__: len(d.signatures) for d in dispatchers(UNIT)}
    out["compiled"] = compiled_here(UNIT)
    return out


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
        weight_norm: str = "softmax_topk",
    ) -> None:
        """`weight_norm`: how the model normalises its gate weights (a trace's metadata, the adapter's family):
        Cache-Prior's recomputed weights follow it (docs/policies.md, Additions (4))."""
        policy.validate()
        if policy.pool != "per_layer" or policy.layer_split != "none":  # never run as a per-layer cache
            raise ValueError(f"PolicyCache: pool = {policy.pool!r}, layer_split = {policy.layer_split!r} is llama.cpp's "
                             "way of holding experts: runtime.core.llamacpp_cache.cache_for builds its cache")
        ensure(UNIT)  # the compiled kernel checked once per process (runtime/core/compiled.py)
        self.policy = policy
        self.E, self.k = int(num_experts), int(top_k)
        self.caps = np.atleast_1d(np.asarray(capacities, dtype=np.int64))
        L = self.L = len(self.caps)
        E = self.E
        for l_, c in enumerate(self.caps.tolist()):
            if not (self.k <= c < E or (allow_full and c == E)):
                raise InputError(f"capacity = {c} (layer {l_}) must satisfy k={self.k} <= C < E={E}")
        cmax = int(self.caps.max())
        cs = self._state = allocate(L, E, cmax)  # every layer's cache as the kernel takes it (state.FIELDS)
        cs.caps[:] = self.caps
        for f in FIELDS:  # the arrays as attributes: cache.key, cache.qstate, ...
            setattr(self, f.name, getattr(cs, f.name))
        if policy.evict == "belady" and belady_first_use is None:
            raise InputError("evict = 'belady' needs the whole trace in advance (simulator only)")
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
                self.qstate[l_, Q_RES] = len(res)
        # the pinned hot set (docs/policies.md, Additions (2)): the first P_l entries of each layer's initial
        # residency (count order for a warm start, file order for a residency file) sit in slots 0..P_l-1
        self.npin[:] = [pinned_count(policy.pin_fraction, c) for c in self.caps.tolist()]
        if policy.pin_fraction > 0:
            if initial_residency is None:
                raise InputError(f"--pin-fraction = {policy.pin_fraction!r} needs a warm start (the pinned experts "
                                 "are the first of the initial residency); this run starts cold")
            for l_, (c, p_) in enumerate(zip(self.caps.tolist(), self.npin.tolist(), strict=True)):
                if c - p_ < self.k:
                    raise InputError(f"--pin-fraction = {policy.pin_fraction!r} pins P={p_} of C={c} slots at layer "
                                     f"{l_}, leaving {c - p_} < k={self.k} for fetches (need C - P >= k)")
                if int(self.qstate[l_, Q_RES]) < p_:
                    raise InputError(f"--pin-fraction = {policy.pin_fraction!r} pins P={p_} experts at layer {l_}; "
                                     f"its initial residency holds only {int(self.qstate[l_, Q_RES])}")
        p = policy
        self.prefetch_width = 0 if p.prefetch == "off" else int(p.prefetch_n or self.k)
        if p.prefetch == "oracle":
            self.prefetch_width = min(self.prefetch_width, self.k)
        ek.init_state(p, cs, belady_first_use)  # the eviction kind's initial keys
        self.params_array = kernel_record(p)  # [1] KERNEL_DTYPE: the engine's one call reads it (decide.address_table)
        self._params = self.params_array[0]  # the policy record the kernel reads (a view of params_array's element)
        r = self._params  # the lean build decides it (step: unless router scores are given)
        self._lean = bool(r["evict"] == ek.K_LFU and r["gamma"] == 1.0 and r["fallback"] == F_SUBSTITUTE
                          and r["fetch_cap"] == -1 and self.prefetch_width == 0 and not self.npin.any()
                          and p.route == "off")
        self._route_checks(weight_norm)

    def _route_checks(self, weight_norm: str) -> None:
        """Cache-aware routing's configuration against the model (k, E, weight normalisation): one-line errors."""
        p = self.policy
        if weight_norm not in WEIGHT_NORM_CODE:
            raise InputError(f"weight_norm = {weight_norm!r} is unknown (choose from {', '.join(WEIGHT_NORM_CODE)})")
        self.weight_norm = weight_norm
        self.routed: tuple[np.ndarray, np.ndarray] | None = None  # step_layers: the routed ids and weights
        self._params["route_norm"] = WEIGHT_NORM_CODE[weight_norm]
        if p.route == "off":
            return
        if p.route_keep > self.k:
            raise InputError(f"--route-keep = {p.route_keep} must be <= k = {self.k} (policy field route_keep)")
        if p.route == "cache-route" and min(p.route_window, self.E) < self.k:
            raise InputError(f"--route-window = {p.route_window} must be >= k = {self.k} (policy field route_window)")
        if p.route == "cache-prior" and weight_norm == "sigmoid_topk":
            raise InputError("--route = 'cache-prior' with a sigmoid router (weight_norm sigmoid_topk) is not "
                             "implemented: its gate needs the score-correction bias, not in the router scores")

    @property
    def route_depth(self) -> int:
        """The ranking depth cache-route reads (min(M, E)); 0 for the other policies."""
        return min(self.policy.route_window, self.E) if self.policy.route == "cache-route" else 0

    def _route_inputs(self, ids: np.ndarray, rank: np.ndarray, scores: np.ndarray | None,
                      where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ranking, scores) as the route stage reads them: cache-prior the router scores (logits) [.., E], required;
        cache-route a ranking at least min(M, E) deep (from the scores when the ranking is shallower)."""
        p = self.policy
        if p.route == "cache-prior":
            if scores is None:
                raise InputError(f"--route = 'cache-prior' needs the router scores (trace column router_scores; "
                                 f"record or emulate --trace-out with this policy writes it){where}")
            sc = np.ascontiguousarray(scores, dtype=np.float64)
            if sc.shape != (*ids.shape[:-1], self.E):
                raise InputError(f"router scores: shape {sc.shape}, expected {[*ids.shape[:-1], self.E]}{where}")
            return rank, sc
        depth = self.route_depth
        if rank.shape[-1] >= depth:
            return rank, np.zeros((*ids.shape[:-2], 0, 0))
        if scores is None:
            raise InputError(f"--route-window = {self.policy.route_window} needs a ranking {depth} deep; this one "
                             f"keeps {rank.shape[-1]} (record a deeper ranking){where}")
        sc = np.asarray(scores, dtype=np.float64)
        rest = sc.copy()
        np.put_along_axis(rest, ids.astype(np.int64), -np.inf, axis=-1)
        others = np.argsort(-rest, axis=-1, kind="stable")[..., : depth - ids.shape[-1]]
        return np.ascontiguousarray(np.concatenate([ids, others.astype(np.int32)], -1)), np.zeros((*ids.shape[:-2], 0, 0))

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
        routed = self.policy.route != "off"  # the kernel rewrites the selection: our own copies
        ids = np.array(ids, dtype=np.int32, order="C", copy=True) if routed else np.ascontiguousarray(ids, dtype=np.int32)
        T, k = ids.shape
        w = (np.array(weights, dtype=np.float64, order="C", copy=True) if routed
             else np.ascontiguousarray(weights, dtype=np.float64))
        rank = ids if ranking is None else np.ascontiguousarray(ranking, dtype=np.int32)
        valid = np.ones(T, np.bool_) if valid is None else np.ascontiguousarray(valid, dtype=np.bool_)
        if routed:
            rank, sc = self._route_inputs(ids, rank, scores, f" (layer {layer})")
        elif scores is None or rank.shape[1] == self.E:  # a full ranking: walk it (stops after a few entries)
            sc = np.zeros((0, 0))
        else:
            # C-contiguous, whatever the caller holds (the adapters pass a strided slice of their pack): one
            # compiled signature (a strided one would be a second compile in every process)
            sc = np.ascontiguousarray(scores, dtype=np.float64)
            if sc.shape != (T, self.E):
                raise InputError(f"router scores: shape {sc.shape}, expected [T={T}, E={self.E}] (layer {layer})")
            rank = ids
        t0 = int(self.next_t[layer]) if t0 is None else int(t0)
        self.next_t[layer] = t0 + T
        nxt = np.zeros((0, k)) if nxt is None else np.ascontiguousarray(nxt, dtype=np.float64)
        if predicted is None or self.prefetch_width == 0:
            pred = np.zeros((0, 0), np.int32)
        else:
            pred = self._predicted(np.asarray(predicted)[:, : self.prefetch_width], (T,), f" (layer {layer})")
        l_ = layer
        rows = T if decisions else 1
        kind = np.empty((rows, k), np.int8)
        served = np.empty((rows, k), np.int32)
        slot = np.empty((rows, k), np.int32)
        ev = np.zeros((T, N_EV), np.int32) if events is None else np.ascontiguousarray(events, dtype=np.int32)
        n_adm = min(T * k, 1 << 20) + self.E if logs else 0  # the simulator needs no logs
        adm_log = np.empty((n_adm, 3), np.int64)
        q_log = np.empty((n_adm, 2), np.int64)  # copies started: this chunk's queued and the E that may wait
        pf_log = np.empty((T * pred.shape[1] if logs else 0, 3), np.int64)
        n_logs = np.zeros(3, np.int64)
        run_layers(Tokens(ids[None], w[None], rank[None], valid[None], sc[None], nxt[None], pred[None]), t0,
                   self._params, self._state, Outputs(kind[None], served[None], slot[None], ev[None], adm_log[None],
                                                      q_log[None], pf_log[None], n_logs[None]), l_,
                   self._lean and sc.shape[0] == 0)
        if events is not None and ev is not events:  # the caller's array (another dtype or layout) gets the counts
            events[...] = ev
        na, nq, npf = (int(x) for x in n_logs)
        if not decisions:
            kind = served = slot = None
        return StepResult(kind, served, slot, ev, adm_log[: min(na, len(adm_log))], q_log[: min(nq, len(q_log))],
                          pf_log[: min(npf, len(pf_log))], ids if routed else None, w if routed else None)

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
        scores: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Decide every layer over the same tokens in one kernel call (the simulator's replay; `step` per layer
        makes the same decisions). ids [L, T, k] int32, weights [L, T, k] float64, ranking [L, T, M] int32,
        valid [L, T] bool (converted if need be), events [L, T, N_EV] int32 C-contiguous (added to); nxt [L, T, k] (belady) or
        None; predicted [L, T, P] int32 (as `step`'s, a row of -1 at layer 0) or None. Writes no logs.
        Returns (kind, served, slot), each [L, T, k], with `decisions`, else None. `scores` [L, T, E]: the
        trace's router scores (cache-prior needs them). With cache-aware routing the kernel rewrites copies of ids
        and weights: `routed` holds them afterwards (docs/policies.md, Additions (4))."""
        routed = self.policy.route != "off"
        ids = np.array(ids, dtype=np.int32, order="C", copy=True) if routed else np.ascontiguousarray(ids, dtype=np.int32)
        weights = (np.array(weights, dtype=np.float64, order="C", copy=True) if routed
                   else np.ascontiguousarray(weights, dtype=np.float64))
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
        sc = np.zeros((L, 0, 0))
        if routed:
            ranking, sc = self._route_inputs(ids, ranking, scores, "")
        self.routed = (ids, weights) if routed else None
        rows = T if decisions else 1
        out = Outputs(np.empty((L, rows, k), np.int8), np.empty((L, rows, k), np.int32),
                      np.empty((L, rows, k), np.int32), events, np.empty((L, 0, 3), np.int64),
                      np.empty((L, 0, 2), np.int64), np.empty((L, 0, 3), np.int64), np.zeros((L, 3), np.int64))
        run_layers(Tokens(ids, weights, ranking, valid, sc, nxt, pred), t0, self._params, self._state,
                   out, 0, self._lean)
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
