"""Routing dumps of vLLM, SGLang and llama.cpp imported as traces without gate weights (runtime/formats/trace/
imports.py), what the simulator and the sweep do with such a trace (runtime/core/policy.py GATE_WEIGHT_READERS).

Each import round-trips a known id array written in its engine's layout; each bad file is one line, exit 2, no
output; a policy that reads gate weights is refused on a weightless trace, one that reads none replays it exactly as
it replays the weighted original (synthetic, and ../shared's real vLLM routing when present); the sweep leaves the
weight-reading dimensions out of its space.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.core.errors import InputError
from runtime.core.policy import PRESETS, PolicyConfig, gate_weight_readers
from runtime.formats.trace import load_trace, save_trace, synthetic_trace
from runtime.formats.trace.formats import Trace
from runtime.formats.trace.imports import import_routing

ROOT = Path(__file__).resolve().parents[1]
T, L, K, E = 30, 3, 4, 16


def known_ids(seed: int = 0, T: int = T, L: int = L, k: int = K, E: int = E) -> np.ndarray:
    """int32 [T, L, k]: distinct ids per token and layer, every expert used."""
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.permutation(E)[:k] for _ in range(L)]) for _ in range(T)]).astype(np.int32)


def moe_trace_csv(path: Path, ids: np.ndarray, layers: list[int], ubatches: list[int], header: bool = True) -> Path:
    """llama.cpp moe-trace's CSV: per ubatch (token counts `ubatches`), per MoE layer in graph order, the ubatch's
    tokens one after another, each token's k ids in router order: one `layer,expert` row per routed activation."""
    rows = ["layer,expert"] if header else []
    t0 = 0
    for n in ubatches:
        for li, layer in enumerate(layers):
            rows += [f"{layer},{e}" for t in range(t0, t0 + n) for e in ids[t, li]]
        t0 += n
    assert t0 == ids.shape[0]
    path.write_text("\n".join(rows) + "\n")
    return path


def pos_csv(path: Path, ids: np.ndarray, layers: list[int], pos: np.ndarray, ubatches: list[int]) -> Path:
    """The forks' CSV `pos,layer,id0..id{k-1}`: per ubatch, per layer, one row per token."""
    k = ids.shape[2]
    rows = ["pos,layer," + ",".join(f"id{j}" for j in range(k))]
    t0 = 0
    for n in ubatches:
        for li, layer in enumerate(layers):
            rows += [f"{pos[t]},{layer}," + ",".join(map(str, ids[t, li])) for t in range(t0, t0 + n)]
        t0 += n
    path.write_text("\n".join(rows) + "\n")
    return path


def sglang_pt(path: Path, ids: np.ndarray, passes: list[int], dense: int | None = None, slots: int = 8,
              physical: bool = False, top: bool = False) -> tuple[Path, np.ndarray]:
    """SGLang's per_token expert-distribution dump: records (one per forward pass) with topk_ids_of_layer
    [model layers, tokens, 8] (the recorder's fixed 8 slots, -1 past k; a dense layer's rows -1), and
    last_physical_to_logical_map [layers, physical experts]. `physical`: the ids stored are physical (a per-layer
    permutation of 2E slots, the map sending them back). Returns (path, the model layer of each trace layer)."""
    import torch

    Tn, Ln, k = ids.shape
    model_layers = [i if dense is None or i < dense else i + 1 for i in range(Ln)]
    n_model = Ln + (dense is not None)
    rng = np.random.default_rng(1)
    P = 2 * E if physical else E
    p2l = np.tile(np.arange(P) % E, (n_model, 1))  # [layers, P]
    store = ids.copy()
    if physical:  # expert e's replica lives at a random one of its two physical slots
        for li, ml in enumerate(model_layers):
            perm = rng.permutation(P)
            p2l[ml] = perm % E
            replicas = np.stack([np.flatnonzero(p2l[ml] == e) for e in range(E)])  # [E, 2] physical slots
            choice = rng.integers(0, 2, size=ids[:, li].shape)
            store[:, li] = replicas[ids[:, li], choice]
    full = np.full((n_model, Tn, slots), -1, np.int32)
    for li, ml in enumerate(model_layers):
        full[ml, :, :k] = store[:, li]
    if top:
        obj = {"topk_ids_of_layer": torch.from_numpy(full)}
    else:
        cuts = np.cumsum([0, *passes])
        obj = {"records": [{"forward_pass_id": i, "rank": 0, "forward_mode": 1,
                            "positions": list(range(int(b - a))),
                            "topk_ids_of_layer": torch.from_numpy(full[:, a:b].copy()), "misc_objects": []}
                           for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))],
               "last_physical_to_logical_map": torch.from_numpy(p2l)}
    torch.save(obj, path)
    return path, np.array(model_layers)


