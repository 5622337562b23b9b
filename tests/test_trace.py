"""Trace formats, .npz import, validation messages and the synthetic generator (runtime/formats/trace/)."""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.core.errors import InputError, atomic_write, cli_main
from runtime.formats.trace import (
    Trace,
    TraceMeta,
    _top_m_stable,
    calibration_split,
    calibration_twin,
    load_trace,
    save_trace,
    synthetic_pair,
    synthetic_trace,
    validate_trace,
)

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
FIELDS = ("topk_ids", "topk_weights", "ranking", "valid", "seq_id", "position")


def assert_same(a: Trace, b: Trace) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype, f
        assert np.array_equal(x, y), f
    assert a.meta == b.meta


def small_trace(T: int = 40, L: int = 3, E: int = 16, k: int = 3, M: int = 6, **kw) -> Trace:
    return synthetic_trace(T, L, E, k, M, seq_len=10, **kw)


def base_npz() -> dict[str, np.ndarray]:
    """A valid recorder dump: T=4, L=2, k=2, E=8, ranking M=3."""
    ids = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 0], [3, 2]], [[7, 6], [5, 4]]], np.int32)
    w = np.tile(np.array([0.7, 0.3], np.float32), (4, 2, 1))
    extra = np.array([[[2], [0]], [[0], [0]], [[2], [0]], [[0], [0]]], np.int32)
    return {"topk_ids": ids, "topk_weights": w, "ranking": np.concatenate([ids, extra], -1),
            "num_experts": np.array(8), "top_k": np.array(2)}


def write_npz(tmp_path: Path, name: str = "trace.npz", **fields) -> Path:
    d = base_npz()
    for key, v in fields.items():
        if v is None:
            d.pop(key)
        else:
            d[key] = v
    p = tmp_path / name
    np.savez(p, **d)
    return p


def expect_error(path, *fragments: str, **kw) -> str:
    with pytest.raises(InputError) as ei:
        load_trace(path, **kw)
    msg = str(ei.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)
    return msg


# ---------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_round_trip_exact(tmp_path, suffix):
    tr = small_trace(weight_norm="softmax_all", seed=3)
    meta = dataclasses.replace(tr.meta, model="Qwen/Qwen3-Next-80B-A3B", layer_ids=(5, 9, 47),
                               text_sha256="ab" * 32)
    tr = dataclasses.replace(tr, meta=meta)
    # a few recorder losses, already in normal form (ids 0..k-1, ranking 0..M-1, weight 0)
    tr.valid[[2, 7, 7], [0, 1, 2]] = False
    tr.topk_ids[~tr.valid] = np.arange(tr.k)
    tr.ranking[~tr.valid] = np.arange(tr.M)
    tr.topk_weights[~tr.valid] = 0
    p = tmp_path / f"t{suffix}"
    save_trace(tr, p)
    back = load_trace(p)
    assert_same(tr, back)
    assert (back.T, back.L, back.k, back.M, back.E) == (40, 3, 3, 6, 16)
    assert back.topk_ids.flags.c_contiguous and back.topk_ids.flags.writeable
    assert sorted(os.listdir(tmp_path)) == [p.name]  # no temp file left behind


@settings(max_examples=15, deadline=None)
@given(T=st.integers(1, 30), L=st.integers(1, 4), E=st.integers(1, 12), data=st.data())
def test_round_trip_property(T, L, E, data):
    k = data.draw(st.integers(1, E))
    M = data.draw(st.integers(k, E))
    suffix = data.draw(st.sampled_from([".parquet", ".arrow"]))
    tr = synthetic_trace(T, L, E, k, M, seed=data.draw(st.integers(0, 2**32 - 1)),
                         seq_len=data.draw(st.integers(1, 8)), skew=data.draw(st.floats(0, 3)))
    validate_trace(tr)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"t{suffix}"
        save_trace(tr, p)
        assert_same(tr, load_trace(p))


def test_parquet_schema_and_metadata(tmp_path):
    tr = small_trace()
    p = tmp_path / "t.parquet"
    save_trace(tr, p)
    schema = pq.read_schema(p)
    assert schema.names == ["token", "seq_id", "position", "layer", "valid", "topk_ids",
                            "topk_weights", "ranking"]
    assert schema.field("layer").type == pa.int16()
    assert schema.field("ranking").type == pa.list_(pa.int32(), 6)
    assert schema.field("topk_weights").type == pa.list_(pa.float32(), 3)
    assert b'"format_version": 1' in schema.metadata[b"expertsweep"]
    table = pq.read_table(p)
    assert table.num_rows == tr.T * tr.L
    assert table.column("token").to_pylist()[:4] == [0, 0, 0, 1]
    assert table.column("layer").to_pylist()[:4] == [0, 1, 2, 0]


