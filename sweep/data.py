"""The sweep's inputs: the model, its texts and router traces, resolved up front, recorded where the model is.

`locate` runs in the driver before Ray starts, so a missing model, text or trace the driver can
check is a one-line error before any trial. A model is `demo` / `test` (`runtime.tools.tinymodel.
ensure_model`), any local Hugging Face checkpoint folder (config.json + safetensors shards), or a
GGUF file (recorded by llama.cpp, emulated dequantized by transformers: runtime/backends/gguf.py; its
texts beside it in its folder, its digest `gguf.file_digest`, its config.json transformers' config).
With `model_resource: NAME` the folder (and the texts) are on the Ray nodes offering `model:NAME`
and the driver does not need to see them; else they are on the driver's node.

`prepare` (after Ray is up) gets the router traces of the evaluated text and of the calibration
text from `record_on_node`, a Ray task that runs where the model's files are (sweep/worker.py
`model_placement`): it records with the sweep's `dtype` and `max_memory_GiB` (streamed layer by
layer above it, runtime/backends/stream.py), or reuses the trace cached on that node under
`$EXPERTSWEEP_CACHE/traces/` by `trace_key`: the checkpoint digest (`checkpoint_digest`: a hash
of config.json's bytes and of the name, size and modification time of every other file of the
folder, the safetensors shards and their index included; no weight is read) plus the recording
parameters (the text's SHA-256, max_tokens, lookahead, dtype). A second sweep on the same
checkpoint therefore records nothing. The task returns the trace bytes (and config.json), which
the driver writes into `<out>/traces/` for the report and hands to the workers through Ray's
object store (sweep/driver.py): no node reads the driver's output folder.

A synthetic trace (`trace: {synthetic: {...}}`) is generated in `<out>/traces/` with its
calibration twin (the same model draw `seed`, another token draw `sample`), reused while its
parameters are unchanged.

Warm start (never the evaluated data): the calibration text is the config's `calib_text`, else
the model's `calib.txt`; the calibration trace is `calib_trace`, else the one recorded from that
text, else the synthetic twin. Without any, every backend takes `held-out`: the last 20% of the
evaluated tokens (runtime/core/spec.py `HELD_OUT_FRACTION`) calibrate the cache and are not evaluated.
`Inputs.warm_start` says which, for the summary and MLflow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.backends import gguf
from runtime.core.errors import InputError
from runtime.formats.trace import Trace, load_trace, save_trace, synthetic_trace
from sweep.config import SweepConfig

log = logging.getLogger(__name__)

RECORDER_VERSION = 1  # part of every cached trace's key: bump when recording changes what it writes


@dataclass(frozen=True)
class Inputs:
    trace: str
    calib_trace: str | None
    model_dir: str | None  # on the model's nodes (the driver's node unless model_resource is set)
    text: str | None  # the same
    calib_text: str | None  # the same
    dims: tuple[int, int, int]  # L, E, k of the trace
    warm_start: str = ""  # where the warm start comes from, in words (summary.md, MLflow)
    model_config: str | None = None  # the model's config.json as copied into <out>/traces/ (a cost-model shape)
    digest: str | None = None  # checkpoint_digest of the model


@dataclass(frozen=True)
class Located:
    """What the driver knows before Ray starts: the model folder (local or on a model:NAME node) and
    the trace files it can check."""

    model_dir: str | None
    local: bool  # the driver sees the model folder (then the model's tasks run on the driver's node)
    text: str | None
    calib_text: str | None


def _abs(path: str, where: str, kind: str = "file") -> Path:
    p = Path(path).expanduser()
    p = p if p.is_absolute() else Path.cwd() / p
    if kind == "file" and not p.is_file():
        raise InputError(f"{where} = {path}: no such file")
    if kind == "dir" and not p.is_dir():
        raise InputError(f"{where} = {path}: no such folder")
    return p.resolve()


def resolve_model(model: str) -> Path:
    """`demo` / `test` (built if absent), a model folder holding config.json, or a GGUF file (of an
    architecture the emulation loads: runtime/backends/gguf.py)."""
    if model in ("demo", "test"):
        from runtime.tools.tinymodel import ensure_model

        return Path(ensure_model(model, progress=True)).resolve()
    if gguf.is_gguf(model):
        p = _abs(model, "model", "file")
        gguf.check(p, "model =")
        return p
    p = _abs(model, "model", "dir")
    conf = p / "config.json"
    if not conf.is_file():
        raise InputError(f"model = {model}: {p} has no config.json")
    try:
        c = json.loads(conf.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"model = {model}: {conf}: cannot be read ({str(exc).splitlines()[0][:200]})") from None
    c = c.get("text_config", c) if isinstance(c, dict) else {}
    if not any(c.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise InputError(f"model = {model}: {conf}: model_type = {c.get('model_type')!r} has no experts "
                         f"(no num_experts, num_local_experts or n_routed_experts): not a mixture-of-experts model")
    return p


def checkpoint_digest(model_dir: str | os.PathLike) -> str:
    """A cheap digest of a checkpoint folder: SHA-256 of config.json's bytes and of the relative name,
    size and modification time (ns) of every other file in it (the safetensors shards and their index,
    the tokenizer), no weight read. A rewritten or touched shard changes it; a copy of the folder to
    another disk (new mtimes) records once more."""
    root = Path(model_dir)
    h = hashlib.sha256()
    h.update((root / "config.json").read_bytes())
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "config.json" and not p.name.startswith("."):
            st = p.stat()
            h.update(f"\0{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def model_config_json(model: Path) -> str:
    """The model's config.json text: the checkpoint's, or the transformers config of a GGUF."""
    return gguf.gguf_config(model, "model =").to_json_string() if gguf.is_gguf(model) else (model / "config.json").read_text()


def model_digest(model: Path) -> str:
    """`checkpoint_digest` of a folder, `gguf.file_digest` of a GGUF file."""
    return gguf.file_digest(model) if gguf.is_gguf(model) else checkpoint_digest(model)


def sha_file(path: Path | str) -> str:
    """SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def trace_key(digest: str, text: Path, max_tokens: int | None, lookahead: int, dtype: str,
              scores: bool = False) -> str:
    """The cache key of a recorded trace: the checkpoint, the text's bytes and the recording parameters
    (max_memory_GiB is not one: a streamed recording equals the in-memory one, runtime/backends/stream.py);
    `scores`: with the router_scores column (Cache-Prior replays it)."""
    parts = [str(RECORDER_VERSION), digest, sha_file(text), str(max_tokens), str(lookahead), dtype]
    if scores:  # (keys of traces without the column are unchanged)
        parts.append("router_scores")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def cache_root() -> Path:
    """`$EXPERTSWEEP_CACHE`, default `~/.cache/expertsweep` (runtime.tools.tinymodel's; no torch import here)."""
    env = os.environ.get("EXPERTSWEEP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "expertsweep"


def recorded_trace(model_dir: Path, text: Path, digest: str, max_tokens: int | None, lookahead: int,
                   dtype: str, max_memory: float | str, scores: bool = False) -> tuple[Path, bool]:
    """The trace of `text` on this node's cache (recorded now unless cached): (path, was cached)."""
    key = trace_key(digest, text, max_tokens, lookahead, dtype, scores)
    dest = cache_root() / "traces" / f"{model_dir.name}-{key}.parquet"
    if dest.is_file():
        log.info("router trace of %s: cached %s", text, dest)
        return dest, True
    from runtime.tools.record import record_trace

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.stem}.tmp{os.getpid()}.parquet")
    log.info("recording the router trace of %s (dtype %s, max_memory_GiB %s)", text, dtype, max_memory)
    try:
        record_trace(model_dir, text, tmp, max_tokens=max_tokens, progress=False, lookahead=lookahead, dtype=dtype,
                     max_memory=max_memory, router_scores=scores)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest, False


