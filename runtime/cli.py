"""The `expertsweep` command: one console command, a subcommand per tool, and the emulation's command line.

`expertsweep sweep | simulate | emulate | record | findings | model [ARGS]` (pyproject.toml
`[project.scripts]`) runs the same `main(argv)` as `python -m sweep`,
`python -m runtime.simulate | emulate | record | findings` and `python -m runtime.tools.tinymodel`, with
the same flags, one-line errors and exit status 2 on bad input. Each subcommand's module is
imported only when it runs (`expertsweep simulate` never imports torch).

The emulation's command line lives here (`emulate_main`; `python -m runtime.emulate` delegates to
it): its flags are the policy table's (runtime/core/policy.py) plus the run-field table's rows that the
emulation or the engine honours (runtime/core/spec.py `add_run_flags`), so a field's flag, default
and help are written once.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable

from runtime.core import threads
from runtime.core.errors import ArgumentParser, InputError, cli_main

log = logging.getLogger(__name__)

_WARN = "expertsweep: warning: %(message)s"
# subcommand -> (module, its main, log level and format as its `python -m` form sets them (None: its main
# sets its own), what it does)
COMMANDS: dict[str, tuple[str, str, int | None, str | None, str]] = {
    "sweep": ("sweep.driver", "main", None, None,
              "the Ray Tune + Optuna sweep: speed/perplexity Pareto fronts per host (python -m sweep)"),
    "simulate": ("runtime.backends.simulate", "main", logging.WARNING, _WARN,
                 "replay a router trace under a policy with a host cost model (python -m runtime.simulate)"),
    "emulate": ("runtime.cli", "emulate_main", logging.WARNING, _WARN,
                "exact perplexity of a checkpoint under policies, or decoded by the engine "
                "(python -m runtime.emulate)"),
    "record": ("runtime.tools.record", "main", logging.WARNING, None,
               "record a checkpoint's router trace over a text, or a .gguf's by llama.cpp (python -m runtime.record)"),
    "findings": ("runtime.tools.findings", "main", logging.INFO, "%(name)s: %(message)s",
                 "the paper's findings on a checkpoint, with intervals (python -m runtime.findings)"),
    "model": ("runtime.tools.tinymodel", "main", None, None,
              "build the tiny reference models (python -m runtime.tools.tinymodel, make model)"),
}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="expertsweep", description=__doc__.splitlines()[0],
                       epilog="`expertsweep COMMAND --help` lists a command's flags.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (*_, what) in COMMANDS.items():
        sub.add_parser(name, help=what, add_help=False)
    return p


def main(argv: list[str] | None = None) -> None:
    """`expertsweep COMMAND ARGS`: the command's own `main(ARGS)`; bad input is one line, exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    threads.configure(counts=argv[:1] != ["sweep"])  # before any subcommand imports torch (OpenMP reads it once)
    if not argv or argv[0] not in COMMANDS:
        # `expertsweep`, `expertsweep --help` or an unknown command: argparse prints or raises
        cli_main(lambda: build_parser().parse_args(argv[:1] or ["--help"]))
        return
    module, fn, level, fmt, _ = COMMANDS[argv[0]]
    if level is not None:
        logging.basicConfig(level=level, stream=sys.stderr, **({"format": fmt} if fmt else {}))
    run: Callable[[list[str]], None] = getattr(importlib.import_module(module), fn)
    cli_main(lambda: run(argv[1:]))


# ---------------------------------------------------------------- expertsweep emulate / python -m runtime.emulate

EMULATE_BACKENDS = ("emulation", "engine")


def build_emulate_parser() -> argparse.ArgumentParser:
    from runtime.backends import emulate
    from runtime.core.policy import add_policy_flags
    from runtime.core.spec import DEFAULT_CAPACITY_FRACTION, add_run_flags

    p = ArgumentParser(prog="python -m runtime.emulate", description=emulate.__doc__.splitlines()[0],
                       allow_abbrev=False)  # --model is not --model-shape
    add_policy_flags(p, repeatable_preset=True)
    add_run_flags(p, EMULATE_BACKENDS, size_default=f"--capacity-fraction {DEFAULT_CAPACITY_FRACTION}")
    p.add_argument("--backend", default="emulation", help=" | ".join(EMULATE_BACKENDS))
    p.add_argument("--json", action="store_true", help="print the full result(s) as JSON")
    return p


def emulate_specs(a: argparse.Namespace) -> dict:
    """{name: RunSpec} from the emulation command line (one per `--policy`)."""
    from runtime.core.policy import policies_from_flags
    from runtime.core.spec import (
        DEFAULT_CAPACITY_FRACTION,
        RUN_FIELD_BY_NAME,
        RunSpec,
        honoured_by,
        run_kwargs,
    )

    for req in ("model", "text"):
        if getattr(a, req) is None:
            raise InputError(f"{RUN_FIELD_BY_NAME[req].flag} is required")
    pols = policies_from_flags(a)
    for out in ("trace_out", "residency_out"):
        path = getattr(a, RUN_FIELD_BY_NAME[out].dest)
        if path and len(pols) > 1:
            raise InputError(f"{RUN_FIELD_BY_NAME[out].flag} {path}: one policy's output; {len(pols)} policies given")
    names = tuple(n for n in sorted(honoured_by("emulation") | honoured_by("engine")) if RUN_FIELD_BY_NAME[n].flag)
    kw = run_kwargs(a, names)
    if all(kw[n] is None for n in ("capacity", "capacity_fraction", "vram_budget_GiB")):
        kw["capacity_fraction"] = DEFAULT_CAPACITY_FRACTION
    return {name: RunSpec(policy=pol, name=name, **kw) for name, pol in pols.items()}


def emulate_main(argv: list[str] | None = None) -> None:
    """`python -m runtime.emulate` / `expertsweep emulate` (raises InputError; `main` prints it)."""
    from runtime.backends import get_backend

    a = build_emulate_parser().parse_args(argv)
    specs = emulate_specs(a)
    if a.backend not in EMULATE_BACKENDS:
        raise InputError(f"--backend = {a.backend!r} is unknown (choose from {', '.join(EMULATE_BACKENDS)})")
    backend = get_backend(a.backend, flag="--backend")
    if a.policy == ["all"] or a.policy == "all":  # every preset this backend runs; the others named in one line
        refused = [name for name, spec in specs.items() if not backend.runs(spec)]
        if refused:
            print(f"expertsweep: --policy all on --backend {a.backend}: left out {', '.join(refused)} "
                  f"(the backend refuses them)", file=sys.stderr)
        specs = {name: spec for name, spec in specs.items() if name not in refused}
    results = dict(zip(specs, backend.evaluate_many(list(specs.values()), progress=sys.stderr.isatty()), strict=True))
    from runtime.tools.llamacpp import is_gguf_path, peak_rss_mib

    if is_gguf_path(a.model):  # held whole in memory, dequantized: what the load cost (runtime/backends/gguf.py)
        print(f"expertsweep emulate: peak RSS {peak_rss_mib():.0f} MiB (this process, the GGUF dequantized to "
              f"float by transformers)", file=sys.stderr)
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


if __name__ == "__main__":
    main()
