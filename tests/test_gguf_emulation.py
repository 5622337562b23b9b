"""A GGUF file as the emulation's model (runtime/backends/gguf.py): transformers' public GGUF loader, dequantized.

A small random Qwen3-MoE checkpoint (runtime/tools/llamacpp_compare.py `build_checkpoint`) is exported to an
F32 GGUF (runtime/tools/gguf_export.py): loaded through `hfmodel.load` it is the checkpoint's model, the same
token ids, the same routing and the same logits bit for bit (an F32 GGUF holds the checkpoint's float32 values
unchanged and both run in the same torch code, so no tolerance is needed; a wrong size or routing field read
from the GGUF changes them by far more). llama.cpp's own Q8_0 quantizer's GGUF loads as its dequantized
weights (each tensor equals the gguf package's dequantization of its blocks) and so differs from the F32 one.
Bad input (not a GGUF, another architecture, no such file, above --max-memory) is one line naming the file,
exit 2, nothing written. End to end: a GGUF and a text -> `expertsweep record` -> a sweep on that trace with
the GGUF emulated -> an answer with the `x llama.cpp` column. Skips without the llamacpp extra (gguf, and
llama-cpp-python for recording and quantizing).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from runtime import cli
from runtime.tools.llamacpp_compare import SAMPLE_TEXT, build_checkpoint

TEXT = SAMPLE_TEXT + "<|endoftext|>" + SAMPLE_TEXT[::-1] + SAMPLE_TEXT.upper() * 2
WINDOW = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The checkpoint, its F32 GGUF and the text (three times TEXT: 12 windows): (dir, gguf, text)."""
    pytest.importorskip("gguf")
    from runtime.tools.gguf_export import export_gguf

    root = tmp_path_factory.mktemp("gguf")
    ckpt = build_checkpoint(root / "ckpt", texts=(SAMPLE_TEXT, TEXT))
    (root / "g").mkdir()  # alone in its folder: nothing of the checkpoint beside it
    gguf_path = export_gguf(ckpt, root / "g" / "tiny.gguf")
    text = root / "g" / "text.txt"
    text.write_text(TEXT * 3)
    return ckpt, gguf_path, text


@pytest.fixture(scope="module")
def q8_0(model):
    """llama.cpp's Q8_0 quantization of the F32 GGUF."""
    pytest.importorskip("llama_cpp")
    from runtime.tools.gguf_export import quantize_gguf

    _, gguf_path, _ = model
    return quantize_gguf(gguf_path, gguf_path.with_name("tiny.q8_0.gguf"), "q8_0")


def _forward(m, windows: np.ndarray):
    """Logits [n, W, V] and the routing (ids, weights, ranking [T, L, E]) of the exact model."""
    from runtime.backends import hfmodel

    with torch.inference_mode():
        logits = m.model(input_ids=torch.from_numpy(windows), use_cache=False).logits
    ids, weights, ranking, _ = hfmodel.record(m, windows, m.E)
    return logits, ids, weights, ranking


def test_f32_gguf_is_the_checkpoints_model(model):
    from runtime.backends import hfmodel

    ckpt, gguf_path, text = model
    hf, gg = hfmodel.load(ckpt, max_memory=4), hfmodel.load(gguf_path, max_memory=4)
    assert (gg.num_layers, gg.E, gg.k, gg.layer_ids) == (hf.num_layers, hf.E, hf.k, hf.layer_ids) == (2, 16, 4, (0, 1))
    assert gg.dtype == torch.float32 and not gg.streamed and gg.model_dir == gguf_path
    ids_hf, _ = hfmodel.read_tokens(hf, text)
    ids_gg, _ = hfmodel.read_tokens(gg, text)
    assert np.array_equal(ids_hf, ids_gg) and 0 in ids_gg.tolist()  # the special token's text became its id
    windows = hfmodel.to_windows(ids_hf, None, WINDOW, "text")
    got, want = _forward(gg, windows), _forward(hf, windows)
    assert torch.equal(got[0], want[0])  # logits, bit for bit (module docstring)
    for a, b in zip(got[1:], want[1:], strict=True):  # top-k ids, gate weights, full ranking
        assert np.array_equal(a, b)


