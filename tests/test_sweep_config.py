"""The sweep config's key table (sweep/config.py): one row per YAML key, and the reading derived from it."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.core.errors import InputError
from runtime.core.spec import RUN_FIELD_BY_NAME
from sweep import config as C

SPACE = {"rule": "threshold", "tau": {"low": 0.05, "high": 0.5}, "capacity_fraction": 0.25}
BASE = {"trace": "t.parquet", "space": SPACE}
# a bad value for each key, and what its one-line message says after "x.yaml: <key> = <value>"
BAD = {
    "space": ({"rule": "nope"}, ".rule = 'nope'"), "model": ("", "must be a non-empty string"),
    "text": (3, "must be a non-empty string"), "calib_text": ("t.parquet", ""),
    "model_shape": ("", "must be a non-empty string"), "name": ("a/b", "use letters, digits"),
    "calib_trace": ("", "must be a non-empty string"), "model_resource": ("a:b", "use letters, digits"),
    "max_memory_GiB": ("lots", "must be a positive number of GiB or 'auto'"), "dtype": ("fp8", "must be one of"),
    "trace": (3, "expected a trace file"), "hosts": ([], "must be a non-empty list"),
    "max_tokens": (0, "must be an integer >= 2"), "trials": (-1, "must be an integer >= 0"),
    "population": (1, "must be an integer >= 2"), "seed": (1.5, "must be an integer >= 0"),
    "max_failures": ("2", "must be an integer >= 0"), "sampler": ("cmaes", "(choose from tpe, nsga2)"),
    "objectives": (["mass_per_token"], "must be [time_per_token_s, mass_per_token]"),
    "batch": (0, "must be an integer >= 1"), "task_seconds": (0, "must be a positive number"),
    "baselines": ({"policies": ["nope"]}, ".policies = ['nope'] (choose from"),
    "emulation": ({"eta": 1}, ".eta = 1 must be an integer >= 2"),
    "ppl_budgets_pct": ([], "must be a non-empty list of positive numbers"),
}


def test_one_row_per_yaml_key_with_its_default_and_help():
    names = [k.name for k in C.SWEEP_KEYS]
    assert len(set(names)) == len(names) and set(names) == set(BAD)
    assert all(k.help and k.kind in ("str", "int", "number", "choice", "run", "custom") for k in C.SWEEP_KEYS)
    assert all(k.reader is not None for k in C.SWEEP_KEYS if k.kind == "custom")
    cfg = C.from_dict({"space": SPACE}, "x.yaml")
    for k in C.SWEEP_KEYS:
        if k.name != "space":  # the row's default is the config's when the key is absent
            assert getattr(cfg, k.field) == k.default, k.name
        if k.kind == "run":  # a RunSpec field keeps RunSpec's default
            assert k.default == RUN_FIELD_BY_NAME[k.field].default, k.name
    # the fields without a row are set by a reader or by the sweep, never read from the file
    rowless = {f.name for f in dataclasses.fields(C.SweepConfig)} - {k.field for k in C.SWEEP_KEYS}
    assert rowless == {"baseline_capacity_fraction", "source", "vram_budget_auto", "budget_notes", "space_spec"}


def test_unknown_and_missing_keys_name_the_table():
    with pytest.raises(InputError, match=r"^x\.yaml: unknown key 'hosst' \(choose from (\w+, )+\w+\)$") as e:
        C.from_dict({**BASE, "hosst": 1}, "x.yaml")
    assert str(e.value).split("(choose from ")[1].rstrip(")").split(", ") == sorted(k.name for k in C.SWEEP_KEYS)
    with pytest.raises(InputError, match=r"^x\.yaml: space is required$"):
        C.from_dict({"trace": "t.parquet"}, "x.yaml")


@pytest.mark.parametrize("key", sorted(BAD))
def test_every_key_refuses_a_bad_value_in_one_line_naming_file_key_and_value(key):
    value, says = BAD[key]
    data = {**BASE, "text": "t.parquet"} if key == "calib_text" else BASE
    with pytest.raises(InputError) as e:
        C.from_dict({**data, key: value}, "x.yaml")
    msg = str(e.value)
    assert "\n" not in msg and says in msg, msg
    assert msg.startswith(f"x.yaml: {key}"), msg
    if not isinstance(value, dict):  # a nested key's message names the nested key and value (in `says`)
        assert f" = {value!r}" in msg or f" = {value}" in msg, msg


def test_a_run_key_is_checked_by_runspecs_row():
    for k in (k for k in C.SWEEP_KEYS if k.kind == "run"):
        bad = BAD[k.name][0] if k.name != "calib_text" else 3
        with pytest.raises(InputError) as got:
            C.from_dict({**BASE, k.name: bad}, "x.yaml")
        with pytest.raises(InputError) as want:
            RUN_FIELD_BY_NAME[k.field].check(bad, f"x.yaml: {k.name}")
        assert str(got.value) == str(want.value), k.name


def test_nested_keys_set_their_fields():
    cfg = C.from_dict({**BASE, "name": None, "batch": 3, "task_seconds": 1, "max_tokens": 4096,
                       "baselines": {"policies": ["quality-first"], "capacity_fraction": 0.3},
                       "emulation": {"rungs": [512], "cpus": 4}, "ppl_budgets_pct": [2, 0.5],
                       "hosts": "a, b", "space": {k: v for k, v in {**SPACE, "vram_budget_GiB": "auto"}.items() if k != "capacity_fraction"}},
                      "x.yaml")
    assert cfg.name == "sweep" and cfg.batch == 3 and cfg.task_seconds == 1.0 and isinstance(cfg.task_seconds, float)
    assert (cfg.baseline_policies, cfg.baseline_capacity_fraction) == (("quality-first",), 0.3)
    assert cfg.emulation == C.Emulation(True, (512,), 3, 8, True, 4) and cfg.ppl_budgets_pct == (0.5, 2.0)
    assert [h.name for h in cfg.hosts] == ["a", "b"] and cfg.vram_budget_auto
    # a key sees the keys read before it: emulation's rungs stay below max_tokens
    with pytest.raises(InputError, match=r"x\.yaml: emulation\.rungs = \[4096\]: every rung must be below max_tokens"):
        C.from_dict({**BASE, "max_tokens": 4096, "emulation": {"rungs": [4096]}}, "x.yaml")


def test_overrides_are_read_by_the_same_rows_naming_the_flag():
    cfg = C.from_dict(BASE, "x.yaml")
    out = C.with_overrides(cfg, trials=3, batch="4", hosts="a,b", seed=None, name="run-1")
    assert (out.trials, out.batch, [h.name for h in out.hosts], out.seed, out.name) == (3, 4, ["a", "b"], 0, "run-1")
    for kw, message in ((dict(trials=-1), "--trials = -1 must be an integer >= 0"),
                        (dict(batch="x"), "--batch = 'x' must be an integer >= 1"),
                        (dict(seed=-2), "--seed = -2 must be an integer >= 0"),
                        (dict(hosts=""), "--hosts = [] must be a non-empty list of host names")):
        with pytest.raises(InputError) as e:
            C.with_overrides(cfg, **kw)
        assert str(e.value) == message


def test_key_table_lists_every_key_once():
    table = C.key_table().splitlines()
    assert table[:2] == ["| key | default | what |", "|---|---|---|"]
    assert [row.split(" | ")[0] for row in table[2:]] == [f"| `{k.name}`" for k in C.SWEEP_KEYS]
    assert all(row.count(" | ") == 2 for row in table[2:])  # a | in a help text is escaped


def test_the_docs_key_table_is_the_generated_one():
    """docs/sweep.md's table of YAML keys is `python -m sweep.config`'s (the field table), not a copy by hand."""
    from pathlib import Path

    from sweep.config import key_table

    page = (Path(__file__).resolve().parents[1] / "docs" / "sweep.md").read_text()
    assert key_table().strip() in page
