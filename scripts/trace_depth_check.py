"""Does a ranking truncated to depth 64 change the simulator's decisions at E = 512?

    python scripts/trace_depth_check.py [--model next-shape] [--tokens 2048] [--depth 64]

Records the model's exact routing over the first `--tokens` tokens of its eval.txt at full depth,
takes the first `--depth` ranking entries as a second trace, and replays rule-0.15, substitute-all
and Quality-First on both at 25% residency (warm start: the held-out last 20%). Prints
substitutions, drops, calls and substituted mass per policy and depth (docs/performance.md,
"How cost grows").
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from runtime.backends import hfmodel
from runtime.backends.simulate import simulate
from runtime.core.policy import PRESETS
from runtime.tools.tinymodel import ensure_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default="next-shape")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--depth", type=int, default=64)
    a = p.parse_args()
    d = ensure_model(a.model, progress=False)
    m = hfmodel.load(d)
    win, sha = hfmodel.tokenize_file(m, d / "eval.txt", a.tokens, hfmodel.default_window(m))
    ids, w, rank, _ = hfmodel.record(m, win, m.E)
    full = hfmodel.make_trace(m, ids, w, rank, win, sha, "trace_depth_check")
    cut = dataclasses.replace(full, ranking=np.ascontiguousarray(rank[:, :, : a.depth]),
                              meta=dataclasses.replace(full.meta, ranking_depth=a.depth))
    for name in ("rule-0.15", "substitute-all", "quality-first"):
        for label, tr in ((f"M={m.E}", full), (f"M={a.depth}", cut)):
            c = simulate(tr, PRESETS[name], capacity_fraction=0.25, initial_residency="held-out",
                         baselines=False).counters
            print(f"{name:15s} {label}: substitutions {int(c['substitutions'])} drops {int(c['drops'])} "
                  f"calls {int(c['calls'])} mass {c['substituted_mass']:.2f}")


if __name__ == "__main__":
    main()
