"""Shared test setup: device choice, the package import, the tolerance table, error helpers.

Kernels run on CUDA when a GPU is visible, else on CPU under the Triton interpreter. TRITON_INTERPRET
must be set before Triton decorates the kernels, so it is set here, before the package is imported.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Fresh outputs are NaN-filled, so an element a kernel forgot to write fails loudly.
os.environ.setdefault("FUSED_LINEAR_CE_POISON", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "torch-ext"))

import fused_linear_ce  # noqa: E402
from fused_linear_ce import reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

# err(ours, float64) <= err(plain torch in the input dtype, float64) + TOL[dtype]; and never above CAP.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
CAP = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.2e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Frobenius relative error; absolute when the expectation is zero. NaN in either is an error."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, (a.shape, e.shape)
    assert not torch.isnan(a).any(), "NaN in result"
    assert not torch.isnan(e).any(), "NaN in expectation"
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


class KernelSpy:
    """Wraps a Triton kernel (``kernel[grid](...)``) and records each launch's keyword arguments;
    tests monkeypatch it in place of the module's kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        launcher = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append(kwargs)
            return launcher(*args, **kwargs)

        return run


# --- GPU test tier and shards (docs/testing.md) ------------------------------------------------------
#
# The whole suite takes over 30 minutes on one H200 run serially, and one device command may run 10.
# Every collected test gets exactly one marker `shard1`..`shardK` (the shards partition the suite; each
# is sized to fit one 10-minute command) and some also get `tier` (a subset that reaches every kernel
# path, each dtype and the realistic sizes, sized for ~8 minutes; it overlaps the shards). Markers are
# assigned here, by file and test name, so that no test file has to carry them.
#
# GPU_SECONDS: seconds per test file on one H200, pytest start-up excluded. Since 2026-12-03 the
# measured figures of `GPU_TESTS_WORKERS=12 bash scripts/gpu_tests.sh all` (the sums of each file's test
# durations over 0.5 s, 12 workers sharing the GPU and a Triton cache that starts cold), rounded up to
# 5 s; files none of whose tests reached 0.5 s there, or that skipped there (test_trl.py: no `datasets`
# on that machine; test_hub_cache, test_publish, test_bench_logprobs failed there for packages or tools
# that machine lacks), keep the earlier estimates (test counts times a per-kind cost, anchored on the
# serial logs of benchmarks/results/cublas/ and ignored/). Those estimates had put test_compensated at
# 10 s (measured 91), test_master_weight at 50 (147) and test_integration at 100 (24): the tier came to
# 381 s against its 380. Rerun and replace them when the suite changes much (file_durations.txt).
GPU_SECONDS = {
    # Estimates for the files added on 2026-12-03 (no serial durations yet): one pytest -n 6 run of
    # test_divergence, test_double_backward, test_topk_logprobs, test_trl_distill and test_trl took 106 s.
    "test_divergence.py": 90,  # estimate; 78 tests, the bf16 cases at 2048 x 32000 and two compiles
    "test_trl_distill.py": 90,  # estimate; 19 tests, a 3-step DistillationTrainer twice
    "test_topk_logprobs.py": 45,  # estimate; 32 tests
    "test_bench_distill.py": 90,  # estimate; bench_distill.py subprocesses, as test_benchmark.py (75)
    "test_results_render.py": 5,  # estimate; no kernels
    "test_autotune.py": 105,  # measured 105 (estimate was 190); 31 tests; autotuning compiles and times several tile candidates each
    "test_benchmark.py": 75,  # measured 72 (estimate was 60); bench.py subprocesses
    "test_bench_logprobs.py": 60,  # bench_logprobs.py in process: our kernels' and TRL's first compiles (29 s there, TRL's rows failing: no `datasets`)
    "test_bf16_emulation.py": 2,
    "test_borrowed_accumulator.py": 5,  # layout checks on the CPU side (0.3 s measured, v20)
    "test_compensated.py": 95,  # measured 91 (estimate was 10); 32 matmul tests, a compile per dtype and layout
    "test_master_weight.py": 150,  # measured 147 (estimate was 50); autocast cases (loss and per-token), two torch.compile, one GPU memory case
    "test_correctness.py": 325,  # measured 322 (estimate was 340); 134 cases x ~2.5 s (compiles per specialisation), 6 at GPU sizes
    "test_determinism.py": 40,
    "test_double_backward.py": 30,  # estimate: 18 small cases of two or three backwards, one inductor compile per path  # measured 38 (estimate was 20)
    "test_examples.py": 20,  # measured 15 (estimate was 120); trains the Llama example twice in a subprocess
    "test_extremes.py": 35,  # measured 32 (estimate was 60)
    "test_fuzz.py": 180,  # measured 179 (estimate was 100); 100 hypothesis examples on the GPU
    "test_gpu_scale.py": 40,  # measured 38 (estimate was 45); Llama-3 lm-head shape, float64 chunked reference (31-40 s measured, v20-v22)
    "test_grad_semantics.py": 15,  # measured 15 (estimate was 76)
    "test_hosted_accumulator.py": 10,  # measured 8 (estimate was 10); 4 small recompute backwards, twice each
    "test_hosted_chunk.py": 50,  # measured 50 with 12 workers beside five other files (v30; 138 inside the tier's 161 tests; estimate was 20)
    "test_gradient_scaling.py": 5,
    "test_hub_cache.py": 30,  # kernels CLI subprocesses (failed at once there: no `cryptography`)
    "test_ignored_blocks.py": 30,  # measured 27 (estimate was 60)
    "test_inputs.py": 15,  # measured 10 (estimate was 30); mostly validation errors before any kernel
    "test_integration.py": 25,  # measured 24 (estimate was 100); torch.compile training steps, opcheck, CUDA graphs
    "test_kernels_benchmark.py": 40,
    "test_kernels_tools.py": 10,  # estimate; loads at six simulated capabilities, one describe-api subprocess
    "test_layout.py": 15,  # measured 12 (estimate was 20)
    "test_loader.py": 15,
    "test_logprobs.py": 160,  # measured 156 (estimate was 60); 33 per-token tests, two torch.compile runs
    "test_memory.py": 50,  # measured 48 (estimate was 90); a thousand calls per case
    "test_metrics.py": 25,  # measured 25 (estimate was 35)
    "test_parallel.py": 1,  # CPU/gloo only: skipped on a GPU
    "test_parallel_nccl.py": 2,  # needs two GPUs: skipped on one (87 s on two: scripts/gpu_tests.sh nccl)
    "test_patch_model.py": 45,  # measured 41 (estimate was 60); tiny models, two 3-step Trainer runs each patched and not; bf16 32k-vocabulary memory
    "test_pingpong.py": 80,  # measured 78 (estimate was 40); Gluon compiles of the ping-pong sweep (measured 40 s serial, v23)
    "test_plan.py": 25,  # measured 24 (estimate was 5)
    "test_products.py": 32,  # measured 31.6 with 27 tests (v31; 21 before the split-K tests)
    "test_public_api.py": 10,
    "test_publish.py": 25,  # (17 s there, failing at once without nix)
    "test_registers.py": 145,  # measured 142 (estimate was 60); offline sm_90 compile of the hot kernels in a subprocess
    "test_arch_matrix.py": 35,  # estimate: 7 targets compiled offline, one process each (~20 s a target cold on one core), seconds warm
    "test_families.py": 10,  # estimate: 6 s on the CPU (interpreter)
    "test_rounding.py": 20,  # measured 18 (estimate was 56)
    "test_scale.py": 95,  # measured 91 (estimate was 120); sizes past int32 elements
    "test_splits.py": 5,
    "test_tiers.py": 40,  # measured 38 (estimate was 10)
    "test_transformers.py": 5,  # measured 5 (estimate was 60)
    "test_trl.py": 90,  # SFTTrainer run
    "test_variants.py": 165,  # measured 164 (estimate was 190)
    "test_workflows.py": 20,
    # Skipped where DeepSpeed is not installed (gpu_tests.sh installs nothing); with it, six world-size-1
    # ZeRO-3 runs in spawned processes (the world-size-2 and FSDP2 ones skip on one GPU), not yet
    # measured: re-estimate then (shard9 is within 20 s of the budget).
    "test_zero3.py": 5,
    "test_zero2_ddp.py": 5,  # both tests need 2 GPUs, so they skip on one (18 s for both on 2 CPU cores)
    "test_compile.py": 75,  # measured 73
    "test_torch_parity.py": 35,  # measured 34
}
GPU_SECONDS_DEFAULT = 60  # a test file not in the table yet
GPU_SHARDS = 11
GPU_SHARD_BUDGET_S = 380  # estimate per shard: 10-minute command less start-up, ~1.5x margin
GPU_SHARD_PART_S = 130  # files estimated above this are spread over several shards, test by test
GPU_TIER_BUDGET_S = 380  # estimate for the tier: 8 minutes less start-up, ~1.2x margin
GPU_STARTUP_S = 30  # interpreter, torch/CUDA/Triton import and collection, per command

