"""Routing dumps of serving engines (vLLM, SGLang, llama.cpp) as traces without gate weights.

`import_routing(path, routing_format, num_experts, top_k=None) -> Trace` reads the expert ids an engine
recorded and returns a validated `Trace` with `meta.gate_weights = False` (topk_weights NaN, ranking = the
top-k, M = k), which the simulator replays under the policies that read no gate weight
(runtime/core/policy.py `GATE_WEIGHT_READERS`). The formats (`ROUTING_FORMATS`; docs/traces.md, "Importing
routing from vLLM, SGLang and llama.cpp dumps"):

- `vllm`, `sglang`: integer ids `[tokens, layers, top_k]` as `.npy`, `.npz` (array `routed_experts` or
  `topk_ids`, or the archive's only array) or JSON (that nested list, or an object holding it under
  `routed_experts`): vLLM's `--enable-return-routed-experts` / SGLang's `return_routed_experts` output;
- `sglang-pt`: SGLang's `--expert-distribution-recorder-mode per_token` dump (`torch.load(weights_only=True)`):
  `topk_ids_of_layer` `[layers, tokens, top_k]`, at the top level or in each of its `records` (one per forward
  pass); physical ids are mapped to logical ones by `last_physical_to_logical_map` when the file has it;
- `llamacpp-csv`: llama.cpp's moe-trace CSV, rows `layer,expert`, one per routed activation;
- `pos-csv`: the forks' CSV, rows `pos,layer,id0,...,id{k-1}`.

Every problem with a file is a one-line `InputError` naming the file and the line, index or field. The
command line is `expertsweep record --routing FILE --routing-format F --experts E --out T.parquet`
(`add_routing_flags`, `import_main`, called by runtime/tools/record.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import pickle
import zipfile
import zlib
from pathlib import Path

import numpy as np

from runtime.core.errors import InputError
from runtime.formats.trace.checks import _check_ids, _first
from runtime.formats.trace.formats import (
    Trace,
    TraceMeta,
    _build,
    _positions,
    save_trace,
    trace_output_path,
)

logger = logging.getLogger(__name__)

ROUTING_FORMATS = ("vllm", "sglang", "sglang-pt", "llamacpp-csv", "pos-csv")
NPZ_NAMES = ("routed_experts", "topk_ids")  # the arrays a vllm / sglang .npz may hold the ids under
ARRAY_SUFFIXES = (".npy", ".npz", ".json")


# ---------------------------------------------------------------------------------------------- arrays


def _json_ints(where: str, obj: object, name: str) -> np.ndarray:
    """A JSON nested list of integers [tokens][layers][top_k] as int64 [T, L, k]; the first ragged row or
    non-integer value is a one-line error naming its index."""
    if not isinstance(obj, list) or not obj:
        raise InputError(f"{where}: {name} is {type(obj).__name__}, expected a non-empty list [tokens][layers][top_k]")
    dims = []
    x = obj
    while isinstance(x, list) and len(dims) < 3:
        dims.append(len(x))
        x = x[0] if x else None

    def walk(x: object, idx: tuple[int, ...]) -> None:
        at = f"{name}[{', '.join(map(str, idx))}]" if idx else name
        if len(idx) == 3:
            if isinstance(x, bool) or not isinstance(x, int):
                raise InputError(f"{where}: {at} = {x!r}, expected an integer expert id")
            return
        if not isinstance(x, list):
            raise InputError(f"{where}: {at} = {x!r}, expected a list ([tokens][layers][top_k])")
        if len(dims) <= len(idx) or len(x) != dims[len(idx)]:
            raise InputError(f"{where}: {at} has {len(x)} entries, expected {dims[len(idx)] if len(dims) > len(idx) else '?'} "
                             f"(every token lists the same layers, every layer the same top_k ids)")
        for i, y in enumerate(x):
            walk(y, (*idx, i))

    try:
        a = np.array(obj)
    except (ValueError, OverflowError):
        a = None
    if a is None or a.ndim != 3 or a.dtype.kind not in "iu" or a.dtype == np.bool_:
        walk(obj, ())  # raises on the first bad entry
        raise InputError(f"{where}: {name} is not an integer array [tokens][layers][top_k]")
    return a


def _load_array(where: str, path: Path) -> tuple[np.ndarray, str]:
    """(ids as stored, the field name) from a vllm / sglang file: .npy, .npz or .json."""
    suffix = path.suffix.lower()
    if suffix not in ARRAY_SUFFIXES:
        raise InputError(f"{where}: unknown suffix '{suffix or path.name}' for --routing-format vllm / sglang "
                         f"(expected {', '.join(ARRAY_SUFFIXES)})")
    try:
        if suffix == ".json":
            obj = json.loads(path.read_text())
            if isinstance(obj, dict):
                if "routed_experts" not in obj:
                    raise InputError(f"{where}: key 'routed_experts' is missing (keys: {', '.join(sorted(obj)) or 'none'})")
                if isinstance(obj["routed_experts"], str):
                    raise InputError(f"{where}: routed_experts is a string (SGLang's base64 of int32 ids): decode it "
                                     f"to a [tokens, layers, top_k] array and save it as .npy (docs/traces.md)")
                return _json_ints(where, obj["routed_experts"], "routed_experts"), "routed_experts"
            return _json_ints(where, obj, "ids"), "ids"
        loaded = np.load(path, allow_pickle=False)
        if suffix == ".npy":
            if not isinstance(loaded, np.ndarray):
                raise InputError(f"{where}: not a .npy array")
            return loaded, "array"
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise InputError(f"{where}: not an .npz archive")
        with loaded:
            names = list(loaded.files)
            name = next((n for n in NPZ_NAMES if n in names), names[0] if len(names) == 1 else None)
            if name is None:
                raise InputError(f"{where}: no array named {' or '.join(NPZ_NAMES)} (arrays: {', '.join(names) or 'none'})")
            return loaded[name], name
    except FileNotFoundError as e:
        raise InputError(f"{where}: no such file") from e
    except InputError:
        raise
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not a UTF-8 JSON file: {e}") from e
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON: {e}") from e
    except (zipfile.BadZipFile, zlib.error, OSError, ValueError, EOFError, KeyError) as e:
        raise InputError(f"{where}: not a readable {suffix} file (truncated, corrupt or pickled?): {e}") from e


def _load_sglang_pt(where: str, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, str]:
    """(ids [L, T, k] as stored, seq_id [T], physical-to-logical map [L, P] or None, field) from SGLang's
    per_token expert-distribution dump."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency
        raise InputError(f"{where}: --routing-format sglang-pt needs torch ({e})") from e
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise InputError(f"{where}: no such file") from e
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError, TypeError) as e:
        raise InputError(f"{where}: not a torch file readable with weights_only=True: {str(e).splitlines()[0]}") from e

    def tensor(x: object, field: str) -> np.ndarray:
        if not isinstance(x, torch.Tensor):
            raise InputError(f"{where}: {field} is {type(x).__name__}, expected an integer tensor [layers, tokens, top_k]")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise InputError(f"{where}: {field} has dtype {x.dtype}, expected integers")
        if x.ndim != 3:
            raise InputError(f"{where}: {field} has shape {tuple(x.shape)}, expected [layers, tokens, top_k]")
        return x.numpy().astype(np.int64)

    if not isinstance(obj, dict):
        raise InputError(f"{where}: holds a {type(obj).__name__}, expected a dict with 'topk_ids_of_layer' or 'records'")
    if "topk_ids_of_layer" in obj:
        ids = tensor(obj["topk_ids_of_layer"], "topk_ids_of_layer")
        seq = np.zeros(ids.shape[1], np.int64)
        field = "topk_ids_of_layer"
    elif "records" in obj:
        records = obj["records"]
        if not isinstance(records, list) or not records:
            raise InputError(f"{where}: records is {type(records).__name__}, expected a non-empty list of forward passes")
        parts, seqs = [], []
        for r, rec in enumerate(records):
            if not isinstance(rec, dict) or "topk_ids_of_layer" not in rec:
                raise InputError(f"{where}: records[{r}] has no key 'topk_ids_of_layer'")
            a = tensor(rec["topk_ids_of_layer"], f"records[{r}].topk_ids_of_layer")
            if parts and (a.shape[0], a.shape[2]) != (parts[0].shape[0], parts[0].shape[2]):
                raise InputError(f"{where}: records[{r}].topk_ids_of_layer has shape {tuple(a.shape)}, expected "
                                 f"[{parts[0].shape[0]}, tokens, {parts[0].shape[2]}] like records[0]")
            if a.shape[1]:
                parts.append(a)
                seqs.append(np.full(a.shape[1], r, np.int64))  # a forward pass is a sequence (docs/traces.md)
        if not parts:
            raise InputError(f"{where}: every record holds 0 tokens")
        ids, seq = np.concatenate(parts, axis=1), np.concatenate(seqs)
        field = "records[*].topk_ids_of_layer"
    else:
        raise InputError(f"{where}: key 'topk_ids_of_layer' is missing (keys: {', '.join(map(str, obj)) or 'none'})")
    mapping = obj.get("last_physical_to_logical_map")
    if mapping is not None:
        if not isinstance(mapping, torch.Tensor) or mapping.ndim != 2 or mapping.shape[0] != ids.shape[0]:
            raise InputError(f"{where}: last_physical_to_logical_map has shape "
                             f"{tuple(getattr(mapping, 'shape', ()))}, expected [{ids.shape[0]}, physical experts]")
        mapping = mapping.numpy().astype(np.int64)
    return ids, seq, mapping, field


