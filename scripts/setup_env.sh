#!/usr/bin/env bash
# Installs what the tests need into the current python3; a fast no-op when everything is there.
#
# torch and triton are installed pinned, and only when missing: a bare `torch` requirement on a machine
# without torch resolves to the newest CUDA build (several GB), while torch==2.13.0 is the CPU wheel
# kept on this image's disk. An existing torch/triton (e.g. a CUDA build on a GPU machine) is kept.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup_env: installing torch==2.13.0"
    "$PYTHON" -m pip install -q "torch==2.13.0"
fi
if ! "$PYTHON" -c "import triton" >/dev/null 2>&1; then
    echo "setup_env: installing triton==3.6.0"
    "$PYTHON" -m pip install -q "triton==3.6.0"
fi
# tests/integrations/test_zero3.py: DeepSpeed (ZeRO-3 on its CPU accelerator), pinned. Its PyPI release is an
# sdist whose isolated build would download a CUDA torch (several GB): built against the torch installed
# above, without its C++/CUDA ops (the tests use none; DeepSpeed JIT-builds an op only when one is used).
# Built before kernels is installed: kernels 0.17.0 registers a setuptools egg_info writer from a module
# it does not ship (`kernels.lockfile`), so any build without isolation fails in an environment holding
# it ("No module named 'kernels.lockfile'"); the requirements below install kernels again.
if ! "$PYTHON" -c "import deepspeed" >/dev/null 2>&1; then
    echo "setup_env: installing deepspeed==0.19.8"
    "$PYTHON" -m pip uninstall -q -y kernels >/dev/null 2>&1 || true
    DS_BUILD_OPS=0 "$PYTHON" -m pip install -q --no-build-isolation -c requirements-test.txt "deepspeed==0.19.8"
fi
"$PYTHON" -m pip install -q -r requirements-test.txt
# What the tests will run with (docs/testing.md lists the versions tested).
"$PYTHON" -c "
import torch, triton
v = torch.version
build = f'CUDA {v.cuda}' if v.cuda else f'ROCm {v.hip}' if v.hip else 'CPU'
gpu = torch.cuda.is_available()
print(f'setup_env: torch {torch.__version__} ({build} build, GPU: {gpu}), triton {triton.__version__}')"
