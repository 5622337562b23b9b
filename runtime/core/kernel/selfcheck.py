"""The policy kernel's check after every load: a fixed case through every compiled variant, against a golden table.

`exercise()` replays one small two-layer trace (built here by an integer hash, so it is the same on every
numpy) under one policy per miss rule, fallback, eviction kind, admission, prefetch kind, fetch cap, pinned
hot set and per-layer capacity, through every way a caller enters the compiled code: `PolicyCache.step` on
the lean and the full specialization of `run_layer`, with a ranking and with router scores, in two chunks;
`step_layers` (the simulator's call) on both specializations; `next_use` (Belady: inside the belady case, and
its own output on strided views of another dtype, as the simulator passes them); llama.cpp's shared pool
(shared_pool.py, through `SharedPoolCache` as the emulation and the simulator enter it). It returns every counter
per layer, every decision and the final residency. `selfcheck.json` (package data) holds what the
independent pure-Python reference (tests/reference.py) gives for the same runs, written by `python -m
tests.golden` and checked by tests/test_compile_once.py. runtime/core/compiled.py runs the comparison once
per process before the kernel decides anything (the unit is `runtime.core.kernel.cache.UNIT`). Also the
engine's one compiled call per layer (decide.py `decide_layer`, whose cached object carries its own copy of
run_layers) on its own fixed cases (`decide.exercise`: a tiny one, and this trace under every policy the engine
sends through that call: each miss rule, fallback, eviction kind, admission, copy buffer, fetch cap, pinning,
the SLOW and BAD_SCORES returns and the HOST / LOWBIT / DROP plan rows), against tests/golden.py's reading of
the reference's decisions as plan rows. Every entry point converts its arguments to the signature run here
(tests/test_compile_once.py checks that production compiles no other).
"""

from __future__ import annotations

import numpy as np

T, L, E, K, P = 40, 2, 12, 3, 3  # tokens, layers, experts, top-k, lookahead depth
CAPS = (5, 4)  # per-layer capacities (C_l differ)
INIT = ((0, 1, 2, 3, 4), (5, 6, 7, 8))  # initial residency per layer
CHUNK = 17  # step() is called on tokens [0, 17) and [17, T)

