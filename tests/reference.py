"""Plain, slow, obviously-correct pure-Python reference of docs/policies.md.

This module is the oracle the compiled policy kernel (runtime/core/kernel/) is
checked against. It deliberately uses nothing but lists, dicts and sets and
follows the numbered steps of the spec literally, one token-layer at a time.
It imports nothing from the project, so it stays independent of the kernel.

Choices where the spec is silent follow docs/design.md:

- ``valid[t][layer] == False`` cells are skipped entirely (no decision, no
  counters, no key update, no decay); the stream index ``t`` keeps counting.
- ``gamma`` aging and ``crf`` decay happen once per processed token of a
  layer, for every expert of that layer.
- ``crf``: ``c[e] = 2**(-1/h) * c[e] + (1 if e computed here this token)``.
- ``belady`` (``fetch_all`` only): key ``-(next token at which the layer's
  router selects e)``, never again = ``+inf`` (key ``-inf``, evicted first).

Further choices made here (documented so the kernel can match them):

- Floats: weights are converted with ``float()`` (the exact float64 of a
  float32), all sums are float64 in rank order ``j = 0..k-1``; the per
  token-layer substituted mass ``m`` is summed first and then added to the
  layer's running total.
- Belady next use is the next *processed* (valid) token of that layer whose
  top-k contains ``e``: strictly after ``t`` for a fetch at token ``t``; at or
  after ``t'`` for an admission applied right before token ``t'``.
- Admission batches due by a processed token ``t'`` (queued at ``tq`` with
  ``tq + d <= t'``) are applied right before it, oldest batch first; batches
  still pending at the end of the trace are never applied.
- With ``beta`` set, "every expert" in step 6 means literally every expert of
  the layer (so ``beta <= 0`` would queue every non-resident expert).

Additions (fallback, band, prefetch; the spec's section "Additions"):

- ``band(tau, tau_high)``: the first choice is always fetched; a later miss
  with ``tau <= w_j < tau_high`` is not fetched (it gets the fallback); every
  other miss is fetched.
- The predicted list ``P`` for layer ``l`` at token ``t`` is formed after layer
  ``l - 1`` processed ``t``: none for layer 0, none when layer ``l - 1``'s cell
  is invalid (it did not process the token). ``lookahead``: the first
  ``prefetch_n`` ids of the trace's lookahead list stored on layer ``l - 1``;
  ``oracle``: the first ``min(prefetch_n, k)`` ids of layer ``l``'s selection.
  A prefetch at an invalid cell of layer ``l`` does not happen (the cell is
  skipped entirely).
- ``crf`` counts full-precision device use only (hit, fetch, substitute), as
  ``lru`` does.
- Belady victims of a prefetch look at the next use at or after ``t`` (as for
  an admission).

Additions (2) (``lfuda``, ``pin_fraction``, ``capacity_alloc``; ``fetch_cap``
above):

- ``lfuda``: when a load evicts, the victim leaves first (``A = max(A, K[v])``,
  ``c[v] = floor(c[v] / 2)``), then the loaded expert gets ``K[e] = A + c[e]``
  with that ``A``. Initial residents have ``K = c = 0``.
- ``pin_fraction``: ``P_l = floor(pin_fraction * C_l)`` computed exactly (the
  fraction read from its decimal text); the first ``P_l`` ids of the layer's
  initial residency list are never a victim. Fewer than ``P_l`` initial residents,
  ``C_l - P_l < k`` or pinning with an empty (cold) start are errors.
- ``calibrated`` capacities: ``calibrated_capacities_reference`` with exact
  fractions for the shares.

``s3fifo`` (docs/policies.md, "S3-FIFO"; Yang et al., SOSP'23, as
bigrig_engine.policies.s3fifo decides it), per layer, over the experts outside
the pinned hot set (``n = C - P`` slots):

- Three lists, oldest first: ``small``, ``main`` and ``ghost`` (ids only, at
  most ``n``); ``s_target = max(1, round(s3_small * n))``. The initial
  residents outside the hot set start in ``main``, the last of the residency
  list the oldest, all with ``freq = 0``.
- A load (fetch, admission, prefetch) of ``e``: if ``e`` is in ``ghost`` it
  leaves it and goes to ``main``'s tail, else to ``small``'s tail; ``freq[e] = 0``.
- Step 5: every hit and every substitute adds 1 to its ``freq``, at most 3.
- A victim among the residents a step allows: if ``len(small) >= s_target``
  and ``small`` holds an allowed one, its oldest allowed one ``x``; else if
  ``main`` holds an allowed one, its oldest allowed one ``y``; else ``small``'s
  oldest allowed one. ``x`` with ``freq > 1`` moves to ``main``'s tail with
  ``freq = 0`` and the search starts again, else ``x`` is the victim and goes
  to ``ghost``'s tail (the oldest ghost leaves when it holds ``n``). ``y``
  with ``freq > 0`` loses 1 and goes back to ``main``'s tail (search again),
  else ``y`` is the victim.
"""

