"""A run's initial residency and per-layer slot counts: the warm start from calibration counts
(docs/policies.md, "Initial residency" and "Per-layer capacities"), and the residency-file form of a start."""

from __future__ import annotations

import numpy as np

from runtime.core.errors import InputError
from runtime.core.policy import PolicyConfig


def warm_residency(topk_ids: np.ndarray, valid: np.ndarray | None, num_experts: int, capacities: np.ndarray) -> list[np.ndarray]:
    """Per layer the C_l most frequently selected experts of a calibration trace (ties: lower id). topk_ids [T, L, k]."""
    T, L, k = topk_ids.shape
    out = []
    for l_ in range(L):
        ids = topk_ids[:, l_, :] if valid is None else topk_ids[valid[:, l_], l_, :]
        counts = np.bincount(ids.ravel(), minlength=num_experts)[:num_experts]
        order = np.lexsort((np.arange(num_experts), -counts))
        out.append(order[: int(capacities[l_])].astype(np.int32))
    return out


def residency_array(init: list | None, capacities, flag: str = "--residency-out") -> np.ndarray:
    """A run's initial residency as a residency file holds it: int64 [L, max C_l], each row in its order (a
    warm start: count order), padded with -1 where a layer has fewer slots (calibrated capacities)."""
    if init is None:
        raise InputError(f"{flag}: needs a warm start (this run starts cold)")
    caps = [int(c) for c in capacities]
    arr = np.full((len(caps), max(caps)), -1, np.int64)
    for l_, row in enumerate(init):
        row = np.asarray(row, np.int64)
        row = row[row >= 0]
        arr[l_, : len(row)] = row
    return arr


def calibration_counts(topk_ids: np.ndarray, valid: np.ndarray | None, num_experts: int) -> np.ndarray:
    """n_l[e]: how often the router selected e at layer l over a calibration trace; topk_ids [T, L, k] -> int64 [L, E]."""
    T, L, k = topk_ids.shape
    out = np.zeros((L, num_experts), np.int64)
    for l_ in range(L):
        ids = topk_ids[:, l_, :] if valid is None else topk_ids[np.asarray(valid[:, l_], bool), l_, :]
        out[l_] = np.bincount(ids.ravel().astype(np.int64), minlength=num_experts)[:num_experts]
    return out


def calibrated_capacities(counts: np.ndarray, capacities: np.ndarray, top_k: int) -> np.ndarray:
    """`capacity_alloc = calibrated` (docs/policies.md, "Per-layer capacities"): the total S of `capacities`
    spread over the layers. Every layer starts with k slots; each remaining slot goes to the layer whose next
    expert in count order (position C_l) has the largest share n_l[e] / sum_e n_l[e] of the layer's calls
    (ties: lower layer; a layer stops at E - 1). counts int [L, E] -> int64 [L]."""
    L, E = counts.shape
    total = int(np.asarray(capacities).sum())
    order = np.lexsort((np.broadcast_to(np.arange(E), (L, E)), -counts), axis=1)  # [L, E] count order
    sums = counts.sum(axis=1)
    share = np.take_along_axis(counts, order, axis=1) / np.maximum(sums, 1)[:, None]  # [L, E] in count order
    caps = np.full(L, top_k, np.int64)
    for _ in range(total - L * top_k):
        nxt = np.where(caps < E - 1, share[np.arange(L), np.minimum(caps, E - 1)], -1.0)  # [L]
        caps[int(np.argmax(nxt))] += 1  # argmax: the first (lowest) layer among equal shares
    return caps


def warm_start(policy: PolicyConfig, capacities: np.ndarray, top_k: int, num_experts: int,
               calib_ids: np.ndarray | None = None, calib_valid: np.ndarray | None = None,
               given: list | None = None, source: str = "") -> tuple[np.ndarray, list[np.ndarray] | None]:
    """A run's slots per layer and initial residency: from calibration selections `calib_ids` [T, L, k] the
    warm start (with `capacity_alloc = calibrated`, the capacities spread by the counts first), else `given`
    per-layer ids (a residency file), else cold (None). Calibrated capacities need calibration counts: with
    a residency file or a cold start they are a one-line InputError naming `source`."""
    caps = np.asarray(capacities, np.int64)
    if calib_ids is not None:
        if policy.capacity_alloc == "calibrated":
            caps = calibrated_capacities(calibration_counts(calib_ids, calib_valid, num_experts), caps, top_k)
        return caps, warm_residency(calib_ids, calib_valid, num_experts, caps)
    if policy.capacity_alloc == "calibrated":
        raise InputError(f"--capacity-alloc = 'calibrated' needs calibration counts (a warm start from a calibration "
                         f"trace or text, or held-out); the initial residency is {source or 'cold'!s}")
    return caps, given