def test_rows_in_any_order_and_plain_lists(tmp_path):
    tr = small_trace()
    p = tmp_path / "t.parquet"
    save_trace(tr, p)
    table = pq.read_table(p)
    perm = np.random.default_rng(0).permutation(table.num_rows)
    shuffled = table.take(pa.array(perm))
    # variable-length lists (as another tool might write them) are accepted too
    ids = shuffled.column("topk_ids").combine_chunks()
    plain = pa.ListArray.from_arrays(pa.array(np.arange(0, len(ids) * 3 + 1, 3, dtype=np.int32)),
                                     ids.flatten())
    shuffled = shuffled.set_column(5, pa.field("topk_ids", pa.list_(pa.int32())), plain)
    q = tmp_path / "shuffled.parquet"
    pq.write_table(shuffled.replace_schema_metadata(table.schema.metadata), q)
    assert_same(tr, load_trace(q))


def test_missing_row_and_inconsistent_seq(tmp_path):
    tr = small_trace()
    p = tmp_path / "t.parquet"
    save_trace(tr, p)
    table = pq.read_table(p)
    q = tmp_path / "dup.parquet"
    token = table.column("token").to_numpy().copy()
    token[5] = 0  # (token 0, layer 2) twice, (token 1, layer 2) missing
    pq.write_table(table.set_column(0, table.schema.field("token"), pa.array(token)), q)
    expect_error(q, "dup.parquet", "exactly once", "token")
    seq = table.column("seq_id").to_numpy().copy()
    seq[4] = 99
    pq.write_table(table.set_column(1, table.schema.field("seq_id"), pa.array(seq)), q)
    expect_error(q, "seq_id", "token 1", "99")


def test_num_experts_override(tmp_path):
    tr = small_trace(E=16)
    p = tmp_path / "t.arrow"
    save_trace(tr, p)
    assert load_trace(p, num_experts=32).E == 32
    expect_error(p, "t.arrow: ranking depth M = 6 exceeds num_experts E = 3", num_experts=3)
    with pytest.raises(InputError, match="num_experts = 0"):
        load_trace(p, num_experts=0)


def test_large_round_trip(tmp_path):
    tr = synthetic_trace(500, 48, 512, 10, 64)
    for suffix in (".parquet", ".arrow"):
        p = tmp_path / f"big{suffix}"
        save_trace(tr, p)
        back = load_trace(p)
        assert np.array_equal(back.ranking, tr.ranking) and np.array_equal(back.topk_weights, tr.topk_weights)


# ---------------------------------------------------------------------------------- npz import


def test_npz_import_defaults(tmp_path):
    p = write_npz(tmp_path)
    tr = load_trace(p)
    d = base_npz()
    assert np.array_equal(tr.topk_ids, d["topk_ids"]) and tr.topk_ids.dtype == np.int32
    assert np.array_equal(tr.ranking, d["ranking"]) and tr.M == 3
    assert tr.valid.all() and (tr.seq_id == 0).all() and list(tr.position) == [0, 1, 2, 3]
    assert tr.meta == TraceMeta(model="unknown", num_experts=8, top_k=2, ranking_depth=3,
                                layer_ids=(0, 1), weight_norm="softmax_topk", source="trace.npz")


def test_npz_import_options(tmp_path):
    w = np.tile(np.array([0.5, 0.2], np.float32), (4, 2, 1))
    p = write_npz(tmp_path, ranking=None, num_experts=None, top_k=None, topk_weights=w,
                  layers=np.array([3, 11]), call_idx=np.array([0, 0, 1, 0]),
                  is_prefill=np.ones(4, bool))
    tr = load_trace(p)
    assert tr.E == 8  # max id + 1
    assert tr.M == tr.k == 2 and np.array_equal(tr.ranking, tr.topk_ids)
    assert tr.meta.layer_ids == (3, 11) and tr.meta.weight_norm == "softmax_all"
    assert list(tr.seq_id) == [0, 0, 1, 0] and list(tr.position) == [0, 1, 0, 2]
    assert load_trace(p, num_experts=20).E == 20


