"""Checkpoints larger than RAM: the model built on the meta device, its weights read from the
safetensors shards one unit at a time (the embeddings, a decoder layer, the head), within a
host-memory budget.

`open_checkpoint(dir, dtype)` builds the model skeleton with accelerate's `init_empty_weights`
(parameters on the meta device, buffers real) and a `Weights` object that knows, for every
parameter and persistent buffer, where its values are in the shards (`safetensors.safe_open`;
names, shapes and dtypes from the library, no header parsing). Every supported family's
checkpoint layout maps onto transformers 5.x modules the way transformers' own conversion table
does (`transformers/conversion_mapping.py`): a name as it is, Mixtral's `block_sparse_moe` as
`mlp`, and the per-expert `experts.E.{gate,up,down}_proj` (`w1, w3, w2`) stacked into the fused
`experts.gate_up_proj` [E, 2I, H] (gate then up) and `experts.down_proj` [E, H, I].
tests/test_stream.py checks every family's weights against `from_pretrained`, bit for bit.

Units: `embed` (the input embeddings), `layer.<i>` (decoder layer i without its router and routed
experts), `experts.<i>` (its routed experts: the engine's host store is filled from them),
`routers` (every MoE layer's router, kept resident: a prefetch lookahead at layer l needs layer
l + 1's router), and one unit per other module (the final norm, `lm_head`). `load(unit)` reads
a unit into memory, `release(unit)` puts its tensors back on the meta device (the shard files are
opened per read and closed after it, so nothing stays mapped).

`resolve_max_memory("auto")`: the machine's available memory less a margin, the budget the
model's weights may use (runtime/backends/hfmodel.py decides from it whether the model is loaded whole or
streamed layer by layer).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from runtime.core.errors import InputError

log = logging.getLogger(__name__)

GiB = float(1 << 30)
AUTO_MARGIN_GiB = 2.0  # left to the runtime (Python, torch, the policy caches, hidden states) under "auto"
AUTO_MARGIN_FRACTION = 0.1
# experts read per opening of their shards: a layer's shard pages are mapped only chunk by chunk, so a
# load holds the layer once plus one chunk's pages, not the layer twice
EXPERT_CHUNK = 32

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def available_memory_GiB() -> float:
    """MemAvailable of /proc/meminfo (the memory the kernel can give without swapping), in GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / GiB


def resolve_max_memory(value: float | str | None, flag: str = "--max-memory") -> float:
    """GiB the model's weights may use: a positive number, or `auto` (None): available memory less
    max(2 GiB, 10%), logged."""
    if value is None or value == "auto":
        avail = available_memory_GiB()
        budget = max(avail - max(AUTO_MARGIN_GiB, AUTO_MARGIN_FRACTION * avail), 0.5)
        log.info("%s auto = %.1f GiB (%.1f GiB available less the margin)", flag, budget, avail)
        return budget
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{flag} = {value!r} must be a number of GiB or 'auto'") from None
    if not (v > 0 and v < float("inf")):
        raise InputError(f"{flag} = {value!r} must be a positive number of GiB or 'auto'")
    return v


def checkpoint_dtype(shards: Shards, cfg) -> torch.dtype:
    """The checkpoint's own floating dtype: config.json's `dtype` / `torch_dtype`, else the first
    floating tensor of the shards."""
    d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(d, torch.dtype) and d.is_floating_point:
        return d
    if isinstance(d, str) and isinstance(getattr(torch, d, None), torch.dtype):
        return getattr(torch, d)
    for _, (_, dt) in shards.meta.items():
        if dt in _ST_DTYPES:
            return _ST_DTYPES[dt]
    return torch.float32


