"""Shared test setup: device choice, the package import, the tolerance table, error helpers. The GPU
shards and tier are tests/gpu_plan.py's (a plugin loaded here).

Kernels run on CUDA when a GPU is visible, else on CPU under the Triton interpreter. TRITON_INTERPRET
must be set before Triton decorates the kernels, so it is set here, before the package is imported.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Fresh outputs are NaN-filled, so an element a kernel forgot to write fails loudly.
os.environ.setdefault("FUSED_LINEAR_CE_POISON", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "torch-ext"))

import fused_linear_ce  # noqa: E402
from fused_linear_ce import reference  # noqa: E402

pytest_plugins = ("gpu_plan",)  # the GPU shards and tier (docs/testing.md)

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
