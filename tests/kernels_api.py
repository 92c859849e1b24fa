"""The `kernels` internals the packaging tests reach into, under each supported version.

kernels 0.19 moved its modules under `kernels._internals` (0.17.2: `kernels.resolver`,
`kernels._versions`, `kernels.cli.*`); the public loader API (`get_kernel`, `get_local_kernel`,
`Metadata`, ...) is the same in both. The tests run under the declared minimum (requirements-test.txt)
and under the newest release (scripts/test_kernels_newest.sh); this module is the one place that
knows where each internal lives.
"""

from __future__ import annotations

import importlib
import inspect
import sys

import kernels
from kernels import get_local_kernel

VERSION = tuple(int(part) for part in kernels.__version__.split(".")[:3])
_INTERNALS = "kernels._internals" if VERSION >= (0, 19) else "kernels"

resolver = importlib.import_module(f"{_INTERNALS}.resolver")
versions = importlib.import_module(f"{_INTERNALS}._versions")
backends = importlib.import_module(f"{_INTERNALS}.backends")
# `python -c CLI verb ...` runs the `kernels` command of this interpreter's kernels.
CLI = f"import sys; from {_INTERNALS}.cli import main; sys.argv[0] = 'kernels'; sys.exit(main())"
KERNELS_CLI = [sys.executable, "-c", CLI]
# describe-api (symbols.json) and `kernels info` are 0.19 verbs.
HAS_DESCRIBE_API = VERSION >= (0, 19)
# get_local_kernel takes check_arch since 0.19 (get_kernel already in 0.17).
LOCAL_CHECK_ARCH = "check_arch" in inspect.signature(get_local_kernel).parameters


def cli_main():
    """The `kernels` command's entry point (reads sys.argv), for running a verb in-process."""
    return importlib.import_module(f"{_INTERNALS}.cli").main


def benchmark_cli():
    """kernels' benchmark CLI module; it imports sigstore (and cryptography), absent on some machines."""
    return importlib.import_module(f"{_INTERNALS}.cli.benchmark")


def backend() -> str:
    """The backend whose variants kernels selects here ("cpu", "cuda", "rocm", ...): taken from the torch
    build (``torch.version.cuda`` / ``hip``), not from whether a GPU is present."""
    return backends._backend().name
