"""The sweep on a real local multi-node Ray cluster: `ray job submit`, a real MLflow server, and faults.

One session cluster (tests/sweep_fixtures.py): a head with `host:rtx4090` and the job server,
two workers with `host:rtx3090` (the first also `model:sweepmicro`), one CPU each, each node in its
own working directory, all on 127.0.0.1 and stopped by pid. The node-loss test adds and kills a
third worker of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sweep.bounds import bound_of
from tests import sweep_faults
from tests.sweep_fixtures import (  # noqa: F401 - the fixtures are used by name
    MODEL_RESOURCE,
    PY,
    RAY,
    REPO,
    driver_cmd,
    env,
    ledger,
    mlflow_server_fixture,
    ray_cluster_fixture,
    run_driver,
    stop_group,
    write_config,
)

pytestmark = pytest.mark.slow


def _node_of(cluster, resource: str) -> set[str]:
    return {n["id"] for n in cluster.started_nodes if resource in n["resources"]}


def test_host_with_no_node_is_one_line_before_any_trial(ray_cluster, tmp_path):
    cfg = write_config(tmp_path)
    out = tmp_path / "out"
    proc = run_driver(cfg, out, "--hosts", "rtx3090,rtx5090", "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}",
                      RAY_ADDRESS=ray_cluster.address, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("expertsweep: error: host rtx5090: no Ray node has the resource host:rtx5090"), last
    assert not ledger(out)


def test_model_resource_no_node_offers_is_one_line_before_any_trial(ray_cluster, micro_model, tmp_path):
    cfg = write_config(tmp_path, trace=None, calib_trace=None, model=str(micro_model), model_resource="elsewhere")
    out = tmp_path / "out"
    proc = run_driver(cfg, out, "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}", RAY_ADDRESS=ray_cluster.address,
                      timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("expertsweep: error: model_resource elsewhere: no alive Ray node offers the resource "
                           "model:elsewhere"), last
    assert not ledger(out) and not (out / "tune").exists()


def test_job_submit_smoke_to_mlflow_server(ray_cluster, mlflow_server, micro_model, tmp_path):
    """`ray job submit --working-dir . -- python sweep/pareto.py --config search_spaces/smoke.yaml`
    (on a micro model built in seconds: recording, sweep and emulation all run in the job)."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    cmd = [RAY, "job", "submit", "--address", ray_cluster.dashboard, "--working-dir", ".", "--",
           "python", "sweep/pareto.py", "--config", "search_spaces/smoke.yaml", "--out", str(out),
           "--mlflow-uri", mlflow_server, "--name", "smoke-job", "--model", str(micro_model)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0 and "succeeded" in proc.stdout.lower(), (proc.stdout[-4000:], proc.stderr[-2000:])
    for f in ("pareto_rtx3090.csv", "pareto_rtx4090.csv", "speed_ratios.csv", "pareto.png", "summary.md"):
        assert (out / f).is_file(), f
    rows = ledger(out)
    sim = [r for r in rows if r["fidelity"] == "simulator" and bound_of(r["baseline"]) is None]  # (bounds: the bounded copy pool)
    assert len(sim) == 2 * (7 + 6) and all(r["status"] == "ok" for r in sim)
    # every trial ran on a node of its host
    assert {r["node"] for r in sim if r["host"] == "rtx4090"} <= _node_of(ray_cluster, "host:rtx4090")
    assert {r["node"] for r in sim if r["host"] == "rtx3090"} <= _node_of(ray_cluster, "host:rtx3090")
    emu = [r for r in rows if r["fidelity"] == "emulation"]
    assert emu and all(r["status"] == "ok" for r in emu)
    assert "Mass hypothesis" in (out / "summary.md").read_text()

    client = MlflowClient(mlflow_server)  # over HTTP
    exp = client.get_experiment_by_name("expertsweep")
    parent = client.search_runs([exp.experiment_id], "tags.sweep = 'smoke-job'")[0]
    assert parent.info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                  max_results=1000)
    assert {c.data.tags["host"] for c in children} == {"rtx3090", "rtx4090"}
    assert "emulation" in {c.data.tags["fidelity"] for c in children}
    assert all(c.info.run_name == f"{c.data.tags['host']} · {c.data.tags.get('baseline') or c.data.tags['policy']}"
               for c in children)
    assert "summary.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}


