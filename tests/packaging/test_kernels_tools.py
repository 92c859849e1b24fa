"""What kernels' own tools read from the published variant, under the declared minimum and kernels 0.19.1.

* `symbols.json` (0.19's `kernels describe-api`): written by scripts/sync_build.py from the package's
  `__all__` and `layers.__all__` (scripts/symbols.py), in kernel-builder's schema.
* The architecture check: 0.19's loaders (and 0.17's get_kernel) refuse a GPU whose compute capability
  (CUDA) or gfx name (ROCm) the variant's `metadata.json` `backend.archs` does not cover, unless
  `check_arch=False`. Each load users make is tried at sm_80 through sm_120 and at each declared arch
  on a simulated CUDA machine, and at each declared gfx and an undeclared one (gfx908) on a simulated
  ROCm machine (tests/simulated_gpu.py: torch reports the build, a GPU and its capability or
  gcnArchName; kernels' variant resolution and validators then run as on that GPU; nothing launches).
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hub_offline import load_script
from kernels import Metadata, get_kernel, get_local_kernel
from kernels_api import HAS_DESCRIBE_API, KERNELS_CLI, LOCAL_CHECK_ARCH, cli_main
from simulated_gpu import SimulatedGpu

REPO = Path(__file__).resolve().parents[2]
CUDA_VARIANT, ROCM_VARIANT = "torch-cuda", "torch-rocm"
VARIANT = REPO / "build" / CUDA_VARIANT
META = json.loads((VARIANT / "metadata.json").read_bytes())
ROCM_META = json.loads((REPO / "build" / ROCM_VARIANT / "metadata.json").read_bytes())
UNDECLARED_GFX = "gfx908"  # MI100 (CDNA1): no record declares it
HUB_REPO_ID = tomllib.loads((REPO / "build.toml").read_text(encoding="utf-8"))["general"]["hub"]["repo-id"]
# What `describe-api` must list (the issue's list; the rest of __all__'s functions come along).
REQUIRED_FUNCTIONS = {"fused_linear_cross_entropy", "fused_linear_logprobs", "fused_linear_divergence",
                      "patch_model", "unpatch_model", "use_in_trl"}
CAPABILITIES = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]  # A100 .. RTX 5090
REFUSED = "does not support the current device"

sync_build = load_script("sync_build")
symbols = load_script("symbols")


def _symbols() -> dict:
    return json.loads((VARIANT / "symbols.json").read_bytes())


def _package():
    return get_local_kernel(VARIANT)


# --- symbols.json ----------------------------------------------------------------------------------


def test_symbols_json_is_the_package_surface():
    doc, package = _symbols(), _package()
    assert doc["schema_version"] == 1 and doc["module"] == META["id"] == package.__name__
    functions = [n for n in package.__all__ if inspect.isfunction(getattr(package, n))]
    assert [f["name"] for f in doc["functions"]] == functions
    assert REQUIRED_FUNCTIONS <= set(functions)
    layers = [n for n in package.layers.__all__ if inspect.isclass(getattr(package.layers, n))]
    assert [layer["name"] for layer in doc["layers"]] == layers and layers
    entries = [(e, package) for e in doc["functions"]] + [(e, package.layers) for e in doc["layers"]]
    for entry, module in entries:
        obj = getattr(module, entry["name"])
        assert entry["qualname"] == obj.__qualname__ and entry["module"] == obj.__module__
        assert entry["module"].startswith(META["id"] + ".") and entry["doc"] == inspect.getdoc(obj)
        assert [p["name"] for p in entry["signature"]["parameters"]] == list(inspect.signature(obj).parameters)
    for layer in doc["layers"]:
        cls = getattr(package.layers, layer["name"])
        assert layer["kind"] == "class" and layer["attributes"] == {
            "has_backward": cls.has_backward, "can_torch_compile": cls.can_torch_compile}
        assert all(isinstance(v, bool) for v in layer["attributes"].values())
    assert all(f["kind"] == "function" for f in doc["functions"])


def test_symbols_json_is_digested_and_follows_the_sources():
    assert "symbols.json" in Metadata.read_from_file(VARIANT / "metadata.json").digest.files
    sources = sync_build.source_files(REPO)
    meta = dict(sync_build.read_metadata(REPO), id=META["id"])
    files = sync_build.variant_files(meta, sources)
    assert files["symbols.json"] == (VARIANT / "symbols.json").read_bytes()
    # A layer attribute changes in the sources: the generated file changes with it (and so --check fails).
    layers_py = sources["layers.py"].decode()
    assert layers_py.count("    has_backward = True\n") >= 1
    sources["layers.py"] = layers_py.replace("    has_backward = True\n", "    has_backward = False\n", 1).encode()
    changed = json.loads(sync_build.variant_files(meta, sources)["symbols.json"])
    assert changed != _symbols() and False in [l["attributes"]["has_backward"] for l in changed["layers"]]


def test_symbols_generator_refuses_a_bad_all():
    module = type(inspect)("example")
    module.__all__ = ["missing"]
    with pytest.raises(ValueError, match="names a missing symbol: 'missing'"):
        symbols.describe(module)
    module.__all__ = "missing"
    with pytest.raises(ValueError, match="must be a list or tuple of strings"):
        symbols.describe(module)


@pytest.mark.skipif(not HAS_DESCRIBE_API, reason="`kernels describe-api` is new in kernels 0.19")
@pytest.mark.parametrize("variant", [CUDA_VARIANT, ROCM_VARIANT])
def test_kernels_describe_api_lists_functions_and_layers(tmp_path, variant):
    proc = subprocess.run([*KERNELS_CLI, "describe-api", str(REPO / "build" / variant), "--json"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout)
    assert REQUIRED_FUNCTIONS <= {f["name"] for f in info["functions"]}
    assert {"ForCausalLMLoss", "LinearCrossEntropy"} <= {layer["name"] for layer in info["layers"]}
    for layer in info["layers"]:
        assert set(layer["attributes"]) == {"has_backward", "can_torch_compile"}
        assert all(isinstance(v, bool) for v in layer["attributes"].values())


def test_kernels_info_of_the_clone_shows_minver_upstream_and_source(machine, monkeypatch, capsys):
    """`kernels info .` in a clone, as on a CUDA machine (simulated sm_90): the metadata users see."""
    machine.cuda((9, 0))
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["kernels", "info", ".", "--json"])
    cli_main()()
    info = json.loads(capsys.readouterr().out)
    expected = {"name": META["name"], "version": META["version"], "kernels_minver": META["kernels-minver"],
                "upstream": META["upstream"], "source": META["source"], "backends": ["cuda", "rocm"]}
    assert {key: info.get(key) for key in expected} == expected
    assert info.get("variant", "torch-cuda") == "torch-cuda"  # 0.19 names the variant it resolved


# --- the architecture check --------------------------------------------------------------------------


def covers(archs: list[str], capability: tuple[int, int]) -> bool:
    """Whether declared CUDA archs cover a capability, by the rules kernels documents: `X.Y` runs on
    X.Y' with Y' >= Y, `X.Ya` only on X.Y, `X.Yf` like `X.Y`, `+PTX` on anything at or above."""
    for arch in archs:
        m = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", arch)
        assert m, f"unexpected arch string {arch!r}"
        major, minor = int(m[1]), int(m[2])
        if m[3] == "a":
            ok = capability == (major, minor)
        elif m[4]:
            ok = capability >= (major, minor)
        else:
            ok = capability[0] == major and capability[1] >= minor
        if ok:
            return True
    return False


@pytest.fixture
def machine(monkeypatch) -> SimulatedGpu:
    """Makes torch report a CUDA or ROCm build with one GPU, as the test sets (undone after it)."""
    return SimulatedGpu(monkeypatch.setattr)


def _loads(folder: Path, monkeypatch, variant: str = CUDA_VARIANT, **check):
    """The three loads of a clone-like folder: the folder, its variant, get_kernel via LOCAL_KERNELS."""
    local_check = check if LOCAL_CHECK_ARCH else {}
    monkeypatch.setenv("LOCAL_KERNELS", f"{HUB_REPO_ID}={folder}")
    return [lambda: get_local_kernel(folder, **local_check),
            lambda: get_local_kernel(folder / "build" / variant, **local_check),
            lambda: get_kernel(HUB_REPO_ID, version=META["version"], **check)]


def _variant_of(module) -> str:
    """The variant folder a loaded kernel was imported from."""
    return Path(module.__file__).parent.name


def declared_capabilities(archs: list[str]) -> set[tuple[int, int]]:
    return {(int(m[1]), int(m[2])) for m in (re.match(r"(\d+)\.(\d+)", a) for a in archs or []) if m}


def _assert_arch_policy(folder: Path, archs, machine, monkeypatch):
    """Each capability of CAPABILITIES and each declared one: the CUDA variant loads when covered (or
    unchecked)."""
    for capability in sorted(set(CAPABILITIES) | declared_capabilities(archs)):
        machine.cuda(capability)
        for n, load in enumerate(_loads(folder, monkeypatch)):
            checked = n == 2 or LOCAL_CHECK_ARCH  # 0.17's get_local_kernel has no arch check
            if not archs or covers(archs, capability) or not checked:
                kernel = load()
                assert callable(kernel.fused_linear_cross_entropy), (capability, n)
                assert _variant_of(kernel) == CUDA_VARIANT, (capability, n)
            else:
                with pytest.raises(RuntimeError, match=REFUSED):
                    load()
        for load in _loads(folder, monkeypatch, check_arch=False):
            assert _variant_of(load()) == CUDA_VARIANT


def test_every_load_at_every_gpu_with_the_arch_check_on(machine, monkeypatch):
    """The repo as published: with no `backend.archs` every capability loads; with archs declared,
    those they cover load and the others are refused unless check_arch=False."""
    _assert_arch_policy(REPO, META["backend"].get("archs"), machine, monkeypatch)


def test_declared_archs_refuse_other_gpus(tmp_path, machine, monkeypatch):
    """The same policy on a copy whose metadata declares three archs (the digest leaves metadata.json
    out, so the copy stays valid): sm_75, sm_80/86/89 and sm_90 load, sm_100 and sm_120 are refused."""
    clone = tmp_path / "clone"
    shutil.copytree(VARIANT, clone / "build" / "torch-cuda", ignore=shutil.ignore_patterns("__pycache__"))
    meta = dict(META, backend={**META["backend"], "archs": ["8.0", "9.0a", "7.5"]})
    for path in (clone / "metadata.json", clone / "build" / "torch-cuda" / "metadata.json"):
        path.write_bytes(sync_build.render_metadata(meta))
    assert [covers(meta["backend"]["archs"], c) for c in CAPABILITIES] == [True] * 4 + [False] * 2
    _assert_arch_policy(clone, meta["backend"]["archs"], machine, monkeypatch)


# --- ROCm: build/torch-rocm ---------------------------------------------------------------------------


def test_rocm_loads_the_rocm_variant_on_each_declared_gfx(machine, monkeypatch):
    """On a ROCm torch, the clone, build/torch-rocm and get_kernel via LOCAL_KERNELS all load the
    torch-rocm variant (its own id) on every gfx its metadata declares, the arch check on."""
    archs = ROCM_META["backend"]["archs"]
    assert archs and UNDECLARED_GFX not in archs
    for gfx in archs:
        machine.rocm(gfx)
        for n, load in enumerate(_loads(REPO, monkeypatch, ROCM_VARIANT, check_arch=True)):
            kernel = load()
            assert kernel.__name__ == ROCM_META["id"] and _variant_of(kernel) == ROCM_VARIANT, (gfx, n)
            assert callable(kernel.fused_linear_cross_entropy)


def test_rocm_refuses_an_undeclared_gfx_with_kernels_message(machine, monkeypatch):
    """kernels' own refusal for a gfx the variant does not declare (0.17's get_local_kernel has no
    check and loads); check_arch=False loads everywhere."""
    machine.rocm(UNDECLARED_GFX)
    refused = (f"Kernel 'fused-linear-ce' variant '{ROCM_VARIANT}' does not support the current device: "
               f"ROCm arch {UNDECLARED_GFX} of the current device is not supported by the architectures "
               f"of the build: {', '.join(ROCM_META['backend']['archs'])}")
    for n, load in enumerate(_loads(REPO, monkeypatch, ROCM_VARIANT)):
        if n == 2 or LOCAL_CHECK_ARCH:
            with pytest.raises(RuntimeError, match=re.escape(refused)):
                load()
        else:
            assert _variant_of(load()) == ROCM_VARIANT
    for load in _loads(REPO, monkeypatch, ROCM_VARIANT, check_arch=False):
        assert _variant_of(load()) == ROCM_VARIANT
