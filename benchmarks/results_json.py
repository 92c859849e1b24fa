"""The provenance and merging of bench.py's JSON (``<gpu>.json``): what was measured, and one file
from several calls (S1-S3 in one, S4 in another).

``meta.commit`` / ``meta.dirty``: the commit of the package measured and whether the working tree
differed from it: ``BENCH_COMMIT`` and ``BENCH_DIRTY`` from the environment where set (a copy of the
tree on another machine, whose .git, if it travelled, names the copy's base and reports the copied
changes as dirty), else ``git rev-parse HEAD`` / ``git status --porcelain``, else None.
``meta.shape_runs``: per shape, the date, commit, dirty flag, rounds and versions of the call that
measured it (a JSON written before this key existed reads as one call for all its shapes).
"""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE_ORDER = ("S1", "S2", "S3", "S4", "tiny")


def _git(*args):
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise OSError(done.stderr.strip())
    return done.stdout


def provenance():
    """{"commit": sha | None, "dirty": bool | None, "commit_source": "BENCH_COMMIT" | "git" | None}."""
    commit = os.environ.get("BENCH_COMMIT") or None
    if commit:
        flag = os.environ.get("BENCH_DIRTY")
        dirty = None if flag is None else flag.strip().lower() in ("1", "true", "yes")
        return dict(commit=commit, dirty=dirty, commit_source="BENCH_COMMIT")
    try:
        commit = _git("rev-parse", "HEAD").strip()
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no").strip())
        return dict(commit=commit, dirty=dirty, commit_source="git")
    except (OSError, subprocess.SubprocessError):
        return dict(commit=None, dirty=None, commit_source=None)


RUN_KEYS = ("date", "commit", "dirty", "gpu", "torch", "triton", "liger-kernel", "cut-cross-entropy", "trl")


def shape_runs(meta, rows):
    """meta's per-shape runs; for a JSON without them, one run (meta's date, commit, versions) for
    every shape of its rows."""
    if "shape_runs" in meta:
        return dict(meta["shape_runs"])
    run = {k: meta.get(k) for k in RUN_KEYS}
    run["rounds"] = (meta.get("args") or {}).get("rounds", 1)
    return {r["shape"]: dict(run) for r in rows}


def _shape_of(key):
    """'S1/random' or 'S1/random/cce-exact: ...' -> 'S1'."""
    return key.split("/", 1)[0]


def merge(old, new):
    """``new`` (this call's {"meta", "rows"}) over ``old``: the shapes of new's rows replace old's rows,
    data, skipped lines and runs; old's other shapes stay. Rows in SHAPE_ORDER, then as measured."""
    shapes = {r["shape"] for r in new["rows"]} | set(new["meta"].get("shape_runs", {}))
    om, nm = old.get("meta", {}), new["meta"]
    rows = [r for r in old.get("rows", []) if r["shape"] not in shapes] + list(new["rows"])
    rank = {s: i for i, s in enumerate(SHAPE_ORDER)}
    rows.sort(key=lambda r: rank.get(r["shape"], len(rank)))  # stable: the order within a shape stays
    meta = dict(nm)
    runs = {s: r for s, r in shape_runs(om, old.get("rows", [])).items() if s not in shapes}
    runs.update(nm.get("shape_runs", {}))
    meta["shape_runs"] = {s: runs[s] for s in sorted(runs, key=lambda s: rank.get(s, len(rank)))}
    data = {k: v for k, v in om.get("data", {}).items() if _shape_of(k) not in shapes}
    data.update(nm.get("data", {}))
    meta["data"] = {k: data[k] for k in sorted(data, key=lambda k: rank.get(_shape_of(k), len(rank)))}
    meta["skipped"] = [s for s in om.get("skipped", []) if _shape_of(s) not in shapes] + list(nm.get("skipped", []))
    meta["notes"] = list(dict.fromkeys(list(om.get("notes", [])) + list(nm.get("notes", []))))
    return dict(meta=meta, rows=rows)
