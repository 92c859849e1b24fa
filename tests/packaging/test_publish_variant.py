"""The published variant (build/torch-cuda): its committed digest is kernels' own re-hash of its files
(`kernels._rust.Digest`, what `kernels.verify.verify_variant` checks), leaving out what kernels leaves
out, and scripts/sync_build.py reports and fixes a stale one; the compatibility package an older
loader imports exports the flat package's names and loads the kernel alone. Sockets are refused
throughout. The upload that publishes it: test_publish.py."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEVICE, ON_GPU, REPO
from hub_offline import guarded_env, load_script, refuse_network
from kernels._rust import Digest, DigestValidationError, Metadata

sync_build = load_script("sync_build")
VARIANT = REPO / "build" / "torch-cuda"


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    refuse_network(monkeypatch)


def test_committed_digest_matches_the_variant_files():
    """What `kernels.verify.verify_variant` checks after the signature: re-hash the folder with the
    metadata's algorithm and validate. Fails when any variant file changed after sync_build ran."""
    meta = Metadata.read_from_file(VARIANT / "metadata.json")
    assert meta.digest is not None, "metadata.json has no digest: run `python3 scripts/sync_build.py`"
    meta.digest.validate(Digest.hash_variant(meta.digest.algorithm, VARIANT))
    raw = json.loads((VARIANT / "metadata.json").read_bytes())["digest"]
    files = {p.relative_to(VARIANT).as_posix() for p in VARIANT.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert raw["algorithm"] == "sha256"
    assert set(raw["files"]) == files - set(sync_build.DIGEST_EXCLUDED)
    assert "fused_linear_ce/__init__.py" in raw["files"]


def test_digest_leaves_out_what_kernels_leaves_out(tmp_path):
    """The digest is kernels' own: metadata.json, its signature and bytecode are not hashed, so the
    loader's __pycache__ and a later signature do not make it stale; any other file change does."""
    variant = tmp_path / "torch-cuda"
    shutil.copytree(VARIANT, variant, ignore=shutil.ignore_patterns("__pycache__"))
    meta = Metadata.read_from_file(variant / "metadata.json")
    (variant / "__pycache__").mkdir()
    (variant / "__pycache__" / "api.cpython-311.pyc").write_bytes(b"\0")
    (variant / "metadata.json.sigstore").write_text("{}")
    meta.digest.validate(Digest.hash_variant(meta.digest.algorithm, variant))
    (variant / "api.py").write_text("changed\n")
    (variant / "extra.py").write_text("x = 1\n")
    with pytest.raises(DigestValidationError) as e:
        meta.digest.validate(Digest.hash_variant(meta.digest.algorithm, variant))
    text = " ".join(str(v) for v in e.value.violations)
    assert "api.py" in text and "extra.py" in text


def test_sync_build_reports_and_fixes_a_stale_digest(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "torch-ext", repo / "torch-ext", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "build", repo / "build", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("metadata.json", "build.toml"):
        shutil.copy(REPO / name, repo / name)
    assert sync_build.check(repo) == []
    compat = repo / "build" / "torch-cuda" / "fused_linear_ce" / "__init__.py"
    compat.write_text("# old compat module\n")
    assert sync_build.check(repo) == ["differs: build/torch-cuda/fused_linear_ce/__init__.py"]
    # A hand-made metadata.json with a wrong digest is reported even when every other file is right.
    compat.write_bytes(sync_build.COMPAT_INIT.encode())
    meta = json.loads((repo / "metadata.json").read_bytes())
    meta["digest"]["files"]["api.py"] = "AAAA"
    for path in (repo / "metadata.json", repo / "build" / "torch-cuda" / "metadata.json"):
        path.write_bytes(sync_build.render_metadata(meta))
    assert sync_build.check(repo) == ["differs: build/torch-cuda/metadata.json", "differs: metadata.json"]
    sync_build.sync(repo)
    assert sync_build.check(repo) == []
    fixed = Metadata.read_from_file(repo / "build" / "torch-cuda" / "metadata.json")
    fixed.digest.validate(Digest.hash_variant(fixed.digest.algorithm, repo / "build" / "torch-cuda"))


def _import_as(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def test_compat_package_exports_the_flat_variant_symbols(monkeypatch):
    """An older loader imports build/torch-cuda/fused_linear_ce/__init__.py as a package of its own:
    it must import (its relative imports resolve one level up) and export the flat package's names."""
    for name in list(sys.modules):
        if name.startswith(("_flce_flat_test", "_flce_compat_test")):
            monkeypatch.delitem(sys.modules, name)
    flat = _import_as("_flce_flat_test", VARIANT / "__init__.py")
    compat_init = VARIANT / "fused_linear_ce" / "__init__.py"
    assert compat_init.read_text() == sync_build.COMPAT_INIT
    compat = _import_as("_flce_compat_test_a", compat_init)
    public = lambda m: sorted(n for n in vars(m) if not n.startswith("_"))  # noqa: E731
    assert sorted(compat.__all__) == sorted(flat.__all__)
    assert set(flat.__all__) <= set(public(compat)) and set(public(compat)) <= set(flat.__all__) | {"annotations"}
    # The flat package was already imported from this folder (here, and maybe earlier in the session by
    # the loader under its id): the compat package reuses such a module instead of importing a copy.
    reused = compat._variant
    assert Path(reused.__file__).resolve() == (VARIANT / "__init__.py").resolve()
    assert reused.__name__ != "_flce_compat_test_a._variant"
    for name in flat.__all__:
        assert getattr(compat, name) is getattr(reused, name), name


def test_compat_package_alone_loads_the_kernel(tmp_path):
    """In a fresh process (what an older loader sees): only the compat package is imported, under the
    python name, and its loss runs."""
    code = f"""
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("fused_linear_ce", {str(VARIANT / "fused_linear_ce" / "__init__.py")!r})
m = importlib.util.module_from_spec(spec); sys.modules["fused_linear_ce"] = m; spec.loader.exec_module(m)
d = {DEVICE.type!r}
h = torch.randn(4, 16, device=d); w = torch.randn(10, 16, device=d); t = torch.tensor([1, 2, 3, -100], device=d)
ref = torch.nn.functional.cross_entropy(h @ w.T, t)
print(sorted(m.__all__), float((m.fused_linear_cross_entropy(h, w, t) - ref).abs()))
"""
    env = guarded_env(tmp_path, tmp_path / "hf_home")
    if not ON_GPU:  # on a GPU the kernels compile for it
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    names, diff = proc.stdout.strip().rsplit(" ", 1)
    flat_all = ast.literal_eval(re.search(r"__all__ = (\[.*?\])", (VARIANT / "__init__.py").read_text(), re.S).group(1))
    assert names == repr(sorted(flat_all))
    assert float(diff) < 1e-4
