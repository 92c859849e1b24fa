#!/usr/bin/env bash
# Runs the tests whose outcome depends on the Triton release again under the newest one: the tile
# tables and path choices (test_families, test_autotune, test_pingpong), the register and
# architecture checks (test_registers, test_arch_matrix: offline compiles), and a correctness subset of
# each path against float64 in the interpreter (below). The main run (scripts/test.sh) uses the Triton
# installed (setup_env.sh's triton==3.6.0 where none is). A virtual environment (scripts/side_venv.sh)
# takes torch, kernels and pytest from the main environment and adds only triton==$TRITON_NEWEST
# (`TRITON_NEWEST=3.8.0` for another release); scripts/test.sh then runs the files there, choosing the
# interpreter as it does for the main run. Extra arguments pass to pytest. scripts/test.sh runs this
# after a full run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TRITON_NEWEST=${TRITON_NEWEST:-3.9.0}
VENV=${TRITON_NEWEST_VENV:-.venv-triton-$TRITON_NEWEST}

bash scripts/side_venv.sh "$PYTHON" "$VENV" "triton==$TRITON_NEWEST"
"$VENV/bin/python" -c "import sys, torch, triton; print('test_triton_newest.sh: triton', triton.__version__, 'torch', torch.__version__); sys.exit(triton.__version__ != '$TRITON_NEWEST')"

# The correctness subset: both gradient paths and their plans (test_correctness's strategy cases), the
# per-token sweep and top-k, the divergence's row kernel, the products and their compensated pairs,
# the chunked path's class-major buffer, and the interpreter's bf16 emulation the CPU cases rely on.
FILES=(
    tests/kernel/test_families.py
    tests/kernel/test_autotune.py
    tests/kernel/test_pingpong.py
    tests/kernel/test_registers.py
    tests/kernel/test_arch_matrix.py
    tests/kernel/test_bf16_emulation.py
    "tests/kernel/test_correctness.py::test_matches_float64_reference"
)
PYTHON="$VENV/bin/python" exec bash scripts/test.sh "${FILES[@]}" "$@"
