"""One resolver for a run: what a RunSpec means on one input, the same for every backend.

`resolve(spec, source) -> Run` is the one implementation of
- the cache size: `capacity` (C or C0,C1,...), `capacity_fraction`, or `vram_budget_GiB` (the cost
  model's `capacities_for_budget` on the input's model shape: the one meaning of a VRAM budget), each
  checked k <= C_l < E; then the policy's `capacity_alloc` (calibrated: the same total spread by the
  calibration counts, runtime.core.kernel.warm_start);
- the initial residency (runtime/core/spec.py, docs/policies.md "Initial residency"): `cold`,
  `held-out`, `warm:TRACE` (its model and E, k, L checked against the input), `FILE.npy` (int [L, C],
  -1 an empty slot; shape, ids, columns and rows checked), unset (a calibration text when the backend
  has one, else held-out with a warning), and the library's per-layer ids given in memory;
- the pinned hot set's checks (`pin_fraction`: a warm start, C_l - P_l >= k, P_l residents);
- `residency_out` (a cold start cannot write one: refused before any work; `save_residency` writes it);
- the host profile (simulator): by name (a preset or a YAML file) or by value (RunSpec.host's mapping),
  and the model shape (`model_shape`, `weight_format`).

A backend only supplies a `CalibrationSource`: the input's dimensions, its model shape, and the
calibration ids: the held-out tokens (trace rows or text tokens) and, for text backends, a calibration
text (runtime/backends/simulate.py `TraceSource`, runtime/backends/emulate.py `TextSource`; `IdsSource`
for ids already in hand). The resolver sits in backends, not core: it reads the cost model and traces
(runtime.formats), which core may not import (tests/test_imports.py). It never imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.core.errors import InputError, atomic_write
from runtime.core.kernel import residency_array, warm_start
from runtime.core.policy import PolicyConfig, pinned_count, resolve_capacities
from runtime.core.spec import HELD_OUT, HELD_OUT_FRACTION, RunSpec, honoured_by
from runtime.formats import costmodel
from runtime.formats.trace import Trace, load_trace

log = logging.getLogger(__name__)

FLAG = "--initial-residency"


@dataclass(frozen=True, eq=False)
class Calibration:
    """Where a warm start comes from, as a backend supplies it."""

    kind: str  # held-out | warm | text | file | given | cold
    source: str  # in words: Result.initial_residency
    ids: np.ndarray | None = None  # [T_c, L, k] router selections that calibrate the cache
    valid: np.ndarray | None = None  # [T_c, L] bool (None: every cell)
    given: tuple[np.ndarray, ...] | None = None  # per layer the resident ids of a residency file (or given)
    evaluated: int | None = None  # held-out: only the tokens before the calibrated part are evaluated


@dataclass(frozen=True, eq=False)
class Run:
    """A RunSpec resolved on one input: what a backend evaluates."""

    policy: PolicyConfig
    capacities: np.ndarray  # int64 [L] slots per MoE layer (after capacity_alloc)
    initial_residency: tuple[np.ndarray, ...] | None  # per layer the resident ids in slot order; None: cold
    residency_source: str  # Result.initial_residency
    evaluated_tokens: int | None  # held-out: evaluate only the first N tokens (the rest calibrated); None: all
    host: costmodel.HostProfile | None  # the cost model's host (simulator); None where time is not modelled
    shape: costmodel.ModelShape | None  # the input's model shape (simulator; a VRAM budget); None otherwise


class CalibrationSource:
    """What a backend supplies to `resolve`: the input's dimensions, its model shape and its calibration ids.

    Subclasses implement `held_out` (and, for text backends, `calibration_text`); `memo` keeps what
    repeated resolutions on this input share (calibrations, traces and host profiles loaded by name)."""

    backend = ""  # the backend resolving: the host profile is resolved where it honours --host

    def __init__(self, num_layers: int, num_experts: int, top_k: int, *, model: str = "",
                 input_name: str = "the input", tokens_name: str = "the tokens") -> None:
        self.num_layers, self.num_experts, self.top_k = int(num_layers), int(num_experts), int(top_k)
        self.model = model  # the model's identity as a trace names it (TraceMeta.model, 'type:path'); "" unknown
        self.input_name = input_name  # in errors: "the trace", "the model"
        self.tokens_name = tokens_name  # in the held-out warning: what the last 20% is taken of
        self.memo: dict[tuple, Any] = {}

    def held_out(self, fraction: float) -> Calibration:
        """The last `fraction` of the input's tokens as calibration ids (with `evaluated` set)."""
        raise InputError(f"{FLAG} = {HELD_OUT!r}: {self.input_name} has no tokens to hold out")

    def calibration_text(self, path: str | None) -> Calibration | None:
        """A calibration text's ids (`path`, else the input's default one), or None when there is none."""
        return None

    def model_shape(self, name: str | None) -> costmodel.ModelShape:
        """The cost model's shape of the input (`name`: a RunSpec's model_shape)."""
        raise InputError(f"--vram-budget / --model-shape: the cost model has no shape for {self.input_name}")

    def load_trace(self, path: str) -> Trace:
        """A calibration trace (`warm:PATH`), loaded once per source."""
        key = ("trace", path)
        if key not in self.memo:
            self.memo[key] = load_trace(path, num_experts=self.num_experts if path.endswith(".npz") else None)
        return self.memo[key]


