"""Finding 4b: admission around topic changes, on a stream that switches domain every ~`segment` tokens.

The stream takes whole lines in turn from each domain's eval text; Quality-First and the 0.15 rule are emulated
on it and every scored token is put in its segment, early (the first `early` tokens after the switch) or later.
The statistics (`rows.topic`) resample blocks of consecutive segments, the block length chosen by the data
(`stats.choose_block` on the per-segment gaps early and later).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from runtime.core.policy import PRESETS, PolicyConfig
from runtime.tools.findings import rows as R
from runtime.tools.findings import stats
from runtime.tools.findings.experiments import Row, Setup, emulate_policies, paper_policy
from runtime.tools.findings.rules import UNTESTABLE
from runtime.tools.findings.stats import fmt_ci


def topic_stream(s: Setup, tokenizer: Any) -> tuple[str, list[int], list[str]]:
    """Text that switches domain every ~`segment` tokens; token index of each switch and its domain.

    Segments are whole lines taken in turn from each domain's eval text (code, prose, verse,
    code, ...); switch positions come from the stream's own tokenization (character offsets)."""
    lines = {d: p.read_text(encoding="utf-8").splitlines(keepends=True) for d, p in s.domains.items()}
    pos = dict.fromkeys(lines, 0)
    budget = s.max_tokens or 10**9
    parts: list[str] = []
    starts: list[int] = []  # character offsets of segment starts
    doms: list[str] = []
    total_chars, total_tok = 0, 0
    while total_tok < budget:
        progressed = False
        for d in lines:
            seg, n_tok = [], 0
            while pos[d] < len(lines[d]) and n_tok < s.segment:
                ln = lines[d][pos[d]]
                pos[d] += 1
                seg.append(ln)
                n_tok += len(tokenizer(ln, add_special_tokens=False)["input_ids"])
            if n_tok < s.segment // 2:
                continue
            text = "".join(seg)
            starts.append(total_chars)
            doms.append(d)
            parts.append(text)
            total_chars += len(text)
            total_tok += n_tok
            progressed = True
            if total_tok >= budget:
                break
        if not progressed:
            break
    stream = "".join(parts)
    enc = tokenizer(stream, add_special_tokens=False, return_offsets_mapping=True)
    offs = np.asarray([o[0] for o in enc["offset_mapping"]])
    switch_tok = [int(np.searchsorted(offs, c, side="left")) for c in starts]
    return stream, switch_tok, doms


def segment_sums(switches: list[int], rule_d: np.ndarray, qf_d: np.ndarray, early: int) -> list[np.ndarray]:
    """Per-segment sums [S-1] in rows.TOPIC_KEYS' order from per-token NLL differences [n, W-1] of the rule and
    Quality-First (scored position p >= 1 of window w is stream token w*W + p); segment 0 has no switch before
    it and is left out."""
    n, Wm1 = rule_d.shape
    W = Wm1 + 1
    tok = (np.arange(n)[:, None] * W + np.arange(1, W)[None, :]).ravel()  # [n * (W-1)]
    sw = np.asarray(switches)
    seg = np.searchsorted(sw, tok, side="right") - 1  # segment of each scored token
    dist = tok - sw[np.clip(seg, 0, None)]
    ok = seg >= 1
    n_seg = int(seg.max()) + 1
    e, la = ok & (dist < early), ok & (dist >= early)
    dr, dq, one = rule_d.ravel(), qf_d.ravel(), np.ones(tok.size)

    def per_seg(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.bincount(seg[mask], weights=x[mask], minlength=n_seg)[1:]

    return [per_seg(v, m) for v, m in ((dr, e), (dr, la), (dq, e), (dq, la), (one, e), (one, la))]


def segment_blocks(sums: list[np.ndarray], seed: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Blocks of consecutive segments: the longer of the lengths chosen on the early and the later gap."""
    rule_e, rule_l, qf_e, qf_l, n_e, n_l = sums
    early = stats.choose_block({"QF - rule, early": qf_e - rule_e}, n_e, seed)
    later = stats.choose_block({"QF - rule, later": qf_l - rule_l}, n_l, seed)
    pick = early if early["block"] >= later["block"] else later
    info = {"block": pick["block"], "stopped": pick["stopped"], "max_block": pick["max_block"],
            "check": {**early["check"], **later["check"]}}
    starts = stats.block_starts(len(n_e), info["block"])
    info["blocks"] = len(starts)
    return starts, info


def finding_topic(s: Setup, rid: str = "4b", quality_first: PolicyConfig | None = None,
                  budget: float | None = None) -> Row:
    """Row 4b (`rid`): the 0.15 rule at the column's slots against Quality-First (`quality_first`, default the
    paper's, `paper_policy`), at the column's slots or, with `budget` (GiB; row 4b-mem), at the slots that device memory leaves it
    (`capacities_for_budget`, its copy buffers charged)."""
    if len(s.domains) < 2:
        return Row(rid, "one-domain model: no topic changes", "n/a", UNTESTABLE,
                   "needs eval_<domain>.txt for >= 2 domains beside the model")
    stream, switches, doms = topic_stream(s, s.m.tokenizer)
    path: Path = s.tmp / "topic_stream.txt"
    path.write_text(stream, encoding="utf-8")
    qf_pol = paper_policy("quality-first") if quality_first is None else quality_first
    runs = emulate_policies(s, {"rule-0.15": PRESETS["rule-0.15"], "quality-first": qf_pol}, path, nll=True,
                            max_tokens=None, budget=None if budget is None else {"quality-first": budget})
    rule, qf = runs["rule-0.15"], runs["quality-first"]
    sums = segment_sums(switches, rule.nll - rule.nll_exact, qf.nll - qf.nll_exact, s.early)
    starts, blocks = segment_blocks(sums, s.seed)
    d = R.topic(starts, sums, s.seed, rid)
    T = rule.nll.shape[0] * rule.window
    n_sw = len(sums[0])
    slots = ("" if budget is None else f"at equal device memory, the rule {rule.result.capacity[0]} slots per "
             f"layer, Quality-First ({qf_pol.label()}) {qf.result.capacity[0]}: ")
    ours = slots + (f"{n_sw} switches every ~{s.segment} tokens ({T} tokens); first {s.early} tokens after a switch: 0.15 "
            f"rule {d['rule_e']:+.2f}%, Quality-First {d['qf_e']:+.2f}% (QF - rule {d['gap_e']:+.2f}); later: rule "
            f"{d['rule_l']:+.2f}%, QF {d['qf_l']:+.2f}% (QF - rule {d['gap_l']:+.2f}); early - later "
            f"{d['dd']:+.2f} points")
    ci95 = (f"(1) QF - rule early {fmt_ci(*d['gap_e_ci95'])}; (2) early - later {fmt_ci(*d['dd_ci95'])} points "
            f"(QF - rule later {fmt_ci(*d['gap_l_ci95'])})")
    d.update({"switches": n_sw, "segment_tokens": s.segment, "early_tokens": s.early, "tokens": T,
              "domains": sorted(set(doms)), "blocks": blocks,
              "slots": {"rule-0.15": int(rule.result.capacity[0]), "quality-first": int(qf.result.capacity[0])},
              "quality_first_policy": qf_pol.label()})
    method = "/".join(sorted(set(d["methods"].values())))
    grow = "" if blocks["stopped"] else ", width still growing at the longest length"
    return Row(rid, ours, ci95, d["verdict"],
               f"{n_sw} topic segments of ~{s.segment} tokens in {blocks['blocks']} blocks of {blocks['block']} "
               f"consecutive segments (length chosen by the data{grow}), {method}, {stats.N_BOOT} resamples", d)