class Shards:
    """Where each checkpoint tensor is: name -> shard file, shape and safetensors dtype."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        self.dir = model_dir
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise InputError(f"--model {model_dir}: no .safetensors files there (only safetensors checkpoints are read)")
        self.where: dict[str, Path] = {}
        self.meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as s:
                    for k in s.keys():  # noqa: SIM118 - safe_open is not a dict
                        sl = s.get_slice(k)
                        self.where[k] = f
                        self.meta[k] = (tuple(sl.get_shape()), sl.get_dtype())
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise InputError(f"--model {f}: the weights cannot be loaded: not a readable safetensors file ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:160] if str(exc) else ''})") from None

    @contextlib.contextmanager
    def reader(self, keys: list[str]):
        """`get(key) -> tensor` over the shards holding `keys`, each opened once and closed on exit.
        Tensors are read one at a time, so a caller that copies each into place holds one extra
        tensor at most, not a second copy of the unit."""
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            handles = {f: stack.enter_context(safe_open(str(f), framework="pt"))
                       for f in dict.fromkeys(self.where[k] for k in keys)}
            yield lambda k: handles[self.where[k]].get_tensor(k)


@dataclass
class Entry:
    """One parameter or persistent buffer of the model, where it lives and where its values come from."""

    name: str  # the model's name for it (the first alias)
    aliases: list[tuple[nn.Module, str]]  # (owner module, attribute): tied weights have several
    is_param: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: list[list[str]]  # direct: [[key]]; stacked experts: one list of keys per expert, concatenated on dim 0

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Weights:
    """The model's tensors by unit, read from the shards on demand (module doc)."""

    shards: Shards
    units: dict[str, list[Entry]]
    loaded: set[str] = field(default_factory=set)
    bytes_read: int = 0
    reads: Counter = field(default_factory=Counter)  # unit -> times read from the shards

    def nbytes(self, unit: str | None = None) -> int:
        units = [unit] if unit is not None else list(self.units)
        return sum(e.nbytes for u in units for e in self.units[u])

    def read_entry(self, e: Entry, out: torch.Tensor | None = None) -> torch.Tensor:
        """One entry's values from the shards, into `out` when given (a staging view of its shape and
        dtype), else into a new tensor."""
        if len(e.sources) == 1 and len(e.sources[0]) == 1:
            with self.shards.reader(e.sources[0]) as get:
                src = get(e.sources[0][0])
                if tuple(src.shape) != e.shape:
                    raise InputError(f"--model {self.shards.dir}: {e.name} has shape {tuple(src.shape)} in the "
                                     f"safetensors files, the model expects {e.shape}")
                t = src.to(e.dtype) if out is None else out.copy_(src)
        else:  # stacked experts [E, ...], each expert's parts concatenated on dim 0
            t = torch.empty(e.shape, dtype=e.dtype) if out is None else out
            for a in range(0, len(e.sources), EXPERT_CHUNK):  # the shard pages read are unmapped per chunk
                chunk = e.sources[a : a + EXPERT_CHUNK]
                with self.shards.reader([k for keys in chunk for k in keys]) as get:
                    for i, keys in enumerate(chunk, start=a):
                        parts = [get(k) for k in keys]
                        if (sum(p.shape[0] for p in parts) != e.shape[1]
                                or tuple(parts[0].shape[1:]) != e.shape[2:]):
                            raise InputError(f"--model {self.shards.dir}: {keys[0]} has shape "
                                             f"{list(parts[0].shape)}; the model's {e.name} expects {list(e.shape)}")
                        torch.cat(parts, dim=0, out=t[i]) if len(parts) > 1 else t[i].copy_(parts[0])
        return t

    def load(self, *units: str) -> None:
        for unit in units:
            if unit in self.loaded:
                continue
            self.bind(unit, [self.read_entry(e) for e in self.units[unit]])

    def bind(self, unit: str, tensors: list[torch.Tensor]) -> None:
        """Put a unit's tensors (read by `read_entry`, on any device) in place: counted as one read."""
        for e, t in zip(self.units[unit], tensors, strict=True):
            self._set(e, t)
            self.bytes_read += e.nbytes
        self.loaded.add(unit)
        self.reads[unit] += 1

    def to_device(self, unit: str, device: torch.device) -> None:
        """Move a loaded unit's tensors to `device` (the host copy is dropped)."""
        for e in self.units[unit]:
            owner, attr = e.aliases[0]
            self._set(e, getattr(owner, attr).detach().to(device))

    def release(self, *units: str) -> None:
        for unit in units:
            if unit not in self.loaded:
                continue
            for e in self.units[unit]:
                self._set(e, torch.empty(e.shape, dtype=e.dtype, device="meta"))
            self.loaded.discard(unit)

    def load_all(self) -> None:
        self.load(*self.units)

    @staticmethod
    def _set(e: Entry, t: torch.Tensor) -> None:
        v = nn.Parameter(t, requires_grad=False) if e.is_param else t
        for owner, attr in e.aliases:
            setattr(owner, attr, v)