def test_npz_invalid_cells_normalised(tmp_path):
    ids = base_npz()["topk_ids"].copy()
    w = base_npz()["topk_weights"].copy()
    r = base_npz()["ranking"].copy()
    valid = np.ones((4, 2), bool)
    valid[1, 0] = valid[3, 1] = False
    ids[~valid] = -1
    w[~valid] = np.nan
    r[~valid] = 99
    tr = load_trace(write_npz(tmp_path, topk_ids=ids, topk_weights=w, ranking=r, valid=valid))
    assert np.array_equal(tr.topk_ids[~valid], [[0, 1], [0, 1]])
    assert np.array_equal(tr.ranking[~valid], [[0, 1, 2], [0, 1, 2]])
    assert (tr.topk_weights[~valid] == 0).all() and np.isfinite(tr.topk_weights).all()
    assert np.array_equal(tr.topk_ids[valid], base_npz()["topk_ids"][valid])
    # a valid cell with the same garbage is an error
    valid[1, 0] = True
    expect_error(write_npz(tmp_path, topk_ids=ids, topk_weights=w, ranking=r, valid=valid),
                 "topk_ids[1, 0, 0] = -1 is out of range [0, 8)")


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="../shared/data/traces not available")
def test_real_mixtral_trace():
    tr = load_trace(SHARED_TRACES / "mixtral-8x7b-humaneval0.npz")
    assert (tr.T, tr.L, tr.k, tr.M, tr.E) == (218, 32, 2, 2, 8)
    assert tr.meta.weight_norm == "softmax_topk"
    n_bad = int((~tr.valid).sum())
    assert 0 < n_bad < 0.05 * tr.valid.size
    assert np.array_equal(tr.topk_ids[~tr.valid], np.tile([0, 1], (n_bad, 1)))
    assert np.isfinite(tr.topk_weights).all() and (tr.topk_weights[~tr.valid] == 0).all()
    assert tr.position[0] == 0 and tr.seq_id[-1] > tr.seq_id[0]
    validate_trace(tr)


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="../shared/data/traces not available")
def test_real_qwen_trace(tmp_path):
    tr = load_trace(SHARED_TRACES / "qwen15moe-a2.7b-gsm8k.npz")
    assert (tr.T, tr.L, tr.k, tr.M, tr.E) == (4357, 5, 4, 4, 60)
    assert tr.meta.layer_ids == (0, 8, 12, 18, 23)
    assert tr.meta.weight_norm == "softmax_all" and tr.valid.all()
    assert (tr.topk_weights.sum(-1) < 1.0 + 1e-5).all()
    p = tmp_path / "qwen.parquet"
    save_trace(tr, p)
    assert_same(tr, load_trace(p))


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("change, fragments", [
    (lambda d: d["topk_ids"].__setitem__((2, 1, 1), 64), ["topk_ids[2, 1, 1] = 64 is out of range [0, 8)"]),
    (lambda d: d["topk_ids"].__setitem__((1, 0, 1), 4), ["topk_ids[1, 0] repeats expert 4", "0, 1"]),
    (lambda d: d["topk_weights"].__setitem__((3, 1, 0), np.nan), ["topk_weights[3, 1, 0] = nan", "not finite"]),
    (lambda d: d["topk_weights"].__setitem__((0, 0, 1), np.inf), ["topk_weights[0, 0, 1] = inf"]),
    (lambda d: d["topk_weights"].__setitem__((0, 1, 1), -0.25), ["topk_weights[0, 1, 1] = -0.25 is negative"]),
    (lambda d: d["ranking"].__setitem__((1, 1, 0), 5), ["ranking[1, 1, 0] = 5", "topk_ids[1, 1, 0] = 6",
                                                        "must start with the top-k"]),
    (lambda d: d["ranking"].__setitem__((0, 0, 2), 1), ["ranking[0, 0] repeats expert 1"]),
    (lambda d: d["ranking"].__setitem__((0, 1, 2), 8), ["ranking[0, 1, 2] = 8 is out of range [0, 8)"]),
    (lambda d: d.__setitem__("ranking", d["ranking"][..., :1]), ["ranking depth M = 1", "top_k k = 2"]),
    (lambda d: d.__setitem__("topk_weights", d["topk_weights"][:3]), ["topk_weights has shape (3, 2, 2)"]),
    (lambda d: d.__setitem__("valid", np.ones((4, 3), bool)), ["valid", "(4, 3)"]),
    (lambda d: d.__setitem__("topk_ids", d["topk_ids"].astype(np.float32)), ["topk_ids has dtype float32"]),
    (lambda d: d.__setitem__("top_k", np.array(3)), ["top_k = 3", "2 slots"]),
    (lambda d: d.__setitem__("num_experts", np.array(6)), ["topk_ids[1, 1, 0] = 6 is out of range [0, 6)"]),
    (lambda d: d.__setitem__("layers", np.array([1, 2, 3])), ["layers", "(3,)"]),
    (lambda d: d.__setitem__("call_idx", np.array([0, 1])), ["call_idx", "(2,)"]),
    (lambda d: d.pop("topk_weights"), ["required field 'topk_weights' is missing"]),
    (lambda d: d.pop("topk_ids"), ["required field 'topk_ids' is missing"]),
])
def test_bad_npz(tmp_path, change, fragments):
    d = base_npz()
    change(d)
    p = tmp_path / "bad.npz"
    np.savez(p, **d)
    expect_error(p, "bad.npz: ", *fragments)


