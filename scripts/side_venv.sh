#!/usr/bin/env bash
# A virtual environment beside the main one, for a second test pass under another release of one
# package (scripts/test_kernels_newest.sh, scripts/test_triton_newest.sh):
#
#   bash scripts/side_venv.sh PYTHON VENV REQUIREMENT     e.g. python3 .venv-triton-3.9.0 triton==3.9.0
#
# VENV sees every package of PYTHON's environment (torch, pytest, ...) and has REQUIREMENT installed
# over them. --system-site-packages gives the base interpreter's packages only: where PYTHON is itself
# a venv (a torch of its own), its site-packages come through a .pth file, searched after VENV's own
# and before the base interpreter's. The .pth is rewritten on every call, so VENV follows PYTHON.
set -euo pipefail
if [ "$#" -ne 3 ]; then
    echo "usage: bash scripts/side_venv.sh PYTHON VENV REQUIREMENT" >&2
    exit 2
fi
python=$1 venv=$2 requirement=$3
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --system-site-packages "$venv"
fi
purelib=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$python" -c "import site; print('\n'.join(site.getsitepackages()))" > "$purelib/_main_environment.pth"
"$venv/bin/python" -m pip install -q "$requirement"
