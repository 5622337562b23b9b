"""Helpers for the sweep tests: small inputs, a real local multi-node Ray cluster, a real MLflow server.

The cluster is `ray start --block` processes (a head and worker nodes, each in its own session,
on 127.0.0.1 with free ports, a private temp dir and its own working directory), stopped by their
process ids; nothing here runs `ray stop`. The MLflow server is `mlflow/start.sh` (the project's script) on a free port
with a SQLite store in a temp dir, stopped by its process group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
RAY = str(Path(PY).parent / "ray")
SPACE = {
    "rule": {"choices": ["threshold", "first_choice", "substitute_all"]},
    "tau": {"low": 0.05, "high": 0.5, "log": True},
    "evict": {"choices": ["lfu", "lru"]},
    "gamma": {"low": 0.9, "high": 1.0},
    "beta": {"choices": ["off", 0.5]},
    "capacity_fraction": {"low": 0.15, "high": 0.4},
}


MODEL_RESOURCE = "model:sweepmicro"  # the session cluster's first worker holds the micro model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ray's start-up waits, through its documented environment variables, long enough for a machine whose
# cores another job keeps busy (the defaults are 30-60 s per GCS call; a loaded 2-core machine exceeded
# them: "Failed to get node info: Deadline Exceeded"). Overridable from the environment.
# (not RAY_raylet_client_connect_timeout_milliseconds: at 60000 an embedded ray.init(address="local") failed
# "The current node timed out during startup" in 1 of 4 starts on an idle machine, measured)
RAY_PATIENCE = {"RAY_gcs_server_request_timeout_seconds": "180", "RAY_py_gcs_connect_timeout_s": "180",
                "RAY_gcs_rpc_server_reconnect_timeout_s": "180", "RAY_worker_register_timeout_seconds": "180"}
START_WAIT_S = float(os.environ.get("EXPERTSWEEP_TEST_RAY_START_S", "300"))  # per node, all its attempts


def env(**extra: str) -> dict[str, str]:
    e = {**RAY_PATIENCE, **os.environ}
    e.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", MLFLOW_DISABLE_TELEMETRY="true",
             PYTHONUNBUFFERED="1")
    e.pop("RAY_ADDRESS", None)
    e["PATH"] = f"{Path(PY).parent}{os.pathsep}{e.get('PATH', '')}"  # as with the venv activated (ray job: python)
    e.update(extra)
    return e


def make_trace(folder: Path, tokens: int = 1200, layers: int = 3, experts: int = 32, top_k: int = 4) -> Path:
    """A small synthetic trace file (and its calibration twin next to it)."""
    from runtime.formats.trace import save_trace, synthetic_trace

    path = folder / "trace.parquet"
    if not path.exists():
        save_trace(synthetic_trace(tokens, layers, experts, top_k, seed=0), path)
        save_trace(synthetic_trace(tokens, layers, experts, top_k, seed=0, sample=1), folder / "calib.parquet")
    return path


def write_config(folder: Path, name: str = "t", **kw) -> Path:
    """A sweep YAML on the synthetic trace of `folder` (keys of `kw` override the defaults)."""
    trace = make_trace(folder)
    cfg = {"name": name, "trace": str(trace), "calib_trace": str(folder / "calib.parquet"),
           "hosts": ["rtx3090", "rtx4090"], "trials": 6, "max_failures": 1,
           "emulation": False, "space": SPACE}
    cfg.update(kw)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def driver_cmd(config: Path, out: Path, *extra: str, faults: list[dict] | None = None) -> list[str]:
    """sweep/pareto.py, or with `faults` the same driver run by tests/sweep_faults.py, whose `ray.init` gives
    the job the runtime_env that injects the faults into its Ray workers; run from REPO."""
    head = [PY, "-m", "tests.sweep_faults", json.dumps(faults)] if faults else [PY, str(REPO / "sweep" / "pareto.py")]
    return [*head, "--config", str(config), "--out", str(out), *extra]


def run_driver(config: Path, out: Path, *extra: str, timeout: float = 240, faults: list[dict] | None = None,
               **env_extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(driver_cmd(config, out, *extra, faults=faults), cwd=REPO, env=env(**env_extra),
                          capture_output=True, text=True, timeout=timeout)


def ledger(out: Path, bounds: bool = True) -> list[dict]:
    """The sweep's trials.jsonl rows; bounds=False leaves out the offline bounds computed per host (sweep/bounds.py)."""
    from sweep.bounds import bound_of

    path = out / "trials.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return rows if bounds else [r for r in rows if bound_of(r.get("baseline")) is None]


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
    """Stop a process started in its own session, then anything left in its group."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class LocalCluster:
    """A head and worker nodes started with `ray start --block` on 127.0.0.1."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))  # short: socket paths have a length limit
        self.port = free_port()
        self.dashboard_port = free_port()
        self.nodes: list[tuple[subprocess.Popen, dict]] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, args: list[str], resources: dict, num_cpus: int) -> subprocess.Popen:
        """`ray start --block` one node and wait until it says it started. Ray's own wait for its raylet
        to register is a fixed 30 s that a loaded machine can exceed ("The current node timed out during
        startup"): then the node's processes are stopped and it is started again, in a fresh temp dir,
        until START_WAIT_S has passed."""
        index = len(self.nodes)
        deadline = time.time() + START_WAIT_S
        for attempt in range(1, 100):
            cmd = [RAY, "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
                   f"--resources={json.dumps(resources)}", "--object-store-memory=100000000",
                   f"--temp-dir={self.root / f'n{index}.{attempt}'}", "--disable-usage-stats",
                   f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                   f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}", *args]
            path = self.root / f"node{index}.{attempt}.log"
            cwd = self.root / f"cwd{index}"  # each node (and the workers it starts) in a folder of its own
            cwd.mkdir(exist_ok=True)
            proc = subprocess.Popen(cmd, stdout=open(path, "w"), stderr=subprocess.STDOUT, env=env(), cwd=cwd,
                                    start_new_session=True)
            # one node at a time: nodes started together in one session folder race for socket names
            while "Ray runtime started" not in path.read_text():
                if proc.poll() is not None or time.time() > deadline:
                    break
                time.sleep(0.5)
            else:
                self.nodes.append((proc, resources))
                return proc
            stop_group(proc)
            if time.time() > deadline:
                raise RuntimeError(f"ray start failed {attempt} time(s) in {START_WAIT_S:.0f} s: "
                                   f"{path.read_text()[-3000:]}")
            time.sleep(2)
        raise AssertionError("unreachable")

    def start_head(self, resources: dict, num_cpus: int = 1) -> None:
        self._start(["--head", f"--port={self.port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                     f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={free_port()}"],
                    resources, num_cpus)

    def add_worker(self, resources: dict, num_cpus: int = 1) -> subprocess.Popen:
        return self._start([f"--address={self.address}"], resources, num_cpus)

    def node_ids(self, timeout: float = START_WAIT_S) -> list[dict]:
        """Alive nodes (waits until every started node has joined)."""
        code = (f"import ray, json; ray.init(address={self.address!r}, logging_level='ERROR'); "
                "print(json.dumps([{'id': n['NodeID'], 'resources': n['Resources']} for n in ray.nodes() "
                "if n['Alive']]))")
        deadline = time.time() + timeout
        while True:
            r = subprocess.run([PY, "-c", code], env=env(), capture_output=True, text=True, timeout=timeout + 60)
            alive = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else []
            if len(alive) >= sum(p.poll() is None for p, _ in self.nodes) or time.time() > deadline:
                return alive
            time.sleep(2)

    def kill(self, proc: subprocess.Popen) -> None:
        """Lose a node at once: SIGKILL to its whole process group (raylet, workers)."""
        stop_group(proc, signal.SIGKILL, timeout=5)

    def stop(self) -> None:
        for proc, _ in reversed(self.nodes):
            stop_group(proc)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session", name="ray_cluster")
