#!/usr/bin/env bash
# Every check of the offloading engine on a GPU, as one prepared, time-boxed run (docs/engine.md, "GPU checks").
#
#   bash scripts/gpu_checks.sh [RESULTS_DIR]              # on a machine with an NVIDIA GPU
#   bash scripts/gpu_checks.sh --cpu [--tiny] RESULTS_DIR  # the same steps in CPU device mode, small sizes (dry run)
#   bash scripts/gpu_checks.sh --wheels                    # here, with a package index: fill .gpu_wheels/ (15 MB)
#   bash scripts/gpu_checks.sh ... --steps versions,kernel RESULTS_DIR  # only the named steps (the rest: not run)
#
# NOT YET RUN ON CUDA: every step has run in CPU device mode (--cpu) only; read the first CUDA run's
# summary.md with that in mind. The device machine has no internet: `--wheels` downloads (pip) the
# pure-Python wheels of hqq (built from its sdist), einops, termcolor, accelerate, huggingface_hub and
# transformers at the versions of constraints.txt into .gpu_wheels/ (git-ignored), which the device tool
# carries (`carry: [".gpu_wheels"]`); the versions step installs from it with --no-index what the
# machine lacks. Without them the low-bit step fails with a line saying it did not run.
#
# RESULTS_DIR defaults to $OUT (the device tool) or ./gpu_results. At most 8 files are written there (the
# device tool returns 8): summary.md (rewritten after EVERY step, so a killed run still returns what it
# measured), gpu_checks.log (everything the steps printed), versions.json, bench_pinned.json,
# bench_pageable.json, calibrate.json, host.yaml, generate.json. Scratch files go to $WORK (a temp dir).
#
# Steps, in run order, each under its own `timeout` and never stopping the run (no -x; pytest with per-test
# timeouts when pytest-timeout is installed):
#   1 kernel     compile every signature of the policy kernel and the cost model's replay that the later steps
#                use, in one process, into $NUMBA_CACHE_DIR (default: $WORK/numba_cache, empty: every run is
#                planned for a fresh machine). Every later step then loads it: its log says "kernel loaded from
#                cache", or the step FAILS ("kernel compiled") when it wrote a numba cache file.
#   2 versions   first install the carried wheels of the pinned set over whatever the machine has (pip install
#                --no-index --no-deps --force-reinstall: seconds), check that every pinned package that imports is at
#                its constraints.txt version (a loud VERSION MISMATCH line and a failed step otherwise), then
#                record Python/torch/CUDA/transformers/numba..., compare with constraints.txt, and check every
#                transformers internal the adapters use on all families (scripts/gpu_env.py). Fix-up: when the
#                machine's transformers differs from the tested one and a wheel of the tested version is in
#                $WHEELS (default .gpu_wheels/, carried with the device tool's `carry`), it is installed into a
#                private folder (--no-index --no-deps --target) and used if its internals check passes.
#                The machine cannot download anything; torch and numba are the machine's own.
#   3 oom        a device out-of-memory inside the engine's CLI: one 'expertsweep: error:' line, exit 2
#   4 stream     a 4-layer checkpoint written on the spot (scripts/bigmodel.py), fp32: `runtime.backends.emulate
#                --device cuda --max-memory 0.001` with every layer streamed through the GPU (device budget
#                capped) == the model resident on the GPU (counters, NLL 1e-5), and vs the CPU run (exact
#                NLL 1e-3); `runtime.tools.record --device cuda` streamed vs the CPU recording (top-k ids 99.9%)
#   5 bench-pinned    scripts/bench_engine.py, ONE round (GPU_CHECKS_ROUNDS: more): calibration + simulated vs
#                     measured time per token for fetch-every-miss, rule-0.15, quality-first, speed-first,
#                     host-compute, and (--families) lookahead prefetch, host and 4-bit fallbacks, at the VRAM
#                     budget (runtime.formats.costmodel) that holds 25% of the experts; speedups; peak vs budget.
#                     A host store that cannot be pinned (cudaHostRegister refused) falls back to pageable
#                     memory with a warning. The budget uses the CUDA context measured after start; stalls are
#                     counted from the device time measured between CUDA events. It writes the model steps 6-7
#                     and 12 read.
#   6 fetch-exact bf16, engine on the device, no debug syncs (scripts/gpu_exact_check.py fetch-exact): fetch-every-miss
#                at 25% and at E-1 slots bit-identical NLL; fetch-every-miss + lookahead prefetch (background
#                prefetch copies) bit-identical to it; rule-0.15 at beta 0.05 (background admissions) without debug
#                bit-identical to the same run with a sync after every layer (a copy read before it landed would
#                change them); the NLL vs the exact pass reported
#   7 lowbit     the bench's 4-bit (hqq) row is there; else the line "low-bit step did not run" (a failure)
#   8 generate   runtime.tools.generate: greedy agreement of quality-first with the exact model at the bench's
#                budget (sized with the context this process measures, as the bench sized it)
#   8b graphs    scripts/gpu_graphs_check.py on the bench's model: fetch-every-miss, quality-first, speed-first at
#                25%, the decode step's segments replayed from CUDA graphs vs run eagerly (--no-cuda-graphs): NLL
#                bit-identical, counters equal, the path really `cuda_graphs`; time per token of both, and per
#                decoder layer with all but one expert resident (CPU
#                mode: the eager segments vs the Hugging Face forward path, same decisions, logits 1e-4)
#   9 exactness  tests/test_engine.py with the engine on the device (CUDA: TF32 off, logits within 1e-4)
#  10 calibrate  runtime.tools.calibrate: pinned/pageable bandwidth and issue time, fetch isolated and in context
#  11 engine-cpu (--cpu only: CPU-only work never spends device time) the engine in CPU device mode on every
#                family (tests/test_engine.py::test_other_families...)
#  12 bench-pageable  the bench, one round, host store in pageable memory (copies block the host): what is left
# Steps 4, 6, 7 and 8b write their JSON to $WORK (stream.json, fetch_exact.json, lowbit.txt, graphs.json); summary.md
# carries their figures, so the 8 files above stay 8. stream and fetch-exact print one line per stage
# (`[check +SECONDS] ...`: model written or loaded, each run started and finished with its seconds, each
# comparison), so a cut says where.
# GPU_CHECKS_CPU_K and GPU_CHECKS_EXACT_K replace the -k expressions of steps 11 and 9.
# `--steps a,b,...` runs only the named steps (of the 12 above), in the order above; the others are logged as not
# selected and left out of summary.md. Steps 6-8 and 12 read the model and bench_pinned.json of bench-pinned (in
# $WORK, RESULTS_DIR): select it with them, or they fail saying what is missing.
# A step past its limit gets SIGINT (pytest and Python flush what they have), then SIGKILL 10 s later.
# The plan (the `step` lines at the end; reports/gpu_check_plan_rehearsal.md): on CUDA the limits of the
# planned steps (kernel .. graphs) add up to at most $GPU_CHECKS_BUDGET = 420 s with 2 s a step of overhead, the most valuable
# unverified checks first (stream and fetch-exact); exactness (verified on CUDA in the first run),
# calibrate and bench-pageable run in what is left. The limits come from a --cpu rehearsal with an empty
# NUMBA_CACHE_DIR, scaled for the device host's slower CPU, and the two CUDA runs' step times, with a
# margin (tests/test_gpu_checks.py checks the sums). In CPU mode every limit is x5 within 840 s. A step that
# would not fit is cut to what is left, or skipped (status 'skipped') when under 20 s remain.
# Before a device run, here (with a package index): bash scripts/gpu_checks.sh --wheels
# On the device tool: run(command="bash scripts/gpu_checks.sh", carry=[".gpu_wheels"], timeout_s=540).
# Exit status 0 when every step passed, 1 otherwise; 2 for a bad option.
set -u -o pipefail
cd "$(dirname "$0")/.."
SELF="$PWD/scripts/gpu_checks.sh"
MODE=cuda
TINY=0
RES=""
RUN_STEP=""
STEPS=""
ALL_STEPS="kernel versions oom stream bench-pinned fetch-exact lowbit generate graphs exactness calibrate engine-cpu bench-pageable"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --tiny) TINY=1 ;;
    --_step) RUN_STEP=$2; shift ;;  # internal: run one step's function (under the caller's `timeout`)
    --steps)
      [ $# -ge 2 ] && [ -n "${2//[, ]/}" ] || { echo "expertsweep: error: scripts/gpu_checks.sh: --steps needs a comma-separated list of steps" >&2; exit 2; }
      STEPS=" ${2//,/ } "
      for s in $STEPS; do
        case " $ALL_STEPS " in
          *" $s "*) ;;
          *) echo "expertsweep: error: scripts/gpu_checks.sh: --steps: unknown step $s (steps: ${ALL_STEPS// /,})" >&2; exit 2 ;;
        esac
      done
      shift ;;
    --wheels) MODE=wheels ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$SELF"; exit 0 ;;
    -*) echo "expertsweep: error: scripts/gpu_checks.sh: unknown option $1 (use --cpu, --tiny, --steps, RESULTS_DIR)" >&2; exit 2 ;;
    *) RES=$1 ;;
  esac
  shift
