"""The one resolver of a run (runtime/backends/resolve.py): the same RunSpec gives every backend the same run.

On one tiny checkpoint (E=8, k=2, L=2) and one text, the emulation's and the engine's input is the text
(`TextSource`, the class both use), the simulator's a router trace of the same model (`TraceSource`)
whose last 20% of rows are exactly the emulation's held-out calibration routing (so a held-out warm
start means the same calibration ids for both). For every cache size (C, per-layer C_l, a fraction, a
VRAM budget with and without low-bit copies), warm start (held-out, unset, a calibration trace, a
residency file, cold), `capacity_alloc = calibrated` and a pinned hot set, both resolve to identical
capacities and initial residency; through the backends themselves (simulator, emulation, engine) the
Result's capacities and the `--residency-out` file agree too. Every bad input is a one-line InputError
naming the flag or field and the value.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from runtime.backends import get_backend, hfmodel
from runtime.backends.emulate import TextSource
from runtime.backends.resolve import IdsSource, resolve
from runtime.backends.simulate import TraceSource
from runtime.core.errors import InputError
from runtime.core.policy import PRESETS, PolicyConfig
from runtime.core.spec import RunSpec
from runtime.formats import costmodel
from runtime.formats.trace import Trace, load_trace, save_trace, synthetic_trace
from tests.tiny_hf import build_tiny

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 16
FE = PRESETS["fetch-every-miss"]
LOWBIT = PolicyConfig(rule="first_choice", fallback="lowbit", lowbit_bits=4, lowbit_group=16, beta=0.5)
CALIBRATED = PolicyConfig(rule="first_choice", evict="lfuda", capacity_alloc="calibrated", beta=0.3)
PINNED = PolicyConfig(rule="threshold", tau=0.15, evict="lfuda", pin_fraction=0.34, beta=0.3)


def ids_trace(ids: np.ndarray, meta) -> Trace:
    """A trace of these router selections [T, L, k] (every cell valid, gate weight 0.5, the selection as its
    ranking, one sequence) with `meta`'s model and dimensions."""
    T = len(ids)
    return Trace(ids, np.full(ids.shape, 0.5, np.float32), ids.copy(), np.ones(ids.shape[:2], bool),
                 np.zeros(T, np.int32), np.arange(T, dtype=np.int32),
                 dataclasses.replace(meta, lookahead_depth=0, ranking_depth=ids.shape[2]))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The checkpoint, the text, a calibration trace of another text, the simulator's trace and a residency file."""
    d = tmp_path_factory.mktemp("resolve")
    ckpt = build_tiny("qwen3_moe", d / "qwen3_moe")
    text, calib_text = d / "text.txt", d / "calib.txt"
    frozen = (ROOT / "tests" / "data" / "kernel_source.txt").read_text()  # a fixed text: the source files change
    text.write_text(frozen[:6000])
    calib_text.write_text(frozen[20000:23000])
    calib = d / "calib.parquet"  # the routing of another text, recorded by the emulation
    get_backend("emulation").evaluate(RunSpec(policy=FE, model=str(ckpt), text=str(calib_text), capacity=3,
                                              window=WINDOW, initial_residency="cold", trace_out=str(calib)))
    m = hfmodel.load(ckpt, "bf16")
    base = RunSpec(policy=FE, model=str(ckpt), text=str(text), capacity=3, window=WINDOW, dtype="bf16")
    ids, _ = hfmodel.read_tokens(m, text)
    text_src = TextSource(m, base, ids, WINDOW)
    held = text_src.held_out(0.2).ids  # [T_c, L, k]: the emulation's held-out calibration routing
    # the simulator's trace: 4 T_c rows of any routing (the calibration trace's), then those T_c rows
    c = load_trace(calib)
    n = 4 * len(held)
    ev = np.resize(c.topk_ids, (n, *c.topk_ids.shape[1:]))
    tids = np.concatenate([ev, held]).astype(np.int32)  # [5 T_c, L, k]
    trace_path = d / "trace.parquet"
    save_trace(ids_trace(tids, c.meta), trace_path)
    npy = d / "residency.npy"  # layer 0 full (4 slots), layer 1 with one empty slot
    np.save(npy, np.array([[5, 1, 7, 2], [3, 0, 6, -1]], np.int64))
    (d / "config.json").write_text((Path(ckpt) / "config.json").read_text())
    # a calibration trace uneven by construction: layer 0 routes every token to experts 0 and 1, layer 1
    # spreads its calls over all 8
    sk = np.empty((64, 2, 2), np.int32)  # [T, L, k]
    sk[:, 0] = (0, 1)
    sk[:, 1] = (np.arange(64)[:, None] * 2 + np.arange(2)) % 8
    skewed = d / "skewed.parquet"
    save_trace(ids_trace(sk, c.meta), skewed)
    return {"dir": d, "ckpt": str(ckpt), "text": str(text), "calib": str(calib), "trace": str(trace_path),
            "skewed": str(skewed),
            "npy": str(npy), "m": m, "text_src": text_src, "held_T": len(held), "config": str(Path(ckpt) / "config.json")}


