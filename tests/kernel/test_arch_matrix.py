"""The portability matrix: every configuration the package can launch (``scripts/registers.py``)
compiled offline for each target of each architecture family (``archs.ARCHS``: every CUDA
architecture metadata.json declares, and one gfx target a family of AMD parts), with that family's
tables, TMA and dot precision, held to what a launch there needs: it compiles; its shared memory (LDS
on AMD) fits the family's per-block limit; it spills at most ``MAX_STACK`` bytes of registers a
thread (a lane on AMD: scratch); it fits the register file. No GPU needed: Triton compiles for any
target, and its wheel carries ptxas and cuobjdump and the AMD backend.

Reported and not held: the pointer fallbacks of layouts TMA cannot take on the TMA architectures
(``REPORTED``). The newest Triton's matrix: ``scripts/registers_matrix.sh`` (a venv; not run here).
metadata.json's archs, the README's GPU table and docs/gpus.md's family table say what the records
say (the last tests).

Runs the compiler, not the interpreter, in a subprocess without TRITON_INTERPRET; each distinct
configuration compiles once (``registers.compile_all``) and Triton's cache keeps the binaries, so a
second run takes seconds (a cold one ~4 minutes on two CPU cores for the seven CUDA targets, ~1.5
more for the five AMD ones)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from fused_linear_ce import archs

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import registers  # noqa: E402

sys.path.remove(str(REPO / "scripts"))

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CUDA_TARGETS = registers.matrix_targets("cuda")
AMD_TARGETS = registers.matrix_targets("rocm")
KB = 1024
MAX_STACK = 256
# The registers a thread (lane) may hold: CUDA's 255; AMD's 256 VGPRs (and on CDNA 256 AGPRs beside).
MAX_REGISTERS = {"cuda": 255, "rocm": 256}
# Pointer fallbacks of layouts a TMA descriptor cannot take (a strided or misaligned gradient), and
# a pair epilogue no table ships whole: compiled and fitted, their spills reported.
REPORTED = {"matmul, da^T, compensated, pointers", "matmul, compensated int8, unsplit"}


def _compile(targets) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "registers.py"), "--json", "--arch", *targets],
                         env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    return {target: [r for r in rows if r["arch"] == target] for target in targets}


@pytest.fixture(scope="module")
def cuda_matrix():
    if not (TOOLS / "cuobjdump").exists() or not (TOOLS / "ptxas").exists():
        pytest.skip(f"this Triton install has no ptxas / cuobjdump under {TOOLS}")
    return _compile(CUDA_TARGETS)


@pytest.fixture(scope="module")
def amd_matrix():
    if not (Path(triton.__file__).parent / "backends" / "amd").is_dir():
        pytest.skip("this Triton install has no AMD backend")
    return _compile(AMD_TARGETS)


def check_target(rows, target, fewest=40):
    """``target``'s rows: at least ``fewest`` configurations, every one compiled, within the family's
    shared memory, stack and register file."""
    arch = registers.arch_of(target)
    assert len(rows) >= fewest, f"{target}: {len(rows)} configurations (the sweeps, products, gradients, divergence)"
    failed = [f"{r['name']}: {r['error']}" for r in rows if "error" in r]
    assert not failed, f"{target} does not compile: {failed}"
    over = [f"{r['name']}: {r['shared'] / KB:.1f} KB" for r in rows if r["shared"] > arch.shared]
    assert not over, f"{target}: past its {arch.shared // KB} KB of shared memory a block: {over}"
    held = {r["name"]: r["stack"] for r in rows if r["name"] not in REPORTED}
    spills = [f"{name}: {stack} B" for name, stack in held.items() if stack > MAX_STACK]
    assert not spills, f"{target}: spills past {MAX_STACK} bytes a thread: {spills}"
    limit = MAX_REGISTERS[arch.backend]
    assert all(0 < r["registers"] <= limit and r.get("agprs", 0) <= limit for r in rows), target


@pytest.mark.parametrize("target", CUDA_TARGETS)
def test_every_configuration_compiles_fits_and_holds_its_registers(cuda_matrix, target):
    check_target(cuda_matrix[target], target)


@pytest.mark.parametrize("target", AMD_TARGETS)
def test_every_configuration_compiles_for_amd_within_lds_and_scratch(amd_matrix, target):
    """As many configurations as a CUDA target without TMA; "ieee" dots where the family's take no
    "tf32"; no VGPR spilled to scratch at all."""
    check_target(amd_matrix[target], target)
    assert all(r["vgpr_spills"] == 0 for r in amd_matrix[target]), target


def test_every_path_is_in_the_matrix(cuda_matrix, amd_matrix):
    """Each family compiles the same roles: the sweeps (metrics, per-token fields), the chunked sweep
    and its gradient kernels, dlogits, every matmul use, fp32, the divergence's row kernel."""
    names = {target: {r["name"] for r in rows} for target, rows in {**cuda_matrix, **amd_matrix}.items()}
    needed = {"sweep", "sweep, metrics, ragged V", "sweep, every per-token field", "chunked sweep",
              "chunked sweep, class-major", "chunked sweep, softcap and bias",
              "chunked gradient, entropy and bias gradients",
              "dlogits, bias gradient", "dlogits, entropy gradient", "matmul, da^T, fp32 sum", "matmul, split K",
              "matmul, da^T, compensated 4-bit", "matmul, paired rows", "fp32 matmul, da^T, sum"}
    for target, have in names.items():
        assert needed <= have, (target, needed - have)
        assert any(n.startswith("divergence rows") for n in have), target


