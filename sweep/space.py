"""Declarative search spaces: the `space:` mapping of a sweep YAML -> a validated Optuna space.

Every parameter name is a `runtime.policy.PolicyConfig` field (`rule`, `tau`, `beta`, `evict`,
`gamma`, `half_life`, `admission_delay`) or a cache size (`capacity_fraction`, or
`vram_budget_GiB`: GiB of device memory for the expert cache). A parameter is given as

    rule: threshold                      # a fixed value
    evict: {choices: [lfu, lru, crf]}    # a categorical choice
    tau: {low: 0.02, high: 0.5, log: true}          # a float (or int) range, optional step
    beta: {low: 0.1, high: 2.0, log: true, off: true}  # beta only: also try admission off
    beta: {choices: [off, 0.25, 0.5, 1.0]}

Conditional parameters follow the policy semantics (docs/policies.md) and need no markup:
`tau` is only drawn for rule `threshold`, `gamma` only for eviction `lfu`, `half_life` only for
`crf`, `admission_delay` only when `beta` is on. `SpaceSampler` is the define-by-run function
handed to Ray Tune's `OptunaSearch`; it returns the full policy config of a trial.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import optuna

from runtime.errors import InputError
from runtime.policy import EVICTS, RULES, PolicyConfig

log = logging.getLogger(__name__)

POLICY_FIELDS = ("rule", "tau", "beta", "evict", "gamma", "half_life", "admission_delay")
CAPACITY_FIELDS = ("capacity_fraction", "vram_budget_GiB")
PARAMETERS = POLICY_FIELDS + CAPACITY_FIELDS
OFF = "off"
BETA_SWITCH = "beta_off"  # the Optuna switch behind `beta: {low, high, off: true}`

# name -> (kind, lower bound, lower inclusive, upper bound, upper inclusive) for numeric fields
_NUMERIC: dict[str, tuple[str, float, bool, float, bool]] = {
    "tau": ("float", 0.0, True, math.inf, False),
    "beta": ("float", 0.0, False, math.inf, False),
    "gamma": ("float", 0.0, False, 1.0, True),
    "half_life": ("float", 0.0, False, math.inf, False),
    "admission_delay": ("int", 1, True, math.inf, False),
    "capacity_fraction": ("float", 0.0, False, 1.0, False),
    "vram_budget_GiB": ("float", 0.0, False, math.inf, False),
}
_CATEGORICAL = {"rule": RULES, "evict": EVICTS}
_RANGE_KEYS = {"low", "high", "log", "step", "off"}


def _active(name: str, cfg: dict[str, Any]) -> bool:
    """Whether `name` matters for a (partial) config, by the policy semantics."""
    if name == "tau":
        return cfg.get("rule") == "threshold"
    if name == "gamma":
        return cfg.get("evict") == "lfu"
    if name == "half_life":
        return cfg.get("evict") == "crf"
    if name == "admission_delay":
        return cfg.get("beta") is not None
    return True


@dataclass(frozen=True)
class Param:
    """One searched or fixed parameter."""

    name: str
    kind: str  # "fixed" | "choice" | "float" | "int"
    value: Any = None  # fixed
    choices: tuple = ()  # choice (beta: "off" stands for None)
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None
    off: bool = False  # beta range: also try off

    def values(self) -> tuple:
        """The values this parameter can take when it is fixed or categorical."""
        return (self.value,) if self.kind == "fixed" else self.choices

    def contains(self, v: Any) -> bool:
        if self.kind in ("fixed", "choice"):
            return any(_same(v, c) for c in self.values())
        if v is None:
            return self.off
        return isinstance(v, int | float) and self.low <= v <= self.high

    def suggest(self, trial: optuna.Trial) -> Any:
        if self.kind == "fixed":
            return self.value
        if self.kind == "choice":
            v = trial.suggest_categorical(self.name, [OFF if c is None else c for c in self.choices])
            return None if v == OFF else v
        if self.off and trial.suggest_categorical(BETA_SWITCH, [False, True]):
            return None
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log,
                                     step=int(self.step or 1))
        return trial.suggest_float(self.name, self.low, self.high, log=self.log, step=self.step)

    def optuna_params(self, v: Any) -> tuple[dict, dict]:
        """(params, distributions) that an Optuna trial drawing value `v` here would hold."""
        if self.kind == "fixed":
            return {}, {}
        if self.kind == "choice":
            choices = [OFF if c is None else c for c in self.choices]
            return ({self.name: OFF if v is None else _match(v, self.choices)},
                    {self.name: optuna.distributions.CategoricalDistribution(choices)})
        params, dists = {}, {}
        if self.off:
            params[BETA_SWITCH] = v is None
            dists[BETA_SWITCH] = optuna.distributions.CategoricalDistribution([False, True])
            if v is None:
                return params, dists
        if self.kind == "int":
            dists[self.name] = optuna.distributions.IntDistribution(int(self.low), int(self.high), log=self.log,
                                                                    step=int(self.step or 1))
            params[self.name] = int(v)
        else:
            dists[self.name] = optuna.distributions.FloatDistribution(self.low, self.high, log=self.log,
                                                                      step=self.step)
            params[self.name] = float(v)
        return params, dists


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b and type(a) is type(b) or (a is None and b is None)


def _match(v: Any, choices: tuple) -> Any:
    return next(c for c in choices if _same(v, c))


def _check_value(where: str, name: str, v: Any) -> Any:
    """Type- and range-check one value of parameter `name`; returns it normalised."""
    if name in _CATEGORICAL:
        if v not in _CATEGORICAL[name]:
            raise InputError(f"{where} = {v!r} is not a {name} (choose from {', '.join(_CATEGORICAL[name])})")
        return v
    if name == "beta" and (v is None or v is False or v == OFF):  # YAML reads a bare off as false
        return None
    kind, lo, lo_in, hi, hi_in = _NUMERIC[name]
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InputError(f"{where} = {v!r} must be a number" + (" or off" if name == "beta" else ""))
    if kind == "int" and int(v) != v:
        raise InputError(f"{where} = {v!r} must be an integer")
    if not math.isfinite(v) or v < lo or (v == lo and not lo_in) or v > hi or (v == hi and not hi_in):
        lo_s = f"{'[' if lo_in else '('}{lo:g}"
        hi_s = f"{hi:g}{']' if hi_in else ')'}" if math.isfinite(hi) else "inf)"
        raise InputError(f"{where} = {v!r} is out of range {lo_s}, {hi_s}")
    return int(v) if kind == "int" else float(v)


def parse_param(where: str, name: str, spec: Any) -> Param:
    if name not in PARAMETERS:
        raise InputError(f"{where}: unknown parameter {name!r} (choose from {', '.join(PARAMETERS)})")
    if not isinstance(spec, dict):
        return Param(name, "fixed", value=_check_value(where, name, spec))
    spec = {(OFF if k is False else k): v for k, v in spec.items()}  # YAML reads the key off as false
    keys = set(spec)
    if "choices" in keys:
        if keys != {"choices"}:
            raise InputError(f"{where}: give either choices or low/high, not {', '.join(sorted(keys))}")
        ch = spec["choices"]
        if not isinstance(ch, list) or not ch:
            raise InputError(f"{where}.choices = {ch!r}: empty choices (need a non-empty list)")
        vals = tuple(_check_value(f"{where}.choices[{i}]", name, c) for i, c in enumerate(ch))
        if len(set(vals)) != len(vals):
            raise InputError(f"{where}.choices = {ch!r} repeats a value")
        return Param(name, "choice", choices=vals) if len(vals) > 1 else Param(name, "fixed", value=vals[0])
    unknown = keys - _RANGE_KEYS
    if unknown:
        raise InputError(f"{where}: unknown key {sorted(unknown)[0]!r} (a parameter is a value, "
                         f"{{choices: [...]}} or {{low, high, log, step}})")
    if name in _CATEGORICAL:
        raise InputError(f"{where}: {name} is categorical; give a value or {{choices: [...]}}")
    if "low" not in keys or "high" not in keys:
        raise InputError(f"{where}: a range needs both low and high (got {', '.join(sorted(keys))})")
    low = _check_value(f"{where}.low", name, spec["low"])
    high = _check_value(f"{where}.high", name, spec["high"])
    if low is None or high is None:
        raise InputError(f"{where}: low/high must be numbers; use off: true to also try beta off")
    if not low < high:
        raise InputError(f"{where}: empty range low = {low!r} >= high = {high!r} (give a single value to fix it)")
    log_ = spec.get("log", False)
    if not isinstance(log_, bool):
        raise InputError(f"{where}.log = {log_!r} must be true or false")
    step = spec.get("step")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int | float) or not step > 0:
            raise InputError(f"{where}.step = {step!r} must be a positive number")
        if log_:
            raise InputError(f"{where}: step and log cannot be combined")
    off = spec.get("off", False)
    if not isinstance(off, bool):
        raise InputError(f"{where}.off = {off!r} must be true or false")
    if off and name != "beta":
        raise InputError(f"{where}.off: only beta can be switched off")
    kind = _NUMERIC[name][0]
    return Param(name, kind, low=low, high=high, log=log_, step=step, off=off)


@dataclass(frozen=True)
class Space:
    """A validated search space; `params` in draw order (conditions come after what they depend on)."""

    params: tuple[Param, ...]

    def __getitem__(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def capacity_field(self) -> str:
        return next(n for n in CAPACITY_FIELDS if n in self.names)

    def searched(self) -> list[str]:
        return [p.name for p in self.params if p.kind != "fixed"]

    def contains(self, cfg: dict[str, Any]) -> bool:
        """Whether a full config (policy fields + capacity) is a point of this space."""
        for p in self.params:
            if _active(p.name, cfg) and not p.contains(cfg.get(p.name)):
                return False
        return True

    def optuna_params(self, cfg: dict[str, Any]) -> tuple[dict, dict]:
        """(params, distributions) of a config inside the space, for `optuna.trial.create_trial`."""
        params, dists = {}, {}
        for p in self.params:
            if _active(p.name, cfg):
                a, b = p.optuna_params(cfg.get(p.name))
                params.update(a)
                dists.update(b)
        return params, dists

    def sample(self, trial: optuna.Trial) -> dict[str, Any]:
        """Draw a config: the policy fields (inactive ones at their defaults) and the capacity."""
        cfg: dict[str, Any] = {}
        for p in self.params:
            if _active(p.name, cfg):
                cfg[p.name] = p.suggest(trial)
        return complete(cfg)


def complete(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fill the policy fields a config leaves out with PolicyConfig defaults (tau None unless threshold)."""
    out = PolicyConfig().to_dict()
    out.update({k: v for k, v in cfg.items() if k in POLICY_FIELDS})
    if out["rule"] != "threshold":
        out["tau"] = None
    if out["beta"] is None:
        out["admission_delay"] = PolicyConfig().admission_delay
    for k in CAPACITY_FIELDS:
        if k in cfg:
            out[k] = cfg[k]
    return out


