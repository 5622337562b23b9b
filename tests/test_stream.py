"""Checkpoints larger than RAM (runtime/stream.py, the layer-major passes of runtime/hfmodel.py).

The streamed emulation's decisions, counters, NLL and recorded traces are checked against the
in-memory emulation in tests/test_contract.py (the `streamed` column, every family and policy).
Here: the loader reads exactly what `from_pretrained` loads, every layer is read once per pass
whatever the number of policies, nothing stays loaded after a pass, the engine fills its host
store from the shards, `--dtype auto` keeps the checkpoint's dtype, and bad flags are one-line
errors.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from runtime import hfmodel, stream
from runtime.adapters import family_of, moe_blocks
from runtime.engine import Engine
from runtime.errors import InputError
from runtime.policy import PRESETS
from runtime.spec import RunSpec
from tests.tiny_hf import FAMILIES, build_tiny


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    return {fam: build_tiny(fam, d / fam) for fam in FAMILIES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_loader_reads_what_from_pretrained_loads(ckpts, family, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = ckpts[family]
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, local_files_only=True).state_dict()
    cfg = AutoConfig.from_pretrained(d, local_files_only=True)
    model = stream.skeleton(cfg, dtype)
    fam = family_of(cfg)
    blocks = moe_blocks(model, fam)
    w = stream.build_weights(model, stream.Shards(d), [getattr(b, fam.router_attr) for b in blocks],
                             [getattr(b, fam.experts_attr) for b in blocks])
    assert {f"experts.{i}" for i in range(len(blocks))} <= set(w.units) and "routers" in w.units
    w.load_all()
    got = model.state_dict()
    assert set(got) == set(ref)
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def test_each_layer_is_read_once_per_pass(ckpts, text, tmp_path):
    """Three policies and the exact model advance layer by layer together: one read of each layer for the
    warm-start calibration and one for the evaluation, not one per policy; nothing stays loaded."""
    from runtime import emulate

    calib = tmp_path / "calib.txt"
    calib.write_text(text.read_text()[::-1])
    m = hfmodel.load(ckpts["qwen3_moe"], max_memory=1e-6)
    assert m.streamed
    specs = [RunSpec(policy=PRESETS[p], model=str(m.model_dir), text=str(text), calib_text=str(calib), capacity=3,
                     window=16, max_tokens=256, max_memory_GiB=1e-6) for p in ("rule-0.15", "quality-first", "substitute-all")]
    res = emulate.evaluate_group(m, specs)
    assert len(res) == 3 and all(r.extra["streamed"] for r in res)
    layer_units = [u for u in m.weights.units if u.startswith(("layer.", "experts."))]
    assert layer_units and all(m.weights.reads[u] == 2 for u in layer_units), dict(m.weights.reads)
    assert m.weights.reads["routers"] == 1
    assert not m.weights.loaded & set(layer_units)
    dec = m.model.get_decoder()
    assert all(p.is_meta for p in dec.layers[0].self_attn.parameters())
    w = m.weights  # everything twice but the resident routers and final norm, read once
    assert w.bytes_read == 2 * w.nbytes() - w.nbytes("routers") - w.nbytes("model.norm")


def test_engine_fills_its_store_from_the_shards(ckpts):
    """Above --max-memory the engine reads the non-expert part whole and each layer's experts straight into
    its host store: the same store as from a model loaded whole."""
    full = Engine(hfmodel.load(ckpts["qwen3_moe"]), "cpu")
    part = Engine(hfmodel.load(ckpts["qwen3_moe"], max_memory=1e-6), "cpu")
    try:
        assert part.m.streamed and not full.m.streamed
        for (a_gu, a_d), (b_gu, b_d) in zip(full.store.fused, part.store.fused, strict=True):
            assert torch.equal(a_gu, b_gu) and torch.equal(a_d, b_d)
        assert not {u for u in part.m.weights.loaded if u.startswith("experts.")}
        x = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            la = full.m.model(input_ids=x, use_cache=False).logits
            lb = part.m.model(input_ids=x, use_cache=False).logits
        assert torch.equal(la, lb)
    finally:
        full.close()
        part.close()


def test_dtype_auto_keeps_the_checkpoints_dtype(tmp_path):
    d = build_tiny("qwen3_moe", tmp_path / "fp32")
    from transformers import AutoModelForCausalLM

    bf = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(d, local_files_only=True).to(torch.bfloat16).save_pretrained(bf)
    for f in d.iterdir():
        if "token" in f.name:
            (bf / f.name).write_bytes(f.read_bytes())
    assert hfmodel.load(bf).dtype == torch.bfloat16
    assert hfmodel.load(bf, "fp32").dtype == torch.float32
    assert hfmodel.load(d).dtype == torch.float32


@pytest.mark.parametrize("value", ["abc", "-1", "0", "inf"])
def test_bad_max_memory_is_a_one_line_error(value):
    with pytest.raises(InputError, match=f"--max-memory = '{value}' must be"):
        stream.resolve_max_memory(value)


def test_auto_is_below_what_is_available():
    assert 0 < stream.resolve_max_memory("auto") < stream.available_memory_GiB()


@pytest.mark.parametrize("flags,msg", [(["--max-memory", "lots"], "--max-memory = 'lots' must be"),
                                       (["--dtype", "fp8"], "--dtype = 'fp8' must be one of auto")])
def test_record_cli_rejects_bad_flags_without_output(ckpts, text, tmp_path, flags, msg):
    out = tmp_path / "t.parquet"
    r = subprocess.run([sys.executable, "-m", "runtime.record", "--model", str(ckpts["qwen3_moe"]), "--text", str(text),
                        "--out", str(out), *flags], capture_output=True, text=True)
    assert r.returncode == 2 and not out.exists()
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("expertsweep: error:")]
    assert len(err) == 1 and msg in err[0], r.stderr


def test_record_streamed_equals_in_memory(ckpts, text, tmp_path):
    import numpy as np

    from runtime.record import record_trace
    from runtime.trace import load_trace

    a = load_trace(record_trace(ckpts["qwen2_moe"], text, tmp_path / "a.parquet", max_tokens=200, window=20, lookahead=3))
    b = load_trace(record_trace(ckpts["qwen2_moe"], text, tmp_path / "b.parquet", max_tokens=200, window=20, lookahead=3,
                                max_memory=1e-6))
    for f in ("topk_ids", "topk_weights", "ranking", "lookahead"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
