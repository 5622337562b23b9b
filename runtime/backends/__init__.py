"""The backends, chosen by name: `simulator`, `emulation`, `engine`; each `evaluate(spec) -> Result`.

Like transformers' `integrations/moe.py`: one contract, several implementations behind a
registry. Every backend drives the same policy kernel (runtime/core/kernel/) through
`PolicyCache`, so for the same router scores they make the same decisions
(tests/test_contract.py checks it token by token).

- `simulator` (runtime/backends/simulate.py): replays a router trace; time from the host cost model.
- `emulation` (runtime/backends/emulate.py): exact teacher-forced perplexity of a checkpoint.
- `engine` (runtime/backends/engine/core.py): the same evaluation decoded token by token by the offloading
  engine (CPU device mode without a GPU); time measured.

A backend honours the RunSpec fields whose row in the run-field table (runtime/core/spec.py) names it
(`honours`); a spec that sets any other field, or a policy the backend cannot run, is refused by
`check` with a one-line InputError before any work. What a spec means on its input (slots per layer,
the warm start, the host profile) is resolved in one place, runtime/backends/resolve.py; a backend
supplies only its calibration ids. `evaluate_many` groups specs that share an input so the exact pass
runs once. The command lines are elsewhere: `runtime.backends.simulate` and
`runtime.cli` (the emulation's, and the `expertsweep` command).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from runtime.backends import simulate
from runtime.core.errors import InputError
from runtime.core.kernel import COUNTER_NAMES  # noqa: F401 - re-exported: the counters every Result reports
from runtime.core.spec import FLAGS, GROUP_FIELDS, Result, RunSpec, backend_options, honoured_by


class Backend:
    """The contract. Subclasses set `name`, `honours`, and implement `_evaluate_group`."""

    name = ""
    honours: frozenset[str] = frozenset()  # RunSpec fields: the run-field table's `backends` column (spec.py)
    # policy (field, value) pairs the backend cannot run, with the reason
    refuses: dict[tuple[str, object], str] = {}

    def check(self, spec: RunSpec) -> None:
        """A one-line InputError for every request this backend cannot honour (never ignored)."""
        for fld, value in spec.requested().items():
            if fld not in self.honours:
                raise InputError(f"backend {self.name}: cannot honour {FLAGS[fld]} = {value!r} "
                                 f"(it honours {', '.join(sorted(FLAGS[f] for f in self.honours))})")
        for (fld, value), why in self.refuses.items():
            if getattr(spec.policy, fld) == value:
                raise InputError(f"backend {self.name}: policy {fld} = {value!r} is not supported ({why})")

    def runs(self, spec: RunSpec) -> bool:
        """Whether `check` accepts the spec."""
        try:
            self.check(spec)
        except InputError:
            return False
        return True

    def evaluate(self, spec: RunSpec, progress: bool = False) -> Result:
        return self.evaluate_many([spec], progress)[0]

    def evaluate_many(self, specs: list[RunSpec], progress: bool = False) -> list[Result]:
        """Results in the order of `specs`; specs sharing an input share its exact pass."""
        for s in specs:
            self.check(s)
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(specs):
            groups.setdefault(self._group_key(s), []).append(i)
        out: list[Result | None] = [None] * len(specs)
        for idx in groups.values():
            for i, r in zip(idx, self._evaluate_group([specs[i] for i in idx], progress), strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def _group_key(self, spec: RunSpec) -> tuple:
        return tuple(getattr(spec, f) for f in GROUP_FIELDS)

    def _evaluate_group(self, specs: list[RunSpec], progress: bool) -> list[Result]:
        raise NotImplementedError


class Simulator(Backend):
    """Replays traces; one instance keeps what its runs share (`simulate.ReplayCache`: the loaded trace with
    its calibrations and host presets, the baseline replays), so a sweep worker's trials on one trace cost
    one replay each. A host profile travels in the RunSpec (`host`: a name, or the profile by value)."""

    name = "simulator"
    honours = honoured_by(name)

    def __init__(self) -> None:
        self.cache = simulate.ReplayCache()

    def _group_key(self, spec: RunSpec) -> tuple:
        return (id(spec),)

    def _evaluate_group(self, specs: list[RunSpec], progress: bool) -> list[Result]:
        return [simulate.evaluate(s, cache=self.cache) for s in specs]


class Emulation(Backend):
    name = "emulation"
    honours = honoured_by(name)  # device: cpu | cuda, layers streamed through it
    refuses = {("evict", "belady"): "an offline bound that needs the whole trace in advance: simulator only"}

    def _evaluate_group(self, specs: list[RunSpec], progress: bool) -> list[Result]:
        # torch-side: imported when first used (a simulator-only sweep worker never imports torch)
        from runtime.backends import emulate

        m = _loaded(specs[0])
        return emulate.evaluate_group(m, specs, backend=self.name, progress=progress)


class EngineBackend(Backend):
    name = "engine"
    honours = honoured_by(name)
    refuses = {("evict", "belady"): "an offline bound that needs the whole trace in advance: simulator only"}

    def _evaluate_group(self, specs: list[RunSpec], progress: bool) -> list[Result]:
        from runtime.backends import (  # torch-side: imported when first used
            emulate,
            engine,
            hfmodel,
        )

        first = specs[0]
        dev = engine.resolve_device(first.device)
        with engine.device_errors(), engine.cpu_threads(dev, 1):
            m = hfmodel.load(first.model, first.dtype, first.max_memory_GiB)
            eng = engine.Engine(m, dev, **backend_options(first, self.name))  # host_store, no_cuda_graphs: the table's rows
            try:
                res = emulate.evaluate_group(m, specs, runner=eng.teacher_forced, backend=self.name, progress=progress)
            finally:
                eng.close()
        for r in res:
            r.time_kind = "measured"
            r.time_per_token_s = r.extra.pop("time_per_token_s", None)
        return res


_MODELS: dict[tuple, object] = {}


def _loaded(spec: RunSpec):
    """The emulation's loaded checkpoint, kept between calls (one per model and dtype)."""
    from runtime.backends import hfmodel

    key = (spec.model, spec.dtype, spec.max_memory_GiB, spec.device)
    if key not in _MODELS:
        _MODELS.clear()
        gc.collect()  # a loaded model holds reference cycles: free the last one before the next loads
        _MODELS[key] = hfmodel.load(spec.model, spec.dtype, spec.max_memory_GiB, device=spec.device)
    return _MODELS[key]


BACKENDS: dict[str, Callable[[], Backend]] = {"simulator": Simulator, "emulation": Emulation, "engine": EngineBackend}


def get_backend(name: str, flag: str = "backend") -> Backend:
    if name not in BACKENDS:
        raise InputError(f"{flag} = {name!r} is unknown (choose from {', '.join(BACKENDS)})")
    return BACKENDS[name]()


def evaluate(spec: RunSpec, backend: str = "simulator", progress: bool = False) -> Result:
    """`spec` through the named backend."""
    return get_backend(backend).evaluate(spec, progress)
