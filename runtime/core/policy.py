"""Miss-policy configuration: the one table of policy parameters, and the frozen dataclass built on it.

`PolicyConfig`'s fields *are* the parameter table: each field carries its type, range or choices,
when it is active, its default and its CLI flag in `dataclasses.field(metadata=...)`. `PARAMS`
reads them back, and everything else is derived from it: validation (in `__post_init__`, so a
config is valid once built), the CLI flags of every backend (`add_policy_flags` /
`policy_from_flags`), the sweep's space validation, and the MLflow params (`mlflow_params`).
Field names are the search-space names. The semantics live in docs/policies.md; the compiled
kernel that carries them out is the package runtime/core/kernel/.

One encoding each: admission off is `beta = None`; "no threshold" is `tau = None`; the `cpu` rule
is an alias, normalised at construction to `rule = substitute_all` (fetch nothing) with
`fallback = host`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from runtime.core.errors import InputError

RULES = ("fetch_all", "threshold", "first_choice", "substitute_all", "band")
EVICTS = ("lfu", "lru", "crf", "belady", "lfuda", "s3fifo")  # codes are positions: append only
CAPACITY_ALLOCS = ("uniform", "calibrated")
FALLBACKS = ("substitute", "drop", "host", "lowbit")
PREFETCHES = ("off", "lookahead", "oracle")
ROUTES = ("off", "cache-prior", "cache-route")  # cache-aware routing (docs/policies.md, Additions (4)); codes are positions
# llama.cpp's two ways of holding experts (docs/policies.md, Additions (5)): its expert cache (one pool and one LRU
# shared by every MoE layer) and its static layer split -ncmoe N
POOLS = ("per_layer", "shared")
LAYER_SPLITS = ("none", "ncmoe")
RULE_CODE = {r: i for i, r in enumerate(RULES)}
EVICT_CODE = {e: i for i, e in enumerate(EVICTS)}
FALLBACK_CODE = {f: i for i, f in enumerate(FALLBACKS)}
PREFETCH_CODE = {p: i for i, p in enumerate(PREFETCHES)}
ROUTE_CODE = {r: i for i, r in enumerate(ROUTES)}
# how the model normalises its gate weights (a trace's / an adapter's weight_norm), as the kernel reads it for
# Cache-Prior's recomputed weights: the record's `route_norm` (set by PolicyCache, not a policy field)
WEIGHT_NORMS = ("softmax_topk", "softmax_all", "sigmoid_topk")
WEIGHT_NORM_CODE = {n: i for i, n in enumerate(WEIGHT_NORMS)}
RULE_ALIASES = {"cpu": ("substitute_all", "host")}  # alias -> (rule, fallback)


@dataclass(frozen=True)
class Param:
    """One row of the parameter table (read from PolicyConfig's field metadata)."""

    name: str
    type: type
    default: Any
    flag: str
    help: str
    choices: tuple | None = None
    low: float | None = None  # inclusive unless low_open
    high: float | None = None  # inclusive unless high_open
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False  # None is a value (tau: unused, beta: admission off, prefetch_n: k)
    active: str = "always"  # when the parameter matters, as text (docs, space validation)
    # how the compiled kernel reads it: (field of the kernel's policy record, encoder of the PolicyConfig);
    # None for parameters the kernel never reads (runtime/core/kernel/run_layer.py reads the record as
    # `pol.<field>`)
    kernel: tuple[str, Callable[[Any], float]] | None = None

    def is_active(self, p: PolicyConfig) -> bool:
        return _ACTIVE[self.active](p)

    def range_text(self) -> str:
        if self.choices:
            return " | ".join(map(str, self.choices))
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        return f"{'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"

    def check(self, value: Any, where: str) -> Any:
        """The value converted to this parameter's type, or an InputError naming flag, field and value."""

        def bad(why: str) -> InputError:
            return InputError(f"{where}{self.flag} = {value!r} {why} (policy field {self.name})")

        if value is None:
            if self.nullable:
                return None
            raise bad(f"needs a value ({self.range_text()})")
        if self.type is bool:
            if not isinstance(value, bool | np.bool_):
                raise bad("must be true or false")
            return bool(value)
        if self.type is str:
            if value not in self.choices:
                raise bad(f"is unknown (choose from {', '.join(self.choices)})")
            return value
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise bad("must be a number")
        if self.type is int:
            if float(value) != int(value):
                raise bad("must be an integer")
            value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise bad("must be finite")
        if self.choices is not None and value not in self.choices:
            raise bad(f"must be one of {', '.join(map(str, self.choices))}")
        bad_lo = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        bad_hi = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if bad_lo or bad_hi:
            raise bad(f"must be in {self.range_text()}")
        return value


_ACTIVE = {
    "always": lambda p: True,
    "rule in (threshold, band)": lambda p: p.rule in ("threshold", "band"),
    "rule = band": lambda p: p.rule == "band",
    "evict = lfu": lambda p: p.evict == "lfu",
    "evict = crf": lambda p: p.evict == "crf",
    "evict = s3fifo": lambda p: p.evict == "s3fifo",
    "beta set": lambda p: p.beta is not None,
    "fallback = lowbit": lambda p: p.fallback == "lowbit",
    "prefetch != off": lambda p: p.prefetch != "off",
    # routing composes with rule fetch_all (no fetch cap) and every eviction key but belady (docs/policies.md,
    # Additions (4)); its parameters matter only when it is on
    "rule = fetch_all, no fetch cap, evict != belady": lambda p: (p.rule == "fetch_all" and p.fetch_cap is None
                                                                 and p.evict != "belady"),
    "route = cache-prior": lambda p: p.route == "cache-prior",
    "route != off": lambda p: p.route != "off",
    "route = cache-route": lambda p: p.route == "cache-route",
    "beta set or prefetch != off": lambda p: p.beta is not None or p.prefetch != "off",
    # llama.cpp's expert cache and layer split (docs/policies.md, Additions (5)): only with the fields they fix
    "llama.cpp's cache: fetch_all + lru, layer_split none, nothing else": lambda p: (
        p.evict == "lru" and p.layer_split == "none" and _llamacpp_conflict(p) is None),
    "llama.cpp's split: fetch_all, nothing else": lambda p: _llamacpp_conflict(p) is None,
    # a drop needs a non-fetched miss (the rule, or a fetch cap) whose fallback is substitute or drop
    "drops possible": lambda p: p.fallback in ("substitute", "drop") and not (p.rule == "fetch_all"
                                                                              and p.fetch_cap is None),
}


def _p(default, flag: str, help: str, **kw) -> Any:
    return field(default=default, metadata={"param": dict(flag=flag, help=help, **kw)})


def _llamacpp_conflict(p: PolicyConfig) -> tuple[str, Any, Any] | None:
    """The first field that llama.cpp's expert cache and layer split fix, set otherwise: (flag, value, needed)."""
    for name, needed in (("rule", "fetch_all"), ("beta", None), ("prefetch", "off"), ("fetch_cap", None),
                         ("pin_fraction", 0.0), ("capacity_alloc", "uniform"), ("route", "off")):
        if getattr(p, name) != needed:
            return PARAM_BY_NAME[name].flag, getattr(p, name), needed
    return None


@dataclass(frozen=True)
class PolicyConfig:
    """A miss policy (docs/policies.md). Validated when built; `cpu` normalised to substitute_all + host."""

    rule: str = _p("fetch_all", "--rule", "which misses are fetched", choices=RULES + tuple(RULE_ALIASES),
                   kernel=("rule", lambda p: RULE_CODE[p.rule]))
    tau: float | None = _p(None, "--tau", "fetch a miss whose gate weight >= tau (band: the band's low edge)",
                           low=0.0, nullable=True, active="rule in (threshold, band)",
                           kernel=("tau", lambda p: p.tau_value))
    tau_high: float | None = _p(None, "--tau-high", "band: non-first-choice misses with tau <= w < tau_high are "
                                "not fetched (a controlled mode for Experiment B)", low=0.0, nullable=True,
                                active="rule = band",
                                kernel=("tau_high", lambda p: float(p.tau_high) if p.rule == "band" else math.inf))
    fallback: str = _p("substitute", "--fallback", "what a non-fetched miss becomes", choices=FALLBACKS,
                       kernel=("fallback", lambda p: FALLBACK_CODE[p.fallback]))
    fetch_cap: int | None = _p(None, "--fetch-cap", "at most this many synchronous fetches per token and layer, "
                               "in rank order; the other fetched misses get the fallback (unset: no cap)",
                               low=1, nullable=True,
                               kernel=("fetch_cap", lambda p: -1 if p.fetch_cap is None else p.fetch_cap))
    lowbit_bits: int = _p(4, "--lowbit-bits", "bits of the low-precision copies", choices=(8, 4, 3, 2),
                          active="fallback = lowbit")
    lowbit_group: int = _p(64, "--lowbit-group", "weights per quantisation group", low=1,
                           active="fallback = lowbit")
    evict: str = _p("lfu", "--evict", "eviction key", choices=EVICTS, kernel=("evict", lambda p: EVICT_CODE[p.evict]))
    gamma: float = _p(1.0, "--gamma", "LFU aging (1 = plain LFU)", low=0.0, high=1.0, low_open=True,
                      active="evict = lfu", kernel=("gamma", lambda p: p.gamma))
    half_life: float = _p(32.0, "--half-life", "CRF half-life in tokens", low=0.0, low_open=True,
                          active="evict = crf", kernel=("decay", lambda p: 2.0 ** (-1.0 / p.half_life)))
    s3_small: float = _p(0.1, "--s3-small", "S3-FIFO: the small FIFO's target share of a layer's evictable slots "
                         "(at least 1 slot)", low=0.0, high=1.0, low_open=True, high_open=True,
                         active="evict = s3fifo")
    beta: float | None = _p(None, "--beta", "background admission threshold (unset: admission off)",
                            low=0.0, low_open=True, nullable=True,
                            kernel=("beta", lambda p: -1.0 if p.beta is None else p.beta))
    admission_delay: int = _p(1, "--delay", "admission delay d in tokens", low=1, active="beta set",
                              kernel=("delay", lambda p: p.admission_delay))
    prefetch: str = _p("off", "--prefetch", "prefetch of the next layer's experts", choices=PREFETCHES)
    prefetch_n: int | None = _p(None, "--prefetch-n", "experts prefetched per token-layer (unset: k)", low=1,
                                nullable=True, active="prefetch != off")
    copy_buffers: int | None = _p(None, "--copy-buffers", "copy buffers per MoE layer for the background copies "
                                  "(admissions, prefetches); a copy with no free buffer waits (admission) or is "
                                  "not made (prefetch); the budget charges L * copy_buffers buffers (unset: "
                                  "unbounded, charged the worst case)", low=1, nullable=True,
                                  active="beta set or prefetch != off",
                                  kernel=("copy_buffers", lambda p: -1 if p.copy_buffers is None else p.copy_buffers))
    pin_fraction: float = _p(0.0, "--pin-fraction", "pin the first floor(pin_fraction * C_l) experts of each layer's "
                             "warm start (count order): never evicted; needs C_l - P_l >= k and a warm start",
                             low=0.0, high=1.0, high_open=True)
    capacity_alloc: str = _p("uniform", "--capacity-alloc", "how the run's total slots are spread over the layers "
                             "(calibrated: to the layers whose next expert covers the most calibration calls)",
                             choices=CAPACITY_ALLOCS)
    drop_renorm: bool = _p(False, "--drop-renorm", "scale the computed experts' gate weights so a dropped miss's "
                           "weight is shared out (outputs only: no decision or counter changes)",
                           choices=(False, True), active="drops possible")
    # cache-aware routing (docs/policies.md, "Additions (4)"): a stage before the hits that changes the selection
    route: str = _p("off", "--route", "cache-aware routing: cache-prior (top-k of z + lambda*D*resident) or "
                    "cache-route (true top-J, the rest from residents inside the true top-M); needs rule fetch_all",
                    choices=ROUTES, active="rule = fetch_all, no fetch cap, evict != belady",
                    kernel=("route", lambda p: ROUTE_CODE[p.route]))
    route_lambda: float = _p(0.5, "--route-lambda", "cache-prior: the bias lambda, in units of D (the running mean "
                             "of the per-token logit range); 0 = the model", low=0.0, active="route = cache-prior",
                             kernel=("route_lambda", lambda p: p.route_lambda))
    route_keep: int = _p(1, "--route-keep", "J: the true top-J experts are always kept (fetched on a miss); "
                         "cache-prior's max-rank option (0: none)", low=0, active="route != off",
                         kernel=("route_keep", lambda p: p.route_keep))
    route_window: int = _p(16, "--route-window", "cache-route: M, replacements only from the true top-M "
                           "(clamped to E; needs M >= k and a ranking that deep)", low=1, active="route = cache-route",
                           kernel=("route_window", lambda p: p.route_window))
    route_alpha: float = _p(1.0, "--route-alpha", "cache-route: a replacement gets alpha * the displaced expert's "
                            "weight, then the token's weights are scaled back to the model's sum (1: no scaling)",
                            low=0.0, low_open=True, active="route = cache-route",
                            kernel=("route_alpha", lambda p: p.route_alpha))

    # llama.cpp's two ways of holding experts (docs/policies.md, Additions (5)): capacity structures, not miss rules
    pool: str = _p("per_layer", "--pool", "shared: llama.cpp's expert cache (--moe-cache-mib), one pool of sum C_l "
                   "slots and one LRU over (layer, expert) for every MoE layer, every miss fetched; needs rule "
                   "fetch_all and evict lru", choices=POOLS,
                   active="llama.cpp's cache: fetch_all + lru, layer_split none, nothing else")
    layer_split: str = _p("none", "--layer-split", "ncmoe: llama.cpp's -ncmoe N, the first N MoE layers compute "
                          "every expert on the host, the others hold all E; N the smallest that fits the memory of "
                          "the run's slots; needs rule fetch_all", choices=LAYER_SPLITS,
                          active="llama.cpp's split: fetch_all, nothing else")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "") -> PolicyConfig:
        """Raise InputError (naming the field, its flag and the value) unless the policy is well formed."""
        where = f"{where}: " if where else ""
        for prm in PARAMS:
            object.__setattr__(self, prm.name, prm.check(getattr(self, prm.name), where))
        if self.rule in RULE_ALIASES:
            rule, fb = RULE_ALIASES[self.rule]
            if self.fallback not in ("substitute", fb):
                raise InputError(f"{where}--rule = {self.rule!r} means fetch nothing + fallback {fb}; "
                                 f"fallback = {self.fallback!r} contradicts it")
            object.__setattr__(self, "rule", rule)
            object.__setattr__(self, "fallback", fb)
        if self.rule in ("threshold", "band") and self.tau is None:
            raise InputError(f"{where}--tau = None: rule {self.rule} needs a threshold (policy field tau)")
        if self.rule == "band" and (self.tau_high is None or not self.tau_high > self.tau):
            raise InputError(f"{where}--tau-high = {self.tau_high!r} must be > tau = {self.tau!r} for rule band")
        if self.evict == "belady" and self.rule != "fetch_all":
            raise InputError(f"{where}--evict = 'belady' is an offline bound for rule fetch_all only "
                             f"(rule = {self.rule!r})")
        if self.fetch_cap is not None and self.evict == "belady":
            raise InputError(f"{where}--fetch-cap = {self.fetch_cap} with evict = 'belady' is not supported "
                             "(belady is the bound of fetching every miss)")
        if self.route != "off":
            if self.rule != "fetch_all":
                raise InputError(f"{where}--route = {self.route!r} needs rule fetch_all (every miss of the routed "
                                 f"selection is fetched); rule = {self.rule!r}")
            if self.fetch_cap is not None:
                raise InputError(f"{where}--fetch-cap = {self.fetch_cap} with route = {self.route!r} is not supported "
                                 "(every miss of the routed selection is fetched)")
            if self.evict == "belady":
                raise InputError(f"{where}--evict = 'belady' with route = {self.route!r} is not supported (its next "
                                 "uses are the model's selections, not the routed ones)")
        for flag, value, name in (("--pool", self.pool, "shared"), ("--layer-split", self.layer_split, "ncmoe")):
            if value != name:
                continue
            bad = _llamacpp_conflict(self)
            if bad is None and name == "shared" and self.evict != "lru":
                bad = ("--evict", self.evict, "lru")
            if bad is None and name == "shared" and self.layer_split != "none":
                bad = ("--layer-split", self.layer_split, "none")
            if bad is not None:
                raise InputError(f"{where}{flag} = {value!r} (llama.cpp's {'expert cache' if name == 'shared' else 'layer split'}) "
                                 f"needs {bad[0]} = {'unset' if bad[2] is None else repr(bad[2])}, not {bad[1]!r}")
        return self

    @property
    def tau_value(self) -> float:
        """The effective threshold: first_choice = +inf, fetch_all = 0, others unused."""
        if self.rule in ("threshold", "band"):
            return float(self.tau)
        if self.rule == "first_choice":
            return math.inf
        return 0.0

    @property
    def fetches_first_choice(self) -> bool:
        return self.rule != "substitute_all"

    @property
    def exact(self) -> bool:
        """Every selected expert is computed exactly (fetched, hit or host-computed)."""
        return self.rule == "fetch_all" or self.fallback == "host"

    def active_params(self) -> dict[str, Any]:
        """The parameters that matter for this policy (inactive ones omitted)."""
        return {prm.name: getattr(self, prm.name) for prm in PARAMS if prm.is_active(self)}

    def label(self) -> str:
        if self.rule == "substitute_all" and self.fallback == "host":
            parts = ["host-compute"]
        else:
            parts = [f"threshold({self.tau:g})" if self.rule == "threshold" else
                     f"band({self.tau:g},{self.tau_high:g})" if self.rule == "band" else self.rule]
            if self.fallback != "substitute":
                parts[0] += f"->{self.fallback}" + (f"{self.lowbit_bits}" if self.fallback == "lowbit" else "")
                if self.fallback == "lowbit" and self.lowbit_group != 64:
                    parts[0] += f"(g={self.lowbit_group})"
        if self.fetch_cap is not None:
            parts[0] += f"[cap={self.fetch_cap}]"
        ev = self.evict
        if self.evict == "lfu" and self.gamma != 1.0:
            ev += f"(gamma={self.gamma:g})"
        if self.evict == "crf":
            ev += f"(h={self.half_life:g})"
        if self.evict == "s3fifo" and self.s3_small != 0.1:
            ev += f"(small={self.s3_small:g})"
        parts.append(ev)
        if self.beta is not None:
            parts.append(f"beta={self.beta:g}" + (f",d={self.admission_delay}" if self.admission_delay != 1 else ""))
        if self.prefetch != "off":
            parts.append(f"prefetch={self.prefetch}" + (f"({self.prefetch_n})" if self.prefetch_n else ""))
        if self.copy_buffers is not None and (self.beta is not None or self.prefetch != "off"):
            parts.append(f"buffers={self.copy_buffers}")
        if self.pin_fraction:
            parts.append(f"pin={self.pin_fraction:g}")
        if self.capacity_alloc != "uniform":
            parts.append(f"alloc={self.capacity_alloc}")
        if self.drop_renorm:
            parts.append("drop-renorm")
        if self.pool != "per_layer":
            parts.append(f"pool={self.pool}")
        if self.layer_split != "none":
            parts = [parts[0], self.layer_split]  # the eviction key is unused: every expert is resident or on the host
        if self.route == "cache-prior":
            parts.append(f"cache-prior(lambda={self.route_lambda:g},J={self.route_keep})")
        elif self.route == "cache-route":
            parts.append(f"cache-route(J={self.route_keep},M={self.route_window}"
                         + (f",alpha={self.route_alpha:g}" if self.route_alpha != 1.0 else "") + ")")
        return " + ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "policy") -> PolicyConfig:
        """From a mapping of field names (unknown keys are an InputError naming them)."""
        unknown = sorted(set(d) - set(PARAM_NAMES))
        if unknown:
            raise InputError(f"{where}: unknown policy field {unknown[0]!r} (fields: {', '.join(PARAM_NAMES)})")
        try:
            return cls(**d)
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None

    def mlflow_params(self) -> dict[str, str]:
        """Every field as an MLflow param (inactive ones too, so runs compare column by column)."""
        return {prm.name: "" if getattr(self, prm.name) is None else str(getattr(self, prm.name)) for prm in PARAMS}


