"""Realistic sizes on the GPU: the Llama-3 lm-head shape in bf16 against an fp32-logit reference."""

import pytest
import torch

from conftest import ON_GPU, rel_err
from fused_linear_ce import fused_linear_cross_entropy
from fused_linear_ce.reference import chunked_linear_cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (realistic sizes)"), pytest.mark.tier]


def _inputs(n, h, v, peaked, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    weight = torch.randn(v, h, device="cuda", generator=g) * (1.0 / h) ** 0.5
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    hidden = torch.randn(n, h, device="cuda", generator=g)
    if peaked:  # each row leans to its target's weight row: p(target) high, like a trained model
        hidden = hidden + 14.0 * weight[targets] / weight[targets].norm(dim=1, keepdim=True) ** 2
    else:  # logits std ~2
        hidden = hidden * 2.0
    return hidden.bfloat16(), weight.bfloat16(), targets


@pytest.mark.parametrize("peaked", [False, True], ids=["random", "peaked"])
@pytest.mark.parametrize("chunk_bytes", [None, 64 << 20], ids=["default", "64MiB"])
def test_llama_shape_bf16_against_fp32_reference(peaked, chunk_bytes):
    n, h, v = 4096, 4096, 128256
    hidden, weight, targets = _inputs(n, h, v, peaked)
    total, count, ref_dx, ref_dw, _ = chunked_linear_cross_entropy(
        hidden, weight, targets, chunk=1024, compute_dtype=torch.float64
    )
    hd, wd = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(hd, wd, targets, chunk_bytes=chunk_bytes)
    loss.backward()
    # Peaked rows: the loss (~0.2) is lse - z_t with both ~14, so fp32 logits' absolute error (~1e-5,
    # from H = 4096 products) is ~5e-5 of it; random rows: loss ~ 12, no cancellation.
    assert rel_err(loss, total / count) < (2e-4 if peaked else 1e-5)
    assert rel_err(hd.grad, ref_dx / count) < 3e-3
    assert rel_err(wd.grad, ref_dw / count) < 3e-3


# Every plan of the backward at this size (``backward_passes.plan_passes``, GPU tiles) and the chunked path.
RARE_ROW_SETTINGS = {
    "default": dict(),  # auto: the chunked path in one chunk (the 250 MiB plane fits in its 256 MiB)
    "recompute": dict(strategy="recompute"),  # 192 MiB: the hosted N x H accumulator, two vocabulary blocks
    "recompute-whole": dict(strategy="recompute", chunk_bytes=256 << 20),  # the whole plane in one block
    "16MiB": dict(chunk_bytes=16 << 20),  # recompute: the hosted accumulator's extra half in half the budget
    "12MiB": dict(chunk_bytes=12 << 20),  # recompute: the accumulator in grad_weight's memory
    "1MiB": dict(chunk_bytes=1 << 20),  # recompute: token blocks, V x H accumulator
    "chunked-64MiB": dict(strategy="chunked", chunk_bytes=64 << 20),  # 4 chunks summed in fp32
}


@pytest.mark.parametrize("setting", list(RARE_ROW_SETTINGS))
def test_rare_vocabulary_row_gets_its_gradient_from_one_token(setting):
    """One class is the target of a single token among 4096: its weight-gradient row is that token's
    (p - 1) * hidden plus the tiny softmax mass of the others; fp32 accumulation keeps it exact, in
    every setting (hidden takes a gradient too, so that the plans that sum grad_hidden run)."""
    n, h, v = 4096, 1024, 32000
    hidden, weight, targets = _inputs(n, h, v, peaked=True, seed=1)
    targets[targets == 7] = 8
    targets[1234] = 7
    total, count, _, ref_dw, _ = chunked_linear_cross_entropy(
        hidden, weight, targets, chunk=1024, compute_dtype=torch.float64
    )
    hd, wd = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    fused_linear_cross_entropy(hd, wd, targets, reduction="sum", **RARE_ROW_SETTINGS[setting]).backward()
    assert rel_err(wd.grad[7], ref_dw[7]) < 3e-3
