#!/usr/bin/env bash
# One command for a GPU machine that has no package registry (`make gpu-check`).
#
# Prints the GPU, driver, CUDA, torch and CuPy versions; installs the wheels carried in
# .gpu-wheels/ (filled beforehand by `make gpu-wheels` on a machine with PyPI) into a
# private directory; checks that compute/ and services/ import; runs the gpu-marked tests
# (kernels first, stopping at the first failure; then the engine and service tests),
# bench/kernels.py at a short setting, and compute-sanitizer memcheck and racecheck over a
# subset of the kernel tests, and bench/step_gap.py (the GPU's idle time between steps,
# synchronous vs asynchronous output, batch 8 and 64). Every step has its own time limit (GPU_CHECK_*_S below) so
# the whole run ends inside a 10-minute command; a failing step does not stop the later
# ones, and the exit status is that of the first failure.
#
# Results go to $OUT (the device tool's return folder; default bench/results/gpu-check-<ts>),
# at most 8 files: summary.txt (versions and each step's status), pytest.log,
# sanitizer.log, the kernel and step-gap benchmarks' JSON and PNG, and all.tar.gz with
# every log.
#
# Use: bash bench/gpu_check.sh [steps...]   steps: versions install tests bench sanitize
#      (default: all, in that order), and two not in the default list because with them
#      the run could pass a 10-minute command: engine (bench/engine_gpu.py: headrace vs
#      HF static batching, 256 requests of 512 + 128 tokens, SmolLM2 and Llama-1B shapes)
#      and graphs (bench/cuda_graphs.py: decode steps with and without CUDA graphs);
#      run them as `bash bench/gpu_check.sh versions install engine graphs`.
#      Python: $PYTHON (default python3, the image's torch).
set -uo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
STAMP=$(date -u +%Y%m%d-%H%M%S)
OUT=${OUT:-bench/results/gpu-check-$STAMP}
WHEELS=${GPU_WHEELS_DIR:-.gpu-wheels}
SITE=${GPU_SITE_DIR:-/tmp/headrace-site}
# Limits in seconds; together with start-up they stay under the device tool's 600 s.
KERNEL_TESTS_S=${GPU_CHECK_KERNEL_TESTS_S:-180} # tests/kernels/test_kernels_gpu.py, -x
ENGINE_TESTS_S=${GPU_CHECK_ENGINE_TESTS_S:-150} # every other gpu-marked test
BENCH_S=${GPU_CHECK_BENCH_S:-70}                # bench/kernels.py, short setting
GAP_S=${GPU_CHECK_GAP_S:-60}                    # bench/step_gap.py, 50 steps per run
ENGINE_BENCH_S=${GPU_CHECK_ENGINE_BENCH_S:-400} # bench/engine_gpu.py, both shapes
GRAPHS_BENCH_S=${GPU_CHECK_GRAPHS_BENCH_S:-300} # bench/cuda_graphs.py, both shapes
SANITIZE_S=${GPU_CHECK_SANITIZE_S:-60}          # each of memcheck and racecheck
PER_TEST_S=${GPU_CHECK_PER_TEST_S:-120}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The carried wheels (installed by the install step) come before the image's packages.
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
FIRST_FAILURE=0

note() { echo "$*" | tee -a "$LOGS/summary.txt"; }

# step NAME LIMIT_S LOG COMMAND...: runs COMMAND under a time limit and records its status.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOGS/$log" 2>&1
  local rc=$?
  local verdict=ok
  if [ "$rc" -ne 0 ]; then
    verdict="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ", over its ${limit}s limit"))"
    [ "$FIRST_FAILURE" -eq 0 ] && FIRST_FAILURE=$rc
  fi
  note "step $name: $verdict in $((SECONDS - start)) s (log: $log)"
  tail -n 15 "$LOGS/$log"
}

versions() {
  {
    echo "== gpu-check $STAMP, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    nvcc --version 2>&1 | tail -n 2
    command -v compute-sanitizer >/dev/null && compute-sanitizer --version 2>&1 | tail -n 1
    "$PYTHON" - <<'EOF'
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
  } 2>&1 | tee -a "$LOGS/summary.txt"
}

install() {
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    step install 120 install.log "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  else
    note "step install: no wheels in $WHEELS (run 'make gpu-wheels' where PyPI is reachable)"
  fi
  step imports 60 install.log "$PYTHON" -c \
    "import compute.engine, services.server.server, kernels.cuda; print('imports ok')"
}

tests() {
  local common=(-q -rfEs -p no:cacheprovider --timeout "$PER_TEST_S")
  step kernel-tests "$KERNEL_TESTS_S" pytest.log "$PYTHON" -m pytest -m gpu -x "${common[@]}" \
    tests/kernels/test_kernels_gpu.py
  step engine-tests "$ENGINE_TESTS_S" pytest.log "$PYTHON" -m pytest -m gpu "${common[@]}" \
    tests --ignore tests/kernels/test_kernels_gpu.py
}

bench() {
  step bench-kernels "$BENCH_S" bench.log "$PYTHON" -m bench.gpu.cuda_kernels --iters 20 --warmup 5
  local f
  for f in $(ls -t bench/results/kernels-*.json bench/results/kernels-*.png 2>/dev/null | head -n 2); do
    cp "$f" "$OUT/"
  done
  step bench-step-gap "$GAP_S" bench.log "$PYTHON" -m bench.gpu.step_gap --device cuda --steps 50
  for f in $(ls -t bench/results/step-gap-gpu-*.json bench/results/step-gap-gpu-*.png 2>/dev/null | head -n 2); do
    cp "$f" "$OUT/"
  done
}

engine() {
  step bench-engine "$ENGINE_BENCH_S" bench.log "$PYTHON" -m bench.gpu.engine_gpu
  for f in $(ls -t bench/results/engine-gpu-*.json bench/results/engine-gpu-*.png 2>/dev/null | head -n 2); do
    cp "$f" "$OUT/"
  done
}

graphs() {
  step bench-graphs "$GRAPHS_BENCH_S" bench.log "$PYTHON" -m bench.gpu.cuda_graphs
  for f in $(ls -t bench/results/cuda-graphs-*.json bench/results/cuda-graphs-*.png 2>/dev/null | head -n 2); do
    cp "$f" "$OUT/"
  done
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
  local tool
  for tool in memcheck racecheck; do
    step "$tool" "$SANITIZE_S" sanitizer.log compute-sanitizer --tool "$tool" --error-exitcode 3 \
      --print-limit 20 "$PYTHON" -m pytest -m gpu -x -q -p no:cacheprovider \
      tests/kernels/test_kernels_gpu.py -k "$subset"
  done
}

STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(versions install tests bench sanitize)
for s in "${STEPS[@]}"; do
  case $s in
    versions | install | tests | bench | sanitize | engine | graphs) "$s" ;;
    *) note "unknown step $s (steps: versions install tests bench sanitize engine graphs)" ;;
  esac
done

for f in summary.txt pytest.log sanitizer.log; do
  [ -f "$LOGS/$f" ] && cp "$LOGS/$f" "$OUT/"
done
tar -czf "$OUT/all.tar.gz" -C "$LOGS" . 2>/dev/null
note "results in $OUT; first failure exit status: $FIRST_FAILURE"
cp "$LOGS/summary.txt" "$OUT/summary.txt"
exit "$FIRST_FAILURE"