def specs(inputs, **kw):
    """The same request as the simulator's spec (on the trace, the model's config.json as its shape, bf16) and
    the emulation's (on the model and the text, loaded in bf16)."""
    sim = RunSpec(trace=inputs["trace"], model_shape=inputs["config"], **kw)
    text = RunSpec(model=inputs["ckpt"], text=inputs["text"], window=WINDOW, dtype="bf16", **kw)
    return sim, text


def budget(inputs, slots: int, policy: PolicyConfig) -> float:
    """The VRAM budget (GiB) that holds `slots` per layer under `policy` on the model's bf16 shape."""
    shape = costmodel.model_shape_for(inputs["m"].model.config.to_dict(), "bf16")
    return costmodel.budget_for_capacities(shape, slots, policy) * (1 + 1e-9)


def cases(inputs):
    return {
        "C, held-out": dict(policy=FE, capacity=3, initial_residency="held-out"),
        "C, unset": dict(policy=FE, capacity=3),
        "per-layer C_l, warm": dict(policy=FE, capacity=(3, 5), initial_residency=f"warm:{inputs['calib']}"),
        "fraction, warm": dict(policy=FE, capacity_fraction=0.5, initial_residency=f"warm:{inputs['calib']}"),
        "calibrated, held-out": dict(policy=CALIBRATED, capacity=4, initial_residency="held-out"),
        "calibrated, warm": dict(policy=CALIBRATED, capacity=4, initial_residency=f"warm:{inputs['calib']}"),
        "budget, warm": dict(policy=FE, vram_budget_GiB=budget(inputs, 5, FE), initial_residency=f"warm:{inputs['calib']}"),
        "budget lowbit, held-out": dict(policy=LOWBIT, vram_budget_GiB=budget(inputs, 5, LOWBIT), initial_residency="held-out"),
        "file": dict(policy=FE, capacity=4, initial_residency=inputs["npy"]),
        "pinned, file": dict(policy=PINNED, capacity=4, initial_residency=inputs["npy"]),
        "pinned, warm": dict(policy=PINNED, capacity=5, initial_residency=f"warm:{inputs['calib']}"),
        "cold": dict(policy=FE, capacity=3, initial_residency="cold"),
    }


CASES = ["C, held-out", "C, unset", "per-layer C_l, warm", "fraction, warm", "calibrated, held-out",
         "calibrated, warm", "budget, warm", "budget lowbit, held-out", "file", "pinned, file", "pinned, warm", "cold"]


def _residency(run) -> list[list[int]] | None:
    return None if run.initial_residency is None else [np.asarray(r).tolist() for r in run.initial_residency]


