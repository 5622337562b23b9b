"""User-facing errors and safe output writing shared by every ExpertSweep entry point.

`InputError` is raised for anything the user got wrong (a bad file, field, flag or value);
`cli_main` turns it into a one-line `expertsweep: error: ...` message and exit status 2
instead of a traceback. `atomic_write` makes sure a failed or interrupted run never leaves
a partial output file behind.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


class InputError(ValueError):
    """Bad user input; str() is one line naming the file/field/flag and the value."""

    def __init__(self, message: object) -> None:
        # Keep the message on one line whatever was passed in (e.g. a library's multi-line error).
        super().__init__(" ".join(str(message).split()))


class CompiledCheckError(RuntimeError):
    """A freshly compiled unit disagrees with its golden table: the compiler or the sources are wrong
    (raised by runtime/core/compiled.py)."""


def cli_main(fn: Callable[[], Any]) -> None:
    """Run `fn()`; on InputError print `expertsweep: error: <msg>` to stderr and exit with status 2; when a
    compiled unit fails its check after a fresh compile (runtime/core/compiled.py) print that line and exit 3."""
    try:
        fn()
    except InputError as e:
        print(f"expertsweep: error: {e}", file=sys.stderr)
        sys.exit(2)
    except CompiledCheckError as e:
        print(f"expertsweep: error: {e}", file=sys.stderr)
        sys.exit(3)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for every command: a usage error is an InputError (one line, exit 2 through cli_main),
    not the usage block; no abbreviated long flags (`--host` is not taken for `--hosts`), also in its
    subparsers (argparse makes them of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # argparse's documented override point
        raise InputError(f"{self.prog}: {message}")


def check_output_path(path: str | os.PathLike[str] | None, flag: str = "--out") -> None:
    """Before any work: an output file must be writable where it is asked for (its folder exists)."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} {p}: is a directory, expected a file path")
    if not p.parent.is_dir():
        raise InputError(f"{flag} {p}: folder {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK):
        raise InputError(f"{flag} {p}: folder {p.parent} is not writable")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike[str], write_fn: Callable[[str], Any]) -> None:
    """Create or replace `path` atomically.

    `write_fn(tmp_path)` is called with the name (a str) of a fresh temporary file in the same
    directory as `path` and must write the complete content there (it may open it itself or hand
    the name to a library writer). On success the temporary file is renamed over `path`
    (os.replace, atomic on POSIX); on any exception it is removed and the exception re-raised,
    so `path` is either the old file (or absent) or the complete new one, never a partial one.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write_fn(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
