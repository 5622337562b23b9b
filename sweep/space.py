"""Declarative search spaces: the `space:` mapping of a sweep YAML -> a validated Optuna space.

Every parameter name is a row of `runtime.core.policy.PARAMS` (the one table of policy parameters: its
type, range or choices, and when it is active) or a cache size (`capacity_fraction`, or
`vram_budget_GiB`: GiB of device memory for the expert cache). Nothing here lists the policy
fields again: names, types, ranges and conditions all come from that table. A parameter is given as

    rule: threshold                      # a fixed value
    evict: {choices: [lfu, lru, crf]}    # a categorical choice
    tau: {low: 0.02, high: 0.5, log: true}          # a float (or int) range, optional step
    beta: {low: 0.1, high: 2.0, log: true, off: true}  # beta, prefetch_n, copy_buffers: also try None
    beta: {choices: [off, 0.25, 0.5, 1.0]}

Conditional parameters follow the table's activity conditions (docs/policies.md) and need no
markup: `tau` is only drawn for rule `threshold`/`band`, `gamma` only for eviction `lfu`,
`lowbit_bits` only for fallback `lowbit`, `admission_delay` only when `beta` is set, and so on.
Admission off is only ever `beta = None` (written `off` in YAML). `Space.sample` is the
define-by-run draw on an Optuna trial; it returns the full, canonical policy config of a trial.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import optuna

from runtime.core.errors import InputError
from runtime.core.policy import PARAM_BY_NAME, PARAM_NAMES, PARAMS, PolicyConfig

log = logging.getLogger(__name__)

POLICY_FIELDS = PARAM_NAMES
CAPACITY_FIELDS = ("capacity_fraction", "vram_budget_GiB")
PARAMETERS = POLICY_FIELDS + CAPACITY_FIELDS
OFF = "off"
# nullable fields whose None is a setting (admission off; k experts; an unbounded copy pool)
OFFABLE = ("beta", "prefetch_n", "copy_buffers")
_DEFAULTS = {p.name: p.default for p in PARAMS}
_CAPACITY = {"capacity_fraction": (0.0, 1.0), "vram_budget_GiB": (0.0, math.inf)}  # open intervals
_RANGE_KEYS = {"low", "high", "log", "step", "off"}


def _switch(name: str) -> str:
    return f"{name}_off"  # the Optuna switch behind `{low, high, off: true}`


def _active(name: str, cfg: dict[str, Any]) -> bool:
    """Whether `name` matters for a (partial) config, by the parameter table's activity condition."""
    prm = PARAM_BY_NAME.get(name)
    return True if prm is None else prm.is_active(SimpleNamespace(**{**_DEFAULTS, **cfg}))


def _categorical(name: str) -> bool:
    prm = PARAM_BY_NAME.get(name)
    return prm is not None and prm.choices is not None


def _kind(name: str) -> str:
    prm = PARAM_BY_NAME.get(name)
    return "int" if prm is not None and prm.type is int else "float"


