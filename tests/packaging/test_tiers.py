"""The GPU tier and shards that tests/conftest.py assigns (docs/testing.md): every collected test is in
exactly one shard, a test's shard does not depend on what else is collected, the estimates fit one
device command, and the tier still reaches every path it is meant to cover."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest

from conftest import (
    GPU_SHARD_BUDGET_S,
    GPU_SHARDS,
    GPU_TIER,
    GPU_TIER_BUDGET_S,
    GPU_TIER_GPU_ONLY,
    ON_GPU,
    REPO,
    _file_seconds,
    _parts,
    _test_files,
    gpu_shard_of,
    gpu_shard_plan,
)

SHARD_MARKERS = {f"shard{i}" for i in range(1, GPU_SHARDS + 1)}


def collect(tmp_path, *args: str) -> tuple[dict, list[str]]:
    """`pytest --collect-only` in a subprocess: the plan of every collected test, and the node ids
    left after `args` (e.g. `-m shard3`) selected."""
    out = tmp_path / f"plan{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--gpu-plan-json", str(out), *args],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]  # 5: nothing selected
    selected = [line for line in proc.stdout.splitlines() if "::" in line]
    return json.loads(out.read_text()), selected


@pytest.fixture(scope="module")
def full_plan(tmp_path_factory) -> dict:
    plan, _ = collect(tmp_path_factory.mktemp("plan"))
    return plan


def test_this_session_marks_each_test_with_exactly_one_shard(request):
    for item in request.session.items:
        shards = [m.name for m in item.iter_markers() if m.name in SHARD_MARKERS]
        assert len(shards) == 1, (item.nodeid, shards)


def test_every_collected_test_is_in_exactly_one_shard(full_plan, tmp_path):
    """The whole suite: each test has one shard in range, and `-m shardN` selects exactly those."""
    assert len(full_plan) > 500
    assert all(1 <= v["shard"] <= GPU_SHARDS for v in full_plan.values())
    by_shard = collections.defaultdict(set)
    for nodeid, v in full_plan.items():
        by_shard[v["shard"]].add(nodeid)
    assert set(by_shard) == set(range(1, GPU_SHARDS + 1)), "a shard is empty"
    _, selected = collect(tmp_path, "-m", "shard3 or tier")
    assert set(selected) == by_shard[3] | {n for n, v in full_plan.items() if v["tier"]}


def test_a_tests_shard_does_not_depend_on_what_else_is_collected(full_plan, tmp_path):
    alone, _ = collect(tmp_path, "tests/kernel/test_plan.py", "tests/kernel/test_correctness.py")
    assert alone and all(full_plan[n]["shard"] == v["shard"] for n, v in alone.items())


def test_the_plan_is_deterministic_and_covers_every_part():
    plan = gpu_shard_plan()
    assert plan == gpu_shard_plan()
    assert set(plan) == {(f, p) for f in _test_files() for p in range(_parts(f))}
    assert gpu_shard_of("test_new_file_not_in_the_table.py", "test_x") in range(1, GPU_SHARDS + 1)


def _estimates(plan: dict) -> tuple[dict[int, float], float]:
    per_file = collections.Counter(v["file"] for v in plan.values())
    shards: dict[int, float] = collections.defaultdict(float)
    tier = 0.0
    for v in plan.values():
        seconds = _file_seconds(v["file"]) / per_file[v["file"]]
        shards[v["shard"]] += seconds
        tier += seconds if v["tier"] else 0.0
    return shards, tier


def test_estimates_fit_one_device_command(full_plan):
    """Estimated serial GPU seconds (conftest.GPU_SECONDS spread evenly over a file's tests)."""
    shards, tier = _estimates(full_plan)
    for shard, seconds in sorted(shards.items()):
        assert seconds <= GPU_SHARD_BUDGET_S, f"shard{shard} is estimated at {seconds:.0f} s: raise GPU_SHARDS"
    assert tier <= GPU_TIER_BUDGET_S, f"the tier is estimated at {tier:.0f} s"


def test_the_tier_reaches_every_path(full_plan):
    tier = [n for n, v in full_plan.items() if v["tier"]]
    # Every rule still selects something (a renamed test would silently drop out of the tier).
    for file_name, rule in GPU_TIER.items():
        chosen = [n for n in tier if full_plan[n]["file"] == file_name]
        assert chosen, f"GPU_TIER[{file_name!r}] selects nothing"
        if rule is True:
            assert len(chosen) == sum(1 for v in full_plan.values() if v["file"] == file_name)
        else:
            for s in rule:
                if s in GPU_TIER_GPU_ONLY and not ON_GPU:
                    continue
                assert any(s in n for n in chosen), f"GPU_TIER[{file_name!r}]: {s!r} matches no test"
    correctness = [n for n in tier if "test_correctness.py::test_matches_float64_reference" in n]
    for dtype in ("float32", "float16", "bfloat16"):
        for path in ("-recompute]", "-chunked]"):
            assert any(f"-{dtype}-" in n and n.endswith(path) for n in correctness), (dtype, path)
    if ON_GPU:
        for dtype in ("float32", "float16", "bfloat16"):
            assert any(f"[N4096H1024V32001-{dtype}-" in n for n in correctness), dtype
    # Realistic sizes: the Llama-3 shape (all backward plans), GPU-size cases per dtype, past int32.
    assert sum("test_gpu_scale.py" in n for n in tier) == sum(v["file"] == "test_gpu_scale.py" for v in full_plan.values())
    assert any("past_int32" in n for n in tier)
    assert any("test_products.py" in n for n in tier) and any("test_memory.py" in n for n in tier)
