"""Tiny reference Qwen3-MoE models that the project trains itself, offline, on CPU.

``python -m runtime.tools.tinymodel --size demo|test|all [--force]`` (``make model``) builds the models
that are not cached yet and prints their folders and evaluation texts; ``ensure_model(size)`` is
what the rest of the project calls when it needs one.

The ``demo`` and ``test`` models are ``Qwen3MoeForCausalLM`` (64 experts, top-8, every layer
sparse) trained on the running Python's standard library; ``mix`` (128 experts, top-8) is trained
on a mixture of code, English prose and verse (``runtime.tools.corpus`` source ``mix``) and has
held-out calibration and evaluation texts per domain; ``ref`` (128 experts, top-4, the mix corpus) is the
findings' reference model, whose 25% cache holds 8 x top-k as the paper's regime does; ``next-shape`` has Qwen3-Next's routing
shape (48 MoE layers, 512 experts, top-10, one shared expert; ``Qwen2MoeForCausalLM``, since
Qwen3-MoE has no shared expert) at a tiny hidden size, briefly trained, for rehearsals. Each has a
byte-level BPE tokenizer trained by ``tokenizers`` on its corpus. Training is a fixed number of AdamW steps with warmup and
cosine decay over packed sequences of the train documents, including the router's load-balancing
loss, and is deterministic given the spec's seed. A build goes to a temporary folder that is
renamed into place only when complete, under ``$EXPERTSWEEP_CACHE`` (default
``~/.cache/expertsweep``) as ``models/<name>-<digest>``, where the digest covers the spec, the
corpus text and the builder version. The folder holds a standard checkpoint that
``from_pretrained`` loads offline (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), the calibration and evaluation texts (calib.txt, eval.txt: documents
each followed by ``<|endoftext|>``) and train_log.json (steps, losses, validation perplexity,
gate-weight statistics, wall time, corpus digest); a ``mix``-corpus model also has
calib_<domain>.txt and eval_<domain>.txt and per-domain perplexities. See docs/tiny_models.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from runtime.core.errors import ArgumentParser, InputError, cli_main
from runtime.core.threads import configure as configure_threads
from runtime.tools.corpus import EOS, CorpusSplit, join_documents, load_corpus
from runtime.tools.tinyspec import ARCHITECTURES, TinySpec  # noqa: F401 (importable from here, as before)
from runtime.tools.tinytrain import (
    GATE_THRESHOLD,  # noqa: F401 (importable from here, as before)
    _encode,
    evaluate,
    hf_tokenizer,
    make_config,
    train_model,
    train_tokenizer,
)

logger = logging.getLogger(__name__)

BUILD_VERSION = 2
"""Bump when the build procedure changes so cached models are rebuilt."""

REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "calib.txt",
    "eval.txt",
    "train_log.json",
)
_LATER_FIELDS = {"architecture": "qwen3_moe", "shared_expert_intermediate_size": 0}


# 128 experts, top-8 (a 25% cache holds 32 = 4 x top-k), on code + English prose + verse;
# ~12M parameters. Sized so that the build stays within ~30 minutes on a busy 2-core machine
# (docs/tiny_models.md has the measured times).
_MIX = TinySpec(
    name="mix",
    num_layers=4,
    hidden_size=128,
    intermediate_size=512,
    moe_intermediate_size=64,
    num_experts=128,
    num_experts_per_tok=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=8192,
    seq_len=256,
    batch_size=8,
    steps=300,
    warmup_steps=30,
    lr=3e-3,
    seed=0,
    corpus="mix",
    train_bytes=2_000_000,  # per domain
    heldout_bytes=50_000,  # per domain and held-out split
)

SPECS: dict[str, TinySpec] = {
    # ~7M parameters (4 x 64 experts of 3 x 128 x 64), top-8: trained far enough (1,200 steps of 4 x 256 tokens) that its experts
    # differ, so every lossy policy costs perplexity, within a fresh `make pareto`'s 10 minutes; a weak load-balancing
    # loss (0.001) lets the router specialise, which makes the losses larger and steadier from build to build
    # (docs/tiny_models.md has what it costs and the builds compared).
    "demo": TinySpec(
        name="demo",
        num_layers=4,
        hidden_size=128,
        intermediate_size=512,
        moe_intermediate_size=64,
        num_experts=64,
        num_experts_per_tok=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=4096,
        seq_len=256,
        batch_size=4,
        steps=1200,
        warmup_steps=50,
        lr=3e-3,
        seed=0,
        router_aux_loss_coef=0.001,
    ),
    # ~1.3M parameters, for tests and quick end-to-end runs.
    "test": TinySpec(
        name="test",
        num_layers=2,
        hidden_size=64,
        intermediate_size=256,
        moe_intermediate_size=32,
        num_experts=64,
        num_experts_per_tok=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=4096,
        seq_len=128,
        batch_size=8,
        steps=2400,
        lr=3e-3,
        seed=0,
    ),
    "mix": _MIX,
    # The findings' reference model in the paper's cache regime: 128 experts, top-4, so a 25% cache holds
    # 32 = 8 x top-k (Qwen3-Next-80B-A3B: 128 slots for top-10, 12.8 x top-k; E/k 32 against its 51.2), on the
    # mix corpus with the demo's weak load-balancing loss (0.001) so that the router specialises, trained about
    # one epoch (docs/tiny_models.md has what it costs and its regime beside the paper's).
    "ref": dataclasses.replace(
        _MIX, name="ref", num_experts_per_tok=4, steps=800, warmup_steps=50, router_aux_loss_coef=0.001
    ),
    # Qwen3-Next's routing shape (48 MoE layers, 512 experts, top-10, a shared expert) at a tiny
    # hidden size, with random weights: for rehearsing every stage's cost at that shape, not for
    # quality (30 training steps collapsed its routing onto ~32 experts per layer: every call hit).
    "next-shape": TinySpec(
        name="next-shape",
        num_layers=48,
        hidden_size=64,
        intermediate_size=256,
        moe_intermediate_size=16,
        num_experts=512,
        num_experts_per_tok=10,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=4096,
        seq_len=256,
        batch_size=4,
        steps=0,
        warmup_steps=5,
        lr=3e-3,
        seed=0,
        corpus="mix",
        train_bytes=400_000,
        heldout_bytes=20_000,
        architecture="qwen2_moe",
        shared_expert_intermediate_size=64,
    ),
}
DEFAULT_SIZES = ("demo", "test", "mix")
"""What ``--size all`` (``make model``) builds; ``next-shape`` is built on demand."""


# --------------------------------------------------------------------------- paths and keys


def cache_dir() -> Path:
    """``$EXPERTSWEEP_CACHE``, default ``~/.cache/expertsweep`` (not created here)."""
    env = os.environ.get("EXPERTSWEEP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "expertsweep"


def resolve_spec(size: str | TinySpec) -> TinySpec:
    """A spec by size name (``demo``, ``test``), or the spec itself."""
    if isinstance(size, TinySpec):
        return size
    try:
        return SPECS[size]
    except KeyError:
        raise InputError(
            f"--size: unknown model size {size!r} (choose from {', '.join(SPECS)})"
        ) from None


def _corpus(spec: TinySpec) -> CorpusSplit:
    return load_corpus(spec.corpus, spec.train_bytes, spec.heldout_bytes)


def model_digest(spec: TinySpec, corpus_digest: str | None = None) -> str:
    """Cache key: spec, corpus text and builder version."""
    if corpus_digest is None:
        corpus_digest = _corpus(spec).digest
    fields = dataclasses.asdict(spec)
    for name, default in _LATER_FIELDS.items():  # keeps the demo/test keys of before they existed
        if fields[name] == default:
            del fields[name]
    payload = json.dumps(
        {"spec": fields, "corpus": corpus_digest, "build": BUILD_VERSION},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def model_dir(size: str | TinySpec) -> Path:
    """``cache_dir()/models/<name>-<digest>`` (may not exist yet)."""
    spec = resolve_spec(size)
    return cache_dir() / "models" / f"{spec.name}-{model_digest(spec)}"


def is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in REQUIRED_FILES)


def domain_texts(path: str | Path, kind: str = "eval") -> dict[str, Path]:
    """``{domain: path/<kind>_<domain>.txt}`` of a model folder (empty for one-domain models)."""
    path = Path(path)
    out = {}
    for f in sorted(path.glob(f"{kind}_*.txt")):
        out[f.stem[len(kind) + 1 :]] = f
    return out


# --------------------------------------------------------------------------- building blocks


def _check_reload(out_dir: Path, model: Any, sample: Any) -> float:
    """Reload from disk like a user would (offline) and compare logits; returns max |diff|."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if tok.eos_token != EOS:
        raise RuntimeError(f"{out_dir}: reloaded tokenizer has eos {tok.eos_token!r}")
    reloaded.eval()
    model.eval()
    with torch.no_grad():
        a = model(input_ids=sample).logits
        b = reloaded(input_ids=sample).logits
    diff = float((a - b).abs().max())
    if diff > 1e-4:
        raise RuntimeError(
            f"{out_dir}: reloaded model differs from the trained one (max |dlogit| {diff})"
        )
    return diff


