"""The backends, chosen by name: `simulator`, `emulation`, `engine`; each `evaluate(spec) -> Result`.

Like transformers' `integrations/moe.py`: one contract, several implementations behind a
registry. Every backend drives the same policy kernel (runtime/kernel.py) through
`PolicyCache`, so for the same router scores they make the same decisions
(tests/test_contract.py checks it token by token).

- `simulator` (runtime/simulate.py): replays a router trace; time from the host cost model.
- `emulation` (runtime/emulate.py): exact teacher-forced perplexity of a checkpoint.
- `engine` (runtime/engine.py): the same evaluation decoded token by token by the offloading
  engine (CPU device mode without a GPU); time measured.

A backend honours a fixed set of RunSpec fields (`honours`); a spec that sets any other field,
or a policy the backend cannot run, is refused by `check` with a one-line InputError before any
work. `evaluate_many` groups specs that share an input so the exact pass runs once.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from collections.abc import Callable

from runtime import simulate
from runtime.errors import ArgumentParser, InputError, check_output_path, cli_main
from runtime.kernel import COUNTER_NAMES  # noqa: F401 - re-exported: the counters every Result reports
from runtime.policy import add_policy_flags, policies_from_flags
from runtime.spec import FLAGS, GROUP_FIELDS, Result, RunSpec

_COMMON = frozenset({"capacity", "capacity_fraction", "vram_budget_GiB", "max_tokens", "initial_residency",
                     "residency_out", "record_decisions"})
_TEXT = frozenset({"model", "text", "window", "batch_windows", "calib_text", "calib_max_tokens", "dtype",
                   "max_memory_GiB", "nll_out", "substitute_weight"})


class Backend:
    """The contract. Subclasses set `name`, `honours`, and implement `_evaluate_group`."""

    name = ""
    honours: frozenset[str] = _COMMON
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
    """Replays traces; one instance keeps what its runs share (`simulate.ReplayCache`: the loaded trace,
    warm starts, the baseline replays, host profiles given with `add_host`), so a sweep worker's trials
    on one trace cost one replay each."""

    name = "simulator"
    honours = _COMMON | {"trace", "host", "model_shape", "weight_format"}

    def __init__(self) -> None:
        self.cache = simulate.ReplayCache()

    def add_host(self, data: dict) -> object:
        """Register a host profile given as a mapping (e.g. calibrated); RunSpecs name it by `host`."""
        return self.cache.add_host(data)

    def _group_key(self, spec: RunSpec) -> tuple:
        return (id(spec),)

    def _evaluate_group(self, specs: list[RunSpec], progress: bool) -> list[Result]:
        return [simulate.evaluate(s, cache=self.cache) for s in specs]


class Emulation(Backend):
    name = "emulation"
    honours = _COMMON | _TEXT | {"trace_out"}
    refuses = {("evict", "belady"): "an offline bound that needs the whole trace in advance: simulator only"}

    def _evaluate_group(self, specs: list[RunSpec], progress: bool) -> list[Result]:
        # torch-side: imported when first used (a simulator-only sweep worker never imports torch)
        from runtime import emulate

        m = _loaded(specs[0])
        return emulate.evaluate_group(m, specs, backend=self.name, progress=progress)


class EngineBackend(Backend):
    name = "engine"
    honours = _COMMON | _TEXT | {"device", "host_store"}
    refuses = {("evict", "belady"): "an offline bound that needs the whole trace in advance: simulator only"}

    def _evaluate_group(self, specs: list[RunSpec], progress: bool) -> list[Result]:
        from runtime import emulate, engine, hfmodel  # torch-side: imported when first used

        first = specs[0]
        dev = engine.resolve_device(first.device)
        with engine.device_errors(), engine.cpu_threads(dev, 1):
            m = hfmodel.load(first.model, first.dtype, first.max_memory_GiB)
            eng = engine.Engine(m, dev, host_store=first.host_store)
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
    from runtime import hfmodel

    key = (spec.model, spec.dtype, spec.max_memory_GiB)
    if key not in _MODELS:
        _MODELS.clear()
        gc.collect()  # a loaded model holds reference cycles: free the last one before the next loads
        _MODELS[key] = hfmodel.load(spec.model, spec.dtype, spec.max_memory_GiB)
    return _MODELS[key]


BACKENDS: dict[str, Callable[[], Backend]] = {"simulator": Simulator, "emulation": Emulation, "engine": EngineBackend}


def get_backend(name: str, flag: str = "backend") -> Backend:
    if name not in BACKENDS:
        raise InputError(f"{flag} = {name!r} is unknown (choose from {', '.join(BACKENDS)})")
    return BACKENDS[name]()


def evaluate(spec: RunSpec, backend: str = "simulator", progress: bool = False) -> Result:
    """`spec` through the named backend."""
    return get_backend(backend).evaluate(spec, progress)


# ---------------------------------------------------------------- python -m runtime.emulate

def build_parser(backends: tuple[str, ...] = ("emulation", "engine")) -> argparse.ArgumentParser:
    from runtime import emulate, hfmodel

    p = ArgumentParser(prog="python -m runtime.emulate", description=emulate.__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--text", required=True, help="UTF-8 text file to evaluate")
    add_policy_flags(p, repeatable_preset=True)
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--capacity-fraction", type=float, default=None, help="default 0.25")
    cap.add_argument("--capacity", type=int, default=None)
    cap.add_argument("--vram-budget", type=float, default=None, help="GiB (runtime.costmodel.capacities_for_budget)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--window", type=int, default=None, help="tokens per context window (default: min(max positions, 512))")
    p.add_argument("--batch-windows", type=int, default=8)
    p.add_argument("--initial-residency", default=None, help="warm:TRACE | cold | FILE.npy | held-out "
                   "(default: --calib-text, else calib.txt beside the model, else held-out: the text's last 20%%)")
    p.add_argument("--calib-text", default=None, help="text for the warm start (default: calib.txt beside the model)")
    p.add_argument("--calib-max-tokens", type=int, default=16384, help="calibration tokens read (independent of --max-tokens)")
    p.add_argument("--substitute-weight", default="missed", help="missed | own")
    p.add_argument("--backend", default="emulation", help=" | ".join(backends))
    p.add_argument("--device", default=None, help="engine: cpu | cuda")
    hfmodel.add_model_flags(p)
    p.add_argument("--host-store", default="ram", help="engine: ram | mmap")
    p.add_argument("--nll-out", default=None, help="per-token NLLs (Parquet)")
    p.add_argument("--trace-out", default=None, help="router trace seen under the (single) policy")
    p.add_argument("--residency-out", default=None, help="initial residency used (.npy int [L, C])")
    p.add_argument("--json", action="store_true")
    return p


def specs_from_args(a: argparse.Namespace) -> dict[str, RunSpec]:
    pols = policies_from_flags(a)
    if a.trace_out and len(pols) > 1:
        raise InputError(f"--trace-out {a.trace_out}: records one policy's trace; {len(pols)} policies given")
    if a.residency_out and len(pols) > 1:
        raise InputError(f"--residency-out {a.residency_out}: one policy's warm start; {len(pols)} policies given")
    for flag, path in (("--nll-out", a.nll_out), ("--trace-out", a.trace_out), ("--residency-out", a.residency_out)):
        check_output_path(path, flag)
    if a.capacity is None and a.capacity_fraction is None and a.vram_budget is None:
        a.capacity_fraction = 0.25
    return {name: RunSpec(policy=pol, name=name, capacity=a.capacity, capacity_fraction=a.capacity_fraction,
                          vram_budget_GiB=a.vram_budget, model=a.model, text=a.text, max_tokens=a.max_tokens,
                          window=a.window, batch_windows=a.batch_windows, initial_residency=a.initial_residency,
                          calib_text=a.calib_text, calib_max_tokens=a.calib_max_tokens, device=a.device,
                          dtype=a.dtype, max_memory_GiB=a.max_memory, host_store=a.host_store, substitute_weight=a.substitute_weight,
                          nll_out=a.nll_out, trace_out=a.trace_out, residency_out=a.residency_out)
            for name, pol in pols.items()}


def main(argv: list[str] | None = None) -> None:
    a = build_parser(tuple(BACKENDS)).parse_args(argv)
    specs = specs_from_args(a)
    backend = get_backend(a.backend, flag="--backend")
    results = dict(zip(specs, backend.evaluate_many(list(specs.values()), progress=sys.stderr.isatty()), strict=True))
    if a.json:
        out = {n: r.to_dict() for n, r in results.items()}
        print(json.dumps(next(iter(out.values())) if len(out) == 1 else out, indent=2))
        return
    first = next(iter(results.values()))
    print(f"exact perplexity {first.exact_perplexity:.4f} over {first.tokens} tokens (warm start: {first.initial_residency})")
    for n, r in results.items():
        print(f"{n:18s} ppl {r.perplexity:.4f}  change {r.ppl_change_pct:+.2f}% [{r.ppl_ci_low:+.2f}, {r.ppl_ci_high:+.2f}]  "
              f"mass/token {r.mass_per_token:.4f}  fetches {r.counters['fetches']}  subs {r.counters['substitutions']}"
              + (f"  {r.time_per_token_s * 1e3:.2f} ms/token" if r.time_per_token_s is not None else ""))


def emulate_cli(argv: list[str] | None = None) -> None:
    """`python -m runtime.emulate`: one-line errors, exit status 2."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="expertsweep: warning: %(message)s")
    cli_main(lambda: main(argv))