def skeleton(cfg, dtype: torch.dtype) -> nn.Module:
    """The model of `cfg` with its parameters on the meta device (no memory) and its buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def _candidates(name: str) -> list[list[list[str]]]:
    """The checkpoint layouts that may hold `name`, as source lists (module doc), most direct first.
    Per-expert lists hold the literal `{e}` where the expert index goes."""
    alts = [name]
    if ".mlp." in name:  # Mixtral's checkpoints call the sparse block block_sparse_moe
        alts.append(name.replace(".mlp.", ".block_sparse_moe."))
    out: list[list[list[str]]] = [[[a]] for a in alts]
    for a in alts:
        if a.endswith("experts.gate_up_proj"):
            p = a[: -len("gate_up_proj")]
            out += [[[f"{p}{{e}}.gate_proj.weight", f"{p}{{e}}.up_proj.weight"]], [[f"{p}{{e}}.w1.weight", f"{p}{{e}}.w3.weight"]]]
        elif a.endswith("experts.down_proj"):
            p = a[: -len("down_proj")]
            out += [[[f"{p}{{e}}.down_proj.weight"]], [[f"{p}{{e}}.w2.weight"]]]
    return out


def _sources(name: str, shape: tuple[int, ...], shards: Shards, tied_to: str | None) -> list[list[str]]:
    for cand in _candidates(name):
        keys = cand[0]
        if "{e}" not in keys[0]:
            if keys[0] in shards.where:
                return [keys]
            continue
        E = shape[0] if shape else 0
        per = [[k.format(e=e) for k in keys] for e in range(E)]
        if E and all(k in shards.where for ks in per for k in ks):
            return per
    if tied_to is not None:  # a tied output embedding saved only once
        return _sources(tied_to, shape, shards, None)
    raise InputError(f"--model {shards.dir}: weight {name} {list(shape)} is not in the safetensors files "
                     "(a checkpoint layout this loader does not know)")


def build_weights(model: nn.Module, shards: Shards, router_modules: list[nn.Module],
                  expert_modules: list[nn.Module]) -> Weights:
    """Map every parameter and persistent buffer of `model` to its unit and its checkpoint keys."""
    persistent = set(model.state_dict(keep_vars=True).keys())
    layers_mod = model.get_decoder().layers
    layer_of = {id(mod): i for i, lay in enumerate(layers_mod) for mod in lay.modules()}
    routers = {id(mod) for r in router_modules for mod in r.modules()}
    experts = {id(mod) for x in expert_modules for mod in x.modules()}
    emb = model.get_input_embeddings()
    by_tensor: dict[int, Entry] = {}
    units: dict[str, list[Entry]] = defaultdict(list)
    tied = "model.embed_tokens.weight" if getattr(model.config, "tie_word_embeddings", False) else None
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        own = [(n, p, True) for n, p in mod.named_parameters(recurse=False, remove_duplicate=False)]
        own += [(n, b, False) for n, b in mod.named_buffers(recurse=False, remove_duplicate=False)]
        for attr, t, is_param in own:
            full = f"{mod_name}.{attr}" if mod_name else attr
            if not is_param and full not in persistent:
                continue  # a computed buffer (rotary frequencies): real from the skeleton
            if id(t) in by_tensor:
                by_tensor[id(t)].aliases.append((mod, attr))
                continue
            shape = tuple(t.shape)
            e = Entry(full, [(mod, attr)], is_param, shape, t.dtype,
                      _sources(full, shape, shards, tied if full.endswith("lm_head.weight") else None))
            by_tensor[id(t)] = e
            if id(mod) in routers:
                unit = "routers"
            elif id(mod) in experts:
                unit = f"experts.{layer_of[id(mod)]}"
            elif id(mod) in layer_of:
                unit = f"layer.{layer_of[id(mod)]}"
            elif mod is emb:
                unit = "embed"
            else:
                unit = mod_name or "model"
            units[unit].append(e)
    return Weights(shards, dict(units))


def output_units(model: nn.Module, w: Weights) -> list[str]:
    """The units holding the output embeddings (lm_head, or the tied input embeddings)."""
    out = model.get_output_embeddings()
    ids = {id(t) for t in out.parameters()}
    return [u for u, es in w.units.items() if any(id(getattr(o, a)) in ids for e in es for o, a in e.aliases)]


def units_of_layer(w: Weights, i: int) -> list[str]:
    """Decoder layer i's units: its attention, norms, dense or shared MLP, and its routed experts."""
    return [u for u in (f"layer.{i}", f"experts.{i}") if u in w.units]


