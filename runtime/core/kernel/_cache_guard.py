"""Empties numba's cache of this package's compiled kernels when any of their sources changed.

numba keys a cached function on its own source file's time stamp and size only: the functions run_layer.py
compiles inline helpers of evict.py, state.py and plan.py and codes of runtime/core/policy.py, whose
changes it would not see. This module hashes those sources and, when the hash differs from the one stored
beside numba's cache files, removes the package's cache files (numba compiles them again on first use).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
_SOURCES = (*sorted(_HERE.glob("*.py")), _HERE.parent / "policy.py")


def _cache_dirs() -> list[Path]:
    """Where numba keeps this package's cache files: NUMBA_CACHE_DIR (a folder named after the package's directory) and/or the
    package's __pycache__."""
    out = [_HERE / "__pycache__"]
    base = os.environ.get("NUMBA_CACHE_DIR")
    if base:
        from numba.core.caching import _CacheLocator

        out.append(Path(base) / _CacheLocator.get_suitable_cache_subpath(str(_HERE / "run_layer.py")))
    return out


def check() -> None:
    """Compare the sources' hash with the stored one; on a difference drop the cache files and store it."""
    h = hashlib.sha256()
    for p in _SOURCES:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    digest = h.hexdigest()
    for d in _cache_dirs():
        stamp = d / "kernel-sources.sha256"
        try:
            if stamp.is_file() and stamp.read_text() == digest:
                continue
            removed = 0
            for f in (*d.glob("*.nbi"), *d.glob("*.nbc")) if d.is_dir() else ():
                f.unlink(missing_ok=True)
                removed += 1
            if removed:
                log.info("kernel sources changed: removed %d numba cache files in %s", removed, d)
            d.mkdir(parents=True, exist_ok=True)
            stamp.write_text(digest)
        except OSError as exc:  # a read-only tree: numba's own checks only
            log.debug("kernel cache guard: %s: %s", d, exc)


check()
