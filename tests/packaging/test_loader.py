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

The numerical check runs on CUDA when present, else on CPU under TRITON_INTERPRET=1 (set by
scripts/test.sh and conftest.py before Triton decorates the kernels).
"""

from __future__ import annotations

import os
import re
import shutil
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
HUB_REPO_ID = tomllib.loads((REPO / "build.toml").read_text(encoding="utf-8"))["general"]["hub"]["repo-id"]
VERSION = Metadata.read_from_file(REPO / "metadata.json").version

# What kernels.backends picks as the system backend: the torch build, not the presence of a GPU.
TORCH_IS_CUDA_BUILD = torch.version.cuda is not None
TORCH_IS_CPU_BUILD = torch.version.cuda is None and torch.version.hip is None
HAS_GPU = torch.cuda.is_available()


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


@pytest.mark.kernels_ci
def test_variant_folder_loads_with_its_metadata(no_hub):
    kernel = get_local_kernel(VARIANT)
    metadata = _loaded_metadata(kernel)
    assert kernel.__name__ == metadata.id == Metadata.read_from_file(VARIANT / "metadata.json").id
    assert str(metadata.name) == "fused-linear-ce" and metadata.version == VERSION
    assert callable(kernel.fused_linear_cross_entropy)
    assert "fused_linear_cross_entropy" in kernel.__all__


@pytest.mark.kernels_ci
def test_variant_folder_loss_matches_float64_torch(no_hub):
    if HAS_GPU:
        device = "cuda"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"
    else:
        pytest.skip("no CUDA GPU and TRITON_INTERPRET is not 1 (scripts/test.sh sets it)")
    kernel = get_local_kernel(VARIANT)
    gen = torch.Generator().manual_seed(0)
    n, h, v = 7, 24, 37  # odd sizes: partial tiles on every axis
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    targets = torch.randint(0, v, (n,), generator=gen)

    loss = kernel.fused_linear_cross_entropy(hidden.to(device), weight.to(device), targets.to(device))

    expected = F.cross_entropy(hidden.double() @ weight.double().T, targets)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert abs(loss.item() - expected.item()) <= 1e-5, (loss.item(), expected.item())


# --- (b) the repo root -----------------------------------------------------------------------------


@pytest.mark.kernels_ci
def test_repo_root_loads_on_cuda_torch_and_is_refused_on_cpu_torch(no_hub):
    if TORCH_IS_CUDA_BUILD:
        # `build/torch-cuda` is picked; same variant path, so the loader hands back the same module.
        assert get_local_kernel(REPO) is get_local_kernel(VARIANT)
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
    if TORCH_IS_CUDA_BUILD:
        assert get_kernel(HUB_REPO_ID, version=VERSION) is get_local_kernel(VARIANT)
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
