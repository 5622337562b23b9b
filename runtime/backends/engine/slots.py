"""The device's expert memory: per MoE layer a pool of slots, the staging buffers, and the ledger of the
device bytes the engine holds.

- The slots of MoE layer `l` are ONE tensor pair, `gate_up[l]` [C_l, 2I, H] and `down[l]` [C_l, H, I], so
  that a layer's experts are computed in one grouped call (runtime/backends/engine/plan.py, `grouped_experts`:
  gather by slot index + batched matmul). Slot `s` (`slots[l][s]`, an `ExpertBuf` of views of row `s`)
  holds the expert the kernel's own table says (`cache.slot_expert[l, s]`): the pool reads the bound
  `PolicyCache` and keeps no copy of its slot table. Fetches copy host -> row.
- llama.cpp's two ways of holding experts (runtime/core/llamacpp_cache.py, docs/engine.md "llama.cpp's expert
  cache and layer split"): the shared pool (`SharedPoolCache`) is ONE tensor pair `[S, 2I, H]` / `[S, H, I]`
  for the whole model, which every layer's `gate_up[l]` / `down[l]` and `slots[l]` name, so the kernel's pool
  slot ids address it directly (the grouped call reads the layer's experts from it in place, no gather); the
  layer split (`LayerSplitCache`) holds E slots (slot = expert id) on each device layer and none on its first
  N (host) layers. `residents` and `slot_of` read each cache's own table.
- Staging buffers: the prefill's double buffer (the exact path's streamed experts: two buffers, allocated
  with the pool), and the copy buffers of the background copies (admissions, lookahead prefetches). With a
  bounded pool (policy field `copy_buffers` = B, docs/policies.md "Additions (3)") `bind` allocates B
  buffers per MoE layer up front, layer l's copies take only layer l's, and taking one from an empty
  partition is an error (the kernel never plans a copy without a free buffer); unbounded, one shared pool
  grows on demand (never returned to the allocator). `high_water` is the most copy buffers in use at
  once. A buffer whose copy the kernel admits or loads is copied into the slot's row on the compute
  stream (`install`: a device -> device copy, ordered after the row's last reader) and goes back.
- CUDA: every buffer carries its own events (`ready` after its last copy, `done_reading` after its last
  queued reader; `freed` is the one the next writer's stream waits on), re-recorded, never new per copy.

The copies into these buffers are runtime/backends/engine/copies.py's; what goes where is the kernel's plan
(runtime/backends/engine/plan.py).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from runtime.core.llamacpp_cache import LayerSplitCache, SharedPoolCache

if TYPE_CHECKING:
    from runtime.backends.engine.store import HostStore
    from runtime.core.kernel import PolicyCache


def residents(cache, layer: int) -> list[tuple[int, int]]:
    """(slot, expert) of every expert of MoE layer `layer` on the device, read from `cache`'s own table: a
    `PolicyCache`'s `slot_expert`, the shared pool's keys (layer * E + expert) in its slots, the layer split's
    slot = expert id on a device layer."""
    if isinstance(cache, SharedPoolCache):
        keys = cache.pool.slot_key  # [S] key per pool slot, -1 empty
        mine = np.flatnonzero((keys >= 0) & (keys // cache.E == layer))
        return [(int(s), int(keys[s]) % cache.E) for s in mine]
    if isinstance(cache, LayerSplitCache):
        return [(e, e) for e in cache.resident(layer).tolist()]
    row = cache.slot_expert[layer, : int(cache.caps[layer])]
    return [(int(s), int(e)) for s, e in enumerate(row.tolist()) if e >= 0]


def slot_of(cache, layer: int, e: int) -> int:
    """The slot of expert e of MoE layer `layer` in `cache`'s own table (a shared pool: its pool slot), -1 when not
    on the device."""
    if isinstance(cache, SharedPoolCache):
        return int(cache.pool.key_slot[layer * cache.E + e])
    if isinstance(cache, LayerSplitCache):
        return e if layer >= cache.ncmoe else -1
    return int(cache.expert_slot[layer, e])


@dataclass
class ExpertBuf:
    """One expert's weights on the device (a slot's content or a staging buffer).

    CUDA: `ready` is recorded after the last copy into the buffer; `freed` points at the event after
    which the buffer's last reader (or writer) is done, that the next writer's stream waits on. The two
    events are the buffer's own, re-recorded (no new CUDA event per copy)."""

    gate_up: torch.Tensor  # [2I, H] (a slot: a view of row s of the layer's [C_l, 2I, H])
    down: torch.Tensor  # [H, I] (a slot: a view of row s of the layer's [C_l, H, I])
    ready: object = None
    done_reading: object = None
    freed: object = None
    home: int = -1  # the MoE layer whose partition of a bounded copy pool holds it; -1 shared, -2 prefill