def test_the_matrix_covers_every_family():
    """Every record has matrix targets it declares; the CUDA matrix is every declared CUDA arch."""
    for arch in archs.ARCHS:
        assert arch.matrix and set(arch.matrix) <= set(arch.declares), arch.name
    assert [f"{t[:-1]}.{t[-1]}" for t in CUDA_TARGETS] == archs.declared("cuda")
    assert set(AMD_TARGETS) <= set(archs.declared("rocm"))


def test_metadata_declares_the_records_archs():
    """metadata.json's archs (what ``kernels`` 0.19 lets load without check_arch=False) are the CUDA
    records' (``archs.declared``, written by scripts/sync_build.py)."""
    meta = json.loads((REPO / "metadata.json").read_text())
    assert meta["backend"]["archs"] == archs.declared("cuda")


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of each row of the first table under ``heading`` (a markdown heading line)."""
    section = text.split(heading + "\n", 1)[1]
    rows = [line for line in section.split("\n## ", 1)[0].splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def arch_cell(arch: archs.Arch) -> str:
    """How the docs name a family's declared targets: "sm_86, sm_89"; "gfx1100, gfx1101"."""
    return ", ".join(t if t.startswith("gfx") else f"sm_{t.replace('.', '')}" for t in arch.declares)


def test_readme_gpu_table_says_what_the_records_say():
    """One README row a family (its declared targets, its GPUs); AMD rows say they were compiled
    offline for the matrix's targets, tested in the interpreter and not run on AMD hardware."""
    rows = {row[0]: row for row in _table_rows((REPO / "README.md").read_text(), "## GPUs")}
    for arch in archs.ARCHS:
        row = rows.get(arch_cell(arch))
        assert row is not None, f"README's GPU table has no row | {arch_cell(arch)} | {arch.gpus} | ... |"
        assert row[1] == arch.gpus, (arch.name, row[1])
        if arch.backend == "rocm":
            assert f"compiled offline for {', '.join(arch.matrix)}, tested in the interpreter, not run on AMD " \
                   "hardware" in row[2], row
    named = {a for cell in rows for a in re.findall(r"(?:sm_\d+|gfx\w+)", cell)}
    assert named == {a for arch in archs.ARCHS for a in re.findall(r"(?:sm_\d+|gfx\w+)", arch_cell(arch))}


def family_row(arch: archs.Arch) -> str:
    """docs/gpus.md's row of family ``arch``."""
    if arch.backend == "cuda":
        recognised = ", ".join(f"{major}.{minor}" for major, minor in arch.recognises)
    else:
        recognised = ", ".join(arch.recognises)
    cells = [arch.name, arch.backend, recognised, arch_cell(arch), arch.gpus, f"{arch.shared // KB} KB", str(arch.wave),
             "yes" if arch.tma else "no", arch.mma, "yes" if arch.tf32 else "no", "yes" if arch.pingpong else "no"]
    return "| " + " | ".join(cells) + " |"


def test_gpus_doc_family_table_is_the_records():
    """docs/gpus.md's family table has exactly one row a record, each cell the record's."""
    doc = (REPO / "docs" / "gpus.md").read_text()
    rows = ["| " + " | ".join(row) + " |" for row in _table_rows(doc, "## Families")]
    want = [family_row(arch) for arch in archs.ARCHS]
    assert rows == want, "docs/gpus.md's family table should read:\n" + "\n".join(want)
