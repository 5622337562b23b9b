"""The sweep driver: `python -m sweep [--config FILE]`, `expertsweep sweep` or `python sweep/pareto.py`.

All three forms run `main` below: `python -m sweep` through sweep/__main__.py, `expertsweep sweep` through
runtime/cli.py, and `python sweep/pareto.py` (the form `ray job submit -- python sweep/pareto.py` needs: a
script run by its path) through that thin script.

Joins the Ray cluster named by `--ray-address` (default `auto`: `RAY_ADDRESS`, else a running
local cluster, else an embedded one; `local` always embeds one whose single node carries every
host's `host:NAME` resource). Sweeps each host with Ray Tune + Optuna over the config's space
(simulator fidelity: time per token and substituted mass), records every trial as it finishes
(`<out>/trials.jsonl`, MLflow child runs, refreshed Pareto tables), re-measures the fronts by
exact emulation, then writes the report (sweep/report.py) and prints the per-host tables.

`--resume` continues the sweep in the `--out` it is given (Tuner.restore, Optuna studies in
`<out>/optuna.journal`, the ledger, the config's content in `<out>/config.yaml` and the MLflow parent
run in `<out>/state.json`; a copied folder gets its own parent run); a flag that differs from the saved
sweep is refused in one line naming both values, except where to run and more `--trials`. Without it a
sweep in the same `--out` starts over. Every bad input is a one-line error before any trial, and nothing
is created in `--out` before the Ray cluster is joined.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

from runtime.core import threads
from runtime.core.errors import ArgumentParser, InputError, atomic_write
from runtime.core.policy import PRESETS
from sweep import config as sweep_config
from sweep import data, hosts, tracking
from sweep.finish import climb_ladder, print_results, write_answer
from sweep.raycluster import connect_ray, prepare_ray_auth
from sweep.space import complete

log = logging.getLogger(__name__)

# search_spaces/ is package data (sweep/search_spaces links to it): found in a checkout and an installed wheel
DEFAULT_CONFIG = Path(str(resources.files("sweep") / "search_spaces" / "demo.yaml"))
CONFIG_FILE = "config.yaml"  # the config's content as the sweep ran it (a --resume reads it, not the original)
STATE_FILES = ("tune", "optuna.journal", "trials.jsonl", "started", "state.json", "stats.json", CONFIG_FILE)
# what sweep/report.py writes: deleted when a run starts, written again only by a run that finishes
REPORT_FILES = ("answer.csv", "summary.md", "pareto.png", "pareto_*.csv", "pareto_*.parquet", "pareto_*.png",
                "screening_*.csv", "speed_ratios.csv", "bounds.csv", "policy_by_host.csv", "trials.csv")


class Stopped(BaseException):
    """The driver got SIGINT or SIGTERM. A BaseException, as KeyboardInterrupt: no `except Exception` on its
    way out records it as a failed trial or measurement."""


class StopHandler:
    """The driver's SIGINT / SIGTERM handler. Inside `tuner.fit()` the first signal asks Tune to stop the way
    Ctrl-C does (SIGUSR1, Tune's own interrupt: the experiment state saved, trials in flight left unfinished
    for `--resume`), and the driver raises `Stopped` when fit returns; anywhere else, or a second signal,
    raises `Stopped` at once. Rows already in the ledger stay (each written whole); nothing is reported."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.in_fit = False
        self.defer = False  # while the MLflow parent, ledger and Tuner are set up: record, raise at `check`
        self.out: Path | None = None  # the sweep's --out, once known

    def __call__(self, signum: int, frame: Any) -> None:
        first = self.signal is None
        self.signal = signal.Signals(signum).name
        if first and self.in_fit and hasattr(signal, "SIGUSR1"):
            log.warning("%s: stopping the trials (again to stop at once)", self.signal)
            signal.raise_signal(signal.SIGUSR1)
            return
        if first and self.defer:
            return
        raise Stopped(self.signal)

    def install(self) -> dict[int, Any]:
        """(Re)install on SIGINT and SIGTERM (ray.init installs its own SIGTERM handler: call after it);
        returns the handlers it replaced."""
        old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, self)
        return old

    def check(self) -> None:
        if self.signal is not None:
            raise Stopped(self.signal)