def _placeholders(ids: np.ndarray) -> np.ndarray:
    """bool [L]: layers that hold no routing (ids [T, L, k]): all -1, or all 0 with k >= 2 (a top-k never repeats
    an id): the rows an engine's buffer keeps for a dense layer."""
    none = (ids == -1).all(axis=(0, 2))
    zero = (ids == 0).all(axis=(0, 2)) if ids.shape[2] >= 2 else np.zeros(ids.shape[1], bool)
    return none | zero


def _array_trace(where: str, ids: np.ndarray, field: str, num_experts: int, top_k: int | None, seq_id: np.ndarray,
                 mapping: np.ndarray | None, source: str) -> Trace:
    """ids [T, L, k] as the file holds them (any integer dtype) -> the Trace; placeholder layers and the -1 padding
    slots past k are left out (logged)."""
    T, L, k = ids.shape
    if min(T, L, k) < 1:
        raise InputError(f"{where}: {field} has shape {tuple(ids.shape)}, every dimension must be >= 1")
    drop = _placeholders(ids)
    if drop.all():
        raise InputError(f"{where}: {field} holds no routing (every layer all -1 or all 0)")
    layer_ids = tuple(int(i) for i in np.flatnonzero(~drop))
    if drop.any():
        logger.info("%s: left out %d layer(s) without routing (all -1 or all 0: dense layers): %s", where,
                    int(drop.sum()), ", ".join(map(str, np.flatnonzero(drop))))
        ids = ids[:, ~drop]
    pad = (ids == -1).all(axis=(0, 1))  # [k] slots the recorder pads (SGLang's fixed 8 for a smaller top-k)
    width = k - int(np.argmin(pad[::-1])) if pad.any() and not pad.all() else k
    if width < k and pad[width:].all():
        logger.info("%s: slots %d..%d are -1 throughout (padding): k = %d", where, width, k - 1, width)
        ids = ids[..., :width]
    if top_k is not None and top_k != ids.shape[2]:
        raise InputError(f"{where}: --top-k = {top_k} but {field} holds k = {ids.shape[2]} ids per token and layer")
    valid = np.ones(ids.shape[:2], bool)
    if mapping is not None:  # SGLang records physical ids: check them against the map, then map to logical ones
        mapping = mapping[list(layer_ids)]
        _check_ids(where, f"{field} (physical ids)", ids, valid, mapping.shape[1])
        ids = mapping[np.arange(ids.shape[1])[None, :, None], ids]  # [T, L, k]: mapping[l, ids[t, l, j]]
    _check_ids(where, field, ids, valid, num_experts)
    return _trace(where, ids, layer_ids, seq_id, num_experts, source)


