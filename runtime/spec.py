"""RunSpec and Result: one evaluation request and its answer, the same for every backend.

A `RunSpec` travels unchanged from a search space (sweep/) or a command line to a backend
(runtime/backends.py: simulator, emulation, engine) and into MLflow. It holds the policy
(runtime/policy.py's PolicyConfig), the cache size (exactly one of per-layer `capacity`,
`capacity_fraction`, `vram_budget_GiB`), the inputs (a router `trace`, or a `model` and a
`text`), the token budget, the warm-start source and the output requests. It validates itself
when built; a backend refuses, with a one-line error, every field it cannot honour
(`Backend.check`).

Warm start (docs/policies.md "Initial residency"): never the evaluated data.
- `initial_residency`: `warm:TRACE` (a calibration trace), `cold`, `FILE.npy` (int [L, C]), or
  `held-out`: the last `HELD_OUT_FRACTION` of the tokens (trace rows or text tokens) calibrate
  the cache and are never evaluated; the evaluation uses the tokens before them.
- unset: the simulator takes `held-out` with a warning; the emulation and the engine take
  `calib_text`, else `calib.txt` beside the model, else `held-out` with a warning. The
  calibration text is read up to `calib_max_tokens` tokens, independently of `max_tokens`.
`Result.initial_residency` names the source actually used.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from runtime.errors import InputError
from runtime.policy import PolicyConfig

HELD_OUT = "held-out"
HELD_OUT_FRACTION = 0.2  # the last 20% of the tokens calibrate a held-out warm start
# the fields every spec of one evaluation group shares (one exact pass, one warm-start source)
GROUP_FIELDS = ("model", "text", "max_tokens", "window", "batch_windows", "initial_residency", "calib_text",
                "calib_max_tokens", "dtype", "max_memory_GiB", "device", "host_store", "nll_out")
DTYPES = ("auto", "fp32", "bf16", "fp16")
SUBSTITUTE_WEIGHTS = ("missed", "own")

# RunSpec field -> its command-line flag (error messages name the flag the user typed)
FLAGS = {
    "capacity": "--capacity", "capacity_fraction": "--capacity-fraction", "vram_budget_GiB": "--vram-budget",
    "trace": "--trace", "model": "--model", "text": "--text", "max_tokens": "--max-tokens", "window": "--window",
    "batch_windows": "--batch-windows", "initial_residency": "--initial-residency", "calib_text": "--calib-text",
    "calib_max_tokens": "--calib-max-tokens", "host": "--host", "model_shape": "--model-shape",
    "weight_format": "--weight-format", "device": "--device", "dtype": "--dtype", "max_memory_GiB": "--max-memory",
    "host_store": "--host-store",
    "substitute_weight": "--substitute-weight", "nll_out": "--nll-out", "trace_out": "--trace-out",
    "residency_out": "--residency-out", "record_decisions": "(record_decisions)",
}


@dataclass(frozen=True)
class RunSpec:
    """One evaluation: a policy at a cache size on an input. Validated when built."""

    policy: PolicyConfig
    name: str = ""  # display name (a preset's name, a sweep trial's label); empty = the policy's label
    capacity: int | tuple[int, ...] | None = None  # slots per layer: one for all, or one per MoE layer
    capacity_fraction: float | None = None
    vram_budget_GiB: float | None = None  # what the engine really holds (runtime.costmodel.capacities_for_budget)
    trace: str | None = None  # simulator input
    model: str | None = None  # Hugging Face checkpoint directory (emulation, engine)
    text: str | None = None  # evaluated text (emulation, engine)
    max_tokens: int | None = None  # evaluated tokens (trace rows or text tokens); None = all
    window: int | None = None  # tokens per context window (None: min(max positions, 512))
    batch_windows: int = 8  # windows per batched forward (speed only)
    initial_residency: str | None = None  # warm:TRACE | cold | FILE.npy | held-out | None (module doc)
    calib_text: str | None = None
    calib_max_tokens: int = 16384
    host: str = "rtx4090"  # simulator: host profile preset or YAML
    model_shape: str | None = None  # simulator: model shape preset or YAML (default: from the trace)
    weight_format: str | None = None  # simulator: bf16 | q8_0 | q4_k_m
    device: str | None = None  # engine: cpu | cuda (None: cuda when available)
    dtype: str = "auto"  # the checkpoint's own dtype (a bf16 checkpoint stays bf16); fp32 only when asked
    max_memory_GiB: float | str = "auto"  # host RAM the weights may use; above it passes stream layer by layer
    host_store: str = "ram"  # engine: ram | mmap
    substitute_weight: str = "missed"  # emulation: apply a substitute with the missed expert's weight, or its own
    nll_out: str | None = None
    trace_out: str | None = None
    residency_out: str | None = None
    record_decisions: bool = False  # Result.decisions: per token and layer kind / served / slot

    def __post_init__(self) -> None:
        for name in ("trace", "model", "text", "calib_text", "nll_out", "trace_out", "residency_out"):
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        if not isinstance(self.policy, PolicyConfig):
            raise InputError(f"RunSpec.policy = {self.policy!r} must be a PolicyConfig")
        sizes = [n for n in ("capacity", "capacity_fraction", "vram_budget_GiB") if getattr(self, n) is not None]
        if len(sizes) != 1:
            given = ", ".join(f"{FLAGS[n]} {getattr(self, n)!r}" for n in sizes) or "none"
            raise InputError(f"cache size: give exactly one of --capacity, --capacity-fraction, --vram-budget (given: {given})")
        if isinstance(self.capacity, list | np.ndarray):
            object.__setattr__(self, "capacity", tuple(int(c) for c in self.capacity))
        if self.capacity_fraction is not None and not (0 < self.capacity_fraction < 1):
            raise InputError(f"--capacity-fraction = {self.capacity_fraction!r} must be in (0, 1)")
        if self.vram_budget_GiB is not None and not (self.vram_budget_GiB > 0 and math.isfinite(self.vram_budget_GiB)):
            raise InputError(f"--vram-budget = {self.vram_budget_GiB!r} must be a positive number of GiB")
        for name in ("max_tokens", "window", "batch_windows", "calib_max_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int | np.integer) or v < (1 if name == "batch_windows" else 2)):
                raise InputError(f"{FLAGS[name]} = {v!r} must be an integer >= {1 if name == 'batch_windows' else 2}")
        if (self.trace is None) == (self.text is None):
            raise InputError("input: give either --trace (simulator) or --model with --text (emulation, engine)")
        if self.text is not None and self.model is None:
            raise InputError(f"--text {self.text}: --model is required with a text")
        if self.dtype not in DTYPES:
            raise InputError(f"--dtype = {self.dtype!r} must be one of {', '.join(DTYPES)}")
        if self.max_memory_GiB != "auto":
            from runtime.stream import resolve_max_memory

            object.__setattr__(self, "max_memory_GiB", resolve_max_memory(self.max_memory_GiB))
        if self.substitute_weight not in SUBSTITUTE_WEIGHTS:
            raise InputError(f"--substitute-weight = {self.substitute_weight!r} must be 'missed' or 'own'")
        if self.host_store not in ("ram", "mmap"):
            raise InputError(f"--host-store = {self.host_store!r} must be ram or mmap")
        ir = self.initial_residency
        if ir is not None and not (ir in ("cold", HELD_OUT) or ir.startswith("warm:") or ir.endswith(".npy")):
            raise InputError(f"--initial-residency = {ir!r}: expected warm:TRACE, cold, held-out or a .npy file")
        if ir == "warm:self":
            raise InputError("--initial-residency = 'warm:self' calibrates on the evaluated trace: use held-out, "
                             "warm:CALIB_TRACE, cold or a .npy file")
        if ir is not None and self.calib_text is not None:
            raise InputError(f"--initial-residency {ir!r} and --calib-text {self.calib_text!r}: give one of them")

    @property
    def label(self) -> str:
        return self.name or self.policy.label()

    def requested(self) -> dict[str, Any]:
        """The fields (besides the policy) whose value differs from the default: what a backend must honour."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("policy", "name") and getattr(self, f.name) != f.default}

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "policy"}
        d["capacity"] = list(self.capacity) if isinstance(self.capacity, tuple) else self.capacity
        d["policy"] = self.policy.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "run spec") -> RunSpec:
        d = dict(d)
        pol = d.pop("policy", {})
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise InputError(f"{where}: unknown field {unknown[0]!r}")
        return cls(policy=pol if isinstance(pol, PolicyConfig) else PolicyConfig.from_dict(pol, where), **d)

    def mlflow_params(self) -> dict[str, str]:
        """Policy fields plus the spec's set fields, as MLflow params (strings)."""
        out = self.policy.mlflow_params()
        for k, v in self.to_dict().items():
            if k != "policy" and v is not None and k not in ("nll_out", "trace_out", "residency_out", "record_decisions"):
                out[k] = ",".join(map(str, v)) if isinstance(v, list) else str(v)
        return out


