"""How long the test suite takes: `make test` and `make check` in a fresh clone, timed, into reports/suite.md/.json.

    .venv/bin/python scripts/suite_time.py                 # both targets (the lead runs it on the merged tree)
    .venv/bin/python scripts/suite_time.py --targets check # the fast loop only
    .venv/bin/python scripts/suite_time.py measure -- .venv/bin/python -m pytest -q tests/test_x.py   # one command

The clone is `git clone` of this checkout's HEAD into a temporary folder, `.venv` a link to this checkout's virtual
environment (its stamp kept: `make -o .venv/.installed`, so the set-up's pip steps are not timed, only the suite and
the numba compile), `NUMBA_CACHE_DIR` an empty folder (as on CI: the controller compiles the kernel cold) and
`EXPERTSWEEP_CACHE` an empty folder (no model built by an earlier run).

CPU time is counted over every process the command starts, the Ray nodes and their workers included: this process
makes itself the child subreaper (prctl PR_SET_CHILD_SUBREAPER), so a daemonised descendant is reaped here when it
exits and its CPU time is added to RUSAGE_CHILDREN (`/usr/bin/time` counts only the processes its command waits for:
a sweep test's Ray processes, reparented to init, are not counted there).

The report lists, per target: wall seconds, user and system CPU seconds, passed / skipped / failed / errors (pytest's
summary line) and the 25 slowest test phases (pytest's `--durations=25` table, which `make test` and `make check`
print).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.core.errors import ArgumentParser, InputError, cli_main  # noqa: E402
from runtime.tools.reports import git_commit, write_report  # noqa: E402

logger = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)", re.M)
COUNTS = re.compile(r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed|deselected)")


def become_subreaper() -> bool:
    """Orphaned descendants are reparented to this process (Linux), so their CPU time reaches RUSAGE_CHILDREN."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_all(patience_s: float = 60) -> None:
    """Wait for every child left (orphans adopted by the subreaper included), so their times are counted; a
    process still running after `patience_s` (a leak) is left alone and its time not counted."""
    deadline = time.time() + patience_s
    while time.time() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.2)  # a daemon still shutting down
    logger.warning("processes still running %.0f s after the command ended: their CPU time is not counted",
                   patience_s)


def measure(cmd: list[str], cwd: Path, env: dict[str, str], log: Path | None = None) -> dict:
    """Run `cmd`; its return code, wall seconds, user and system CPU seconds of it and every descendant, output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") if log is None else open(log, "w+") as sink:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        rc = proc.wait()
        wall = time.perf_counter() - t0
        reap_all()
        sink.seek(0)
        output = sink.read()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"rc": rc, "wall_s": round(wall, 1), "user_s": round(after.ru_utime - before.ru_utime, 1),
            "sys_s": round(after.ru_stime - before.ru_stime, 1), "output": output}


def parse_pytest(output: str) -> dict:
    """pytest's final counts and its `--durations` table (slowest first)."""
    tail = output[output.rfind("slowest"):] if "slowest" in output else ""
    durations = [{"seconds": float(s), "phase": phase, "test": test} for s, phase, test in DURATION.findall(tail)]
    summary = [ln for ln in output.splitlines() if re.search(r"\d+ (passed|failed)", ln) and " in " in ln]
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
              for n, k in COUNTS.findall(summary[-1])} if summary else {}
    return {"counts": counts, "summary_line": summary[-1].strip("= ") if summary else None,
            "slowest": sorted(durations, key=lambda d: -d["seconds"])[:25]}


def fresh_clone(parent: Path) -> Path:
    """HEAD of this checkout cloned into `parent`/es, `.venv` linked to this checkout's."""
    clone = parent / "es"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()],
        check=True)
    venv = (ROOT / ".venv").resolve()
    (clone / ".venv").symlink_to(venv)
    return clone