def _trace(where: str, ids: np.ndarray, layer_ids: tuple[int, ...], seq_id: np.ndarray, num_experts: int,
           source: str) -> Trace:
    """The Trace of checked ids [T, L, k]: no gate weights (NaN), ranking = the top-k (M = k), every cell valid."""
    T, L, k = ids.shape
    meta = TraceMeta(model="unknown", num_experts=num_experts, top_k=k, ranking_depth=k, layer_ids=layer_ids,
                     weight_norm="unknown", source=source, gate_weights=False)
    w = np.full((T, L, k), np.nan, np.float32)  # [T, L, k]: no gate weights
    return _build(where, ids, w, ids, np.ones((T, L), bool), seq_id, _positions(seq_id), meta)


# ---------------------------------------------------------------------------------------------- CSVs


def _csv_rows(where: str, path: Path, width: int | None, columns: str) -> tuple[np.ndarray, np.ndarray]:
    """(values int64 [rows, width], line numbers [rows]) of an integer CSV; a first line that is not integers is a
    header. `width` None: every line as wide as the first."""
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise InputError(f"{where}: no such file") from e
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not a UTF-8 text file: {e}") from e
    except OSError as e:
        raise InputError(f"{where}: cannot read: {e.strerror or e}") from e
    rows, lines = [], []
    header_ok = True  # the first non-empty line may be a header
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        try:
            vals = [int(f) for f in fields]
        except ValueError:
            if header_ok:
                header_ok = False
                continue
            bad = next(f for f in fields if not _is_int(f))
            raise InputError(f"{where}: line {n}: {bad!r} is not an integer (columns {columns})") from None
        want = width if width is not None else (len(rows[0]) if rows else len(vals))
        if len(vals) != want:
            raise InputError(f"{where}: line {n} has {len(vals)} fields, expected {want} (columns {columns})")
        header_ok = False
        rows.append(vals)
        lines.append(n)
    if not rows:
        raise InputError(f"{where}: no rows (columns {columns})")
    return np.array(rows, np.int64), np.array(lines, np.int64)


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _per_layer(where: str, layer: np.ndarray, lines: np.ndarray, per_token: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the layers, sorted; per layer the indices of its rows in file order), each layer with the same number of
    rows, a multiple of `per_token` (else a one-line error naming the layers and counts)."""
    i = _first(layer < 0)
    if i is not None:
        raise InputError(f"{where}: line {int(lines[i[0]])}: layer {int(layer[i[0]])} is negative")
    layers = np.unique(layer)  # sorted
    order = np.argsort(layer, kind="stable")  # rows grouped by layer, file order within a layer
    rows = np.split(order, np.cumsum(np.bincount(np.searchsorted(layers, layer), minlength=len(layers)))[:-1])
    counts = [len(r) for r in rows]
    for lay, r in zip(layers, rows, strict=True):
        if len(r) % per_token:
            raise InputError(f"{where}: layer {int(lay)} has {len(r)} rows, not a multiple of k = {per_token} "
                             f"(its last row: line {int(lines[r[-1]])})")
    if len(set(counts)) > 1:
        a, b = int(np.argmax(counts)), int(np.argmin(counts))
        raise InputError(f"{where}: layer {int(layers[a])} has {counts[a] // per_token} tokens but layer "
                         f"{int(layers[b])} has {counts[b] // per_token} (ragged: every token lists every MoE layer)")
    return layers, rows


def _check_rows(where: str, ids: np.ndarray, lines: np.ndarray, num_experts: int) -> None:
    """ids [T, L, k] with the line of each id: out of range or repeated within a token-layer, naming the line."""
    i = _first((ids < 0) | (ids >= num_experts))
    if i is not None:
        raise InputError(f"{where}: line {int(lines[tuple(i)])}: expert {int(ids[tuple(i)])} is out of range "
                         f"[0, {num_experts})")
    srt = np.sort(ids, axis=-1)  # [T, L, k]
    i = _first(srt[..., 1:] == srt[..., :-1])
    if i is not None:
        t, ly = int(i[0]), int(i[1])
        e = srt[t, ly, i[2]]
        at = lines[t, ly][ids[t, ly] == e]
        raise InputError(f"{where}: line {int(at[-1])}: expert {int(e)} repeated within one token's top-k at one layer "
                         f"(lines {', '.join(str(int(x)) for x in np.unique(at))})")


def _llamacpp_csv(where: str, path: Path, num_experts: int, top_k: int | None, source: str) -> Trace:
    """llama.cpp moe-trace: `layer,expert` rows, each (ubatch, layer) writing its tokens' k ids token by token."""
    vals, lines = _csv_rows(where, path, 2, "layer,expert")
    layer, expert = vals[:, 0], vals[:, 1]
    starts = np.flatnonzero(np.r_[True, layer[1:] != layer[:-1]])  # runs: one (ubatch, layer) each
    runs = np.diff(np.r_[starts, len(layer)])
    def span(r: int) -> str:
        return f"lines {int(lines[starts[r]])}-{int(lines[starts[r] + runs[r] - 1])} (layer {int(layer[starts[r]])})"

    how = ""
    if top_k is None:
        top_k = int(runs.min())
        how = f" (k inferred: the shortest run of one layer's rows, {span(int(np.argmin(runs)))}; give --top-k)"
        logger.info("%s: k = %d, the shortest run of one layer's rows (a one-token step); give --top-k if the dump "
                    "has none", where, top_k)
    bad = _first(runs % top_k != 0)
    if bad is not None:
        r = int(bad[0])
        raise InputError(f"{where}: {span(r)} hold {int(runs[r])} rows, not a multiple of k = {top_k}{how}")
    layers, rows = _per_layer(where, layer, lines, top_k)
    # one ubatch lists every layer with the same tokens: the i-th run of every layer has the same length
    first = runs[layer[starts] == layers[0]]  # layer 0's runs' lengths, one per ubatch
    for lay in layers[1:]:
        mine = np.flatnonzero(layer[starts] == lay)  # this layer's runs
        n = min(len(mine), len(first))
        bad = _first(runs[mine[:n]] != first[:n])
        i = int(bad[0]) if bad is not None else (n if len(mine) != len(first) else None)
        if i is not None:
            r = int(mine[min(i, len(mine) - 1)])
            theirs = int(first[i]) // top_k if i < len(first) else 0
            raise InputError(f"{where}: {span(r)} hold {int(runs[r]) // top_k} token(s) where layer {int(layers[0])}'s "
                             f"matching ubatch holds {theirs} (each ubatch lists every MoE layer with the same tokens)")
    T = len(rows[0]) // top_k
    idx = np.stack([r.reshape(T, top_k) for r in rows], axis=1)  # [T, L, k] row indices
    ids = expert[idx]
    _check_rows(where, ids, lines[idx], num_experts)
    return _trace(where, ids, tuple(int(x) for x in layers), np.zeros(T, np.int64), num_experts, source)


