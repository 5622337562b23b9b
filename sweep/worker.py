"""Trial execution on the Ray workers: one Ray Tune trial evaluates a batch of policies on one host;
the model's recording and emulation tasks run on the node that holds the model.

`run_task` is the Tune trainable. Its config holds the host, the batch (`items`: Optuna trial
numbers or named baselines with their policy config and capacity) and the sweep context `ctx`
(the trace files as Ray object references, the host profile, retry and report settings). Every trial is a RunSpec
evaluated by `runtime.backends`' simulator; the worker keeps one backend per process (`_EVALUATORS`):
with `reuse_actors` a Tune actor serves many trials, and the backend keeps the loaded trace, the warm
starts and the fetch-every-miss / host-compute replays (the same for every policy at one capacity). Results go back with `tune.report` every `report_s` seconds, so the
driver records them as they finish and a killed task loses only what it had not reported.

No shared disk: a worker never opens the driver's output folder. The trace files (and a
model_shape file) come through Ray's object store (`shipped` in the driver, `local_file` here:
a copy in this node's cache named by its SHA-256); results go back through `tune.report`; a
retried task (its process or node died) resumes from its Tune checkpoint (`tune.get_checkpoint()`:
the keys it had reported), and a resumed sweep's tasks skip the keys the driver's ledger already
holds (`ctx["done"]`, sent through Ray).

An item that raises is retried in place up to `max_failures` times, then reported failed (an
`InputError`, a bad configuration, fails at once; a policy whose staging and low-bit copies leave
fewer than k slots in the sweep's `vram_budget_GiB`, `costmodel.BudgetTooSmall`, is reported
`infeasible` at once, with the slots it would have had). A task whose process dies is retried by Tune
(`FailureConfig`).

The model's tasks (`record_task`, `evaluate_task`) are placed by `model_placement`: on the nodes
offering the custom resource `model:NAME` (the config's `model_resource`; infra/start_host.sh
`--model NAME`), else on the driver's own node (where the driver found the model folder), with
`num_cpus` = the config's `emulation.cpus` (auto: every CPU of the smallest such node) and torch
threads set to the CPUs Ray gave the task (`task_threads`; Ray itself sets OMP_NUM_THREADS=1 for
a one-CPU task).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from runtime.backends import COUNTER_NAMES, get_backend
from runtime.core.errors import InputError
from runtime.core.spec import HELD_OUT, RunSpec
from runtime.formats.costmodel import BudgetTooSmall
from sweep.space import policy_of

log = logging.getLogger(__name__)

METRICS = ("time_per_token_s", "mass_per_token", "mass_per_token_layer", "substituted_call_fraction",
           "speed_ratio_vs_fetch_all", "speed_ratio_vs_host_compute", "speed_ratio_vs_all_resident",
           "fetch_all_time_per_token_s", "host_compute_time_per_token_s", "all_resident_time_per_token_s",
           "device_memory_GiB") + COUNTER_NAMES


def run_spec(cfg: dict[str, Any], trace: str, initial_residency: str, host: str | dict[str, Any],
             model_shape: str | None) -> RunSpec:
    """The RunSpec of a trial: its policy and cache size on the sweep's trace, on `host` (a preset name, or
    the sweep's profile of the host by value: what the backend runs)."""
    size = {k: cfg[k] for k in ("capacity_fraction", "vram_budget_GiB") if cfg.get(k) is not None}
    return RunSpec(policy=policy_of(cfg), trace=trace, initial_residency=initial_residency, host=host,
                   model_shape=model_shape, **size)


