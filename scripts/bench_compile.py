"""What the compiled kernel costs a process: a cold first compile, then loading it from numba's cache and checking it.

    python scripts/bench_compile.py [--checkout NAME=PATH ...] [--loads 3] [--no-report] [--out FILE.json]

Per checkout (default: this one; a `git archive` of another revision unpacked in a folder times that one), in an
empty numba cache folder (NUMBA_CACHE_DIR, a new temporary folder per checkout): one fresh process runs
`from runtime.core.kernel import warmup; warmup()` (the cold first compile: numba compiles every function the
check and warmup reach, and writes the cache), then `--loads` more fresh processes do the same (each loads the
cache and runs the post-load check, runtime/core/compiled.py `ensure`). Each process reports the seconds of its
`import runtime.core.kernel` and of `warmup()` (perf_counter), its CPU seconds (user + system) to there, and the
fixed cases run once more (`check_again_s`: the check's own cost, everything loaded); the wall of the whole process
(interpreter start included) is timed from here. Then one more process compiles each entry
point on its own in a new empty cache with the check skipped (`compiled._checked`), to show where a cold compile
goes. The machine is shared: each figure is one run, beside whatever else runs (the load average is recorded).

Writes reports/compile_cost.md and .json (runtime.tools.reports.write_report) unless --no-report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# one process: import, warmup(), CPU seconds; printed as the last line (JSON)
PROCESS = """
import json, resource, time
t0 = time.perf_counter()
from runtime.core.kernel import warmup
t1 = time.perf_counter()
warmup()
t2 = time.perf_counter()
from runtime.core.kernel.cache import kernel_signatures
ru = resource.getrusage(resource.RUSAGE_SELF)
from runtime.core import compiled
from runtime.core.units import KERNEL
t3 = time.perf_counter()
compiled.exercise(KERNEL)  # the fixed cases again, everything loaded: what the check itself costs
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "warmup_s": t2 - t1, "cpu_s": ru.ru_utime + ru.ru_stime,
                  "compiled": kernel_signatures()["compiled"], "check_again_s": t4 - t3}))
"""

# one process: each entry point compiled alone (the check skipped), in the order a process meets them
STAGES = """
import json, time
import numpy as np
from runtime.core import compiled
from runtime.core.units import KERNEL
compiled._checked.add(KERNEL.slug)
from runtime.core.kernel import PolicyCache, next_use
from runtime.core.kernel import decide, selfcheck
from runtime.core.policy import PolicyConfig
out = {}
t = time.perf_counter()
next_use(np.zeros((2, 1), np.int32), np.ones(2, np.bool_), 4, 0)
out["next_use"] = time.perf_counter() - t
t = time.perf_counter()
pc = PolicyCache(PolicyConfig(rule="threshold", tau=0.1, beta=0.5), 4, 1, np.array([1]), [np.array([0])])
pc.step(0, np.array([[1], [2]]), np.array([[0.9], [0.1]]))
out["run_layers (both builds)"] = time.perf_counter() - t
t = time.perf_counter()
(getattr(selfcheck, 'decide_exercise', None) or decide.exercise)()  # older checkouts: decide.exercise
out["decide_layer"] = time.perf_counter() - t
print(json.dumps(out))
"""


def _run(code: str, root: Path, cache: Path) -> tuple[dict, float]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"bench_compile: a process under {root} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), wall


def measure(root: Path, loads: int) -> dict:
    """The cold compile, `loads` loading processes and the per-entry-point compile of one checkout."""
    out: dict = {"root": str(root), "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        cold, wall = _run(PROCESS, root, Path(tmp) / "numba")
        out["cold"] = {**cold, "process_wall_s": wall}
        out["loads"] = []
        for _ in range(loads):
            got, wall = _run(PROCESS, root, Path(tmp) / "numba")
            out["loads"].append({**got, "process_wall_s": wall})
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        out["stages"], _ = _run(STAGES, root, Path(tmp) / "numba")
    return out


def body(results: dict[str, dict]) -> str:
    lines = ["A fresh process runs `from runtime.core.kernel import warmup; warmup()`: first on an empty numba cache "
             "(the cold compile), then again on what it wrote (load and post-load check). Seconds; one run each, "
             "on a shared machine (load average at the start in the JSON).", "",
             "| checkout | what | import s | warmup s | CPU s | process wall s | signatures compiled | check again s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        rows = [("cold compile", r["cold"])] + [(f"load {i + 1}", x) for i, x in enumerate(r["loads"])]
        for what, x in rows:
            lines.append(f"| {name} | {what} | {x['import_s']:.2f} | {x['warmup_s']:.2f} | {x['cpu_s']:.2f} | "
                         f"{x['process_wall_s']:.2f} | {x['compiled']} | {x['check_again_s']:.3f} |")
    lines += ["", "Each entry point compiled alone in an empty cache (the post-load check skipped), seconds:", "",
              "| checkout | " + " | ".join(next(iter(results.values()))["stages"]) + " |",
              "|---|" + "---|" * len(next(iter(results.values()))["stages"])]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in r["stages"].values()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from runtime.core.errors import ArgumentParser

    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", action="append", default=[], metavar="NAME=PATH",
                    help="a checkout to measure (repeatable); default: this one, as 'this'")
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    checkouts = dict(c.split("=", 1) for c in a.checkout) or {"this": str(ROOT)}
    results = {name: measure(Path(path).resolve(), a.loads) for name, path in checkouts.items()}
    print(body(results))
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    if not a.no_report:
        from runtime.tools.reports import write_report

        print(write_report("compile_cost", "The compiled kernel's cost per process: cold compile, load and check",
                           results, body(results)))


if __name__ == "__main__":
    main()
