"""Emulation on real (tiny, random) Hugging Face checkpoints of every supported family."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runtime import cli
from runtime.backends import adapters, emulate
from runtime.backends.simulate import simulate
from runtime.core.errors import InputError, cli_main
from runtime.core.kernel import (
    COUNTER_NAMES,
    FLOAT_COUNTERS,
    INT_COUNTERS,
    PolicyCache,
    warm_residency,
)
from runtime.core.llamacpp_cache import cache_for
from runtime.core.policy import PRESETS, PolicyConfig
from runtime.formats.trace import load_trace
from tests.tiny_hf import FAMILIES, build_tiny


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return {fam: build_tiny(fam, d / fam) for fam in FAMILIES}


def logits_under(m, ids, cache):
    m.ctx.cache = cache
    try:
        with torch.inference_mode():
            return m.model(input_ids=ids, use_cache=False).logits.float()
    finally:
        m.ctx.cache = None


@pytest.mark.parametrize("family", FAMILIES)
def test_fetch_every_miss_is_exact(ckpts, family):
    m = emulate.load(ckpts[family])
    ids = torch.randint(0, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    exact = logits_under(m, ids, None)
    caps = np.full(m.num_layers, m.k + 1)
    got = logits_under(m, ids, PolicyCache(PRESETS["fetch-every-miss"], m.E, m.k, caps, None))
    assert (got - exact).abs().max().item() <= 1e-5
    sub = logits_under(m, ids, PolicyCache(PRESETS["substitute-all"], m.E, m.k, caps, None))
    assert (sub - exact).abs().max().item() > 1e-4  # the wrappers really act


@pytest.mark.parametrize("family", FAMILIES)
def test_all_resident_every_policy_is_exact(ckpts, family):
    """With every expert resident (the kernel accepts C = E; users are held to C < E) every preset
    reproduces the model and every call hits."""
    m = emulate.load(ckpts[family])
    ids = torch.randint(0, 90, (2, 32), generator=torch.Generator().manual_seed(1))
    exact = logits_under(m, ids, None)
    caps = np.full(m.num_layers, m.E)
    init = [np.arange(m.E)] * m.num_layers
    for name, pol in PRESETS.items():  # (llama.cpp's pool and layer split: their own caches, runtime/core/llamacpp_cache.py)
        cache = cache_for(pol, m.E, m.k, caps, init, allow_full=True)
        got = logits_under(m, ids, cache)
        assert (got - exact).abs().max().item() <= 1e-5, name
        assert cache.counter_totals()["hits"] == cache.counter_totals()["calls"], name


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("policy", ["quality-first", "speed-first", "host-compute"])
def test_batched_equals_incremental_decode(ckpts, family, policy):
    m = emulate.load(ckpts[family])
    T = 24
    ids = torch.randint(0, 90, (1, T), generator=torch.Generator().manual_seed(2))
    caps = np.full(m.num_layers, m.k + 1)
    init = [np.arange(m.k + 1)] * m.num_layers
    batched_cache = PolicyCache(PRESETS[policy], m.E, m.k, caps, init)
    m.ctx.cache = batched_cache
    try:
        with torch.inference_mode():
            batched = m.model(input_ids=ids, use_cache=False).logits.float()[0]
        kinds_b = [m.ctx.last[l_]["kind"].copy() for l_ in range(m.num_layers)]
        served_b = [m.ctx.last[l_]["served"].copy() for l_ in range(m.num_layers)]
        inc_cache = PolicyCache(PRESETS[policy], m.E, m.k, caps, init)
        m.ctx.cache = inc_cache
        past, rows, kinds_i, served_i = None, [], [[] for _ in range(m.num_layers)], [[] for _ in range(m.num_layers)]
        with torch.inference_mode():
            for t in range(T):
                out = m.model(input_ids=ids[:, t : t + 1], cache=past, use_cache=True)
                past = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
                rows.append(out.logits.float()[0, -1])
                for l_ in range(m.num_layers):
                    kinds_i[l_].append(m.ctx.last[l_]["kind"][0])
                    served_i[l_].append(m.ctx.last[l_]["served"][0])
    finally:
        m.ctx.cache = None
    for l_ in range(m.num_layers):
        assert np.array_equal(kinds_b[l_], np.stack(kinds_i[l_])), l_
        assert np.array_equal(served_b[l_], np.stack(served_i[l_])), l_
    assert (torch.stack(rows) - batched).abs().max().item() <= 1e-4
    for b, i in zip(batched_cache.per_layer(), inc_cache.per_layer(), strict=True):
        mb, mi = b.pop("substituted_mass"), i.pop("substituted_mass")
        assert b == i
        assert mb == pytest.approx(mi, rel=1e-5)  # gate weights differ by float rounding only


def test_emulation_trace_replays_in_simulator(ckpts, text, tmp_path):
    tr_path, res_path = tmp_path / "seen.parquet", tmp_path / "res.npy"
    pol = PolicyConfig(rule="threshold", tau=0.3, beta=0.2, evict="lru", admission_delay=2)
    res = emulate.emulate(ckpts["qwen3_moe"], text, {"p": pol}, capacity=3,
                          window=32, max_tokens=640, trace_out=str(tr_path), residency_out=str(res_path))
    emu = res["p"]
    tr = load_trace(tr_path)
    assert tr.M == tr.E and tr.T == emu["tokens"]
    sim = simulate(tr, pol, 3, initial_residency=[r for r in np.load(res_path)], baselines=False).to_dict()
    for key in INT_COUNTERS:
        assert sim[key] == emu[key], key
    for key in FLOAT_COUNTERS:
        assert sim[key] == pytest.approx(emu[key], rel=1e-12), key
    assert emu["substitutions"] > 0 and emu["admissions"] > 0


def test_exact_pass_cache_is_per_model_and_dies_with_it(ckpts, text):
    """The exact pass is cached per loaded model only while it lives: a later model (which may get
    the freed one's id()) must never be handed the earlier model's warm start (CI saw the engine run
    qwen2_moe from qwen3_moe's warm start that way)."""
    import gc

    from runtime.core.spec import RunSpec

    spec = RunSpec(policy=PRESETS["first-choice"], model=str(ckpts["qwen3_moe"]), text=str(text), capacity=3,
                   window=16, max_tokens=96, initial_residency="held-out")
    a, b = emulate.load(ckpts["qwen3_moe"]), emulate.load(ckpts["qwen2_moe"])
    ex_a, ex_b = emulate.exact_pass(a, spec), emulate.exact_pass(b, spec)
    assert emulate.exact_pass(a, spec) is ex_a  # cached for the same model
    assert not np.array_equal(ex_a.nll, ex_b.nll)  # another model, its own pass
    gc.collect()  # earlier tests' unreachable models (reference cycles) must not be counted below
    n = len(emulate._EXACT)
    del a, ex_a
    gc.collect()
    assert len(emulate._EXACT) == n - 1  # the freed model's entry is gone with it


def test_record_cli_and_warm_residency(ckpts, text, tmp_path, capsys):
    from runtime.tools import record

    out = tmp_path / "exact.parquet"
    with pytest.raises(SystemExit) as e:
        cli_main(lambda: record.main(["--model", str(ckpts["olmoe"]), "--text", str(text), "--out", str(out),
                                      "--window", "32", "--max-tokens", "320", "--depth", "5"]))
        raise SystemExit(0)
    assert e.value.code == 0
    tr = load_trace(out)
    assert (tr.T, tr.k, tr.M) == (320, 2, 5) and tr.meta.model.startswith("olmoe")
    assert np.array_equal(tr.ranking[..., :2], tr.topk_ids)
    w = tr.topk_weights
    assert (np.diff(w, axis=-1) <= 1e-7).all()  # rank order: descending weight
    assert len(warm_residency(tr.topk_ids, tr.valid, tr.E, np.full(tr.L, 3))) == tr.L


def test_emulate_cli_json_and_nll(ckpts, text, tmp_path, capsys):
    nll = tmp_path / "nll.parquet"
    with pytest.raises(SystemExit) as e:
        cli_main(lambda: cli.emulate_main(["--model", str(ckpts["mixtral"]), "--text", str(text), "--policy",
                                       "rule-0.15", "--capacity-fraction", "0.5", "--max-tokens", "256",
                                       "--window", "32", "--json", "--nll-out", str(nll)]))
        raise SystemExit(0)
    assert e.value.code == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("perplexity", "exact_perplexity", "ppl_change_pct", "ppl_ci_low", "ppl_ci_high", "mass_per_token",
                "initial_residency", *COUNTER_NAMES):
        assert key in res, key
    lo, hi = res["ppl_change_ci95"]
    assert lo <= res["ppl_change_pct"] <= hi
    import pyarrow.parquet as pq

    t = pq.read_table(nll)
    assert t.num_rows == 8 * 31 and {"nll_exact", "nll_rule-0.15"} <= set(t.column_names)
    ppl = float(np.exp(t.column("nll_rule-0.15").to_numpy().mean()))
    assert ppl == pytest.approx(res["perplexity"], rel=1e-9)


def _cli_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(lambda: cli.emulate_main(argv))
        raise SystemExit(0)
    return e.value.code, capsys.readouterr().err


def test_bad_inputs(ckpts, text, tmp_path, capsys):
    base = ["--text", str(text), "--policy", "rule-0.15", "--capacity-fraction", "0.5", "--window", "32",
            "--nll-out", str(tmp_path / "n.parquet")]
    code, err = _cli_error(["--model", str(tmp_path / "nowhere"), *base], capsys)
    assert code == 2 and "no config.json" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ckpts["qwen3_moe"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    code, err = _cli_error(["--model", str(broken), *base], capsys)
    assert code == 2 and "weights cannot be loaded" in err and len(err.strip().splitlines()) == 1
    cfg = json.loads((ckpts["qwen3_moe"] / "config.json").read_text())
    small = tmp_path / "smallvocab"
    small.mkdir()
    for f in ckpts["qwen3_moe"].iterdir():
        (small / f.name).write_bytes(f.read_bytes())
    cfg["vocab_size"] = 50
    (small / "config.json").write_text(json.dumps(cfg))
    code, err = _cli_error(["--model", str(small), *base], capsys)
    assert code == 2 and "tokenizer" in err
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    code, err = _cli_error(["--model", str(ckpts["qwen3_moe"]), "--text", str(short), "--policy", "rule-0.15",
                            "--window", "32", "--nll-out", str(tmp_path / "n.parquet")], capsys)
    assert code == 2 and "fewer than one window" in err and str(short) in err
    cfg = json.loads((ckpts["qwen3_moe"] / "config.json").read_text())
    cfg["model_type"] = "llama"
    (small / "config.json").write_text(json.dumps(cfg))
    code, err = _cli_error(["--model", str(small), *base], capsys)
    assert code == 2 and "not supported" in err and "qwen3_moe" in err
    assert not (tmp_path / "n.parquet").exists()


def test_non_finite_router_scores(ckpts, text):
    m = emulate.load(ckpts["qwen3_moe"])
    tap = next(mod for mod in m.model.modules() if isinstance(mod, adapters.RouterTap))
    with torch.no_grad():
        tap.router.weight[0, 0] = float("nan")
    with pytest.raises(InputError, match="non-finite"):
        emulate.emulate(m, text, {"rule-0.15": PRESETS["rule-0.15"]}, capacity=3, window=32, max_tokens=128)


def test_huge_finite_router_scores_are_not_an_error(ckpts, text):
    """The finiteness check sums each token's scores; a sum that overflows while every score is finite
    (here four scores of 1e38) is told apart and accepted."""
    m = emulate.load(ckpts["qwen3_moe"])
    tap = next(mod for mod in m.model.modules() if isinstance(mod, adapters.RouterTap))

    class Bump(torch.nn.Module):
        def __init__(self, router):
            super().__init__()
            self.router = router

        def forward(self, x):
            out = self.router(x)
            bump = torch.zeros(out[0].shape[-1])
            bump[:4] = 1e38
            return (out[0] + bump, *out[1:])

    tap.router = Bump(tap.router)
    res = emulate.emulate(m, text, {"rule-0.15": PRESETS["rule-0.15"]}, capacity=3, window=32, max_tokens=128)
    assert res["rule-0.15"]["tokens"] > 0