def ray_cluster_fixture():
    """Head (host:rtx4090, dashboard for jobs) + two workers (host:rtx3090 each; the first also holds the
    micro model: `model:sweepmicro`), one CPU per node."""
    c = LocalCluster()
    try:
        c.start_head({"host:rtx4090": 1})
        c.add_worker({"host:rtx3090": 1, MODEL_RESOURCE: 1})
        c.add_worker({"host:rtx3090": 1})
        nodes = c.node_ids()
        assert len(nodes) == 3, f"cluster did not come up: {nodes}; logs in {c.root}"
        c.started_nodes = nodes
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session", name="micro_model")
def micro_model_fixture() -> Path:
    """A two-layer micro Qwen3-MoE (64 experts, top-8) built in seconds, once for every worker of the run and
    kept for the next run (tests/fixture_cache.py: keyed by its spec, corpus and the builder's sources)."""
    import dataclasses

    from tests.fixture_cache import cached_model

    tinymodel = pytest.importorskip("runtime.tools.tinymodel")
    spec = dataclasses.replace(tinymodel.SPECS["test"], name="sweepmicro", num_layers=2, hidden_size=32,
                               intermediate_size=64, moe_intermediate_size=16, head_dim=8, vocab_size=320,
                               seq_len=64, batch_size=4, steps=20, warmup_steps=5, train_bytes=60_000,
                               heldout_bytes=8_000)
    return cached_model(spec)


@pytest.fixture(scope="session", name="mlflow_server")
def mlflow_server_fixture(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 (the project's mlflow/start.sh), SQLite store in a temp dir."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    e = env(MLFLOW_BACKEND_STORE_URI=f"sqlite:///{root / 'mlflow.db'}", MLFLOW_ARTIFACTS_DESTINATION=str(root / "art"),
            MLFLOW_HOST="127.0.0.1", MLFLOW_PORT=str(port), MLFLOW_WORKERS="1")
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(["bash", str(REPO / "mlflow" / "start.sh")], cwd=REPO, env=e, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.time() + START_WAIT_S  # a loaded machine imports MLflow slowly
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(1)
        yield url
    finally:
        stop_group(proc)
