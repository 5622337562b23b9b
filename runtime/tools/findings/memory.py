"""The admission rows at equal device memory (4a-mem, 4b-mem, 5-mem, 5q-mem): what one budget buys each policy.

The column's capacity C is what the 0.15 rule (and fetch-every-miss: neither copies in the background) holds; the
column's device memory is the smallest budget that holds it (`column_budget`: `budget_for_capacities`, checked
with `capacities_for_budget`). An admission policy at that memory also pays for its copy buffers: the budget
charges the prefill's double buffer plus L x `copy_buffers` (docs/policies.md "Additions (3)", docs/cost_model.md
"VRAM budget"), so Quality-First and Speed-First run with a bounded pool of COPY_BUFFERS per layer at the slots
`capacities_for_budget` leaves them (`slots_at`). The perplexity rows run the emulation at that budget
(RunSpec.vram_budget_GiB, the loaded model's shape); row 5-mem charges the same budget rule on the cost model's
shape (Qwen3-Next's expert size on the trace's L, E, k), whose slots it reports.

COPY_BUFFERS = 1: the pool of the main job's answer (reports/pareto_equal_memory_copy_pool.md: the rtx4090 answer and both named admission
presets measured there carry `buffers=1`), the smallest pool, and the one that costs the fewest slots (one per
layer); a larger pool waits less but costs a slot per layer per buffer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from runtime.core.policy import PRESETS, PolicyConfig
from runtime.formats import costmodel
from runtime.tools.findings import rows as R
from runtime.tools.findings import stats
from runtime.tools.findings.experiments import PolicyRun, Row, Setup, emulate_policies, sample_text
from runtime.tools.findings.rules import MEMORY, UNTESTABLE
from runtime.tools.findings.stats import fmt_ci

COPY_BUFFERS = 1  # copy buffers per MoE layer of the admission policies at equal memory (module docstring)
ADMISSION = ("quality-first", "speed-first")


def pooled(name: str, buffers: int = COPY_BUFFERS) -> PolicyConfig:
    """The admission preset `name` with a bounded pool of `buffers` copy buffers per layer."""
    return dataclasses.replace(PRESETS[name], copy_buffers=buffers)


def slots_at(shape: costmodel.ModelShape, budget_gib: float, policy: PolicyConfig) -> int:
    """Slots per layer that `budget_gib` leaves `policy` (`capacities_for_budget`'s arithmetic; may be < k)."""
    return int(costmodel.budget_breakdown(shape, budget_gib, policy).slots_per_layer)


def column_budget(shape: costmodel.ModelShape, slots: int, policy: PolicyConfig | None = None) -> float:
    """The smallest device memory (GiB) at which `policy` (default the 0.15 rule) gets `slots` slots per layer:
    `budget_for_capacities`, raised by a byte at a time where its rounding leaves a slot short."""
    policy = PRESETS["rule-0.15"] if policy is None else policy
    budget = costmodel.budget_for_capacities(shape, slots, policy)
    for _ in range(1024):
        if slots_at(shape, budget, policy) >= slots:
            break
        budget += 2.0**-30
    got = slots_at(shape, budget, policy)
    if got != slots:
        raise RuntimeError(f"findings: no budget gives {policy.label()} exactly {slots} slots on {shape.name} "
                           f"({got} at {budget!r} GiB)")
    return budget


def equal_memory(s: Setup, trace: Any, slots: int) -> dict[str, Any]:
    """The column's device memory on the loaded model's shape (the emulation's) and on the cost model's (row 5),
    and the slots each policy gets there."""
    # the emulation's shape (EmulateSource.model_shape), named by the model's folder name: no machine path
    shapes = {"emulation": costmodel.model_shape_for(s.m.model.config.to_dict(), s.m.dtype, name=Path(s.model).name),
              "cost model": costmodel.shape_for_trace(trace, None)}
    out: dict[str, Any] = {"copy_buffers": COPY_BUFFERS}
    for key, shape in shapes.items():
        b = column_budget(shape, slots)
        out[key] = {"shape": shape.name, "budget_gib": b,
                    "slots": {n: slots_at(shape, b, p) for n, p in (("rule-0.15", PRESETS["rule-0.15"]),
                                                                    ("fetch-every-miss", PRESETS["fetch-every-miss"]),
                                                                    *((a, pooled(a)) for a in ADMISSION))}}
    return out


def fits(eq: dict[str, Any], key: str, k: int) -> bool:
    """Whether every admission policy keeps at least k slots per layer at the column's memory on `key`'s shape."""
    return all(eq[key]["slots"][a] >= k for a in ADMISSION)


def emulate_memory(s: Setup, eq: dict[str, Any], k: int) -> dict[str, PolicyRun]:
    """Quality-First and Speed-First with the pool, emulated at the column's device memory ({} when the budget
    leaves them fewer than k slots); each run's slots are checked against `slots_at`'s."""
    if not fits(eq, "emulation", k):
        return {}
    b = eq["emulation"]["budget_gib"]
    runs = emulate_policies(s, {a: pooled(a) for a in ADMISSION}, s.eval_text, budget=dict.fromkeys(ADMISSION, b))
    for a, r in runs.items():
        if int(r.result.capacity[0]) != eq["emulation"]["slots"][a]:
            raise RuntimeError(f"findings: {a} ran at {r.result.capacity} slots, the budget gives "
                               f"{eq['emulation']['slots'][a]}")
    return runs


def finding_admission_memory(s: Setup, main: dict[str, PolicyRun], mem: dict[str, PolicyRun],
                             eq: dict[str, Any]) -> tuple[Row, Row]:
    """Rows 4a-mem and 5q-mem: Quality-First with the pool at the column's device memory minus the 0.15 rule at the
    column's slots (points); Speed-First with the pool minus first-choice is kept in 4a-mem's data."""
    sl = eq["emulation"]["slots"]
    where = (f"at equal device memory ({eq['emulation']['budget_gib']:.4f} GiB on {eq['emulation']['shape']}): the "
             f"rule {sl['rule-0.15']} slots per layer, Quality-First with {COPY_BUFFERS} copy buffer(s) per layer "
             f"{sl['quality-first']}")
    out = []
    for rid in ("4a", "5q"):
        if not mem:
            out.append(Row(rid + MEMORY, where + ": fewer slots than top-k, not run", "n/a", UNTESTABLE,
                           "no run", {"equal_memory": eq}))
            continue
        qf, rule = mem["quality-first"], main["rule-0.15"]
        cnt = np.full(len(qf.dnll), qf.count)
        d = R.difference(rid + MEMORY, s.starts, qf.dnll, rule.dnll, cnt, s.seed)
        row = Row(rid + MEMORY, f"{where}; Quality-First {qf.change:+.2f}% vs the 0.15 rule {rule.change:+.2f}%: "
                  f"{d['difference']:+.2f} points", f"{fmt_ci(*d['ci95'])} points", d["verdict"],
                  sample_text(s, d["method"]), {**d, "quality-first": qf.change, "rule-0.15": rule.change,
                                                "equal_memory": eq,
                                                "quality_first_policy": pooled("quality-first").label(),
                                                "admissions": qf.result.counters["admissions"],
                                                "admissions_waited": qf.result.counters["admissions_waited"]})
        out.append(row)
    if mem:
        sf, fc = mem["speed-first"], main["first-choice"]
        cnt = np.full(len(sf.dnll), sf.count)
        blk = [stats.to_blocks(x, s.starts) for x in (sf.dnll, fc.dnll, cnt)]
        out[0].data["speed_first_minus_first_choice"] = R.paired(blk, (stats.diff_stat,), s.seed)[0]
        out[0].data.update({"speed-first": sf.change, "first-choice": fc.change,
                            "speed_first_policy": pooled("speed-first").label()})
    return out[0], out[1]


def speed_policies(eq: dict[str, Any]) -> dict[str, tuple[PolicyConfig, int]]:
    """Row 5-mem's policies: each admission preset with the pool at the slots the cost model's shape leaves it."""
    return {a: (pooled(a), eq["cost model"]["slots"][a]) for a in ADMISSION}


def untestable(rid: str, eq: dict[str, Any]) -> Row:
    """A row at equal memory whose admission policies the budget leaves fewer than k slots."""
    return Row(rid + MEMORY, f"at equal device memory the admission policies keep fewer slots than top-k "
               f"({eq['emulation']['slots']})", "n/a", UNTESTABLE, "no run", {"equal_memory": eq})
