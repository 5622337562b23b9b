"""Search algorithms: Ray Tune's OptunaSearch per host, batched, behind one host-routing Searcher.

`BatchOptunaSearch` is Ray Tune's `OptunaSearch` (multi-objective, TPE or NSGA-II, define-by-run
space, persistent Optuna storage) whose Tune trials each carry a batch of Optuna trials: one Ray task
then evaluates many cheap simulator trials, so Ray's per-task cost is paid once per batch.
Results are told to Optuna per Optuna trial as the task reports them.

`HostSearch` is the Searcher handed to the Tuner. It owns one `BatchOptunaSearch` (one study)
per host, suggests each host's named baselines first (they also seed that host's study when
they lie inside the space, as soon as they are reported), then Optuna batches, preferring the
host whose task just ended (so Tune reuses its actor) and else round-robin, until every host has
asked its `trials`. With `batch: auto` a batch holds about `task_seconds` of simulation at the
median seconds per trial measured lately on that host. Its state is saved with Tune's experiment
state (the studies' trials live in their storage), so `Tuner.restore` resumes it; Optuna trials
asked after the last save are marked failed (user attribute `orphaned`) on restore and asked anew.

The studies live in an Optuna `JournalStorage` on `DriverJournalBackend`: the journal file format
of Optuna's `JournalFileBackend`, but written by the driver alone, so it keeps the log in memory
and appends without file locks or fsync (an ask or tell costs ~1 ms instead of ~10).
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import statistics
import warnings
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from sweep.space import Space, SpaceSampler

log = logging.getLogger(__name__)

DEFAULT_EVAL_S = 0.05  # assumed seconds per simulator trial until a host has reported some


class DriverJournalBackend(optuna.storages.journal.BaseJournalBackend):
    """An Optuna journal file with a single writer (the sweep driver): log in memory, appends flushed.

    The file is the JSON-lines journal of `JournalFileBackend`, readable by it. A killed driver
    loses no flushed append; a line cut short by a crash is ignored when the file is read back.
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._load()

    def _load(self) -> None:
        self._logs: list[dict[str, Any]] = []
        p = Path(self.path)
        if p.exists():
            with open(p, "rb") as f:
                for line in f:
                    try:
                        self._logs.append(json.loads(line))
                    except ValueError:
                        break  # the tail of an interrupted append
        self._f = open(p, "ab")

    def read_logs(self, log_number_from: int) -> Iterable[dict[str, Any]]:
        return self._logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        self._f.write(("\n".join(json.dumps(x, separators=(",", ":")) for x in logs) + "\n").encode())
        self._f.flush()
        self._logs.extend(logs)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._load()


def journal_storage(path: str | Path) -> optuna.storages.JournalStorage:
    return optuna.storages.JournalStorage(DriverJournalBackend(path))


def make_sampler(kind: str, seed: int, population: int) -> optuna.samplers.BaseSampler:
    if kind == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=population, seed=seed)
    with warnings.catch_warnings():  # multivariate/group are stable in practice, "experimental" by name
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                          n_startup_trials=10)


