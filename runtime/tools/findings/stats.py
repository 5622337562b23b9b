"""Statistics of the findings: perplexity change, Pearson r, block sums, bootstrap intervals and the block choice.

Every interval here is `scipy.stats.bootstrap` (BCa, percentile where BCa is degenerate; the method used is
returned with it) over blocks of consecutive units (evaluation windows, or topic segments): the policy cache
carries across windows and documents span several, so single windows are not independent. The block length is
chosen by the data (`choose_block`): the smallest block beyond which the interval stops widening.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

N_BOOT = 2000
MIN_BLOCKS = 10  # a block bootstrap needs enough blocks: blocks are at most n_units // MIN_BLOCKS long
WIDTH_TOL = 0.10  # the width has stopped growing at a block when no longer block is more than 10% wider


def pct_change(dnll_sum: np.ndarray | float, count: np.ndarray | float) -> np.ndarray | float:
    """Perplexity change in percent from a summed NLL difference over `count` tokens."""
    return np.expm1(np.asarray(dnll_sum) / np.asarray(count)) * 100


def pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r over the last axis (`scipy.stats.pearsonr`; nan when either side is constant or has fewer
    than 2 values, as a run of one window has)."""
    from scipy.stats import pearsonr

    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.shape[-1] < 2:
        return np.full(np.broadcast_shapes(x.shape, y.shape)[:-1], np.nan)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore")
        return np.asarray(pearsonr(x, y, axis=-1).statistic)


def change_stat(dn: np.ndarray, cnt: np.ndarray, axis: int = -1) -> np.ndarray:
    """Perplexity change (%) of summed NLL differences over summed token counts."""
    return pct_change(np.sum(dn, axis=axis), np.sum(cnt, axis=axis))


def diff_stat(a: np.ndarray, b: np.ndarray, cnt: np.ndarray, axis: int = -1) -> np.ndarray:
    """Perplexity change of `a` minus that of `b` (points), on the same tokens."""
    return change_stat(a, cnt, axis) - change_stat(b, cnt, axis)


def block_starts(n: int, block: int) -> np.ndarray:
    """First unit of each block of `block` consecutive units out of `n`; a short last block (< half) joins the
    one before it."""
    if n < 1 or block < 1:
        raise ValueError(f"block_starts: n = {n}, block = {block} must be >= 1")
    starts = np.arange(0, n, block)
    if len(starts) > 1 and n - starts[-1] < (block + 1) // 2:
        starts = starts[:-1]
    return starts


def to_blocks(x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sums of `x` over the blocks that begin at `starts` (last axis)."""
    return np.add.reduceat(np.asarray(x, np.float64), starts, axis=-1)


def block_ci(samples: Sequence[np.ndarray], statistic: Callable[..., np.ndarray], seed: int,
             n_boot: int = N_BOOT) -> tuple[float, float, str]:
    """95% interval of `statistic(*samples, axis=-1)` by `scipy.stats.bootstrap` over the blocks (the samples'
    last axis, paired: one resample for all): BCa, else percentile where BCa is degenerate; (lo, hi, method)."""
    from scipy.stats import bootstrap

    if np.asarray(samples[0]).shape[-1] < 2:
        return math.nan, math.nan, "none (one block)"
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
            warnings.simplefilter("ignore")
            res = bootstrap(tuple(samples), statistic, n_resamples=n_boot, paired=True, vectorized=True, axis=-1,
                            method=method, rng=np.random.default_rng(seed))
        lo, hi = (float(v) for v in res.confidence_interval)
        if math.isfinite(lo) and math.isfinite(hi):
            return lo, hi, method
    return math.nan, math.nan, "none"


def block_widths(series: np.ndarray, counts: np.ndarray, seed: int, max_block: int,
                 n_boot: int = N_BOOT) -> list[dict[str, Any]]:
    """Width of the perplexity-change interval of per-unit NLL-difference sums `series` (token `counts`) at
    every block length 1..max_block units."""
    n = len(series)
    out = []
    for b in range(1, max(max_block, 1) + 1):
        st = block_starts(n, b)
        lo, hi, method = block_ci((to_blocks(series, st), to_blocks(counts, st)), change_stat, seed, n_boot)
        out.append({"block": b, "blocks": len(st), "width": hi - lo, "method": method})
    return out


def stop_block(widths: Sequence[float], tol: float = WIDTH_TOL) -> tuple[int, bool]:
    """(index, stopped): the first block length whose width no longer one exceeds by more than `tol`
    (relative); `stopped` is False when that is the longest one tried (growth not seen to stop)."""
    w = [x if math.isfinite(x) else 0.0 for x in widths]
    for i in range(len(w)):
        if all(v <= w[i] * (1 + tol) for v in w[i + 1:]):
            return i, i < len(w) - 1
    return len(w) - 1, False


def choose_block(series: dict[str, np.ndarray], counts: np.ndarray, seed: int,
                 min_blocks: int = MIN_BLOCKS, n_boot: int = N_BOOT) -> dict[str, Any]:
    """The block length for `series` (name -> per-unit NLL-difference sums over the same units): for each,
    the interval width at block lengths 1..n // min_blocks and the length where it stopped growing
    (`stop_block`); the block is the longest of these. {"block", "stopped", "max_block", "check": {...}}."""
    n = len(counts)
    max_block = max(1, n // min_blocks)
    check, chosen, stopped = {}, 1, True
    for name, x in series.items():
        ws = block_widths(x, counts, seed, max_block, n_boot)
        i, ok = stop_block([w["width"] for w in ws])
        check[name] = {"widths": ws, "block": ws[i]["block"], "stopped": ok}
        if ws[i]["block"] > chosen:
            chosen, stopped = ws[i]["block"], ok
        elif ws[i]["block"] == chosen:
            stopped = stopped and ok
    return {"block": chosen, "stopped": stopped if max_block > 1 else False, "max_block": max_block,
            "tolerance": WIDTH_TOL, "check": check}


def fmt_ci(lo: float, hi: float, spec: str = "+.2f", unit: str = "") -> str:
    """`[lo, hi]` formatted, or n/a."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "n/a"
    return f"[{lo:{spec}}{unit}, {hi:{spec}}{unit}]"
