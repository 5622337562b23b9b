"""Golden tables of the compiled units' post-load checks (runtime/core/compiled.py), from independent references.

`kernel_golden()` replays runtime/core/kernel/selfcheck.py's fixed case under each of its policies through the
pure-Python reference of docs/policies.md (tests/reference.py), never through the kernel, and reads the
reference's decisions on decide.py's fixed case as the engine's plan rows (`decide_golden`); `timing_golden()` runs
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
            s3_small=p.s3_small, route=p.route, route_lambda=p.route_lambda, route_keep=p.route_keep,
            route_window=p.route_window, route_alpha=p.route_alpha,
            router_scores=c["logits"] if "logits" in mode else None, copy_buffers=p.copy_buffers)
        row: dict = {}
        if not mode.startswith("layers"):
            row["kind"] = [x for t in range(sc.T) for l_ in range(sc.L)
                           for x in (ref["kind"][t][l_] if c["valid"][t][l_] else [-1] * sc.K)]
            row["served"] = [x for t in range(sc.T) for l_ in range(sc.L)
                             for x in (ref["served"][t][l_] if c["valid"][t][l_] else [-1] * sc.K)]
        row["counters"] = [{k: layer[k] for k in sc.COUNTER_KEYS} for layer in ref["counters"]]
        row["resident"] = [sorted(r) for r in ref["final_resident"]]
        out[name] = row
    out["decide"] = decide_golden()
    out["next_use"] = next_use_golden(c)
    pool = shared_pool_golden(c)
    out["shared_pool"] = {"step": pool, "layers": pool}
    return out


def shared_pool_golden(c: dict) -> dict:
    """llama.cpp's shared pool on selfcheck.py's case (`_pool`), from tests/reference_llamacpp.py: kind and slot per
    cell (-1 at invalid ones), calls / hits / fetches per layer, the final residency (the last key per slot)."""
    from runtime.core.kernel import selfcheck as sc
    from tests.reference_llamacpp import shared_pool_reference

    kind, slot, counters = shared_pool_reference(c["ids"], c["valid"], sc.E, list(sc.CAPS), [list(r) for r in sc.INIT])
    # the pool's content: each slot's owner (key layer * E + expert), from the warm start (keys in order, slots 0..)
    # through every decision's slot
    keys = sorted(layer * sc.E + e for layer in range(sc.L) for e in sc.INIT[layer])
    owner: dict[int, int] = dict(enumerate(keys))
    for t in range(sc.T):
        for layer in range(sc.L):
            for j in range(sc.K):
                if kind[t][layer][j] >= 0:
                    owner[slot[t][layer][j]] = layer * sc.E + c["ids"][t][layer][j]
    resident = [sorted(key - layer * sc.E for key in owner.values() if key // sc.E == layer) for layer in range(sc.L)]
    return {"kind": [x for t in range(sc.T) for layer in range(sc.L) for x in kind[t][layer]],
            "slot": [x for t in range(sc.T) for layer in range(sc.L) for x in slot[t][layer]],
            "counters": counters, "resident": resident}


def next_use_golden(c: dict) -> list[dict]:
    """Belady's next uses per layer of the case (selfcheck.py `_next_uses`, t0 = 3), by their definition: for each
    valid token t and rank j the next valid token after t selecting the same expert, and each expert's first valid
    token (None: never)."""
    from runtime.core.kernel import selfcheck as sc

    t0, out = 3, []
    for l_ in range(sc.L):
        ok = [t for t in range(sc.T) if c["valid"][t][l_]]
        nxt = [[None] * sc.K for _ in range(sc.T)]
        for t in ok:
            for j, e in enumerate(c["ids"][t][l_]):
                later = [u for u in ok if u > t and e in c["ids"][u][l_]]
                nxt[t][j] = float(t0 + later[0]) if later else None
        first = [next((float(t0 + t) for t in ok if e in c["ids"][t][l_]), None) for e in range(sc.E)]
        out.append({"nxt": nxt, "first": first})
    return out


def decide_golden() -> dict:
    """What decide_layer must give on its fixed cases (decide.py `exercise`): the tiny one (`decide_tiny_golden`)
    and each policy of DECIDE_CASES (`decide_case_golden`)."""
    from runtime.core.kernel import selfcheck as sc
    from runtime.core.kernel.decide import DECIDE_CASES

    c = sc.case()
    return {"tiny": decide_tiny_golden(), **{name: decide_case_golden(f, c) for name, f in DECIDE_CASES.items()}}


def _bf16(w: float) -> float:
    import torch

    return float(torch.tensor(w, dtype=torch.float32).to(torch.bfloat16).float())


def decide_case_golden(fields: dict, c: dict) -> dict:
    """One policy of decide.py's DECIDE_CASES from the reference, every cell of selfcheck.py's trace valid, the
    selection in rank order (the call sorts the model's order by descending score; the case's logits descend along
    its ranking), substitutes from that ranking: per call the reference's kinds and served experts; the plan row's
    weight (bfloat16, torch's conversion) and on-device flag (HIT, FETCH, SUB), 0 off device; the slot column
    names the served expert's slot; the return: SLOW (-1) when the plan holds more than its fetches (a host or
    low-bit expert, a drop under drop_renorm, an admission applied before the token, an admission copy started
    after it), else the fetch count; BAD_SCORES (-2) for the non-finite row; counters and final residency."""
    from runtime.core.kernel import selfcheck as sc
    from runtime.core.kernel.decide import BAD_SCORES, SLOW
    from runtime.core.kernel.plan import DROP, FETCH, HOST, LOWBIT
    from runtime.core.policy import PolicyConfig

    p = PolicyConfig(**fields)
    T, L = sc.T, sc.L
    ref = reference_replay(
        c["ids"], c["weights"], c["ranking"], [[True] * L for _ in range(T)], sc.E, list(sc.CAPS),
        [list(r) for r in sc.INIT], p.rule, tau=p.tau, beta=p.beta, evict=p.evict, gamma=p.gamma,
        half_life=p.half_life, admission_delay=p.admission_delay, fallback=p.fallback, tau_high=p.tau_high,
        fetch_cap=p.fetch_cap, pin_fraction=p.pin_fraction, s3_small=p.s3_small, copy_buffers=p.copy_buffers)
    busy = [{t for t, *_ in ref["admission_log"][l_]} | {t for t, _ in ref["copies_started"][l_]} for l_ in range(L)]
    res: dict = {"returns": [], "kinds": [], "served": [], "weights": [], "on_device": [], "slot_holds": [],
                 "bad_scores": BAD_SCORES}
    for t in range(T):
        for l_ in range(L):
            kinds = [int(x) for x in ref["kind"][t][l_]]
            served = [int(x) for x in ref["served"][t][l_]]
            on = [int(x not in (DROP, HOST, LOWBIT)) for x in kinds]
            slow = (t in busy[l_] or any(x in (HOST, LOWBIT) for x in kinds)
                    or (p.drop_renorm and DROP in kinds))
            res["returns"].append(SLOW if slow else sum(x == FETCH for x in kinds))
            res["kinds"].append(kinds)
            res["served"].append(served)
            res["weights"].append([_bf16(w) if o else 0.0 for w, o in zip(c["weights"][t][l_], on, strict=True)])
            res["on_device"].append(on)
            res["slot_holds"].append([e if o else -1 for e, o in zip(served, on, strict=True)])
    res["counters"] = [{key: layer[key] for key in sc.COUNTER_KEYS} for layer in ref["counters"]]
    res["resident"] = [sorted(r) for r in ref["final_resident"]]
    return res


def decide_tiny_golden() -> dict:
    """What decide_layer must give on its tiny fixed case, from the reference: the selection in rank order
    (descending score, ties lower id), the reference's decisions per token, each fetched expert in the slot of
    the expert it evicted, the plan row [slot, gate weight as bfloat16 (torch's conversion), on device] per
    rank, the fetch count returned (nothing else to apply under fetch-every-miss), the events and counters."""
    import numpy as np

    from runtime.core.kernel.decide import EXERCISE_ROWS
    from runtime.core.kernel.plan import COUNTER_NAMES, FLOAT_COUNTERS, N_EV

    k, E = 2, 4  # decide.exercise_tiny(): E = 4, k = 2, C = 2, fetch-every-miss, experts 0 and 1 in slots 0 and 1
    ids, ws = [], []
    for r in EXERCISE_ROWS:
        row = np.array(r, np.float32)
        sel = sorted(range(k), key=lambda j, row=row: (-row[2 * k + int(row[j])], int(row[j])))
        ids.append([[int(row[j]) for j in sel]])
        ws.append([[float(row[k + j]) for j in sel]])
    T = len(EXERCISE_ROWS)
    slot_of, prev = {0: 0, 1: 1}, {0, 1}
    res: dict = {"returns": [], "plans": [], "kinds": [], "slots": []}
    events = []
    for t in range(T):
        ref = reference_replay(ids[: t + 1], ws[: t + 1], ids[: t + 1], [[True]] * (t + 1), E, [2], [[0, 1]],
                               "fetch_all")
        now = set(ref["final_resident"][0])
        gone, new = sorted(prev - now), sorted(now - prev)
        assert len(gone) == len(new) <= 1, "decide's fixed case: one eviction per token at most (slots unambiguous)"
        for g, n in zip(gone, new, strict=True):
            slot_of[n] = slot_of.pop(g)
        prev = now
        kinds = [int(x) for x in ref["kind"][t][0]]
        slots = [slot_of[e] for e in ids[t][0]]
        bf16 = [_bf16(w) for w in ws[t][0]]
        res["returns"].append(sum(x == 1 for x in kinds))  # FETCH
        res["plans"].append([float(s) for s in slots] + bf16 + [1.0] * k)  # every rank on device (no fallback)
        res["kinds"].append(kinds)
        res["slots"].append(slots)
        events += [k, sum(x == 1 for x in kinds)] + [0] * (N_EV - 2)
    res["events"] = events
    final = ref["counters"][0]
    res["counters"] = {n: (float(final.get(n, 0.0)) if n in FLOAT_COUNTERS else int(final.get(n, 0)))
                       for n in COUNTER_NAMES}
    return res


def timing_golden() -> dict:
    from runtime.formats.costmodel import selfcheck as tc

    return tc.exercise(interpreted=True)


def write() -> None:
    from runtime.core.kernel.cache import UNIT as kernel
    from runtime.formats.costmodel.timing import UNIT as costmodel

    for path, table, what in ((kernel.golden, kernel_golden(), "tests/reference.py"),
                              (costmodel.golden, timing_golden(), "timing._replay_loop.py_func, interpreted")):
        doc = {"about": f"expected results of {path.parent.name}/selfcheck.py's exercise(), from {what}; "
                        "written by `python -m tests.golden`", "expected": table}
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    write()
