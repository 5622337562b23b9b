"""The offloading engine: the policy kernel's decisions drive real expert copies and computes.

Layout (docs/engine.md):
- non-expert weights on the device (`cuda`, or `cpu` in CPU device mode);
- every MoE layer's expert weights in a `HostStore` (pinned host memory when CUDA, or
  memory-mapped safetensors for SSD-backed offload);
- per MoE layer a pool of `C_l` device slots (`ExpertBuf`, one [2I, H] and one [H, I] tensor
  each); `slot_expert` mirrors the kernel's residency slot for slot (checked in debug mode);
- a shared pool of staging buffers for background admissions and the prefill stream.

The adapters (runtime/adapters.py) route, rank and ask the kernel exactly as in the emulation,
then call `Engine.run_experts(layer, hidden, ids, weights, decisions)`. Per decoded token and
layer, in the kernel's order: admissions due are applied (wait for their copy, counting a stall
if it is late, then the staging buffer becomes the slot's buffer), FETCHes copy host -> slot on
the copy stream and the token waits, HIT/FETCH/SUB compute from their slots with the (adapted)
router weight, HOST computes on the host from the store, DROP computes nothing; then the
admissions queued at this token start copying into staging buffers on the admission stream
(CPU device mode: a background thread; torch copies release the GIL).

The `engine` backend of runtime/backends.py (`python -m runtime.emulate --backend engine`) is the
emulation's evaluation with every policy decoded token by token by `Engine.teacher_forced`
(batch 1, KV cache, teacher forcing).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import json
import logging
import mmap
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runtime import adapters, hfmodel
from runtime.errors import InputError, cli_main
from runtime.kernel import DROP, FETCH, HOST, PolicyCache, warmup
from runtime.policy import PolicyConfig

log = logging.getLogger(__name__)

# --vram-budget: what is kept back for activations, the KV cache and allocator slack, as a
# fraction of the budget, on top of the staging buffers (see capacities_for_budget).
RESERVE_FRACTION = 0.05
PREFILL_STAGING = 2  # double buffer


def resolve_device(device: str | None, flag: str = "--device") -> torch.device:
    """'cuda' | 'cpu' | None (cuda when available, else CPU device mode)."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise InputError(f"{flag} = {device!r} must be cpu or cuda")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"{flag} = {device}: no CUDA device is available (torch.cuda.is_available() is False)")
    return torch.device(device)


def expert_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act) -> torch.Tensor:
    """One expert on tokens x [n, H]: gate_up [2I, H], down [H, I] -> [n, H] (the HF fused layout's math)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act(gate) * up, down)


@dataclass
class ExpertBuf:
    """One expert's weights on the device (a slot's content or a staging buffer)."""

    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]
    freed: object = None  # CUDA: event after which the buffer's last reader/writer is done


# ----------------------------------------------------------------------------- host store

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_PER_EXPERT = re.compile(r"layers\.(\d+)\.(?:.*\.)?experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"layers\.(\d+)\.(?:.*\.)?experts\.(gate_up_proj|down_proj)$")
_ROLE = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def mmap_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors file as views of a copy-on-write memory map (pages load on first use)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    n = int.from_bytes(mm[:8], "little")
    header = json.loads(mm[8 : 8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__" or meta["dtype"] not in _ST_DTYPES:
            continue
        dt = _ST_DTYPES[meta["dtype"]]
        a, b = meta["data_offsets"]
        count = (b - a) // torch.empty((), dtype=dt).element_size()
        if count:
            out[name] = torch.frombuffer(mm, dtype=dt, count=count, offset=8 + n + a).view(meta["shape"])
    return out


class HostStore:
    """Expert weights of every MoE layer on the host.

    `fused[l] = (gate_up [E, 2I, H], down [E, H, I])` (pinned when the device is CUDA), or
    `parts[l][e] = (gate [I, H], up [I, H], down [H, I])` views of memory-mapped safetensors.
    """

    def __init__(self, dtype: torch.dtype, fused: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 parts: list[list[tuple[torch.Tensor, ...]]] | None = None, kind: str = "ram") -> None:
        self.dtype, self.fused, self.parts, self.kind = dtype, fused, parts, kind
        self.pinned = bool(fused) and all(gu.is_pinned() for gu, _ in fused)

    def copy_into(self, layer: int, e: int, buf: ExpertBuf, non_blocking: bool = False) -> None:
        if self.fused is not None:
            gu, d = self.fused[layer]
            buf.gate_up.copy_(gu[e], non_blocking=non_blocking)
            buf.down.copy_(d[e], non_blocking=non_blocking)
        else:
            g, u, d = self.parts[layer][e]
            i = g.shape[0]
            buf.gate_up[:i].copy_(g, non_blocking=non_blocking)
            buf.gate_up[i:].copy_(u, non_blocking=non_blocking)
            buf.down.copy_(d, non_blocking=non_blocking)

    def weights(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) on the host, in the engine's dtype (for host compute)."""
        if self.fused is not None:
            gu, d = self.fused[layer]
            return gu[e], d[e]
        g, u, d = self.parts[layer][e]
        return torch.cat([g, u]).to(self.dtype), d.to(self.dtype)


