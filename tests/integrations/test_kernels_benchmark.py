"""benchmarks/benchmark.py follows kernels' Benchmark convention: discovered by the kernels CLI's
own loader, each workload runs and verifies against plain torch."""

import subprocess
import sys

import pytest
import torch
# kernels' benchmark CLI imports sigstore (and cryptography), which a machine may lack even where
# kernels itself loads (the GPU image): the module skips there, saying why; CI installs them.
benchmark_cli = pytest.importorskip("kernels.cli.benchmark", reason="kernels' benchmark CLI needs sigstore")
discover_benchmark_classes, discover_benchmark_scripts = (benchmark_cli.discover_benchmark_classes,
                                                          benchmark_cli.discover_benchmark_scripts)

import fused_linear_ce
from conftest import DEVICE, ON_GPU, REPO


def test_the_cli_discovers_and_runs_every_workload():
    scripts = discover_benchmark_scripts(str(REPO), REPO)
    assert [s.name for s in scripts] == ["benchmark.py"]
    (cls,) = discover_benchmark_classes(scripts[0], REPO)
    workloads = sorted(m[len("benchmark_"):] for m in dir(cls) if m.startswith("benchmark_"))
    assert workloads == ["forward", "forward_backward"]
    for name in workloads:
        bench = cls()
        bench.kernel, bench.device = fused_linear_ce, DEVICE.type
        torch.manual_seed(cls.seed)
        bench.setup()
        getattr(bench, f"benchmark_{name}")()
        torch.testing.assert_close(bench.out, getattr(bench, f"verify_{name}")(), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="`kernels benchmark` loads the cuda variant from the repo root")
def test_kernels_benchmark_cli_on_the_repo():
    cli = "import sys; from kernels.cli import main; sys.argv[0] = 'kernels'; sys.exit(main())"
    out = subprocess.run([sys.executable, "-c", cli, "benchmark", str(REPO), "--iterations", "3", "--warmup", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
