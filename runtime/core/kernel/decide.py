"""The engine's host decision for one MoE layer and one token in ONE compiled call (`decide_row`).

From the packed routing row the segments write (runtime/backends/adapters.py `PolicyExperts.pack`:
top-k ids, their gate weights, the router scores, a finiteness flag) to the plan row the next segment
reads (runtime/backends/engine/plan.py `write_plan_row`'s layout), with nothing in Python per rank:

  1. the finiteness flag checked (else `BAD_SCORES`: the caller raises the one-line error);
  2. the selection in rank order (descending router score, ties lower id: `adapters.rank_order`);
  3. the policy kernel's step for the token (`run_layers`, the same compiled entry and arguments as
     `PolicyCache.step` with router scores: identical decisions, counters and logs);
  4. the kernel's events into the layer's event table, the token's fetches listed as (expert, slot);
  5. the plan row [3, k] float32: slot, gate weight in the model dtype's value (`round_to`), 1 where the
     rank is computed from a device slot (HIT, FETCH, SUB).

Every array it reads or writes is preallocated by the caller (`DecideBuffers`); nothing is allocated per
call. It returns the number of fetches when the rest of the plan is those fetches alone (the engine copies
them and is done), or `SLOW` when the plan holds anything the engine applies in Python (admissions,
queued copies, prefetch loads, host or low-bit fallbacks, a drop under drop_renorm): the caller then
hands the same outputs to `PlanRunner.apply` (which rewrites the same plan row).

Entering compiled code costs per array argument (numba unboxes each one: with the kernel's 17 state arrays,
the 15 of Tokens and Outputs and the rest, ~40 us a call on the development VM, more than the decision),
so the engine calls `decide_layer(tab, layer)` instead: ONE int64 table of (address, shape) rows made once per
binding (`address_table`) from which it rebuilds every array as a view (`carray`, no copy), the policy record
(a record scalar alone costs ~4 us to unbox) and the call's constants included, and calls `decide_row`.
The table points into arrays its maker keeps alive.

Module-level `@njit(cache=True)` functions only, each name unique in the project (the compile cache's rules);
`exercise()` runs the call on fixed cases for the post-load check: a tiny one, and selfcheck.py's trace under
every policy the engine sends through this call (DECIDE_CASES).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

from runtime.core.kernel.plan import DROP, FETCH, HOST, LOWBIT, N_EV, Outputs, Tokens
from runtime.core.kernel.run_layer import run_layers
from runtime.core.kernel.state import FIELDS, CacheState
from runtime.core.policy import KERNEL_DTYPE

SLOW = -1  # the plan needs PlanRunner.apply (see the module doc)
BAD_SCORES = -2  # a router score of the row is not finite
# the model dtypes' rounding of a float32 gate weight: (explicit mantissa bits, smallest normal exponent,
# largest finite value); float32's own: no rounding
DTYPE_ROUNDING = {"float32": (23, -126, 3.4028234663852886e38), "bfloat16": (7, -126, 3.3895313892515355e38),
                  "float16": (10, -14, 65504.0)}


@njit(cache=True)
def decide_round_to(x, mant, emin, fmax):
    """float `x` rounded to a binary format of `mant` explicit mantissa bits, smallest normal exponent `emin`
    and largest finite `fmax` (round to nearest, ties to even; subnormals kept; overflow to inf): what
    torch's float32 -> bfloat16 / float16 conversion gives, as a float. `mant` 23: x unchanged."""
    if mant >= 23 or x == 0.0 or not math.isfinite(x):
        return x
    m, ex = math.frexp(abs(x))  # |x| = m * 2**ex, m in [0.5, 1)
    e = max(ex - 1, emin)  # the exponent of the leading bit (subnormals: the smallest normal's)
    q = math.ldexp(1.0, e - mant)  # the format's spacing at |x|
    r = np.rint(abs(x) / q) * q  # exact in float64 (a float32 has 24 bits); rint: ties to even
    if r > fmax:
        r = np.inf
    return r if x > 0 else -r