from __future__ import annotations

import math
from fractions import Fraction

HIT, FETCH, SUB, DROP, HOST, LOWBIT = 0, 1, 2, 3, 4, 5

RULES = ("fetch_all", "threshold", "first_choice", "substitute_all", "cpu", "band")
EVICTS = ("lfu", "lru", "crf", "belady", "lfuda", "s3fifo")
FALLBACKS = ("substitute", "drop", "host", "lowbit")
PREFETCHES = ("off", "lookahead", "oracle")
ROUTES = ("off", "cache-prior", "cache-route")

COUNTER_KEYS = (
    "calls",
    "hits",
    "fetches",
    "substitutions",
    "drops",
    "host_computes",
    "lowbit_computes",
    "admissions",
    "prefetches",
    "prefetch_used",
    "admissions_waited",
    "prefetch_unbuffered",
    "substituted_mass",
    "lowbit_mass",
    "reroutes",
    "rerouted_mass",
)


def _plain(x):
    """numpy array -> nested Python lists (float32 -> exact float64); lists as they are."""
    return x.tolist() if hasattr(x, "tolist") else x


def _check_ids(ids, num_experts, what):
    for e in ids:
        if not (0 <= e < num_experts):
            raise ValueError(f"{what}: expert id {e} outside [0, {num_experts})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what}: repeated expert ids {ids}")


