"""The one policy kernel: every miss rule, fallback, eviction key, admission and prefetch rule of docs/policies.md.

Compiled with numba. Caches are per layer and independent, so the kernel runs one layer over a chunk of
tokens at a time; `PolicyCache` holds the state of every layer and is the only way callers drive it. The
package by job:

- `plan`: decision kinds, counters, event columns, the kernel's input/output records, `StepResult`;
- `state`: the table of per-layer fields, generating LayerState, CacheState and their allocation;
- `evict`: each eviction kind as a key contract (initial keys, touch, on-load / on-evict rules);
- `run_layer`: the compiled kernel, one stage per step of the spec;
- `cache`: `PolicyCache`, the prefetch's predicted lists, Belady's next uses, `warmup`;
- `residency`: the warm start, calibrated per-layer capacities, the residency-file form.

A new policy field is one `_p(..., kernel=(name, encoder))` row in runtime/core/policy.py and its use in
run_layer.py; a new eviction kind is one EVICTS entry there, one EVICT_KINDS row and its rules in evict.py
(the row names its victim search, on-load rule and step-5 touch; a new mechanism is a name in evict.py's
KEYS / ON_LOADS / TOUCHES and its branch in run_layer.py), its reference in tests/reference.py and its row
in docs/policies.md's table of kinds (tests/test_evict_contract.py runs every kind against the reference and
checks the table). A half-added kind, or a mechanism, rule or fallback without its kernel branch, fails at
import with a message naming it.

- `selfcheck`: the fixed case every process checks the compiled kernel with, before it decides anything.

numba caches a compiled function by its own source file only, and a cached object is code this process did
not compile: runtime/core/compiled.py serialises the first compile across processes (a lock beside the
cache), empties this package's cached kernels whenever any of its sources (or runtime/core/policy.py, whose
codes are compiled in) changes, and runs `selfcheck` against its golden table after every load (a wrong or
unreadable cache is removed and compiled again, with one warning).
"""

from __future__ import annotations

import runtime.core.units  # noqa: F401 - numba's cache locator for the compiled units, before any is defined
from runtime.core.kernel.cache import (
    PolicyCache,
    next_use,
    predicted_layers,
    predicted_lists,
    warmup,
)
from runtime.core.kernel.plan import (
    COUNTER_NAMES,
    DROP,
    EV_ADM_POPPED,
    EV_ADM_QUEUED,
    EV_DEV,
    EV_FETCH,
    EV_HOST,
    EV_LOWBIT,
    EV_PREFETCH,
    FETCH,
    FLOAT_COUNTERS,
    HIT,
    HOST,
    INT_COUNTERS,
    KIND_NAMES,
    LOWBIT,
    N_EV,
    N_INT,
    SUB,
    Outputs,
    StepResult,
    Tokens,
    drop_renorm_scale,
)
from runtime.core.kernel.residency import (
    calibrated_capacities,
    calibration_counts,
    residency_array,
    warm_residency,
    warm_start,
)
from runtime.core.kernel.state import CacheState, LayerState

__all__ = [
    "COUNTER_NAMES", "DROP", "EV_ADM_POPPED", "EV_ADM_QUEUED", "EV_DEV", "EV_FETCH", "EV_HOST", "EV_LOWBIT",
    "EV_PREFETCH", "FETCH", "FLOAT_COUNTERS", "HIT", "HOST", "INT_COUNTERS", "KIND_NAMES", "LOWBIT", "N_EV", "N_INT",
    "SUB", "CacheState", "LayerState", "Outputs", "PolicyCache", "StepResult", "Tokens", "calibrated_capacities",
    "calibration_counts", "drop_renorm_scale", "next_use", "predicted_layers", "predicted_lists", "residency_array",
    "warm_residency", "warm_start", "warmup",
]
