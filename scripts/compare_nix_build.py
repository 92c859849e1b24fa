#!/usr/bin/env python3
"""Compares a kernel-builder (Nix) build with the committed build/: CI's drift check.

`nix build .#bundle` (genKernelFlakeOutputs) leaves `result/<variant>/...` for every variant (one per
build.toml backend: `torch-cuda`, `torch-rocm`), plus
`result/benchmarks/` (a copy of benchmarks/) and, when the repo has a CARD.md template, `result/CARD.md`.
For a noarch Triton kernel a variant folder holds the `torch-ext/<module>/` files, `metadata.json`, and
what kernel-builder generates itself: `_ops.py` (a torch.ops namespace named after the build's git
revision) and `<module>/__init__.py` (a compatibility module for the nested layout).

The committed build/ (what scripts/upload.py publishes) is in sync when:
* the variant folders are the same;
* every committed file is in the Nix build with the same bytes, except metadata.json, whose keys must
  carry the same values there, `id` and `digest` excepted (Nix derives the id from the git revision,
  sync_build.py from the sources' digest; the digest covers each side's own generated files, so it
  differs by construction, and each side's is checked against its own files by kernels), and the
  compatibility module `<module>/__init__.py`, which both sides generate (each its own text; it must
  exist on both); keys only Nix writes (provenance, ...) are allowed; `kernels-minver` may be lower
  in the Nix build (ours is the oldest kernels our tests pass with; a higher one there is drift);
* `symbols.json` (the public functions and layers, for `kernels describe-api`) says the same on both
  sides once the package's name is set aside: kernel-builder imports the build under its own name,
  sync_build.py under the build id, and that name starts every `module` field and every annotation
  that names one of the package's classes;
* the Nix build has no other file than the generated ones above.

Usage: python3 scripts/compare_nix_build.py RESULT_DIR [--repo ROOT]   (exit 1 on drift)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IGNORED_KEYS = {"id", "digest"}
MINVER = "kernels-minver"
SYMBOLS = "symbols.json"


def _files(folder: Path) -> dict[str, Path]:
    return {
        p.relative_to(folder).as_posix(): p
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def _variants(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_dir() and p.name.startswith("torch")} if folder.is_dir() else set()


def compat_module(repo: Path) -> str:
    """The nested compatibility module both kernel-builder and scripts/sync_build.py generate."""
    module = json.loads((repo / "metadata.json").read_text(encoding="utf-8"))["name"].replace("-", "_")
    return f"{module}/__init__.py"


def generated_files(repo: Path) -> set[str]:
    return {"_ops.py", compat_module(repo)}


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")) if text else ()


def _metadata_problems(where: str, mine: dict, theirs: dict) -> list[str]:
    problems = []
    for key in sorted(set(mine) - IGNORED_KEYS):
        if key == MINVER and _version(theirs.get(key)) <= _version(mine[key]):
            continue
        if theirs.get(key) != mine[key]:
            problems.append(f"{where}: {key} is {theirs.get(key)!r} in the Nix build, {mine[key]!r} here")
    return problems


def relative_symbols(document: dict) -> dict:
    """symbols.json with the package's own name replaced by `<package>` in every string (the `module`
    fields, and annotations naming the package's classes, e.g. `<package>.trl_head.Replaced`)."""
    package = document.get("module") or "<package>"

    def relative(entry):
        if isinstance(entry, dict):
            return {k: relative(v) for k, v in entry.items()}
        if isinstance(entry, list):
            return [relative(v) for v in entry]
        if isinstance(entry, str):
            return "<package>" if entry == package else entry.replace(package + ".", "<package>.")
        return entry

    return relative(document)


def compare(result: Path, repo: Path = REPO) -> list[str]:
    """Differences between the Nix build in `result` and repo/build/, one line each; empty when in sync."""
    problems = []
    built, committed = _variants(result), _variants(repo / "build")
    for name in sorted(built - committed):
        problems.append(f"variant only in the Nix build: {name}")
    for name in sorted(committed - built):
        problems.append(f"variant only in build/: {name}")
    allowed_extra = generated_files(repo)
    compat = compat_module(repo)
    for variant in sorted(built & committed):
        nix, ours = _files(result / variant), _files(repo / "build" / variant)
        for rel, path in ours.items():
            where = f"{variant}/{rel}"
            if rel not in nix:
                problems.append(f"missing in the Nix build: {where}")
            elif rel == "metadata.json":
                mine = json.loads(path.read_text(encoding="utf-8"))
                theirs = json.loads(nix[rel].read_text(encoding="utf-8"))
                problems += _metadata_problems(where, mine, theirs)
            elif rel == SYMBOLS:
                mine = relative_symbols(json.loads(path.read_text(encoding="utf-8")))
                if relative_symbols(json.loads(nix[rel].read_text(encoding="utf-8"))) != mine:
                    problems.append(f"differs: {where} (beyond the package name)")
            elif rel == compat:
                continue  # generated on each side; present on both is what matters
            elif nix[rel].read_bytes() != path.read_bytes():
                problems.append(f"differs: {where}")
        for rel in sorted(set(nix) - set(ours) - allowed_extra):
            problems.append(f"only in the Nix build: {variant}/{rel}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="the Nix build output (e.g. ./result)")
    parser.add_argument("--repo", type=Path, default=REPO, help="repository root (default: this script's repo)")
    args = parser.parse_args(argv)
    if not args.result.is_dir():
        print(f"compare_nix_build.py: {args.result} is not a folder", file=sys.stderr)
        return 2
    problems = compare(args.result.resolve(), args.repo.resolve())
    if problems:
        print("build/ differs from the kernel-builder build:", file=sys.stderr)
        print("\n".join(f"  {line}" for line in problems), file=sys.stderr)
        return 1
    print(f"build/ matches the kernel-builder build in {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