# name -> (PolicyConfig fields, how the kernel is entered: "step", "scores" (router scores for the ranking),
# "layers" (step_layers, counters only))
CASES: dict[str, tuple[dict, str]] = {
    "fetch_all-lfu": ({"rule": "fetch_all"}, "step"),
    "threshold-beta0.1": ({"rule": "threshold", "tau": 0.15, "beta": 0.1}, "step"),
    "first_choice-lru-beta1": ({"rule": "first_choice", "evict": "lru", "beta": 1.0}, "step"),
    "substitute_all-lru-beta0.3-d2": ({"rule": "substitute_all", "evict": "lru", "beta": 0.3,
                                       "admission_delay": 2}, "step"),
    "band-crf": ({"rule": "band", "tau": 0.1, "tau_high": 0.4, "evict": "crf", "half_life": 4.0}, "step"),
    "threshold-drop-lfuda": ({"rule": "threshold", "tau": 0.15, "fallback": "drop", "evict": "lfuda"}, "step"),
    "host-s3fifo": ({"rule": "substitute_all", "fallback": "host", "evict": "s3fifo", "s3_small": 0.3}, "step"),
    "lowbit-lfu-gamma0.5": ({"rule": "threshold", "tau": 0.15, "fallback": "lowbit", "gamma": 0.5}, "step"),
    "lfu-aging-delay3": ({"rule": "threshold", "tau": 0.15, "beta": 0.1, "gamma": 0.9, "admission_delay": 3},
                         "step"),
    "belady": ({"rule": "fetch_all", "evict": "belady"}, "step"),
    "lookahead-n2-beta0.1": ({"rule": "threshold", "tau": 0.15, "beta": 0.1, "prefetch": "lookahead",
                              "prefetch_n": 2}, "step"),
    "oracle-n1-cap1": ({"rule": "threshold", "tau": 0.15, "prefetch": "oracle", "prefetch_n": 1, "fetch_cap": 1},
                       "step"),
    "pinned-0.25": ({"rule": "threshold", "tau": 0.15, "beta": 0.1, "pin_fraction": 0.25}, "step"),
    # Additions (3): a bounded copy pool (admissions wait in queue order, prefetches cut)
    "threshold-beta0.1-buffers1-d2": ({"rule": "threshold", "tau": 0.15, "beta": 0.1, "admission_delay": 2,
                                       "copy_buffers": 1}, "step"),
    "lookahead-n3-beta0.1-buffers2": ({"rule": "threshold", "tau": 0.15, "beta": 0.1, "prefetch": "lookahead",
                                       "prefetch_n": 3, "copy_buffers": 2, "evict": "lru"}, "step"),
    "layers-first_choice-beta0.1-buffers1": ({"rule": "first_choice", "beta": 0.1, "copy_buffers": 1}, "layers"),
    "scores-threshold-beta0.1": ({"rule": "threshold", "tau": 0.15, "beta": 0.1}, "scores"),
    "scores-drop-lru": ({"rule": "first_choice", "fallback": "drop", "evict": "lru"}, "scores"),
    "layers-threshold-beta0.1": ({"rule": "threshold", "tau": 0.15, "beta": 0.1}, "layers"),
    "layers-substitute_all-lru": ({"rule": "substitute_all", "evict": "lru", "beta": 0.1}, "layers"),
    # cache-aware routing (docs/policies.md, Additions (4)): "logits" passes the case's router logits as scores
    "cache-prior-J0": ({"rule": "fetch_all", "route": "cache-prior", "route_lambda": 0.5, "route_keep": 0},
                       "logits"),
    "cache-prior-J1-lru-beta0.2": ({"rule": "fetch_all", "route": "cache-prior", "route_lambda": 1.0,
                                    "evict": "lru", "beta": 0.2}, "logits"),
    "layers-cache-prior-lfuda": ({"rule": "fetch_all", "route": "cache-prior", "route_lambda": 0.3,
                                  "evict": "lfuda", "route_keep": 1}, "layers-logits"),
    "cache-route-J1-M6": ({"rule": "fetch_all", "route": "cache-route", "route_keep": 1, "route_window": 6}, "step"),
    "cache-route-alpha0.5-oracle-beta0.2": ({"rule": "fetch_all", "route": "cache-route", "route_keep": 0,
                                             "route_window": 8, "route_alpha": 0.5, "prefetch": "oracle",
                                             "beta": 0.2}, "step"),
    "scores-cache-route-J2": ({"rule": "fetch_all", "route": "cache-route", "route_keep": 2, "route_window": 5},
                              "scores"),
    "layers-cache-route-s3fifo": ({"rule": "fetch_all", "route": "cache-route", "route_keep": 1, "route_window": 7,
                                   "evict": "s3fifo", "pin_fraction": 0.25}, "layers"),
}


