"""The run-field table and the command lines built on it: one flag per RunSpec field, every CLI takes
every flag its backend honours, defaults written once, refusals from the table, one --capacity."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

import pytest

from runtime import cli
from runtime.backends import BACKENDS, get_backend, simulate
from runtime.core.errors import InputError, cli_main
from runtime.core.policy import PARAMS, PRESETS
from runtime.core.spec import (
    FLAGS,
    RUN_FIELD_BY_NAME,
    RUN_FIELDS,
    SIZE_FIELDS,
    RunSpec,
    honoured_by,
)
from runtime.formats.trace import save_trace, synthetic_pair

# a command-line value per field kind, and what the parser must turn it into
SAMPLE = {"str": ("x.y", "x.y"), "int": ("7", 7), "float": ("0.5", 0.5), "capacity": ("3,4", (3, 4)),
          "memory": ("8", "8"), "host": ("x.y", "x.y"), "bool": (None, True)}  # bool: a switch, no value


def given(flag: str, kind: str) -> list[str]:
    """The flag with its sample value (a switch alone)."""
    text = SAMPLE[kind][0]
    return [flag] if text is None else [flag, text]
# a RunSpec value per field that a backend may be asked for (valid for RunSpec, so only the backend objects)
SPEC_VALUE = {"capacity": 4, "trace": "t.parquet", "model": "M", "text": "T", "max_tokens": 64, "window": 16,
              "batch_windows": 2, "initial_residency": "cold", "calib_text": "c.txt", "calib_max_tokens": 100,
              "host": "rtx3090", "model_shape": "s.yaml", "weight_format": "q8_0", "device": "cpu", "dtype": "bf16",
              "max_memory_GiB": 8.0, "host_store": "mmap", "substitute_weight": "own", "nll_out": "n.parquet",
              "trace_out": "t2.parquet", "residency_out": "r.npy", "record_decisions": True, "no_cuda_graphs": True}
# each CLI: its parser, the backends whose fields it takes, the arguments it needs besides the one tested
CLIS = {"simulate": (simulate.build_parser, ("simulator",), ["--trace", "t.parquet", "--policy", "rule-0.15"]),
        "emulate": (cli.build_emulate_parser, ("emulation", "engine"),
                    ["--model", "M", "--text", "T", "--policy", "rule-0.15"])}


def test_every_run_field_has_exactly_one_flag():
    table = {f.name for f in RUN_FIELDS}
    assert table == {f.name for f in fields(RunSpec)} - {"policy", "name"}  # policy: its own table
    flags = [f.flag for f in RUN_FIELDS if f.flag] + [p.flag for p in PARAMS]
    assert len(flags) == len(set(flags)), sorted(f for f in flags if flags.count(f) > 1)
    assert {f.name for f in RUN_FIELDS if f.flag is None} == {"record_decisions"}  # library only: decision arrays
    assert all(FLAGS[f.name] == f.flag for f in RUN_FIELDS if f.flag)
    for f in RUN_FIELDS:  # a default is the dataclass field's, once
        assert f.default == next(d.default for d in fields(RunSpec) if d.name == f.name)


@pytest.mark.parametrize("name", list(CLIS))
def test_every_cli_accepts_every_flag_its_backend_honours(name):
    build, backends, base = CLIS[name]
    p = build()
    honoured = set().union(*(honoured_by(b) for b in backends))
    assert honoured, backends
    for fld in sorted(honoured):
        f = RUN_FIELD_BY_NAME[fld]
        if f.flag is None:
            continue
        text, value = SAMPLE[f.kind]
        argv = base
        if f.flag in base:  # one of the base arguments itself: given below with the sample value
            i = base.index(f.flag)
            argv = base[:i] + base[i + 2:]
        extra = [] if f.name in SIZE_FIELDS or name != "simulate" else ["--capacity", "4"]
        a = p.parse_args(argv + extra + given(f.flag, f.kind))
        assert getattr(a, f.dest) == value, (name, f.flag)
    # and nothing it does not honour: a flag of another backend's field is a usage error
    for f in RUN_FIELDS:
        if f.flag and f.name not in honoured:
            with pytest.raises(InputError, match="unrecognized arguments"):
                p.parse_args(base + ["--capacity", "4", *given(f.flag, f.kind)])


@pytest.mark.parametrize("name", list(CLIS))
def test_cli_defaults_are_the_runspec_defaults(name):
    build, backends, _ = CLIS[name]
    p = build()
    for f in RUN_FIELDS:
        if f.flag and f.backends & set(backends):
            assert p.get_default(f.dest) == f.default, f.flag


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_refusals_follow_the_table(backend):
    """A backend refuses exactly the fields whose row does not name it (one line naming the flag)."""
    inputs = {"trace": "t.parquet"} if backend == "simulator" else {"model": "M", "text": "T"}
    assert get_backend(backend).honours == honoured_by(backend)
    for f in RUN_FIELDS:
        if f.name in ("trace", "model", "text", *SIZE_FIELDS):
            continue
        spec = RunSpec(policy=PRESETS["rule-0.15"], capacity=4, **inputs, **{f.name: SPEC_VALUE[f.name]})
        if backend in f.backends:
            assert f.name in spec.requested()
            continue
        with pytest.raises(InputError, match=f"backend {backend}: cannot honour {f.flag or FLAGS[f.name]}") as e:
            get_backend(backend).check(spec)
        assert "\n" not in str(e.value)


def _run(fn, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(lambda: fn(argv))
        raise SystemExit(0)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    ev, _ = synthetic_pair(120, 2, 16, 2, 16, seed=3)
    p = tmp_path_factory.mktemp("t") / "t.parquet"
    save_trace(ev, p)
    return p


def test_capacity_means_the_same_in_every_cli(trace, capsys):
    """`--capacity C` and `--capacity C,C,...` are the same run; anything else is one line, exit 2, in
    the simulator's, the emulation's and the `expertsweep` command lines alike."""
    base = ["--trace", str(trace), "--policy", "rule-0.15", "--initial-residency", "cold", "--json"]
    one = _run(simulate.main, base + ["--capacity", "4"], capsys)
    per = _run(simulate.main, base + ["--capacity", "4,4"], capsys)
    assert one[0] == per[0] == 0
    a, b = json.loads(one[1]), json.loads(per[1])
    assert a["capacity"] == b["capacity"] == [4, 4] and a["fetches"] == b["fetches"]
    uneven = json.loads(_run(simulate.main, base + ["--capacity", "3,6"], capsys)[1])
    assert uneven["capacity"] == [3, 6]
    for run, argv in ((simulate.main, base), (cli.emulate_main, ["--model", "M", "--text", "T", "--policy", "rule-0.15"]),
                      (lambda v: cli.main(["simulate", *v]), base)):
        for bad in ("4,x", "four", "4;4"):
            code, out, err = _run(run, argv + ["--capacity", bad], capsys)
            assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
            assert f"--capacity = {bad!r} must be one int for all layers or a comma list" in err
    code, _, err = _run(simulate.main, base + ["--capacity", "4,4,4"], capsys)  # 3 entries, 2 layers
    assert code == 2 and "--capacity = [4, 4, 4] has 3 entries, the model has 2 MoE layers" in err


def test_expertsweep_command_dispatches(trace, capsys):
    argv = ["--trace", str(trace), "--policy", "quality-first", "--capacity", "5", "--initial-residency", "cold",
            "--host", "rtx5090", "--json"]
    direct = json.loads(_run(simulate.main, argv, capsys)[1])
    code, out, _ = _run(cli.main, ["simulate", *argv], capsys)
    via = json.loads(out)
    assert code == 0 and via["host"] == "rtx5090"
    for k in ("fetches", "substitutions", "admissions", "time_per_token_s", "capacity"):
        assert via[k] == direct[k], k
    code, out, err = _run(cli.main, ["simulat"], capsys)
    assert code == 2 and "invalid choice: 'simulat'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_subcommand_has_help(command, capsys):
    code, out, _ = _run(cli.main, [command, "--help"], capsys)
    assert code == 0 and out.startswith("usage:"), out[:200]


def test_top_level_help_lists_the_subcommands(capsys):
    code, out, _ = _run(cli.main, ["--help"], capsys)
    assert code == 0 and all(c in out for c in cli.COMMANDS)
    assert isinstance(cli.build_parser(), argparse.ArgumentParser)


def test_mlflow_params_leave_out_outputs_and_library_requests():
    spec = RunSpec(policy=PRESETS["rule-0.15"], trace="t.parquet", capacity=(3, 4), max_tokens=64,
                   residency_out="r.npy", record_decisions=True)
    params = spec.mlflow_params()
    assert params["capacity"] == "3,4" and params["max_tokens"] == "64" and params["host"] == "rtx4090"
    assert not {f.name for f in RUN_FIELDS if f.output or f.flag is None} & set(params)


def test_sweep_config_reads_run_fields_through_the_table():
    """The sweep config's `model`, `text`, `calib_text`, `model_shape`, `max_tokens`, `dtype`,
    `max_memory_GiB`: RunSpec's defaults and RunSpec's checks (messages naming the file and key)."""
    from sweep import config as sweep_config

    base = {"trace": "t.parquet", "space": {"rule": "threshold", "tau": {"low": 0.05, "high": 0.5},
                                             "capacity_fraction": 0.25}}
    cfg = sweep_config.from_dict(base, "x.yaml")
    assert (cfg.dtype, cfg.max_memory_GiB) == (RUN_FIELD_BY_NAME["dtype"].default, RUN_FIELD_BY_NAME["max_memory_GiB"].default)
    for key, bad in (("dtype", "fp8"), ("max_memory_GiB", "lots"), ("max_tokens", 1), ("model_shape", ""), ("text", 3)):
        with pytest.raises(InputError) as got:
            sweep_config.from_dict({**base, key: bad}, "x.yaml")
        with pytest.raises(InputError) as want:
            RUN_FIELD_BY_NAME[key].check(bad, f"x.yaml: {key}")
        assert str(got.value) == str(want.value), key
    assert sweep_config.from_dict({**base, "max_memory_GiB": 8, "dtype": "bf16"}, "x.yaml").max_memory_GiB == 8.0


@pytest.mark.parametrize("entry", ["expertsweep simulate", "expertsweep findings", "tinymodel", "findings args"])
def test_cpu_heavy_entry_points_set_passive_openmp_waiting_and_their_threads(entry, monkeypatch):
    """Each entry point sets OMP_WAIT_POLICY=PASSIVE and the thread counts first (runtime/core/threads.py), before
    anything imports torch; a value the user set is kept."""
    from runtime import cli
    from runtime.core import threads
    from runtime.tools import tinymodel
    from runtime.tools.findings import cli as findings_cli

    run = {"expertsweep simulate": lambda: cli.main(["simulate", "--help"]),
           "expertsweep findings": lambda: cli.main(["findings", "--help"]),
           "tinymodel": lambda: tinymodel.main(["--help"]),
           "findings args": lambda: findings_cli.checked_args(["--help"])}[entry]
    for var in ("OMP_WAIT_POLICY", threads.ENV_THREADS, *threads.COUNT_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "1")  # the user's own setting
    with pytest.raises(SystemExit):
        run()
    import os

    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ["OMP_NUM_THREADS"] == os.environ["OPENBLAS_NUM_THREADS"] == str(threads.available_cpus())
    assert os.environ["MKL_NUM_THREADS"] == "1"
    monkeypatch.setenv(threads.ENV_THREADS, "3")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.configure() == 3 and os.environ["OMP_NUM_THREADS"] == "3"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.parametrize("form", ["python -m sweep", "python sweep/pareto.py"])
def test_the_sweep_runs_as_a_module_and_as_a_script_by_its_path(form, tmp_path):
    """`python -m sweep` and `python sweep/pareto.py` (the form `ray job submit` runs: a script by its path, from
    any folder) both run this checkout's driver: a decoy `sweep` package on PYTHONPATH is never imported (the
    script puts the checkout root first), the usage line names the form, a bad --config is one line, exit 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    decoy = tmp_path / "decoy" / "sweep"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy sweep package was imported')\n")
    head, cwd = (["-m", "sweep"], repo) if form == "python -m sweep" else ([str(repo / "sweep" / "pareto.py")], tmp_path)
    env = {**os.environ, "PYTHONPATH": str(decoy.parent)}
    run = [sys.executable, *head]
    helped = subprocess.run([*run, "--help"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: {form} "), helped.stdout[:300] + helped.stderr
    bad = subprocess.run([*run, "--config", str(tmp_path / "nowhere.yaml")], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout + bad.stderr
    assert bad.stderr.strip().splitlines() == [f"expertsweep: error: --config {tmp_path / 'nowhere.yaml'}: cannot "
                                               "read (No such file or directory)"], bad.stderr
