"""Fixtures shared by the test modules: the text the emulation, engine and fallback tests evaluate, and the sweep
tests' micro model (tests/sweep_fixtures.py; defined here so that the session builds it once, not once per module
that imports it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sweep_fixtures import micro_model_fixture  # noqa: F401 - the fixture is used by name

# a text nobody tuned anything on: a former version of this project's kernel source
TEXT = (Path(__file__).resolve().parent / "data" / "kernel_source.txt").read_text()


@pytest.fixture(scope="session")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text(TEXT)
    return p