@pytest.mark.parametrize("case", CASES)
def test_same_spec_resolves_the_same_for_every_backend(inputs, case):
    sim_spec, text_spec = specs(inputs, **cases(inputs)[case])
    sim = resolve(sim_spec, TraceSource(load_trace(inputs["trace"])))
    text = resolve(text_spec, inputs["text_src"])
    assert sim.capacities.dtype == text.capacities.dtype == np.int64
    assert sim.capacities.tolist() == text.capacities.tolist()
    assert _residency(sim) == _residency(text)
    assert sim.policy == text.policy == sim_spec.policy
    assert sim.host is not None and sim.host.name == "rtx4090" and text.host is None  # only the simulator is timed
    if "held-out" in case or "unset" in case:  # each holds out its last 20%: the trace's rows, the text's tokens
        assert sim.evaluated_tokens == 4 * inputs["held_T"] and text.evaluated_tokens == int(len(inputs["text_src"].ids) * 0.8)
        assert sim.residency_source.startswith("held-out: trace tokens") and "text tokens" in text.residency_source
    else:
        assert sim.evaluated_tokens is None and text.evaluated_tokens is None
        assert sim.residency_source == text.residency_source == (text_spec.initial_residency or "")


def test_cases_are_not_vacuous(inputs):
    """The cases differ where they should: the cache size, the allocation, the source and the pins act."""
    c = cases(inputs)
    src = TraceSource(load_trace(inputs["trace"]))
    got = {n: resolve(specs(inputs, **c[n])[0], src) for n in CASES}
    assert got["per-layer C_l, warm"].capacities.tolist() == [3, 5]
    assert got["fraction, warm"].capacities.tolist() == [4, 4]
    assert got["budget, warm"].capacities.tolist() == [5, 5]
    # the low-bit copies of every expert and its staging take device memory: without them the same budget
    # holds more slots
    assert got["budget lowbit, held-out"].capacities.tolist() == [5, 5]
    fe = resolve(specs(inputs, policy=FE, vram_budget_GiB=c["budget lowbit, held-out"]["vram_budget_GiB"],
                       initial_residency="held-out")[0], src).capacities.tolist()
    assert fe[0] > 5 and fe[0] == fe[1]
    for n in ("calibrated, held-out", "calibrated, warm"):  # the total kept, spread by the counts
        assert got[n].capacities.sum() == 8, n
    # calls that two experts cover take two slots in layer 0: the rest go to layer 1, which spreads over all 8
    skewed = resolve(specs(inputs, policy=CALIBRATED, capacity=4, initial_residency=f"warm:{inputs['skewed']}")[0], src)
    assert skewed.capacities.sum() == 8 and skewed.capacities[0] < skewed.capacities[1], skewed.capacities
    assert _residency(got["file"]) == [[5, 1, 7, 2], [3, 0, 6]]
    assert [len(r) for r in _residency(got["per-layer C_l, warm"])] == [3, 5]
    assert got["cold"].initial_residency is None


@pytest.mark.parametrize("case", ["per-layer C_l, warm", "calibrated, warm", "budget, warm", "pinned, file"])
def test_every_backend_runs_the_resolved_run(inputs, case, tmp_path):
    """Through the backends: Result.capacity and the --residency-out file are the same for all three."""
    sim_spec, text_spec = specs(inputs, **cases(inputs)[case], max_tokens=32)
    out = {}
    for backend, spec in (("simulator", sim_spec), ("emulation", text_spec), ("engine", text_spec)):
        path = tmp_path / f"{backend}.npy"
        res = get_backend(backend).evaluate(dataclasses.replace(spec, residency_out=str(path)))
        out[backend] = (res.capacity, np.load(path).tolist(), res.initial_residency)
    assert out["simulator"] == out["emulation"] == out["engine"], out


def test_host_travels_in_the_spec_by_value(inputs):
    """A host profile by value (a mapping, or a HostProfile kept as its mapping) is the profile used; it
    survives the spec's JSON form (what a Ray task receives) and is named by its name in MLflow."""
    prof = costmodel.load_host_profile("rtx3090")
    slow = dataclasses.replace(prof, name="rtx3090-slow", link_GBps=prof.link_GBps / 4)
    src = TraceSource(load_trace(inputs["trace"]))
    spec = RunSpec(policy=FE, trace=inputs["trace"], capacity=3, initial_residency="cold", host=slow)
    assert isinstance(spec.host, dict) and spec.mlflow_params()["host"] == "rtx3090-slow"
    again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert resolve(again, src).host == resolve(spec, src).host == slow
    assert resolve(dataclasses.replace(spec, host="rtx3090"), src).host == prof
    fast, slower = (get_backend("simulator").evaluate(dataclasses.replace(spec, host=h)) for h in ("rtx3090", slow))
    assert slower.extra["host"] == "rtx3090-slow" and slower.time_per_token_s > fast.time_per_token_s


