"""scripts/demo_builds.py's --build parsing: TinySpec fields typed like the demo's, `aux` for the router loss,
and a one-line exit naming the flag and the value for anything else (the builds themselves take minutes
each: docs/tiny_models.md "Builds compared")."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.tools import tinymodel
from tests.test_cuda_paths import load_script

FIELDS = dataclasses.asdict(tinymodel.SPECS["demo"])


def test_build_fields_are_typed_like_the_demo():
    db = load_script("demo_builds")
    assert db.parse_build("", FIELDS) == {}
    got = db.parse_build("aux=0.01,seed=2,steps=1600", FIELDS)
    assert got == {"router_aux_loss_coef": 0.01, "seed": 2, "steps": 1600}
    assert type(got["seed"]) is int and type(got["router_aux_loss_coef"]) is float
    assert dataclasses.replace(tinymodel.SPECS["demo"], **got).seed == 2
    # every default build is a valid one
    assert all(isinstance(db.parse_build(b, FIELDS), dict) for b in db.DEFAULT_BUILDS)


@pytest.mark.parametrize("text, says", [("nope=1", "'nope=1' is not FIELD=VALUE"), ("seed", "'seed' is not FIELD=VALUE"),
                                        ("seed=one", "seed = 'one': expected int")])
def test_bad_build_is_one_line(text, says):
    db = load_script("demo_builds")
    with pytest.raises(SystemExit) as exc:
        db.parse_build(text, FIELDS)
    msg = str(exc.value)
    assert msg.startswith(f"demo_builds: --build {text!r}: ") and says in msg and "\n" not in msg
