#!/usr/bin/env bash
# Regenerates the committed results: bench.py with the committed settings (3 interleaved rounds, the
# shapes given merged into benchmarks/results/<gpu>.json), then plot.py (the PNGs and <gpu>.md), then
# render.py (the tables in README.md and docs/benchmarks.md). On the GPU:
#   bash benchmarks/regenerate.sh S1,S2,S3     # ~5 min on an H200
#   bash benchmarks/regenerate.sh S4           # ~4 min
#   bash benchmarks/regenerate.sh              # S1-S4 in one call, ~9 min
# Extra arguments after the shapes go to bench.py (e.g. --quick). Without .git (a copy of the tree),
# set BENCH_COMMIT (and BENCH_DIRTY=0/1) to the commit measured. The log goes to
# benchmarks/results/run_<shapes>.log.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SHAPES=${1:-S1,S2,S3,S4}
shift || true
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-benchmarks/results}  # where the JSON, log, table and PNGs go
LOG="$RESULTS/run_${SHAPES//,/}.log"
mkdir -p "$RESULTS"

"$PYTHON" benchmarks/bench.py --shapes "$SHAPES" --rounds 3 --merge --out "$RESULTS" "$@" 2>&1 | tee "$LOG"
JSON=$(sed -n 's/.* wrote \(.*\.json\).*/\1/p' "$LOG" | tail -n 1)
"$PYTHON" benchmarks/plot.py "$JSON"
if [ "$JSON" = "benchmarks/results/h200.json" ]; then
    "$PYTHON" benchmarks/render.py
else
    echo "regenerate.sh: $JSON is not the committed h200.json; README and docs not rendered" >&2
fi
