"""The hosted accumulator (``backward_passes.plan_passes``, ``BackwardPlan.hosted``): grad_hidden's fp32 sum over
vocabulary blocks keeps its first rows in grad_hidden's own 16-bit memory and the rest in an extra
buffer; at the end the hosted rows are copied into the spent da block before grad_hidden's rows
overwrite them. These check that the plan is the one that runs, and that its gradients are those of
a separate fp32 (N, H) accumulator: a row lost, summed twice or overwritten before it was read would
show (odd and even N, both 16-bit dtypes, per-row upstream gradients and ignored rows). The numbers
against float64: test_correctness.py's 72000-byte cases, test_parallel.py's sharded case."""

import dataclasses

import pytest
import torch

from conftest import DEVICE, ON_GPU
from fused_linear_ce import fused_linear_cross_entropy, plan, recompute

pytestmark = pytest.mark.tier  # the GPU tier: every test of this file

H, V, CHUNK = 96, 500, 72000  # two vocabulary blocks of 256 + 244 columns (CPU and GPU tiles: 256 wide)


def _inputs(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, H, generator=g) * 0.5).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[::5] = -100
    upstream = torch.randn(n, generator=g)
    return hidden.to(DEVICE), weight.to(DEVICE), targets.to(DEVICE), upstream.to(DEVICE)


def _run(hidden, weight, targets, upstream):
    hd, wd = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(hd, wd, targets, chunk_bytes=CHUNK, strategy="recompute", reduction="none")
    (loss * upstream).sum().backward()
    return loss.detach(), hd.grad, wd.grad


@pytest.mark.parametrize("n", [77, 80])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_hosted_sum_gives_the_gradients_of_a_separate_accumulator(n, dtype, monkeypatch):
    inputs = _inputs(n, dtype)
    hosted_splits = []
    accumulate = recompute._Gradients.accumulate_hosted

    def spy(self, *args, **kwargs):
        hosted_splits.append(self.dx_hosted.shape[0])
        return accumulate(self, *args, **kwargs)

    monkeypatch.setattr(recompute._Gradients, "accumulate_hosted", spy)
    loss, grad_hidden, grad_weight = _run(*inputs)
    assert hosted_splits == [n // 2, n // 2], "not one pass of two vocabulary blocks with the hosted sum"

    real = plan.plan_passes
    monkeypatch.setattr(plan, "plan_passes",
                        lambda *a, **k: tuple(dataclasses.replace(p, hosted=False) for p in real(*a, **k)))
    hosted_splits.clear()
    loss_sep, grad_hidden_sep, grad_weight_sep = _run(*inputs)
    assert not hosted_splits
    assert torch.equal(loss, loss_sep) and torch.equal(grad_weight, grad_weight_sep)  # the same da, dW products
    if ON_GPU:  # cuBLAS may cut the K sums of N / 2 rows differently from N rows': one rounding apart
        diff = (grad_hidden.float() - grad_hidden_sep.float()).abs()
        ulp = torch.finfo(dtype).eps * grad_hidden_sep.float().abs().clamp(min=torch.finfo(dtype).tiny)
        assert bool((diff <= ulp).all())
    else:
        assert torch.equal(grad_hidden, grad_hidden_sep)
    assert grad_hidden.abs().sum() > 0 and not grad_hidden.isnan().any()
