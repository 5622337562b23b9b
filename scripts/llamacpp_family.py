"""llama.cpp's two ways of holding experts beside the project's per-layer caches, at equal device memory, on the
real traces (simulator): writes reports/llamacpp_family.md and .json.

Policies (docs/policies.md, Additions (5)): `llamacpp-lru` (one pool of L x C slots, LRU over (layer, expert)),
its per-layer twin `fetch_all + lru` (C slots per layer), `fetch-every-miss` (per-layer LFU), `llamacpp-ncmoe`
(the first N layers on the host, N the smallest that fits L x C slots), `host-compute` and `rule-0.15`. Each
trace at each residency `C = round(fraction * E)` per layer, warm start `held-out` (the last 20% of the trace
calibrates and is not evaluated), the cost model's default host and the trace's model shape.

    python scripts/llamacpp_family.py [--fractions 0.25,0.5] [--traces ../shared/data/traces]
"""

from __future__ import annotations

import logging
from pathlib import Path

from runtime.backends import get_backend
from runtime.core.errors import ArgumentParser
from runtime.core.policy import PRESETS, PolicyConfig
from runtime.core.spec import HELD_OUT, RunSpec
from runtime.tools.reports import write_report

ROOT = Path(__file__).resolve().parents[1]
TRACES = {"qwen1.5-moe gsm8k": "qwen15moe-a2.7b-gsm8k.npz", "mixtral humaneval": "mixtral-8x7b-humaneval0.npz"}
POLICIES = {
    "llamacpp-lru": PRESETS["llamacpp-lru"],
    "per-layer LRU": PolicyConfig(rule="fetch_all", evict="lru"),
    "fetch-every-miss (LFU)": PRESETS["fetch-every-miss"],
    "llamacpp-ncmoe": PRESETS["llamacpp-ncmoe"],
    "host-compute": PRESETS["host-compute"],
    "rule-0.15": PRESETS["rule-0.15"],
}

log = logging.getLogger(__name__)


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", default="0.25,0.5")
    ap.add_argument("--traces", default=str(ROOT.parent / "shared" / "data" / "traces"))
    a = ap.parse_args()
    sim = get_backend("simulator")
    rows = []
    for label, file in TRACES.items():
        path = Path(a.traces) / file
        for frac in (float(x) for x in a.fractions.split(",")):
            for name, pol in POLICIES.items():
                res = sim.evaluate(RunSpec(policy=pol, trace=str(path), capacity_fraction=frac,
                                           initial_residency=HELD_OUT))
                c, x = res.counters, res.extra
                per_token = 1.0 / max(res.tokens, 1)
                rows.append({"trace": label, "fraction": frac, "policy": name, "label": res.policy,
                             "slots_per_layer": res.capacity[0], "tokens": res.tokens,
                             "hit_rate": c["hits"] / c["calls"], "fetches_per_token": c["fetches"] * per_token,
                             "host_computes_per_token": c["host_computes"] * per_token,
                             "substituted_calls": (c["substitutions"] + c["drops"]) / c["calls"],
                             "ncmoe": x.get("ncmoe"), "time_per_token_ms": res.time_per_token_s * 1e3,
                             "speed_ratio_vs_fetch_all": res.speed_ratio_vs_fetch_all,
                             "device_memory_GiB": x["device_memory_GiB"], "host": x["host"],
                             "model_shape": x["model_shape"]})
                log.info("%s %.2f %s: %.3f ms/token", label, frac, name, rows[-1]["time_per_token_ms"])
    lines = ["Simulator, warm start held-out, the cost model's default host (`" + rows[0]["host"] + "`) and each "
             "trace's model shape. Equal memory: C slots per layer; llamacpp-lru pools L x C, llamacpp-ncmoe keeps "
             "(L - N) x E experts resident with N the smallest that fits L x C (its device memory column is that).",
             ""]
    head = ("| trace | residency (C) | policy | hit rate | fetches/token | host computes/token | substituted calls "
            "| N (ncmoe) | ms/token | vs fetch-every-miss | device GiB |")
    lines += [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['trace']} | {r['fraction']:.0%} ({r['slots_per_layer']}) | {r['policy']} | "
                     f"{r['hit_rate']:.4f} | {r['fetches_per_token']:.3f} | {r['host_computes_per_token']:.3f} | "
                     f"{r['substituted_calls']:.2%} | {'' if r['ncmoe'] is None else r['ncmoe']} | "
                     f"{r['time_per_token_ms']:.3f} | {r['speed_ratio_vs_fetch_all']:.2f}x | "
                     f"{r['device_memory_GiB']:.2f} |")
    write_report("llamacpp_family", "llama.cpp's expert cache and -ncmoe split beside per-layer caches (simulator)",
                 {"rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
