"""A GGUF emulated dequantized by transformers, against the checkpoint and against llama.cpp's own routing of it.

`python scripts/gguf_emulation.py [--model DIR] [--max-tokens N] [--window W]` writes reports/gguf_emulation.md
and .json. From a Qwen3-MoE checkpoint (default: the demo model when built, else a random checkpoint of its
shape: scripts/llamacpp_routing.py `default_model`) it writes F32, Q8_0 and Q4_0 GGUFs (runtime/tools/gguf_export.py,
llama.cpp's own quantizer) and loads each as the emulation does (runtime/backends/gguf.py: transformers'
GGUF loader, dequantized to float32). Per GGUF, on the same windows of tests/data/kernel_source.txt:
- the dequantized model against the checkpoint: the largest logit difference, the exact perplexity of each, and
  the routing cell by cell (runtime/tools/llamacpp_compare.py `compare`: top-k sets, near-ties, probabilities);
- the dequantized model's routing against llama.cpp's recording of the same GGUF (runtime/tools/llamacpp.py,
  the recorder's exact context): how far the emulated model routes from the trace a sweep screens on.
The load's seconds and this process's peak RSS are stated; and the peak RSS of loading a larger random GGUF
(4 layers, hidden 512, 64 experts of 512: about 0.8 GiB in F32), each load in a fresh process (`--peak-of`),
in float32 and bf16, beside `gguf.load_GiB`'s estimate that --max-memory is checked against.
"""

from __future__ import annotations

import logging
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
TEXT = ROOT / "tests" / "data" / "kernel_source.txt"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from llamacpp_routing import default_model, parse_args  # noqa: E402

from runtime.backends import hfmodel  # noqa: E402
from runtime.formats.trace import load_trace  # noqa: E402
from runtime.tools.gguf_export import export_gguf, quantize_gguf  # noqa: E402
from runtime.tools.llamacpp import peak_rss_mib, record_gguf  # noqa: E402
from runtime.tools.llamacpp_compare import NEAR_TIE, build_checkpoint, compare  # noqa: E402
from runtime.tools.reports import write_report  # noqa: E402

log = logging.getLogger("gguf_emulation")


def routed(m: hfmodel.Loaded, windows: np.ndarray):
    """The exact model's trace (with router_scores) over `windows`, its NLL [n, W-1] and its logits [n, W, V]."""
    ids, w, rank, _, nll, scores = hfmodel.record_routing(m, windows, m.E, scores=True)
    with torch.inference_mode():
        logits = torch.cat([m.model(input_ids=torch.from_numpy(windows[a:a + 4]), use_cache=False).logits
                            for a in range(0, len(windows), 4)])
    return hfmodel.make_trace(m, ids, w, rank, windows, "", "gguf_emulation", router_scores=scores), nll, logits


def peak_of(path: Path, dtype: str) -> dict:
    """Load `path` as the emulation does in this (fresh) process: the peak RSS (VmHWM) above the RSS before the
    load, the model's bytes and `load_GiB`'s estimate, in MiB."""
    from gguf import GGUFReader

    from runtime.backends import gguf

    def status(key: str) -> float:  # /proc/self/status, MiB
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key + ":"))
        return int(line.split()[1]) / 1024

    # ru_maxrss survives fork and exec (the parent's peak): reset the high-water mark instead (Linux clear_refs 5)
    Path("/proc/self/clear_refs").write_text("5")
    base = status("VmRSS")
    m = hfmodel.load(path, dtype, max_memory=64)
    peak = status("VmHWM")
    model = sum(t.numel() * t.element_size() for t in m.model.parameters()) / 2**20
    estimate = gguf.load_GiB(path, GGUFReader(str(path)), m.dtype) * 1024
    return {"dtype": str(m.dtype).removeprefix("torch."), "gguf_mib": round(path.stat().st_size / 2**20, 1),
            "model_mib": round(model, 1), "peak_rss_of_load_mib": round(peak - base, 1),
            "load_estimate_mib": round(estimate, 1)}


