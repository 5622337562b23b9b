"""What the policy kernel decides, and the shapes of what it reads and writes: defined once here.

The decision kinds of a top-k slot, the counter list every backend reports, the per token-layer event
columns the cost model reads (defined in runtime/core/events.py, re-exported), the kernel's input (`Tokens`) and
output (`Outputs`) records, and `StepResult`, the plan of one layer over a chunk of tokens that the
engine applies and the cost model charges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from runtime.core.events import (  # noqa: F401 - the event columns, re-exported: defined in runtime/core/events.py
    EV_ADM_POPPED,
    EV_ADM_QUEUED,
    EV_DEV,
    EV_FETCH,
    EV_HOST,
    EV_LOWBIT,
    EV_PREFETCH,
    N_EV,
)

# decision kinds, per token, layer and top-k slot j
HIT, FETCH, SUB, DROP, HOST, LOWBIT = 0, 1, 2, 3, 4, 5
KIND_NAMES = ("hit", "fetch", "substitute", "drop", "host", "lowbit")
MISS = -1  # a miss not decided yet (inside the kernel only)

# THE counter list: integer counters (column order of PolicyCache.counters), then the float counters
INT_COUNTERS = ("calls", "hits", "fetches", "substitutions", "drops", "host_computes", "lowbit_computes",
                "admissions", "admissions_skipped", "prefetches", "prefetch_used", "reroutes", "admissions_waited",
                "prefetch_unbuffered")
FLOAT_COUNTERS = ("substituted_mass", "lowbit_mass", "rerouted_mass")
COUNTER_NAMES = INT_COUNTERS + FLOAT_COUNTERS
(C_CALLS, C_HITS, C_FETCHES, C_SUBS, C_DROPS, C_HOST, C_LOWBIT, C_ADM, C_ADM_SKIPPED, C_PREF,
 C_PREF_USED, C_REROUTES, C_ADM_WAITED, C_PREF_UNBUF) = range(len(INT_COUNTERS))
N_INT = len(INT_COUNTERS)
M_SUB, M_LOWBIT, M_REROUTE = range(len(FLOAT_COUNTERS))


class Tokens(NamedTuple):
    """One layer's input over a chunk of tokens."""

    ids: np.ndarray  # [T, k] int32 selection
    w: np.ndarray  # [T, k] float64 gate weights
    rank: np.ndarray  # [T, M] int32 candidate ranking (starts with the selection)
    valid: np.ndarray  # [T] bool
    score: np.ndarray  # [T, E] float64 router scores standing for the full ranking (adapters), or [0, 0]: use rank
    nxt: np.ndarray  # [T, k] float64 next use (belady), or [0, k]
    pred: np.ndarray  # [T, P] int32 predicted lists (-1 = none), or [0, 0]


class Outputs(NamedTuple):
    """What run_layer writes: per-slot decisions, per-token events, and the logs of the plan."""

    kind: np.ndarray  # [T, k] int8
    served: np.ndarray  # [T, k] int32
    slot: np.ndarray  # [T, k] int32
    ev: np.ndarray  # [T, N_EV] int32
    adm_log: np.ndarray  # [n, 3] int64 (token, expert, slot)
    q_log: np.ndarray  # [n, 2] int64 (token, expert)
    pf_log: np.ndarray  # [n, 3] int64 (token, expert, slot)
    n_logs: np.ndarray  # [3] int64 entries written (may exceed the logs' length)


@dataclass
class StepResult:
    """The kernel's plan for one layer over a chunk of tokens; the engine applies it in this order per
    token: admissions (`admitted`), prefetch loads (`prefetched`), then the per-slot decisions."""

    # (kind, served and slot are None when step was asked for no decisions)
    kind: np.ndarray | None  # int8 [T, k]: HIT/FETCH/SUB/DROP/HOST/LOWBIT, -1 for invalid cells
    served: np.ndarray | None  # int32 [T, k]: expert that computes slot j (the missed expert for HOST/LOWBIT; -1 drop/invalid)
    slot: np.ndarray | None  # int32 [T, k]: device slot used (-1 drop/host/lowbit/invalid)
    events: np.ndarray  # int32 [T, N_EV]: EV_* counts per token
    admitted: np.ndarray  # int64 [n, 3]: (token, expert, slot) admissions applied
    queued: np.ndarray  # int64 [n, 2]: (token, expert) admissions queued
    prefetched: np.ndarray  # int64 [n, 3]: (token, expert, slot) prefetch loads, applied after that token's admissions
    # cache-aware routing (policy route != off; else None): the routed selection and its gate weights, [T, k] in
    # the routed order, which the per-slot decisions refer to (docs/policies.md, Additions (4))
    ids: np.ndarray | None = None  # int32 [T, k]
    weights: np.ndarray | None = None  # float64 [T, k]


def drop_renorm_scale(kind: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
    """`drop_renorm` (docs/policies.md, "Renormalised drop"): per token the factor (sum of w_j over the
    selection) / (sum of w_j over the hits and the non-dropped misses) for the gate weights of the experts it
    computes; 1 for a token without drops (or with every call dropped: nothing is computed). kind [N, k],
    weights [N, k] -> float64 [N], or None when no call of the chunk is dropped (nothing changes)."""
    drop = np.asarray(kind) == DROP  # [N, k]
    if not drop.any():
        return None
    w = np.asarray(weights, np.float64)
    kept = np.where(drop, 0.0, w).sum(axis=1)  # [N]
    return np.where(drop.any(axis=1) & (kept > 0), w.sum(axis=1) / np.where(kept > 0, kept, 1.0), 1.0)
