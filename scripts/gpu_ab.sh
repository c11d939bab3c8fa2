#!/usr/bin/env bash
# Same-machine A/B of the working tree against a baseline tree: a benchmark run ROUNDS times
# (default 2), alternating baseline and working tree, each a process of its own, into one
# JSON-lines file whose rows carry "tree" (base | new) and "ab_round". The baseline is the mpk
# package and CUDA headers of another commit, unpacked beside the checkout (git-ignored; carry it
# to the device with the cubin cache):
#     git archive REV cuda runtime mpk pyproject.toml | tar -x -C _old
# and, on the CPU machine, its cubins prebuilt like the working tree's, with PYTHONPATH=$PWD/_old.
# Usage: OUT=dir [BASE=_old] [ROUNDS=2] scripts/gpu_ab.sh NAME benchmarks/SCRIPT.py ARGS…
# (the script must take --out FILE). Writes $OUT/NAME.jsonl and $OUT/NAME-{base,new}-rN.log.
set -uo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 2 ]] || { echo "usage: OUT=dir scripts/gpu_ab.sh NAME benchmarks/SCRIPT.py ARGS..." >&2; exit 2; }
name=$1; shift
OUT=${OUT:-gpu-out}; BASE=${BASE:-_old}; ROUNDS=${ROUNDS:-2}
[[ -d $BASE/mpk && -d $BASE/cuda && -d $BASE/runtime ]] || { echo "gpu_ab.sh: no baseline tree at $BASE (mpk/, cuda/, runtime/)" >&2; exit 2; }
BASE=$(cd "$BASE" && pwd)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
rc=0
for (( r = 0; r < ROUNDS; r++ )); do
  for tree in base new; do
    part="$OUT/$name-$tree-r$r"
    if [[ $tree == base ]]; then
      PYTHONPATH="$BASE${PYTHONPATH:+:$PYTHONPATH}" python3 "$@" --out "$part.jsonl" > "$part.log" 2>&1
    else
      python3 "$@" --out "$part.jsonl" > "$part.log" 2>&1
    fi
    status=$?
    (( status )) && { echo "gpu_ab.sh: $tree round $r exited $status (see $part.log)" >&2; rc=1; }
    tail -n 6 "$part.log"
  done
done
python3 - "$OUT/$name.jsonl" "$OUT/$name" "$ROUNDS" <<'EOF'
import json, sys
from pathlib import Path
out, stem, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
with out.open("w") as f:
    for r in range(rounds):
        for tree in ("base", "new"):
            part = Path(f"{stem}-{tree}-r{r}.jsonl")
            for line in part.read_text().splitlines() if part.exists() else []:
                f.write(json.dumps({**json.loads(line), "tree": tree, "ab_round": r}) + "\n")
            part.unlink(missing_ok=True)
print(f"wrote {out}")
EOF
exit $rc