def _pos_csv(where: str, path: Path, num_experts: int, top_k: int | None, source: str) -> Trace:
    """The forks' `pos,layer,id0..id{k-1}` rows: token t of a layer is its t-th row; a sequence starts where pos
    decreases."""
    vals, lines = _csv_rows(where, path, None if top_k is None else top_k + 2, "pos,layer,id0,...,id{k-1}")
    k = vals.shape[1] - 2
    if k < 1:
        raise InputError(f"{where}: line {int(lines[0])} has {vals.shape[1]} fields, expected pos, layer and k >= 1 ids")
    layers, rows = _per_layer(where, vals[:, 1], lines, 1)
    idx = np.stack(rows, axis=1)  # [T, L] row indices
    pos = vals[idx, 0]  # [T, L]
    i = _first(pos != pos[:, :1])
    if i is not None:
        t, ly = int(i[0]), int(i[1])
        raise InputError(f"{where}: line {int(lines[idx[t, ly]])}: token {t} of layer {int(layers[ly])} has pos "
                         f"{int(pos[t, ly])}, but layer {int(layers[0])}'s token {t} (line {int(lines[idx[t, 0]])}) "
                         f"has pos {int(pos[t, 0])}")
    ids = vals[idx, 2:]  # [T, L, k]
    _check_rows(where, ids, np.repeat(lines[idx][..., None], k, axis=2), num_experts)
    p = pos[:, 0]
    seq_id = np.r_[0, np.cumsum(p[1:] < p[:-1])]  # a new sequence where pos goes back
    return _trace(where, ids, tuple(int(x) for x in layers), seq_id, num_experts, source)


