#!/usr/bin/env bash
# The one device call of a GPU session (`make gpu-check`; bench/README.md, "GPU", has the
# exact `run` call and what to do when a step fails).
#
# A session that is lent a GPU gets 15 minutes of device time in all, the machine's start
# (2-4 minutes) included, and at most 600 s a command: one full call and perhaps one short
# rerun. So this is ONE command that fits `run(timeout_s=600)`: its steps together are cut
# to GPU_CHECK_BUDGET_S (540 s) counted from the start, in order of value:
#   versions                 the GPU, driver, nvcc, torch, CuPy, NVRTC (summary.txt)
#   install imports ready    the carried wheels; `import compute, services`; a CUDA device
#                            and CuPy (else every gpu test would skip, and pass: stop)
#   compile                  NVRTC-compile every kernel the launcher builds, timed; CuPy's
#                            disk cache then serves the tests and benchmarks
#   kernel-tests             the gpu-marked kernel tests (tests/kernels)
#   engine-tests             the gpu-marked engine tests: GPU vs CPU, graphs, async, abort,
#                            prefix cache, SDPA prefill (tests/engine)
#   bench-kernels            both decode kernels and SDPA, % of HBM peak; CuPy vs SDPA prefill
#   bench-graphs             decode steps eager vs CUDA graphs, batch 1 and 64
#   bench-gap                device idle between steps, sync vs async, graphs recorded
#   sanitize bench-engine    only with time left (optional: cut or skipped, never a failure):
#                            compute-sanitizer memcheck and racecheck over a kernel-test
#                            subset; engine throughput vs HF static batching
# `call` (the default) is all of them. Single steps can be named, e.g. a rerun of what
# failed: bash bench/gpu/gpu_check.sh install ready compile engine-tests
# Groups: tests = kernel-tests engine-tests; bench = bench-kernels bench-graphs bench-gap.
# `collect` (pytest --collect-only over the same test files) is the CPU test's dry run.
#
# Every step has a time limit (GPU_CHECK_*_S), cut to what is left of the budget; a
# required step that would get under 20 s is skipped and fails the run, an optional one
# under 60 s is skipped. A failing step does not stop the later ones, except install,
# imports, ready and compile (everything after them would fail the same way). The exit
# status is that of the first failure.
#
# The wheels: .gpu-wheels/ (`make gpu-wheels`) is git-ignored, so it reaches the GPU
# machine only when the device call names it in `carry`; without it every step but
# `versions` stops at once. GPU_WHEELS_DIR=installed skips the install where the packages
# are importable already.
#
# Results go to $OUT (the device call's return folder; default bench/results/gpu-check-<ts>)
# as they are produced, so a run killed at its limit still returns what it did. At most 8
# files come back from a device call, so: summary.txt (versions, every step's verdict and
# time), setup.log (install, imports, ready, compile), pytest.log (the tests and the
# sanitizers), bench.log (the benchmarks' output), and the benchmarks' JSON, each written
# straight into $OUT (HEADRACE_BENCH_RESULTS) without its PNG (`python -m bench.gpu.replot`
# draws them afterwards): kernels-<gpu>-*.json, cuda-graphs-<gpu>-*.json,
# step-gap-gpu-*.json and, with time left, engine-gpu-<gpu>-*.json.
#      Python: $PYTHON (default python3, the image's torch). Commit: $HEADRACE_COMMIT where
#      the copy has no .git (the summary and the JSON files name it).
set -uo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
STAMP=$(date -u +%Y%m%d-%H%M%S)
OUT=${OUT:-bench/results/gpu-check-$STAMP}
WHEELS=${GPU_WHEELS_DIR:-.gpu-wheels}
SITE=${GPU_SITE_DIR:-/tmp/headrace-site}
# Limits in seconds. The required steps add up to at most 520 s, and BUDGET_S (540 s,
# counted from the script's start, versions included) cuts them where they run long: under
# the 600 s a device command gets, with room for the copy back.
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
INSTALL_S=${GPU_CHECK_INSTALL_S:-25}            # pip install of the carried wheels
IMPORTS_S=${GPU_CHECK_IMPORTS_S:-30}            # import compute, services, kernels.cuda
READY_S=${GPU_CHECK_READY_S:-20}                # a CUDA device and CuPy (bench/gpu/ready.py)
COMPILE_S=${GPU_CHECK_COMPILE_S:-70}            # bench/gpu/compile_kernels.py (NVRTC)
KERNEL_TESTS_S=${GPU_CHECK_KERNEL_TESTS_S:-125} # KERNEL_TEST_FILES below
ENGINE_TESTS_S=${GPU_CHECK_ENGINE_TESTS_S:-105} # ENGINE_TEST_FILES below
BENCH_KERNELS_S=${GPU_CHECK_BENCH_KERNELS_S:-50} # bench/gpu/cuda_kernels.py, short setting
BENCH_GRAPHS_S=${GPU_CHECK_BENCH_GRAPHS_S:-50}  # bench/gpu/cuda_graphs.py, batch 1 and 64
BENCH_GAP_S=${GPU_CHECK_BENCH_GAP_S:-40}        # bench/gpu/step_gap.py, batch 8 and 64
SANITIZE_S=${GPU_CHECK_SANITIZE_S:-120}         # each of memcheck and racecheck (optional)
BENCH_ENGINE_S=${GPU_CHECK_BENCH_ENGINE_S:-120} # bench/gpu/engine_gpu.py, small (optional)
COLLECT_S=${GPU_CHECK_COLLECT_S:-120}           # pytest --collect-only (the CPU dry run)
PER_TEST_S=${GPU_CHECK_PER_TEST_S:-90}
MIN_STEP_S=20
MIN_OPTIONAL_S=60
# The gpu-marked tests, by file: collecting all of tests/ would import modules that need
# packages the image lacks (cryptography, jsonschema, opentelemetry, ...) and fail.
# tests/bench/test_gpu_check.py collects these files with those packages made unimportable.
KERNEL_TEST_FILES=(tests/kernels/test_kernels_gpu.py tests/kernels/test_kernels_gpu_window.py)
ENGINE_TEST_FILES=(tests/engine/test_engine_gpu.py tests/engine/test_sampler.py)

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export HEADRACE_BENCH_RESULTS="$OUT" # the benchmarks' JSON lands in $OUT directly
HEADRACE_COMMIT=${HEADRACE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export HEADRACE_COMMIT
if [ "$WHEELS" = installed ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else # the carried wheels (installed by the install step) come before the image's packages
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
FIRST_FAILURE=0
NOT_READY=3 # bench/gpu/ready.py's exit status for "no CUDA device or no CuPy"

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

fail() { [ "$FIRST_FAILURE" -eq 0 ] && FIRST_FAILURE=$1; }

# run_step NAME LIMIT_S LOG COMMAND...: runs COMMAND under a time limit (cut to what is left
# of the budget), appending its output to $OUT/LOG as it comes. Sets STEP_RC and STEP_TIME.
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET_S - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  echo "== step $name (limit ${limit}s) $(date -u +%H:%M:%S)" >>"$OUT/$log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1
  STEP_RC=$?
  STEP_TIME=$((SECONDS - start))
  STEP_LIMIT=$limit
  tail -n 15 "$OUT/$log"
}

# step NAME LIMIT_S LOG COMMAND...: a required step; skipped (and failed) when the budget
# cannot give it MIN_STEP_S; its exit status is returned and the first failure kept.
step() {
  local name=$1 limit=$2 log=$3
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    note "step $name: SKIPPED (${left}s left of the ${BUDGET_S}s budget)"
    fail 124
    return 124
  fi
  run_step "$@"
  local verdict=ok
  if [ "$STEP_RC" -ne 0 ]; then
    verdict="FAILED (exit $STEP_RC$([ "$STEP_RC" -eq 124 ] && echo ", over its ${STEP_LIMIT}s limit"))"
    fail "$STEP_RC"
  fi
  note "step $name: $verdict in $STEP_TIME s (log: $log)"
  return "$STEP_RC"
}

# optional NAME LIMIT_S LOG COMMAND...: run only with MIN_OPTIONAL_S left; cut at the
# budget it is reported so, never as a failure (it is extra, and found nothing in the part
# that ran); a real failure (exit status other than a timeout) counts as one.
optional() {
  local name=$1 left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt "$MIN_OPTIONAL_S" ]; then
    note "step $name: not run (optional; ${left}s left of the ${BUDGET_S}s budget)"
    return 0
  fi
  run_step "$@"
  case $STEP_RC in
    0) note "step $name: ok in $STEP_TIME s (log: $3)" ;;
    124 | 137) note "step $name: CUT at ${STEP_LIMIT}s (optional, not a failure; log: $3)" ;;
    *)
      note "step $name: FAILED (exit $STEP_RC) in $STEP_TIME s (log: $3)"
      fail "$STEP_RC"
      ;;
  esac
}

