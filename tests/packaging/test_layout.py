"""The repo is a valid Hub kernel for `kernels` 0.17.2 and 0.19.1: build.toml, the metadata.json files and
build/ (a variant per backend: `torch-cuda`, `torch-rocm`).

Files are validated with the loader's own Rust parser (`kernels._rust`), not a copy of its rules.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from kernels._rust import Backend, Build, Metadata

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "torch-ext" / "fused_linear_ce"
VARIANT = REPO / "build" / "torch-cuda"
VARIANTS = {"cuda": VARIANT, "rocm": REPO / "build" / "torch-rocm"}
METADATA_FILES = {"top-level": REPO / "metadata.json", "build": VARIANT / "metadata.json",
                  "build-rocm": VARIANTS["rocm"] / "metadata.json"}
BACKEND_OF = {"top-level": Backend.CUDA, "build": Backend.CUDA, "build-rocm": Backend.ROCm}
ID_PATTERN = re.compile(r"_fused_linear_ce_(cuda|rocm)_[0-9a-f]{7}")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sync_build, symbols = _load_script("sync_build"), _load_script("symbols")


def _build_toml() -> dict:
    return tomllib.loads((REPO / "build.toml").read_text(encoding="utf-8"))


@pytest.fixture(params=sorted(METADATA_FILES), ids=str)
def metadata_path(request) -> Path:
    return METADATA_FILES[request.param]


@pytest.fixture(params=sorted(VARIANTS), ids=str)
def backend(request) -> str:
    return request.param


# --- build/ is what scripts/sync_build.py generates -------------------------------------------------


def test_build_is_up_to_date():
    problems = sync_build.check(REPO)
    assert not problems, "build/ is out of date; run `python3 scripts/sync_build.py`:\n" + "\n".join(problems)


def test_sources_are_flat_python_files():
    """The flat copy ships top-level .py files only; anything else in the package would be lost."""
    unshippable = [
        p.relative_to(SOURCE).as_posix()
        for p in SOURCE.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and not (p.parent == SOURCE and p.suffix == ".py")
    ]
    assert not unshippable, f"not copied into build/torch-* by scripts/sync_build.py: {unshippable}"


def test_build_id_is_derived_from_current_sources(backend):
    variant = VARIANTS[backend]
    meta = json.loads((variant / "metadata.json").read_bytes())
    expected = sync_build.kernel_id(meta, sync_build.source_files(REPO))
    assert ID_PATTERN.fullmatch(expected) and expected.startswith(f"_fused_linear_ce_{backend}_")
    assert Metadata.read_from_file(variant / "metadata.json").id == expected


def test_top_level_metadata_is_the_cuda_variant_s():
    """A clone's root is a valid CUDA variant metadata for kernels (kernels-layout: keep it valid)."""
    assert (REPO / "metadata.json").read_bytes() == (VARIANT / "metadata.json").read_bytes()


def test_a_variant_per_backend_with_the_same_sources():
    """build/ holds `torch-<backend>` for each of build.toml's backends; each ships every source
    byte-identical; the variants differ only in what names the backend (metadata, symbols' module)."""
    backends = _build_toml()["general"]["backends"]
    assert sorted(p.name for p in (REPO / "build").iterdir() if p.is_dir()) == sorted(f"torch-{b}" for b in backends)
    assert sorted(VARIANTS) == sorted(backends)
    sources = sync_build.source_files(REPO)
    listings = {}
    for backend, variant in VARIANTS.items():
        for name, data in sources.items():
            assert (variant / name).read_bytes() == data, f"{variant.name}/{name}"
        listings[backend] = set(Metadata.read_from_file(variant / "metadata.json").digest.files)
        symbols_doc = json.loads((variant / "symbols.json").read_bytes())
        assert symbols_doc["module"] == Metadata.read_from_file(variant / "metadata.json").id
    assert listings["cuda"] == listings["rocm"]


def test_each_variant_declares_the_record_s_archs(backend):
    """`backend.archs` of each variant is `archs.declared(backend)` of the package's record, as the
    package itself sees it (imported, not loaded the way sync_build loads it); ROCm's are gfx names."""
    from fused_linear_ce import archs

    raw = json.loads((VARIANTS[backend] / "metadata.json").read_bytes())
    assert raw["backend"] == {"type": backend, "archs": archs.declared(backend)}
    assert raw["backend"]["archs"], f"no archs declared for {backend}"
    if backend == "rocm":
        assert all(re.fullmatch(r"gfx[0-9a-f]+", a) for a in raw["backend"]["archs"])