def test_failing_and_killed_trials_are_retried_then_recorded_failed(ray_cluster, tmp_path):
    cfg = write_config(tmp_path, hosts=["rtx3090"], trials=6, seed=3, batch=1,
                       baselines={"policies": ["rule-0.15", "substitute-all"]},
                       space={"rule": {"choices": ["threshold", "first_choice"]}, "tau": {"low": 0.1, "high": 0.4},
                              "capacity_fraction": {"low": 0.15, "high": 0.4}})
    out = tmp_path / "out"
    faults = [{"match": {"rule": "substitute_all"}, "action": "raise"},
              {"match": {"rule": "first_choice"}, "action": "kill"}]
    proc = run_driver(cfg, out, "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}", RAY_ADDRESS=ray_cluster.address,
                      faults=faults, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["key"]: r for r in ledger(out) if bound_of(r["baseline"]) is None}  # the computed bounds aside
    assert len(rows) == 2 + 6
    raised = [r for r in rows.values() if r["params"]["rule"] == "substitute_all"]
    assert raised and all(r["status"] == "failed" and r["attempts"] == 2 and "injected fault" in r["error"]
                          for r in raised)
    killed = [r for r in rows.values() if r["params"]["rule"] == "first_choice"]
    assert killed, "the seed should draw first_choice at least once"
    assert all(r["status"] == "failed" and "failed 2 time(s)" in r["error"] for r in killed)
    assert all(r["status"] == "ok" for r in rows.values() if r["params"]["rule"] == "threshold")
    stats = json.loads((out / "stats.json").read_text())
    assert stats["trials_failed"] == len(raised) + len(killed)


