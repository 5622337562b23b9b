"""Host profiles (`HostProfile`): a GPU host's link, device and host-CPU figures, stored as YAML.

Presets `rtx3090`, `rtx4090`, `rtx5090` are package data, `runtime/data/hosts/<name>.yaml`, found with
`importlib.resources` (in a checkout and in an installed wheel alike; `EXPERTSWEEP_HOSTS_DIR` names another
folder of presets instead). Also the YAML reading, validation and preset lookup that `shapes` shares.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from runtime.core.errors import InputError, atomic_write

log = logging.getLogger(__name__)

_HOST_REQUIRED_FLOATS = (
    "link_GBps", "link_pageable_GBps", "link_latency_us", "device_mem_GBps",
    "device_overhead_us", "host_mem_GBps", "host_overhead_us",
)
_HOST_OPTIONAL_FLOATS = ("device_expert_us", "host_expert_us", "dense_layer_us", "head_us", "lowbit_expert_us")


# ----------------------------------------------------------------------------- validation

def _where(source: str | None) -> str:
    return f"{source}: " if source else ""


def _check_positive_number(value: Any, fld: str, source: str | None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise InputError(f"{_where(source)}field '{fld}' = {value!r}: expected a positive number")
    return float(value)


def _check_positive_int(value: Any, fld: str, source: str | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise InputError(f"{_where(source)}field '{fld}' = {value!r}: expected a positive integer")
    return int(value)


def _check_text(value: Any, fld: str, source: str | None) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{_where(source)}field '{fld}' = {value!r}: expected a non-empty string")
    return value


def _check_fields(data: Any, cls: type, source: str | None) -> None:
    if not isinstance(data, dict):
        raise InputError(f"{_where(source)}expected a mapping of {cls.__name__} fields, "
                         f"got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise InputError(f"{_where(source)}unknown field '{key}' = {data[key]!r} "
                             f"(known: {', '.join(sorted(known))})")
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in data:
            raise InputError(f"{_where(source)}missing field '{f.name}'")


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{path}: invalid YAML{where}: {problem}") from exc


def _preset_dir(env: str, sub: str) -> Path:
    """The folder of `sub` presets: `$env` when set, else the package data `runtime/data/<sub>`
    (`importlib.resources`: the checkout's folder, or the installed package's; a zipped install is
    not supported)."""
    if os.environ.get(env):
        return Path(os.environ[env])
    return Path(str(resources.files("runtime") / "data" / sub))


def _resolve(name_or_path: str | os.PathLike, env: str, sub: str, what: str) -> Path:
    text = os.fspath(name_or_path)
    path = Path(text)
    looks_like_path = path.suffix.lower() in (".yaml", ".yml", ".json") or os.sep in text \
        or "/" in text
    if looks_like_path or path.is_file():
        if not path.is_file():
            raise InputError(f"{what} file '{text}' does not exist")
        return path
    preset = _preset_dir(env, sub) / f"{text}.yaml"
    if preset.is_file():
        return preset
    avail = ", ".join(_list_presets(env, sub)) or "none"
    raise InputError(f"unknown {what} '{text}': not a file and not a preset (presets: {avail})")


def _write_text(path: str | os.PathLike, text: str) -> None:
    def write(tmp: str) -> None:
        Path(tmp).write_text(text, encoding="utf-8")

    atomic_write(path, write)


def _list_presets(env: str, sub: str) -> list[str]:
    d = _preset_dir(env, sub)
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


# ----------------------------------------------------------------------------- host profiles

@dataclass(frozen=True)
class HostProfile:
    """One host: link, device and host-CPU figures. Field names are the YAML keys.

    GB/s are 1e9 bytes per second. The optional `*_us` calibration fields, when set,
    replace the bandwidth formulas of `cost_params`; they are measured at one model shape
    and are only meaningful with that shape.
    """

    name: str
    gpu: str
    link_GBps: float
    link_pageable_GBps: float
    link_latency_us: float
    device_mem_GBps: float
    device_overhead_us: float
    host_mem_GBps: float
    host_overhead_us: float
    device_expert_us: float | None = None
    host_expert_us: float | None = None
    dense_layer_us: float | None = None
    head_us: float | None = None  # final norm + LM head per token (calibrated)
    lowbit_expert_us: float | None = None  # one low-bit expert dequantized and computed on the device
    vram_GiB: float = 24.0
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _validate_host(self, None)


def _validate_host(p: HostProfile, source: str | None) -> None:
    _check_text(p.name, "name", source)
    _check_text(p.gpu, "gpu", source)
    for f in _HOST_REQUIRED_FLOATS:
        object.__setattr__(p, f, _check_positive_number(getattr(p, f), f, source))
    for f in _HOST_OPTIONAL_FLOATS:
        v = getattr(p, f)
        if v is not None:
            object.__setattr__(p, f, _check_positive_number(v, f, source))
    object.__setattr__(p, "vram_GiB", _check_positive_number(p.vram_GiB, "vram_GiB", source))
    src = p.sources
    if isinstance(src, str) or not isinstance(src, list | tuple) \
            or not all(isinstance(s, str) for s in src):
        raise InputError(f"{_where(source)}field 'sources' = {src!r}: expected a list of strings")
    object.__setattr__(p, "sources", tuple(src))


def host_profile_from_dict(data: Any, source: str | None = None) -> HostProfile:
    """Build a validated `HostProfile` from a mapping (errors name `source`)."""
    _check_fields(data, HostProfile, source)
    d = dict(data)
    if "sources" in d and d["sources"] is None:
        d["sources"] = ()
    # validate with the file name in the message before the dataclass validates again
    probe = object.__new__(HostProfile)
    for f in dataclasses.fields(HostProfile):
        object.__setattr__(probe, f.name, d.get(f.name, f.default))
    _validate_host(probe, source)
    return HostProfile(**{f.name: getattr(probe, f.name) for f in dataclasses.fields(HostProfile)})


def list_host_profiles() -> list[str]:
    """Names of the host presets (`runtime/data/hosts/`, or `$EXPERTSWEEP_HOSTS_DIR`)."""
    return _list_presets("EXPERTSWEEP_HOSTS_DIR", "hosts")


def load_host_profile(name_or_path: str | os.PathLike) -> HostProfile:
    """A preset name (`rtx3090`, `rtx4090`, `rtx5090`: `runtime/data/hosts/<name>.yaml`) or a YAML path."""
    path = _resolve(name_or_path, "EXPERTSWEEP_HOSTS_DIR", "hosts", "host profile")
    prof = host_profile_from_dict(_read_yaml(path), str(path))
    log.debug("host profile %s from %s", prof.name, path)
    return prof


def save_host_profile(profile: HostProfile, path: str | os.PathLike) -> None:
    """Write `profile` as YAML readable by `load_host_profile` (unset calibration fields omitted)."""
    data: dict[str, Any] = {}
    for f in dataclasses.fields(HostProfile):
        v = getattr(profile, f.name)
        if f.name in _HOST_OPTIONAL_FLOATS and v is None:
            continue
        data[f.name] = list(v) if f.name == "sources" else v
    _write_text(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