# The tier, by file: True = every test of the file; a tuple = tests whose name (with parameters)
# contains one of the strings. Paths: recompute (sweep + backward plans) and chunked, per dtype; the
# products (TMA, pointer, cuBLAS; the compensated pair through descriptors); realistic sizes (Llama-3 bf16 all plans, sizes past int32, the
# fp32/fp16/bf16 GPU-size correctness cases); memory bounds (an fp32 master weight's too); ignored
# row blocks; loss variants; autotuning; CUDA graphs; loading through kernels. Left to the shards
# since v18, to keep the estimate within budget (388 s on the H200's collection with them): the
# backward planner (shape arithmetic, no kernel) and loading from the Hub cache (test_loader stays).
GPU_TIER = {
    "test_gpu_scale.py": True,
    # bf16 against float64 and the Triton sweep (lse, entropy, argmax), a shard with ignored blocks, the
    # public function: the rest of the file (fp16, ties, the calls that stay on the Triton sweep) runs
    # in its shard.
    "test_pingpong.py": ("-bf16]", "vocabulary_shard", "take_it"),
    "test_hosted_accumulator.py": True,
    # the bf16 cases (one chunk and a head), the master weight's (one chunk and a head), the long-context
    # head's 4-bit pair; the fp32 / fp16 cases and the plan's arithmetic in the shards
    "test_hosted_chunk.py": ("bfloat16", "master", "long_context_head"),
    "test_products.py": True,
    "test_compensated.py": ("test_ragged_edges_through_descriptors_and_pointers[tma-bf16]",),
    "test_master_weight.py": ("test_extra_memory_is_the_weight_copy_and_the_chunk",),
    "test_correctness.py": ("-recompute]", "-chunked]", "[N1000H512V50257-", "[N4096H1024V32001-"),
    "test_scale.py": ("test_hidden_and_plane_past_int32_elements", "chunk1048576]", "test_misaligned_pointers_give_the_aligned_result[bf16]"),
    "test_memory.py": ("[default-recompute]", "[16MiB-chunked]"),
    "test_ignored_blocks.py": ("-bias-recompute]", "-bias-chunked]", "test_the_sweep_leaves_neutral_statistics", "test_returned_lse_covers"),
    "test_variants.py": ("-bias-scale0.7-ls0.2-z0.01-cw]",),
    "test_autotune.py": ("test_tunes_each_stage_once_per_shape_and_stays_exact", "test_no_tuning_during_cuda_graph_capture"),
    "test_integration.py": ("test_cuda_graph_capture_and_replay", "test_num_items_in_batch_gradients_on_both_paths"),
    "test_rounding.py": ("-no-tma]",),
    "test_extremes.py": ("[N45H72V700-bfloat16-mean-bias-scale0.001-cap0.001]", "test_logits_of_magnitude_1e4_give_a_finite_loss_and_the_right_gradient[bf16]"),
    "test_grad_semantics.py": ("test_second_backward_accumulates_into_existing_grad",),
    "test_loader.py": True,
    "test_logprobs.py": ("[bf16-", "test_compiles", "test_cuda_graph"),
    "test_patch_model.py": ("test_peak_memory_is_lower_than_unpatched",),
}
# Tier strings naming cases that only a GPU run parametrizes (tests/packaging/test_tiers.py checks the others
# still match a test on any machine).
GPU_TIER_GPU_ONLY = {"[N1000H512V50257-", "[N4096H1024V32001-"}