def test_ids_source_is_the_warm_start_of_given_calibration_ids(inputs):
    """`IdsSource`: ids in hand (an exact pass's) resolve like the text they came from."""
    src = inputs["text_src"]
    cal = src.calibration_text(str(Path(inputs["dir"]) / "calib.txt"))
    spec = specs(inputs, policy=FE, capacity_fraction=0.5, calib_text=str(Path(inputs["dir"]) / "calib.txt"))[1]
    a = resolve(spec, src)
    b = resolve(RunSpec(policy=FE, trace="recorded", capacity_fraction=0.5), IdsSource(2, 8, 2, cal.ids))
    assert a.capacities.tolist() == b.capacities.tolist() and _residency(a) == _residency(b)
    assert resolve(RunSpec(policy=FE, trace="x", capacity=3, initial_residency="cold"),
                   IdsSource(2, 8, 2, None)).initial_residency is None


def _other_trace(d: Path, name: str, num_layers: int, model: str) -> str:
    path = d / f"{name}.parquet"
    save_trace(synthetic_trace(64, num_layers, 8, 2, seed=1, model=model), path)
    return str(path)


def errors(inputs):
    d = Path(inputs["dir"])
    bad = d / "bad"
    bad.mkdir(exist_ok=True)
    for name, arr in {"3d": np.zeros((2, 2, 2), np.int64), "float": np.zeros((2, 3)), "ids": np.array([[0, 9], [1, 2]]),
                      "repeat": np.array([[1, 1], [2, 3]]), "wide": np.zeros((2, 6), np.int64)}.items():
        np.save(bad / f"{name}.npy", arr)
    (bad / "junk.npy").write_text("not an array")
    warm = f"warm:{inputs['calib']}"
    return [
        (dict(capacity=(3, 4, 5)), r"--capacity = \[3, 4, 5\] has 3 entries, the model has 2 MoE layers"),
        (dict(capacity=8), r"--capacity = 8 \(layer 0\) must satisfy k=2 <= C < E=8"),
        (dict(capacity_fraction=0.1), r"--capacity-fraction 0.1: capacity = 1 \(layer 0\) must satisfy k=2"),
        (dict(vram_budget_GiB=1e-4), "--vram-budget = 0.0001 GiB leaves"),
        (dict(capacity=3, initial_residency=f"warm:{_other_trace(d, 'three-layers', 3, 'unknown')}"),
         "--initial-residency: calibration trace .* has E=8, k=2, L=3; the .* has E=8, k=2, L=2"),
        (dict(capacity=3, initial_residency=f"warm:{_other_trace(d, 'mixtral', 2, 'mixtral:/x')}"),
         "--initial-residency: calibration trace .* is from model 'mixtral:/x'"),
        (dict(capacity=3, initial_residency=f"warm:{d / 'absent.parquet'}"), "absent.parquet"),
        (dict(capacity=3, initial_residency=str(bad / "junk.npy")), "--initial-residency: cannot read .*junk.npy"),
        (dict(capacity=3, initial_residency=str(bad / "3d.npy")), r"3d.npy has shape \(2, 2, 2\) .* expected int \[L=2, C\]"),
        (dict(capacity=3, initial_residency=str(bad / "float.npy")), "float.npy has shape .* dtype float64"),
        (dict(capacity=3, initial_residency=str(bad / "ids.npy")), r"ids.npy layer 0 = \[0, 9\]: expected ids in \[0, 8\)"),
        (dict(capacity=3, initial_residency=str(bad / "repeat.npy")), r"repeat.npy row 0 = \[1, 1\] repeats an id"),
        (dict(capacity=3, initial_residency=str(bad / "wide.npy")), "wide.npy layer 0 = .* at most C=3 columns"),
        (dict(capacity=3, initial_residency="cold", policy=CALIBRATED),
         "--capacity-alloc = 'calibrated' needs calibration counts .* the initial residency is cold"),
        (dict(capacity=4, initial_residency=str(inputs["npy"]), policy=CALIBRATED),
         "--capacity-alloc = 'calibrated' needs calibration counts .*residency.npy"),
        (dict(capacity=3, initial_residency="cold", policy=PINNED), "--pin-fraction = 0.34 needs a warm start"),
        (dict(capacity=3, initial_residency=warm, policy=dataclasses.replace(PINNED, pin_fraction=0.7)),
         "--pin-fraction = 0.7 pins P=2 of C=3 slots at layer 0, leaving 1 < k=2"),
        (dict(capacity=6, initial_residency=str(inputs["npy"]), policy=dataclasses.replace(PINNED, pin_fraction=0.7)),
         "--pin-fraction = 0.7 pins P=4 experts at layer 1; its initial residency holds only 3"),
        (dict(capacity=3, initial_residency="cold", residency_out=str(d / "r.npy")),
         "--residency-out .*r.npy: needs a warm start"),
        (dict(capacity=3, initial_residency="cold", host="nohost"), "nohost"),
        (dict(capacity=3, initial_residency="cold", host={"name": "box", "gpu": "x", "link_GBps": -1}), "box"),
    ]