def _hash(*xs: int) -> int:
    """A fixed integer hash (splitmix64 of the arguments): the case's only randomness."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


def case() -> dict:
    """The fixed trace as plain lists: ids [T][L][K], weights [T][L][K] (float64 values of float32s, descending),
    ranking [T][L][E] (the selection first, then a skewed order of the rest), valid [T][L], lookahead [T][L][P]
    (on layer l's row a guess at layer l + 1's selection), logits [T][L][E] (router logits whose descending
    order is the ranking: float32 values, strictly decreasing along it)."""
    ids, w, rank, valid, look = [], [], [], [], []
    for t in range(T):
        row_i, row_w, row_r, row_v, row_l = [], [], [], [], []
        for l_ in range(L):
            # a skewed popularity: expert e drawn with weight (E - e)^2, per layer rotated
            order = sorted(range(E), key=lambda e, t=t, l_=l_: (_hash(t, l_, e) % 1000) / (E - (e + 3 * l_) % E))
            row_r.append(order)
            row_i.append(order[:K])
            a = 0.3 + (_hash(t, l_, 101) % 400) / 1000.0
            b = min(a, (1.0 - a) * (_hash(t, l_, 102) % 1000) / 1000.0)
            c = min(b, (1.0 - a - b) * (_hash(t, l_, 103) % 1000) / 1000.0)
            row_w.append([float(np.float32(x)) for x in (a, b, c)])
            row_v.append(not ((t == 5 and l_ == 1) or (t == 11 and l_ == 0) or (t == 23 and l_ == 1)))
            row_l.append([])
        ids.append(row_i)
        w.append(row_w)
        rank.append(row_r)
        valid.append(row_v)
        look.append(row_l)
    for t in range(T):
        for l_ in range(L):
            nxt = ids[t][min(l_ + 1, L - 1)]
            keep = list(nxt[: _hash(t, l_, 7) % (K + 1)])
            rest = [e for e in sorted(range(E), key=lambda e, t=t, l_=l_: _hash(t, l_, e, 9)) if e not in keep]
            look[t][l_] = keep + rest[: P - len(keep)]
    logits = []
    for t in range(T):
        row = []
        for l_ in range(L):
            z = [0.0] * E
            v = 2.0 + (_hash(t, l_, 201) % 1000) / 500.0  # the first choice's logit
            for e in rank[t][l_]:
                z[e] = float(np.float32(v))
                v -= 0.05 + (_hash(t, l_, e, 202) % 1000) / 1000.0  # strictly decreasing (float32-distinct)
            row.append(z)
        logits.append(row)
    return {"ids": ids, "weights": w, "ranking": rank, "valid": valid, "lookahead": look, "logits": logits}


def _run(name: str, fields: dict, mode: str, c: dict) -> dict:
    from runtime.core.kernel.cache import PolicyCache, next_use, predicted_layers, predicted_lists
    from runtime.core.kernel.plan import N_EV
    from runtime.core.policy import PolicyConfig

    pol = PolicyConfig(**fields)
    ids = np.array(c["ids"], np.int32)  # [T, L, K]
    w = np.array(c["weights"], np.float64)  # [T, L, K]
    rank = np.array(c["ranking"], np.int32)  # [T, L, E]
    valid = np.array(c["valid"], np.bool_)  # [T, L]
    look = np.array(c["lookahead"], np.int32)  # [T, L, P]
    logits = np.array(c["logits"], np.float64)  # [T, L, E]
    nxt = first = None
    if pol.evict == "belady":
        nxt, first = zip(*(next_use(np.ascontiguousarray(ids[:, l_]), np.ascontiguousarray(valid[:, l_]), E, 0)
                           for l_ in range(L)), strict=True)
    pc = PolicyCache(pol, E, K, np.array(CAPS), [np.array(r, np.int32) for r in INIT], belady_first_use=first)
    out: dict = {}
    if mode in ("layers", "layers-logits"):
        lay = [np.ascontiguousarray(a.swapaxes(0, 1)) for a in (ids, w, rank, valid)]
        pc.step_layers(*lay, np.zeros((L, T, N_EV), np.int32), predicted=predicted_layers(pol, ids, valid, look),
                       scores=np.ascontiguousarray(logits.swapaxes(0, 1)) if mode == "layers-logits" else None)
    else:
        kind = np.full((T, L, K), -1, np.int64)
        served = np.full((T, L, K), -1, np.int64)
        for l_ in range(L):
            pred = predicted_lists(pol, l_, ids, valid, look)
            for a, b in ((0, CHUNK), (CHUNK, T)):
                kw = {}
                if mode == "scores":  # scores whose descending order (ties: lower id) is the ranking
                    sc = np.zeros((b - a, E))
                    for i in range(b - a):
                        sc[i, rank[a + i, l_]] = np.arange(E, 0, -1, dtype=np.float64)
                    kw["scores"] = sc
                elif mode == "logits":
                    kw["scores"] = logits[a:b, l_]
                else:
                    kw["ranking"] = rank[a:b, l_]
                r = pc.step(l_, ids[a:b, l_], w[a:b, l_], valid=valid[a:b, l_], t0=a,
                            nxt=None if nxt is None else nxt[l_][a:b],
                            predicted=None if pred is None else pred[a:b], **kw)
                kind[a:b, l_] = r.kind
                served[a:b, l_] = r.served
        kind[~valid] = -1
        served[~valid] = -1
        out["kind"] = kind.reshape(-1).tolist()
        out["served"] = served.reshape(-1).tolist()
    out["counters"] = [{k: row[k] for k in COUNTER_KEYS} for row in pc.per_layer()]
    out["resident"] = [pc.resident(l_).tolist() for l_ in range(L)]
    return out


# the counters compared (those tests/reference.py keeps: the kernel's COUNTER_NAMES beyond them are derived)
COUNTER_KEYS = ("calls", "hits", "fetches", "substitutions", "drops", "host_computes", "lowbit_computes",
                "admissions", "prefetches", "prefetch_used", "admissions_waited", "prefetch_unbuffered",
                "substituted_mass", "lowbit_mass", "reroutes", "rerouted_mass")


def exercise() -> dict:
    """Every case of CASES through the compiled kernel: {name: {"counters", "resident", "kind" and "served" but
    for step_layers' cases}} as plain ints and floats."""
    c = case()
    out = {name: _run(name, fields, mode, c) for name, (fields, mode) in CASES.items()}
    out["decide"] = decide_exercise(c)
    out["next_use"] = _next_uses(c)
    out["shared_pool"] = {mode: _pool(mode, c) for mode in ("step", "layers")}
    return out


def decide_exercise(c: dict | None = None) -> dict:
    """The engine's call (decide.py `decide_layer`) on its fixed cases, as plain ints and floats: {"tiny":
    `decide.exercise_tiny()`, and per policy of decide.DECIDE_CASES `decide.exercise_case` over this module's
    trace}; compared with tests/golden.py's reading of the reference's decisions."""
    from runtime.core.kernel import decide

    c = case() if c is None else c
    return {"tiny": decide.exercise_tiny(),
            **{name: decide.exercise_case(fields, c, CAPS, INIT, COUNTER_KEYS)
               for name, fields in decide.DECIDE_CASES.items()}}


def _pool(mode: str, c: dict) -> dict:
    """llama.cpp's shared pool (runtime/core/llamacpp_cache.py `SharedPoolCache`, whose compiled code is
    shared_pool.py's `run_pool` and `place`) under its preset on the case, warm (INIT), entered as the emulation does
    ("step": each layer's chunk in turn, decided token-major as they arrive) or as the simulator does ("layers":
    `step_layers`): kind and slot [T * L * K] (-1 at invalid cells), calls / hits / fetches per layer, the final
    residency."""
    from runtime.core.kernel.plan import N_EV
    from runtime.core.llamacpp_cache import SharedPoolCache
    from runtime.core.policy import PRESETS

    ids = np.array(c["ids"], np.int32)  # [T, L, K]
    valid = np.array(c["valid"], np.bool_)  # [T, L]
    pool = SharedPoolCache(PRESETS["llamacpp-lru"], E, K, np.array(CAPS), [np.array(r, np.int32) for r in INIT])
    kind = np.full((T, L, K), -1, np.int64)
    slot = np.full((T, L, K), -1, np.int64)
    if mode == "layers":
        lay = [np.ascontiguousarray(a.swapaxes(0, 1)) for a in (ids, valid)]
        k_, _, s_ = pool.step_layers(lay[0], None, lay[0], lay[1], np.zeros((L, T, N_EV), np.int32), decisions=True)
        kind[:], slot[:] = k_.swapaxes(0, 1), s_.swapaxes(0, 1)
    else:
        results = []
        for a, b in ((0, CHUNK), (CHUNK, T)):
            for l_ in range(L):
                results.append((a, b, l_, pool.step(l_, ids[a:b, l_], valid=valid[a:b, l_])))
        for a, b, l_, r in results:  # filled in as the pool decided them
            kind[a:b, l_], slot[a:b, l_] = r.kind, r.slot
    kind[~valid] = -1
    slot[~valid] = -1
    return {"kind": kind.reshape(-1).tolist(), "slot": slot.reshape(-1).tolist(),
            "counters": [{key: row[key] for key in ("calls", "hits", "fetches")} for row in pool.per_layer()],
            "resident": [pool.resident(l_).tolist() for l_ in range(L)]}


def _next_uses(c: dict) -> list[dict]:
    """`next_use` per layer on the case's ids and valid flags as the simulator passes them (strided views of the
    [T, L, ..] arrays, t0 = 3): {"nxt": [T][K], "first": [E]} (inf as None)."""
    from runtime.core.kernel.cache import next_use

    ids = np.array(c["ids"], np.int64)  # [T, L, K]: another dtype than the kernel's, converted by next_use
    valid = np.array(c["valid"], np.bool_)  # [T, L]
    out = []
    for l_ in range(L):
        nxt, first = next_use(ids[:, l_], valid[:, l_], E, 3)
        out.append({"nxt": [[None if np.isinf(x) else float(x) for x in row] for row in nxt],
                    "first": [None if np.isinf(x) else float(x) for x in first]})
    return out
