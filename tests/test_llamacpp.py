"""Recording with llama.cpp from a GGUF (runtime/tools/llamacpp.py) against the checkpoint's own recording.

A small random Qwen3-MoE checkpoint (runtime/tools/llamacpp_compare.py `build_checkpoint`, the project's
byte-level BPE tokenizer) is exported to an F32 GGUF (runtime/tools/gguf_export.py) and the same text is
recorded from both: llama.cpp's tokenizer gives the checkpoint's token ids, and with flash attention off and
an F32 KV cache the top-k set of every (token, layer) cell equals the checkpoint's except at router
near-ties (k-th and (k+1)-th probabilities within NEAR_TIE, relative: counted, printed), with probabilities
and gate weights within PROB_TOL. Bad input (no bindings, not a GGUF, not a MoE GGUF, a flag llama.cpp does
not take) is one line, exit 2, no output file. Tests needing the bindings skip without the llamacpp extra.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from runtime import cli
from runtime.formats.trace import load_trace
from runtime.tools.llamacpp import MISSING
from runtime.tools.llamacpp_compare import NEAR_TIE, SAMPLE_TEXT, build_checkpoint, compare

WINDOW = 64
# f32 arithmetic in two implementations (ggml against torch): measured differences are below 1e-6; 1e-5 leaves
# room for other CPUs' summation orders and is far below what a wrong normalisation or a wrong expert makes
# (differences of order 0.1)
PROB_TOL = 1e-5
TEXT = SAMPLE_TEXT + "<|endoftext|>" + SAMPLE_TEXT[::-1] + SAMPLE_TEXT.upper() * 2


def _record(argv: list[str], capsys) -> tuple[int, str]:
    """`expertsweep record ARGV`: its exit status (0 when it returns) and its stderr."""
    try:
        cli.main(["record", *argv])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The checkpoint, its F32 GGUF and the text: (dir, gguf, text)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from runtime.tools.gguf_export import export_gguf

    root = tmp_path_factory.mktemp("llamacpp")
    ckpt = build_checkpoint(root / "ckpt", texts=(SAMPLE_TEXT, TEXT))
    gguf_path = export_gguf(ckpt, root / "ckpt.gguf")
    text = root / "text.txt"
    text.write_text(TEXT)
    return ckpt, gguf_path, text


@pytest.fixture(scope="module")
def hf_trace(model, tmp_path_factory):
    from runtime.tools.record import record_trace

    ckpt, _, text = model
    out = tmp_path_factory.mktemp("hf") / "hf.parquet"
    return load_trace(record_trace(ckpt, text, out, window=WINDOW, router_scores=True, max_memory=4))


def test_llamacpp_tokenizer_gives_the_checkpoints_token_ids(model):
    from transformers import AutoTokenizer

    from runtime.tools.llamacpp import LlamaModel, read_info

    ckpt, gguf_path, text = model
    want = AutoTokenizer.from_pretrained(ckpt)(TEXT, add_special_tokens=False)["input_ids"]
    with LlamaModel(read_info(gguf_path), WINDOW) as llama:
        got = llama.tokenize(text.read_bytes())
    assert got.tolist() == want
    assert len(want) >= 4 * WINDOW and 0 in want  # the special token's text became its id


def test_gguf_routing_equals_the_checkpoints_but_near_ties(model, hf_trace, tmp_path, capsys):
    _, gguf_path, text = model
    out = tmp_path / "llama.parquet"
    code, err = _record(["--model", str(gguf_path), "--text", str(text), "--out", str(out), "--window", str(WINDOW),
                         "--router-scores"], capsys)
    assert code == 0, err
    assert "peak RSS" in err
    got = load_trace(out)
    assert (got.meta.layer_ids, got.meta.weight_norm, got.meta.num_experts, got.meta.top_k) == \
        (hf_trace.meta.layer_ids, hf_trace.meta.weight_norm, hf_trace.meta.num_experts, hf_trace.meta.top_k)
    assert got.meta.text_sha256 == hf_trace.meta.text_sha256 and got.M == got.E
    a = compare(hf_trace, got)
    print(f"\nllama.cpp F32, flash attention off, F32 KV: {a.topk_equal}/{a.cells} top-k sets equal; "
          f"{a.differ} differ, {a.differ_near_tie} of them near-ties (relative {NEAR_TIE}); {a.near_ties} near-tie "
          f"cells in all; max |dp| {a.max_prob_diff:.2e}, max |dw| {a.max_weight_diff:.2e}")
    assert a.cells == hf_trace.T * hf_trace.L >= 4 * WINDOW * 2
    assert a.differ == a.differ_near_tie, a.first_differ  # every differing set is a router near-tie
    assert a.max_prob_diff < PROB_TOL and a.max_weight_diff < PROB_TOL
    # the ranking is the checkpoint's wherever no two neighbouring probabilities are near-tied
    p = np.sort(hf_trace.router_scores.astype(np.float64), axis=-1)
    clear = (np.diff(p, axis=-1) > 1e-4).all(axis=-1)  # [T, L]: logit gaps all above 1e-4
    assert clear.mean() > 0.5
    assert np.array_equal(got.ranking[clear], hf_trace.ranking[clear])
    assert np.allclose(got.topk_weights[clear], hf_trace.topk_weights[clear], atol=PROB_TOL, rtol=0)


def test_llamacpp_defaults_flag_changes_the_context(model, tmp_path, capsys):
    """--llamacpp-defaults (flash attention auto, F16 KV cache) computes other probabilities than the exact
    default context: the flag reaches llama.cpp."""
    _, gguf_path, text = model
    runs = {}
    for name, extra in (("exact", []), ("defaults", ["--llamacpp-defaults"])):
        out = tmp_path / f"{name}.parquet"
        code, err = _record(["--model", str(gguf_path), "--text", str(text), "--out", str(out), "--window",
                             str(WINDOW), "--router-scores", "--max-tokens", str(2 * WINDOW), *extra], capsys)
        assert code == 0, err
        runs[name] = load_trace(out)
    assert "llama.cpp defaults" in runs["defaults"].meta.source and "F32 KV" in runs["exact"].meta.source
    assert runs["exact"].T == runs["defaults"].T == 2 * WINDOW
    assert not np.array_equal(runs["exact"].router_scores, runs["defaults"].router_scores)


def test_quantized_gguf_routing_is_recorded_as_it_runs(model, hf_trace, tmp_path, capsys):
    """A Q8_0 GGUF from llama.cpp's own quantizer: smaller, recorded, its probabilities off the checkpoint's by
    far more than the F32 GGUF's (the routing its users get; reports/llamacpp_routing.md counts the sets)."""
    from runtime.tools.gguf_export import quantize_gguf

    _, gguf_path, text = model
    q8 = quantize_gguf(gguf_path, tmp_path / "ckpt.q8_0.gguf", "q8_0")
    assert q8.stat().st_size < 0.5 * gguf_path.stat().st_size
    out = tmp_path / "q8.parquet"
    code, err = _record(["--model", str(q8), "--text", str(text), "--out", str(out), "--window", str(WINDOW),
                         "--router-scores"], capsys)
    assert code == 0, err
    a = compare(hf_trace, load_trace(out))
    print(f"\nllama.cpp Q8_0: {a.differ}/{a.cells} top-k sets differ ({a.differ_near_tie} near-ties), "
          f"max |dp| {a.max_prob_diff:.2e}")
    assert a.max_prob_diff > 100 * PROB_TOL