@dataclass(frozen=True)
class Param:
    """One searched or fixed parameter."""

    name: str
    kind: str  # "fixed" | "choice" | "float" | "int"
    value: Any = None  # fixed
    choices: tuple = ()  # choice ("off" stands for None)
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None
    off: bool = False  # a range of an OFFABLE field: also try None

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
            return None if v == OFF and None in self.choices else v
        if self.off and trial.suggest_categorical(_switch(self.name), [False, True]):
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
            params[_switch(self.name)] = v is None
            dists[_switch(self.name)] = optuna.distributions.CategoricalDistribution([False, True])
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
    """Type- and range-check one value of parameter `name` (by the parameter table); returns it normalised."""
    if name in OFFABLE and (v is None or v is False or v == OFF):  # YAML reads a bare off as false
        return None
    if name in _CAPACITY:
        lo, hi = _CAPACITY[name]
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise InputError(f"{where} = {v!r} must be a number")
        if not (math.isfinite(v) and lo < v < hi):
            raise InputError(f"{where} = {v!r} is out of range ({lo:g}, {hi:g})")
        return float(v)
    prm = PARAM_BY_NAME[name]
    if v is False and prm.choices and OFF in prm.choices:  # YAML reads prefetch: off as false
        v = OFF
    if v is None:
        raise InputError(f"{where} = None: give a value ({prm.range_text()})")
    try:
        return prm.check(v, "")
    except InputError as exc:  # the table names the field and its flag; the space names the file and key
        msg = str(exc)
        raise InputError(f"{where} = {msg[msg.index(' = ') + 3:] if ' = ' in msg else msg}") from None


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
    if _categorical(name):
        raise InputError(f"{where}: {name} is categorical; give a value or {{choices: [...]}}")
    if "low" not in keys or "high" not in keys:
        raise InputError(f"{where}: a range needs both low and high (got {', '.join(sorted(keys))})")
    low = _check_value(f"{where}.low", name, spec["low"])
    high = _check_value(f"{where}.high", name, spec["high"])
    if low is None or high is None:
        raise InputError(f"{where}: low/high must be numbers; use off: true to also try {name} unset")
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
    if off and name not in OFFABLE:
        raise InputError(f"{where}.off: only {' and '.join(OFFABLE)} can be switched off")
    kind = _kind(name)
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
        # a field the space leaves out is fixed at its default
        return all(cfg.get(prm.name) == prm.default for prm in PARAMS
                   if prm.name not in self.names and _active(prm.name, cfg))

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
    """The canonical full config: every policy field (aliases normalised, inactive fields at their
    defaults, so one policy has one key) plus the capacity field the config gives."""
    pol = PolicyConfig(**{k: cfg[k] for k in POLICY_FIELDS if k in cfg})
    out = {p.name: getattr(pol, p.name) if p.is_active(pol) else p.default for p in PARAMS}
    for k in CAPACITY_FIELDS:
        if k in cfg:
            out[k] = cfg[k]
    return out


def policy_of(cfg: dict[str, Any]) -> PolicyConfig:
    return PolicyConfig(**{k: cfg[k] for k in POLICY_FIELDS if k in cfg})


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
    for rule, needs in (("threshold", "tau"), ("band", "tau"), ("band", "tau_high")):
        if rule in rules and needs not in parsed:
            raise InputError(f"{where}: rule can be {rule} but {needs} is not given")
    if "belady" in evicts and set(rules) != {"fetch_all"}:
        raise InputError(f"{where}.evict: belady is an offline bound for rule fetch_all only; "
                         f"rule can be {', '.join(r for r in rules if r != 'fetch_all')}")
    # the values each field's activity condition can see: categorical values, and set/unset for the rest
    seen = [{}]
    for prm in PARAMS:
        p = parsed.get(prm.name)
        if p is None:
            vals: tuple = (prm.default,)
        elif p.kind in ("fixed", "choice"):
            vals = p.values()
        else:
            vals = (p.low,) + ((None,) if p.off else ())
        seen = [{**c, prm.name: v} for c in seen for v in vals] if prm.choices or prm.nullable else seen
    for name in parsed:
        if name in PARAM_BY_NAME and not any(_active(name, c) for c in seen):
            log.warning("%s.%s is never used by this space (its condition, %s, never holds)", where, name,
                        PARAM_BY_NAME[name].active)
    order = [n for n in PARAMETERS if n in parsed]
    space = Space(tuple(parsed[n] for n in order))
    if not space.searched():
        raise InputError(f"{where}: nothing to search (every parameter is fixed)")
    return space