stop_now() {
  note "STOPPED: $*"
  note "first failure exit status: $FIRST_FAILURE"
  exit "$FIRST_FAILURE"
}

versions() {
  {
    echo "== gpu-check $STAMP, commit $HEADRACE_COMMIT, steps: ${STEPS[*]}"
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
      --format=csv 2>&1
    timeout 30 nvcc --version 2>&1 | tail -n 2
    command -v compute-sanitizer >/dev/null && timeout 30 compute-sanitizer --version 2>&1 | tail -n 1
    timeout 60 "$PYTHON" - <<'EOF'
import sys
import torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB,"
          f" sm_{p.major}{p.minor}")
try:
    import cupy
    print("cupy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "NVRTC", cupy.cuda.nvrtc.getVersion())
except Exception as exc:  # noqa: BLE001 - reported, not fatal here
    print("cupy: NOT AVAILABLE:", exc)
EOF
  } 2>&1 | tee -a "$OUT/summary.txt"
}

# Every step but `versions` needs the wheels: checked before any of them runs.
require_wheels() {
  [ "$WHEELS" = installed ] && return
  if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    fail 2
    stop_now "no wheels in $WHEELS/: run 'make gpu-wheels' where PyPI is reachable, and name" \
      "$WHEELS in the device call's carry (it is git-ignored, so it travels only then)"
  fi
}

