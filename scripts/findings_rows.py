"""The findings rows at equal device memory (4a-mem, 4b-mem, 5-mem, 5q-mem) and row 7 alone, on one build.

    python scripts/findings_rows.py --model DIR [--max-tokens N] [--capacity-fraction F|paper ...] [--out-json FILE]

The same code as `make findings` (runtime/tools/findings: `memory`, `routing`, the rows at equal slots they are
compared with) without the rows that do not bear on them (1, 2a-2c, 3, 6): the presets' emulations, the column's
blocks, then rows 4a/4a-mem, 5q-mem, 4b-mem, 5-mem and 7 per column. For a machine where the whole page cannot be
regenerated in the time there is; the page itself comes from `make findings` only. Prints the rows as the page's
table (Markdown) and writes the JSON with `--out-json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import sys
import tempfile
import time
from pathlib import Path

from runtime.core.threads import configure as configure_threads


def main(argv: list[str] | None = None) -> None:
    """Run the rows and print their table."""
    configure_threads()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", required=True)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--capacity-fraction", action="append", default=None)
    p.add_argument("--out-json", default=None)
    a = p.parse_args(argv)
    from runtime.backends import hfmodel
    from runtime.tools.findings import cli, memory, render, routing
    from runtime.tools.findings import experiments as X
    from runtime.tools.findings.rules import MEMORY
    from runtime.tools.findings.topic import finding_topic
    from runtime.tools.tinymodel import domain_texts

    model = Path(a.model)
    fracs = [cli.parse_capacity_fraction(v) for v in (a.capacity_fraction or ["0.0625", "paper"])]
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    rows, cols = [], []
    with tempfile.TemporaryDirectory(prefix="findings-rows-") as tmp:
        s0 = X.Setup(model, model / "eval.txt", domain_texts(model), 0.25, a.max_tokens, 320, 64, 1, 1, 0, Path(tmp),
                     hfmodel.load(model))
        trace, calib_ids, _ = X.exact_trace(s0, s0.eval_text)
        paper_frac, _ = X.paper_capacity(trace, calib_ids)
        for f in fracs:
            frac = paper_frac if f == "paper" else float(f)
            reg = X.regime(trace, calib_ids, frac)
            label = f"C={reg['slots']} ({frac:.1%})"
            s = dataclasses.replace(s0, capacity_fraction=frac, starts=None, blocks={})
            timed = cli.timer(label, timings)
            main_runs = timed("presets", lambda s=s: X.emulate_policies(s, X.preset_policies(), s.eval_text))
            s.starts, s.blocks = X.choose_blocks(s, main_runs)
            slots = int(X.caps_and_warm(trace, calib_ids, frac)[0][0])
            eq = memory.equal_memory(s, trace, slots)
            mem = timed("memory", memory.emulate_memory, s, eq, trace.k)
            r4a = X.finding_admission(s, main_runs)[0]
            r4am, r5qm = memory.finding_admission_memory(s, main_runs, mem, eq)
            r4bm = timed("topic-memory", finding_topic, s, "4b" + MEMORY, memory.pooled("quality-first"),
                         eq["emulation"]["budget_gib"])
            r5m = timed("speed-memory", X.finding_speed, s, mem, "5" + MEMORY, memory.speed_policies(eq))
            r7 = timed("routing", routing.finding_routing, s, main_runs, eq["emulation"]["budget_gib"], slots)
            for r in (r4a, r4am, r4bm, r5m, r5qm, r7):
                r.column = label
                rows.append(r)
            reg.update({"label": label, "requested": f, "paper_regime": math.isclose(frac, paper_frac)})
            cols.append(reg)
    res = {"commit": cli.git_commit(), "model": model.name, "max_tokens": a.max_tokens, "columns": cols,
           "rows": [r.to_dict() for r in rows], "seconds": round(time.perf_counter() - t0, 1),
           "seconds_by_finding": timings, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
           "command": "python scripts/findings_rows.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    res = json.loads(cli.scrub(json.dumps(res), model))
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    order = [r["id"] for r in res["rows"]]
    print("\n".join(render.table(res["rows"], order)))


if __name__ == "__main__":
    main()
