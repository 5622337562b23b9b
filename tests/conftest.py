"""Fixtures shared by the test modules: the text the emulation, engine and fallback tests evaluate, and the sweep
tests' micro model (tests/sweep_fixtures.py; defined here so that the session builds it once, not once per module
that imports it)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from runtime.core.compiled import cache_root
from tests.sweep_fixtures import micro_model_fixture  # noqa: F401 - the fixture is used by name

# numba caches the compiled units in $EXPERTSWEEP_CACHE/numba by default (runtime/core/numba_locator.py); tests point
# EXPERTSWEEP_CACHE at temporary model caches, so the session fixes the folder once, for itself and every process it
# starts (the Ray nodes, `ray job submit`'s unpacked copies, an installed wheel): one compile per run, not one per
# temporary cache or copy
os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_root()))

# OpenMP's idle threads sleep instead of spinning, in the test processes (which import torch themselves: the entry
# points' runtime.core.threads.configure never runs in them) and every process they start, as the product's entry
# points set it for themselves. With two workers and their subprocesses on two cores, spinning threads took the CPU
# the other processes waited for (a torch loop of small matmuls on the loaded machine: 41.6 s of CPU and 250 s wall
# spinning, 1.4 s and 2.9 s passive). Set before any test module imports torch (OpenMP reads it once, at load).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A runner that ignores SIGTERM hands that on to every process it starts, across exec: the model build, the
# mlflow server and the Ray nodes the tests stop with SIGTERM would then run on until killed (a CI run saw a
# build ignore it for 60 s). The processes the tests start get the default disposition back.
if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

# a text nobody tuned anything on: a former version of this project's kernel source, its first 12,000 characters
# (~7,700 tokens of the tiny checkpoints' tokenizer). The tests evaluate at most 640 tokens of it, but a run without a
# calibration text holds out the text's last 20% as its warm start and records the exact model over it: on the
# whole file (38,442 tokens) that was ~7,700 tokens per model, 10-80x what the test evaluates.
TEXT = (Path(__file__).resolve().parent / "data" / "kernel_source.txt").read_text()[:12000]


# The modules that take longest, longest first (their summed test times; reports/suite.md lists the slowest tests,
# reports/test_suite_runs.md earlier runs):
# `make test` runs pytest-xdist with --dist loadfile --no-loadscope-reorder, so each worker takes the next whole
# module in this collection order, the long ones start at once and the short ones fill in beside them (xdist's own
# order, by number of tests, ran the few-test long modules last: they set the end of the run). The local cluster's
# module leads (its token test is the longest test, and its six others share one cluster of three nodes).
LONGEST_FIRST = ("test_sweep_cluster.py", "test_sweep_local.py", "test_gpu_checks.py", "test_findings_page.py",
                 "test_sweep_stop.py", "test_contract.py", "test_compile_once.py", "test_tinymodel.py",
                 "test_reference_cases.py", "test_exact_cli.py", "test_engine.py")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, the controller compiles (or loads and checks) the numba units once before the workers
    start: a cold compile is ~85 s of CPU, and paid inside whichever test first needs the kernel, beside the other
    workers' tests, it ran past that test's own time limit (an end-to-end sweep's 240 s) on two CPUs."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return  # a worker (the controller did it), or one process (its first test compiles, as users' runs do)
    from runtime.core import compiled
    from runtime.core.kernel import warmup
    from runtime.core.units import COSTMODEL

    warmup()
    compiled.ensure(COSTMODEL)


# `slow` tests of modules whose own file another change owns: (module, test name without parameters). The marker
# leaves them out of `make check` (pytest -m "not slow"); `make test` runs them.
SLOW_ELSEWHERE = {
    # the kernel's first compile killed at three points, then four processes at once, then a loader: several cold
    # compiles in subprocesses (test_compile_once.py keeps its golden tables, damaged caches and guards in the loop)
    ("test_compile_once.py", "test_interrupted_first_compiles_then_four_at_once_then_a_loader_decide_as_the_reference"),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if (item.path.name, item.originalname) in SLOW_ELSEWHERE:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: a module stays whole


@pytest.fixture(scope="session")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text(TEXT)
    return p