def policy_of(cfg: dict[str, Any]) -> PolicyConfig:
    return PolicyConfig(**{k: cfg[k] for k in POLICY_FIELDS if k in cfg})


class SpaceSampler:
    """The define-by-run function handed to OptunaSearch (a picklable callable)."""

    def __init__(self, space: Space):
        self.space = space

    def __call__(self, trial: optuna.Trial) -> dict[str, Any]:
        return self.space.sample(trial)


def parse_space(spec: Any, where: str = "space") -> Space:
    """Validate a `space:` mapping; every problem is a one-line InputError naming file, field and value."""
    if not isinstance(spec, dict) or not spec:
        raise InputError(f"{where}: expected a non-empty mapping of parameters (got {spec!r})")
    for name in spec:
        if name not in PARAMETERS:
            raise InputError(f"{where}: unknown parameter {name!r} (choose from {', '.join(PARAMETERS)})")
    parsed = {name: parse_param(f"{where}.{name}", name, spec[name]) for name in spec}
    caps = [n for n in CAPACITY_FIELDS if n in parsed]
    if len(caps) != 1:
        raise InputError(f"{where}: give exactly one of capacity_fraction or vram_budget_GiB (got "
                         f"{', '.join(caps) or 'neither'})")
    parsed.setdefault("rule", Param("rule", "fixed", value="fetch_all"))
    parsed.setdefault("evict", Param("evict", "fixed", value="lfu"))
    rules, evicts = parsed["rule"].values(), parsed["evict"].values()
    if "threshold" in rules and "tau" not in parsed:
        raise InputError(f"{where}: rule can be threshold but tau is not given")
    if "belady" in evicts and set(rules) != {"fetch_all"}:
        raise InputError(f"{where}.evict: belady is an offline bound for rule fetch_all only; "
                         f"rule can be {', '.join(r for r in rules if r != 'fetch_all')}")
    unused = {"tau": "threshold" not in rules, "gamma": "lfu" not in evicts, "half_life": "crf" not in evicts,
              "admission_delay": "beta" not in parsed or parsed["beta"].values() == (None,)}
    for name, never in unused.items():
        if never and name in parsed:
            log.warning("%s.%s is never used by this space (its condition never holds)", where, name)
    order = [n for n in ("rule", "tau", "evict", "gamma", "half_life", "beta", "admission_delay", caps[0])
             if n in parsed]
    space = Space(tuple(parsed[n] for n in order))
    if not space.searched():
        raise InputError(f"{where}: nothing to search (every parameter is fixed)")
    return space
