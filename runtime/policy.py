"""Miss-policy configuration: the one frozen dataclass every backend and the sweep share.

Field names are the search-space names (`rule`, `tau`, `beta`, `evict`, `gamma`,
`half_life`, `admission_delay`). The semantics live in docs/policies.md; the
compiled kernel that carries them out is runtime/kernel.py.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import numpy as np

from runtime.errors import InputError

log = logging.getLogger(__name__)

RULES = ("fetch_all", "threshold", "first_choice", "substitute_all", "cpu")
EVICTS = ("lfu", "lru", "crf", "belady")
RULE_CODE = {r: i for i, r in enumerate(RULES)}
EVICT_CODE = {e: i for i, e in enumerate(EVICTS)}


@dataclass(frozen=True)
class PolicyConfig:
    rule: str = "fetch_all"
    tau: float | None = None  # threshold only
    beta: float | None = None  # background admission threshold; None = off
    evict: str = "lfu"
    gamma: float = 1.0  # lfu aging, 1 = plain LFU
    half_life: float = 32.0  # crf only, in tokens
    admission_delay: int = 1  # d >= 1

    def validate(self, where: str = "policy") -> PolicyConfig:
        """Raise InputError (naming the field and value) unless the policy is well formed."""
        if self.rule not in RULE_CODE:
            raise InputError(f"{where}: rule = {self.rule!r} is unknown (choose from {', '.join(RULES)})")
        if self.evict not in EVICT_CODE:
            raise InputError(f"{where}: evict = {self.evict!r} is unknown (choose from {', '.join(EVICTS)})")
        if self.rule == "threshold":
            if self.tau is None:
                raise InputError(f"{where}: tau = None is required for rule threshold")
            if not (self.tau >= 0):
                raise InputError(f"{where}: tau = {self.tau!r} must be >= 0")
        if self.beta is not None and (not (self.beta > 0) or not math.isfinite(self.beta)):
            raise InputError(f"{where}: beta = {self.beta!r} must be > 0 (or unset)")
        if not (0.0 < self.gamma <= 1.0):
            raise InputError(f"{where}: gamma = {self.gamma!r} must be in (0, 1]")
        if not (self.half_life > 0) or not math.isfinite(self.half_life):
            raise InputError(f"{where}: half_life = {self.half_life!r} must be > 0")
        if int(self.admission_delay) != self.admission_delay or self.admission_delay < 1:
            raise InputError(f"{where}: admission_delay = {self.admission_delay!r} must be an integer >= 1")
        if self.evict == "belady" and self.rule != "fetch_all":
            raise InputError(f"{where}: evict = 'belady' is an offline bound for rule fetch_all only (rule = {self.rule!r})")
        return self

    @property
    def tau_value(self) -> float:
        """The effective threshold: first_choice = +inf, fetch_all = 0, others unused."""
        if self.rule == "threshold":
            return float(self.tau)
        if self.rule == "first_choice":
            return math.inf
        return 0.0

    @property
    def fetches_first_choice(self) -> bool:
        return self.rule in ("fetch_all", "threshold", "first_choice")

    def label(self) -> str:
        parts = [self.rule if self.rule != "threshold" else f"threshold({self.tau:g})", self.evict]
        if self.evict == "lfu" and self.gamma != 1.0:
            parts[-1] += f"(gamma={self.gamma:g})"
        if self.evict == "crf":
            parts[-1] += f"(h={self.half_life:g})"
        if self.beta is not None:
            parts.append(f"beta={self.beta:g}" + (f",d={self.admission_delay}" if self.admission_delay != 1 else ""))
        return " + ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, PolicyConfig] = {
    "fetch-every-miss": PolicyConfig(rule="fetch_all"),
    "rule-0.15": PolicyConfig(rule="threshold", tau=0.15),
    "first-choice": PolicyConfig(rule="first_choice"),
    "substitute-all": PolicyConfig(rule="substitute_all"),
    "host-compute": PolicyConfig(rule="cpu"),
    "quality-first": PolicyConfig(rule="threshold", tau=0.15, beta=0.5),
    "speed-first": PolicyConfig(rule="first_choice", beta=0.5),
}


def preset(name: str, flag: str = "--policy") -> PolicyConfig:
    if name not in PRESETS:
        raise InputError(f"{flag} = {name!r} is not a preset (choose from {', '.join(PRESETS)})")
    return PRESETS[name]


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
            raise InputError(f"{flag} = {list(arr)} has {arr.size} entries, the trace has {num_layers} layers")
        caps = arr.astype(np.int64)
    for l_, c in enumerate(caps):
        if not (top_k <= c < num_experts):
            raise InputError(f"{flag} = {int(c)} (layer {l_}) must satisfy k={top_k} <= C < E={num_experts}")
    return caps
