"""llama.cpp's routing of a GGUF against the checkpoint's: reports/llamacpp_routing.md and .json.

`python scripts/llamacpp_routing.py [--model DIR] [--max-tokens N] [--window W]` records the same text from
a Qwen3-MoE checkpoint (runtime/tools/record.py) and with llama.cpp from GGUFs of it
(runtime/tools/gguf_export.py, runtime/tools/llamacpp.py), and compares cell by cell (token, layer)
(runtime/tools/llamacpp_compare.py): an F32 GGUF with flash attention off and an F32 KV cache (the
recorder's default), the same with llama.cpp's defaults (flash attention auto, F16 KV), an F16 GGUF, and
the Q8_0 and Q4_0 GGUFs of llama.cpp's own quantizer (the routing their users get). Per setting: cells
compared, top-k sets equal, differing sets and how many of those are router near-ties, near-tie cells in
all, the largest probability and gate-weight differences. Without --model: the demo model when it is built
(make model), else a random checkpoint of the demo's shape (4 layers, 64 experts, top-8). The text:
tests/data/kernel_source.txt (the tests' frozen text, a former version of the kernel source; the random
checkpoint's tokenizer is trained on it).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEXT = ROOT / "tests" / "data" / "kernel_source.txt"

from runtime.core.errors import ArgumentParser  # noqa: E402
from runtime.formats.trace import load_trace  # noqa: E402
from runtime.tools.gguf_export import export_gguf, quantize_gguf  # noqa: E402
from runtime.tools.llamacpp import LlamaSettings, peak_rss_mib, record_gguf  # noqa: E402
from runtime.tools.llamacpp_compare import NEAR_TIE, build_checkpoint, compare  # noqa: E402
from runtime.tools.record import record_trace  # noqa: E402
from runtime.tools.reports import write_report  # noqa: E402

log = logging.getLogger("llamacpp_routing")

# name -> (GGUF type: f32, f16 or a quantizer type, exact context), in the report's order
SETTINGS = {
    "F32, flash attention off, F32 KV (recorder default)": ("f32", True),
    "F32, llama.cpp defaults (flash attention auto, F16 KV)": ("f32", False),
    "F16 GGUF, flash attention off, F32 KV": ("f16", True),
    "Q8_0 GGUF (llama.cpp quantizer), flash attention off, F32 KV": ("q8_0", True),
    "Q4_0 GGUF (llama.cpp quantizer), flash attention off, F32 KV": ("q4_0", True),
}


def default_model(work: Path) -> tuple[Path, str]:
    """The demo model when built, else a random checkpoint of its shape; and what it is."""
    from runtime.tools.tinymodel import is_complete, model_dir

    demo = model_dir("demo")
    if is_complete(demo):
        return demo, f"the demo model ({demo})"
    path = build_checkpoint(work / "random-demo-shape", layers=4, hidden=128, experts=64, top_k=8,
                            moe_intermediate=64, vocab_size=1024, texts=(TEXT.read_text(),))
    return path, "a random checkpoint of the demo's shape (4 layers, hidden 128, 64 experts, top-8, routers of " \
                 "logit spread about 2; llamacpp_compare.build_checkpoint)"


def parse_args(argv: list[str] | None, description: str):
    """--model, --max-tokens, --window (this script's and scripts/gguf_emulation.py's), with warnings logged."""
    p = ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="a Qwen3-MoE checkpoint directory (default: see above)")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=256)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv, __doc__.splitlines()[0])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, what = (Path(a.model), f"{a.model}") if a.model else default_model(work)
        text = TEXT
        t0 = time.perf_counter()
        hf = load_trace(record_trace(model, text, work / "hf.parquet", a.max_tokens, window=a.window,
                                     router_scores=True, max_memory=8))
        hf_s = time.perf_counter() - t0
        ggufs = {"f32": export_gguf(model, work / "m.f32.gguf", "f32"), "f16": export_gguf(model, work / "m.f16.gguf", "f16")}
        for q in ("q8_0", "q4_0"):
            ggufs[q] = quantize_gguf(ggufs["f32"], work / f"m.{q}.gguf", q)
        rows = []
        for name, (kind, exact) in SETTINGS.items():
            out = work / f"{kind}-{exact}.parquet"
            t0 = time.perf_counter()
            record_gguf(ggufs[kind], text, out, a.max_tokens, window=a.window, router_scores=True,
                        settings=LlamaSettings(exact=exact))
            seconds = time.perf_counter() - t0
            agreement = compare(hf, load_trace(out))
            rows.append({"setting": name, "gguf": kind, "exact_context": exact, "gguf_bytes": ggufs[kind].stat().st_size,
                         "record_seconds": round(seconds, 2), **agreement.as_dict()})
            log.warning("%s: %d/%d sets equal, %d differ (%d near-ties)", name, agreement.topk_equal, agreement.cells,
                        agreement.differ, agreement.differ_near_tie)
    data = {"model": what, "tokens": hf.T, "layers": hf.L, "experts": hf.E, "top_k": hf.k, "window": a.window,
            "near_tie_relative": NEAR_TIE, "hf_record_seconds": round(hf_s, 2), "settings": rows,
            "peak_rss_mib": round(peak_rss_mib())}
    lines = [
        f"Model: {what}. Text: tests/data/kernel_source.txt, first {hf.T} tokens in windows of "
        f"{a.window}; {hf.L} MoE layers, {hf.E} experts, top-{hf.k}: {hf.T * hf.L} (token, layer) cells per setting.",
        "",
        ("A random checkpoint's weights are not a trained model's: how far quantization moves a trained router "
         "is for a rerun with --model (the demo model is used when built: make model)." if "random" in what else ""),
        "",
        f"A cell is a router near-tie when the checkpoint's k-th and (k+1)-th probabilities are within {NEAR_TIE} "
        "of the k-th (relative). Probabilities: softmax of each trace's router scores; weights: expert by expert "
        "on cells whose sets agree.",
        "",
        "| setting | GGUF bytes | sets equal | sets differ | of which near-ties | near-tie cells | max prob diff | "
        "max weight diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['gguf_bytes']:,} | {r['topk_equal']:,}/{r['cells']:,} | {r['differ']:,} | "
                     f"{r['differ_near_tie']:,} | {r['near_ties']:,} | {r['max_prob_diff']:.2e} | "
                     f"{r['max_weight_diff']:.2e} |")
    lines += ["", f"Peak RSS of the script: {data['peak_rss_mib']} MiB. Recording times (s): checkpoint "
              f"{data['hf_record_seconds']}, llama.cpp " + ", ".join(f"{r['gguf']}: {r['record_seconds']}" for r in rows)
              + "."]
    write_report("llamacpp_routing", "llama.cpp's routing of a GGUF against the checkpoint's", data, "\n".join(lines))


if __name__ == "__main__":
    main()