@njit(cache=True)
def decide_row(packed, k, E, layer, t_next, pol, cs, tok, out, ev_tab, ev_n, rnd, drop_renorm, plan, fetches):
    """One token of MoE layer `layer`, all of the host decision (module doc). packed [1, >= 2k + E + 1] float32;
    t_next [L] int64 (the cache's next token per layer, advanced); pol / cs the PolicyCache's record and state;
    tok / out the kernel's Tokens / Outputs over [1, 1, ...] buffers (ids, rank [1, 1, k] int32 (one array),
    w [1, 1, k] float64, valid [1, 1], score [1, 1, E] float64, nxt [1, 0, k], pred [1, 0, 0]; kind, served,
    slot [1, 1, k], ev [1, 1, N_EV], the logs and n_logs [1, 3]); ev_tab [L, cap, N_EV] int32 and ev_n [L]
    int64: the layer's kernel events, one row per token (the caller keeps cap above what it decodes);
    rnd (mant, emin, fmax) of the model dtype; plan [3, k] float32 (written); fetches [k, 2] int64 (expert,
    slot) of the fetches in rank order (written). Returns the fetch count, SLOW or BAD_SCORES."""
    if packed[0, 2 * k + E] != 1.0:
        return BAD_SCORES
    ids, w, score = tok.ids, tok.w, tok.score
    # 2. rank order: insertion sort of the k selected ids by (-score, id), stable for the model's order
    for j in range(k):
        e = np.int32(packed[0, j])
        wj = packed[0, k + j]
        s = packed[0, 2 * k + e]
        p = j
        while p > 0:
            ep = ids[0, 0, p - 1]
            sp = packed[0, 2 * k + ep]
            if sp > s or (sp == s and ep < e):
                break
            ids[0, 0, p] = ep
            w[0, 0, p] = w[0, 0, p - 1]
            p -= 1
        ids[0, 0, p] = e
        w[0, 0, p] = wj  # float32 -> float64: exact
    for c in range(E):
        score[0, 0, c] = packed[0, 2 * k + c]
    # 3. the kernel's step (PolicyCache.step's call: router scores, so the full build; logs on)
    t0 = t_next[layer]
    t_next[layer] = t0 + 1
    for c in range(N_EV):
        out.ev[0, 0, c] = 0
    for c in range(3):
        out.n_logs[0, c] = 0
    # the full build, as a runtime bool: a literal False would type run_layers' last argument Literal[bool](False)
    # and compile a second run_layers signature beside PolicyCache's (`bool`) in every process that compiles this
    run_layers(tok, t0, pol, cs, out, layer, layer < 0)
    # 4. events, fetches; 5. the plan row
    n = ev_n[layer]
    for c in range(N_EV):
        ev_tab[layer, n, c] = out.ev[0, 0, c]
    ev_n[layer] = n + 1
    kind, served, slot = out.kind, out.served, out.slot
    slow = out.n_logs[0, 0] > 0 or out.n_logs[0, 1] > 0 or out.n_logs[0, 2] > 0
    nf = 0
    for j in range(k):
        c = kind[0, 0, j]
        if c == HOST or c == LOWBIT or (c == DROP and drop_renorm):
            slow = True
        on = c != DROP and c != HOST and c != LOWBIT
        if on:
            plan[0, j] = slot[0, 0, j]
            plan[1, j] = decide_round_to(w[0, 0, j], rnd[0], rnd[1], rnd[2])
            plan[2, j] = 1.0
        else:
            plan[0, j] = 0.0
            plan[1, j] = 0.0
            plan[2, j] = 0.0
        if c == FETCH:
            fetches[nf, 0] = served[0, 0, j]
            fetches[nf, 1] = slot[0, 0, j]
            nf += 1
    return SLOW if slow else nf


@intrinsic
def decide_typed_ptr(typingctx, addr, dt):
    """`decide_typed_ptr(addr, np.int32)`: the int64 address as a typed data pointer (for `carray`)."""
    ty = dt.instance_type if hasattr(dt, "instance_type") else dt.dtype

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_data_type(ty).as_pointer())

    return types.CPointer(ty)(addr, dt), codegen


@njit(cache=True, inline="always")
def decide_view1(tab, i, dt):
    """Row i of the address table as a 1-D C array of dtype `dt` (a view: no copy)."""
    return carray(decide_typed_ptr(tab[i, 0], dt), (tab[i, 1],))


