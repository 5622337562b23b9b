"""Timing: the per-(host, shape) times (`cost_params`) and the event replay that turns the policy kernel's
per token-layer event counts into time per token (`replay_time`, `all_resident_time`).

The replay is a numba loop over tokens in stream order and layers in order with one clock and one FIFO
host->device link; it returns a `TimeBreakdown` (the formulas are fixed in docs/cost_model.md; keep the two
in step).

Event columns: runtime/core/events.py, the one definition the kernel writes by (EV_*, N_EV columns; an
array of N_EV_BASE columns, from before the low-bit and prefetch columns, is read with those as zero).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from runtime.core.compiled import ensure
from runtime.core.events import (  # noqa: F401 - the kernel's event columns, one definition (N_EV_BASE: the oldest arrays)
    EV_ADM_POPPED,
    EV_ADM_QUEUED,
    EV_DEV,
    EV_FETCH,
    EV_HOST,
    EV_LOWBIT,
    EV_PREFETCH,
    N_EV,
    N_EV_BASE,
    N_EV_FULL,
)
from runtime.core.units import COSTMODEL as UNIT
from runtime.formats.costmodel.hosts import HostProfile
from runtime.formats.costmodel.shapes import (
    ModelShape,
    dense_bytes_per_layer,
    expert_bytes,
    head_bytes,
    lowbit_expert_bytes,
)

log = logging.getLogger(__name__)



# Device kernel-launch-sized calls charged per layer for the dense part when it is not
# calibrated (attention/mixer projections + attention, output projection, shared expert,
# norms + router): dense_layer_s = DENSE_CALLS_PER_LAYER * device_overhead + dense bytes / bw.
DENSE_CALLS_PER_LAYER = 4


# ----------------------------------------------------------------------------- cost parameters

@dataclass(frozen=True)
class CostParams:
    """Per-(host, shape) times in seconds."""

    fetch_s: float          # one synchronous, background or prefetch expert copy on the link
    device_expert_s: float  # one expert computed on the device
    host_expert_s: float    # one expert computed on the host CPU
    dense_layer_s: float    # the dense part of one layer on the device
    head_s: float = 0.0     # final norm + LM head, once per token
    lowbit_expert_s: float = 0.0  # one low-bit expert dequantized and computed on the device
    copies_block_host: bool = False  # pageable host memory: every copy blocks the issuing host thread


def cost_params(profile: HostProfile, shape: ModelShape, pinned: bool = True, lowbit_bits: int = 4,
                lowbit_group: int = 64) -> CostParams:
    """Resolve `profile` x `shape` into `CostParams` (formulas in docs/cost_model.md).

    `pinned=False`: copies from pageable memory, at `link_pageable_GBps`, and they block the host
    (CUDA stages pageable memory synchronously), so background copies are not in the background."""
    b = expert_bytes(shape)
    link = profile.link_GBps if pinned else profile.link_pageable_GBps
    fetch = profile.link_latency_us * 1e-6 + b / (link * 1e9)
    if profile.device_expert_us is not None:
        dev = profile.device_expert_us * 1e-6
    else:
        dev = profile.device_overhead_us * 1e-6 + b / (profile.device_mem_GBps * 1e9)
    if profile.host_expert_us is not None:
        host = profile.host_expert_us * 1e-6
    else:
        host = profile.host_overhead_us * 1e-6 + b / (profile.host_mem_GBps * 1e9)
    if profile.dense_layer_us is not None:
        dense = profile.dense_layer_us * 1e-6
    else:
        dense = (DENSE_CALLS_PER_LAYER * profile.device_overhead_us * 1e-6
                 + dense_bytes_per_layer(shape) / (profile.device_mem_GBps * 1e9))
    if profile.head_us is not None:
        head = profile.head_us * 1e-6
    elif shape.vocab_size:
        head = HEAD_CALLS * profile.device_overhead_us * 1e-6 + head_bytes(shape) / (profile.device_mem_GBps * 1e9)
    else:
        head = 0.0
    if profile.lowbit_expert_us is not None:
        lowbit = profile.lowbit_expert_us * 1e-6
    else:  # read the packed copy, dequantize (one more launch), compute
        lowbit = (LOWBIT_CALLS * profile.device_overhead_us * 1e-6
                  + lowbit_expert_bytes(shape, lowbit_bits, lowbit_group) / (profile.device_mem_GBps * 1e9))
    params = CostParams(fetch_s=fetch, device_expert_s=dev, host_expert_s=host, dense_layer_s=dense, head_s=head,
                        lowbit_expert_s=lowbit, copies_block_host=not pinned)
    log.debug("cost params %s x %s (pinned=%s): %s", profile.name, shape.name, pinned, params)
    return params


HEAD_CALLS = 2  # final norm, LM head matmul
LOWBIT_CALLS = 2  # dequantize, expert


# ----------------------------------------------------------------------------- replay

@dataclass(frozen=True)
class TimeBreakdown:
    """Result of `replay_time`. Sums are over the whole trace, in seconds.

    total_s = dense_s + head_s + compute_s + stall_fetch_s + stall_admission_s + stall_prefetch_s exactly.
    """

    total_s: float
    per_token_s: float             # total_s / T
    stall_fetch_s: float           # waiting for synchronous fetches
    stall_admission_s: float       # waiting for admission copies still in flight (and, pageable, issuing them)
    link_busy_s: float             # link occupancy, sync + admission + prefetch copies
    link_fetch_busy_s: float
    link_admission_busy_s: float
    dense_s: float
    compute_s: float               # sum over token-layers of max(device + low-bit, host) expert time
    device_compute_s: float
    host_compute_s: float
    num_tokens: int
    num_token_layers: int          # valid cells
    token_s: np.ndarray = field(repr=False, compare=False)  # float64 [T] time of each token
    head_s: float = 0.0            # final norm + LM head, once per token with a valid cell
    lowbit_compute_s: float = 0.0
    stall_prefetch_s: float = 0.0  # waiting for prefetch copies still in flight (and, pageable, issuing them)
    link_prefetch_busy_s: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        """Scalar fields as a dict (no per-token array)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "token_s"}