N_ERRORS = 21


def test_every_error_case_is_run(inputs):
    assert len(errors(inputs)) == N_ERRORS


@pytest.mark.parametrize("i", range(N_ERRORS))
def test_bad_input_is_one_line_naming_the_flag_and_value(inputs, i):
    kw, message = errors(inputs)[i]
    spec = RunSpec(**{"policy": FE, "trace": inputs["trace"], **kw})
    with pytest.raises(InputError, match=message) as exc:
        resolve(spec, TraceSource(load_trace(inputs["trace"])))
    assert "\n" not in str(exc.value)
    if "host" not in kw:  # the text backends' source says the same (the host is the simulator's alone)
        text = RunSpec(**{"policy": FE, "model": inputs["ckpt"], "text": inputs["text"], "window": WINDOW, **kw})
        with pytest.raises(InputError, match=message.replace("the trace", "the model")):
            resolve(text, inputs["text_src"])


def test_spec_host_errors_are_one_line():
    with pytest.raises(InputError, match="--host = .*a host profile by value needs a non-empty 'name'"):
        RunSpec(policy=FE, trace="t.parquet", capacity=3, host={"gpu": "x"})
    with pytest.raises(InputError, match="--host = 3 must be a host preset name"):
        RunSpec(policy=FE, trace="t.parquet", capacity=3, host=3)


def test_given_ids_and_a_spec_residency_are_one_or_the_other(inputs):
    spec = RunSpec(policy=FE, trace=inputs["trace"], capacity=3, initial_residency="cold")
    with pytest.raises(InputError, match="--initial-residency = 'cold' and per-layer ids given: give one of them"):
        resolve(spec, TraceSource(load_trace(inputs["trace"])), initial_residency=[np.arange(3)] * 2)
    run = resolve(dataclasses.replace(spec, initial_residency=None), TraceSource(load_trace(inputs["trace"])),
                  initial_residency=[np.array([4, 1]), np.array([0, 6, 2])])
    assert _residency(run) == [[4, 1], [0, 6, 2]] and run.residency_source == "given"


def test_findings_caps_and_warm_is_the_resolved_run():
    """The findings' capacities and warm start (runtime/tools/findings/experiments.py) are the resolver's, and
    equal what the fraction and the calibration counts give directly (cold without calibration ids)."""
    from runtime.core.kernel import warm_residency
    from runtime.core.policy import resolve_capacities
    from runtime.tools.findings.experiments import caps_and_warm

    tr = synthetic_trace(300, 3, 32, 4, seed=5)
    cal = synthetic_trace(200, 3, 32, 4, seed=6).topk_ids
    caps, init = caps_and_warm(tr, cal, 0.25)
    want = resolve_capacities(None, 3, 32, 4, 0.25)
    assert caps.tolist() == want.tolist() == [8, 8, 8]
    ref = warm_residency(cal, None, 32, want)
    assert [np.asarray(r).tolist() for r in init] == [np.asarray(r)[np.asarray(r) >= 0].tolist() for r in ref]
    assert caps_and_warm(tr, None, 0.25)[1] is None