def run_target(target: str, parent: Path, warm_kernel: bool = False) -> dict:
    """`make TARGET` in a fresh clone with empty caches; `warm_kernel`: numba's cache is the user's own
    (runtime/core/compiled.py cache_root, content-keyed: what a new clone finds once these kernel sources have
    compiled on the machine, the editing loop's case) instead of an empty folder."""
    clone = fresh_clone(parent / target)
    numba, models = parent / target / "numba", parent / target / "models"
    numba.mkdir()
    models.mkdir()
    env = {**os.environ, "EXPERTSWEEP_CACHE": str(models)}
    if warm_kernel:
        from runtime.core.compiled import cache_root

        env["NUMBA_CACHE_DIR"] = str(cache_root())
    else:
        env["NUMBA_CACHE_DIR"] = str(numba)
    logger.info("make %s in %s", target, clone)
    load_before = os.getloadavg()[0]
    res = measure(["make", "-o", ".venv/.installed", target], clone, env, log=parent / f"{target}.log")
    res["load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]  # a shared machine's other work
    out = res.pop("output")
    res.update(parse_pytest(out))
    res["tail"] = out[-3000:]
    return res


def body(results: dict[str, dict], warm_kernel: bool = False) -> str:
    numba = ("the user's own content-keyed numba cache (the kernel already compiled on this machine: no compile)"
             if warm_kernel else "an empty `NUMBA_CACHE_DIR` (the controller compiles the kernel cold)")
    lines = [f"Each target in a fresh clone of the commit (`.venv` linked, an empty `EXPERTSWEEP_CACHE`, {numba}); "
             "CPU over every process it started (Ray's included).", "",
             "| target | exit | wall s | user CPU s | sys CPU s | passed | skipped | failed | errors | load before, after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t, r in results.items():
        c = r["counts"]
        lines.append(f"| make {t} | {r['rc']} | {r['wall_s']:.0f} | {r['user_s']:.0f} | {r['sys_s']:.0f} | "
                     f"{c.get('passed', 0)} | {c.get('skipped', 0)} | {c.get('failed', 0)} | {c.get('error', 0)} | "
                     f"{r['load_1min'][0]:.1f}, {r['load_1min'][1]:.1f} |")
    for t, r in results.items():
        lines += ["", f"## make {t}: the 25 slowest test phases", "", "| seconds | phase | test |", "|---|---|---|"]
        lines += [f"| {d['seconds']:.1f} | {d['phase']} | {d['test']} |" for d in r["slowest"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["measure"]:  # one command, timed the same way (a module's tests while tuning them)
        cmd = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        if not cmd:
            raise InputError("scripts/suite_time.py measure: no command given")
        become_subreaper()
        res = measure(cmd, Path.cwd(), dict(os.environ))
        print(res.pop("output")[-4000:])
        print(f"suite_time: exit {res['rc']}, wall {res['wall_s']} s, user {res['user_s']} s, sys {res['sys_s']} s, "
              f"CPU {res['user_s'] + res['sys_s']:.1f} s")
        return res["rc"]
    p = ArgumentParser(prog="scripts/suite_time.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="test,check", help="comma-separated make targets (default: test,check)")
    p.add_argument("--keep", action="store_true", help="keep the temporary clones and logs (printed)")
    p.add_argument("--warm-kernel", action="store_true",
                   help="numba's cache: the user's own (no kernel compile, the editing loop) instead of an empty one")
    p.add_argument("--report", default="suite", help="the report's name under reports/ (default: suite)")
    a = p.parse_args(argv)
    targets = [t for t in a.targets.split(",") if t]
    if not targets or not set(targets) <= {"test", "check"}:
        raise InputError(f"scripts/suite_time.py: --targets {a.targets!r}: use test and/or check")
    if not become_subreaper():
        logger.warning("not a subreaper: the CPU time leaves out processes that outlive their parents (Ray's)")
    parent = Path(tempfile.mkdtemp(prefix="suite_time."))
    results = {}
    try:
        for t in targets:
            results[t] = run_target(t, parent, a.warm_kernel)
            r = results[t]
            logger.info("make %s: exit %s, %s s wall, %s + %s s CPU, %s", t, r["rc"], r["wall_s"], r["user_s"],
                        r["sys_s"], r["summary_line"])
    finally:
        if a.keep:
            logger.info("kept %s", parent)
        else:
            shutil.rmtree(parent, ignore_errors=True)
    data = {"commit_measured": git_commit(), "warm_kernel": a.warm_kernel, "targets": {t: {k: v for k, v in r.items() if k != "tail"}
                                                          for t, r in results.items()}}
    title = "Test suite time on a fresh clone" + (", the kernel already compiled" if a.warm_kernel else "")
    path = write_report(a.report, title, data, body(results, a.warm_kernel))
    logger.info("wrote %s", path)
    return 0 if all(r["rc"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    status: list[int] = []
    cli_main(lambda: status.append(main()))
    sys.exit(status[0] if status else 1)
