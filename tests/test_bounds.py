"""The sweep's offline bounds are bounds: computed at the budget (sweep/bounds.py), no fetch-every-miss policy the
sweep could screen at that memory is faster than its kind's bound.

A synthetic trace with a lookahead column, one equal-memory budget (fetch-every-miss with 8 slots per layer),
the simulator as the sweep's workers run it (sweep/worker.py `Evaluator`, a preset host). Fetch-every-miss
policies over every eviction key, aging, pinning, admission (never triggered by fetch_all, but charged its
buffers), lookahead prefetch widths and copy pools: each at least as slow as the bound of its kind.
"""

from __future__ import annotations

import itertools

import pandas as pd
import pytest

from runtime.core.errors import InputError
from runtime.formats import costmodel
from runtime.formats.costmodel import BudgetTooSmall
from runtime.formats.trace import calibration_twin, save_trace, synthetic_trace
from sweep import report
from sweep.bounds import BOUNDS, bound_of, bound_params
from sweep.space import complete
from sweep.worker import Evaluator

HOST = "rtx3090"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("bounds")
    ev, cal = d / "eval.parquet", d / "calib.parquet"
    save_trace(synthetic_trace(400, 4, 32, 4, 16, seed=2, lookahead_depth=8), ev)
    save_trace(calibration_twin(300, 4, 32, 4, 16, seed=2, lookahead_depth=8), cal)
    e = Evaluator(str(ev), str(cal), None)
    shape = costmodel.shape_for_trace(e.backend.cache.trace(str(ev)), None)
    gib = costmodel.budget_for_capacities(shape, 8, None) + 1e-6
    bounds = {}
    for name, params in bound_params({"vram_budget_GiB": gib}, top_k=4):
        r = e.evaluate(params, HOST)
        kind = bound_of(name)
        bounds[kind] = min(bounds.get(kind, float("inf")), r["time_per_token_s"])
    return e, gib, bounds


def policies(gib: float):
    """Fetch-every-miss policies at the budget, one per combination (the features that change its time)."""
    evicts = [{"evict": "lfu"}, {"evict": "lfu", "gamma": 0.9}, {"evict": "lru"}, {"evict": "crf", "half_life": 8.0},
              {"evict": "lfuda"}, {"evict": "s3fifo"}]
    extras = [{}, {"pin_fraction": 0.25}, {"beta": 0.5, "copy_buffers": 1}, {"capacity_alloc": "calibrated"}]
    prefetch = [{}, {"prefetch": "lookahead", "prefetch_n": 2, "copy_buffers": 1},
                {"prefetch": "lookahead", "prefetch_n": 8, "copy_buffers": 2},
                {"prefetch": "lookahead", "prefetch_n": 4}]
    for ev, ex, pf in itertools.product(evicts, extras, prefetch):
        yield complete({"rule": "fetch_all", **ev, **ex, **pf, "vram_budget_GiB": gib})


def kind_of(params: dict) -> str:
    return "Belady + oracle prefetch" if params.get("prefetch", "off") != "off" else "Belady eviction"


def test_no_fetch_every_miss_policy_is_faster_than_its_bound(setup):
    e, gib, bounds = setup
    assert set(bounds) == set(BOUNDS)
    # the bounds are not vacuous: each is faster than plain fetch-every-miss at the same memory
    plain = e.evaluate(complete({"rule": "fetch_all", "vram_budget_GiB": gib}), HOST)["time_per_token_s"]
    assert bounds["Belady eviction"] < plain and bounds["Belady + oracle prefetch"] < bounds["Belady eviction"]
    checked = 0
    for params in policies(gib):
        try:
            t = e.evaluate(params, HOST)["time_per_token_s"]
        except (BudgetTooSmall, InputError):
            continue
        assert t >= bounds[kind_of(params)] * (1 - 1e-9), (params, t, bounds)
        checked += 1
    assert checked >= 60


def test_report_lists_the_computed_bounds_not_sampled_ones():
    """A sampled trial that uses the future (faster or slower) is not a bound; the computed rows are, with what
    each bounds."""
    rows = pd.DataFrame([
        {"host": HOST, "status": "ok", "baseline": "bound:Belady eviction", "time_per_token_s": 2e-3,
         "time_per_token_ms": 2.0, "speed_ratio_vs_fetch_all": 1.5, "policy": "fetch_all + belady", "capacity_slots": [8], "vram_budget_GiB": 1.0},
        {"host": HOST, "status": "ok", "baseline": "bound:oracle prefetch B=1", "time_per_token_s": 3e-3,
         "time_per_token_ms": 3.0, "speed_ratio_vs_fetch_all": 1.1, "policy": "o1", "capacity_slots": [7], "vram_budget_GiB": 1.0},
        {"host": HOST, "status": "ok", "baseline": "bound:oracle prefetch B=2", "time_per_token_s": 2.5e-3,
         "time_per_token_ms": 2.5, "speed_ratio_vs_fetch_all": 1.2, "policy": "o2", "capacity_slots": [6], "vram_budget_GiB": 1.0},
        {"host": HOST, "status": "ok", "baseline": None, "time_per_token_s": 1e-3, "time_per_token_ms": 1.0,
         "speed_ratio_vs_fetch_all": 3.0, "policy": "sampled oracle", "capacity_slots": [8], "vram_budget_GiB": 1.0},
    ])
    bd = report.bounds(rows, [HOST]).set_index("bound")
    assert sorted(bd.index) == ["Belady eviction", "oracle prefetch"]
    assert bd.loc["oracle prefetch", "time_per_token_ms"] == 2.5 and bd.loc["oracle prefetch", "runs"] == 2
    assert bd.loc["Belady eviction", "bounds"] == BOUNDS["Belady eviction"]
