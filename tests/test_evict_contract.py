"""The eviction contract: one suite run over every eviction kind of the policy table.

Like optuna's sampler tests (one suite, every sampler), each test here is parametrized by the kinds of
runtime.core.policy.EVICTS, so a new kind is covered once it has its table row, its rules in
runtime/core/kernel/evict.py and its reference in tests/reference.py. Then S3-FIFO's own checks: the
reference against bigrig's S3FIFO (the implementation the rules were read from), the kernel on bigrig's flat
request sequences, and the simulator's CLI with `--evict s3fifo`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.cli import main as cli_main
from runtime.core.kernel import N_EV, PolicyCache
from runtime.core.kernel import primitives as prim
from runtime.core.kernel.evict import EVICT_KINDS, check_kinds
from runtime.core.policy import EVICTS, PARAM_BY_NAME, PolicyConfig
from runtime.formats.trace import load_trace, save_trace, synthetic_trace
from tests import reference
from tests.reference import reference_replay
from tests.test_kernel import check_against_reference, policies_of, random_case

EXAMPLES = int(os.environ.get("ES_CONTRACT_EXAMPLES", "120"))


def test_every_kind_has_a_row_rules_and_a_reference():
    """The policy table, the kernel's eviction table and the reference name the same kinds, in code order."""
    assert tuple(k.name for k in EVICT_KINDS) == EVICTS == reference.EVICTS
    assert PARAM_BY_NAME["evict"].choices == EVICTS
    check_kinds(EVICT_KINDS, EVICTS)  # what the import ran: every row names mechanisms the kernel implements


def test_docs_table_is_the_eviction_table():
    """docs/policies.md's table of kinds holds EVICT_KINDS' rows, in code order."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "policies.md").read_text()
    sec = text[text.index("### Eviction kinds: the table"):]
    rows = [ln for ln in sec[: sec.index("\n\n", sec.index("| kind |"))].splitlines() if ln.startswith("| `")]
    cells = [tuple(c.strip().strip("`") for c in ln.strip("|").split("|")) for ln in rows]
    assert cells == [(k.name, k.keys, k.on_load, k.touch, k.experts, k.rule) for k in EVICT_KINDS]


def test_half_added_kind_fails_with_a_message():
    """A kind in the policy table without its row, a row naming a mechanism the kernel lacks, and a rule,
    fallback or touch without its kernel branch each fail (at import) with a message naming them."""
    with pytest.raises(ValueError, match=r"no row: \['arc'\].*tests/reference.py.*docs/policies.md"):
        check_kinds(EVICT_KINDS, (*EVICTS, "arc"))
    for field in ("keys", "on_load", "touch"):
        bad = (*EVICT_KINDS[:-1], EVICT_KINDS[-1]._replace(**{field: "arc"}))
        with pytest.raises(ValueError, match=rf"row 's3fifo': {field} = 'arc' is not one the kernel implements"):
            check_kinds(bad, EVICTS)
    with pytest.raises(ImportError, match=r"no branch: \['clock'\]"):
        prim._codes(("lfu", "lru"), ("lfu", "lru", "clock"), "TOUCHES")

def test_reference_refuses_a_kind_or_rule_without_its_rule(monkeypatch):
    """The reference, told of a kind or a rule it has no rule for (a half-added one), raises instead of
    running another kind's or rule's (its eviction key used to fall through to Belady's, its miss rule to band)."""
    ids, ws, rks, valid = [[[2]]], [[[1.0]]], [[[2, 0, 1, 3]]], [[True]]  # a miss with two residents to evict
    monkeypatch.setattr(reference, "EVICTS", (*reference.EVICTS, "arc"))
    with pytest.raises(ValueError, match="no eviction key for 'arc'"):
        reference_replay(ids, ws, rks, valid, 4, [2], [[0, 1]], "fetch_all", evict="arc")
    monkeypatch.setattr(reference, "RULES", (*reference.RULES, "spare"))
    with pytest.raises(ValueError, match="no miss rule 'spare'"):
        reference_replay(ids, ws, rks, valid, 4, [2], [[0, 1]], "spare")


def test_kind_added_to_the_policy_table_alone_fails_at_import():
    """The import itself: a kind appended to runtime.core.policy.EVICTS with nothing else fails importing the
    kernel, naming the kind (a subprocess: the kernel is imported fresh)."""
    code = ("import runtime.core.policy as p; p.EVICTS = (*p.EVICTS, 'arc'); p.EVICT_CODE['arc'] = len(p.EVICT_CODE); "
            "import runtime.core.kernel")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1],
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode != 0
    assert "no row: ['arc']" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("evict", EVICTS)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 40), L=st.integers(1, 3), E=st.integers(3, 12),
       data=st.data())