def _test_files() -> list[str]:
    """Every test file on disk (not only the collected ones), so that the plan does not depend on
    which files a run selects."""
    return sorted(p.name for p in (REPO / "tests").rglob("test_*.py"))


def _file_seconds(name: str) -> float:
    return float(GPU_SECONDS.get(name, GPU_SECONDS_DEFAULT))


def _parts(name: str) -> int:
    return max(1, -(-int(_file_seconds(name)) // GPU_SHARD_PART_S))


def gpu_shard_plan(files: list[str] | None = None) -> dict[tuple[str, int], int]:
    """`{(file, part): shard}`, shards numbered from 1: each file is cut in `_parts(file)` equal
    estimated parts and the parts are packed largest first onto the least loaded shard (ties: the
    lowest number). Deterministic: depends on the file names on disk and the table only."""
    pieces = [(name, part, _file_seconds(name) / _parts(name)) for name in files or _test_files() for part in range(_parts(name))]
    pieces.sort(key=lambda p: (-p[2], p[0], p[1]))
    load = [0.0] * GPU_SHARDS
    plan = {}
    for name, part, seconds in pieces:
        shard = min(range(GPU_SHARDS), key=lambda i: (load[i], i))
        load[shard] += seconds
        plan[(name, part)] = shard + 1
    return plan


def gpu_shard_of(file_name: str, test_name: str, plan: dict | None = None) -> int:
    """The shard of one test: its file's part is chosen by a CRC-32 of the test's name (with its
    parameters), so a test keeps its shard whatever else is collected."""
    import zlib

    plan = plan or gpu_shard_plan()
    if (file_name, 0) not in plan:  # a file created after the plan (e.g. during this session)
        plan = gpu_shard_plan(sorted(set(_test_files()) | {file_name}))
    return plan[(file_name, zlib.crc32(test_name.encode("utf-8")) % _parts(file_name))]


def in_gpu_tier(file_name: str, test_name: str) -> bool:
    rule = GPU_TIER.get(file_name, False)
    return rule if isinstance(rule, bool) else any(s in test_name for s in rule)


def _item_names(item) -> tuple[str, str]:
    file_name = Path(str(item.path)).name
    return file_name, item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name


def pytest_addoption(parser):
    parser.addoption(
        "--gpu-plan-json",
        metavar="FILE",
        help="write {nodeid: {file, shard, tier}} of the collected tests to FILE (tests/packaging/test_tiers.py, scripts/gpu_tests.sh plan)",
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    plan = gpu_shard_plan()
    report = {}
    for item in items:
        file_name, test_name = _item_names(item)
        shard = gpu_shard_of(file_name, test_name, plan)
        item.add_marker(getattr(pytest.mark, f"shard{shard}"))
        tier = in_gpu_tier(file_name, test_name)
        if tier:
            item.add_marker(pytest.mark.tier)
        report[item.nodeid] = {"file": file_name, "shard": shard, "tier": tier}
    path = config.getoption("--gpu-plan-json")
    if path:
        import json

        Path(path).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