PARAMS: tuple[Param, ...] = tuple(
    Param(name=f.name, type={"str": str, "int": int, "int | None": int, "bool": bool}.get(f.type, float),
          default=f.default,
          **f.metadata["param"])
    for f in fields(PolicyConfig)
)
PARAM_NAMES: tuple[str, ...] = tuple(p.name for p in PARAMS)
# the kernel's policy record: one field per table row with a `kernel` encoding (ints for codes and counts)
# (+ `route_norm`: the model's weight normalisation, WEIGHT_NORM_CODE, set by PolicyCache from its caller's
# weight_norm; not a policy field)
KERNEL_DTYPE = np.dtype([(p.kernel[0], np.int64 if p.type in (str, int, bool) else np.float64) for p in PARAMS if p.kernel]
                        + [("route_norm", np.int64)])


def kernel_record(policy: PolicyConfig) -> np.ndarray:
    """The policy as the compiled kernel reads it: a one-element record array of KERNEL_DTYPE."""
    rec = np.zeros(1, KERNEL_DTYPE)
    for prm in PARAMS:
        if prm.kernel:
            rec[0][prm.kernel[0]] = prm.kernel[1](policy)
    return rec
PARAM_BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}


# What reads a trace's gate weights (`topk_weights`) or its ranking below the top-k, by the policy field that turns
# it on: (field, when, what reads them). run_layer.py reads a weight only in the miss rule's comparison with tau,
# in a non-fetched miss's fallback (its mass; a substitute also walks the ranking past k), in the admission
# accumulators and in cache-aware routing; fetch-every-miss, every eviction kind, the fetch cap with fallback host,
# pinning, capacity allocation and prefetch (oracle, or lookahead from its own column) read ids only. A trace
# without gate weights (TraceMeta.gate_weights False: routing imported from an engine's dump,
# runtime/formats/trace/imports.py) replays exactly the policies for which none applies (docs/traces.md).
GATE_WEIGHT_READERS: tuple[tuple[str, Callable[[PolicyConfig], bool], str], ...] = (
    ("rule", lambda p: p.rule in ("threshold", "band"), "the rule compares each miss's gate weight with tau"),
    ("fallback", lambda p: p.fallback in ("substitute", "drop", "lowbit") and not (p.rule == "fetch_all"
                                                                                  and p.fetch_cap is None),
     "a miss that is not fetched is substituted (from the ranking past k), dropped or computed low-bit, its gate "
     "weight counted as lost mass (fallback host reads none)"),
    ("beta", lambda p: p.beta is not None, "admission accumulates the gate weights of the misses not fetched"),
    ("route", lambda p: p.route != "off", "cache-aware routing recomputes and moves gate weights"),
)


