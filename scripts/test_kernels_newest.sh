#!/usr/bin/env bash
# Runs the tests of what kernels reads (loader, Hub cache, layout, digest and upload of both variants,
# torch-cuda and torch-rocm, on simulated CUDA and ROCm machines, describe-api and
# the architecture check, `kernels benchmark`, the Nix drift check) under the newest kernels release as
# well: the main run (scripts/test.sh) uses the declared minimum, `kernels==` in requirements-test.txt
# and `kernels-minver` in metadata.json. A virtual environment (scripts/side_venv.sh) takes torch,
# Triton and pytest from the main environment and adds only kernels[benchmark]==$KERNELS_NEWEST.
# Extra arguments pass to pytest. scripts/test.sh runs this after a full run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

KERNELS_NEWEST=${KERNELS_NEWEST:-0.19.1}
VENV=${KERNELS_NEWEST_VENV:-.venv-kernels-$KERNELS_NEWEST}

bash scripts/side_venv.sh "$VENV" "kernels[benchmark]==$KERNELS_NEWEST"

FILES=(
    tests/packaging/test_layout.py
    tests/packaging/test_loader.py
    tests/packaging/test_hub_cache.py
    tests/packaging/test_pinning.py
    tests/packaging/test_publish.py
    tests/packaging/test_publish_variant.py
    tests/packaging/test_kernels_tools.py
    tests/packaging/test_workflows.py
    tests/integrations/test_kernels_benchmark.py
)
exec "$VENV/bin/python" -m pytest -q "${FILES[@]}" "$@"
