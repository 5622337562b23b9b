"""Measurements beyond the simulator: RunSpecs through the emulation and engine backends, as Ray tasks.

`Measurer` is the ladder's `measure` (sweep/ladder.py): a list of policy configs at one token budget
becomes one `RunSpec` each (the policy, its cache size, the model and text, the budget and the warm
start: the sweep's calibration text, else `held-out`), evaluated by `runtime.backends`'
`emulation` backend in one Ray task (`evaluate_many`: the exact pass runs once for all). Each
result becomes a ledger row keyed by everything the measurement depends on
(`sweep.ladder.measurement_key`: the spec as evaluated, with its capacity, tokens and warm start, and
the checkpoint's digest; `emulation:<budget>:<digest>`, host `all`, fidelity `emulation`), the spec
and digest stored in the row (`spec`, `model_digest`; `check_rows` refuses a resume over rows that
do not match them): quality is measured once and shared by every host, and a resumed sweep measures
nothing twice and reuses nothing measured otherwise. `engine` runs the same specs through the `engine` backend pinned to a
calibrated host (`host:NAME` resource, one GPU where its nodes have one): rows with fidelity
`engine`, that host, and the measured time per token.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from runtime.backends import COUNTER_NAMES
from runtime.core.errors import InputError
from runtime.core.spec import HELD_OUT, RunSpec
from sweep.ladder import measurement_key
from sweep.report import policy_key
from sweep.space import policy_of

log = logging.getLogger(__name__)

ROW_FIELDS = ("perplexity", "exact_perplexity", "ppl_change_pct", "ppl_ci_low", "ppl_ci_high", "mass_per_token",
              "substituted_call_fraction", "time_per_token_s", "time_kind", "initial_residency", "tokens",
              "capacity") + COUNTER_NAMES


def emulation_spec(params: dict[str, Any], model_dir: str, text: str, tokens: int | None,
                   calib_text: str | None, slots: list[int] | None = None, **run_fields: Any) -> RunSpec:
    """The RunSpec of one policy config on the sweep's text at a token budget (`run_fields`: the
    sweep's dtype and max_memory_GiB). `slots`: the per-layer capacity the simulator gave the policy
    for its `vram_budget_GiB` on the sweep's cost-model shape, emulated as such (the checkpoint's own
    shape would give another count for the same GiB: a tiny model fits whole in a GPU's budget)."""
    size = {k: params[k] for k in ("capacity_fraction", "vram_budget_GiB") if params.get(k) is not None}
    if slots is not None and "vram_budget_GiB" in size:
        size = {"capacity": tuple(int(c) for c in slots)}
    return RunSpec(policy=policy_of(params), model=model_dir, text=text, max_tokens=tokens, calib_text=calib_text,
                   initial_residency=None if calib_text else HELD_OUT, **size, **run_fields)


