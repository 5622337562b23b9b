#!/usr/bin/env bash
# Every CUDA check of the offloading engine, in one prepared run (docs/engine.md, "GPU checks").
#
#   scripts/gpu_checks.sh [RESULTS_DIR]
#
# Run from anywhere on a machine with an NVIDIA GPU and a Python that has CUDA torch, transformers,
# numba, pyarrow, pyyaml, safetensors, tokenizers, tqdm and pytest (PY=... picks it; default: the
# repository's .venv if its torch sees CUDA, else python3). RESULTS_DIR defaults to $OUT when that is
# set (the device tool), else ./gpu_results. About 5 minutes on an H200. Writes there:
#   summary.md             the figures (paste into docs/performance.md, "Engine")
#   gpu_checks.log         everything the steps printed
#   bench_cuda.json        simulator vs engine on the GPU, pinned host store, at one VRAM budget
#   bench_cuda_pageable.json  the same with a pageable host store (one round)
#   calibrate_cuda.json    pinned and pageable link bandwidth, fetch, expert and dense times
#   host_cuda.yaml         the calibrated HostProfile (python -m runtime.simulate --host ...)
#   generate_cuda.json     greedy agreement, quality-first vs the exact model, on the GPU
# Steps: (1) tests/test_engine.py with the engine on cuda (logits within 1e-4 of the emulation,
# identical counters, prefill, generate, budget, mmap store); (2) CUDA OOM -> one-line error, exit 2;
# (3) bench_engine.py: calibration + simulated vs measured time per token for fetch-every-miss,
# rule-0.15, quality-first, speed-first, host-compute at the same --vram-budget, and the speedups;
# (4) the pageable variant; (5) runtime.calibrate; (6) runtime.generate.
# Exit status 1 if any step failed (the others still run).
set -u -o pipefail
cd "$(dirname "$0")/.."
RES=${1:-${OUT:-gpu_results}}
mkdir -p "$RES"
LOG="$RES/gpu_checks.log"
: >"$LOG"
WORK=${WORK:-/tmp/expertsweep-gpu-bench}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${PY:-}" ]; then
  PY=python3
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=.venv/bin/python
  fi
fi
# bench model: Qwen3-30B-A3B-like experts (3 x 2048 x 768, bf16 = 9.4 MB), 32 per layer, top-4, 4 layers;
# 0.55 GiB holds the dense part, 8 slots per layer (25%) and the staging buffers
BENCH=(--device cuda --dtype bf16 --hidden 2048 --moe-intermediate 768 --experts 32 --top-k 4 --layers 4
       --vram-budget 0.55 --window 64 --windows 3 --repeats 10 --workdir "$WORK")
status=0
step() {
  local name=$1
  shift
  echo "=== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  if "$@" >>"$LOG" 2>&1; then
    echo "--- ok: $name ($((SECONDS - t0)) s)" | tee -a "$LOG"
  else
    echo "--- FAILED: $name ($((SECONDS - t0)) s)" | tee -a "$LOG"
    status=1
  fi
}
oom_check() {  # a CUDA OOM inside the engine's CLI wrapper: exit 2 and one 'expertsweep: error:' line
  local err rc
  err=$("$PY" -c "
import torch
from runtime.engine import engine_cli
engine_cli(lambda: torch.empty(1 << 50, dtype=torch.uint8, device='cuda'))" 2>&1)
  rc=$?
  echo "exit $rc: $err"
  [ "$rc" -eq 2 ] && [ "$(echo "$err" | grep -c '^expertsweep: error: CUDA out of memory')" -eq 1 ] \
    && ! echo "$err" | grep -q Traceback
}
prompts() {
  printf '%s\n' "def fibonacci(n):" "The policy kernel decides, per token and layer," \
    "import numpy as np" "Background admission copies run on their own stream" >"$WORK/prompts.txt"
}

step environment "$PY" -c "import torch, transformers; assert torch.cuda.is_available(), 'no CUDA';
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0),
      'transformers', transformers.__version__)"