# ---------------------------------------------------------------------------------------------- entry points


def import_routing(path: str | Path, routing_format: str, num_experts: int, top_k: int | None = None) -> Trace:
    """The routing ids of an engine's dump (`routing_format` one of ROUTING_FORMATS) as a validated Trace without
    gate weights (`meta.gate_weights` False, M = k). `num_experts` E is required (ids must lie in [0, E));
    `top_k` checks k (llamacpp-csv: gives it, else k is the shortest run of one layer's rows)."""
    path = Path(path)
    where = str(path)
    if routing_format not in ROUTING_FORMATS:
        raise InputError(f"--routing-format = {routing_format!r} is unknown (choose from {', '.join(ROUTING_FORMATS)})")
    for flag, v, low in (("--experts", num_experts, 1), ("--top-k", top_k, 1)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | np.integer) or v < low):
            raise InputError(f"{flag} = {v!r} must be an integer >= {low}")
    if not path.is_file():
        raise InputError(f"{where}: no such file")
    source = f"{routing_format} routing {path.name}"
    if routing_format in ("vllm", "sglang"):
        ids, field = _load_array(where, path)
        if ids.ndim != 3:
            raise InputError(f"{where}: {field} has shape {tuple(ids.shape)}, expected [tokens, layers, top_k]")
        if ids.dtype.kind not in "iu":
            raise InputError(f"{where}: {field} has dtype {ids.dtype}, expected integers")
        trace = _array_trace(where, ids.astype(np.int64), field, num_experts, top_k, np.zeros(ids.shape[0], np.int64),
                             None, source)
    elif routing_format == "sglang-pt":
        ids, seq_id, mapping, field = _load_sglang_pt(where, path)  # ids [L, T, k]
        trace = _array_trace(where, ids.transpose(1, 0, 2), field + " (as [tokens, layers, k])", num_experts, top_k,
                             seq_id, mapping, source)
    elif routing_format == "llamacpp-csv":
        trace = _llamacpp_csv(where, path, num_experts, top_k, source)
    else:
        trace = _pos_csv(where, path, num_experts, top_k, source)
    logger.info("imported %s routing %s: T=%d L=%d k=%d E=%d, no gate weights", routing_format, where, trace.T,
                trace.L, trace.k, trace.E)
    return trace


