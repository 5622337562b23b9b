"""llama.cpp's command-line flags for a policy at a capacity, where llama.cpp can express it (docs/policies.md,
"Additions (5)"): `--moe-cache-mib M` for its expert cache (`llamacpp-lru`), `-ncmoe N` for its layer split
(`llamacpp-ncmoe`), and for any other policy one line saying what llama.cpp lacks to run it.

`python -m runtime.tools.llamacpp_flags --policy llamacpp-lru --model-shape qwen3-30b-a3b --capacity 32` prints the
line; the sweep's answer table calls `llamacpp_flags`.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from runtime.core.errors import ArgumentParser, InputError, cli_main
from runtime.core.llamacpp_cache import ncmoe_layers
from runtime.core.policy import (
    PolicyConfig,
    add_policy_flags,
    policies_from_flags,
    resolve_capacities,
)
from runtime.formats import costmodel

log = logging.getLogger(__name__)

MIB = 2**20


def moe_cache_mib(shape: costmodel.ModelShape, slots: int) -> int:
    """The smallest `--moe-cache-mib` whose budget holds `slots` experts of `shape` plus llama.cpp's padding slot:
    ceil((slots + 1) * expert bytes / MiB)."""
    return math.ceil((int(slots) + 1) * costmodel.expert_bytes(shape) / MIB)


def moe_cache_slots(shape: costmodel.ModelShape, mib: int) -> int:
    """The slots a `--moe-cache-mib` budget gives one group of `shape`'s experts: floor(mib * MiB / expert bytes),
    less the padding slot (the inverse of `moe_cache_mib`)."""
    return int(mib) * MIB // costmodel.expert_bytes(shape) - 1


def lacks(policy: PolicyConfig) -> list[str]:
    """What llama.cpp lacks to run `policy` (empty for its own two: the shared pool, the layer split)."""
    p = policy
    if p.pool == "shared" or p.layer_split != "none":
        return []
    out = []
    if p.route != "off":
        out.append("llama.cpp has no cache-aware routing (it computes the router's own top-k)")
    if p.rule != "fetch_all" or p.fetch_cap is not None:
        out.append({
            "substitute": "llama.cpp has no substitution of a missed expert",
            "drop": "llama.cpp never drops a missed expert",
            "lowbit": "llama.cpp keeps no low-precision copy of an expert to compute a miss from",
            "host": "llama.cpp cannot keep some of a layer's experts on the device and compute its misses on the host "
                    "(a layer's experts are one tensor, placed whole: -ncmoe)",
        }[p.fallback])
    if p.fetch_cap is not None:
        out.append("llama.cpp has no cap on the fetches of a token (its cache fetches every miss)")
    if p.beta is not None:
        out.append("llama.cpp has no background admission")
    if p.prefetch != "off":
        out.append("llama.cpp has no prefetch of the next layer's experts")
    if p.rule == "fetch_all" and p.fetch_cap is None:
        out.append("llama.cpp's expert cache is one pool shared by every layer (llamacpp-lru), not a cache per layer")
    if p.evict != "lru" and (p.rule != "substitute_all" or p.beta is not None or p.prefetch != "off"):  # it evicts
        out.append(f"llama.cpp's expert cache evicts by LRU only (no {p.evict})")
    if p.pin_fraction > 0:
        out.append("llama.cpp has no pinned hot set")
    if p.capacity_alloc != "uniform":
        out.append("llama.cpp has no per-layer capacities")
    return out


def llamacpp_args(policy: PolicyConfig, shape: costmodel.ModelShape, capacities) -> list[str] | None:
    """llama.cpp's arguments for `policy` with `capacities` slots per layer (C, or C_l per layer) on `shape`, or None
    when llama.cpp cannot express the policy (`lacks` says why)."""
    caps = resolve_capacities(capacities, shape.num_layers, shape.num_experts, shape.top_k)
    if policy.pool == "shared":
        return ["--moe-cache-mib", str(moe_cache_mib(shape, int(np.sum(caps))))]
    if policy.layer_split == "ncmoe":
        return ["-ncmoe", str(ncmoe_layers(caps, shape.num_experts))]
    return None


def llamacpp_flags(policy: PolicyConfig, shape: costmodel.ModelShape, capacities) -> str:
    """One line: llama.cpp's flags for the policy at this capacity, or what llama.cpp lacks to run it."""
    args = llamacpp_args(policy, shape, capacities)
    if args is not None:
        return " ".join(args)
    return "; ".join(lacks(policy))


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="python -m runtime.tools.llamacpp_flags", description=__doc__.splitlines()[0],
                       allow_abbrev=False)
    add_policy_flags(p)
    p.add_argument("--model-shape", required=True, help="a cost-model shape name (runtime/data/models) or YAML file")
    p.add_argument("--capacity", required=True, help="slots per MoE layer: C, or C0,C1,...")
    a = p.parse_args(argv)
    pols = policies_from_flags(a)
    if len(pols) != 1:
        raise InputError(f"--policy: one policy ({len(pols)} given)")
    try:
        caps = [int(x) for x in a.capacity.split(",")]
    except ValueError:
        raise InputError(f"--capacity = {a.capacity!r} is not an integer or a list of them") from None
    (pol,) = pols.values()
    print(llamacpp_flags(pol, costmodel.load_model_shape(a.model_shape), caps[0] if len(caps) == 1 else caps))


if __name__ == "__main__":
    cli_main(main)
