"""fused_linear_divergence's values and gradients against the float64 plain-torch reference
(``reference.linear_divergence``, through ``divergence_cases.check``): forward KL, reverse KL and the
generalized JSD, their values, the student's entropy and target log-prob, and the gradients of hidden,
weight and bias for random upstream gradients, on both strategies, in several chunks, under every
option, under autocast; extremes stay finite and right; nothing counted gives NaN and zero gradients.
How a call runs (its chunks, groups, products, compiles, memory): test_divergence_plan.py; bad inputs:
test_divergence_errors.py.

CPU (the Triton interpreter) runs fp32 and fp16 at small odd sizes; bf16 is covered by the GPU run
(``test_gpu_bf16_realistic`` and the parametrised cases, which take bf16 there): the interpreter's
``tl.dot`` is wrong for bf16 operands (triton#11584).
"""

import pytest
import torch

from conftest import DEVICE, ON_GPU, rel_err
from fused_linear_ce import fused_linear_divergence, reference
from fused_linear_ce import plan as plan_module

pytest.register_assert_rewrite("divergence_cases")
from divergence_cases import (  # noqa: E402
    DTYPES, GRAD_TOL, N, SMALL_CHUNKS, V, VALUE_TOL, check, divergence_inputs,
)


@pytest.mark.parametrize("beta,reduction", [(b, r) for b in (0.0, 0.3, 0.5, 1.0) for r in ("mean", "none")]
                         + [(0.3, "sum")])


def test_matches_reference_fp32(beta, reduction):
    """With a random upstream gradient on log_probs too where beta is 0.3 (on the chunked strategy its
    gradient comes from a recompute in the backward)."""
    check(divergence_inputs(torch.float32, bias=True), torch.float32, lp_grad=beta == 0.3, beta=beta,
          reduction=reduction, temperature=1.5)


