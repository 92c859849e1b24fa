"""The public API (`__all__` and the signatures behind it) matches tests/public_api.json.

A change there is either compatible (new names, new keyword-only parameters with defaults: update the
snapshot with `python3 scripts/public_api.py --update`) or needs the next `version` (new Hub branch
`v<N+1>`); docs/MAINTAINERS.md says which is which, and scripts/public_api.py refuses to record an
incompatible change without the version bump.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import fused_linear_ce  # imported from torch-ext/ by tests/conftest.py
import pytest
from hub_offline import load_script

REPO = Path(__file__).resolve().parents[2]
public_api = load_script("public_api")


def test_public_api_matches_the_snapshot():
    committed = json.loads(public_api.SNAPSHOT.read_text(encoding="utf-8"))
    now = public_api.current(REPO)
    if committed != now:
        bad, ok = public_api.classify(committed, now)
        pytest.fail(
            "the public API differs from tests/public_api.json\n"
            f"incompatible (needs the next version): {bad}\ncompatible: {ok}\n"
            "update with: python3 scripts/public_api.py --update (see docs/MAINTAINERS.md)"
        )


def test_snapshot_belongs_to_the_current_version():
    committed = json.loads(public_api.SNAPSHOT.read_text(encoding="utf-8"))
    assert committed["version"] == json.loads((REPO / "metadata.json").read_text())["version"]
    assert public_api.SNAPSHOT.read_text(encoding="utf-8") == public_api.render(committed)


def test_the_snapshot_covers_the_entry_point():
    names = public_api.current(REPO)["names"]
    assert list(names) == list(fused_linear_ce.__all__)
    entry = names["fused_linear_cross_entropy"]
    params = inspect.signature(fused_linear_ce.fused_linear_cross_entropy).parameters
    assert [p["name"] for p in entry["parameters"]] == list(params)
    assert entry["parameters"][:3] == [{"name": n, "kind": "POSITIONAL_OR_KEYWORD"} for n in ("hidden", "weight", "targets")]


# --- the compatibility rules, on stand-in APIs -------------------------------------------------------


def _api(fn, **extra) -> dict:
    return {"version": 1, "__all__": ["f", *extra], "names": {"f": public_api.describe(fn), **extra}}


def v1(hidden, weight, targets, bias=None, reduction="mean", *, chunk_bytes=None):
    pass


def new_kw_only(hidden, weight, targets, bias=None, reduction="mean", *, chunk_bytes=None, z_loss=0.0):
    pass


def new_kw_only_required(hidden, weight, targets, bias=None, reduction="mean", *, chunk_bytes=None, z_loss):
    pass


def new_positional(hidden, weight, targets, bias=None, reduction="mean", softcap=None, *, chunk_bytes=None):
    pass


def reordered(hidden, weight, targets, reduction="mean", bias=None, *, chunk_bytes=None):
    pass


def renamed(hidden, weight, labels, bias=None, reduction="mean", *, chunk_bytes=None):
    pass


def new_default(hidden, weight, targets, bias=None, reduction="sum", *, chunk_bytes=None):
    pass


def kw_default_changed(hidden, weight, targets, bias=None, reduction="mean", *, chunk_bytes=1 << 20):
    pass


def kw_removed(hidden, weight, targets, bias=None, reduction="mean"):
    pass


@pytest.mark.parametrize(
    ("changed", "compatible"),
    [
        (new_kw_only, True),
        (new_kw_only_required, False),
        (new_positional, False),
        (reordered, False),
        (renamed, False),
        (new_default, False),
        (kw_default_changed, False),
        (kw_removed, False),
    ],
    ids=lambda x: x.__name__ if callable(x) else str(x),
)
def test_signature_changes_are_classified(changed, compatible):
    bad, ok = public_api.classify(_api(v1), _api(changed))
    assert (not bad) is compatible, bad
    assert bool(ok) is compatible


def test_name_changes_are_classified():
    added = _api(v1, g={"kind": "function", "parameters": []})
    assert public_api.classify(_api(v1), added) == ([], ["g: added"])
    bad, _ = public_api.classify(added, _api(v1))
    assert bad == ["g: removed"]
    module = {"kind": "module", "members": {"h": public_api.describe(v1)}}
    bad, _ = public_api.classify(_api(v1, m=module), _api(v1, m={"kind": "module", "members": {}}))
    assert bad == ["m.h: removed"]


def test_update_refuses_an_incompatible_change_without_a_version_bump(tmp_path):
    path = tmp_path / "public_api.json"
    assert public_api.update(path, _api(v1)) == []
    assert public_api.update(path, _api(new_kw_only)) == []  # compatible: recorded
    refused = public_api.update(path, _api(renamed))
    assert refused and "targets" in refused[0]
    assert json.loads(path.read_text()) == _api(new_kw_only), "a refused update writes nothing"
    assert public_api.update(path, {**_api(renamed), "version": 2}) == []  # bumped: recorded
    assert json.loads(path.read_text())["version"] == 2
