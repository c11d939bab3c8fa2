#!/usr/bin/env bash
# Everything GPU-side in one call (for the lent device): install, GPU tests (runtime and
# decode), the runtime benchmarks, then with DECODE=1 the decode benchmarks (task bandwidth and
# decode latency against the torch peer: about 10 minutes more), short tables last. Logs and
# JSON go to $OUT (or ./gpu-out); the exit status is non-zero when a test or benchmark failed. PARTS picks a subset (default "decode parity breadth runtime bench";
# without breadth ~9 minutes on an H100 with xdist): the device's 10-minute limit per command fits
# PARTS="decode parity", PARTS="breadth" (the breadth suite in bf16: ~24 nvcc builds, under
# xdist) and PARTS="runtime bench" as three calls.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=" ${PARTS:-decode parity breadth runtime bench} "
for part in $PARTS; do
  case $part in decode|parity|breadth|runtime|bench) ;; *) echo "PARTS has $part; expected decode, parity, breadth, runtime, bench" >&2; exit 2;; esac
done
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPK_CACHE_DIR=${MPK_CACHE_DIR:-/tmp/mpk-cache}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || echo "pip install failed (see install.log)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# The decode tests are numerics, each mostly an nvcc build: with pytest-xdist importable (carried
# as a wheel) they run in $PYTEST_JOBS processes, each with its share of the CPU threads. Then,
# alone: the full-size parity tests, whose eager reference runs its paged ops on the CPU (two of
# them side by side stall for minutes on a 16-core machine, where one takes 50 s),
# and the runtime tests, which time hops and watch for hangs (kernels of several processes
# time-slice the GPU).
jobs=${PYTEST_JOBS:-6}
test_rc=0
run_tests() {  # pytest arguments; appends to pytest_gpu.log, folds the exit code into test_rc
  python3 -m pytest -m gpu -q -p no:cacheprovider "$@" ${PYTEST_ARGS:-} 2>&1 | tee -a "$OUT/pytest_gpu.log" | tail -15
  local rc=${PIPESTATUS[0]}
  (( rc == 5 )) && rc=0  # pytest's "no tests collected": a part PYTEST_ARGS narrowed to nothing
  test_rc=$(( test_rc | rc ))
}
# Without xdist the decode part runs serially (~10 minutes on its own).
parallel=() threads=$(nproc)
python3 -c "import xdist" 2>/dev/null && parallel=(-n "$jobs") threads=$(( threads / jobs > 0 ? threads / jobs : 1 ))
[[ $PARTS == *" decode "* ]] && OMP_NUM_THREADS=$threads run_tests "${parallel[@]}" -k "not qwen3-1.7b" tests/gpu/test_gpu_decode.py
[[ $PARTS == *" parity "* ]] && run_tests -k "qwen3-1.7b" tests/gpu/test_gpu_decode.py
[[ $PARTS == *" breadth "* ]] && OMP_NUM_THREADS=$threads run_tests "${parallel[@]}" tests/gpu/test_gpu_hf_breadth.py
[[ $PARTS == *" runtime "* ]] && run_tests tests --deselect tests/gpu/test_gpu_decode.py \
  --ignore tests/gpu/test_gpu_hf_breadth.py
if [[ $PARTS == *" bench "* ]]; then
  python3 examples/compile_module.py --out "$OUT/example" 2>&1 | tee "$OUT/example.log" | tail -4
  bench_rc=${PIPESTATUS[0]}
  python3 benchmarks/hop_breakdown.py 2>&1 | tee "$OUT/hop_breakdown.txt"
  bench_rc=$(( bench_rc | PIPESTATUS[0] ))
  python3 benchmarks/runtime_overhead.py --out "$OUT/runtime_overhead.jsonl" 2>&1 | tee "$OUT/bench.log" | tail -8
  bench_rc=$(( bench_rc | PIPESTATUS[0] ))
fi
if [[ ${DECODE:-0} == 1 ]]; then
  STAGE=bandwidth OUT=$OUT bash scripts/gpu_decode.sh; bench_rc=$(( ${bench_rc:-0} | $? ))
  STAGE=latency OUT=$OUT bash scripts/gpu_decode.sh; bench_rc=$(( bench_rc | $? ))
fi
echo "gpu tests exit code: $test_rc; benchmarks' exit code: ${bench_rc:-0}"
exit $(( test_rc | ${bench_rc:-0} ))
