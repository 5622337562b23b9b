"""Tests for the findings rows at equal device memory (4a-mem, 4b-mem, 5-mem, 5q-mem: runtime/tools/findings/memory.py)
and row 7, routing toward residents against the 0.15 rule (runtime/tools/findings/routing.py): the budget gives
each policy its slots for the same bytes, the calibration finds the strength at the target miss rate, and each
row's verdict goes both ways on synthetic runs whose effect is large by construction."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from runtime.core.policy import PRESETS
from runtime.formats import costmodel
from runtime.tools.findings import memory as M
from runtime.tools.findings import routing as RT
from runtime.tools.findings.rules import DIFFERS, HOLDS, INCONCLUSIVE, RULES, UNTESTABLE
from tests.test_findings_page import _run, _setup, calibration_fixture, equal_memory_fixture


def _shape(L: int = 2, E: int = 64, k: int = 8) -> costmodel.ModelShape:
    base = costmodel.load_model_shape("qwen3-next-80b-a3b")
    return dataclasses.replace(base, name=f"test[L={L},E={E},k={k}]", num_layers=L, num_experts=E, top_k=k)


@pytest.mark.parametrize("slots", [8, 16, 40])
def test_equal_memory_gives_each_policy_its_slots_for_the_same_bytes(slots: int) -> None:
    """At the smallest budget holding the rule's C, capacities_for_budget leaves a policy with a pool of B copy
    buffers per layer C - B slots (the budget charges L * B buffers: the presets' B = 1), and the unbounded pool
    L * k * d fewer."""
    shape = _shape()
    b = M.column_budget(shape, slots)
    assert int(costmodel.capacities_for_budget(shape, b, PRESETS["rule-0.15"])[0]) == slots
    assert M.slots_at(shape, b - 2**-20, PRESETS["rule-0.15"]) == slots - 1  # the smallest such budget
    assert M.slots_at(shape, b, PRESETS["fetch-every-miss"]) == slots
    for name in M.ADMISSION:
        for buffers in (1, 2):
            assert M.slots_at(shape, b, M.pooled(name, buffers)) == slots - buffers
        assert M.slots_at(shape, b, PRESETS[name]) == slots - 1
        unbounded = dataclasses.replace(PRESETS[name], copy_buffers=None)
        assert M.slots_at(shape, b, unbounded) == slots - shape.top_k * PRESETS[name].admission_delay
    for name in ("cache-prior", "cache-route"):  # routing copies nothing in the background: the rule's slots
        assert M.slots_at(shape, b, PRESETS[name]) == slots


def test_admission_rows_at_equal_memory_are_named_and_decided_as_at_equal_slots() -> None:
    for rid in ("4a", "4b", "5", "5q"):
        same, mem = RULES[rid], RULES[rid + "-mem"]
        assert same.finding.endswith("(equal slots)") and mem.finding.endswith("(equal device memory)")
        assert same.claims == mem.claims and same.paper == mem.paper and not mem.own
    assert "5s-mem" not in RULES and RULES["7"].own


def test_admission_at_equal_memory_verdict_both_ways() -> None:
    """Quality-First with the pool at 15 slots far below the rule at 16: 4a-mem holds; far above: it differs;
    no run (the budget leaves fewer than k slots): not testable, under the -mem id."""
    rng = np.random.default_rng(1)
    s = _setup()
    main = {"rule-0.15": _run("rule-0.15", 0.01, 0.07, 0.1, rng), "first-choice": _run("first-choice", 0.03, 0.09, 0.2, rng)}
    eq = equal_memory_fixture()
    for level, want in ((0.001, HOLDS), (0.03, DIFFERS)):
        mem = {"quality-first": _run("quality-first", level, 0.07, 0.09, rng, slots=15),
               "speed-first": _run("speed-first", 0.02, 0.1, 0.15, rng, slots=15)}
        r4a, r5q = M.finding_admission_memory(s, main, mem, eq)
        assert (r4a.id, r5q.id) == ("4a-mem", "5q-mem") and r4a.verdict == want
        assert "Quality-First with 1 copy buffer(s) per layer 15" in r4a.ours and "the rule 16" in r4a.ours
        assert r4a.data["speed_first_minus_first_choice"]["point"] < 0  # SF 0.02 vs first-choice 0.03 per token
    r4a, r5q = M.finding_admission_memory(s, main, {}, eq)
    assert r4a.verdict == r5q.verdict == UNTESTABLE and r4a.id == "4a-mem"
    assert M.untestable("5", eq).id == "5-mem"
    assert not M.fits({"emulation": {"slots": {"quality-first": 7, "speed-first": 9}}}, "emulation", 8)


def test_calibrate_finds_the_strength_at_the_target_rate() -> None:
    lam = RT.calibrate(lambda x: 0.3 / (1 + x), 0.0, 1.0, 0.1, integer=False)  # 0.3 / (1 + 2) = 0.1
    assert lam["reached"] and lam["strength"] == pytest.approx(2.0, abs=1e-3)
    assert lam["rate"] == pytest.approx(0.1, abs=1e-4) and [0.0, 0.3] in lam["tried"]
    m = RT.calibrate(lambda x: 1.0 / x, 4, 64, 0.1, integer=True)  # 1/10 = 0.1
    assert m["reached"] and m["strength"] == 10 and m["rate"] == pytest.approx(0.1)
    m = RT.calibrate(lambda x: 1.0 / x, 4, 64, 0.093, integer=True)  # between 1/11 and 1/10: the nearer, 11
    assert m["strength"] == 11
    flat = RT.calibrate(lambda x: 0.5, 0.0, 1.0, 0.1, integer=False)  # never reaches: searched up to LAMBDA_MAX
    assert not flat["reached"] and max(x for x, _ in flat["tried"]) == RT.LAMBDA_MAX


def _routed(rng: np.random.Generator, prior: float, route: float, rate: float = 0.1) -> dict:
    return {"cache-prior": _run("cache-prior", prior, 0.0, 0.0, rng, fetched=rate),
            "cache-route": _run("cache-route", route, 0.0, 0.0, rng, fetched=0.1)}


def test_routing_row_verdict_both_ways_and_not_at_equal_miss_rate() -> None:
    """Row 7: a family losing far less than the rule per token holds, far more differs; a family whose miss rate
    is more than MATCH from the rule's is not compared (its claim not testable)."""
    rng = np.random.default_rng(2)
    s = _setup()
    rule = _run("rule-0.15", 0.01, 0.07, 0.1, rng, fetched=0.1)
    cal = calibration_fixture()
    row = RT.routing_row(s, rule, _routed(rng, 0.001, 0.001), cal, 1.2345, 16)
    assert row.id == "7" and row.verdict == HOLDS
    assert [row.data[f]["verdict"] for f in RT.FAMILIES] == [HOLDS, HOLDS]
    row = RT.routing_row(s, rule, _routed(rng, 0.001, 0.03), cal, 1.2345, 16)
    assert row.verdict == DIFFERS and [row.data[f]["verdict"] for f in RT.FAMILIES] == [HOLDS, DIFFERS]
    row = RT.routing_row(s, rule, _routed(rng, 0.01, 0.01), cal, 1.2345, 16)
    assert row.verdict == INCONCLUSIVE
    row = RT.routing_row(s, rule, _routed(rng, 0.001, 0.001, rate=0.2), cal, 1.2345, 16)  # twice the rule's rate
    assert row.data["cache-prior"]["verdict"] == UNTESTABLE and not row.data["cache-prior"]["equal_miss_rate"]
    assert row.data["cache-route"]["verdict"] == HOLDS and "NOT equal" in row.ours
    assert math.isfinite(row.data["cache-prior"]["difference"])  # reported, not tested
    with pytest.raises(RuntimeError, match="slots at the column's memory"):
        RT.routing_row(s, rule, _routed(rng, 0.001, 0.001), cal, 1.2345, 15)


def test_family_policy_sets_the_calibrated_strength() -> None:
    assert RT.family_policy("cache-prior", 1.5).route_lambda == 1.5
    p = RT.family_policy("cache-route", 24)
    assert p.route_window == 24 and p.route_keep == PRESETS["cache-route"].route_keep
    assert RT.miss_rate({"fetches": 5, "calls": 50}) == pytest.approx(0.1)
