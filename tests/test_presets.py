"""The named admission presets (quality-first, speed-first) carry the copy pool the engine needs for background
admission, one buffer per MoE layer (docs/policies.md, "Additions (3)"): at equal device memory they keep far more
slots than the same policies with an unbounded pool, which stays expressible on every command line
(`--copy-buffers unbounded`, or `off` as a sweep space writes it) and in a sweep space (`copy_buffers: off`)."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.backends import resolve
from runtime.cli import build_emulate_parser
from runtime.core.errors import InputError
from runtime.core.policy import PRESETS, policies_from_flags
from runtime.core.spec import RunSpec
from runtime.formats import costmodel
from sweep import config as sweep_config
from sweep import ladder
from sweep.space import parse_space

ADMISSION = ("quality-first", "speed-first")


def _shape() -> costmodel.ModelShape:
    """Top-8 of 64 experts on 4 MoE layers: an unbounded pool is charged L x k x d = 32 expert buffers, 8 slots
    per layer, where one buffer per layer costs 1 slot: a gap of 7 slots by construction."""
    base = costmodel.load_model_shape("qwen3-next-80b-a3b")
    return dataclasses.replace(base, name="presets[L=4,E=64,k=8]", num_layers=4, num_experts=64, top_k=8)


def test_admission_presets_carry_one_copy_buffer_per_layer():
    for name in ADMISSION:
        assert PRESETS[name].copy_buffers == 1 and PRESETS[name].beta is not None, name
        assert PRESETS[name].label().endswith(" + buffers=1"), PRESETS[name].label()


def test_presets_get_more_slots_than_the_unbounded_pool_at_equal_memory():
    """The sweep's equal-memory budget (`vram_budget_GiB: auto`, resolved on the shape) and the slots the
    backends' resolve code gives each named baseline there: the preset one slot per layer fewer than
    fetch-every-miss, the unbounded form L x k x d buffers fewer."""
    shape = _shape()
    cfg = sweep_config.from_dict({"trace": "t.parquet", "baselines": {"policies": ["fetch-every-miss", *ADMISSION]},
                                  "space": {"rule": "threshold", "tau": {"low": 0.05, "high": 0.5},
                                            "vram_budget_GiB": "auto"}}, "x.yaml")
    cfg = sweep_config.resolve_vram_budget(cfg, shape)
    capacity = cfg.baseline_capacity()
    assert set(capacity) == {"vram_budget_GiB"}

    def slots(policy) -> int:  # noqa: ANN001
        spec = RunSpec(policy=policy, trace="t.parquet", **capacity)
        caps = resolve.capacities(spec, shape.num_layers, shape.num_experts, shape.top_k, shape)
        assert len(set(caps.tolist())) == 1
        return int(caps[0])

    full = slots(PRESETS["fetch-every-miss"])
    assert full == 16  # 25% of 64 experts
    for name, params in zip(ADMISSION, ladder.baseline_params(list(ADMISSION), capacity), strict=True):
        assert params["copy_buffers"] == 1, name  # the sweep's baseline runs the preset as it is
        preset, unbounded = PRESETS[name], dataclasses.replace(PRESETS[name], copy_buffers=None)
        assert slots(preset) == full - 1
        assert slots(unbounded) == full - shape.top_k * preset.admission_delay == 8
        assert slots(preset) - slots(unbounded) == 7, name


@pytest.mark.parametrize("word", ["unbounded", "off", "Unbounded"])
def test_the_unbounded_pool_is_a_flag_value_overriding_the_preset(word):
    parser = build_emulate_parser()
    got = policies_from_flags(parser.parse_args(["--policy", "quality-first", "--policy", "speed-first",
                                                 "--copy-buffers", word]))
    assert {n: p.copy_buffers for n, p in got.items()} == {"quality-first": None, "speed-first": None}
    assert got["quality-first"] == dataclasses.replace(PRESETS["quality-first"], copy_buffers=None)
    kept = policies_from_flags(parser.parse_args(["--policy", "quality-first"]))  # not given: the preset's
    assert kept["quality-first"].copy_buffers == 1
    two = policies_from_flags(parser.parse_args(["--policy", "speed-first", "--copy-buffers", "2"]))
    assert two["speed-first"].copy_buffers == 2


def test_a_bad_copy_buffers_value_is_one_line_naming_the_flag():
    with pytest.raises(InputError, match=r"--copy-buffers = 'lots' is not an integer \(or unbounded \| off\)"):
        build_emulate_parser().parse_args(["--policy", "quality-first", "--copy-buffers", "lots"])
    with pytest.raises(InputError, match=r"--copy-buffers = 0 must be in \[1, inf\]"):
        policies_from_flags(build_emulate_parser().parse_args(["--policy", "quality-first", "--copy-buffers", "0"]))


def test_the_sweep_space_keeps_its_unbounded_choice():
    """`copy_buffers: off` (fixed, a choice, or `off: true` beside a range) is the unbounded pool, None."""
    base = {"rule": "threshold", "tau": {"low": 0.05, "high": 0.5}, "beta": 0.5, "capacity_fraction": 0.25}
    fixed = parse_space({**base, "copy_buffers": "off"}, "x.yaml: space")
    assert fixed["copy_buffers"].values() == (None,)
    choice = parse_space({**base, "copy_buffers": {"choices": [1, 2, "off"]}}, "x.yaml: space")
    assert None in choice["copy_buffers"].values() and 1 in choice["copy_buffers"].values()
    ranged = parse_space({**base, "copy_buffers": {"low": 1, "high": 4, "off": True}}, "x.yaml: space")
    assert ranged["copy_buffers"].off


def test_findings_run_the_papers_policies_at_equal_slots_and_the_presets_pool_at_equal_memory():
    """The findings test the paper's claims: at equal slots its admission policies as the spec defines them (no
    copy pool), at equal device memory the presets as they are (one buffer per layer, charged to the budget)."""
    from runtime.tools.findings import experiments, memory

    paper = experiments.preset_policies()
    for name in ADMISSION:
        assert paper[name] == dataclasses.replace(PRESETS[name], copy_buffers=None)
        assert memory.pooled(name) == PRESETS[name]
    assert paper["rule-0.15"] == PRESETS["rule-0.15"] and paper["fetch-every-miss"] == PRESETS["fetch-every-miss"]