def test_q8_0_gguf_loads_as_its_dequantized_weights(model, q8_0):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from runtime.backends import hfmodel

    _, gguf_path, text = model
    f32, q8 = hfmodel.load(gguf_path, max_memory=4), hfmodel.load(q8_0, max_memory=4)
    reader = GGUFReader(str(q8_0))
    tensors = {t.name: t for t in reader.tensors}
    checked = 0
    for gguf_name, param in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                             ("blk.1.ffn_down_exps.weight", "model.layers.1.mlp.experts.experts.down_proj")):
        t = tensors[gguf_name]
        assert t.tensor_type.name == "Q8_0"
        want = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type)))
        got = q8.model.get_parameter(param).detach()
        assert torch.equal(got, want.reshape(got.shape))  # the loader dequantized it
        assert not torch.equal(got, f32.model.get_parameter(param).detach())  # and Q8_0 moved the values
        checked += 1
    assert checked == 2
    windows = hfmodel.to_windows(hfmodel.read_tokens(f32, text)[0], None, WINDOW, "text")
    nll_f32 = hfmodel.run_stream(f32, windows)
    nll_q8 = hfmodel.run_stream(q8, windows)
    assert np.abs(nll_q8 - nll_f32).max() > 0  # the quantized model's perplexity is its own


def _emulate(argv: list[str], capsys) -> tuple[int, str, str]:
    """`expertsweep emulate ARGV`: its exit status (0 when it returns), stderr and stdout."""
    try:
        cli.main(["emulate", *argv])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    got = capsys.readouterr()
    return code, got.err, got.out


def _llama_moe_gguf(path: Path) -> Path:
    """A GGUF of architecture `llama` with experts (how Mixtral's GGUFs are written): one the emulation refuses."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case", ["not a gguf", "another architecture", "no such file", "above max memory"])
def test_bad_gguf_is_one_line_exit_2_nothing_written(model, tmp_path, capsys, case):
    _, gguf_path, text = model
    extra: list[str] = []
    if case == "not a gguf":
        bad = tmp_path / "x.gguf"
        bad.write_text("not a model")
        expect = f"--model {bad}: not a GGUF file"
    elif case == "another architecture":
        bad = _llama_moe_gguf(tmp_path / "mixtral.gguf")
        expect = f"--model {bad}: GGUF architecture 'llama'"
    elif case == "no such file":
        bad = tmp_path / "nope.gguf"
        expect = f"--model {bad}: no such file"
    else:
        bad, extra = gguf_path, ["--max-memory", "0.0001"]
        expect = f"--model {bad}: loading it dequantized to float32 needs about"
    out = tmp_path / "nll.parquet"
    code, err, _ = _emulate(["--model", str(bad), "--text", str(text), "--policy", "rule-0.15", "--nll-out", str(out),
                          *extra], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("expertsweep: error: " + expect), err
    assert not out.exists()


@pytest.mark.parametrize("case", ["not a gguf", "another architecture"])
def test_a_sweep_on_a_bad_gguf_is_one_line_before_any_trial(model, tmp_path, case):
    from tests.sweep_fixtures import run_driver, write_config

    _, _, text = model
    if case == "not a gguf":
        bad = tmp_path / "x.gguf"
        bad.write_text("not a model")
        expect = f"model = {bad}: not a GGUF file"
    else:
        bad = _llama_moe_gguf(tmp_path / "mixtral.gguf")
        expect = f"model = {bad}: GGUF architecture 'llama'"
    cfg = write_config(tmp_path, trace=None, calib_trace=None)
    out = tmp_path / "out"
    proc = run_driver(cfg, out, "--model", str(bad), "--text", str(text), "--ray-address", "local",
                      "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}", timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and lines[-1].startswith("expertsweep: error: " + expect), proc.stderr[-2000:]
    assert not any("Traceback" in ln for ln in lines) and not out.exists()  # refused before Ray starts


def test_emulate_a_gguf_warm_from_its_llamacpp_trace_states_its_peak_rss(model, tmp_path, capsys):
    """llama.cpp's recording of the GGUF (architecture qwen3moe) warms the emulation of that GGUF (qwen3_moe)."""
    pytest.importorskip("llama_cpp")
    _, gguf_path, text = model
    trace = tmp_path / "calib.parquet"
    cli.main(["record", "--model", str(gguf_path), "--text", str(text), "--out", str(trace)])
    capsys.readouterr()
    code, err, out = _emulate(["--model", str(gguf_path), "--text", str(text), "--policy", "rule-0.15", "--json",
                               "--initial-residency", f"warm:{trace}"], capsys)
    assert code == 0 and "expertsweep emulate: peak RSS" in err, err
    assert json.loads(out)["initial_residency"] == f"warm:{trace}"