STOP = StopHandler()


def _prog() -> str:
    """How the user ran this driver, for its usage line and the lines that tell what to run next."""
    launcher = Path(sys.argv[0])
    if launcher.name == "expertsweep":
        return "expertsweep sweep"
    if launcher.name == "pareto.py":
        return "python sweep/pareto.py"
    return "python -m sweep"


PROG = _prog()


def _packaged() -> list[str]:
    return sorted(p.stem for p in DEFAULT_CONFIG.parent.glob("*.yaml"))


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help=f"sweep YAML, or the name of a packaged search space ({', '.join(_packaged())}; "
                        f"default demo)")
    p.add_argument("--out", help="output folder (default results/<sweep name>/)")
    p.add_argument("--name", help="override the sweep name")
    p.add_argument("--trials", type=int, help="simulator trials per host after the baselines")
    p.add_argument("--hosts", help="comma-separated host names (profiles from presets of the same name)")
    p.add_argument("--trace", help="router trace file instead of the config's model/trace")
    p.add_argument("--model", help="model (demo, test, a checkpoint folder or a .gguf file) instead of the config's")
    p.add_argument("--text", help="the evaluated text instead of the config's (default: eval.txt beside the model)")
    p.add_argument("--batch", help="simulator trials per Ray task: auto or N")
    p.add_argument("--seed", type=int)
    p.add_argument("--mlflow-uri", help="http://HOST:PORT or sqlite:///PATH (default sqlite under mlflow/)")
    p.add_argument("--mlflow-experiment", default=tracking.EXPERIMENT)
    p.add_argument("--ray-address", default="auto", help="auto | local | HOST:PORT (default auto)")
    p.add_argument("--num-cpus", type=int, help="CPUs of an embedded Ray (default: all)")
    p.add_argument("--no-emulation", action="store_true",
                   help="simulator only: skip the ladder's emulation (no perplexity fronts, no answer)")
    p.add_argument("--resume", action="store_true", help="continue the sweep in --out after its driver stopped")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray, Tune, Optuna and MLflow logs here (always written to <out>/logs/)")
    return p


def load(args: argparse.Namespace) -> sweep_config.SweepConfig:
    cfg = sweep_config.load_config(args.config)
    if tracking.submitted_job() and Path(args.config).is_relative_to(tracking.REPO):
        # named in messages and notes by its path in the submitted folder, not in Ray's temporary copy of it
        cfg = dataclasses.replace(cfg, source=str(Path(args.config).relative_to(tracking.REPO)))
    trace = model = None
    if args.trace:
        trace = str(Path(args.trace).expanduser().resolve())
    if args.model:
        model = args.model if args.model in ("demo", "test") else str(Path(args.model).expanduser().resolve())
    text = str(Path(args.text).expanduser().resolve()) if args.text else None
    cfg = sweep_config.with_overrides(cfg, name=args.name, trials=args.trials, hosts=args.hosts, batch=args.batch,
                                      seed=args.seed, trace=trace, model=model, text=text)
    if args.trace and not args.model:
        cfg = dataclasses.replace(cfg, model=None, calib_trace=None)
    return cfg


LIBRARY_LOGGERS = ("ray", "mlflow", "optuna", "alembic", "urllib3", "filelock", "py.warnings", "numba")


def setup_logging(out: Path | None, verbose: bool) -> Path | None:
    """Everything at INFO into <out>/logs/sweep.log; the console gets only this project's warnings
    (and, with `verbose`, everything). Returns the log folder. `out=None` (before the cluster is joined:
    nothing is created in --out until then): the records are kept in memory and written to the file by the
    first call with the folder."""
    from logging.handlers import MemoryHandler

    root = logging.getLogger()
    early = next((h for h in root.handlers if isinstance(h, MemoryHandler)), None)
    if out is None:
        logs = None
        to_file = early or MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1)
        to_file.setLevel(logging.INFO)
        if early is None:
            root.addHandler(to_file)
    else:
        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        to_file = next((h for h in root.handlers if isinstance(h, logging.FileHandler)
                        and h.baseFilename == str(logs / "sweep.log")), None)
        if to_file is None:
            to_file = logging.FileHandler(logs / "sweep.log")
            to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            to_file.setLevel(logging.INFO)
            root.addHandler(to_file)
        if early is not None:  # what was said before the folder existed
            early.setTarget(to_file)
            early.flush()
            root.removeHandler(early)
            early.close()
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        if (isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                and not isinstance(h, MemoryHandler)):
            h.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.captureWarnings(True)
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")  # MLflow leaves its logger to us
    import optuna

    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()
    for name in LIBRARY_LOGGERS:
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        lg.handlers = [to_file] if not verbose else [to_file, *[h for h in root.handlers if h is not to_file]]
        lg.propagate = False
    return logs


