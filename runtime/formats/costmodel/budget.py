"""The VRAM budget: THE meaning of a device memory budget (`capacities_for_budget`) and its inverse.

Slots per layer that the engine can really hold after the non-expert weights, the CUDA context, cuBLAS
workspace, a reserve, staging buffers and, with fallback=lowbit, the low-bit copies; used by the engine,
the simulator and the sweep alike (docs/cost_model.md, "VRAM budget").
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import numpy as np

from runtime.core.errors import InputError
from runtime.formats.costmodel.shapes import (
    ModelShape,
    expert_bytes,
    lowbit_expert_bytes,
    nonexpert_bytes,
)

log = logging.getLogger(__name__)

# VRAM budget (capacities_for_budget, docs/cost_model.md "VRAM budget"). The CUDA context is not
# allocated through PyTorch and is not in torch.cuda.memory_allocated; 512 MiB is a typical CUDA 12/13
# context with PyTorch's kernels loaded lazily (the engine measures the real one on CUDA and reports it
# as `cuda_context_bytes`). cuBLAS keeps one workspace per stream and handle: 32 MiB on sm90+ (PyTorch's
# default CUBLAS_WORKSPACE_CONFIG ":4096:8"), 8 MiB before; we charge 32 MiB per stream that runs
# matrix products (the compute stream only). RESERVE_FRACTION of the budget covers activations, the KV
# cache and what the caching allocator reserves but does not hand out.
CUDA_CONTEXT_BYTES = 512 * 2**20
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
RESERVE_FRACTION = 0.05
PREFILL_STAGING = 2  # the prefill's double buffer


@dataclass(frozen=True)
class BudgetBreakdown:
    """What a VRAM budget is spent on (bytes), as `capacities_for_budget` computed it."""

    budget: int
    nonexpert: int
    context: int
    workspace: int
    reserve: int
    staging: int
    lowbit: int
    slot: int  # bytes of one slot (one expert)
    slots_per_layer: int

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _as_policies(policy) -> list:
    if policy is None:
        return []
    return list(policy) if isinstance(policy, list | tuple) else [policy]


def budget_breakdown(shape: ModelShape, budget_gib: float, policy=None, *,
                     context_bytes: int = CUDA_CONTEXT_BYTES, workspace_bytes: int = CUBLAS_WORKSPACE_BYTES,
                     reserve_fraction: float = RESERVE_FRACTION, flag: str = "--vram-budget") -> BudgetBreakdown:
    """The arithmetic of `capacities_for_budget` (no check against k)."""
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, int | float) or not math.isfinite(budget_gib) \
            or budget_gib <= 0:
        raise InputError(f"{flag} = {budget_gib!r} must be a positive number of GiB")
    pols = _as_policies(policy)
    L, k = shape.num_layers, shape.top_k
    budget = int(budget_gib * 2**30)
    slot = expert_bytes(shape)
    # staging: the prefill's double buffer plus the copy buffers of the background copies
    in_flight = 0
    lowbit = 0
    for p in pols:
        in_flight = max(in_flight, copy_buffers_charged(p, L, k))
        if getattr(p, "fallback", "substitute") == "lowbit":
            lowbit = max(lowbit, L * shape.num_experts * lowbit_expert_bytes(shape, int(p.lowbit_bits),
                                                                            int(p.lowbit_group)))
    staging = (PREFILL_STAGING + in_flight) * slot
    reserve = int(reserve_fraction * budget)
    avail = budget - nonexpert_bytes(shape) - context_bytes - workspace_bytes - reserve - staging - lowbit
    c = min(int(avail // (L * slot)) if avail > 0 else 0, shape.num_experts - 1)
    return BudgetBreakdown(budget, nonexpert_bytes(shape), context_bytes, workspace_bytes, reserve, staging, lowbit,
                           slot, c)


def copy_buffers_charged(policy, num_layers: int, top_k: int) -> int:
    """Staging buffers for `policy`'s background copies (admissions, prefetches), beside the prefill's two.

    None without admission or prefetch. With a bounded pool (`copy_buffers` = B per MoE layer, docs/policies.md
    "Additions (3)"): exactly the L * B buffers the engine allocates up front. Unbounded (`copy_buffers`
    unset): the worst case of the rule without a pool, per layer k admissions queued per token for d tokens
    plus prefetch_n prefetch loads (the engine then grows its buffers on demand)."""
    beta = getattr(policy, "beta", None)
    prefetch = getattr(policy, "prefetch", "off")
    if beta is None and prefetch == "off":
        return 0
    b = getattr(policy, "copy_buffers", None)
    if b is not None:
        return num_layers * int(b)
    adm = num_layers * top_k * int(policy.admission_delay) if beta is not None else 0
    pf = num_layers * int(getattr(policy, "prefetch_n", None) or top_k) if prefetch != "off" else 0
    return adm + pf


class BudgetTooSmall(InputError):
    """A VRAM budget that leaves fewer than k expert slots per layer under the policy (capacities_for_budget).

    An InputError (one line, exit 2 at a CLI); a sweep records such a trial as `infeasible` at its
    budget instead of failed (sweep/worker.py). `slots` is what the budget left."""

    def __init__(self, message: str, slots: int = 0):
        super().__init__(message)
        self.slots = slots


def capacities_for_budget(shape: ModelShape, budget_gib: float, policy=None, *,
                          context_bytes: int = CUDA_CONTEXT_BYTES, workspace_bytes: int = CUBLAS_WORKSPACE_BYTES,
                          reserve_fraction: float = RESERVE_FRACTION, flag: str = "--vram-budget") -> np.ndarray:
    """Slots per MoE layer (int64 [L]) that a device with `budget_gib` GiB really holds under `policy`
    (one PolicyConfig, a list of them: the most demanding, or None).

    C = floor((budget - non-expert weights - CUDA context - cuBLAS workspace - reserve - staging
    - low-bit copies) / (L * expert bytes)), clamped to E - 1; reserve = RESERVE_FRACTION * budget;
    staging = (2 + `copy_buffers_charged`: L * copy_buffers, or unbounded the worst case of the admission
    and prefetch copies in flight) expert buffers; low-bit copies
    of all L * E experts when a policy's fallback is lowbit. Fewer than k slots: a one-line
    `BudgetTooSmall` (an InputError) naming `flag`, the budget and what went into it.
    docs/cost_model.md, "VRAM budget"."""
    b = budget_breakdown(shape, budget_gib, policy, context_bytes=context_bytes, workspace_bytes=workspace_bytes,
                         reserve_fraction=reserve_fraction, flag=flag)
    if b.slots_per_layer < shape.top_k:
        gib = 2**30
        raise BudgetTooSmall(f"{flag} = {budget_gib:g} GiB leaves {b.slots_per_layer} expert slots per layer, fewer "
                             f"than k = {shape.top_k} (non-expert weights {b.nonexpert / gib:.3g} GiB, CUDA context "
                             f"{b.context / gib:.3g}, cuBLAS workspace {b.workspace / gib:.3g}, reserve {b.reserve / gib:.3g}, "
                             f"staging {b.staging / gib:.3g}, low-bit copies {b.lowbit / gib:.3g} GiB; one expert "
                             f"{b.slot / 2**20:.3g} MiB x {shape.num_layers} layers)", b.slots_per_layer)
    log.info("VRAM budget %g GiB: %d slots per layer (%s)", budget_gib, b.slots_per_layer, b)
    return np.full(shape.num_layers, b.slots_per_layer, np.int64)


def budget_for_capacities(shape: ModelShape, capacities, policy=None, *,
                          context_bytes: int = CUDA_CONTEXT_BYTES, workspace_bytes: int = CUBLAS_WORKSPACE_BYTES,
                          reserve_fraction: float = RESERVE_FRACTION) -> float:
    """The inverse of `capacities_for_budget`: the smallest VRAM budget (GiB) that holds `capacities`
    slots per layer under `policy`, counted the same way (the simulator's `device_memory_GiB`), with the
    same `context_bytes` and `workspace_bytes` (the engine on CUDA passes the context it measured)."""
    b = budget_breakdown(shape, 1.0, policy, context_bytes=context_bytes, workspace_bytes=workspace_bytes,
                         reserve_fraction=0.0)  # fixed parts (no reserve)
    fixed = b.nonexpert + b.context + b.workspace + b.staging + b.lowbit
    slots = int(np.sum(np.broadcast_to(np.asarray(capacities, np.int64), (shape.num_layers,))))
    return (fixed + slots * b.slot) / (1.0 - reserve_fraction) / 2**30
