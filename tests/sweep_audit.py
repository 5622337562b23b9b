"""Test support: an audit hook that makes a Ray worker fail when it touches the driver's output folder.

`install` is a Ray `worker_process_setup_hook` (runtime_env of the sweep's job). It adds a
`sys.addaudithook` hook to the worker process: a Python-level `open` (and `os.mkdir`, `os.remove`,
`os.rename`, `os.rmdir`, `os.listdir`, `os.scandir`) of a path under `$EXPERTSWEEP_AUDIT_ROOT`
raises PermissionError in that worker and is written to `$EXPERTSWEEP_AUDIT_LOG/violations-<pid>.txt`;
every process that installed it leaves `installed-<pid>` there (so a test knows it ran).
"""

from __future__ import annotations

import os
import sys

EVENTS = {"open", "os.mkdir", "os.remove", "os.rename", "os.rmdir", "os.listdir", "os.scandir"}


def _under(path: object, root: str) -> bool:
    if isinstance(path, int) or path is None:
        return False
    try:
        p = os.fsdecode(path)
    except TypeError:
        return False
    p = os.path.abspath(p)
    return p == root or p.startswith(root + os.sep) or os.path.realpath(p).startswith(root + os.sep)


def install() -> None:
    root = os.path.realpath(os.environ["EXPERTSWEEP_AUDIT_ROOT"])
    log = os.environ["EXPERTSWEEP_AUDIT_LOG"]
    with open(os.path.join(log, f"installed-{os.getpid()}"), "w") as f:
        f.write(" ".join(sys.argv)[:500])

    def hook(event: str, args: tuple) -> None:
        if event in EVENTS and args and any(_under(a, root) for a in args[:2 if event == "os.rename" else 1]):
            with open(os.path.join(log, f"violations-{os.getpid()}.txt"), "a") as f:
                f.write(f"{event} {args[0]!r}\n")
            raise PermissionError(f"audit: a Ray worker touched the driver's output folder: {event} {args[0]!r}")

    sys.addaudithook(hook)