# stats vector layout of the numba loop
(_S_STALL_FETCH, _S_STALL_ADM, _S_LINK_FETCH, _S_LINK_ADM, _S_DENSE, _S_COMPUTE, _S_DEV, _S_HOST, _S_CELLS,
 _S_HEAD, _S_LOWBIT, _S_STALL_PF, _S_LINK_PF) = range(13)
_N_STATS = 13


@njit(cache=True)
def _replay_loop(events, valid, fetch_s, dev_s, host_s, dense_s, head_s, lowbit_s, blocking, ring_cap,
                 token_s, stats, err):  # pragma: no cover - compiled
    T = events.shape[0]
    L = events.shape[1]
    ring = np.zeros((L, ring_cap), np.float64)
    head = np.zeros(L, np.int64)
    count = np.zeros(L, np.int64)
    pf_done = np.zeros(L, np.float64)  # completion of the prefetch copies issued for layer l of this token
    now = 0.0
    link_free = 0.0
    for t in range(T):
        t_start = now
        any_valid = False
        for l in range(L):  # noqa: E741
            if not valid[t, l]:
                continue
            any_valid = True
            stats[_S_CELLS] += 1.0
            # (1) dense part (attention, router): the routing of this layer is known after it
            now += dense_s
            stats[_S_DENSE] += dense_s
            # (2) admissions taken off this layer's queue: the compute waits for the latest copy
            npop = events[t, l, EV_ADM_POPPED]
            if npop > count[l]:
                err[0] = t
                err[1] = l
                return now
            latest = -1.0
            for _ in range(npop):
                c = ring[l, head[l]]
                head[l] = (head[l] + 1) % ring_cap
                count[l] -= 1
                if c > latest:
                    latest = c
            if npop > 0 and latest > now:
                stats[_S_STALL_ADM] += latest - now
                now = latest
            # (3) prefetch loads for this layer, issued when the previous layer's routing was known
            npf = events[t, l, EV_PREFETCH]
            if npf > 0 and pf_done[l] > now:
                stats[_S_STALL_PF] += pf_done[l] - now
                now = pf_done[l]
            # (4) synchronous fetches, queued on the link behind what is already there
            nf = events[t, l, EV_FETCH]
            if nf > 0:
                for _ in range(nf):
                    link_free = max(link_free, now) + fetch_s
                stats[_S_LINK_FETCH] += nf * fetch_s
                if link_free > now:
                    stats[_S_STALL_FETCH] += link_free - now
                    now = link_free
            # (5) prefetch copies for the next valid layer of this token start now, behind the fetches
            nl = l + 1
            while nl < L and not valid[t, nl]:
                nl += 1
            if nl < L:
                npn = events[t, nl, EV_PREFETCH]
                for _ in range(npn):
                    link_free = max(link_free, now) + fetch_s
                stats[_S_LINK_PF] += npn * fetch_s
                pf_done[nl] = link_free if npn > 0 else 0.0
                if blocking and npn > 0:  # pageable: the host issues them synchronously
                    stats[_S_STALL_PF] += link_free - now
                    now = link_free
            # (6) expert compute: device (full precision + low-bit) and host in parallel
            d = events[t, l, EV_DEV] * dev_s
            lb = events[t, l, EV_LOWBIT] * lowbit_s
            h = events[t, l, EV_HOST] * host_s
            m = d + lb if d + lb > h else h
            now += m
            stats[_S_COMPUTE] += m
            stats[_S_DEV] += d
            stats[_S_LOWBIT] += lb
            stats[_S_HOST] += h
            # (7) background admission copies start now, behind anything on the link
            nq = events[t, l, EV_ADM_QUEUED]
            for _ in range(nq):
                link_free = max(link_free, now) + fetch_s
                ring[l, (head[l] + count[l]) % ring_cap] = link_free
                count[l] += 1
            stats[_S_LINK_ADM] += nq * fetch_s
            if blocking and nq > 0:
                stats[_S_STALL_ADM] += link_free - now
                now = link_free
        if any_valid:  # (8) final norm + LM head
            now += head_s
            stats[_S_HEAD] += head_s
        token_s[t] = now - t_start
    return now


