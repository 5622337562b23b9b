"""Fault injection for the sweep tests, kept out of the product's code path.

`FaultyEvaluator` is `sweep.worker.Evaluator` with faults: a list of `{"match": {field: value},
"action": "raise" | "kill" | "sleep", "seconds": s}` (match on policy fields, the capacity, or
`host`: the host profile's name). Run a sweep with it as

    python -m tests.sweep_faults '<faults JSON>' --config ... (the arguments of sweep/pareto.py)

which sets `sweep.pareto.EVALUATOR`, so every Ray worker builds this evaluator instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from sweep.worker import Evaluator

ACTIONS = ("raise", "kill", "sleep")


class FaultyEvaluator(Evaluator):
    def __init__(self, trace_path: str, calib_path: str | None, model_shape: str | None,
                 args: list[dict[str, Any]] | None = None):
        super().__init__(trace_path, calib_path, model_shape)
        self.faults = args or []

    def evaluate(self, cfg: dict[str, Any], profile) -> dict[str, Any]:  # noqa: ANN001
        for f in self.faults:
            if all((profile.name if k == "host" else cfg.get(k)) == v for k, v in f.get("match", {}).items()):
                if f["action"] == "sleep":
                    time.sleep(float(f.get("seconds", 1.0)))
                elif f["action"] == "raise":
                    raise RuntimeError(f"injected fault for {cfg}")
                elif f["action"] == "kill":
                    os._exit(17)
        return super().evaluate(cfg, profile)


def main() -> None:
    from runtime.core.errors import cli_main
    from sweep import pareto

    faults = json.loads(sys.argv[1])
    assert isinstance(faults, list) and all(f["action"] in ACTIONS for f in faults), faults
    pareto.EVALUATOR = "tests.sweep_faults:FaultyEvaluator"
    pareto.EVALUATOR_ARGS = faults
    cli_main(lambda: pareto.main(sys.argv[2:]))


if __name__ == "__main__":
    main()