nvidia-smi >>"$LOG" 2>&1 || true
step exactness-on-cuda env EXPERTSWEEP_ENGINE_DEVICE=cuda "$PY" -m pytest tests/test_engine.py -q -x -p no:cacheprovider
step oom-one-line-error oom_check
step bench-pinned "$PY" scripts/bench_engine.py "${BENCH[@]}" --rounds 3 --out "$RES/bench_cuda.json"
step bench-pageable "$PY" scripts/bench_engine.py "${BENCH[@]}" --rounds 1 --pageable --out "$RES/bench_cuda_pageable.json"
step calibrate sh -c "'$PY' -m runtime.calibrate --model '$WORK/model' --device cuda --dtype bf16 \
  --out '$RES/host_cuda.yaml' --json > '$RES/calibrate_cuda.json'"
mkdir -p "$WORK" && prompts
step generate "$PY" -m runtime.generate --model "$WORK/model" --prompts "$WORK/prompts.txt" --policy quality-first \
  --vram-budget 0.55 --device cuda --dtype bf16 --max-new-tokens 48 --out "$RES/generate_cuda.json"

"$PY" - "$RES" "$status" >"$RES/summary.md" 2>>"$LOG" <<'EOF'
import json, sys
from pathlib import Path
res, status = Path(sys.argv[1]), sys.argv[2]
def load(name):
    p = res / name
    return json.loads(p.read_text()) if p.is_file() else None
print("# GPU checks of the engine\n")
print(f"All steps passed: {'yes' if status == '0' else 'NO (see gpu_checks.log)'}\n")
for name, title in (("bench_cuda.json", "pinned host store"), ("bench_cuda_pageable.json", "pageable host store")):
    b = load(name)
    if not b:
        print(f"{name}: missing\n"); continue
    print(f"## Simulator vs engine, {title} ({b['device']}, {b['dtype']}, capacity {b['capacity'][0]} of "
          f"{b['model']['experts']}, expert {b['model']['expert_bytes'] / 2**20:.2f} MiB)\n")
    print("| policy | measured ms/token | simulated ms/token | error | fetches | admissions | stalls | peak device MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for n, r in b["policies"].items():
        print(f"| {n} | {r['measured_time_per_token_s'] * 1e3:.3f} | {r['simulated_time_per_token_s'] * 1e3:.3f} | "
              f"{r['rel_error'] * 100:+.1f}% | {r['counters']['fetches']} | {r['counters']['admissions']} | "
              f"{r['admission_stalls']} | {r['peak_device_bytes'] / 2**20:.0f} |")
    print(f"\ntarget met (|error| <= 15% for fetch-every-miss, rule-0.15, quality-first): {b['target_met']}\n")
    for k, v in b["speedups_measured"].items():
        print(f"- speedup {k}: measured {v:.2f}x, simulated {b['speedups_simulated'][k]:.2f}x")
    print()
c = load("calibrate_cuda.json")
if c:
    print("## Calibration\n")
    print(f"- link: pinned {c['link']['pinned_GBps']:.2f} GB/s, pageable {c['link']['pageable_GBps']:.2f} GB/s")
    print(f"- one expert fetch {c['fetch_us']:.1f} us; expert on device {c['device_expert_us']:.1f} us, "
          f"on host {c['host_expert_us']:.1f} us; dense {c['dense_layer_us']:.1f} us per layer\n")
g = load("generate_cuda.json")
if g:
    print("## Greedy generation, quality-first vs exact\n")
    print(f"- agreement {g['agreement']:.3f} over {g['prompts']} prompts x {g['max_new_tokens']} tokens, "
          f"{g['identical_prompts']} identical; first divergences "
          f"{[r['first_divergence'] for r in g['per_prompt']]}; {g['time_per_token_s'] * 1e3:.2f} ms/token "
          f"(exact, streaming every expert: {g['exact_time_per_token_s'] * 1e3:.2f}); peak device "
          f"{g['peak_device_bytes'] / 2**20:.0f} MiB")
EOF
cat "$RES/summary.md"
exit $status
