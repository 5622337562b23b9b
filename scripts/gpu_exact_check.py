"""Exactness checks of scripts/gpu_checks.sh that compare a device run with a reference run.

    python scripts/gpu_exact_check.py stream --device cuda|cpu --work DIR --out FILE.json [--layers 4 ...]
    python scripts/gpu_exact_check.py fetch-exact --device cuda|cpu --model DIR --out FILE.json [--tokens 256]

`stream`: writes a small random bf16 checkpoint on the spot (scripts/bigmodel.py write: per-expert
tensors, a shared expert, 4 layers), then runs the user's commands in their own processes (1-3 side by
side, then the two recordings side by side: each is mostly a process's fixed cost at these sizes):
1. `python -m runtime.emulate ... --device D --max-memory 0.001` with the device budget capped
   ($EXPERTSWEEP_DEVICE_MEMORY_GIB, so every layer is streamed through the device, stream.LayerPipe),
2. the same with the model resident on the device (no cap; on CPU device mode: the in-memory run),
3. the same on the host without `--device` (the CPU reference),
4. `python -m runtime.record ... --device D --max-memory 0.001` (streamed) and the CPU recording,
all in fp32 (the bf16 checkpoint upcast; TF32 is off by default for matmuls in PyTorch). Pass:
streamed == resident on the device (counters identical, per-token NLL within 1e-5); against the CPU
the exact model's NLL within 1e-3 and the recorded top-k ids agreeing on at least 99.9% of the
token-layer-slots (a random model has near ties that fp32 rounding on another device may flip).

`fetch-exact`: the engine in the checkpoint's dtype (bf16) on the device: fetch-every-miss at 25%
of the experts and at E - 1 slots (nearly every expert resident) compute the same experts with the
same weights, so their per-token NLLs must be bit-identical: a fetched copy that is read before it
has landed (a missing stream or event wait) would change them. The engine runs without its debug sync
after every layer (which would hide such a race), and two more runs exercise the background copies:
fetch-every-miss with lookahead prefetch (its prefetched experts are the same weights: bit-identical to
the 25% run) and "admissions": rule-0.15 with admission at beta 0.05 (quality-first's rule; beta 0.5 may
make no admission in the dry run's 64 tokens), bit-identical to the same run with the debug sync on,
counters equal. Each run must have moved something (fetches, prefetch and admission copies),
so the check cannot pass vacuously. Also reported, not judged: the
NLL difference to the engine's exact pass (prefill, batched: other kernels, other rounding).

Both print one progress line per stage to stderr as it happens (`[check +SECONDS] ...`: model written or
loaded, each run started and finished with its seconds, each comparison), so a run cut by its step's
timeout says where it was. Prints one JSON object and writes it to --out (atomically); exit status 0 when
the check passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_T0 = time.perf_counter()
_CHECK = ["check"]  # the check's name, for the progress lines
_OUT: list = [None]  # the results file, rewritten at every stage
_STAGES: list[str] = []  # the progress lines so far


def write_json(path, rec: dict) -> None:
    """`rec` to `path` atomically (a reader never sees half a file)."""
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=2) + "\n")
    tmp.replace(path)


def say(msg: str) -> None:
    """One progress line on stderr, at once: `[CHECK +SECONDS since start] msg`; the results file gets the lines so
    far ({"ok": false, "finished": false, "stages": [...]}), so a check cut by its timeout keeps what finished."""
    line = f"[{_CHECK[0]} +{time.perf_counter() - _T0:.1f}s] {msg}"
    print(line, file=sys.stderr, flush=True)
    _STAGES.append(line)
    if _OUT[0]:
        write_json(_OUT[0], {"check": _CHECK[0], "ok": False, "finished": False, "stages": _STAGES})


def _run_all(jobs: list[tuple[str, list[str], dict]]) -> dict[str, tuple[float, str]]:
    """Run independent commands (stages) at once, each its own process: {name: (seconds, stdout)}, each start
    and end (with its seconds) said as a progress line. Their fixed costs (interpreter, torch, the model)
    dominate at these sizes, so side by side they take about the longest one's time, not the sum (the device
    machine has 16 cores). A command that fails raises naming it, after the others ended."""
    procs = {}
    for name, cmd, env in jobs:
        say(f"{name}: started")
        fo, fe = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")  # (pipes could fill up)
        procs[name] = (time.perf_counter(), subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, text=True,
                                                             stdout=fo, stderr=fe), fo, fe)
    out, failed = {}, []
    while len(out) < len(procs):  # each one's end said when it ends
        for name, (t0, proc, fo, fe) in procs.items():
            if name in out or proc.poll() is None:
                continue
            sec = time.perf_counter() - t0
            fo.seek(0)
            fe.seek(0)
            stdout, stderr = fo.read(), fe.read()
            fo.close()
            fe.close()
            sys.stderr.write(stderr[-2000:])
            if proc.returncode != 0:
                failed.append(f"{name} exited {proc.returncode}: {stderr.strip().splitlines()[-3:]}")
                say(f"{name}: FAILED after {sec:.1f} s")
            else:
                say(f"{name}: finished in {sec:.1f} s")
            out[name] = (sec, stdout)
        time.sleep(0.1)
    if failed:
        raise RuntimeError("; ".join(failed))
    return out


def _run(cmd: list[str], env: dict | None = None, what: str = "") -> tuple[float, str]:
    """Run one command (a stage), its start and its end (seconds) said as progress lines."""
    what = what or " ".join(cmd[1:4])
    return _run_all([(what, cmd, env or {})])[what]


def stream_check(a: argparse.Namespace) -> dict:
    import pyarrow.parquet as pq

    from runtime.formats.trace import load_trace

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "stream_model"
    if not (model / "config.json").is_file():
        _run([sys.executable, "scripts/bigmodel.py", "write", "--out", str(model), "--layers", str(a.layers), "--hidden",
              str(a.hidden), "--experts", str(a.experts), "--moe-intermediate", str(a.moe_intermediate), "--top-k",
              str(a.top_k), "--shared", str(a.moe_intermediate), "--vocab", "1024", "--shard-gb", "0.05"],
             what="write the checkpoint (scripts/bigmodel.py)")
    else:
        say(f"checkpoint {model} already written")
    text = ROOT / "tests" / "data" / "kernel_source.txt"
    emu = [sys.executable, "-m", "runtime.emulate", "--model", str(model), "--text", str(text), "--policy", "rule-0.15",
           "--policy", "substitute-all", "--capacity-fraction", "0.25", "--max-tokens", str(a.tokens), "--window", "128",
           "--calib-max-tokens", str(a.tokens), "--dtype", "fp32", "--json"]
    cap = {"EXPERTSWEEP_DEVICE_MEMORY_GIB": "0.000001"}
    runs = {"streamed": (["--device", a.device, "--max-memory", "0.001"], cap),
            "resident": (["--device", a.device], {}), "cpu": ([], {})}
    if a.device == "cpu":  # CPU device mode: the resident run is the in-memory CPU run itself
        del runs["cpu"]
    out: dict = {"check": "stream", "device": a.device, "model": str(model), "tokens": a.tokens, "seconds": {}}
    res, nll = {}, {}
    jobs = []
    for name, (flags, env) in runs.items():
        path = work / f"nll-{name}.parquet"
        path.unlink(missing_ok=True)
        jobs.append((f"emulate {name} ({a.tokens} tokens)", [*emu, *flags, "--nll-out", str(path)], env))
    done = _run_all(jobs)  # the runs side by side (independent processes)
    for name, (what, _, _) in zip(runs, jobs, strict=True):
        out["seconds"][f"emulate-{name}"], stdout = done[what]
        res[name] = json.loads(stdout)
        nll[name] = pq.read_table(work / f"nll-{name}.parquet").to_pandas()
    if "cpu" not in runs:
        res["cpu"], nll["cpu"] = res["resident"], nll["resident"]
    cols = [c for c in nll["streamed"].columns if c.startswith("nll_")]
    counters = ("hits", "fetches", "substitutions", "drops", "admissions")
    out["streamed_vs_resident"] = {
        "counters_equal": all(res["streamed"][p][c] == res["resident"][p][c] for p in ("rule-0.15", "substitute-all")
                              for c in counters),
        "nll_max_abs_diff": max(float(np.abs(nll["streamed"][c] - nll["resident"][c]).max()) for c in cols),
        "streamed": [res["streamed"][p]["streamed"] for p in ("rule-0.15", "substitute-all")],
    }
    say(f"compare streamed vs resident: {out['streamed_vs_resident']}")
    out["device_vs_cpu"] = {
        "exact_nll_max_abs_diff": float(np.abs(nll["streamed"]["nll_exact"] - nll["cpu"]["nll_exact"]).max()),
        "ppl_change_pct": {p: [res[r][p]["ppl_change_pct"] for r in ("streamed", "cpu")] for p in ("rule-0.15", "substitute-all")},
        "fetches": {p: [res[r][p]["fetches"] for r in ("streamed", "cpu")] for p in ("rule-0.15", "substitute-all")},
    }
    say(f"compare device vs cpu: exact NLL max |diff| {out['device_vs_cpu']['exact_nll_max_abs_diff']:.3g}")
    rec = [sys.executable, "-m", "runtime.record", "--model", str(model), "--text", str(text), "--max-tokens",
           str(a.tokens), "--window", "128", "--dtype", "fp32", "--depth", str(a.top_k * 2)]
    traces, jobs = {}, []
    for name, flags, env in (("streamed", ["--device", a.device, "--max-memory", "0.001"], cap), ("cpu", [], {})):
        path = work / f"trace-{name}.parquet"
        path.unlink(missing_ok=True)
        jobs.append((f"record {name} ({a.tokens} tokens)", [*rec, *flags, "--out", str(path)], env))
    done = _run_all(jobs)
    for name, (what, _, _) in zip(("streamed", "cpu"), jobs, strict=True):
        out["seconds"][f"record-{name}"] = done[what][0]
        traces[name] = load_trace(work / f"trace-{name}.parquet")
    ids_a, ids_b = traces["streamed"].topk_ids, traces["cpu"].topk_ids
    out["record_vs_cpu"] = {"topk_ids_agreement": float((ids_a == ids_b).mean()), "rows": int(ids_a.shape[0])}
    say(f"compare recorded top-k ids vs cpu: agreement {out['record_vs_cpu']['topk_ids_agreement']:.4f}")
    sv, dv = out["streamed_vs_resident"], out["device_vs_cpu"]
    out["ok"] = bool(sv["counters_equal"] and sv["nll_max_abs_diff"] <= 1e-5 and all(sv["streamed"])
                     and dv["exact_nll_max_abs_diff"] <= 1e-3 and out["record_vs_cpu"]["topk_ids_agreement"] >= 0.999)
    return out


def fetch_exact(a: argparse.Namespace) -> dict:
    import torch

    from runtime.backends import hfmodel
    from runtime.backends.engine import load_engine
    from runtime.core.kernel import warm_residency
    from runtime.core.policy import PRESETS, PolicyConfig, resolve_capacities

    say(f"loading the engine on {a.device}: {a.model}")
    eng = load_engine(a.model, a.device)
    m = eng.m
    say(f"model loaded: {m.num_layers} layers, {m.E} experts, top-{m.k}")
    try:
        W = 64
        windows, _ = hfmodel.tokenize_file(m, Path(a.model) / "eval.txt", a.tokens, W)
        cids, _ = hfmodel.calibration_ids(m, None, 2 * a.tokens, W)  # the warm start (calib.txt beside the model)
        runs = {}
        quarter = resolve_capacities(None, m.num_layers, m.E, m.k, 0.25)
        warm = warm_residency(cids, None, m.E, quarter)

        def run(name, policy, caps, residency):
            say(f"run {name}: started ({int(windows.size)} tokens)")
            t0 = time.perf_counter()
            runs[name] = eng.evaluate(windows, policy, caps, residency)
            c = runs[name]["counters"]
            say(f"run {name}: finished in {time.perf_counter() - t0:.1f} s (fetches {c.get('fetches')}, "
                f"admissions {c.get('admissions')}, prefetches {c.get('prefetches')})")

        for name, frac_or_cap in (("quarter", 0.25), ("E-1", m.E - 1)):
            caps = quarter if isinstance(frac_or_cap, float) else np.full(m.num_layers, frac_or_cap)
            run(name, PRESETS["fetch-every-miss"], caps, warm_residency(cids, None, m.E, caps))
        # background copies without the debug sync per layer: prefetches (lookahead), then admissions, whose
        # reference is the same run with a sync after every layer (eng.runner.debug)
        run("lookahead", PolicyConfig(rule="fetch_all", prefetch="lookahead"), quarter, warm)
        # quality-first's rule at a low beta: it admits within the dry run's 64 tokens as well (beta 0.5 may not)
        adm = dataclasses.replace(PRESETS["quality-first"], beta=0.05)
        run("admissions", adm, quarter, warm)
        eng.runner.debug = True
        try:
            run("admissions, debug", adm, quarter, warm)
        finally:
            eng.runner.debug = False
        say("exact pass: started")
        t0 = time.perf_counter()
        exact = hfmodel.run_lanes(m, windows, [hfmodel.Lane(desc="exact")])[0]  # the engine's exact (prefill) pass
        say(f"exact pass: finished in {time.perf_counter() - t0:.1f} s")
    finally:
        eng.close()
    rec = fetch_exact_record(runs, exact, eng, int(windows.size), torch.cuda.is_available())
    for label, v in rec["pairs"].items():
        say(f"compare {label}: bit-identical {v['bit_identical']}, NLL max |diff| {v['nll_max_abs_diff']:.3g}, "
            f"counters equal {v['counters_equal']}")
    say(f"copies moved: {rec['copies']}")
    return rec


def fetch_exact_record(runs: dict, exact: np.ndarray, eng, tokens: int, cuda: bool) -> dict:
    """The fetch-exact verdict: every pair that must be bit-identical, with its largest NLL difference."""
    pairs = {"E-1 vs quarter": ("E-1", "quarter"), "lookahead vs quarter": ("lookahead", "quarter"),
             "admissions vs their debug run": ("admissions", "admissions, debug")}
    same = {}
    for label, (a, b) in pairs.items():
        x, y = runs[a]["nll"], runs[b]["nll"]
        same[label] = {"bit_identical": bool(np.array_equal(x, y)), "nll_max_abs_diff": float(np.abs(x - y).max()),
                       "counters_equal": runs[a]["counters"] == runs[b]["counters"] if "debug" in b else None}
    adm = runs["admissions"]
    moved = {"fetches": int(runs["quarter"]["counters"]["fetches"]),
             "prefetch_copies": int(runs["lookahead"]["engine"].get("prefetch_copies", 0)),
             "admission_copies": int(adm["engine"].get("admission_copies", 0))}
    a_ = runs["quarter"]["nll"]
    ok = (all(v["bit_identical"] and v["counters_equal"] is not False for v in same.values())
          and all(v > 0 for v in moved.values()))
    return {"check": "fetch-exact", "device": str(eng.device), "dtype": str(eng.dtype).removeprefix("torch."),
            "tokens": tokens, "copies": moved, "pairs": same,
            "nll_bit_identical": same["E-1 vs quarter"]["bit_identical"],
            "nll_max_abs_diff": same["E-1 vs quarter"]["nll_max_abs_diff"],
            "vs_exact_pass_nll_max_abs_diff": float(np.abs(a_ - exact).max()),
            "vs_exact_pass_ppl_change_pct": float(np.expm1(a_.mean() - exact.mean()) * 100),
            "cuda": cuda, "ok": bool(ok)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("check", choices=["stream", "fetch-exact"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", default="/tmp/expertsweep-exact")
    p.add_argument("--model", default=None, help="fetch-exact: the checkpoint (the bench's)")
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--top-k", type=int, default=4)
    a = p.parse_args(argv)
    _CHECK[0] = a.check
    _OUT[0] = a.out
    say(f"started: {' '.join(sys.argv[1:] if argv is None else argv)}")
    try:
        rec = stream_check(a) if a.check == "stream" else fetch_exact(a)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the summary shows what failed (SIGINT: the step's timeout)
        rec = {"check": a.check, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    rec = {**rec, "finished": True, "stages": _STAGES}
    print(json.dumps(rec, indent=2))
    write_json(a.out, rec)
    return 0 if rec.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
