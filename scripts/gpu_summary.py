"""Write summary.md of scripts/gpu_checks.sh from whatever its steps have produced so far.

    python scripts/gpu_summary.py RESULTS_DIR WORK_DIR

Called after every step, so a run killed at any point still returns what it measured. Reads
WORK_DIR/steps.tsv (step, status, seconds, limit), RESULTS_DIR/versions.json (scripts/gpu_env.py),
WORK_DIR/junit_*.xml (pytest), RESULTS_DIR/bench_pinned.json and bench_pageable.json
(scripts/bench_engine.py), calibrate.json (runtime.tools.calibrate --json) and generate.json
(runtime.tools.generate), and from WORK_DIR lowbit.txt, fetch_exact.json and stream.json
(scripts/gpu_exact_check.py) and graphs.json (scripts/gpu_graphs_check.py). Only the standard library: it must run whatever else is broken.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def load(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def steps(work: Path) -> list[list[str]]:
    p = work / "steps.tsv"
    if not p.is_file():
        return []
    return [ln.split("\t") for ln in p.read_text().splitlines() if ln.strip()]


def junit(p: Path) -> tuple[dict, list[str]]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    try:
        root = ET.parse(p).getroot()
    except (OSError, ET.ParseError):
        return counts, failed
    for suite in root.iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                msg = (el.get("message") or "").splitlines()
                failed.append(f"{case.get('name')}: {tag}: {msg[0][:200] if msg else ''}")
    return counts, failed


def main() -> None:
    res, work = Path(sys.argv[1]), Path(sys.argv[2])
    mode = (work / "mode").read_text().strip() if (work / "mode").is_file() else "?"
    out = [f"# Engine checks ({mode} mode)\n"]
    st = steps(work)
    bad = [s for s in st if s[1] != "ok"]
    out.append(f"Steps run: {len(st)}; all ok: {'yes' if st and not bad else 'NO'}\n")
    out.append("| step | status | seconds | limit s |")
    out.append("|---|---|---|---|")
    for s in st:
        out.append("| " + " | ".join(s + [""] * (4 - len(s))) + " |")
    v = load(res / "versions.json")
    if v:
        out.append("\n## Machine and versions\n")
        pk = v.get("packages", {})
        out.append(f"- Python {v.get('python')}, torch {pk.get('torch')} (CUDA {v.get('torch_cuda')}, cuDNN "
                   f"{v.get('cudnn')}), transformers {pk.get('transformers')}, numba {pk.get('numba')}, numpy "
                   f"{pk.get('numpy')}; GPU {v.get('gpu')}")
        out.append(f"- differs from the tested versions (constraints.txt): {v.get('skew') or 'nothing'}; missing: "
                   f"{v.get('missing') or 'nothing'}; pytest-timeout: {v.get('pytest_timeout')}")
        bad_f = {f: r for f, r in v.get("internals", {}).items() if not r.get("ok")}
        out.append(f"- transformers internals the adapters use: {'all ' + str(len(v.get('internals', {}))) + ' families ok' if not bad_f and v.get('internals') else bad_f}")
        if v.get("installed"):
            out.append(f"- installed for this run: {v['installed']}")
    for tag, title in (("cpu", "one engine test, CPU device mode"), ("exact", "engine exactness tests")):
        p = work / f"junit_{tag}.xml"
        if p.is_file():
            c, failed = junit(p)
            out.append(f"\n## {title}\n")
            out.append(f"- {c['tests']} tests, {c['failures']} failures, {c['errors']} errors, {c['skipped']} skipped")
            out.extend(f"- FAILED {f}" for f in failed[:20])
    budget = None
    for name, title in (("bench_pinned.json", "pinned host store"), ("bench_pageable.json", "pageable host store")):
        b = load(res / name)
        if not b or "policies" not in b:
            continue
        budget = b.get("vram_budget_GiB", budget)
        out.append(f"\n## Simulator vs engine, {title} ({b['device']}, {b['dtype']}, capacity {b['capacity'][0]} of "
                   f"{b['model']['experts']}, expert {b['model']['expert_bytes'] / 2**20:.2f} MiB, VRAM budget "
                   f"{b.get('vram_budget_GiB') or '-'} GiB, copies block the host: {b.get('copies_block_host')})\n")
        out.append("| policy | decode path | measured ms/token | simulated ms/token | error | fetches | admissions | stalls | stall ms/token | peak device MiB |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for n, r in b["policies"].items():
            out.append(f"| {n} | {r.get('decode_path') or '-'} | {r['measured_time_per_token_s'] * 1e3:.3f} | "
                       f"{r['simulated_time_per_token_s'] * 1e3:.3f} | "
                       f"{r['rel_error'] * 100:+.1f}% | {r['counters']['fetches']} | {r['counters']['admissions']} | "
                       f"{r['admission_stalls']} | {r['admission_stall_s_per_token'] * 1e3:.3f} | "
                       f"{r['peak_device_bytes'] / 2**20:.0f} |")
        out.append(f"\ntarget met (|error| <= 15% for fetch-every-miss, rule-0.15, quality-first): {b['target_met']}")
        if b.get("vram_budget_GiB"):
            peak = max(r["peak_device_bytes"] for r in b["policies"].values())
            out.append(f"peak device memory {peak / 2**30:.3f} GiB vs budget {b['vram_budget_GiB']:.3f} GiB: "
                       f"{'within' if peak <= b['vram_budget_GiB'] * 2**30 else 'OVER'}; CUDA context measured "
                       f"{b.get('cuda_context_bytes', 0) / 2**20:.0f} MiB (the budget was sized with "
                       f"{b.get('budget_context_bytes', 512 * 2**20) / 2**20:.0f} MiB)")
        for k, val in b.get("speedups_measured", {}).items():
            out.append(f"- speedup {k}: measured {val:.2f}x, simulated {b['speedups_simulated'][k]:.2f}x")
    c = load(res / "calibrate.json")
    if c:
        lk = c["link"]
        fic = c.get("fetch_in_context_us")
        out.append("\n## Calibration\n")
        out.append(f"- link: pinned {lk['pinned_GBps']:.2f} GB/s, pageable {lk['pageable_GBps']:.2f} GB/s; a non-blocking "
                   f"copy holds the host {lk.get('pinned_issue_us', float('nan')):.1f} us from pinned, "
                   f"{lk.get('pageable_issue_us', float('nan')):.1f} us from pageable memory")
        out.append(f"- expert fetch: isolated {c.get('fetch_isolated_us', float('nan')):.1f} us, in context "
                   f"{'-' if fic is None else f'{fic:.1f}'} us (used: {c['fetch_us']:.1f}); expert on device "
                   f"{c['device_expert_us']:.1f} us, on host {c['host_expert_us']:.1f} us; dense "
                   f"{c['dense_layer_us']:.1f} us per layer; final norm + LM head {c.get('head_us', 0):.1f} us; "
                   f"low-bit (4-bit) expert {c.get('lowbit_expert_us') or '-'} us")
    g = load(res / "generate.json")
    if g:
        out.append("\n## Greedy generation, quality-first vs exact\n")
        out.append(f"- agreement {g['agreement']:.3f} over {g['prompts']} prompts x {g['max_new_tokens']} tokens, "
                   f"{g['identical_prompts']} identical; first divergences "
                   f"{[r['first_divergence'] for r in g['per_prompt']]}; {g['time_per_token_s'] * 1e3:.2f} ms/token "
                   f"(exact, streaming every expert: {g['exact_time_per_token_s'] * 1e3:.2f}); peak device "
                   f"{g['peak_device_bytes'] / 2**20:.0f} MiB")
    out.extend(exact_checks(work))
    (res / "summary.md").write_text("\n".join(out) + "\n")


def exact_checks(work: Path) -> list[str]:
    """The low-bit line and the two exactness checks of scripts/gpu_exact_check.py."""
    out = []
    lb = work / "lowbit.txt"
    if lb.is_file():
        out += ["\n## Low-bit (hqq) fallback\n", f"- {lb.read_text().strip()}"]
    fe = load(work / "fetch_exact.json")
    if fe:
        out.append(f"\n## Bit-identical runs without debug syncs ({fe.get('device')}, {fe.get('dtype')})\n")
        if "error" in fe:
            out.append(f"- FAILED: {fe['error']}")
        else:
            for label, p in fe.get("pairs", {}).items():
                out.append(f"- {label}: bit-identical {p['bit_identical']} (max |dNLL| {p['nll_max_abs_diff']:.3g}"
                           + ("" if p.get("counters_equal") is None else f", counters equal {p['counters_equal']}")
                           + ")")
            out.append(f"- copies moved ({fe['tokens']} tokens): {fe.get('copies')}; vs the engine's exact pass "
                       f"(prefill): max |dNLL| {fe['vs_exact_pass_nll_max_abs_diff']:.3g}, perplexity change "
                       f"{fe['vs_exact_pass_ppl_change_pct']:+.4f}%")
    st = load(work / "stream.json")
    if st:
        out.append(f"\n## Streamed emulation and recording through the device ({st.get('device')}, fp32)\n")
        if "error" in st:
            out.append(f"- FAILED: {st['error']}")
        else:
            sv, dv, rv = st["streamed_vs_resident"], st["device_vs_cpu"], st["record_vs_cpu"]
            out.append(f"- streamed == resident on the device: counters equal {sv['counters_equal']}, max |dNLL| "
                       f"{sv['nll_max_abs_diff']:.3g} (limit 1e-5), streamed {sv['streamed']}")
            out.append(f"- vs the CPU run: exact max |dNLL| {dv['exact_nll_max_abs_diff']:.3g} (limit 1e-3); perplexity "
                       f"change [device, cpu] {dv['ppl_change_pct']}; fetches {dv['fetches']}")
            out.append(f"- record --device streamed vs CPU: top-k ids agree on {rv['topk_ids_agreement'] * 100:.3f}% "
                       f"of {rv['rows']} rows x layers x k (limit 99.9%)")
            out.append(f"- seconds per command: {st['seconds']}")
        out.append(f"- ok: {st.get('ok')}")
    gr = load(work / "graphs.json")
    if gr:
        out.append(f"\n## CUDA graphs on vs off ({gr.get('device')}, {gr.get('tokens')} tokens, slots {gr.get('capacity')})\n")
        for name, r in gr.get("policies", {}).items():
            out.append(f"- {name}: {r['decode_path_on']} {r['time_per_token_us_on']:.1f} us/token vs "
                       f"{r['decode_path_off']} {r['time_per_token_us_off']:.1f} ({r['speedup']:.2f}x); "
                       + ("identical NLL and counters" if not r["problems"] else "DIFFERS: " + "; ".join(r["problems"])))
        ar = gr.get("all_resident")
        if ar:
            out.append(f"- all-resident ({ar['slots']} slots): {ar['us_per_layer_on']:.1f} us per decoder layer with "
                       f"{ar['decode_path_on']}, {ar['us_per_layer_off']:.1f} eager"
                       + ("" if not ar["problems"] else "; DIFFERS: " + "; ".join(ar["problems"])))
        out.append(f"- ok: {gr.get('ok')}")
    return out


if __name__ == "__main__":
    main()
