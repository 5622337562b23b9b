"""RunSpec and Result: one evaluation request and its answer, the same for every backend.

A `RunSpec` travels unchanged from a search space (sweep/) or a command line to a backend
(runtime/backends/__init__.py: simulator, emulation, engine) and into MLflow. It holds the policy
(runtime/core/policy.py's PolicyConfig), the cache size (exactly one of per-layer `capacity`,
`capacity_fraction`, `vram_budget_GiB`), the inputs (a router `trace`, or a `model` and a
`text`), the token budget, the warm-start source and the output requests. It validates itself
when built; a backend refuses, with a one-line error, every field it cannot honour
(`Backend.check`).

RunSpec's fields (besides `policy`, whose table is PolicyConfig's, and the display `name`) are the
run-field table, like PolicyConfig's: each carries in `dataclasses.field` metadata (`_r(...)`) its
default, its one command-line flag, help, kind (with range or choices), whether it names an output
file, and the backends that honour it. `RUN_FIELDS` reads them back; validation (`RunField.check`),
`FLAGS`, each backend's `honours` (`honoured_by`), every command line's run flags
(`add_run_flags` / `run_kwargs`) and the sweep config's reading of these keys derive from it.
`--capacity` is one meaning everywhere: `C` (every MoE layer) or `C0,C1,...` (one per layer). `host` is a
preset name, a YAML file, or (library, the sweep) the profile by value: its fields as a mapping (a
`HostProfile` given is kept as its mapping), so a spec carries everything its evaluation needs.

What a spec means on an input (slots per layer, the initial residency and its source, the host profile)
is resolved in one place, `runtime.backends.resolve.resolve` (it needs the cost model, a formats module,
so it sits in backends, not here); a backend only supplies its calibration ids.

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

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from runtime.core.errors import InputError, check_output_path
from runtime.core.policy import PolicyConfig

HELD_OUT = "held-out"
HELD_OUT_FRACTION = 0.2  # the last 20% of the tokens calibrate a held-out warm start
# the fields every spec of one evaluation group shares (one exact pass, one warm-start source)
GROUP_FIELDS = ("model", "text", "max_tokens", "window", "batch_windows", "initial_residency", "calib_text",
                "calib_max_tokens", "dtype", "max_memory_GiB", "device", "host_store", "no_cuda_graphs", "nll_out")
DTYPES = ("auto", "fp32", "bf16", "fp16")
SUBSTITUTE_WEIGHTS = ("missed", "own")
HOST_STORES = ("ram", "mmap")

BACKEND_NAMES = ("simulator", "emulation", "engine")
_ALL = BACKEND_NAMES
_SIM = ("simulator",)
_TEXT = ("emulation", "engine")
SIZE_FIELDS = ("capacity", "capacity_fraction", "vram_budget_GiB")  # exactly one of them per spec
DEFAULT_CAPACITY_FRACTION = 0.25  # the emulation / engine CLIs' cache size when none is given


@dataclass(frozen=True)
class RunField:
    """One row of the run-field table (read from RunSpec's field metadata, like policy.Param)."""

    name: str
    default: Any
    flag: str | None  # its one command-line flag; None: library only (record_decisions)
    help: str
    backends: frozenset[str]  # the backends that honour it; the others refuse it (Backend.check)
    kind: str = "str"  # str | int | float | capacity | bool | memory (a number of GiB or 'auto') | host
    choices: tuple[str, ...] | None = None
    low: float | None = None  # int: smallest value; float: exclusive lower bound
    high: float | None = None  # float: exclusive upper bound
    output: bool = False  # a file the run writes: its folder is checked before any work
    metavar: str | None = None

    @property
    def dest(self) -> str:
        """The argparse attribute of its flag (argparse's own rule: `--max-memory` -> `max_memory`)."""
        return self.flag.lstrip("-").replace("-", "_") if self.flag else self.name

    def check(self, value: Any, label: str | None = None) -> Any:
        """The value, converted (paths to str, lists to tuples), or a one-line InputError naming
        `label` (default: the flag) and the value."""
        label = label or self.flag or self.name
        if value is None:
            if self.default is None:
                return None
            raise InputError(f"{label} = None: needs a value (default {self.default!r})")
        if self.kind == "str":
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
            if not isinstance(value, str) or not value:
                raise InputError(f"{label} = {value!r} must be a non-empty string")
            if self.choices is not None and value not in self.choices:
                raise InputError(f"{label} = {value!r} must be one of {', '.join(self.choices)}")
            return value
        if self.kind == "bool":
            if not isinstance(value, bool | np.bool_):
                raise InputError(f"{label} = {value!r} must be true or false")
            return bool(value)
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < self.low:
                raise InputError(f"{label} = {value!r} must be an integer >= {self.low:g}")
            return int(value)
        if self.kind == "capacity":
            vals = list(value) if isinstance(value, list | tuple | np.ndarray) else [value]
            if not vals or any(isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1 for v in vals):
                raise InputError(f"{label} = {value!r} must be one positive int for all layers or a list of them, "
                                 "one per layer")
            return int(vals[0]) if not isinstance(value, list | tuple | np.ndarray) else tuple(int(v) for v in vals)
        if self.kind == "host":  # by name (a preset or a YAML file) or by value: the profile's fields
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)  # e.g. a runtime.formats.costmodel.HostProfile
            if isinstance(value, Mapping):
                if not isinstance(value.get("name"), str) or not value["name"]:
                    raise InputError(f"{label} = {dict(value)!r}: a host profile by value needs a non-empty 'name'")
                return dict(value)  # validated field by field when resolved (runtime/backends/resolve.py)
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
            if not isinstance(value, str) or not value:
                raise InputError(f"{label} = {value!r} must be a host preset name, a host YAML file or a host "
                                 "profile's fields (a mapping with a 'name')")
            return value
        if self.kind == "memory":  # runtime.backends.stream.resolve_max_memory turns auto into GiB when a model loads
            if value == "auto":
                return value
            try:
                v = float(value) if not isinstance(value, bool) else math.nan
            except (TypeError, ValueError):
                v = math.nan
            if not (0 < v < math.inf):
                raise InputError(f"{label} = {value!r} must be a positive number of GiB or 'auto'")
            return v
        ok = not isinstance(value, bool) and isinstance(value, int | float | np.integer | np.floating)
        if not ok or not math.isfinite(value) or not (self.low is None or value > self.low) \
                or not (self.high is None or value < self.high):
            if self.high is None:
                raise InputError(f"{label} = {value!r} must be a number > {self.low:g}"
                                 + (" (GiB)" if self.metavar == "GIB" else ""))
            raise InputError(f"{label} = {value!r} must be in ({self.low:g}, {self.high:g})")
        return float(value)