class Evaluator:
    """A sweep worker's trials, each a `RunSpec` evaluated by the simulator backend (`runtime.backends`).

    The backend instance is kept for the worker's life, so what trials share is computed once, in the
    backend (`Simulator`'s cache): the loaded trace, the warm start per capacity, and the
    fetch-every-miss / host-compute replays per (host, capacity) that the speed ratios divide by.
    The warm start is `warm:<calibration trace>` when the sweep has one, else the held-out last part
    of the trace (runtime/core/spec.py `held-out`; those tokens are then not evaluated)."""

    def __init__(self, trace_path: str, calib_path: str | None, model_shape: str | None):
        self.trace_path = trace_path
        self.initial_residency = f"warm:{calib_path}" if calib_path else HELD_OUT
        self.model_shape = model_shape
        self.backend = get_backend("simulator")
        self.backend.cache.trace(trace_path)  # load it now: a bad trace fails the worker, not each trial

    def evaluate(self, cfg: dict[str, Any], profile: dict[str, Any]) -> dict[str, Any]:
        """Simulate one policy at one capacity on one host (`profile`: its mapping from the driver, carried
        in the RunSpec by value); the sweep's metrics (a flat row)."""
        spec = run_spec(cfg, self.trace_path, self.initial_residency, profile, self.model_shape)
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


def _file_arg(v: Any) -> str | None:
    """A shipped file (`shipped`) -> its copy on this node; a plain string (a preset name) as it is."""
    return local_file(v) if isinstance(v, dict) else v


def evaluator(ctx: dict[str, Any]) -> Evaluator:
    """This process's `Evaluator` of the sweep's inputs (built on first use, then kept)."""
    def ident(v: Any) -> Any:
        return v["sha256"] if isinstance(v, dict) else v

    key = (ident(ctx["trace"]), ident(ctx.get("calib_trace")), ident(ctx.get("model_shape")))
    if key not in _EVALUATORS:
        trace, calib, shape = (_file_arg(ctx.get(k)) for k in ("trace", "calib_trace", "model_shape"))
        _EVALUATORS.clear()  # one sweep per process at a time; free the previous trace
        _EVALUATORS[key] = Evaluator(trace, calib, shape)
    return _EVALUATORS[key]


def shipped(path: str, name: str | None = None) -> dict[str, Any]:
    """In the driver: a file put into Ray's object store once, as workers receive it (`local_file`).
    `name` keeps the file's last path parts (a model's `<folder>/config.json` names its shape)."""
    import ray

    data = Path(path).read_bytes()
    return {"name": name or Path(path).name, "sha256": hashlib.sha256(data).hexdigest(), "ref": ray.put(data),
            "source": path}


def inputs_cache() -> Path:
    """This node's cache of shipped files: `$EXPERTSWEEP_CACHE/sweep-inputs` (default ~/.cache/expertsweep)."""
    env = os.environ.get("EXPERTSWEEP_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "expertsweep") / "sweep-inputs"


def local_file(f: dict[str, Any]) -> str:
    """A shipped file's copy on this node (fetched from the object store once, by content hash)."""
    dest = inputs_cache() / f["sha256"][:16] / f["name"]
    if not dest.is_file():
        import ray

        data = ray.get(f["ref"])
        if hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise RuntimeError(f"shipped file {f['name']}: content hash mismatch")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    return str(dest)


def run_item(ev: Evaluator, item: dict[str, Any], profile: dict[str, Any], ctx: dict[str, Any],
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


def trial_resources(config: dict[str, Any]) -> dict[str, float]:
    """A trial's Ray resources: one CPU on a node of its host."""
    from sweep.hosts import HOST_SLIVER, resource

    return {"CPU": 1, resource(config["host"]): HOST_SLIVER}


def trial_name(trial) -> str:  # noqa: ANN001 - a Tune Trial
    return f"{trial.config['host']}-{trial.trial_id}"


def _checkpointed_keys() -> set[str]:
    """Keys this Tune trial reported before it was retried (its latest Tune checkpoint), else none."""
    from ray import tune

    ckpt = tune.get_checkpoint()
    if ckpt is None:
        return set()
    try:
        with ckpt.as_directory() as d:
            return set(json.loads((Path(d) / "done.json").read_text()))
    except (OSError, ValueError) as exc:  # e.g. a checkpoint of a driver that was killed: start over
        log.warning("could not read the trial's checkpoint (%s): evaluating its whole batch", exc)
        return set()


def _report(rows: list[dict[str, Any]], host: str, final: bool, done: set[str]) -> None:
    """`tune.report` the rows; a report before the last carries a Tune checkpoint of the keys done so
    far, so a retry of this trial skips them."""
    from ray import tune

    metrics = {"items": rows, "host": host, "final": final}
    if final:
        tune.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="expertsweep-ckpt-") as d:
        (Path(d) / "done.json").write_text(json.dumps(sorted(done)))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))


