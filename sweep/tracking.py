"""MLflow tracking of a sweep through MLflow's public client: a parent run, fewer and richer child runs.

The store is `--mlflow-uri`, else `MLFLOW_TRACKING_URI` (MLflow's own variable), else SQLite under
the repository's `mlflow/` folder (artifacts in `mlflow/mlruns/`); an `http://HOST:PORT` server is
checked with its `/health` endpoint before any trial starts. The experiment is created as a
traditional-ML experiment (tag `mlflow.experimentKind = custom_model_development`); MLflow 3.17's UI
decides GenAI vs classic by its own workflow switch (the page's `workflowType` parameter, else the
browser's last choice), so `runs_page` gives the runs page's address in the classic view
(`#/experiments/<id>/runs?workflowType=machine_learning&viewStateShareKey=...`: with the key metrics as
columns, `VIEW_STATE`) that `make mlflow-ui` and the sweep print.

What is written (all through `MlflowClient`; metrics and params through MLflow's own asynchronous
logging, `log_batch(..., synchronous=False)`, so the sweep does not wait on the store while it
screens; `flush` waits for every queued operation):

- the parent run (one per sweep): the config as params; while the sweep runs, progress metrics
  (trials recorded per host) at most every few seconds; at the end the summary metrics, each
  host's front and every trial as MLflow tables (`log_table`), and the output files as artifacts;
- one child run per policy that matters on a host (a baseline, a front member or a policy measured
  beyond the simulator), named `HOST · POLICY` (`rtx4090 · speed-first`; a searched policy by its
  label), tagged `host`, `gpu`, `policy`, `fidelity` (the highest it reached), `key`; the policy's
  active fields as params (`active_params`: the policy table's rule of when a field matters, so no
  `lowbit_bits` without a low-bit fallback), its simulated and measured figures as metrics; each is one `create_run`, one `log_batch` and one `set_terminated`, written
  when the report is (not per trial);
- every run carries MLflow's source tags: `mlflow.source.name` (sweep/driver.py),
  `mlflow.source.type` (LOCAL), `mlflow.user`, and where the code is a git checkout
  `mlflow.source.git.commit`, `mlflow.source.git.branch`, `mlflow.source.git.repoURL` and
  `mlflow.source.git.dirty`.

Every screened trial is a row of the parent's `trials` table rather than a run of its own: a child
run costs ~16 ms of CPU, a third of a simulator trial, and would break the 20% overhead target.
"""

from __future__ import annotations

import getpass
import json
import logging
import math
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from runtime.core.errors import InputError

log = logging.getLogger(__name__)

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

REPO = Path(__file__).resolve().parent.parent
# a checkout keeps its runs in its mlflow/ folder; an installed package (no mlflow/ beside it, only the
# mlflow library's own folder) in ./mlflow/ of the working directory, like results/
DEFAULT_DB = (REPO if (REPO / "mlflow" / "start.sh").is_file() else Path.cwd()) / "mlflow" / "mlflow.db"
EXPERIMENT = "expertsweep"
# set by Ray's job supervisor in the driver of a `ray job submit`: its working directory (REPO above) is then
# Ray's temporary copy of the submitted folder, deleted with the cluster's session
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
ENV_URI = "MLFLOW_TRACKING_URI"


