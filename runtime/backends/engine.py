"""The offloading engine: the policy kernel's plan drives real expert copies and computes.

Layout (docs/engine.md):
- non-expert weights on the device (`cuda`, or `cpu` in CPU device mode);
- every MoE layer's expert weights in a `HostStore`: one flat buffer per layer holding
  `gate_up [E, 2I, H]` and `down [E, H, I]` (with CUDA pinned in place with cudaHostRegister: no
  power-of-two rounding, no second copy), or memory-mapped safetensors (pageable: copies block);
- per MoE layer a pool of `C_l` device slots (`ExpertBuf`, one [2I, H] and one [H, I] tensor each).
  Slot `s` of layer `l` holds the expert the kernel's own table says (`cache.slot_expert[l, s]`): the
  engine keeps no copy of the kernel's slot table or admission queue;
- a shared pool of staging buffers for background admissions and the prefill stream.

The adapters (runtime/backends/adapters.py) route, rank and ask the kernel exactly as in the emulation, then
call `Engine.run_experts(layer, hidden, ids, weights, plan)` with the kernel's plan (`StepResult`).
The engine applies it, per token in the kernel's order (docs/engine.md "Per token and layer"):
admissions `admitted (t, e, s)` (wait for the copy, the staging buffer becomes slot `s`), pending
copies the kernel popped without admitting are released, prefetch loads `prefetched (t, e, s)`,
FETCH (host -> slot `slot[t, j]`), then the expert compute by kind (HIT/FETCH/SUB from `slot[t, j]`,
HOST on the host CPU overlapping the device, DROP nothing), then the admissions `queued (t, e)` start
copying into staging buffers in the background.

`Engine.teacher_forced` is the `engine` backend's runner (runtime/backends/__init__.py); `Engine.evaluate`
runs one policy on given windows (capacities, warm residency) and can return the per-token plan
[T, L, k] for the contract test.
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
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runtime.backends import adapters, hfmodel
from runtime.core.errors import InputError, cli_main
from runtime.core.kernel import DROP, FETCH, HOST, LOWBIT, PolicyCache, StepResult, warmup
from runtime.core.policy import PolicyConfig
from runtime.formats import costmodel

log = logging.getLogger(__name__)


STALL_MIN_S = 5e-6  # CUDA: a shorter wait between two timing events is their own spacing, not a stall


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
    """One expert's weights on the device (a slot's content or a staging buffer).

    CUDA: `ready` is recorded after the last copy into the buffer; `freed` points at the event after
    which the buffer's last reader (or writer) is done, that the next writer's stream waits on. The two
    events are the buffer's own, re-recorded (no new CUDA event per copy)."""

    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]
    ready: object = None
    done_reading: object = None
    freed: object = None


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


