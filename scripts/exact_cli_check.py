"""Engine == emulation from the command line, every preset in its own processes (the exact-equality check).

    python scripts/exact_cli_check.py [--model DIR] [--text FILE] [--max-tokens 4096] [--window 256]
                                      [--capacity-fraction 0.25] [--policies all|P1,P2] [--device cpu]
                                      [--out FILE.json]

For each preset, `python -m runtime.emulate --backend emulation --policy P --json --nll-out A.parquet` and the
same with `--backend engine` run as two SEPARATE processes (fresh interpreters, kernels loaded from numba's
cache: where the in-process test suite could hide a bug, e.g. a state shared between runs); then per preset:
- every integer counter identical, the float masses within 1e-5 relative (the batched and the one-token router
  weights round differently);
- the per-token NLL (the --nll-out files) within `--nll-atol` (default 1e-3) and the perplexities within 1e-4
  relative.
Defaults: the demo model (runtime.tools.tinymodel, `make model`), its eval.txt (4,096 tokens) with its calib.txt
as the warm start. Prints one line per preset and writes the JSON to `--out` after every preset (a cut run
keeps what finished). Exit status 0 when every preset agrees, 1 otherwise.

A preset whose counters differ is then located (`--locate`, on by default): scripts/exact_divergence.py runs it
through both backends once more, in one process, and reports the first token-layer where the model's own
top-k selections part, the router scores of the experts swapped there, and whether the kernel's decisions
agreed on every token-layer before it. `routing near-tie` (the batched and the one-token forward round
the router scores differently and two experts within rounding of each other swap places: the runs compute
different things from there on, no policy or kernel fault) is printed as such; it still fails the check
unless `--accept-near-tie`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(backend: str, policy: str, a: argparse.Namespace, work: Path) -> tuple[dict, list[float], float]:
    """One `python -m runtime.emulate` process: (its --json result, its per-token policy NLL, seconds)."""
    import pyarrow.parquet as pq

    nll = work / f"{policy}.{backend}.parquet"
    cmd = [sys.executable, "-m", "runtime.emulate", "--backend", backend, "--policy", policy, "--model", a.model,
           "--text", a.text, "--max-tokens", str(a.max_tokens), "--window", str(a.window), "--capacity-fraction",
           str(a.capacity_fraction), "--device", a.device, "--json", "--nll-out", str(nll)]
    if a.calib_text:
        cmd += ["--calib-text", a.calib_text]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
    sec = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{backend} {policy}: exit {r.returncode}: {r.stderr.strip()[-600:]}")
    res = json.loads(r.stdout)
    tab = pq.read_table(nll).to_pydict()
    col = next(c for c in tab if c.startswith("nll_") and c != "nll_exact")  # the policy's column (nll_<label>)
    return res, tab[col], sec


def compare(em: dict, en: dict, nll_em: list[float], nll_en: list[float], atol: float) -> dict:
    """The two results of one preset: identical integer counters, masses and perplexity within tolerance."""
    from runtime.core.kernel import FLOAT_COUNTERS, INT_COUNTERS

    ce, cg = ({k: r[k] for k in INT_COUNTERS + FLOAT_COUNTERS} for r in (em, en))  # (to_dict: at the top level)
    ints = {k: (ce[k], cg[k]) for k in INT_COUNTERS if ce[k] != cg[k]}
    floats = {k: (ce[k], cg[k]) for k in FLOAT_COUNTERS if abs(ce[k] - cg[k]) > 1e-5 * max(abs(ce[k]), 1e-9) + 1e-9}
    dn = max((abs(x - y) for x, y in zip(nll_em, nll_en, strict=True)), default=0.0)
    dp = abs(em["perplexity"] - en["perplexity"]) / em["perplexity"]
    problems = ([f"int counters differ {ints}"] if ints else []) + ([f"masses differ {floats}"] if floats else [])
    if len(nll_em) != len(nll_en):
        problems.append(f"NLL lengths {len(nll_em)} vs {len(nll_en)}")
    if dn > atol:
        problems.append(f"NLL max |diff| {dn:.3g} > {atol}")
    if dp > 1e-4:
        problems.append(f"perplexity rel diff {dp:.3g} > 1e-4")
    return {"tokens": en.get("tokens"), "perplexity_emulation": em["perplexity"], "perplexity_engine": en["perplexity"],
            "nll_max_abs_diff": dn, "ppl_rel_diff": dp, "counters": cg,
            "decode_path": (en.get("engine") or {}).get("decode_path"), "problems": problems}


def locate(policy: str, a: argparse.Namespace, work: Path) -> dict:
    """scripts/exact_divergence.py on one preset (its own process): where and why the two backends part."""
    js = work / f"{policy}.divergence.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "exact_divergence.py"), "--policy", policy, "--model", a.model,
           "--text", a.text, "--max-tokens", str(a.max_tokens), "--window", str(a.window), "--capacity-fraction",
           str(a.capacity_fraction), "--device", a.device, "--out", str(js)]
    if a.calib_text:
        cmd += ["--calib-text", a.calib_text]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2 * a.timeout)
    if not js.is_file():
        return {"verdict": f"not located: exit {r.returncode}: {r.stderr.strip()[-400:]}"}
    return json.loads(js.read_text())


def where(row: dict) -> str:
    """The located divergence of a differing preset, in words."""
    d = row.get("divergence")
    if not d:
        return f" (layers {row.get('layers_differ')})" if row.get("layers_differ") else ""
    f = d.get("first_selection_diff")
    if d["verdict"] != "routing near-tie" or not f:
        return f" -- located: {d['verdict']} (first decision difference {d.get('first_decision_diff')})"
    return (f" -- located: ROUTING NEAR-TIE at token {f['token']} (window {f['window']}, position {f['position']}), "
            f"MoE layer {f['layer']}: the model selects {f['emulation_only']} in the emulation, {f['engine_only']} in "
            f"the engine, score gap {f['gap']:.3g} (emulation {f['scores_emulation']}, engine {f['scores_engine']}); "
            f"router scores before it within {d['score_diff_before']:.2g}; decisions identical before it")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--text", default=None, help="evaluation text (default: the model folder's eval.txt)")
    p.add_argument("--calib-text", default=None, help="warm-start text (default: the model folder's calib.txt)")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--capacity-fraction", type=float, default=0.25)
    p.add_argument("--policies", default="all", help="all, or comma-separated presets")
    p.add_argument("--device", default="cpu")
    p.add_argument("--nll-atol", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    p.add_argument("--out", default=None)
    p.add_argument("--locate", action=argparse.BooleanOptionalAction, default=True,
                   help="on a counter difference, find where and why the runs part (scripts/exact_divergence.py)")
    p.add_argument("--accept-near-tie", action="store_true",
                   help="a difference located at a routing near-tie (decisions identical before it) passes")
    a = p.parse_args(argv)
    from runtime.core.kernel import INT_COUNTERS
    from runtime.core.policy import PRESETS

    if a.model is None:
        from runtime.tools.tinymodel import model_dir

        a.model = str(model_dir("demo"))
        if not Path(a.model).is_dir():
            print(f"exact_cli_check: no demo model at {a.model}: build it with `make model`", file=sys.stderr)
            return 2
    a.text = a.text or str(Path(a.model) / "eval.txt")
    if a.calib_text is None and (Path(a.model) / "calib.txt").is_file():
        a.calib_text = str(Path(a.model) / "calib.txt")
    names = list(PRESETS) if a.policies == "all" else a.policies.split(",")  # all: every preset
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out: dict = {"command": " ".join(["scripts/exact_cli_check.py", *(sys.argv[1:] if argv is None else argv)]),
                 "commit": commit, "model": a.model, "text": a.text, "max_tokens": a.max_tokens, "window": a.window,
                 "capacity_fraction": a.capacity_fraction, "device": a.device, "policies": {}, "finished": False}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                em, nll_em, s_em = run_cli("emulation", name, a, Path(tmp))
                en, nll_en, s_en = run_cli("engine", name, a, Path(tmp))
                row = {**compare(em, en, nll_em, nll_en, a.nll_atol), "seconds": {"emulation": s_em, "engine": s_en}}
                row["layers_differ"] = [i for i, (x, y) in enumerate(zip(em["per_layer"], en["per_layer"], strict=True))
                                        if {c: x[c] for c in INT_COUNTERS} != {c: y[c] for c in INT_COUNTERS}]
                if row["problems"] and a.locate:
                    row["divergence"] = locate(name, a, Path(tmp))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                row = {"problems": [str(exc)[:800]]}
            out["policies"][name] = row
            tie = (row.get("divergence") or {}).get("verdict") == "routing near-tie"
            ok &= not row["problems"] or (tie and a.accept_near_tie)
            print(f"{name:17s} " + ("identical counters, NLL max |diff| "
                                    f"{row['nll_max_abs_diff']:.2e}, ppl {row['perplexity_engine']:.4f} "
                                    f"[{row['decode_path']}]" if not row["problems"] else
                                    "DIFFERS: " + "; ".join(row["problems"]) + where(row)), flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    out["finished"], out["ok"] = True, ok
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print("exact CLI check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
