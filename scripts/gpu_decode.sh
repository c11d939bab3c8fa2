#!/usr/bin/env bash
# Decode work on the lent device: install, the decode GPU tests, then the task-bandwidth and
# decode-latency benchmarks and the linear tasks' phase split. STAGE=tests|bandwidth|latency|phases|all
# (default all); MODELS and BATCHES narrow decode_latency and linear_phases, LINEAR_BATCHES the
# linear cases of task_bandwidth (default 1 16). Logs and JSON lines go to $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${STAGE:-all}
case $STAGE in tests|bandwidth|latency|phases|all) ;; *)
  echo "STAGE=$STAGE; expected tests, bandwidth, latency, phases or all" >&2; exit 2;; esac
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPK_CACHE_DIR=${MPK_CACHE_DIR:-/tmp/mpk-cache}
rc=0  # any stage's failure, folded in (PIPESTATUS[0]: the python command, not tee or tail)
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || echo "pip install failed (see install.log)"
python3 -c "import transformers, safetensors" 2>/dev/null || echo "transformers/safetensors missing on the device"
if [[ $STAGE == tests || $STAGE == all ]]; then
  python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_gpu_decode.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_decode.log" | grep -E "vs transformers|passed|failed|Error|assert" | tail -30
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ $STAGE == bandwidth || $STAGE == all ]]; then
  python3 benchmarks/task_bandwidth.py --batches ${LINEAR_BATCHES:-1 16} --out "$OUT/task_bandwidth.jsonl" 2>&1 | tee "$OUT/task_bandwidth.log" | tail -9
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ $STAGE == latency || $STAGE == all ]]; then
  python3 benchmarks/decode_latency.py --profile --out "$OUT/decode_latency.jsonl" ${TRACE:+--trace-dir "$OUT/traces"} \
    --models ${MODELS:-llama3.2-1b qwen3-1.7b qwen3-8b} --batches ${BATCHES:-1 4 16} 2>&1 | tee "$OUT/decode_latency.log" | tail -14
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ $STAGE == phases || $STAGE == all ]]; then
  python3 benchmarks/linear_phases.py --out "$OUT/linear_phases.jsonl" \
    --models ${MODELS:-llama3.2-1b qwen3-8b} --batches ${BATCHES:-1 16} 2>&1 | tee "$OUT/linear_phases.log" | tail -12
  rc=$(( rc | PIPESTATUS[0] ))
fi
exit $rc