def add_routing_flags(p: argparse.ArgumentParser) -> None:
    """`--routing FILE --routing-format F --experts E [--top-k K]` (the record command's import)."""
    g = p.add_argument_group("import an engine's routing dump instead of recording (docs/traces.md, \"Importing "
                             "routing from vLLM, SGLang and llama.cpp dumps\"); the trace has no gate weights")
    g.add_argument("--routing", metavar="FILE", default=None, help="the dump to import (instead of --model/--text)")
    g.add_argument("--routing-format", default=None, help=" | ".join(ROUTING_FORMATS))
    g.add_argument("--experts", type=int, default=None, help="E, the model's routed experts per layer (required)")
    g.add_argument("--top-k", type=int, default=None,
                   help="k: checked against the file; llamacpp-csv: default the shortest run of one layer's rows")


def import_main(a: argparse.Namespace, recording_flags: dict[str, object]) -> bool:
    """With `--routing`: import, write `--out`, print its path and return True. Without it, False (the caller
    records a checkpoint; --model and --text then required). `recording_flags`: flag -> value of the flags that
    only recording takes (None / default: not given); giving one with --routing is a one-line error."""
    routing_only = {"--routing-format": a.routing_format, "--experts": a.experts, "--top-k": a.top_k}
    if a.routing is None:
        given = [f for f, v in routing_only.items() if v is not None]
        if given:
            raise InputError(f"{given[0]} needs --routing FILE (an engine's routing dump to import)")
        missing = [f for f, v in (("--model", a.model), ("--text", a.text)) if v is None]
        if missing:
            raise InputError(f"{' and '.join(missing)} required (or --routing FILE to import an engine's routing dump)")
        return False
    mixed = [f for f, v in recording_flags.items() if v]
    if mixed:
        raise InputError(f"--routing {a.routing} and {mixed[0]}: give one of them (--routing imports an engine's "
                         f"routing dump; {mixed[0]} is for recording a checkpoint)")
    for flag, v in (("--routing-format", a.routing_format), ("--experts", a.experts)):
        if v is None:
            raise InputError(f"--routing {a.routing}: {flag} is required")
    out = trace_output_path(a.out)
    save_trace(import_routing(a.routing, a.routing_format, a.experts, a.top_k), out)
    print(out)
    return True
