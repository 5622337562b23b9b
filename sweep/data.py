"""The sweep's inputs: the model, its texts and router traces, resolved to absolute paths up front.

`prepare` runs in the driver before anything is scheduled, so a missing model, text or trace is a
one-line error before any trial. A model (`demo` / `test`: `runtime.tinymodel.ensure_model`,
or a folder with config.json) gets its evaluated text and calibration text recorded as router
traces (`runtime.record.record_trace`) into `<out>/traces/`, reused while newer than the model
and the texts. A synthetic trace (`trace: {synthetic: {...}}`) is generated there with its
calibration twin (the same model draw `seed`, another token draw `sample`), also reused while its
parameters are unchanged.

Warm start (never the evaluated data): the calibration text is the config's `calib_text`, else
the model's `calib.txt`; the calibration trace is `calib_trace`, else the one recorded from that
text, else the synthetic twin. Without any, every backend takes `held-out`: the last 20% of the
evaluated tokens (runtime/spec.py `HELD_OUT_FRACTION`) calibrate the cache and are not evaluated.
`Inputs.warm_start` says which, for the summary and MLflow.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import InputError
from runtime.trace import Trace, load_trace, save_trace, synthetic_trace
from sweep.config import SweepConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inputs:
    trace: str
    calib_trace: str | None
    model_dir: str | None
    text: str | None
    calib_text: str | None
    dims: tuple[int, int, int]  # L, E, k of the trace
    warm_start: str = ""  # where the warm start comes from, in words (summary.md, MLflow)


def _abs(path: str, where: str, kind: str = "file") -> Path:
    p = Path(path).expanduser()
    p = p if p.is_absolute() else Path.cwd() / p
    if kind == "file" and not p.is_file():
        raise InputError(f"{where} = {path}: no such file")
    if kind == "dir" and not p.is_dir():
        raise InputError(f"{where} = {path}: no such folder")
    return p.resolve()


def resolve_model(model: str) -> Path:
    """`demo` / `test` (built if absent) or a model folder holding config.json."""
    if model in ("demo", "test"):
        from runtime.tinymodel import ensure_model

        return Path(ensure_model(model, progress=True)).resolve()
    p = _abs(model, "model", "dir")
    if not (p / "config.json").is_file():
        raise InputError(f"model = {model}: {p} has no config.json")
    return p


def _fresh(target: Path, sources: list[Path]) -> bool:
    return target.is_file() and all(target.stat().st_mtime >= s.stat().st_mtime for s in sources)


def _record(model_dir: Path, text: Path, dest: Path, max_tokens: int | None, lookahead: int = 0) -> Path:
    if _fresh(dest, [model_dir / "config.json", text]):
        return dest
    from runtime.record import record_trace

    log.info("recording the router trace of %s", text)
    return Path(record_trace(model_dir, text, dest, max_tokens=max_tokens, progress=True, lookahead=lookahead))


def lookahead_width(cfg: SweepConfig, model_dir: Path) -> int:
    """The lookahead column a space needs (0 when it never draws prefetch lookahead): the widest
    prefetch_n it can draw, at least the model's top-k (prefetch_n unset means k)."""
    names = cfg.space.names
    if "prefetch" not in names or "lookahead" not in cfg.space["prefetch"].values():
        return 0
    k = int(json.loads((model_dir / "config.json").read_text()).get("num_experts_per_tok", 8))
    n = 0
    if "prefetch_n" in names:
        p = cfg.space["prefetch_n"]
        n = int(max(v for v in p.values() if v is not None) if p.kind in ("fixed", "choice") else p.high)
    return max(k, n)


def _synthetic(spec: dict[str, Any], folder: Path) -> tuple[Path, Path]:
    params = dict(spec)
    calib_sample = params.pop("calib_sample", params.get("sample", 0) + 1000)
    stamp = folder / "synthetic.json"
    paths = folder / "synthetic.parquet", folder / "synthetic_calib.parquet"
    if stamp.is_file() and json.loads(stamp.read_text()) == spec and all(p.is_file() for p in paths):
        return paths
    try:
        save_trace(synthetic_trace(**params), paths[0])
        save_trace(synthetic_trace(**{**params, "sample": calib_sample}), paths[1])
    except TypeError as exc:
        raise InputError(f"trace.synthetic: {exc}") from None
    stamp.write_text(json.dumps(spec))
    return paths


def prepare(cfg: SweepConfig, out: Path) -> Inputs:
    """Resolve and, where needed, build the traces; every problem is an InputError."""
    folder = out / "traces"
    folder.mkdir(parents=True, exist_ok=True)
    model_dir = text = calib_text = None
    if cfg.model is not None:
        model_dir = resolve_model(cfg.model)
        text = _abs(cfg.text, "text") if cfg.text else model_dir / "eval.txt"
        if not text.is_file():
            raise InputError(f"model = {cfg.model}: {text} is missing (give text: FILE)")
        if cfg.calib_text:
            calib_text = _abs(cfg.calib_text, "calib_text")
        elif (model_dir / "calib.txt").is_file():
            calib_text = model_dir / "calib.txt"
        if calib_text is not None and calib_text == text:
            raise InputError(f"calib_text = {cfg.calib_text}: the evaluated text itself (a warm start must not "
                             f"see the evaluated data; leave calib_text out for a held-out part)")
    elif cfg.calib_text:
        raise InputError(f"{cfg.source}: calib_text = {cfg.calib_text} needs model: (a trace sweep takes calib_trace)")
    calib = _abs(cfg.calib_trace, "calib_trace") if cfg.calib_trace else None
    if isinstance(cfg.trace, dict):
        trace, synth_calib = _synthetic(cfg.trace["synthetic"], folder)
        calib = calib or synth_calib
    elif cfg.trace is not None:
        trace = _abs(cfg.trace, "trace")
    elif model_dir is not None:
        look = lookahead_width(cfg, model_dir)
        tag = f"{model_dir.name}-{cfg.max_tokens or 'all'}" + (f"-look{look}" if look else "")
        trace = _record(model_dir, text, folder / f"eval-{tag}.parquet", cfg.max_tokens, look)
        if calib is None and calib_text is not None:
            ctag = f"{calib_text.stem}-{tag}"
            calib = _record(model_dir, calib_text, folder / f"calib-{ctag}.parquet", cfg.max_tokens, look)
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
    return Inputs(str(trace), str(calib) if calib else None, str(model_dir) if model_dir else None,
                  str(text) if text else None, str(calib_text) if calib_text else None, (t.L, t.E, t.k), warm)


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