def check_import(trace: Trace, ids: np.ndarray, layer_ids) -> None:
    assert np.array_equal(trace.topk_ids, ids)
    assert trace.meta.gate_weights is False and np.isnan(trace.topk_weights).all()
    assert trace.M == trace.k == ids.shape[2] and np.array_equal(trace.ranking, ids)
    assert trace.meta.layer_ids == tuple(int(x) for x in layer_ids) and trace.E == E and trace.valid.all()


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", ["npy", "npz-routed_experts", "npz-topk_ids", "npz-only-array", "json", "json-object"])
@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_vllm_and_sglang_arrays_round_trip(tmp_path, fmt, layout):
    ids = known_ids()
    path = tmp_path / f"dump.{layout.split('-')[0]}"
    if layout == "npy":
        np.save(path, ids)
    elif layout.startswith("npz"):
        name = {"npz-routed_experts": "routed_experts", "npz-topk_ids": "topk_ids", "npz-only-array": "r0"}[layout]
        extra = {"prompt_token_ids": np.arange(T)} if layout != "npz-only-array" else {}
        np.savez(path, **{name: ids}, **extra)
    elif layout == "json":
        path.write_text(json.dumps(ids.tolist()))
    else:
        path.write_text(json.dumps({"routed_experts": ids.tolist(), "text": "x"}))
    check_import(import_routing(path, fmt, E), ids, range(L))


def test_vllm_dense_layers_are_left_out(tmp_path):
    """vLLM keeps a row of zeros for a dense layer: that layer is left out, the others keep their model index."""
    ids = known_ids()
    full = np.zeros((T, L + 1, K), np.int64)
    full[:, [0, 2, 3]] = ids
    np.save(tmp_path / "d.npy", full)
    check_import(import_routing(tmp_path / "d.npy", "vllm", E), ids, [0, 2, 3])


@pytest.mark.parametrize("variant", ["records", "physical", "top-level"])
def test_sglang_per_token_dump_round_trips(tmp_path, variant):
    ids = known_ids(3)
    path, model_layers = sglang_pt(tmp_path / "expert_distribution_recorder_1.0_0.pt", ids, [12, 1, 1, 16],
                                   dense=1, physical=variant == "physical", top=variant == "top-level")
    tr = import_routing(path, "sglang-pt", E)
    check_import(tr, ids, model_layers)
    if variant != "top-level":  # one sequence per forward pass
        assert np.array_equal(tr.seq_id, np.repeat(np.arange(4), [12, 1, 1, 16]))


@pytest.mark.parametrize("top_k", [None, K])
def test_llamacpp_moe_trace_csv_round_trips(tmp_path, top_k):
    """A prompt in ubatches of 12 and 8 tokens, then one token per step; MoE layers 1, 3, 4 (k from the one-token
    steps when --top-k is not given)."""
    ids = known_ids(5)
    path = moe_trace_csv(tmp_path / "moe_trace.csv", ids, [1, 3, 4], [12, 8] + [1] * 10)
    check_import(import_routing(path, "llamacpp-csv", E, top_k), ids, [1, 3, 4])
    headerless = moe_trace_csv(tmp_path / "bare.csv", ids, [1, 3, 4], [12, 8] + [1] * 10, header=False)
    check_import(import_routing(headerless, "llamacpp-csv", E, top_k), ids, [1, 3, 4])


def test_pos_csv_round_trips_with_its_sequences(tmp_path):
    ids = known_ids(7)
    pos = np.r_[np.arange(20), np.arange(10)]  # two prompts: pos goes back to 0 at token 20
    path = pos_csv(tmp_path / "routing.csv", ids, [0, 2, 5], pos, [8, 8, 4, 10])
    tr = import_routing(path, "pos-csv", E)
    check_import(tr, ids, [0, 2, 5])
    assert np.array_equal(tr.seq_id, np.r_[np.zeros(20), np.ones(10)]) and np.array_equal(tr.position, pos)