def reference_replay(
    topk_ids,
    topk_weights,
    ranking,
    valid,
    num_experts,
    capacities,
    initial_residency,
    rule,
    tau=None,
    beta=None,
    evict="lfu",
    gamma=1.0,
    half_life=None,
    admission_delay=1,
    fallback="substitute",
    tau_high=None,
    prefetch="off",
    prefetch_n=None,
    lookahead=None,
    fetch_cap=None,
    pin_fraction=0.0,
    s3_small=0.1,
    route="off",
    route_lambda=0.5,
    route_keep=1,
    route_window=16,
    route_alpha=1.0,
    router_scores=None,
    weight_norm="softmax_topk",
    copy_buffers=None,
):
    """Replay a router trace under one policy, literally as docs/policies.md says.

    Cache-aware routing (Additions (4)): ``route`` in off|cache-prior|cache-route with its parameters;
    ``router_scores [T][L][E]`` the router logits (cache-prior), ``weight_norm`` softmax_topk|softmax_all.
    The result's ``routed_ids`` / ``routed_weights [T][L][k]`` hold the selection every later step used.

    Arguments: ``topk_ids [T][L][k]`` ints, ``topk_weights [T][L][k]`` floats,
    ``ranking [T][L][M]`` (starts with the top-k, ``M >= k``), ``valid [T][L]``
    bools, ``capacities`` one int per layer, ``initial_residency`` one list of
    expert ids per layer (may hold fewer than ``C_l``). ``rule`` in
    fetch_all|threshold|first_choice|substitute_all|cpu|band; ``evict`` in
    lfu|lru|crf|belady|lfuda|s3fifo (``s3_small``: its small FIFO's share); ``fallback`` in substitute|drop|host|lowbit (``cpu``
    is substitute_all with host); ``prefetch`` in off|lookahead|oracle with
    ``prefetch_n`` (None = k) and, for lookahead, ``lookahead [T][L][P]``
    (on layer ``l``'s row: layer ``l + 1``'s router applied to layer ``l``'s
    router input). numpy arrays are accepted anywhere.

    Returns a dict:

    - ``kind [T][L][k]``: HIT/FETCH/SUB/DROP/HOST/LOWBIT, ``None`` for invalid cells
      (the whole ``[k]`` row is ``None``).
    - ``served [T][L][k]``: the expert computing slot j (the selected expert
      for HIT/FETCH/HOST/LOWBIT, the substitute for SUB, -1 for DROP); ``None`` rows
      for invalid cells.
    - ``mass [T][L]``: substituted mass m of the token-layer (``None`` if invalid).
    - ``counters``: per layer a dict with COUNTER_KEYS.
    - ``final_resident``: per layer the set of resident experts at the end.
    - ``final_state``: per layer ``{"f", "a", "last", "crf"}`` lists (length E).
    - ``admission_log``: per layer a list of ``(t, e, victim)``: ``e`` admitted
      right before token ``t``, evicting ``victim`` (-1 if a free slot was used).
    - ``copies_started``: per layer a list of ``(t, e)``: the admission copy of ``e``
      started after token ``t``.
    """
    ids = _plain(topk_ids)
    weights = _plain(topk_weights)
    ranks = _plain(ranking)
    ok = _plain(valid)
    caps = [int(c) for c in _plain(capacities)]
    init = [[int(e) for e in layer] for layer in _plain(initial_residency)]
    E = int(num_experts)
    T = len(ids)
    L = len(caps)

    # ---- configuration checks (a configuration error is reported as such) ----
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}")
    if evict not in EVICTS:
        raise ValueError(f"unknown evict {evict!r}")
    if rule in ("threshold", "band") and tau is None:
        raise ValueError(f"rule {rule} needs tau")
    if rule == "band" and (tau_high is None or not tau_high > tau):
        raise ValueError("rule band needs tau_high > tau")
    if fallback not in FALLBACKS:
        raise ValueError(f"unknown fallback {fallback!r}")
    if rule == "cpu":
        if fallback not in ("substitute", "host"):
            raise ValueError("rule cpu means fallback host")
        rule, fallback = "substitute_all", "host"
    if prefetch not in PREFETCHES:
        raise ValueError(f"unknown prefetch {prefetch!r}")
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}")
    if route != "off" and (rule != "fetch_all" or fetch_cap is not None or evict == "belady"):
        raise ValueError("route needs rule fetch_all, no fetch cap and no belady")
    if route == "cache-prior" and (router_scores is None or weight_norm not in ("softmax_topk", "softmax_all")):
        raise ValueError("cache-prior needs router scores and a softmax weight normalisation")
    zs = _plain(router_scores) if router_scores is not None else None
    if prefetch == "lookahead" and lookahead is None:
        raise ValueError("prefetch lookahead needs the lookahead lists")
    if evict == "crf" and (half_life is None or not half_life > 0):
        raise ValueError("evict crf needs half_life > 0")
    if evict == "belady" and rule != "fetch_all":
        raise ValueError("evict belady is only defined with rule fetch_all")
    if int(admission_delay) != admission_delay or admission_delay < 1:
        raise ValueError("admission_delay must be an integer >= 1")
    if copy_buffers is not None and (int(copy_buffers) != copy_buffers or copy_buffers < 1):
        raise ValueError("copy_buffers must be an integer >= 1 (or None: unbounded)")
    if len(init) != L:
        raise ValueError("initial_residency needs one list per layer")
    for t in range(T):
        if len(ids[t]) != L or len(weights[t]) != L or len(ranks[t]) != L or len(ok[t]) != L:
            raise ValueError(f"token {t}: expected {L} layers")
    k = len(ids[0][0]) if T else None
    for layer in range(L):
        # "k <= C_l < E; anything else is a configuration error"
        if not (caps[layer] < E) or (k is not None and caps[layer] < k):
            raise ValueError(f"layer {layer}: capacity {caps[layer]} outside [k={k}, E={E})")
        _check_ids(init[layer], E, f"initial_residency[{layer}]")
        if len(init[layer]) > caps[layer]:
            raise ValueError(
                f"layer {layer}: {len(init[layer])} initial residents > capacity {caps[layer]}"
            )

    pins = []
    for layer in range(L):
        # "P_l = floor(pin_fraction * C_l). The first P_l experts of layer l's initial residency ... are pinned"
        P = int(Fraction(str(pin_fraction)) * caps[layer]) if pin_fraction else 0
        if P and not any(init):
            raise ValueError("pin_fraction > 0 with a cold start")
        if k is not None and caps[layer] - P < k:
            raise ValueError(f"layer {layer}: C - P = {caps[layer] - P} < k = {k}")
        if len(init[layer]) < P:
            raise ValueError(f"layer {layer}: {len(init[layer])} initial residents < P = {P}")
        pins.append(set(init[layer][:P]))

    n_pre = k if prefetch_n is None else int(prefetch_n)
    look = _plain(lookahead) if lookahead is not None else None

    def predicted(t, layer):
        """The list P for `layer` at token t, or None (formed after layer - 1 processed t)."""
        if prefetch == "off" or layer == 0 or not ok[t][layer - 1]:
            return None
        if prefetch == "oracle":
            return [int(e) for e in ids[t][layer][: min(n_pre, k)]]
        row = [int(e) for e in look[t][layer - 1]]
        if len(row) < n_pre:
            raise ValueError(f"lookahead lists hold {len(row)} ids, prefetch_n = {n_pre}")
        return row[:n_pre]

    kind = [[None] * L for _ in range(T)]
    served = [[None] * L for _ in range(T)]
    mass = [[None] * L for _ in range(T)]
    routed_ids = [[None] * L for _ in range(T)]
    routed_weights = [[None] * L for _ in range(T)]
    counters, final_resident, final_state, admission_log, copies_started = [], [], [], [], []

    # Caches are per layer and independent: replay each layer on its own.
    for layer in range(L):
        out = _replay_layer(
            [ids[t][layer] for t in range(T)],
            [weights[t][layer] for t in range(T)],
            [ranks[t][layer] for t in range(T)],
            [bool(ok[t][layer]) for t in range(T)],
            E,
            k,
            caps[layer],
            init[layer],
            rule,
            tau,
            beta,
            evict,
            gamma,
            half_life,
            int(admission_delay),
            fallback,
            tau_high,
            [predicted(t, layer) for t in range(T)],
            fetch_cap,
            pins[layer],
            s3_small,
            init[layer][: len(pins[layer])],
            (route, route_lambda, route_keep, route_window, route_alpha, weight_norm,
             [zs[t][layer] for t in range(T)] if zs is not None else None),
            copy_buffers,
        )
        for t in range(T):
            routed_ids[t][layer] = out["routed"][t][0]
            routed_weights[t][layer] = out["routed"][t][1]
            kind[t][layer] = out["kind"][t]
            served[t][layer] = out["served"][t]
            mass[t][layer] = out["mass"][t]
        counters.append(out["counters"])
        final_resident.append(out["resident"])
        final_state.append(out["state"])
        admission_log.append(out["log"])
        copies_started.append(out["started"])

    return {
        "kind": kind,
        "served": served,
        "mass": mass,
        "counters": counters,
        "final_resident": final_resident,
        "final_state": final_state,
        "admission_log": admission_log,
        "copies_started": copies_started,
        "routed_ids": routed_ids,
        "routed_weights": routed_weights,
    }


