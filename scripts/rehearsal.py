"""Rehearsal at Qwen3-Next's routing shape: every stage on the next-shape model beside the demo model.

    python scripts/rehearsal.py [--models demo,next-shape] [--tokens 2048] [--trials 200]
                                [--engine-tokens 512] [--out-md FILE] [--out-json FILE]

For each model (runtime.tools.tinymodel: `next-shape` = 48 MoE layers, 512 experts, top-10, a shared
expert, tiny hidden size), each stage runs in its own process, timed (wall clock) with its peak
resident memory (the child's ru_maxrss):

- `build`: the model (if not cached yet: ensure_model);
- `record@64`, `record@512`: router traces of `--tokens` tokens of its eval.txt at ranking depth
  64 and 512 (capped at E) -> trace bytes per token;
- `simulate`: Quality-First replayed on the depth-E trace (recorded routing, not synthetic) at
  25% residency -> simulator token-layers per second (kernel loop only, and whole command);
- `emulate`: exact emulation of `--tokens` tokens under Quality-First -> its time against the
  plain forward of the same windows (no cache, no recorder; both after a warm-up in one process;
  target: within 1.25x);
- `sweep`: sweep/pareto.py with `--trials` simulator trials on one host over the depth-64 trace
  (embedded Ray, no emulation ladder);
- `engine`: the offloading engine in CPU device mode decoding `--engine-tokens` tokens under
  Quality-First -> time per token.

Prints a Markdown table (reports/rehearsal_next_shape.md) and writes the JSON with --out-json.
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

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def run_stage(cmd: list[str], env: dict[str, str], timeout: float) -> dict:
    """Run one stage as a child process: wall seconds, peak RSS (MiB), exit code, stdout."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, ru = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    return {"cmd": " ".join(cmd), "seconds": round(wall, 2), "peak_rss_mib": round(ru.ru_maxrss / 1024, 1),
            "rc": proc.returncode, "stdout": stdout, "stderr_tail": stderr[-1500:]}


def _json_tail(text: str) -> dict:
    """The last JSON object printed by a command."""
    start = text.find("{")
    return json.loads(text[start:]) if start >= 0 else {}


SWEEP_YAML = """name: rehearsal-{name}
trace: {trace}
hosts: [rtx4090]
trials: {trials}
sampler: tpe
seed: 0
objectives: [time_per_token_s, mass_per_token]
batch: auto
emulation: false
space:
  rule: {{choices: [threshold, first_choice, substitute_all, fetch_all]}}
  tau: {{low: 0.02, high: 0.6, log: true}}
  evict: {{choices: [lfu, lru, crf]}}
  gamma: {{low: 0.9, high: 1.0}}
  half_life: {{low: 4, high: 256, log: true}}
  beta: {{low: 0.1, high: 2.0, log: true, off: true}}
  admission_delay: {{low: 1, high: 4}}
  capacity_fraction: 0.25
"""


def rehearse(name: str, a: argparse.Namespace, work: Path, results: list[dict], save=lambda: None) -> dict:
    """Every stage on one model; its result is appended to `results` first and saved after each stage."""
    from runtime.tools.tinymodel import SPECS, is_complete, model_dir

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    spec = SPECS[name]
    E = spec.num_experts
    res: dict = {"model": name, "layers": spec.num_layers, "experts": E, "top_k": spec.num_experts_per_tok,
                 "tokens": a.tokens, "stages": {}}
    st = _Stages(save)
    res["stages"] = st
    results.append(res)
    path = model_dir(name)
    cached = is_complete(path)
    st["build"] = run_stage([PY, "-m", "runtime.tools.tinymodel", "--size", name, "--quiet"], env, a.timeout)
    st["build"]["cached"] = cached
    if st["build"]["rc"]:
        return res
    text = path / "eval.txt"
    traces = {}
    for depth in sorted({min(64, E), min(512, E)}):
        out = work / f"{name}-d{depth}.parquet"
        st[f"record@{depth}"] = r = run_stage(
            [PY, "-m", "runtime.record", "--model", str(path), "--text", str(text), "--out", str(out),
             "--depth", str(depth), "--max-tokens", str(a.tokens)], env, a.timeout)
        if r["rc"] == 0:
            r["trace_bytes"] = out.stat().st_size
            r["trace_bytes_per_token"] = out.stat().st_size / a.tokens
            traces[depth] = out
    full = traces.get(min(512, E))
    if full is not None:
        st["simulate"] = r = run_stage(
            [PY, "-m", "runtime.simulate", "--trace", str(full), "--policy", "quality-first",
             "--capacity-fraction", "0.25", "--initial-residency", "held-out", "--json"], env, a.timeout)
        if r["rc"] == 0:
            j = _json_tail(r["stdout"])
            r["token_layers_per_s"] = j.get("token_layers_per_second")
            r["replay_seconds"] = j.get("replay_seconds")
            r["token_layers"] = j.get("tokens", 0) * spec.num_layers
    st["emulate"] = r = run_stage([PY, str(Path(__file__).resolve()), "--forward-ratio", str(path), str(text),
                                   str(a.tokens)], env, a.timeout)
    if r["rc"] == 0:
        r.update(_json_tail(r["stdout"]))
    sweep_trace = traces.get(min(64, E))
    if sweep_trace is not None and a.trials > 0:
        cfg = work / f"{name}-sweep.yaml"
        cfg.write_text(SWEEP_YAML.format(name=name, trace=sweep_trace, trials=a.trials))
        st["sweep"] = r = run_stage(
            [PY, "sweep/pareto.py", "--config", str(cfg), "--out", str(work / f"{name}-sweep"),
             "--ray-address", "local", "--num-cpus", "2", "--no-emulation",
             "--mlflow-uri", f"sqlite:///{work / f'{name}-mlflow.db'}"], env, a.timeout)
        r["trials"] = a.trials
    st["engine"] = r = run_stage(
        [PY, "-m", "runtime.emulate", "--backend", "engine", "--device", "cpu", "--model", str(path), "--text",
         str(text), "--policy", "quality-first", "--capacity-fraction", "0.25", "--max-tokens",
         str(a.engine_tokens), "--window", str(min(a.engine_tokens, spec.seq_len)), "--json"], env, a.timeout)
    if r["rc"] == 0:
        r["time_per_token_s"] = _json_tail(r["stdout"]).get("time_per_token_s")
    return res