def gate_weight_readers(policy: PolicyConfig) -> list[tuple[str, str]]:
    """(field, what reads the weights) for every part of `policy` that reads gate weights; [] when none does."""
    return [(name, why) for name, applies, why in GATE_WEIGHT_READERS if applies(policy)]


PRESETS: dict[str, PolicyConfig] = {
    "fetch-every-miss": PolicyConfig(rule="fetch_all"),
    "rule-0.15": PolicyConfig(rule="threshold", tau=0.15),
    "first-choice": PolicyConfig(rule="first_choice"),
    "substitute-all": PolicyConfig(rule="substitute_all"),
    "host-compute": PolicyConfig(rule="cpu"),
    "quality-first": PolicyConfig(rule="threshold", tau=0.15, beta=0.5),
    "speed-first": PolicyConfig(rule="first_choice", beta=0.5),
    # cache-aware routing (docs/policies.md, Additions (4)): Skliar et al.'s Cache-Prior with max-rank J = 1 and
    # lambda = 0.5 (our choice inside the paper's range), colibri's CACHE_ROUTE with J = 1, M = 16, no alpha scaling
    "cache-prior": PolicyConfig(rule="fetch_all", route="cache-prior", route_lambda=0.5, route_keep=1),
    "cache-route": PolicyConfig(rule="fetch_all", route="cache-route", route_keep=1, route_window=16),
    # llama.cpp's expert cache (--moe-cache-mib) and its layer split (-ncmoe) (docs/policies.md, Additions (5))
    "llamacpp-lru": PolicyConfig(rule="fetch_all", evict="lru", pool="shared"),
    "llamacpp-ncmoe": PolicyConfig(rule="fetch_all", layer_split="ncmoe"),
}


