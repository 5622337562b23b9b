"""Applying the policy kernel's plan: per MoE layer, the copies and the expert computes the kernel decided.

The adapters (runtime/backends/adapters.py) route, rank and ask the kernel exactly as in the emulation,
then call the engine's hook `PlanRunner.run_experts(layer, hidden [N, H], ids [N, k], weights [N, k],
plan)` with the kernel's plan (`StepResult`: kind / served / slot [N, k], and the rows `admitted (t, e, s)`,
`queued (t, e)`, `prefetched (t, e, s)`). `PlanRunner.apply` carries it out per token in the kernel's
order (docs/engine.md, "Per token and layer"):

  (1) admissions `admitted (t, e, s)`: wait for the copy, the staging buffer becomes slot s; pending
      copies the kernel popped without admitting are released;
  (2) prefetch loads `prefetched (t, e, s)`, (3) FETCH (host -> slot `slot[t, j]`, synchronous);
  (3b) lookahead: the next layer's predicted experts start copying;
  (4) device compute: every HIT / FETCH / SUB of the token in ONE grouped call from the layer's slot
      tensors (`grouped_experts`: gather rows `slot[t, j]` + batched matmul, summed over the ranks in rank
      order), then LOWBIT from the expert's packed low-bit copy; (5) HOST on the host CPU overlapping the
      device; DROP nothing;
  (6) the admissions `queued (t, e)` start copying into staging buffers in the background.

With no plan (prefill, the exact reference) `stream_layer` computes the exact experts' output, streaming
the non-resident ones through two staging buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from runtime.backends.engine.copies import Pending
from runtime.core.kernel import DROP, FETCH, HOST, LOWBIT, N_EV, StepResult
from runtime.core.policy import PolicyConfig

if TYPE_CHECKING:
    from runtime.backends.engine.copies import Copies
    from runtime.backends.engine.slots import SlotPool
    from runtime.backends.engine.store import HostStore

log = logging.getLogger(__name__)


def expert_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act) -> torch.Tensor:
    """One expert on tokens x [n, H]: gate_up [2I, H], down [H, I] -> [n, H] (the HF fused layout's math)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act(gate) * up, down)


def grouped_impl(x: torch.Tensor, gate_up: torch.Tensor) -> str:
    """Which grouped call `grouped_experts` makes for inputs like `x`: "grouped_mm" (torch.nn.functional.grouped_mm
    over the slot tensors themselves, no copy of expert weights; the call transformers' grouped_mm experts make)
    on CUDA in bfloat16 on compute capability >= 8.0 with rows of a multiple of 16 bytes (what its kernels take),
    else "bmm" (the selected slots gathered, then a batched matmul)."""
    rows_ok = all(n * x.element_size() % 16 == 0 for n in (gate_up.shape[1] // 2, gate_up.shape[2]))
    if (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm") and rows_ok
            and torch.cuda.get_device_capability(x.device) >= (8, 0)):
        return "grouped_mm"
    return "bmm"


def grouped_experts(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor,
                    act, impl: str | None = None) -> torch.Tensor:
    """M expert calls in one: slot tensors gate_up [C, 2I, H] and down [C, H, I], inputs x [M, H], the slot of
    each call rows [M] (int64, on the device) and its gate weight w [M] -> weighted outputs [M, H] in the
    calls' order. The same number of operators whatever M is, and the same shapes for a given M (what a CUDA
    graph needs). `impl` (default `grouped_impl(x, gate_up)`):
    - "grouped_mm": the calls sorted by slot (stable), each slot's group of rows through its own weights in
      place (`F.grouped_mm` with the groups' end offsets, found by `searchsorted`: no device sync), the rows
      put back in call order. Reads only the selected slots' weights, copies none.
    - "bmm": gather the selected slots' weights (`index_select`) and batched matmul (the Hugging Face
      `batched_mm` experts' math). Reads and writes a copy of the M experts' weights.
    The two agree within the rounding of one matmul in the model dtype (tests/test_graphs.py)."""
    if (impl or grouped_impl(x, gate_up)) == "grouped_mm":
        C = gate_up.shape[0]
        order = torch.argsort(rows, stable=True)  # [M] calls by slot
        rs = rows.index_select(0, order)  # [M] ascending slots
        offs = torch.searchsorted(rs, torch.arange(C, device=rows.device, dtype=rs.dtype), right=True)
        offs = offs.to(torch.int32)  # [C]: end of each slot's group (empty groups: no rows, no work)
        xs = x.index_select(0, order)  # [M, H]
        h = F.grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [M, 2I]
        gate, up = h.chunk(2, dim=-1)  # [M, I] each
        ys = F.grouped_mm(act(gate) * up, down.transpose(1, 2), offs=offs)  # [M, H]
        y = torch.empty_like(ys).index_copy_(0, order, ys)  # [M, H] back in call order
        return y * w.to(y.dtype).unsqueeze(-1)
    h = torch.bmm(gate_up.index_select(0, rows), x.unsqueeze(-1)).squeeze(-1)  # [M, 2I]
    gate, up = h.chunk(2, dim=-1)  # [M, I] each
    y = torch.bmm(down.index_select(0, rows), (act(gate) * up).unsqueeze(-1)).squeeze(-1)  # [M, H]
    return y * w.to(y.dtype).unsqueeze(-1)


def write_plan_row(row: np.ndarray, kind: np.ndarray, slot: np.ndarray, w: torch.Tensor) -> int:
    """One token's plan row, in place: row [3, k] float32 = the slot, the gate weight (the model dtype's value)
    and 1 for every rank computed from a device slot (`on_device`: HIT, FETCH, SUB), slot 0 and weight 0
    elsewhere, from its decisions `kind` [k], slots `slot` [k] and weights `w` [k] (host); returns how many ranks
    are computed on the device. `grouped_masked` reads it."""
    on = on_device(kind)
    row[0] = np.where(on, slot, 0)
    row[1] = np.where(on, w.float().numpy(), 0.0)
    row[2] = on
    return int(on.sum())


def grouped_masked(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, plan: torch.Tensor, act,
                   dtype: torch.dtype) -> torch.Tensor:
    """A token's device-computed experts in one grouped call of fixed shape: x [1, H], plan [3, k] float32 on
    the device (slot, gate weight in `dtype`'s values, 1 where the rank is computed here) -> [1, H], the
    weighted outputs summed over the k ranks in rank order, the other ranks counting 0 (`torch.where`: a
    rank not computed here may read an empty slot; its value never enters the sum). Equal, bit for bit,
    to `PlanRunner.device_compute`'s call over the computed ranks alone (tests/test_graphs.py)."""
    k = plan.shape[1]
    y = grouped_experts(gate_up, down, x.expand(k, -1), plan[0].long(), plan[1].to(dtype), act)  # [k, H]
    return torch.where(plan[2, :, None] > 0, y, 0).sum(dim=0, keepdim=True)  # [1, H]


@dataclass
class Staged:
    """One MoE layer's plan for the next segment: `plan` [3, k] float32 on the host (pinned on CUDA), written
    by PlanRunner.apply (`write_plan_row`); `extra` [1, H] on the device, the host and low-bit experts' output
    (`used`: written this step, else zero)."""

    plan: torch.Tensor
    extra: torch.Tensor
    used: bool = False

    def __post_init__(self) -> None:
        self.rows = self.plan.numpy()  # [3, k]: the plan row's host view (written in place)

    def begin(self) -> None:
        if self.used:
            self.extra.zero_()
            self.used = False


def ranks_of(kinds: list[int], code: int, served: np.ndarray) -> list[int]:
    """The ranks j with decision `code` in one token's `kinds` [k], by ascending served expert (stable)."""
    js = [j for j, c in enumerate(kinds) if c == code]
    return sorted(js, key=lambda j: served[j]) if len(js) > 1 else js


def on_device(kind: np.ndarray) -> np.ndarray:
    """Which decisions are computed from a device slot (HIT, FETCH, SUB): bool, `kind`'s shape."""
    return (kind != DROP) & (kind != HOST) & (kind != LOWBIT)


class PlanRunner:
    """The experts' part of one engine: the kernel's plan applied to `pool`'s slots with `copies`, host
    compute from `store`, the low-bit copies. `act[l]`: MoE layer l's activation; `ctx`: the adapters'
    context (the lookahead's predicted lists); counters go into `stats` (the engine's dict, shared)."""

    def __init__(self, store: HostStore, pool: SlotPool, copies: Copies, act: list, E: int, stats: dict, ctx,
                 debug: bool = False) -> None:
        self.store, self.pool, self.copies, self.act, self.E = store, pool, copies, act, E
        self.stats, self.ctx, self.debug = stats, ctx, debug
        self.device, self.cuda, self.dtype, self.L = pool.device, pool.cuda, pool.dtype, len(act)
        # the plans' kernel events: one row per decided token and layer (ev_n[l] rows of layer l); the engine's
        # one-call decision (runtime/core/kernel/decide.py) writes its rows here too
        self.ev_tab = np.zeros((self.L, 256, N_EV), np.int32)  # [L, cap, N_EV]
        self.ev_n = np.zeros(self.L, np.int64)  # [L]
        self.null_compute = False  # calibration only: skip the expert math (everything else runs)
        self.lowbit: list[list[tuple]] | None = None  # [L][E] (gate_up, down) QWeight on the device
        self.lowbit_key: tuple[int, int, int] | None = None  # (bits, group, experts per layer) of `lowbit`
        self.lowbit_bytes = 0
        # the host copies, quantized once per (bits, group) and expert: {(bits, group): {(layer, e): (gu, d)}}
        self.lowbit_host: dict[tuple[int, int], dict[tuple[int, int], tuple]] = {}

    def reset(self) -> None:
        self.ev_n[:] = 0

    def reserve_events(self, more: int) -> None:
        """Room for `more` further event rows per layer (a larger table, the rows kept, when needed)."""
        need = int(self.ev_n.max()) + int(more)
        if need > self.ev_tab.shape[1]:
            tab = np.zeros((self.L, max(need, 2 * self.ev_tab.shape[1]), N_EV), np.int32)
            tab[:, : self.ev_tab.shape[1]] = self.ev_tab
            self.ev_tab = tab

    def add_events(self, layer: int, ev: np.ndarray) -> None:
        """A plan's kernel events [N, N_EV] appended to MoE layer `layer`'s rows."""
        n = len(ev)
        self.reserve_events(n)
        a = int(self.ev_n[layer])
        self.ev_tab[layer, a : a + n] = ev
        self.ev_n[layer] = a + n

    def events_array(self) -> np.ndarray:
        """Kernel events of the run since bind, int32 [T, L, N_EV] (every layer decided the same T tokens)."""
        n = set(self.ev_n.tolist())
        if len(n) != 1:
            raise RuntimeError(f"engine: the MoE layers decided different token counts {sorted(n)}")
        return np.ascontiguousarray(self.ev_tab[:, : n.pop()].transpose(1, 0, 2))

    def run_experts(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, plan) -> torch.Tensor:
        """Experts' output for tokens x [N, H]: exact streaming (plan None) or the kernel's plan."""
        if plan is None:
            return stream_layer(self, layer, x, ids, w)
        return self.apply(layer, x, w, plan)

    # ------------------------------------------------------------------ the plan

    def apply(self, layer: int, x: torch.Tensor, w: torch.Tensor, plan: StepResult,
              staged: Staged | None = None, events_recorded: bool = False) -> torch.Tensor | None:
        """The kernel's plan for N tokens of `layer`: x [N, H], gate weights w [N, k] -> [N, H]. With `staged`
        (the segmented decode step, runtime/backends/engine/graphs.py; N = 1) step (4)'s grouped call is
        left to the next segment: the token's plan row goes into `staged.plan`, the host and low-bit
        experts' output into `staged.extra`, and nothing is returned. `events_recorded`: the plan's events are
        in the event table already (the one-call decision wrote them)."""
        kind, served, slot = plan.kind, plan.served, plan.slot  # [N, k]
        N, k = kind.shape
        cache = self.pool.cache
        t0 = int(cache.next_t[layer]) - N
        w_host = w
        kinds = kind.tolist()  # [N][k] Python ints: per-rank tests on k entries cost less than numpy calls
        fallback = any(c == HOST or c == LOWBIT for row in kinds for c in row)
        if staged is None or fallback:  # the weights on the device: the eager grouped call, low-bit, host
            if w.device != self.device and self.cuda:  # host weights (the adapters' re-rank): pinned, async
                w = w.pin_memory().to(self.device, non_blocking=True)
            wd = w.to(self.device).reshape(-1)  # [N * k] gate weights on the device, rank order
        outs: list[torch.Tensor | None] = []  # [N] of [1, H]
        pol = cache.policy
        adm, queued, d = plan.admitted, plan.queued, pol.admission_delay  # [n, 3] (t, e, s), [n, 2] (t, e)
        pref = getattr(plan, "prefetched", None)
        pref = np.zeros((0, 3), np.int64) if pref is None else pref  # [n, 3] (t, e, s)
        lookahead = pol.prefetch == "lookahead" and N == 1
        ai = qi = pi = 0
        for i in range(N):
            t = t0 + i
            ki, kl, si = kind[i], kinds[i], served[i]  # [k] this token's decisions (array, list), served experts
            hosts = [] if self.null_compute else ranks_of(kl, HOST, si)  # host ranks, ascending expert id
            # (0) the activation of a host-computed token goes to the host first: nothing but this layer's
            # dense part (already finished: its routing was read) is queued ahead of it on the stream
            xh = x[i : i + 1].to("cpu") if hosts else None
            # (1) admissions the kernel applied before token t, then the copies it popped and skipped
            while ai < len(adm) and adm[ai, 0] == t:
                self._admit(layer, int(adm[ai, 1]), int(adm[ai, 2]))
                ai += 1
            if self.copies.pending[layer]:
                self._release_popped(layer, t)
            # (2) prefetch loads the kernel made for this token, (3) synchronous fetches in rank order
            while pi < len(pref) and pref[pi, 0] == t:
                self._load_prefetched(layer, int(pref[pi, 1]), int(pref[pi, 2]))
                pi += 1
            if self.copies.prefetch[layer]:
                self._release_prefetch(layer)
            for j, c in enumerate(kl):  # (host-side: one copy per missed expert, in rank order)
                if c == FETCH:
                    self.fetch(layer, int(si[j]), int(slot[i, j]))
            # (3b) the next layer's lookahead copies start behind this layer's fetches
            if lookahead:
                self._issue_prefetch(layer, t)
            # (4) device compute, queued without waiting: every HIT / FETCH / SUB of the token in ONE grouped call
            # from the layer's slot tensors (gather by slot index + batched matmul, summed over the k ranks
            # in rank order: the Hugging Face batched_mm / grouped_mm order); LOWBIT from the expert's packed
            # low-bit copy, added after it
            xi = x if N == 1 else x[i : i + 1]  # [1, H]
            oi = None
            if staged is not None:  # the grouped call runs in the next segment, from this plan row
                self.stats["device_computes"] += write_plan_row(staged.rows, ki, slot[i], w_host[i])
                oi = staged.extra
                staged.used = fallback
            if not self.null_compute and staged is None:
                oi = self.device_compute(layer, xi, ki, slot[i], wd if N == 1 else wd[i * k : (i + 1) * k])  # [1, H]
            if not self.null_compute:
                for j in ranks_of(kl, LOWBIT, si):  # ascending expert id
                    oi[0] += (self.lowbit_expert(layer, int(si[j]), xi) * wd[i * k + j])[0]
                    self.stats["lowbit_computes"] += 1
            # (5) host compute runs on the CPU while the device works through (4); results go back async
            for j in hosts:
                y = self.host_expert(layer, int(si[j]), xh)
                oi[0] += (self.result_to_device(y) * wd[i * k + j])[0]
                self.stats["host_computes"] += 1
            outs.append(oi)
            # (6) the admissions queued at this token start copying in the background
            while qi < len(queued) and queued[qi, 0] == t:
                e = int(queued[qi, 1])
                buf = self.pool.take_staging(layer)
                self.copies.pending[layer][e] = Pending(t + d, buf, self.copies.copy_async(layer, e, buf, "adm"))
                self.stats["admission_copies"] += 1
                qi += 1
        if ai != len(adm) or pi != len(pref) or qi != len(queued):
            raise RuntimeError(f"engine: MoE layer {layer}: plan rows outside tokens {t0}..{t0 + N - 1}")
        if not events_recorded:
            self.add_events(layer, plan.events)
        if self.debug:
            self.pool.check(layer)
        if staged is not None:
            return None
        if self.null_compute:
            return torch.zeros_like(x)
        return outs[0] if N == 1 else torch.cat(outs)  # [N, H]

    def device_compute(self, layer: int, x: torch.Tensor, kind: np.ndarray, slot: np.ndarray,
                       w: torch.Tensor) -> torch.Tensor:
        """One token's device-computed experts (kind HIT / FETCH / SUB) in one grouped call of the M ranks
        computed here (the Hugging Face forward path: generation, families without a capture plan): x [1, H],
        the token's decisions kind / slot [k] (host), its gate weights w [k] on the device in rank order ->
        [1, H], the weighted outputs summed over the k ranks in rank order (other kinds count 0). The segments
        compute all k ranks masked instead (`grouped_masked`: a CUDA graph needs one shape), bit for bit the
        same sum at about 10 more operators per layer, which this eager path does not pay."""
        k = len(kind)
        pos = np.flatnonzero(on_device(kind))  # [M] ranks computed here
        M = len(pos)
        self.stats["device_computes"] += M
        if M == 0:
            return torch.zeros_like(x)
        idx = self.to_device(slot[pos] if M == k else np.concatenate([slot[pos], pos]))  # [M] or [2M]
        rows, wm = (idx, w) if M == k else (idx[:M], w.index_select(0, idx[M:]))  # [M], [M]
        y = grouped_experts(self.pool.gate_up[layer], self.pool.down[layer], x.expand(M, -1), rows, wm,
                            self.act[layer])  # [M, H]
        if M < k:  # the ranks not computed here count 0 (exact: adding 0 changes no sum)
            y = y.new_zeros(k, y.shape[1]).index_copy_(0, idx[M:], y)
        return y.sum(dim=0, keepdim=True)  # [1, H]

    def to_device(self, a: np.ndarray) -> torch.Tensor:
        """Host int indices -> an int64 tensor on the device (CUDA: from pinned memory, without blocking)."""
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def fetch(self, layer: int, e: int, s: int, prefetch_load: bool = False) -> None:
        """Copy host -> slot s on the copy stream; the compute waits for it (CPU device mode: a plain copy)."""
        self.copies.copy_now(layer, e, self.pool.slots[layer][s])
        self.stats["prefetch_sync_loads" if prefetch_load else "fetch_copies"] += 1

    def _admit(self, layer: int, e: int, s: int) -> None:
        p = self.copies.pending[layer].pop(e, None)
        if p is None:
            raise RuntimeError(f"engine: MoE layer {layer}: the kernel admitted expert {e}, whose copy the engine "
                               "never started (its plan's queued rows were not applied)")
        if self.copies.wait_copy(p.handle, timed="admission_stall_s") and not self.cuda:  # CUDA: counted from the measured wait
            self.stats["admission_stalls"] += 1
        self.pool.install(layer, s, p.buf)
        self.stats["admissions_applied"] += 1

    def _release_popped(self, layer: int, t: int) -> None:
        """Copies due before token t that the kernel did not admit (it skips an expert that became resident
        meanwhile): their staging buffers go back to the pool once the copy is done."""
        q = self.copies.pending[layer]
        for e in [e for e, p in q.items() if p.due <= t]:
            p = q.pop(e)
            self.pool.give_staging(p.buf, after=p.handle)
            self.stats["admissions_discarded"] += 1

    def _load_prefetched(self, layer: int, e: int, s: int) -> None:
        """The kernel loaded expert e into slot s ahead of this token (prefetch): the copy started one layer
        earlier becomes the slot's buffer (waiting for it, a stall if late); without one (oracle prefetch,
        known only now, or an expert evicted by this token's admissions after the copies were issued) it
        is copied now, as a fetch."""
        p = self.copies.prefetch[layer].pop(e, None)
        if p is None:
            self.fetch(layer, e, s, prefetch_load=True)
            return
        if self.copies.wait_copy(p.handle, timed="prefetch_stall_s") and not self.cuda:  # CUDA: counted from the measured wait
            self.stats["prefetch_stalls"] += 1
        self.pool.install(layer, s, p.buf)
        self.stats["prefetch_applied"] += 1

    def _issue_prefetch(self, layer: int, t: int) -> None:
        """Lookahead prefetch: once this layer's routing is known, the next layer's predicted list is
        (runtime/backends/adapters.py, `Context.pending`); copies of its experts that are not resident there start
        now on the copy stream (behind this layer's fetches), into staging buffers. The next layer's plan
        says which of them the kernel loads, and into which slots."""
        nxt = layer + 1
        pend = getattr(self.ctx, "pending", None)
        q = pend[nxt] if pend is not None and nxt < self.L else None
        pred = q[-1] if q else None  # the list this step just formed for the next layer
        if pred is None or len(pred) != 1:
            return
        cache = self.pool.cache
        q = self.copies.prefetch[nxt]
        # a bounded copy pool (docs/policies.md, "Additions (3)"): the next layer's buffers not held by its
        # admission copies in flight; the kernel cuts the list after as many non-resident members
        free = self.pool.free_copy_buffers(nxt)
        for e in pred[0][: cache.prefetch_width].tolist():
            if e < 0:
                break
            if cache.expert_slot[nxt, e] >= 0 or e in q:
                continue
            if free is not None and len(q) == cache.policy.copy_buffers - len(self.copies.pending[nxt]):
                break
            buf = self.pool.take_staging(nxt)
            q[e] = Pending(t, buf, self.copies.copy_async(nxt, e, buf, "copy"))
            self.stats["prefetch_copies"] += 1

    def _release_prefetch(self, layer: int) -> None:
        """Early copies the kernel did not load (an admission made the expert resident first, or no victim)."""
        q = self.copies.prefetch[layer]
        for p in q.values():
            self.pool.give_staging(p.buf, after=p.handle)
            self.stats["prefetch_wasted"] += 1
        q.clear()

    # ------------------------------------------------------------------ host compute

    def host_expert(self, layer: int, e: int, x_host: torch.Tensor) -> torch.Tensor:
        """Expert e on the host CPU from the host store: x_host [n, H] on the host -> [n, H] on the host."""
        gu, d = self.store.weights(layer, e)
        return expert_forward(x_host, gu, d, self.act[layer])

    def result_to_device(self, y: torch.Tensor) -> torch.Tensor:
        """A host result back to the device: a non-blocking copy from pinned memory (CPU device mode: as is)."""
        if not self.cuda:
            return y
        return y.pin_memory().to(self.device, non_blocking=True)  # the caching host allocator keeps it alive

    # ------------------------------------------------------------------ low-bit copies

    def bind_lowbit(self, policy: PolicyConfig) -> None:
        """The low-bit copies `policy` needs (fallback lowbit) on the device, or none (they leave it)."""
        if policy.fallback == "lowbit":
            self.build_lowbit(int(policy.lowbit_bits), int(policy.lowbit_group))
        elif self.lowbit is not None:  # another policy: the low-bit copies leave the device
            self.lowbit, self.lowbit_key = None, None
            self.pool.refund(self.lowbit_bytes)
            self.lowbit_bytes = 0

    def build_lowbit(self, bits: int, group: int, experts: int | None = None) -> None:
        """Packed low-bit copies (runtime/backends/lowbit.py: HQQ, groups along each matrix's input dimension) of
        every expert (`experts`: only the first that many of each layer, calibration) on the device. Each is
        quantized once, on the host in float32 from the host store, as the emulation quantizes its copies
        (so both compute with the same codes), and kept on the host (`lowbit_host`): a later build of the
        same (bits, group) only copies them to the device again."""
        n = self.E if experts is None else min(int(experts), self.E)
        if self.lowbit_key == (bits, group, n):
            return
        from runtime.backends import lowbit  # noqa: PLC0415 - hqq is only needed for this fallback

        if self.lowbit is not None:
            self.pool.refund(self.lowbit_bytes)
        self.lowbit, self.lowbit_key, self.lowbit_bytes = None, None, 0
        host = self.lowbit_host.setdefault((bits, group), {})
        todo = [(l_, e) for l_ in range(self.L) for e in range(n) if (l_, e) not in host]
        for l_, e in todo:
            gu, d = self.store.weights(l_, e)  # [2I, H], [H, I] on the host
            host[(l_, e)] = (lowbit.quantize(gu, bits, group), lowbit.quantize(d, bits, group))
        copies, nbytes = [], 0
        for l_ in range(self.L):
            row = [tuple(q.to(self.device) for q in host[(l_, e)]) for e in range(n)]
            nbytes += sum(q.nbytes for pair in row for q in pair)
            copies.append(row)
        self.lowbit, self.lowbit_key, self.lowbit_bytes = copies, (bits, group, n), nbytes
        self.pool.charge(nbytes)
        log.info("low-bit copies (%d bits, group %d) of %d experts (%d quantized now): %.3g MiB on %s", bits, group,
                 self.L * n, len(todo), nbytes / 2**20, self.device)

    def lowbit_expert(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e from its packed low-bit copy: dequantize on the device, then compute; x [n, H] -> [n, H]."""
        qgu, qd = self.lowbit[layer][e]
        return expert_forward(x, qgu.dequantize(self.dtype), qd.dequantize(self.dtype), self.act[layer])


def stream_layer(run: PlanRunner, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact experts' output for x [N, H], selection ids [N, k] and gate weights w [N, k] -> [N, H]: the
    engine's exact mode (prefill, the exact reference). Resident experts read their slots; the others
    stream host -> device through two staging buffers, the copy of the next expert overlapping the
    compute of the current one. Tokens accumulate in the Hugging Face eager order (ascending expert
    id, then rank-major token order), so the result equals the model's.

    One device -> host read of the selection per call (which experts, which tokens); the token lists
    go back to the device in one pinned, asynchronous copy; no other synchronisation."""
    pool, copies = run.pool, run.copies
    out = torch.zeros_like(x)  # [N, H]
    ids_h = ids.cpu().numpy()  # [N, k]
    experts = np.unique(ids_h).tolist()  # ascending
    N, k = ids_h.shape
    # per expert, (token, rank) pairs in rank-major order, as the HF eager loop accumulates them
    pos_l, tok_l, bounds = [], [], [0]
    for e in experts:
        pos, tok = np.nonzero((ids_h == e).T)  # [k, N] mask: rank-major
        pos_l.append(pos)
        tok_l.append(tok)
        bounds.append(bounds[-1] + len(tok))
    idx = torch.from_numpy(np.concatenate([np.concatenate(tok_l), np.concatenate(pos_l)]).astype(np.int64))
    if run.cuda:
        idx = idx.pin_memory().to(run.device, non_blocking=True)
    M = bounds[-1]
    toks, poss = idx[:M], idx[M:]  # [M] token, [M] rank
    slots = {e: pool.resident_slot(layer, e) for e in experts}
    stream = [e for e in experts if slots[e] < 0]
    bufs = [pool.take_prefill() for _ in range(min(2, len(stream)))]
    handles: list = [None, None]

    def issue(n: int) -> None:
        handles[n % 2] = copies.copy_async(layer, stream[n], bufs[n % 2], stream="copy")
        run.stats["prefill_copies"] += 1

    if stream:
        issue(0)
    n = 0
    act = run.act[layer]
    for a, e in enumerate(experts):
        if slots[e] >= 0:
            buf = pool.slots[layer][slots[e]]
        else:
            copies.wait_copy(handles[n % 2])
            buf = bufs[n % 2]
            if n + 1 < len(stream):
                issue(n + 1)  # into the other buffer, whose last reader (expert n-1) was marked below
        tok, pos = toks[bounds[a] : bounds[a + 1]], poss[bounds[a] : bounds[a + 1]]
        y = expert_forward(x[tok], buf.gate_up, buf.down, act) * w[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
        if slots[e] < 0:
            pool.mark_read(buf)  # the next copy into this buffer waits for this compute
            n += 1
    for b in bufs:
        pool.give_staging(b)
    return out