def peaks(work: Path) -> list[dict]:
    """`peak_of` a larger random GGUF in float32 and bf16, each in its own process."""
    import json
    import subprocess

    ckpt = build_checkpoint(work / "big", layers=4, hidden=512, experts=64, top_k=8, moe_intermediate=512,
                            vocab_size=320)
    (work / "bigg").mkdir()
    path = export_gguf(ckpt, work / "bigg" / "big.gguf", "f32")
    rows = []
    for dtype in ("auto", "bf16"):
        proc = subprocess.run([sys.executable, __file__, "--peak-of", str(path), dtype], capture_output=True, text=True,
                              check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.argv[1:2] == ["--peak-of"]:
        import json

        print(json.dumps(peak_of(Path(sys.argv[2]), sys.argv[3])))
        return
    a = parse_args(argv, __doc__.splitlines()[0])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, what = (Path(a.model), a.model) if a.model else default_model(work)
        hf = hfmodel.load(model, "fp32", max_memory=8)
        windows = hfmodel.tokenize_file(hf, TEXT, a.max_tokens, a.window)[0]
        hf_trace, hf_nll, hf_logits = routed(hf, windows)
        del hf
        (work / "g").mkdir()
        ggufs = {"F32": export_gguf(model, work / "g" / "m.gguf", "f32")}
        for q in ("q8_0", "q4_0"):
            ggufs[q.upper()] = quantize_gguf(ggufs["F32"], work / "g" / f"m.{q}.gguf", q)
        rows = []
        for kind, path in ggufs.items():
            t0 = time.perf_counter()
            m = hfmodel.load(path, max_memory=8)
            load_s = time.perf_counter() - t0
            ids = hfmodel.tokenize_file(m, TEXT, a.max_tokens, a.window)[0]
            trace, nll, logits = routed(m, windows)
            del m
            out = work / f"llama-{kind}.parquet"
            record_gguf(path, TEXT, out, a.max_tokens, window=a.window, router_scores=True)
            vs_checkpoint, vs_llama = compare(hf_trace, trace), compare(trace, load_trace(out))
            rows.append({"gguf": kind, "gguf_bytes": path.stat().st_size, "load_seconds": round(load_s, 2),
                         "same_token_ids": bool(np.array_equal(ids, windows)),
                         "max_logit_diff_vs_checkpoint": float((logits - hf_logits).abs().max()),
                         "perplexity": math.exp(nll.mean()), "checkpoint_perplexity": math.exp(hf_nll.mean()),
                         "routing_vs_checkpoint": vs_checkpoint.as_dict(), "routing_vs_llamacpp": vs_llama.as_dict()})
            log.warning("%s: ppl %.4f (checkpoint %.4f), vs llama.cpp %d/%d sets equal", kind, rows[-1]["perplexity"],
                        rows[-1]["checkpoint_perplexity"], vs_llama.topk_equal, vs_llama.cells)
        load_peaks = peaks(work)
    data = {"model": what, "tokens": hf_trace.T, "layers": hf_trace.L, "experts": hf_trace.E, "top_k": hf_trace.k,
            "window": a.window, "near_tie_relative": NEAR_TIE, "ggufs": rows, "peak_rss_mib": round(peak_rss_mib()),
            "load_peaks": load_peaks}
    lines = [
        f"Model: {what}. Text: tests/data/kernel_source.txt, first {hf_trace.T} tokens in windows of {a.window}; "
        f"{hf_trace.L} MoE layers, {hf_trace.E} experts, top-{hf_trace.k}: {hf_trace.T * hf_trace.L} (token, layer) "
        "cells. Each GGUF is loaded as the emulation loads it (transformers' GGUF loader, dequantized to float32: "
        "runtime/backends/gguf.py) and run in torch; llama.cpp's column is its own recording of the same GGUF "
        "(flash attention off, F32 KV cache: the recorder's default).",
        "",
        ("A random checkpoint's weights are not a trained model's: how far quantization moves a trained model is "
         "for a rerun with --model (the demo model is used when built: make model)." if "random" in what else ""),
        "",
        f"Sets: top-k sets equal per (token, layer) cell; near-ties: the reference's k-th and (k+1)-th probabilities "
        f"within {NEAR_TIE} relative (reference: the checkpoint, resp. the dequantized model).",
        "",
        "| GGUF | bytes | same token ids | max logit diff vs checkpoint | perplexity (checkpoint) | sets equal vs "
        "checkpoint | of differing, near-ties | sets equal vs llama.cpp's routing | of differing, near-ties | "
        "max prob diff vs llama.cpp |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c, ll = r["routing_vs_checkpoint"], r["routing_vs_llamacpp"]
        lines.append(f"| {r['gguf']} | {r['gguf_bytes']:,} | {r['same_token_ids']} | {r['max_logit_diff_vs_checkpoint']:.3g} "
                     f"| {r['perplexity']:.4f} ({r['checkpoint_perplexity']:.4f}) | {c['topk_equal']:,}/{c['cells']:,} "
                     f"| {c['differ_near_tie']}/{c['differ']} | {ll['topk_equal']:,}/{ll['cells']:,} | "
                     f"{ll['differ_near_tie']}/{ll['differ']} | {ll['max_prob_diff']:.2e} |")
    lines += ["", f"Peak RSS of the script: {data['peak_rss_mib']} MiB. Load seconds (transformers, dequantizing): "
              + ", ".join(f"{r['gguf']}: {r['load_seconds']}" for r in rows) + ".",
              "", "Loading a larger random F32 GGUF (4 layers, hidden 512, 64 experts of 512), each in a fresh process: "
              "peak RSS above the RSS before the load against the model's bytes and the estimate --max-memory is checked against "
              "(gguf.load_GiB: the file, float32 tensors and the model).", "",
              "| dtype | GGUF MiB | model MiB | peak RSS above the RSS before the load, MiB | load estimate MiB |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['dtype']} | {r['gguf_mib']} | {r['model_mib']} | {r['peak_rss_of_load_mib']} | "
              f"{r['load_estimate_mib']} |" for r in load_peaks]
    write_report("gguf_emulation", "A GGUF emulated dequantized, against its checkpoint and llama.cpp's routing",
                 data, "\n".join(lines))


if __name__ == "__main__":
    main()