install() {
  if [ "$WHEELS" != installed ]; then
    step install "$INSTALL_S" setup.log "$PYTHON" -m pip install -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl ||
      stop_now "the carried wheels did not install (setup.log)"
  fi
  step imports "$IMPORTS_S" setup.log "$PYTHON" -c \
    "import compute.engine, services.server.server, kernels.cuda.launch; print('imports ok')" ||
    stop_now "compute/services do not import (setup.log): a package missing from GPU_WHEELS?"
}

# Without a GPU and CuPy every gpu-marked test skips and pytest exits 0: stop instead. The
# check's own verdict decides what the summary says: NOT_READY is "no GPU", any other
# failure is the check's own fault (a traceback in setup.log), never read as "no GPU".
ready() {
  step ready "$READY_S" setup.log "$PYTHON" -m bench.gpu.ready
  local rc=$?
  if [ "$rc" -eq "$NOT_READY" ]; then
    stop_now "no CUDA device or no CuPy: $(grep 'NOT READY:' "$OUT/setup.log" | tail -n 1)" \
      "(setup.log); every gpu test would skip"
  elif [ "$rc" -ne 0 ]; then
    stop_now "the ready check itself failed (exit $rc; its traceback in setup.log), which" \
      "says nothing about the GPU: fix bench/gpu/ready.py or what it imports"
  fi
  note "$(grep '^ready:' "$OUT/setup.log" | tail -n 1)"
}

compile() {
  step compile "$COMPILE_S" setup.log "$PYTHON" -m bench.gpu.compile_kernels ||
    stop_now "the kernels did not compile and load (setup.log: NVRTC's log)"
  note "$(grep '^compile:' "$OUT/setup.log" | tail -n 4 | tr '\n' ';')"
}

common_pytest=(-q -rfEs -p no:cacheprovider)

collect() {
  step collect "$COLLECT_S" pytest.log "$PYTHON" -m pytest --collect-only -m gpu \
    "${common_pytest[@]}" "${KERNEL_TEST_FILES[@]}" "${ENGINE_TEST_FILES[@]}"
}

