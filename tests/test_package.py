"""The installable package: a wheel built from the checkout, installed into a fresh virtual environment,
runs `expertsweep --help` and `expertsweep simulate` from another directory with the host presets,
model shapes and search spaces it carries as package data (importlib.resources), none from the checkout.

Offline: the wheel is built with `pip wheel --no-deps --no-build-isolation --no-index` and installed
with `--no-deps --no-index`; the fresh environment sees this interpreter's installed dependencies
through a `.pth` line (not its editable install of the project, whose finder that line does not load).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.core.errors import InputError
from runtime.formats.trace import save_trace, synthetic_pair

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "runtime", "sweep", "search_spaces")
SHARED_TRACE = REPO.parent / "shared" / "data" / "traces"


def _run(argv, cwd, env, timeout=600):
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the fresh environment's bin/, a working directory outside the checkout, the environment variables)."""
    root = tmp_path_factory.mktemp("pkg")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:  # a copy: the build writes build/ and *.egg-info beside the sources
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EXPERTSWEEP_HOSTS_DIR",
                                                            "EXPERTSWEEP_MODELS_DIR", "VIRTUAL_ENV")}
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
              "-w", root / "dist", src], root, env)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (root / "dist").glob("expertsweep-*.whl")
    venv = root / "venv"
    r = _run([sys.executable, "-m", "venv", "--without-pip", venv], root, env)
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root, env)
                   .stdout.strip())
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    r = _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel], root, env)
    assert r.returncode == 0, r.stderr[-3000:]
    work = root / "elsewhere"
    work.mkdir()
    return venv / "bin", work, env


@pytest.mark.slow
def test_wheel_carries_its_data_and_the_command(installed):
    bin_, work, env = installed
    code = ("import runtime, sweep.pareto as p; from runtime.formats import costmodel as c; "
            "print(runtime.__file__); print(p.DEFAULT_CONFIG, p.DEFAULT_CONFIG.is_file()); "
            "print(c.list_host_profiles()); print(c.list_model_shapes())")
    r = _run([bin_ / "python", "-c", code], work, env)
    assert r.returncode == 0, r.stderr[-3000:]
    where, config, hosts, shapes = r.stdout.strip().splitlines()
    assert Path(where).is_relative_to(bin_.parent) and not Path(where).is_relative_to(REPO), where
    assert config.endswith("sweep/search_spaces/demo.yaml True") and str(REPO) not in config
    assert eval(hosts) == sorted(p.stem for p in (REPO / "runtime" / "data" / "hosts").glob("*.yaml"))
    assert eval(shapes) == sorted(p.stem for p in (REPO / "runtime" / "data" / "models").glob("*.yaml"))
    r = _run([bin_ / "expertsweep", "--help"], work, env)
    assert r.returncode == 0 and all(c in r.stdout for c in ("sweep", "simulate", "emulate", "record", "findings",
                                                             "model")), r.stdout + r.stderr
    r = _run([bin_ / "expertsweep", "simulat"], work, env)
    assert r.returncode == 2 and r.stderr.startswith("expertsweep: error:"), r.stderr
    r = _run([bin_ / "expertsweep", "sweep", "--config", "nowhere.yaml"], work, env)  # the installed sweep driver
    assert r.returncode == 2 and f"--config {work / 'nowhere.yaml'}: cannot read" in r.stderr, r.stderr[-2000:]
    r = _run([bin_ / "expertsweep", "sweep", "--help"], work, env)
    assert r.returncode == 0 and r.stdout.startswith("usage: expertsweep sweep"), r.stdout[:500]
    # a packaged search space by name; refused at its (bad) --hosts, before anything is created
    r = _run([bin_ / "expertsweep", "sweep", "--config", "smoke", "--hosts", "rtx9999"], work, env)
    assert r.returncode == 2 and "--hosts rtx9999: host rtx9999: profile: no preset" in r.stderr, r.stderr[-2000:]
    assert not any(work.iterdir())  # no results/, no mlflow/


