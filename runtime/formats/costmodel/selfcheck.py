"""The cost model's check after every load: its compiled event replay on a fixed case, against a golden table.

`exercise()` replays fixed event counts (every column: device, fetch, host, admissions queued and popped,
low-bit, prefetch; invalid cells) through `timing._replay_loop` with pinned and with pageable copies and
returns the clock, every per-token time and every statistic. `selfcheck.json` (package data) holds the same
run interpreted by Python (`_replay_loop.py_func`: the source numba compiles, run without the compiler),
written by `python -m tests.golden`; runtime/core/compiled.py compares the two once per process before
`replay_time` returns anything (the unit is `runtime.formats.costmodel.timing.UNIT`).
"""

from __future__ import annotations

import numpy as np

T, L = 12, 3


def _events() -> tuple[np.ndarray, np.ndarray]:
    """Fixed consistent events [T, L, 7] (pops never exceed what a layer queued before) and valid [T, L]."""
    from runtime.formats.costmodel.timing import N_EV_FULL

    ev = np.zeros((T, L, N_EV_FULL), np.int32)
    valid = np.ones((T, L), np.bool_)
    valid[3, 1] = valid[7, 2] = False
    out = np.zeros(L, np.int64)
    for t in range(T):
        for l_ in range(L):
            if not valid[t, l_]:
                continue
            h = (t * 7 + l_ * 13 + 5) * 2654435761 % 1000003
            pop = min(int(out[l_]), h % 3)
            q = (h // 3) % 3
            out[l_] += q - pop
            ev[t, l_] = (4 + h % 3, (h // 9) % 3, (h // 27) % 2, q, pop, (h // 54) % 2, (h // 108) % 3 if l_ else 0)
    return ev, valid


def exercise(interpreted: bool = False) -> dict:
    """The replay of the fixed events with pinned (background copies) and pageable (blocking) copies:
    {"pinned": {"total", "token_s", "stats"}, "pageable": ...}. `interpreted`: run the Python source instead of
    the compiled code (how the golden table is made)."""
    from runtime.formats.costmodel import timing as tm

    fn = tm._replay_loop.py_func if interpreted else tm._replay_loop
    ev, valid = _events()
    out = {}
    for name, blocking in (("pinned", False), ("pageable", True)):
        token_s = np.zeros(T, np.float64)
        stats = np.zeros(tm._N_STATS, np.float64)
        err = np.full(2, -1, np.int64)
        total = fn(ev, valid, 3.1e-4, 4.7e-5, 9.3e-4, 2.2e-4, 1.3e-4, 6.1e-5, blocking, tm._max_outstanding(ev, valid),
                   token_s, stats, err)
        out[name] = {"total": float(total), "token_s": token_s.tolist(), "stats": stats.tolist(),
                     "err": err.tolist()}
    return out
