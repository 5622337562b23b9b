"""Screenshots of the MLflow UI over a sweep's store, for the docs (not part of CI).

Starts `mlflow server` on 127.0.0.1 (a free port) over the store, finds the experiment and its
latest sweep (parent run), and has headless Chromium (Debian's `chromium` package: `apt-get
install -y chromium`) save PNGs of: the experiment's runs list, the parent run, a front table
and one child run. The server is stopped by its process id at the end.

    python scripts/mlflow_screenshots.py [--store sqlite:///mlflow/mlflow.db] [--out docs/img]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("mlflow_screenshots")

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                  "--disable-dev-shm-usage")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store: str, artifacts: str, port: int, logs: Path) -> subprocess.Popen:
    mlflow = Path(sys.executable).parent / "mlflow"
    cmd = [str(mlflow if mlflow.exists() else shutil.which("mlflow")), "server", "--backend-store-uri", store,
           "--artifacts-destination", artifacts, "--serve-artifacts", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(cmd, stdout=open(logs, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600  # a loaded machine takes minutes to import the server
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            stop(proc)
            raise SystemExit(f"mlflow server did not start: {logs.read_text()[-2000:]}")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    """Stop the server (its own session) by pid, then anything left in its process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def shoot(chromium: str, url: str, path: Path, size: str, wait_ms: int) -> None:
    """One PNG of `url`: Chromium gives the page `wait_ms` of virtual time (its scripts run; the budget
    pauses while requests are in flight) and at most `wait_ms` of real time (MLflow's UI keeps
    polling, so the virtual budget alone may never run out), then saves the screenshot; stopped by
    its process group."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
               f"--virtual-time-budget={wait_ms}", f"--timeout={wait_ms}", f"--screenshot={path}", url]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=wait_ms / 1000 + 240)
        except subprocess.TimeoutExpired:
            err = "timed out"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    if not path.is_file():
        raise SystemExit(f"chromium failed on {url}: {err[-1500:]}")
    log.info("saved %s (%s)", path, url)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--store", default=f"sqlite:///{ROOT / 'mlflow' / 'mlflow.db'}")
    ap.add_argument("--artifacts", default=str(ROOT / "mlflow" / "mlruns"))
    ap.add_argument("--experiment", default="expertsweep")
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    ap.add_argument("--size", default="1600,1000")
    ap.add_argument("--wait-ms", type=int, default=45000, help="time each page gets to load and render")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not a.chromium:
        raise SystemExit("chromium not found: apt-get update && apt-get install -y chromium")
    from mlflow.tracking import MlflowClient

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = start_server(a.store, a.artifacts, port, Path(tempfile.gettempdir()) / f"mlflow-screens-{port}.log")
    try:
        base = f"http://127.0.0.1:{port}"
        client = MlflowClient(base)
        exp = client.get_experiment_by_name(a.experiment)
        if exp is None:
            raise SystemExit(f"--experiment {a.experiment}: not in {a.store}")
        parents = client.search_runs([exp.experiment_id], "tags.fidelity = 'sweep'", order_by=["start_time DESC"],
                                     max_results=1)
        if not parents:
            raise SystemExit(f"no sweep in experiment {a.experiment} of {a.store}")
        parent = parents[0].info.run_id
        children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent}'",
                                      order_by=["metrics.speed_ratio_vs_fetch_all DESC"], max_results=50)
        eid = exp.experiment_id
        sys.path.insert(0, str(ROOT))
        from sweep.tracking import runs_page

        classic = "?workflowType=machine_learning"  # MLflow 3.17's UI opens a fresh browser in its GenAI view
        pages = [("mlflow_runs.png", runs_page(base, eid)),  # the classic view, as the sweep prints it
                 ("mlflow_parent.png", f"{base}/#/experiments/{eid}/runs/{parent}{classic}")]
        fronts = [f.path for f in client.list_artifacts(parent, "tables") if f.path.startswith("tables/front_")]
        if fronts:
            pages.append(("mlflow_front_table.png", f"{base}/#/experiments/{eid}/runs/{parent}/artifacts/{fronts[0]}{classic}"))
        child = next((c for c in children if c.data.tags.get("fidelity") != "simulator"), children[0] if children else None)
        if child is not None:
            pages.append(("mlflow_child.png", f"{base}/#/experiments/{eid}/runs/{child.info.run_id}{classic}"))
        for name, url in pages:
            shoot(a.chromium, url, out / name, a.size, a.wait_ms)
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
