"""scripts/peer_replay.py (`make peer-replay`): our simulator beside bigrig's replay.

The script's flat re-encoding run through our kernel must equal bigrig's `pool.simulate` / `belady`
hit for hit (LRU, plain LFU, the Belady bound); a hand-worked case shows the one semantic difference
(a token's own experts stay resident in ours); the numbers the script reports for our simulator are
the simulator backend's. Skips cleanly without bigrig (`pip install --no-deps bigrig==0.9.1`) and,
for the real-trace check, without ../shared/data.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from runtime.backends import get_backend
from runtime.core.policy import PolicyConfig
from runtime.core.spec import RunSpec
from runtime.formats.trace import Trace, TraceMeta, save_trace, synthetic_trace

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "traces"
QWEN = SHARED / "qwen15moe-a2.7b-gsm8k.npz"


def _script():
    spec = importlib.util.spec_from_file_location("peer_replay", REPO / "scripts" / "peer_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pool():
    return pytest.importorskip("bigrig_engine.pool", reason="bigrig not installed (pip install --no-deps bigrig==0.9.1)")


def _hand_trace() -> Trace:
    """E=3, k=2: token 0 selects (0, 1), token 1 selects (2, 0)."""
    ids = np.array([[[0, 1]], [[2, 0]]], np.int32)  # [T=2, L=1, k=2]
    w = np.full(ids.shape, 0.5, np.float32)
    meta = TraceMeta(model="hand", num_experts=3, top_k=2, ranking_depth=2, layer_ids=(0,), weight_norm="softmax_topk")
    return Trace(ids, w, ids.copy(), np.ones((2, 1), bool), np.zeros(2, np.int32), np.arange(2, dtype=np.int32), meta)


def test_semantics_hand_case() -> None:
    """C = 2 = k. Ours: at token 1, expert 0 is a hit (resident when the token starts) and stays resident
    while 2 is fetched (victim 1): 1 hit. Flat (bigrig): request 2 misses and evicts the least recent, 0;
    request 0 then misses too: 0 hits."""
    pool = _pool()
    pr = _script()
    tr = _hand_trace()
    assert pr.ours(tr, "lru", 2, 1)["hits"] == 1
    assert pr.ours(pr.flat_trace(tr), "lru", 2, 1)["hits"] == 0
    assert sum(pool.simulate(s, 2, 3, pool.LRU, r)["hits"] for s, r in pr.flat_sequences(tr)) == 0


@pytest.mark.parametrize("key", ["lru", "lfu", "belady"])
@pytest.mark.parametrize("capacity", [6, 12])
def test_flat_equals_bigrig(key: str, capacity: int) -> None:
    """Our kernel on the flat re-encoding == bigrig's replay, hit for hit, on a synthetic trace with
    invalid cells (left out of both)."""
    pool = _pool()
    pr = _script()
    tr = synthetic_trace(400, 3, 32, 4, 8, seed=3)
    tr.valid[::37, 1] = False
    seqs = pr.flat_sequences(tr)
    assert sum(len(s) for s, _ in seqs) == int(tr.valid.sum()) * tr.k
    flat = pr.ours(pr.flat_trace(tr), key, capacity, 1)
    big = pr.bigrig(pool, seqs, key, capacity, tr.E, 1)
    assert flat["calls"] == big["calls"] == int(tr.valid.sum()) * tr.k
    assert flat["hits"] == big["hits"]


def test_ours_is_the_simulator_backend(tmp_path: Path) -> None:
    """What the script reports for our simulator is the simulator backend's result (cold start)."""
    _pool()
    pr = _script()
    tr = synthetic_trace(300, 2, 32, 4, 8, seed=5)
    path = tmp_path / "t.parquet"
    save_trace(tr, path)
    for key in ("lru", "lfuda"):
        r = get_backend("simulator").evaluate(RunSpec(policy=PolicyConfig(rule="fetch_all", evict=key), trace=str(path),
                                                      capacity=8, initial_residency="cold"))
        o = pr.ours(tr, key, 8, 1)
        assert (o["hits"], o["calls"]) == (r.counters["hits"], r.counters["calls"])


@pytest.mark.skipif(not QWEN.exists(), reason="../shared/data absent")
def test_real_trace_issue_reference() -> None:
    """Qwen1.5-MoE GSM8K at C = 15, cold: the flat replay is bigrig's exactly (LRU, LFU, Belady), and the
    printed hit rates are the backend's."""
    pool = _pool()
    pr = _script()
    res = pr.compare(QWEN, [0.25], 1, pool)
    cap = res["capacities"][0]
    assert cap["C"] == 15
    for key in ("lru", "lfu", "belady"):
        row = cap["keys"][key]
        assert row["ours_flat"]["hits"] == row["bigrig"]["hits"], key
    r = get_backend("simulator").evaluate(RunSpec(policy=PolicyConfig(rule="fetch_all", evict="lru"), trace=str(QWEN),
                                                  capacity=15, initial_residency="cold"))
    assert cap["keys"]["lru"]["ours"]["hits"] == r.counters["hits"]
    md = pr.markdown([res], "h")
    assert f"| {r.counters['hits'] / r.counters['calls']:.4f} |" in md


def test_missing_bigrig_is_one_line(monkeypatch, capsys) -> None:
    pr = _script()
    monkeypatch.setattr(pr, "bigrig_pool", lambda: None)
    with pytest.raises(SystemExit) as exc:
        pr.main([])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pip install --no-deps bigrig==0.9.1" in err