class IdsSource(CalibrationSource):
    """An input given by its dimensions and calibration ids already in hand (e.g. an exact pass's): its
    calibration text is those ids; no held-out part."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, ids: np.ndarray | None,
                 valid: np.ndarray | None = None, source: str = "calibration ids") -> None:
        super().__init__(num_layers, num_experts, top_k)
        self._cal = None if ids is None else Calibration("text", source, np.asarray(ids), valid)

    def calibration_text(self, path: str | None) -> Calibration | None:
        return self._cal


def resolve(spec: RunSpec, source: CalibrationSource, *,
            initial_residency: Sequence[np.ndarray] | None = None) -> Run:
    """`spec` on the input `source` describes: the Run a backend evaluates (module docstring).
    `initial_residency`: per-layer ids given in memory (library; `spec.initial_residency` then unset)."""
    L, E, k = source.num_layers, source.num_experts, source.top_k
    policy = spec.policy
    timed = "host" in honoured_by(source.backend)
    shape = _shape(spec, source) if timed or spec.vram_budget_GiB is not None else None
    caps = capacities(spec, L, E, k, shape)
    cal = calibration(spec, source, initial_residency)
    if cal.kind in ("file", "given"):
        _check_rows(cal, spec.initial_residency or "given per-layer ids", caps, E)
    caps, init = warm_start(policy, caps, k, E, cal.ids, cal.valid, given=cal.given,
                            source=cal.source if cal.kind != "given" else "given per-layer ids")
    init = None if init is None else tuple(r[r >= 0] for r in map(np.asarray, init))  # a file's -1: empty slots
    check_pinned(policy, caps, init, k)
    if spec.residency_out is not None and init is None:
        raise InputError(f"--residency-out {spec.residency_out}: needs a warm start (this run starts cold)")
    return Run(policy, caps, init, cal.source, cal.evaluated, _host(spec, source) if timed else None, shape)


def capacities(spec: RunSpec, num_layers: int, num_experts: int, top_k: int,
               shape: costmodel.ModelShape | None = None) -> np.ndarray:
    """Slots per layer (int64 [L]) of the spec's one cache-size field, before `capacity_alloc`."""
    if spec.vram_budget_GiB is not None:
        caps = costmodel.capacities_for_budget(shape, spec.vram_budget_GiB, spec.policy)
        return resolve_capacities(caps, num_layers, num_experts, top_k,
                                  flag=f"--vram-budget {spec.vram_budget_GiB!r} GiB: capacity")
    return resolve_capacities(spec.capacity, num_layers, num_experts, top_k, spec.capacity_fraction)


def calibration(spec: RunSpec, source: CalibrationSource,
                initial_residency: Sequence[np.ndarray] | None = None) -> Calibration:
    """The warm-start source of `spec` on `source` (kept in `source.memo`: every spec of a group shares it)."""
    ir = spec.initial_residency
    if initial_residency is not None:
        if ir is not None:
            raise InputError(f"{FLAG} = {ir!r} and per-layer ids given: give one of them")
        return Calibration("given", "given", given=tuple(np.asarray(r) for r in initial_residency))
    key = ("calibration", ir, spec.calib_text)
    if key not in source.memo:
        source.memo[key] = _calibration(ir, spec.calib_text, source)
    return source.memo[key]


