"""First step of scripts/gpu_checks.sh: record this machine's versions and check every library internal the adapters use.

    python scripts/gpu_env.py OUT.json

Writes OUT.json with: Python, torch (+ CUDA, cuDNN, GPU name, compute capability, memory), transformers,
numba, numpy and the other packages the engine needs, each against the version in constraints.txt (the
tested environment); the packages that are missing; whether pytest-timeout is there; and the result of
the internals check: for every adapter family (runtime/tools/tinyhf.py), a tiny random model built in memory
with the machine's transformers must (1) expose the sparse block the adapters wrap (router returning
(logits, weights, indices), fused experts gate_up_proj [E, 2I, H] / down_proj [E, H, I] called as
experts(x, indices, weights)), (2) give identical logits with the adapters attached and no cache, and
(3) identical logits with a cache holding every expert (all hits), and the causal LM's forward must take
the KV cache as `cache` or `past_key_values` (runtime.backends.engine.forward_cached). Exit status 0 when every
required package imports and every family passes, 1 otherwise (the later steps still run: their results
then say whether a failure is version skew or CUDA).
"""

from __future__ import annotations

import importlib
import inspect
import json
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

REQUIRED = ("torch", "transformers", "numba", "numpy", "pyarrow", "yaml", "safetensors", "tokenizers", "tqdm", "pytest")
DIST = {"yaml": "PyYAML"}


def tested_versions() -> dict[str, str]:
    out = {}
    p = ROOT / "constraints.txt"
    if p.is_file():
        for line in p.read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                name, v = line.split("==", 1)
                out[name.strip().lower()] = v.strip()
    return out


def versions() -> dict:
    tested = tested_versions()
    rec: dict = {"python": platform.python_version(), "platform": platform.platform(), "packages": {}, "missing": [],
                 "skew": {}}
    for mod in REQUIRED:
        try:
            m = importlib.import_module(mod)
            v = str(getattr(m, "__version__", "?"))
        except Exception as exc:  # noqa: BLE001 - anything that stops the import is "missing"
            rec["missing"].append(f"{mod} ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")
            continue
        rec["packages"][mod] = v
        want = tested.get(DIST.get(mod, mod).lower())
        if want and v.split("+")[0] != want.split("+")[0]:
            rec["skew"][mod] = {"machine": v, "tested": want}
    try:  # optional: the low-bit fallback's quantizer
        import hqq

        rec["packages"]["hqq"] = str(getattr(hqq, "__version__", "?"))
    except ImportError:
        rec["optional_missing"] = ["hqq (fallback = lowbit)"]
    try:
        import pytest_timeout  # noqa: F401

        rec["pytest_timeout"] = True
    except ImportError:
        rec["pytest_timeout"] = False
    try:
        import torch

        rec["cuda_available"] = bool(torch.cuda.is_available())
        rec["torch_cuda"] = torch.version.cuda
        rec["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            rec["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_GiB": p.total_memory / 2**30}
    except Exception as exc:  # noqa: BLE001
        rec["torch_error"] = str(exc)[:200]
    return rec


def check_family(family: str) -> dict:
    """The adapters' view of one family with this machine's transformers (see the module doc)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.backends import adapters
    from runtime.backends.engine import kv_cache_kwarg
    from runtime.core.kernel import PolicyCache
    from runtime.core.policy import PRESETS
    from runtime.tools.tinyhf import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(family)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    x = torch.randint(0, 100, (2, 9))
    with torch.inference_mode():
        ref = model(input_ids=x, use_cache=False).logits
    fam = adapters.family_of(cfg)
    blocks = adapters.moe_blocks(model, fam)
    if not blocks:
        return {"ok": False, "why": "no sparse block with a router and an experts module"}
    ex = getattr(blocks[0], fam.experts_attr)
    gu, d = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    layout = isinstance(gu, torch.Tensor) and gu.dim() == 3 and isinstance(d, torch.Tensor) and d.dim() == 3
    params = list(inspect.signature(type(ex).forward).parameters)
    ctx = adapters.attach(model)
    with torch.inference_mode():
        same = torch.equal(model(input_ids=x, use_cache=False).logits, ref)
        L, E, k = adapters.moe_geometry(model)
        ctx.cache = PolicyCache(PRESETS["fetch-every-miss"], E, k, np.full(L, E), [np.arange(E)] * L, allow_full=True)
        try:
            full = model(input_ids=x, use_cache=False).logits
        finally:
            ctx.cache = None
    dev = float((full - ref).abs().max())
    res = {"fused_expert_layout": bool(layout), "experts_forward": params[1:4], "identity_exact": bool(same),
           "all_resident_max_abs_diff": dev, "kv_cache_argument": kv_cache_kwarg(type(model))}
    res["ok"] = bool(same and dev <= 1e-5 and len(params) >= 4)
    if family != "gpt_oss":  # the engine needs the fused layout without biases (gpt-oss is refused by design)
        res["ok"] = res["ok"] and bool(layout)
    return res


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    t0 = time.perf_counter()
    rec = versions()
    fams: dict = {}
    if not rec["missing"]:
        from runtime.tools.tinyhf import FAMILIES

        for f in FAMILIES:
            try:
                fams[f] = check_family(f)
            except Exception as exc:  # noqa: BLE001 - report it, the other families still run
                fams[f] = {"ok": False, "why": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
                           "where": traceback.format_exc().splitlines()[-3:]}
    rec["internals"] = fams
    rec["ok"] = not rec["missing"] and bool(fams) and all(v["ok"] for v in fams.values())
    rec["seconds"] = time.perf_counter() - t0
    text = json.dumps(rec, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
