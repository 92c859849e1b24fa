"""Register pressure of the hot kernels, read from an offline sm_90 compile (``scripts/registers.py``;
no GPU needed: Triton compiles for any target, and its wheel carries ptxas and cuobjdump). Runs under
whichever Triton is installed: the full suite under the CI's, ``scripts/test_triton_newest.sh`` under
the newest release.

Held at 0 bytes of stack (``ZERO``): the kernels whose epilogues were slimmed so that a tile's
softmax epilogue could overlap the next tile's products (warp specialisation, benchmarks/NOTES.md
v11-v29) and that every Triton tested compiles without a spill (3.6.0 to 3.9.0): the sweep with
and without the metrics and every per-token field, on a ragged last tile too; dlogits with the
entropy gradient; the chunked sweep with a softcap and a bias (its own 128 x 128 tiles,
``configs.chunked_epilogue``); the chunked path's in-place gradient kernels; every matmul use whose
result goes through a tensor descriptor, the compensated pairs (16-bit, int8 and 4-bit remainders)
included, and the strided result's pointer epilogue.

Held to the architecture matrix's bound (``MAX_STACK``, test_arch_matrix.py), since their figures
move with the Triton release: the chunked sweep at sm_90's tables (72 bytes under 3.6; 0 under 3.8
and 3.9, whose table has 128 x 128 tiles there), class-major (40; 0), up to H = 1024 (8; 104 and
192), with the metrics (0, 0, 8); dlogits with the bias gradient (48, 16, 40); the Hopper ping-pong
sweep's (Gluon, compiled only where ``pingpong.HAVE_GLUON``: Triton 3.6) with the metrics 16, the
others 0. Every pointer and integer argument is compiled as divisible by 16 and the unit strides
specialised, as a launch at the package's shapes specialises them (``registers.unit_strides``).
The pair's pointer epilogue (~1 KB) and the unsplit int8 pair are reported, not held."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from fused_linear_ce import pingpong
from test_arch_matrix import MAX_STACK

REPO = Path(__file__).resolve().parents[2]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ZERO = {"sweep", "sweep, ragged V", "sweep, metrics", "sweep, every per-token field", "dlogits",
        "dlogits, entropy gradient", "chunked sweep, softcap and bias", "chunked gradient",
        "chunked gradient, bias gradient", "chunked gradient, entropy gradient",
        "chunked gradient, entropy and bias gradients", "chunked gradient, class-major",
        "chunked gradient, class-major, bias gradient", "matmul", "matmul, da^T", "matmul, da^T, fp32 sum",
        "matmul, pointers", "matmul, split K", "matmul, paired rows", "matmul, da^T, compensated",
        "matmul, compensated int8", "matmul, da^T, compensated int8", "matmul, da^T, compensated 4-bit",
        "pingpong sweep", "pingpong sweep, every block"}
BOUNDED = {"chunked sweep", "chunked sweep, class-major", "chunked sweep, H <= 1024", "chunked sweep, metrics",
           "dlogits, bias gradient", "pingpong sweep, metrics"}
HELD = {**dict.fromkeys(ZERO, 0), **dict.fromkeys(BOUNDED, MAX_STACK)}
PINGPONG = {name for name in HELD if name.startswith("pingpong")}


@pytest.fixture(scope="module")
def usage():
    if not (TOOLS / "cuobjdump").exists() or not (TOOLS / "ptxas").exists():
        pytest.skip(f"this Triton install has no ptxas / cuobjdump under {TOOLS}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "registers.py"), "--json"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return {row["name"]: row for row in json.loads(out.stdout)}


def test_every_hot_kernel_compiles_for_sm90_within_the_register_file(usage):
    """Every held kernel is compiled, the ping-pong sweep exactly where this Triton enables it."""
    assert {name for name in usage if name.startswith("pingpong")} == (PINGPONG if pingpong.HAVE_GLUON else set())
    assert set(HELD) - PINGPONG <= set(usage)
    for name, row in usage.items():
        assert 0 < row["registers"] <= 255, name
        assert 0 <= row["shared"] <= 227 * 1024, name  # an H100/H200 block's shared memory (none without reductions)


@pytest.mark.parametrize("name", sorted(HELD))
def test_the_slimmed_epilogues_do_not_spill(usage, name):
    if name in PINGPONG and not pingpong.HAVE_GLUON:
        pytest.skip(f"the Gluon ping-pong sweep is not enabled under Triton {triton.__version__}")
    assert usage[name]["stack"] <= HELD[name], f"{name}: {usage[name]['stack']} bytes of stack (spilled registers)"