def preset(name: str, flag: str = "--policy") -> PolicyConfig:
    if name not in PRESETS:
        raise InputError(f"{flag} = {name!r} is not a preset (choose from {', '.join(PRESETS)})")
    return PRESETS[name]


def add_policy_flags(p: argparse.ArgumentParser, repeatable_preset: bool = False) -> None:
    """`--policy PRESET` plus one flag per row of the parameter table (every backend's CLI)."""
    g = p.add_argument_group("policy (docs/policies.md; flags override the preset's fields)")
    g.add_argument("--policy", action="append" if repeatable_preset else "store",
                   help=f"preset{' (repeatable, or all)' if repeatable_preset else ''}: {', '.join(PRESETS)}")
    for prm in PARAMS:
        conv = {str: str, int: _num(int, prm.flag), float: _num(float, prm.flag), bool: _bool(prm.flag)}[prm.type]
        more = dict(nargs="?", const=True) if prm.type is bool else {}  # `--drop-renorm` alone means true
        g.add_argument(prm.flag, dest=f"pol_{prm.name}", type=conv, default=None, **more,
                       help=f"{prm.help}; {prm.range_text()}; default {prm.default!r}; active when {prm.active}")


def _num(kind: type, flag: str):
    def conv(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} = {text!r} is not {'an integer' if kind is int else 'a number'}") from None
    return conv


