"""The answer against llama.cpp (sweep.answer): `x llama.cpp` is the answer policy's speed ratio over the faster of
llama.cpp's two baselines (its LRU expert cache, its -ncmoe split) at the same device memory on that host, `-` where
either is missing; `llama.cpp flags` is the policy in llama.cpp's flags, or what llama.cpp lacks to run it; the
summary names the baselines ("llama.cpp LRU cache", "llama.cpp -ncmoe N") and the MLflow metrics carry them."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from runtime.core.policy import PRESETS
from runtime.formats import costmodel
from sweep.answer import answer, answer_text, llamacpp_baselines, llamacpp_text
from sweep.finish import answer_metrics, llamacpp_metrics, log_llamacpp_metrics
from sweep.report import policy_key, write_report
from sweep.space import PARAMETERS, complete

GIB = 2.0
SLOTS = [32] * 48  # qwen3-30b-a3b: 48 layers of 128 experts of 9 MiB (9437184 bytes) each
LACKS_SUBSTITUTION = "llama.cpp has no substitution of a missed expert"


def _shape() -> costmodel.ModelShape:
    return costmodel.load_model_shape("qwen3-30b-a3b")


def _params(preset: str) -> dict:
    p = {k: v for k, v in dataclasses.asdict(PRESETS[preset]).items() if k in PARAMETERS and v is not None}
    return complete({**p, "vram_budget_GiB": GIB})


def _row(preset: str, ms: float, hi: float, baseline: bool, gib: float = GIB) -> dict:
    """A measured row (report.measured's columns): `preset` at `ms` ms/token with upper bound `hi`."""
    return {"policy_key": policy_key({**_params(preset), "vram_budget_GiB": gib}), "policy": preset,
            "label": preset, "baseline": preset if baseline else None, "family": "test", "host": "h", "status": "ok",
            "vram_budget_GiB": gib, "capacity_slots": SLOTS, "device_memory_GiB": gib * 0.99,
            "time_per_token_s": ms / 1e3, "time_per_token_ms": ms, "speed_ratio_vs_fetch_all": 10.0 / ms,
            "ppl_change_pct": hi / 2, "ppl_ci_low": 0.0, "ppl_ci_high": hi}


def _tables(lru_ms: float | None, ncmoe_ms: float | None, answer_ms: float = 2.0) -> dict[str, pd.DataFrame]:
    rows = [_row("rule-0.15", answer_ms, 0.8, baseline=False)]
    if lru_ms is not None:
        rows.append(_row("llamacpp-lru", lru_ms, 0.0, baseline=True))
    if ncmoe_ms is not None:
        rows.append(_row("llamacpp-ncmoe", ncmoe_ms, 0.0, baseline=True))
    return {"h": pd.DataFrame(rows)}


def _answer_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln.startswith("| h |")]


def test_x_llamacpp_is_over_the_faster_baseline_the_lru_cache() -> None:
    ans = answer(_tables(lru_ms=5.0, ncmoe_ms=8.0), [1.0], shape=_shape())
    r = ans.iloc[0]
    assert r["policy"] == "rule-0.15" and r["speed_ratio_vs_llamacpp"] == pytest.approx(2.5)  # 5 ms / 2 ms
    assert r["llamacpp_faster"] == "llama.cpp LRU cache" and r["llamacpp_time_per_token_ms"] == 5.0
    text = answer_text(ans)
    head = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    (row,) = _answer_rows(text)
    assert head.index("x llama.cpp") == head.index("x fetch-every-miss") + 1
    assert row[head.index("x llama.cpp")] == "2.50" and row[head.index("x fetch-every-miss")] == "5.00"
    assert "over llama.cpp LRU cache (5.000 ms/token)" in llamacpp_text(ans, llamacpp_baselines(
        _tables(5.0, 8.0)["h"], ["h"], _shape()))


def test_x_llamacpp_is_over_the_faster_baseline_the_split() -> None:
    ans = answer(_tables(lru_ms=8.0, ncmoe_ms=5.0), [1.0], shape=_shape())
    r = ans.iloc[0]
    assert r["speed_ratio_vs_llamacpp"] == pytest.approx(2.5)
    assert r["llamacpp_faster"] == "llama.cpp -ncmoe 36"  # 48 layers - floor(1536 slots / 128 experts)
    assert _answer_rows(answer_text(ans))[0][7] == "2.50"


