"""The GPU tier and shards that tests/gpu_plan.py assigns (docs/testing.md): every collected test is in
exactly one shard, `-m` selects the plan, a test's shard does not depend on what else is collected, the
estimates fit one device command, every `tier_if` marker chooses a test, and the tier still reaches
every path it is meant to cover."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest

import gpu_plan
from conftest import ON_GPU, REPO
from gpu_plan import SHARD_BUDGET_S, SHARDS, TIER_BUDGET_S, estimates, parts, shard_of, shard_plan, suite_files

SHARD_MARKERS = {f"shard{i}" for i in range(1, SHARDS + 1)}
# The files docs/testing.md's tier list names (the ping-pong sweep, the hosted accumulator and chunk,
# ignored blocks, the loss variants, autotuning, CUDA graphs, num_items_in_batch, gradient accumulation,
# extreme scales, cuBLAS rounding, loading through kernels, per-token functions, patch_model's memory).
REACHED = {
    "test_pingpong.py", "test_hosted_accumulator.py", "test_hosted_chunk.py", "test_compensated.py",
    "test_master_weight.py", "test_scale.py", "test_ignored_blocks.py", "test_variants.py", "test_autotune.py",
    "test_integration.py", "test_grad_semantics.py", "test_extremes.py", "test_rounding.py", "test_loader.py",
    "test_logprobs.py", "test_patch_model.py",
}


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
    assert all(1 <= v["shard"] <= SHARDS for v in full_plan.values())
    by_shard = collections.defaultdict(set)
    for nodeid, v in full_plan.items():
        by_shard[v["shard"]].add(nodeid)
    assert set(by_shard) == set(range(1, SHARDS + 1)), "a shard is empty"
    _, selected = collect(tmp_path, "-m", "shard3 or tier")
    assert set(selected) == by_shard[3] | {n for n, v in full_plan.items() if v["tier"]}


def test_a_tests_shard_does_not_depend_on_what_else_is_collected(full_plan, tmp_path):
    alone, _ = collect(tmp_path, "tests/kernel/test_plan.py", "tests/kernel/test_correctness.py")
    assert alone and all(full_plan[n]["shard"] == v["shard"] for n, v in alone.items())


def test_the_plan_is_deterministic_and_covers_every_part():
    plan = shard_plan()
    assert plan == shard_plan()
    assert set(plan) == {(f, p) for f in suite_files() for p in range(parts(f))}
    assert shard_of("test_new_file_not_in_the_durations.py", "test_x") in range(1, SHARDS + 1)


def test_the_durations_name_only_test_files_on_disk():
    """A renamed or removed test file leaves the durations file with it (a new one is packed at
    gpu_plan.DEFAULT_S until a GPU run measures it)."""
    assert set(gpu_plan.durations()) <= set(suite_files())


def test_estimates_fit_one_device_command(full_plan):
    """Estimated serial GPU seconds (tests/gpu_durations.json spread evenly over a file's tests)."""
    shards, _, tier, _ = estimates(full_plan)
    for shard, seconds in sorted(shards.items()):
        assert seconds <= SHARD_BUDGET_S, f"shard{shard} is estimated at {seconds:.0f} s: raise gpu_plan.SHARDS"
    assert tier <= TIER_BUDGET_S, f"the tier is estimated at {tier:.0f} s"


def test_every_tier_if_marker_chooses_a_test(full_plan):
    """A predicate that no longer matches its test's parameters (a renamed field, a changed case list)
    would drop cases out of the tier silently."""
    chosen = collections.defaultdict(bool)
    for v in full_plan.values():
        for rule, holds in v["tier_rules"].items():
            chosen[rule] |= holds
    assert len(chosen) >= 10, sorted(chosen)  # 17 tier_if markers: fewer means the report lost them
    assert not [rule for rule, any_case in chosen.items() if not any_case]


def test_the_tier_reaches_every_path(full_plan):
    tier = [n for n, v in full_plan.items() if v["tier"]]
    correctness = [n for n in tier if "test_correctness.py::test_matches_float64_reference" in n]
    for dtype in ("float32", "float16", "bfloat16"):
        for path in ("-recompute]", "-chunked]"):
            assert any(f"-{dtype}-" in n and n.endswith(path) for n in correctness), (dtype, path)
    if ON_GPU:
        for dtype in ("float32", "float16", "bfloat16"):
            assert any(f"[N4096H1024V32001-{dtype}-" in n for n in correctness), dtype
            assert any(f"[N1000H512V50257-{dtype}-" in n for n in correctness), dtype
    # Realistic sizes: the Llama-3 shape (all backward plans), GPU-size cases per dtype, past int32.
    assert sum("test_gpu_scale.py" in n for n in tier) == sum(v["file"] == "test_gpu_scale.py" for v in full_plan.values())
    assert any("past_int32" in n for n in tier)
    assert any("test_products.py" in n for n in tier) and any("test_memory.py" in n for n in tier)
    # The rest of what docs/testing.md says the tier reaches, a file each.
    reached = {full_plan[n]["file"] for n in tier}
    assert REACHED <= reached, sorted(REACHED - reached)
