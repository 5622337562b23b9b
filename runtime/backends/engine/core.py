"""The offloading engine: the policy kernel's plan drives real expert copies and computes.

`Engine` binds the parts, one module each (docs/engine.md):
- the host store (runtime/backends/engine/store.py): every MoE layer's expert weights on the host, one flat
  buffer per layer holding `gate_up [E, 2I, H]` and `down [E, H, I]` (CUDA: pinned in place), or the
  checkpoint's memory-mapped safetensors (pageable: copies block);
- the slot pool (runtime/backends/engine/slots.py): per MoE layer `C_l` device slots, one tensor pair
  `[C_l, 2I, H]` / `[C_l, H, I]` (a slot is a row), slot `s` of layer `l` holding the expert the kernel's own table says (`cache.slot_expert[l, s]`: the engine keeps no copy
  of the kernel's slot table or admission queue), a shared pool of staging buffers, the device ledger;
  llama.cpp's expert cache (`SharedPoolCache`): one `[S, ...]` pair that every layer names, addressed by the
  pool's slot ids; its layer split (`LayerSplitCache`): E slots per device layer, none on the host layers;
- the copies (runtime/backends/engine/copies.py): the CUDA copy streams (CPU device mode: a link thread), waits
  and stalls, the admission and prefetch copies in flight;
- applying the kernel's plan (runtime/backends/engine/plan.py): per token in the kernel's order, admissions,
  prefetch loads, fetches, the compute by kind (device, host, low-bit), then the queued admissions'
  copies; with no plan, the exact streamed path `stream_layer` (prefill, the exact reference).
The non-expert weights live on the device (`cuda`, or `cpu` in CPU device mode).

`Engine.teacher_forced` is the `engine` backend's runner (runtime/backends/__init__.py); `Engine.evaluate`
runs one policy on given windows (capacities, warm residency) and can return the per-token plan
[T, L, k] for the contract test; `Engine.decode_step` decodes one token (runtime/tools/generate.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runtime.backends import adapters, hfmodel
from runtime.backends.engine import graphs
from runtime.backends.engine.copies import Copies
from runtime.backends.engine.graphs import kv_cache_kwarg
from runtime.backends.engine.plan import PlanRunner, expert_forward, stream_layer
from runtime.backends.engine.slots import SlotPool
from runtime.backends.engine.store import build_host_store, page_aligned_empty
from runtime.core.errors import InputError, cli_main
from runtime.core.kernel import PolicyCache, decide, warmup
from runtime.core.llamacpp_cache import LayerSplitCache, SharedPoolCache, cache_for
from runtime.core.policy import PolicyConfig
from runtime.formats import costmodel

# what callers imported from here before the split (expert_forward, stream_layer: plan.py;
# page_aligned_empty: store.py) stays importable from here
__all__ = ["Engine", "cpu_threads", "cuda_context_bytes", "device_errors", "engine_cli", "expert_forward",
           "forward_cached", "kv_cache_kwarg", "load_cublas", "load_engine", "model_shape_of", "page_aligned_empty",
           "resolve_device", "stream_layer"]

log = logging.getLogger(__name__)


def resolve_device(device: str | None, flag: str = "--device") -> torch.device:
    """'cuda' | 'cpu' | None (cuda when available, else CPU device mode)."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise InputError(f"{flag} = {device!r} must be cpu or cuda")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"{flag} = {device}: no CUDA device is available (torch.cuda.is_available() is False)")
    return torch.device(device)


def model_shape_of(m: hfmodel.Loaded, dtype: torch.dtype) -> costmodel.ModelShape:
    """The cost model's shape of a loaded checkpoint in the engine's dtype (the VRAM budget's input)."""
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if name is None:
        raise InputError(f"--dtype: the engine runs in fp32, bf16 or fp16, not {dtype}")
    return costmodel.model_shape_for(m.model.config.to_dict(), name, name=str(m.model_dir))