class _Stages(dict):
    """Stage results; each new stage is saved at once (a partial rehearsal keeps what ran)."""

    def __init__(self, save) -> None:
        super().__init__()
        self._save = save

    def __setitem__(self, key: str, value: dict) -> None:
        super().__setitem__(key, value)
        self._save()


def forward_ratio(model: str, text: str, tokens: int) -> dict:
    """The emulation's Quality-First pass against the plain forward (no cache, no recorder) of the same
    windows, both timed after a warm-up in one process (best of two plain forwards)."""
    from runtime.backends import emulate, hfmodel
    from runtime.core.kernel import warmup
    from runtime.core.policy import PRESETS
    from runtime.core.spec import RunSpec

    m = hfmodel.load(model)
    warmup()
    spec = RunSpec(policy=PRESETS["quality-first"], capacity_fraction=0.25, model=model, text=text,
                   max_tokens=tokens)
    ex = emulate.exact_pass(m, spec)  # tokenizes, calibrates, and warms the model up
    plain = []
    for _ in range(2):
        t0 = time.perf_counter()
        hfmodel.run_stream(m, ex.windows, spec.batch_windows)
        plain.append(time.perf_counter() - t0)
    res = emulate.evaluate_group(m, [spec])[0]
    pol = float(res.extra["seconds"])
    return {"plain_forward_s": min(plain), "policy_s": pol, "ratio_vs_forward": pol / min(plain),
            "substituted_call_fraction": res.to_dict()["substituted_call_fraction"],
            "fetches_per_token": res.counters["fetches"] / res.tokens}


def _cell(s: dict | None) -> str:
    if s is None:
        return "-"
    if s["rc"]:
        return f"failed (rc {s['rc']})"
    extra = " (cached)" if s.get("cached") else ""
    return f"{s['seconds']:.1f} s, {s['peak_rss_mib']:.0f} MiB{extra}"


def _figure(name: str, s: dict | None) -> str:
    if s is None or s["rc"]:
        return ""
    if name.startswith("record") and "trace_bytes_per_token" in s:
        return f"{s['trace_bytes_per_token'] / 1024:.1f} KiB/token"
    if name == "simulate" and s.get("token_layers_per_s"):
        return f"{s['token_layers_per_s'] / 1e6:.2f} M token-layers/s (kernel)"
    if name == "emulate" and s.get("ratio_vs_forward"):
        return (f"{s['ratio_vs_forward']:.2f}x the plain forward ({s['policy_s']:.1f} s vs {s['plain_forward_s']:.1f} s; "
                f"{s['substituted_call_fraction'] * 100:.1f}% substituted, {s['fetches_per_token']:.1f} fetches/token)")
    if name == "sweep":
        return f"{s['trials']} trials"
    if name == "engine" and s.get("time_per_token_s"):
        return f"{s['time_per_token_s'] * 1e3:.1f} ms/token"
    return ""


def table(results: list[dict]) -> str:
    stages = ["build", "record@64", "record@512", "simulate", "emulate", "sweep", "engine"]
    head = "| stage | " + " | ".join(
        f"{r['model']} ({r['layers']} x {r['experts']} experts, top-{r['top_k']})" for r in results) + " |"
    lines = [head, "|---|" + "---|" * len(results)]
    for stg in stages:
        cells = []
        for r in results:
            s = r["stages"].get(stg)
            if s is None and stg == "record@512" and r["experts"] <= 64:
                s = r["stages"].get("record@64")  # depth capped at E: the same trace
            fig = _figure(stg, s)
            cells.append(_cell(s) + (f"; {fig}" if fig else ""))
        lines.append(f"| {stg} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python scripts/rehearsal.py", description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--models", default="demo,next-shape")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--engine-tokens", type=int, default=512)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per stage")
    p.add_argument("--out-md", default=None)
    p.add_argument("--out-json", default=None)
    p.add_argument("--forward-ratio", nargs=3, metavar=("MODEL", "TEXT", "TOKENS"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.forward_ratio:
        model, text, tokens = a.forward_ratio
        print(json.dumps(forward_ratio(model, text, int(tokens))))
        return
    results: list[dict] = []

    def save() -> None:
        if a.out_json:
            clean = [{**r, "stages": {k: {f: v for f, v in s.items() if f != "stdout"} for k, s in r["stages"].items()}}
                     for r in results]
            Path(a.out_json).write_text(json.dumps(clean, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="rehearsal-") as work:
        for name in a.models.split(","):
            rehearse(name, a, Path(work), results, save)
            save()
            print(f"{name}: done", file=sys.stderr, flush=True)
    md = table(results)
    if a.out_md:
        Path(a.out_md).write_text(md)
    print(md)


if __name__ == "__main__":
    main()