def test_record_cli_writes_a_weightless_trace_that_loads_back(tmp_path, capsys):
    from runtime.cli import main

    ids = known_ids(9)
    np.save(tmp_path / "r.npy", ids)
    for out in (tmp_path / "t.parquet", tmp_path / "t.arrow"):
        main(["record", "--routing", str(tmp_path / "r.npy"), "--routing-format", "vllm", "--experts", str(E),
              "--out", str(out)])
        assert capsys.readouterr().out.strip() == str(out)
        tr = load_trace(out)
        check_import(tr, ids, range(L))
    import pyarrow.parquet as pq

    schema = pq.read_schema(tmp_path / "t.parquet")
    assert "topk_weights" not in schema.names  # a reader that predates the flag refuses the file, not misreads it
    assert json.loads(schema.metadata[b"expertsweep"])["gate_weights"] is False


def test_weightless_traces_are_validated(tmp_path):
    """A weightless trace must hold NaN weights; a file that says so must not carry a weights column."""
    import dataclasses

    tr = import_routing(_npy(tmp_path, known_ids()), "vllm", E)
    bad = dataclasses.replace(tr, topk_weights=np.zeros_like(tr.topk_weights))
    with pytest.raises(InputError, match=r"topk_weights\[0, 0, 0\] = 0.0 but meta gate_weights = False"):
        save_trace(bad, tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()
    weighted = synthetic_trace(20, 2, 8, 2, seed=0)
    save_trace(weighted, tmp_path / "w.parquet")
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "w.parquet")
    meta = json.loads(table.schema.metadata[b"expertsweep"])
    table = table.replace_schema_metadata({b"expertsweep": json.dumps({**meta, "gate_weights": False}).encode()})
    pq.write_table(table, tmp_path / "flipped.parquet")
    with pytest.raises(InputError, match="gate_weights = false but the file has a 'topk_weights' column"):
        load_trace(tmp_path / "flipped.parquet")


def _npy(tmp_path: Path, ids: np.ndarray, name: str = "r.npy") -> Path:
    np.save(tmp_path / name, ids)
    return tmp_path / name


# ---------------------------------------------------------------------------------------------- bad files


