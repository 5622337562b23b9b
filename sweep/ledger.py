"""The sweep's ledger: every finished trial as a row in `trials.jsonl`, fed by a Tune callback.

`Ledger` is `trials.jsonl` in the output folder: one JSON row per finished trial (simulator,
emulation or engine; ok or failed), appended and flushed as results arrive, keyed by
`key` (`HOST:NUMBER` for Optuna trials, `HOST:baseline:NAME` for baselines). A key is written
once, so a task that is retried or resumed never records a trial twice. `Session` adds rows to it
and refreshes the Pareto tables and the MLflow parent's progress metrics at most every
`refresh_s` seconds. `LedgerCallback` is the Tune callback; it is pickled with the experiment, so
it holds only the output folder and finds the live `Session` of this driver in `SESSIONS`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ray.tune import Callback

from sweep import report

log = logging.getLogger(__name__)

SESSIONS: dict[str, Session] = {}


class Ledger:
    """Append-only JSON-lines record of finished trials."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.keys: set[str] = set()
        if path.exists():
            with open(path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue  # the last line of a killed driver may be cut short
                    if row.get("key") not in self.keys:
                        self.rows.append(row)
                        self.keys.add(row["key"])
        self._f = open(path, "a")

    def add(self, row: dict[str, Any]) -> bool:
        if row["key"] in self.keys:
            return False
        self._f.write(json.dumps(row, default=_json_default) + "\n")
        self._f.flush()
        self.rows.append(row)
        self.keys.add(row["key"])
        return True

    def close(self) -> None:
        self._f.close()


def _json_default(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    if hasattr(v, "tolist"):
        return v.tolist()
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")


class Session:
    """Live state of one sweep in the driver."""

    def __init__(self, out: Path, ledger: Ledger, tracker, hosts: list[str], gpus: dict[str, str],
                 objectives: tuple[str, ...], refresh_s: float = 30.0, totals: dict[str, int] | None = None):
        self.out, self.ledger, self.tracker = out, ledger, tracker
        self.bars = {}
        if totals:  # a progress bar per host (trials recorded, with tqdm's rate and ETA)
            from tqdm import tqdm

            done = {h: sum(c) for h, c in self._counts(hosts).items()}
            self.bars = {h: tqdm(total=totals[h], initial=done[h], desc=f"trials {h}", unit="trial", position=i,
                                 mininterval=1.0, dynamic_ncols=True) for i, h in enumerate(hosts)}
        self.hosts, self.gpus, self.objectives = hosts, gpus, objectives
        self.refresh_s = refresh_s
        self._last_refresh = 0.0
        self._last_progress = time.monotonic()
        self.new_rows = 0  # simulator trials recorded by this driver
        self.repeated = 0  # rows reported again for a key already recorded (work done twice)
        self.eval_seconds = 0.0
        SESSIONS[str(out)] = self

    def add_rows(self, rows: list[dict[str, Any]], redelivered: bool = False) -> None:
        """Record rows (a key once). `redelivered`: rows of a trial's last result handed over again when it
        ends (Tune may keep its own copy of a result that carried a checkpoint): not a second evaluation."""
        for row in rows:
            if self.ledger.add(row):
                if row.get("fidelity") == "simulator":
                    self.new_rows += 1
                    self.eval_seconds += row.get("eval_seconds", 0.0)
                    if row["host"] in self.bars:
                        self.bars[row["host"]].update(1)
            elif "eval_seconds" in row and not redelivered:
                self.repeated += 1
                log.info("trial %s was reported again (evaluated twice; pid %s)", row["key"], row.get("pid"))
        now = time.monotonic()
        if now - self._last_refresh >= self.refresh_s:
            self.refresh()
        if now - self._last_progress >= 15:
            self._last_progress = now
            self.progress()

    def close_bars(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars = {}

    def counts(self) -> dict[str, list[int]]:
        """host -> [ok, infeasible, failed] simulator trials recorded (infeasible: did not fit the sweep's
        device-memory budget, an answer about the policy, not a failure)."""
        return self._counts(self.hosts)

    def _counts(self, hosts: list[str]) -> dict[str, list[int]]:
        counts = {h: [0, 0, 0] for h in hosts}
        for r in self.ledger.rows:
            if r.get("fidelity") == "simulator" and r["host"] in counts:
                counts[r["host"]][{"ok": 0, "infeasible": 1}.get(r["status"], 2)] += 1
        return counts

    def refresh(self) -> None:
        self._last_refresh = time.monotonic()
        try:
            report.write_tables(self.out, self.ledger.rows, self.hosts, self.objectives)
        except Exception as exc:  # noqa: BLE001 - the tables are refreshed again later
            log.warning("could not refresh the Pareto tables: %s", exc)
        if self.tracker is not None:
            counts = self.counts()
            self.tracker.log_parent_metrics({**{f"trials_ok_{h}": ok for h, (ok, _, _) in counts.items()},
                                             **{f"trials_infeasible_{h}": inf for h, (_, inf, _) in counts.items()},
                                             **{f"trials_failed_{h}": bad for h, (_, _, bad) in counts.items()}},
                                            step=sum(sum(c) for c in counts.values()))

    def progress(self) -> None:
        log.info("progress: %s", ", ".join(f"{h} {ok} ok/{inf} infeasible/{bad} failed"
                                           for h, (ok, inf, bad) in self.counts().items()))

    def missing(self, items: list[dict[str, Any]], host: str, error: str) -> list[dict[str, Any]]:
        """Failed rows for the items of a task that never reported them."""
        return [{"key": it["key"], "number": it["number"], "baseline": it["baseline"], "params": it["params"],
                 "host": host, "fidelity": "simulator", "status": "failed", "error": error,
                 "finished_at": time.time()} for it in items if it["key"] not in self.ledger.keys]


class LedgerCallback(Callback):
    """Tune callback: hands each reported batch of trial rows to this driver's `Session`."""

    def __init__(self, out: str):
        self.out = out

    @property
    def session(self) -> Session | None:
        return SESSIONS.get(self.out)

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:  # noqa: ANN001 - Tune's hook
        if self.session is not None:
            self.session.add_rows(result.get("items") or [])
            # recorded (and told to Optuna before this hook): keep them out of Tune's saved trial state
            result["items"] = []

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:  # noqa: ANN001
        s = self.session
        if s is None:
            return
        s.add_rows((trial.last_result or {}).get("items") or [], redelivered=True)
        s.add_rows(s.missing(trial.config.get("items", []), trial.config.get("host", "?"),
                             "the task ended without reporting this trial"))

    def on_trial_error(self, iteration, trials, trial, **info) -> None:  # noqa: ANN001
        s = self.session
        if s is None:
            return
        s.add_rows((trial.last_result or {}).get("items") or [], redelivered=True)
        s.add_rows(s.missing(trial.config.get("items", []), trial.config.get("host", "?"), _error_text(trial)))


def _error_text(trial) -> str:  # noqa: ANN001 - a Tune Trial
    path = getattr(trial, "error_file", None)
    text = ""
    if path and os.path.exists(path):
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
        text = lines[-1] if lines else ""
    return f"the Ray task failed {trial.num_failures} time(s): {text or 'worker died'}"[:2000]
