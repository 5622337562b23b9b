"""Search algorithms: one Optuna study per host behind one host-routing Ray Tune `Searcher`.

`HostStudy` wraps one host's Optuna study (multi-objective, TPE or NSGA-II) through its public
ask-and-tell interface: `Study.ask()` gives a trial, the space draws the policy on it define-by-run
(`Space.sample`), and `Study.tell(number, ...)` reports the result. A Tune trial carries a batch of
Optuna trials: one Ray task then evaluates many cheap simulator trials, so Ray's per-task cost is
paid once per batch. Results are told per Optuna trial as the task reports them.

`HostSearch` is the `ray.tune.search.Searcher` handed to the Tuner. It suggests each host's named
baselines first (they also seed that host's study when they lie inside the space, as soon as they
are reported), then Optuna batches, preferring the host whose task just ended (so Tune reuses its
actor) and else round-robin, until every host has asked its `trials`. With `batch: auto` a batch
holds about `task_seconds` of simulation at the median seconds per trial measured lately on that
host. Its state is saved as JSON with Tune's experiment state (the finished trials live in their
journal), so `Tuner.restore` resumes it: trials still pending in a restored Tune trial are asked
again with the values they were drawn with, trials asked after the last save are simply asked anew.

Each host's finished trials are recorded in Optuna's own `JournalStorage` on `JournalFileBackend`
(`<out>/optuna.journal`: a file lock and an fsync per append), one append per trial (`HostStudy`).
The journal copy of a trial keeps its system attributes (`create_trial(system_attrs=...)`): they
hold the sampler's own state, such as NSGA-II's generation number, so a resumed NSGA-II search
continues its generations instead of starting generation 0 again.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections import deque
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from ray.tune.search import Searcher

from sweep.space import Space

DEFAULT_EVAL_S = 0.05  # assumed seconds per simulator trial until a host has reported some


def journal_storage(path: str | Path) -> optuna.storages.JournalStorage:
    """Optuna's journal storage on a file (its own backend: a lock and fsync per append)."""
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def make_sampler(kind: str, seed: int, population: int) -> optuna.samplers.BaseSampler:
    if kind == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=population, seed=seed)
    with warnings.catch_warnings():  # multivariate/group are stable in practice, "experimental" by name
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                          n_startup_trials=10)