def _route(how, t, sel, w, cand, resident, E, k, D):
    """Additions (4), cache-aware routing, for one token-layer: (new selection, its weights, displaced experts).
    ``D`` is the layer's ``[sum, count]`` of logit ranges (updated here under cache-prior)."""
    route, lam, J, M, alpha, norm, zrows = how
    if route == "cache-prior":
        z = [float(x) for x in zrows[t]]
        # "D is the running mean of the per-token range (max - min) of the layer's router logits, this token's included"
        D[0] += max(z) - min(z)
        D[1] += 1.0
        dval = D[0] / D[1]
        # the model's selection lifted to at least the best unselected logit: the unbiased order is the model's
        zout = max(z[e] for e in range(E) if e not in sel)
        zt = [max(z[e], zout) if e in sel else z[e] for e in range(E)]
        # "z' = z + lambda * D * m", m = 1 for the residents of the layer
        zb = [zt[e] + lam * dval * (1 if e in resident else 0) for e in range(E)]
        new = list(sel[:J])  # "the true top-J are always kept"
        # descending z'; equal z': the model's selection first, in its rank order, the others by z; then lower id
        others = sorted((e for e in range(E) if e not in new),
                        key=lambda e: (-zb[e], 0 if e in sel else 1, sel.index(e) if e in sel else -z[e], e))
        new += others[: k - J]
    else:
        Mw = min(M, E)
        new = list(cand[:J])  # "keep the true top-J"
        for m in range(J, Mw):  # "fill the other k - J places with resident experts ranked inside the true top-M"
            if len(new) < k and cand[m] in resident:
                new.append(cand[m])
        for m in range(J, len(cand)):  # "where too few are resident there, take the true ranking"
            if len(new) < k and cand[m] not in new:
                new.append(cand[m])
    if set(new) == set(sel):  # the model's set: its order and weights, unchanged
        return sel, w, []
    displaced = [j for j in range(k) if sel[j] not in new]  # positions j, rank order
    if route == "cache-prior":
        if norm == "softmax_topk":  # softmax over the routed selection's logits (the model's renormalisation)
            zmax = max(z[e] for e in new)
            ex = [math.exp(z[e] - zmax) for e in new]
            den = 0.0
            for x in ex:
                den += x
        else:  # softmax over all E logits (no renormalisation)
            zmax = max(z)
            den = 0.0
            for e in range(E):
                den += math.exp(z[e] - zmax)
            ex = [math.exp(z[e] - zmax) for e in new]
        return new, [x / den for x in ex], displaced
    nw = []
    r = 0
    for e in new:
        if e in sel:
            nw.append(w[sel.index(e)])  # a kept expert keeps w_j
        else:  # the r-th replacement takes alpha times the r-th displaced expert's weight
            nw.append(alpha * w[displaced[r]])
            r += 1
    if alpha != 1.0:  # "scaled back to the model's sum"
        tot = 0.0
        for x in w:
            tot += x
        tot2 = 0.0
        for x in nw:
            tot2 += x
        f = tot / tot2
        nw = [x * f for x in nw]
    return new, nw, displaced


