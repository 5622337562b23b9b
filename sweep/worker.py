"""Trial execution on the Ray workers: one Ray Tune trial evaluates a batch of policies on one host.

`run_task` is the Tune trainable. Its config holds the host, the batch (`items`: Optuna trial
numbers or named baselines with their policy config and capacity) and the sweep context `ctx`
(absolute trace paths, the host profile, retry and report settings). Every trial is a RunSpec
evaluated by `runtime.backends`' simulator; the worker keeps one backend per process (`_EVALUATORS`):
with `reuse_actors` a Tune actor serves many trials, and the backend keeps the loaded trace, the warm
starts and the fetch-every-miss / host-compute replays (the same for every policy at one capacity). Results go back with `tune.report` every `report_s` seconds, so the
driver records them as they finish and a killed task loses only what it had not reported.

An item that raises is retried in place up to `max_failures` times, then reported failed (an
`InputError`, a bad configuration, fails at once; a policy whose staging and low-bit copies leave
fewer than k slots in the sweep's `vram_budget_GiB`, `costmodel.BudgetTooSmall`, is reported
`infeasible` at once, with the slots it would have had). A task whose process dies is retried by Tune
(`FailureConfig`); on a retry, items already in the driver's ledger are skipped when the ledger
file is reachable from this node. `ctx["evaluator"]` ("module:Class") replaces `Evaluator` (the
tests' fault injection, tests/sweep_faults.py, lives there, outside this module).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

from runtime.backends import COUNTER_NAMES, get_backend
from runtime.costmodel import BudgetTooSmall
from runtime.errors import InputError
from runtime.spec import HELD_OUT, RunSpec
from sweep.space import policy_of

log = logging.getLogger(__name__)

METRICS = ("time_per_token_s", "mass_per_token", "mass_per_token_layer", "substituted_call_fraction",
           "speed_ratio_vs_fetch_all", "speed_ratio_vs_host_compute", "speed_ratio_vs_all_resident",
           "fetch_all_time_per_token_s", "host_compute_time_per_token_s", "all_resident_time_per_token_s",
           "device_memory_GiB") + COUNTER_NAMES


def run_spec(cfg: dict[str, Any], trace: str, initial_residency: str, host: str, model_shape: str | None
             ) -> RunSpec:
    """The RunSpec of a trial: its policy and cache size on the sweep's trace (what the backend runs)."""
    size = {k: cfg[k] for k in ("capacity_fraction", "vram_budget_GiB") if cfg.get(k) is not None}
    return RunSpec(policy=policy_of(cfg), trace=trace, initial_residency=initial_residency, host=host,
                   model_shape=model_shape, **size)


class Evaluator:
    """A sweep worker's trials, each a `RunSpec` evaluated by the simulator backend (`runtime.backends`).

    The backend instance is kept for the worker's life, so what trials share is computed once, in the
    backend (`Simulator`'s cache): the loaded trace, the warm start per capacity, and the
    fetch-every-miss / host-compute replays per (host, capacity) that the speed ratios divide by.
    The warm start is `warm:<calibration trace>` when the sweep has one, else the held-out last part
    of the trace (runtime/spec.py `held-out`; those tokens are then not evaluated)."""

    def __init__(self, trace_path: str, calib_path: str | None, model_shape: str | None):
        self.trace_path = trace_path
        self.initial_residency = f"warm:{calib_path}" if calib_path else HELD_OUT
        self.model_shape = model_shape
        self.backend = get_backend("simulator")
        self.backend.cache.trace(trace_path)  # load it now: a bad trace fails the worker, not each trial

    def profile(self, data: dict[str, Any]) -> Any:
        """The host profile of a sweep host (its mapping from the driver), registered with the backend."""
        return self.backend.add_host(data)

    def evaluate(self, cfg: dict[str, Any], profile: Any) -> dict[str, Any]:
        """Simulate one policy at one capacity on one host; the sweep's metrics (a flat row)."""
        spec = run_spec(cfg, self.trace_path, self.initial_residency, profile.name, self.model_shape)
        res = self.backend.evaluate(spec)
        d = res.to_dict()
        # device_memory_GiB is the simulator's: costmodel.budget_for_capacities of the slots under the policy
        # (experts, non-expert weights, context, staging, low-bit copies), what the answer reports
        out = {k: float(d[k]) for k in METRICS}
        out["capacity_slots"] = res.capacity
        out["policy"] = res.policy
        out["initial_residency"] = res.initial_residency
        return out


_EVALUATORS: dict[tuple, Evaluator] = {}


def evaluator(ctx: dict[str, Any]) -> Evaluator:
    key = (ctx["trace"], ctx.get("calib_trace"), ctx.get("model_shape"), ctx.get("evaluator"))
    if key not in _EVALUATORS:
        trace = local_copy(ctx["trace"], ctx.get("store"))
        calib = local_copy(ctx["calib_trace"], ctx.get("store")) if ctx.get("calib_trace") else None
        cls = Evaluator
        if ctx.get("evaluator"):
            module, name = ctx["evaluator"].split(":")
            cls = getattr(importlib.import_module(module), name)
        _EVALUATORS.clear()  # one sweep per process at a time; free the previous trace
        _EVALUATORS[key] = cls(trace, calib, ctx.get("model_shape"), **({"args": ctx["evaluator_args"]}
                                                                          if ctx.get("evaluator_args") else {}))
    return _EVALUATORS[key]