def test_int64_ids_beyond_int32_reported_as_is(tmp_path):
    ids = base_npz()["topk_ids"].astype(np.int64)
    ids[0, 0, 0] = 2**33
    expect_error(write_npz(tmp_path, topk_ids=ids), f"topk_ids[0, 0, 0] = {2**33} is out of range")


def test_corrupt_files(tmp_path):
    good = write_npz(tmp_path, "good.npz")
    data = good.read_bytes()
    (tmp_path / "trunc.npz").write_bytes(data[: len(data) // 2])
    expect_error(tmp_path / "trunc.npz", "trunc.npz", "not a readable .npz")
    (tmp_path / "junk.npz").write_bytes(b"this is not a zip file at all")
    expect_error(tmp_path / "junk.npz", "junk.npz", "not a readable .npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    os.replace(tmp_path / "single.npy", tmp_path / "single.npz")
    expect_error(tmp_path / "single.npz", "single.npz", "not an .npz archive")
    np.savez(tmp_path / "pickled.npz", topk_ids=np.array([{"a": 1}], dtype=object))
    expect_error(tmp_path / "pickled.npz", "pickled.npz", "not a readable .npz")
    expect_error(tmp_path / "absent.parquet", "absent.parquet: no such file")
    expect_error(tmp_path / "t.csv", "t.csv", "unknown trace format '.csv'")

    tr = small_trace()
    for suffix, kind in ((".parquet", "Parquet"), (".arrow", "Arrow IPC")):
        p = tmp_path / f"full{suffix}"
        save_trace(tr, p)
        data = p.read_bytes()
        for name, blob in (("trunc", data[: len(data) // 2]), ("head", data[:10]),
                           ("flip", data[:200] + bytes(64) + data[264:])):
            q = tmp_path / f"{name}{suffix}"
            q.write_bytes(blob)
            try:
                load_trace(q)
            except InputError as e:
                assert str(e).startswith(f"{q}: ") and "\n" not in str(e)
            else:  # a flipped payload byte may still decode; then it must still validate
                assert name == "flip"
        if suffix == ".parquet":
            expect_error(tmp_path / f"trunc{suffix}", f"not a readable {kind} file")


def test_bad_parquet_metadata(tmp_path):
    tr = small_trace()
    p = tmp_path / "t.parquet"
    save_trace(tr, p)
    table = pq.read_table(p)
    q = tmp_path / "nometa.parquet"
    pq.write_table(table.replace_schema_metadata(None), q)
    expect_error(q, "nometa.parquet", "no 'expertsweep' schema metadata")
    meta = table.schema.metadata[b"expertsweep"]
    for name, new, frag in (("v2", meta.replace(b'"format_version": 1', b'"format_version": 2'),
                             "format_version = 2"),
                            ("ntype", meta.replace(b'"num_experts": 16', b'"num_experts": "16"'),
                             "'num_experts' = '16'"),
                            ("topk", meta.replace(b'"top_k": 3', b'"top_k": 4'), "holds lists of 3"),
                            ("json", b"{not json", "not valid JSON")):
        q = tmp_path / f"{name}.parquet"
        pq.write_table(table.replace_schema_metadata({b"expertsweep": new}), q)
        expect_error(q, f"{name}.parquet", frag)


def test_validate_trace_direct():
    tr = small_trace()
    validate_trace(tr)
    bad = dataclasses.replace(tr, topk_ids=tr.topk_ids.astype(np.int64))
    with pytest.raises(InputError, match=r"<trace>: topk_ids has dtype int64, expected int32"):
        validate_trace(bad)
    bad = dataclasses.replace(tr, meta=dataclasses.replace(tr.meta, layer_ids=(0, 1)))
    with pytest.raises(InputError, match=r"x\.parquet: meta layer_ids has 2 entries"):
        validate_trace(bad, "x.parquet")
    bad = dataclasses.replace(tr, meta=dataclasses.replace(tr.meta, weight_norm="sigmoid"))
    with pytest.raises(InputError, match="weight_norm = 'sigmoid'"):
        validate_trace(bad)
    bad = dataclasses.replace(tr, meta=dataclasses.replace(tr.meta, num_experts=5))
    with pytest.raises(InputError, match=r"ranking depth M = 6 exceeds num_experts E = 5"):
        validate_trace(bad)


def test_save_errors_and_atomicity(tmp_path):
    tr = small_trace()
    with pytest.raises(InputError, match="use a .parquet or .arrow"):
        save_trace(tr, tmp_path / "t.npz")
    with pytest.raises(InputError, match="cannot write trace"):
        save_trace(tr, tmp_path / "missing_dir" / "t.parquet")
    bad = dataclasses.replace(tr, topk_weights=tr.topk_weights.copy())
    bad.topk_weights[0, 0, 0] = np.nan
    with pytest.raises(InputError, match=r"topk_weights\[0, 0, 0\] = nan"):
        save_trace(bad, tmp_path / "t.parquet")
    assert not (tmp_path / "t.parquet").exists()

    target = tmp_path / "out.txt"
    target.write_text("old")

    def failing(tmp: str) -> None:
        Path(tmp).write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(target, failing)
    assert target.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["out.txt"]
    atomic_write(target, lambda tmp: Path(tmp).write_text("new"))
    assert target.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["out.txt"]


def test_cli_main(capsys):
    def bad() -> None:
        raise InputError("trace.npz: topk_ids[1, 2, 3] = 64\nis out of range")

    with pytest.raises(SystemExit) as ei:
        cli_main(bad)
    assert ei.value.code == 2
    assert capsys.readouterr().err == "expertsweep: error: trace.npz: topk_ids[1, 2, 3] = 64 is out of range\n"
    cli_main(lambda: None)


# ---------------------------------------------------------------------------------- generator


def test_generator_shapes_and_invariants():
    tr = synthetic_trace(300, 4, 64, 4, 12, seed=1, seq_len=100)
    assert (tr.T, tr.L, tr.k, tr.M, tr.E) == (300, 4, 4, 12, 64)
    assert tr.topk_ids.dtype == np.int32 and tr.topk_weights.dtype == np.float32
    assert tr.valid.all() and list(tr.seq_id[[0, 99, 100, 299]]) == [0, 0, 1, 2]
    assert list(tr.position[[0, 99, 100]]) == [0, 99, 0]
    validate_trace(tr)
    assert np.array_equal(tr.ranking[..., :4], tr.topk_ids)
    w = tr.topk_weights
    assert np.isfinite(w).all() and (w > 0).all()
    assert np.allclose(w.sum(-1), 1.0, atol=1e-5)
    assert (np.diff(w, axis=-1) <= 1e-7).all()  # router order = descending weight
    tr_all = synthetic_trace(300, 4, 64, 4, 12, seed=1, weight_norm="softmax_all")
    s = tr_all.topk_weights.sum(-1)
    assert (s < 1).all() and (s > 0).all() and tr_all.meta.weight_norm == "softmax_all"
    assert np.array_equal(tr_all.topk_ids, synthetic_trace(300, 4, 64, 4, 12, seed=1).topk_ids)


def test_generator_determinism():
    a = synthetic_trace(200, 3, 32, 2, 8, seed=7)
    b = synthetic_trace(200, 3, 32, 2, 8, seed=7)
    c = synthetic_trace(200, 3, 32, 2, 8, seed=8)
    assert_same(a, b)
    assert not np.array_equal(a.topk_ids, c.topk_ids)
    assert synthetic_trace(10, 1, 8, 2).M == 8  # ranking_depth defaults to E (exact ranking)


def test_generator_ties_go_to_lower_id():
    tr = synthetic_trace(20, 2, 16, 3, 5, skew=0.0, noise=0.0, topic_locality=0.0)
    assert (tr.topk_ids == [0, 1, 2]).all() and (tr.ranking == [0, 1, 2, 3, 4]).all()
    assert np.allclose(tr.topk_weights, 1 / 3)
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, size=(500, 40)).astype(np.float32)  # many ties, also at the cut
    for M in (1, 7, 40):
        idx, vals = _top_m_stable(scores, M)
        ref = np.argsort(-scores, axis=1, kind="stable")[:, :M]
        assert np.array_equal(idx, ref) and np.array_equal(vals, np.take_along_axis(scores, ref, 1))


def test_generator_realistic_weights_and_locality():
    tr = synthetic_trace(1000, 2, 512, 10, 64, seed=0)
    w0 = tr.topk_weights[..., 0]
    assert 0.2 <= np.median(w0) <= 0.5
    assert np.mean((tr.topk_weights < 0.15).sum(-1)) >= 3  # several small weights per row
    ids = tr.topk_ids[:, 0]
    counts = np.bincount(ids.ravel(), minlength=512)
    assert np.sort(counts)[::-1][:128].sum() > 0.5 * counts.sum()  # popularity skew
    adj = (ids[1:, :, None] == ids[:-1, None, :]).any(-1).mean()
    far = (ids[500:, :, None] == ids[:500, None, :]).any(-1).mean()
    assert adj > far  # topic locality: neighbours share more experts than distant tokens


def test_generator_bad_parameters():
    with pytest.raises(InputError, match=r"top_k = 9 must be in \[1, num_experts\]"):
        synthetic_trace(10, 1, 8, 9)
    with pytest.raises(InputError, match=r"ranking_depth = 2 must be in \[top_k, num_experts\]"):
        synthetic_trace(10, 1, 8, 3, 2)
    with pytest.raises(InputError, match=r"topic_locality = 1.0"):
        synthetic_trace(10, 1, 8, 2, topic_locality=1.0)


def test_slice_and_calibration_split():
    tr = small_trace(T=45)  # sequences of 10 tokens
    part = tr.slice_tokens(5, 15)
    assert part.T == 10 and np.array_equal(part.topk_ids, tr.topk_ids[5:15]) and part.meta == tr.meta
    calib, rest = calibration_split(tr, 0.25)  # target 11 -> boundary at 10
    assert (calib.T, rest.T) == (10, 35) and rest.seq_id[0] == 1
    calib, rest = calibration_split(synthetic_trace(30, 1, 8, 2, seq_len=100), 0.5)
    assert (calib.T, rest.T) == (15, 15)
    with pytest.raises(InputError, match="fraction"):
        calibration_split(tr, 1.0)


def test_messages_are_one_line_and_name_the_file(tmp_path):
    d = base_npz()
    d["topk_ids"][0, 1, 0] = 99
    p = tmp_path / "x.npz"
    np.savez(p, **d)
    msg = expect_error(p)
    assert re.fullmatch(r".*x\.npz: topk_ids\[0, 1, 0\] = 99 is out of range \[0, 8\)", msg)


# ---------------------------------------------------------------------------------- lookahead, twins, families


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_lookahead_round_trip(tmp_path, suffix):
    tr = synthetic_trace(60, 3, 16, 2, 6, seed=4, lookahead_depth=5)
    assert tr.lookahead.shape == (60, 3, 5) and (tr.lookahead[:, -1] == -1).all()
    validate_trace(tr)
    p = tmp_path / f"t{suffix}"
    save_trace(tr, p)
    back = load_trace(p)
    assert_same(tr, back)
    assert np.array_equal(back.lookahead, tr.lookahead) and back.meta.lookahead_depth == 5
    assert "lookahead" in pq.read_schema(p).names if suffix == ".parquet" else True
    # the guess is informative: it overlaps the next layer's selection far above chance (2 of 16 per id)
    hit = (tr.lookahead[:, 0, :, None] == tr.topk_ids[:, 1, None, :]).any(-1).mean()
    assert hit > 0.3
    # no column without lookahead
    plain = synthetic_trace(60, 3, 16, 2, 6, seed=4)
    save_trace(plain, tmp_path / "plain.parquet")
    assert "lookahead" not in pq.read_schema(tmp_path / "plain.parquet").names
    assert load_trace(tmp_path / "plain.parquet").lookahead is None


def test_lookahead_npz_import_and_errors(tmp_path):
    d = base_npz()
    look = np.array([[[2, 3], [-1, -1]]] * 4, np.int32)  # [T=4, L=2, P=2]
    p = tmp_path / "la.npz"
    np.savez(p, **d, lookahead=look)
    tr = load_trace(p)
    assert tr.meta.lookahead_depth == 2 and np.array_equal(tr.lookahead, look)
    bad = look.copy()
    bad[1, 1] = [0, 1]
    np.savez(p, **d, lookahead=bad)
    assert re.fullmatch(r".*la\.npz: lookahead\[1, 1\] = \[0, 1\]: the last layer has no next layer.*",
                        expect_error(p))
    bad = look.copy()
    bad[2, 0] = [3, 3]
    np.savez(p, **d, lookahead=bad)
    assert "lookahead[2, 0] repeats expert 3" in expect_error(p)
    bad = look.copy()
    bad[0, 0, 1] = 8
    np.savez(p, **d, lookahead=bad)
    assert "lookahead[0, 0, 1] = 8 is out of range [0, 8)" in expect_error(p)
    np.savez(p, **d, lookahead=look[:, :1])
    assert "lookahead has shape (4, 1, 2), expected [4, 2, P]" in expect_error(p)


def test_npz_ranking_not_3d_is_one_line_error(tmp_path):
    d = base_npz()
    d["ranking"] = d["ranking"][:, 0]  # [T, M]
    p = tmp_path / "r.npz"
    np.savez(p, **d)
    msg = expect_error(p)
    assert re.fullmatch(r".*r\.npz: ranking has shape \(4, 3\), expected \[4, 2, M\]", msg)


def test_sigmoid_topk_weight_norm_accepted(tmp_path):
    tr = synthetic_trace(20, 2, 8, 2, seed=1)
    tr = dataclasses.replace(tr, meta=dataclasses.replace(tr.meta, weight_norm="sigmoid_topk"))
    save_trace(tr, tmp_path / "ds.parquet")
    assert load_trace(tmp_path / "ds.parquet").meta.weight_norm == "sigmoid_topk"


def test_calibration_twin_shares_the_model_not_the_tokens():
    tr, twin = synthetic_pair(1500, 2, 128, 6, 16, calib_tokens=1000, seed=5)
    assert twin.T == 1000 and not np.array_equal(tr.topk_ids[:1000], twin.topk_ids)
    assert np.array_equal(twin.topk_ids, calibration_twin(1000, 2, 128, 6, 16, seed=5).topk_ids)
    other = synthetic_trace(1000, 2, 128, 6, 16, seed=6)

    def top(t, l_, n=32):
        c = np.bincount(t.topk_ids[:, l_].ravel(), minlength=128)
        return set(np.lexsort((np.arange(128), -c))[:n].tolist())

    for l_ in range(2):
        assert len(top(tr, l_) & top(twin, l_)) >= 24  # same popularity and topics: the warm sets agree
        assert len(top(tr, l_) & top(other, l_)) <= 16  # another model: about chance (32 * 32 / 128 = 8)
    with pytest.raises(InputError, match="sample = 0"):
        calibration_twin(10, 1, 8, 2, sample=0)


def test_synthetic_defaults_substitute_about_the_papers_share():
    """docs/traces.md: on the Qwen3-Next shape (E=512, top-10, C=128) with a warm start from the twin, the
    0.15 rule substitutes about 7.5% of expert calls (the paper's figure); here on 6 of the 48 layers."""
    from runtime.core.kernel import PolicyCache, warm_residency
    from runtime.core.policy import PRESETS

    L = 6
    tr, twin = synthetic_pair(3000, L, 512, 10, 64, calib_tokens=2000, seed=1)
    caps = np.full(L, 128)
    init = warm_residency(twin.topk_ids, twin.valid, 512, caps)
    cache = PolicyCache(PRESETS["rule-0.15"], 512, 10, caps, init)
    for l_ in range(L):
        cache.step(l_, tr.topk_ids[:, l_], tr.topk_weights[:, l_], tr.ranking[:, l_], logs=False)
    tot = cache.counter_totals()
    share = (tot["substitutions"] + tot["drops"]) / tot["calls"]
    assert 0.065 <= share <= 0.085, share


def test_oracle_prefetch_cli_no_sync_fetch_after_the_first_layer(tmp_path, capsys):
    from runtime.backends.simulate import main as sim_main

    tr, twin = synthetic_pair(300, 4, 64, 6, 16, calib_tokens=200, seed=3)
    save_trace(tr, tmp_path / "t.parquet")
    save_trace(twin, tmp_path / "c.parquet")
    out = tmp_path / "o.json"
    sim_main(["--trace", str(tmp_path / "t.parquet"), "--rule", "fetch_all", "--prefetch", "oracle",
              "--prefetch-n", "6", "--capacity", "16", "--initial-residency", f"warm:{tmp_path / 'c.parquet'}",
              "--out", str(out)])
    import json

    rows = json.loads(out.read_text())["per_layer"]
    assert rows[0]["fetches"] > 0 and [r["fetches"] for r in rows[1:]] == [0, 0, 0]
    assert all(r["prefetches"] == r["prefetch_used"] > 0 for r in rows[1:])
    # lookahead needs the column: a one-line error naming the flag
    with pytest.raises(InputError, match="prefetch.*lookahead column"):
        sim_main(["--trace", str(tmp_path / "t.parquet"), "--rule", "fetch_all", "--prefetch", "lookahead",
                  "--capacity", "16", "--initial-residency", f"warm:{tmp_path / 'c.parquet'}"])


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory):
    from tests.tiny_hf import build_tiny

    d = tmp_path_factory.mktemp("ckpt")
    return {fam: build_tiny(fam, d / fam) for fam in ("qwen3_moe", "deepseek_v3")}


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text((Path(__file__).resolve().parent / "data" / "kernel_source.txt").read_text())
    return p


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_record_lookahead_is_the_next_router_on_this_input(tiny_ckpts, tiny_text, tmp_path, family):
    """runtime.tools.record --lookahead: on layer l's rows, the next layer's router scores on layer l's router
    input, recomputed here from forward hooks on a plain (unwrapped) copy of the model."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.backends.adapters import FAMILIES, moe_blocks
    from runtime.tools.record import record_trace

    out = record_trace(tiny_ckpts[family], tiny_text, tmp_path / "r.parquet", max_tokens=256, window=64,
                       lookahead=3)
    tr = load_trace(out)
    want_norm = "sigmoid_topk" if family == "deepseek_v3" else "softmax_all"
    assert tr.meta.weight_norm == want_norm and tr.lookahead.shape == (tr.T, tr.L, 3)
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpts[family], dtype=torch.float32).eval()
    fam = FAMILIES[family]
    gates = [getattr(b, fam.router_attr) for b in moe_blocks(model, fam)]
    seen = {}
    hooks = [g.register_forward_hook(lambda mod, args, out, i=i: seen.setdefault(i, []).append(args[0]))
             for i, g in enumerate(gates)]
    from runtime.backends.hfmodel import load, tokenize_file

    m = load(tiny_ckpts[family])
    windows, _ = tokenize_file(m, tiny_text, 256, 64)
    with torch.inference_mode():
        model(input_ids=torch.from_numpy(windows[:1]), use_cache=False)
    for h in hooks:
        h.remove()
    x0 = seen[0][0].reshape(-1, seen[0][0].shape[-1])  # layer 0's router input, first window
    with torch.inference_mode():
        logits = gates[1](x0)[0].float()
        score = logits.sigmoid() + gates[1].e_score_correction_bias if fam.score == "sigmoid_bias" else logits
    want = torch.sort(-score, dim=1, stable=True).indices[:, :3].numpy()
    assert np.array_equal(tr.lookahead[:64, 0], want)
    assert (tr.lookahead[:, -1] == -1).all()


@pytest.mark.parametrize("column, values, fragments", [
    ("token", lambda t: [f"x{v}" for v in t], ["column 'token' has type string", "'x0'", "expected integers"]),
    ("token", lambda t: [str(v) for v in t], ["column 'token' has type string", "'0'", "expected integers"]),
    ("layer", lambda t: [v + 0.5 * (i == 3) for i, v in enumerate(t)], ["column 'layer' row 3 holds ",
                                                                         ".5, expected an integer"]),
])
def test_token_and_layer_must_be_integers(tmp_path, column, values, fragments):
    """Strings (even "0", "1") or fractions in `token` / `layer` are one-line errors, never a traceback or a
    silently accepted trace; whole floats (a writer's float64) are read as integers."""
    tr = small_trace()
    p = tmp_path / "t.parquet"
    save_trace(tr, p)
    table = pq.read_table(p)
    i = table.column_names.index(column)
    old = table.column(column).to_pylist()
    q = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(i, column, pa.array(values(old))), q)
    expect_error(q, "bad.parquet", *fragments)
    pq.write_table(table.set_column(i, column, pa.array([float(v) for v in old])), q)
    assert_same(tr, load_trace(q))
