"""What the sweep driver (sweep/driver.py) does once the screening is over: the multi-fidelity ladder and
the engine on calibrated hosts (`climb_ladder`), the report, stats.json and the MLflow tables, child runs and
parent metrics of a finished sweep (`write_answer`, `answer_metrics`, `log_llamacpp_metrics`; `_stats`,
`_log_bound_metrics`), and the results printed on stdout, the answer last (`print_results`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from runtime.core.errors import atomic_write
from sweep import hosts, report, tracking
from sweep.answer import answer_text


def write_answer(cfg, inputs, out: Path, uri: str, parent: str, gpus: dict[str, str], notes: list[str],  # noqa: ANN001
            ladder_stats: dict[str, Any], session, ledger, tracker: tracking.Tracker,  # noqa: ANN001
            timing: tuple[float, float, list[float]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A finished sweep's report and stats.json written, and logged into MLflow (a child run per front policy,
    the tables, the answer's parent metrics); (report, stats). timing: screening seconds, driver CPU seconds,
    the fit window."""
    import ray

    sweep_s, driver_cpu, fit_window = timing
    host_names = list(gpus)
    meta = {"name": cfg.name, "trace": inputs.trace, "model": inputs.model_dir, "objectives": cfg.objectives,
            "sampler": cfg.sampler, "trials": cfg.trials, "mlflow_uri": uri, "parent_run_id": parent,
            "gpus": gpus, "notes": notes + list(cfg.budget_notes), "warm_start": inputs.warm_start, "ladder": ladder_stats,
            "budgets": cfg.ppl_budgets_pct, "shape": model_shape(cfg, inputs)}
    rep = report.write_report(out, ledger.rows, host_names, cfg.objectives, meta)
    tracker.log_children(report.policy_records(ledger.rows, rep["fronts"], host_names), gpus)
    tracker.log_table(rep["trials"], "tables/trials.json")
    for h, fr in rep["fronts"].items():
        tracker.log_table(fr, f"tables/front_{h}.json")
    if not rep["policy_by_host"].empty:
        tracker.log_table(rep["policy_by_host"], "tables/policy_by_host.json")
    if not rep["answer"].empty:
        tracker.log_table(rep["answer"], "tables/answer.json")
        tracker.log_parent_metrics(answer_metrics(rep["answer"]))
    _log_bound_metrics(tracker, rep)
    log_llamacpp_metrics(tracker, rep)
    tracker.flush()
    stats = _stats(session, sweep_s, driver_cpu, tracker, ray.cluster_resources())
    stats["fit_window"] = fit_window
    stats["ladder"] = ladder_stats
    atomic_write(out / "stats.json", lambda tmp: Path(tmp).write_text(json.dumps(stats, indent=2)))
    files = [p for p in rep["paths"].values() if Path(p).is_file()]
    files += [out / f"pareto_{h}.parquet" for h in host_names]
    tracker.log_artifacts([f for f in files if f.is_file()] + [out / "stats.json"])
    hyp = rep["hypothesis"]
    tracker.log_parent_metrics({**{f"front_size_{h}": len(rep["fronts"].get(h, [])) for h in host_names},
                                "trials_ok": stats["trials_ok"], "trials_failed": stats["trials_failed"],
                                **({"mass_ppl_pearson_r": hyp["r"]} if hyp["r"] == hyp["r"] else {})})
    return rep, stats


