"""numba's cache locator for the compiled units: one folder per content of a unit's sources, not per path.

numba's own locators key a cache on where the source file is (`__pycache__` beside it, or NUMBA_CACHE_DIR plus
the file's folder path), so the same sources at another path compile again: every checkout and worktree, an
installed wheel, and every node of a Ray cluster that unpacks `ray job submit --working-dir .` into its own
temporary folder (each paid a cold compile of the policy kernel, about 85 s of CPU). `UnitCacheLocator` caches
a unit's functions in `compiled.unit_dir(unit)` (NUMBA_CACHE_DIR, else $EXPERTSWEEP_CACHE/numba, else
~/.cache/expertsweep/numba; then `<slug>-<first 16 hex of the sources' hash>`) with the file's content as
numba's source stamp, so identical sources load one compile wherever they are. Functions of any other file are
left to numba's own locators (listed after this one by `compiled.use_unit_cache`). A unit's function always gets
this locator, even where its folder is not writable: numba's fallback folders (the package's __pycache__, its
user-wide folder) are never used for a unit, and `compiled.ensure` compiles a unit whose folder is not writable in
memory. What is loaded is still checked against the unit's golden table once per process (`compiled.ensure`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from numba.core.caching import InTreeCacheLocator


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
        from runtime.core.units import UNITS

        unit = compiled.unit_of_file(UNITS, py_file)
        if unit is None:
            return None  # not a unit's file: numba's next locator
        self = cls(py_func, py_file, compiled.unit_dir(unit))
        try:
            self.ensure_cache_path()
        except OSError:
            pass  # not writable: compiled.ensure compiles the unit in memory (numba's own fallbacks go unguarded)
        return self
