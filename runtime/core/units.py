"""The compiled units (runtime/core/compiled.py) by name, defined without importing their modules.

numba asks `UnitCacheLocator` (runtime/core/numba_locator.py) where to cache each function as the function is
defined, before the unit's own modules have finished importing; so the units live here, and importing this
module points numba at that locator in this process (`numba_locator.use_unit_cache`: it imports numba). Each package
with a unit imports this module first: runtime/core/kernel/__init__.py and runtime/formats/costmodel/__init__.py.
A unit's sources are the files whose code numba compiles into it (runtime/core/compiled.py is not one: the
post-load check it runs covers whatever it loads, so a change to it compiles nothing again).
"""

from __future__ import annotations

from pathlib import Path

from runtime.core.compiled import Unit
from runtime.core.numba_locator import use_unit_cache

_CORE = Path(__file__).resolve().parent
_KERNEL = _CORE / "kernel"
_COSTMODEL = _CORE.parent / "formats" / "costmodel"

# the policy kernel: every module with numba functions (callees first), every source compiled or inlined into
# them, the fixed case (selfcheck.py) and its golden table
KERNEL = Unit(
    name="policy kernel",
    slug="kernel",
    package_dir=_KERNEL,
    modules=tuple(f"runtime.core.kernel.{m}" for m in ("search", "evict", "primitives", "route", "slots", "copies",
                                                     "decisions", "run_layer", "cache", "decide", "shared_pool")),
    sources=(*sorted(_KERNEL.glob("*.py")), _CORE / "policy.py", _CORE / "events.py"),
    exercise="runtime.core.kernel.selfcheck:exercise",
    golden=_KERNEL / "selfcheck.json",
)

# the cost model's event replay (selfcheck.py: the fixed case; its golden table: the same replay interpreted by
# Python)
COSTMODEL = Unit(
    name="cost model replay",
    slug="costmodel",
    package_dir=_COSTMODEL,
    modules=("runtime.formats.costmodel.timing",),
    sources=(_COSTMODEL / "timing.py", _COSTMODEL / "selfcheck.py", _CORE / "events.py"),
    exercise="runtime.formats.costmodel.selfcheck:exercise",
    golden=_COSTMODEL / "selfcheck.json",
)

UNITS = (KERNEL, COSTMODEL)

use_unit_cache(UNITS)