def _bool(flag: str):
    def conv(text: str) -> bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"{flag} = {text!r} is not true or false")
    return conv


def pinned_count(pin_fraction: float, capacity: int) -> int:
    """P_l = floor(pin_fraction * C_l) (docs/policies.md, "Pinned hot set"); the product is taken with a 1e-9
    tolerance so that a decimal fraction such as 0.29 of 100 slots pins 29, not 28."""
    return int(math.floor(pin_fraction * int(capacity) + 1e-9))


def policy_overrides(a: argparse.Namespace) -> dict[str, Any]:
    return {prm.name: getattr(a, f"pol_{prm.name}") for prm in PARAMS if getattr(a, f"pol_{prm.name}") is not None}


def policies_from_flags(a: argparse.Namespace) -> dict[str, PolicyConfig]:
    """{label: PolicyConfig} from `--policy` (one or several presets) and the per-field flags."""
    names = a.policy if isinstance(a.policy, list) else ([a.policy] if a.policy else [])
    if names == ["all"]:
        names = list(PRESETS)
    over = policy_overrides(a)
    if not names:
        if "rule" not in over:
            raise InputError("--policy or --rule is required")
        return {_label_of(over): PolicyConfig(**over)}
    if "rule" in over:
        raise InputError(f"--policy {names[0]!r} and --rule {over['rule']!r}: give one of them")
    out = {}
    for n in names:
        base = preset(n)
        out[n] = replace(base, **over) if over else base
    return out