def _max_outstanding(events: np.ndarray, valid: np.ndarray) -> int:
    """Most admission copies ever outstanding on one layer (ring-buffer size)."""
    q = np.where(valid, events[:, :, EV_ADM_QUEUED], 0).astype(np.int64)
    p = np.where(valid, events[:, :, EV_ADM_POPPED], 0).astype(np.int64)
    if q.size == 0:
        return 1
    outstanding = np.cumsum(q - p, axis=0)  # after each cell's pops then pushes
    return max(1, int(outstanding.max()))


def replay_time(events: np.ndarray, valid: np.ndarray, params: CostParams) -> TimeBreakdown:
    """Replay kernel events ([T, L, 5 or 7] ints) over `valid` ([T, L] bool) on one clock and link.

    Rules per valid token-layer, tokens in stream order then layers in order (invalid cells
    cost nothing and their events are ignored): dense; pop admissions (stall until the latest
    completes); wait for this layer's prefetch copies; synchronous fetches on the FIFO link
    (stall until the last lands); prefetch copies of the token's next layer start on the link;
    max(device + low-bit, host) expert compute; background admission copies start on the link.
    After the token's last layer: final norm + LM head. docs/cost_model.md has the details.
    """
    ensure(UNIT)  # the compiled replay checked once per process (runtime/core/compiled.py)
    ev = np.asarray(events)
    va = np.asarray(valid)
    if ev.ndim != 3 or ev.shape[2] not in (N_EV_BASE, N_EV) or not np.issubdtype(ev.dtype, np.integer):
        raise ValueError(f"events: expected an integer array [T, L, {N_EV_BASE} or {N_EV}], got "
                         f"{ev.dtype} {ev.shape}")
    if va.shape != ev.shape[:2]:
        raise ValueError(f"valid: shape {va.shape} does not match events {ev.shape[:2]}")
    if ev.shape[2] == N_EV_BASE:
        ev = np.concatenate([ev, np.zeros(ev.shape[:2] + (N_EV - N_EV_BASE,), ev.dtype)], axis=2)
    ev = np.ascontiguousarray(ev, dtype=np.int32)
    va = np.ascontiguousarray(va, dtype=np.bool_)
    if (ev < 0).any():
        raise ValueError("events: negative counts")
    T = ev.shape[0]
    ring_cap = _max_outstanding(ev, va)
    token_s = np.zeros(T, np.float64)
    stats = np.zeros(_N_STATS, np.float64)
    err = np.full(2, -1, np.int64)
    total = _replay_loop(ev, va, float(params.fetch_s), float(params.device_expert_s),
                         float(params.host_expert_s), float(params.dense_layer_s), float(params.head_s),
                         float(params.lowbit_expert_s), bool(params.copies_block_host), ring_cap,
                         token_s, stats, err)
    if err[0] >= 0:
        raise ValueError(f"events: token {err[0]} layer {err[1]} pops more admissions than "
                         "are queued on that layer")
    link_f, link_a, link_p = float(stats[_S_LINK_FETCH]), float(stats[_S_LINK_ADM]), float(stats[_S_LINK_PF])
    return TimeBreakdown(
        total_s=float(total),
        per_token_s=float(total) / T if T else 0.0,
        stall_fetch_s=float(stats[_S_STALL_FETCH]),
        stall_admission_s=float(stats[_S_STALL_ADM]),
        link_busy_s=link_f + link_a + link_p,
        link_fetch_busy_s=link_f,
        link_admission_busy_s=link_a,
        dense_s=float(stats[_S_DENSE]),
        compute_s=float(stats[_S_COMPUTE]),
        device_compute_s=float(stats[_S_DEV]),
        host_compute_s=float(stats[_S_HOST]),
        num_tokens=T,
        num_token_layers=int(stats[_S_CELLS]),
        token_s=token_s,
        head_s=float(stats[_S_HEAD]),
        lowbit_compute_s=float(stats[_S_LOWBIT]),
        stall_prefetch_s=float(stats[_S_STALL_PF]),
        link_prefetch_busy_s=link_p,
    )


def all_resident_time(valid_layers: np.ndarray | int, params: CostParams, top_k: int) -> float:
    """Time per token if every expert call were a device hit.

    `valid_layers`: per-token counts of valid layers ([T] ints, e.g. `valid.sum(axis=1)`),
    a [T, L] bool `valid` mask, or one int (layers of a fully valid token). Each valid
    token-layer costs dense_layer_s + top_k * device_expert_s, and each token with a valid
    layer head_s; the result is the mean over T.
    """
    per_cell = params.dense_layer_s + top_k * params.device_expert_s
    if isinstance(valid_layers, int | np.integer):
        return float(valid_layers) * per_cell + (params.head_s if valid_layers > 0 else 0.0)
    v = np.asarray(valid_layers)
    if v.ndim == 2:
        v = v.sum(axis=1)
    if v.ndim != 1:
        raise ValueError(f"valid_layers: expected [T] counts or a [T, L] mask, got {v.shape}")
    if v.size == 0:
        return 0.0
    return (float(v.sum()) * per_cell + float((v > 0).sum()) * params.head_s) / v.size
