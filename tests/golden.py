"""Golden tables of the compiled units' post-load checks (runtime/core/compiled.py), from independent references.

`kernel_golden()` replays runtime/core/kernel/selfcheck.py's fixed case under each of its policies through the
pure-Python reference of docs/policies.md (tests/reference.py), never through the kernel; `timing_golden()` runs
the cost model's event replay as the Python function numba compiles (`py_func`: the interpreter, not the
compiler). `python -m tests.golden` writes both tables (what tests/test_compile_once.py checks them against).
"""

from __future__ import annotations

import json

from tests.reference import reference_replay


def kernel_golden() -> dict:
    from runtime.core.kernel import selfcheck as sc
    from runtime.core.policy import PolicyConfig

    c = sc.case()
    out = {}
    for name, (fields, mode) in sc.CASES.items():
        p = PolicyConfig(**fields)
        ref = reference_replay(
            c["ids"], c["weights"], c["ranking"], c["valid"], sc.E, list(sc.CAPS), [list(r) for r in sc.INIT],
            p.rule, tau=p.tau, beta=p.beta, evict=p.evict, gamma=p.gamma, half_life=p.half_life,
            admission_delay=p.admission_delay, fallback=p.fallback, tau_high=p.tau_high, prefetch=p.prefetch,
            prefetch_n=p.prefetch_n, lookahead=c["lookahead"], fetch_cap=p.fetch_cap, pin_fraction=p.pin_fraction,
            s3_small=p.s3_small, copy_buffers=p.copy_buffers)
        row: dict = {}
        if mode != "layers":
            row["kind"] = [x for t in range(sc.T) for l_ in range(sc.L)
                           for x in (ref["kind"][t][l_] if c["valid"][t][l_] else [-1] * sc.K)]
            row["served"] = [x for t in range(sc.T) for l_ in range(sc.L)
                             for x in (ref["served"][t][l_] if c["valid"][t][l_] else [-1] * sc.K)]
        row["counters"] = [{k: layer[k] for k in sc.COUNTER_KEYS} for layer in ref["counters"]]
        row["resident"] = [sorted(r) for r in ref["final_resident"]]
        out[name] = row
    return out


def timing_golden() -> dict:
    from runtime.formats.costmodel import selfcheck as tc

    return tc.exercise(interpreted=True)


def write() -> None:
    from runtime.core.kernel import selfcheck as kc
    from runtime.formats.costmodel import selfcheck as tc

    for path, table, what in ((kc.UNIT.golden, kernel_golden(), "tests/reference.py"),
                              (tc.UNIT.golden, timing_golden(), "timing._replay_loop.py_func, interpreted")):
        doc = {"about": f"expected results of {path.parent.name}/selfcheck.py's exercise(), from {what}; "
                        "written by `python -m tests.golden`", "expected": table}
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    write()