class Engine:
    """Runs a loaded checkpoint (runtime.backends.hfmodel.load) with its experts offloaded; see the module doc.

    Parts: `store` (HostStore), `pool` (SlotPool), `copies` (Copies), `runner` (PlanRunner: the adapters'
    executor hook); `stats`, the run's copy / compute / stall counters, is shared by them."""

    def __init__(self, m: hfmodel.Loaded, device: str | torch.device | None = None, host_store: str = "ram",
                 pinned: bool = True, debug: bool = False, no_cuda_graphs: bool = False) -> None:
        self.m = m
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.cuda = self.device.type == "cuda"
        self.debug = debug
        self.no_cuda_graphs = no_cuda_graphs
        # None: teacher-forced decoding runs as segments around each MoE layer's decision (graphs.py), captured
        # as CUDA graphs on CUDA unless no_cuda_graphs; else why the Hugging Face forward decodes instead
        self.no_segments_why = graphs.capture_plan(m.model)
        self.decode_path = ""  # what the last teacher-forced run used (the report's `decode_path`)
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
        self.context_bytes = 0  # CUDA: measured at the end of __init__, after cuBLAS and the model's kernels loaded
        if self.cuda:
            torch.cuda.init()
        w = m.weights if m.streamed else None
        if w is not None:  # above --max-memory: the non-expert part is read whole, the experts layer by layer
            w.load(*[u for u in w.units if not u.startswith("experts.")])
        # the decoder-layer index of each MoE layer's experts unit (streamed models only)
        units = [f"experts.{i}" for i in m.layer_ids] if w is not None else None
        self.store = build_host_store(host_store, experts, self.dtype, pin=self.cuda and pinned,
                                      model_dir=m.model_dir, layer_ids=m.layer_ids, weights=w, units=units)
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
        self.stats: dict = {}
        self.pool = SlotPool(self.store, self.device, self.H, self.I, self.expert_bytes, self.nonexpert_bytes)
        self.copies = Copies(self.store, self.device, self.L, self.stats)
        self.runner = PlanRunner(self.store, self.pool, self.copies, self.act, self.E, self.stats, m.ctx, debug)
        m.ctx.executor = self.runner.run_experts
        self._reset_stats()
        # timer of decode and calibration: wall clock; time.thread_time (the main thread's CPU time, CPU
        # device mode only) leaves out the time a shared host's other processes hold the core
        self.clock = time.perf_counter
        self.logits: list[torch.Tensor] = []
        self.shape: costmodel.ModelShape | None = None
        with contextlib.suppress(InputError):  # a family the cost model does not describe: no --vram-budget
            self.shape = model_shape_of(m, self.dtype)
        if self.cuda:  # what the process holds on the GPU outside PyTorch's allocator, once it has run once
            self.context_bytes = cuda_context_bytes(self.device, self.warm_up)

    @torch.inference_mode()
    def warm_up(self, tokens: int = 2) -> None:
        """Load what the first decode would load into the CUDA context (cuBLAS and cuBLASLt, the attention and
        the model's other kernels, loaded lazily): `tokens` tokens through the exact path, no policy bound."""
        load_cublas(self.device, self.dtype)
        ids = torch.zeros(1, tokens, dtype=torch.long)
        saved, self.m.ctx.cache = self.m.ctx.cache, None
        try:
            forward_cached(self.m.model, ids.to(self.device))
        finally:
            self.m.ctx.cache = saved
            self.sync()
            self.stats["prefill_copies"] = 0

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
        self.copies.close()

    def _reset_stats(self) -> None:
        """The counters start again (the dict the parts share, refilled in place)."""
        self.stats.clear()
        self.stats.update({"fetch_copies": 0, "admission_copies": 0, "admissions_applied": 0,
                           "admissions_discarded": 0, "admission_stalls": 0, "admission_stall_s": 0.0,
                           "host_computes": 0, "device_computes": 0, "lowbit_computes": 0, "prefetch_copies": 0,
                           "prefetch_applied": 0, "prefetch_wasted": 0, "prefetch_sync_loads": 0,
                           "prefetch_stalls": 0, "prefetch_stall_s": 0.0, "prefill_copies": 0})
        self.copies.stall_events = []

    @property
    def lowbit_bytes(self) -> int:
        """Device bytes of the low-bit expert copies (fallback lowbit), 0 when none are built."""
        return self.runner.lowbit_bytes

    # ------------------------------------------------------------------ binding a run

    @property
    def budget_context_bytes(self) -> int:
        """The CUDA context a VRAM budget charges: on CUDA the one measured (after cuBLAS loaded, the largest
        seen so far); in CPU device mode, which models a GPU's budget on the host, the cost model's
        CUDA_CONTEXT_BYTES."""
        return int(self.context_bytes) if self.cuda else costmodel.CUDA_CONTEXT_BYTES

    def _budget_shape(self, flag: str) -> costmodel.ModelShape:
        if self.shape is None:
            raise InputError(f"{flag}: the cost model has no shape for model_type "
                             f"{self.m.model.config.model_type!r}; give --capacity or --capacity-fraction")
        return self.shape

    def capacities_for_budget(self, budget_gib: float, policies: list[PolicyConfig] | tuple = (),
                              flag: str = "--vram-budget") -> np.ndarray:
        """Slots per layer that fit a device memory budget (GiB): runtime.formats.costmodel.capacities_for_budget
        on this model's shape in the engine's dtype (the one meaning of a VRAM budget), with the CUDA context
        `budget_context_bytes` (on CUDA: measured)."""
        return costmodel.capacities_for_budget(self._budget_shape(flag), budget_gib, list(policies),
                                               context_bytes=self.budget_context_bytes, flag=flag)

    def budget_for_capacities(self, capacities, policies: list[PolicyConfig] | tuple = (),
                              flag: str = "--vram-budget") -> float:
        """The smallest budget (GiB) that holds `capacities` slots per layer under `policies`, counted as
        `capacities_for_budget` counts it (the same CUDA context)."""
        return costmodel.budget_for_capacities(self._budget_shape(flag), capacities, list(policies),
                                               context_bytes=self.budget_context_bytes)

    @torch.inference_mode()
    def bind(self, cache: PolicyCache | SharedPoolCache | LayerSplitCache) -> None:
        """Start a run under `cache`: slot pools sized by its capacities and loaded with its residency (llama.cpp's
        shared pool: one slot array for every layer; its layer split: E slots per device layer, none on the
        host layers; docs/engine.md)."""
        self.drain()
        warmup()  # the kernel is compiled (or loaded from numba's cache) before anything is timed
        decide.compiled()  # and the engine's one-call host decision (runtime/core/kernel/decide.py)
        self.runner.bind_lowbit(cache.policy)
        self.pool.bind(cache)
        self.runner.reset()
        self._reset_stats()
        self.sync()
        if self.cuda:
            torch.cuda.empty_cache()  # what an earlier binding cached is not this run's peak
            torch.cuda.reset_peak_memory_stats(self.device)
        self.pool.reset_peak()

    def drain(self) -> None:
        """Wait for and drop every admission and prefetch copy still in flight (end of a run)."""
        self.copies.drain(self.pool)

    def peak_device_bytes(self) -> int:
        """CUDA: the CUDA context (measured after the warm-up, the largest seen) + torch.cuda.max_memory_reserved since bind (everything
        the caching allocator held, cuBLAS workspace included); CPU device mode: non-expert weights + slots
        + staging buffers (the device-side tensors the engine holds; activations and KV not counted)."""
        if self.cuda:
            return int(self._measure_context() + torch.cuda.max_memory_reserved(self.device))
        return int(self.pool.peak_bytes)

    def _measure_context(self) -> int:
        """CUDA: device memory in use outside PyTorch's caching allocator (the CUDA context, with the kernels
        loaded lazily so far), the largest seen: used (cudaMemGetInfo) minus what PyTorch reserved."""
        self.context_bytes = max(self.context_bytes, cuda_context_bytes(self.device))
        return self.context_bytes

    def trace_events(self) -> np.ndarray:
        """Kernel events of the run since bind, int32 [T, L, N_EV] (the cost model's input)."""
        return self.runner.events_array()

    # ------------------------------------------------------------------ decoding

    @torch.inference_mode()
    def decode_step(self, token: torch.Tensor, past=None):
        """One token [1, 1] through the model with a KV cache: (logits [V] on the host, new cache)."""
        out, past = forward_cached(self.m.model, token, past)
        return out.logits[0, -1], past

    @torch.inference_mode()
    def teacher_forced(self, m: hfmodel.Loaded, windows: np.ndarray, cache: PolicyCache,
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
        prog = None
        try:
            why = self.no_segments_why
            if why is None and self.runner.null_compute:  # a captured segment cannot leave its expert math out
                why = "expert math off (calibration's isolated dense part)"
            if why is None and m.ctx.substitute_weight != "missed":  # the adapters' own-weight path
                why = f"substitute_weight {m.ctx.substitute_weight!r}"
            if why is None:  # built (and on CUDA captured) once per run: it reads this binding's slots
                prog = graphs.StepProgram(m.model, m.ctx, self.runner, W, capture=self.cuda and not self.no_cuda_graphs)
            self.decode_path = self._path_name(prog, why)
            for a in range(n):
                x = torch.from_numpy(windows[a : a + 1])
                xd = x.to(self.device)
                rows, past = [], None
                if prog is not None:
                    prog.begin()
                self.sync()
                t0 = self.clock()
                for t in range(W):
                    if prog is not None:
                        rows.append(prog.step(xd[:, t : t + 1], t)[0].clone())
                    else:
                        out, past = forward_cached(m.model, xd[:, t : t + 1], past)
                        rows.append(out.logits[0, -1])
                self.sync()
                decode_s += self.clock() - t0
                lg = torch.stack(rows).float()  # [W, V]
                lp = torch.log_softmax(lg[:-1], dim=-1)
                nll[a] = (-torch.gather(lp, 1, xd[0, 1:, None])[:, 0]).cpu().numpy()  # float32 -> float64: exact
                if keep_logits:
                    self.logits.append(lg.cpu())
        finally:
            self.logits_to_host = True
            m.ctx.cache = m.ctx.step = None
            self.drain()
        return nll, self.run_report(decode_s, n * W)

    @staticmethod
    def _path_name(prog: graphs.StepProgram | None, why: str | None) -> str:
        """How teacher-forced decoding ran: `cuda_graphs` (segments captured), `segments` (the same segments
        eagerly: CPU device mode, or no_cuda_graphs), `segments: cuda graphs refused: why` (a family whose
        cache or RoPE branches on values), `segments: capture failed: why`, or `hf_forward: why` (no capture
        plan; calibration's run with the expert math off)."""
        if prog is None:
            return f"hf_forward: {why}"
        if prog.refused:
            return f"segments: cuda graphs refused: {prog.refused}"
        if prog.capture_error:
            return f"segments: capture failed: {prog.capture_error}"
        return "cuda_graphs" if prog.graphs else "segments"

    def evaluate(self, windows: np.ndarray, policy, capacities=None, initial_residency=None, *,
                 record_decisions: bool = False, substitute_weight: str = "missed") -> dict:
        """One policy on `windows` [n, W]: a resolved run (runtime.backends.resolve.Run: its policy, slots per
        layer and warm start), or a PolicyConfig with `capacities` (C for every layer or C_l per layer,
        k <= C_l < E: the RunSpec meaning) and `initial_residency` (per-layer expert ids; None: cold).
        Returns nll [n, W-1], counters / per_layer (the kernel's), events [T, L, N_EV], the measured
        report, and with `record_decisions` the plan per token: decisions = {kind, served, slot} int
        [T, L, k] (tokens in stream order)."""
        from runtime.backends.resolve import Run
        from runtime.core.policy import resolve_capacities

        m = self.m
        if isinstance(policy, Run):
            if capacities is not None or initial_residency is not None:
                raise InputError("Engine.evaluate: a resolved Run carries its capacities and initial residency")
            policy, caps, initial_residency = policy.policy, policy.capacities, policy.initial_residency
        else:
            caps = resolve_capacities(capacities, self.L, self.E, self.k)
        cache = cache_for(policy, self.E, self.k, caps, initial_residency,
                          weight_norm=adapters.weight_norm_of(m.model.config))
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
        rep = {"device": str(self.device), "decode_path": self.decode_path, "host_store": self.store.kind,
               "pinned": self.store.pinned,
               "copies_block_host": self.copies_block_host, "host_store_bytes": int(self.store.nbytes()),
               "nonexpert_bytes": int(self.nonexpert_bytes), "expert_bytes": int(self.expert_bytes),
               "slot_bytes": int(self.pool.slot_bytes()), "slot_layout": self.pool.layout[0] if self.pool.layout else "",
               "staging_buffers": self.pool.n_staging,
               "staging_bytes": int(self.pool.staging_bytes()), "lowbit_bytes": int(self.lowbit_bytes),
               "copy_buffers_high_water": self.pool.high_water, **self.stats}
        if self.cuda:
            rep.update({"cuda_context_bytes": self._measure_context(),
                        "max_memory_allocated": int(torch.cuda.max_memory_allocated(self.device)),
                        "max_memory_reserved": int(torch.cuda.max_memory_reserved(self.device))})
        return rep


def load_cublas(device: torch.device, dtype: torch.dtype) -> None:
    """One matrix product without and one with a bias in `dtype` on the device: cuBLAS and cuBLASLt create their
    handles and load their kernels into the CUDA context (their workspaces come from PyTorch's allocator)."""
    a = torch.ones(8, 8, dtype=dtype, device=device)
    F.linear(a, a)
    F.linear(a, a, a[0])


def cuda_context_bytes(device: torch.device, warm=None) -> int:
    """Device memory in use outside PyTorch's caching allocator (the CUDA context): used (cudaMemGetInfo) minus
    what PyTorch reserved, after `warm()` (the work that loads kernels lazily) and a synchronize. The context
    grows as cuBLAS and kernels load: measured before them it undercounts what the run's peak includes."""
    if warm is not None:
        warm()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free - torch.cuda.memory_reserved(device))


def forward_cached(model: nn.Module, input_ids: torch.Tensor, past=None):
    """model(input_ids) continuing the KV cache `past` (None: a new one); returns (output, cache)."""
    name = kv_cache_kwarg(type(model))
    out = model(input_ids=input_ids, **{name: past}, use_cache=True)
    return out, getattr(out, name)


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