def _calibration(ir: str | None, calib_text: str | None, source: CalibrationSource) -> Calibration:
    if ir is None:
        cal = source.calibration_text(calib_text)
        if cal is not None:
            return cal
        log.warning("no %s (and no calibration text): warm start from the held-out last %d%% of %s (not evaluated)",
                    FLAG, round(HELD_OUT_FRACTION * 100), source.tokens_name)
        ir = HELD_OUT
    if ir == "cold":
        return Calibration("cold", "cold")
    if ir == HELD_OUT:
        return source.held_out(HELD_OUT_FRACTION)
    if ir.startswith("warm:"):
        path = ir[len("warm:"):]
        calib = source.load_trace(path)
        known = {calib.meta.model, source.model}.isdisjoint({"", "unknown"})
        family = lambda name: name.split(":")[0].replace("_", "")  # noqa: E731 - llama.cpp's qwen3moe is qwen3_moe
        if known and family(calib.meta.model) != family(source.model):
            raise InputError(f"{FLAG}: calibration trace {path} is from model {calib.meta.model!r}; "
                             f"{source.input_name} is from {source.model!r}")
        dims = (source.num_experts, source.top_k, source.num_layers)
        if (calib.E, calib.k, calib.L) != dims:
            raise InputError(f"{FLAG}: calibration trace {path} has E={calib.E}, k={calib.k}, L={calib.L}; "
                             f"{source.input_name} has E={dims[0]}, k={dims[1]}, L={dims[2]}")
        return Calibration("warm", ir, calib.topk_ids, calib.valid)
    try:  # a residency file (RunSpec admits only warm:, cold, held-out or .npy)
        arr = np.load(Path(ir), allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"{FLAG}: cannot read {ir}: {str(exc).splitlines()[0]}") from None
    L = source.num_layers
    if arr.ndim != 2 or arr.shape[0] != L or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{FLAG}: {ir} has shape {arr.shape} dtype {arr.dtype}; expected int [L={L}, C]")
    return Calibration("file", ir, given=tuple(arr[l_] for l_ in range(L)))


def _check_rows(cal: Calibration, name: str, caps: np.ndarray, E: int) -> None:
    """A residency file's (or given ids') rows: ids in [0, E) or -1, at most C_l distinct ids per layer."""
    if len(cal.given) != len(caps):
        raise InputError(f"{FLAG}: {name} has {len(cal.given)} layers, expected {len(caps)}")
    cmax = int(caps.max())
    for l_, row in enumerate(cal.given):
        row = np.asarray(row)
        if row.size > cmax or (row.size and (row.min() < -1 or row.max() >= E)):
            raise InputError(f"{FLAG}: {name} layer {l_} = {row.tolist()[:12]}: expected ids in [0, {E}) (-1: an empty "
                             f"slot) and at most C={cmax} columns")
        ids = row[row >= 0]
        if len(ids) > caps[l_] or len(np.unique(ids)) != len(ids):
            raise InputError(f"{FLAG}: {name} row {l_} = {row.tolist()[:12]} repeats an id or exceeds C={caps[l_]}")


def check_pinned(policy: PolicyConfig, caps: np.ndarray, init: Sequence[np.ndarray] | None, top_k: int) -> None:
    """`pin_fraction` (docs/policies.md, "Pinned hot set"): P_l = floor(pin_fraction * C_l) of each layer's
    first residents are pinned, so it needs a warm start holding P_l experts and C_l - P_l >= k slots left."""
    f = policy.pin_fraction
    if not f:
        return
    if init is None:
        raise InputError(f"--pin-fraction = {f!r} needs a warm start (the pinned experts are the first of the "
                         "initial residency); this run starts cold")
    for l_, c in enumerate(caps.tolist()):
        p_ = pinned_count(f, c)
        if c - p_ < top_k:
            raise InputError(f"--pin-fraction = {f!r} pins P={p_} of C={c} slots at layer {l_}, leaving {c - p_} < "
                             f"k={top_k} for fetches (need C - P >= k)")
        held = int((np.asarray(init[l_]) >= 0).sum())
        if held < p_:
            raise InputError(f"--pin-fraction = {f!r} pins P={p_} experts at layer {l_}; its initial residency "
                             f"holds only {held}")


def _shape(spec: RunSpec, source: CalibrationSource) -> costmodel.ModelShape:
    shape = source.model_shape(spec.model_shape)
    return costmodel.with_format(shape, spec.weight_format) if spec.weight_format else shape


def _host(spec: RunSpec, source: CalibrationSource) -> costmodel.HostProfile:
    """RunSpec.host: a preset name or YAML file (loaded once per source), or the profile by value."""
    if isinstance(spec.host, dict):
        return costmodel.host_profile_from_dict(spec.host, f"--host (profile {spec.host.get('name')!r})")
    key = ("host", spec.host)
    if key not in source.memo:
        source.memo[key] = costmodel.load_host_profile(spec.host)
    return source.memo[key]


def save_residency(run: Run, path: str | None) -> None:
    """`residency_out`: the run's initial residency as .npy int [L, max C_l] (rows padded with -1 where a
    layer has fewer slots); nothing when `path` is None."""
    if path is None:
        return
    arr = residency_array(run.initial_residency, run.capacities, f"--residency-out {path}")
    atomic_write(path, lambda tmp: np.save(open(tmp, "wb"), arr))