@njit(cache=True, inline="always")
def decide_view2(tab, i, dt):
    """Row i of the address table as a 2-D C array of dtype `dt` (a view: no copy)."""
    return carray(decide_typed_ptr(tab[i, 0], dt), (tab[i, 1], tab[i, 2]))


@njit(cache=True, inline="always")
def decide_view3(tab, i, dt):
    """Row i of the address table as a 3-D C array of dtype `dt` (a view: no copy)."""
    return carray(decide_typed_ptr(tab[i, 0], dt), (tab[i, 1], tab[i, 2], tab[i, 3]))


# the address table's rows: the cache state (FIELDS order), Tokens, four shared arrays, then per MoE layer its packed
# routing row, its plan row and its Outputs
NF = len(FIELDS)
R_TOK = NF  # ids, w, rank, valid, score, nxt, pred
R_SHARED = R_TOK + 7  # t_next, ev_tab, ev_n, fetches, the policy record [1], the call's constants [6]
R_LAYER = R_SHARED + 6
PER_LAYER = 10  # packed, plan, kind, served, slot, ev, adm_log, q_log, pf_log, n_logs


def _build_cache_state():
    """`decide_cache_state(tab)`: the CacheState of the table's first NF rows (generated from FIELDS: numba builds
    a tuple from a fixed argument list only; inlined into `decide_layer`, whose cache entry holds it)."""
    args = ", ".join(f"decide_view{1 if f.axis == 'layer' else 2}(tab, {i}, dt{i})" for i, f in enumerate(FIELDS))
    src = f"def decide_cache_state(tab):\n    return CacheState({args})\n"
    scope: dict = {"CacheState": CacheState, "decide_view1": decide_view1, "decide_view2": decide_view2,
                   **{f"dt{i}": f.dtype for i, f in enumerate(FIELDS)}}
    exec(compile(src, "<runtime.core.kernel.decide>", "exec"), scope)  # noqa: S102 - generated from FIELDS
    return njit(inline="always")(scope["decide_cache_state"])


decide_cache_state = _build_cache_state()


@njit(cache=True)
def decide_layer(tab, layer):
    """`decide_row` for MoE layer `layer` with every array from the address table `tab` (`address_table`): the
    engine's one call per layer and token. Two arguments: the policy record (a numpy record scalar costs ~4 us to
    unbox per call, its 1-element array in the table nothing), k, E, the rounding and drop_renorm (`decide_consts`)
    come from the table too."""
    pol = decide_view1(tab, R_SHARED + 4, KERNEL_DTYPE)[0]
    cst = decide_view1(tab, R_SHARED + 5, np.float64)  # k, E, mant, emin, fmax, drop_renorm
    k, E = np.int64(cst[0]), np.int64(cst[1])
    rnd = (np.int64(cst[2]), np.int64(cst[3]), cst[4])
    cs = decide_cache_state(tab)
    tok = Tokens(decide_view3(tab, R_TOK, np.int32), decide_view3(tab, R_TOK + 1, np.float64),
                 decide_view3(tab, R_TOK + 2, np.int32), decide_view2(tab, R_TOK + 3, np.bool_),
                 decide_view3(tab, R_TOK + 4, np.float64), decide_view3(tab, R_TOK + 5, np.float64),
                 decide_view3(tab, R_TOK + 6, np.int32))
    b = R_LAYER + layer * PER_LAYER
    out = Outputs(decide_view3(tab, b + 2, np.int8), decide_view3(tab, b + 3, np.int32),
                  decide_view3(tab, b + 4, np.int32), decide_view3(tab, b + 5, np.int32),
                  decide_view3(tab, b + 6, np.int64), decide_view3(tab, b + 7, np.int64),
                  decide_view3(tab, b + 8, np.int64), decide_view2(tab, b + 9, np.int64))
    return decide_row(decide_view2(tab, b, np.float32), k, E, layer, decide_view1(tab, R_SHARED, np.int64), pol, cs,
                      tok, out, decide_view3(tab, R_SHARED + 1, np.int32), decide_view1(tab, R_SHARED + 2, np.int64),
                      rnd, cst[5] != 0.0, decide_view2(tab, b + 1, np.float32),
                      decide_view2(tab, R_SHARED + 3, np.int64))