def _out_dir(args: argparse.Namespace) -> Path:
    """--out, else results/<sweep name>/ (the config is read only for its name)."""
    return Path(args.out or Path.cwd() / "results" / load(args).name).expanduser().resolve()


def _absolute(args: argparse.Namespace) -> argparse.Namespace:
    """Paths of the command line made absolute (a resumed driver may start elsewhere); a --config that is no
    file but the name of a packaged search space (`smoke`, `demo.yaml`) is that file."""
    packaged = DEFAULT_CONFIG.parent / (args.config if args.config.endswith(".yaml") else f"{args.config}.yaml")
    if not Path(args.config).expanduser().exists() and "/" not in args.config and packaged.is_file():
        args.config = str(packaged)
    args.config = str(Path(args.config).expanduser().resolve())
    if args.trace:
        args.trace = str(Path(args.trace).expanduser().resolve())
    if args.model and args.model not in ("demo", "test"):
        args.model = str(Path(args.model).expanduser().resolve())
    if args.text:
        args.text = str(Path(args.text).expanduser().resolve())
    return args


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """One sweep (the command line's `argv`), with the driver's SIGINT / SIGTERM handling (`STOP`) while it
    runs; the caller's handlers are restored after."""
    threads.configure(counts=False)  # passive OpenMP waiting here (a test model built in-process) and in the
    # embedded cluster's workers, which inherit it; their thread counts stay Ray's (sweep/worker.py)
    STOP.__init__()
    old = STOP.install()
    try:
        return _run(argv)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _given(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The dests of the flags given on the command line (not left at their defaults)."""
    for a in parser._actions:  # noqa: SLF001 - argparse has no public list of a parser's actions
        a.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


# on --resume: where and how loudly to run may change; more trials are applied; anything else that differs
# from the saved sweep is refused (one line naming both values)
RESUME_FREE = ("out", "resume", "ray_address", "num_cpus", "verbose")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _resume_args(args: argparse.Namespace, argv: list[str] | None, out: Path) -> tuple[argparse.Namespace,
                                                                                       dict[str, Any]]:
    """The saved sweep of `out` (its state.json and config.yaml) with this command line's changes: (args to
    run, the saved state). Refuses, as one InputError naming the flag and both values, any flag that differs
    from the saved sweep other than RESUME_FREE and more --trials."""
    if not (out / "state.json").is_file():
        raise InputError(f"--resume: no sweep state in {out} (state.json is missing)")
    state = json.loads((out / "state.json").read_text())
    saved = argparse.Namespace(**{**vars(build_parser().parse_args([])), **state["args"]})
    config = out / CONFIG_FILE
    if not config.is_file():  # a sweep of an earlier version: its state names the config file
        config = Path(saved.config)
        if not config.is_file():
            raise InputError(f"--resume: {out / CONFIG_FILE} is missing and the saved --config {saved.config} is "
                             f"gone: start the sweep over in another --out")
    given = _given(build_parser(), argv)
    refuse = f"drop the flag to resume the sweep in {out} as it was, or start a new sweep in another --out"
    for dest in sorted(given - set(RESUME_FREE)):
        new, old = getattr(args, dest), state["name"] if dest == "name" else getattr(saved, dest, None)
        if dest == "config":
            if not Path(new).is_file():
                raise InputError(f"--config {new}: no such file")
            if Path(new).read_bytes() != config.read_bytes():
                raise InputError(f"--resume: --config {new} differs from the config the sweep in {out} ran with "
                                 f"({state.get('config_from', saved.config)}, saved as {config}); {refuse}")
        elif dest == "trials":
            before = state.get("trials", old)
            if before is not None and new < before:
                raise InputError(f"--resume: --trials {new} is fewer than the {before} the sweep in {out} was "
                                 f"given; {refuse}")
            saved.trials = new  # more trials: the search goes on to the new count
        elif new != old:
            shown = "not given" if old is None or old is False else f"{_flag(dest)} {old}"
            raise InputError(f"--resume: {_flag(dest)} {new} differs from the sweep in {out} ({shown}); {refuse}")
    for dest in ("ray_address", "num_cpus", "verbose"):  # where and how loudly to run may change
        if dest in given:
            setattr(saved, dest, getattr(args, dest))
    saved.config, saved.name, saved.out, saved.resume = str(config), state["name"], str(out), True
    return saved, state


def _run(argv: list[str] | None) -> dict[str, Any]:
    args = _absolute(build_parser().parse_args(argv))
    state: dict[str, Any] = {}
    if args.resume:  # that folder's sweep, whatever its state.json says it was written for (a copy is a copy)
        args, state = _resume_args(args, argv, _out_dir(args))
        home = state.get("out") or state["args"].get("out")
        if home and Path(home) != Path(args.out):
            # a copy (or a move) of a sweep: its MLflow parent run is the original folder's; this one gets its
            # own, and Tune starts afresh from the copy's ledger and journals (no path of the original is used)
            log.warning("resuming the sweep copied from %s: a new MLflow parent run (the original's, %s, is left "
                        "as it is)", home, state.get("parent_run_id"))
            state = {**state, "parent_run_id": None, "copied_from": {"out": home, "run": state.get("parent_run_id")},
                     "fresh_tune": True}
        if args.trials is not None and args.trials != state.get("trials", args.trials):
            state = {**state, "fresh_tune": True}  # more trials: the searchers' budget is taken from the journals
    prepare_ray_auth(args.ray_address)
    cfg = load(args)
    config_text = Path(args.config).read_bytes()  # saved in --out as the sweep runs (its path may not outlive it)
    out = _out_dir(args)
    args.out = str(out)
    STOP.out = out

    # -- every check the driver can make itself, before Ray starts and before anything in --out (or the
    # MLflow folder) is created or deleted: the config (above), the hosts' profiles, the model, the trace
    preflight(args, cfg)
    loc = data.locate(cfg)
    uri = tracking.resolve_uri(args.mlflow_uri or state.get("mlflow_uri"), create=False)
    inputs = None
    synthetic = isinstance(cfg.trace, dict)
    if loc.model_dir is None and not synthetic:  # a trace sweep: every input is checked here (nothing written)
        inputs = data.prepare(cfg, out, loc)
        cfg = _check_inputs(cfg, inputs)
    setup_logging(None, args.verbose)  # kept in memory: nothing is created in --out before the cluster is joined
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "10")  # the ledger covers the gap
    os.environ.setdefault("TUNE_MAX_PENDING_TRIALS_PG", str(max(8, 4 * len(cfg.hosts))))
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no Tune tables on stdout
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # SIGINT is the driver's (STOP), which asks Tune to stop
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)  # no result.json: by design
    import ray

    extra = {f"model:{cfg.model_resource}": 1.0} if cfg.model_resource else {}
    owns_ray, _ = connect_ray(args.ray_address, cfg.hosts, args.num_cpus, args.verbose, extra)
    STOP.install()  # after ray.init's own SIGTERM handler
    try:
        STOP.check()
        out.mkdir(parents=True, exist_ok=True)
        # ray.init installs its own handlers: route them again. Ray's session folder is not linked from --out:
        # it is deleted with the cluster (the workers' logs are where Ray keeps them, docs/sweep.md)
        setup_logging(out, args.verbose)
        if uri.startswith("sqlite:///"):
            tracking.resolve_uri(uri)  # its folder, now
        if synthetic:  # generated into <out>/traces/ (checked there, before any trial)
            inputs = data.prepare(cfg, out, loc)
            cfg = _check_inputs(cfg, inputs)
    except BaseException:
        ray.shutdown()
        raise
    try:
        hosts.check_cluster(cfg.hosts, ray.cluster_resources())
        placement = None
        if loc.model_dir is not None:  # the traces recorded (or reused) where the model's files are
            from sweep.worker import model_placement

            placement = model_placement(cfg.model_resource, cfg.emulation.cpus,
                                        ray.get_runtime_context().get_node_id())
            inputs = data.prepare(cfg, out, loc, record=_record_where_the_model_is(placement))
            cfg = _check_inputs(cfg, inputs)
        profiles = hosts.resolve_profiles(cfg.hosts, inputs.model_dir, cfg.dtype, cfg.max_memory_GiB)
        fingerprint = _fingerprint(inputs, cfg, profiles)
        if args.resume:
            from sweep.remeasure import check_resume

            check_resume(out, state, fingerprint)
        else:  # every check passed: only now does a new sweep replace an earlier one's state in --out
            _clear(out, STATE_FILES)
        _clear(out, REPORT_FILES)  # an answer is written only by a run that finishes
        return _sweep(args, cfg, out, inputs, uri, profiles, state, placement, fingerprint, config_text)
    finally:
        ray.shutdown()
        if owns_ray:
            log.info("embedded Ray stopped")


def preflight(args: argparse.Namespace, cfg: sweep_config.SweepConfig) -> None:
    """The flags' files and the hosts' profiles (a preset must exist): one-line InputErrors naming the flag
    (or the config) and the value."""
    if args.trace and not Path(args.trace).is_file():
        raise InputError(f"--trace {args.trace}: no such file")
    if args.model and args.model not in ("demo", "test") and not Path(args.model).is_dir():
        if not args.model.lower().endswith(".gguf"):
            raise InputError(f"--model {args.model}: no such folder")
        if not Path(args.model).is_file():
            raise InputError(f"--model {args.model}: no such file")
    if args.text and not Path(args.text).is_file():
        raise InputError(f"--text {args.text}: no such file")
    for h in cfg.hosts:
        try:
            hosts.preset_profile(h)
        except InputError as exc:
            if args.hosts and h.name in args.hosts.split(","):
                raise InputError(f"--hosts {args.hosts}: {exc}") from None
            raise InputError(f"{cfg.source}: {exc}") from None


def _clear(out: Path, names: tuple[str, ...]) -> None:
    """Delete these files and folders of --out (glob patterns)."""
    for pattern in names:
        for p in out.glob(pattern):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


def _fingerprint(inputs: data.Inputs, cfg: sweep_config.SweepConfig, profiles: dict[str, dict]) -> dict[str, Any]:
    """What every measurement of this sweep depends on beyond its own row's key: the trace and its
    calibration (content), the checkpoint digest, the texts, the warm start, the token budget and the
    simulated hosts' profiles (calibrated ones are measured again on a resume)."""
    simulated = {h.name for h in cfg.hosts if hosts.simulated(h)}
    sha = lambda p: None if p is None else data.sha_file(p)[:16]  # noqa: E731
    local = lambda p: p if p is None or Path(p).is_file() else None  # noqa: E731 - a text on the model's node
    return {"trace_sha256": sha(inputs.trace), "calib_trace_sha256": sha(inputs.calib_trace),
            "text_sha256": sha(local(inputs.text)), "calib_text_sha256": sha(local(inputs.calib_text)),
            "model_digest": inputs.digest, "text": inputs.text, "calib_text": inputs.calib_text,
            "warm_start": inputs.warm_start, "max_tokens": cfg.max_tokens,
            "profiles": {h: p for h, p in sorted(profiles.items()) if h in simulated}}


