"""Who runs the gradient products (``products``), and that every runner sums in fp32 and rounds once:
cuBLAS may not round split-K partial sums to bf16 inside our calls, and the user's flags come back."""

import pytest
import torch

from conftest import DEVICE
from fused_linear_ce import products

FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


def _operands(m, k, p, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(k, p, generator=g).to(dtype).to(DEVICE)
    return a, b


def _out(a, b):
    return torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)


def _beyond_one_rounding(got, a, b, factor=1.0):
    """How far ``got`` is from the float64 product (a @ b) * factor beyond half a bf16 ulp, in units of the l2
    norm of each output's K terms. An fp32 sum of the terms (any order) stays near 2^-24 of that
    norm; bf16 partial sums (a split-K reduction rounded to the output type) reach ~2^-9."""
    a, b = a.double(), b.double()
    want = (a @ b) * factor
    binade = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))))
    half_ulp = binade * 2.0**-8
    terms = torch.sqrt((a * a) @ (b * b)) * abs(factor)
    return (((got.double() - want).abs() - half_ulp).clamp_min(0) / terms).max().item()


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "a-transposed"])
def test_direct_bf16_is_the_exact_sum_rounded_once(transposed):
    """A long reduction (k = 4096): the result is the float64 product rounded once to bf16, up to
    the fp32 summation's own error (bf16 partial sums would be ~1000x further off)."""
    a, b = _operands(48, 4096, 40, torch.bfloat16)
    if transposed:  # grad_weight's product reads da^T
        a = a.t().contiguous().t()
    got = products.direct(a, b, _out(a, b))
    assert got.dtype == torch.bfloat16 and got.shape == (48, 40)
    assert _beyond_one_rounding(got, a, b) <= 2.0**-16
    out = torch.empty(48, 40, dtype=torch.bfloat16, device=DEVICE)
    assert products.direct(a, b, out) is out and torch.equal(out, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_direct_sends_fp16_and_fp32_to_the_package_matmul(dtype, monkeypatch):
    """fp32 through cuBLAS would follow the user's TF32 switch; fp16 da carries a lift the products undo."""
    calls = []
    real = products.matmul
    monkeypatch.setattr(products, "matmul", lambda *args: calls.append(args) or real(*args))
    a, b = _operands(16, 64, 24, dtype)
    got = products.direct(a, b, _out(a, b))
    assert len(calls) == 1
    torch.testing.assert_close(got.double(), a.double() @ b.double(), rtol=2e-3, atol=2e-3)


def test_cublas_calls_run_without_reduced_precision_reductions_and_the_flags_come_back(monkeypatch):
    seen = []
    real_mm, real_addmm = torch.mm, torch.addmm

    def record(real):
        def run(*args, **kwargs):
            seen.append(tuple(getattr(torch.backends.cuda.matmul, f) for f in FLAGS))
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(torch, "mm", record(real_mm))
    monkeypatch.setattr(torch, "addmm", record(real_addmm))
    for f in FLAGS:
        monkeypatch.setattr(torch.backends.cuda.matmul, f, True)
    a, b = _operands(16, 64, 24, torch.bfloat16)
    acc = torch.zeros(16, 24, device=DEVICE)
    products.direct(a, b, _out(a, b))
    products.accumulate(a, b, acc, True)
    products.accumulate(a, b, acc, False)
    assert len(seen) == 3 and set(seen) == {(False, False)}
    assert all(getattr(torch.backends.cuda.matmul, f) for f in FLAGS), "the user's flags must come back"
    monkeypatch.setattr(torch, "mm", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        products.direct(a, b, _out(a, b))
    assert all(getattr(torch.backends.cuda.matmul, f) for f in FLAGS), "...after an error too"


def test_rows_product_without_a_factor_is_direct_and_with_one_scales_once():
    a, b = _operands(32, 2048, 40, torch.bfloat16)
    out = torch.empty(32, 40, dtype=torch.bfloat16, device=DEVICE)
    products.rows_product(a, b, out, None)
    assert torch.equal(out, products.direct(a, b, _out(a, b)))
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    products.rows_product(a, b, out, third)
    assert _beyond_one_rounding(out, a, b, 1.0 / 3.0) <= 2.0**-16
