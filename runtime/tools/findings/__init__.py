"""The paper's findings, reproduced on any MoE checkpoint: one row per finding and cache regime, with a verdict.

`python -m runtime.findings --model DIR ...` (`cli`; `make findings` runs it on the `ref` reference model and
writes reports/findings/findings.md and .json). The package, by job:

- `rules`: each row's verdict rule as data (`RULES`: the paper's claim quoted with its source, the statistics
  tested, their directions, no-effect values and paper figures) and the one function turning intervals into a
  verdict;
- `stats`: perplexity change, Pearson r, block sums and `scipy.stats.bootstrap` intervals over blocks whose
  length the data chooses (the width has stopped growing at the chosen length): one interval per statistic;
- `rows`: each row's statistics and verdict from plain per-window (or per-segment) arrays: no model runs there;
- `experiments`: the emulations and simulations that gather those arrays, one column at a time, and each row's
  text; `topic`: finding 4b's topic-switch stream;
- `memory`: the admission rows at equal device memory (4a-mem, 4b-mem, 5-mem, 5q-mem: Quality-First and
  Speed-First with a bounded copy pool at the slots the column's budget leaves them);
- `routing`: row 7, the page's own finding: routing toward residents (Cache-Prior, CACHE_ROUTE, each calibrated
  to the 0.15 rule's fetched-miss rate) against the rule's substitution at equal device memory;
- `admission`: admission against the cache size (C/k) on a routing trace (the simulator), and its plot;
- `render`: the Markdown page from the JSON result; `cli`: the command line, and `stability` (a second build's
  verdicts: rows that differ read "unstable").

Every row has `paper` (the claim as quoted, with `paper_source`), `ours`, `ci95`, `verdict`, `rule` (how the
verdict follows from the intervals) and `sample` (what the interval rests on).
"""

from runtime.tools.findings.cli import (
           build_parser,
           checked_args,
           git_commit,
           main,
           parse_capacity_fraction,
           power,
           run,
           scrub,
           stability,
)
from runtime.tools.findings.render import to_markdown
from runtime.tools.findings.rules import DIFFERS, HOLDS, INCONCLUSIVE, RULES, UNTESTABLE, VERDICTS

__all__ = ["DIFFERS", "HOLDS", "INCONCLUSIVE", "RULES", "UNTESTABLE", "VERDICTS", "build_parser", "checked_args",
           "git_commit", "main", "parse_capacity_fraction", "power", "run", "scrub", "stability",
           "to_markdown"]
