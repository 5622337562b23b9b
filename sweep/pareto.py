"""`python sweep/pareto.py ARGS`: the sweep driver (sweep/driver.py) run as a script by its path.

This is the form `ray job submit --working-dir . -- python sweep/pareto.py ARGS` runs (and the one the
Makefile and docs/sweep.md name beside `python -m sweep`). A script run by its path gets its own folder,
sweep/, as the first entry of `sys.path` rather than the checkout root, so `import sweep` would fail and
sweep/'s modules (config, data, ...) could shadow libraries of the same name: the one line below puts the
checkout root in its place, then the package's `main` runs. Imported as `sweep.pareto` it does nothing.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    _ROOT = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "sweep"]

    from runtime.core.errors import cli_main
    from sweep.driver import main

    cli_main(main)
