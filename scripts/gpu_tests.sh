#!/usr/bin/env bash
# Runs one slice of the test suite on a CUDA machine, sized for one 10-minute device command
# (docs/testing.md). The slices are pytest markers that tests/gpu_plan.py assigns: shards packed from
# tests/gpu_durations.json, the tier from the `tier` / `tier_if` markers on the tests.
#
#   bash scripts/gpu_tests.sh all         # the whole suite; with GPU_TESTS_WORKERS=12 (pytest-xdist) 5.5 min measured
#   bash scripts/gpu_tests.sh tier        # `-m tier`: every kernel path, each dtype, realistic sizes (~6-7 min est.)
#   bash scripts/gpu_tests.sh shard N     # `-m shardN`, N in 1..11: the shards partition the whole suite
#   bash scripts/gpu_tests.sh nccl        # tests/integrations/test_parallel_nccl.py (needs 2 GPUs; skipped on one)
#   bash scripts/gpu_tests.sh plan        # no GPU needed: print each test's shard/tier (JSON) and the estimates
#
# Logs go to $OUT/gpu_tests/ when OUT is set (the device machine's result folder), else to
# ${TMPDIR:-/tmp}/fused_linear_ce_gpu_tests/: pytest.log (output, with --durations=0), junit.xml,
# file_durations.txt (measured seconds per test file), after `all` gpu_durations.json (tests/gpu_durations.json
# with the files this run measured: copy it over that file) and env.txt (GPU, driver, torch/triton versions).
#
# Nothing is installed (the device machine has no network): the python3 on PATH (or $PYTHON) must
# already have torch with CUDA, triton, kernels and pytest. pytest runs under `timeout -s INT` (default
# 570 s, GPU_TESTS_TIMEOUT_S) so that a run that overstays still prints its summary and writes its
# logs before a 600-second command limit. GPU_TESTS_WORKERS=N runs pytest-xdist with N workers when
# it is installed (the estimates assume a serial run). Extra arguments after the slice go to pytest.
# GPU_TESTS_ALLOW_CPU=1 lets the script run without a GPU (Triton interpreter), to check the script
# itself: `GPU_TESTS_ALLOW_CPU=1 bash scripts/gpu_tests.sh tier tests/kernel/test_plan.py`.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

usage() {
    sed -n '2,11p' "${BASH_SOURCE[0]}" >&2
    exit 2
}

PYTHON=${PYTHON:-python3}
mode=${1:-}
[ -n "$mode" ] || usage
shift
case "$mode" in
    all) select=() ;;
    tier) select=(-m tier) ;;
    shard)
        n=${1:-}
        shift || true
        shards=$("$PYTHON" -c "import sys; sys.path.insert(0, 'tests'); import gpu_plan; print(gpu_plan.SHARDS)")
        if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$n" -gt "$shards" ]; then
            echo "gpu_tests.sh: shard N needs N in 1..$shards" >&2
            exit 2
        fi
        select=(-m "shard$n")
        mode="shard$n"
        ;;
    nccl) select=(tests/integrations/test_parallel_nccl.py) ;;
    plan) ;;
    *) usage ;;
esac

LOG_DIR=${OUT:+$OUT/gpu_tests}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/fused_linear_ce_gpu_tests}
mkdir -p "$LOG_DIR"

if [ "$mode" = plan ]; then
    TRITON_INTERPRET=${TRITON_INTERPRET:-1} "$PYTHON" -m pytest --collect-only -q -p no:cacheprovider \
        --gpu-plan-json="$LOG_DIR/plan.json" "$@" >/dev/null || true
    exec "$PYTHON" tests/gpu_plan.py summary "$LOG_DIR/plan.json"
fi

if [ -n "${GPU_TESTS_ALLOW_CPU:-}" ]; then
    export TRITON_INTERPRET=1
elif [ -n "${TRITON_INTERPRET:-}" ] || ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_tests.sh: no CUDA device visible to torch (or TRITON_INTERPRET is set); use scripts/test.sh on a CPU" >&2
    exit 2
fi

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    echo "git: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) changed file(s)"
    echo "slice: $mode ${select[*]} $*"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
    "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    "$PYTHON" -c "import kernels; print('kernels', kernels.__version__)" 2>&1 | tail -1
} >"$LOG_DIR/env.txt" 2>&1
cat "$LOG_DIR/env.txt"

workers=()
if [ -n "${GPU_TESTS_WORKERS:-}" ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
    workers=(-n "$GPU_TESTS_WORKERS")
fi
how=${workers[*]:+"$GPU_TESTS_WORKERS pytest-xdist workers sharing the GPU"}
how=${how:-serial}

start=$(date +%s)
timeout -s INT -k 20 "${GPU_TESTS_TIMEOUT_S:-570}" \
    "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider --durations=0 --durations-min=0.5 \
    --junitxml="$LOG_DIR/junit.xml" "${workers[@]}" "${select[@]}" "$@" 2>&1 | tee "$LOG_DIR/pytest.log"
rc=${PIPESTATUS[0]}
echo "gpu_tests.sh: $mode finished with exit status $rc after $(( $(date +%s) - start )) s" | tee -a "$LOG_DIR/pytest.log"
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu_tests.sh: stopped by the ${GPU_TESTS_TIMEOUT_S:-570} s timeout: the slice is too large, see docs/testing.md" | tee -a "$LOG_DIR/pytest.log"
fi

# Measured seconds per test file (setup + call + teardown); gpu_durations.json: the next tests/gpu_durations.json.
"$PYTHON" tests/gpu_plan.py files "$LOG_DIR/junit.xml" >"$LOG_DIR/file_durations.txt" 2>&1 || true
cat "$LOG_DIR/file_durations.txt"
if [ "$mode" = all ]; then  # a slice runs part of a cut file: only a whole run measures every file
    "$PYTHON" tests/gpu_plan.py durations "$LOG_DIR/junit.xml" \
        --measured "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) $(date -u +%F): $how" \
        >"$LOG_DIR/gpu_durations.json" || true
fi
exit "$rc"
