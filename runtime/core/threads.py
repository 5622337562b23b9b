"""Thread settings of the CPU-heavy commands (model builds, emulation, findings), set by the command itself.

`configure()` is called first thing by each entry point (runtime/cli.py `main` for every `expertsweep`
subcommand and its `python -m` form, the tiny-model build's `main`, the sweep driver): it sets
`OMP_WAIT_POLICY=PASSIVE` and the thread counts (`OMP_NUM_THREADS`, `MKL_NUM_THREADS`,
`OPENBLAS_NUM_THREADS`: the CPUs this process may run on, or `EXPERTSWEEP_THREADS`) unless the
environment already sets them. OpenMP reads its wait policy once, when its runtime is loaded (libgomp:
when torch is imported), so it must run before torch is imported in the process; imported later it
changes nothing (measured: reports/threads_beside_another_job.md), and `configure` says so
in a debug log line. Why: with OpenMP's default (active) policy each idle thread spins before it sleeps, so
beside another job on a 2-core machine a training step waited on threads that were burning the other
job's core (13 s per step against ~1 s with PASSIVE).
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

ENV_THREADS = "EXPERTSWEEP_THREADS"
COUNT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure(threads: int | None = None, counts: bool = True) -> int:
    """Passive OpenMP waiting and (with `counts`) the thread counts, in this process's environment, each only
    where the environment does not set it. Returns the thread count (`threads`, else EXPERTSWEEP_THREADS,
    else the available CPUs). `counts=False` (the sweep driver): only the wait policy, the counts of its Ray
    workers staying Ray's (one per CPU a task holds)."""
    env = os.environ.get(ENV_THREADS, "")
    n = threads or (int(env) if env.isdigit() and int(env) > 0 else available_cpus())
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if counts:
        for var in COUNT_VARS:
            os.environ.setdefault(var, str(n))
    if "torch" in sys.modules:
        log.debug("torch was imported before the thread settings: OMP_WAIT_POLICY=%s has no effect in this "
                    "process (OpenMP read it when torch loaded)", os.environ["OMP_WAIT_POLICY"])
    return n