def _r(default: Any, flag: str | None, help: str, backends: tuple[str, ...] = _ALL, **kw: Any) -> Any:
    return field(default=default, metadata={"run": dict(flag=flag, help=help, backends=frozenset(backends), **kw)})


@dataclass(frozen=True)
class RunSpec:
    """One evaluation: a policy at a cache size on an input. Validated when built.

    Every field but `policy` (its own table, runtime/core/policy.py) and `name` is a row of the run-field
    table: its default, its one flag, its help and the backends that honour it (`RUN_FIELDS`)."""

    policy: PolicyConfig
    name: str = ""  # display name (a preset's name, a sweep trial's label); empty = the policy's label
    capacity: int | tuple[int, ...] | None = _r(
        None, "--capacity", "expert slots per MoE layer: C (one int for all layers) or C0,C1,... (one per layer)",
        kind="capacity", metavar="C[,C1,...]")
    capacity_fraction: float | None = _r(
        None, "--capacity-fraction", "slots per layer as a fraction of the experts, in (0, 1)", kind="float",
        low=0.0, high=1.0, metavar="F")
    vram_budget_GiB: float | None = _r(
        None, "--vram-budget", "GiB of device memory: the slots the engine really holds "
        "(runtime.formats.costmodel.capacities_for_budget)", kind="float", low=0.0, metavar="GIB")
    trace: str | None = _r(None, "--trace", "router trace: .parquet, .arrow or .npz", _SIM)
    model: str | None = _r(None, "--model", "Hugging Face checkpoint directory, or a .gguf file (qwen3moe: "
                           "dequantized by transformers, docs/emulation.md)", _TEXT)
    text: str | None = _r(None, "--text", "UTF-8 text file to evaluate", _TEXT)
    max_tokens: int | None = _r(None, "--max-tokens", "evaluated tokens (trace rows or text tokens, after any "
                                "held-out split); unset: all", kind="int", low=2, metavar="N")
    window: int | None = _r(None, "--window", "tokens per context window (unset: min(max positions, 512))", _TEXT,
                            kind="int", low=2, metavar="N")
    batch_windows: int = _r(8, "--batch-windows", "windows per batched forward (speed only)", _TEXT, kind="int",
                            low=1, metavar="N")
    initial_residency: str | None = _r(
        None, "--initial-residency", "warm start: warm:CALIB_TRACE | cold | FILE.npy (int [L, C]) | held-out "
        "(unset: simulator held-out, the last 20% of the trace; emulation/engine --calib-text, else calib.txt "
        "beside the model, else held-out)")
    calib_text: str | None = _r(None, "--calib-text", "text for the warm start (unset: calib.txt beside the model)",
                                _TEXT)
    calib_max_tokens: int = _r(16384, "--calib-max-tokens", "calibration tokens read (independent of --max-tokens)",
                               _TEXT, kind="int", low=2, metavar="N")
    host: str | dict = _r("rtx4090", "--host", "host profile: a preset (runtime/data/hosts) or a YAML file; library: "
                          "also the profile by value (its fields as a mapping, or a HostProfile)", _SIM, kind="host")
    model_shape: str | None = _r(None, "--model-shape", "model shape: a preset (runtime/data/models), a YAML file "
                                 "or a config.json (unset: from the trace)", _SIM)
    weight_format: str | None = _r(None, "--weight-format", "expert storage format: bf16 | q8_0 | q4_k_m "
                                   "(unset: the shape's)", _SIM)
    device: str | None = _r(None, "--device", "cpu | cuda (emulation: each layer streamed through it; unset: the host "
                            "path, no device pipe; engine: where it decodes; unset: cuda when available)", _TEXT)
    dtype: str = _r("auto", "--dtype", "auto (the checkpoint's own: bf16 stays bf16) | fp32 | bf16 | fp16", _TEXT,
                    choices=DTYPES)
    max_memory_GiB: float | str = _r(
        "auto", "--max-memory", "host RAM the model's weights may use (auto: available memory less max(2 GiB, "
        "10%)); a model above it is read from its safetensors shards layer by layer (docs/emulation.md)", _TEXT,
        kind="memory", metavar="GIB")
    host_store: str = _r("ram", "--host-store", "ram | mmap: where the engine's host expert store lives", ("engine",),
                         choices=HOST_STORES)
    no_cuda_graphs: bool = _r(False, "--no-cuda-graphs", "engine: decode each step eagerly instead of replaying its "
                              "captured CUDA graphs (debugging; the same segments and results; CPU device mode never "
                              "captures)", ("engine",), kind="bool")
    substitute_weight: str = _r("missed", "--substitute-weight", "missed | own: apply a substitute with the missed expert's "
                                "gate weight, or its own", ("emulation",), choices=SUBSTITUTE_WEIGHTS)
    nll_out: str | None = _r(None, "--nll-out", "write the per-token NLLs (Parquet)", _TEXT, output=True)
    trace_out: str | None = _r(None, "--trace-out", "write the router trace seen under the (single) policy",
                               ("emulation",), output=True)
    residency_out: str | None = _r(None, "--residency-out", "write the initial residency used (.npy int [L, C])",
                                   output=True)
    record_decisions: bool = _r(False, None, "Result.decisions: per token and layer kind / served / slot "
                                "(library only)", kind="bool")

    def __post_init__(self) -> None:
        for f in RUN_FIELDS:
            object.__setattr__(self, f.name, f.check(getattr(self, f.name)))
        if not isinstance(self.policy, PolicyConfig):
            raise InputError(f"RunSpec.policy = {self.policy!r} must be a PolicyConfig")
        sizes = [n for n in SIZE_FIELDS if getattr(self, n) is not None]
        if len(sizes) != 1:
            given = ", ".join(f"{FLAGS[n]} {getattr(self, n)!r}" for n in sizes) or "none"
            raise InputError(f"cache size: give exactly one of {', '.join(FLAGS[n] for n in SIZE_FIELDS)} "
                             f"(given: {given})")
        if (self.trace is None) == (self.text is None):
            raise InputError("input: give either --trace (simulator) or --model with --text (emulation, engine)")
        if self.text is not None and self.model is None:
            raise InputError(f"--text {self.text}: --model is required with a text")
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
            if k != "policy" and v is not None and k not in _NOT_PARAMS:
                if isinstance(v, dict):  # a host profile by value: its name
                    v = v["name"]
                out[k] = ",".join(map(str, v)) if isinstance(v, list) else str(v)
        return out