def _replay_layer(
    ids, weights, ranks, ok, E, k, C, init, rule, tau, beta, evict, gamma, half_life, d,
    fallback, tau_high, plists, fetch_cap=None, hot=frozenset(), s3_small=0.1, hot_list=(),
    how=("off", 0.0, 0, 0, 1.0, "softmax_topk", None), B=None,
):
    """One layer's cache over the whole trace (lists indexed by token t); `hot`: the pinned hot set."""
    T = len(ids)
    resident = set(init)
    f = [0.0] * E  # LFU count ("all counts f, a at 0")
    a = [0.0] * E  # admission accumulator
    last = [-1] * E  # LRU: "never-used residents count as token -1"
    crf = [0.0] * E  # CRF value c[e]
    # lfuda: "an inflation value A (starts at 0) and per expert an integer count c[e] and a key K[e] (both 0)"
    age = {"A": 0}
    dac = [0] * E
    dak = [0] * E
    decay = 2.0 ** (-1.0 / half_life) if evict == "crf" else None
    # s3fifo: small / main / ghost lists, oldest first; freq per resident
    n_evictable = C - len(hot_list)
    s_target = max(1, int(round(s3_small * n_evictable)))
    small, main, ghost = [], [e for e in reversed(init) if e not in hot], []
    freq = [0] * E
    pending = []  # admission batches whose copies started, oldest first: (t_started, [experts in queue order])
    waiting = []  # queued admissions whose copies have not started, in queue order: (t_queued, e)
    log = []
    started_log = []  # (t, e): an admission copy started after token t
    cnt = {key: 0 for key in COUNTER_KEYS}
    cnt["substituted_mass"] = 0.0
    cnt["lowbit_mass"] = 0.0
    cnt["rerouted_mass"] = 0.0
    kind_out = [None] * T
    served_out = [None] * T
    mass_out = [None] * T
    routed_out = [(None, None)] * T
    dsum = [0.0, 0.0]  # cache-prior: the sum of the logit ranges, their count

    def next_use(e, start):
        """Next processed token >= start at which this layer's router selects e."""
        for u in range(start, T):
            if ok[u] and e in [int(x) for x in ids[u]]:
                return float(u)
        return float("inf")

    def evicted(v):
        # lfuda: "Whenever an expert v is evicted ...: A = max(A, K[v]), then c[v] = floor(c[v] / 2)"
        resident.remove(v)
        if evict == "s3fifo":
            if v in small:  # a victim from small is remembered in ghost
                small.remove(v)
                if len(ghost) >= max(1, n_evictable):
                    ghost.pop(0)
                ghost.append(v)
            else:
                main.remove(v)
        if evict == "lfuda":
            age["A"] = max(age["A"], dak[v])
            dac[v] = dac[v] // 2

    def arrived(e):
        # lfuda: "Whenever an expert e becomes resident ...: K[e] = A + c[e], with the A of that moment"
        resident.add(e)
        if evict == "s3fifo":  # a ghost comes back to main, anything else enters small
            if e in ghost:
                ghost.remove(e)
                main.append(e)
            else:
                small.append(e)
            freq[e] = 0
        if evict == "lfuda":
            dak[e] = age["A"] + dac[e]

    def evict_key(e, belady_start):
        if evict == "lfu":
            return f[e]
        if evict == "lru":
            return last[e]
        if evict == "crf":
            return crf[e]
        if evict == "lfuda":
            return dak[e]
        if evict == "belady":  # minus the next use; never again = +inf -> key -inf (evicted first)
            return -next_use(e, belady_start)
        raise ValueError(f"reference: no eviction key for {evict!r}")  # s3fifo has no key: pick_victim

    def s3_victim(allowed):
        while True:
            in_small = [e for e in small if e in allowed]
            in_main = [e for e in main if e in allowed]
            if len(small) >= s_target and in_small:
                x = in_small[0]
            elif in_main:
                y = in_main[0]
                if freq[y] == 0:
                    return y
                freq[y] -= 1  # second chance
                main.remove(y)
                main.append(y)
                continue
            elif in_small:
                x = in_small[0]
            else:
                return None
            if freq[x] <= 1:
                return x
            small.remove(x)  # promoted
            main.append(x)
            freq[x] = 0

    def pick_victim(options, belady_start):
        # "the resident expert with the smallest eviction key ...; ties go to the lower expert id"
        # pinned hot set: "never a victim of a fetch, an admission or a prefetch"
        if evict == "s3fifo":
            return s3_victim(set(options) - hot)
        best = None
        for e in sorted(set(options) - hot):
            if best is None or evict_key(e, belady_start) < evict_key(best, belady_start):
                best = e
        return best

    for t in range(T):
        if not ok[t]:
            continue  # invalid cell: skipped entirely, t still advances

        sel = [int(x) for x in ids[t]]
        w = [float(x) for x in weights[t]]
        cand = [int(x) for x in ranks[t]]
        if len(sel) != k or len(w) != k:
            raise ValueError(f"token {t}: expected k={k} selected experts and weights")
        _check_ids(sel, E, f"token {t} topk_ids")
        _check_ids(cand, E, f"token {t} ranking")
        if cand[:k] != sel:
            raise ValueError(f"token {t}: ranking {cand} does not start with top-k {sel}")

        # ---- Additions (3), prefetch: "the copies of P are issued before the admissions
        # due at t: for its first B - (admission copies in flight) members not resident
        # now; P is cut after the last of them" ----
        P = plists[t]
        if P and B is not None:
            free = B - sum(len(b) for _, b in pending)
            issued, cut = 0, len(P)
            for pos, e in enumerate(P):
                if e not in resident:
                    if issued < free:
                        issued += 1
                    else:
                        cut = min(cut, pos)
                        cnt["prefetch_unbuffered"] += 1
            P = P[:cut]

        admitted_now = set()  # experts admitted right before this token (all batches)
        # ---- 6 (applying). "The experts queued at token t become resident, in
        # queue order, before the layer is processed for token t + d." (Additions (3):
        # d tokens after their copies started) ----
        while pending and pending[0][0] + d <= t:
            _, batch = pending.pop(0)
            admitted_in_batch = set()
            for e in batch:
                # "one that became resident meanwhile is skipped"
                if e in resident:
                    continue
                victim = -1
                if len(resident) >= C:
                    # "Each evicts the resident with the smallest eviction key at
                    # that moment, never one admitted in the same batch"
                    options = [r for r in resident if r not in admitted_in_batch and r not in hot]
                    if not options:
                        continue  # design.md: no evictable victim -> skipped
                    victim = pick_victim(options, t)
                    evicted(victim)
                arrived(e)
                admitted_in_batch.add(e)
                admitted_now.add(e)
                a[e] = 0.0  # "reset to 0 ... whenever e becomes resident"
                cnt["admissions"] += 1
                log.append((t, e, victim))

        # ---- Prefetch: "Before layer l + 1 processes token t, after the admissions due
        # there, each expert of P that is not resident in layer l + 1 is loaded, in P
        # order, evicting the resident with the smallest eviction key that is neither in
        # P nor admitted by the admissions of the same token (a prefetch with no such
        # resident is skipped). A prefetch changes no f, a or lru key." ----
        loaded = []
        if P:
            protected = set(P) | (admitted_now & resident)
            for e in P:
                if e in resident:
                    continue
                if len(resident) >= C:
                    options = [r for r in resident if r not in protected and r not in hot]
                    if not options:
                        continue
                    evicted(pick_victim(options, t))
                arrived(e)
                loaded.append(e)

        # ---- Additions (4): cache-aware routing, on the residency left by admissions and prefetch ----
        model_sel = sel
        rerouted = set()
        if how[0] != "off":
            new, nw, displaced = _route(how, t, sel, w, cand, resident, E, k, dsum)
            rerouted = set(new) - set(sel)  # resident by construction: "neither a hit nor a substitution"
            if not rerouted <= resident:
                raise AssertionError(f"token {t}: a rerouted expert is not resident ({sorted(rerouted - resident)})")
            rm = 0.0
            for j in displaced:
                rm += w[j]  # the moved gate mass: the model's weights of the displaced experts
                a[sel[j]] += w[j]  # they join the admission accumulator
            cnt["reroutes"] += len(rerouted)
            cnt["rerouted_mass"] += rm
            sel, w = new, nw
        routed_out[t] = (list(sel), list(w))

        # ---- 1. Hits and misses: "e_j is a hit if resident, else a miss." ----
        is_hit = [e in resident for e in sel]

        # ---- 2. Miss rule: one decision per miss, from its rank and weight only ----
        decision = [None] * k
        for j in range(k):
            if is_hit[j]:
                decision[j] = HIT
                continue
            if rule == "fetch_all":
                fetch = True  # "FETCH every miss"
            elif rule == "threshold":
                fetch = j == 0 or w[j] >= tau  # "FETCH if j == 0 or w_j >= tau, else SUBSTITUTE"
            elif rule == "first_choice":
                fetch = j == 0  # "FETCH if j == 0, else SUBSTITUTE"
            elif rule == "substitute_all":
                fetch = False  # "SUBSTITUTE every miss, the first choice included"
            elif rule == "band":  # the first choice always; a later miss with tau <= w < tau_high is not fetched
                fetch = j == 0 or not (tau <= w[j] < tau_high)
            else:
                raise ValueError(f"reference: no miss rule {rule!r}")
            # Additions (2), fetch cap: "the first fetch_cap of them in rank order are fetched and the
            # others get the policy's fallback ... exactly as if the rule had not fetched them"
            if fetch and fetch_cap is not None and sum(x == FETCH for x in decision) >= fetch_cap:
                fetch = False
            # "Every miss that the miss rule does not FETCH gets the policy's fallback"
            decision[j] = FETCH if fetch else {"substitute": SUB, "drop": DROP, "host": HOST,
                                               "lowbit": LOWBIT}[fallback]

        srv = [None] * k
        used = set()  # experts used by this token: hits, fetches, substitutes
        pinned = set()  # "this token's hits and the experts already fetched for it"
        for j in range(k):
            if decision[j] == HIT:
                srv[j] = sel[j]
                used.add(sel[j])
                pinned.add(sel[j])
            elif decision[j] in (HOST, LOWBIT):
                srv[j] = sel[j]  # computed exactly on the host / from the low-precision copy
            elif decision[j] == DROP:
                srv[j] = -1  # fallback drop: "contributes nothing"

        # ---- 3. Fetches, in rank order ----
        for j in range(k):
            if decision[j] != FETCH:
                continue
            e = sel[j]
            if len(resident) >= C:  # "If the layer is full"
                options = [r for r in resident if r not in pinned and r not in hot]
                if not options:
                    raise AssertionError("no unpinned resident (needs k <= C - P)")
                # a fetch at token t: Belady looks strictly after t
                victim = pick_victim(options, t + 1)
                evicted(victim)
            arrived(e)
            a[e] = 0.0  # "reset to 0 ... whenever e becomes resident (by fetch ...)"
            pinned.add(e)
            used.add(e)
            srv[j] = e

        # ---- 4. Substitutes, in rank order of the substituted misses, after all fetches ----
        for j in range(k):
            if decision[j] != SUB:
                continue
            substitute = None
            # "the highest expert in the candidate ranking that is resident and
            # not already used by this token (as a hit, a fetch or an earlier substitute)"
            for c in cand:
                if c in resident and c not in used:
                    substitute = c
                    break
            if substitute is None:
                decision[j] = DROP  # "the miss is dropped: it contributes nothing"
                srv[j] = -1
            else:
                srv[j] = substitute
                used.add(substitute)

        # ---- 5. Bookkeeping ----
        m = 0.0
        lm = 0.0
        for j in range(k):
            if decision[j] in (SUB, DROP):
                m += w[j]  # "m = sum of w_j over its substituted and dropped misses"
            if decision[j] == LOWBIT:
                lm += w[j]  # "lowbit_mass = sum of w_j over lowbit misses"
            if decision[j] in (SUB, DROP, LOWBIT):
                # "The admission accumulator adds w_j for every substituted, dropped or lowbit miss"
                a[sel[j]] += w[j]
        selected = set(sel)
        for e in range(E):
            # "f[e] = gamma * f[e] + (1 if e was selected else 0)" (router demand)
            f[e] = gamma * f[e] + (1.0 if e in selected else 0.0)
        # LRU: "the last token at which e was computed here (hit, fetch or substitute)";
        # "lru keys are updated by full-precision computes only" (`used` holds exactly those)
        for e in used:
            last[e] = t
        # lfuda: "At the bookkeeping of each token (step 5), every selected e: c[e] += 1, then K[e] = A + c[e]"
        for e in sel:
            dac[e] += 1
            dak[e] = age["A"] + dac[e]
        if evict == "crf":
            for e in range(E):
                crf[e] = decay * crf[e] + (1.0 if e in used else 0.0)
        if evict == "s3fifo":  # hits and substitutes: a computed resident that was not loaded for the token
            for j in range(k):
                if decision[j] in (HIT, SUB):
                    freq[srv[j]] = min(freq[srv[j]] + 1, 3)

        cnt["calls"] += k
        for j in range(k):
            if decision[j] == HIT and sel[j] in rerouted:
                pass  # counted as a reroute above
            elif decision[j] == HIT:
                cnt["hits"] += 1
            elif decision[j] == FETCH:
                cnt["fetches"] += 1
            elif decision[j] == SUB:
                cnt["substitutions"] += 1
            elif decision[j] == DROP:
                cnt["drops"] += 1
            elif decision[j] == LOWBIT:
                cnt["lowbit_computes"] += 1
            else:
                cnt["host_computes"] += 1
        cnt["substituted_mass"] += m
        cnt["lowbit_mass"] += lm
        cnt["prefetches"] += len(loaded)
        # "prefetched experts that the token then selected" (the model's selection, before any routing)
        cnt["prefetch_used"] += sum(1 for e in loaded if e in set(model_sel))

        # ---- 6 (queueing). "after the token, every expert that is neither
        # resident nor already queued and has a[e] >= beta is queued for
        # admission, largest a[e] first (ties: lower id)" ----
        if beta is not None:
            queued = {e for _, e in waiting}
            for _, batch in pending:
                queued.update(batch)
            new = [e for e in range(E) if e not in resident and e not in queued and a[e] >= beta]
            new.sort(key=lambda e: (-a[e], e))
            for e in new:
                a[e] = 0.0  # "a[e] is reset to 0 when e is queued"
            waiting.extend((t, e) for e in new)
            # Additions (3): "the waiting admissions start their copies in queue order
            # while a copy buffer is free; one resident by then leaves the queue"
            in_flight = sum(len(b) for _, b in pending)
            started = []
            while waiting and (B is None or in_flight + len(started) < B):
                tq, e = waiting.pop(0)
                if e in resident:
                    continue
                if tq < t:
                    cnt["admissions_waited"] += 1
                started.append(e)
            if started:
                pending.append((t, started))
                started_log.extend((t, e) for e in started)

        kind_out[t] = decision
        served_out[t] = srv
        mass_out[t] = m

    return {
        "kind": kind_out,
        "served": served_out,
        "mass": mass_out,
        "counters": cnt,
        "resident": set(resident),
        "state": {"f": list(f), "a": list(a), "last": list(last), "crf": list(crf), "K": list(dak), "c": list(dac),
                  "A": age["A"], "small": list(small), "main": list(main), "ghost": list(ghost),
                  "freq": list(freq)},
        "log": log,
        "started": started_log,
        "routed": routed_out,
    }


