"""MLflow tracking of a sweep: one parent run per sweep, one child run per trial, written in the background.

The default store is SQLite under the repository's `mlflow/` folder (artifacts in
`mlflow/mlruns/`); `--mlflow-uri http://HOST:PORT` logs to a tracking server (checked with its
`/health` endpoint before any trial starts). Child runs carry the tags `host`, `gpu`, `fidelity`
(simulator | emulation | engine), `policy` (its label) and `key` (the sweep's trial key), the
policy's fields as params and its figures as metrics. Children are written by one background
thread, so the sweep never waits on the store; `close` drains it. Writes are batched: against a
server each child is one `create_run`, one `log_batch` and one `set_terminated`; against the
default SQLite store the thread inserts every queued child in one transaction into MLflow's own
tables (through its SQLAlchemy models: ~10x less CPU per child), falling back to the client calls
if that fails (another MLflow schema).
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
import uuid
from pathlib import Path
from typing import Any

from runtime.errors import InputError

log = logging.getLogger(__name__)

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DB = REPO / "mlflow" / "mlflow.db"
EXPERIMENT = "expertsweep"
PARAM_FIELDS = ("rule", "tau", "beta", "evict", "gamma", "half_life", "admission_delay",
                "capacity_fraction", "vram_budget_GiB")


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


def _param(v: Any, name: str = "") -> str:
    if v is None:
        return "off" if name == "beta" else "none"
    return f"{v:g}" if isinstance(v, float) else str(v)


def child_payload(row: dict[str, Any], gpu: str) -> tuple[dict[str, str], dict[str, str], dict[str, float]]:
    """(tags, params, metrics) of a ledger row."""
    tags = {"host": row["host"], "gpu": gpu, "fidelity": row["fidelity"], "key": row["key"],
            "policy": row.get("policy") or row["params"].get("rule", "?"), "status": row["status"],
            "mlflow.runName": row["key"]}
    if row.get("baseline"):
        tags["baseline"] = row["baseline"]
    if row.get("number") is not None:
        tags["optuna_number"] = str(row["number"])
    if row.get("node"):
        tags["node"] = str(row["node"])
    if row.get("error"):
        tags["error"] = str(row["error"])[:4000]
    params = {k: _param(row["params"][k], k) for k in PARAM_FIELDS if k in row["params"]}
    metrics = {}
    for k, v in row.items():
        if k in ("number", "pid", "finished_at") or isinstance(v, bool) or not isinstance(v, int | float):
            continue
        if math.isfinite(v):
            metrics[k] = float(v)
    return tags, params, metrics


class Tracker:
    """A sweep's MLflow parent run and its background child-run writer."""

    def __init__(self, uri: str, experiment: str = EXPERIMENT):
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            art = None
            if uri.startswith("sqlite:///"):
                art = (Path(uri[len("sqlite:///"):]).parent / "mlruns").as_uri()
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=art)
            exp = self.client.get_experiment(self.experiment_id)
        self.experiment_id = exp.experiment_id
        self.artifact_location = exp.artifact_location.rstrip("/")
        self.user = os.environ.get("USER") or os.environ.get("LOGNAME") or "expertsweep"
        self._bulk = uri.startswith("sqlite:///")
        self.parent_id: str | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.cpu_seconds = 0.0  # CPU time spent by the writer thread
        self.written = 0
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
        """Keys of the child runs already in the store (to fill gaps after a killed driver)."""
        keys, token = set(), None
        while True:
            page = self.client.search_runs([self.experiment_id], f"tags.mlflow.parentRunId = '{self.parent_id}'",
                                           max_results=1000, page_token=token)
            keys.update(r.data.tags.get("key", "") for r in page)
            token = page.token
            if not token:
                return keys

    def log_child(self, row: dict[str, Any], gpu: str) -> None:
        self._queue.put(("child", row, gpu))

    def log_parent_metrics(self, metrics: dict[str, float]) -> None:
        self._queue.put(("parent_metrics", metrics, None))

    def _write_child(self, row: dict[str, Any], gpu: str) -> None:
        from mlflow.entities import Metric, Param

        tags, params, metrics = child_payload(row, gpu)
        tags["mlflow.parentRunId"] = self.parent_id
        ts = int(row.get("finished_at", time.time()) * 1000)
        run = self.client.create_run(self.experiment_id, start_time=ts, tags=tags, run_name=row["key"])
        self.client.log_batch(run.info.run_id, metrics=[Metric(k, v, ts, 0) for k, v in metrics.items()],
                              params=[Param(k, v) for k, v in params.items()])
        self.client.set_terminated(run.info.run_id, "FINISHED" if row["status"] == "ok" else "FAILED", end_time=ts)

    def _write_children_sql(self, batch: list[tuple[dict[str, Any], str]]) -> None:
        """All of `batch` in one SQLite transaction: the rows MLflow's store writes for each run
        (runs, tags, params, metrics, latest_metrics), as five multi-row inserts."""
        from mlflow.store.tracking.dbmodels.models import (
            SqlLatestMetric,
            SqlMetric,
            SqlParam,
            SqlRun,
            SqlTag,
        )

        runs, tag_rows, param_rows, metric_rows = [], [], [], []
        for row, gpu in batch:
            tags, params, metrics = child_payload(row, gpu)
            tags["mlflow.parentRunId"] = self.parent_id
            ts = int(row.get("finished_at", time.time()) * 1000)
            run_id = uuid.uuid4().hex
            runs.append({"run_uuid": run_id, "name": row["key"], "source_type": "UNKNOWN", "source_name": "",
                         "entry_point_name": "", "user_id": self.user, "source_version": "",
                         "status": "FINISHED" if row["status"] == "ok" else "FAILED", "start_time": ts,
                         "end_time": ts, "deleted_time": None, "lifecycle_stage": "active",
                         "artifact_uri": f"{self.artifact_location}/{run_id}/artifacts",
                         "experiment_id": int(self.experiment_id)})
            tag_rows += [{"key": k, "value": v, "run_uuid": run_id} for k, v in tags.items()]
            param_rows += [{"key": k, "value": v, "run_uuid": run_id} for k, v in params.items()]
            metric_rows += [{"key": k, "value": v, "timestamp": ts, "step": 0, "is_nan": False, "run_uuid": run_id}
                            for k, v in metrics.items()]
        store = self.client._tracking_client.store
        with store.ManagedSessionMaker() as session:
            for model, rows in ((SqlRun, runs), (SqlTag, tag_rows), (SqlParam, param_rows),
                                (SqlMetric, metric_rows), (SqlLatestMetric, metric_rows)):
                if rows:
                    session.execute(model.__table__.insert(), rows)

    def _write_children(self, batch: list[tuple[dict[str, Any], str]]) -> None:
        if self._bulk:
            try:
                self._write_children_sql(batch)
                return
            except Exception as exc:  # noqa: BLE001 - another MLflow version: use the client API
                self._bulk = False
                log.warning("MLflow bulk insert unavailable (%s); writing child runs one by one", exc)
        for row, gpu in batch:
            self._write_child(row, gpu)

    def _drain(self) -> None:
        from mlflow.entities import Metric

        stop = False
        while not stop:
            items = [self._queue.get()]
            while len(items) < 200:  # take what has queued up meanwhile: one transaction for all
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            t0 = time.thread_time()
            children = [(payload, extra) for kind, payload, extra in items if kind == "child"]
            try:
                if children:
                    self._write_children(children)
                    self.written += len(children)
                for kind, payload, _ in items:
                    if kind == "parent_metrics":
                        ts = int(time.time() * 1000)
                        self.client.log_batch(self.parent_id, metrics=[Metric(k, float(v), ts, 0)
                                                                       for k, v in payload.items()])
                    stop = stop or kind == "stop"
            except Exception as exc:  # noqa: BLE001 - tracking must not stop the sweep
                self.errors += 1
                log.warning("MLflow write failed: %s", exc)
            finally:
                self.cpu_seconds += time.thread_time() - t0
                for _ in items:
                    self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()

    def log_artifacts(self, folder: Path, files: list[Path]) -> None:
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
