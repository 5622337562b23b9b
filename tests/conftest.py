"""Fixtures shared by the test modules: the text the emulation, engine and fallback tests evaluate."""

from __future__ import annotations

from pathlib import Path

import pytest

# a text nobody tuned anything on: this project's own kernel source
TEXT = (Path(__file__).resolve().parents[1] / "runtime" / "core" / "kernel.py").read_text()


@pytest.fixture(scope="session")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text(TEXT)
    return p
