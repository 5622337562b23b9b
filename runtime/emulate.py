"""`python -m runtime.emulate`: the documented form of `expertsweep emulate` (runtime/backends/emulate.py).

Kept so the commands in the docs and in users' scripts go on working; it runs the console command's
subcommand, with the same flags, logging, one-line errors and exit status.
"""

import sys

from runtime.cli import main

if __name__ == "__main__":
    main(["emulate", *sys.argv[1:]])