def run_task(config: dict[str, Any], ctx: dict[str, Any]) -> None:
    """The Ray Tune trainable: evaluate `config['items']` on `config['host']`, reporting as it goes.

    `ctx` (the sweep context) comes through `tune.with_parameters`."""
    host = config["host"]
    ev = evaluator(ctx)
    profile = ctx["profiles"][host]  # the host's profile by value: each trial's RunSpec carries it
    done = set(ctx.get("done") or ()) | _checkpointed_keys()
    out: list[dict[str, Any]] = []
    last = time.monotonic()
    for item in config["items"]:
        if item["key"] in done:
            continue
        out.append(run_item(ev, item, profile, ctx, host))
        done.add(item["key"])
        if time.monotonic() - last >= ctx.get("report_s", 1.0):
            _report(out, host, False, done)
            out, last = [], time.monotonic()
    _report(out, host, True, done)


# --------------------------------------------------------------------------- the model's tasks

MODEL_SLIVER = 0.001  # of model:NAME per task; a node offers model:NAME = 1


def model_resource(name: str) -> str:
    return f"model:{name}"


def model_nodes(resource: str | None, driver_node: str) -> list[dict[str, Any]]:
    """Alive Ray nodes that hold the model: those offering `model:NAME`, else the driver's own."""
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    if resource:
        return [n for n in alive if n["Resources"].get(model_resource(resource), 0) > 0]
    return [n for n in alive if n["NodeID"] == driver_node]


def model_placement(resource: str | None, cpus: int | None, driver_node: str) -> dict[str, Any]:
    """Ray task options of a recording / emulation task: where the model's files are, with `cpus`
    CPUs (None: every CPU of the smallest node holding the model). A one-line InputError when no
    node holds it or `cpus` exceeds every such node."""
    nodes = model_nodes(resource, driver_node)
    where = f"model_resource {resource}" if resource else "the driver's node"
    if not nodes:
        raise InputError(f"{where}: no alive Ray node offers the resource {model_resource(resource)} (start the "
                         f"node holding the model with infra/start_host.sh ... --model {resource})")
    most = max(int(n["Resources"].get("CPU", 0)) for n in nodes)
    n_cpus = cpus or max(1, min(int(n["Resources"].get("CPU", 0)) for n in nodes))
    if n_cpus > most:
        raise InputError(f"emulation.cpus = {cpus}: no node holding the model ({where}) has that many CPUs "
                         f"(at most {most})")
    opts: dict[str, Any] = {"num_cpus": n_cpus}
    if resource:
        opts["resources"] = {model_resource(resource): MODEL_SLIVER}
    else:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(driver_node, soft=False)
    return opts


def task_threads() -> int:
    """torch threads = the CPUs Ray assigned this task (Ray sets OMP_NUM_THREADS=1 for one-CPU tasks)."""
    import ray
    import torch

    try:
        n = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))
    except Exception:  # noqa: BLE001 - outside a Ray task
        n = 1
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def record_task(**kw: Any) -> dict[str, Any]:
    """Ray task body: the sweep's traces recorded (or reused) on this node (sweep/data.py `record_on_node`)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from sweep.data import record_on_node

    threads = task_threads()
    return {**record_on_node(**kw), "torch_threads": threads, "node": _node_id()}


def evaluate_task(spec_dicts: list[dict[str, Any]], backend: str) -> list[dict[str, Any]]:
    """Ray task body: RunSpecs through one backend (`evaluate_many`), results as flat dicts, each with
    the torch threads it ran with and the node it ran on."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    threads = task_threads()
    specs = [RunSpec.from_dict(d) for d in spec_dicts]
    return [{**r.to_dict(), "torch_threads": threads, "node": _node_id()}
            for r in get_backend(backend).evaluate_many(specs)]
