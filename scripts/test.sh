#!/usr/bin/env bash
# The single test command: installs what is missing, then runs pytest (extra arguments pass through,
# e.g. `bash scripts/test.sh -m kernels_ci` or `bash scripts/test.sh tests/packaging/test_layout.py`).
# Without arguments it runs the whole suite, then scripts/test_kernels_newest.sh (kernels 0.19.1) and
# scripts/test_triton_newest.sh (the Triton-dependent tests under Triton 3.9.0).
# With no CUDA GPU visible, Triton kernels run in its interpreter on the CPU (TRITON_INTERPRET=1),
# unless TRITON_INTERPRET is already set.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
PYTHON="$PYTHON" bash scripts/setup_env.sh

if [ -z "${TRITON_INTERPRET:-}" ] && ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1
fi
echo "test.sh: TRITON_INTERPRET=${TRITON_INTERPRET:-<unset>}"

if [ "$#" -gt 0 ]; then
    exec "$PYTHON" -m pytest -q "$@"
fi
# A full run (pytest takes `testpaths = ["tests"]` from pyproject.toml), then the tests of what kernels
# reads again under the newest kernels release (the first run has the declared minimum), and the tests
# whose outcome depends on the Triton release under the newest Triton.
status=0
"$PYTHON" -m pytest -q || status=$?
PYTHON="$PYTHON" bash scripts/test_kernels_newest.sh || status=$?
PYTHON="$PYTHON" bash scripts/test_triton_newest.sh || status=$?
exit "$status"