def test_sync_build_check_sync_roundtrip(tmp_path):
    """--check reports a changed source, a stale file and a stale id, writes nothing; sync fixes all."""
    repo = tmp_path / "repo"
    shutil.copytree(SOURCE, repo / SOURCE.relative_to(REPO), ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("metadata.json", "build.toml"):
        shutil.copy(REPO / name, repo / name)
    script = REPO / "scripts" / "sync_build.py"

    missing = {line for line in sync_build.check(repo) if line.startswith("missing: ")}
    assert missing == {f"missing: {rel}" for rel in sync_build.expected_files(repo) if rel.startswith("build/")}
    sync_build.sync(repo)
    assert sync_build.check(repo) == []
    ok = subprocess.run([sys.executable, script, "--check", "--repo", repo], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr

    old_id = json.loads((repo / "metadata.json").read_bytes())["id"]
    with open(repo / SOURCE.relative_to(REPO) / "__init__.py", "a", encoding="utf-8") as f:
        f.write("# changed\n")
    stale = repo / "build" / "torch-cuda" / "removed_module.py"
    stale.write_text("x = 1\n")
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}

    bad = subprocess.run([sys.executable, script, "--check", "--repo", repo], capture_output=True, text=True)
    assert bad.returncode == 1
    for line in (
        "differs: build/torch-cuda/__init__.py",
        "differs: build/torch-cuda/metadata.json",
        "differs: build/torch-rocm/__init__.py",
        "differs: build/torch-rocm/metadata.json",
        "differs: metadata.json",
        "stale:   build/torch-cuda/removed_module.py",
    ):
        assert line in bad.stderr
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()} == before, "--check wrote files"

    sync_build.sync(repo)
    assert sync_build.check(repo) == []
    assert not stale.exists()
    new_id = json.loads((repo / "metadata.json").read_bytes())["id"]
    assert new_id != old_id and ID_PATTERN.fullmatch(new_id)