def feasible_spec(spec: dict[str, Any], fits: Callable[[dict[str, Any]], bool], where: str = "space",
                  limit: int = 50_000) -> tuple[dict[str, Any], list[str]]:
    """The `space:` mapping without the categorical values that no point of the space with that value
    `fits` (at a fixed device-memory budget: leaves at least k slots), and without the parameters
    that are then never active; returns (mapping, one note per removed value or parameter).

    Enumerated over every combination of the categorical values, each range at its least demanding
    point (`low`, and unset where `off: true`): staging grows with `admission_delay` and `prefetch_n`,
    so a value infeasible there is infeasible everywhere. A point of a range that does not fit is
    left to the trial (the sweep records it `infeasible`). No point fitting at all is an InputError;
    more than `limit` combinations: the mapping is returned as it is (a warning)."""
    space = parse_space(spec, where)
    axes = [(p.name, p.values() if p.kind in ("fixed", "choice") else (p.low,) + ((None,) if p.off else ()))
            for p in space.params if p.name not in CAPACITY_FIELDS]
    if math.prod(len(v) for _, v in axes) > limit:
        log.warning("%s: more than %d combinations; values that never fit the budget are left to the trials",
                    where, limit)
        return spec, []
    used: set[tuple[str, Any]] = set()  # (name, value) active in a point that fits
    active: set[str] = set()  # names active in some point (fitting or not)
    ints = [p.name for p in space.params if p.kind == "int" and p.name not in CAPACITY_FIELDS]
    fitting: dict[str, list[dict[str, Any]]] = {n: [] for n in ints}  # points that fit with the int range active
    for combo in itertools.product(*(v for _, v in axes)):
        cfg = dict(zip((n for n, _ in axes), combo, strict=True))
        on = [n for n in cfg if _active(n, cfg)]
        active.update(on)
        try:
            ok = fits(complete({n: cfg[n] for n in on}))
        except InputError:  # not a valid policy (e.g. belady with a rule that substitutes)
            continue
        if ok:
            used.update((n, _key(cfg[n])) for n in on)
            for n in ints:
                if n in on:
                    fitting[n].append({m: cfg[m] for m in on})
    # an integer range's upper end: the largest value some fitting point still fits with (staging grows with it)
    top = {}
    for n in ints:
        p = space[n]
        for v in range(int(p.high), int(p.low), -1):
            if any(_fits(fits, {**c, n: v}) for c in fitting[n]):
                break
        else:
            v = int(p.low)
        if fitting[n] and v < p.high:
            top[n] = v
    if not used:
        raise InputError(f"{where}: no policy of the space fits the budget (every one leaves fewer than k slots)")
    out, notes = {}, []
    for name, given in spec.items():
        p = space[name]
        if name in CAPACITY_FIELDS or name not in active:
            out[name] = given
        elif not any(n == name for n, _ in used):
            notes.append(f"{name}: never used, as no policy that uses it fits the budget")
        elif name in top:
            notes.append(f"{name} above {top[name]}: no policy with it fits the budget")
            out[name] = top[name] if top[name] == int(p.low) else {**given, "high": top[name]}
        elif p.kind == "choice":
            keep = [v for v in p.choices if (name, _key(v)) in used]
            notes += [f"{name} = {OFF if v is None else v}: no policy with it fits the budget"
                      for v in p.choices if (name, _key(v)) not in used]
            vals = [OFF if v is None else v for v in keep]
            out[name] = vals[0] if len(vals) == 1 else {"choices": vals}
        else:
            out[name] = given
    for note in notes:
        log.warning("%s.%s", where, note)
    return out, notes


def _fits(fits: Callable[[dict[str, Any]], bool], cfg: dict[str, Any]) -> bool:
    try:
        return fits(complete(cfg))
    except InputError:
        return False


def _key(v: Any) -> Any:
    return ("float", float(v)) if isinstance(v, int | float) and not isinstance(v, bool) else v