def _check_inputs(cfg: sweep_config.SweepConfig, inputs: data.Inputs) -> sweep_config.SweepConfig:
    """The cost-model shape, the equal-memory budget and the capacity range, checked on the trace."""
    from runtime.formats import costmodel
    from runtime.formats.trace import load_trace

    if cfg.model_shape is None and inputs.model_dir and not all(hosts.simulated(h) for h in cfg.hosts):
        # a calibrated profile is measured at the model's own shape: simulate every host with it
        cfg = dataclasses.replace(cfg, model_shape=inputs.model_config)
    trace = load_trace(inputs.trace)
    shape = costmodel.shape_for_trace(trace, cfg.model_shape)
    if cfg.vram_budget_auto:  # equal device memory: fetch-every-miss's at 25% residency, for every policy
        cfg = sweep_config.resolve_vram_budget(cfg, shape)
        log.info("equal device memory: vram_budget_GiB = %g for every policy", cfg.space_spec["vram_budget_GiB"])
    else:
        data.check_capacity(cfg, inputs.dims, costmodel.expert_bytes(shape))
    # the config's own trace file, read once: what it cannot replay, then at one budget
    given = trace if isinstance(cfg.trace, str) and Path(cfg.trace).resolve() == Path(inputs.trace).resolve() else None
    return sweep_config.fit_to_budget(cfg, shape, given)  # at one budget: values no policy with which fits, left out


