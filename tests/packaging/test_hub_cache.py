"""The Hub path without the Hub: a Hugging Face cache holding what scripts/upload.py puts on branch `v1`,
read by the real loader with HF_HUB_OFFLINE=1 (`get_kernel`, `has_kernel`, `kernels info`).

The cache (tests/hub_offline.py) is what `hf download --repo-type kernel trl-lib/fused-linear-ce
--revision v1` leaves: `kernels--trl-lib--fused-linear-ce/{blobs,snapshots/<commit>,refs/v1,trees}`.
On a CPU-only torch the `torch-cuda` and `torch-rocm` variants are refused with the loader's own
message; on a CUDA torch `torch-cuda` loads from the snapshot (and computes a loss when a GPU is
visible): that half runs in the GPU job. On a simulated ROCm torch (tests/simulated_gpu.py) and a
simulated CUDA one, each machine's variant loads from the snapshot.
No test here may reach the network: sockets are refused in process and in subprocesses.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from huggingface_hub import get_cached_repo_tree, snapshot_download
from hub_offline import build_hub_cache, guarded_env, offline_hub, version_branch_files
from kernels import Metadata, get_kernel, has_kernel
from kernels_api import KERNELS_CLI, versions
from kernels_api import VERSION as KERNELS_VERSION
from simulated_gpu import SimulatedGpu

REPO = Path(__file__).resolve().parents[2]
GENERAL = tomllib.loads((REPO / "build.toml").read_text(encoding="utf-8"))["general"]
REPO_ID = GENERAL["hub"]["repo-id"]
BACKENDS = GENERAL["backends"]  # a variant build/torch-<backend> each
# A GPU of each backend: (how SimulatedGpu makes one, its capability or gfx name).
GPU_OF = {"cuda": ("cuda", (9, 0)), "rocm": ("rocm", "gfx942")}
VERSION = Metadata.read_from_file(REPO / "metadata.json").version
BRANCH = f"v{VERSION}"
CACHE_FOLDER = "kernels--" + REPO_ID.replace("/", "--")  # kernels--trl-lib--fused-linear-ce
TORCH_IS_CUDA_BUILD = torch.version.cuda is not None
TORCH_IS_CPU_BUILD = torch.version.cuda is None and torch.version.hip is None
HAS_GPU = torch.cuda.is_available()



def branch_files() -> dict[str, bytes]:
    return version_branch_files(REPO)


def assert_variant_refusal(text: str, commit: str) -> None:
    """A CPU-only torch's refusal: the header, then every variant's backend on a line of its own (in the
    order the kernels version lists them)."""
    assert f"Cannot find a build variant for this system in {REPO_ID} (revision: {commit}):\n\n" in text, text[-2000:]
    lines = text.splitlines()
    for b in BACKENDS:
        line = f"torch-{b}: backend ({b}) does not match system backend (cpu) and is not universal"
        assert line in lines, text[-2000:]


def simulate(monkeypatch, backend: str) -> None:
    """torch reports a machine with one GPU of `backend` (GPU_OF), for this test."""
    kind, arch = GPU_OF[backend]
    getattr(SimulatedGpu(monkeypatch.setattr), kind)(arch)


def loaded_variant(kernel) -> str:
    return Path(kernel.__file__).parent.name


def forget_loaded(monkeypatch, variant: Path) -> None:
    """Drops, for this test, the module that shares ``variant``'s id: kernels 0.19 hands back a module
    already imported under the same id (from build/ by an earlier test) instead of the snapshot's."""
    module_id = Metadata.read_from_file(variant / "metadata.json").id
    for name in [n for n in sys.modules if n == module_id or n.startswith(module_id + ".")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """Offline mode with an empty cache in tmp_path (`offline_hub`)."""
    return offline_hub(monkeypatch, tmp_path / "hf_home")


def test_cache_layout_is_what_the_libraries_read(hub_cache):
    files = branch_files()
    commit, snapshot = build_hub_cache(hub_cache, REPO_ID, files, ref=BRANCH)
    assert snapshot == hub_cache / CACHE_FOLDER / "snapshots" / commit
    assert (hub_cache / CACHE_FOLDER / "refs" / BRANCH).read_text() == commit
    available = versions._get_available_versions_from_cache(REPO_ID)
    assert list(available) == [VERSION] and available[VERSION].target_commit == commit
    assert snapshot_download(REPO_ID, repo_type="kernel", revision=BRANCH, local_files_only=True) == str(snapshot)
    listed = get_cached_repo_tree(REPO_ID, repo_type="kernel", revision=BRANCH)
    assert sorted(f.path for f in listed) == sorted(files)
    for path, data in files.items():
        assert (snapshot / path).is_symlink() and (snapshot / path).read_bytes() == data


@pytest.mark.kernels_ci
def test_get_kernel_version_from_hub_cache_offline(hub_cache, monkeypatch):
    commit, snapshot = build_hub_cache(hub_cache, REPO_ID, branch_files(), ref=BRANCH)
    if TORCH_IS_CPU_BUILD:
        with pytest.raises(FileNotFoundError) as refused:
            get_kernel(REPO_ID, version=VERSION)
        assert_variant_refusal(str(refused.value), commit)
        return
    variant = snapshot / "build" / ("torch-cuda" if TORCH_IS_CUDA_BUILD else "torch-rocm")
    forget_loaded(monkeypatch, variant)
    kernel = get_kernel(REPO_ID, version=VERSION)
    assert Path(kernel.__file__).parent == variant
    assert kernel.__name__ == Metadata.read_from_file(variant / "metadata.json").id
    if HAS_GPU:
        gen = torch.Generator().manual_seed(0)
        hidden, weight = torch.randn(7, 24, generator=gen), torch.randn(37, 24, generator=gen) / 24**0.5
        targets = torch.randint(0, 37, (7,), generator=gen)
        loss = kernel.fused_linear_cross_entropy(hidden.cuda(), weight.cuda(), targets.cuda())
        expected = F.cross_entropy(hidden.double() @ weight.double().T, targets)
        assert abs(loss.item() - expected.item()) <= 1e-5


@pytest.mark.kernels_ci
def test_has_kernel_from_hub_cache_offline(hub_cache):
    """has_kernel resolves (cache, version, variant) without importing the module."""
    build_hub_cache(hub_cache, REPO_ID, branch_files(), ref=BRANCH)
    assert has_kernel(REPO_ID, version=VERSION) is not TORCH_IS_CPU_BUILD
    with pytest.raises(ValueError, match=f"Version {VERSION + 1} not found, available versions: {VERSION}"):
        has_kernel(REPO_ID, version=VERSION + 1)  # only FileNotFoundError becomes False


def test_kernels_info_cli_offline(tmp_path):
    hf_home = tmp_path / "hf_home"
    files = branch_files()
    commit, snapshot = build_hub_cache(hf_home / "hub", REPO_ID, files, ref=BRANCH)
    env = guarded_env(tmp_path, hf_home)

    def kernels_cli(*args):
        return subprocess.run([*KERNELS_CLI, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)

    # The cached snapshot, given as a path: answered from disk. 0.19 resolves a variant for this machine
    # first (a CPU-only torch has none in the snapshot), so there it is given the variant folder.
    path = snapshot if KERNELS_VERSION < (0, 19) or not TORCH_IS_CPU_BUILD else snapshot / "build" / "torch-cuda"
    local = kernels_cli("info", str(path), "--json")
    assert local.returncode == 0, local.stderr
    meta = json.loads(files["build/torch-cuda/metadata.json"])
    expected = {
        "path": str(path),
        "name": meta["name"],
        "version": meta["version"],
        "kernels_minver": meta["kernels-minver"],
        "license": meta["license"],
        "upstream": meta["upstream"],
        "source": meta["source"],
        "python_depends": [],
        "backends": BACKENDS,
    }
    info = json.loads(local.stdout)
    assert {key: info.get(key) for key in expected} == expected
    assert set(info) - set(expected) <= {"variant", "kernel_depends"}  # 0.19 adds these two
    # The repo id: the version resolves from refs/v1, but listing the variants is a Hub call
    # (`HfApi.list_repo_tree`), which offline mode refuses before any socket is opened.
    # 0.19 answers it from the cache (its HubCacheResolver), choosing this machine's variant.
    remote = kernels_cli("info", REPO_ID, "--version", str(VERSION))
    assert "network access refused" not in remote.stderr
    if KERNELS_VERSION < (0, 19):
        assert remote.returncode != 0
        assert "offline mode is enabled" in remote.stderr, remote.stderr[-2000:]
    elif not TORCH_IS_CPU_BUILD:
        assert remote.returncode == 0 and f"Minimum kernels version: {meta['kernels-minver']}" in remote.stdout
    else:
        assert remote.returncode != 0
        assert_variant_refusal(remote.stderr, commit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_machine_loads_its_variant_from_hub_cache_offline(hub_cache, monkeypatch, backend):
    """What scripts/upload.py puts on the version branch, read back offline on a (simulated) GPU of each
    backend: `get_kernel(version=1)` and `has_kernel` find that backend's variant."""
    build_hub_cache(hub_cache, REPO_ID, branch_files(), ref=BRANCH)
    simulate(monkeypatch, backend)
    kernel = get_kernel(REPO_ID, version=VERSION)
    assert loaded_variant(kernel) == f"torch-{backend}" and kernel.__name__.startswith(f"_fused_linear_ce_{backend}_")
    assert has_kernel(REPO_ID, version=VERSION) is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_left_by_an_online_get_kernel(hub_cache, monkeypatch, backend):
    """An online get_kernel(version=1) on a GPU machine downloads by commit hash (no refs/v1) and only
    its own variant's build/torch-<backend>/*, while huggingface_hub records the whole branch listing
    (the other variant too, and a Hub repo's .gitattributes). Offline, version=1 then cannot resolve;
    revision=<commit> loads the downloaded variant under 0.19, while 0.17 wants every listed file in
    the cache and finds no snapshot."""
    files = branch_files()
    downloaded = sorted(p for p in files if p.startswith(f"build/torch-{backend}/"))
    commit, _ = build_hub_cache(hub_cache, REPO_ID, files, ref=None, downloaded=downloaded)
    simulate(monkeypatch, backend)
    with pytest.raises(ValueError, match=f"Version {VERSION} of '{REPO_ID}' is not available in the local cache"):
        get_kernel(REPO_ID, version=VERSION)
    if KERNELS_VERSION < (0, 19):
        with pytest.raises(FileNotFoundError, match=re.escape(f"Cannot find a local snapshot for {REPO_ID}")):
            get_kernel(REPO_ID, revision=commit)
        assert has_kernel(REPO_ID, revision=commit) is False
    else:
        assert loaded_variant(get_kernel(REPO_ID, revision=commit)) == f"torch-{backend}"