def local_copy(path: str, store: str | None) -> str:
    """`path` if this node sees it, else a cached copy fetched from the driver's TraceStore actor."""
    if os.path.exists(path) or not store:
        return path
    import ray

    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    dest = Path.home() / ".cache" / "expertsweep" / "traces" / f"{digest}-{Path(path).name}"
    if not dest.exists():
        data = ray.get(ray.get_actor(store).get.remote(path))
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(dest.suffix + f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    return str(dest)


class TraceStore:
    """Serves the sweep's trace files to nodes that do not share the driver's file system."""

    def __init__(self, paths: list[str]):
        self._paths = set(paths)

    def get(self, path: str) -> bytes:
        if path not in self._paths:
            raise KeyError(path)
        return Path(path).read_bytes()


def run_item(ev: Evaluator, item: dict[str, Any], profile: Any, ctx: dict[str, Any],
             host: str) -> dict[str, Any]:
    """Evaluate one item with in-place retries; returns its ledger row (status ok or failed)."""
    row = {k: item[k] for k in ("key", "number", "baseline", "params")}
    row.update(host=host, fidelity="simulator", pid=os.getpid(), node=_node_id())
    attempts, t0, c0 = 0, time.perf_counter(), time.process_time()
    while True:
        attempts += 1
        try:
            row.update(ev.evaluate(item["params"], profile), status="ok")
            break
        except BudgetTooSmall as exc:  # the policy does not fit the sweep's device-memory budget: data, not a failure
            row.update(status="infeasible", error=str(exc), capacity_slots=exc.slots)
            break
        except InputError as exc:
            row.update(status="failed", error=str(exc))
            break
        except Exception as exc:  # noqa: BLE001 - a trial failure is data, recorded with its message
            if attempts > ctx.get("max_failures", 0):
                row.update(status="failed", error=f"{type(exc).__name__}: {exc}")
                log.warning("trial %s failed after %d attempts:\n%s", item["key"], attempts, traceback.format_exc())
                break
    row["attempts"] = attempts
    row["eval_seconds"] = time.perf_counter() - t0
    row["eval_cpu_seconds"] = time.process_time() - c0
    row["finished_at"] = time.time()
    return row


_NODE: list[str] = []


def _node_id() -> str:
    if not _NODE:
        try:
            import ray

            _NODE.append(ray.get_runtime_context().get_node_id())
        except Exception:  # noqa: BLE001 - outside Ray (unit tests)
            _NODE.append("local")
    return _NODE[0]


def ledger_keys(path: str | None) -> set[str]:
    """Keys already recorded by the driver (when its ledger is visible from this node)."""
    if not path or not os.path.exists(path):
        return set()
    keys = set()
    with open(path) as f:
        for line in f:
            try:
                keys.add(json.loads(line)["key"])
            except (ValueError, KeyError):
                continue  # a line cut short by a killed driver
    return keys


def _is_retry(ledger: str | None) -> bool:
    """True when this Tune trial ran before (a Tune retry or a resumed sweep): its marker exists.

    Markers live next to the driver's ledger (`<out>/started/<trial id>`), so they are seen only
    where the output folder is; elsewhere a retried task simply evaluates its batch again."""
    from ray import tune

    if not ledger or not os.path.isdir(os.path.dirname(ledger)):
        return False
    marker = Path(ledger).parent / "started" / tune.get_context().get_trial_id()
    if marker.exists():
        return True
    marker.parent.mkdir(exist_ok=True)
    marker.touch()
    return False


def trial_resources(config: dict[str, Any]) -> dict[str, float]:
    """A trial's Ray resources: one CPU on a node of its host."""
    from sweep.hosts import HOST_SLIVER, resource

    return {"CPU": 1, resource(config["host"]): HOST_SLIVER}


def trial_name(trial) -> str:  # noqa: ANN001 - a Tune Trial
    return f"{trial.config['host']}-{trial.trial_id}"


def run_task(config: dict[str, Any], ctx: dict[str, Any]) -> None:
    """The Ray Tune trainable: evaluate `config['items']` on `config['host']`, reporting as it goes.

    `ctx` (the sweep context) comes through `tune.with_parameters`."""
    from ray import tune

    host = config["host"]
    ev = evaluator(ctx)
    profile = ev.profile(ctx["profiles"][host])
    done = ledger_keys(ctx.get("ledger")) if _is_retry(ctx.get("ledger")) else set()
    out: list[dict[str, Any]] = []
    last = time.monotonic()
    for item in config["items"]:
        if item["key"] in done:
            continue
        out.append(run_item(ev, item, profile, ctx, host))
        if time.monotonic() - last >= ctx.get("report_s", 1.0):
            tune.report({"items": out, "host": host, "final": False})
            out, last = [], time.monotonic()
    tune.report({"items": out, "host": host, "final": True})