class SlotPool:
    """Per-layer slots and the staging pool of one engine, in `store`'s dtype on `device`.

    `dev_bytes` / `peak_bytes`: the device bytes the engine holds (non-expert weights `base_bytes`, every
    buffer allocated here, and what others `charge`, such as the low-bit copies), now and at most since
    `reset_peak` (CPU device mode's peak device memory)."""

    def __init__(self, store: HostStore, device: torch.device, H: int, I: int, expert_bytes: int,  # noqa: E741
                 base_bytes: int) -> None:
        self.store, self.device, self.cuda = store, device, device.type == "cuda"
        self.dtype, self.H, self.I, self.expert_bytes = store.dtype, H, I, expert_bytes
        self.cache: PolicyCache | None = None
        self.slots: list[list[ExpertBuf]] | None = None  # [L][C_l]: views of the rows below
        self.gate_up: list[torch.Tensor] = []  # [L] of [C_l, 2I, H] (a shared pool: the same [S, 2I, H] L times)
        self.down: list[torch.Tensor] = []  # [L] of [C_l, H, I] (a shared pool: the same [S, H, I] L times)
        self.layout: tuple = ()  # ("per_layer", C_0, ..., C_{L-1}) or ("shared", L, S): what `slots` holds
        self.free: list[ExpertBuf] = []  # unbounded copy pool: buffers not in use
        self.part: list[list[ExpertBuf]] | None = None  # bounded copy pool: per layer, its free buffers
        self.bound_copies: tuple[int, int] = (0, 0)  # (layers, buffers per layer) of the bounded pool
        self.n_copy = 0  # copy buffers allocated
        self.in_use = self.high_water = 0  # copy buffers in use now, and at most since `reset_peak`
        self.dev_bytes = self.peak_bytes = base_bytes
        self.prefill_free = [self._new_prefill() for _ in range(2)]  # the prefill's double buffer

    # ------------------------------------------------------------------ the ledger

    def charge(self, nbytes: int) -> None:
        self.dev_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.dev_bytes)

    def refund(self, nbytes: int) -> None:
        self.dev_bytes -= nbytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.dev_bytes
        self.high_water = self.in_use

    @property
    def n_staging(self) -> int:
        """Staging buffers allocated: the prefill's two and the copy buffers."""
        return 2 + self.n_copy

    def staging_bytes(self) -> int:
        return self.n_staging * self.expert_bytes

    def slot_bytes(self) -> int:
        """Device bytes of the slots (a shared pool's S slots counted once)."""
        if self.layout[:1] == ("shared",):
            return self.layout[2] * self.expert_bytes
        return sum(len(s) for s in self.slots or []) * self.expert_bytes

    # ------------------------------------------------------------------ buffers

    def new_buf(self, gate_up: torch.Tensor | None = None, down: torch.Tensor | None = None) -> ExpertBuf:
        """A staging buffer (new tensors) or, given `gate_up` / `down` (views of a slot row), a slot's buffer;
        both charged to the ledger and given their CUDA events."""
        if gate_up is None:
            with torch.inference_mode(False):  # normal tensors: the link thread (not in inference mode) writes them
                gate_up = torch.empty(2 * self.I, self.H, dtype=self.dtype, device=self.device)
                down = torch.empty(self.H, self.I, dtype=self.dtype, device=self.device)
        buf = ExpertBuf(gate_up, down)
        if self.cuda:
            buf.ready, buf.done_reading = torch.cuda.Event(), torch.cuda.Event()
            # the caching allocator may hand out memory that the compute stream freed a moment ago and
            # still reads: whoever writes the new buffer on another stream waits for the compute stream
            buf.done_reading.record(torch.cuda.current_stream(self.device))
            buf.freed = buf.done_reading
        self.charge(self.expert_bytes)
        return buf

    def _new_prefill(self) -> ExpertBuf:
        buf = self.new_buf()
        buf.home = -2
        return buf

    def take_prefill(self) -> ExpertBuf:
        """One of the prefill's two staging buffers (the exact path streams through them)."""
        if not self.prefill_free:
            raise RuntimeError("engine: the exact path took more than the prefill's two staging buffers")
        return self.prefill_free.pop()

    def bind_copies(self, policy, num_layers: int) -> None:
        """The copy pool `policy` needs: bounded (`copy_buffers` B, with admission or prefetch on), B buffers per
        layer allocated now (kept while the next binding needs the same); else the shared pool, on demand."""
        b = getattr(policy, "copy_buffers", None)
        want = (num_layers, int(b)) if b is not None and (policy.beta is not None or policy.prefetch != "off") \
            else (0, 0)
        if want == self.bound_copies and (want != (0, 0) or self.part is None):
            return
        self.refund(self.n_copy * self.expert_bytes)  # the old pool leaves (the caller drained every copy)
        self.free, self.part, self.n_copy, self.in_use, self.bound_copies = [], None, 0, 0, want
        if want != (0, 0):
            self.part = []
            for l_ in range(num_layers):
                row = [self.new_buf() for _ in range(want[1])]
                for buf in row:
                    buf.home = l_
                self.part.append(row)
            self.n_copy = num_layers * want[1]

    def take_staging(self, layer: int) -> ExpertBuf:
        """A free copy buffer for a background copy of MoE layer `layer`: from its partition of the bounded pool
        (none free: an error, the kernel's plan and the engine disagree), or from the shared pool (allocated on
        demand; buffers are never returned to the allocator)."""
        if self.part is not None:
            if not self.part[layer]:
                raise RuntimeError(f"engine: MoE layer {layer}: no free copy buffer of its {self.bound_copies[1]} "
                                   "(the kernel planned a copy the bounded pool cannot hold)")
            buf = self.part[layer].pop()
        elif not self.free:
            self.n_copy += 1
            buf = self.new_buf()
        else:
            buf = self.free.pop()
        self.in_use += 1
        self.high_water = max(self.high_water, self.in_use)
        return buf

    def free_copy_buffers(self, layer: int) -> int | None:
        """Free buffers of layer `layer`'s partition of the bounded pool; None when the pool is unbounded."""
        return None if self.part is None else len(self.part[layer])

    def mark_read(self, buf: ExpertBuf) -> None:
        """CUDA: the compute stream's reads of `buf` queued so far end its use; the next writer waits for them."""
        if self.cuda:
            buf.done_reading.record(torch.cuda.current_stream(self.device))
            buf.freed = buf.done_reading

    def give_staging(self, buf: ExpertBuf, after=None) -> None:
        """Return a buffer to the staging pool: free once the compute stream's reads queued so far are done,
        or (after = its copy's handle: a copy nobody will read) once that copy is done."""
        if self.cuda:
            if after is None:
                self.mark_read(buf)
            else:
                buf.freed = after
        elif isinstance(after, Future):
            after.result()
        if buf.home == -2:
            self.prefill_free.append(buf)
            return
        self.in_use -= 1
        (self.part[buf.home] if buf.home >= 0 else self.free).append(buf)

    # ------------------------------------------------------------------ slots

    def bind(self, cache: PolicyCache | SharedPoolCache | LayerSplitCache) -> None:
        """Slots sized by `cache`'s capacities (reallocated only when they change; a shared pool: one array of its
        S slots that every layer names) and loaded with its residency from the host store (blocking copies on
        the current stream)."""
        caps = [int(c) for c in cache.caps]
        L = len(caps)
        layout = ("shared", L, sum(caps)) if isinstance(cache, SharedPoolCache) else ("per_layer", *caps)
        if self.slots is None or self.layout != layout:
            if self.slots is not None:
                self.refund(self.slot_bytes())
            self.slots, self.gate_up, self.down = None, [], []  # the old rows go before the new ones are allocated
            sizes = [layout[2]] if layout[0] == "shared" else caps
            with torch.inference_mode(False):  # normal tensors and views (written outside inference mode too)
                gate_up = [torch.empty(c, 2 * self.I, self.H, dtype=self.dtype, device=self.device) for c in sizes]
                down = [torch.empty(c, self.H, self.I, dtype=self.dtype, device=self.device) for c in sizes]
                slots = [[self.new_buf(gu[s], dn[s]) for s in range(len(gu))] for gu, dn in zip(gate_up, down, strict=True)]
            if layout[0] == "shared":  # every layer names the one pool: the kernel's pool slot s is row s
                gate_up, down, slots = gate_up * L, down * L, slots * L
            self.gate_up, self.down, self.slots, self.layout = gate_up, down, slots, layout
        self.cache = cache
        self.bind_copies(cache.policy, L)
        for l_ in range(L):
            for s, e in residents(cache, l_):
                self.store.copy_into(l_, e, self.slots[l_][s])

    def install(self, layer: int, s: int, buf: ExpertBuf) -> None:
        """`buf` (a landed staging copy: the caller made the compute stream wait for it) is copied into slot s
        of `layer` on the current stream, after the row's last reader queued there; `buf` goes back to the
        staging pool once that copy has read it."""
        row = self.slots[layer][s]
        row.gate_up.copy_(buf.gate_up)
        row.down.copy_(buf.down)
        self.give_staging(buf)

    def resident_slot(self, layer: int, e: int) -> int:
        """The kernel's slot of expert e (its own table), -1 when not resident or nothing is bound."""
        if self.slots is None or self.cache is None:
            return -1
        return slot_of(self.cache, layer, e)

    def check(self, layer: int) -> None:
        """Debug: every slot holds the weights of the expert the kernel's table puts there."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for s, e in residents(self.cache, layer):
            gu, d = self.store.weights(layer, e)
            buf = self.slots[layer][s]
            if not (torch.equal(buf.gate_up.cpu(), gu) and torch.equal(buf.down.cpu(), d)):
                raise AssertionError(f"engine slot {s} of MoE layer {layer} does not hold expert {e}'s weights")