STAGING_ALIGN = 256  # bytes: every staged tensor starts on this boundary (any dtype may view it)


def _aligned(n: int) -> int:
    return -(-n // STAGING_ALIGN) * STAGING_ALIGN


class LayerPipe:
    """Decoder layers streamed through a compute device (`--device`; runtime/backends/hfmodel.py's layer-major pass).

    Layer i's units are read from the shards into one of two staging buffers (pinned host memory on
    CUDA, plain memory in CPU device mode) by a worker thread, then copied to freshly allocated device
    tensors: on CUDA with non-blocking copies on a side stream, followed by an event. `start(i + 1)`
    is called right after `acquire(i)`, so the next layer's read and copy overlap the current layer's
    compute. `acquire(i)` makes the compute stream wait for layer i's copy event, marks each tensor
    used by the compute stream (`record_stream`: the caching allocator reuses its memory only after
    the compute queued before it is freed), and binds the tensors into the model; `Weights.release`
    then drops them. A staging buffer is refilled only once the copy that read it has finished (its
    event, waited for on the worker thread). At most two layers are on the device at once (three for
    a moment while the allocator waits for the compute stream), and two layers' staging on the host.
    CPU device mode runs the same steps with a plain copy for the transfer and no streams or events.
    """

    def __init__(self, w: Weights, device: torch.device, layer_units: list[list[str]]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.w, self.device, self.layer_units = w, device, layer_units
        self.cuda = device.type == "cuda"
        self.entries = [[e for u in units for e in w.units[u]] for units in layer_units]
        cap = max((sum(_aligned(e.nbytes) for e in es) for es in self.entries), default=STAGING_ALIGN)
        self.pinned = self.cuda
        self.staging = [self._alloc(cap) for _ in range(2)]
        self.slot_done: list = [None, None]  # per staging buffer: the event of the last copy that read it
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="expertsweep-staging")
        self.futures: dict = {}
        self.staged_bytes = 2 * cap

    def _alloc(self, nbytes: int) -> torch.Tensor:
        with torch.inference_mode(False):
            if self.pinned:
                try:
                    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                except RuntimeError as exc:  # page-locking refused: pageable staging (copies then block)
                    log.warning("pinned staging of %.3g GiB refused (%s): pageable staging, host-blocking copies",
                                nbytes / GiB, str(exc).splitlines()[0][:120])
                    self.pinned = False
            return torch.empty(nbytes, dtype=torch.uint8)

    def start(self, i: int) -> None:
        """Begin reading and copying layer i in the background."""
        if 0 <= i < len(self.entries) and i not in self.futures:
            self.futures[i] = self.pool.submit(self._prepare, i)

    @torch.inference_mode()
    def _prepare(self, i: int) -> tuple[list[torch.Tensor], object]:
        slot = i % 2
        if self.slot_done[slot] is not None:
            self.slot_done[slot].synchronize()  # the copy that last read this buffer is done
        buf, off, views = self.staging[slot], 0, []
        for e in self.entries[i]:
            v = buf[off : off + e.nbytes].view(e.dtype).view(e.shape)
            views.append(self.w.read_entry(e, out=v))
            off += _aligned(e.nbytes)
        if not self.cuda:  # CPU device mode: the transfer is a plain copy into new tensors
            return [v.clone() for v in views], None
        with torch.cuda.stream(self.copy_stream):
            dev = [torch.empty(e.shape, dtype=e.dtype, device=self.device) for e in self.entries[i]]
            for d, v in zip(dev, views, strict=True):
                d.copy_(v, non_blocking=self.pinned)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        self.slot_done[slot] = ev
        return dev, ev

    def acquire(self, i: int) -> None:
        """Layer i's weights in place on the device, the compute stream ordered after their copy."""
        self.start(i)
        dev, ev = self.futures.pop(i).result()
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(ev)
            for d in dev:
                d.record_stream(cur)
        k = 0
        for u in self.layer_units[i]:
            n = len(self.w.units[u])
            self.w.bind(u, dev[k : k + n])
            k += n

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=True)
        self.futures.clear()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