def scores_need(cfg: SweepConfig) -> bool:
    """Whether the space can draw Cache-Prior routing, or a named baseline routes so, which replays the traces'
    router_scores column."""
    from runtime.core.policy import PRESETS

    return (("route" in cfg.space.names and "cache-prior" in cfg.space["route"].values())
            or any(PRESETS[n].route == "cache-prior" for n in cfg.baseline_policies))


def lookahead_need(cfg: SweepConfig) -> int | None:
    """None when the space never draws prefetch lookahead; else the widest prefetch_n it can draw (0 if
    none: prefetch_n unset means k). The lookahead column recorded is max(k, this)."""
    names = cfg.space.names
    if "prefetch" not in names or "lookahead" not in cfg.space["prefetch"].values():
        return None
    n = 0
    if "prefetch_n" in names:
        p = cfg.space["prefetch_n"]
        n = int(max(v for v in p.values() if v is not None) if p.kind in ("fixed", "choice") else p.high)
    return n


def record_on_node(model: str, text: str | None, calib_text: str | None, max_tokens: int | None,
                   look_need: int | None, dtype: str, max_memory: float | str, scores: bool = False) -> dict[str, Any]:
    """Body of the recording task (sweep/worker.py `record_task`), on a node holding the model: resolve
    the texts beside the model, record (or reuse) their traces, return them as bytes."""
    model_dir = resolve_model(model)
    folder = gguf.model_folder(model_dir)
    text_p = _abs(text, "text") if text else folder / "eval.txt"
    if not text_p.is_file():
        raise InputError(f"model = {model}: {text_p} is missing (give text: FILE)")
    calib_p = _abs(calib_text, "calib_text") if calib_text else (
        folder / "calib.txt" if (folder / "calib.txt").is_file() else None)
    if calib_p is not None and calib_p == text_p:
        raise InputError(f"calib_text = {calib_text}: the evaluated text itself (a warm start must not "
                         f"see the evaluated data; leave calib_text out for a held-out part)")
    config_json = model_config_json(model_dir)
    k = int(json.loads(config_json).get("num_experts_per_tok", 8))
    look = 0 if look_need is None else max(k, look_need)
    digest = model_digest(model_dir)
    out: dict[str, Any] = {"model_dir": str(model_dir), "text": str(text_p), "digest": digest,
                           "calib_text": str(calib_p) if calib_p else None, "config_json": config_json,
                           "model_name": model_dir.name}
    tag = (f"{model_dir.name}-{digest[:12]}-{max_tokens or 'all'}" + (f"-look{look}" if look else "")
           + ("-scores" if scores else ""))
    for role, src in (("eval", text_p), ("calib", calib_p)):
        if src is None:
            out[role] = None
            continue
        path, cached = recorded_trace(model_dir, src, digest, max_tokens, look, dtype, max_memory, scores)
        name = f"eval-{tag}.parquet" if role == "eval" else f"calib-{src.stem}-{tag}.parquet"
        out[role] = {"name": name, "data": path.read_bytes(), "cached": cached, "cache": str(path)}
    return out


