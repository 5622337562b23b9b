"""Router traces on disk: the in-memory `Trace`, its file formats and the validation of every loaded trace.

A trace records, for every token of a stream and every traced MoE layer, the router's top-k
selection (in router order), the gate weights the model applied (or none: `TraceMeta.gate_weights` False, routing
ids imported from an engine's dump by imports.py), and the first M entries of the
candidate ranking (M >= k; M = E keeps it exact); optionally a lookahead list per token and layer
(the first P ids of layer l + 1's router applied to layer l's router input, for prefetch), and
optionally the router scores of every expert (`router_scores`, float32 [T, L, E]: the logits of a softmax
router, the selection scores `sigmoid(z) + b` of a sigmoid one; Cache-Prior routing needs them). This module
holds `Trace` and `TraceMeta`, the on-disk formats (Parquet / Arrow IPC, one row per (token, layer);
`.npz` import of recorder dumps), the validation every loaded trace goes through (one-line
`InputError`s naming file, field, value and location) and the calibration split of a stream.

The file formats are documented in docs/traces.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from runtime.core.errors import InputError, atomic_write, check_output_path
from runtime.formats.trace.checks import _first, _fmt, _loc, _validate_arrays, _validate_lookahead

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_KEY = b"expertsweep"
WEIGHT_NORMS = ("softmax_topk", "softmax_all", "sigmoid_topk", "unknown")
SUFFIXES = (".parquet", ".arrow", ".npz")


@dataclass(frozen=True)
class TraceMeta:
    model: str  # e.g. "Qwen/Qwen3-Next-80B-A3B" or "synthetic"
    num_experts: int  # E
    top_k: int  # k
    ranking_depth: int  # M >= k
    layer_ids: tuple[int, ...]  # model layer index of each trace layer
    weight_norm: str  # "softmax_topk" (renormalised) | "softmax_all" | "sigmoid_topk" (DeepSeek-V3) | "unknown"
    text_sha256: str = ""  # digest of the text the trace was recorded on
    source: str = ""  # where the trace came from (file, recorder, generator settings)
    lookahead_depth: int = 0  # P: width of the optional lookahead column (0: none)
    # False: the trace holds no gate weights (routing ids imported from a serving engine's dump,
    # runtime/formats/trace/imports.py): topk_weights is NaN throughout, the file has no topk_weights column,
    # and only the policies that read no weight replay it (runtime/core/policy.py `gate_weight_readers`)
    gate_weights: bool = True


@dataclass
class Trace:
    topk_ids: np.ndarray  # int32 [T, L, k], router order (descending score)
    topk_weights: np.ndarray  # float32 [T, L, k], gate weights as the model applied them (NaN: meta.gate_weights False)
    ranking: np.ndarray  # int32 [T, L, M], candidate ranking, ranking[..., :k] == topk_ids
    valid: np.ndarray  # bool [T, L]; invalid cells are skipped by every backend
    seq_id: np.ndarray  # int32 [T]
    position: np.ndarray  # int32 [T], position within the sequence
    meta: TraceMeta
    # int32 [T, L, P] or None: on layer l's row the first P ids, in score order, of layer l + 1's router
    # applied to layer l's router input (lookahead prefetch); the last layer's rows are -1 (none)
    lookahead: np.ndarray | None = None
    # float32 [T, L, E] or None: every expert's router score (the column `router_scores`; docs/traces.md)
    router_scores: np.ndarray | None = None

    @property
    def T(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def L(self) -> int:
        return int(self.topk_ids.shape[1])

    @property
    def k(self) -> int:
        return int(self.topk_ids.shape[2])

    @property
    def M(self) -> int:
        return int(self.ranking.shape[2])

    @property
    def E(self) -> int:
        return int(self.meta.num_experts)

    def slice_tokens(self, a: int, b: int) -> Trace:
        """Tokens [a, b) of the stream (numpy slice semantics); arrays are views, meta is shared."""
        s = slice(a, b)
        return Trace(self.topk_ids[s], self.topk_weights[s], self.ranking[s], self.valid[s],
                     self.seq_id[s], self.position[s], self.meta,
                     None if self.lookahead is None else self.lookahead[s],
                     None if self.router_scores is None else self.router_scores[s])


# ----------------------------------------------------------------------------------------------
# validation


def _validate_meta(where: str, meta: TraceMeta, L: int, k: int, M: int) -> None:
    if not isinstance(meta, TraceMeta):
        raise InputError(f"{where}: meta is {type(meta).__name__}, expected TraceMeta")
    if meta.top_k != k:
        raise InputError(f"{where}: meta top_k = {meta.top_k} but topk_ids has k = {k} slots")
    if meta.ranking_depth != M:
        raise InputError(f"{where}: meta ranking_depth = {meta.ranking_depth} but ranking has M = {M}")
    if len(meta.layer_ids) != L:
        raise InputError(f"{where}: meta layer_ids has {len(meta.layer_ids)} entries "
                         f"{list(meta.layer_ids)} but the trace has L = {L} layers")
    if not (isinstance(meta.lookahead_depth, int) and meta.lookahead_depth >= 0):
        raise InputError(f"{where}: meta lookahead_depth = {meta.lookahead_depth!r} must be an integer >= 0")
    if not isinstance(meta.gate_weights, bool):
        raise InputError(f"{where}: meta gate_weights = {meta.gate_weights!r} must be true or false")
    if meta.weight_norm not in WEIGHT_NORMS:
        raise InputError(f"{where}: meta weight_norm = {meta.weight_norm!r}, expected one of "
                         f"{', '.join(WEIGHT_NORMS)}")


def _validate_scores(where: str, trace: Trace) -> None:
    """The optional router_scores column: float32 [T, L, E], finite on valid cells."""
    sc = trace.router_scores
    if sc is None:
        return
    want = (trace.T, trace.L, trace.meta.num_experts)
    if tuple(sc.shape) != want:
        raise InputError(f"{where}: router_scores has shape {tuple(sc.shape)}, expected {list(want)}")
    if sc.dtype != np.float32:
        raise InputError(f"{where}: router_scores has dtype {sc.dtype}, expected float32")
    i = _first(~np.isfinite(sc) & trace.valid[..., None])
    if i is not None:
        raise InputError(f"{where}: router_scores[{_loc(i)}] = {_fmt(sc[tuple(i)])} is not finite")


def validate_trace(trace: Trace, path: str | os.PathLike[str] = "<trace>") -> None:
    """Check shapes, dtypes, id ranges, repeats, weights, the ranking and the lookahead lists; raise a
    one-line InputError.

    Cells with valid == False are not checked (they may hold -1 / NaN)."""
    where = str(path)
    weighted = getattr(trace.meta, "gate_weights", True)
    _validate_arrays(where, trace.topk_ids, trace.topk_weights if weighted else None, trace.ranking, trace.valid,
                     trace.seq_id, trace.position, trace.meta.num_experts)
    if not weighted:
        _validate_no_weights(where, trace.topk_weights, trace.topk_ids.shape)
    _validate_lookahead(where, trace.lookahead, trace.valid, trace.meta.num_experts,
                        getattr(trace.meta, "lookahead_depth", 0))
    if trace.lookahead is not None and trace.lookahead.dtype != np.int32:
        raise InputError(f"{where}: lookahead has dtype {trace.lookahead.dtype}, expected int32")
    _validate_scores(where, trace)
    for name, a, dt in (("topk_ids", trace.topk_ids, np.int32), ("ranking", trace.ranking, np.int32),
                        ("topk_weights", trace.topk_weights, np.float32),
                        ("valid", trace.valid, np.bool_), ("seq_id", trace.seq_id, np.int32),
                        ("position", trace.position, np.int32)):
        if a.dtype != dt:
            raise InputError(f"{where}: {name} has dtype {a.dtype}, expected {np.dtype(dt)}")
    _validate_meta(where, trace.meta, trace.L, trace.k, trace.M)


def _validate_no_weights(where: str, w: np.ndarray, shape: tuple[int, ...]) -> None:
    """A trace without gate weights (meta.gate_weights False) holds NaN in topk_weights [T, L, k], nothing else."""
    if tuple(w.shape) != tuple(shape) or w.dtype.kind != "f":
        raise InputError(f"{where}: topk_weights has dtype {w.dtype} and shape {tuple(w.shape)}, expected floats "
                         f"{tuple(shape)} (NaN: the trace has no gate weights)")
    i = _first(~np.isnan(w))
    if i is not None:
        raise InputError(f"{where}: topk_weights[{_loc(i)}] = {_fmt(w[tuple(i)])} but meta gate_weights = False "
                         f"(a trace without gate weights holds NaN there)")


def _normalise_invalid(trace: Trace) -> None:
    """Invalid cells get ids 0..k-1 / ranking 0..M-1 in order and weight 0 (in place)."""
    bad = ~trace.valid  # [T, L]
    if bad.any():
        trace.topk_ids[bad] = np.arange(trace.k, dtype=np.int32)
        trace.ranking[bad] = np.arange(trace.M, dtype=np.int32)
        trace.topk_weights[bad] = 0.0 if trace.meta.gate_weights else np.nan
        if trace.lookahead is not None:
            trace.lookahead[bad] = -1
        if trace.router_scores is not None:
            trace.router_scores[bad] = 0.0


def _warn_order(where: str, trace: Trace) -> None:
    if not trace.meta.gate_weights:
        return
    w = trace.topk_weights
    n = int(((w[..., 1:] > w[..., :-1] + 1e-6) & trace.valid[..., None]).any(-1).sum())
    if n:
        logger.warning("%s: topk_weights are not in descending order in %d of %d token-layers; "
                       "ranks follow the stored order", where, n, trace.valid.sum())


# ----------------------------------------------------------------------------------------------
# Parquet / Arrow IPC


def _schema(meta: TraceMeta, k: int, M: int, P: int = 0, scores: bool = False) -> pa.Schema:
    fields = [
        pa.field("token", pa.int32(), nullable=False),
        pa.field("seq_id", pa.int32(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("valid", pa.bool_(), nullable=False),
        pa.field("topk_ids", pa.list_(pa.int32(), k), nullable=False),
        pa.field("topk_weights", pa.list_(pa.float32(), k), nullable=False),
        pa.field("ranking", pa.list_(pa.int32(), M), nullable=False),
    ]
    if not meta.gate_weights:  # no gate weights: no column (a reader that predates the flag refuses the file)
        fields.pop(6)
    if P:
        fields.append(pa.field("lookahead", pa.list_(pa.int32(), P), nullable=False))
    if scores:
        fields.append(pa.field("router_scores", pa.list_(pa.float32(), meta.num_experts), nullable=False))
    info = {"format_version": FORMAT_VERSION, **dataclasses.asdict(meta)}
    info["layer_ids"] = [int(x) for x in meta.layer_ids]
    return pa.schema(fields, metadata={META_KEY: json.dumps(info).encode()})


def _to_table(trace: Trace) -> pa.Table:
    T, L, k, M = trace.T, trace.L, trace.k, trace.M
    if L > np.iinfo(np.int16).max:
        raise InputError(f"cannot save a trace with L = {L} layers (the layer column is int16)")
    n = T * L

    def fsl(a: np.ndarray, width: int) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(a).reshape(n * width)), width)

    cols = [
        pa.array(np.repeat(np.arange(T, dtype=np.int32), L)),
        pa.array(np.repeat(trace.seq_id, L)),
        pa.array(np.repeat(trace.position, L)),
        pa.array(np.tile(np.arange(L, dtype=np.int16), T)),
        pa.array(np.ascontiguousarray(trace.valid).reshape(n)),
        fsl(trace.topk_ids, k),
        fsl(trace.topk_weights, k),
        fsl(trace.ranking, M),
    ]
    if not trace.meta.gate_weights:
        cols.pop(6)
    P = 0
    if trace.lookahead is not None:
        P = trace.lookahead.shape[2]
        cols.append(fsl(trace.lookahead, P))
    if trace.router_scores is not None:
        cols.append(fsl(trace.router_scores, trace.E))
    return pa.Table.from_arrays(cols, schema=_schema(trace.meta, k, M, P, trace.router_scores is not None))


def trace_output_path(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """A command's trace output, checked before any work: a .parquet or .arrow name (what `save_trace` writes) that
    `check_output_path` accepts; else a one-line InputError naming `flag`."""
    out = Path(path)
    if out.suffix not in (".parquet", ".arrow"):
        raise InputError(f"{flag} {out}: use a .parquet or .arrow file name")
    check_output_path(out, flag)
    return out


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write `trace` as Parquet (`.parquet`, zstd) or Arrow IPC file (`.arrow`), atomically.

    The trace is validated first; any other suffix is an InputError (`.npz` is import-only)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".arrow"):
        raise InputError(f"{path}: cannot save a trace as '{suffix or path.name}' "
                         f"(use a .parquet or .arrow file name)")
    validate_trace(trace, "<trace to save>")
    table = _to_table(trace)

    def write(tmp: str) -> None:
        if suffix == ".parquet":
            pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)
        else:
            with pa.OSFile(tmp, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
                w.write_table(table)

    try:
        atomic_write(path, write)
    except OSError as e:
        raise InputError(f"{path}: cannot write trace: {e.strerror or e}") from e
    logger.info("saved trace %s: T=%d L=%d k=%d M=%d E=%d", path, trace.T, trace.L, trace.k,
                trace.M, trace.E)


def _meta_from_json(where: str, raw: bytes | None) -> TraceMeta:
    if raw is None:
        raise InputError(f"{where}: not an ExpertSweep trace (no '{META_KEY.decode()}' schema metadata)")
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{where}: schema metadata '{META_KEY.decode()}' is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise InputError(f"{where}: schema metadata '{META_KEY.decode()}' is not a JSON object")
    version = d.get("format_version")
    if version != FORMAT_VERSION:
        raise InputError(f"{where}: format_version = {version!r} is not supported "
                         f"(this version of ExpertSweep reads {FORMAT_VERSION})")
    kw: dict = {}
    for f in dataclasses.fields(TraceMeta):
        if f.name not in d:
            if f.default is dataclasses.MISSING:
                raise InputError(f"{where}: metadata field '{f.name}' is missing")
            continue
        v = d[f.name]
        if f.name in ("num_experts", "top_k", "ranking_depth", "lookahead_depth"):
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif f.name == "gate_weights":
            ok = isinstance(v, bool)
        elif f.name == "layer_ids":
            ok = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            v = tuple(v) if ok else v
        else:
            ok = isinstance(v, str)
        if not ok:
            raise InputError(f"{where}: metadata field '{f.name}' = {v!r} has the wrong type")
        kw[f.name] = v
    return TraceMeta(**kw)


def _list_values(where: str, table: pa.Table, name: str, width: int) -> np.ndarray:
    """A list column as a numpy array [n_rows, width] (no per-row Python work)."""
    col = table.column(name)
    if col.null_count:
        raise InputError(f"{where}: column '{name}' has {col.null_count} null rows")
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_fixed_size_list(arr.type):
        if arr.type.list_size != width:
            raise InputError(f"{where}: column '{name}' holds lists of {arr.type.list_size}, expected {width}")
    elif pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        lengths = arr.value_lengths().to_numpy(zero_copy_only=False)
        i = _first(lengths != width)
        if i is not None:
            raise InputError(f"{where}: column '{name}' row {int(i[0])} has {int(lengths[i[0]])} "
                             f"entries, expected {width}")
    else:
        raise InputError(f"{where}: column '{name}' has type {arr.type}, expected a list")
    flat = arr.flatten()
    if flat.null_count:
        raise InputError(f"{where}: column '{name}' has {flat.null_count} null entries")
    return flat.to_numpy(zero_copy_only=False).reshape(len(arr), width)


def _scalar_column(where: str, table: pa.Table, name: str) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        raise InputError(f"{where}: column '{name}' has {col.null_count} null rows")
    return col.to_numpy()


def _int_column(where: str, table: pa.Table, name: str) -> np.ndarray:
    """An integer column: integers, or floats that are whole numbers (a writer's float64); anything else (strings,
    even "0", "1"; 0.5; booleans) is a one-line InputError naming the column and the first bad value."""
    typ = table.schema.field(name).type
    a = _scalar_column(where, table, name)
    if pa.types.is_integer(typ):
        return a.astype(np.int64)
    if pa.types.is_floating(typ):
        i = _first(~np.isfinite(a) | (a != np.round(a)))
        if i is None:
            return a.astype(np.int64)
        r = int(i[0])
        raise InputError(f"{where}: column '{name}' row {r} holds {float(a[r])!r}, expected an integer")
    raise InputError(f"{where}: column '{name}' has type {typ} (first value {a[0]!r}), expected integers")


def _from_table(where: str, table: pa.Table, num_experts: int | None) -> Trace:
    meta = _meta_from_json(where, (table.schema.metadata or {}).get(META_KEY))
    if num_experts is not None:
        meta = dataclasses.replace(meta, num_experts=int(num_experts))
    names = set(table.column_names)
    for name in ("token", "layer", "topk_ids") + (("topk_weights",) if meta.gate_weights else ()):
        if name not in names:
            raise InputError(f"{where}: required column '{name}' is missing")
    if not meta.gate_weights and "topk_weights" in names:
        raise InputError(f"{where}: metadata gate_weights = false but the file has a 'topk_weights' column")
    L, k, M = len(meta.layer_ids), meta.top_k, meta.ranking_depth
    n = table.num_rows
    if L < 1 or k < 1:
        raise InputError(f"{where}: metadata gives L = {L} layers and top_k = {k}, both must be >= 1")
    if n == 0 or n % L:
        raise InputError(f"{where}: {n} rows is not a positive multiple of L = {L} layers")
    T = n // L

    token = _int_column(where, table, "token")
    layer = _int_column(where, table, "layer")
    want_t = np.repeat(np.arange(T), L)
    want_l = np.tile(np.arange(L), T)
    order = None
    if not (np.array_equal(token, want_t) and np.array_equal(layer, want_l)):
        order = np.lexsort((layer, token))  # rows may come in any order; sort by (token, layer)
        token, layer = token[order], layer[order]
        i = _first((token != want_t) | (layer != want_l))
        if i is not None:
            r = int(i[0])
            raise InputError(f"{where}: rows must cover each (token, layer) with token in [0, {T}) "
                             f"and layer in [0, {L}) exactly once; found (token {token[r]}, "
                             f"layer {layer[r]}) where (token {want_t[r]}, layer {want_l[r]}) was expected")

    def rows(a: np.ndarray) -> np.ndarray:
        return a if order is None else a[order]

    ids = rows(_list_values(where, table, "topk_ids", k)).reshape(T, L, k)
    w = (rows(_list_values(where, table, "topk_weights", k)).reshape(T, L, k) if meta.gate_weights
         else np.full((T, L, k), np.nan, np.float32))  # no gate weights: NaN
    if "ranking" in names:
        ranking = rows(_list_values(where, table, "ranking", M)).reshape(T, L, M)
    elif M == k:
        ranking = ids.copy()
    else:
        raise InputError(f"{where}: column 'ranking' is missing but ranking_depth = {M} > top_k = {k}")
    valid = rows(_scalar_column(where, table, "valid")).reshape(T, L) if "valid" in names \
        else np.ones((T, L), dtype=bool)
    per_token = {}
    for name in ("seq_id", "position"):
        if name not in names:
            continue
        a = rows(_scalar_column(where, table, name)).reshape(T, L)
        i = _first(a != a[:, :1])
        if i is not None:
            raise InputError(f"{where}: column '{name}' differs between layers of token {int(i[0])} "
                             f"({a[i[0], 0]} at layer 0, {a[tuple(i)]} at layer {int(i[1])})")
        per_token[name] = a[:, 0]
    seq_id = per_token.get("seq_id", np.zeros(T, dtype=np.int64))
    position = per_token.get("position", _positions(seq_id))
    look = None
    if meta.lookahead_depth:
        if "lookahead" not in names:
            raise InputError(f"{where}: metadata lookahead_depth = {meta.lookahead_depth} but column 'lookahead' is missing")
        look = rows(_list_values(where, table, "lookahead", meta.lookahead_depth)).reshape(T, L, meta.lookahead_depth)
    scores = None
    if "router_scores" in names:
        E = meta.num_experts
        scores = rows(_list_values(where, table, "router_scores", E)).reshape(T, L, E)

    return _build(where, ids, w, ranking, valid, seq_id, position, meta, look, scores)


def _build(where: str, ids: np.ndarray, w: np.ndarray, ranking: np.ndarray, valid: np.ndarray,
           seq_id: np.ndarray, position: np.ndarray, meta: TraceMeta, lookahead: np.ndarray | None = None,
           router_scores: np.ndarray | None = None) -> Trace:
    """Cast to the Trace dtypes (always copying: callers' arrays are never modified) and validate."""
    arrays = (ids, w, ranking, valid, seq_id, position)
    dtypes = (np.int32, np.float32, np.int32, np.bool_, np.int32, np.int32)
    if any(a.dtype != dt for a, dt in zip(arrays, dtypes, strict=True)):
        # check before casting so that e.g. int64 ids beyond the int32 range are reported as they are
        _validate_arrays(where, ids, w if meta.gate_weights else None, *arrays[2:], meta.num_experts)
        if np.iinfo(np.int32).max < max(meta.num_experts, int(seq_id.max()), int(position.max())):
            raise InputError(f"{where}: num_experts = {meta.num_experts}, seq_id or position "
                             f"exceeds the int32 range")
    if lookahead is not None:
        if lookahead.dtype.kind not in "iu":
            raise InputError(f"{where}: lookahead has dtype {lookahead.dtype}, expected integers")
        i32 = np.iinfo(np.int32)
        if lookahead.size and not (i32.min <= int(lookahead.min()) and int(lookahead.max()) <= i32.max):
            raise InputError(f"{where}: lookahead holds id {int(lookahead.max())} (or {int(lookahead.min())}) "
                             f"outside the int32 range")
        lookahead = np.array(lookahead, dtype=np.int32, order="C")
    if router_scores is not None:
        if router_scores.dtype.kind != "f":
            raise InputError(f"{where}: router_scores has dtype {router_scores.dtype}, expected floats")
        router_scores = np.array(router_scores, dtype=np.float32, order="C")
    trace = Trace(*(np.array(a, dtype=dt, order="C") for a, dt in zip(arrays, dtypes, strict=True)), meta, lookahead,
                  router_scores)
    validate_trace(trace, where)
    return trace


def _read_table(where: str, path: Path, suffix: str) -> pa.Table:
    try:
        if suffix == ".parquet":
            # (pq.read_table would import pyarrow.dataset); page CRCs catch corrupted data pages
            with pq.ParquetFile(path, page_checksum_verification=True) as f:
                return f.read()
        with pa.memory_map(str(path), "r") as src:
            try:
                return pa.ipc.open_file(src).read_all()
            except pa.ArrowInvalid as e:
                try:  # also accept the IPC stream format; report the file reader's error otherwise
                    src.seek(0)
                    return pa.ipc.open_stream(src).read_all()
                except pa.ArrowException:
                    raise e from None
    except FileNotFoundError as e:
        raise InputError(f"{where}: no such file") from e
    except (pa.ArrowException, OSError, ValueError, EOFError) as e:
        kind = "Parquet" if suffix == ".parquet" else "Arrow IPC"
        raise InputError(f"{where}: not a readable {kind} file (truncated or corrupt?): {e}") from e


# ----------------------------------------------------------------------------------------------
# .npz import


def _positions(seq_id: np.ndarray) -> np.ndarray:
    """Index of each token among the earlier tokens of its sequence: [T] -> [T]."""
    T = len(seq_id)
    order = np.argsort(seq_id, kind="stable")
    s = seq_id[order]
    start = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # group starts in sorted order
    group_start = np.repeat(start, np.diff(np.r_[start, T]))
    pos = np.empty(T, dtype=np.int64)
    pos[order] = np.arange(T) - group_start
    return pos


def _npz_scalar(where: str, z: dict[str, np.ndarray], name: str, kind: str = "iu") -> object:
    a = z[name]
    if a.ndim != 0 or a.dtype.kind not in kind:
        raise InputError(f"{where}: field '{name}' has dtype {a.dtype} and shape {tuple(a.shape)}, "
                         f"expected a scalar")
    return a.item()


def _load_npz(where: str, path: Path, num_experts: int | None) -> Trace:
    try:
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise InputError(f"{where}: not an .npz archive (a single .npy array?)")
        with f:
            z = {name: f[name] for name in f.files}
    except FileNotFoundError as e:
        raise InputError(f"{where}: no such file") from e
    except InputError:
        raise
    except (zipfile.BadZipFile, zlib.error, OSError, ValueError, EOFError, KeyError) as e:
        raise InputError(f"{where}: not a readable .npz file (truncated or corrupt?): {e}") from e

    for name in ("topk_ids", "topk_weights"):
        if name not in z:
            raise InputError(f"{where}: required field '{name}' is missing (fields: {', '.join(sorted(z))})")
    ids, w = z["topk_ids"], z["topk_weights"]
    if ids.ndim != 3:
        raise InputError(f"{where}: topk_ids has shape {tuple(ids.shape)}, expected [T, L, k]")
    T, L, k = ids.shape
    valid = z["valid"] if "valid" in z else np.ones((T, L), dtype=bool)
    ranking = z["ranking"] if "ranking" in z else ids
    if ranking.ndim != 3 or tuple(ranking.shape[:2]) != (T, L):
        raise InputError(f"{where}: ranking has shape {tuple(ranking.shape)}, expected [{T}, {L}, M]")
    look = z.get("lookahead")
    if look is not None and (look.ndim != 3 or tuple(look.shape[:2]) != (T, L)):
        raise InputError(f"{where}: lookahead has shape {tuple(look.shape)}, expected [{T}, {L}, P]")
    if ids.dtype.kind not in "iu":
        raise InputError(f"{where}: topk_ids has dtype {ids.dtype}, expected integers")
    if w.shape != ids.shape:
        raise InputError(f"{where}: topk_weights has shape {tuple(w.shape)}, expected {(T, L, k)} "
                         f"to match topk_ids")
    if valid.dtype.kind != "b" or valid.shape != (T, L):
        raise InputError(f"{where}: valid has dtype {valid.dtype} and shape {tuple(valid.shape)}, "
                         f"expected bool [{T}, {L}]")

    if "top_k" in z and _npz_scalar(where, z, "top_k") != k:
        raise InputError(f"{where}: top_k = {_npz_scalar(where, z, 'top_k')} but topk_ids has "
                         f"{k} slots per row")
    file_E = _npz_scalar(where, z, "num_experts") if "num_experts" in z else None
    if num_experts is not None:
        E = int(num_experts)
        if file_E is not None and file_E != E:
            logger.warning("%s: using num_experts = %d (the file says %d)", where, E, file_E)
    elif file_E is not None:
        E = int(file_E)
    else:
        E = int(ids[valid].max()) + 1 if valid.any() else k
        logger.info("%s: no num_experts given; using max id + 1 = %d", where, E)

    if "layers" in z:
        layers = z["layers"]
        if layers.dtype.kind not in "iu" or layers.shape != (L,):
            raise InputError(f"{where}: layers has dtype {layers.dtype} and shape "
                             f"{tuple(layers.shape)}, expected integers [{L}]")
        layer_ids = tuple(int(x) for x in layers)
    else:
        layer_ids = tuple(range(L))

    if "call_idx" in z:
        seq_id = z["call_idx"]
        if seq_id.shape != (T,) or seq_id.dtype.kind not in "iu":
            raise InputError(f"{where}: call_idx has dtype {seq_id.dtype} and shape "
                             f"{tuple(seq_id.shape)}, expected integers [{T}]")
    else:
        seq_id = np.zeros(T, dtype=np.int64)
    position = _positions(seq_id)

    if "weight_norm" in z:
        weight_norm = str(_npz_scalar(where, z, "weight_norm", "U"))
    elif valid.any():
        sums = w[valid].astype(np.float64).sum(-1)  # [n_valid]
        weight_norm = "softmax_topk" if np.all(np.abs(sums - 1.0) <= 1e-3) else "softmax_all"
    else:
        weight_norm = "unknown"
    model = str(_npz_scalar(where, z, "model", "U")) if "model" in z else "unknown"
    extra = sorted(set(z) - {"topk_ids", "topk_weights", "ranking", "valid", "num_experts", "top_k",
                             "layers", "call_idx", "weight_norm", "model", "lookahead", "router_scores"})
    if extra:
        logger.debug("%s: ignoring fields %s", where, ", ".join(extra))

    meta = TraceMeta(model=model, num_experts=E, top_k=k, ranking_depth=int(ranking.shape[2]),
                     layer_ids=layer_ids, weight_norm=weight_norm, source=path.name,
                     lookahead_depth=0 if look is None else int(look.shape[2]))
    return _build(where, ids, w, ranking, valid, seq_id, position, meta, look, z.get("router_scores"))


# ----------------------------------------------------------------------------------------------
# entry points


def load_trace(path: str | os.PathLike[str], num_experts: int | None = None) -> Trace:
    """Load and validate a trace by suffix: `.parquet`, `.arrow` (Arrow IPC) or `.npz` (import).

    `num_experts` overrides E from the file. Invalid cells come back normalised (ids 0..k-1,
    ranking 0..M-1, weights 0). Every problem with the file is a one-line InputError."""
    path = Path(path)
    where = str(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise InputError(f"{where}: unknown trace format '{suffix or path.name}' "
                         f"(expected {', '.join(SUFFIXES)})")
    if num_experts is not None:
        try:
            ok = not isinstance(num_experts, bool) and int(num_experts) == num_experts >= 1
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InputError(f"num_experts = {num_experts!r} must be a positive integer")
        num_experts = int(num_experts)
    if suffix == ".npz":
        trace = _load_npz(where, path, num_experts)
    else:
        trace = _from_table(where, _read_table(where, path, suffix), num_experts)
    _warn_order(where, trace)
    _normalise_invalid(trace)
    n_bad = int(trace.valid.size - trace.valid.sum())
    logger.info("loaded trace %s: T=%d L=%d k=%d M=%d E=%d (%d invalid cells)", where, trace.T,
                trace.L, trace.k, trace.M, trace.E, n_bad)
    return trace


def calibration_split(trace: Trace, fraction: float = 0.25) -> tuple[Trace, Trace]:
    """Split a stream into (calibration, evaluation) parts for warm-cache initialisation.

    The cut is the sequence boundary closest to `fraction * T` (the exact token if the trace is a
    single sequence); both parts are non-empty views of `trace`."""
    if not 0.0 < fraction < 1.0:
        raise InputError(f"calibration fraction = {fraction!r} must be in (0, 1)")
    T = trace.T
    if T < 2:
        raise InputError(f"cannot split a trace of {T} token(s) into calibration and evaluation parts")
    target = min(max(int(round(fraction * T)), 1), T - 1)
    starts = np.flatnonzero(trace.seq_id[1:] != trace.seq_id[:-1]) + 1  # sequence starts, in (0, T)
    cut = int(starts[np.argmin(np.abs(starts - target))]) if starts.size else target
    return trace.slice_tokens(0, cut), trace.slice_tokens(cut, T)