@pytest.mark.slow
def test_a_gguf_and_a_text_give_a_trace_a_sweep_and_an_answer(model, tmp_path, capsys):
    """The README's three commands: record the GGUF with llama.cpp, sweep that trace with the GGUF emulated,
    read the answer (with the `x llama.cpp` column)."""
    pytest.importorskip("llama_cpp")
    import yaml

    from tests.sweep_fixtures import ledger, run_driver

    _, gguf_path, text = model
    trace = tmp_path / "my.parquet"
    cli.main(["record", "--model", str(gguf_path), "--text", str(text), "--out", str(trace)])
    capsys.readouterr()
    cfg = tmp_path / "gguf.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "gguf", "hosts": ["rtx3090"], "trials": 4, "max_failures": 1, "seed": 0,
        "emulation": {"rungs": [], "max_full": 2}, "ppl_budgets_pct": [50.0],
        "baselines": {"policies": ["fetch-every-miss", "rule-0.15", "llamacpp-lru", "llamacpp-ncmoe"]},
        "space": {"rule": {"choices": ["threshold", "substitute_all"]}, "tau": {"low": 0.05, "high": 0.5, "log": True},
                  "evict": {"choices": ["lfu", "lru"]}, "vram_budget_GiB": "auto"}}))
    out = tmp_path / "out"
    proc = run_driver(cfg, out, "--trace", str(trace), "--model", str(gguf_path), "--text", str(text),
                      "--ray-address", "local", "--num-cpus", "2", "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}",
                      timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    emulated = [r for r in ledger(out) if r["fidelity"] == "emulation" and r["status"] == "ok"]
    assert emulated and {r["spec"]["model"] for r in emulated} == {str(gguf_path)}  # the GGUF itself, emulated
    assert all(r["ppl_change_pct"] is not None and r["exact_perplexity"] > 1 for r in emulated)
    ans = pd.read_csv(out / "answer.csv")
    assert len(ans) == 1 and ans["policy"].notna().all() and ans["speed_ratio_vs_llamacpp"].notna().all()
    table = proc.stdout[proc.stdout.index("The answer"):]
    head = [c.strip() for c in next(ln for ln in table.splitlines() if ln.startswith("| host")).strip("|").split("|")]
    row = [c.strip() for c in next(ln for ln in table.splitlines() if ln.startswith("| rtx3090")).strip("|").split("|")]
    assert float(row[head.index("x llama.cpp")]) == pytest.approx(float(ans["speed_ratio_vs_llamacpp"].iloc[0]), abs=0.01)


def test_the_engine_decodes_a_gguf_as_the_emulation_evaluates_it(model, capsys):
    """`--backend engine` on a GGUF (token by token, runtime/backends/engine) against the emulation: the same
    counters, the same perplexity (both run the same dequantized float32 model)."""
    _, gguf_path, text = model
    got = {}
    for backend in ("emulation", "engine"):
        code, err, out = _emulate(["--model", str(gguf_path), "--text", str(text), "--policy", "rule-0.15",
                                   "--max-tokens", "256", "--backend", backend, "--json"], capsys)
        assert code == 0, err
        got[backend] = json.loads(out)
    from runtime.backends import COUNTER_NAMES

    emulation, engine = got["emulation"], got["engine"]
    counts = [c for c in COUNTER_NAMES if not c.endswith("_mass")]  # the masses: float32 gate weights summed in
    # another order (token by token against batched), as tests/test_contract.py compares them
    assert [emulation[c] for c in counts] == [engine[c] for c in counts]
    for c in set(COUNTER_NAMES) - set(counts):
        assert engine[c] == pytest.approx(emulation[c], rel=1e-6, abs=1e-9)
    assert emulation["fetches"] > 0 and emulation["substitutions"] > 0
    assert engine["perplexity"] == pytest.approx(emulation["perplexity"], rel=1e-5)
