"""Cost model: turn the policy kernel's per token-layer event counts into time per token.

A package by job (the formulas are fixed in docs/cost_model.md; keep the two in step):

- `hosts`: `HostProfile`, a GPU host (link, device, host-CPU figures), stored as YAML. Presets `rtx3090`,
  `rtx4090`, `rtx5090` are package data, `runtime/data/hosts/<name>.yaml`, found with
  `importlib.resources` (in a checkout and in an installed wheel alike; `EXPERTSWEEP_HOSTS_DIR`
  names another folder of presets instead).
- `shapes`: `ModelShape`, the MoE geometry that sets expert and dense bytes, stored as YAML: presets in
  `runtime/data/models/` (`EXPERTSWEEP_MODELS_DIR` instead), or derived from a Hugging Face
  `config.json` (`model_shape_from_hf_config`); the byte counts; `shape_for_trace`.
- `budget`: `capacities_for_budget`, THE meaning of a VRAM budget (slots per layer that the engine can
  really hold after the non-expert weights, the CUDA context, cuBLAS workspace, a reserve,
  staging buffers and, with fallback=lowbit, the low-bit copies); used by the engine, the
  simulator and the sweep alike; `budget_for_capacities`, its inverse.
- `timing`: `CostParams`, the per-(host, shape) times in seconds (`cost_params`); `replay_time`, the event
  replay, a numba loop over tokens in stream order and layers in order with one clock and one FIFO
  host->device link, returning a `TimeBreakdown`; `all_resident_time`, the every-call-is-a-hit
  reference time per token; the event columns (EV_*, N_EV, N_EV_FULL).

Every public name is importable from here (`from runtime.formats.costmodel import X`).
"""

from __future__ import annotations

import runtime.core.units  # noqa: F401 - numba's cache locator for the compiled units, before any is defined
from runtime.formats.costmodel.budget import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    PREFILL_STAGING,
    RESERVE_FRACTION,
    BudgetBreakdown,
    BudgetTooSmall,
    budget_breakdown,
    budget_for_capacities,
    capacities_for_budget,
    copy_buffers_charged,
)
from runtime.formats.costmodel.hosts import (
    HostProfile,
    host_profile_from_dict,
    list_host_profiles,
    load_host_profile,
    save_host_profile,
)
from runtime.formats.costmodel.shapes import (
    BITS_PER_WEIGHT,
    DTYPE_FORMATS,
    ModelShape,
    dense_bytes_per_layer,
    expert_bytes,
    head_bytes,
    list_model_shapes,
    load_model_shape,
    lowbit_expert_bytes,
    model_shape_for,
    model_shape_from_dict,
    model_shape_from_hf_config,
    nonexpert_bytes,
    save_model_shape,
    shape_for_trace,
    with_format,
)
from runtime.formats.costmodel.timing import (
    DENSE_CALLS_PER_LAYER,
    EV_ADM_POPPED,
    EV_ADM_QUEUED,
    EV_DEV,
    EV_FETCH,
    EV_HOST,
    EV_LOWBIT,
    EV_PREFETCH,
    HEAD_CALLS,
    LOWBIT_CALLS,
    N_EV,
    N_EV_FULL,
    CostParams,
    TimeBreakdown,
    all_resident_time,
    cost_params,
    replay_time,
)

__all__ = [
    "BITS_PER_WEIGHT", "CUBLAS_WORKSPACE_BYTES", "CUDA_CONTEXT_BYTES", "DENSE_CALLS_PER_LAYER", "DTYPE_FORMATS",
    "EV_ADM_POPPED", "EV_ADM_QUEUED", "EV_DEV", "EV_FETCH", "EV_HOST", "EV_LOWBIT", "EV_PREFETCH", "HEAD_CALLS",
    "LOWBIT_CALLS", "N_EV", "N_EV_FULL", "PREFILL_STAGING", "RESERVE_FRACTION", "BudgetBreakdown", "BudgetTooSmall",
    "CostParams", "HostProfile", "ModelShape", "TimeBreakdown", "all_resident_time", "budget_breakdown",
    "budget_for_capacities", "capacities_for_budget", "copy_buffers_charged", "cost_params", "dense_bytes_per_layer", "expert_bytes",
    "head_bytes", "host_profile_from_dict", "list_host_profiles", "list_model_shapes", "load_host_profile",
    "load_model_shape", "lowbit_expert_bytes", "model_shape_for", "model_shape_from_dict",
    "model_shape_from_hf_config", "nonexpert_bytes", "replay_time", "save_host_profile", "save_model_shape",
    "shape_for_trace", "with_format",
]
