"""The GPU test plan (docs/testing.md): one device command runs at most 10 minutes and the suite takes
over 30 on one GPU, so every collected test gets exactly one marker ``shard1`` .. ``shard{SHARDS}``
(the shards partition the suite), and the tests that the ``tier`` markers choose get ``tier``.

- **Shards** are packed from the seconds per test file in ``tests/gpu_durations.json`` (what
  ``bash scripts/gpu_tests.sh all`` measures): a file above ``PART_S`` is cut into equal parts, the
  parts go largest first onto the least loaded shard, and a test of a cut file goes to the part given
  by a CRC-32 of its name (with parameters). The plan depends only on the test files on disk and the
  durations, so a test keeps its shard whatever a run collects.
- **The tier** is chosen by markers on the tests themselves: ``pytestmark = pytest.mark.tier`` (a whole
  file), ``@pytest.mark.tier`` (every case of a test), or ``@pytest.mark.tier_if(predicate)`` (the cases
  whose parameters satisfy it: ``lambda case: case.dtype == torch.bfloat16`` reads the parameter
  ``case``). This module adds ``tier`` to the cases a ``tier_if`` chooses, so ``-m tier`` selects them.

tests/conftest.py loads this file as a pytest plugin. ``python3 tests/gpu_plan.py --help``: the
estimates of a plan, and the next durations file from a run's junit.xml.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import math
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
DURATIONS = TESTS / "gpu_durations.json"
SHARDS = 11
SHARD_BUDGET_S = 380  # estimate per shard: a 10-minute command less start-up, ~1.5x margin
PART_S = 130  # files estimated above this are spread over several shards, test by test
TIER_BUDGET_S = 380  # estimate for the tier: 8 minutes less start-up, ~1.2x margin
STARTUP_S = 30  # interpreter, torch/CUDA/Triton import and collection, per command
DEFAULT_S = 60  # a test file not in the durations file yet
ROUND_S = 5  # measured seconds are rounded up to this step: run-to-run noise


@functools.cache
def durations() -> dict[str, float]:
    """Seconds per test file name, from tests/gpu_durations.json."""
    return json.loads(DURATIONS.read_text(encoding="utf-8"))["seconds"]


def suite_files() -> list[str]:
    """Every test file on disk (not only the collected ones), so that the plan does not depend on
    which files a run selects."""
    return sorted(p.name for p in TESTS.rglob("test_*.py"))


def file_seconds(name: str) -> float:
    return float(durations().get(name, DEFAULT_S))


def parts(name: str) -> int:
    return max(1, -(-int(file_seconds(name)) // PART_S))


def shard_plan(files: list[str] | None = None) -> dict[tuple[str, int], int]:
    """``{(file, part): shard}``, shards numbered from 1: the parts packed largest first onto the least
    loaded shard (ties: the lowest number). Deterministic: depends on the file names and durations only."""
    pieces = [(name, part, file_seconds(name) / parts(name)) for name in files or suite_files() for part in range(parts(name))]
    pieces.sort(key=lambda p: (-p[2], p[0], p[1]))
    load = [0.0] * SHARDS
    plan = {}
    for name, part, seconds in pieces:
        shard = min(range(SHARDS), key=lambda i: (load[i], i))
        load[shard] += seconds
        plan[(name, part)] = shard + 1
    return plan


def shard_of(file_name: str, test_name: str, plan: dict | None = None) -> int:
    """The shard of one test: its file's part is chosen by a CRC-32 of the test's name (with its
    parameters), so a test keeps its shard whatever else is collected."""
    plan = plan or shard_plan()
    if (file_name, 0) not in plan:  # a file created after the plan was made
        plan = shard_plan(sorted(set(suite_files()) | {file_name}))
    return plan[(file_name, zlib.crc32(test_name.encode("utf-8")) % parts(file_name))]


def _chooses(mark, item) -> bool:
    """Whether ``tier_if(predicate)`` holds for this case: the predicate's arguments are the test's
    parameters of the same names."""
    (predicate,) = mark.args
    params = item.callspec.params if hasattr(item, "callspec") else {}
    names = list(inspect.signature(predicate).parameters)
    missing = [n for n in names if n not in params]
    if missing:
        raise pytest.UsageError(f"{item.nodeid}: tier_if's predicate takes {missing}, not parameters of this test")
    return bool(predicate(**{n: params[n] for n in names}))


def tier_rules(item) -> dict[str, bool]:
    """Each ``tier_if`` marker on the item (``file::test#i``) and whether it chooses this case."""
    file_name = Path(str(item.path)).name
    name = getattr(item, "originalname", item.name)
    return {f"{file_name}::{name}#{i}": _chooses(m, item) for i, m in enumerate(item.iter_markers("tier_if"))}


def pytest_addoption(parser):
    parser.addoption(
        "--gpu-plan-json",
        metavar="FILE",
        help="write {nodeid: {file, shard, tier, tier_rules}} of the collected tests to FILE (tests/gpu_plan.py)",
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    plan = shard_plan()
    report = {}
    for item in items:
        file_name = Path(str(item.path)).name
        test_name = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
        shard = shard_of(file_name, test_name, plan)
        item.add_marker(getattr(pytest.mark, f"shard{shard}"))
        rules = tier_rules(item)
        if any(rules.values()):
            item.add_marker(pytest.mark.tier)
        tier = item.get_closest_marker("tier") is not None
        report[item.nodeid] = {"file": file_name, "shard": shard, "tier": tier, "tier_rules": rules}
    path = config.getoption("--gpu-plan-json")
    if path:
        Path(path).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def estimates(plan: dict) -> tuple[dict[int, float], dict[int, int], float, int]:
    """Estimated seconds and test counts per shard, and of the tier, for a ``--gpu-plan-json`` report:
    each file's seconds spread evenly over its collected tests."""
    per_file = collections.Counter(v["file"] for v in plan.values())
    seconds: dict[int, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    tier, tier_n = 0.0, 0
    for v in plan.values():
        s = file_seconds(v["file"]) / per_file[v["file"]]
        seconds[v["shard"]] += s
        counts[v["shard"]] += 1
        if v["tier"]:
            tier, tier_n = tier + s, tier_n + 1
    return seconds, counts, tier, tier_n


def summary(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
    seconds, counts, tier, tier_n = estimates(plan)
    print(f"plan: {plan_path} ({len(plan)} tests, estimated {sum(seconds.values()) / 60:.0f} min serial on one GPU)")
    print(f"tier:    {tier_n:4d} tests, ~{tier:4.0f} s + ~{STARTUP_S} s start-up")
    for k in sorted(seconds):
        print(f"shard{k}:  {counts[k]:4d} tests, ~{seconds[k]:4.0f} s + ~{STARTUP_S} s start-up")


def measured(junit_path: str) -> dict[str, tuple[float, int, int]]:
    """Per test file of a run's junit.xml: (seconds of its tests' setup + call + teardown, tests, tests
    that did not skip)."""
    out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, 0])
    for case in ET.parse(junit_path).iter("testcase"):
        row = out[case.get("classname", "").split(".")[-1] + ".py"]
        row[0] += float(case.get("time", 0) or 0)
        row[1] += 1
        row[2] += case.find("skipped") is None
    return {name: tuple(row) for name, row in out.items()}


def file_table(junit_path: str) -> None:
    """Measured seconds per test file, the slowest first (gpu_tests.sh's file_durations.txt)."""
    rows = measured(junit_path)
    for name in sorted(rows, key=lambda n: rows[n][0], reverse=True):
        print(f"{name:32s} {rows[name][0]:8.1f} s  {rows[name][1]:4d} tests")
    print(f"{'total':32s} {sum(r[0] for r in rows.values()):8.1f} s  {sum(r[1] for r in rows.values()):4d} tests")


def next_durations(junit_path: str, how: str) -> dict:
    """tests/gpu_durations.json with the files that ran a test in ``junit_path`` measured (their tests'
    setup + call + teardown, rounded up to ``ROUND_S``); files that only skipped keep their figures."""
    ran = {name: seconds for name, (seconds, _, not_skipped) in measured(junit_path).items() if not_skipped}
    doc = json.loads(DURATIONS.read_text(encoding="utf-8"))
    seconds = dict(doc["seconds"], **{f: ROUND_S * max(1, math.ceil(s / ROUND_S)) for f, s in ran.items()})
    doc.update(measured=how, seconds=dict(sorted(seconds.items())))
    doc["estimated"] = sorted(f for f in seconds if f not in ran)
    return doc


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="The GPU test plan's estimates and durations (docs/testing.md).")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("summary", help="estimated seconds per shard and of the tier").add_argument("plan_json")
    sub.add_parser("files", help="measured seconds per test file of a run's junit.xml").add_argument("junit_xml")
    nxt = sub.add_parser("durations", help="print the next tests/gpu_durations.json from a run's junit.xml")
    nxt.add_argument("junit_xml")
    nxt.add_argument("--measured", required=True, help="where and how it was measured (GPU, date, workers)")
    args = ap.parse_args(argv)
    if args.command == "summary":
        summary(args.plan_json)
    elif args.command == "files":
        file_table(args.junit_xml)
    else:
        print(json.dumps(next_durations(args.junit_xml, args.measured), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
