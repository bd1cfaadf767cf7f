#!/usr/bin/env bash
# One command per device call on a GPU machine that has no package registry (`make gpu-check`).
#
# The device tool gives one command at most 600 s, and a session about 30 minutes, so the
# work is cut into three calls (bench/README.md, "GPU", has the exact commands):
#   call1 (the default): versions install ready tests bench
#         versions; the carried wheels; `import compute, services`; a CUDA device and CuPy
#         there (else every gpu test would skip, and pass); the gpu-marked kernel
#         tests (stopping at the first failure), then the engine and sampler ones;
#         bench/gpu/cuda_kernels.py at a short setting; bench/gpu/step_gap.py (batch 8 and 64)
#   call2: versions install ready graphs engine
#         bench/gpu/cuda_graphs.py, then bench/gpu/engine_gpu.py (each writes its JSON after every
#         shape, so a kill keeps the shapes done)
#   call3: versions install ready sanitize
#         compute-sanitizer memcheck (PYTORCH_NO_CUDA_MEMORY_CACHING=1, so accesses inside
#         torch's pool are checked) and racecheck over a subset of the kernel tests
# Single steps can be named too: bash bench/gpu/gpu_check.sh versions install engine ...
# `collect` (pytest --collect-only over the same test files) is the CPU test's dry run.
#
# Every step has a time limit (GPU_CHECK_*_S), and all of them together are cut to
# GPU_CHECK_BUDGET_S (540 s) counted from the start: a step gets what is left, and one that
# would get under 20 s is skipped, said so. A failing step does not stop the later ones,
# except a missing or broken install (everything after it would fail the same way). The
# exit status is that of the first failure.
#
# The wheels: .gpu-wheels/ is git-ignored, so it reaches the GPU machine only when the
# device call names it in `carry`; without it every step but `versions` stops at once.
# GPU_WHEELS_DIR=installed skips the install where the packages are importable already.
#
# Results go to $OUT (the device call's return folder; default bench/results/gpu-check-<ts>)
# as they are produced, so a run killed at its limit still returns what it did: at most 8
# files (the device call returns no more): summary.txt (versions and each step's status),
# setup.log (install and imports), pytest.log, bench.log, sanitizer.log, and the
# benchmarks' JSON and PNG (written straight into $OUT: HEADRACE_BENCH_RESULTS).
#      Python: $PYTHON (default python3, the image's torch). Commit: $HEADRACE_COMMIT where
#      the copy has no .git (the JSON files name it).
set -uo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
STAMP=$(date -u +%Y%m%d-%H%M%S)
OUT=${OUT:-bench/results/gpu-check-$STAMP}
WHEELS=${GPU_WHEELS_DIR:-.gpu-wheels}
SITE=${GPU_SITE_DIR:-/tmp/headrace-site}
# Limits in seconds. Each call's steps add up to at most 520 s, and BUDGET_S (540 s, counted
# from the script's start, versions included) cuts them where they run long: under the
# 600 s a device command gets, with room for the machine's start-up and the copy back.
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
INSTALL_S=${GPU_CHECK_INSTALL_S:-40}            # pip install of the carried wheels
IMPORTS_S=${GPU_CHECK_IMPORTS_S:-40}            # import compute, services, kernels.cuda
READY_S=${GPU_CHECK_READY_S:-30}                # a CUDA device and CuPy (kernels.cuda)
KERNEL_TESTS_S=${GPU_CHECK_KERNEL_TESTS_S:-160} # tests/kernels/test_kernels_gpu.py, -x (call 1)
ENGINE_TESTS_S=${GPU_CHECK_ENGINE_TESTS_S:-130} # ENGINE_TEST_FILES below (call 1)
BENCH_S=${GPU_CHECK_BENCH_S:-60}                # bench/gpu/cuda_kernels.py, short setting (call 1)
GAP_S=${GPU_CHECK_GAP_S:-60}                    # bench/gpu/step_gap.py, 50 steps per run (call 1)
GRAPHS_BENCH_S=${GPU_CHECK_GRAPHS_BENCH_S:-160} # bench/gpu/cuda_graphs.py, both shapes (call 2)
ENGINE_BENCH_S=${GPU_CHECK_ENGINE_BENCH_S:-250} # bench/gpu/engine_gpu.py, both shapes (call 2)
SANITIZE_S=${GPU_CHECK_SANITIZE_S:-205}         # each of memcheck and racecheck (call 3)
COLLECT_S=${GPU_CHECK_COLLECT_S:-120}           # pytest --collect-only (the CPU dry run)
PER_TEST_S=${GPU_CHECK_PER_TEST_S:-120}
MIN_STEP_S=20
# The gpu-marked tests, by file: collecting all of tests/ would import modules that need
# packages the image lacks (cryptography, jsonschema, opentelemetry, ...) and fail.
# tests/bench/test_gpu_check.py collects these files with those packages made unimportable.
KERNEL_TEST_FILES=(tests/kernels/test_kernels_gpu.py tests/kernels/test_kernels_gpu_window.py)
ENGINE_TEST_FILES=(tests/engine/test_engine_gpu.py tests/engine/test_sampler.py)

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export HEADRACE_BENCH_RESULTS="$OUT" # the benchmarks' JSON and PNG land in $OUT directly
HEADRACE_COMMIT=${HEADRACE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export HEADRACE_COMMIT
if [ "$WHEELS" = installed ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else # the carried wheels (installed by the install step) come before the image's packages
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
FIRST_FAILURE=0

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

fail() { [ "$FIRST_FAILURE" -eq 0 ] && FIRST_FAILURE=$1; }

# step NAME LIMIT_S LOG COMMAND...: runs COMMAND under a time limit (cut to what is left of
# the budget), appending its output to $OUT/LOG as it comes, and records its status.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    note "step $name: SKIPPED (${left}s left of the ${BUDGET_S}s budget)"
    fail 124
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  echo "== step $name (limit ${limit}s) $(date -u +%H:%M:%S)" >>"$OUT/$log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1
  local rc=$?
  local verdict=ok
  if [ "$rc" -ne 0 ]; then
    verdict="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ", over its ${limit}s limit"))"
    fail "$rc"
  fi
  note "step $name: $verdict in $((SECONDS - start)) s (log: $log)"
  tail -n 15 "$OUT/$log"
  return "$rc"
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
    print(f"device {p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
try:
    import cupy
    print("cupy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())
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

# Without a GPU and CuPy every gpu-marked test skips and pytest exits 0: stop instead.
ready() {
  step ready "$READY_S" setup.log "$PYTHON" -c "import sys; from kernels import cuda
sys.exit(0 if cuda.is_available() else 'kernels.cuda.is_available() is False (no GPU or no CuPy)')" ||
    stop_now "no CUDA device or no CuPy (setup.log): every gpu test would skip"
}

common_pytest=(-q -rfEs -p no:cacheprovider)

collect() {
  step collect "$COLLECT_S" pytest.log "$PYTHON" -m pytest --collect-only -m gpu \
    "${common_pytest[@]}" "${KERNEL_TEST_FILES[@]}" "${ENGINE_TEST_FILES[@]}"
}

tests() {
  step kernel-tests "$KERNEL_TESTS_S" pytest.log "$PYTHON" -m pytest -m gpu -x \
    "${common_pytest[@]}" --timeout "$PER_TEST_S" "${KERNEL_TEST_FILES[@]}"
  step engine-tests "$ENGINE_TESTS_S" pytest.log "$PYTHON" -m pytest -m gpu \
    "${common_pytest[@]}" --timeout "$PER_TEST_S" "${ENGINE_TEST_FILES[@]}"
}

bench() {
  step bench-kernels "$BENCH_S" bench.log "$PYTHON" -m bench.gpu.cuda_kernels --iters 20 --warmup 5
  step bench-step-gap "$GAP_S" bench.log "$PYTHON" -m bench.gpu.step_gap --device cuda --steps 50
}

graphs() {
  step bench-graphs "$GRAPHS_BENCH_S" bench.log "$PYTHON" -m bench.gpu.cuda_graphs
}

engine() {
  step bench-engine "$ENGINE_BENCH_S" bench.log "$PYTHON" -m bench.gpu.engine_gpu
}

sanitize() {
  if ! command -v compute-sanitizer >/dev/null; then
    note "step sanitize: compute-sanitizer not found, skipped"
    return
  fi
  # A subset: the sanitizers slow kernels down 10-100x. SmolLM2's shape and a GQA-8 one,
  # decode (several partitions, merge), prefill, mixed, and the cache write.
  # (-k matches substrings of test ids: "[float16-" excludes the bfloat16 twins.)
  local subset="[float16-d64-b16-g3] or [bfloat16-d128-b32-g8] or reshape_and_cache_gpu"
  subset+=" or test_decode_partition_sizes_gpu[f16-64]"
  local args=(--error-exitcode 3 --print-limit 20 "$PYTHON" -m pytest -m gpu -x -q
    -p no:cacheprovider tests/kernels/test_kernels_gpu.py -k "$subset")
  # Without torch's caching allocator every tensor is its own allocation, so memcheck
  # sees an access past a tensor's end (inside the pool it lands in other memory).
  step memcheck "$SANITIZE_S" sanitizer.log env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    compute-sanitizer --tool memcheck "${args[@]}"
  step racecheck "$SANITIZE_S" sanitizer.log compute-sanitizer --tool racecheck "${args[@]}"
}

STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(call1)
EXPANDED=()
for s in "${STEPS[@]}"; do
  case $s in
    call1) EXPANDED+=(versions install ready tests bench) ;;
    call2) EXPANDED+=(versions install ready graphs engine) ;;
    call3) EXPANDED+=(versions install ready sanitize) ;;
    versions | install | ready | collect | tests | bench | sanitize | engine | graphs)
      EXPANDED+=("$s")
      ;;
    *)
      echo "unknown step $s (call1 call2 call3, or: versions install ready collect tests" \
        "bench graphs engine sanitize)" >&2
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