def _row(a: np.ndarray) -> list[int]:
    """(address, shape padded to 3) of a C-contiguous array (the table's row for it)."""
    if not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError(f"decide: address table: an array of shape {a.shape} is not C-contiguous and writeable")
    return [a.ctypes.data, *a.shape, *[0] * (3 - a.ndim)]


def decide_consts(k: int, E: int, rnd: tuple, drop_renorm: bool) -> np.ndarray:
    """The call's constants as `decide_layer` reads them from its table: float64 [6] (k, E, the model dtype's
    rounding (mant, emin, fmax), drop_renorm 0 / 1)."""
    return np.array([k, E, *rnd, float(bool(drop_renorm))], np.float64)


def address_table(cs, t_next: np.ndarray, tok: Tokens, ev_tab: np.ndarray, ev_n: np.ndarray, fetches: np.ndarray,
                  layers: list[tuple[np.ndarray, np.ndarray, Outputs]], pol: np.ndarray, consts: np.ndarray) -> np.ndarray:
    """`decide_layer`'s table, int64 [R_LAYER + PER_LAYER * S, 4]: the CacheState `cs`, the cache's next-token array,
    the Tokens buffers, the event table and its counts, the fetch list, the policy record (`pol`: the PolicyCache's
    1-element KERNEL_DTYPE array, `params_array`), the call's constants (`decide_consts`), and per MoE layer (packed
    row [1, P] float32, plan row [3, k] float32, Outputs). The caller keeps every array alive while the table is
    used and re-writes the event table's row (`set_row`) when it replaces that array."""
    if pol.dtype != KERNEL_DTYPE or pol.shape != (1,) or consts.dtype != np.float64 or consts.shape != (6,):
        raise ValueError("decide: address table: pol must be a [1] KERNEL_DTYPE array, consts float64 [6]")
    rows = [_row(getattr(cs, f.name)) for f in FIELDS] + [_row(a) for a in tok]
    rows += [_row(t_next), _row(ev_tab), _row(ev_n), _row(fetches), _row(pol), _row(consts)]
    for packed, plan, out in layers:
        rows += [_row(packed), _row(plan), *[_row(a) for a in out]]
    return np.array(rows, np.int64)


def set_row(tab: np.ndarray, i: int, a: np.ndarray) -> None:
    """Row i of an address table now points at `a`."""
    tab[i] = _row(a)


class DecideBuffers(NamedTuple):
    """`decide_row`'s preallocated arguments for one PolicyCache (prefetch off) and top-k / E / model dtype."""

    tok: Tokens
    out: Outputs
    ev_tab: np.ndarray  # [L, cap, N_EV] int32: every layer's kernel events, one row per decided token
    ev_n: np.ndarray  # [L] int64: rows used per layer
    rnd: tuple  # (mant, emin, fmax) of the model dtype
    plan_scratch: np.ndarray  # [3, k] float32: a plan row for callers without one
    fetches: np.ndarray  # [k, 2] int64


def decide_buffers(L: int, k: int, E: int, dtype_name: str = "float32", cap: int = 256) -> DecideBuffers:
    """The buffers of `decide_row` for L layers (event table of `cap` rows; `grow_events` enlarges it)."""
    ids = np.zeros((1, 1, k), np.int32)
    tok = Tokens(ids, np.zeros((1, 1, k)), ids, np.ones((1, 1), np.bool_), np.zeros((1, 1, E)),
                 np.zeros((1, 0, k)), np.zeros((1, 0, 0), np.int32))
    out = Outputs(np.zeros((1, 1, k), np.int8), np.zeros((1, 1, k), np.int32), np.zeros((1, 1, k), np.int32),
                  np.zeros((1, 1, N_EV), np.int32), np.zeros((1, k + E, 3), np.int64), np.zeros((1, k, 2), np.int64),
                  np.zeros((1, 0, 3), np.int64), np.zeros((1, 3), np.int64))
    return DecideBuffers(tok, out, np.zeros((L, cap, N_EV), np.int32), np.zeros(L, np.int64),
                         DTYPE_ROUNDING[dtype_name], np.zeros((3, k), np.float32), np.zeros((k, 2), np.int64))


