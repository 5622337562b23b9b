"""The per token-layer event columns: what the policy kernel counts and the cost model charges, defined once.

The kernel (runtime/core/kernel/plan.py, run_layer.py) writes an int32 events array [T, N_EV] per layer; the
cost model's replay (runtime/formats/costmodel/timing.py) reads [T, L, N_EV]. Both import these names from
here (tests/test_events.py checks that neither defines its own). Nothing is imported: the numba code of both
compiled units reads these as constants, and runtime/core/units.py hashes this file into both units' sources.
"""

from __future__ import annotations

# full-precision device computes (hits, fetches, substitutes), synchronous fetches, host computes, admission
# copies started after the token (with a bounded copy pool a copy may start tokens after it was queued),
# admissions popped before it, low-precision computes, prefetch loads issued for this token-layer
EV_DEV, EV_FETCH, EV_HOST, EV_ADM_QUEUED, EV_ADM_POPPED, EV_LOWBIT, EV_PREFETCH = range(7)
N_EV = 7  # the columns the kernel writes
N_EV_FULL = N_EV  # (the cost model's name for them)
N_EV_BASE = 5  # the columns every event array has: an array from before EV_LOWBIT / EV_PREFETCH has these only