@dataclass
class Result:
    """One backend's answer to one RunSpec. Fields mean the same thing in every backend; a backend
    leaves None what it does not measure (the simulator has no perplexity, the emulation no time)."""

    backend: str
    policy: str  # label
    policy_config: dict
    capacity: list[int]  # slots per layer actually used
    initial_residency: str  # the warm-start source actually used
    tokens: int  # evaluated tokens
    num_layers: int
    num_experts: int
    top_k: int
    counters: dict[str, float]  # runtime.kernel.COUNTER_NAMES and the masses, totals over layers
    per_layer: list[dict]
    perplexity: float | None = None
    exact_perplexity: float | None = None
    ppl_change_pct: float | None = None
    ppl_ci_low: float | None = None  # 95% bootstrap interval over windows
    ppl_ci_high: float | None = None
    time_per_token_s: float | None = None
    time_kind: str | None = None  # "simulated" (cost model) | "measured" (engine wall clock)
    speed_ratio_vs_fetch_all: float | None = None
    extra: dict = field(default_factory=dict)  # backend-specific figures (documented per backend)
    decisions: dict[str, np.ndarray] | None = None  # kind / served / slot int [T, L, k] when requested

    @property
    def mass_per_token(self) -> float:
        return self.counters["substituted_mass"] / max(self.tokens, 1)

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready dict (the result keys of earlier versions kept: counters at the top level)."""
        d = asdict(self)
        d.pop("decisions")
        d.pop("counters")
        extra = d.pop("extra")
        d.update(self.counters)
        calls = max(self.counters.get("calls", 0), 1)
        d["mass_per_token"] = self.mass_per_token
        d["mass_per_token_layer"] = self.counters["substituted_mass"] / max(self.tokens * self.num_layers, 1)
        d["substituted_call_fraction"] = (self.counters["substitutions"] + self.counters["drops"]) / calls
        if self.ppl_ci_low is not None:
            d["ppl_change_ci95"] = [self.ppl_ci_low, self.ppl_ci_high]
        d.update(extra)
        return d