def resolve_uri(uri: str | None, create: bool = True) -> str:
    """A usable tracking URI or a one-line InputError (unreachable server, unwritable folder).

    `uri` is `--mlflow-uri` (or the one a resumed sweep used); without it `MLFLOW_TRACKING_URI`,
    else the repository's SQLite store. The error names where the URI came from. `create=False`:
    a SQLite store's folder is only checked (its nearest existing parent must be writable), not made."""
    flag = "--mlflow-uri"
    if uri is None and os.environ.get(ENV_URI):
        uri, flag = os.environ[ENV_URI], ENV_URI
    in_job = submitted_job()
    if uri is None and in_job:
        raise InputError("--mlflow-uri: required under ray job submit (the default store would be inside Ray's "
                         f"temporary copy of the submitted folder, {REPO}, deleted with the cluster): give "
                         "--mlflow-uri http://HOST:PORT, or sqlite:////ABSOLUTE/PATH/mlflow.db on the head, "
                         "e.g. sqlite:///$PWD/mlflow/mlflow.db of the submitting checkout")
    if uri is None:
        uri = f"sqlite:///{DEFAULT_DB}"
    if uri.startswith(("http://", "https://")):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status != 200:
                    raise InputError(f"{flag} {uri}: {url} answered HTTP {resp.status}")
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise InputError(f"{flag} {uri}: unreachable ({reason})") from None
        return uri.rstrip("/")
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.is_absolute():
            path = Path.cwd() / path
        if in_job and path.resolve().is_relative_to(REPO):
            raise InputError(f"{flag} {uri}: inside Ray's temporary copy of the submitted folder ({REPO}), deleted "
                             f"with the cluster: give an absolute path outside it (sqlite:////ABSOLUTE/PATH) or "
                             f"http://HOST:PORT")
        if not create:
            near = next(p for p in path.parents if p.exists())
            if not near.is_dir() or not os.access(near, os.W_OK):
                raise InputError(f"{flag} {uri}: {near} is not a writable folder")
            return f"sqlite:///{path}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"{flag} {uri}: cannot create {path.parent} ({exc.strerror})") from None
        if not os.access(path.parent, os.W_OK):
            raise InputError(f"{flag} {uri}: {path.parent} is not writable")
        return f"sqlite:///{path}"
    raise InputError(f"{flag} {uri!r}: expected http(s)://HOST:PORT or sqlite:///PATH")


def _git(*args: str) -> str | None:
    try:
        p = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def source_tags(source: str = "sweep/driver.py") -> dict[str, str]:
    """MLflow's source tags for a run of this code: the script, LOCAL, the user and, in a git
    checkout, its commit, branch, remote and whether the working tree had changes."""
    from mlflow.entities import SourceType
    from mlflow.utils import mlflow_tags as mt

    tags = {mt.MLFLOW_SOURCE_NAME: source, mt.MLFLOW_SOURCE_TYPE: SourceType.to_string(SourceType.LOCAL)}
    try:
        tags[mt.MLFLOW_USER] = getpass.getuser()
    except (KeyError, OSError):
        pass
    commit = _git("rev-parse", "HEAD")
    if commit:  # a `ray job submit --working-dir` package has no .git: no git tags then
        tags[mt.MLFLOW_GIT_COMMIT] = commit
        tags[mt.MLFLOW_GIT_DIRTY] = str(bool(_git("status", "--porcelain", "--untracked-files=no"))).lower()
        branch = _git("rev-parse", "--abbrev-ref", "HEAD")
        if branch and branch != "HEAD":
            tags[mt.MLFLOW_GIT_BRANCH] = branch
        remote = _git("remote", "get-url", "origin")
        if remote:
            tags[mt.MLFLOW_GIT_REPO_URL] = remote
    return tags


def submitted_job() -> bool:
    """This driver runs as a `ray job submit` entrypoint."""
    return bool(os.environ.get(RAY_JOB_ENV))


def where_runs_are(uri: str, experiment_id: str) -> str:
    """The closing line's MLflow part: where the runs are and how to open them. A server: its runs page. A
    SQLite store: the checkout's default one opens with `make mlflow-ui`; any other (an installed package, a
    job, another path) with `mlflow ui --backend-store-uri ...`, then the runs page on 127.0.0.1:5000."""
    if uri.startswith("http"):
        return f"MLflow runs: {runs_page(uri, experiment_id)}"
    page = runs_page("http://127.0.0.1:5000", experiment_id)
    checkout = (REPO / "Makefile").is_file() and not submitted_job()
    if checkout and uri == f"sqlite:///{DEFAULT_DB}":
        return f"MLflow runs: in {uri}; open them with make mlflow-ui, then {page}"
    return (f"MLflow runs: in {uri}; open them with mlflow ui --backend-store-uri {uri} --host 127.0.0.1 "
            f"--port 5000, then {page}")


