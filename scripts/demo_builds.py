"""Builds of the demo model compared: how much its quality axis depends on the build.

    python scripts/demo_builds.py [--build aux=0.001,seed=1 ...] [--cache DIR] [--tokens 16384]

Each `--build` is a comma-separated list of TinySpec fields that replace the demo's (the demo itself:
`--build ""`; default: the demo, seeds 1 and 2, and seeds 0 and 1 at router_aux_loss_coef 0.01; `aux`
is short for router_aux_loss_coef). Each variant is built (or reused) in `--cache` (default: a
folder under the system temp dir, never the user's model cache, since these are not the models
`make pareto` uses), then emulated on 16,384 tokens of its eval.txt at 25% residency, warm start from
its calib.txt: the lossy presets and the drop fallbacks at several thresholds, each with its 95%
interval. Prints one Markdown table: a row per build (validation perplexity, then each policy's
perplexity change %). docs/tiny_models.md "Builds compared" is its output. A build takes ~3 min
on an idle 2-core machine; the evaluations ~15 s each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUILDS = ("", "seed=1", "seed=2", "aux=0.01", "aux=0.01,seed=1")
ALIASES = {"aux": "router_aux_loss_coef"}


def parse_build(text: str, fields: dict) -> dict:
    """'aux=0.001,seed=1' -> {'router_aux_loss_coef': 0.001, 'seed': 1}, typed like the demo's fields."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        if not sep or key not in fields:
            sys.exit(f"demo_builds: --build {text!r}: {item!r} is not FIELD=VALUE of a TinySpec field")
        try:
            out[key] = type(fields[key])(value)
        except ValueError:
            sys.exit(f"demo_builds: --build {text!r}: {key} = {value!r}: expected {type(fields[key]).__name__}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--build", action="append", default=None, help="TinySpec fields to replace (repeatable)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "expertsweep-demo-builds"))
    ap.add_argument("--tokens", type=int, default=16384)
    a = ap.parse_args(argv)
    os.environ["EXPERTSWEEP_CACHE"] = a.cache  # before the model cache is first read
    sys.path.insert(0, str(ROOT))
    from runtime.backends import get_backend
    from runtime.core.policy import PRESETS, PolicyConfig
    from runtime.core.spec import RunSpec
    from runtime.tools import tinymodel

    demo = tinymodel.SPECS["demo"]
    fields = dataclasses.asdict(demo)
    builds = [parse_build(b, fields) for b in (a.build if a.build is not None else DEFAULT_BUILDS)]
    policies = {n: PRESETS[n] for n in ("substitute-all", "first-choice", "rule-0.15", "speed-first", "quality-first")}
    policies["first-choice -> drop"] = PolicyConfig(rule="first_choice", fallback="drop")
    for tau in (0.15, 0.1, 0.065, 0.03):
        policies[f"threshold({tau:g}) -> drop"] = PolicyConfig(rule="threshold", tau=tau, fallback="drop")
    print("| build | val ppl | " + " | ".join(policies) + " |")
    print("|---|---|" + "---|" * len(policies))
    for over in builds:
        d = tinymodel.ensure_model(dataclasses.replace(demo, **over), progress=sys.stderr.isatty())
        log = json.loads((d / "train_log.json").read_text())
        specs = [RunSpec(policy=p, model=str(d), text=str(d / "eval.txt"), max_tokens=a.tokens,
                         capacity_fraction=0.25) for p in policies.values()]
        cells = [f"{r.ppl_change_pct:+.2f} [{r.ppl_ci_low:+.2f}, {r.ppl_ci_high:+.2f}]"
                 for r in get_backend("emulation").evaluate_many(specs)]
        name = ", ".join(f"{k} {v}" for k, v in over.items()) or "the demo"
        print(f"| {name} ({d.name}) | {log['val_ppl']:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
