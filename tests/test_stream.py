"""Checkpoints larger than RAM (runtime/backends/stream.py, the layer-major passes of runtime/backends/hfmodel.py).

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

from runtime.backends import hfmodel, stream
from runtime.backends.adapters import family_of, moe_blocks
from runtime.backends.engine import Engine
from runtime.core.errors import InputError
from runtime.core.policy import PRESETS, PolicyConfig
from runtime.core.spec import RunSpec
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
    from runtime.backends import emulate

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

    from runtime.formats.trace import load_trace
    from runtime.tools.record import record_trace

    a = load_trace(record_trace(ckpts["qwen2_moe"], text, tmp_path / "a.parquet", max_tokens=200, window=20, lookahead=3))
    b = load_trace(record_trace(ckpts["qwen2_moe"], text, tmp_path / "b.parquet", max_tokens=200, window=20, lookahead=3,
                                max_memory=1e-6))
    for f in ("topk_ids", "topk_weights", "ranking", "lookahead"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


# ---------------------------------------------------------------- device mode (--device; stream.LayerPipe)

DEVICE_POLICIES = {  # substitutions, admissions, drops, host compute, low-bit copies, both prefetches
    "quality-first": PRESETS["quality-first"],
    "drop": PolicyConfig(rule="threshold", tau=0.3, fallback="drop"),
    "host": PolicyConfig(rule="threshold", tau=0.3, fallback="host", beta=0.3),
    "lowbit-4": PolicyConfig(rule="first_choice", fallback="lowbit", lowbit_bits=4, lowbit_group=16, beta=0.5),
    "lookahead": PolicyConfig(rule="threshold", tau=0.3, prefetch="lookahead", prefetch_n=3),
    "oracle": PolicyConfig(rule="fetch_all", prefetch="oracle", evict="lru"),
}


def _group(ckpt, text, tmp_path, tag, **fields):
    import pyarrow.parquet as pq

    from runtime.backends import get_backend

    nll = tmp_path / f"{tag}-nll.parquet"
    specs = [RunSpec(policy=p, name=n, model=str(ckpt), text=str(text), capacity=3, window=16, max_tokens=128,
                     record_decisions=True, nll_out=str(nll), **fields) for n, p in DEVICE_POLICIES.items()]
    return get_backend("emulation").evaluate_many(specs), pq.read_table(nll).to_pandas()


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_device_mode_equals_in_memory(ckpts, text, tmp_path, family, monkeypatch):
    """--device cpu with every layer streamed runs the device path (LayerPipe: staging, copy, bind,
    release) on the host: every decision and counter identical to the in-memory run, NLL within 1e-5,
    each layer through the pipe once per pass."""
    import numpy as np

    acquired = []
    real_acquire = stream.LayerPipe.acquire

    def acquire(self, i):
        acquired.append(i)
        real_acquire(self, i)

    monkeypatch.setattr(stream.LayerPipe, "acquire", acquire)
    ref, nll_a = _group(ckpts[family], text, tmp_path, "mem")
    assert not acquired
    got, nll_b = _group(ckpts[family], text, tmp_path, "dev", max_memory_GiB=1e-6, device="cpu")
    L = ref[0].num_layers
    passes = len(acquired) // L
    assert passes >= 2 and acquired == list(range(L)) * passes  # the held-out calibration pass, the evaluation
    for a, b in zip(ref, got, strict=True):
        assert b.extra["streamed"] and not a.extra["streamed"]
        assert a.counters == b.counters, a.policy
        for f in ("kind", "served", "slot"):
            np.testing.assert_array_equal(a.decisions[f], b.decisions[f], err_msg=f"{a.policy} {f}")
    assert any(r.counters["lowbit_computes"] for r in ref) and any(r.counters["prefetches"] for r in ref)
    assert list(nll_a.columns) == list(nll_b.columns)
    for c in nll_a.columns:
        assert np.abs(nll_a[c].to_numpy() - nll_b[c].to_numpy()).max() <= 1e-5, c


def test_device_mode_overlaps_and_releases_each_layer(ckpts, text, monkeypatch):
    """While layer i computes, layer i + 1's read and copy have been started and layer i - 1's device copy
    is gone (its parameters back on the meta device); after the pass no layer is loaded and each was read
    once."""
    import numpy as np

    pipes = []
    real_init = stream.LayerPipe.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        pipes.append(self)

    monkeypatch.setattr(stream.LayerPipe, "__init__", init)
    m = hfmodel.load(ckpts["qwen2_moe"], max_memory=1e-6, device="cpu")
    assert m.streamed and m.device == torch.device("cpu")
    layers = m.model.get_decoder().layers
    seen = []

    def hook(i):
        def pre(mod, args, kwargs):
            nxt = i + 1 >= len(layers) or i + 1 in pipes[-1].futures
            routers = {id(getattr(o, a)) for e in m.weights.units["routers"] for o, a in e.aliases}  # resident
            seen.append((i, all(not p.is_meta for p in mod.parameters()),
                         i == 0 or all(p.is_meta for p in layers[i - 1].parameters() if id(p) not in routers), nxt))
        return pre

    handles = [lay.register_forward_pre_hook(hook(i), with_kwargs=True) for i, lay in enumerate(layers)]
    try:
        windows = np.arange(64, dtype=np.int64).reshape(4, 16) % 90
        nll = hfmodel.run_lanes(m, windows, [hfmodel.Lane()], batch_windows=2)[0]
    finally:
        for h in handles:
            h.remove()
    assert nll.shape == (4, 15) and np.isfinite(nll).all()
    assert [s[0] for s in seen] == [0, 0, 1, 1]  # two batches per layer, layer-major
    assert all(s[1] and s[2] for s in seen), seen
    assert all(s[3] for s in seen if s[0] == 0), seen  # layer 1 on its way while layer 0 computes
    units = [u for u in m.weights.units if u.startswith(("layer.", "experts."))]
    assert all(m.weights.reads[u] == 1 for u in units) and not m.weights.loaded & set(units)


def test_record_cli_device_cpu_equals_in_memory(ckpts, text, tmp_path):
    import numpy as np

    from runtime.formats.trace import load_trace
    from runtime.tools.record import main as record_main

    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    common = ["--model", str(ckpts["deepseek_v3"]), "--text", str(text), "--max-tokens", "160", "--window", "16",
              "--lookahead", "2"]
    record_main([*common, "--out", str(a)])
    record_main([*common, "--out", str(b), "--device", "cpu", "--max-memory", "0.000001"])
    ta, tb = load_trace(a), load_trace(b)
    for f in ("topk_ids", "topk_weights", "ranking", "lookahead"):
        np.testing.assert_array_equal(getattr(ta, f), getattr(tb, f), err_msg=f)


def test_bad_device_is_a_one_line_error_without_output(ckpts, text, tmp_path):
    from runtime.tools.record import record_trace

    out = tmp_path / "t.parquet"
    r = subprocess.run([sys.executable, "-m", "runtime.record", "--model", str(ckpts["qwen3_moe"]), "--text", str(text),
                        "--out", str(out), "--device", "tpu"], capture_output=True, text=True)
    assert r.returncode == 2 and not out.exists()
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("expertsweep: error:")]
    assert len(err) == 1 and "--device = 'tpu' must be cpu or cuda" in err[0], r.stderr
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="--device = cuda: no CUDA device is available"):
            record_trace(ckpts["qwen3_moe"], text, out, device="cuda")
        assert not out.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_checks.sh runs it)")
def test_cuda_streamed_equals_cuda_resident_and_cpu(ckpts, text, tmp_path, monkeypatch):
    """fp32 on the GPU: every layer streamed through the device (device budget capped) makes the decisions of
    the model resident on the device and its NLL within 1e-5; against the CPU run the NLL is within 1e-3."""
    import numpy as np

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ck = ckpts["qwen3_moe"]
    res, nll_r = _group(ck, text, tmp_path, "resident", device="cuda")
    monkeypatch.setenv(hfmodel.DEVICE_MEMORY_ENV, "0.000001")
    got, nll_s = _group(ck, text, tmp_path, "streamed", device="cuda")
    assert got[0].extra["streamed"] and not res[0].extra["streamed"]
    for a, b in zip(res, got, strict=True):
        assert a.counters == b.counters, a.policy
        for f in ("kind", "served", "slot"):
            np.testing.assert_array_equal(a.decisions[f], b.decisions[f], err_msg=f"{a.policy} {f}")
    _, nll_c = _group(ck, text, tmp_path, "cpu")
    for c in nll_r.columns:
        assert np.abs(nll_r[c].to_numpy() - nll_s[c].to_numpy()).max() <= 1e-5, c
    assert np.abs(nll_r["nll_exact"].to_numpy() - nll_c["nll_exact"].to_numpy()).max() <= 1e-3
