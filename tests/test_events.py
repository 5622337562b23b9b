"""The event columns have one definition (runtime/core/events.py) that the policy kernel writes by and the
cost model's replay reads by: the same values in both, no module defining its own, and each column charged
as the kernel means it."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import runtime.core.events as events
from runtime.core import kernel
from runtime.core.kernel import plan
from runtime.formats import costmodel
from runtime.formats.costmodel import timing

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("EV_DEV", "EV_FETCH", "EV_HOST", "EV_ADM_QUEUED", "EV_ADM_POPPED", "EV_LOWBIT", "EV_PREFETCH", "N_EV")


def test_kernel_and_cost_model_read_the_same_columns():
    for name in NAMES:
        value = getattr(events, name)
        for mod in (plan, kernel, timing, costmodel):
            assert getattr(mod, name) == value, f"{mod.__name__}.{name} = {getattr(mod, name)}, events.py: {value}"
    columns = [getattr(events, n) for n in NAMES[:-1]]
    assert sorted(columns) == list(range(events.N_EV))  # one column each, every column named
    assert timing.N_EV_FULL == kernel.N_EV and 0 < events.N_EV_BASE < events.N_EV


def _module_level_definitions(source: str) -> set[str]:
    """Names a module assigns at its top level (imports excluded)."""
    out: set[str] = set()
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign | ast.AugAssign) else []
        for t in targets:
            out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def test_no_module_defines_its_own_event_columns():
    """A second definition (even with today's values) is how the kernel's and the cost model's columns drifted
    apart before: only runtime/core/events.py may assign an EV_* or N_EV* name."""
    own = {}
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "runtime/core/events.py":
            continue
        names = {n for n in _module_level_definitions(path.read_text()) if n.startswith(("EV_", "N_EV"))}
        if names:
            own[rel] = sorted(names)
    assert own == {}, f"event columns defined outside runtime/core/events.py: {own}"
    assert _module_level_definitions("EV_X, N_EV = range(2)\nN_EV_FULL: int = 3\n") == {"EV_X", "N_EV", "N_EV_FULL"}


@pytest.mark.parametrize("column, charged", [("EV_DEV", "device"), ("EV_HOST", "host"), ("EV_LOWBIT", "lowbit")])
def test_replay_charges_each_kernel_column_as_the_kernel_means_it(column, charged):
    """An events array written by the kernel's column names ([T, L, N_EV]): the replay charges the one count
    as that kind of compute and nothing else (a column read from another position charges another time)."""
    times = {"device": 1.0, "host": 10.0, "lowbit": 100.0}
    params = timing.CostParams(fetch_s=1000.0, device_expert_s=times["device"], host_expert_s=times["host"],
                               dense_layer_s=0.0, lowbit_expert_s=times["lowbit"])
    ev = np.zeros((1, 1, plan.N_EV), np.int32)  # [T, L, N_EV]
    ev[0, 0, getattr(plan, column)] = 3
    tb = timing.replay_time(ev, np.ones((1, 1), bool), params)
    assert tb.total_s == pytest.approx(3 * times[charged])
