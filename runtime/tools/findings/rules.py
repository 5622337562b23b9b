"""The verdict rules of the findings, written once as data: per row the paper's claim (quoted, with where the
quotation comes from), the statistic(s) tested, each one's direction, no-effect value and paper value, and the
one function that turns 95% intervals into a verdict.

A claim is one statistic with the paper's direction (+1: above `null`, -1: below it) and optionally the paper's
figure, either a range the interval must lie inside (`inside`, finding 5) or a point it must contain (`point`,
finding 2a). Per claim (`verdict`):

- `not testable here`: no finite interval;
- `inconclusive here`: the interval contains `null`;
- `differs`: the interval lies wholly on the other side of `null`; or wholly outside the paper's range; or
  it misses the paper's point;
- `holds`: wholly on the paper's side (and inside the range, or containing the point);
- otherwise (on the paper's side, overlapping the range but not inside it) `inconclusive here`.

A row with several claims (`Rule.decide`) differs if any claim differs, holds if all hold, is not testable if
none is, and is inconclusive otherwise. A row whose intervals all contain no effect is never `differs`.

Each interval is one 95% interval per statistic, fixed before the data: the block bootstrap of `stats` (blocks of
consecutive windows, the length chosen by `stats.choose_block`); no union of intervals. The no-effect values
that are not 0 are read off the claim's words, not the data: "most of the loss" is more than half of it (`MOST`),
"about as many calls" is sparing fewer than half of them, "mass does not predict" is r below `R_SMALL`, the
conventional bound between a small and a medium correlation. Rows marked `own` are this page's checks, not the
paper's claims; `note` carries the paper's own hedge on a claim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

HOLDS, DIFFERS, INCONCLUSIVE, UNTESTABLE = "holds", "differs", "inconclusive here", "not testable here"
UNSTABLE = "unstable"  # the verdict differs between two builds of the model (cli.stability)
VERDICTS = (HOLDS, DIFFERS, INCONCLUSIVE, UNTESTABLE, UNSTABLE)

SPEC = "docs/policies.md, 'Policies named in the paper'"
PAPER_SPEED = (2.5, 3.0)
PAPER_R = 0.92
PAPER_QF_VS_RULE = (-0.8, -0.5)  # F5: Quality-First's perplexity change minus the 0.15 rule's (points)
MOST = 50.0  # "most" of the loss: more than half of it (%); "about as many calls": the rule spares under half
R_SMALL = 0.3  # "does not predict": r across windows below 0.3 (Cohen's bound between a small and a medium r)
PAPER_HEDGE = ("the paper calls its conclusions modest: one model (Qwen3-Next-80B-A3B), one cache size (~25% "
               "resident), a few evaluation texts")


@dataclass(frozen=True)
class Claim:
    """One tested statistic: the paper says it lies on the `direction` side of `null` (and in `inside`, or at
    `point`)."""

    statistic: str
    direction: int
    null: float = 0.0
    inside: tuple[float, float] | None = None
    point: float | None = None
    unit: str = ""

    def __post_init__(self) -> None:
        if self.direction not in (1, -1):
            raise ValueError(f"Claim {self.statistic!r}: direction must be +1 or -1, got {self.direction}")

    def text(self) -> str:
        """The rule in words."""
        u, side, other = self.unit, (">" if self.direction > 0 else "<"), ("<" if self.direction > 0 else ">")
        s = f"{self.statistic}: holds if its 95% interval lies wholly {side} {self.null:g}{u}"
        if self.inside is not None:
            s += f" and inside the paper's {self.inside[0]:g}-{self.inside[1]:g}{u}"
        if self.point is not None:
            s += f" and contains the paper's {self.point:g}{u}"
        s += f"; differs if it lies wholly {other} {self.null:g}{u}"
        if self.inside is not None:
            s += f" or wholly outside {self.inside[0]:g}-{self.inside[1]:g}{u}"
        if self.point is not None:
            s += f" or excludes {self.point:g}{u}"
        s += f"; inconclusive here if it contains {self.null:g}{u}"
        if self.inside is not None:
            s += " or overlaps the paper's range without lying inside it"
        return s


def verdict(ci: Sequence[float], claim: Claim) -> str:
    """The one verdict rule (module docstring) for one claim's 95% interval."""
    lo, hi = float(ci[0]), float(ci[1])
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return UNTESTABLE
    if lo > hi:
        raise ValueError(f"interval [{lo}, {hi}] is reversed")
    if lo <= claim.null <= hi:
        return INCONCLUSIVE
    if (lo > claim.null) != (claim.direction > 0):
        return DIFFERS
    if claim.inside is not None:
        a, b = claim.inside
        if hi < a or lo > b:
            return DIFFERS
        return HOLDS if a <= lo and hi <= b else INCONCLUSIVE
    if claim.point is not None:
        return HOLDS if lo <= claim.point <= hi else DIFFERS
    return HOLDS


