"""The portability matrix: every configuration the package can launch (``scripts/registers.py``)
compiled offline for each CUDA architecture the kernel declares (metadata.json's ``backend.archs``),
with that architecture's family of tables (``configs.FAMILY_TABLES``, ``device.family_of``) and TMA
from sm_90 on, held to what a launch there needs: it compiles; its shared memory fits the
architecture's per-block limit; it spills at most ``MAX_STACK`` bytes of registers a thread (the hot
loops otherwise run from local memory). No GPU needed: Triton compiles for any target, and its wheel
carries ptxas and cuobjdump.

Reported and not held: the pointer fallbacks of layouts TMA cannot take on the TMA architectures
(``REPORTED``). The newest Triton's matrix: ``scripts/registers_matrix.sh`` (a venv; not run
here). The README's GPU table and metadata.json say the same as ``ARCHS`` (the last test).

Runs the compiler, not the interpreter, in a subprocess without TRITON_INTERPRET; each distinct
configuration compiles once (``registers.compile_all``) and Triton's cache keeps the binaries, so a
second run takes seconds (a cold one ~4 minutes on two CPU cores, all seven architectures)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

REPO = Path(__file__).resolve().parents[2]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ARCHS = (80, 86, 89, 90, 100, 103, 120)
KB = 1024
# The shared memory a block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin): A100 163 KB;
# the Ampere / Ada consumer and inference parts and the RTX 50xx 99 KB; Hopper and B200 227 KB.
SHARED = {80: 163 * KB, 86: 99 * KB, 89: 99 * KB, 90: 227 * KB, 100: 227 * KB, 103: 227 * KB, 120: 99 * KB}
MAX_STACK = 256
# Pointer fallbacks of layouts a TMA descriptor cannot take (a strided or misaligned gradient), and
# a pair epilogue no table ships whole: compiled and fitted, their spills reported.
REPORTED = {"matmul, da^T, compensated, pointers", "matmul, compensated int8, unsplit"}


@pytest.fixture(scope="module")
def matrix():
    if not (TOOLS / "cuobjdump").exists() or not (TOOLS / "ptxas").exists():
        pytest.skip(f"this Triton install has no ptxas / cuobjdump under {TOOLS}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "registers.py"), "--json", "--arch",
                          *map(str, ARCHS)], env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    return {arch: [r for r in rows if r["arch"] == arch] for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_configuration_compiles_fits_and_holds_its_registers(matrix, arch):
    rows = matrix[arch]
    assert len(rows) >= 40, f"sm_{arch}: {len(rows)} configurations (the sweeps, products, gradients, divergence)"
    failed = [f"{r['name']}: {r['error']}" for r in rows if "error" in r]
    assert not failed, f"sm_{arch} does not compile: {failed}"
    over = [f"{r['name']}: {r['shared'] / KB:.1f} KB" for r in rows if r["shared"] > SHARED[arch]]
    assert not over, f"sm_{arch}: past its {SHARED[arch] // KB} KB of shared memory a block: {over}"
    held = {r["name"]: r["stack"] for r in rows if r["name"] not in REPORTED}
    spills = [f"{name}: {stack} B" for name, stack in held.items() if stack > MAX_STACK]
    assert not spills, f"sm_{arch}: spills past {MAX_STACK} bytes a thread: {spills}"
    assert all(0 < r["registers"] <= 255 for r in rows), arch


def test_every_path_is_in_the_matrix(matrix):
    """Each family compiles the same roles: the sweeps (metrics, per-token fields), the chunked sweep
    and its gradient kernels, dlogits, every matmul use, fp32, the divergence's row kernel."""
    names = {arch: {r["name"] for r in rows} for arch, rows in matrix.items()}
    needed = {"sweep", "sweep, metrics, ragged V", "sweep, every per-token field", "chunked sweep",
              "chunked sweep, class-major", "chunked sweep, softcap and bias", "chunked gradient, entropy and bias gradients",
              "dlogits, bias gradient", "dlogits, entropy gradient", "matmul, da^T, fp32 sum", "matmul, split K",
              "matmul, da^T, compensated 4-bit", "matmul, paired rows", "fp32 matmul, da^T, sum"}
    for arch in ARCHS:
        assert needed <= names[arch], (arch, needed - names[arch])
        assert any(n.startswith("divergence rows") for n in names[arch]), arch


def test_metadata_readme_and_matrix_agree():
    """metadata.json's archs (what ``kernels`` 0.19 lets load without check_arch=False), the README's
    GPU table and this matrix name the same architectures."""
    meta = json.loads((REPO / "metadata.json").read_text())
    assert meta["backend"]["archs"] == [f"{a // 10}.{a % 10}" for a in ARCHS]
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import registers
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert registers.ARCHS == ARCHS
    readme = (REPO / "README.md").read_text()
    section = readme.split("## GPUs", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| sm_")]
    named = {int(a) for line in rows for a in re.findall(r"sm_(\d+)", line.split("|")[1])}
    assert named == set(ARCHS), named
