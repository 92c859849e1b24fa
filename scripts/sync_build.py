#!/usr/bin/env python3
"""Regenerates `build/torch-cuda/` and `build/torch-rocm/` (the noarch Triton variants the `kernels`
loader imports) from sources.

What `kernel-builder` does for a noarch Triton kernel, without Nix, for each backend of build.toml's
`[general] backends` (variant `torch-<backend>`):

* every `torch-ext/fused_linear_ce/*.py` is copied flat and byte-identical into the variant folder
  (the same sources for every backend: the package picks its tiles from the GPU at run time);
* the compatibility package `<variant>/fused_linear_ce/__init__.py` (`COMPAT_INIT`) is written
  for older `kernels` loaders, which import `<variant>/<python name>/__init__.py`: it imports the flat
  variant package one level up and re-exports its public names (kernel-requirements.md: "must contain
  an `__init__.py` file that exports the same symbols"; kernel-builder generates its own);
* `<variant>/metadata.json` is the top-level `metadata.json` (the single hand-edited source of the
  kernel's other metadata) with `backend` set to `{"type": <backend>, "archs": <declared archs>}`,
  `id` set to `_<python name>_<backend>_<7 hex>`, the hex being the start of a SHA-256 over the sorted
  source file names and contents (`source_digest`), and `digest` set to the variant's file digest
  (`variant_digest`). The loader imports the variant under that id, so a changed source gives a new
  module name, and each backend's build has its own;
* the declared archs come from the package's architecture record, `torch-ext/fused_linear_ce/archs.py`
  (`declared(backend)`: CUDA capabilities such as "9.0", ROCm gfx names such as "gfx942"), loaded by
  file path without torch (`declared_archs`); kernels 0.19 refuses a GPU they do not cover;
* `<variant>/symbols.json` lists the public functions (`__all__`) and layers (`layers.__all__`)
  for `kernels describe-api`, in kernel-builder's schema (`scripts/symbols.py`, which imports the staged
  variant in a child process under the build id); it is one of the variant's files, so the digest
  covers it and `--check` compares it;
* the top-level `metadata.json` is the CUDA variant's (`ROOT_BACKEND`), written back here, so that it
  stays a fully valid metadata file for `kernels` (see docs) and both files are byte-identical.

The `digest` (required by kernels' kernel-requirements.md since 0.17) is computed with kernels' own
hashing, `kernels._rust.Digest.hash_variant(DigestAlgorithm.SHA256, <variant folder>)`, the call
`kernels.verify.verify_variant` makes to re-hash a variant before `metadata.digest.validate(...)`.
It hashes every file of the variant folder except `metadata.json` itself (and its signature
`metadata.json.sigstore`) and `__pycache__/`, so the order is: the variant's other files first, then
the metadata that records their digest. To compute it without touching build/ (`--check`), the
expected variant files are staged in a temporary folder and hashed there. Serialised as kernels'
parser reads it: `{"algorithm": "sha256", "files": {relative path: base64 SHA-256}}`.

Everything under `build/` that is not expected is removed (`__pycache__/` and `*.pyc` are left alone:
git ignores them and the loader writes them). Output is deterministic: sorted JSON keys, two-space
indent, trailing newline.

Usage:
    python3 scripts/sync_build.py            # rewrite what differs, print what changed
    python3 scripts/sync_build.py --check    # write nothing; list differences, exit 1 if any

As a module (tests load it by path): `expected_files()`, `check()`, `sync()`, `backends()`,
`declared_archs()`, `variant_metadata()`, `kernel_id()`, `variant_digest()`, `hash_variant()`,
`symbols_json()`, `COMPAT_INIT`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import tomllib
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "fused_linear_ce"
SOURCE_DIR = Path("torch-ext") / PACKAGE  # relative to the repo root
BUILD_DIR = Path("build")
BUILD_TOML = Path("build.toml")
METADATA = Path("metadata.json")
ARCHS_MODULE = "archs"  # torch-ext/fused_linear_ce/archs.py: the architecture record, stdlib only
# The backend whose variant metadata is also the top-level metadata.json, the file kernels reads when it
# takes a clone's root as a variant.
ROOT_BACKEND = "cuda"
ID_HEX_DIGITS = 7  # kernels' convention for ids (`_<name>_<backend>_<7 hex>`)
# Keys the loader's parser requires besides `id` and `backend` (which are written here), checked so
# that a typo fails before the loader.
REQUIRED_KEYS = ("name", "version", "license", "python-depends")
DIGEST_ALGORITHM = "SHA256"  # kernels._rust.DigestAlgorithm member; written as "sha256"
# Files `Digest.hash_variant` leaves out of a variant's digest (checked by tests/packaging/test_publish_variant.py).
DIGEST_EXCLUDED = ("metadata.json", "metadata.json.sigstore")
SYMBOLS = "symbols.json"  # what `kernels describe-api` (0.19+) reads from the variant
SYMBOLS_SCRIPT = Path(__file__).resolve().with_name("symbols.py")
_symbols_cache: dict[str, bytes] = {}  # staged variant digest -> symbols.json, one import per content

# The nested compatibility package, `build/<variant>/<python name>/__init__.py`. It is imported by
# older loaders as a package of its own (under whatever name they choose), one folder below the flat
# modules, so a relative import cannot reach them: it loads the flat variant package by path, as a
# subpackage of itself (its relative imports `from .ops import ...` then resolve in the variant
# folder, and the torch.library namespace, derived from the top-level module name, stays this
# load's own), unless that exact folder is already imported (by the current loader, under the
# metadata id): then it reuses that module, so both entry points hand out the same objects.
COMPAT_INIT = '''"""Compatibility entry point for older `kernels` loaders, generated by scripts/sync_build.py.