class BatchOptunaSearch(OptunaSearch):
    """OptunaSearch over one host's study; a Tune trial asks and tells a batch of Optuna trials."""

    def __init__(self, space: Space, objectives: tuple[str, ...], sampler: optuna.samplers.BaseSampler,
                 storage: optuna.storages.BaseStorage, study_name: str):
        super().__init__(space=SpaceSampler(space), metric=list(objectives), mode=["min"] * len(objectives),
                         sampler=sampler, storage=storage, study_name=study_name)
        self.space_def = space
        self.objectives = tuple(objectives)
        self._ot_trials: dict[str, set[int]] = {}  # Tune trial id -> Optuna numbers not yet told

    @property
    def study(self) -> optuna.Study:
        return self._ot_study

    def ask_batch(self, trial_id: str, n: int) -> list[tuple[int, dict[str, Any]]]:
        out = []
        for _ in range(n):
            ot = self._ot_study.ask()
            out.append((ot.number, self._suggest_from_define_by_run_func(self._space, ot)))
        self._ot_trials[trial_id] = {num for num, _ in out}
        return out

    def tell_row(self, trial_id: str, row: dict[str, Any]) -> None:
        """Tell one reported result (once: a repeated report of the same number is ignored)."""
        pending = self._ot_trials.get(trial_id)
        if pending is None or row["number"] not in pending:
            return
        pending.discard(row["number"])
        values = [row.get(o) for o in self.objectives] if row["status"] == "ok" else None
        if values is not None and all(isinstance(v, float) and math.isfinite(v) for v in values):
            self._tell(row["number"], values=values)
        else:
            self._tell(row["number"], state=TrialState.FAIL)

    def _tell(self, number: int, **kw: Any) -> None:
        try:
            self._ot_study.tell(number, **kw)
        except ValueError as exc:  # already finished: told before a driver restart
            log.debug("Optuna trial %d: %s", number, exc)

    def finish(self, trial_id: str) -> None:
        """A Tune trial ended: every Optuna trial it never reported is failed."""
        for num in sorted(self._ot_trials.pop(trial_id, set())):
            self._tell(num, state=TrialState.FAIL)

    def add_baseline(self, row: dict[str, Any]) -> None:
        """Seed the study with a baseline's result when the baseline is a point of the space (once)."""
        if row["status"] != "ok" or not self.space_def.contains(row["params"]):
            return
        if any(t.user_attrs.get("baseline") == row["baseline"] for t in self._ot_study.get_trials(deepcopy=False)):
            return
        params, dists = self.space_def.optuna_params(row["params"])
        self._ot_study.add_trial(optuna.trial.create_trial(
            params=params, distributions=dists, values=[row[o] for o in self.objectives],
            user_attrs={"baseline": row["baseline"]}))

    def counted(self) -> int:
        """Optuna trials that count against the host's budget (not baselines, not orphans)."""
        return sum(1 for t in self._ot_study.get_trials(deepcopy=False)
                   if "baseline" not in t.user_attrs and "orphaned" not in t.user_attrs)

    def fail_orphans(self) -> int:
        """After a restore: forget the held trials that finished meanwhile (told after the saved
        state), and fail the running Optuna trials that no restored Tune trial holds."""
        running = {t.number: t for t in self._ot_study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        for nums in self._ot_trials.values():
            nums &= running.keys()
        held = set().union(*self._ot_trials.values()) if self._ot_trials else set()
        n = 0
        for num, t in running.items():
            if num not in held:
                self._ot_study._storage.set_trial_user_attr(t._trial_id, "orphaned", True)
                self._tell(num, state=TrialState.FAIL)
                n += 1
        return n


class HostSearch(Searcher):
    """Routes Tune's suggestions over hosts: baselines first, then batches of each host's study."""

    def __init__(self, searchers: dict[str, BatchOptunaSearch], baselines: dict[str, list[dict[str, Any]]],
                 trials: int, batch: int | str, task_seconds: float, parallelism: int):
        super().__init__(metric=None, mode=None)
        self.searchers = searchers
        self.hosts = list(searchers)
        self.baselines = baselines
        self.trials = trials
        self.batch = batch
        self.task_seconds = task_seconds
        self.parallelism = max(1, parallelism)
        self.asked = {h: 0 for h in self.hosts}
        self.baseline_todo = {h: bool(baselines[h]) for h in self.hosts}
        self.eval_seconds: dict[str, deque[float]] = {h: deque(maxlen=200) for h in self.hosts}
        self.trial_host: dict[str, str] = {}
        self.baseline_trials: set[str] = set()
        self._rr = 0
        self._last_done: str | None = None

    def sync_from_storage(self) -> None:
        """Start from what the studies already hold (a resumed sweep without Tune state)."""
        for host, s in self.searchers.items():
            s.fail_orphans()
            self.asked[host] = s.counted()

    def set_search_properties(self, metric, mode, config, **spec) -> bool:  # noqa: ANN001 - Tune's signature
        return True

    def batch_size(self, host: str) -> int:
        if self.batch != "auto":
            return int(self.batch)
        samples = self.eval_seconds[host]
        per = statistics.median(samples) if samples else DEFAULT_EVAL_S
        cap = max(1, math.ceil(self.trials / (2 * self.parallelism)))
        return max(1, min(cap, round(self.task_seconds / max(per, 1e-6))))

    def _config(self, host: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        return {"host": host, "items": items}

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        for host in self.hosts:
            if self.baseline_todo[host]:
                self.baseline_todo[host] = False
                self.trial_host[trial_id] = host
                self.baseline_trials.add(trial_id)
                return self._config(host, self.baselines[host])
        open_hosts = [h for h in self.hosts if self.asked[h] < self.trials]
        if not open_hosts:
            return Searcher.FINISHED
        # the host whose task just ended first: Tune then hands it that task's actor (trace loaded)
        host = self._last_done if self._last_done in open_hosts else None
        if host is None:
            host = next(self.hosts[(self._rr + i) % len(self.hosts)] for i in range(len(self.hosts))
                        if self.hosts[(self._rr + i) % len(self.hosts)] in open_hosts)
            self._rr = (self.hosts.index(host) + 1) % len(self.hosts)
        self._last_done = None
        n = min(self.batch_size(host), self.trials - self.asked[host])
        drawn = self.searchers[host].ask_batch(trial_id, n)
        self.asked[host] += n
        self.trial_host[trial_id] = host
        return self._config(host, [{"key": f"{host}:{num}", "number": num, "baseline": None, "params": params}
                                   for num, params in drawn])

    def _rows(self, trial_id: str, result: dict[str, Any] | None) -> None:
        host = self.trial_host.get(trial_id)
        if host is None or not result:
            return
        for row in result.get("items") or []:
            if row["status"] == "ok":
                self.eval_seconds[host].append(row["eval_seconds"])
            if row["baseline"]:
                if trial_id in self.baseline_trials:
                    self.searchers[host].add_baseline(row)
            else:
                self.searchers[host].tell_row(trial_id, row)

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        self._rows(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        self._rows(trial_id, result)
        host = self.trial_host.get(trial_id)
        if host is None:
            return
        self._last_done = host
        if trial_id in self.baseline_trials:
            self.baseline_trials.discard(trial_id)
        else:
            self.searchers[host].finish(trial_id)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))
        # the searcher and Tune's trials were saved together, so they agree; the studies may hold more
        self.sync_from_storage()
