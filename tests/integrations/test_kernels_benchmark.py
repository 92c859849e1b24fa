"""benchmarks/benchmark.py follows kernels' Benchmark convention: discovered by the kernels CLI's
own loader, each workload runs and verifies against plain torch; `kernels benchmark` itself runs it
(kernels 0.17.2 and 0.19.1: the same CLI, moved under `kernels._internals` in 0.19)."""

import json
import os
import shutil
import subprocess

import pytest
import torch
from kernels_api import KERNELS_CLI, backend, benchmark_cli

# kernels' benchmark CLI imports sigstore (0.17) and tabulate (the `benchmark` extra), which a machine
# may lack even where kernels itself loads (the GPU image): the module skips there, saying why.
try:
    cli = benchmark_cli()
except ImportError as e:  # pragma: no cover - CI installs them
    pytest.skip(f"kernels' benchmark CLI cannot be imported: {e}", allow_module_level=True)

import fused_linear_ce
from conftest import DEVICE, ON_GPU, REPO

# The CLI itself refuses to run without its `benchmark` extra (tabulate, ...).
needs_cli_deps = pytest.mark.skipif(bool(cli.MISSING_DEPS), reason=f"`kernels benchmark` lacks {cli.MISSING_DEPS}")
# `kernels benchmark` loads the variant of the backend kernels selects from the torch build and runs the
# workloads on that backend's device: a cpu variant on the CPU only under a CPU build of torch.
KERNELS_BACKEND = backend()
selects_cpu = pytest.mark.skipif(
    KERNELS_BACKEND != "cpu",
    reason=f"kernels selects {KERNELS_BACKEND} variants under torch {torch.__version__} (its build's backend), "
    + ("and on this GPU the test below runs the repo itself" if ON_GPU else
       "and this machine has no GPU to run them on: the CPU check needs a CPU build of torch"))


def test_the_cli_discovers_and_runs_every_workload():
    scripts = cli.discover_benchmark_scripts(str(REPO), REPO)
    assert [s.name for s in scripts] == ["benchmark.py"]
    (cls,) = cli.discover_benchmark_classes(scripts[0], REPO)
    workloads = sorted(m[len("benchmark_"):] for m in dir(cls) if m.startswith("benchmark_"))
    assert workloads == ["forward", "forward_backward"]
    for name in workloads:
        bench = cls()
        bench.kernel, bench.device = fused_linear_ce, DEVICE.type
        torch.manual_seed(cls.seed)
        bench.setup()
        getattr(bench, f"benchmark_{name}")()
        torch.testing.assert_close(bench.out, getattr(bench, f"verify_{name}")(), rtol=1e-4, atol=1e-4)


@needs_cli_deps
@selects_cpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run needs TRITON_INTERPRET=1")
def test_kernels_benchmark_cli_on_the_cpu(tmp_path):
    """`kernels benchmark <folder>` end to end on a CPU build of torch, at the script's tiny shape. The CLI
    loads the folder with get_local_kernel, which on a CPU build takes only a cpu variant: the folder
    holds `benchmarks/benchmark.py` and the committed variant as `build/torch-cpu` (its metadata says
    `cpu`; the digest leaves metadata.json out, so it still validates). The CLI fails on a workload
    whose output does not match its `verify_` reference."""
    folder = tmp_path / "clone"
    variant = folder / "build" / "torch-cpu"
    shutil.copytree(REPO / "build" / "torch-cuda", variant, ignore=shutil.ignore_patterns("__pycache__"))
    meta = json.loads((variant / "metadata.json").read_bytes())
    (variant / "metadata.json").write_text(json.dumps({**meta, "backend": {"type": "cpu"}}))
    (folder / "benchmarks").mkdir()
    shutil.copy(REPO / "benchmarks" / "benchmark.py", folder / "benchmarks" / "benchmark.py")
    results = tmp_path / "results.json"
    out = subprocess.run([*KERNELS_CLI, "benchmark", "./", "--iterations", "2", "--warmup", "1",
                          "--output", str(results)], capture_output=True, text=True, timeout=600, cwd=folder)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Running FusedLinearCrossEntropyBenchmark on cpu" in out.stderr
    report = json.loads(results.read_text())
    assert {r["workload"]: r["verified"] for r in report["results"]} == {
        "FusedLinearCrossEntropyBenchmark.forward": True, "FusedLinearCrossEntropyBenchmark.forward_backward": True}
    assert report["kernelCommitSha"] == meta["id"][-7:] and report["machineInfo"]["backend"] == "CPU"


@pytest.mark.gpu
@needs_cli_deps
@pytest.mark.skipif(not ON_GPU, reason="`kernels benchmark` loads the cuda variant from the repo root")
def test_kernels_benchmark_cli_on_the_repo():
    out = subprocess.run([*KERNELS_CLI, "benchmark", str(REPO), "--iterations", "3", "--warmup", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
