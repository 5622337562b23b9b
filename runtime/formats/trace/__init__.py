"""Router traces: what the simulator replays. A package by job:

- `formats`: the in-memory `Trace` and `TraceMeta`; the on-disk formats (Parquet / Arrow IPC, one row
  per (token, layer); `.npz` import of recorder dumps) read by `load_trace` and written by
  `save_trace`; `validate_trace`, the checks every loaded trace goes through (one-line `InputError`s
  naming file, field, value and location); `calibration_split`;
- `checks`: the array checks `validate_trace` runs (ids, weights, rankings, lookahead);
- `imports`: `import_routing`, the routing dumps of vLLM, SGLang and llama.cpp as traces without gate
  weights, and the record command's `--routing` flags (`add_routing_flags`, `import_main`);
- `synthetic`: `synthetic_trace`, a generator with realistic MoE routing statistics, and its
  calibration twin (`calibration_twin`, `synthetic_pair`).

Every name used outside the package is importable from here (`from runtime.formats.trace import X`).
The file formats and the generator are documented in docs/traces.md.
"""

from __future__ import annotations

from runtime.formats.trace.formats import (
    FORMAT_VERSION,
    META_KEY,
    SUFFIXES,
    WEIGHT_NORMS,
    Trace,
    TraceMeta,
    calibration_split,
    load_trace,
    save_trace,
    trace_output_path,
    validate_trace,
)
from runtime.formats.trace.imports import (
    ROUTING_FORMATS,
    add_routing_flags,
    import_main,
    import_routing,
)
from runtime.formats.trace.synthetic import (
    _top_m_stable as _top_m_stable,  # private: tests/test_trace.py checks it
)
from runtime.formats.trace.synthetic import calibration_twin, synthetic_pair, synthetic_trace

__all__ = [
    "FORMAT_VERSION", "META_KEY", "ROUTING_FORMATS", "SUFFIXES", "WEIGHT_NORMS", "Trace", "TraceMeta",
    "add_routing_flags", "calibration_split", "calibration_twin", "import_main", "import_routing", "load_trace",
    "save_trace", "synthetic_pair", "synthetic_trace", "trace_output_path", "validate_trace",
]