def _record_where_the_model_is(placement: dict[str, Any]):  # noqa: ANN202 - data.prepare's `record`
    """`data.record_on_node` as a Ray task on a node holding the model (its error as one line here)."""
    def record(**kw: Any) -> dict[str, Any]:
        import ray

        from sweep.worker import record_task

        log.warning("router traces of %s: recording (or reusing the cached ones) on the model's node",
                    kw["model"])
        try:
            return ray.get(ray.remote(record_task).options(max_retries=0, **placement).remote(**kw))
        except InputError as exc:  # Ray's error of the task's InputError: its own line
            raise InputError(str(getattr(exc, "cause", exc)).strip().splitlines()[-1]) from None
    return record


def _config_from(args: argparse.Namespace, state: dict[str, Any]) -> str:
    """Where the config came from, for the record: its path, but never one inside Ray's temporary copy of a
    submitted working directory (gone with the cluster): then its path relative to that folder."""
    if "config_from" in state:
        return state["config_from"]
    p = Path(args.config)
    if tracking.submitted_job() and p.is_relative_to(tracking.REPO):
        return f"{p.relative_to(tracking.REPO)} (of the submitted working directory)"
    return str(p)


def _sweep(args, cfg, out, inputs, uri, profiles, state, placement=None,  # noqa: ANN001
           fingerprint: dict[str, Any] | None = None, config_text: bytes = b"") -> dict[str, Any]:
    import ray
    from ray import tune

    from sweep.ledger import Ledger, Session
    from sweep.storage import tune_filesystem
    from sweep.worker import run_task, shipped, trial_resources

    host_names = [h.name for h in cfg.hosts]
    gpus = {h: profiles[h]["gpu"] for h in host_names}
    STOP.defer = True  # a signal from here on stops the sweep through the `finally` below, which closes all
    tracker = tracking.Tracker(uri, args.mlflow_experiment)
    config_from = _config_from(args, state)
    config_sha = hashlib.sha256(config_text).hexdigest()
    parent = tracker.start_parent(
        cfg.name, params={"config": f"{out / CONFIG_FILE} (from {config_from}; sha256 {config_sha[:16]})", "trace": inputs.trace, "model": inputs.model_dir,
                          "hosts": ",".join(host_names), "trials": cfg.trials, "sampler": cfg.sampler,
                          "objectives": ",".join(cfg.objectives), "warm_start": inputs.warm_start,
                          "calib_text": inputs.calib_text, "calib_trace": inputs.calib_trace,
                          "model_digest": inputs.digest, "model_resource": cfg.model_resource, "dtype": cfg.dtype,
                          "max_memory_GiB": cfg.max_memory_GiB, "space": json.dumps(
                              {p.name: p.kind for p in cfg.space.params})},
        tags={"sweep": cfg.name, "fidelity": "sweep", "hosts": ",".join(host_names)},
        run_id=state.get("parent_run_id"))
    fresh_tune = bool(state.get("fresh_tune"))
    copied = state.get("copied_from")
    if copied and tracker.parent_id:
        tracker.client.set_tag(tracker.parent_id, "copied_from_run", str(copied.get("run")))
    # the saved command line names the config by its copy in --out: nothing in state.json points elsewhere
    state = {"args": {**vars(args), "config": CONFIG_FILE, "out": str(out), "resume": False}, "name": cfg.name,
             "out": str(out), "config_from": config_from, "config_sha256": config_sha, "trials": cfg.trials,
             "mlflow_uri": uri, "experiment": args.mlflow_experiment, "parent_run_id": parent,
             "started": state.get("started", time.time()), "fingerprint": fingerprint,
             **({"copied_from": copied} if copied else {})}
    if Path(args.config) != out / CONFIG_FILE:
        atomic_write(out / CONFIG_FILE, lambda tmp: Path(tmp).write_bytes(config_text))
    atomic_write(out / "state.json", lambda tmp: Path(tmp).write_text(json.dumps(state, indent=2)))
    ledger = Ledger(out / "trials.jsonl")
    session = Session(out, ledger, tracker, host_names, gpus, cfg.objectives,
                      totals={h: cfg.trials + len(cfg.baseline_policies) for h in host_names})

    # no shared disk: the workers get the trace files (and a model_shape file) through Ray's object store,
    # report their rows through Tune, and keep their retry checkpoints in an actor (sweep/storage.py)
    shape_arg = cfg.model_shape
    if shape_arg and Path(shape_arg).is_file():
        p = Path(shape_arg)
        shape_arg = shipped(str(p), f"{p.parent.name}/{p.name}" if p.name == "config.json" else p.name)
    ctx = {"trace": shipped(inputs.trace), "calib_trace": shipped(inputs.calib_trace) if inputs.calib_trace else None,
           "model_shape": shape_arg, "profiles": profiles, "max_failures": cfg.max_failures,
           "report_s": 1.0,
           "done": sorted(r["key"] for r in ledger.rows if r.get("fidelity") == "simulator")}
    driver_node = ray.get_runtime_context().get_node_id()
    fs, files_actor = tune_filesystem(f"expertsweep-tune-{cfg.name}-{os.getpid()}", driver_node)
    # the context goes to the object store once, not into every trial's config
    trainable = tune.with_resources(tune.with_parameters(run_task, ctx=ctx), trial_resources)
    t0, cpu0 = time.time(), time.process_time()
    fit_window = [t0]
    tuner = _tuner(args, cfg, out, inputs, ledger, host_names, trainable, fs, fresh_tune)
    status = "FAILED"
    try:
        STOP.defer = False
        STOP.check()
        STOP.in_fit = True
        try:
            results = tuner.fit()
        finally:
            STOP.in_fit = False
        fit_window.append(time.time())
        if STOP.signal is None and results.num_terminated + results.num_errors < len(results):
            STOP.signal = "a stop of Tune"  # stopped from elsewhere (Tune's SIGUSR1): not finished either
        if STOP.signal is not None:
            session.refresh()
            raise Stopped(STOP.signal)
        lost = sorted(f"{h}:baseline:{n}" for h in host_names for n in cfg.baseline_policies
                      if f"{h}:baseline:{n}" not in ledger.keys)
        if lost:  # never an answer without its baselines
            raise InputError(f"{out / 'trials.jsonl'}: the sweep ended without baseline rows {lost}; run it again "
                             f"with --resume")
        # the screening is over and every trial is in the ledger and the journals: Tune's own state is no longer
        # needed (a resume starts Tune afresh from them, as for a copy), and it pickles Tune's storage context,
        # which names Ray's local staging folder in the session's temp dir (gone with the cluster)
        _clear(out, ("tune",))
        sweep_s, driver_cpu = time.time() - t0, time.process_time() - cpu0
        session.close_bars()
        session.refresh()
        t_ladder = time.time()
        notes, ladder_stats = climb_ladder(cfg, inputs, session, ledger, enabled=not args.no_emulation,
                                      placement=placement)
        ladder_stats["seconds"] = time.time() - t_ladder
        ladder_stats["screening"] = {"trials": session.new_rows, "seconds": sweep_s}
        rep, stats = write_answer(cfg, inputs, out, uri, parent, gpus, notes, ladder_stats, session, ledger, tracker,
                             (sweep_s, driver_cpu, fit_window))
        status = "FINISHED"
        print_results(rep, host_names, gpus, out, stats, tracking.where_runs_are(uri, tracker.experiment_id))
        return {"out": out, "stats": stats, "report": rep, "parent_run_id": parent, "trace": inputs.trace}
    except Stopped:
        status = "KILLED"
        session.close_bars()  # before the driver's last line
        raise
    finally:
        tracker.close(status)
        ledger.close()
        ray.kill(files_actor)