def test_kind_decides_as_the_reference(evict, seed, T, L, E, data):
    """Every decision, counter and final residency equal to tests/reference.py on random traces, with every
    other feature of the policy drawn (rules, fallbacks, admission, prefetch, fetch cap, pinned hot set)."""
    check_against_reference(seed, T, L, E, data, data.draw(policies_of(evict)))


@pytest.mark.parametrize("evict", [e for e in EVICTS if e != "belady"])
@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 30), E=st.integers(3, 12), data=st.data())
def test_kind_step_layers_and_no_decisions_agree(evict, seed, T, E, data):
    """The simulator's call (step_layers, no decisions) and one step per layer leave every kind's state alike."""
    policy = data.draw(policies_of(evict))
    k = data.draw(st.integers(1, min(4, E - 1)))
    cap = data.draw(st.integers(k, E - 1))
    ids, w, ranking, valid = random_case(seed, T, 2, E, k, data.draw(st.integers(k, E)), 0.9)
    policy = replace(policy, prefetch="off", prefetch_n=None, pin_fraction=0.0)
    init = [np.arange(cap // 2, dtype=np.int32)] * 2
    per = PolicyCache(policy, E, k, np.array([cap, cap]), init)
    for l_ in range(2):
        per.step(l_, ids[:, l_], w[:, l_], ranking[:, l_], valid[:, l_], decisions=False)
    one = PolicyCache(policy, E, k, np.array([cap, cap]), init)
    lay = [np.ascontiguousarray(np.asarray(a, dt).swapaxes(0, 1)) for a, dt in
           ((ids, np.int32), (w, np.float64), (ranking, np.int32), (valid, np.bool_))]
    one.step_layers(*lay, np.zeros((2, T, N_EV), np.int32))
    assert per.per_layer() == one.per_layer()
    for name in ("expert_slot", "key", "qstate", "age_count", "queue", "ghost"):
        assert np.array_equal(getattr(per, name), getattr(one, name)), name


def _flat(ids: np.ndarray) -> list[int]:
    return [int(e) for e in ids.ravel()]


def _bigrig_s3fifo():
    pool = pytest.importorskip("bigrig_engine.pool", reason="bigrig is not installed (make peer-replay)")
    from bigrig_engine.policies.s3fifo import S3FIFO

    return pool, S3FIFO


@pytest.mark.parametrize("seed,E,C", [(0, 16, 4), (1, 32, 10), (2, 64, 30), (3, 12, 11)])
def test_s3fifo_reference_and_kernel_decide_as_bigrig(seed, E, C):
    """On bigrig's replay (cold, one request per token, every miss fetched) the reference and the kernel miss
    exactly where bigrig's S3FIFO does: request by request for the reference, in total for the kernel."""
    pool, S3FIFO = _bigrig_s3fifo()
    rng = np.random.default_rng(seed)
    seq = rng.choice(E, size=600, p=rng.dirichlet(np.full(E, 0.4)))
    ids = seq.reshape(-1, 1, 1).astype(np.int32)  # [T, L=1, k=1]
    w = np.ones(ids.shape)
    ref = reference_replay(ids.tolist(), w.tolist(), ids.tolist(), np.ones((len(seq), 1), bool).tolist(), E, [C],
                           [[]], "fetch_all", evict="s3fifo")
    pol, resident, want = S3FIFO(C, E), set(), []
    for e in map(int, seq):  # bigrig_engine.pool.simulate, request by request
        want.append(e in resident)
        if e in resident:
            pol.touch(e)
            continue
        if len(resident) >= C:
            resident.discard(pol.victim())
        resident.add(e)
        pol.admit(e)
    assert [r[0][0] == reference.HIT for r in ref["kind"]] == want
    got = pool.simulate(_flat(seq), C, E, lambda c, n: S3FIFO(c, n))
    cache = PolicyCache(PolicyConfig(rule="fetch_all", evict="s3fifo"), E, 1, np.array([C]), None)
    cache.step(0, ids[:, 0], w[:, 0])
    assert cache.counter_totals()["hits"] == got["hits"] == sum(want)
    assert cache.counter_totals()["fetches"] == got["misses"]


def test_s3fifo_worked_example():
    """C = 3 (small target 1, ghost of 3), one request per token: 0 1 2 fill small; 3 evicts 0 (small's oldest,
    freq 0) into the ghost; 0 comes back from the ghost into main, evicting 1; a hit on 2 twice, then 4:
    small's oldest is 2 with freq 2 > 1, so 2 moves to main and 3 (freq 0) leaves."""
    seq = [0, 1, 2, 3, 0, 2, 2, 4]
    ids = np.array(seq, np.int32).reshape(-1, 1)
    cache = PolicyCache(PolicyConfig(rule="fetch_all", evict="s3fifo"), 8, 1, np.array([3]), None)
    r = cache.step(0, ids, np.ones(ids.shape))
    assert r.kind[:, 0].tolist() == [1, 1, 1, 1, 1, 0, 0, 1]
    assert cache.resident(0).tolist() == [0, 2, 4]
    assert cache.queue[0, [0, 2, 4, 1, 3]].tolist() == [2, 2, 1, 3, 3]  # main, main, small, ghost, ghost
    ref = reference_replay(ids[:, None].tolist(), np.ones((8, 1, 1)).tolist(), ids[:, None].tolist(),
                           [[True]] * 8, 8, [3], [[]], "fetch_all", evict="s3fifo")
    assert ref["final_state"][0]["main"] == [0, 2] and ref["final_state"][0]["ghost"] == [1, 3]


def test_simulate_cli_evict_s3fifo_matches_the_reference(tmp_path, capsys):
    """`expertsweep simulate --evict s3fifo --s3-small ...`: the flags come from the policy table, and the
    result's counters are the reference's."""
    tr = synthetic_trace(60, 3, 16, 3, 8, seed=5)
    path = tmp_path / "t.parquet"
    save_trace(tr, path)
    with pytest.raises(SystemExit) as exc:
        cli_main(["simulate", "--trace", str(path), "--rule", "threshold", "--tau", "0.2", "--evict", "s3fifo",
                  "--s3-small", "0.3", "--beta", "0.4", "--capacity", "6", "--initial-residency", "cold", "--json"])
        raise SystemExit(0)
    assert exc.value.code == 0
    res = json.loads(capsys.readouterr().out)
    tr = load_trace(path)
    ref = reference_replay(tr.topk_ids.tolist(), tr.topk_weights.tolist(), tr.ranking.tolist(), tr.valid.tolist(),
                           tr.E, [6] * tr.L, [[]] * tr.L, "threshold", tau=0.2, beta=0.4, evict="s3fifo",
                           s3_small=0.3)
    for key in ("calls", "hits", "fetches", "substitutions", "drops", "admissions"):
        assert res[key] == sum(c[key] for c in ref["counters"]), key
    assert res["policy_config"]["evict"] == "s3fifo" and "small=0.3" in res["policy"]