def combine(verdicts: Sequence[str]) -> str:
    """One verdict from several claims: differs if any differs, holds if all hold, not testable if none is
    testable, else inconclusive here."""
    vs = [v for v in verdicts if v != UNTESTABLE]
    if not vs:
        return UNTESTABLE
    if DIFFERS in vs:
        return DIFFERS
    if len(vs) == len(verdicts) and all(v == HOLDS for v in vs):
        return HOLDS
    return INCONCLUSIVE


@dataclass(frozen=True)
class Rule:
    """One row: the paper's claim as quoted (`paper`, from `source`), the claims tested and how they combine."""

    id: str
    finding: str
    paper: str
    source: str
    claims: tuple[Claim, ...]
    per: str = ""  # "" (each claim once) or what each claim is repeated over (pairs, hosts)
    own: bool = False  # the page's own check, not a claim of the paper's (rendered below the paper's rows)
    note: str = ""  # the paper's own hedge on this claim, shown with it

    def decide(self, cis: Sequence[Sequence[float]], claims: Sequence[Claim] | None = None) -> tuple[str, list[str]]:
        """(row verdict, per-claim verdicts) for the intervals of `claims` (default: the row's own, in order)."""
        claims = self.claims if claims is None else claims
        if len(cis) != len(claims):
            raise ValueError(f"row {self.id}: {len(cis)} intervals for {len(claims)} claims")
        if not claims:
            return UNTESTABLE, []
        vs = [verdict(ci, c) for ci, c in zip(cis, claims, strict=True)]
        return combine(vs), vs

    def text(self) -> str:
        """How the row's verdict is decided, in words."""
        if not self.claims:
            return "no paper figure to compare with: no verdict"
        parts = [c.text() for c in self.claims]
        s = "; ".join(f"({i + 1}) {p}" for i, p in enumerate(parts)) if len(parts) > 1 else parts[0]
        if self.per:
            s = f"per {self.per}: " + s
        if len(parts) > 1 or self.per:
            s += ". The row: differs if any claim differs, holds if all hold, else inconclusive here"
        return s