def grow_events(b: DecideBuffers, more: int) -> DecideBuffers:
    """`b` with room for `more` further rows per layer in its event table (a new table when needed)."""
    need = int(b.ev_n.max()) + int(more)
    if need <= b.ev_tab.shape[1]:
        return b
    tab = np.zeros((b.ev_tab.shape[0], max(need, 2 * b.ev_tab.shape[1]), N_EV), np.int32)
    tab[:, : b.ev_tab.shape[1]] = b.ev_tab
    return b._replace(ev_tab=tab)


@functools.cache
def compiled() -> bool:
    """`decide_row` compiled (or loaded from numba's cache) in this process, once: `exercise_tiny()` runs it."""
    exercise_tiny()
    return True


# exercise_tiny()'s packed rows: ids (model order), weights, the E = 4 scores, the finite flag; one miss per token
# (tests/golden.py reads the slots off the reference's residency), a tie of scores, a weight bfloat16 rounds
EXERCISE_ROWS = ((1, 2, 0.25, 0.75, 0.1, 0.2, 0.9, 0.3, 1.0),
                 (3, 2, 0.6, 0.4, 0.5, 0.1, 0.2, 0.7, 1.0),
                 (2, 1, 0.1, 0.30000001, 0.0, 0.4, 0.4, 0.0, 1.0))

# exercise()'s policies: every policy the engine sends through `decide_layer` (prefetch off, routing off:
# runtime/backends/engine/graphs.py OneCall.ready) that takes a branch of its own: each miss rule, fallback (drop
# with and without drop_renorm: the plan row is slow with it only), eviction kind but belady (simulator only),
# admission with delays 1-2 and a copy buffer, the fetch cap, aging, the pinned hot set. A lean-eligible policy
# (lfu, substitute, no cap) is among them: the call takes the full build for every policy, and the others give
# other results on the lean one.
DECIDE_CASES: dict[str, dict] = {
    "fetch_all-lfu": {"rule": "fetch_all"},
    "threshold-beta0.1": {"rule": "threshold", "tau": 0.15, "beta": 0.1},
    "first_choice-lru-beta1-d2": {"rule": "first_choice", "evict": "lru", "beta": 1.0, "admission_delay": 2},
    "band-crf": {"rule": "band", "tau": 0.1, "tau_high": 0.4, "evict": "crf", "half_life": 4.0},
    "threshold-drop-renorm-lfuda": {"rule": "threshold", "tau": 0.15, "fallback": "drop", "drop_renorm": True,
                                    "evict": "lfuda"},
    "threshold-drop-lfu": {"rule": "threshold", "tau": 0.15, "fallback": "drop"},
    "host-s3fifo": {"rule": "substitute_all", "fallback": "host", "evict": "s3fifo", "s3_small": 0.3},
    "lowbit-gamma0.5": {"rule": "threshold", "tau": 0.15, "fallback": "lowbit", "gamma": 0.5},
    "fetch_all-cap1-pinned-lru": {"rule": "fetch_all", "fetch_cap": 1, "evict": "lru", "pin_fraction": 0.25},
    "threshold-beta0.1-buffers1-d2": {"rule": "threshold", "tau": 0.15, "beta": 0.1, "admission_delay": 2,
                                      "copy_buffers": 1},
}
BAD_AT = (7, 1)  # (token, layer): a call with a non-finite router score before the real one (BAD_SCORES, no change)


def model_order(t: int, layer: int, k: int) -> list[int]:
    """The positions (in rank order) of the selection as the model lists it at (t, layer): a rotation, so the call
    sorts it back."""
    r = (t + 2 * layer) % k
    return list(range(r, k)) + list(range(r))


