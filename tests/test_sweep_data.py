"""The sweep on a user's checkpoint: config keys, the checkpoint digest and the trace cache (sweep/data.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runtime.core.errors import InputError
from sweep import config as sweep_config
from sweep import data
from tests.sweep_fixtures import write_config

SPACE = {"rule": {"choices": ["threshold", "first_choice"]}, "tau": {"low": 0.1, "high": 0.4},
         "capacity_fraction": 0.25}


def _cfg(**kw) -> sweep_config.SweepConfig:
    return sweep_config.from_dict({"model": "/m", "space": SPACE, **kw}, "s.yaml")


def test_model_keys_reach_the_config():
    cfg = _cfg(max_memory_GiB=6, dtype="bf16", model_resource="qwen3next", emulation={"cpus": 4})
    assert (cfg.max_memory_GiB, cfg.dtype, cfg.model_resource, cfg.emulation.cpus) == (6.0, "bf16", "qwen3next", 4)
    d = _cfg()
    assert (d.max_memory_GiB, d.dtype, d.model_resource, d.emulation.cpus) == ("auto", "auto", None, None)


@pytest.mark.parametrize("key,value,expect", [
    ("max_memory_GiB", -1, "max_memory_GiB = -1"),
    ("max_memory_GiB", "lots", "max_memory_GiB = 'lots'"),
    ("dtype", "int8", "dtype = 'int8'"),
    ("model_resource", "a:b", "model_resource = 'a:b'"),
    ("emulation", {"cpus": 0}, "emulation.cpus = 0"),
])
def test_bad_model_keys_are_one_line_errors(key, value, expect):
    with pytest.raises(InputError) as e:
        _cfg(**{key: value})
    assert expect in str(e.value) and "s.yaml" in str(e.value) and "\n" not in str(e.value)


def test_model_resource_needs_an_absolute_checkpoint_path():
    with pytest.raises(InputError, match="absolute path on the nodes offering model:q"):
        data.locate(sweep_config.from_dict({"model": "ckpt", "model_resource": "q", "space": SPACE}, "s.yaml"))
    loc = data.locate(sweep_config.from_dict({"model": "/nowhere/ckpt", "model_resource": "q", "space": SPACE}))
    assert loc.model_dir == "/nowhere/ckpt" and not loc.local  # not checked here: the files are on that node


def _checkpoint(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8, "num_experts": 4}))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in set(index["weight_map"].values()):
        with open(folder / name, "wb") as f:
            f.truncate(64 << 30)  # 64 GiB, sparse: a digest that read the shards would not finish
    return folder


def test_checkpoint_digest_names_sizes_and_mtimes(tmp_path):
    ck = _checkpoint(tmp_path / "ck")
    d0 = data.checkpoint_digest(ck)
    assert data.checkpoint_digest(ck) == d0
    shard = ck / "model-00002-of-00002.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten in place
    d1 = data.checkpoint_digest(ck)
    assert d1 != d0
    with open(shard, "r+b") as f:
        f.truncate(st.st_size + 1)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    d2 = data.checkpoint_digest(ck)
    assert d2 not in (d0, d1)
    (ck / "config.json").write_text(json.dumps({"hidden_size": 16, "num_experts": 4}))
    assert data.checkpoint_digest(ck) not in (d0, d1, d2)


@pytest.mark.slow
def test_traces_are_recorded_once_per_checkpoint_and_parameters(tmp_path, micro_model, monkeypatch):
    """A second sweep on the same checkpoint records nothing (same bytes); new recording parameters or a
    touched shard record again. The cache is $EXPERTSWEEP_CACHE/traces on the model's node (here: this one)."""
    import shutil

    import runtime.tools.record

    # a copy of its own: the shard's time is touched below, and the micro model is shared with other workers' sweeps
    micro_model = shutil.copytree(micro_model, tmp_path / "micro_model")

    monkeypatch.setenv("EXPERTSWEEP_CACHE", str(tmp_path / "cache"))
    calls = []
    real = runtime.tools.record.record_trace

    def counting(*a, **kw):
        calls.append((Path(a[1]).name, kw.get("max_tokens"), kw.get("dtype"), kw.get("max_memory")))
        return real(*a, **kw)

    monkeypatch.setattr(runtime.tools.record, "record_trace", counting)

    def prepare(out: str, max_tokens: int = 256) -> data.Inputs:
        path = write_config(tmp_path, name=out, trace=None, calib_trace=None, model=str(micro_model),
                            max_tokens=max_tokens, dtype="fp32", max_memory_GiB=0.001, space=SPACE)
        cfg = sweep_config.load_config(path)
        return data.prepare(cfg, tmp_path / out, data.locate(cfg))

    a = prepare("a")
    # the evaluated and the calibration text, with the config's dtype and memory budget (0.001: streamed)
    assert sorted(calls) == [("calib.txt", 256, "fp32", 0.001), ("eval.txt", 256, "fp32", 0.001)]
    assert Path(a.trace).parent == tmp_path / "a" / "traces" and a.digest == data.checkpoint_digest(micro_model)
    b = prepare("b")
    assert len(calls) == 2, "the second sweep recorded again"
    assert Path(a.trace).read_bytes() == Path(b.trace).read_bytes()
    assert Path(a.calib_trace).read_bytes() == Path(b.calib_trace).read_bytes()
    prepare("c", max_tokens=128)
    assert len(calls) == 4
    shard = next(micro_model.glob("*.safetensors"))
    st = shard.stat()
    try:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        prepare("d")
        assert len(calls) == 6
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