def warm_residency_reference(calib_topk_ids, calib_valid, num_experts, capacities):
    """Warm start: per layer the C_l most frequently selected experts over the
    calibration trace (valid cells only), ties lower id, most frequent first."""
    ids = _plain(calib_topk_ids)
    ok = _plain(calib_valid)
    caps = [int(c) for c in _plain(capacities)]
    E = int(num_experts)
    out = []
    for layer in range(len(caps)):
        count = {e: 0 for e in range(E)}
        for t in range(len(ids)):
            if ok[t][layer]:
                for e in ids[t][layer]:
                    count[int(e)] += 1
        order = sorted(range(E), key=lambda e: (-count[e], e))
        out.append(order[: caps[layer]])
    return out


def calibrated_capacities_reference(calib_topk_ids, calib_valid, num_experts, capacities, k):
    """Additions (2), "Per-layer capacities": the total S of `capacities` spread over the layers. "Every
    layer starts with k slots; then the remaining S - L*k slots are given one at a time to the layer whose
    next expert in count order (position C_l) has the largest share n_l[e] / sum_e n_l[e] of that layer's
    calibration calls (ties: lower layer index; a layer stops at E - 1)." Shares as exact fractions."""
    ids = _plain(calib_topk_ids)
    ok = _plain(calib_valid)
    caps_in = [int(c) for c in _plain(capacities)]
    E, L = int(num_experts), len(caps_in)
    counts = []
    for layer in range(L):
        n = [0] * E
        for t in range(len(ids)):
            if ok[t][layer]:
                for e in ids[t][layer]:
                    n[int(e)] += 1
        counts.append(n)
    order = [sorted(range(E), key=lambda e, n=n: (-n[e], e)) for n in counts]
    caps = [k] * L
    for _ in range(sum(caps_in) - L * k):
        best, best_share = None, None
        for layer in range(L):
            if caps[layer] >= E - 1:
                continue  # "a layer stops at E - 1"
            total = sum(counts[layer])
            share = Fraction(counts[layer][order[layer][caps[layer]]], total) if total else Fraction(0)
            if best is None or share > best_share:  # strictly larger: ties keep the lower layer
                best, best_share = layer, share
        caps[best] += 1
    return caps
