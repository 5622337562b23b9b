"""Cache-aware routing's compiled helpers (docs/policies.md, Additions (4)): the selections and their weights.

`_prior_select` (Cache-Prior: the top-k of the biased logits, keeping the true top-J), `_window_select`
(CACHE_ROUTE: the true top-J, the rest from residents inside the true top-M), `_same_set` and
`_routed_weights` (the routed selection's gate weights, normalised as the model normalises). run_layer.py's
`route` stage calls them.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from runtime.core.kernel.primitives import RT_PRIOR, WN_ALL, WN_TOPK, _index


@njit(cache=True)
def _prior_select(z, sel, k, J, lam_d, expert_slot, out):
    """Cache-Prior's selection into out[:k]: the true top-J (sel[:J]), then the top k - J of the others by the
    key (z~[e] + lam_d if e is resident else z~[e], e in sel, -rank in sel or z[e]), descending, then lower id:
    z~ lifts the model's selection to at least the best unselected logit, so the unbiased order is exactly
    the model's (docs/policies.md, Additions (4))."""
    E = z.shape[0]
    zout = -np.inf  # the best logit outside the model's selection
    for e in range(E):
        if _index(sel, k, e) < 0 and z[e] > zout:
            zout = z[e]
    n = 0
    for j in range(J):
        out[n] = sel[j]
        n += 1
    while n < k:
        best = -1
        bv = 0.0
        ba = 0
        bb = 0.0
        for e in range(E):
            if _index(out, n, e) >= 0:
                continue  # taken
            jr = _index(sel, k, e)  # e's rank in the model's selection
            zt = max(z[e], zout) if jr >= 0 else z[e]
            v = zt + lam_d if expert_slot[e] >= 0 else zt
            a = 1 if jr >= 0 else 0
            b = -float(jr) if jr >= 0 else z[e]
            if best < 0 or v > bv or (v == bv and (a > ba or (a == ba and b > bb))):
                best = e
                bv = v
                ba = a
                bb = b
        out[n] = best
        n += 1


@njit(cache=True)
def _window_select(rank_row, k, J, Mw, expert_slot, out):
    """CACHE_ROUTE's selection into out[:k]: the true top-J, then the residents of true ranks J..Mw-1 in rank
    order, then (too few) the true ranking from rank J on, skipping what was taken (Mw >= k: it ends by rank
    k - 1)."""
    n = 0
    for j in range(J):
        out[n] = rank_row[j]
        n += 1
    m = J
    while n < k and m < Mw:
        e = rank_row[m]
        if expert_slot[e] >= 0:
            out[n] = e
            n += 1
        m += 1
    m = J
    while n < k:
        e = rank_row[m]
        if not (m < Mw and expert_slot[e] >= 0):
            out[n] = e
            n += 1
        m += 1


@njit(cache=True)
def _same_set(sel, new, k):
    """new[:k] holds the same experts as sel[:k]."""
    for q in range(k):
        if _index(sel, k, new[q]) < 0:
            return False
    return True


@njit(cache=True)
def _routed_weights(family, z, norm, sel, w, new, k, alpha, out_w):
    """The gate weights out_w[:k] of the routed selection new[:k] (docs/policies.md, Additions (4)):
    cache-prior: the unbiased router's, normalised as the model does (norm: WN_TOPK softmax over the selection
    (also gpt-oss), WN_ALL softmax over all E); cache-route: a kept expert keeps w_j, the q-th replacement gets
    alpha times the q-th displaced expert's w_j (rank order), then with alpha != 1 every weight is scaled so the
    token's sum is the model's."""
    if family == RT_PRIOR:
        if norm == WN_TOPK:
            zmax = z[new[0]]
            for q in range(1, k):
                if z[new[q]] > zmax:
                    zmax = z[new[q]]
            den = 0.0
            for q in range(k):
                out_w[q] = np.exp(z[new[q]] - zmax)
                den += out_w[q]
        elif norm == WN_ALL:
            zmax = z[0]
            for e in range(1, z.shape[0]):
                if z[e] > zmax:
                    zmax = z[e]
            den = 0.0
            for e in range(z.shape[0]):
                den += np.exp(z[e] - zmax)
            for q in range(k):
                out_w[q] = np.exp(z[new[q]] - zmax)
        else:  # sigmoid_topk: refused by PolicyCache (the bias is not in the scores)
            raise ValueError("run_layer: cache-prior weights for this weight normalisation are not implemented")
        for q in range(k):
            out_w[q] = out_w[q] / den
        return
    r = 0  # the next displaced expert (rank order) whose weight the next replacement takes
    for q in range(k):
        jq = _index(sel, k, new[q])
        if jq >= 0:
            out_w[q] = w[jq]
            continue
        while _index(new, k, sel[r]) >= 0:  # the r-th displaced: sel[r] not in new
            r += 1
        out_w[q] = alpha * w[r]
        r += 1
    if alpha != 1.0:
        tot = 0.0
        for j in range(k):
            tot += w[j]
        tot2 = 0.0
        for q in range(k):
            tot2 += out_w[q]
        f = tot / tot2
        for q in range(k):
            out_w[q] = out_w[q] * f