def test_without_the_bindings_one_line_and_no_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    (tmp_path / "t.txt").write_text("hello")
    out = tmp_path / "out.parquet"
    code, err = _record(["--model", str(tmp_path / "m.gguf"), "--text", str(tmp_path / "t.txt"), "--out", str(out)],
                        capsys)
    assert code == 2
    assert err == f"expertsweep: error: {MISSING}\n"
    assert not out.exists()


@pytest.mark.parametrize("flag", [["--max-memory", "3"], ["--device", "cuda"], ["--lookahead", "2"],
                                  ["--dtype", "fp32"], ["--batch-windows", "2"]])
def test_flags_llamacpp_does_not_take_are_refused(flag, tmp_path, capsys):
    out = tmp_path / "out.parquet"
    code, err = _record(["--model", "m.gguf", "--text", "t.txt", "--out", str(out), *flag], capsys)
    assert code == 2
    assert err.startswith(f"expertsweep: error: {flag[0]} = {flag[1]}: does not apply to a .gguf --model")
    assert err.count("\n") == 1 and not out.exists()


def test_record_trace_refuses_them_too(tmp_path):
    """The Python API (record_trace) takes a .gguf and refuses the same arguments, before any work."""
    from runtime.core.errors import InputError
    from runtime.tools.record import record_trace

    with pytest.raises(InputError, match="--lookahead = 2: does not apply to a .gguf"):
        record_trace("m.gguf", "t.txt", tmp_path / "o.parquet", lookahead=2)
    with pytest.raises(InputError, match="--batch-windows = 4: does not apply to a .gguf"):
        record_trace("m.gguf", "t.txt", tmp_path / "o.parquet", batch_windows=4)
    assert not (tmp_path / "o.parquet").exists()


def test_llamacpp_defaults_needs_a_gguf(tmp_path, capsys):
    code, err = _record(["--model", str(tmp_path), "--text", "t.txt", "--out", str(tmp_path / "o.parquet"),
                         "--llamacpp-defaults"], capsys)
    assert code == 2 and "--llamacpp-defaults: applies to a .gguf --model only" in err and err.count("\n") == 1


def _bad_input(model_path: Path, tmp_path: Path, capsys) -> str:
    (tmp_path / "t.txt").write_text("hello world")
    out = tmp_path / "out.parquet"
    code, err = _record(["--model", str(model_path), "--text", str(tmp_path / "t.txt"), "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("expertsweep: error: ")
    assert not out.exists()
    return err


def test_a_file_that_is_not_a_gguf(tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    bad = tmp_path / "x.gguf"
    bad.write_text("not a model\n")
    assert "not a GGUF file" in _bad_input(bad, tmp_path, capsys)


def test_a_gguf_without_experts(tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    gguf = pytest.importorskip("gguf")
    dense = tmp_path / "dense.gguf"
    writer = gguf.GGUFWriter(str(dense), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "llama.expert_count = None" in _bad_input(dense, tmp_path, capsys)


def test_export_refuses_what_llamacpp_would_run_differently(model, tmp_path):
    """norm_topk_prob false: llama.cpp's qwen3moe renormalises anyway, so the GGUF would be another model."""
    import json

    from runtime.core.errors import InputError
    from runtime.tools.gguf_export import export_gguf

    ckpt, _, _ = model
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["norm_topk_prob"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="norm_topk_prob = False"):
        export_gguf(tmp_path, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
