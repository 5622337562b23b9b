"""Where an engine run and an emulation run of one policy part, and why (first used on speed-first's difference).

    python scripts/exact_divergence.py --policy P [--model DIR] [--text FILE] [--calib-text FILE] [--max-tokens 4096]
                                       [--window 256] [--capacity-fraction 0.25] [--device cpu] [--out FILE.json]

Runs the policy through `--backend emulation` and `--backend engine` in this one process (the same RunSpec as
scripts/exact_cli_check.py's processes), keeping every MoE layer's packed routing row as the kernel's caller
read it (the model's top-k ids and gate weights, the router scores: runtime/backends/adapters.py `pack`) and
every decision (`record_decisions`). Then, in token-major order (token, then layer):
- `first_selection_diff`: the first token-layer where the MODEL's top-k selections differ, the experts in one
  selection and not the other, their router scores in each backend and the gap between them;
- `first_decision_diff`: the first token-layer where the kernel's decisions (kind, served, slot) differ;
- `score_diff_before`: the largest router-score difference of any token-layer before the first selection
  difference (the rounding of the batched forward against the one-token decode).
Verdict `routing near-tie` when the decisions agree on every token-layer before the selections part, the
experts swapped there are within `--tie-tol` of each other in one backend's scores, and the scores before it
agree within `--round-tol`: the model itself routed differently because the batched and the one-token forward
round differently, and from there on the two runs compute different things (no policy or kernel fault).
Otherwise `decisions differ on the same routing` (a fault to find) or `no difference`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def capture(backend: str, spec) -> tuple[dict, dict[int, np.ndarray]]:
    """One run of `spec` through `backend` with every packed routing row the kernel's caller read, per MoE layer
    [T, P] in token order -> (the Result as a dict with its decisions, {layer: rows})."""
    from runtime import backends
    from runtime.backends import adapters
    from runtime.backends.engine import graphs

    rows: dict[int, list[np.ndarray]] = {}
    dec0, one0 = adapters.PolicyExperts.decide, graphs.OneCall.decide

    def dec(self, packed, k, dtype):  # the emulation, and the engine's step-by-step path
        if self.ctx.cache is not None:  # the policy's run (not the warm start's recording pass)
            rows.setdefault(self.layer, []).append(np.array(packed, np.float32))
        return dec0(self, packed, k, dtype)

    def one(self, layer, x, st):  # the engine's one compiled call
        rows.setdefault(layer, []).append(np.array(self.packed[layer], np.float32))
        return one0(self, layer, x, st)

    adapters.PolicyExperts.decide, graphs.OneCall.decide = dec, one
    try:
        r = backends.evaluate(spec, backend)
    finally:
        adapters.PolicyExperts.decide, graphs.OneCall.decide = dec0, one0
    T = r.decisions["kind"].shape[0]
    if any(sum(len(x) for x in v) != T for v in rows.values()):
        raise RuntimeError(f"{backend}: routing rows per layer {[sum(len(x) for x in v) for v in rows.values()]} "
                           f"!= the {T} decided tokens")
    return ({"counters": r.counters, "per_layer": r.per_layer, "decisions": r.decisions, "k": r.top_k,
             "E": r.num_experts, "tokens": r.tokens},
            {lay: np.concatenate(v) for lay, v in rows.items()})


def first_cell(diff: np.ndarray) -> tuple[int, int] | None:
    """The first True of a [T, L] mask in token-major order (token, then layer), or None."""
    hit = np.flatnonzero(diff.ravel())
    return None if not hit.size else (int(hit[0] // diff.shape[1]), int(hit[0] % diff.shape[1]))


def compare(em: tuple[dict, dict], en: tuple[dict, dict], W: int, tie_tol: float, round_tol: float) -> dict:
    """The module doc's report from two `capture` results."""
    (re, pe), (rg, pg) = em, en
    k, E, L = re["k"], re["E"], len(pe)
    T = min(len(pe[0]), len(pg[0]))
    sel = [np.stack([np.sort(p[lay][:T, :k], 1) for lay in range(L)], 1).astype(np.int64) for p in (pe, pg)]  # [T, L, k]
    sc = [np.stack([p[lay][:T, 2 * k : 2 * k + E] for lay in range(L)], 1) for p in (pe, pg)]  # [T, L, E]
    de, dg = re["decisions"], rg["decisions"]
    ddiff = np.zeros((T, L), bool)
    for f in ("kind", "served", "slot"):
        ddiff |= (np.asarray(de[f])[:T] != np.asarray(dg[f])[:T]).any(2)
    fs, fd = first_cell((sel[0] != sel[1]).any(2)), first_cell(ddiff)
    ints = [c for c in re["counters"] if isinstance(re["counters"][c], int)]  # (the masses round differently)
    out: dict = {"tokens_compared": T, "window": W,
                 "int_counters_equal": all(re["counters"][c] == rg["counters"][c] for c in ints),
                 "layers_with_different_int_counters": [
                     lay for lay in range(L) if any(re["per_layer"][lay].get(c) != rg["per_layer"][lay].get(c)
                                                    for c in ints)]}
    out["first_decision_diff"] = None if fd is None else {"token": fd[0], "window": fd[0] // W,
                                                          "position": fd[0] % W, "layer": fd[1]}
    if fs is None:
        out["first_selection_diff"] = None
        out["verdict"] = "no difference" if fd is None else "decisions differ on the same routing"
        return out
    t, lay = fs
    only_e = sorted(set(sel[0][t, lay].tolist()) - set(sel[1][t, lay].tolist()))
    only_g = sorted(set(sel[1][t, lay].tolist()) - set(sel[0][t, lay].tolist()))
    pairs = [(a, b) for a in only_e for b in only_g]
    gaps = [min(abs(float(sc[0][t, lay, a] - sc[0][t, lay, b])), abs(float(sc[1][t, lay, a] - sc[1][t, lay, b])))
            for a, b in pairs]
    before = np.abs(sc[0] - sc[1])
    mask = np.zeros((T, L), bool)
    mask[:t] = True
    mask[t, :lay] = True
    sdb = float(before[mask].max()) if mask.any() else 0.0
    scale = max(1.0, float(np.abs(sc[0][t, lay]).max()))
    out["first_selection_diff"] = {
        "token": t, "window": t // W, "position": t % W, "layer": lay, "emulation_only": only_e, "engine_only": only_g,
        "scores_emulation": {str(e): float(sc[0][t, lay, e]) for e in only_e + only_g},
        "scores_engine": {str(e): float(sc[1][t, lay, e]) for e in only_e + only_g},
        "gap": min(gaps) if gaps else None}
    out["score_diff_before"] = sdb
    decisions_first = fd is not None and (fd[0], fd[1]) < (t, lay)
    tie = bool(gaps) and min(gaps) <= tie_tol * scale
    out["verdict"] = ("routing near-tie" if not decisions_first and tie and sdb <= round_tol * scale else
                      "decisions differ on the same routing" if decisions_first else "routing differs (not a near-tie)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--policy", required=True, help="a preset")
    p.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--text", default=None)
    p.add_argument("--calib-text", default=None)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--capacity-fraction", type=float, default=0.25)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tie-tol", type=float, default=1e-5, help="a near-tie: swapped experts' scores within this "
                   "(relative to max(1, the row's largest |score|)) in one backend")
    p.add_argument("--round-tol", type=float, default=1e-4, help="the backends' scores before it agree within this")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from runtime.core.policy import PRESETS
    from runtime.core.spec import RunSpec

    if a.model is None:
        from runtime.tools.tinymodel import model_dir

        a.model = str(model_dir("demo"))
    a.text = a.text or str(Path(a.model) / "eval.txt")
    if a.calib_text is None and (Path(a.model) / "calib.txt").is_file():
        a.calib_text = str(Path(a.model) / "calib.txt")
    spec = RunSpec(policy=PRESETS[a.policy], name=a.policy, model=a.model, text=a.text, calib_text=a.calib_text,
                   max_tokens=a.max_tokens, window=a.window, capacity_fraction=a.capacity_fraction, device=a.device,
                   record_decisions=True)
    res = compare(capture("emulation", spec), capture("engine", spec), a.window, a.tie_tol, a.round_tol)
    res = {"policy": a.policy, "model": a.model, "max_tokens": a.max_tokens, **res}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["verdict"] in ("no difference", "routing near-tie") else 1


if __name__ == "__main__":
    sys.exit(main())