def _bad_files(tmp: Path) -> list[tuple[str, Path, list[str], str]]:
    """(format, file, extra flags, what the one-line error must say)."""
    ids = known_ids()
    out_of_range = ids.copy()
    out_of_range[2, 1, 3] = E
    dup = ids.copy()
    dup[4, 2, 1] = dup[4, 2, 0]
    ragged = ids.tolist()
    ragged[3][1] = ragged[3][1][:3]
    floats = ids.astype(np.float64)
    csv = moe_trace_csv(tmp / "ok.csv", ids, [0, 1, 2], [10] + [1] * 20).read_text().splitlines()
    line_of_first_layer1 = next(i for i, r in enumerate(csv, 1) if r.startswith("1,"))
    two_arrays = tmp / "two.npz"
    np.savez(two_arrays, experts=ids, other=ids)
    import fractions

    import torch

    torch.save({"records": [{"topk_ids": torch.zeros(3, 2, 8, dtype=torch.int32)}]}, tmp / "nokey.pt")
    torch.save({"topk_ids_of_layer": torch.zeros(3, 2, 8)}, tmp / "float.pt")
    torch.save({"x": fractions.Fraction(1, 3)}, tmp / "pickled.pt")

    def write(name: str, text: str) -> Path:
        (tmp / name).write_text(text)
        return tmp / name

    pos_rows = pos_csv(tmp / "pos_ok.csv", ids, [0, 1, 2], np.arange(T), [T]).read_text().splitlines()
    return [
        ("vllm", _npy(tmp, out_of_range, "range.npy"), [], r"range\.npy: array\[2, 1, 3\] = 16 is out of range \[0, 16\)"),
        ("vllm", _npy(tmp, dup, "dup.npy"), [], r"dup\.npy: array\[4, 2\] repeats expert \d+ \(at 0, 1\)"),
        ("vllm", _npy(tmp, floats, "float.npy"), [], r"float\.npy: array has dtype float64, expected integers"),
        ("vllm", _npy(tmp, ids.reshape(T, L * K), "flat.npy"), [], r"flat\.npy: array has shape \(30, 12\), expected \[tokens, layers, top_k\]"),
        ("sglang", write("ragged.json", json.dumps(ragged)), [], r"ragged\.json: ids\[3, 1\] has 3 entries, expected 4"),
        ("sglang", write("floats.json", json.dumps(floats.tolist())), [], r"floats\.json: ids\[0, 0, 0\] = 0?\d+\.0, expected an integer"),
        ("sglang", write("nokey.json", json.dumps({"meta_info": {}})), [], r"nokey\.json: key 'routed_experts' is missing"),
        ("vllm", two_arrays, [], r"two\.npz: no array named routed_experts or topk_ids \(arrays: experts, other\)"),
        ("vllm", _npy(tmp, ids, "k.npy"), ["--top-k", "3"], r"k\.npy: --top-k = 3 but array holds k = 4"),
        ("sglang-pt", tmp / "nokey.pt", [], r"nokey\.pt: records\[0\] has no key 'topk_ids_of_layer'"),
        ("sglang-pt", tmp / "float.pt", [], r"float\.pt: topk_ids_of_layer has dtype torch\.float32, expected integers"),
        ("sglang-pt", tmp / "pickled.pt", [], r"pickled\.pt: not a torch file readable with weights_only=True"),
        ("llamacpp-csv", write("short.csv", "\n".join(csv[:-1]) + "\n"), ["--top-k", "4"],
         rf"short\.csv: lines {len(csv) - 3}-{len(csv) - 1} \(layer 2\) hold 3 rows, not a multiple of k = 4$"),
        ("llamacpp-csv", tmp / "short.csv", [], rf"short\.csv: lines 2-41 \(layer 0\) hold 40 rows, not a multiple of "
         rf"k = 3 \(k inferred: the shortest run of one layer's rows, lines {len(csv) - 3}-{len(csv) - 1} \(layer 2\); "
         r"give --top-k\)"),
        ("llamacpp-csv", write("range.csv", "\n".join(csv[:5] + ["0,99"] + csv[6:]) + "\n"), [],
         r"range\.csv: line 6: expert 99 is out of range \[0, 16\)"),
        ("llamacpp-csv", write("dupe.csv", "\n".join(csv[:2] + [csv[1]] + csv[3:]) + "\n"), [],
         r"dupe\.csv: line 3: expert \d+ repeated within one token's top-k at one layer \(lines 2, 3\)"),
        ("llamacpp-csv", write("text.csv", "\n".join(csv[:7] + ["0,x"] + csv[8:]) + "\n"), [],
         r"text\.csv: line 8: 'x' is not an integer \(columns layer,expert\)"),
        ("llamacpp-csv", write("column.csv", "\n".join(csv[:9] + ["3"] + csv[10:]) + "\n"), [],
         r"column\.csv: line 10 has 1 fields, expected 2 \(columns layer,expert\)"),
        ("llamacpp-csv", write("layers.csv", "\n".join(csv[:line_of_first_layer1 - 1]
                                                      + csv[line_of_first_layer1 - 1 + 4 * 10:]) + "\n"), [],
         r"layers\.csv: layer 0 has 30 tokens but layer 1 has 20 \(ragged"),
        ("llamacpp-csv", write("ubatch.csv", _shifted_ubatch(ids)), ["--top-k", "4"],
         r"ubatch\.csv: lines 14-21 \(layer 1\) hold 2 token\(s\) where layer 0's matching ubatch holds 3 "
         r"\(each ubatch lists every MoE layer with the same tokens\)"),
        ("pos-csv", write("missing.csv", "\n".join(pos_rows[:4] + [pos_rows[4].rsplit(",", 1)[0]] + pos_rows[5:]) + "\n"),
         [], r"missing\.csv: line 5 has 5 fields, expected 6"),
        ("pos-csv", write("pos.csv", "\n".join(pos_rows[:T + 3] + ["7" + pos_rows[T + 3][pos_rows[T + 3].index(","):]]
                                                + pos_rows[T + 4:]) + "\n"), [],
         rf"pos\.csv: line {T + 4}: token 2 of layer 1 has pos 7, but layer 0's token 2 \(line 4\) has pos 2"),
    ]


