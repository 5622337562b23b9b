"""Sweep configuration: a YAML file (search_spaces/*.yaml) -> a validated, frozen `SweepConfig`.

`SweepConfig`'s fields *are* the table of the file's top-level keys, like PolicyConfig's
(runtime/core/policy.py) and RunSpec's (runtime/core/spec.py): each field read from the file carries
in `dataclasses.field` metadata (`_k(...)`) its YAML key (the field name unless given), its kind
(with range or choices) and its help; its default is the field's. `SWEEP_KEYS` reads the rows back,
and the reading of a file (`from_dict`, `load_config`), the command-line overrides (`with_overrides`),
the unknown-key message and the key table (`key_table`, `python -m sweep.config`) derive from it.
Kinds: `str` (a non-empty string), `int` (>= low), `number` (a positive number), `choice`, `run` (a
RunSpec field: the run-field table's row checks it, so the sweep and the command lines agree) and
`custom` (a reader for the nested keys: hosts, trace, baselines, emulation, space, ...). The fields
without a row (`baseline_capacity_fraction`, `source`, ...) are set by a reader or by the sweep.

Unknown keys, bad types and values are one-line `InputError`s naming the file, the key and the value.
The keys are documented in docs/sweep.md ("Sweep configuration").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from runtime.core.errors import InputError
from runtime.core.policy import PRESETS
from runtime.core.spec import RUN_FIELD_BY_NAME as RUN
from sweep.space import Space, feasible_spec, parse_space, policy_of, without_gate_weights

log = logging.getLogger(__name__)

OBJECTIVES = ("time_per_token_s", "mass_per_token", "device_memory_GiB")
SAMPLERS = ("tpe", "nsga2")
SYNTHETIC_KEYS = {"num_tokens", "num_layers", "num_experts", "top_k", "ranking_depth", "seed", "skew",
                  "num_topics", "topic_locality", "switch_prob", "seq_len", "weight_norm", "temperature",
                  "noise", "sample", "calib_sample"}
_NAME_CHARS = ' :/,"{}'  # not in a host or model-resource name (Ray resources are host:NAME, model:NAME)


@dataclass(frozen=True)
class HostSpec:
    name: str
    profile: str = "preset"  # preset | preset:NAME | calibrate | path to a host YAML

    @property
    def resource(self) -> str:
        return f"host:{self.name}"


@dataclass(frozen=True)
class Emulation:
    """The ladder above the simulator (sweep/ladder.py)."""

    enabled: bool = True
    rungs: tuple[int, ...] = (2048,)  # short token budgets, increasing, each below max_tokens
    eta: int = 3  # successive halving: about 1/eta of a rung goes on
    max_full: int = 8  # candidates emulated at the full budget (besides the named baselines)
    engine: bool = True  # also decode the full-budget set with the engine on hosts with profile: calibrate
    cpus: int | None = None  # CPUs (and torch threads) of a recording / emulation task; None: auto (sweep/worker.py)


# ---------------------------------------------------------------------------------------------------
# readers of the keys whose values are nested or cross-checked: (where, value, fields read so far)

Reader = Callable[[str, Any, dict[str, Any]], dict[str, Any]]


def _int(where: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InputError(f"{where} = {v!r} must be an integer >= {lo}")
    return v


def _hosts(where: str, v: Any) -> tuple[HostSpec, ...]:
    if isinstance(v, str):
        v = [h.strip() for h in v.split(",") if h.strip()]
    if not isinstance(v, list) or not v:
        raise InputError(f"{where} = {v!r} must be a non-empty list of host names")
    out = []
    for i, h in enumerate(v):
        if isinstance(h, str):
            h = {"name": h}
        if not isinstance(h, dict) or set(h) - {"name", "profile"} or not isinstance(h.get("name"), str):
            raise InputError(f"{where}[{i}] = {h!r}: expected a name or {{name, profile}}")
        name = h["name"].strip()
        if not name or any(c in name for c in _NAME_CHARS):
            raise InputError(f"{where}[{i}].name = {name!r}: use letters, digits, - and _")
        prof = h.get("profile", "preset")
        if not isinstance(prof, str) or not prof:
            raise InputError(f"{where}[{i}].profile = {prof!r}: expected preset, preset:NAME, calibrate or a file")
        out.append(HostSpec(name, prof))
    names = [h.name for h in out]
    if len(set(names)) != len(names):
        raise InputError(f"{where} = {names}: a host is listed twice")
    return tuple(out)


def _trace(where: str, v: Any) -> str | dict | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and set(v) == {"synthetic"} and isinstance(v["synthetic"], dict):
        bad = set(v["synthetic"]) - SYNTHETIC_KEYS
        if bad:
            raise InputError(f"{where}.synthetic: unknown key {sorted(bad)[0]!r} "
                             f"(choose from {', '.join(sorted(SYNTHETIC_KEYS))})")
        for k in ("num_tokens", "num_layers", "num_experts", "top_k"):
            if k not in v["synthetic"]:
                raise InputError(f"{where}.synthetic: {k} is required")
        return v
    raise InputError(f"{where} = {v!r}: expected a trace file or {{synthetic: {{num_tokens, ...}}}}")


def _emulation(where: str, v: Any, max_tokens: int | None) -> Emulation:
    if v is False or v is None:
        return Emulation(enabled=False)
    if v is True:
        return Emulation()
    keys = {"rungs", "eta", "max_full", "engine", "cpus"}
    if not isinstance(v, dict) or set(v) - keys:
        raise InputError(f"{where} = {v!r}: expected false or {{rungs: [TOKENS, ...], eta, max_full, engine, cpus}}")
    rungs = v.get("rungs", list(Emulation.rungs))
    if not isinstance(rungs, list) or any(isinstance(r, bool) or not isinstance(r, int) or r < 16 for r in rungs) \
            or rungs != sorted(set(rungs)):
        raise InputError(f"{where}.rungs = {rungs!r} must be increasing token budgets >= 16")
    if max_tokens is not None and rungs and rungs[-1] >= max_tokens:
        raise InputError(f"{where}.rungs = {rungs!r}: every rung must be below max_tokens = {max_tokens}")
    if "engine" in v and not isinstance(v["engine"], bool):
        raise InputError(f"{where}.engine = {v['engine']!r} must be true or false")
    cpus = v.get("cpus", "auto")
    return Emulation(True, tuple(rungs), _int(f"{where}.eta", v.get("eta", 3), 2),
                     _int(f"{where}.max_full", v.get("max_full", 8), 1), v.get("engine", True),
                     None if cpus == "auto" else _int(f"{where}.cpus", cpus, 1))


def _read_space(where: str, spec: Any, got: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if isinstance(spec, dict) and spec.get("vram_budget_GiB") == "auto":
        kw["vram_budget_auto"] = True
        spec = {**spec, "vram_budget_GiB": 1.0}  # a placeholder until the model's shape is known
    return {**kw, "space": parse_space(spec, where), "space_spec": spec}


def _read_name(where: str, v: Any, got: dict[str, Any]) -> dict[str, Any]:
    if any(c in v for c in ' /\\:"'):
        raise InputError(f"{where} = {v!r}: use letters, digits, ., - and _")
    return {}


def _read_calib_text(where: str, v: Any, got: dict[str, Any]) -> dict[str, Any]:
    text = got.get("text")
    if v and text and Path(v).resolve() == Path(text).resolve():
        raise InputError(f"{where} = {v} is the evaluated text (a warm start must not see "
                         f"the evaluated data; leave calib_text out for a held-out part)")
    return {}


def _read_model_resource(where: str, res: Any, got: dict[str, Any]) -> dict[str, Any]:
    if res is None:
        return {}
    if not isinstance(res, str) or not res or any(c in res for c in _NAME_CHARS):
        raise InputError(f"{where} = {res!r}: use letters, digits, ., - and _ "
                         f"(the nodes holding the model offer the Ray resource model:NAME)")
    return {"model_resource": res}


def _read_objectives(where: str, obj: Any, got: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(obj, list) or any(o not in OBJECTIVES for o in obj) or obj[:2] != list(OBJECTIVES[:2]):
        raise InputError(f"{where} = {obj!r} must be [time_per_token_s, mass_per_token] "
                         f"optionally followed by device_memory_GiB")
    return {"objectives": tuple(obj)}


def _read_batch(where: str, b: Any, got: dict[str, Any]) -> dict[str, Any]:
    return {"batch": b if b == "auto" else _int(where, b, 1)}


# the default named baselines: every preset but the cache-aware routing ones (docs/policies.md, Additions (4)),
# which a config names itself (Cache-Prior replays router scores that a given trace may lack)
DEFAULT_BASELINES = tuple(n for n, p in PRESETS.items() if p.route == "off")


def _read_baselines(where: str, b: Any, got: dict[str, Any]) -> dict[str, Any]:
    b = b or {}
    if not isinstance(b, dict) or set(b) - {"policies", "capacity_fraction"}:
        raise InputError(f"{where} = {b!r}: expected {{policies: [...], capacity_fraction: F}}")
    pols = b.get("policies", list(DEFAULT_BASELINES))
    if not isinstance(pols, list) or any(p not in PRESETS for p in pols):
        raise InputError(f"{where}.policies = {pols!r} (choose from {', '.join(PRESETS)})")
    cf = b.get("capacity_fraction")
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, int | float) or not 0 < cf < 1):
        raise InputError(f"{where}.capacity_fraction = {cf!r} must be in (0, 1)")
    return {"baseline_policies": tuple(pols), "baseline_capacity_fraction": cf}


def _read_emulation(where: str, v: Any, got: dict[str, Any]) -> dict[str, Any]:
    return {"emulation": _emulation(where, v, got.get("max_tokens"))}


def _read_ppl_budgets(where: str, b: Any, got: dict[str, Any]) -> dict[str, Any]:
    if (not isinstance(b, list) or not b or any(isinstance(x, bool) or not isinstance(x, int | float)
                                                 or not 0 < x < math.inf for x in b)):
        raise InputError(f"{where} = {b!r} must be a non-empty list of positive numbers")
    return {"ppl_budgets_pct": tuple(sorted(float(x) for x in b))}


# ---------------------------------------------------------------------------------------------------
# the key table


@dataclass(frozen=True)
class SweepKey:
    """One row of the sweep-key table (read from SweepConfig's field metadata, like policy.Param)."""

    name: str  # the YAML key
    field: str  # the SweepConfig field it sets (a custom reader may set more, e.g. baselines)
    default: Any
    help: str
    kind: str = "str"  # str | int | number | choice | run | custom
    low: int | None = None  # int: smallest value
    choices: tuple[str, ...] | None = None
    nullable: bool = False  # str: null keeps the default
    required: bool = False
    reader: Reader | None = None  # custom: the whole reading; other kinds: a check after the kind's
    shown: str | None = None  # the default as the key table shows it (else repr of the default)

    def read(self, where: str, value: Any, got: dict[str, Any]) -> dict[str, Any]:
        """The SweepConfig fields `value` sets, or a one-line InputError naming `where` (the file and
        key, or the flag) and the value; `got`: the fields read before it (cross-checked keys)."""
        if self.kind == "custom":
            return self.reader(where, value, got)
        if self.kind == "run":  # RunSpec's own row: its default, its check, its message
            out = RUN[self.field].check(value, where)
        elif value is None and self.nullable:
            return {}
        elif self.kind == "str":
            if not isinstance(value, str) or not value:
                raise InputError(f"{where} = {value!r} must be a non-empty string")
            out = value
        elif self.kind == "int":
            out = _int(where, value, self.low)
        elif self.kind == "choice":
            if value not in self.choices:
                raise InputError(f"{where} = {value!r} (choose from {', '.join(self.choices)})")
            out = value
        else:  # number: positive, finite
            if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
                raise InputError(f"{where} = {value!r} must be a positive number")
            out = float(value)
        if self.reader is not None:
            self.reader(where, out, got)
        return {self.field: out}


def _k(default: Any, help: str, kind: str = "str", *, key: str | None = None, factory: Any = None,
       **kw: Any) -> Any:
    meta = {"sweep_key": dict(key=key, help=help, kind=kind, **kw)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _run(key: str, help: str = "", **kw: Any) -> Any:
    """A key that is a RunSpec field: RunSpec's default (the run-field table's row checks it)."""
    return _k(RUN[key].default, help or RUN[key].help, "run", **kw)


@dataclass(frozen=True)
class SweepConfig:
    """A sweep (docs/sweep.md). Every field with a `_k(...)` row is a top-level YAML key."""

    space: Space = _k(MISSING, "the search space (sweep/space.py); `vram_budget_GiB: auto` compares every policy at "
                      "the device memory fetch-every-miss needs at 25% residency", "custom", required=True,
                      reader=_read_space, shown="required")
    model: str | None = _run("model", "tiny model size (demo | test), any local Hugging Face checkpoint folder or a "
                                      ".gguf file (qwen3moe); "
                                      "its traces are recorded once and cached by a checkpoint digest (sweep/data.py)")
    text: str | None = _run("text", "evaluated text (default: the model's eval.txt)")
    calib_text: str | None = _run("calib_text", "warm-start calibration text (default: the model's calib.txt; "
                                  "without one, the held-out last 20% of the evaluated tokens); never the evaluated "
                                  "text", reader=_read_calib_text)
    model_shape: str | None = _run("model_shape", "cost-model shape preset or YAML (default: from the trace)")
    name: str = _k("sweep", "results go to results/<name>/ unless --out", nullable=True, reader=_read_name,
                   shown="the file's name")
    calib_trace: str | None = _k(None, "warm-start calibration trace (default: the model's calib.txt trace)",
                                 nullable=True)
    model_resource: str | None = _k(None, "NAME: the model's files are on the Ray nodes offering model:NAME (paths "
                                    "of model/text/calib_text are paths there); null: on the driver's node",
                                    "custom", reader=_read_model_resource)
    max_memory_GiB: float | str = _run("max_memory_GiB", "host RAM the model's weights may use in recording and "
                                       "emulation (auto: the node's available memory less a margin); above it "
                                       "passes stream layer by layer")
    dtype: str = _run("dtype", "auto (the checkpoint's own) | fp32 | bf16 | fp16, for recording and emulation")
    trace: str | dict | None = _k(None, "a router trace file instead of a model, or {synthetic: {num_tokens, "
                                  "num_layers, num_experts, top_k, ...}}", "custom",
                                  reader=lambda w, v, got: {"trace": _trace(w, v)})
    hosts: tuple[HostSpec, ...] = _k((HostSpec("rtx3090"), HostSpec("rtx4090")), "host names, or {name, profile: "
                                     "preset | preset:NAME | calibrate | FILE}", "custom",
                                     reader=lambda w, v, got: {"hosts": _hosts(w, v)}, shown="[rtx3090, rtx4090]")
    max_tokens: int | None = _run("max_tokens", "tokens of each text recorded and emulated (null: the whole text)")
    trials: int = _k(40, "simulator trials per host, after the baselines", "int", low=0)
    population: int = _k(16, "nsga2 population size", "int", low=2)
    seed: int = _k(0, "the sampler's seed", "int", low=0)
    max_failures: int = _k(2, "retries of a failing trial (and of a dead task) before it is recorded failed",
                           "int", low=0)
    sampler: str = _k("tpe", "tpe (multivariate, constant liar) | nsga2", "choice", choices=SAMPLERS)
    objectives: tuple[str, ...] = _k(OBJECTIVES[:2], "the screening objectives; append device_memory_GiB for a "
                                     "third", "custom", reader=_read_objectives)
    batch: int | str = _k("auto", "simulator evaluations per Ray task (auto: about task_seconds each)", "custom",
                          reader=_read_batch)
    task_seconds: float = _k(2.0, "seconds of simulation per Ray task with batch: auto", "number")
    baseline_policies: tuple[str, ...] = _k(DEFAULT_BASELINES, "{policies: [...], capacity_fraction: F}: the named "
                                            "policies, screened first on every host and emulated at the full "
                                            "budget", "custom", key="baselines", reader=_read_baselines,
                                            shown="every preset but cache-prior and cache-route, at the space's "
                                                  "capacity")
    baseline_capacity_fraction: float | None = None  # set by `baselines`
    emulation: Emulation = _k(None, "the ladder (sweep/ladder.py): {rungs, eta, max_full, engine, cpus}; "
                              "false: off. cpus: Ray CPUs (= torch threads) of each recording "
                              "and emulation task", "custom", factory=Emulation, reader=_read_emulation,
                              shown="{rungs: [2048], eta: 3, max_full: 8, engine: true, cpus: auto}")
    ppl_budgets_pct: tuple[float, ...] = _k((0.5, 1.0, 2.0), "the answer: per host and budget, the fastest policy "
                                            "within it", "custom", reader=_read_ppl_budgets)
    source: str = "<config>"  # the file read
    vram_budget_auto: bool = False  # space.vram_budget_GiB: auto, resolved by resolve_vram_budget
    budget_notes: tuple[str, ...] = ()  # what fit_to_budget removed from the space (the summary lists it)
    space_spec: Any = field(default=None, compare=False, repr=False)  # the space mapping as given

    def baseline_capacity(self) -> dict[str, float]:
        """The capacity the named baselines run at: the space's fixed one, else the configured one."""
        p = self.space[self.space.capacity_field]
        if p.kind == "fixed":
            return {p.name: p.value}
        if self.baseline_capacity_fraction is not None:
            return {"capacity_fraction": self.baseline_capacity_fraction}
        if p.name == "capacity_fraction":
            v = 0.25 if p.contains(0.25) else (p.values()[0] if p.kind == "choice" else (p.low + p.high) / 2)
            return {"capacity_fraction": v}
        return {"vram_budget_GiB": p.values()[0] if p.kind == "choice" else (p.low * p.high) ** 0.5}


def _rows() -> tuple[SweepKey, ...]:
    out = []
    for f in fields(SweepConfig):
        if "sweep_key" not in f.metadata:
            continue
        m = dict(f.metadata["sweep_key"])
        default = f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
        out.append(SweepKey(name=m.pop("key") or f.name, field=f.name,
                            default=None if default is MISSING else default, **m))
    return tuple(out)


SWEEP_KEYS: tuple[SweepKey, ...] = _rows()  # in reading order (a key's reader sees the keys before it)
SWEEP_KEY_BY_NAME: dict[str, SweepKey] = {k.name: k for k in SWEEP_KEYS}


def _shown(v: Any) -> str:
    """A default as YAML writes it, in flow style: [a, b], auto, 2.0; null: -."""
    if isinstance(v, tuple | list):
        return "[" + ", ".join(_shown(x) for x in v) + "]"
    return "-" if v is None else str(v)


def key_table() -> str:
    """The keys as a Markdown table (key, default, what), from the table."""
    lines = ["| key | default | what |", "|---|---|---|"]
    for k in SWEEP_KEYS:
        cells = (f"`{k.name}`", k.shown or _shown(k.default), k.help)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def from_dict(data: Any, source: str = "<config>") -> SweepConfig:
    """Validate a parsed sweep YAML document, key by key through the table."""
    if not isinstance(data, dict):
        raise InputError(f"{source}: expected a mapping at the top level (got {type(data).__name__})")
    unknown = set(data) - set(SWEEP_KEY_BY_NAME)
    if unknown:
        raise InputError(f"{source}: unknown key {sorted(unknown)[0]!r} "
                         f"(choose from {', '.join(sorted(SWEEP_KEY_BY_NAME))})")
    kw: dict[str, Any] = {"source": source}
    for key in SWEEP_KEYS:
        if key.name in data:
            kw.update(key.read(f"{source}: {key.name}", data[key.name], kw))
        elif key.required:
            raise InputError(f"{source}: {key.name} is required")
    return SweepConfig(**kw)


AUTO_RESIDENCY = 0.25  # `vram_budget_GiB: auto`: what fetch-every-miss needs at this residency


def resolve_vram_budget(cfg: SweepConfig, shape: Any) -> SweepConfig:
    """`vram_budget_GiB: auto` -> the device memory fetch-every-miss needs with 25% of each layer's
    experts resident on `shape` (`costmodel.budget_for_capacities`, rounded up to 1e-4 GiB), fixed in
    the space, so every policy, low-bit copies, staging and admission buffers included, gets the
    slots that budget holds (`costmodel.capacities_for_budget`). Unchanged when not `auto`. A budget
    that leaves a named baseline fewer than k slots is a one-line InputError."""
    from runtime.formats import costmodel

    if not cfg.vram_budget_auto:
        return cfg
    E, k = shape.num_experts, shape.top_k
    slots = min(max(k, round(AUTO_RESIDENCY * E)), E - 1)
    gib = math.ceil(costmodel.budget_for_capacities(shape, slots, PRESETS["fetch-every-miss"]) * 1e4) / 1e4
    flag = f"{cfg.source}: space.vram_budget_GiB = auto ({gib:g} GiB)"
    for name in cfg.baseline_policies:
        costmodel.capacities_for_budget(shape, gib, PRESETS[name], flag=f"{flag}, baseline {name},")
    spec = {**cfg.space_spec, "vram_budget_GiB": gib}
    return replace(cfg, space=parse_space(spec, f"{cfg.source}: space"), space_spec=spec, vram_budget_auto=False,
                   baseline_capacity_fraction=None)


def fit_to_trace(cfg: SweepConfig, trace: Any = None) -> SweepConfig:
    """A sweep of a trace file: the space without what the trace cannot replay, said in one logged line.
    Without gate weights (imported routing ids, docs/traces.md): the values and parameters with which every
    policy reads gate weights (`sweep.space.without_gate_weights`) and the named baselines that read them.
    Without a lookahead column (an import, or a recording without `--lookahead`): `prefetch: lookahead`; without
    a router_scores column (a recording without `--router-scores`): `route: cache-prior` and its baselines.
    Unchanged for a complete trace, a synthetic one or a model's (recorded with what the space needs). `trace`:
    the config's trace already loaded (the driver has it), else it is read here."""
    if not isinstance(cfg.trace, str):
        return cfg
    from runtime.core.policy import gate_weight_readers
    from runtime.formats.trace import load_trace

    trace = load_trace(cfg.trace) if trace is None else trace
    spec, notes, baselines, lacks = cfg.space_spec, [], cfg.baseline_policies, []
    where = f"{cfg.source}: space (trace {Path(cfg.trace).name}"
    if not trace.meta.gate_weights:
        lacks.append("no gate weights")
        spec, notes = without_gate_weights(spec, where + " has no gate weights)")
        baselines = tuple(n for n in cfg.baseline_policies if not gate_weight_readers(PRESETS[n]))
        if not baselines:
            raise InputError(f"{cfg.source}: baselines {list(cfg.baseline_policies)}: every one reads gate weights, "
                             f"which the trace {cfg.trace} lacks (name fetch-every-miss or host-compute)")
    if trace.router_scores is None:  # Cache-Prior replays every expert's router score
        route = spec.get("route")
        replays_scores = [n for n in baselines if PRESETS[n].route == "cache-prior"]
        searches_it = isinstance(route, dict) and "cache-prior" in route.get("choices", ())
        if searches_it:
            kept = [v for v in route["choices"] if v != "cache-prior"]
            if not kept:
                raise InputError(f"{where}): route = {route!r}: the trace has no router_scores column (record it "
                                 f"with --router-scores, or choose another route)")
            spec = {**spec, "route": {**route, "choices": kept}}
            notes = [*notes, "route cache-prior (no router_scores column)"]
        if replays_scores or searches_it:
            baselines = tuple(n for n in baselines if n not in replays_scores)
            lacks.append("no router_scores column")
    prefetch = spec.get("prefetch")
    if trace.lookahead is None and isinstance(prefetch, dict) and "lookahead" in prefetch.get("choices", ()):
        kept = [v for v in prefetch["choices"] if v != "lookahead"]
        if not kept:
            raise InputError(f"{where}): prefetch = {prefetch!r}: the trace has no lookahead column (record it with "
                             f"--lookahead P, or choose oracle / off)")
        spec = {**spec, "prefetch": {**prefetch, "choices": kept}}
        lacks.append("no lookahead column")
        notes = [*notes, "prefetch lookahead (no lookahead column)"]
    if not lacks:
        return cfg
    where += f" has {' and '.join(lacks)})"
    dropped = [n for n in cfg.baseline_policies if n not in baselines]
    log.warning("%s: left out of the search: %s%s", where, ", ".join(notes) or "nothing",
                f"; baselines {', '.join(dropped)}" if dropped else "")
    return replace(cfg, space=parse_space(spec, where), space_spec=spec, baseline_policies=baselines)


def fit_to_budget(cfg: SweepConfig, shape: Any, trace: Any = None) -> SweepConfig:
    """A space at one fixed `vram_budget_GiB` (given, or `auto` once resolved): the categorical values
    with which no policy fits the budget on `shape` (fewer than k slots whatever the other parameters,
    e.g. the low-bit copies of every expert) are removed from the space (`sweep.space.feasible_spec`),
    each named in `budget_notes`; unchanged for any other capacity. A trial that still does not fit
    (a range's upper end) is recorded `infeasible`. First `fit_to_trace` (given `trace`, the config's trace
    loaded): what a trace file cannot replay is left out."""
    from runtime.formats import costmodel

    cfg = fit_to_trace(cfg, trace)
    p = cfg.space[cfg.space.capacity_field]
    if p.name != "vram_budget_GiB" or p.kind != "fixed" or cfg.vram_budget_auto:
        return cfg
    gib, k = p.value, shape.top_k

    def fits(params: dict[str, Any]) -> bool:
        return costmodel.budget_breakdown(shape, gib, policy_of(params)).slots_per_layer >= k

    where = f"{cfg.source}: space (vram_budget_GiB = {gib:g})"
    spec, notes = feasible_spec(cfg.space_spec, fits, where)
    if not notes:
        return cfg
    return replace(cfg, space=parse_space(spec, where), space_spec=spec,
                   budget_notes=tuple(f"{n} at vram_budget_GiB = {gib:g}" for n in notes))


def load_config(path: str | Path) -> SweepConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"--config {path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    cfg = from_dict(data, str(path))
    if "name" not in (data or {}):
        cfg = replace(cfg, name=path.stem)
    return cfg


def with_overrides(cfg: SweepConfig, **kw: Any) -> SweepConfig:
    """Apply command-line overrides (None = keep; key -> value), each validated by its key's row like
    the file's, its message naming the flag (`--trials`)."""
    got = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    out: dict[str, Any] = {}
    for k, v in kw.items():
        if v is None:
            continue
        if k == "batch" and isinstance(v, str) and v.isdigit():
            v = int(v)
        out.update(SWEEP_KEY_BY_NAME[k].read(f"--{k}", v, {**got, **out}))
    return replace(cfg, **out)


if __name__ == "__main__":
    print(key_table())