Older loaders import `<variant>/<python name>/__init__.py`; the kernel itself is the flat package one
folder up (`<variant>/__init__.py`). This module loads that package and exports the same public names.
"""

import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

_VARIANT = _Path(__file__).resolve().parent.parent


def _load_flat_variant():
    init = _VARIANT / "__init__.py"
    for name, module in list(_sys.modules.items()):
        try:  # the module's own namespace: no lazy __getattr__ runs; None placeholders are skipped
            file = vars(module).get("__file__")
            if name != __name__ and isinstance(file, str) and _Path(file).resolve() == init:
                return module  # already imported (e.g. by the current loader, under the metadata id)
        except (TypeError, OSError, ValueError):
            continue
    name = f"{__name__}._variant"
    spec = _util.spec_from_file_location(name, init, submodule_search_locations=[str(_VARIANT)])
    module = _util.module_from_spec(spec)
    _sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        _sys.modules.pop(name, None)
        raise
    return module


_variant = _load_flat_variant()
__all__ = list(_variant.__all__)
globals().update({_name: getattr(_variant, _name) for _name in __all__})
'''


def _ignored(rel: Path) -> bool:
    """Bytecode the interpreter writes next to imported sources; never shipped, never compared."""
    return "__pycache__" in rel.parts or rel.suffix == ".pyc"


def source_files(repo: Path = REPO) -> dict[str, bytes]:
    """The shipped sources: `{file name: bytes}` of `torch-ext/fused_linear_ce/*.py`, sorted by name."""
    src = repo / SOURCE_DIR
    if not (src / "__init__.py").is_file():
        raise FileNotFoundError(f"{src / '__init__.py'} is missing: nothing to build")
    return {p.name: p.read_bytes() for p in sorted(src.glob("*.py")) if p.is_file()}


def source_digest(sources: dict[str, bytes]) -> str:
    """SHA-256 hex over `name NUL size NUL bytes` of each source, in sorted name order (unambiguous)."""
    h = hashlib.sha256()
    for name in sorted(sources):
        data = sources[name]
        h.update(name.encode("utf-8") + b"\0" + str(len(data)).encode("ascii") + b"\0")
        h.update(data)
    return h.hexdigest()


def read_metadata(repo: Path = REPO) -> dict:
    """The top-level metadata.json (its `backend`, `id` and `digest` are replaced per variant)."""
    path = repo / METADATA
    meta = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{path}: missing required key(s) {missing}")
    return meta


def backends(repo: Path = REPO) -> list[str]:
    """build.toml's `[general] backends` (what kernel-builder builds a variant for), in its order; they
    must include `ROOT_BACKEND` (the top-level metadata.json is its variant's)."""
    path = repo / BUILD_TOML
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: it names the backends to build")
    names = tomllib.loads(path.read_text(encoding="utf-8")).get("general", {}).get("backends")
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names) or not names:
        raise ValueError(f"{path}: [general] backends must be a non-empty list of backend names")
    if ROOT_BACKEND not in names:
        raise ValueError(f"{path}: [general] backends {names} lack {ROOT_BACKEND!r}, whose metadata is the top level's")
    return list(names)