RUN_FIELDS: tuple[RunField, ...] = tuple(RunField(name=f.name, default=f.default, **f.metadata["run"])
                                         for f in fields(RunSpec) if "run" in f.metadata)
RUN_FIELD_BY_NAME: dict[str, RunField] = {f.name: f for f in RUN_FIELDS}
# RunSpec field -> its command-line flag (error messages name the flag the user typed)
FLAGS: dict[str, str] = {f.name: f.flag or f"({f.name})" for f in RUN_FIELDS}
_NOT_PARAMS = frozenset(f.name for f in RUN_FIELDS if f.output or f.flag is None)  # outputs, library-only requests


def honoured_by(backend: str) -> frozenset[str]:
    """The RunSpec fields `backend` honours (the table's `backends` column)."""
    return frozenset(f.name for f in RUN_FIELDS if backend in f.backends)


def backend_options(spec: RunSpec, backend: str) -> dict[str, Any]:
    """The fields only `backend` honours, by name: its options (the engine's `host_store`, `no_cuda_graphs`),
    passed to it as keyword arguments, so a new option is one row of the table and its use."""
    return {f.name: getattr(spec, f.name) for f in RUN_FIELDS if f.backends == {backend}}


def parse_capacity(text: str) -> int | tuple[int, ...]:
    """`--capacity`: one int for all layers (`C`) or a comma list, one per MoE layer (`C0,C1,...`)."""
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--capacity = {text!r} must be one int for all layers or a comma list "
                                         "of ints, one per layer (C or C0,C1,...)") from None
    return vals[0] if len(vals) == 1 else tuple(vals)


