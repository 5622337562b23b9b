"""ExpertSweep's runtime: one exact definition of every miss policy, and the backends that run it.

    core/      policy (the policy table), spec (the run-field table, RunSpec), kernel (numba), errors
    backends/  the backend registry (get_backend) and simulate, emulate, engine with their model code
    formats/   trace (router traces on disk, synthetic traces), costmodel (host cost model, presets in data/hosts)
    tools/     record, calibrate, generate, findings, tinymodel, corpus, tinyhf: applications of the above
    cli.py     the `expertsweep` console command; simulate.py, emulate.py, record.py and findings.py
               are its `python -m runtime.X` forms
    data/      host presets and model shapes, shipped as package data

The public API is `__all__`, importable from here (`from runtime import RunSpec, get_backend`):

    PolicyConfig, PRESETS        a miss policy and the named presets (core.policy)
    RunSpec, Result              what to run and a backend's answer (core.spec)
    get_backend                  the backend registry: get_backend(name).evaluate(spec) -> Result
    load_trace                   a router trace from disk (formats.trace)
    HostProfile, load_host_profile, list_host_profiles
                                 host profiles and the shipped presets (formats.costmodel)
    calibrate                    measure a host with an engine into a HostProfile (tools.calibrate)
    InputError                   the one-line error every public function raises on bad input

Each name is imported on first use (a module `__getattr__`), so `import runtime` loads neither numpy,
numba, pyarrow nor torch. tests/test_imports.py holds the sweep and the tools to this API (and an
allowlist of the other runtime modules they may import). docs/architecture.md draws how the parts fit.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a few ms at every start)
if TYPE_CHECKING:  # for type checkers and tests/test_imports.py; at run time the names load lazily
    from runtime.backends import get_backend
    from runtime.core.errors import InputError
    from runtime.core.policy import PRESETS, PolicyConfig
    from runtime.core.spec import Result, RunSpec
    from runtime.formats.costmodel import HostProfile, list_host_profiles, load_host_profile
    from runtime.formats.trace import load_trace
    from runtime.tools.calibrate import calibrate

# public name -> the module that defines it
EXPORTS: dict[str, str] = {
    "PolicyConfig": "runtime.core.policy",
    "PRESETS": "runtime.core.policy",
    "RunSpec": "runtime.core.spec",
    "Result": "runtime.core.spec",
    "get_backend": "runtime.backends",
    "load_trace": "runtime.formats.trace",
    "HostProfile": "runtime.formats.costmodel",
    "load_host_profile": "runtime.formats.costmodel",
    "list_host_profiles": "runtime.formats.costmodel",
    "calibrate": "runtime.tools.calibrate",
    "InputError": "runtime.core.errors",
}

__all__ = [
    "PolicyConfig", "PRESETS", "RunSpec", "Result", "get_backend", "load_trace", "HostProfile", "load_host_profile",
    "list_host_profiles", "calibrate", "InputError",
]  # == list(EXPORTS), checked by tests/test_imports.py; a literal so that linters read it


def __getattr__(name: str) -> object:
    if name not in EXPORTS:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
