"""Fixtures shared by the test modules: the text the emulation, engine and fallback tests evaluate, and the sweep
tests' micro model (tests/sweep_fixtures.py; defined here so that the session builds it once, not once per module
that imports it)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.sweep_fixtures import micro_model_fixture  # noqa: F401 - the fixture is used by name

# A runner that ignores SIGTERM hands that on to every process it starts, across exec: the model build, the
# mlflow server and the Ray nodes the tests stop with SIGTERM would then run on until killed (a CI run saw a
# build ignore it for 60 s). The processes the tests start get the default disposition back.
if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

# a text nobody tuned anything on: a former version of this project's kernel source
TEXT = (Path(__file__).resolve().parent / "data" / "kernel_source.txt").read_text()


@pytest.fixture(scope="session")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text(TEXT)
    return p