kernel-tests() {
  step kernel-tests "$KERNEL_TESTS_S" pytest.log "$PYTHON" -m pytest -m gpu --maxfail 10 \
    "${common_pytest[@]}" --timeout "$PER_TEST_S" "${KERNEL_TEST_FILES[@]}"
}

engine-tests() {
  step engine-tests "$ENGINE_TESTS_S" pytest.log "$PYTHON" -m pytest -m gpu \
    "${common_pytest[@]}" --timeout "$PER_TEST_S" "${ENGINE_TEST_FILES[@]}"
}

bench-kernels() {
  step bench-kernels "$BENCH_KERNELS_S" bench.log "$PYTHON" -m bench.gpu.cuda_kernels \
    --iters 20 --warmup 5 --batches 1 8 64 256 --contexts 2048 --no-png
}

bench-graphs() {
  step bench-graphs "$BENCH_GRAPHS_S" bench.log "$PYTHON" -m bench.gpu.cuda_graphs \
    --shapes smollm2-135m --batches 1,64 --contexts 512 --steps 20 --stream-tokens 64 --no-png
}

bench-gap() {
  step bench-gap "$BENCH_GAP_S" bench.log "$PYTHON" -m bench.gpu.step_gap --device cuda \
    --batches 8,64 --steps 50 --no-png
}

sanitize() {
  if ! command -v compute-sanitizer >/dev/null; then
    note "step sanitize: compute-sanitizer not found, not run"
    return
  fi
  # A subset: the sanitizers slow kernels down 10-100x. SmolLM2's shape and a GQA-8 one,
  # decode (both kernels, several partitions, the merge), prefill, mixed, the cache write.
  # (-k matches substrings of test ids; "bfloat16" also holds "float16-", hence the "not".)
  local subset="(float16-d64-b16-g3] and not bfloat16) or bfloat16-d128-b32-g8]"
  subset+=" or reshape_and_cache_gpu or (test_decode_partition_sizes_gpu and -f16-64])"
  local args=(--error-exitcode 3 --print-limit 20 "$PYTHON" -m pytest -m gpu -x -q
    -p no:cacheprovider tests/kernels/test_kernels_gpu.py -k "$subset")
  # Without torch's caching allocator every tensor is its own allocation, so memcheck
  # sees an access past a tensor's end (inside the pool it lands in other memory).
  optional memcheck "$SANITIZE_S" pytest.log env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    compute-sanitizer --tool memcheck "${args[@]}"
  optional racecheck "$SANITIZE_S" pytest.log compute-sanitizer --tool racecheck "${args[@]}"
}

bench-engine() {
  optional bench-engine "$BENCH_ENGINE_S" bench.log "$PYTHON" -m bench.gpu.engine_gpu \
    --shapes smollm2-135m --num-requests 64 --prompt-len 256 --output-len 64 \
    --hf-batch-sizes 16,64 --no-png
}

STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(call)
EXPANDED=()
for s in "${STEPS[@]}"; do
  case $s in
    call)
      EXPANDED+=(versions install ready compile kernel-tests engine-tests bench-kernels
        bench-graphs bench-gap sanitize bench-engine)
      ;;
    tests) EXPANDED+=(kernel-tests engine-tests) ;;
    bench) EXPANDED+=(bench-kernels bench-graphs bench-gap) ;;
    versions | install | ready | compile | collect | kernel-tests | engine-tests | \
      bench-kernels | bench-graphs | bench-gap | sanitize | bench-engine)
      EXPANDED+=("$s")
      ;;
    *)
      echo "unknown step $s (call, tests, bench, or: versions install ready compile collect" \
        "kernel-tests engine-tests bench-kernels bench-graphs bench-gap sanitize" \
        "bench-engine)" >&2
      exit 2
      ;;
  esac
done
STEPS=("${EXPANDED[@]}")

for s in "${STEPS[@]}"; do
  if [ "$s" != versions ]; then
    require_wheels
    break
  fi
done
for s in "${STEPS[@]}"; do
  "$s"
done

note "results in $OUT; first failure exit status: $FIRST_FAILURE"
exit "$FIRST_FAILURE"
