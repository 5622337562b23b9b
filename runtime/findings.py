"""`python -m runtime.findings`: the documented form of `expertsweep findings` (runtime/tools/findings/cli.py).

Kept so the commands in the docs and in users' scripts go on working; it runs the console command's
subcommand, with the same flags, logging, one-line errors and exit status.
"""

import sys

from runtime.cli import main

if __name__ == "__main__":
    main(["findings", *sys.argv[1:]])