def without_gate_weights(spec: dict[str, Any], where: str = "space", limit: int = 50_000
                         ) -> tuple[dict[str, Any], list[str]]:
    """The `space:` mapping for a trace without gate weights (imported routing ids, docs/traces.md): every
    categorical value and range with which each policy of the space reads gate weights (runtime/core/policy.py
    `GATE_WEIGHT_READERS`: the threshold / band rules and tau, beta, cache-aware routing, a weight-accounting
    fallback) left out, `beta` switched off; where a rule can still leave a miss unfetched, `fallback` fixed to
    host. Returns (mapping, one note per value or parameter left out); enumerated like `feasible_spec` (every
    categorical value, each range at its low end and unset where `off: true`). Every policy of the space reading
    gate weights is an InputError."""
    from runtime.core.policy import gate_weight_readers

    memo: dict[tuple, bool] = {}
    active: set[str] = set()  # parameters active in some point (one never active is left as given)

    def reads(cfg: dict[str, Any]) -> bool:
        key = tuple(sorted(cfg.items(), key=lambda kv: kv[0]))
        if key not in memo:
            try:
                memo[key] = bool(gate_weight_readers(policy_of(complete(cfg))))
            except InputError:  # not a valid policy: not one a trial can draw
                memo[key] = True
        return memo[key]

    def points(spec: dict[str, Any]) -> tuple[Space, set, int]:
        space = parse_space(spec, where)
        axes = [(p.name, p.values() if p.kind in ("fixed", "choice") else (p.low,) + ((None,) if p.off else ()))
                for p in space.params if p.name not in CAPACITY_FIELDS]

        def draws(i: int, on: dict[str, Any]):  # noqa: ANN202 - what trials draw: in draw order, each parameter
            if i == len(axes):  # drawn only when active given those before it (Space.sample)
                yield dict(on)
                return
            name, values = axes[i]
            if not _active(name, on):
                yield from draws(i + 1, on)
                return
            for v in values:
                yield from draws(i + 1, {**on, name: v})

        used, bad = set(), 0  # (name, value) in a weight-free point; points that read weights
        for count, on in enumerate(draws(0, {})):
            if count == limit:
                raise InputError(f"{where}: more than {limit} policies to check against a trace without gate "
                                 f"weights; fix some parameters")
            active.update(on)
            if reads(on):
                bad += 1
            else:
                used.update((n, _key(v)) for n, v in on.items())
        if not used:
            raise InputError(f"{where}: every policy of the space reads gate weights (rule threshold / band, beta, "
                             f"route, a substitute / drop / lowbit fallback), which the trace lacks")
        return space, used, bad

    notes: list[str] = []
    space, used, bad = points(spec)
    out: dict[str, Any] = {}
    for name, given in spec.items():
        p = space[name]
        if name in CAPACITY_FIELDS or name not in active:
            out[name] = given
        elif p.kind in ("fixed", "choice"):
            keep = [OFF if v is None else v for v in p.values() if (name, _key(v)) in used]
            notes += [f"{name} = {OFF if v is None else v}" for v in p.values() if (name, _key(v)) not in used]
            if keep:
                out[name] = keep[0] if len(keep) == 1 else {"choices": keep}
        elif (name, _key(p.low)) in used:
            out[name] = given
        elif p.off and (name, None) in used:
            out[name] = OFF
            notes.append(f"{name} other than off")
        else:
            notes.append(name)
    space, used, bad = points(out)
    if bad and "fallback" in space.names and "host" in space["fallback"].values():
        notes += [f"fallback = {v}" for v in space["fallback"].values() if v != "host"]
        out["fallback"] = "host"  # a miss a rule leaves unfetched is computed on the host: no weight read
        for name in ("lowbit_bits", "lowbit_group", "drop_renorm"):  # active only with the other fallbacks
            if out.pop(name, None) is not None:
                notes.append(name)
        space, used, bad = points(out)
    if bad:  # no reduction to the parameters above removes them: the trials refuse these points
        log.warning("%s: %d combinations still read gate weights; their trials will be refused", where, bad)
    return out, notes
