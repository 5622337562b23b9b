"""The offloading engine, one room: the `engine` backend's parts and the path from a decode step to its kernels.

- core.py: `Engine` binds the parts and owns a run (teacher-forced evaluation, decoding, the report);
- store.py: the host store (every expert on the host: RAM, pinned in place, or the checkpoint's shards);
- slots.py: the device slot pool (per MoE layer one tensor pair, a slot a row), staging buffers, the ledger;
- copies.py: the copy streams (CUDA) or the link thread (CPU device mode), waits and stalls;
- plan.py: the kernel's plan applied to a layer (fetches, admissions, the grouped expert call);
- graphs.py: the decode step as segments around each MoE layer's host decision, captured as CUDA graphs;
- prefill.py: a prompt run exactly in chunks before decoding under a policy.

`from runtime.backends import engine` gives core's public names (what callers used before the split).
"""

from runtime.backends.engine.core import (
    Engine,
    cpu_threads,
    cuda_context_bytes,
    device_errors,
    engine_cli,
    expert_forward,
    forward_cached,
    kv_cache_kwarg,
    load_cublas,
    load_engine,
    model_shape_of,
    page_aligned_empty,
    resolve_device,
    stream_layer,
)

__all__ = ["Engine", "cpu_threads", "cuda_context_bytes", "device_errors", "engine_cli", "expert_forward",
           "forward_cached", "kv_cache_kwarg", "load_cublas", "load_engine", "model_shape_of", "page_aligned_empty",
           "resolve_device", "stream_layer"]