def variant_dir(backend: str) -> Path:
    """`build/torch-<backend>`: the noarch variant folder kernels matches to a backend."""
    return BUILD_DIR / f"torch-{backend}"


def declared_archs(repo: Path, names: list[str]) -> dict[str, list[str]]:
    """`{backend: archs.declared(backend)}`, from the sources' architecture record. archs.py is loaded by
    file path as a submodule of a bare package whose `__path__` is the source folder, so its relative
    imports of other torch-free modules resolve while the package's `__init__` (torch) never runs; the
    modules are dropped from `sys.modules` afterwards."""
    source = repo / SOURCE_DIR
    path = source / f"{ARCHS_MODULE}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: it declares the archs each variant's metadata lists")
    package = f"_sync_build_sources_{hashlib.sha256(str(source).encode()).hexdigest()[:ID_HEX_DIGITS]}"
    before = set(sys.modules)
    sys.modules[package] = stub = types.ModuleType(package)
    stub.__path__ = [str(source)]
    try:
        spec = importlib.util.spec_from_file_location(f"{package}.{ARCHS_MODULE}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        declared = {name: module.declared(name) for name in names}
    finally:
        for name in set(sys.modules) - before:
            if name == package or name.startswith(package + "."):
                del sys.modules[name]
    for name, archs in declared.items():
        if not isinstance(archs, list) or not all(isinstance(a, str) and a for a in archs):
            raise ValueError(f"{path}: declared({name!r}) must be a list of arch names, got {archs!r}")
    return declared


def kernel_id(meta: dict, sources: dict[str, bytes]) -> str:
    """`_fused_linear_ce_<backend>_<first 7 hex of source_digest>` for name `fused-linear-ce`."""
    python_name = meta["name"].replace("-", "_")
    return f"_{python_name}_{meta['backend']['type']}_{source_digest(sources)[:ID_HEX_DIGITS]}"


def variant_metadata(base: dict, backend: str, archs: list[str], sources: dict[str, bytes]) -> dict:
    """A variant's metadata before its digest: `base` with its backend, declared archs and id."""
    meta = dict(base, backend={"type": backend, "archs": list(archs)})
    meta.pop("digest", None)
    meta["id"] = kernel_id(meta, sources)
    return meta


def render_metadata(meta: dict) -> bytes:
    return (json.dumps(meta, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def compat_path(meta: dict) -> str:
    """`<python name>/__init__.py`, relative to the variant folder."""
    return f"{meta['name'].replace('-', '_')}/__init__.py"


def variant_files(meta: dict, sources: dict[str, bytes]) -> dict[str, bytes]:
    """The variant's files other than metadata.json, `{path relative to the variant folder: bytes}`:
    the sources, the compatibility package, and `symbols.json` generated from the two."""
    files = dict(sources)
    files[compat_path(meta)] = COMPAT_INIT.encode("utf-8")
    files[SYMBOLS] = symbols_json(meta["id"], files)
    return dict(sorted(files.items()))


def _stage(files: dict[str, bytes], folder: Path) -> None:
    for rel, data in files.items():
        path = Path(folder, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def symbols_json(module_name: str, files: dict[str, bytes]) -> bytes:
    """`symbols.json` for a variant made of `files`, imported as `module_name` (the build id, the name
    the loader gives it): `scripts/symbols.py` in a child process on the files staged in a temporary
    folder. The import needs torch and Triton (never a GPU); a failure is raised with its output."""
    key = module_name + "\0" + source_digest(files)
    if key not in _symbols_cache:
        with tempfile.TemporaryDirectory(prefix="sync_build_symbols_") as tmp:
            variant, out = Path(tmp, "variant"), Path(tmp, SYMBOLS)
            _stage(files, variant)
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            proc = subprocess.run([sys.executable, str(SYMBOLS_SCRIPT), str(variant), module_name, str(out)],
                                  capture_output=True, text=True, env=env, cwd=tmp)
            if proc.returncode != 0:
                raise RuntimeError(f"{SYMBOLS} could not be generated (the package failed to import?):\n"
                                   f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
            _symbols_cache[key] = out.read_bytes()
    return _symbols_cache[key]


def hash_variant(variant_dir: Path) -> dict:
    """kernels' digest of a variant folder, as metadata.json stores it: the loader's own
    `kernels._rust.Digest.hash_variant` (what `kernels.verify.verify_variant` re-computes)."""
    try:
        from kernels._rust import Digest, DigestAlgorithm
    except ImportError as e:  # pragma: no cover - kernels is in requirements-test.txt
        raise RuntimeError("the digest needs the `kernels` package (pip install kernels)") from e
    digest = Digest.hash_variant(getattr(DigestAlgorithm, DIGEST_ALGORITHM), Path(variant_dir))
    return {"algorithm": str(digest.algorithm), "files": dict(sorted(digest.files.items()))}


def variant_digest(files: dict[str, bytes]) -> dict:
    """The digest the variant will have once `files` are its files (plus metadata.json, which the
    digest leaves out): the files are staged in a temporary folder and hashed there by kernels."""
    with tempfile.TemporaryDirectory(prefix="sync_build_") as tmp:
        _stage(files, Path(tmp))
        return hash_variant(Path(tmp))


def expected_files(repo: Path = REPO) -> dict[str, bytes]:
    """Every generated file, `{repo-relative posix path: bytes}`, the top-level metadata.json included.
    Ordered so that writing them in this order puts each variant's metadata.json after its files."""
    sources = source_files(repo)
    base = read_metadata(repo)
    names = backends(repo)
    archs = declared_archs(repo, names)
    files: dict[str, bytes] = {}
    for backend in names:
        meta = variant_metadata(base, backend, archs[backend], sources)
        files_of_variant = variant_files(meta, sources)
        meta["digest"] = variant_digest(files_of_variant)
        folder = variant_dir(backend)
        files.update({(folder / rel).as_posix(): data for rel, data in files_of_variant.items()})
        files[(folder / METADATA).as_posix()] = render_metadata(meta)
    files[METADATA.as_posix()] = files[(variant_dir(ROOT_BACKEND) / METADATA).as_posix()]
    return files


def _existing_build_files(repo: Path) -> list[str]:
    root = repo / BUILD_DIR
    if not root.exists():
        return []
    return sorted(
        p.relative_to(repo).as_posix()
        for p in root.rglob("*")
        if not p.is_dir() and not _ignored(p.relative_to(repo))
    )


def check(repo: Path = REPO) -> list[str]:
    """Differences between the tree and `expected_files()`, one line each; empty when in sync."""
    expected = expected_files(repo)
    problems = []
    for rel, data in expected.items():
        path = repo / rel
        if not path.is_file():
            problems.append(f"missing: {rel}")
        elif path.read_bytes() != data:
            problems.append(f"differs: {rel}")
    for rel in _existing_build_files(repo):
        if rel not in expected:
            problems.append(f"stale:   {rel}")
    return problems


def sync(repo: Path = REPO) -> list[str]:
    """Writes what differs, removes stale files under build/; returns the change lines."""
    changes = check(repo)
    expected = expected_files(repo)
    # Stale files first, so that the variant folder holds exactly the digested files when its
    # metadata.json (written last, see expected_files) lands.
    for rel in _existing_build_files(repo):
        if rel not in expected:
            (repo / rel).unlink()
    for rel, data in expected.items():
        path = repo / rel
        if not path.is_file() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    # Drop folders that the removals left empty.
    build = repo / BUILD_DIR
    for d in sorted((p for p in build.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if d.name != "__pycache__" and not any(d.iterdir()):
            d.rmdir()
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if build/ is out of date")
    parser.add_argument("--repo", type=Path, default=REPO, help="repository root (default: this script's repo)")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    if args.check:
        problems = check(repo)
        if problems:
            print("build/ is out of date; run `python3 scripts/sync_build.py`:", file=sys.stderr)
            for line in problems:
                print(f"  {line}", file=sys.stderr)
            return 1
        print("build/ is up to date")
        return 0
    changes = sync(repo)
    for line in changes:
        print(line)
    print(f"build/ synced ({len(changes)} change(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
