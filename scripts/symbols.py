#!/usr/bin/env python3
"""Writes a variant's `symbols.json`: the public functions and layers that `kernels describe-api` (0.19+)
lists without importing the kernel.

The schema is kernel-builder's (`schema_version` 1), read by kernels' `describe-api`:

    {"schema_version": 1, "module": <module name>,
     "functions": [<symbol>, ...],   # Python functions named in the package's __all__, in its order
     "layers": [<symbol>, ...]}      # classes named in layers.__all__, in its order

where a symbol is `{"name", "qualname", "module", "kind" ("function" or "class"), "doc" (inspect.getdoc),
"signature": {"parameters": [{"name", "kind", "default", "annotation"}], "return_annotation"} or null}`
(defaults as `repr`, annotations unevaluated, absent ones null) and a layer adds
`"attributes": {"has_backward": bool or null, "can_torch_compile": bool or null}`. Names starting with
`_`, the `layers` module itself, and exports that are neither (modules, classes at the top level such as
`ChunkedLogProbFunction`, data) are left out, as kernel-builder leaves them out.

The package is imported (kernel-builder does the same at build time), so this runs in a child process
of `scripts/sync_build.py`: the import needs torch and Triton but never touches a GPU, and the caller's
`sys.modules` stays clean. The module name is the build's `id`, the name the loader imports it under.

Usage: python3 scripts/symbols.py <variant folder> <module name> <output file>
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path

SCHEMA_VERSION = 1
LAYER_ATTRIBUTES = ("has_backward", "can_torch_compile")


def _annotation(value) -> str | None:
    return None if value is inspect.Parameter.empty else inspect.formatannotation(value)


def signature_of(obj) -> dict | None:
    """`inspect.signature` as JSON, string annotations left as written; None when there is none."""
    try:
        sig = inspect.signature(obj, eval_str=False)
    except (TypeError, ValueError):
        return None
    params = [{"name": p.name, "kind": p.kind.name,
               "default": None if p.default is inspect.Parameter.empty else repr(p.default),
               "annotation": _annotation(p.annotation)} for p in sig.parameters.values()]
    return {"parameters": params, "return_annotation": _annotation(sig.return_annotation)}


def symbol_of(name: str, obj) -> dict:
    is_class = inspect.isclass(obj)
    entry = {"name": name, "qualname": obj.__qualname__, "module": obj.__module__,
             "kind": "class" if is_class else "function", "doc": inspect.getdoc(obj),
             "signature": signature_of(obj)}
    if is_class:
        entry["attributes"] = {a: v if isinstance(v := getattr(obj, a, None), bool) else None
                               for a in LAYER_ATTRIBUTES}
    return entry


def exports(module, keep) -> list[dict]:
    """The names of `module.__all__` (first occurrence, in order) whose objects satisfy `keep`."""
    names = getattr(module, "__all__", ())
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{module.__name__}.__all__ must be a list or tuple of strings")
    out = []
    for name in dict.fromkeys(names):
        if name.startswith("_") or name == "layers":
            continue
        if not hasattr(module, name):
            raise ValueError(f"{module.__name__}.__all__ names a missing symbol: {name!r}")
        obj = getattr(module, name)
        if keep(obj):
            out.append(symbol_of(name, obj))
    return out


def describe(package) -> dict:
    """The symbols.json document of an imported kernel package."""
    layers = getattr(package, "layers", None)
    return {"schema_version": SCHEMA_VERSION, "module": package.__name__,
            "functions": exports(package, inspect.isfunction),
            "layers": exports(layers, inspect.isclass) if inspect.ismodule(layers) else []}


def load(variant: Path, module_name: str):
    """Imports the flat package in `variant` under `module_name` (its relative imports then resolve)."""
    init = Path(variant).resolve() / "__init__.py"
    spec = importlib.util.spec_from_file_location(module_name, init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def render(document: dict) -> bytes:
    return (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    document = render(describe(load(Path(argv[0]), argv[1])))  # all of it before the file is opened
    Path(argv[2]).write_bytes(document)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