def page_aligned_empty(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A host tensor of `numel` elements that starts on a page boundary and owns every page it touches
    (2 spare pages allocated around it), and the page-rounded byte length to register: a registration
    never shares a page with another buffer (cudaHostRegister refuses a page registered twice)."""
    page = mmap.PAGESIZE
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
    off = (-raw.data_ptr()) % page
    return raw[off : off + nbytes].view(dtype), -(-nbytes // page) * page


def pin_in_place(t: torch.Tensor, nbytes: int, what: str) -> bool:
    """Page-lock `nbytes` of host memory from `t`'s first byte where it is (cudaHostRegister): no copy and
    no power-of-two rounding (only to whole pages). On failure (not enough lockable memory, ulimit -l, a
    driver that refuses) the CUDA error is cleared, a warning says what it costs, and False is returned:
    the caller keeps the memory pageable (copies then block the host) instead of stopping."""
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
        why = f"cudaHostRegister error {rc}"
    except (RuntimeError, AttributeError) as exc:
        rc, why = -1, str(exc).splitlines()[0][:160]
    if rc == 0:
        return True
    with contextlib.suppress(RuntimeError, AttributeError):
        torch.cuda.cudart().cudaGetLastError()  # clear it: the next CUDA call must not report it
    log.warning("could not pin %s (%.3g GiB of host memory: %s): it stays pageable, so its host->device copies "
                "block the host thread", what, nbytes / 2**30, why)
    return False


def _unpin(ptrs: list[int]) -> None:
    for p in ptrs:
        with contextlib.suppress(Exception):
            torch.cuda.cudart().cudaHostUnregister(p)


class HostStore:
    """Expert weights of every MoE layer on the host.

    `fused[l] = (gate_up [E, 2I, H], down [E, H, I])`: views of ONE flat buffer per layer (`flat[l]`),
    pinned in place with CUDA; or `parts[l][e] = (gate [I, H], up [I, H], down [H, I])` views of
    memory-mapped safetensors (pageable).
    """

    def __init__(self, dtype: torch.dtype, fused: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 parts: list[list[tuple[torch.Tensor, ...]]] | None = None, kind: str = "ram",
                 flat: list[torch.Tensor] | None = None, pinned: bool = False) -> None:
        self.dtype, self.fused, self.parts, self.kind = dtype, fused, parts, kind
        self.flat = flat or []
        self.pinned = pinned

    @classmethod
    def from_experts(cls, experts: list[nn.Module], dtype: torch.dtype, pin: bool, weights=None,
                     units: list[str] | None = None) -> HostStore:
        """Move every layer's fused expert tensors into one flat host buffer per layer, layer by layer,
        freeing the model's originals as it goes (peak: the experts once plus one layer). With `weights`
        (runtime/backends/stream.py: a model above --max-memory), each layer's experts unit is read from the
        shards just before its copy: the model's experts are never all in memory besides the store."""
        fused, flat, ptrs = [], [], []
        all_pinned = pin
        for l_, ex in enumerate(experts):
            if weights is not None:
                weights.load(units[l_])
                weights.loaded.discard(units[l_])  # its tensors now live in the store
            gu, d = ex.gate_up_proj.data, ex.down_proj.data
            if pin:
                buf, nbytes = page_aligned_empty(gu.numel() + d.numel(), dtype)
                if pin_in_place(buf, nbytes, f"the host expert store (MoE layer {l_})"):
                    ptrs.append(buf.data_ptr())
                else:
                    all_pinned = pin = False  # the rest stays pageable too (one warning)
            else:
                buf = torch.empty(gu.numel() + d.numel(), dtype=dtype)
            fgu, fd = buf[: gu.numel()].view(gu.shape), buf[gu.numel():].view(d.shape)
            fgu.copy_(gu)
            fd.copy_(d)
            ex.gate_up_proj = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
            ex.down_proj = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
            del gu, d
            fused.append((fgu, fd))
            flat.append(buf)
        store = cls(dtype, fused=fused, kind="ram", flat=flat, pinned=all_pinned)
        if ptrs:  # unregister before the buffers are freed
            weakref.finalize(store, _unpin, ptrs)
        return store

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

    def nbytes(self) -> int:
        if self.fused is not None:
            return sum(gu.numel() * gu.element_size() + d.numel() * d.element_size() for gu, d in self.fused)
        return sum(t.numel() * t.element_size() for row in self.parts for ex in row for t in ex)


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


def model_shape_of(m: hfmodel.Loaded, dtype: torch.dtype) -> costmodel.ModelShape:
    """The cost model's shape of a loaded checkpoint in the engine's dtype (the VRAM budget's input)."""
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if name is None:
        raise InputError(f"--dtype: the engine runs in fp32, bf16 or fp16, not {dtype}")
    return costmodel.model_shape_for(m.model.config.to_dict(), name, name=str(m.model_dir))


# ----------------------------------------------------------------------------- engine


@dataclass
class _Pending:
    due: int  # the token before which the kernel pops it (queued token + admission delay)
    buf: ExpertBuf
    handle: object  # CPU: Future of the copy; CUDA: the buffer's `ready` event


class Engine:
    """Runs a loaded checkpoint (runtime.backends.hfmodel.load) with its experts offloaded; see the module doc."""

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
        self.context_bytes = 0
        if self.cuda:  # what the process holds on the GPU outside PyTorch's allocator (the CUDA context)
            torch.cuda.init()
            free, total = torch.cuda.mem_get_info(self.device)
            self.context_bytes = int(total - free - torch.cuda.memory_reserved(self.device))
        w = m.weights if m.streamed else None
        if w is not None:  # above --max-memory: the non-expert part is read whole, the experts layer by layer
            w.load(*[u for u in w.units if not u.startswith("experts.")])
        # the decoder-layer index of each MoE layer's experts unit (streamed models only)
        units = [f"experts.{i}" for i in m.layer_ids] if w is not None else None
        if host_store == "ram":
            self.store = HostStore.from_experts(experts, self.dtype, pin=self.cuda and pinned, weights=w, units=units)
        elif host_store == "mmap":
            parts = _mmap_parts(m.model_dir, m.layer_ids, self.E)
            for l_, ex in enumerate(experts):  # the checkpoint's tensors must be the model's experts
                if w is not None:
                    w.load(units[l_])
                for e in {0, self.E - 1}:
                    g, u, d = parts[l_][e]
                    if not (torch.equal(torch.cat([g, u]).to(self.dtype), ex.gate_up_proj.data[e])
                            and torch.equal(d.to(self.dtype), ex.down_proj.data[e])):
                        raise InputError(f"--host-store mmap: {m.model_dir}: the safetensors experts of MoE layer {l_} "
                                         f"do not match the loaded model's (expert {e})")
                if w is not None:
                    w.release(units[l_])
            for ex in experts:
                ex.gate_up_proj = nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)
                ex.down_proj = nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)
            self.store = HostStore(self.dtype, parts=parts, kind="mmap")
        else:
            raise InputError(f"--host-store = {host_store!r} must be ram or mmap")
        # CUDA copies from pageable memory are staged synchronously: they block this thread (docs/engine.md)
        self.copies_block_host = self.cuda and not self.store.pinned
        if self.copies_block_host:
            log.warning("host store in pageable memory (%s): every host->device copy blocks the host thread, so "
                        "admissions and prefetches are not in the background", host_store)
        m.model.to(self.device)
        self.nonexpert_bytes = sum(t.numel() * t.element_size() for t in (*m.model.parameters(), *m.model.buffers()))
        if self.device.type != "cpu":
            m.model.register_forward_pre_hook(self._inputs_to_device, with_kwargs=True)
            m.model.register_forward_hook(self._logits_to_host)
        self.logits_to_host = True
        m.ctx.executor = self.run_experts
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)  # synchronous fetches, prefetches, prefill stream
            self.adm_stream = torch.cuda.Stream(self.device)  # background admissions
            self._link = None
        else:
            self._link = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertsweep-link")
        self.cache: PolicyCache | None = None
        self.slots: list[list[ExpertBuf]] | None = None
        self._free: list[ExpertBuf] = []
        self._pending: list[dict[int, _Pending]] = [{} for _ in range(self.L)]  # admissions in flight, by expert
        self._prefetch: list[dict[int, _Pending]] = [{} for _ in range(self.L)]  # lookahead copies in flight
        self._stall_events: list[tuple] = []
        self._lowbit: list[list[tuple]] | None = None  # [L][E] (gate_up, down) QWeight on the device
        self._lowbit_key: tuple[int, int] | None = None
        self.lowbit_bytes = 0
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
        self.shape: costmodel.ModelShape | None = None
        with contextlib.suppress(InputError):  # a family the cost model does not describe: no --vram-budget
            self.shape = model_shape_of(m, self.dtype)

    # ------------------------------------------------------------------ plumbing

    def _inputs_to_device(self, module, args, kwargs):
        kwargs = {k: (v.to(self.device) if isinstance(v, torch.Tensor) and k in ("input_ids", "attention_mask",
                                                                              "position_ids") else v)
                  for k, v in kwargs.items()}
        return tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args), kwargs

    def _logits_to_host(self, module, args, out):
        if self.logits_to_host and getattr(out, "logits", None) is not None:
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
        self.stats = {"fetch_copies": 0, "admission_copies": 0, "admissions_applied": 0,
                      "admissions_discarded": 0, "admission_stalls": 0, "admission_stall_s": 0.0, "host_computes": 0,
                      "device_computes": 0, "lowbit_computes": 0, "prefetch_copies": 0, "prefetch_applied": 0,
                      "prefetch_wasted": 0, "prefetch_sync_loads": 0, "prefetch_stalls": 0, "prefetch_stall_s": 0.0,
                      "prefill_copies": 0}
        self._stall_events = []

    def _event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def _new_buf(self) -> ExpertBuf:
        with torch.inference_mode(False):  # normal tensors: the link thread (not in inference mode) writes them
            buf = ExpertBuf(torch.empty(2 * self.I, self.H, dtype=self.dtype, device=self.device),
                            torch.empty(self.H, self.I, dtype=self.dtype, device=self.device))
        if self.cuda:
            buf.ready, buf.done_reading = self._event(), self._event()
            # the caching allocator may hand out memory that the compute stream freed a moment ago and
            # still reads: whoever writes the new buffer on another stream waits for the compute stream
            buf.done_reading.record(torch.cuda.current_stream(self.device))
            buf.freed = buf.done_reading
        self._dev_bytes += self.expert_bytes
        self._peak_bytes = max(self._peak_bytes, self._dev_bytes)
        return buf

    def take_staging(self) -> ExpertBuf:
        """A free staging buffer (allocated on demand; buffers are never returned to the allocator)."""
        if not self._free:
            self.n_staging += 1
            return self._new_buf()
        return self._free.pop()

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
            buf.ready.record(s)
        return buf.ready

    def _copy_on_link(self, layer: int, e: int, buf: ExpertBuf) -> None:
        with torch.no_grad():
            self.store.copy_into(layer, e, buf)

    def wait_copy(self, handle, timed: str | None = None) -> bool:
        """Make the compute wait for a copy; True if it had not finished when asked (a stall).

        CPU device mode: the main thread blocks on the link thread's future (timed with perf_counter).
        CUDA: the compute stream waits on the copy's event; with `timed` (a stats key), a late copy's wait
        is bracketed by two timing events on the compute stream, whose elapsed time (read after the run's
        final synchronize, `_collect_stalls`) is the time the device really stood still."""
        if not self.cuda:
            late = not handle.done()
            t0 = time.perf_counter()
            handle.result()
            if timed and late:
                self.stats[timed] += time.perf_counter() - t0
            return late
        late = not handle.query()
        cur = torch.cuda.current_stream(self.device)
        if timed and late:
            a, b = self._event(True), self._event(True)
            a.record(cur)
            cur.wait_event(handle)
            b.record(cur)
            self._stall_events.append((a, b, timed))
        else:
            cur.wait_event(handle)
        return late

    def _collect_stalls(self) -> None:
        """CUDA: add the device-side stalls measured since the last call (after a synchronize). A stall is
        counted from its measured time: a wait of at least STALL_MIN_S (the host saw the copy unfinished
        when it queued the wait, but the device may have got there after the copy landed)."""
        for a, b, key in self._stall_events:
            dt = a.elapsed_time(b) / 1e3
            self.stats[key] += dt
            if dt >= STALL_MIN_S:
                self.stats[key.replace("_stall_s", "_stalls")] += 1
        self._stall_events = []

    # ------------------------------------------------------------------ pools

    def capacities_for_budget(self, budget_gib: float, policies: list[PolicyConfig] | tuple = (),
                              flag: str = "--vram-budget") -> np.ndarray:
        """Slots per layer that fit a device memory budget (GiB): runtime.formats.costmodel.capacities_for_budget
        on this model's shape in the engine's dtype (the one meaning of a VRAM budget)."""
        if self.shape is None:
            raise InputError(f"{flag}: the cost model has no shape for model_type "
                             f"{self.m.model.config.model_type!r}; give --capacity or --capacity-fraction")
        return costmodel.capacities_for_budget(self.shape, budget_gib, list(policies), flag=flag)

    @torch.inference_mode()
    def bind(self, cache: PolicyCache) -> None:
        """Start a run under `cache`: slot pools sized by its capacities and loaded with its residency."""
        self.drain()
        warmup()  # the kernel is compiled (or loaded from numba's cache) before anything is timed
        pol = cache.policy
        if pol.fallback == "lowbit":
            self._build_lowbit(int(pol.lowbit_bits), int(pol.lowbit_group))
        elif self._lowbit is not None:  # another policy: the low-bit copies leave the device
            self._lowbit, self._lowbit_key = None, None
            self._dev_bytes -= self.lowbit_bytes
            self.lowbit_bytes = 0
        caps = [int(c) for c in cache.caps]
        if self.slots is None or [len(s) for s in self.slots] != caps:
            if self.slots is not None:
                self._dev_bytes -= sum(len(s) for s in self.slots) * self.expert_bytes
            self.slots = None
            self.slots = [[self._new_buf() for _ in range(c)] for c in caps]
        self.cache = cache
        for l_ in range(self.L):
            for s in range(caps[l_]):
                e = int(cache.slot_expert[l_, s])
                if e >= 0:
                    self.store.copy_into(l_, e, self.slots[l_][s])
        self.events = [[] for _ in range(self.L)]
        self._reset_stats()
        self.sync()
        if self.cuda:
            torch.cuda.empty_cache()  # what an earlier binding cached is not this run's peak
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak_bytes = self._dev_bytes

    def _build_lowbit(self, bits: int, group: int) -> None:
        """Packed low-bit copies (runtime/backends/lowbit.py: HQQ, groups along each matrix's input dimension) of every
        expert on the device, built once per (bits, group); quantized on the device from the host store."""
        if self._lowbit_key == (bits, group):
            return
        from runtime.backends import lowbit  # noqa: PLC0415 - hqq is only needed for this fallback

        if self._lowbit is not None:
            self._dev_bytes -= self.lowbit_bytes
        self._lowbit, self._lowbit_key, self.lowbit_bytes = None, None, 0
        copies, nbytes = [], 0
        for l_ in range(self.L):
            row = []
            for e in range(self.E):
                gu, d = self.store.weights(l_, e)
                q = (lowbit.quantize(gu.to(self.device), bits, group), lowbit.quantize(d.to(self.device), bits, group))
                nbytes += q[0].nbytes + q[1].nbytes
                row.append(q)
            copies.append(row)
        self._lowbit, self._lowbit_key, self.lowbit_bytes = copies, (bits, group), nbytes
        self._dev_bytes += nbytes
        self._peak_bytes = max(self._peak_bytes, self._dev_bytes)
        log.info("low-bit copies (%d bits, group %d) of %d experts: %.3g MiB on %s", bits, group, self.L * self.E,
                 nbytes / 2**20, self.device)

    def lowbit_expert(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e from its packed low-bit copy: dequantize on the device, then compute; x [n, H] -> [n, H]."""
        qgu, qd = self._lowbit[layer][e]
        return expert_forward(x, qgu.dequantize(self.dtype), qd.dequantize(self.dtype), self.act[layer])

    def drain(self) -> None:
        """Wait for and drop every admission and prefetch copy still in flight (end of a run)."""
        for q in (*self._pending, *self._prefetch):
            for p in q.values():
                self.wait_copy(p.handle)
                self.give_staging(p.buf)
            q.clear()
        self.sync()
        if self.cuda:
            self._collect_stalls()

    def peak_device_bytes(self) -> int:
        """CUDA: the CUDA context (measured at start) + torch.cuda.max_memory_reserved since bind (everything
        the caching allocator held, cuBLAS workspace included); CPU device mode: non-expert weights + slots
        + staging buffers (the device-side tensors the engine holds; activations and KV not counted)."""
        if self.cuda:
            return int(self._measure_context() + torch.cuda.max_memory_reserved(self.device))
        return int(self._peak_bytes)

    def _measure_context(self) -> int:
        """CUDA: device memory in use outside PyTorch's caching allocator (the CUDA context, with the kernels
        loaded lazily so far), the largest seen: used (cudaMemGetInfo) minus what PyTorch reserved."""
        free, total = torch.cuda.mem_get_info(self.device)
        self.context_bytes = max(self.context_bytes, int(total - free - torch.cuda.memory_reserved(self.device)))
        return self.context_bytes

    def resident_slot(self, layer: int, e: int) -> int:
        """The kernel's slot of expert e (its own table), -1 when not resident or nothing is bound."""
        if self.slots is None or self.cache is None:
            return -1
        return int(self.cache.expert_slot[layer, e])

    # ------------------------------------------------------------------ the adapters' hook

    def run_experts(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, plan) -> torch.Tensor:
        """Experts' output for tokens x [N, H]: exact streaming (plan None) or the kernel's plan."""
        if plan is None:
            return stream_layer(self, layer, x, ids, w)
        return self._apply_plan(layer, x, w, plan)

    def fetch(self, layer: int, e: int, s: int, prefetch_load: bool = False) -> None:
        """Copy host -> slot s on the copy stream; the compute waits for it (CPU device mode: a plain copy)."""
        buf = self.slots[layer][s]
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            self.copy_stream.wait_stream(cur)  # the evicted expert's last readers are done
            with torch.cuda.stream(self.copy_stream):
                self.store.copy_into(layer, e, buf, non_blocking=True)
                buf.ready.record(self.copy_stream)
            cur.wait_event(buf.ready)
        else:
            self.store.copy_into(layer, e, buf)
        self.stats["prefetch_sync_loads" if prefetch_load else "fetch_copies"] += 1

    def host_expert(self, layer: int, e: int, x_host: torch.Tensor) -> torch.Tensor:
        """Expert e on the host CPU from the host store: x_host [n, H] on the host -> [n, H] on the host."""
        gu, d = self.store.weights(layer, e)
        return expert_forward(x_host, gu, d, self.act[layer])

    def result_to_device(self, y: torch.Tensor) -> torch.Tensor:
        """A host result back to the device: a non-blocking copy from pinned memory (CPU device mode: as is)."""
        if not self.cuda:
            return y
        return y.pin_memory().to(self.device, non_blocking=True)  # the caching host allocator keeps it alive

    def _admit(self, layer: int, e: int, s: int) -> None:
        p = self._pending[layer].pop(e, None)
        if p is None:
            raise RuntimeError(f"engine: MoE layer {layer}: the kernel admitted expert {e}, whose copy the engine "
                               "never started (its plan's queued rows were not applied)")
        if self.wait_copy(p.handle, timed="admission_stall_s") and not self.cuda:  # CUDA: counted from the measured wait
            self.stats["admission_stalls"] += 1
        old = self.slots[layer][s]
        self.slots[layer][s] = p.buf
        self.give_staging(old)
        self.stats["admissions_applied"] += 1

    def _release_popped(self, layer: int, t: int) -> None:
        """Copies due before token t that the kernel did not admit (it skips an expert that became resident
        meanwhile): their staging buffers go back to the pool once the copy is done."""
        q = self._pending[layer]
        for e in [e for e, p in q.items() if p.due <= t]:
            p = q.pop(e)
            self.give_staging(p.buf, after=p.handle)
            self.stats["admissions_discarded"] += 1

    def _load_prefetched(self, layer: int, e: int, s: int) -> None:
        """The kernel loaded expert e into slot s ahead of this token (prefetch): the copy started one layer
        earlier becomes the slot's buffer (waiting for it, a stall if late); without one (oracle prefetch,
        known only now, or an expert evicted by this token's admissions after the copies were issued) it
        is copied now, as a fetch."""
        p = self._prefetch[layer].pop(e, None)
        if p is None:
            self.fetch(layer, e, s, prefetch_load=True)
            return
        if self.wait_copy(p.handle, timed="prefetch_stall_s") and not self.cuda:  # CUDA: counted from the measured wait
            self.stats["prefetch_stalls"] += 1
        old = self.slots[layer][s]
        self.slots[layer][s] = p.buf
        self.give_staging(old)
        self.stats["prefetch_applied"] += 1

    def _issue_prefetch(self, layer: int, t: int) -> None:
        """Lookahead prefetch: once this layer's routing is known, the next layer's predicted list is
        (runtime/backends/adapters.py, `Context.pending`); copies of its experts that are not resident there start
        now on the copy stream (behind this layer's fetches), into staging buffers. The next layer's plan
        says which of them the kernel loads, and into which slots."""
        nxt = layer + 1
        pend = getattr(self.m.ctx, "pending", None)
        q = pend[nxt] if pend is not None and nxt < self.L else None
        pred = q[-1] if q else None  # the list this step just formed for the next layer
        if pred is None or len(pred) != 1:
            return
        q = self._prefetch[nxt]
        for e in pred[0][: self.cache.prefetch_width].tolist():
            if e < 0:
                break
            if self.cache.expert_slot[nxt, e] >= 0 or e in q:
                continue
            buf = self.take_staging()
            q[e] = _Pending(t, buf, self.copy_async(nxt, e, buf, "copy"))
            self.stats["prefetch_copies"] += 1

    def _release_prefetch(self, layer: int) -> None:
        """Early copies the kernel did not load (an admission made the expert resident first, or no victim)."""
        q = self._prefetch[layer]
        for p in q.values():
            self.give_staging(p.buf, after=p.handle)
            self.stats["prefetch_wasted"] += 1
        q.clear()

    def _apply_plan(self, layer: int, x: torch.Tensor, w: torch.Tensor, plan: StepResult) -> torch.Tensor:
        kind, served, slot = plan.kind, plan.served, plan.slot
        N, k = kind.shape
        t0 = int(self.cache.next_t[layer]) - N
        out = torch.zeros_like(x)  # [N, H]
        act = self.act[layer]
        pol = self.cache.policy
        adm, queued, d = plan.admitted, plan.queued, pol.admission_delay
        pref = getattr(plan, "prefetched", None)
        pref = np.zeros((0, 3), np.int64) if pref is None else pref
        lookahead = pol.prefetch == "lookahead" and N == 1
        ai = qi = pi = 0
        for i in range(N):
            t = t0 + i
            hosts = [j for j in range(k) if kind[i, j] == HOST] if not self.null_compute else []
            # (0) the activation of a host-computed token goes to the host first: nothing but this layer's
            # dense part (already finished: its routing was read) is queued ahead of it on the stream
            xh = x[i : i + 1].to("cpu") if hosts else None
            # (1) admissions the kernel applied before token t, then the copies it popped and skipped
            while ai < len(adm) and adm[ai, 0] == t:
                self._admit(layer, int(adm[ai, 1]), int(adm[ai, 2]))
                ai += 1
            self._release_popped(layer, t)
            # (2) prefetch loads the kernel made for this token, (3) synchronous fetches in rank order
            while pi < len(pref) and pref[pi, 0] == t:
                self._load_prefetched(layer, int(pref[pi, 1]), int(pref[pi, 2]))
                pi += 1
            self._release_prefetch(layer)
            for j in range(k):
                if kind[i, j] == FETCH:
                    self.fetch(layer, int(served[i, j]), int(slot[i, j]))
            # (3b) the next layer's lookahead copies start behind this layer's fetches
            if lookahead:
                self._issue_prefetch(layer, t)
            # (4) device compute, queued without waiting, in ascending expert id (the HF accumulation order):
            # full precision from a slot, LOWBIT from the expert's packed low-bit copy
            xi = x[i : i + 1]
            if not self.null_compute:
                for j in np.argsort(served[i], kind="stable"):
                    kd = kind[i, j]
                    if kd == DROP or kd == HOST:
                        continue
                    if kd == LOWBIT:
                        out[i] += (self.lowbit_expert(layer, int(served[i, j]), xi) * w[i, j])[0]
                        self.stats["lowbit_computes"] += 1
                        continue
                    buf = self.slots[layer][slot[i, j]]
                    out[i] += (expert_forward(xi, buf.gate_up, buf.down, act) * w[i, j])[0]
                    self.stats["device_computes"] += 1
            # (5) host compute runs on the CPU while the device works through (4); results go back async
            for j in sorted(hosts, key=lambda j: served[i, j]):
                y = self.host_expert(layer, int(served[i, j]), xh)
                out[i] += (self.result_to_device(y) * w[i, j])[0]
                self.stats["host_computes"] += 1
            # (6) the admissions queued at this token start copying in the background
            while qi < len(queued) and queued[qi, 0] == t:
                e = int(queued[qi, 1])
                buf = self.take_staging()
                self._pending[layer][e] = _Pending(t + d, buf, self.copy_async(layer, e, buf, "adm"))
                self.stats["admission_copies"] += 1
                qi += 1
        if ai != len(adm) or pi != len(pref) or qi != len(queued):
            raise RuntimeError(f"engine: MoE layer {layer}: plan rows outside tokens {t0}..{t0 + N - 1}")
        self.events[layer].append(plan.events)
        if self.debug:
            self.check_slots(layer)
        return out

    def check_slots(self, layer: int) -> None:
        """Debug: every slot holds the weights of the expert the kernel's table puts there."""
        self.sync()
        for s in range(int(self.cache.caps[layer])):
            e = int(self.cache.slot_expert[layer, s])
            if e >= 0:
                gu, d = self.store.weights(layer, e)
                buf = self.slots[layer][s]
                if not (torch.equal(buf.gate_up.cpu(), gu) and torch.equal(buf.down.cpu(), d)):
                    raise AssertionError(f"engine slot {s} of MoE layer {layer} does not hold expert {e}'s weights")

    def trace_events(self) -> np.ndarray:
        """Kernel events of the run since bind, int32 [T, L, N_EV] (the cost model's input)."""
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
        run's measurements. The runner of the engine backend (runtime.backends.emulate.evaluate_group)."""
        if m is not self.m:
            raise ValueError("teacher_forced: the Loaded model is not this engine's")
        self.bind(cache)
        n, W = windows.shape
        nll = np.empty((n, W - 1), np.float64)
        self.logits = []
        decode_s = 0.0
        m.ctx.cache = cache
        self.logits_to_host = False  # logits stay on the device until the window ends: no per-token sync
        try:
            for a in range(n):
                x = torch.from_numpy(windows[a : a + 1])
                xd = x.to(self.device)
                rows, past = [], None
                self.sync()
                t0 = self.clock()
                for t in range(W):
                    out, past = forward_cached(m.model, xd[:, t : t + 1], past)
                    rows.append(out.logits[0, -1])
                self.sync()
                decode_s += self.clock() - t0
                lg = torch.stack(rows).float()  # [W, V]
                lp = torch.log_softmax(lg[:-1], dim=-1)
                nll[a] = (-torch.gather(lp, 1, xd[0, 1:, None])[:, 0]).double().cpu().numpy()
                if keep_logits:
                    self.logits.append(lg.cpu())
        finally:
            self.logits_to_host = True
            m.ctx.cache = None
            self.drain()
        return nll, self.run_report(decode_s, n * W)

    def evaluate(self, windows: np.ndarray, policy: PolicyConfig, capacities, initial_residency=None, *,
                 record_decisions: bool = False, substitute_weight: str = "missed") -> dict:
        """One policy on `windows` [n, W] from `initial_residency` (per-layer expert ids) with `capacities`
        slots per layer. Returns nll [n, W-1], counters / per_layer (the kernel's), events [T, L, N_EV],
        the measured report, and with `record_decisions` the plan per token: decisions = {kind, served,
        slot} int [T, L, k] (tokens in stream order)."""
        m = self.m
        caps = np.broadcast_to(np.asarray(capacities, np.int64), (self.L,)).copy()
        cache = PolicyCache(policy, self.E, self.k, caps, initial_residency)
        m.ctx.substitute_weight = substitute_weight
        m.ctx.decisions = [[] for _ in range(self.L)] if record_decisions else None
        try:
            nll, rep = self.teacher_forced(m, windows, cache)
            decisions = m.ctx.decision_arrays() if record_decisions else None
        finally:
            m.ctx.decisions = None
            m.ctx.substitute_weight = "missed"
        return {"nll": nll, "counters": cache.counter_totals(), "per_layer": cache.per_layer(),
                "events": self.trace_events(), "decisions": decisions, "capacity": caps.tolist(), **rep}

    def run_report(self, decode_s: float, tokens: int) -> dict:
        """The measured keys a run adds to the emulation's result."""
        return {"time_per_token_s": decode_s / max(tokens, 1), "peak_device_bytes": self.peak_device_bytes(),
                "engine": {"decode_seconds": decode_s, "decoded_tokens": tokens, **self.report()}}

    def report(self) -> dict:
        """Where things live and what the run since bind copied, computed and waited for."""
        rep = {"device": str(self.device), "host_store": self.store.kind, "pinned": self.store.pinned,
               "copies_block_host": self.copies_block_host, "host_store_bytes": int(self.store.nbytes()),
               "nonexpert_bytes": int(self.nonexpert_bytes), "expert_bytes": int(self.expert_bytes),
               "slot_bytes": int(sum(len(s) for s in self.slots or []) * self.expert_bytes),
               "staging_buffers": self.n_staging, **self.stats}
        if self.cuda:
            rep.update({"cuda_context_bytes": self._measure_context(),
                        "max_memory_allocated": int(torch.cuda.max_memory_allocated(self.device)),
                        "max_memory_reserved": int(torch.cuda.max_memory_reserved(self.device))})
        return rep