def _shifted_ubatch(ids: np.ndarray) -> str:
    """Two layers, two ubatches of 3 tokens; layer 1 moves a token from its first ubatch to its second (the totals
    agree, the ubatches do not)."""
    rows = ["layer,expert"]
    for t0, t1, shift in ((0, 3, 1), (3, 6, -1)):
        rows += [f"0,{e}" for t in range(t0, t1) for e in ids[t, 0]]
        rows += [f"1,{e}" for t in range(t0, t1 - shift) for e in ids[t, 1]]
    return "\n".join(rows) + "\n"


def test_bad_files_are_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    from runtime.cli import main

    out = tmp_path / "out.parquet"
    cases = _bad_files(tmp_path)
    for fmt, path, extra, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(["record", "--routing", str(path), "--routing-format", fmt, "--experts", str(E), "--out", str(out),
                  *extra])
        err = capsys.readouterr().err
        assert exc.value.code == 2, (path, err)
        assert err.startswith("expertsweep: error: ") and err.count("\n") == 1, err
        assert re.search(message, err.rstrip("\n")), (message, err)
        assert not out.exists() and not list(tmp_path.glob(".out.parquet.*"))


@pytest.mark.parametrize("argv, message", [
    (["--routing", "R", "--routing-format", "vllm", "--out", "O.parquet"], "--routing R: --experts is required"),
    (["--routing", "R", "--experts", "16", "--out", "O.parquet"], "--routing R: --routing-format is required"),
    (["--routing", "R", "--routing-format", "vllm", "--experts", "16", "--model", "M", "--out", "O.parquet"],
     "--routing R and --model: give one of them"),
    (["--routing", "R", "--routing-format", "vllm", "--experts", "16", "--lookahead", "4", "--out", "O.parquet"],
     "--routing R and --lookahead: give one of them"),
    (["--routing", "R", "--routing-format", "vlm", "--experts", "16", "--out", "O.parquet"],
     "--routing-format = 'vlm' is unknown"),
    (["--routing", "R", "--routing-format", "vllm", "--experts", "16", "--out", "O.npz"], "--out O.npz: use a .parquet"),
    (["--experts", "16", "--out", "O.parquet"], "--experts needs --routing FILE"),
    (["--text", "T", "--out", "O.parquet"], "--model required (or --routing FILE"),
])
def test_record_flags_are_checked(tmp_path, monkeypatch, argv, message):
    from runtime.tools.record import main

    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "R", known_ids())
    (tmp_path / "R.npy").rename(tmp_path / "R")
    with pytest.raises(InputError, match=re.escape(message)):
        main(argv)
    assert not list(tmp_path.glob("O.*"))


