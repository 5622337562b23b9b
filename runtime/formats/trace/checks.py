"""Array checks of a router trace: shapes, dtypes, expert-id ranges, repeats, gate weights, the ranking's
top-k prefix and the lookahead lists, on plain numpy arrays (no `Trace` needed), each problem a one-line
`InputError` naming the file, field, value and location. `formats.validate_trace` runs them on every trace
it loads or builds, and `_first` / `_loc` / `_fmt` also word the errors of the Parquet / Arrow reader there.
"""

from __future__ import annotations

import numpy as np

from runtime.core.errors import InputError


def _loc(idx: np.ndarray) -> str:
    return ", ".join(str(int(i)) for i in idx)


def _first(mask: np.ndarray) -> np.ndarray | None:
    """Index tuple (as an array) of the first True of `mask` in C order, or None."""
    if not mask.any():
        return None
    return np.array(np.unravel_index(int(np.argmax(mask)), mask.shape))


def _fmt(v: object) -> str:
    return repr(v.item()) if isinstance(v, np.generic) else repr(v)


def _check_ids(where: str, name: str, ids: np.ndarray, valid: np.ndarray, E: int) -> None:
    # ids [T, L, n] any integer dtype; only valid cells are checked
    bad = ((ids < 0) | (ids >= E)) & valid[..., None]
    i = _first(bad)
    if i is not None:
        raise InputError(f"{where}: {name}[{_loc(i)}] = {_fmt(ids[tuple(i)])} is out of range [0, {E})")
    srt = np.sort(ids, axis=-1)  # [T, L, n]
    dup = (srt[..., 1:] == srt[..., :-1]) & valid[..., None]
    i = _first(dup)
    if i is not None:
        t, ly, _ = i
        e = srt[t, ly, i[2]]
        slots = np.flatnonzero(ids[t, ly] == e)
        raise InputError(f"{where}: {name}[{t}, {ly}] repeats expert {int(e)} "
                         f"(at {', '.join(str(int(j)) for j in slots)})")


def _validate_arrays(where: str, topk_ids: np.ndarray, topk_weights: np.ndarray | None, ranking: np.ndarray,
                     valid: np.ndarray, seq_id: np.ndarray, position: np.ndarray, E: int) -> None:
    """Checks on the arrays alone (any numeric dtypes), vectorised. Raises InputError. `topk_weights` None: a
    trace without gate weights (its NaN array is checked by the caller)."""
    if topk_ids.ndim != 3:
        raise InputError(f"{where}: topk_ids has shape {tuple(topk_ids.shape)}, expected [T, L, k]")
    T, L, k = topk_ids.shape
    if T < 1 or L < 1 or k < 1:
        raise InputError(f"{where}: topk_ids has shape {(T, L, k)}, every dimension must be >= 1")
    for name, a, shape in (("topk_weights", topk_weights, (T, L, k)), ("valid", valid, (T, L)),
                           ("seq_id", seq_id, (T,)), ("position", position, (T,))):
        if a is not None and tuple(a.shape) != shape:
            raise InputError(f"{where}: {name} has shape {tuple(a.shape)}, expected {shape} "
                             f"to match topk_ids {(T, L, k)}")
    if ranking.ndim != 3 or tuple(ranking.shape[:2]) != (T, L):
        raise InputError(f"{where}: ranking has shape {tuple(ranking.shape)}, expected [{T}, {L}, M]")
    M = ranking.shape[2]
    if M < k:
        raise InputError(f"{where}: ranking depth M = {M} is smaller than top_k k = {k}")
    if E < 1:
        raise InputError(f"{where}: num_experts = {E} must be >= 1")
    if M > E:
        raise InputError(f"{where}: ranking depth M = {M} exceeds num_experts E = {E}")
    for name, a, kinds in (("topk_ids", topk_ids, "iu"), ("ranking", ranking, "iu"),
                           ("topk_weights", topk_weights, "f"), ("valid", valid, "b"),
                           ("seq_id", seq_id, "iu"), ("position", position, "iu")):
        if a is not None and a.dtype.kind not in kinds:
            want = {"iu": "integers", "f": "floats", "b": "bool"}[kinds]
            raise InputError(f"{where}: {name} has dtype {a.dtype}, expected {want}")

    _check_ids(where, "topk_ids", topk_ids, valid, E)
    w = topk_weights
    if w is not None:
        i = _first(~np.isfinite(w) & valid[..., None])
        if i is not None:
            raise InputError(f"{where}: topk_weights[{_loc(i)}] = {_fmt(w[tuple(i)])} is not finite")
        i = _first((w < 0) & valid[..., None])
        if i is not None:
            raise InputError(f"{where}: topk_weights[{_loc(i)}] = {_fmt(w[tuple(i)])} is negative")
    i = _first((ranking[..., :k] != topk_ids) & valid[..., None])
    if i is not None:
        raise InputError(f"{where}: ranking[{_loc(i)}] = {_fmt(ranking[tuple(i)])} but "
                         f"topk_ids[{_loc(i)}] = {_fmt(topk_ids[tuple(i)])}: "
                         f"the ranking must start with the top-k")
    if M > k:
        _check_ids(where, "ranking", ranking, valid, E)
    for name, a in (("seq_id", seq_id), ("position", position)):
        i = _first(a < 0)
        if i is not None:
            raise InputError(f"{where}: {name}[{_loc(i)}] = {_fmt(a[tuple(i)])} is negative")


def _validate_lookahead(where: str, look: np.ndarray | None, valid: np.ndarray, E: int, depth: int) -> None:
    """look [T, L, P]: ids in [0, E), distinct, on every valid cell of layers 0 .. L-2; the last layer -1."""
    if look is None:
        if depth:
            raise InputError(f"{where}: meta lookahead_depth = {depth} but the trace has no lookahead column")
        return
    T, L = valid.shape
    if look.ndim != 3 or tuple(look.shape[:2]) != (T, L) or look.shape[2] < 1:
        raise InputError(f"{where}: lookahead has shape {tuple(look.shape)}, expected [{T}, {L}, P >= 1]")
    if look.dtype.kind not in "iu":
        raise InputError(f"{where}: lookahead has dtype {look.dtype}, expected integers")
    if look.shape[2] != depth:
        raise InputError(f"{where}: meta lookahead_depth = {depth} but the lookahead column holds {look.shape[2]} ids")
    if look.shape[2] > E:
        raise InputError(f"{where}: lookahead depth P = {look.shape[2]} exceeds num_experts E = {E}")
    if L > 1:
        inner = valid.copy()
        inner[:, -1] = False
        _check_ids(where, "lookahead", look, inner, E)
    i = _first(look[:, -1] != -1)
    if i is not None:
        raise InputError(f"{where}: lookahead[{int(i[0])}, {L - 1}] = {look[int(i[0]), -1].tolist()}: the last "
                         f"layer has no next layer (expected -1)")