RULES: dict[str, Rule] = {r.id: r for r in (
    Rule("1", "Loss comes from a few heavy experts",
         "\"the 0.15 rule substitutes 7.5% of expert calls where substituting every miss substitutes 8.5%, and "
         "cuts the perplexity increase from 5.67% to 0.35%\": the rule removes most of the loss while substituting "
         "about as many calls", SPEC,
         (Claim("share of substitute-all's perplexity change the 0.15 rule removes (%; the paper's 94%)", 1,
                null=MOST, unit="%"),
          Claim("share of substitute-all's substituted calls the 0.15 rule spares (%; the paper's 12%; substituting "
                "more calls than substitute-all is a share below 0)", -1, null=MOST, unit="%"))),
    Rule("2a", "Mass hypothesis across policies",
         "\"across policies that always fetch the first choice, substituted mass and perplexity increase on the "
         "same inputs correlate with Pearson r ~ 0.92\"", SPEC,
         (Claim("Pearson r of mass per token and perplexity change across the distinct policies (policies making "
                "the same decisions on the exact model's routing counted once)", 1, point=PAPER_R),)),
    Rule("2b", "Mass hypothesis per input (window)",
         "the mass hypothesis fails per input: \"mass does not predict which inputs lose\" (no figure)",
         "the paper, as quoted in the project's brief",
         (Claim("Pearson r of mass per token and perplexity change across the windows", -1, null=R_SMALL),),
         per="distinct policy"),
    Rule("3", "Experiment B: few heavy vs many light substitutions at equal mass",
         "\"at equal substituted mass a few heavy substitutions hurt more than many light ones\"",
         "the paper, as quoted in the project's brief",
         (Claim("heavy band's perplexity change minus the light band's (points)", 1),),
         note="the paper's own decision rule gave no verdict on Experiment B: it reports the direction, not a "
              "test that settles it"),
    Rule("4a", "Admission overall: Quality-First vs the 0.15 rule",
         "\"background admission lowered perplexity by 0.3-1.5%\"", "the paper, as quoted in the project's brief",
         (Claim("Quality-First's perplexity change minus the 0.15 rule's (points)", -1),)),
    Rule("4b", "Admission around topic changes",
         "\"admission helps most right after topic changes\" (no figure)", "the paper, as quoted in the project's brief",
         (Claim("Quality-First's perplexity change minus the rule's in the first tokens after a switch (points)", -1),
          Claim("that early gap minus the same gap later in the segment (points)", -1))),
    Rule("5", "Quality-First / Speed-First speed over fetch-every-miss",
         "\"Quality-First and Speed-First are 2.5-3.0x faster per token than fetch-every-miss at +0.7-1.5% "
         "perplexity\"", SPEC,
         (Claim("time per token of fetch-every-miss over the policy's", 1, null=1.0, inside=PAPER_SPEED, unit="x"),),
         per="host preset and policy (Quality-First, Speed-First)"),
    Rule("5q", "F5's perplexity: Quality-First against the 0.15 rule",
         "Quality-First's perplexity is 0.5-0.8% below the 0.15 rule's", "the paper's F5, as quoted in the project's brief",
         (Claim("Quality-First's perplexity change minus the 0.15 rule's (points; the statistic of 4a, against "
                "F5's range)", -1, inside=PAPER_QF_VS_RULE),)),
    Rule("5s", "F5's perplexity: Speed-First against Quality-First",
         "Speed-First's perplexity shows no significant increase (over Quality-First)",
         "the paper's F5, as quoted in the project's brief",
         (Claim("Speed-First's perplexity change minus Quality-First's (points)", -1),)),
    Rule("6", "Greedy generation agreement with the exact model",
         "an agreement test on prompts from each domain (no paper figure)", "the project's brief", ()),
    Rule("2c", "The page's own check: admission pairs, does the loss follow the mass?",
         "no claim of the paper's: 2a's mass hypothesis applied to each with/without-admission pair (less "
         "substituted mass, less loss)", "this page (from 2a)",
         (Claim("loss with admission minus without (points), signed by the mass change (x -1 when admission "
                "lowers the mass)", 1),), per="distinct pair whose mass-change interval excludes 0", own=True),
)}
MEMORY = "-mem"  # the suffix of a row measured at equal device memory (`at_equal_memory`)
EQUAL_SLOTS = " (equal slots)"
EQUAL_MEMORY = " (equal device memory)"


def at_equal_memory(rule: Rule) -> Rule:
    """The same claim measured at equal device memory: its id with MEMORY, its name saying so."""
    return dataclasses.replace(rule, id=rule.id + MEMORY, finding=rule.finding + EQUAL_MEMORY)


# The admission rows twice: at equal slots (every policy the column's C slots per layer; the id as before) and at
# equal device memory (the admission policy with a bounded copy pool, at the slots `capacities_for_budget` leaves it
# at the bytes that hold the 0.15 rule's C; `memory`), each placed after its equal-slots row.
_ADMISSION = ("4a", "4b", "5", "5q")
_rows = {}
for _id, _r in RULES.items():
    if _id in _ADMISSION:
        _rows[_id] = dataclasses.replace(_r, finding=_r.finding + EQUAL_SLOTS)
        _m = at_equal_memory(_r)
        _rows[_m.id] = _m
    else:
        _rows[_id] = _r
_rows["7"] = Rule(
    "7", "The page's own finding: routing toward residents against the 0.15 rule's substitution, at equal device "
    "memory and equal miss rate",
    "no claim of the paper's: at the same device memory and the same rate of fetched misses, does re-routing the "
    "selection toward resident experts (Cache-Prior, Skliar et al. arXiv 2412.00099; CACHE_ROUTE, colibri "
    "docs/CACHE_ROUTE.md; docs/policies.md 'Additions (4)') cost less perplexity than the 0.15 rule's substitution?",
    "this page",
    (Claim("Cache-Prior's perplexity change minus the 0.15 rule's (points), lambda calibrated to the rule's "
           "fetched-miss rate", -1),
     Claim("CACHE_ROUTE's perplexity change minus the 0.15 rule's (points), its window M calibrated to the rule's "
           "fetched-miss rate", -1)),
    own=True)
RULES = _rows
PAPER_ROWS = tuple(r for r in RULES if not RULES[r].own)
OWN_ROWS = tuple(r for r in RULES if RULES[r].own)
