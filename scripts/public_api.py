#!/usr/bin/env python3
"""Records and checks the kernel's public API: what a `version` of the Hub kernel promises.

The surface is the package's `__all__` (torch-ext/fused_linear_ce, imported as tests/conftest.py does)
and, for each name there: a function's parameters (name, kind, default); a module's public functions
(same), classes (those defined there, or re-exported and listed in its `__all__`) and UPPER_CASE
constants. It is committed as tests/public_api.json together with the
`version` of metadata.json it belongs to; tests/packaging/test_public_api.py fails when the code and the file
disagree.

Compatible within a version (docs/MAINTAINERS.md): new names, new keyword-only parameters with a
default. Everything else that changes is incompatible and needs the next `version` (a new Hub branch
`v<N+1>`): a removed or renamed name or parameter, a changed default, a positional parameter added,
removed or moved, a keyword-only parameter without a default. Semantics cannot be checked here.

Usage:
    python3 scripts/public_api.py            # compare code and snapshot; exit 1 if they differ
    python3 scripts/public_api.py --update   # rewrite the snapshot; refuses incompatible changes
                                             # unless metadata.json's version was bumped
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "fused_linear_ce"
SNAPSHOT = REPO / "tests" / "public_api.json"
POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")


def import_package(repo: Path = REPO) -> types.ModuleType:
    """The package from torch-ext/ (the already imported one if tests/conftest.py imported it)."""
    if PACKAGE not in sys.modules:
        sys.path.insert(0, str(repo / "torch-ext"))
    return importlib.import_module(PACKAGE)


def describe_function(fn) -> dict:
    params = []
    for p in inspect.signature(fn).parameters.values():
        entry = {"name": p.name, "kind": p.kind.name}
        if p.default is not inspect.Parameter.empty:
            entry["default"] = repr(p.default)
        params.append(entry)
    return {"kind": "function", "parameters": params}


def describe(obj, *, depth: int = 0) -> dict:
    if isinstance(obj, types.ModuleType) and depth == 0:
        members = {}
        exported = getattr(obj, "__all__", ())  # a name re-exported from another module is listed there
        for name, value in sorted(vars(obj).items()):
            if name.startswith("_") or isinstance(value, types.ModuleType):
                continue
            defined_here = getattr(value, "__module__", None) == obj.__name__ or name in exported
            if (inspect.isfunction(value) or inspect.isclass(value)) and defined_here:
                members[name] = describe(value, depth=1)
            elif name.isupper():
                members[name] = {"kind": "constant"}
        return {"kind": "module", "members": members}
    if inspect.isclass(obj):
        return {"kind": "class"}
    if callable(obj):
        return describe_function(obj)
    return {"kind": "constant"}


def surface(package: types.ModuleType) -> dict:
    names = list(package.__all__)
    return {"__all__": names, "names": {name: describe(getattr(package, name)) for name in names}}


def _param_changes(where: str, old: list[dict], new: list[dict]) -> tuple[list[str], list[str]]:
    """(incompatible, compatible) differences between two parameter lists."""
    bad, ok = [], []
    old_pos = [p for p in old if p["kind"] in POSITIONAL]
    new_pos = [p for p in new if p["kind"] in POSITIONAL]
    for i, p in enumerate(old_pos):
        q = new_pos[i] if i < len(new_pos) else None
        if q != p:
            bad.append(f"{where}: positional parameter {i} was {p}, is now {q}")
    for q in new_pos[len(old_pos):]:
        bad.append(f"{where}: positional parameter {q['name']!r} added (add keyword-only parameters instead)")
    old_rest = {p["name"]: p for p in old if p["kind"] not in POSITIONAL}
    new_rest = {p["name"]: p for p in new if p["kind"] not in POSITIONAL}
    for name, p in old_rest.items():
        if new_rest.get(name) != p:
            bad.append(f"{where}: parameter {p} is now {new_rest.get(name)}")
    for name, q in new_rest.items():
        if name in old_rest:
            continue
        if q["kind"] == "KEYWORD_ONLY" and "default" in q:
            ok.append(f"{where}: keyword-only parameter {name}={q['default']} added")
        else:
            bad.append(f"{where}: parameter {q} added without a default or not keyword-only")
    return bad, ok


def _entry_changes(where: str, old: dict, new: dict | None) -> tuple[list[str], list[str]]:
    if new is None:
        return [f"{where}: removed"], []
    if old["kind"] != new["kind"]:
        return [f"{where}: was a {old['kind']}, is now a {new['kind']}"], []
    if old["kind"] == "function":
        return _param_changes(where, old["parameters"], new["parameters"])
    if old["kind"] == "module":
        return _members_changes(where, old["members"], new["members"])
    return [], []


def _members_changes(where: str, old: dict, new: dict) -> tuple[list[str], list[str]]:
    bad, ok = [], []
    for name, entry in old.items():
        b, o = _entry_changes(f"{where}.{name}" if where else name, entry, new.get(name))
        bad, ok = bad + b, ok + o
    ok += [f"{where}.{name}: added" if where else f"{name}: added" for name in new if name not in old]
    return bad, ok


def classify(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(incompatible, compatible) changes from surface `old` to surface `new`."""
    return _members_changes("", old["names"], new["names"])


def current(repo: Path = REPO) -> dict:
    meta = json.loads((repo / "metadata.json").read_text(encoding="utf-8"))
    return {"version": meta["version"], **surface(import_package(repo))}


def render(snapshot: dict) -> str:
    return json.dumps(snapshot, indent=2, sort_keys=True) + "\n"


def update(path: Path, new: dict, *, allow_incompatible: bool = False) -> list[str]:
    """Writes `new` to `path`; returns the incompatible changes that stopped it (nothing written)."""
    if path.is_file() and not allow_incompatible:
        old = json.loads(path.read_text(encoding="utf-8"))
        bad, _ = classify(old, new)
        if bad and old["version"] == new["version"]:
            return bad
    path.write_text(render(new), encoding="utf-8")
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite tests/public_api.json")
    parser.add_argument(
        "--allow-incompatible", action="store_true", help="with --update: accept breaking changes (unpublished version only)"
    )
    args = parser.parse_args(argv)
    new = current()
    if args.update:
        bad = update(SNAPSHOT, new, allow_incompatible=args.allow_incompatible)
        if bad:
            print(f"incompatible with version {new['version']}; bump `version` in build.toml and metadata.json", file=sys.stderr)
            print("\n".join(f"  - {line}" for line in bad), file=sys.stderr)
            return 1
        print(f"wrote {SNAPSHOT.relative_to(REPO)}")
        return 0
    old = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    if old == new:
        print("public API matches tests/public_api.json")
        return 0
    bad, ok = classify(old, new)
    for title, lines in (("incompatible (needs the next version)", bad), ("compatible", ok)):
        if lines:
            print(f"{title}:\n" + "\n".join(f"  - {line}" for line in lines), file=sys.stderr)
    print("then: python3 scripts/public_api.py --update", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