def _tuner(args, cfg, out, inputs, ledger, host_names, trainable, fs, fresh_tune: bool):  # noqa: ANN001, ANN202
    """The sweep's Tuner: Tune's saved run in <out>/tune restored on a --resume that may use it, else a fresh one
    over each host's Optuna study (the journal in --out), with the baselines and bounds the ledger lacks first."""
    import ray
    from ray import tune

    from sweep.ledger import LedgerCallback
    from sweep.search import HostSearch, HostStudy, journal_storage, make_sampler
    from sweep.worker import trial_name

    exp_dir = out / "tune"
    # Tune's run state is restored only when Tune saved it (its experiment_state-*.json): a sweep stopped before
    # that leaves tuner.pkl and a searcher state without the trials it had started, and Tune "restarts" with
    # that searcher, which holds the baselines it suggested as done; the fresh start below takes the
    # baselines and each host's spent budget from the ledger and the journals instead
    if args.resume and fresh_tune:  # a copy, or more trials: Tune's saved state is not this run's
        _clear(out, ("tune",))
    if (args.resume and not fresh_tune and tune.Tuner.can_restore(str(exp_dir))
            and any(exp_dir.glob("experiment_state-*.json"))):
        log.warning("resuming the sweep in %s", out)
        tuner = tune.Tuner.restore(str(exp_dir), trainable=trainable, resume_unfinished=True,
                                   resume_errored=False, restart_errored=False, storage_filesystem=fs)
    else:
        storage = journal_storage(out / "optuna.journal")
        searchers = {h: HostStudy(cfg.space, cfg.objectives, make_sampler(cfg.sampler, cfg.seed + i, cfg.population),
                                  storage, f"{cfg.name}:{h}", h) for i, h in enumerate(host_names)}
        base_params = [(n, complete({**PRESETS[n].to_dict(), **cfg.baseline_capacity()}))
                       for n in cfg.baseline_policies] + _bound_runs(cfg, inputs)
        baselines = {h: [{"key": f"{h}:baseline:{n}", "number": None, "baseline": n, "params": p}
                         for n, p in base_params if f"{h}:baseline:{n}" not in ledger.keys] for h in host_names}
        search = HostSearch(searchers, baselines, cfg.trials, cfg.batch, cfg.task_seconds,
                            int(ray.cluster_resources().get("CPU", 1)))
        search.sync_from_storage()
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(search_alg=search, num_samples=-1, reuse_actors=True,
                                        trial_name_creator=trial_name, trial_dirname_creator=trial_name),
            run_config=tune.RunConfig(name="tune", storage_path=str(out), storage_filesystem=fs, verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=cfg.max_failures),
                                      callbacks=[LedgerCallback(str(out))]))
    return tuner


def _bound_runs(cfg, inputs) -> list[tuple[str, dict[str, Any]]]:  # noqa: ANN001
    """The offline bounds computed beside the baselines (sweep/bounds.py), at the baselines' capacity."""
    from sweep.bounds import bound_params

    return bound_params(cfg.baseline_capacity(), int(inputs.dims[2]))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        run(argv)
    except Stopped as exc:
        out = STOP.out
        if out is None or not (out / "state.json").is_file():
            print(f"expertsweep: stopped by {exc} before the sweep started: nothing was measured", file=sys.stderr)
        else:
            print(f"expertsweep: stopped by {exc} before the sweep finished: no answer was written (the trials "
                  f"recorded so far are in {out}/trials.jsonl); continue it with: {PROG} --out {out} --resume",
                  file=sys.stderr)
        sys.exit(130 if str(exc) == "SIGINT" else 143 if str(exc) == "SIGTERM" else 1)