def locate(cfg: SweepConfig) -> Located:
    """What the driver can check before Ray starts (every problem an InputError)."""
    if cfg.model is None:
        if cfg.calib_text:
            raise InputError(f"{cfg.source}: calib_text = {cfg.calib_text} needs model: "
                             f"(a trace sweep takes calib_trace)")
        return Located(None, False, None, None)
    if cfg.model_resource:
        if cfg.model in ("demo", "test") or not Path(cfg.model).is_absolute():
            raise InputError(f"{cfg.source}: model = {cfg.model}: with model_resource = {cfg.model_resource} give "
                             f"the checkpoint folder's absolute path on the nodes offering model:{cfg.model_resource}")
        for key in ("text", "calib_text"):
            v = getattr(cfg, key)
            if v and not Path(v).is_absolute():
                raise InputError(f"{cfg.source}: {key} = {v}: with model_resource give an absolute path "
                                 f"(on the nodes offering model:{cfg.model_resource})")
        return Located(cfg.model, False, cfg.text, cfg.calib_text)
    model_dir = resolve_model(cfg.model)
    text = _abs(cfg.text, "text") if cfg.text else gguf.model_folder(model_dir) / "eval.txt"
    if not text.is_file():
        raise InputError(f"model = {cfg.model}: {text} is missing (give text: FILE)")
    calib_text = _abs(cfg.calib_text, "calib_text") if cfg.calib_text else None
    if calib_text is not None and calib_text == text:
        raise InputError(f"calib_text = {cfg.calib_text}: the evaluated text itself (a warm start must not "
                         f"see the evaluated data; leave calib_text out for a held-out part)")
    return Located(str(model_dir), True, str(text), str(calib_text) if calib_text else None)


def _synthetic(spec: dict[str, Any], folder: Path) -> tuple[Path, Path]:
    params = dict(spec)
    calib_sample = params.pop("calib_sample", params.get("sample", 0) + 1000)
    stamp = folder / "synthetic.json"
    paths = folder / "synthetic.parquet", folder / "synthetic_calib.parquet"
    if stamp.is_file() and json.loads(stamp.read_text()) == spec and all(p.is_file() for p in paths):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    try:
        save_trace(synthetic_trace(**params), paths[0])
        save_trace(synthetic_trace(**{**params, "sample": calib_sample}), paths[1])
    except TypeError as exc:
        raise InputError(f"trace.synthetic: {exc}") from None
    stamp.write_text(json.dumps(spec))
    return paths


