"""Fault injection for the sweep tests, entirely in test code: the product has no hook for it.

Faults are a list of `{"match": {field: value}, "action": "raise" | "kill" | "sleep", "seconds": s}`
(match on policy fields, the capacity, or `host`: the host profile's name), given to the Ray workers
in the environment variable `EXPERTSWEEP_TEST_FAULTS` (JSON) of the sweep job's runtime_env. `install`
is that job's `worker_process_setup_hook` (Ray's public runtime_env field: Ray runs it in every worker
process of the job before any task): it replaces `sweep.worker.Evaluator`, the class the trials build
their evaluator from, with `FaultyEvaluator`, which applies the faults before evaluating. The driver is
the product's own `sweep/pareto.py`; the runtime_env reaches the job in one of two public ways:

- `ray job submit --runtime-env-json '{"worker_process_setup_hook": "tests.sweep_faults.install",
  "env_vars": {"EXPERTSWEEP_TEST_FAULTS": ...}}' -- python sweep/pareto.py ...` (`runtime_env`), or
- `python -m tests.sweep_faults '<faults JSON>' <the arguments of sweep/pareto.py>` (`main`), which
  runs the driver in this process with `ray.init` given that runtime_env (`ray.init(runtime_env=...)`).

`install_audited` is `install` plus tests/sweep_audit.py's audit hook (a job has one setup hook).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ACTIONS = ("raise", "kill", "sleep")
FAULTS_ENV = "EXPERTSWEEP_TEST_FAULTS"
HOOK = "tests.sweep_faults.install"


def check(faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert isinstance(faults, list) and all(f["action"] in ACTIONS for f in faults), faults
    return faults


def runtime_env(faults: list[dict[str, Any]], hook: str = HOOK, **env_vars: str) -> dict[str, Any]:
    """The sweep job's runtime_env that injects `faults` into its Ray workers."""
    # the hook lives in tests/, which the installed package does not carry: the workers import it from the checkout
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)
    return {"worker_process_setup_hook": hook,
            "env_vars": {FAULTS_ENV: json.dumps(check(faults)), "PYTHONPATH": path, **env_vars}}


def install() -> None:
    """Ray worker setup hook: the trials of this worker process evaluate with the faults of $EXPERTSWEEP_TEST_FAULTS."""
    from sweep import worker

    base = worker.Evaluator
    faults = check(json.loads(os.environ[FAULTS_ENV]))

    class FaultyEvaluator(base):  # the product's evaluator, with faults before each evaluation
        def evaluate(self, cfg: dict[str, Any], profile: dict[str, Any]) -> dict[str, Any]:
            for f in faults:
                if all((profile["name"] if k == "host" else cfg.get(k)) == v for k, v in f.get("match", {}).items()):
                    if f["action"] == "sleep":
                        time.sleep(float(f.get("seconds", 1.0)))
                    elif f["action"] == "raise":
                        raise RuntimeError(f"injected fault for {cfg}")
                    elif f["action"] == "kill":
                        os._exit(17)
            return super().evaluate(cfg, profile)

    worker.Evaluator = FaultyEvaluator


def install_audited() -> None:
    """`install` and tests/sweep_audit.py's `install` (the audit of the driver's output folder)."""
    from tests import sweep_audit

    sweep_audit.install()
    install()


def main() -> None:
    """`python -m tests.sweep_faults '<faults JSON>' ARGS...`: the sweep driver's `main(ARGS)` in this
    process, its `ray.init` given the runtime_env of the faults."""
    import ray

    from runtime.core.errors import cli_main
    from sweep import driver

    renv = runtime_env(json.loads(sys.argv[1]))
    init = ray.init

    @functools.wraps(init)
    def init_with_faults(*args: Any, **kwargs: Any) -> Any:
        assert not kwargs.get("runtime_env"), "the driver sets a runtime_env of its own: merge it here"
        return init(*args, runtime_env=renv, **kwargs)

    ray.init = init_with_faults
    cli_main(lambda: driver.main(sys.argv[2:]))


if __name__ == "__main__":
    main()