def _conv(f: RunField):  # noqa: ANN202 - an argparse type
    if f.kind == "capacity":
        return parse_capacity
    if f.kind not in ("int", "float"):
        return str
    kind = int if f.kind == "int" else float

    def conv(text: str) -> int | float:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{f.flag} = {text!r} is not {'an integer' if kind is int else 'a number'}"
                                             ) from None
    return conv


def add_run_flags(p: argparse.ArgumentParser, backends: tuple[str, ...], *, only: tuple[str, ...] | None = None,
                  size_required: bool = False, size_default: str = "",
                  notes: dict[str, str] | None = None) -> tuple[str, ...]:
    """One flag per RunSpec field that any of `backends` honours (or those of `only`), from the table:
    flag, type, default and help (plus `notes[field]`); the cache-size flags mutually exclusive.
    Returns the fields added (`run_kwargs` reads them back)."""
    names: list[str] = []
    rows = [f for f in RUN_FIELDS
            if f.flag is not None and f.backends & set(backends) and (only is None or f.name in only)]
    run = p.add_argument_group("run (runtime/core/spec.py's RunSpec fields)")
    if any(f.name in SIZE_FIELDS for f in rows):  # argparse refuses an empty exclusive group
        size = p.add_argument_group("cache size (exactly one)" + (f"; default {size_default}" if size_default else ""))
        size = size.add_mutually_exclusive_group(required=size_required)
    for f in rows:
        which = "" if f.backends >= set(backends) else f" [{', '.join(b for b in backends if b in f.backends)} only]"
        default = "" if f.default is None else f"; default {f.default}"
        note = f": {notes[f.name]}" if notes and f.name in notes else ""
        grp = size if f.name in SIZE_FIELDS else run
        text = (f.help + note + ("" if f.kind == "bool" else default) + which).replace("%", "%%")
        if f.kind == "bool":  # a switch: given means True
            grp.add_argument(f.flag, dest=f.dest, action="store_true", help=text)
        else:
            grp.add_argument(f.flag, dest=f.dest, type=_conv(f), default=f.default, metavar=f.metavar, help=text)
        names.append(f.name)
    return tuple(names)


def run_kwargs(a: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """RunSpec keyword arguments from the flags `add_run_flags` added; output files are checked first."""
    out = {n: getattr(a, RUN_FIELD_BY_NAME[n].dest) for n in names}
    for n, v in out.items():
        if RUN_FIELD_BY_NAME[n].output:
            check_output_path(v, RUN_FIELD_BY_NAME[n].flag)
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
    counters: dict[str, float]  # runtime.core.kernel.COUNTER_NAMES and the masses, totals over layers
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
        """The gate mass per token that the model's own experts did not compute: substituted and dropped
        misses' and, under cache-aware routing, the displaced experts' (rerouted_mass, 0 otherwise)."""
        return (self.counters["substituted_mass"] + self.counters.get("rerouted_mass", 0.0)) / max(self.tokens, 1)

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready dict (the result keys of earlier versions kept: counters at the top level)."""
        d = asdict(self)
        d.pop("decisions")
        d.pop("counters")
        extra = d.pop("extra")
        d.update(self.counters)
        calls = max(self.counters.get("calls", 0), 1)
        d["mass_per_token"] = self.mass_per_token
        d["mass_per_token_layer"] = ((self.counters["substituted_mass"] + self.counters.get("rerouted_mass", 0.0))
                                     / max(self.tokens * self.num_layers, 1))
        d["substituted_call_fraction"] = (self.counters["substitutions"] + self.counters["drops"]) / calls
        if self.ppl_ci_low is not None:
            d["ppl_change_ci95"] = [self.ppl_ci_low, self.ppl_ci_high]
        d.update(extra)
        return d
