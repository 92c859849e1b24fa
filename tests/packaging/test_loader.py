"""Loads the kernel through the real `kernels` loader (0.17.2 and 0.19.1), the three ways users and CI do.

(a) `get_local_kernel(repo / "build" / "torch-cuda")`: the variant folder itself; loads on any machine.
(b) `get_local_kernel(repo)`: variant resolution. A CUDA torch picks `build/torch-cuda`; a CPU-only torch
    rejects that variant, then takes the repo root as the variant folder because the top-level
    metadata.json is valid, and fails: 0.17 with "No kernel module found at: `<repo>`", 0.19 because the
    root's files do not match the digest.
(c) `get_kernel("trl-lib/fused-linear-ce", version=1)` with `LOCAL_KERNELS="trl-lib/fused-linear-ce=<path>"`:
    resolved from disk before the Hub is consulted; `version` (or `revision`) must still be given but is
    not compared with anything; `trust_remote_code` is not checked. `<path>` goes through (b)'s
    resolution, so the repo root behaves as in (b) and the variant folder loads anywhere.
(d) On a ROCm torch (simulated, tests/simulated_gpu.py) the repo root resolves to `build/torch-rocm`: the
    package imports there and computes a loss in a fresh interpreter. The loads at every declared gfx
    and kernels' refusal of an undeclared one are in test_kernels_tools.py.

Both variant folders, `build/torch-cuda` and `build/torch-rocm` (the same sources), go through (a).

The numerical check runs on CUDA when present, else on CPU under TRITON_INTERPRET=1 (set by
scripts/test.sh and conftest.py before Triton decorates the kernels).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernels import Metadata, get_kernel, get_loaded_kernels, get_local_kernel
from kernels_api import VERSION as KERNELS_VERSION
from kernels_api import resolver

pytestmark = pytest.mark.tier  # the GPU tier: every test of this file

REPO = Path(__file__).resolve().parents[2]
VARIANT = REPO / "build" / "torch-cuda"
VARIANTS = {"cuda": VARIANT, "rocm": REPO / "build" / "torch-rocm"}
HUB_REPO_ID = tomllib.loads((REPO / "build.toml").read_text(encoding="utf-8"))["general"]["hub"]["repo-id"]
VERSION = Metadata.read_from_file(REPO / "metadata.json").version

# What kernels.backends picks as the system backend: the torch build, not the presence of a GPU.
TORCH_IS_CUDA_BUILD = torch.version.cuda is not None
TORCH_IS_CPU_BUILD = torch.version.cuda is None and torch.version.hip is None
HAS_GPU = torch.cuda.is_available()
# The variant this torch build resolves to (None on a CPU-only build).
OWN_VARIANT = None if TORCH_IS_CPU_BUILD else VARIANTS["cuda" if TORCH_IS_CUDA_BUILD else "rocm"]


@pytest.fixture
def no_hub(monkeypatch):
    """Fails the test if the loader falls through to the Hub (network or Hub cache)."""

    def refuse(self, **kwargs):
        raise AssertionError(f"loader consulted the Hub for {kwargs['kernel'].repo_id}")

    monkeypatch.setattr(resolver.HubResolver, "resolve", refuse)
    monkeypatch.setattr(resolver.HubCacheResolver, "resolve", refuse)


def _repo_root_refusal():
    """What a CPU-only torch says to the repo root: it rejects `build/torch-cuda`, then takes the root
    itself as the variant folder (its metadata.json is valid). 0.17 finds no module there; 0.19 first
    checks the root's files against the digest, which lists the variant's files, and refuses."""
    if KERNELS_VERSION >= (0, 19):
        return pytest.raises(RuntimeError, match="the files do not match the digest in the metadata")
    return pytest.raises(FileNotFoundError, match=re.escape(f"No kernel module found at: `{REPO}`"))


def _loaded_metadata(module) -> Metadata:
    return next(k.metadata for k in get_loaded_kernels() if k.module is module)


# --- (a) the variant folder ----------------------------------------------------------------------


@pytest.fixture(params=sorted(VARIANTS), ids=str)
def variant(request) -> Path:
    return VARIANTS[request.param]


@pytest.mark.kernels_ci
def test_variant_folder_loads_with_its_metadata(variant, no_hub):
    kernel = get_local_kernel(variant)
    metadata = _loaded_metadata(kernel)
    assert kernel.__name__ == metadata.id == Metadata.read_from_file(variant / "metadata.json").id
    assert str(metadata.name) == "fused-linear-ce" and metadata.version == VERSION
    assert callable(kernel.fused_linear_cross_entropy)
    assert "fused_linear_cross_entropy" in kernel.__all__


@pytest.mark.kernels_ci
def test_variant_folder_loss_matches_float64_torch(variant, no_hub):
    if HAS_GPU:
        device = "cuda"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"
    else:
        pytest.skip("no CUDA GPU and TRITON_INTERPRET is not 1 (scripts/test.sh sets it)")
    kernel = get_local_kernel(variant)
    loss, expected = _small_loss(kernel, device)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert abs(loss.item() - expected.item()) <= LOSS_TOLERANCE, (loss.item(), expected.item())


LOSS_TOLERANCE = 1e-5  # fp32 inputs, a 37-token vocabulary: the kernel's fp32 sums against float64


def _small_loss(kernel, device):
    """The kernel's loss on a small fp32 case, and the float64 torch loss it must match."""
    gen = torch.Generator().manual_seed(0)
    n, h, v = 7, 24, 37  # odd sizes: partial tiles on every axis
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    targets = torch.randint(0, v, (n,), generator=gen)
    loss = kernel.fused_linear_cross_entropy(hidden.to(device), weight.to(device), targets.to(device))
    return loss, F.cross_entropy(hidden.double() @ weight.double().T, targets)