def stream_layer(eng: Engine, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact experts' output for x [N, H], selection ids [N, k] and gate weights w [N, k] -> [N, H]: the
    engine's exact mode (prefill, the exact reference). Resident experts read their slots; the others
    stream host -> device through two staging buffers, the copy of the next expert overlapping the
    compute of the current one. Tokens accumulate in the Hugging Face eager order (ascending expert
    id, then rank-major token order), so the result equals the model's.

    One device -> host read of the selection per call (which experts, which tokens); the token lists
    go back to the device in one pinned, asynchronous copy; no other synchronisation."""
    out = torch.zeros_like(x)
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
    if eng.cuda:
        idx = idx.pin_memory().to(eng.device, non_blocking=True)
    M = bounds[-1]
    toks, poss = idx[:M], idx[M:]
    slots = {e: eng.resident_slot(layer, e) for e in experts}
    stream = [e for e in experts if slots[e] < 0]
    bufs = [eng.take_staging() for _ in range(min(2, len(stream)))]
    handles: list = [None, None]

    def issue(n: int) -> None:
        handles[n % 2] = eng.copy_async(layer, stream[n], bufs[n % 2], stream="copy")
        eng.stats["prefill_copies"] += 1

    if stream:
        issue(0)
    n = 0
    act = eng.act[layer]
    for a, e in enumerate(experts):
        if slots[e] >= 0:
            buf = eng.slots[layer][slots[e]]
        else:
            eng.wait_copy(handles[n % 2])
            buf = bufs[n % 2]
            if n + 1 < len(stream):
                issue(n + 1)  # into the other buffer, whose last reader (expert n-1) was marked below
        tok, pos = toks[bounds[a] : bounds[a + 1]], poss[bounds[a] : bounds[a + 1]]
        y = expert_forward(x[tok], buf.gate_up, buf.down, act) * w[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
        if slots[e] < 0:
            eng.mark_read(buf)  # the next copy into this buffer waits for this compute
            n += 1
    for b in bufs:
        eng.give_staging(b)
    return out



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


def load_engine(model_dir: str | os.PathLike, device: str | None = None, dtype: str | torch.dtype = "auto",
                host_store: str = "ram", pinned: bool = True, debug: bool = False,
                max_memory: float | str = "auto") -> Engine:
    """Load a checkpoint and offload its experts (the commands' common start). Above `max_memory` the
    experts go from the shards into the host store one layer at a time (never the model twice)."""
    dev = resolve_device(device)
    return Engine(hfmodel.load(model_dir, dtype, max_memory), dev, host_store=host_store, pinned=pinned, debug=debug)
