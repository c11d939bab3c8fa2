#!/usr/bin/env bash
# Tensor parallelism on one multi-GPU machine (nvidia-h200-x2/-x4) in up to two calls of the lent
# device. Needs nvshmem4py-cu13 (and for SERVE the server's packages) carried as wheels in .whl/.
#   PARTS="tests parity"  the TP GPU tests (degree 1, NVSHMEM, 2-4 GPUs, engine + dead rank) and
#                         tp_parity.py at TP 4 and 2 (qwen3-1.7b, qwen3-8b): ~6 minutes on 4 H200s
#   PARTS="latency serve" decode_latency.py --tp 4 (overlapped and serialised collectives, NCCL
#                         peer) and mpk serve --tensor-parallel-size 4 with a rank killed under
#                         64 streams: ~9 minutes
# The decode kernels of every rank are built first on the machine's CPUs, in parallel (skipped
# when $MPK_CACHE_DIR already holds them, as it does for a second call on a still-warm machine).
# Logs and JSON lines go to $OUT (or ./gpu-out); tables last. NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=" ${PARTS:-tests parity} "
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPK_CACHE_DIR=${MPK_CACHE_DIR:-$PWD/.mpk-cache}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || echo "pip install failed (see install.log)"
gpus=$(nvidia-smi --list-gpus | wc -l)
models="qwen3-1.7b qwen3-8b"
mkdir -p "$MPK_CACHE_DIR"
if [[ $PARTS == *" parity "* || $PARTS == *" latency "* ]] && (( $(ls "$MPK_CACHE_DIR" | grep -c cubin) < 70 )); then
  for m in $models; do  # one process per (model, batch, degree): tracing is serial within one
    python3 benchmarks/prebuild_decode.py --models "$m" --batches 4 --tp 1 --jobs 2 >> "$OUT/prebuild.log" 2>&1 &
    for b in 1 4 16; do for tp in 2 4; do
      (( tp <= gpus )) && python3 benchmarks/prebuild_decode.py --models "$m" --batches "$b" --tp "$tp" \
        --options '{}' '{"comm_tiles": 1}' --jobs 4 >> "$OUT/prebuild.log" 2>&1 &
    done; done
  done
fi
rc=0
if [[ $PARTS == *" tests "* ]]; then
  timeout 480 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_tp.py tests/gpu/test_gpu_tp_multi.py \
    tests/distributed -m gpu 2>&1 | tee "$OUT/tests.log" | tail -6
  rc=$(( rc | PIPESTATUS[0] ))
fi
wait  # the kernels
for tp in 4 2; do
  [[ $PARTS == *" parity "* ]] && (( tp <= gpus )) || continue
  timeout 150 torchrun --standalone --nproc-per-node $tp benchmarks/tp_parity.py --models $models \
    --out "$OUT/tp_parity.jsonl" > "$OUT/parity$tp.log" 2>&1
  rc=$(( rc | $? )); tail -4 "$OUT/parity$tp.log"
done
if [[ $PARTS == *" latency "* ]]; then
  tp=$(( gpus >= 4 ? 4 : 2 ))
  timeout 320 torchrun --standalone --nproc-per-node $tp benchmarks/decode_latency.py --tp $tp --models $models \
    --options '{}' '{"comm_tiles": 1}' --out "$OUT/decode_latency_tp.jsonl" > "$OUT/latency.log" 2>&1
  rc=$(( rc | $? )); tail -14 "$OUT/latency.log"
fi
if [[ $PARTS == *" serve "* ]]; then
  timeout 240 python3 benchmarks/serve_throughput.py --tensor-parallel-size "$(( gpus >= 4 ? 4 : 2 ))" --kill-rank 1 \
    --concurrency 64 --output-len 2048 --layers 8 --kill-after 3 --out "$OUT/serve_kill.jsonl" > "$OUT/serve_kill.log" 2>&1
  rc=$(( rc | $? )); tail -2 "$OUT/serve_kill.log"
fi
exit $rc
