"""Sweep configuration: a YAML file (search_spaces/*.yaml) -> a validated, frozen `SweepConfig`.

Top-level keys (all optional except `space`):

    name: demo                # results go to results/<name>/ unless --out
    model: demo               # tiny model size (demo | test) or any local Hugging Face checkpoint folder;
                              #   its traces are recorded once and cached by a checkpoint digest (sweep/data.py)
    model_resource: null      # NAME: the model's files are on the Ray nodes offering `model:NAME` (paths of
                              #   model/text/calib_text are paths there); null: on the driver's node
    max_memory_GiB: auto      # host RAM the model's weights may use in recording and emulation (auto: the
                              #   node's available memory less a margin); above it passes stream layer by layer
    dtype: auto               # auto (the checkpoint's own) | fp32 | bf16 | fp16, for recording and emulation
    text: null                # evaluated text (default: the model's eval.txt)
    calib_text: null          # warm-start calibration text (default: the model's calib.txt; without one,
                              #   the held-out last 20% of the evaluated tokens, runtime/core/spec.py)
    trace: null               # a router trace file instead of a model, or {synthetic: {...}}
    calib_trace: null         # warm-start calibration trace (default: the model's calib.txt trace)
    model_shape: null         # cost-model shape preset/YAML; null = from the trace (runtime.backends.simulate)
    max_tokens: null          # tokens of each text recorded and emulated (null: the whole text)
    hosts: [rtx3090, rtx4090] # host names, or {name, profile: preset | preset:NAME | calibrate | FILE}
    trials: 40                # simulator trials per host, after the baselines
    sampler: tpe              # tpe | nsga2
    population: 16            # nsga2 population size
    seed: 0
    objectives: [time_per_token_s, mass_per_token]   # + device_memory_GiB
    batch: auto               # simulator evaluations per Ray task (auto: about task_seconds each)
    task_seconds: 2.0
    max_failures: 2           # retries of a failing trial before it is recorded failed
    baselines: {policies: [fetch-every-miss, ...], capacity_fraction: 0.25}
    emulation: {rungs: [2048], eta: 3, max_full: 8, engine: true, cpus: auto}   # the ladder (sweep/ladder.py);
                              #   false: off; cpus: Ray CPUs (= torch threads) of each recording / emulation task,
                              #   auto: every CPU of the smallest node that holds the model
    ppl_budgets_pct: [0.5, 1, 2]  # the answer: per host and budget, the fastest policy within it
    space: {...}              # sweep/space.py; `vram_budget_GiB: auto` compares every policy at one
                              #   device-memory budget: what fetch-every-miss needs at 25% residency
                              #   (`resolve_vram_budget`, once the model's shape is known)

Unknown keys, bad types and values are one-line `InputError`s naming the file and the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from runtime.core.errors import InputError
from runtime.core.policy import PRESETS
from runtime.core.spec import RUN_FIELD_BY_NAME as RUN
from sweep.space import Space, feasible_spec, parse_space, policy_of

OBJECTIVES = ("time_per_token_s", "mass_per_token", "device_memory_GiB")
SAMPLERS = ("tpe", "nsga2")
SYNTHETIC_KEYS = {"num_tokens", "num_layers", "num_experts", "top_k", "ranking_depth", "seed", "skew",
                  "num_topics", "topic_locality", "switch_prob", "seq_len", "weight_norm", "temperature",
                  "noise", "sample", "calib_sample"}


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


@dataclass(frozen=True)
class SweepConfig:
    space: Space
    name: str = "sweep"
    model: str | None = None
    model_resource: str | None = None  # the model's files are on nodes offering `model:<this>`
    max_memory_GiB: float | str = RUN["max_memory_GiB"].default  # RunSpec's, for every recording and emulation
    dtype: str = RUN["dtype"].default  # RunSpec's, for every recording and emulation
    text: str | None = None
    calib_text: str | None = None
    trace: str | dict | None = None
    calib_trace: str | None = None
    model_shape: str | None = None
    max_tokens: int | None = None
    hosts: tuple[HostSpec, ...] = (HostSpec("rtx3090"), HostSpec("rtx4090"))
    trials: int = 40
    sampler: str = "tpe"
    population: int = 16
    seed: int = 0
    objectives: tuple[str, ...] = ("time_per_token_s", "mass_per_token")
    batch: int | str = "auto"
    task_seconds: float = 2.0
    max_failures: int = 2
    baseline_policies: tuple[str, ...] = tuple(PRESETS)
    baseline_capacity_fraction: float | None = None
    emulation: Emulation = field(default_factory=Emulation)
    ppl_budgets_pct: tuple[float, ...] = (0.5, 1.0, 2.0)
    source: str = "<config>"
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


def _model_keys(source: str, data: dict[str, Any]) -> dict[str, Any]:
    """model_resource, max_memory_GiB and dtype, validated (each a one-line InputError naming the key)."""
    kw: dict[str, Any] = {}
    res = data.get("model_resource")
    if res is not None:
        if not isinstance(res, str) or not res or any(c in res for c in ' :/,"{}'):
            raise InputError(f"{source}: model_resource = {res!r}: use letters, digits, ., - and _ "
                             f"(the nodes holding the model offer the Ray resource model:NAME)")
        kw["model_resource"] = res
    for key in ("max_memory_GiB", "dtype"):  # RunSpec fields: checked by the run-field table's row
        if key in data:
            kw[key] = RUN[key].check(data[key], f"{source}: {key}")
    return kw


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
        if not name or any(c in name for c in ' :/,"{}'):
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


_KEYS = {"name", "model", "model_resource", "max_memory_GiB", "dtype", "text", "calib_text", "trace", "calib_trace",
         "model_shape", "max_tokens", "hosts", "trials", "sampler",
         "population", "seed", "objectives", "batch", "task_seconds", "max_failures", "baselines",
         "emulation", "ppl_budgets_pct", "space"}


def from_dict(data: Any, source: str = "<config>") -> SweepConfig:
    """Validate a parsed sweep YAML document."""
    if not isinstance(data, dict):
        raise InputError(f"{source}: expected a mapping at the top level (got {type(data).__name__})")
    unknown = set(data) - _KEYS
    if unknown:
        raise InputError(f"{source}: unknown key {sorted(unknown)[0]!r} (choose from {', '.join(sorted(_KEYS))})")
    if "space" not in data:
        raise InputError(f"{source}: space is required")
    spec = data["space"]
    kw: dict[str, Any] = {"source": source}
    if isinstance(spec, dict) and spec.get("vram_budget_GiB") == "auto":
        kw["vram_budget_auto"] = True
        spec = {**spec, "vram_budget_GiB": 1.0}  # a placeholder until the model's shape is known
    kw["space"] = parse_space(spec, f"{source}: space")
    kw["space_spec"] = spec
    for key in ("model", "text", "calib_text", "model_shape"):  # RunSpec fields: the run-field table's check
        if data.get(key) is not None:
            kw[key] = RUN[key].check(data[key], f"{source}: {key}")
    for key in ("name", "calib_trace"):
        if data.get(key) is not None:
            if not isinstance(data[key], str) or not data[key]:
                raise InputError(f"{source}: {key} = {data[key]!r} must be a non-empty string")
            kw[key] = data[key]
    if kw.get("calib_text") and kw.get("text") and Path(kw["calib_text"]).resolve() == Path(kw["text"]).resolve():
        raise InputError(f"{source}: calib_text = {kw['calib_text']} is the evaluated text (a warm start must not see "
                         f"the evaluated data; leave calib_text out for a held-out part)")
    if "name" in kw and any(c in kw["name"] for c in ' /\\:"'):
        raise InputError(f"{source}: name = {kw['name']!r}: use letters, digits, ., - and _")
    kw.update(_model_keys(source, data))
    if "trace" in data:
        kw["trace"] = _trace(f"{source}: trace", data["trace"])
    if "hosts" in data:
        kw["hosts"] = _hosts(f"{source}: hosts", data["hosts"])
    if data.get("max_tokens") is not None:
        kw["max_tokens"] = RUN["max_tokens"].check(data["max_tokens"], f"{source}: max_tokens")
    for key, lo in (("trials", 0), ("population", 2), ("seed", 0), ("max_failures", 0)):
        if key in data:
            kw[key] = _int(f"{source}: {key}", data[key], lo)
    if "sampler" in data:
        if data["sampler"] not in SAMPLERS:
            raise InputError(f"{source}: sampler = {data['sampler']!r} (choose from {', '.join(SAMPLERS)})")
        kw["sampler"] = data["sampler"]
    if "objectives" in data:
        obj = data["objectives"]
        if not isinstance(obj, list) or any(o not in OBJECTIVES for o in obj) or obj[:2] != list(OBJECTIVES[:2]):
            raise InputError(f"{source}: objectives = {obj!r} must be [time_per_token_s, mass_per_token] "
                             f"optionally followed by device_memory_GiB")
        kw["objectives"] = tuple(obj)
    if "batch" in data:
        b = data["batch"]
        kw["batch"] = b if b == "auto" else _int(f"{source}: batch", b, 1)
    if "task_seconds" in data:
        ts = data["task_seconds"]
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not (0 < ts < math.inf):
            raise InputError(f"{source}: task_seconds = {ts!r} must be a positive number")
        kw["task_seconds"] = float(ts)
    if "baselines" in data:
        b = data["baselines"] or {}
        if not isinstance(b, dict) or set(b) - {"policies", "capacity_fraction"}:
            raise InputError(f"{source}: baselines = {b!r}: expected {{policies: [...], capacity_fraction: F}}")
        pols = b.get("policies", list(PRESETS))
        if not isinstance(pols, list) or any(p not in PRESETS for p in pols):
            raise InputError(f"{source}: baselines.policies = {pols!r} (choose from {', '.join(PRESETS)})")
        kw["baseline_policies"] = tuple(pols)
        cf = b.get("capacity_fraction")
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, int | float) or not 0 < cf < 1):
            raise InputError(f"{source}: baselines.capacity_fraction = {cf!r} must be in (0, 1)")
        kw["baseline_capacity_fraction"] = cf
    if "emulation" in data:
        kw["emulation"] = _emulation(f"{source}: emulation", data["emulation"], kw.get("max_tokens"))
    if "ppl_budgets_pct" in data:
        b = data["ppl_budgets_pct"]
        if (not isinstance(b, list) or not b or any(isinstance(x, bool) or not isinstance(x, int | float)
                                                     or not 0 < x < math.inf for x in b)):
            raise InputError(f"{source}: ppl_budgets_pct = {b!r} must be a non-empty list of positive numbers")
        kw["ppl_budgets_pct"] = tuple(sorted(float(x) for x in b))
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


def fit_to_budget(cfg: SweepConfig, shape: Any) -> SweepConfig:
    """A space at one fixed `vram_budget_GiB` (given, or `auto` once resolved): the categorical values
    with which no policy fits the budget on `shape` (fewer than k slots whatever the other parameters,
    e.g. the low-bit copies of every expert) are removed from the space (`sweep.space.feasible_spec`),
    each named in `budget_notes`; unchanged for any other capacity. A trial that still does not fit
    (a range's upper end) is recorded `infeasible`."""
    from runtime.formats import costmodel

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
    """Apply command-line overrides (None = keep), validated like the file."""
    kw = {k: v for k, v in kw.items() if v is not None}
    if "hosts" in kw:
        kw["hosts"] = _hosts("--hosts", kw["hosts"])
    if "trials" in kw:
        kw["trials"] = _int("--trials", kw["trials"], 0)
    if "batch" in kw and kw["batch"] != "auto":
        kw["batch"] = _int("--batch", int(kw["batch"]) if str(kw["batch"]).isdigit() else kw["batch"], 1)
    return replace(cfg, **kw)
