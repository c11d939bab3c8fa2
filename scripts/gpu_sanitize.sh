#!/usr/bin/env bash
# The GPU tests under NVIDIA's compute-sanitizer (on the lent device): memcheck (accesses outside
# any allocation, misaligned accesses, hardware exceptions), synccheck (barriers used wrongly)
# and racecheck (shared-memory hazards). PyTorch's caching allocator is off, so each tensor is
# a cudaMalloc of its own exact size and an access past a tensor's end is outside every
# allocation (not inside a pooled block, where memcheck cannot see it). Each tool first runs
# its positive control (scripts/sanitizer_control.py: a planted bug, built by mpk's nvcc step
# and launched through mpk's driver calls); the table's "control" is what the tool counted
# there, which must not be 0 (else its count over the tests means nothing). TOOLS picks tools (default
# "memcheck synccheck racecheck"); MEMCHECK_K / SYNCCHECK_K / RACECHECK_K override each tool's
# pytest -k selection; JOBS: pytest-xdist processes where xdist is importable (default 8);
# TOOL_TIMEOUT: seconds per tool (default 540); PYTEST_ARGS: more pytest arguments. Logs go to
# $OUT (or ./gpu-out), a table last; the exit code is 0 only if every tool ran its tests to the
# end, all passed and none reported an error (one tool process follows pytest and its xdist
# workers: one error summary per tool). About 5 minutes for memcheck on an H100.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; rm -f "$OUT/sanitize-controls.log"
export PYTHONUNBUFFERED=1 MPK_CACHE_DIR=${MPK_CACHE_DIR:-/tmp/mpk-cache} PYTORCH_NO_CUDA_MEMORY_CACHING=1
export MPK_UNDER_SANITIZER=1  # the test that runs this script skips itself under it (no nested tool)
tools=${TOOLS:-memcheck synccheck racecheck}
for tool in $tools; do
  [[ $tool == @(memcheck|synccheck|racecheck) ]] || { echo "TOOLS: $tool? expected memcheck, synccheck or racecheck"; exit 2; }
done
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[[ -x ${san:-} ]] || { echo "compute-sanitizer not found (it ships with the CUDA toolkit)"; exit 2; }
"$san" --version | tail -1
# Installed, not merely importable from here: the 'mpk' dynamo backend is an entry point (without
# it every test fails with "Invalid backend: 'mpk'"), and the control runs from scripts/, where a
# checkout that is not installed cannot be imported.
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || echo "pip install failed (see install.log)"
parallel=(); python3 -c "import xdist" 2>/dev/null && parallel=(-n "${JOBS:-8}")
# Out: the full-size parity tests (minutes each even without a sanitizer), the public shapes'
# two-layer steps (up to 2 GB of weights each: 8 of them side by side under memcheck run an
# H100 out of memory, and every test then running fails with them; their tasks
# are the small decode tests' code at larger sizes), the stress tests (10^5 tasks, and 20k
# through the schedulers), the launch count (torch.profiler's CUPTI cannot attach beside the
# tool), the dropped-cache test (it reads the caching allocator's statistics, which are off
# here) and the dropped-executor test (it needs its launch still running when the executor is
# dropped; under memcheck the launch has often ended by then, or the executor is not yet freed,
# so the test checks nothing there).
# synccheck and racecheck (the slowest tool), whose findings depend on a task family's code
# rather than on its shapes, take each family's tests and one compiled decode step.
memcheck_k=${MEMCHECK_K:-"not qwen3-1.7b and not public_model_shapes and not stress and not one_kernel_launch and not dropped_cache_alive and not dropped_while_its_launch"}
families="paged_attention_matches or fused_rope_attention or linear_variant or norm_split or silu_epilogue or long_row \
or embedding or rope_append or compiled_decode_matches_eager[qwen3-4-3-options4 or random_programs_match_eager_and_interpreter[0]"
synccheck_k=${SYNCCHECK_K:-$families}
racecheck_k=${RACECHECK_K:-$families}
# the tool's count: memcheck and synccheck print "ERROR SUMMARY: N errors", racecheck
# "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
count() { grep -oE "(ERROR|RACECHECK) SUMMARY: [0-9]+" "$1" | awk '{print $3}'; }
table=() status=0
for tool in $tools; do
  log="$OUT/sanitize-$tool.log"
  opts=(--tool "$tool" --target-processes all --report-api-errors no --print-limit 200)
  "$san" "${opts[@]}" --log-file "$OUT/control.tmp" python3 scripts/sanitizer_control.py "$tool" > /dev/null 2>&1
  control=$(count "$OUT/control.tmp")
  cat "$OUT/control.tmp" >> "$OUT/sanitize-controls.log"; rm -f "$OUT/control.tmp"
  if [[ ${control:-0} == 0 ]]; then
    echo "$tool did not report its planted bug: its count below means nothing"; status=1
  fi
  k_var="${tool}_k"
  start=$SECONDS
  timeout -k 30 "${TOOL_TIMEOUT:-540}" "$san" "${opts[@]}" --log-file "$log" python3 -m pytest -m gpu -q -p no:cacheprovider "${parallel[@]}" \
    ${PYTEST_ARGS:-} -k "${!k_var}" tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_runtime.py > "$OUT/pytest-$tool.log" 2>&1
  rc=$?
  errors=$(count "$log")
  tests=$(grep -E "[0-9]+ (passed|failed|skipped|deselected|errors?)\b" "$OUT/pytest-$tool.log" | tail -1)
  (( rc == 124 || rc == 137 )) && tests="TIMED OUT after ${TOOL_TIMEOUT:-540} s; $tests"
  [[ $rc == 0 && ${errors:-x} == 0 ]] || status=1
  table+=("$(printf '%-9s | %7s | %6s | %5d s | %s' "$tool" "${control:-none}" "${errors:-none}" $((SECONDS - start)) "$tests")")
  grep -m 40 -E "^=+ (Invalid|Race|Barrier|Error|.*hazard)|^=+ +at |^=+ +by thread" "$log"
done
printf '%-9s | %7s | %6s | %7s | %s\n' tool control errors time pytest
printf '%s\n' "${table[@]}"
exit $status