@pytest.mark.parametrize("dtype", [d for name, d in DTYPES.items() if name != "fp32"], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("beta,reduction", [(0.0, "mean"), (0.3, "none"), (0.5, "sum"), (1.0, "mean")])
def test_matches_reference_16bit(beta, reduction, dtype):
    check(divergence_inputs(dtype, bias=True), dtype, lp_grad=reduction == "none", beta=beta, reduction=reduction)


OPTION_CASES = {
    "softcaps": dict(student_softcap=3.0, teacher_softcap=5.0, beta=0.5),
    "scales_temperature": dict(student_logit_scale=0.7, teacher_logit_scale=1.3, temperature=0.6, beta=1.0),
    "softcap_temperature_fkl": dict(student_softcap=4.0, temperature=2.0, beta=0.0),
    "recompute_mean": dict(strategy="recompute", beta=0.3, student_softcap=6.0, lp_grad=True),
    "no_targets": dict(beta=0.3, outputs=("entropy",)),
    "num_items_int": dict(beta=0.0, num_items_in_batch=50),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options(case):
    kwargs = dict(OPTION_CASES[case])
    inputs = divergence_inputs(torch.float32, bias=True, teacher_bias=True)
    if case == "no_targets":
        inputs.pop("targets")
    check(inputs, torch.float32, **kwargs)


def test_num_items_tensor_and_sum():
    inputs = divergence_inputs(torch.float32)
    with torch.no_grad():
        a = fused_linear_divergence(**inputs, beta=0.3, num_items_in_batch=torch.tensor(40.0, device=DEVICE))
        b = fused_linear_divergence(**inputs, beta=0.3, reduction="sum")
    assert torch.allclose(a * 40, b, rtol=1e-6)


@pytest.mark.parametrize("beta,strategy,reduction", [(0.0, "chunked", "mean"), (1.0, "recompute", "none")])
def test_several_chunks(beta, strategy, reduction):
    assert plan_module.divergence_chunk_rows(N, V, SMALL_CHUNKS) < N
    check(divergence_inputs(torch.float32, bias=True), torch.float32, beta=beta, strategy=strategy,
          reduction=reduction, chunk_bytes=SMALL_CHUNKS, student_softcap=5.0, lp_grad=reduction == "none")


def test_several_chunks_fp16_mask():
    inputs = divergence_inputs(torch.float16)
    mask = torch.ones(N, dtype=torch.bool, device=DEVICE)
    mask[16:32] = False  # the whole second chunk uncounted
    check(inputs, torch.float16, beta=0.5, mask=mask, chunk_bytes=SMALL_CHUNKS, lp_grad=True)


def test_mask_and_ignore_index():
    inputs = divergence_inputs(torch.float32, bias=True)
    mask = torch.rand(N, generator=torch.Generator().manual_seed(3)).to(DEVICE) > 0.3
    inputs["targets"][inputs["targets"] == -100] = 7  # ignore_index 7: -100 would be out of range
    inputs["targets"][11] = 7
    check(inputs, torch.float32, beta=0.3, mask=mask, ignore_index=7, reduction="none")
    div, fields = fused_linear_divergence(**inputs, beta=0.3, mask=mask, ignore_index=7, reduction="none",
                                          outputs=("entropy", "log_probs"))
    uncounted = ~mask | (inputs["targets"] == 7)
    for t in (div, fields["entropy"], fields["log_probs"]):
        assert (t[uncounted] == 0).all() and (t[~uncounted] != 0).all()


def test_leading_dims():
    inputs = divergence_inputs(torch.float32, lead=(3, 13))
    div, fields, _ = check(inputs, torch.float32, beta=0.5, reduction="none")
    assert div.shape == (3, 13)


@pytest.mark.parametrize("which", ["student_hidden", "student_weight"])
def test_gradient_of_one_leaf(which):
    inputs = divergence_inputs(torch.float32, bias=True)
    for name in ("student_hidden", "student_weight", "student_bias"):
        if name != which:
            inputs[name] = inputs[name].detach()
    check(inputs, torch.float32, beta=0.3)


def test_teacher_gets_no_gradient():
    inputs = divergence_inputs(torch.float32, teacher_bias=True)
    for name in ("teacher_hidden", "teacher_weight", "teacher_bias"):
        inputs[name].requires_grad_(True)
    div = fused_linear_divergence(**inputs, beta=0.5)
    div.backward()
    assert all(inputs[name].grad is None for name in ("teacher_hidden", "teacher_weight", "teacher_bias"))
    assert inputs["student_weight"].grad is not None


@pytest.mark.parametrize("beta", [1e-6, 1 - 1e-6, 0.0, 1.0])
def test_extreme_beta_and_one_hot_teacher(beta):
    """beta near 0 and 1 with a near one-hot teacher: finite, and right against float64."""
    inputs = divergence_inputs(torch.float32, peaked=True)
    div, _, grads = check(inputs, torch.float32, beta=beta, reduction="none")
    assert torch.isfinite(div).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_huge_logits_with_softcap(beta):
    """Logits of +-1e4 saturate both softcaps: p's near one-hot, the softcap's derivative 0 there. The
    gradients are limited by the fp32 products (an error of ~1e-3 in a logit of 1e4 moves the
    softcap's derivative ``1 - tanh^2`` by 1e-4 relative): three-way against plain fp32 torch."""
    inputs = divergence_inputs(torch.float32)
    with torch.no_grad():
        inputs["student_weight"].mul_(3e3)
        inputs["teacher_weight"].mul_(3e3)
    div, _, grads = check(inputs, torch.float32, beta=beta, student_softcap=20.0, teacher_softcap=30.0,
                          three_way=True)
    assert torch.isfinite(div) and all(torch.isfinite(g).all() for g in grads)


def test_out_of_range_target_is_nan():
    inputs = divergence_inputs(torch.float32)
    inputs["targets"][5] = V
    div, fields = fused_linear_divergence(**inputs, beta=0.3, reduction="none", outputs=("log_probs",))
    assert torch.isnan(div[5]) and torch.isnan(fields["log_probs"][5])
    assert torch.isfinite(div[torch.arange(N, device=DEVICE) != 5]).all()


def test_nothing_counted():
    inputs = divergence_inputs(torch.float32)
    mask = torch.zeros(N, dtype=torch.bool, device=DEVICE)
    total = fused_linear_divergence(**inputs, beta=0.3, mask=mask, reduction="sum")
    total.backward()
    assert total == 0 and (inputs["student_weight"].grad == 0).all() and (inputs["student_hidden"].grad == 0).all()
    assert torch.isnan(fused_linear_divergence(**inputs, beta=0.3, mask=mask))


@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
@pytest.mark.parametrize("nothing", ["mask", "ignore_index"])
@pytest.mark.parametrize("denominator", ["mean", "num_items_0"])
def test_nothing_counted_has_zero_gradients_over_no_rows(strategy, nothing, denominator):
    """No row counted, divided by no rows ("mean") or by num_items_in_batch=0: the value is 0 / 0 =
    NaN (as documented), every student gradient exactly 0 on both strategies, with a log-prob
    gradient beside it too (the cross-entropy's rule; 0 x 1/0 in the products' epilogue would be
    NaN). fp32 and fp16 (bf16 on the GPU) run the same host code."""
    dtype = torch.float16 if nothing == "mask" else torch.float32
    inputs = divergence_inputs(dtype, bias=True)
    kwargs = dict(beta=0.3, strategy=strategy, outputs=("log_probs",))
    if nothing == "mask":
        kwargs["mask"] = torch.zeros(N, dtype=torch.bool, device=DEVICE)
    else:
        inputs["targets"][:] = -100
    if denominator == "num_items_0":
        kwargs.update(reduction="sum", num_items_in_batch=0)
    div, fields = fused_linear_divergence(**inputs, **kwargs)
    assert torch.isnan(div)
    (div + fields["log_probs"].float().sum()).backward()
    for name in ("student_hidden", "student_weight", "student_bias"):
        grad = inputs[name].grad
        assert grad is not None and grad.dtype == dtype and (grad == 0).all(), name


@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
def test_autocast_master_weight(strategy):
    """Under a 16-bit autocast the operands go in fp16 (the same divergence as an explicit cast, with
    the gradients asked for as here: a values-only kernel is compiled apart and may sum in another
    order), and the fp32 student weight's gradient is the products' fp32 sum of the fp16 da, never
    rounded to fp16 itself (its entries are not all fp16 values), within fp16's tolerance of float64."""
    inputs = divergence_inputs(torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        a = fused_linear_divergence(**inputs, beta=0.3, strategy=strategy)
    half = {k: (v.detach().half() if v.is_floating_point() else v) for k, v in inputs.items()}
    half["student_weight"].requires_grad_(True)
    b = fused_linear_divergence(**half, beta=0.3, strategy=strategy)
    half["student_weight"].requires_grad_(False)
    assert a.dtype == torch.float32 and torch.equal(a, b)
    with torch.no_grad():
        assert rel_err(fused_linear_divergence(**half, beta=0.3), b) <= VALUE_TOL
    a.backward()
    grad = inputs["student_weight"].grad
    assert grad.dtype == torch.float32
    leaves = {k: (v.double().requires_grad_(k == "student_weight") if v.is_floating_point() else v)
              for k, v in half.items()}
    want = torch.autograd.grad(reference.linear_divergence(**leaves, beta=0.3), leaves["student_weight"])[0]
    assert rel_err(grad, want) <= GRAD_TOL[torch.float16]
    assert (grad != grad.half().float()).any()


@pytest.mark.skipif(not ON_GPU, reason="realistic sizes in bf16 need the GPU")
@pytest.mark.parametrize("h_t", [1024, 2048])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gpu_bf16_realistic(beta, h_t):
    """2048 x 1024 / h_t x 32000 bf16 against an fp32 reference (the float64 logits would take 500 MiB
    each; fp32 logits of bf16 inputs are what the kernel computes, up to the order of its sums)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h_s, v = 2048, 1024, 32000
    hs = torch.randn(n, h_s, device="cuda", generator=g).bfloat16().requires_grad_()
    ws = (torch.randn(v, h_s, device="cuda", generator=g) / h_s**0.5 * 3).bfloat16().requires_grad_()
    ht = torch.randn(n, h_t, device="cuda", generator=g).bfloat16()
    wt = (torch.randn(v, h_t, device="cuda", generator=g) / h_t**0.5 * 3).bfloat16()
    kwargs = dict(beta=beta, temperature=2.0, student_softcap=30.0)
    for strategy, chunk_bytes in (("chunked", 128 << 20), ("recompute", None)):
        div = fused_linear_divergence(hs, ws, ht, wt, strategy=strategy, chunk_bytes=chunk_bytes, **kwargs)
        gh, gw = torch.autograd.grad(div, (hs, ws))
        leaves = [t.detach().float().requires_grad_() for t in (hs, ws)]
        rdiv = reference.linear_divergence(leaves[0], leaves[1], ht.float(), wt.float(), compute_dtype=torch.float32,
                                           **kwargs)
        rgh, rgw = torch.autograd.grad(rdiv, leaves)
        assert rel_err(div, rdiv) <= 1e-4
        assert rel_err(gh, rgh) <= 1.2e-2 and rel_err(gw, rgw) <= 1.2e-2
