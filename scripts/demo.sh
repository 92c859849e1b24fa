#!/usr/bin/env bash
# The main job: set up (same as the tests), then run the demo. Extra arguments go to demo.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
PYTHON="$PYTHON" bash scripts/setup_env.sh
exec "$PYTHON" scripts/demo.py "$@"
