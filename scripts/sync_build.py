#!/usr/bin/env python3
"""Regenerates `build/torch-cuda/` (the noarch Triton variant the `kernels` loader imports) from sources.

What `kernel-builder` does for a noarch Triton kernel, without Nix:

* every `torch-ext/fused_linear_ce/*.py` is copied flat and byte-identical into `build/torch-cuda/`;
* `build/torch-cuda/metadata.json` is the top-level `metadata.json` (the single hand-edited source of
  the kernel's metadata) with `id` set to `_<python name>_<backend>_<7 hex>`, the hex being the start of
  a SHA-256 over the sorted source file names and contents (`source_digest`). The loader imports the
  variant under that id, so a changed source gives a new module name;
* the top-level `metadata.json` carries the same `id`, written back here, so that it stays a fully
  valid metadata file for `kernels` (see docs) and both files are byte-identical.

Everything under `build/` that is not expected is removed (`__pycache__/` and `*.pyc` are left alone:
git ignores them and the loader writes them). Output is deterministic: sorted JSON keys, two-space
indent, trailing newline.

Usage:
    python3 scripts/sync_build.py            # rewrite what differs, print what changed
    python3 scripts/sync_build.py --check    # write nothing; list differences, exit 1 if any

As a module (tests load it by path): `expected_files()`, `check()`, `sync()`, `kernel_id()`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "fused_linear_ce"
SOURCE_DIR = Path("torch-ext") / PACKAGE  # relative to the repo root
BUILD_DIR = Path("build")
VARIANT = "torch-cuda"
VARIANT_DIR = BUILD_DIR / VARIANT
METADATA = Path("metadata.json")
ID_HEX_DIGITS = 7  # kernels' convention for ids (`_<name>_<backend>_<7 hex>`)
# Keys the loader's parser requires besides `id` (checked here so a typo fails before the loader).
REQUIRED_KEYS = ("name", "version", "license", "python-depends", "backend")


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
    """The top-level metadata.json (its `id`, if any, is replaced by `kernel_id`)."""
    path = repo / METADATA
    meta = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{path}: missing required key(s) {missing}")
    return meta


def kernel_id(meta: dict, sources: dict[str, bytes]) -> str:
    """`_fused_linear_ce_cuda_<first 7 hex of source_digest>` for name `fused-linear-ce`, backend cuda."""
    python_name = meta["name"].replace("-", "_")
    return f"_{python_name}_{meta['backend']['type']}_{source_digest(sources)[:ID_HEX_DIGITS]}"


def render_metadata(meta: dict) -> bytes:
    return (json.dumps(meta, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def expected_files(repo: Path = REPO) -> dict[str, bytes]:
    """Every generated file, `{repo-relative posix path: bytes}`, the top-level metadata.json included."""
    sources = source_files(repo)
    meta = dict(read_metadata(repo))
    meta["id"] = kernel_id(meta, sources)
    metadata_bytes = render_metadata(meta)
    files = {(VARIANT_DIR / name).as_posix(): data for name, data in sources.items()}
    files[(VARIANT_DIR / "metadata.json").as_posix()] = metadata_bytes
    files[METADATA.as_posix()] = metadata_bytes
    return dict(sorted(files.items()))


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
    for rel, data in expected.items():
        path = repo / rel
        if not path.is_file() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    for rel in _existing_build_files(repo):
        if rel not in expected:
            (repo / rel).unlink()
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
