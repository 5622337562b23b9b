"""Offline bounds, computed: per host, fetch-every-miss with the future known, run at the sweep's budget.

A bound is not a policy to run (it needs the future: Belady's next uses, the next layer's true selection)
and it is not sampled: `bound_params` gives each kind's fixed runs, which the sweep screens once per
host beside the named baselines (sweep/driver.py), at the baselines' capacity (the equal-memory budget).
Each is fetch-every-miss (`rule = fetch_all`, every miss fetched) with:

- `Belady eviction`: the victim is the resident used furthest in the future (`evict = belady`), no copy
  buffers, so it gets the most slots the budget holds: no eviction order of a fetch-every-miss cache of
  that memory fetches less (Belady's MIN is optimal and a stack algorithm), so no fetch-every-miss
  policy without prefetch is faster;
- `oracle prefetch`: LFU with every miss of the next layer known and copied one layer ahead
  (`prefetch = oracle`), on a bounded copy pool (`copy_buffers` B per layer, charged to the budget);
- `Belady + oracle prefetch`: both.

The oracle kinds are run at each B of `ORACLE_BUFFERS` (k: every selected expert can be in flight) and
the bound is the fastest of them (report.bounds): the pool trades slots for copies in flight, and the
best trade is not known in advance. What each bounds is `BOUNDS[kind]`, the text the summary, plot and
MLflow carry.
"""

from __future__ import annotations

from typing import Any

BOUND_PREFIX = "bound:"
ORACLE_BUFFERS: tuple[int | None, ...] = (1, 2, None)  # None: k (every selected expert in flight at once)
BOUNDS: dict[str, str] = {
    "Belady eviction": "the fastest any fetch-every-miss policy without prefetch could be at this memory "
                       "(the fewest fetches any eviction order makes)",
    "oracle prefetch": "LFU fetch-every-miss with every miss known and copied a layer ahead: the fastest LFU "
                       "fetch-every-miss with prefetch could be at this memory",
    "Belady + oracle prefetch": "the fastest any fetch-every-miss policy with prefetch could be at this memory "
                                "(Belady's eviction, every miss copied a layer ahead)",
}


def bound_params(capacity: dict[str, Any], top_k: int) -> list[tuple[str, dict[str, Any]]]:
    """Every bound run of a sweep: (baseline name `bound:<kind>[ B=n]`, complete params) at `capacity` (the
    baselines' {vram_budget_GiB | capacity_fraction: value}); `top_k` is the model's k."""
    from sweep.space import complete

    runs = [("Belady eviction", {"rule": "fetch_all", "evict": "belady"})]
    for b in ORACLE_BUFFERS:
        n = top_k if b is None else min(b, top_k)
        if b is not None and b >= top_k:
            continue
        for kind, evict in (("oracle prefetch", "lfu"), ("Belady + oracle prefetch", "belady")):
            runs.append((f"{kind} B={n}", {"rule": "fetch_all", "evict": evict, "prefetch": "oracle",
                                          "copy_buffers": n}))
    return [(f"{BOUND_PREFIX}{name}", complete({**fields, **capacity})) for name, fields in runs]


def bound_of(baseline: Any) -> str | None:
    """The kind of a computed bound's row (its `baseline` name), or None for any other row."""
    if not isinstance(baseline, str) or not baseline.startswith(BOUND_PREFIX):
        return None
    return baseline[len(BOUND_PREFIX):].split(" B=")[0]


def bound_metrics(bd) -> dict[str, float]:  # noqa: ANN001 - report.bounds' DataFrame
    """MLflow parent metrics of the computed bounds: per host and kind, ms/token and the speed ratio."""
    out = {}
    for _, r in bd.iterrows():
        tag = f"{r['host']}_{r['bound'].replace(' + ', '_and_').replace(' ', '_').lower()}"
        out[f"bound_{tag}_time_per_token_ms"] = float(r["time_per_token_ms"])
        out[f"bound_{tag}_speed_ratio_vs_fetch_all"] = float(r["speed_ratio_vs_fetch_all"])
    return out
