"""The per-layer cache state of the policy kernel: one table of fields, and everything generated from it.

`FIELDS` lists every array the kernel keeps per layer: its name, its shape per layer (a scalar, or an axis
of slots `C`, experts `E`, the admission ring `E+1`, the layer's scalars `Q`, the counters), its dtype, its
initial value and what it holds. From it come `LayerState` (one layer's views, as run_layer reads them),
`CacheState` (the [L, ...] arrays PolicyCache holds), `allocate` (PolicyCache's allocation) and
`layer_state` (the compiled row view). A new per-layer field is one row here; the eviction kind that
needs it initialises it in runtime/core/kernel/evict.py and uses it in run_layer.py.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from runtime.core.kernel.plan import FLOAT_COUNTERS, N_INT

# the layer's scalars (qstate[Q_*]): the admission ring's head and length, the step stamp, the resident
# count, lfuda's inflation value A, and S3-FIFO's queue sequence, small-queue length, ghost ring head and
# length, small-queue target and ghost capacity, and how many of the admission ring's first entries have
# started their copies (the rest wait for a copy buffer: docs/policies.md, "Additions (3)")
(Q_HEAD, Q_LEN, Q_STAMP, Q_RES, Q_AGE, Q_SEQ, Q_SLEN, Q_GHEAD, Q_GLEN, Q_STARGET, Q_GMAX, Q_NSTART) = range(12)
NQ = 12


class Field(NamedTuple):
    """One row of the state table."""

    name: str
    axis: str  # "layer" (one scalar per layer), "C", "E", "E+1", "Q", "N_INT", "N_FLOAT", "R" (2)
    dtype: type
    fill: float  # initial value (evict.init_state sets kind-specific ones)
    doc: str


FIELDS: tuple[Field, ...] = (
    Field("caps", "layer", np.int64, 0, "C_l"),
    Field("npin", "layer", np.int64, 0, "P_l: slots 0..P_l-1 hold the pinned hot set (never a victim)"),
    Field("slot_expert", "C", np.int32, -1, "expert in each slot (-1 free)"),
    Field("expert_slot", "E", np.int32, -1, "slot of each expert (-1 not resident)"),
    Field("key", "E", np.float64, 0, "eviction key (lfu f, lru last use, crf, belady, lfuda K, s3fifo queue position)"),
    Field("skey", "C", np.int64, 0, "composite integer key per slot (integer-key kinds; IMAX = protected)"),
    Field("acc", "E", np.float64, 0, "admission accumulator a[e]"),
    Field("queued", "E", np.bool_, False, "queued for admission"),
    Field("pin", "C", np.int64, 0, "stamp of the step that protects the slot"),
    Field("qstate", "Q", np.int64, 0, "the layer's scalars (Q_*)"),
    Field("q_exp", "E+1", np.int32, 0, "admission queue (ring)"),
    Field("q_due", "E+1", np.int64, 0, "due token of each started entry; the queue token of a waiting one"),
    Field("counters", "N_INT", np.int64, 0, "integer counters (plan.INT_COUNTERS)"),
    Field("mass", "N_FLOAT", np.float64, 0, "float counters (plan.FLOAT_COUNTERS)"),
    Field("age_count", "E", np.int64, 0, "per-expert count: lfuda's c[e], s3fifo's freq[e]"),
    Field("queue", "E", np.int8, 0, "s3fifo: 0 none (not resident, or pinned), 1 small, 2 main, 3 ghost"),
    Field("ghost", "E+1", np.int32, 0, "s3fifo: the ghost FIFO (ring, Q_GHEAD / Q_GLEN)"),
    Field("route_d", "R", np.float64, 0, "cache-prior: the sum of the per-token logit ranges and their count (D)"),
)
NAMES = tuple(f.name for f in FIELDS)

LayerState = NamedTuple("LayerState", [(f.name, int if f.axis == "layer" else np.ndarray) for f in FIELDS])
LayerState.__doc__ = "One layer's cache (views of PolicyCache's [L, ...] arrays), mutated in place by run_layer."
CacheState = NamedTuple("CacheState", [(f.name, np.ndarray) for f in FIELDS])
CacheState.__doc__ = "Every layer's cache: PolicyCache's [L, ...] arrays (row l is layer l's LayerState)."


def allocate(num_layers: int, num_experts: int, max_slots: int) -> CacheState:
    """Every field of the table at its initial value, [L, ...]."""
    n = {"layer": (), "C": (max_slots,), "E": (num_experts,), "E+1": (num_experts + 1,), "Q": (NQ,),
         "N_INT": (N_INT,), "N_FLOAT": (len(FLOAT_COUNTERS),),
         "R": (2,)}
    return CacheState(*(np.full((num_layers, *n[f.axis]), f.fill, f.dtype) for f in FIELDS))


def _build_layer_state():
    """`layer_state(cs, l)`: layer l's LayerState, views of row l of CacheState `cs` (generated from FIELDS:
    numba builds a tuple from a fixed argument list only)."""
    src = "def layer_state(cs, l_):\n    return LayerState(" + ", ".join(f"cs.{n}[l_]" for n in NAMES) + ")\n"
    scope: dict = {"LayerState": LayerState}
    exec(compile(src, "<runtime.core.kernel.state>", "exec"), scope)  # noqa: S102 - generated from FIELDS
    return njit(inline="always")(scope["layer_state"])


layer_state = _build_layer_state()
