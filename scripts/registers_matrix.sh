#!/usr/bin/env bash
# The portability matrix (tests/kernel/test_arch_matrix.py: the CUDA and the AMD targets) under another
# Triton than the installed one: a venv that sees this machine's packages (torch, pytest) with only
# Triton replaced, then the matrix test run there (extra arguments go to pytest: `-k amd` for the AMD
# targets alone). No GPU needed.
#
#   bash scripts/registers_matrix.sh            # Triton 3.9.0, the newest release
#   TRITON_VERSION=3.8.0 bash scripts/registers_matrix.sh
#   VENV=/tmp/flce-triton39 bash scripts/registers_matrix.sh   # reuse a venv
set -euo pipefail
cd "$(dirname "$0")/.."
version="${TRITON_VERSION:-3.9.0}"
venv="${VENV:-${TMPDIR:-/tmp}/fused_linear_ce_triton${version//./}}"
bash scripts/side_venv.sh "$venv" "triton==$version"
# A cache of its own: binaries of another Triton never mix with the installed one's.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$venv/triton_cache}"
unset TRITON_INTERPRET
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/kernel/test_arch_matrix.py "$@"