def test_llamacpp_flags_of_the_two_presets_and_what_llamacpp_lacks() -> None:
    shape = _shape()
    ans = answer(_tables(lru_ms=5.0, ncmoe_ms=8.0), [1.0], shape=shape)
    assert LACKS_SUBSTITUTION in ans.iloc[0]["llamacpp_flags"]
    head = [c.strip() for c in answer_text(ans).splitlines()[0].strip("|").split("|")]
    assert head[-1] == "llama.cpp flags" and LACKS_SUBSTITUTION in _answer_rows(answer_text(ans))[0][-1]
    # printed on the terminal: the flags on a line under the row, not in a column
    below = answer_text(ans, flags_below=True).splitlines()
    assert "llama.cpp flags" not in below[0] and below[3].startswith("  llama.cpp: " + LACKS_SUBSTITUTION)
    # the answer is llama.cpp's own cache (the substituting policy is over budget): its flags, sized by hand:
    # ceil((1536 slots + 1 padding) * 9 MiB) = 13833 MiB
    tabs = _tables(lru_ms=5.0, ncmoe_ms=8.0)
    tabs["h"].loc[tabs["h"]["policy"] == "rule-0.15", "ppl_ci_high"] = 3.0
    r = answer(tabs, [1.0], shape=shape).iloc[0]
    assert r["policy"] == "llamacpp-lru" and r["llamacpp_flags"] == "--moe-cache-mib 13833"
    assert r["speed_ratio_vs_llamacpp"] == pytest.approx(1.0)
    tabs["h"].loc[tabs["h"]["policy"] == "llamacpp-lru", "ppl_ci_high"] = 3.0
    r = answer(tabs, [1.0], shape=shape).iloc[0]
    assert r["policy"] == "llamacpp-ncmoe" and r["llamacpp_flags"] == "-ncmoe 36"
    assert r["speed_ratio_vs_llamacpp"] == pytest.approx(5.0 / 8.0)


@pytest.mark.parametrize("gone", ["llamacpp-lru", "llamacpp-ncmoe"])
def test_a_missing_baseline_gives_a_dash_and_says_why(gone: str) -> None:
    ans = answer(_tables(lru_ms=None if gone == "llamacpp-lru" else 5.0,
                         ncmoe_ms=None if gone == "llamacpp-ncmoe" else 8.0), [1.0], shape=_shape())
    r = ans.iloc[0]
    assert pd.isna(r.get("speed_ratio_vs_llamacpp")) and gone in r["llamacpp_missing"]
    assert _answer_rows(answer_text(ans))[0][7] == "-"
    why = [ln for ln in llamacpp_text(ans, pd.DataFrame()).splitlines() if "is `-`" in ln]
    assert why == [f"- `x llama.cpp` on h is `-`: {gone} is not among this sweep's baselines (baselines.policies)"]
    assert not any("vs_llamacpp" in k for k in answer_metrics(ans))
    # without an answer (no perplexity measured), the llama.cpp section still says which did not run
    llama = llamacpp_baselines(_tables(None, 8.0)["h"], ["h"], _shape())
    assert "- on h: llamacpp-lru is not among this sweep's baselines (baselines.policies)" in llamacpp_text(
        pd.DataFrame(), llama).splitlines()


def test_a_baseline_at_another_memory_gives_a_dash() -> None:
    tabs = _tables(lru_ms=5.0, ncmoe_ms=8.0)
    tabs["h"].loc[tabs["h"]["policy"] == "llamacpp-ncmoe", "vram_budget_GiB"] = 3.0
    r = answer(tabs, [1.0], shape=_shape()).iloc[0]
    assert pd.isna(r.get("speed_ratio_vs_llamacpp")) and "another device memory" in r["llamacpp_missing"]


