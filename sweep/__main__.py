"""`python -m sweep [--config FILE] ...`: the sweep driver (sweep/driver.py), with its one-line errors and exit
status 2 on bad input; the same `main` as `expertsweep sweep` and `python sweep/pareto.py`."""

from runtime.core.errors import cli_main
from sweep.driver import main

if __name__ == "__main__":
    cli_main(main)