# MLflow 3.17's UI opens every experiment in its GenAI view unless the page asks for the classic one: its
# workflow switch reads the `workflowType` query parameter of the page's address (else the browser's last
# choice, default genai) and, while the switch is on, ignores the `mlflow.experimentKind` tag. Sorted by time
# per token, fastest first.
KEY_METRICS = ("time_per_token_s", "speed_ratio_vs_fetch_all", "ppl_change_pct", "ppl_ci_low", "ppl_ci_high")
# The runs table's columns are the UI's view state (kept in the browser); MLflow's own "share view" keeps one
# as an experiment tag `mlflow.sharedViewState.<key>` (JSON of the UI state and the search facets) that the
# page `...?viewStateShareKey=<key>` loads. The sweep writes one such view with MlflowClient.set_experiment_tag:
# the key metrics and the host as columns, sorted by time per token.
VIEW_KEY = "expertsweep-key-metrics"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
VIEW_STATE = {"orderByKey": "metrics.`time_per_token_s`", "orderByAsc": True,
              "selectedColumns": ["tags.`host`", *(f"metrics.`{m}`" for m in KEY_METRICS), "attributes.`Source`"]}
RUNS_VIEW = f"workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"


def runs_page(ui: str, experiment_id: str) -> str:
    """The address of an experiment's runs list in the MLflow UI at `ui` (http://HOST:PORT), in the classic
    machine-learning view (RUNS_VIEW)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?{RUNS_VIEW}"


def experiment_id_of(uri: str, experiment: str = EXPERIMENT) -> str | None:
    """The id of `experiment` in the store at `uri`, None when it has none yet."""
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
    return exp.experiment_id if exp is not None else None


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


def active_params(params: dict[str, Any]) -> dict[str, Any]:
    """A trial's parameters without the policy's inactive ones (the policy table's `active` rule of each row,
    runtime/core/policy.py: no `lowbit_bits` without a low-bit fallback, no `gamma` without LFU, ...); the
    other keys (capacity, memory budget) stay."""
    from runtime.core.policy import PARAMS
    from sweep.space import policy_of

    try:
        pol = policy_of(params)
    except (TypeError, ValueError):  # not a whole policy: keep what was given
        return dict(params)
    inactive = {prm.name for prm in PARAMS if not prm.is_active(pol)}
    return {k: v for k, v in params.items() if k not in inactive}


def child_payload(rec: dict[str, Any], gpu: str) -> tuple[str, dict[str, str], dict[str, str], dict[str, float]]:
    """(run name, tags, params, metrics) of a child run from a merged record of one policy on one host.

    `rec` holds `key`, `host`, `policy` (label), `params` (policy fields + capacity), `fidelity`,
    `status` and its figures (simulated and, where measured, emulated / engine)."""
    name = f"{rec['host']} · {rec.get('baseline') or rec['policy']}"  # the two hosts' runs of a policy differ
    tags = {"host": rec["host"], "gpu": gpu, "fidelity": rec.get("fidelity", "simulator"), "key": rec["key"],
            "policy": rec["policy"], "status": rec.get("status", "ok"), "mlflow.runName": name}
    for k in ("baseline", "on_front", "initial_residency", "family"):
        if rec.get(k) is not None and rec.get(k) is not False:
            tags[k] = str(rec[k])
    if rec.get("error"):
        tags["error"] = str(rec["error"])[:4000]
    params = {k: _param(v) for k, v in active_params(rec["params"]).items()}
    if rec.get("initial_residency"):
        params["initial_residency"] = str(rec["initial_residency"])[:6000]
    metrics = _metrics({k: v for k, v in rec.items() if k != "params"})
    return name, tags, params, metrics


class Tracker:
    """A sweep's MLflow parent run, its metrics, tables and child runs (MLflow's async logging)."""

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
        tags = {**EXPERIMENT_KIND, VIEW_TAG: json.dumps(VIEW_STATE)}
        for k, v in tags.items():
            if exp is None or exp.tags.get(k) != v:
                self.client.set_experiment_tag(self.experiment_id, k, v)
        self.parent_id: str | None = None
        self.source = source_tags()
        self._ops: list[Any] = []  # MLflow's RunOperations of the queued async log_batch calls
        self._step = 0
        self.cpu_seconds = 0.0  # CPU time of the driver's own MLflow calls (the async writes run in MLflow's pool)
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
            run = self.client.create_run(self.experiment_id, run_name=name, tags={**self.source, **tags})
            self.parent_id = run.info.run_id
            self.client.log_batch(self.parent_id, params=[Param(k, _param(v)[:6000]) for k, v in params.items()])
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

    def _guard(self, kind: str, fn: Any, *args: Any, **kw: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - tracking must not stop the sweep
            self.errors += 1
            log.warning("MLflow write failed (%s): %s", kind, exc)
            return None
        finally:
            self.cpu_seconds += time.thread_time() - t0

    def log_children(self, recs: list[dict[str, Any]], gpus: dict[str, str]) -> None:
        """Write child runs (one per record) not yet in the store."""
        done = self.logged_keys()
        for rec in recs:
            if rec["key"] not in done:
                self._guard("child", self._write_child, rec, gpus.get(rec["host"], "-"))

    def log_parent_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Queue metrics of the parent run (MLflow's async logging: returns at once)."""
        from mlflow.entities import Metric

        if step is None:
            self._step += 1
            step = self._step
        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items()
                 if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
        if batch:
            self._queue_batch("parent_metrics", self.parent_id, metrics=batch)

    def _queue_batch(self, kind: str, run_id: str, **batch: Any) -> None:
        op = self._guard(kind, self.client.log_batch, run_id, synchronous=False, **batch)
        if op is not None:
            self._ops.append((kind, op))

    def log_table(self, df: Any, artifact_file: str) -> None:
        """A pandas DataFrame as an MLflow table of the parent run (shown in the UI's artifacts)."""
        self._guard("table", self.client.log_table, self.parent_id, data=df, artifact_file=artifact_file)

    def _write_child(self, rec: dict[str, Any], gpu: str) -> None:
        from mlflow.entities import Metric, Param

        name, tags, params, metrics = child_payload(rec, gpu)
        tags = {**self.source, **tags, "mlflow.parentRunId": self.parent_id}
        ts = int(rec.get("finished_at", time.time()) * 1000)
        run = self.client.create_run(self.experiment_id, start_time=ts, tags=tags, run_name=name)
        self._queue_batch("child", run.info.run_id, metrics=[Metric(k, v, ts, 0) for k, v in metrics.items()],
                          params=[Param(k, v) for k, v in params.items()])
        self.client.set_terminated(run.info.run_id, "FINISHED" if rec.get("status", "ok") == "ok" else "FAILED",
                                   end_time=ts)
        self.written += 1

    def flush(self) -> None:
        """Wait until every queued write is in the store (a failed one is counted and logged)."""
        ops, self._ops = self._ops, []
        for kind, op in ops:
            self._guard(kind, op.wait)

    def log_artifacts(self, files: list[Path]) -> None:
        self.flush()
        for f in files:
            try:
                self.client.log_artifact(self.parent_id, str(f))
            except Exception as exc:  # noqa: BLE001
                log.warning("MLflow artifact %s not logged: %s", f, exc)

    def close(self, status: str = "FINISHED") -> None:
        if self.parent_id is None:
            return
        self.flush()
        self.client.set_terminated(self.parent_id, status)
        self.parent_id = None
