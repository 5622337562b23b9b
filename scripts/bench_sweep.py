"""Sweep benchmark: simulator trials per hour and the Ray + MLflow overhead, on an embedded Ray.

Runs `sweep/pareto.py` in this process (search_spaces/bench.yaml: the demo model's trace, two
simulated hosts, NSGA-II, no re-measurement) with MLflow on SQLite in the output folder, while
a thread samples the CPU time of this process and every process under it (Ray's GCS, raylet,
workers) from /proc. Reports:

- trials/hour: simulator trials recorded per hour of sweep wall time (Tuner.fit);
- simulator CPU: the workers' CPU time inside the simulator (`eval_cpu_seconds` of each trial);
- overhead, wall: `1 - simulator wall / (sweep wall x slots)`: the share of the trial slots'
  time not spent simulating (it also counts other users of a shared machine);
- overhead, CPU: everything else the sweep burnt (Tune, Optuna, Ray's daemons and workers
  outside the simulator, MLflow writes) relative to the simulator CPU, during the sweep
  (Tuner.fit) and over the whole run (with start-up, imports and the report).

    python scripts/bench_sweep.py [--trials 600] [--trace FILE] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TICK = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (ppid, cpu seconds, command line) for every process."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        try:
            name = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        name = name or stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat[stat.rindex(")") + 2:].split()
        out[int(d)] = (int(f[1]), (int(f[11]) + int(f[12])) / TICK, name)
    return out


class CpuSampler(threading.Thread):
    """Keeps the last CPU time seen of every descendant of this process (they may exit)."""

    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.period = period
        self.seen: dict[int, tuple[float, str]] = {}
        self.history: list[tuple[float, dict[int, float]]] = []
        self.stop_flag = threading.Event()

    def sample(self) -> None:
        table = _proc_table()
        me = os.getpid()
        kids: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            kids.setdefault(ppid, []).append(pid)
        todo = [me]
        while todo:
            pid = todo.pop()
            if pid in table:
                self.seen[pid] = (table[pid][1], table[pid][2])
            todo += kids.get(pid, [])
        self.history.append((time.time(), {pid: cpu for pid, (cpu, _) in self.seen.items()}))

    def run(self) -> None:
        while not self.stop_flag.wait(self.period):
            self.sample()

    @staticmethod
    def _grouped(cpu_by_pid: dict[int, float], trial_pids: set[int]) -> dict[str, float]:
        """CPU seconds of this driver, the trial workers (`trial_pids`), and all other Ray processes."""
        me = os.getpid()
        out = {"driver": 0.0, "trial_workers": 0.0, "other_ray": 0.0}
        for pid, cpu in cpu_by_pid.items():
            out["driver" if pid == me else "trial_workers" if pid in trial_pids else "other_ray"] += cpu
        return out

    def totals(self, trial_pids: set[int]) -> dict[str, float]:
        return self._grouped({pid: cpu for pid, (cpu, _) in self.seen.items()}, trial_pids)

    def window(self, t0: float, t1: float, trial_pids: set[int]) -> dict[str, float]:
        """CPU seconds per group spent between wall times t0 and t1 (nearest samples)."""
        before = max((h for h in self.history if h[0] <= t0), key=lambda h: h[0], default=self.history[0])[1]
        after = min((h for h in self.history if h[0] >= t1), key=lambda h: h[0], default=self.history[-1])[1]
        return self._grouped({pid: cpu - before.get(pid, 0.0) for pid, cpu in after.items()}, trial_pids)

    def top(self, n: int = 8) -> list[tuple[float, str]]:
        return sorted(((cpu, name[:90]) for cpu, name in self.seen.values()), reverse=True)[:n]


def wall_gaps(rows: list[dict], t0: float, t1: float, slots: int) -> dict[str, float]:
    """Where the trial slots' wall time outside the simulator went, from each worker's rows
    (`finished_at`, `eval_seconds`), in slot-seconds: before a worker's first trial (process and
    actor start, imports, trace load), between its trials (reporting to the driver, Tune trial
    turnover), after its last trial (the tail: waiting for the other slots), and slots that never
    ran a trial."""
    by_pid: dict[int, list[tuple[float, float]]] = {}
    for r in rows:
        by_pid.setdefault(r["pid"], []).append((r["finished_at"] - r["eval_seconds"], r["finished_at"]))
    out = {"start": 0.0, "between_trials": 0.0, "tail": 0.0, "idle_slots": max(0, slots - len(by_pid)) * (t1 - t0)}
    for spans in by_pid.values():
        spans.sort()
        out["start"] += max(0.0, spans[0][0] - t0)
        out["between_trials"] += sum(max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:], strict=False))
        out["tail"] += max(0.0, t1 - spans[-1][1])
    out["total_slot_seconds"] = slots * (t1 - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--config", default=str(ROOT / "search_spaces" / "bench.yaml"))
    ap.add_argument("--trials", type=int, default=600, help="simulator trials per host")
    ap.add_argument("--trace", help="a trace file instead of the demo model's")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_sweep"),
                    help="output folder (default results/bench_sweep; its recorded traces are reused)")
    ap.add_argument("--markdown", action="store_true", help="print the rows as Markdown (reports/sweep_overhead.md)")
    a = ap.parse_args()

    from sweep.pareto import run

    out = Path(a.out)
    argv = ["--config", a.config, "--out", str(out), "--trials", str(a.trials), "--ray-address", "local",
            "--mlflow-uri", f"sqlite:///{out / 'mlflow.db'}", "--no-emulation"]
    if a.trace:
        argv += ["--trace", a.trace]
    sampler = CpuSampler()
    sampler.sample()
    base = {pid: cpu for pid, (cpu, _) in sampler.seen.items()}
    sampler.start()
    load0 = os.getloadavg()[0]
    res = run(argv)
    sampler.stop_flag.set()
    sampler.join()
    load1 = os.getloadavg()[0]
    rows = [json.loads(line) for line in open(out / "trials.jsonl")]
    sampler.seen = {pid: (cpu - base.get(pid, 0.0), name) for pid, (cpu, name) in sampler.seen.items()}
    trial_pids = {r["pid"] for r in rows if "pid" in r}
    cpu = sampler.totals(trial_pids)
    sim = [r for r in rows if r.get("fidelity") == "simulator" and r["status"] == "ok"]
    sim_cpu = sum(r.get("eval_cpu_seconds", 0.0) for r in sim)
    st = res["stats"]
    total = sum(cpu.values())
    overhead = (total - sim_cpu) / max(sim_cpu, 1e-9)
    fit_cpu = sampler.window(*res["stats"]["fit_window"], trial_pids)
    fit_overhead = (sum(fit_cpu.values()) - sim_cpu) / max(sim_cpu, 1e-9)
    mlflow_cpu = st["mlflow_cpu_seconds"]
    gaps = wall_gaps(sim, *res["stats"]["fit_window"], st["slots"])
    from runtime.formats.trace import load_trace

    tr = load_trace(res["trace"])
    result = {
        "trials": len(sim), "sweep_seconds": st["sweep_seconds"], "trials_per_hour": st["trials_per_hour"],
        "simulator_cpu_s": sim_cpu, "simulator_cpu_per_trial_ms": 1e3 * sim_cpu / max(len(sim), 1),
        "total_cpu_s": total, "cpu": cpu, "mlflow_cpu_s": mlflow_cpu,
        "overhead_cpu_fraction": overhead, "fit_cpu": fit_cpu, "overhead_cpu_fraction_fit": fit_overhead,
        "mlflow_fraction": mlflow_cpu / max(sim_cpu, 1e-9),
        "overhead_wall_fraction": st["overhead_fraction"], "slots": st["slots"],
        "loadavg_start_end": [load0, load1], "trace": f"T={tr.T} L={tr.L} E={tr.E} k={tr.k}",
        "top_processes": sampler.top(),
        "slot_seconds_not_simulating": gaps,
    }
    print(json.dumps(result, indent=2))
    if a.markdown:
        print(f"\nmachine: {os.cpu_count()} cores ({platform.machine()}), python {platform.python_version()}, "
              f"load average {load0:.1f} -> {load1:.1f} (shared machine); trace {result['trace']}; "
              f"{st['slots']} trial slots")
        print("\n| trials | sweep wall s | trials/hour | simulator CPU/trial | overhead, wall | "
              "overhead, CPU during the sweep | of which MLflow | overhead, CPU whole run |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| {len(sim)} | {st['sweep_seconds']:.0f} | {st['trials_per_hour']:,.0f} | "
              f"{result['simulator_cpu_per_trial_ms']:.0f} ms | {st['overhead_fraction']:.1%} | {fit_overhead:.1%} | "
              f"{result['mlflow_fraction']:.1%} | {overhead:.1%} |")
        print("\nslot-seconds not simulating: " + ", ".join(f"{k} {v:.1f}" for k, v in gaps.items()))

if __name__ == "__main__":
    main()