def _mmap_parts(model_dir: Path, layer_ids: tuple[int, ...], E: int) -> list[list[tuple[torch.Tensor, ...]]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InputError(f"--host-store mmap: no .safetensors files in {model_dir}")
    found: dict[int, dict[int, list]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [None] * 3))
    for f in files:
        for name, t in mmap_safetensors(f).items():
            if (mt := _PER_EXPERT.search(name)) is not None:
                found[int(mt.group(1))][int(mt.group(2))][_ROLE[mt.group(3)]] = t
            elif (mt := _FUSED.search(name)) is not None:
                lay, what = int(mt.group(1)), mt.group(2)
                for e in range(t.shape[0]):
                    if what == "gate_up_proj":
                        i = t.shape[1] // 2
                        found[lay][e][0], found[lay][e][1] = t[e, :i], t[e, i:]
                    else:
                        found[lay][e][2] = t[e]
    parts = []
    for lay in layer_ids:
        row = [tuple(found[lay][e]) for e in range(E)] if lay in found else []
        if len(row) != E or any(p is None for r in row for p in r):
            raise InputError(f"--host-store mmap: {model_dir}: layer {lay} does not have gate/up/down tensors "
                             f"for all {E} experts in the safetensors files")
        parts.append(row)
    return parts


# ----------------------------------------------------------------------------- engine


@dataclass
class _Pending:
    due: int  # token before which the kernel applies it (queued token + admission delay)
    expert: int
    buf: ExpertBuf
    handle: object  # CPU: Future of the copy; CUDA: event recorded after the copy