def test_the_report_and_mlflow_metrics_name_llamacpps_two_baselines(tmp_path) -> None:
    """write_report on a ledger (simulator rows and full-budget emulation rows): answer.csv, summary.md and the
    metrics carry llama.cpp's baselines; the plots draw them (they are written without error)."""
    def sim(preset: str, ms: float, baseline: bool) -> dict:
        return {"key": f"h:{preset}", "number": None, "baseline": preset if baseline else None,
                "params": _params(preset), "host": "h", "fidelity": "simulator", "status": "ok",
                "time_per_token_s": ms / 1e3, "mass_per_token": 0.1, "capacity_slots": SLOTS,
                "fetch_all_time_per_token_s": 10e-3, "host_compute_time_per_token_s": 20e-3,
                "speed_ratio_vs_fetch_all": 10.0 / ms, "speed_ratio_vs_host_compute": 20.0 / ms,
                "speed_ratio_vs_all_resident": 0.5, "device_memory_GiB": GIB * 0.99, "policy": preset}

    def emu(preset: str, hi: float) -> dict:
        return {"key": f"emulation:full:{preset}", "params": _params(preset), "host": "all", "fidelity": "emulation",
                "budget": "full", "status": "ok", "ppl_change_pct": hi / 2, "ppl_ci_low": 0.0, "ppl_ci_high": hi,
                "mass_per_token": 0.1}

    rows = [sim("fetch-every-miss", 10.0, True), sim("llamacpp-lru", 5.0, True), sim("llamacpp-ncmoe", 8.0, True),
            sim("rule-0.15", 2.0, False)]
    rows += [emu("fetch-every-miss", 0.0), emu("llamacpp-lru", 0.0), emu("llamacpp-ncmoe", 0.0), emu("rule-0.15", 0.8)]
    rep = write_report(tmp_path, rows, ["h"], ("time_per_token_s", "mass_per_token"),
                       {"name": "t", "budgets": [1.0], "shape": _shape()})
    csv = pd.read_csv(tmp_path / "answer.csv").iloc[0]
    assert csv["policy"] == "rule-0.15" and csv["speed_ratio_vs_llamacpp"] == pytest.approx(2.5)
    assert LACKS_SUBSTITUTION in csv["llamacpp_flags"]
    summary = (tmp_path / "summary.md").read_text()
    assert "| x fetch-every-miss | x llama.cpp |" in summary and "llama.cpp flags |" in summary
    assert "| h | llama.cpp LRU cache | `--moe-cache-mib 13833` |" in summary
    assert "| h | llama.cpp -ncmoe 36 | `-ncmoe 36` |" in summary
    assert (tmp_path / "pareto_h.png").stat().st_size > 0
    m = llamacpp_metrics(rep["llamacpp"])
    assert m["llamacpp_lru_h_time_per_token_ms"] == 5.0 and m["llamacpp_ncmoe_h_time_per_token_ms"] == 8.0
    assert m["llamacpp_lru_h_speed_ratio_vs_fetch_all"] == pytest.approx(2.0)
    assert answer_metrics(rep["answer"])["answer_h_within_1pct_speed_ratio_vs_llamacpp"] == pytest.approx(2.5)


def test_the_plot_draws_llamacpps_two_baselines_as_labelled_lines(tmp_path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    from sweep.plot import plot_panels

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its lines and labels
    tabs = _tables(lru_ms=5.0, ncmoe_ms=8.0)
    llama = llamacpp_baselines(tabs["h"], ["h"], _shape())
    empty = tabs["h"].iloc[:0]
    plot_panels({"h": {"measured": tabs["h"], "front": empty, "trials": empty, "screening": empty,
                       "llamacpp": llama}}, tmp_path / "p.png", "h", [1.0])
    (fig,) = figures
    for ax in fig.axes:
        texts = {t.get_text() for t in ax.texts}
        assert {"llama.cpp LRU cache 5.000 ms", "llama.cpp -ncmoe 36 8.000 ms"} <= texts
        flat = {float(ln.get_ydata()[0]) for ln in ax.lines if ln.get_linestyle() == "-."}
        assert flat == {5.0, 8.0}
    monkeypatch.undo()
    plt.close(fig)


def test_the_parent_run_logs_llamacpps_baselines_per_host(tmp_path) -> None:
    """Through the sweep's Tracker into an MLflow store, read back with MLflow's client: a metric per host and
    baseline that ran, none for one that did not."""
    from mlflow.tracking import MlflowClient

    from sweep.tracking import Tracker

    tabs = _tables(lru_ms=5.0, ncmoe_ms=None)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tracker = Tracker(uri, "x")
    parent = tracker.start_parent("p", {}, {})
    log_llamacpp_metrics(tracker, {"llamacpp": llamacpp_baselines(tabs["h"], ["h"], _shape())})
    tracker.close()
    got = MlflowClient(uri).get_run(parent).data.metrics
    assert got["llamacpp_lru_h_time_per_token_ms"] == 5.0
    assert got["llamacpp_lru_h_speed_ratio_vs_fetch_all"] == pytest.approx(2.0)
    assert not any(k.startswith("llamacpp_ncmoe") for k in got)