def test_sync_build_refuses_a_missing_or_malformed_record(tmp_path):
    """The variants come from build.toml's backends and archs.py's declared(): either wrong, and
    sync_build stops with a message naming the file, before anything is generated."""
    repo = tmp_path / "repo"
    shutil.copytree(SOURCE, repo / SOURCE.relative_to(REPO), ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("metadata.json", "build.toml"):
        shutil.copy(REPO / name, repo / name)
    record = repo / SOURCE.relative_to(REPO) / "archs.py"
    record.write_text(record.read_text() + "\n\ndef declared(backend):\n    return 'gfx942'\n")
    with pytest.raises(ValueError, match=r"archs.py: declared\('cuda'\) must be a list of arch names"):
        sync_build.expected_files(repo)
    record.unlink()
    with pytest.raises(FileNotFoundError, match="archs.py is missing"):
        sync_build.expected_files(repo)
    toml = repo / "build.toml"
    toml.write_text(toml.read_text().replace('backends = ["cuda", "rocm"]', 'backends = ["rocm"]'))
    with pytest.raises(ValueError, match=r"backends \['rocm'\] lack 'cuda'"):
        sync_build.expected_files(repo)
    assert not (repo / "build").exists()


def test_sync_build_is_deterministic():
    first = sync_build.expected_files(REPO)
    assert first == sync_build.expected_files(REPO)
    for rel, data in first.items():
        if rel.endswith("metadata.json"):
            assert data.endswith(b"\n") and data == sync_build.render_metadata(json.loads(data))
        elif rel.endswith(".json"):  # symbols.json keeps kernel-builder's key order
            assert data.endswith(b"\n") and data == symbols.render(json.loads(data))


# --- build.toml and metadata.json, through kernels' own parser --------------------------------------


def test_build_toml_parses_with_kernels_parser():
    build = Build.open(REPO)
    assert build.general.backends == [Backend.CUDA, Backend.ROCm]
    config = _build_toml()
    general = config["general"]
    assert general["edition"] == 5
    assert general["hub"]["repo-id"] == "trl-lib/fused-linear-ce"
    assert "torch-noarch" in config, "a Triton-only kernel is a [torch-noarch] build"


def test_metadata_parses_with_kernels_parser(metadata_path):
    meta = Metadata.read_from_file(metadata_path)
    assert ID_PATTERN.fullmatch(meta.id)
    name = next(k for k, v in METADATA_FILES.items() if v == metadata_path)
    assert meta.backend.backend_type == BACKEND_OF[name]


def test_build_toml_and_metadata_agree(metadata_path):
    general = _build_toml()["general"]
    meta = Metadata.read_from_file(metadata_path)
    raw = json.loads(metadata_path.read_bytes())
    assert str(meta.name) == general["name"] == "fused-linear-ce"
    assert meta.version == general["version"] == 1
    assert meta.license == general["license"] == "apache-2.0"
    assert general["backends"] == ["cuda", "rocm"] and raw["backend"]["type"] in general["backends"]
    assert meta.backend.backend_type in Build.open(REPO).general.backends


def test_minver_upstream_and_source(metadata_path):
    """What `kernels info` (0.19) shows: the oldest kernels the tests run under (the requirements pin,
    kernels' MinverValidator refuses older ones), and the project's public home (the Hub repo, whose
    branches hold the sources the loader runs) as both the upstream and the kernel-builder source
    (build.toml's [general] keys, which kernel-builder copies over)."""
    meta = Metadata.read_from_file(metadata_path)
    pins = re.findall(r"^kernels==([0-9.]+)$", (REPO / "requirements-test.txt").read_text(), re.M)
    assert pins and str(meta.kernels_minver) == pins[0]
    general = _build_toml()["general"]
    assert meta.upstream == meta.source == general["upstream"] == general["source"]
    assert meta.source == f"https://huggingface.co/{general['hub']['repo-id']}"


def test_python_depends_is_empty(metadata_path):
    """The loader refuses unlisted dependencies (e.g. "triton", which comes with torch anyway)."""
    assert Metadata.read_from_file(metadata_path).python_depends == []
    assert _build_toml()["general"].get("python-depends", []) == []


def test_license_file_is_apache_2():
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_flake_uses_current_kernel_builder_api():
    flake = (REPO / "flake.nix").read_text(encoding="utf-8")
    assert "github:huggingface/kernels" in flake
    assert "genKernelFlakeOutputs" in flake and "genFlakeOutputs" not in flake


# --- the package works when imported under its build id ---------------------------------------------


def _absolute_self_imports(path: Path, own_modules: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] in own_modules:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_package_imports_are_relative():
    """The loader imports the variant as `_fused_linear_ce_cuda_<hash>`: `import fused_linear_ce` breaks."""
    own_modules = {"fused_linear_ce"} | {p.stem for p in SOURCE.glob("*.py")}
    found = [hit for p in sorted(SOURCE.glob("*.py")) for hit in _absolute_self_imports(p, own_modules)]
    assert not found, "use relative imports (`from .x import y`):\n" + "\n".join(found)


# Runs in a fresh interpreter: spies on every torch.cuda entry point that queries or initialises a
# device, imports the variant through the real loader, and reports what was touched, split by caller:
# the kernel's own files (a frame under the variant's folder on the call's stack) or the loader
# (kernels 0.19 asks `torch.cuda.is_available()` itself, in its architecture check, on a CUDA build of
# torch). Only the kernel's calls are the kernel's to answer for.
_IMPORT_PROBE = r"""
import json, sys, traceback
from pathlib import Path
import torch, triton, kernels
from triton.runtime.driver import driver as triton_driver

FORBIDDEN = ("init", "_lazy_init", "is_available", "device_count", "current_device", "set_device",
             "get_device_capability", "get_device_properties", "get_device_name", "synchronize",
             "mem_get_info", "get_arch_list")
VARIANT = Path(sys.argv[1]).resolve()
calls = {"kernel": [], "loader": []}

def spy(name, fn):
    def wrapper(*args, **kwargs):
        files = [Path(frame.filename).resolve() for frame in traceback.extract_stack()[:-1]]
        calls["kernel" if any(VARIANT in f.parents for f in files) else "loader"].append(name)
        return fn(*args, **kwargs)
    return wrapper

for name in FORBIDDEN:
    if hasattr(torch.cuda, name):
        setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))

module = kernels.get_local_kernel(VARIANT)
print(json.dumps({
    "module": module.__name__,
    "module_file": str(Path(module.__file__).resolve()),
    "has_api": hasattr(module, "fused_linear_cross_entropy"),
    "cuda_calls": calls["kernel"],
    "loader_cuda_calls": calls["loader"],
    "cuda_initialized": torch.cuda.is_initialized(),
    "triton_driver_created": triton_driver._default is not None or triton_driver._active is not None,
}))
"""


def _probe_import(variant: Path, env: dict) -> dict:
    """The probe's report for ``variant`` imported through ``kernels.get_local_kernel`` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, str(variant)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.kernels_ci
@pytest.mark.parametrize("env_case", ["nix-sandbox", "inherited"])
def test_import_does_not_touch_the_gpu(env_case, backend):
    """kernel-builder imports each variant's build with get_local_kernel in a sandbox without a GPU: the
    kernel's own code asks torch.cuda nothing and creates no Triton driver (what the loader asks is its own)."""
    env = dict(os.environ)
    if env_case == "nix-sandbox":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.pop("TRITON_INTERPRET", None)
    report = _probe_import(VARIANTS[backend], env)
    assert report["module"] == Metadata.read_from_file(VARIANTS[backend] / "metadata.json").id
    assert VARIANTS[backend].resolve() in Path(report["module_file"]).parents  # the spy's attribution holds
    assert report["has_api"]
    assert report["cuda_calls"] == [], f"importing the kernel called torch.cuda.{report['cuda_calls']}"
    assert not report["cuda_initialized"]
    assert not report["triton_driver_created"], "importing the kernel created a Triton driver (GPU query)"


def test_import_probe_sees_the_kernels_own_calls(tmp_path):
    """The probe is not blind: a copy of the variant whose import asks ``torch.cuda.is_available()`` is caught."""
    copy = tmp_path / "torch-cuda"
    shutil.copytree(VARIANT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    init = next(copy.rglob("__init__.py"))
    init.write_text(init.read_text() + "\nimport torch as _t\n_t.cuda.is_available()\n")
    meta = json.loads((copy / "metadata.json").read_text())  # kernels 0.19 checks the digest: re-hash
    (copy / "metadata.json").write_bytes(sync_build.render_metadata(dict(meta, digest=sync_build.hash_variant(copy))))
    report = _probe_import(copy, dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert "is_available" in report["cuda_calls"], report  # a CUDA build's is_available asks device_count too


# The longest a host function may be, docstring included: one screen, read without scrolling back.
MAX_FUNCTION_LINES = 80


def _is_kernel(node) -> bool:
    """A ``@triton.jit`` / ``@gluon.jit`` function (a kernel or its helper: one program's code, kept whole)."""
    return any(ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith(("triton.jit", "gluon.jit"))
               for d in node.decorator_list)


def test_no_host_function_is_over_80_lines():
    """Every function of the package but the kernels fits MAX_FUNCTION_LINES, its docstring included."""
    long = []
    for path in sorted(SOURCE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"host functions over {MAX_FUNCTION_LINES} lines: {long}"


# Names that several modules define on purpose, each for its own instance of one role: a custom-op
# module's declaration (``custom_ops.define``: its options, implementations, fakes, autograd and
# ``apply``), a path's ``forward`` / ``backward`` and the ``_allocate`` of its gradients.
ROLE_NAMES = {"__all__", "FLOATS", "ARGS", "apply", "forward", "backward", "_forward_impl", "_forward_fake",
              "_backward_impl", "_backward_fake", "_gradients", "_setup_context", "_options", "_allocate"}


def _top_level_names(tree) -> set:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        else:
            targets = []
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def test_no_two_modules_define_one_name_for_two_things():
    """A top-level name defined in two package modules is one of ROLE_NAMES; any other is renamed."""
    where = {}
    for path in sorted(SOURCE.glob("*.py")):
        for name in _top_level_names(ast.parse(path.read_text())):
            where.setdefault(name, []).append(path.name)
    shared = {name: modules for name, modules in where.items() if len(modules) > 1 and name not in ROLE_NAMES}
    assert not shared, f"defined in several modules: {shared}"