def _write(path: Path, data: bytes | str) -> Path:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
    os.replace(tmp, path)
    return path


def prepare(cfg: SweepConfig, out: Path, loc: Located, record: Any = None) -> Inputs:
    """Resolve and, where needed, build the traces; every problem is an InputError. `record(**kw)` runs
    `record_on_node` where the model is (sweep/worker.py `record_task`; default: in this process)."""
    folder = out / "traces"  # made only when something is written there (a synthetic or recorded trace)
    model_dir, text, calib_text = loc.model_dir, loc.text, loc.calib_text
    model_config = digest = None
    calib = str(_abs(cfg.calib_trace, "calib_trace")) if cfg.calib_trace else None
    if isinstance(cfg.trace, dict):
        trace, synth_calib = (str(p) for p in _synthetic(cfg.trace["synthetic"], folder))
        calib = calib or synth_calib
    elif cfg.trace is not None:
        trace = str(_abs(cfg.trace, "trace"))
    elif model_dir is not None:
        got = (record or record_on_node)(model=model_dir, text=text, calib_text=calib_text,
                                         max_tokens=cfg.max_tokens, look_need=lookahead_need(cfg), dtype=cfg.dtype,
                                         max_memory=cfg.max_memory_GiB, scores=scores_need(cfg))
        model_dir, text, calib_text, digest = got["model_dir"], got["text"], got["calib_text"], got["digest"]
        conf_dir = folder / got["model_name"]
        conf_dir.mkdir(parents=True, exist_ok=True)
        model_config = str(_write(conf_dir / "config.json", got["config_json"]))
        for role in ("eval", "calib"):
            if got[role] is not None:
                log.info("router trace %s: %s on the model's node (%s)", got[role]["name"],
                         "cached" if got[role]["cached"] else "recorded", got[role]["cache"])
        trace = str(_write(folder / got["eval"]["name"], got["eval"]["data"]))
        if calib is None and got["calib"] is not None:
            calib = str(_write(folder / got["calib"]["name"], got["calib"]["data"]))
    else:
        raise InputError(f"{cfg.source}: give model: (demo, test or a folder) or trace: (a file or synthetic)")
    t: Trace = load_trace(trace)
    if calib is not None:
        c = load_trace(calib, num_experts=t.E)
        if (c.L, c.E, c.k) != (t.L, t.E, t.k):
            raise InputError(f"calib_trace {calib}: L={c.L}, E={c.E}, k={c.k} differ from the trace's "
                             f"L={t.L}, E={t.E}, k={t.k}")
    if calib is None and calib_text is None:
        warm = ("held-out: the last 20% of the evaluated tokens calibrate the cache and are not evaluated "
                "(no calib_text, no calib.txt beside the model, no calib_trace)")
        log.warning("no calibration text or trace: the warm start uses %s", warm)
    else:
        sim = f"calibration trace {calib}" if calib else "held-out 20% of the trace"
        emu = f"calibration text {calib_text}" if calib_text else "held-out 20% of the text"
        warm = f"simulator: {sim}; emulation: {emu}" if model_dir is not None else f"simulator: {sim}"
    return Inputs(trace, calib, model_dir, text, calib_text, (t.L, t.E, t.k), warm, model_config, digest)


def check_capacity(cfg: SweepConfig, dims: tuple[int, int, int], expert_bytes: int) -> None:
    """The space's capacity range must give k <= C < E on this trace (checked before any trial)."""
    L, E, k = dims

    def slots(name: str, v: float) -> int:
        return int(round(v * E)) if name == "capacity_fraction" else int(v * 2**30 // (L * expert_bytes))

    p = cfg.space[cfg.space.capacity_field]
    checks = [(f"space.{p.name}", p.name, v)
              for v in (list(p.values()) if p.kind in ("fixed", "choice") else [p.low, p.high])]
    checks += [(f"baselines.{name}", name, v) for name, v in cfg.baseline_capacity().items()]
    for where, name, v in checks:
        c = slots(name, v)
        if not k <= c < E:
            raise InputError(f"{cfg.source}: {where} = {v:g} gives {c} expert slots per layer; "
                             f"the trace needs k={k} <= slots < E={E}")