class HostStudy:
    """One host's search: an in-memory Optuna study asked and told through its public ask-and-tell
    interface, and its journal (one `add_trial` per finished trial).

    Sampling runs on the in-memory study (`study`); each finished trial (and each baseline inside
    the space) is then appended to the persistent study (`journal`, Optuna's `JournalStorage`) with
    its sweep key as a user attribute. One journal append (a lock and an fsync) per trial instead of
    one per `suggest_*` call keeps the driver off the disk's latency. A restored search rebuilds the
    in-memory study from the journal (`load`) and asks its still-pending trials again with their
    drawn values (`enqueue_trial`), so nothing recorded is lost and a trial never counts twice."""

    def __init__(self, space: Space, objectives: tuple[str, ...], sampler: optuna.samplers.BaseSampler,
                 storage: optuna.storages.BaseStorage, study_name: str, host: str):
        self.space = space
        self.objectives = tuple(objectives)
        self.sampler = sampler
        self.host = host
        self.directions = ["minimize"] * len(self.objectives)
        self.journal = optuna.create_study(storage=storage, study_name=study_name, directions=self.directions,
                                          load_if_exists=True)
        self.pending: dict[str, dict[str, list]] = {}  # Tune trial id -> {key: [in-memory number, params]}
        self.load()

    def load(self) -> None:
        """The in-memory study from the journal (its finished trials, in order)."""
        self.study = optuna.create_study(directions=self.directions, sampler=self.sampler)
        recorded = self.journal.get_trials(deepcopy=False)
        self.study.add_trials(recorded)
        self.keys = {t.user_attrs.get("key") for t in recorded}
        self.next_index = 1 + max((int(k.rsplit(":", 1)[1]) for k in self.keys
                                   if k and k.rsplit(":", 1)[1].isdigit()), default=-1)

    def counted(self) -> int:
        """Recorded trials that count against the host's budget (not the baselines)."""
        return sum(1 for t in self.journal.get_trials(deepcopy=False) if "baseline" not in t.user_attrs)

    def _draw(self, params: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        if params is not None:  # a trial drawn before a restore: the same values again
            self.study.enqueue_trial(self.space.optuna_params(params)[0], skip_if_exists=False)
        trial = self.study.ask()
        return trial.number, self.space.sample(trial)

    def ask_batch(self, trial_id: str, n: int) -> list[tuple[str, int, dict[str, Any]]]:
        """n new trials for Tune trial `trial_id`: (sweep key, Optuna number, policy config)."""
        out = []
        for _ in range(n):
            num, params = self._draw()
            out.append((f"{self.host}:{self.next_index}", num, params))
            self.next_index += 1
        self.pending[trial_id] = {key: [num, params] for key, num, params in out}
        return out

    def _finish(self, key: str, number: int, values: list[float] | None) -> None:
        if values is not None:
            ft = self.study.tell(number, values, skip_if_finished=True)
        else:
            ft = self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        if key in self.keys:
            return
        self.journal.add_trial(optuna.trial.create_trial(
            params=ft.params, distributions=ft.distributions, state=ft.state,
            values=ft.values if ft.state == TrialState.COMPLETE else None, user_attrs={**ft.user_attrs, "key": key},
            system_attrs=ft.system_attrs))  # the sampler's own state (NSGA-II: the trial's generation)
        self.keys.add(key)

    def tell_row(self, trial_id: str, row: dict[str, Any]) -> None:
        """Tell one reported result (once: a repeated report of the same key is ignored)."""
        entry = self.pending.get(trial_id, {}).pop(row["key"], None)
        if entry is None:
            return
        values = [row.get(o) for o in self.objectives] if row["status"] == "ok" else None
        if values is not None and not all(isinstance(v, float) and math.isfinite(v) for v in values):
            values = None
        self._finish(row["key"], entry[0], values)

    def finish(self, trial_id: str) -> None:
        """A Tune trial ended: every Optuna trial it never reported is failed."""
        for key, (num, _) in sorted(self.pending.pop(trial_id, {}).items()):
            self._finish(key, num, None)

    def add_baseline(self, row: dict[str, Any]) -> None:
        """Seed the study with a baseline's result when the baseline is a point of the space (once)."""
        if row["status"] != "ok" or not self.space.contains(row["params"]) or row["key"] in self.keys:
            return
        params, dists = self.space.optuna_params(row["params"])
        ft = optuna.trial.create_trial(params=params, distributions=dists, values=[row[o] for o in self.objectives],
                                       user_attrs={"baseline": row["baseline"], "key": row["key"]})
        self.journal.add_trial(ft)
        self.study.add_trial(ft)
        self.keys.add(row["key"])

    def restore_pending(self, pending: dict[str, dict[str, list]]) -> None:
        """After a restore: the in-memory study anew from the journal, and the Tune trials' pending
        Optuna trials (those not recorded meanwhile) asked again with the values they were drawn with."""
        self.load()
        self.pending = {}
        for tid, entries in pending.items():
            todo = {key: params for key, (_, params) in entries.items() if key not in self.keys}
            self.pending[tid] = {key: [self._draw(params)[0], params] for key, params in todo.items()}
        self.next_index = max([self.next_index] + [int(k.rsplit(":", 1)[1]) + 1 for e in pending.values()
                                                   for k in e])


class HostSearch(Searcher):
    """Routes Tune's suggestions over hosts: baselines first, then batches of each host's study."""

    def __init__(self, searchers: dict[str, HostStudy], baselines: dict[str, list[dict[str, Any]]],
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
        """Start from what the journals already hold (a resumed sweep without Tune state)."""
        for host, s in self.searchers.items():
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
        return self._config(host, [{"key": key, "number": num, "baseline": None, "params": params}
                                   for key, num, params in drawn])

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

    STATE_KEYS = ("asked", "baseline_todo", "trial_host", "baseline_trials", "_rr", "_last_done")

    def save(self, checkpoint_path: str) -> None:
        """The routing state as JSON (the studies themselves live in their storage)."""
        state = {k: getattr(self, k) for k in self.STATE_KEYS}
        state["baseline_trials"] = sorted(self.baseline_trials)
        state["eval_seconds"] = {h: list(v) for h, v in self.eval_seconds.items()}
        state["pending"] = {h: s.pending for h, s in self.searchers.items()}
        with open(checkpoint_path, "w") as f:
            f.write(json.dumps(state))  # dumps: the C encoder (json.dump streams through the Python one)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path) as f:
            state = json.load(f)
        for k in self.STATE_KEYS:
            setattr(self, k, state[k])
        self.baseline_trials = set(state["baseline_trials"])
        self.eval_seconds = {h: deque(state["eval_seconds"].get(h, []), maxlen=200) for h in self.hosts}
        # the searcher and Tune's trials were saved together, so they agree; the journals may hold more
        # (trials asked and finished after the save): a host's budget is spent by what its journal holds
        # and what its restored Tune trials still carry; trials asked after the save and never
        # finished are asked anew
        for h, s in self.searchers.items():
            s.restore_pending(state["pending"].get(h, {}))
            self.asked[h] = s.counted() + sum(len(e) for e in s.pending.values())