def test_driver_killed_mid_sweep_is_resumed(ray_cluster, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = write_config(tmp_path, trials=14, batch=2, baselines={"policies": ["rule-0.15", "speed-first"]})
    out = tmp_path / "out"
    db = f"sqlite:///{tmp_path / 'm.db'}"
    e = env(RAY_ADDRESS=ray_cluster.address)
    slow = [{"match": {}, "action": "sleep", "seconds": 0.3}]
    log = open(tmp_path / "driver1.log", "w")
    proc = subprocess.Popen(driver_cmd(cfg, out, "--mlflow-uri", db, faults=slow), cwd=REPO, env=e, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while len(ledger(out)) < 12 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None, f"the driver ended before it was killed: {(tmp_path / 'driver1.log').read_text()[-3000:]}"
        assert (out / "screening_rtx3090.csv").exists() or (out / "screening_rtx4090.csv").exists()  # as they finish
    finally:
        stop_group(proc, signal.SIGKILL)
    before = (out / "trials.jsonl").read_text()
    before_keys = [json.loads(line)["key"] for line in before.splitlines() if line.strip()]
    parent = json.loads((out / "state.json").read_text())["parent_run_id"]

    proc2 = subprocess.run(driver_cmd(cfg, out, "--resume", faults=slow), cwd=REPO, env=e, capture_output=True, text=True,
                           timeout=300)
    assert proc2.returncode == 0, proc2.stderr[-4000:]
    after = (out / "trials.jsonl").read_text()
    assert after.startswith(before.rsplit("\n", 1)[0])  # nothing recorded before the kill was rewritten
    rows = ledger(out)
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)), "a trial was recorded twice"
    assert set(before_keys) <= set(keys)
    for host in ("rtx3090", "rtx4090"):
        assert sum(r["host"] == host and r["baseline"] is None for r in rows) == 14
        assert sum(r["host"] == host and r["baseline"] is not None and bound_of(r["baseline"]) is None
                   for r in rows) == 2
    # (a computed bound's run may be infeasible at the budget: one of its pool sizes does not fit)
    assert all(r["status"] == "ok" for r in rows if bound_of(r["baseline"]) is None)
    assert json.loads((out / "stats.json").read_text())["trials_evaluated_twice"] == 0
    assert json.loads((out / "state.json").read_text())["parent_run_id"] == parent
    client = MlflowClient(db)
    children = client.search_runs([client.get_experiment_by_name("expertsweep").experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent}'", max_results=1000)
    child_keys = [c.data.tags["key"] for c in children]
    assert len(child_keys) == len(set(child_keys)), "a child run was written twice"
    assert {c.data.tags.get("baseline") for c in children} >= {"rule-0.15", "speed-first"}
    assert client.get_run(parent).info.status == "FINISHED"


def test_worker_node_lost_mid_sweep_costs_only_its_running_trials(ray_cluster, tmp_path):
    extra = ray_cluster.add_worker({"host:rtx3090": 1})
    nodes = ray_cluster.node_ids()
    extra_ids = {n["id"] for n in nodes} - {n["id"] for n in ray_cluster.started_nodes}
    assert len(extra_ids) == 1, nodes
    extra_id = extra_ids.pop()
    cfg = write_config(tmp_path, hosts=["rtx3090"], trials=24, batch=2, baselines={"policies": ["rule-0.15"]})
    out = tmp_path / "out"
    e = env(RAY_ADDRESS=ray_cluster.address)
    log = open(tmp_path / "driver.log", "w")
    proc = subprocess.Popen(driver_cmd(cfg, out, "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}",
                                       faults=[{"match": {}, "action": "sleep", "seconds": 0.4}]), cwd=REPO,
                            env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while not any(r.get("node") == extra_id for r in ledger(out)) and time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(0.3)
        done_on_lost = [r["key"] for r in ledger(out) if r.get("node") == extra_id]
        assert done_on_lost, "no trial ran on the extra node"
        ray_cluster.kill(extra)
        assert proc.wait(timeout=240) == 0, (tmp_path / "driver.log").read_text()[-4000:]
    finally:
        stop_group(proc)
    rows = ledger(out)
    keys = [r["key"] for r in rows if bound_of(r["baseline"]) is None]  # the computed bounds aside
    assert len(keys) == len(set(keys)) == 1 + 24
    assert set(done_on_lost) <= set(keys)
    failed = [r for r in rows if r["status"] != "ok"]
    assert len(failed) <= 2, failed  # at most the batch that was running there (it is retried elsewhere)
    assert os.path.exists(out / "summary.md")


def test_no_worker_touches_the_output_folder(ray_cluster, micro_model, tmp_path):
    """No shared disk: a sweep submitted as a Ray job, whose model sits on one worker node
    (`model_resource`), with every Ray worker process under an audit hook that makes any Python open,
    listing, mkdir, remove or rename of a path under the output folder raise (tests/sweep_audit.py).
    The traces are recorded and the ladder emulated on the model's node, the trials get the traces
    through the object store and report through Tune, and a trial killed after a Tune checkpoint is
    retried from it (what it reported is not evaluated again)."""
    out, audit, cache = tmp_path / "out", tmp_path / "audit", tmp_path / "nodecache"
    audit.mkdir()
    cfg = write_config(tmp_path, trace=None, calib_trace=None, model=str(micro_model), max_tokens=512,
                       model_resource=MODEL_RESOURCE.split(":", 1)[1], trials=2, batch=3,
                       baselines={"policies": ["fetch-every-miss", "rule-0.15", "first-choice"]},
                       emulation={"rungs": [128], "max_full": 1, "engine": False},
                       space={"rule": {"choices": ["threshold", "substitute_all"]}, "tau": {"low": 0.1, "high": 0.4},
                              "capacity_fraction": 0.25})
    # rtx3090's baselines are one Tune trial of 3 items, 1.1 s each (the worker reports every 1 s): a report
    # with a checkpoint after each of the first two, then the process dies on the third (first-choice), twice
    faults = [{"match": {"rule": "first_choice", "host": "rtx3090"}, "action": "kill"},
              {"match": {}, "action": "sleep", "seconds": 1.1}]
    audit_env = {"EXPERTSWEEP_AUDIT_ROOT": str(out), "EXPERTSWEEP_AUDIT_LOG": str(audit),
                 "EXPERTSWEEP_CACHE": str(cache)}
    # the job's one setup hook installs both the audit and the faults (tests/sweep_faults.py); the driver is
    # the product's own sweep/pareto.py
    job_env = sweep_faults.runtime_env(faults, "tests.sweep_faults.install_audited", **audit_env)
    entry = [PY, "sweep/pareto.py", "--config", str(cfg), "--out", str(out),
             "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"]
    cmd = [RAY, "job", "submit", "--address", ray_cluster.dashboard, "--working-dir", ".",
           "--runtime-env-json", json.dumps(job_env), "--", *entry]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "succeeded" in proc.stdout.lower(), (proc.stdout[-4000:], proc.stderr[-2000:])

    installed = sorted(audit.glob("installed-*"))
    violations = {p.name: p.read_text() for p in audit.glob("violations-*")}
    assert len(installed) >= 3, installed  # the hook ran in the trial actors and the model's tasks
    assert not violations, violations
    assert not list(out.rglob("checkpoint_*"))  # the trials' Tune checkpoints never reached the output folder

    rows = ledger(out)
    model_node = _node_of(ray_cluster, MODEL_RESOURCE)
    emu = [r for r in rows if r["fidelity"] == "emulation"]
    assert emu and all(r["status"] == "ok" and r["node"] in model_node for r in emu)
    assert list((cache / "traces").glob("*.parquet"))  # recorded into the model node's cache, not --out
    base = {r["baseline"]: r for r in rows if r["host"] == "rtx3090" and r["baseline"]}
    assert base["fetch-every-miss"]["status"] == base["rule-0.15"]["status"] == "ok"
    assert base["first-choice"]["status"] == "failed" and "failed 2 time(s)" in base["first-choice"]["error"]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["trials_evaluated_twice"] == 0  # the retry resumed from the checkpoint after item 2 (without
    # it, items 1 and 2 are evaluated and reported again: checked by disabling the checkpoint read)

    # the hook is real: a task under the same runtime_env that opens a file of the output folder fails
    code = ("import json, ray, sys; ray.init(address=sys.argv[1], runtime_env=json.loads(sys.argv[2]), "
            "logging_level='ERROR')\n"
            "@ray.remote(num_cpus=0)\ndef peek(p):\n    return open(p).read()[:10]\n"
            "try:\n    print('READ', ray.get(peek.remote(sys.argv[3])))\n"
            "except Exception as e:\n    print('REFUSED', str(e)[-600:])\n")
    renv = {"worker_process_setup_hook": "tests.sweep_audit.install", "env_vars": audit_env, "working_dir": str(REPO)}
    probe = subprocess.run([PY, "-c", code, ray_cluster.address, json.dumps(renv),
                            str(out / "summary.md")], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert "audit: a Ray worker touched the driver's output folder" in probe.stdout, (probe.stdout[-2000:],
                                                                                      probe.stderr[-2000:])
    assert any("summary.md" in p.read_text() for p in audit.glob("violations-*"))


def test_local_cluster_uses_a_token_and_the_documented_client_steps_work(tmp_path):
    """infra/local_cluster.sh with RAY_AUTH_MODE unset (as a user runs it): token authentication, the nodes on
    127.0.0.1; docs/sweep.md's client steps (the token and RAY_AUTH_MODE=token, as `up` writes them to
    client.env; or the token copied to ~/.ray/auth_token) join it and submit a job; a client without the
    token, or with the token but not RAY_AUTH_MODE=token, is refused."""
    state, home = tmp_path / "state", tmp_path / "home"
    home.mkdir()  # no ~/.ray/auth_token of this machine's user reaches the test
    base = env(EXPERTSWEEP_LOCAL_CLUSTER=str(state), HOME=str(home))
    base.pop("RAY_AUTH_MODE")
    token = state / "auth_token"
    up = subprocess.run(["bash", "infra/local_cluster.sh", "up"], cwd=REPO, env=base, capture_output=True, text=True,
                        timeout=600)
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        client = dict(kv.split("=", 1) for kv in (state / "client.env").read_text().split()[1:])
        assert client["RAY_AUTH_MODE"] == "token" and client["RAY_ADDRESS"].startswith("127.0.0.1:")
        assert Path(client["RAY_AUTH_TOKEN_PATH"]) == token and (token.stat().st_mode & 0o777) == 0o600
        code = (f"import ray; ray.init(address={client['RAY_ADDRESS']!r}, logging_level='ERROR'); "
                "print('resources', ray.cluster_resources().get('host:rtx3090'))")

        def join(**extra: str) -> subprocess.CompletedProcess:
            e = {**base, **extra}
            return subprocess.run([PY, "-c", code], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=240)

        r = join(**client)
        assert r.returncode == 0 and "resources 2.0" in r.stdout, r.stderr[-2000:]
        (home / ".ray").mkdir()
        (home / ".ray" / "auth_token").write_text(token.read_text())
        r = join(RAY_AUTH_MODE="token")  # the token copied to ~/.ray/auth_token, as docs/sweep.md says
        assert r.returncode == 0 and "resources 2.0" in r.stdout, r.stderr[-2000:]
        (home / ".ray" / "auth_token").unlink()
        for extra in ({}, {"RAY_AUTH_TOKEN_PATH": str(token)}):  # no token; the token without RAY_AUTH_MODE=token
            r = join(**extra)
            assert r.returncode != 0 and "resources" not in r.stdout, (extra, r.stdout[-500:])
        _only_documented_sockets_off_loopback(state)
        _no_token_is_one_line(state, base, client, tmp_path)
        out, temps = _job_sweep(state, base, client, tmp_path)
        job = [RAY, "job", "submit", "--address", (state / "dashboard").read_text().strip(), "--", "python", "-c",
               "print('answer', 6 * 7)"]
        r = subprocess.run(job, cwd=tmp_path, env={**base, **client}, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "answer 42" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
        r = subprocess.run(job, cwd=tmp_path, env=base, capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "answer 42" not in r.stdout
    finally:
        down = subprocess.run(["bash", "infra/local_cluster.sh", "down"], cwd=REPO, env=base, capture_output=True,
                              text=True, timeout=120)
        assert down.returncode == 0, down.stderr[-2000:]
    assert not token.exists() and not (state / "client.env").exists()
    _resume_after_the_cluster_is_gone(out, temps, base, tmp_path)


def _cluster_pids(state: Path) -> dict[int, str]:
    """The processes of infra/local_cluster.sh's nodes (each `ray start --block` and its descendants): pid -> its
    role, the psutil name or, for a Python process, its script or module (`dashboard.py`, `ray.util.client.server`)."""
    import psutil

    roles = {}
    for f in state.glob("node*.pid"):
        root = psutil.Process(int(f.read_text()))
        for p in [root, *root.children(recursive=True)]:
            try:
                name, cmd = p.name(), p.cmdline()
            except psutil.NoSuchProcess:
                continue
            if name.startswith("python") and len(cmd) > 1:
                arg = cmd[cmd.index("-m") + 1] if "-m" in cmd else next((a for a in cmd[1:] if a.endswith(".py")), cmd[1])
                name = Path(arg).name
            if name.startswith("ray::") and name not in ("ray::DashboardAgent", "ray::RuntimeEnvAgent"):
                name = "ray::IDLE"  # a Ray worker process, named after its task or actor while it runs one
            roles[p.pid] = name
    return roles


def _only_documented_sockets_off_loopback(state: Path) -> None:
    """Every listening socket of the cluster's own processes is on loopback, or its process is a row of
    infra/README.md's socket table (the job API's never: it must be loopback)."""
    import ipaddress

    import psutil

    roles = _cluster_pids(state)
    table = (REPO / "infra" / "README.md").read_text().split("## Listening sockets")[1]
    documented = {line.split("|")[1].strip().strip("`") for line in table.splitlines()
                  if line.startswith("| `") and "127.0.0.1 only" not in line}
    dash_port = int((state / "dashboard").read_text().strip().rsplit(":", 1)[1])
    listening = [(c.laddr.ip, c.laddr.port, roles[c.pid]) for c in psutil.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in roles]
    assert len(listening) >= 10, listening  # the listing sees the cluster (27 sockets measured)

    def loopback(ip: str) -> bool:
        a = ipaddress.ip_address(ip)
        return a.is_loopback or (a.version == 6 and a.ipv4_mapped is not None and a.ipv4_mapped.is_loopback)

    off = [(ip, port, role) for ip, port, role in listening if not loopback(ip)]
    assert all(loopback(ip) for ip, port, _ in listening if port == dash_port), listening  # the job API
    undocumented = [s for s in off if s[2] not in documented or s[1] == dash_port]
    assert not undocumented, f"non-loopback sockets not in infra/README.md: {undocumented}"


def _no_token_is_one_line(state: Path, base: dict, client: dict, tmp_path: Path) -> None:
    """The driver without the token against the token cluster: one line that says so and where client.env is;
    nothing made in --out."""
    cfg, out = write_config(tmp_path, name="nt", trials=1), tmp_path / "no-token-out"
    e = {**base, "RAY_py_gcs_connect_timeout_s": "5"}  # Ray's own retries end sooner than the fixtures' 180 s
    proc = subprocess.run(driver_cmd(cfg, out, "--ray-address", client["RAY_ADDRESS"], "--mlflow-uri",
                                     f"sqlite:///{tmp_path / 'nt.db'}"), cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=240)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "refused this client's token" in lines[0] and f". {state / 'client.env'}" in lines[0], lines[0]
    assert "RAY_AUTH_TOKEN_PATH" in lines[0] and "RAY_AUTH_MODE=token" in lines[0]
    assert not out.exists()


def _job_sweep(state: Path, base: dict, client: dict, tmp_path: Path) -> tuple[Path, list[str]]:
    """A trace sweep submitted as a job with the packaged config given by its path in the submitted folder (which
    Ray unpacks into its temp folder); (its --out, the nodes' temp folders)."""
    from tests.sweep_fixtures import make_trace

    out = tmp_path / "job-out"
    trace = make_trace(tmp_path)
    cmd = [RAY, "job", "submit", "--address", (state / "dashboard").read_text().strip(), "--working-dir", ".", "--",
           "python", "sweep/pareto.py", "--config", "search_spaces/smoke.yaml", "--trace", str(trace),
           "--no-emulation", "--trials", "2", "--batch", "4", "--out", str(out),
           "--mlflow-uri", f"sqlite:///{tmp_path / 'job.db'}"]
    proc = subprocess.run(cmd, cwd=REPO, env={**base, **client}, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0 and "succeeded" in proc.stdout.lower(), (proc.stdout[-4000:], proc.stderr[-2000:])
    assert (out / "summary.md").is_file()
    return out, [(state / f"node{i}.tmp").read_text().strip() for i in range(3)]


def _resume_after_the_cluster_is_gone(out: Path, temps: list[str], base: dict, tmp_path: Path) -> None:
    """After `down` (Ray's temp folders, with the job's copy of the config, deleted): nothing in --out or in
    MLflow points into them, and `--resume` of that folder runs (on an embedded Ray)."""
    from mlflow.tracking import MlflowClient

    assert temps and not any(Path(t).exists() for t in temps)
    marks = [t.encode() for t in temps] + [b"runtime_resources", b"working_dir_files"]
    for p in out.rglob("*"):
        assert not p.is_symlink(), p
        if p.is_file():
            data = p.read_bytes()
            assert not any(m in data for m in marks), (p, [m for m in marks if m in data])
    db = f"sqlite:///{tmp_path / 'job.db'}"
    client = MlflowClient(db)
    exp = client.get_experiment_by_name("expertsweep")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    for r in runs:
        for v in [*r.data.params.values(), *r.data.tags.values()]:
            assert not any(m.decode() in v for m in marks), (r.info.run_name, v)
    proc = subprocess.run([PY, str(REPO / "sweep" / "pareto.py"), "--out", str(out), "--resume", "--ray-address",
                           "local", "--num-cpus", "2"], cwd=tmp_path, env=base, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "summary.md").is_file() and "outputs: " + str(out) in proc.stdout
