"""numba's cache locator for the compiled units: one folder per content of a unit's sources, not per path.

numba's own locators key a cache on where the source file is (`__pycache__` beside it, or NUMBA_CACHE_DIR plus
the file's folder path), so the same sources at another path compile again: every checkout and worktree, an
installed wheel, and every node of a Ray cluster that unpacks `ray job submit --working-dir .` into its own
temporary folder (each paid a cold compile of the policy kernel, about 85 s of CPU). `UnitCacheLocator` caches
a unit's functions in `compiled.unit_dir(unit)` (NUMBA_CACHE_DIR, else $EXPERTSWEEP_CACHE/numba, else
~/.cache/expertsweep/numba; then `<slug>-<first 16 hex of the sources' hash>`) with the file's content as
numba's source stamp, so identical sources load one compile wherever they are. Functions of any other file are
left to numba's own locators (listed after this one by `use_unit_cache`). A unit's function always gets
this locator, even where its folder is not writable: numba's fallback folders (the package's __pycache__, its
user-wide folder) are never used for a unit, and `compiled.ensure` compiles a unit whose folder is not writable in
memory. What is loaded is still checked against the unit's golden table once per process (`compiled.ensure`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from numba.core.caching import InTreeCacheLocator

log = logging.getLogger(__name__)

LOCATOR_ENV = "NUMBA_CACHE_LOCATOR_CLASSES"  # numba's variable: a user's value replaces numba's list of locators
_warned_locator: list[str] = []  # the user's NUMBA_CACHE_LOCATOR_CLASSES value warned about (once per process)
_units: tuple = ()  # the compiled units (runtime/core/units.py UNITS), given by use_unit_cache


class UnitCacheLocator(InTreeCacheLocator):
    """The cache of a function of a compiled unit: `compiled.unit_dir(unit)`, stamped by the file's content."""

    def __init__(self, py_func, py_file, folder: Path):
        super().__init__(py_func, py_file)
        self._cache_path = str(folder)

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> str:
        # the file's content (numba >= 0.68 stamps its own locators so too; older releases used the mtime, which a
        # copy or an unpacked zip changes)
        return hashlib.sha256(Path(self._py_file).read_bytes()).hexdigest()

    @classmethod
    def from_function(cls, py_func, py_file):
        from runtime.core import compiled

        unit = compiled.unit_of_file(_units, py_file)
        if unit is None:
            return None  # not a unit's file: numba's next locator
        self = cls(py_func, py_file, compiled.unit_dir(unit))
        try:
            self.ensure_cache_path()
        except OSError:
            pass  # not writable: compiled.ensure compiles the unit in memory (numba's own fallbacks go unguarded)
        return self


def use_unit_cache(units: tuple) -> None:
    """Put `UnitCacheLocator` first in numba's own list of cache locators, in this
    process only (numba's `CacheImpl._locator_classes`, the list numba uses when NUMBA_CACHE_LOCATOR_CLASSES is
    unset; os.environ is left alone, so a child process inherits nothing: one that imports `runtime` does this
    itself). A user's NUMBA_CACHE_LOCATOR_CLASSES replaces that list in numba: it is honoured, with one WARNING
    when it leaves our locator out (the content key is then off). Called by runtime/core/units.py before any
    unit's function is defined, with the units (`UNITS`) whose files it caches."""
    global _units
    from numba.core import caching, config

    _units = tuple(units)
    if UnitCacheLocator not in caching.CacheImpl._locator_classes:
        caching.CacheImpl._locator_classes = [UnitCacheLocator, *caching.CacheImpl._locator_classes]
    config.reload_config()  # the variable as it is now (numba read it when it was imported)
    user = str(config.CACHE_LOCATOR_CLASSES or "")
    if user and "UnitCacheLocator" not in user and user not in _warned_locator:
        _warned_locator.append(user)
        log.warning("%s=%s is set: numba caches the compiled units where those locators say, not in one folder per "
                    "content of their sources (runtime/core/numba_locator.py), so a copy of the sources at another "
                    "path compiles again (~85 s of CPU for the policy kernel); unset it to share one compile",
                    LOCATOR_ENV, user)