class Engine:
    """Runs a loaded checkpoint (runtime.hfmodel.load) with its experts offloaded; see the module doc."""

    def __init__(self, m: hfmodel.Loaded, device: str | torch.device | None = None, host_store: str = "ram",
                 pinned: bool = True, debug: bool = False) -> None:
        self.m = m
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.cuda = self.device.type == "cuda"
        self.debug = debug
        experts = [mod.experts for mod in m.model.modules() if isinstance(mod, adapters.PolicyExperts)]
        for ex in experts:
            gu, d = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
            if (not isinstance(gu, torch.Tensor) or not isinstance(d, torch.Tensor) or gu.dim() != 3
                    or hasattr(ex, "gate_up_proj_bias") or gu.shape[1] != 2 * d.shape[2] or gu.shape[2] != d.shape[1]):
                raise InputError(f"--model {m.model_dir}: model_type {m.model.config.model_type!r}: the engine supports "
                                 "the fused expert layout gate_up_proj [E, 2I, H] / down_proj [E, H, I] without biases")
        self.L, self.E, self.k = m.num_layers, m.E, m.k
        self.H, self.I = int(experts[0].down_proj.shape[1]), int(experts[0].down_proj.shape[2])
        self.dtype = experts[0].gate_up_proj.dtype
        self.act = [ex.act_fn for ex in experts]
        self.expert_bytes = 3 * self.H * self.I * torch.empty((), dtype=self.dtype).element_size()
        if host_store == "ram":
            fused = [(ex.gate_up_proj.data, ex.down_proj.data) for ex in experts]
            if self.cuda and pinned:
                fused = [(gu.pin_memory(), d.pin_memory()) for gu, d in fused]
            self.store = HostStore(self.dtype, fused=fused, kind="ram")
        elif host_store == "mmap":
            parts = _mmap_parts(m.model_dir, m.layer_ids, self.E)
            for l_, ex in enumerate(experts):  # the checkpoint's tensors must be the model's experts
                for e in {0, self.E - 1}:
                    g, u, d = parts[l_][e]
                    if not (torch.equal(torch.cat([g, u]).to(self.dtype), ex.gate_up_proj.data[e])
                            and torch.equal(d.to(self.dtype), ex.down_proj.data[e])):
                        raise InputError(f"--host-store mmap: {m.model_dir}: the safetensors experts of MoE layer {l_} "
                                         f"do not match the loaded model's (expert {e})")
            self.store = HostStore(self.dtype, parts=parts, kind="mmap")
        else:
            raise InputError(f"--host-store = {host_store!r} must be ram or mmap")
        for ex in experts:  # the experts live in the host store from now on
            ex.gate_up_proj = nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)
            ex.down_proj = nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)
        m.model.to(self.device)
        self.nonexpert_bytes = sum(t.numel() * t.element_size() for t in (*m.model.parameters(), *m.model.buffers()))
        if self.device.type != "cpu":
            m.model.register_forward_pre_hook(self._inputs_to_device, with_kwargs=True)
            m.model.register_forward_hook(self._logits_to_host)
        m.ctx.executor = self.run_experts
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)  # synchronous fetches, prefill stream
            self.adm_stream = torch.cuda.Stream(self.device)  # background admissions
            self._link = None
        else:
            self._link = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertsweep-link")
        self.cache: PolicyCache | None = None
        self.slots: list[list[ExpertBuf]] | None = None
        self.slot_expert = np.full((self.L, 0), -1, np.int64)
        self._free: list[ExpertBuf] = []
        self._pending: list[collections.deque] = [collections.deque() for _ in range(self.L)]
        self._dev_bytes = self._peak_bytes = self.nonexpert_bytes
        self.n_staging = 0
        self.events: list[list[np.ndarray]] = [[] for _ in range(self.L)]
        self.stats: dict = {}
        self._reset_stats()
        self.null_compute = False  # calibration only: skip the expert math (everything else runs)
        # timer of decode and calibration: wall clock; time.thread_time (the main thread's CPU time, CPU
        # device mode only) leaves out the time a shared host's other processes hold the core
        self.clock = time.perf_counter
        self.logits: list[torch.Tensor] = []

    # ------------------------------------------------------------------ plumbing

    def _inputs_to_device(self, module, args, kwargs):
        kwargs = {k: (v.to(self.device) if isinstance(v, torch.Tensor) and k in ("input_ids", "attention_mask",
                                                                              "position_ids") else v)
                  for k, v in kwargs.items()}
        return tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args), kwargs

    @staticmethod
    def _logits_to_host(module, args, out):
        if getattr(out, "logits", None) is not None:
            out.logits = out.logits.cpu()
        return out

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self._link is not None:
            self._link.shutdown(wait=True)
            self._link = None

    def _reset_stats(self) -> None:
        self.stats = {"fetch_copies": 0, "admission_copies": 0, "admissions_applied": 0, "admissions_discarded": 0,
                      "admission_stalls": 0, "admission_stall_s": 0.0, "host_computes": 0, "device_computes": 0,
                      "prefill_copies": 0}

    def _new_buf(self) -> ExpertBuf:
        with torch.inference_mode(False):  # normal tensors: the link thread (not in inference mode) writes them
            buf = ExpertBuf(torch.empty(2 * self.I, self.H, dtype=self.dtype, device=self.device),
                            torch.empty(self.H, self.I, dtype=self.dtype, device=self.device))
        self._dev_bytes += self.expert_bytes
        self._peak_bytes = max(self._peak_bytes, self._dev_bytes)
        return buf

    def take_staging(self) -> ExpertBuf:
        """A free staging buffer (allocated on demand; buffers are never returned to the allocator)."""
        if not self._free:
            self.n_staging += 1
            return self._new_buf()
        return self._free.pop()

    def give_staging(self, buf: ExpertBuf, after=None) -> None:
        """Return a buffer to the staging pool once its readers (CUDA: the compute stream now) are done."""
        if self.cuda:
            if after is None:
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(self.device))
            buf.freed = after
        elif isinstance(after, Future):
            after.result()
        self._free.append(buf)

    def copy_async(self, layer: int, e: int, buf: ExpertBuf, stream: str = "adm"):
        """Start copying expert e of `layer` into `buf`; returns the handle `wait_copy` takes."""
        if not self.cuda:
            return self._link.submit(self._copy_on_link, layer, e, buf)
        s = self.adm_stream if stream == "adm" else self.copy_stream
        if buf.freed is not None:
            s.wait_event(buf.freed)
        with torch.cuda.stream(s):
            self.store.copy_into(layer, e, buf, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s)
        return ev

    def _copy_on_link(self, layer: int, e: int, buf: ExpertBuf) -> None:
        with torch.no_grad():
            self.store.copy_into(layer, e, buf)

    def wait_copy(self, handle) -> bool:
        """Make the compute wait for a copy; True if it had not finished yet (a stall)."""
        if not self.cuda:
            late = not handle.done()
            handle.result()
            return late
        late = not handle.query()
        torch.cuda.current_stream(self.device).wait_event(handle)
        return late

    # ------------------------------------------------------------------ pools

    def capacities_for_budget(self, budget_gib: float, policies: list[PolicyConfig] | tuple = (),
                              flag: str = "--vram-budget") -> np.ndarray:
        """Slots per layer that fit a device memory budget (GiB); InputError when fewer than k.

        C = floor((budget - non-expert bytes - reserve) / (L * bytes per expert)), clamped to E - 1, where
        reserve = RESERVE_FRACTION * budget + staging buffers (2 for the prefill stream, plus L * k * d
        when a policy admits in the background: the most admissions that can be in flight at once).
        """
        if not (budget_gib > 0) or not np.isfinite(budget_gib):
            raise InputError(f"{flag} = {budget_gib!r} must be a positive number of GiB")
        budget = budget_gib * 2**30
        staging = PREFILL_STAGING + max([self.L * self.k * p.admission_delay for p in policies if p.beta is not None],
                                        default=0)
        reserve = RESERVE_FRACTION * budget + staging * self.expert_bytes
        avail = budget - self.nonexpert_bytes - reserve
        c = min(int(avail // (self.L * self.expert_bytes)) if avail > 0 else 0, self.E - 1)
        if c < self.k:
            raise InputError(f"{flag} = {budget_gib:g}: leaves {c} expert slots per layer, fewer than k = {self.k} "
                             f"(non-expert weights {self.nonexpert_bytes / 2**30:.3g} GiB, reserve "
                             f"{reserve / 2**30:.3g} GiB, one expert {self.expert_bytes / 2**20:.3g} MiB x "
                             f"{self.L} layers)")
        log.info("--vram-budget %g GiB: %d slots per layer", budget_gib, c)
        return np.full(self.L, c, np.int64)

    @torch.inference_mode()
    def bind(self, cache: PolicyCache) -> None:
        """Start a run under `cache`: slot pools sized by its capacities and loaded with its residency."""
        self.drain()
        warmup()  # the kernel is compiled (or loaded from numba's cache) before anything is timed
        caps = [int(c) for c in cache.caps]
        if self.slots is None or [len(s) for s in self.slots] != caps:
            if self.slots is not None:
                self._dev_bytes -= sum(len(s) for s in self.slots) * self.expert_bytes
            self.slots = None
            self.slots = [[self._new_buf() for _ in range(c)] for c in caps]
        self.cache = cache
        self.slot_expert = np.full((self.L, max(caps)), -1, np.int64)
        for l_ in range(self.L):
            for s in range(caps[l_]):
                e = int(cache.slot_expert[l_, s])
                if e >= 0:
                    self.store.copy_into(l_, e, self.slots[l_][s])
                    self.slot_expert[l_, s] = e
        self.events = [[] for _ in range(self.L)]
        self._reset_stats()
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak_bytes = self._dev_bytes

    def drain(self) -> None:
        """Wait for and drop every admission copy still in flight (end of a run)."""
        for q in self._pending:
            while q:
                p = q.popleft()
                self.wait_copy(p.handle)
                self.give_staging(p.buf)
        self.sync()

    def peak_device_bytes(self) -> int:
        """CUDA: torch.cuda.max_memory_allocated since bind; CPU device mode: non-expert weights + slots
        + staging buffers (the device-side tensors the engine holds; activations and KV not counted)."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self._peak_bytes)

    def resident_slot(self, layer: int, e: int) -> int:
        if self.slots is None:
            return -1
        hit = np.flatnonzero(self.slot_expert[layer, : len(self.slots[layer])] == e)
        return int(hit[0]) if len(hit) else -1

    # ------------------------------------------------------------------ the adapters' hook

    def run_experts(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, decisions) -> torch.Tensor:
        """Experts' output for tokens x [N, H]: exact streaming (decisions None) or the kernel's decisions."""
        if decisions is None:
            from runtime.prefill import stream_layer

            return stream_layer(self, layer, x, ids, w)
        return self._policy_layer(layer, x, w, decisions)

    def fetch(self, layer: int, e: int, s: int) -> None:
        """Synchronous fetch host -> slot s; the token's compute waits for it."""
        buf = self.slots[layer][s]
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            self.copy_stream.wait_stream(cur)  # the evicted expert's last readers are done
            with torch.cuda.stream(self.copy_stream):
                self.store.copy_into(layer, e, buf, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.copy_stream)
            cur.wait_event(ev)
        else:
            self.store.copy_into(layer, e, buf)
        self.slot_expert[layer, s] = e
        self.stats["fetch_copies"] += 1

    def host_expert(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on the host CPU from the host store; x [n, H] on the device -> [n, H] on the device."""
        gu, d = self.store.weights(layer, e)
        y = expert_forward(x.to("cpu"), gu, d, self.act[layer])
        return y.to(x.device)

    def _apply_admissions(self, layer: int, t: int, adm: np.ndarray, ai: int) -> int:
        q = self._pending[layer]
        while q and q[0].due <= t:
            p = q.popleft()
            if ai < len(adm) and adm[ai, 0] == t and adm[ai, 1] == p.expert:
                s = int(adm[ai, 2])
                ai += 1
                t0 = time.perf_counter()
                if self.wait_copy(p.handle):
                    self.stats["admission_stalls"] += 1
                    self.stats["admission_stall_s"] += time.perf_counter() - t0
                old = self.slots[layer][s]
                self.slots[layer][s] = p.buf
                self.slot_expert[layer, s] = p.expert
                self.give_staging(old)
                self.stats["admissions_applied"] += 1
            else:  # the kernel skipped it (the expert became resident meanwhile)
                self.give_staging(p.buf, after=p.handle)
                self.stats["admissions_discarded"] += 1
        return ai

    def _policy_layer(self, layer: int, x: torch.Tensor, w: torch.Tensor, res) -> torch.Tensor:
        N, k = res.kind.shape
        t0 = int(self.cache.next_t[layer]) - N
        out = torch.zeros_like(x)  # [N, H]
        act = self.act[layer]
        ai = qi = 0
        adm, queued, d = res.admitted, res.queued, self.cache.policy.admission_delay
        for i in range(N):
            t = t0 + i
            ai = self._apply_admissions(layer, t, adm, ai)
            for j in range(k):  # synchronous fetches in rank order
                if res.kind[i, j] == FETCH:
                    self.fetch(layer, int(res.served[i, j]), int(res.slot[i, j]))
            xi = x[i : i + 1]
            host_terms = []
            for j in np.argsort(res.served[i], kind="stable") if not self.null_compute else ():  # ascending expert id: the HF accumulation order
                kd = res.kind[i, j]
                if kd == DROP:
                    continue
                if kd == HOST:
                    host_terms.append(j)
                    continue
                buf = self.slots[layer][res.slot[i, j]]
                out[i] += (expert_forward(xi, buf.gate_up, buf.down, act) * w[i, j])[0]
                self.stats["device_computes"] += 1
            for j in host_terms:  # after the device work is queued, so both overlap on CUDA
                out[i] += (self.host_expert(layer, int(res.served[i, j]), xi) * w[i, j])[0]
                self.stats["host_computes"] += 1
            while qi < len(queued) and queued[qi, 0] == t:  # background admissions start after the token
                e = int(queued[qi, 1])
                buf = self.take_staging()
                self._pending[layer].append(_Pending(t + d, e, buf, self.copy_async(layer, e, buf, "adm")))
                self.stats["admission_copies"] += 1
                qi += 1
        if ai != len(adm):
            raise RuntimeError(f"engine: MoE layer {layer}: the kernel admitted {adm[ai:].tolist()} that the engine "
                               "had not queued")
        self.events[layer].append(res.events)
        if self.debug:
            self.check_mirror(layer)
        return out

    def check_mirror(self, layer: int) -> None:
        """Debug: the engine's slots hold exactly the kernel's residency, with the right weights."""
        c = int(self.cache.caps[layer])
        if not np.array_equal(self.slot_expert[layer, :c], self.cache.slot_expert[layer, :c]):
            raise AssertionError(f"engine slots {self.slot_expert[layer, :c].tolist()} != kernel "
                                 f"{self.cache.slot_expert[layer, :c].tolist()} at MoE layer {layer}")
        for s in range(c):
            e = int(self.slot_expert[layer, s])
            if e >= 0:
                gu, d = self.store.weights(layer, e)
                buf = self.slots[layer][s]
                if not (torch.equal(buf.gate_up.cpu(), gu) and torch.equal(buf.down.cpu(), d)):
                    raise AssertionError(f"engine slot {s} of MoE layer {layer} does not hold expert {e}'s weights")

    def trace_events(self) -> np.ndarray:
        """Kernel events of the run since bind, int32 [T, L, 5] (the cost model's input)."""
        return np.stack([np.concatenate(ev) for ev in self.events], axis=1).astype(np.int32)

    # ------------------------------------------------------------------ decoding

    @torch.inference_mode()
    def decode_step(self, token: torch.Tensor, past=None):
        """One token [1, 1] through the model with a KV cache: (logits [V] on the host, new cache)."""
        out, past = forward_cached(self.m.model, token, past)
        return out.logits[0, -1], past

    @torch.inference_mode()
    def teacher_forced(self, m: hfmodel.Loaded, windows: np.ndarray, cache: PolicyCache, name: str | None = None,
                       keep_logits: bool = False) -> tuple[np.ndarray, dict]:
        """Decode every window token by token under `cache` (feeding the true tokens); NLL [n, W-1] and the
        run's measurements. The policy_runner of runtime.emulate.emulate()."""
        if m is not self.m:
            raise ValueError("teacher_forced: the Loaded model is not this engine's")
        self.bind(cache)
        n, W = windows.shape
        nll = np.empty((n, W - 1), np.float64)
        self.logits = []
        decode_s = 0.0
        m.ctx.cache = cache
        try:
            for a in range(n):
                x = torch.from_numpy(windows[a : a + 1])
                rows, past = [], None
                self.sync()
                t0 = self.clock()
                for t in range(W):
                    logits, past = self.decode_step(x[:, t : t + 1], past)
                    rows.append(logits)
                self.sync()
                decode_s += self.clock() - t0
                lg = torch.stack(rows).float()  # [W, V]
                lp = torch.log_softmax(lg[:-1], dim=-1)
                nll[a] = (-torch.gather(lp, 1, x[0, 1:, None])[:, 0]).double().numpy()
                if keep_logits:
                    self.logits.append(lg)
        finally:
            m.ctx.cache = None
            self.drain()
        return nll, self.run_report(decode_s, n * W)

    def run_report(self, decode_s: float, tokens: int) -> dict:
        """The measured keys a run adds to the emulation's result."""
        return {"time_per_token_s": decode_s / max(tokens, 1), "peak_device_bytes": self.peak_device_bytes(),
                "engine": {"decode_seconds": decode_s, "decoded_tokens": tokens, **self.report()}}

    def report(self) -> dict:
        """Where things live and what the run since bind copied, computed and waited for."""
        return {"device": str(self.device), "host_store": self.store.kind, "pinned": self.store.pinned,
                "nonexpert_bytes": int(self.nonexpert_bytes), "expert_bytes": int(self.expert_bytes),
                "slot_bytes": int(sum(len(s) for s in self.slots or []) * self.expert_bytes),
                "staging_buffers": self.n_staging, **self.stats}


@functools.cache
def _takes_cache(cls: type) -> bool:
    return "cache" in inspect.signature(cls.forward).parameters


def forward_cached(model: nn.Module, input_ids: torch.Tensor, past=None):
    """model(input_ids) continuing the KV cache `past` (None: a new one); returns (output, cache).
    transformers >= 5.2x calls the cache argument `cache`, earlier 5.x `past_key_values`."""
    if _takes_cache(type(model)):
        out = model(input_ids=input_ids, cache=past, use_cache=True)
        return out, out.cache
    out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
    return out, out.past_key_values


# ----------------------------------------------------------------------------- entry points


@contextlib.contextmanager
def device_errors(hint: str = "lower --vram-budget or --capacity-fraction"):
    """CUDA out-of-memory -> a one-line InputError."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise InputError(f"CUDA out of memory ({first[:160]}); {hint}") from None


def engine_cli(fn) -> None:
    """cli_main for the engine's commands: CUDA OOM and Ctrl-C become one-line errors, exit status 2."""

    def wrapped():
        try:
            with device_errors():
                fn()
        except KeyboardInterrupt:
            raise InputError("interrupted (KeyboardInterrupt) before the run finished; no output was written") from None

    cli_main(wrapped)


@contextlib.contextmanager
def cpu_threads(device: torch.device, threads: int | None):
    """CPU device mode runs the 'device' on `threads` intra-op threads (the link is one more thread)."""
    old = torch.get_num_threads()
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def load_engine(model_dir: str | os.PathLike, device: str | None = None, dtype: str | torch.dtype = "fp32",
                host_store: str = "ram", pinned: bool = True, debug: bool = False) -> Engine:
    """Load a checkpoint and offload its experts (the commands' common start)."""
    dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    dev = resolve_device(device)
    return Engine(hfmodel.load(model_dir, dt), dev, host_store=host_store, pinned=pinned, debug=debug)


def parse_dtype(name: str, flag: str = "--dtype") -> torch.dtype:
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise InputError(f"{flag} = {name!r} must be one of fp32, bf16, fp16")
    return table[name]