@contextlib.contextmanager
def _torch_state(seed: int, threads: int = 2) -> Iterator[None]:
    """Seed torch, pin its thread count and turn on deterministic algorithms; restore all after.

    Deterministic algorithms matter on CPU too: the backward of the experts' token gather
    (``index_put_`` with accumulation) is otherwise summed in a thread-timing-dependent order.
    """
    import torch

    threads_before = torch.get_num_threads()
    det_before = torch.are_deterministic_algorithms_enabled()
    warn_before = torch.is_deterministic_algorithms_warn_only_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(det_before, warn_only=warn_before)
            torch.set_num_threads(threads_before)


def build(spec: TinySpec, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Train tokenizer and model for ``spec`` and write every REQUIRED_FILES entry to ``out_dir``."""
    import tokenizers
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    t_start = time.perf_counter()
    corpus = _corpus(spec)
    train_texts = [d.text for d in corpus.train]
    tok = train_tokenizer(train_texts, spec.vocab_size)
    hf_tok = hf_tokenizer(tok, spec)
    eos_id = tok.token_to_id(EOS)
    calib_text = join_documents(corpus.calib)
    eval_text = join_documents(corpus.evaluation)
    train_tokens = _encode(tok, train_texts)
    eval_tokens = torch.tensor(
        tok.encode(eval_text, add_special_tokens=False).ids, dtype=torch.long
    )
    if spec.eval_max_tokens:
        eval_tokens = eval_tokens[: spec.eval_max_tokens]

    with _torch_state(spec.seed):
        config = make_config(spec, tok.get_vocab_size(), eos_id)
        model = AutoModelForCausalLM.from_config(config)
        n_params = sum(p.numel() for p in model.parameters())
        expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        active = n_params - expert_params * (1 - spec.num_experts_per_tok / spec.num_experts)
        logger.info(
            "%s: %.2fM parameters (%.2fM active per token), %d train tokens, %d steps",
            spec.name,
            n_params / 1e6,
            active / 1e6,
            train_tokens.numel(),
            spec.steps,
        )
        if spec.steps:
            train_log = train_model(model, train_tokens, spec, progress=progress)
        else:  # random weights (the initialisation of the seed), e.g. for cost rehearsals
            train_log = {"steps": 0, "tokens_seen": 0, "train_tokens": int(train_tokens.numel()),
                         "train_wall_s": 0.0, "loss_curve": []}
        ev = evaluate(model, eval_tokens, spec)
        by_domain: dict[str, dict[str, float]] = {}
        for dom in corpus.domains():
            docs = [d for d in corpus.evaluation if d.domain == dom]
            ids = tok.encode(join_documents(docs), add_special_tokens=False).ids
            d_ev = evaluate(model, torch.tensor(ids, dtype=torch.long), spec)
            by_domain[dom] = {
                "val_ppl": d_ev["val_ppl"],
                "val_tokens": d_ev["val_tokens"],
                "frac_topk_ge_threshold": d_ev["gate_stats"]["frac_topk_ge_threshold"],
            }

    model.config.output_router_logits = False
    model.save_pretrained(out_dir)
    hf_tok.save_pretrained(out_dir)
    (out_dir / "calib.txt").write_text(calib_text, encoding="utf-8")
    (out_dir / "eval.txt").write_text(eval_text, encoding="utf-8")
    for dom in corpus.domains():
        for kind, docs in (("calib", corpus.calib), ("eval", corpus.evaluation)):
            text = join_documents(d for d in docs if d.domain == dom)
            (out_dir / f"{kind}_{dom}.txt").write_text(text, encoding="utf-8")
    sample = eval_tokens[: spec.seq_len][None]
    reload_diff = _check_reload(out_dir, model, sample)

    log: dict[str, Any] = {
        "name": spec.name,
        "digest": model_digest(spec, corpus.digest),
        "build_version": BUILD_VERSION,
        "spec": dataclasses.asdict(spec),
        "parameters": n_params,
        "active_parameters_per_token": int(active),
        **{k: v for k, v in train_log.items()},
        **ev,
        "val_by_domain": by_domain,
        "reload_max_abs_logit_diff": reload_diff,
        "build_wall_s": time.perf_counter() - t_start,
        "corpus_digest": corpus.digest,
        "corpus": corpus.summary(),
        "vocab_size": tok.get_vocab_size(),
        "eos_token": EOS,
        "eos_token_id": eos_id,
        "threads": 2,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    (out_dir / "train_log.json").write_text(json.dumps(log, indent=2) + "\n", encoding="utf-8")
    return log


def _publishable(folder: Path) -> None:
    """Give the build folder and its files the usual permissions (mkdtemp makes 0700)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~mask)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit (so cleanup runs) unless the process set its own handler."""
    install = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    )
    if install:

        def _exit(signum: int, _frame: object) -> None:
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        if install:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def ensure_model(size: str | TinySpec, progress: bool = True, force: bool = False) -> Path:
    """Return the folder of a complete model for ``size``, building it first if needed.

    Concurrent callers wait on a lock file instead of building twice. The build goes to a
    temporary sibling folder that is renamed into place only once every file is written, so the
    final folder is either absent or complete; a failed build leaves nothing behind (and a killed
    one's leftovers are removed by the next build). ``progress`` shows a tqdm bar while training.
    """
    spec = resolve_spec(size)
    final = model_dir(spec)
    if is_complete(final) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _lock(final.parent / f".{final.name}.lock"), _sigterm_as_exit():
        if is_complete(final) and not force:
            return final
        # Holding the lock, any temporary folder of this model is a killed build's leftover.
        for stale in final.parent.glob(f".{final.name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            logger.info("building %s model into %s", spec.name, final)
            log = build(spec, tmp, progress=progress)
            missing = [f for f in REQUIRED_FILES if not (tmp / f).is_file()]
            if missing:
                raise RuntimeError(f"build {spec.name}: missing {', '.join(missing)}")
            _publishable(tmp)
            if final.exists():  # stale or forced: move it aside first, then drop it
                old = final.with_name(f".{final.name}.old-{os.getpid()}.tmp")
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info(
        "%s: val ppl %.2f after %d steps (%.0f s training)",
        spec.name,
        log["val_ppl"],
        spec.steps,
        log["train_wall_s"],
    )
    return final


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m runtime.tools.tinymodel --size demo|test|all [--force]``."""
    configure_threads()  # before torch is imported: passive OpenMP waiting (runtime/core/threads.py)
    parser = ArgumentParser(
        prog="python -m runtime.tools.tinymodel",
        description="Build (if not cached) the tiny reference Qwen3-MoE models and print their paths.",
    )
    parser.add_argument(
        "--size",
        choices=[*SPECS, "all"],
        default="all",
        help=f"model to build; all = {', '.join(DEFAULT_SIZES)}",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument(
        "--corpus",
        choices=["stdlib", "shakespeare", "mix"],
        default=None,
        help="training corpus (default: the spec's, stdlib)",
    )
    parser.add_argument("--steps", type=int, default=None, help="override the number of steps (0: random weights)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)

    def run() -> None:
        sizes = list(DEFAULT_SIZES) if args.size == "all" else [args.size]
        for size in sizes:
            spec = SPECS[size]
            if args.corpus:
                spec = dataclasses.replace(spec, corpus=args.corpus)
            if args.steps is not None:
                spec = dataclasses.replace(spec, steps=args.steps)
            path = ensure_model(spec, progress=not args.quiet, force=args.force)
            print(f"{size} model: {path}")
            print(f"{size} calib text: {path / 'calib.txt'}")
            print(f"{size} eval text: {path / 'eval.txt'}", flush=True)

    cli_main(run)


if __name__ == "__main__":
    main()