def test_a_bad_dump_fails_cleanly_as_users_run_it(tmp_path):
    """`python -m runtime.record` in a subprocess: one line on stderr, exit 2, no output file."""
    ids = known_ids()
    ids[0, 0, 0] = 99
    np.save(tmp_path / "bad.npy", ids)
    out = tmp_path / "t.parquet"
    r = subprocess.run([sys.executable, "-m", "runtime.record", "--routing", str(tmp_path / "bad.npy"),
                        "--routing-format", "vllm", "--experts", str(E), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"expertsweep: error: {tmp_path / 'bad.npy'}: array[0, 0, 0] = 99 is out of range [0, 16)\n"
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- the simulator

# the policies that read no gate weight (fetch-every-miss, every eviction kind, host-compute, the fetch cap and
# first choice with fallback host, prefetch oracle, pinning) and one per reader of GATE_WEIGHT_READERS
WEIGHT_FREE = {
    "fetch-every-miss": PRESETS["fetch-every-miss"],
    "host-compute": PRESETS["host-compute"],
    "first-choice-host-lru": PolicyConfig(rule="first_choice", fallback="host", evict="lru"),
    "cap-host-s3fifo": PolicyConfig(rule="fetch_all", fetch_cap=1, fallback="host", evict="s3fifo"),
    "crf-oracle": PolicyConfig(evict="crf", prefetch="oracle", prefetch_n=2),
    "lfuda": PolicyConfig(evict="lfuda"),
    "lfu-aged": PolicyConfig(evict="lfu", gamma=0.9),
    "belady": PolicyConfig(evict="belady"),
}
WEIGHT_READING = {
    "rule-0.15": (PRESETS["rule-0.15"], "rule = 'threshold'"),
    "band": (PolicyConfig(rule="band", tau=0.1, tau_high=0.3), "rule = 'band'"),
    "first-choice": (PRESETS["first-choice"], "fallback = 'substitute'"),
    "drop": (PolicyConfig(rule="substitute_all", fallback="drop"), "fallback = 'drop'"),
    "cap-lowbit": (PolicyConfig(rule="fetch_all", fetch_cap=1, fallback="lowbit"), "fallback = 'lowbit'"),
    "speed-first-host": (PolicyConfig(rule="first_choice", fallback="host", beta=0.5), "beta = 0.5"),
    "cache-route": (PRESETS["cache-route"], "route = 'cache-route'"),
}


@pytest.fixture(scope="module")
def twins() -> tuple[Trace, Trace]:
    """A synthetic trace (gate weights, ranking 8 deep) and the same ids as a vLLM dump imported."""
    import tempfile

    tr = synthetic_trace(600, 3, 32, 4, 8, seed=2, seq_len=600)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.npy"
        np.save(path, tr.topk_ids)
        ids_only = import_routing(path, "vllm", 32)
    return tr, ids_only


def test_policies_that_read_gate_weights_are_marked_so():
    """The table's verdicts (what the simulator refuses below rests on them)."""
    assert all(not gate_weight_readers(p) for p in WEIGHT_FREE.values())
    for pol, reader in WEIGHT_READING.values():
        (field, _), *_ = gate_weight_readers(pol)
        assert reader.startswith(field + " = ")


@pytest.mark.parametrize("name", sorted(WEIGHT_READING))
def test_a_weight_reading_policy_is_refused_on_a_weightless_trace(twins, name):
    from runtime.backends.simulate import simulate

    _, ids_only = twins
    pol, reader = WEIGHT_READING[name]
    with pytest.raises(InputError) as exc:
        simulate(ids_only, pol, 10, initial_residency="cold", baselines=False)
    msg = str(exc.value)
    assert f"policy {pol.label()!r} needs the trace column topk_weights" in msg and reader in msg, msg


def test_the_simulator_command_refuses_one_line_exit_2(tmp_path):
    ids_only = import_routing(_npy(tmp_path, known_ids()), "vllm", E)
    save_trace(ids_only, tmp_path / "t.parquet")
    r = subprocess.run([sys.executable, "-m", "runtime.simulate", "--trace", str(tmp_path / "t.parquet"),
                        "--policy", "quality-first", "--capacity", "8", "--initial-residency", "cold",
                        "--out", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "policy 'threshold(0.15) + lfu + beta=0.5 + buffers=1' needs the trace column topk_weights" in r.stderr
    assert not (tmp_path / "r.json").exists()


def test_weight_free_policies_replay_a_weightless_trace_as_its_weighted_original(twins):
    """Same hits, fetches and every other counter on the ids alone as on the trace with gate weights and a deeper
    ranking: nothing these policies decide reads what the import lacks."""
    from runtime.backends.simulate import simulate

    weighted, ids_only = twins
    assert weighted.meta.gate_weights and not ids_only.meta.gate_weights and ids_only.M == 4 < weighted.M
    for name, pol in WEIGHT_FREE.items():
        a = simulate(weighted, pol, 10, initial_residency="cold", baselines=False)
        b = simulate(ids_only, pol, 10, initial_residency="cold", baselines=False)
        assert a.counters == b.counters, name
        assert b.counters["fetches"] + b.counters["host_computes"] > 0, name
        assert b.counters["hits"] > 0 or pol.rule == "substitute_all", name  # host-compute from cold: no hit
        assert b.mass_per_token == 0.0, name
    # pinning and calibrated capacities need a warm start: the held-out last 20% of the same ids
    for pol in (PolicyConfig(evict="lfu", pin_fraction=0.25), PolicyConfig(capacity_alloc="calibrated", evict="lru")):
        a = simulate(weighted, pol, 10, baselines=False)
        b = simulate(ids_only, pol, 10, baselines=False)
        assert a.counters == b.counters and a.initial_residency.startswith("held-out"), pol.label()


def _shared_traces() -> Path | None:
    """../shared/data/traces beside the checkout (a worktree one level deeper finds it one level up)."""
    for base in (ROOT.parent, ROOT.parent.parent):
        if (base / "shared" / "data" / "traces").is_dir():
            return base / "shared" / "data" / "traces"
    return None


def test_real_vllm_routing_imported_as_ids_replays_as_the_weighted_dump(tmp_path):
    """../shared's Qwen1.5-MoE vLLM routing (skipped without ../shared): its ids alone, written in vLLM's
    routed_experts layout [tokens, layers, top_k] and imported, give fetch-every-miss (and LRU host-compute) the
    same hits and fetches as the weighted dump loaded as it is."""
    from runtime.backends.simulate import simulate

    folder = _shared_traces()
    if folder is None or not (folder / "qwen15moe-a2.7b-gsm8k.npz").is_file():
        pytest.skip("../shared/data/traces/qwen15moe-a2.7b-gsm8k.npz absent (a checkout without ../shared)")
    weighted = load_trace(folder / "qwen15moe-a2.7b-gsm8k.npz")
    with np.load(folder / "qwen15moe-a2.7b-gsm8k.npz") as z:
        np.savez(tmp_path / "routed.npz", routed_experts=z["topk_ids"])  # what vLLM returns: ids only
    ids_only = import_routing(tmp_path / "routed.npz", "vllm", weighted.E)
    assert np.array_equal(ids_only.topk_ids, weighted.topk_ids) and not ids_only.meta.gate_weights
    for pol in (PRESETS["fetch-every-miss"], PolicyConfig(rule="first_choice", fallback="host", evict="lru")):
        a = simulate(weighted, pol, 15, initial_residency="cold", baselines=False)
        b = simulate(ids_only, pol, 15, initial_residency="cold", baselines=False)
        assert a.counters == b.counters and a.counters["fetches"] > 1000, (pol.label(), a.counters, b.counters)
        assert a.counters["hits"] > 0


# ---------------------------------------------------------------------------------------------- the sweep


def test_a_sweep_on_a_weightless_trace_leaves_the_weight_reading_dimensions_out(tmp_path, caplog):
    """demo.yaml's space on an imported trace: no threshold / band, tau, beta, route or weight-accounting fallback;
    no trial the reduced space draws reads gate weights (the full space draws many), and one logged line says what
    was left out; a weighted trace's sweep is left as it is."""
    import optuna
    import yaml

    from sweep import config as sweep_config
    from sweep.space import parse_space

    space = yaml.safe_load((ROOT / "search_spaces" / "demo.yaml").read_text())["space"]
    space = {**space, "vram_budget_GiB": 2.0}
    save_trace(import_routing(_npy(tmp_path, known_ids()), "vllm", E), tmp_path / "ids.parquet")
    base = {"name": "t", "hosts": ["rtx3090"], "space": space}
    cfg = sweep_config.from_dict({**base, "trace": str(tmp_path / "ids.parquet")}, "demo.yaml")
    with caplog.at_level(logging.WARNING, logger="sweep.config"):
        fit = sweep_config.fit_to_trace(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "sweep.config"]
    assert len(lines) == 1 and "has no gate weights" in lines[0], lines
    for left_out in ("rule = threshold", "tau", "beta other than off", "admission_delay", "route = cache-prior",
                     "route_lambda", "fallback = substitute", "fallback = lowbit", "lowbit_bits",
                     "prefetch lookahead (no lookahead column)",
                     "baselines rule-0.15, first-choice, substitute-all, quality-first, speed-first"):
        assert left_out in lines[0], (left_out, lines[0])
    assert fit.baseline_policies == ("fetch-every-miss", "host-compute", "llamacpp-lru", "llamacpp-ncmoe")
    assert fit.space["rule"].values() == ("first_choice", "substitute_all", "fetch_all")
    assert fit.space["fallback"].values() == ("host",) and fit.space["beta"].values() == (None,)
    assert fit.space["prefetch"].values() == ("off", "oracle")  # an import has no lookahead column to replay
    assert not {"tau", "admission_delay", "route_lambda", "route_window", "lowbit_bits"} & set(fit.space.names)
    assert {"evict", "gamma", "half_life", "prefetch", "capacity_fraction"} - {"capacity_fraction"} <= set(
        fit.space.searched())

    def drawn(sp) -> list[PolicyConfig]:
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        return [PolicyConfig(**{k: v for k, v in sp.sample(study.ask()).items() if k != "vram_budget_GiB"})
                for _ in range(300)]

    assert sum(bool(gate_weight_readers(p)) for p in drawn(parse_space(space))) > 150
    reduced = drawn(fit.space)
    assert not [p.label() for p in reduced if gate_weight_readers(p)]
    assert len({p.rule for p in reduced}) == 3
    # fit_to_budget (where the sweep calls it) does it too; a weighted trace, or none, is left as it is
    by_fraction = {k: v for k, v in space.items() if k != "vram_budget_GiB"} | {"capacity_fraction": 0.25}
    frac = sweep_config.from_dict({**base, "space": by_fraction, "trace": str(tmp_path / "ids.parquet")}, "demo.yaml")
    assert "tau" not in sweep_config.fit_to_budget(frac, None).space.names and "tau" in frac.space.names
    # a synthetic trace has no router_scores column: the space without Cache-Prior routing for the weighted cases
    no_route = {**base, "space": {k: v for k, v in space.items() if not k.startswith("route")}}
    save_trace(synthetic_trace(20, 2, E, K, seed=0, lookahead_depth=K), tmp_path / "w.parquet")
    weighted = sweep_config.from_dict({**no_route, "trace": str(tmp_path / "w.parquet")}, "demo.yaml")
    assert sweep_config.fit_to_trace(weighted) is weighted
    # a weighted trace recorded without --lookahead: only prefetch lookahead is left out, said in one line
    save_trace(synthetic_trace(20, 2, E, K, seed=0), tmp_path / "nolook.parquet")
    no_look = sweep_config.from_dict({**no_route, "trace": str(tmp_path / "nolook.parquet")}, "demo.yaml")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sweep.config"):
        fit = sweep_config.fit_to_trace(no_look)
    lines = [r.getMessage() for r in caplog.records if r.name == "sweep.config"]
    assert len(lines) == 1 and lines[0].endswith("left out of the search: prefetch lookahead (no lookahead column)")
    assert fit.space["prefetch"].values() == ("off", "oracle") and fit.space["tau"] == no_look.space["tau"]
    # and without --router-scores: route cache-prior and the baselines that replay it go too, in the same line
    scores = sweep_config.from_dict({**base, "trace": str(tmp_path / "nolook.parquet"),
                                     "baselines": {"policies": ["fetch-every-miss", "cache-prior"]}}, "demo.yaml")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sweep.config"):
        fit = sweep_config.fit_to_trace(scores)
    lines = [r.getMessage() for r in caplog.records if r.name == "sweep.config"]
    assert len(lines) == 1 and "has no router_scores column and no lookahead column)" in lines[0], lines
    assert lines[0].endswith("route cache-prior (no router_scores column), prefetch lookahead (no lookahead column)"
                             "; baselines cache-prior"), lines[0]
    assert "cache-prior" not in fit.space["route"].values() and fit.baseline_policies == ("fetch-every-miss",)
    none = sweep_config.from_dict(base, "demo.yaml")
    assert sweep_config.fit_to_trace(none) is none


def test_a_space_that_only_reads_gate_weights_is_one_line(tmp_path):
    from sweep import config as sweep_config

    save_trace(import_routing(_npy(tmp_path, known_ids()), "vllm", E), tmp_path / "ids.parquet")
    space = {"rule": {"choices": ["threshold", "band"]}, "tau": {"low": 0.05, "high": 0.2},
             "tau_high": {"low": 0.3, "high": 0.5}, "capacity_fraction": {"low": 0.2, "high": 0.5}}
    cfg = sweep_config.from_dict({"name": "t", "space": space, "trace": str(tmp_path / "ids.parquet")}, "x.yaml")
    with pytest.raises(InputError, match=r"x\.yaml: space \(trace ids\.parquet has no gate weights\): every policy "
                                         r"of the space reads gate weights"):
        sweep_config.fit_to_trace(cfg)