@pytest.mark.slow
def test_installed_simulate_runs_on_a_small_trace(installed, tmp_path):
    bin_, work, env = installed
    ev, calib = synthetic_pair(300, 3, 32, 4, 16, seed=5)
    save_trace(ev, tmp_path / "ev.parquet")
    save_trace(calib, tmp_path / "calib.parquet")
    argv = [bin_ / "expertsweep", "simulate", "--trace", tmp_path / "ev.parquet", "--policy", "quality-first",
            "--capacity", "8", "--initial-residency", f"warm:{tmp_path / 'calib.parquet'}", "--json"]
    runs = {}
    for host in ("rtx3090", "rtx5090"):  # two presets from the package data, different figures
        r = _run(argv + ["--host", host], work, env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[host] = json.loads(r.stdout)
        assert runs[host]["host"] == host and runs[host]["capacity"] == [8, 8, 8]
    assert runs["rtx3090"]["fetches"] == runs["rtx5090"]["fetches"] > 0  # same decisions
    assert runs["rtx3090"]["time_per_token_s"] != runs["rtx5090"]["time_per_token_s"]  # other host figures
    r = _run(argv + ["--host", "rtx9999"], work, env)
    assert r.returncode == 2 and "unknown host profile 'rtx9999'" in r.stderr and "rtx4090" in r.stderr, r.stderr
    assert list(work.iterdir()) == []  # nothing written where it ran


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_TRACE.is_dir(), reason="../shared/data absent")
def test_installed_simulate_on_a_shared_trace(installed):
    """A real router trace (Qwen1.5-MoE on GSM8K) with a packaged model-shape preset."""
    bin_, work, env = installed
    r = _run([bin_ / "expertsweep", "simulate", "--trace", SHARED_TRACE / "qwen15moe-a2.7b-gsm8k.npz", "--policy",
              "rule-0.15", "--capacity", "15", "--initial-residency", "held-out", "--model-shape", "qwen1.5-moe-a2.7b",
              "--json"], work, env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["host"] == "rtx4090" and res["model_shape"].startswith("qwen1.5-moe-a2.7b"), res["model_shape"]
    assert res["fetches"] > 0 and list(work.iterdir()) == []


def test_presets_are_package_data_and_the_env_folders_still_win(tmp_path, monkeypatch):
    from importlib import resources

    import yaml

    from runtime.formats import costmodel

    monkeypatch.delenv("EXPERTSWEEP_HOSTS_DIR", raising=False)
    monkeypatch.delenv("EXPERTSWEEP_MODELS_DIR", raising=False)
    pkg = Path(str(resources.files("runtime"))) / "data"
    assert costmodel.list_host_profiles() == sorted(p.stem for p in (pkg / "hosts").glob("*.yaml")) != []
    assert costmodel.list_model_shapes() == sorted(p.stem for p in (pkg / "models").glob("*.yaml")) != []
    assert not (REPO / "hosts").exists() and not (REPO / "models").exists()  # not beside the package any more
    hosts, shapes = tmp_path / "h", tmp_path / "m"
    hosts.mkdir()
    shapes.mkdir()
    box = yaml.safe_load((pkg / "hosts" / "rtx4090.yaml").read_text()) | {"name": "mybox", "link_GBps": 3.0}
    (hosts / "mybox.yaml").write_text(yaml.safe_dump(box))
    (shapes / "tiny.yaml").write_text((pkg / "models" / "olmoe-1b-7b.yaml").read_text())
    monkeypatch.setenv("EXPERTSWEEP_HOSTS_DIR", str(hosts))
    monkeypatch.setenv("EXPERTSWEEP_MODELS_DIR", str(shapes))
    assert costmodel.list_host_profiles() == ["mybox"] and costmodel.list_model_shapes() == ["tiny"]
    assert costmodel.load_host_profile("mybox").link_GBps == 3.0
    assert costmodel.load_model_shape("tiny").num_experts == costmodel.load_model_shape(pkg / "models" / "olmoe-1b-7b.yaml").num_experts
    with pytest.raises(InputError, match="unknown host profile 'rtx4090'.*presets: mybox"):
        costmodel.load_host_profile("rtx4090")


def test_dependency_bounds_admit_the_tested_versions_and_no_untested_minor():
    """pyproject's bounds take the version of each dependency that constraints.txt pins (the suite's) and
    refuse the next minor release (an untested optuna 5.1, transformers 5.25, torch 2.14 ...)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    tested = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, v = line.split("==")
            tested[name.strip().lower().replace("_", "-")] = Version(v.strip())
    extras = project["optional-dependencies"]
    reqs = [Requirement(r) for r in project["dependencies"] + extras["test"] + extras.get("llamacpp", [])]
    for req in reqs:
        v = tested[req.name.lower()]
        nxt = Version(f"{v.major}.{v.minor + 1}")
        assert req.specifier.contains(v, prereleases=True), (req, v)
        assert not req.specifier.contains(nxt), (req, nxt)
    assert {r.name for r in reqs} >= {"optuna", "transformers", "torch", "ray"}
    readme = (REPO / "README.md").read_text()
    assert "-c constraints.txt" in readme and "https://download.pytorch.org/whl/cpu" in readme