# --- (b) the repo root -----------------------------------------------------------------------------


@pytest.mark.kernels_ci
def test_repo_root_loads_on_gpu_torch_and_is_refused_on_cpu_torch(no_hub):
    if OWN_VARIANT is not None:
        # `build/torch-cuda` (or torch-rocm) is picked; same variant path, so the same module.
        assert get_local_kernel(REPO) is get_local_kernel(OWN_VARIANT)
    else:
        with _repo_root_refusal():
            get_local_kernel(REPO)


@pytest.mark.skipif(not TORCH_IS_CPU_BUILD, reason="the rejection trace names the CPU backend")
def test_cpu_torch_rejects_cuda_variant_without_top_level_metadata(tmp_path, no_hub):
    """Without the top-level metadata.json the refusal is the variant trace (what the layout doc says)."""
    repo = tmp_path / "repo"
    shutil.copytree(VARIANT, repo / "build" / "torch-cuda", ignore=shutil.ignore_patterns("__pycache__"))
    expected = (
        f"Cannot find a build variant for this system in {repo}:\n\n"
        "torch-cuda: backend (cuda) does not match system backend (cpu) and is not universal"
    )
    with pytest.raises(FileNotFoundError, match=re.escape(expected)):
        get_local_kernel(repo)
    with pytest.raises(ValueError, match="Invalid backend 'cuda', system supported backends: cpu"):
        get_local_kernel(VARIANT, backend="cuda")


# --- (c) get_kernel + LOCAL_KERNELS ----------------------------------------------------------------


@pytest.mark.kernels_ci
def test_get_kernel_via_local_kernels_repo_root(monkeypatch, no_hub):
    monkeypatch.setenv("LOCAL_KERNELS", f"{HUB_REPO_ID}={REPO}")
    if OWN_VARIANT is not None:
        assert get_kernel(HUB_REPO_ID, version=VERSION) is get_local_kernel(OWN_VARIANT)
    else:
        with _repo_root_refusal():
            get_kernel(HUB_REPO_ID, version=VERSION)


@pytest.mark.kernels_ci
def test_get_kernel_via_local_kernels_variant_folder(monkeypatch, no_hub):
    monkeypatch.setenv("LOCAL_KERNELS", f"{HUB_REPO_ID}={VARIANT}")
    kernel = get_kernel(HUB_REPO_ID, version=VERSION)
    assert kernel is get_local_kernel(VARIANT)
    assert callable(kernel.fused_linear_cross_entropy)


def test_get_kernel_needs_a_version_even_with_local_kernels(monkeypatch, no_hub):
    monkeypatch.setenv("LOCAL_KERNELS", f"{HUB_REPO_ID}={VARIANT}")
    with pytest.raises(ValueError, match="A kernel version or revision must be specified"):
        get_kernel(HUB_REPO_ID)


# --- (d) ROCm --------------------------------------------------------------------------------------

# Runs in a fresh interpreter, so that the package is first imported on the simulated machine.
_ROCM_PROBE = r"""
import json, sys
from pathlib import Path
sys.path[:0] = sys.argv[2:4]  # tests/ (simulated_gpu, kernels_api) and tests/packaging/ (this file)
from simulated_gpu import SimulatedGpu
SimulatedGpu.plain().rocm(sys.argv[4])
import torch
from kernels import get_local_kernel
from test_loader import _small_loss

kernel = get_local_kernel(Path(sys.argv[1]))
report = {"module": kernel.__name__, "variant": Path(kernel.__file__).parent.name}
loss, expected = _small_loss(kernel, "cpu")
report.update(loss=loss.item(), expected=expected.item())
print(json.dumps(report))
"""


@pytest.mark.skipif(HAS_GPU, reason="the probe computes on CPU tensors in the interpreter; a GPU runs (a)")
def test_rocm_torch_imports_the_rocm_variant_and_computes():
    """On a ROCm torch (gfx942, an MI300X) the clone's root loads build/torch-rocm: the package imports
    there without touching a GPU, and its loss (CPU tensors, the interpreter) matches float64 torch."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _ROCM_PROBE, str(REPO), str(tests.parent), str(tests), "gfx942"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["module"] == Metadata.read_from_file(VARIANTS["rocm"] / "metadata.json").id
    assert report["variant"] == "torch-rocm"
    assert abs(report["loss"] - report["expected"]) <= LOSS_TOLERANCE, report