done
WHEELS=${WHEELS:-$PWD/.gpu_wheels}
LOWBIT_PKGS="hqq einops termcolor accelerate huggingface_hub"
if [ "$MODE" = wheels ]; then  # on a machine with a package index: the wheels the device installs offline
  PYW=${PY:-.venv/bin/python}
  mkdir -p "$WHEELS" || exit 2
  pins=()
  for p in $LOWBIT_PKGS transformers; do
    v=$(sed -n "s/^$p==//p" constraints.txt)
    [ -n "$v" ] || { echo "expertsweep: error: constraints.txt: no pinned version of $p" >&2; exit 2; }
    pins+=("$p==$v")
  done
  "$PYW" -m pip download -q --no-deps -d "$WHEELS" "${pins[@]}" || exit 1
  for sd in "$WHEELS"/*.tar.gz; do  # hqq ships an sdist: build its pure-Python wheel here
    [ -e "$sd" ] || continue
    "$PYW" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$sd" && rm -f "$sd" || exit 1
  done
  ls -l "$WHEELS"
  du -sh "$WHEELS"
  exit 0
fi
RES=${RES:-${OUT:-gpu_results}}
mkdir -p "$RES" || { echo "expertsweep: error: scripts/gpu_checks.sh: cannot create $RES" >&2; exit 2; }
RES=$(cd "$RES" && pwd)
export WORK=${WORK:-$(mktemp -d /tmp/expertsweep-checks.XXXXXX)}
mkdir -p "$WORK"
# numba's cache: empty unless given, as on a fresh machine; the kernel step fills it, the later steps load it
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$WORK/numba_cache}
mkdir -p "$NUMBA_CACHE_DIR"
LOG="$RES/gpu_checks.log"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -f "$WORK/site_path" ] && PYTHONPATH="$(cat "$WORK/site_path"):$PYTHONPATH"  # the versions step's fix-up
[ -f "$WORK/site_lowbit_path" ] && PYTHONPATH="$PYTHONPATH:$(cat "$WORK/site_lowbit_path")"  # after the machine's own
export PYTHONPATH
if [ -z "${PY:-}" ]; then
  PY=python3
  if [ "$MODE" = cpu ] && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
  elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=.venv/bin/python
  fi
fi
if [ "$MODE" = cpu ]; then
  BUDGET=${GPU_CHECKS_BUDGET:-840}
  SCALE=5  # a loaded 2-core host (steps run 5x slower there under load): every step's limit x5 (the run's budget still bounds the whole)
  DEV=cpu
  # 2 layers of 8 experts (3 x 64 x 256, fp32), top-2, half the experts resident
  BENCH=(--device cpu --dtype fp32 --hidden 64 --moe-intermediate 256 --experts 8 --top-k 2 --layers 2
         --budget-for-fraction 0.5 --window 16 --windows 1 --repeats 2 --workdir "$WORK/bench")
  CAL=(--device cpu --dtype fp32 --repeats 2 --tokens 8 --link-mib 4)
  GEN_TOKENS=8
  ROUNDS=${GPU_CHECKS_ROUNDS:-1}
  STREAM=(--device cpu --hidden 64 --experts 8 --moe-intermediate 32 --top-k 2 --tokens 256)
  FE_TOKENS=64
  GRAPH_TOKENS=16
else
  BUDGET=${GPU_CHECKS_BUDGET:-420}
  SCALE=1
  DEV=cuda
  # Qwen3-30B-A3B-like experts (3 x 2048 x 768, bf16 = 9.4 MB), 32 per layer, top-4, 4 layers; the VRAM budget
  # is the one that holds 8 slots per layer (25%) by runtime.formats.costmodel.capacities_for_budget
  # (sizes cut from the first runs' 3 windows / 10 repeats / 3 rounds, 48 generated tokens, 2048 streamed and
  # 512 fetch-exact tokens, which did not fit their limits: reports/gpu_check_plan_rehearsal.md)
  BENCH=(--device cuda --dtype bf16 --hidden 2048 --moe-intermediate 768 --experts 32 --top-k 4 --layers 4
         --budget-for-fraction 0.25 --window 64 --windows 1 --repeats 2 --workdir "$WORK/bench")
  CAL=(--device cuda --dtype bf16 --repeats 4)
  GEN_TOKENS=24
  ROUNDS=${GPU_CHECKS_ROUNDS:-1}
  # 4 layers of 32 experts (3 x 512 x 256), top-4, hidden 512: 16 MiB a layer in fp32
  STREAM=(--device cuda --hidden 512 --experts 32 --moe-intermediate 256 --top-k 4 --tokens 512)
  FE_TOKENS=128
  GRAPH_TOKENS=64
fi
EXACT_K="not other_families and not gpu_checks_script"
CPU_K="test_other_families_equal_emulation"
if [ "$TINY" = 1 ]; then
  EXACT_K="rule-0.15 or flat_buffer or per_token_plan"
  CPU_K="test_other_families_equal_emulation and qwen2_moe"
fi
# the tests the two pytest steps select (-k of tests/test_engine.py), overridable: the suite's own test of this
# script (which runs those tests itself) selects one cheap test each
EXACT_K=${GPU_CHECKS_EXACT_K:-$EXACT_K}
CPU_K=${GPU_CHECKS_CPU_K:-$CPU_K}
START=$SECONDS
status=0
KERNEL_DONE=0
summary() { timeout 30 "$PY" scripts/gpu_summary.py "$RES" "$WORK" >>"$LOG" 2>&1 || true; }
step() {  # step NAME LIMIT_S FUNCTION: the function runs in a fresh copy of this script under `timeout`
  local name=$1 limit=$(($2 * SCALE)) left t0 rc st
  shift 2
  if [ -n "$STEPS" ] && [[ "$STEPS" != *" $name "* ]]; then
    echo "=== $name: not selected (--steps)" | tee -a "$LOG"
    return
  fi
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped, ${left}s of the run's budget left" | tee -a "$LOG"
    printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >>"$WORK/steps.tsv"
    status=1
    summary
    return
  fi
  [ "$limit" -gt $((left - 5)) ] && limit=$((left - 5))
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  t0=$SECONDS
  # SIGINT first: pytest writes its report and Python its buffers; KILL 10 s later
  touch "$WORK/numba_stamp"
  timeout -s INT -k 10 "$limit" bash "$SELF" ${ARGS[@]+"${ARGS[@]}"} --_step "$1" "$RES" >>"$LOG" 2>&1
  rc=$?
  case $rc in
    0) st=ok ;;
    124 | 130 | 137) st=TIMEOUT ;;
    *) st="FAILED (exit $rc)" ;;
  esac
  if [ "$name" = kernel ]; then
    [ "$rc" -eq 0 ] && KERNEL_DONE=1
  elif [ "$KERNEL_DONE" = 1 ]; then  # the kernel step compiled everything: this step must have loaded it
    local new
    new=$(find "$NUMBA_CACHE_DIR" -name '*.nb[ic]' -newer "$WORK/numba_stamp" 2>/dev/null | sed 's#.*/##' | sort)
    if [ -n "$new" ]; then
      echo "KERNEL COMPILED in step $name: numba wrote $(echo "$new" | wc -l) cache files ($(echo $new)): the kernel step did not compile every signature this step uses" | tee -a "$LOG"
      st="FAILED (kernel compiled)"
      rc=1
    else
      echo "$name: kernel loaded from cache (no numba cache file written in this step)" >>"$LOG"
    fi
  fi
  [ "$rc" -ne 0 ] && status=1
  echo "--- $st: $name ($((SECONDS - t0)) s)" | tee -a "$LOG"
  printf '%s\t%s\t%s\t%s\n' "$name" "$st" "$((SECONDS - t0))" "$limit" >>"$WORK/steps.tsv"
  summary
}
ptimeout() {  # pytest per-test timeout flags, when pytest-timeout is installed
  "$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=$1"
}
offline_wheels() {  # the carried wheels of the pinned set REPLACE the machine's versions (no index, no deps)
  local p v whl missing=() wheels=()
  for p in $LOWBIT_PKGS transformers; do
    v=$(sed -n "s/^$p==//p" constraints.txt)
    whl=$(ls "$WHEELS"/"$p"-"$v"-*.whl 2>/dev/null | head -1)
    if [ -n "$whl" ]; then wheels+=("$whl"); else missing+=("$p==$v"); fi
  done
  echo "carried wheels of the pinned set: ${wheels[*]:-none in $WHEELS}; not carried: ${missing[*]:-none}"
  [ ${#wheels[@]} -eq 0 ] && return 0
  if "$PY" -m pip --version >/dev/null 2>&1; then
    # --force-reinstall: a package that already imports (transformers 5.17 on the first device) is replaced too
    "$PY" -m pip install -q --no-index --no-deps --force-reinstall "${wheels[@]}" ||
      echo "PINNED WHEELS NOT INSTALLED: pip install --force-reinstall failed (see above)"
  else  # no pip: a pure-Python wheel is a zip of its import tree, first on the path
    mkdir -p "$WORK/site_lowbit"
    for whl in "${wheels[@]}"; do "$PY" -m zipfile -e "$whl" "$WORK/site_lowbit" || return 0; done
    echo "$WORK/site_lowbit" >"$WORK/site_path"
    export PYTHONPATH="$WORK/site_lowbit:$PYTHONPATH"
  fi
}
pinned_check() {  # every package of the pinned set that imports is at constraints.txt's version, or a loud failure
  "$PY" - $LOWBIT_PKGS transformers <<'PYEOF'
import importlib.metadata as md, re, sys
pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", open("constraints.txt").read(), flags=re.M))
bad = []
for p in sys.argv[1:]:
    try:
        have = md.version(p)
    except md.PackageNotFoundError:
        print(f"pinned set: {p} not installed (pinned {pins.get(p)})")
        continue
    print(f"pinned set: {p} {have} (pinned {pins.get(p)})")
    if pins.get(p) and have != pins[p]:
        bad.append(f"{p} {have} installed, {pins[p]} pinned")
if bad:
    print("VERSION MISMATCH after installing the carried wheels: " + "; ".join(bad), flush=True)
    sys.exit(1)
PYEOF
}
versions() {  # the carried wheels first; record; if transformers differs from the tested version and its wheel was carried, try it
  local rc want whl t0=$SECONDS
  offline_wheels
  echo "wheels: done in $((SECONDS - t0)) s"
  [ -f "$WORK/site_lowbit_path" ] && export PYTHONPATH="$PYTHONPATH:$(cat "$WORK/site_lowbit_path")"
  pinned_check
  local pinned_rc=$?
  "$PY" scripts/gpu_env.py "$RES/versions.json" >/dev/null
  rc=$?
  [ "$pinned_rc" -ne 0 ] && rc=$pinned_rc
  echo "versions and internals checked (exit $rc) after $((SECONDS - t0)) s"
  want=$(sed -n 's/^transformers==//p' constraints.txt)
  whl=$(ls "${WHEELS:-.gpu_wheels}"/transformers-"$want"-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ] && ! "$PY" -c "import transformers,sys; sys.exit(transformers.__version__ != '$want')" 2>/dev/null; then
    mkdir -p "$WORK/site"
    if "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$whl" &&
      PYTHONPATH="$WORK/site:$PYTHONPATH" "$PY" scripts/gpu_env.py "$WORK/versions_tested.json" >/dev/null; then
      echo "using transformers $want from $whl (its internals check passed)"
      echo "$WORK/site" >"$WORK/site_path"
      "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); d['installed']=sys.argv[2]; json.dump(d, open(sys.argv[3],'w'), indent=2)" \
        "$WORK/versions_tested.json" "transformers $want from $whl" "$RES/versions.json"
      rc=0
    else
      echo "transformers $want from $whl did not pass the internals check: running with the machine's"
    fi
  fi
  cat "$RES/versions.json"
  return $rc
}
kernel() {  # every signature the later steps use, compiled in this one process (they load it from the cache)
  echo "numba cache: $NUMBA_CACHE_DIR ($(find "$NUMBA_CACHE_DIR" -name '*.nbi' | wc -l) index files before)"
  "$PY" -c "
import time, numpy as np
t = time.perf_counter()
from runtime.core.kernel import warmup
from runtime.core.kernel.cache import kernel_signatures
print(f'kernel imported in {time.perf_counter() - t:.1f} s', flush=True)
warmup()
print(f'kernel: {kernel_signatures()} after {time.perf_counter() - t:.1f} s', flush=True)
from runtime.core.kernel import decide
decide.exercise_tiny()
print(f'the engine\'s one-call decision (decide.py) compiled or loaded after {time.perf_counter() - t:.1f} s', flush=True)
from runtime.formats import costmodel as cm
cm.replay_time(np.zeros((2, 2, 5), np.int32), np.ones((2, 2), bool), cm.CostParams(1.0, 1.0, 1.0, 1.0))
print(f'kernel and replay compiled (or loaded from the numba cache) in {time.perf_counter() - t:.1f} s')"
}
oom_check() {  # a device OOM inside the engine's CLI wrapper: exit 2 and one 'expertsweep: error:' line
  local err rc
  if [ "$MODE" = cuda ]; then
    err=$("$PY" -c "
import torch
from runtime.backends.engine import engine_cli
engine_cli(lambda: torch.empty(1 << 50, dtype=torch.uint8, device='cuda'))" 2>&1)
  else  # no device memory to exhaust: the same wrapper around torch's OOM exception
    err=$("$PY" -c "
import torch
from runtime.backends.engine import engine_cli
def f():
    raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 1024.00 TiB')
engine_cli(f)" 2>&1)
  fi
  rc=$?
  echo "exit $rc: $err"
  [ "$rc" -eq 2 ] && [ "$(echo "$err" | grep -c '^expertsweep: error: CUDA out of memory')" -eq 1 ] &&
    ! echo "$err" | grep -q Traceback
}
prompts() {
  mkdir -p "$WORK"
  printf '%s\n' "def fibonacci(n):" "The policy kernel decides, per token and layer," \
    "import numpy as np" "Background admission copies run on their own stream" >"$WORK/prompts.txt"
}
bench_budget() {  # the VRAM budget the pinned bench used
  "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['vram_budget_GiB'])" "$RES/bench_pinned.json"
}
generate() {
  local b
  b=$(bench_budget) || { echo "no bench_pinned.json: no budget to generate at"; return 1; }
  prompts
  "$PY" -m runtime.tools.generate --model "$WORK/bench/model" --prompts "$WORK/prompts.txt" --policy quality-first \
    --vram-budget "$b" --device "$DEV" --dtype "${BENCH[3]}" --max-new-tokens "$GEN_TOKENS" --out "$RES/generate.json"
}
calibrate_step() {
  "$PY" -m runtime.tools.calibrate --model "$WORK/bench/model" "${CAL[@]}" --out "$RES/host.yaml" --json >"$RES/calibrate.json"
}

engine_cpu() {
  env EXPERTSWEEP_ENGINE_DEVICE=cpu "$PY" -m pytest tests/test_engine.py -q -p no:cacheprovider -rfE $(ptimeout 60) \
    -k "$CPU_K" --junitxml="$WORK/junit_cpu.xml"
}
exactness() {
  env EXPERTSWEEP_ENGINE_DEVICE="$DEV" "$PY" -m pytest tests/test_engine.py -q -p no:cacheprovider -rfE $(ptimeout 90) \
    -k "$EXACT_K" --junitxml="$WORK/junit_exact.xml"
}
bench_pinned() {
  "$PY" scripts/bench_engine.py "${BENCH[@]}" --rounds "$ROUNDS" --families --out "$RES/bench_pinned.json"
}
lowbit_check() {  # the bench's low-bit row, or the line saying the step did not run
  local msg
  local rc
  "$PY" -c "
import importlib.util, json, sys
if importlib.util.find_spec('hqq') is None:
    sys.exit(3)
try:
    sys.exit(0 if 'rule-0.15+lowbit4' in json.load(open(sys.argv[1]))['policies'] else 4)
except (OSError, ValueError, KeyError):
    sys.exit(4)" "$RES/bench_pinned.json"
  rc=$?
  if [ "$rc" -eq 3 ]; then
    msg="LOW-BIT STEP DID NOT RUN: hqq is not importable here and no wheel was installed from $WHEELS (run bash scripts/gpu_checks.sh --wheels where pip reaches an index, carry .gpu_wheels)"
  elif [ "$rc" -ne 0 ]; then
    msg="LOW-BIT STEP DID NOT RUN: hqq is there but bench_pinned.json has no rule-0.15+lowbit4 row (the bench step failed or was cut)"
  else
    echo "low-bit (hqq 4-bit) fallback measured: rule-0.15+lowbit4 in bench_pinned.json" | tee "$WORK/lowbit.txt"
    return 0
  fi
  echo "$msg" | tee "$WORK/lowbit.txt"
  return 1
}
fetch_exact() {
  "$PY" scripts/gpu_exact_check.py fetch-exact --device "$DEV" --model "$WORK/bench/model" --tokens "$FE_TOKENS" \
    --out "$WORK/fetch_exact.json"
}
stream_check() {
  "$PY" scripts/gpu_exact_check.py stream "${STREAM[@]}" --work "$WORK/stream" --out "$WORK/stream.json"
}
graphs_check() {  # the captured segments against the eager ones on the bench's model (CPU mode: against hf_forward)
  local cpu=()
  [ "$MODE" = cpu ] && cpu=(--cpu)
  "$PY" scripts/gpu_graphs_check.py --model "$WORK/bench/model" --device "$DEV" --dtype "${BENCH[3]}" ${cpu[@]+"${cpu[@]}"} \
    --tokens "$GRAPH_TOKENS" --out "$WORK/graphs.json"
}
bench_pageable() {
  "$PY" scripts/bench_engine.py "${BENCH[@]}" --rounds 1 --pageable --out "$RES/bench_pageable.json"
}

if [ -n "$RUN_STEP" ]; then
  "$RUN_STEP"
  exit $?
fi
ARGS=()
[ "$MODE" = cpu ] && ARGS+=(--cpu)
[ "$TINY" = 1 ] && ARGS+=(--tiny)
: >"$LOG"
: >"$WORK/steps.tsv"
rm -f "$WORK/site_path" "$WORK/site_lowbit_path" "$WORK/lowbit.txt" "$WORK/fetch_exact.json" "$WORK/stream.json"
echo "$MODE" >"$WORK/mode"
echo "engine checks, $MODE mode, budget ${BUDGET}s, results in $RES, scratch in $WORK${STEPS:+, steps:$STEPS}" | tee -a "$LOG"
summary
# The plan (reports/gpu_check_plan_rehearsal.md). CUDA: the limits of the planned steps (seconds; x SCALE in
# CPU mode) and 2 s a step add up to at most the 420 s budget (tests/test_gpu_checks.py),
# the most valuable unverified checks first: the compiled kernel every step needs, the environment (the
# carried wheels first), the streamed emulation and the race checks without debug syncs (neither had ever
# completed on CUDA), with the bench before fetch-exact as it writes the model fetch-exact reads, then
# lowbit and generate, which read the bench's results, then the CUDA-graphs check (graphs on vs off on the
# bench's model: the captured path's first verification). What was verified on CUDA already (exactness: run 1) and the least valuable steps run
# only in what is left. engine-cpu is CPU-only work: it runs in the --cpu dry run here, never on the device.
step kernel 55 kernel
[ "$MODE" = cuda ] && { nvidia-smi >>"$LOG" 2>&1 || true; }
step versions 30 versions
[ -f "$WORK/site_path" ] && export PYTHONPATH="$(cat "$WORK/site_path"):$PYTHONPATH"
[ -f "$WORK/site_lowbit_path" ] && export PYTHONPATH="$PYTHONPATH:$(cat "$WORK/site_lowbit_path")"
step oom 8 oom_check
step stream 75 stream_check
step bench-pinned 80 bench_pinned  # its figures are the run's purpose; it writes the model the next steps read
step fetch-exact 45 fetch_exact
step lowbit 4 lowbit_check
step generate 30 generate
step graphs 40 graphs_check  # CUDA graphs on vs off: NLL and counters identical; time per token of both
# in what is left (the plan ends above):
step exactness 40 exactness
step calibrate 20 calibrate_step
if [ "$MODE" = cpu ]; then
  step engine-cpu 45 engine_cpu
else
  echo "=== engine-cpu: CPU-only work, not run on the device (bash scripts/gpu_checks.sh --cpu --steps engine-cpu)" | tee -a "$LOG"
fi
step bench-pageable 60 bench_pageable
echo "total $((SECONDS - START)) s of ${BUDGET}" | tee -a "$LOG"
summary
cat "$RES/summary.md"
exit $status
