#!/usr/bin/env bash
# The prefill benchmark in one device call: its kernels built by parallel --prebuild processes
# (a prompt length each, the mixed batch, the decode step with a chunk riding), the GEMM and
# prefill GPU tests beside the builds (TESTS=0 skips them), then benchmarks/prefill_latency.py
# with its peer, a table last. MODELS (default "qwen3-1.7b llama3.2-1b": about 7 minutes on an
# H200 with the tests), PARTS (default "prompts chunk"), logs and JSON lines in $OUT (or
# ./gpu-out). The skewed-decode part ("skew") is left to its own call.
set -uo pipefail
cd "$(dirname "$0")/.."
MODELS=${MODELS:-qwen3-1.7b llama3.2-1b}
PARTS=${PARTS:-prompts chunk}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 MPK_CACHE_DIR=${MPK_CACHE_DIR:-/tmp/mpk-cache}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || echo "pip install failed (see install.log)"
start=$(date +%s)
builds=()
for m in $MODELS; do
  if [[ " $PARTS " == *" prompts "* ]]; then
    for n in 64 512 2048 8192; do
      python3 benchmarks/prefill_latency.py --prebuild --models "$m" --lengths "$n" --mixed --parts prompts \
        > "$OUT/logs/prebuild-$m-$n.log" 2>&1 & builds+=($!)
    done
    python3 benchmarks/prefill_latency.py --prebuild --models "$m" --lengths --parts prompts \
      > "$OUT/logs/prebuild-$m-mixed.log" 2>&1 & builds+=($!)
  fi
  if [[ " $PARTS " == *" chunk "* ]]; then
    python3 benchmarks/prefill_latency.py --prebuild --models "$m" --lengths --mixed --parts chunk \
      > "$OUT/logs/prebuild-$m-chunk.log" 2>&1 & builds+=($!)
  fi
done
rc=0
if [[ ${TESTS:-1} != 0 ]]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/gpu/test_gpu_gemm.py tests/gpu/test_gpu_prefill.py \
    > "$OUT/logs/tests.log" 2>&1 || rc=1
  tail -1 "$OUT/logs/tests.log"
fi
for pid in "${builds[@]}"; do wait "$pid" || { echo "a prebuild failed (logs/prebuild-*.log)"; rc=1; }; done
echo "built in $(( $(date +%s) - start )) s"
# shellcheck disable=SC2086  # (MODELS and PARTS are lists)
python3 benchmarks/prefill_latency.py --models $MODELS --parts $PARTS --out "$OUT/prefill_latency.jsonl" \
  > "$OUT/logs/prefill_latency.log" 2>&1 || rc=1
tail -16 "$OUT/logs/prefill_latency.log"
exit $rc