class Measurer:
    """Emulation (and engine) measurements of policy configs, recorded in the ledger once each."""

    def __init__(self, model_dir: str, text: str, calib_text: str | None, ledger, add_rows,  # noqa: ANN001
                 progress: bool = True, placement: dict[str, Any] | None = None,
                 run_fields: dict[str, Any] | None = None, model_digest: str | None = None):
        self.model_dir, self.text, self.calib_text = model_dir, text, calib_text
        self.model_digest = model_digest
        # emulation tasks run where the model's files are, with their CPUs as torch threads (sweep/worker.py)
        self.placement = placement or {"num_cpus": 1}
        self.run_fields = run_fields or {}
        self.ledger, self.add_rows = ledger, add_rows
        self.progress = progress
        self.tasks_seconds = 0.0

    def _slots(self) -> dict[str, list[int]]:
        """policy key -> the slots per layer its simulator trials held (the same on every host of one shape)."""
        return {policy_key(r["params"]): r["capacity_slots"] for r in self.ledger.rows
                if r.get("fidelity") == "simulator" and r.get("status") == "ok"
                and isinstance(r.get("capacity_slots"), list)}

    def _rows(self, keys: dict[str, str]) -> dict[str, dict[str, Any]]:
        by_key = {r["key"]: r for r in self.ledger.rows if r["key"] in keys.values()}
        return {pk: by_key[k] for pk, k in keys.items() if k in by_key}

    def _run(self, params_list: list[dict[str, Any]], tokens: int | None, budget: str, host: str | None,
             gpus: int) -> dict[str, dict[str, Any]]:
        import ray

        from sweep.hosts import HOST_SLIVER, resource
        from sweep.worker import evaluate_task

        slots = self._slots()
        specs = {policy_key(p): emulation_spec(p, self.model_dir, self.text, tokens, self.calib_text,
                                               slots.get(policy_key(p)), **self.run_fields).to_dict()
                 for p in params_list}
        keys = {pk: measurement_key(spec, self.model_digest, budget, host) for pk, spec in specs.items()}
        todo = [p for p in params_list if keys[policy_key(p)] not in self.ledger.keys]
        if todo:
            opts: dict[str, Any] = {**self.placement, "max_retries": 1}
            if host:  # the engine on the calibrated host's node, one CPU as in its calibration
                opts = {"num_cpus": 1, "max_retries": 1, "num_gpus": gpus, "resources": {resource(host): HOST_SLIVER}}
            what = f"engine {host}" if host else f"emulation {budget}"
            log.info("%s: %d policies", what, len(todo))
            specs_todo = [specs[policy_key(p)] for p in todo]
            t0 = time.time()
            bar = _bar(len(todo), what) if self.progress else None
            try:
                results, err = ray.get(ray.remote(evaluate_task).options(**opts).remote(
                    specs_todo, "engine" if host else "emulation")), None
            except Exception as exc:  # noqa: BLE001 - recorded as failed rows
                results, err = [None] * len(todo), f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.tasks_seconds += time.time() - t0
            if bar is not None:
                bar.update(len(todo))
                bar.close()
            rows = []
            for p, r in zip(todo, results, strict=True):
                row = {"key": keys[policy_key(p)], "number": None, "baseline": None, "params": p,
                       "host": host or "all", "fidelity": "engine" if host else "emulation", "budget": budget,
                       "policy": policy_of(p).label(), "finished_at": time.time(),
                       "spec": specs[policy_key(p)], "model_digest": self.model_digest}
                if r is None:
                    row.update(status="failed", error=err or "no result")
                else:
                    row.update(status="ok", **{k: r.get(k) for k in ROW_FIELDS if k in r}, seconds=r.get("seconds"),
                               torch_threads=r.get("torch_threads"), node=r.get("node"))
                rows.append(row)
            self.add_rows(rows)
        return self._rows(keys)

    def __call__(self, params_list: list[dict[str, Any]], tokens: int | None, budget: str) -> dict[str, dict[str, Any]]:
        return self._run(params_list, tokens, budget, None, 0)

    def engine(self, params_list: list[dict[str, Any]], tokens: int | None, host: str, gpus: int
               ) -> dict[str, dict[str, Any]]:
        return self._run(params_list, tokens, "full", host, gpus)


def check_rows(rows: list[dict[str, Any]], model_digest: str | None, where: str) -> None:
    """Before a resume reuses them: every emulation / engine row of the ledger must carry the key of what it
    measured (its stored spec and checkpoint digest give its key again) and this sweep's checkpoint; else a
    one-line InputError naming the ledger, the row and what differs."""
    for r in rows:
        if r.get("fidelity") not in ("emulation", "engine"):
            continue
        if "spec" not in r:
            raise InputError(f"--resume: {where}: row {r['key']} was measured under another key (a ledger "
                             f"without the measurement's capacity, tokens and warm start in its key); start "
                             f"the sweep over without --resume, or in another --out")
        if measurement_key(r["spec"], r.get("model_digest"), r.get("budget", ""),
                           r["host"] if r.get("fidelity") == "engine" else None) != r["key"]:
            raise InputError(f"--resume: {where}: row {r['key']}: its key is not the digest of its spec "
                             f"(edited?); start the sweep over without --resume")
        if r.get("model_digest") != model_digest:
            raise InputError(f"--resume: {where}: row {r['key']} was measured on checkpoint digest "
                             f"{r.get('model_digest')}, this sweep's is {model_digest} (the model changed); "
                             f"start the sweep over without --resume, or in another --out")


def check_resume(out: Path, state: dict[str, Any], fingerprint: dict[str, Any]) -> None:
    """A resume continues only what was measured under the same key: the sweep's fingerprint and every
    emulation/engine row's own key (sweep/remeasure.py `check_rows`); else one line, nothing changed."""
    from sweep.ledger import Ledger

    saved = state.get("fingerprint")
    if saved is None:
        raise InputError(f"--resume: {out / 'state.json'} has no fingerprint of its inputs (written by an earlier "
                         f"version): start the sweep over without --resume, or in another --out")
    for k, v in fingerprint.items():
        if k not in saved:  # a digest an earlier version did not save (the text's): nothing to compare it with
            continue
        if json.loads(json.dumps(saved.get(k), default=str)) != json.loads(json.dumps(v, default=str)):
            shown = "changed" if k == "profiles" else f"{saved.get(k)!r} -> {v!r}"
            raise InputError(f"--resume: {out / 'trials.jsonl'} was measured under another {k} ({shown}); start "
                             f"the sweep over without --resume, or in another --out")
    ledger = Ledger(out / "trials.jsonl")
    try:
        check_rows(ledger.rows, fingerprint.get("model_digest"), str(out / "trials.jsonl"))
    finally:
        ledger.close()


def _bar(total: int, desc: str):  # noqa: ANN202 - a tqdm bar
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="policy", dynamic_ncols=True)