def exercise_tiny() -> dict:
    """`decide_row` on a fixed tiny case (E = 4, k = 2, C = 2, fetch-every-miss, experts 0 and 1 resident, three
    tokens, a tie of scores) through the engine's entry `decide_layer` -> its outputs as plain ints and floats.
    Also compiles the call (`Engine.bind` and the GPU checks' kernel step run it)."""
    from runtime.core.kernel.cache import PolicyCache
    from runtime.core.policy import PRESETS

    k, E = 2, 4
    pc = PolicyCache(PRESETS["fetch-every-miss"], E, k, np.array([2]), [np.array([0, 1])])
    b = decide_buffers(1, k, E, "bfloat16", cap=4)
    rows = EXERCISE_ROWS
    packed = np.zeros((1, 2 * k + E + 1), np.float32)  # [1, 2k + E + 1]: the row decide_layer reads
    tab = address_table(pc._state, pc.next_t, b.tok, b.ev_tab, b.ev_n, b.fetches, [(packed, b.plan_scratch, b.out)],
                        pc.params_array, decide_consts(k, E, b.rnd, False))
    res: dict = {"returns": [], "plans": [], "kinds": [], "slots": []}
    for r in rows:
        packed[0] = r
        n = decide_layer(tab, 0)  # the engine's call (decide_row inside)
        res["returns"].append(int(n))
        res["plans"].append([float(v) for v in b.plan_scratch.ravel()])
        res["kinds"].append([int(v) for v in b.out.kind[0, 0]])
        res["slots"].append([int(v) for v in b.out.slot[0, 0]])
    res["events"] = [int(v) for v in b.ev_tab[0, :3].ravel()]
    res["counters"] = {n: (int(v) if isinstance(v, int) else float(v)) for n, v in pc.counter_totals().items()}
    return res


def exercise_case(fields: dict, c: dict, capacities: tuple, initial: tuple, counter_keys: tuple) -> dict:
    """One policy of DECIDE_CASES through `decide_layer` as the engine calls it, over selfcheck.py's fixed trace
    (every cell decided; the selection in `model_order`, the router logits as scores, bfloat16 rounding), with
    one non-finite row at BAD_AT -> per call (token-major, layers in order): the return, the kinds, the served
    experts, the plan row's weight and on-device columns, and the expert its slot column names (-1 off device);
    the counters per layer and the final residency. `capacities`, `initial` (per-layer residency) and
    `counter_keys` are selfcheck.py's (which calls this: decide.py does not import it)."""
    from runtime.core.kernel.cache import PolicyCache
    from runtime.core.policy import PolicyConfig

    pol = PolicyConfig(**fields)
    T, L, k, E = len(c["ids"]), len(c["ids"][0]), len(c["ids"][0][0]), len(c["logits"][0][0])
    pc = PolicyCache(pol, E, k, np.array(capacities), [np.array(r, np.int32) for r in initial])
    b = decide_buffers(L, k, E, "bfloat16", cap=T + 1)
    outs = [b.out] + [decide_buffers(1, k, E, "bfloat16", cap=1).out for _ in range(L - 1)]
    packed = [np.zeros((1, 2 * k + E + 1), np.float32) for _ in range(L)]  # [1, 2k + E + 1] per layer
    plans = [np.zeros((3, k), np.float32) for _ in range(L)]  # [3, k] per layer
    tab = address_table(pc._state, pc.next_t, b.tok, b.ev_tab, b.ev_n, b.fetches,
                        list(zip(packed, plans, outs, strict=True)), pc.params_array,
                        decide_consts(k, E, b.rnd, pol.drop_renorm))
    res: dict = {"returns": [], "kinds": [], "served": [], "weights": [], "on_device": [], "slot_holds": []}
    for t in range(T):
        for l_ in range(L):
            sel = model_order(t, l_, k)
            row = packed[l_][0]
            row[:k] = [c["ids"][t][l_][j] for j in sel]
            row[k: 2 * k] = [c["weights"][t][l_][j] for j in sel]
            row[2 * k: 2 * k + E] = c["logits"][t][l_]
            if (t, l_) == BAD_AT:
                row[2 * k + E] = 0.0
                res["bad_scores"] = int(decide_layer(tab, l_))
            row[2 * k + E] = 1.0
            n = decide_layer(tab, l_)
            out, plan = outs[l_], plans[l_]
            on = plan[2] != 0.0  # [k]
            res["returns"].append(int(n))
            res["kinds"].append([int(v) for v in out.kind[0, 0]])
            res["served"].append([int(v) for v in out.served[0, 0]])
            res["weights"].append([float(v) for v in plan[1]])
            res["on_device"].append([int(v) for v in on])
            res["slot_holds"].append([int(pc.slot_expert[l_, int(plan[0, j])]) if on[j] else -1 for j in range(k)])
    res["counters"] = [{key: row[key] for key in counter_keys} for row in pc.per_layer()]
    res["resident"] = [pc.resident(l_).tolist() for l_ in range(L)]
    return res

