"""Built test models, cached on disk by content and shared by every pytest worker and session.

A test model (runtime.tools.tinymodel) takes seconds to minutes of CPU to train. A module-scoped or even
session-scoped fixture builds it once per pytest-xdist worker; the sweep modules' micro model was built by each
worker that ran one of them, and the findings page's model again in every run. Here the model goes into
tinymodel's own cache layout (`models/<name>-<digest of spec, corpus and builder version>`, file-locked: concurrent
callers wait for one build) under a root that is also keyed by the builder's source files, so a change to the
builder's code builds again instead of reusing a model the old code trained:

    $EXPERTSWEEP_TEST_CACHE (default $EXPERTSWEEP_CACHE/test-models, i.e. ~/.cache/expertsweep/test-models)
        /<sha256 of runtime/tools/{tinymodel,tinyspec,tinytrain,corpus}.py, 12 hex>/models/<name>-<digest>/

A fresh clone on a fresh machine (CI) builds each model once per run; a second run on the same machine reuses it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
BUILDER_SOURCES = ("runtime/tools/tinymodel.py", "runtime/tools/tinyspec.py", "runtime/tools/tinytrain.py",
                   "runtime/tools/corpus.py")


def builder_digest() -> str:
    """sha256 of the builder's source files (12 hex digits): a new builder, a new cache root."""
    h = hashlib.sha256()
    for rel in BUILDER_SOURCES:
        path = REPO / rel
        h.update(rel.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return h.hexdigest()[:12]


def cache_root() -> Path:
    """Where the test models live (see the module docstring)."""
    env = os.environ.get("EXPERTSWEEP_TEST_CACHE")
    if env:
        base = Path(env).expanduser()
    else:
        from runtime.tools.tinymodel import cache_dir

        base = cache_dir() / "test-models"
    return base / builder_digest()


def cached_model(spec) -> Path:  # noqa: ANN001 - a runtime.tools.tinymodel.TinySpec
    """The folder of `spec`'s model, built once into the shared cache (waiting on another worker's build)."""
    from runtime.tools import tinymodel

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXPERTSWEEP_CACHE", str(cache_root()))
        path = tinymodel.ensure_model(spec, progress=False)
    logger.info("test model %s: %s", spec.name, path)
    return path