def _label_of(over: dict) -> str:
    return PolicyConfig(**over).label()


def resolve_capacities(
    capacity: int | list[int] | tuple[int, ...] | np.ndarray | None,
    num_layers: int,
    num_experts: int,
    top_k: int,
    capacity_fraction: float | None = None,
    flag: str = "--capacity",
) -> np.ndarray:
    """Per-layer slot counts C_l as int64 [L]; k <= C_l < E or an InputError."""
    if capacity is None and capacity_fraction is None:
        raise InputError(f"{flag}: a capacity (or capacity fraction) is required")
    if capacity is None:
        if not (0 < capacity_fraction < 1):
            raise InputError(f"--capacity-fraction = {capacity_fraction!r} must be in (0, 1)")
        caps = np.full(num_layers, int(round(capacity_fraction * num_experts)), dtype=np.int64)
        flag = f"--capacity-fraction {capacity_fraction!r}: capacity"
    else:
        arr = np.atleast_1d(np.asarray(capacity))
        if arr.size == 1:
            arr = np.full(num_layers, arr.item())
        if arr.shape != (num_layers,):
            raise InputError(f"{flag} = {arr.tolist()} has {arr.size} entries, the model has {num_layers} MoE layers")
        caps = arr.astype(np.int64)
    for l_, c in enumerate(caps):
        if not (top_k <= c < num_experts):
            raise InputError(f"{flag} = {int(c)} (layer {l_}) must satisfy k={top_k} <= C < E={num_experts}")
    return caps