def climb_ladder(cfg, inputs, session, ledger, enabled: bool,  # noqa: ANN001
            placement: dict[str, Any] | None = None) -> tuple[list[str], dict[str, Any]]:
    """The multi-fidelity ladder (sweep/ladder.py) and the engine on calibrated hosts; (notes, stats)."""
    from sweep import ladder
    from sweep.remeasure import Measurer

    calibrated = [h.name for h in cfg.hosts if not hosts.simulated(h)]
    if not enabled or not cfg.emulation.enabled:
        return ["Emulation was switched off for this sweep: no perplexity fronts and no answer, only the "
                "simulator's screening (mass view)."], {}
    if inputs.model_dir is None:
        return ["Emulation needs a model; this sweep ran on a trace only: no perplexity fronts and no answer, "
                "only the simulator's screening (mass view)."], {}
    cands = ladder.screening_candidates(ledger.rows, session.hosts)
    bases = ladder.baseline_params(list(cfg.baseline_policies), cfg.baseline_capacity())
    measure = Measurer(inputs.model_dir, inputs.text, inputs.calib_text, ledger, session.add_rows,
                       placement=placement, run_fields={"dtype": cfg.dtype, "max_memory_GiB": cfg.max_memory_GiB},
                       model_digest=inputs.digest)
    stats = ladder.run_ladder(cands, bases, ledger.rows, session.hosts, list(cfg.emulation.rungs), cfg.emulation.eta,
                              cfg.emulation.max_full, cfg.max_tokens, list(cfg.ppl_budgets_pct), measure)
    full_params = {report.policy_key(p): p for p in cands + bases}
    full = [full_params[pk] for pk in stats["full"] if pk in full_params]
    notes = [f"Ladder: {stats['screened']} screened candidates -> " + " -> ".join(
        f"{r['candidates']} at {r['tokens'] or 'all'} tokens" for r in stats["rungs"])
        + f" (the full budget includes the {len(bases)} named baselines) on {inputs.text}."]
    for host in (calibrated if cfg.emulation.engine else []):
        t0 = time.time()
        measure.engine(full, cfg.max_tokens, host, hosts.gpus_of(host))
        stats.setdefault("engine", []).append({"host": host, "policies": len(full), "seconds": time.time() - t0})
        notes.append(f"The engine decoded the {len(full)} full-budget policies on {host} (measured time per token).")
    if not calibrated:
        notes.append("No host of this sweep is calibrated (all profiles are presets): times per token are the "
                     "cost model's; a host with `profile: calibrate` is also measured by the engine.")
    return notes, stats


def _stats(session, sweep_s: float, driver_cpu: float, tracker, resources: dict[str, float]) -> dict[str, Any]:  # noqa: ANN001
    rows = [r for r in session.ledger.rows if r.get("fidelity") == "simulator"]
    slots = int(resources.get("CPU", 1))
    ok = sum(r["status"] == "ok" for r in rows)
    busy = session.eval_seconds
    infeasible = sum(r["status"] == "infeasible" for r in rows)  # did not fit the sweep's vram budget
    return {"trials_ok": ok, "trials_infeasible": infeasible, "trials_failed": len(rows) - ok - infeasible,
            "trials_this_run": session.new_rows,
            "trials_evaluated_twice": session.repeated,
            "sweep_seconds": sweep_s, "trials_per_hour": session.new_rows / max(sweep_s, 1e-9) * 3600,
            "simulator_seconds": busy, "slots": slots,
            "overhead_fraction": 1 - busy / max(sweep_s * slots, 1e-9),
            "driver_cpu_seconds": driver_cpu, "mlflow_cpu_seconds": tracker.cpu_seconds,
            "mlflow_children_written": tracker.written, "mlflow_errors": tracker.errors}


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and v == v


def _log_bound_metrics(tracker, rep: dict[str, Any]) -> None:  # noqa: ANN001
    """The computed bounds as MLflow parent metrics (per host and kind: ms/token, speed ratio)."""
    from sweep.bounds import bound_metrics

    if rep.get("bounds") is not None and not rep["bounds"].empty:
        tracker.log_parent_metrics(bound_metrics(rep["bounds"]))


def log_llamacpp_metrics(tracker, rep: dict[str, Any]) -> None:  # noqa: ANN001 - tracking.Tracker
    """llama.cpp's two baselines as MLflow parent metrics (`llamacpp_metrics`), where the sweep ran them."""
    if rep.get("llamacpp") is not None and not rep["llamacpp"].empty:
        tracker.log_parent_metrics(llamacpp_metrics(rep["llamacpp"]))


