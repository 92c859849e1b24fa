#!/usr/bin/env bash
# A virtual environment beside the main one, for a second test pass under another release of one
# package (scripts/test_kernels_newest.sh, scripts/test_triton_newest.sh):
#
#   bash scripts/side_venv.sh VENV NAME==VERSION       e.g. .venv-triton-3.9.0 triton==3.9.0
#
# VENV sees every package of the main environment ($PYTHON's, python3 by default: torch, pytest, ...)
# and has the requirement installed over them; it fails unless VENV then has that version.
# --system-site-packages gives the base interpreter's packages only: where PYTHON is itself a venv (a
# torch of its own), its site-packages come through a .pth file, searched after VENV's own and before
# the base interpreter's. The .pth is rewritten on every call, so VENV follows PYTHON.
set -euo pipefail
if [ "$#" -ne 2 ] || [[ "$2" != *==* ]]; then
    echo "usage: bash scripts/side_venv.sh VENV NAME==VERSION" >&2
    exit 2
fi
python=${PYTHON:-python3} venv=$1 requirement=$2
name=${requirement%%==*} name=${name%%[*} version=${requirement##*==}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --system-site-packages "$venv"
fi
purelib=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$python" -c "import site; print('\n'.join(site.getsitepackages()))" > "$purelib/_main_environment.pth"
"$venv/bin/python" -m pip install -q "$requirement"
"$venv/bin/python" - "$name" "$version" <<'PY'
import sys
from importlib.metadata import version

import torch

name, wanted = sys.argv[1:]
print(f"side_venv.sh: {name} {version(name)} over torch {torch.__version__} in {sys.prefix}")
sys.exit(version(name) != wanted)
PY
