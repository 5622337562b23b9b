"""MLflow tracking of a sweep through MLflow's public client: a parent run, fewer and richer child runs.

The default store is SQLite under the repository's `mlflow/` folder (artifacts in
`mlflow/mlruns/`); `--mlflow-uri http://HOST:PORT` logs to a tracking server (checked with its
`/health` endpoint before any trial starts). The experiment is created as a traditional-ML
experiment (tag `mlflow.experimentKind = custom_model_development`), so the UI opens on its runs.

What is written (all through `MlflowClient`, by one background thread, so the sweep never waits
on the store; `close` drains it):

- the parent run (one per sweep): the config as params; while the sweep runs, progress metrics
  (trials recorded per host) at most every few seconds; at the end the summary metrics, each
  host's front and every trial as MLflow tables (`log_table`), and the output files as artifacts;
- one child run per policy that matters on a host (a baseline, a front member or a policy measured
  beyond the simulator), named by its policy label, tagged `host`, `gpu`, `policy`, `fidelity`
  (the highest it reached), `key`; the policy's fields as params, its simulated and measured
  figures as metrics; each is one `create_run`, one `log_batch` and one `set_terminated`.

Every screened trial is a row of the parent's `trials` table rather than a run of its own: a child
run costs ~16 ms of CPU, a third of a simulator trial, and would break the 20% overhead target.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from runtime.errors import InputError

log = logging.getLogger(__name__)

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DB = REPO / "mlflow" / "mlflow.db"
EXPERIMENT = "expertsweep"
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}  # the UI opens on the runs


def resolve_uri(uri: str | None) -> str:
    """A usable tracking URI or a one-line InputError (unreachable server, unwritable folder)."""
    if uri is None:
        uri = f"sqlite:///{DEFAULT_DB}"
    if uri.startswith(("http://", "https://")):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status != 200:
                    raise InputError(f"--mlflow-uri {uri}: {url} answered HTTP {resp.status}")
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise InputError(f"--mlflow-uri {uri}: unreachable ({reason})") from None
        return uri.rstrip("/")
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.is_absolute():
            path = Path.cwd() / path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--mlflow-uri {uri}: cannot create {path.parent} ({exc.strerror})") from None
        if not os.access(path.parent, os.W_OK):
            raise InputError(f"--mlflow-uri {uri}: {path.parent} is not writable")
        return f"sqlite:///{path}"
    raise InputError(f"--mlflow-uri {uri!r}: expected http(s)://HOST:PORT or sqlite:///PATH")


def _param(v: Any) -> str:
    if v is None:
        return ""
    return f"{v:g}" if isinstance(v, float) else str(v)


def _metrics(rec: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in rec.items():
        if k in ("number", "pid", "finished_at", "attempts") or isinstance(v, bool):
            continue
        if isinstance(v, int | float) and math.isfinite(v):
            out[k] = float(v)
    return out


def child_payload(rec: dict[str, Any], gpu: str) -> tuple[str, dict[str, str], dict[str, str], dict[str, float]]:
    """(run name, tags, params, metrics) of a child run from a merged record of one policy on one host.

    `rec` holds `key`, `host`, `policy` (label), `params` (policy fields + capacity), `fidelity`,
    `status` and its figures (simulated and, where measured, emulated / engine)."""
    name = rec["policy"] if not rec.get("baseline") else f"{rec['baseline']}: {rec['policy']}"
    tags = {"host": rec["host"], "gpu": gpu, "fidelity": rec.get("fidelity", "simulator"), "key": rec["key"],
            "policy": rec["policy"], "status": rec.get("status", "ok"), "mlflow.runName": name}
    for k in ("baseline", "on_front", "initial_residency", "family"):
        if rec.get(k) is not None and rec.get(k) is not False:
            tags[k] = str(rec[k])
    if rec.get("error"):
        tags["error"] = str(rec["error"])[:4000]
    params = {k: _param(v) for k, v in rec["params"].items()}
    if rec.get("initial_residency"):
        params["initial_residency"] = str(rec["initial_residency"])[:6000]
    metrics = _metrics({k: v for k, v in rec.items() if k != "params"})
    return name, tags, params, metrics


class Tracker:
    """A sweep's MLflow parent run and the background writer of its metrics, tables and child runs."""

    def __init__(self, uri: str, experiment: str = EXPERIMENT):
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            art = None
            if uri.startswith("sqlite:///"):
                art = (Path(uri[len("sqlite:///"):]).parent / "mlruns").as_uri()
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=art,
                                                               tags=EXPERIMENT_KIND)
        else:
            self.experiment_id = exp.experiment_id
            for k, v in EXPERIMENT_KIND.items():
                if exp.tags.get(k) != v:
                    self.client.set_experiment_tag(self.experiment_id, k, v)
        self.parent_id: str | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._step = 0
        self.cpu_seconds = 0.0  # CPU time spent by the writer thread
        self.written = 0  # child runs written
        self.errors = 0

    def start_parent(self, name: str, params: dict[str, Any], tags: dict[str, str],
                     run_id: str | None = None) -> str:
        """Create the sweep's parent run, or reopen `run_id` when resuming."""
        from mlflow.entities import Param

        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.parent_id = run_id
        else:
            run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
            self.parent_id = run.info.run_id
            self.client.log_batch(self.parent_id, params=[Param(k, _param(v)[:6000]) for k, v in params.items()])
        self._thread = threading.Thread(target=self._drain, name="mlflow-writer", daemon=True)
        self._thread.start()
        return self.parent_id

    def logged_keys(self) -> set[str]:
        """Keys of the child runs already in the store (a resumed sweep does not write them again)."""
        keys, token = set(), None
        while True:
            page = self.client.search_runs([self.experiment_id], f"tags.mlflow.parentRunId = '{self.parent_id}'",
                                           max_results=1000, page_token=token)
            keys.update(r.data.tags.get("key", "") for r in page)
            token = page.token
            if not token:
                return keys

    def log_children(self, recs: list[dict[str, Any]], gpus: dict[str, str]) -> None:
        """Queue child runs (one per record) not yet in the store."""
        done = self.logged_keys()
        for rec in recs:
            if rec["key"] not in done:
                self._queue.put(("child", rec, gpus.get(rec["host"], "-")))

    def log_parent_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if step is None:
            self._step += 1
            step = self._step
        self._queue.put(("parent_metrics", metrics, step))

    def log_table(self, df: Any, artifact_file: str) -> None:
        """A pandas DataFrame as an MLflow table of the parent run (shown in the UI's artifacts)."""
        self._queue.put(("table", df, artifact_file))

    def _write_child(self, rec: dict[str, Any], gpu: str) -> None:
        from mlflow.entities import Metric, Param

        name, tags, params, metrics = child_payload(rec, gpu)
        tags["mlflow.parentRunId"] = self.parent_id
        ts = int(rec.get("finished_at", time.time()) * 1000)
        run = self.client.create_run(self.experiment_id, start_time=ts, tags=tags, run_name=name)
        self.client.log_batch(run.info.run_id, metrics=[Metric(k, v, ts, 0) for k, v in metrics.items()],
                              params=[Param(k, v) for k, v in params.items()])
        self.client.set_terminated(run.info.run_id, "FINISHED" if rec.get("status", "ok") == "ok" else "FAILED",
                                   end_time=ts)
        self.written += 1

    def _write(self, kind: str, payload: Any, extra: Any) -> None:
        from mlflow.entities import Metric

        if kind == "child":
            self._write_child(payload, extra)
        elif kind == "parent_metrics":
            ts = int(time.time() * 1000)
            self.client.log_batch(self.parent_id, metrics=[Metric(k, float(v), ts, extra)
                                                           for k, v in payload.items()
                                                           if isinstance(v, int | float) and math.isfinite(v)])
        elif kind == "table":
            self.client.log_table(self.parent_id, data=payload, artifact_file=extra)

    def _drain(self) -> None:
        while True:
            kind, payload, extra = self._queue.get()
            t0 = time.thread_time()
            try:
                if kind == "stop":
                    return
                self._write(kind, payload, extra)
            except Exception as exc:  # noqa: BLE001 - tracking must not stop the sweep
                self.errors += 1
                log.warning("MLflow write failed (%s): %s", kind, exc)
            finally:
                self.cpu_seconds += time.thread_time() - t0
                self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()

    def log_artifacts(self, files: list[Path]) -> None:
        self.flush()
        for f in files:
            try:
                self.client.log_artifact(self.parent_id, str(f))
            except Exception as exc:  # noqa: BLE001
                log.warning("MLflow artifact %s not logged: %s", f, exc)

    def close(self, status: str = "FINISHED") -> None:
        if self._thread is None:
            return
        self._queue.put(("stop", None, None))
        self._thread.join()
        self._thread = None
        self.client.set_terminated(self.parent_id, status)