def model_shape(cfg, inputs):  # noqa: ANN001, ANN201 - SweepConfig, data.Inputs -> costmodel.ModelShape
    """The cost model's shape of the sweep's trace (`cfg.model_shape` as the driver's input check resolved it): the
    shape llama.cpp's flags are sized for (`--moe-cache-mib`'s bytes, `-ncmoe`'s layers)."""
    from runtime.formats import costmodel
    from runtime.formats.trace import load_trace

    return costmodel.shape_for_trace(load_trace(inputs.trace), cfg.model_shape)


def llamacpp_metrics(llama) -> dict[str, float]:  # noqa: ANN001 - answer.llamacpp_baselines' DataFrame
    """MLflow parent metrics of llama.cpp's two baselines: per host and baseline, ms/token, the speed ratio over
    fetch-every-miss and the device memory (none for a baseline the sweep did not run)."""
    out = {}
    for _, r in llama.iterrows():
        if not _is_number(r.get("time_per_token_ms")):
            continue
        tag = f"{r['baseline'].replace('-', '_')}_{r['host']}"
        out[f"{tag}_time_per_token_ms"] = float(r["time_per_token_ms"])
        for k in ("speed_ratio_vs_fetch_all", "device_memory_GiB"):
            if _is_number(r.get(k)):
                out[f"{tag}_{k}"] = float(r[k])
    return out


def answer_metrics(ans) -> dict[str, float]:  # noqa: ANN001 - the answer DataFrame
    """MLflow parent metrics of the answer: per host and budget, the speed ratio and the upper bound."""
    out = {}
    for _, r in ans.iterrows():
        if isinstance(r["policy"], str):
            tag = f"{r['host']}_within_{r['ppl_budget_pct']:g}pct"
            out[f"answer_{tag}_speed_ratio_vs_fetch_all"] = float(r["speed_ratio_vs_fetch_all"])
            out[f"answer_{tag}_ppl_ci_high"] = float(r["ppl_ci_high"])
            if _is_number(r.get("speed_ratio_vs_llamacpp")):
                out[f"answer_{tag}_speed_ratio_vs_llamacpp"] = float(r["speed_ratio_vs_llamacpp"])
            if _is_number(r.get("device_memory_GiB")):
                out[f"answer_{tag}_device_memory_GiB"] = float(r["device_memory_GiB"])
    return out


def print_results(rep: dict[str, Any], host_names: list[str], gpus: dict[str, str], out: Path, stats: dict,
           mlflow_line: str = "") -> None:
    """The results on stdout: the fronts, then the answer last (what the user asked)."""
    for h in host_names:
        fr = rep["fronts"].get(h)
        if fr is not None and not fr.empty:
            print(report.host_table_text(h, fr, gpus.get(h, "")) + "\n")
    hyp = rep["hypothesis"]
    if hyp["r"] == hyp["r"]:
        print(f"mass hypothesis: Pearson r = {hyp['r']:.3f} [{hyp['ci_low']:.3f}, {hyp['ci_high']:.3f}] "
              f"over {hyp['n']} policies\n")
    print(f"{stats['trials_ok']} trials ok, " + (f"{stats['trials_infeasible']} infeasible at the budget, "
                                                 if stats.get("trials_infeasible") else "")
          + f"{stats['trials_failed']} failed; "
          f"{stats['trials_per_hour']:.0f} trials/hour this run")
    for k, p in rep["paths"].items():
        if k.startswith("plot") or k == "summary":
            print(f"{k}: {p}")
    if mlflow_line:
        print(mlflow_line)
    print(f"outputs: {out}\n")
    if not rep["answer"].empty:
        print("The answer: per host and perplexity budget, the fastest policy within it (upper 95% bound)\n")
        print(answer_text(rep["answer"], flags_below=True))
    else:
        print("No perplexity was measured (emulation off or no model): no answer, screening fronts only.")
