"""Hosts of a sweep: Ray nodes carrying a custom resource `host:NAME`, and their cost profiles.

A simulated host takes its profile from a preset (`runtime/data/hosts/NAME.yaml`, or `preset:OTHER`, or a
YAML file); a real host (`profile: calibrate`) is measured by the engine's calibration
(`runtime.tools.calibrate.calibrate` on the model's engine) run as a Ray task pinned to that host's
node, with one GPU where its nodes have one (else in the engine's CPU device mode). Trials request a sliver
(`HOST_SLIVER`) of `host:NAME` besides their CPU, so they run only on that host's nodes while
the CPUs there bound how many run at once.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from runtime.core.errors import InputError
from runtime.formats import costmodel
from sweep.config import HostSpec

log = logging.getLogger(__name__)

HOST_SLIVER = 0.001  # of host:NAME per trial; a node offers host:NAME = 1


def resource(name: str) -> str:
    return f"host:{name}"


def local_resources(hosts: tuple[HostSpec, ...]) -> dict[str, float]:
    """Custom resources of an embedded single-node cluster that simulates every host."""
    return {resource(h.name): 1.0 for h in hosts}


def check_cluster(hosts: tuple[HostSpec, ...], cluster_resources: dict[str, float]) -> None:
    """One-line InputError for the first host that no node of the cluster offers."""
    offered = sorted(k for k in cluster_resources if k.startswith("host:"))
    for h in hosts:
        if cluster_resources.get(h.resource, 0) <= 0:
            raise InputError(f"host {h.name}: no Ray node has the resource {h.resource} (the cluster offers "
                             f"{', '.join(offered) or 'no host:NAME resources'}; start a node with "
                             f"ray start --resources '{{\"{h.resource}\": 1}}')")


def profile_to_dict(profile: costmodel.HostProfile) -> dict[str, Any]:
    d = dataclasses.asdict(profile)
    d["sources"] = list(profile.sources)
    return d


def preset_profile(spec: HostSpec) -> costmodel.HostProfile | None:
    """The profile of a simulated host (None for `calibrate`)."""
    prof = spec.profile
    if prof == "calibrate":
        return None
    where = f"host {spec.name}: profile"
    if prof == "preset":
        target = spec.name
    elif prof.startswith("preset:"):
        target = prof[len("preset:"):]
    else:
        target = str(Path(prof).expanduser().resolve())
        if not Path(target).is_file():
            raise InputError(f"{where} = {prof!r}: no such file (give preset, preset:NAME, calibrate or a host YAML)")
    if "/" not in target and target not in costmodel.list_host_profiles():
        raise InputError(f"{where}: no preset named {target!r} (presets: {', '.join(costmodel.list_host_profiles())}; "
                         f"give profile: preset:NAME, a host YAML or calibrate)")
    try:
        return costmodel.load_host_profile(target)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None


def _calibrate(model_dir: str, name: str, dtype: str = "auto", max_memory: float | str = "auto") -> dict[str, Any]:
    """Ray task body: measure this node with the model's engine (its calibration), loaded in the
    sweep's `dtype` within its `max_memory_GiB` (streamed into the host store above it)."""
    from runtime.backends.engine import load_engine
    from runtime.tools.calibrate import calibrate

    eng = load_engine(model_dir, dtype=dtype, max_memory=max_memory)
    try:
        prof, _ = calibrate(eng)
    finally:
        eng.close()
    return {**profile_to_dict(prof), "name": name}


def gpus_of(host: str) -> int:
    """1 when every alive node of `host` has a GPU, else 0 (the engine then runs on the CPU)."""
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource(host), 0) > 0]
    return 1 if nodes and all(n["Resources"].get("GPU", 0) >= 1 for n in nodes) else 0


def resolve_profiles(hosts: tuple[HostSpec, ...], model_dir: str | None, dtype: str = "auto",
                     max_memory: float | str = "auto") -> dict[str, dict[str, Any]]:
    """name -> profile dict; presets read here, calibrations run as Ray tasks on their hosts (in parallel),
    each loading the model in `dtype` within `max_memory` GiB of host RAM (the sweep config's)."""
    out: dict[str, dict[str, Any]] = {}
    pending = {}
    for h in hosts:
        prof = preset_profile(h)
        if prof is not None:
            out[h.name] = profile_to_dict(prof)
            continue
        if model_dir is None:
            raise InputError(f"host {h.name}: profile calibrate needs a model (set model: in the sweep config)")
        import ray

        task = ray.remote(_calibrate).options(num_gpus=gpus_of(h.name), num_cpus=1,
                                              resources={h.resource: HOST_SLIVER}, name=f"calibrate:{h.name}")
        pending[h.name] = task.remote(model_dir, h.name, dtype, max_memory)
    if pending:
        import ray

        log.warning("calibrating %s on their nodes", ", ".join(pending))
        for name, ref in pending.items():
            out[name] = ray.get(ref)
    return out


def simulated(spec: HostSpec) -> bool:
    return spec.profile != "calibrate"
