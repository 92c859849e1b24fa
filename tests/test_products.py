"""Who runs the gradient products (``products``), and that every runner sums in fp32 and rounds once:
cuBLAS may not round split-K partial sums to bf16 inside our calls, and the user's flags come back."""

import dataclasses

import pytest
import torch

from conftest import DEVICE, ON_GPU
from fused_linear_ce import configs, products

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


class _MatmulSpy:
    """Wraps ``matmul_kernel`` and records each launch's TMA flags."""

    def __init__(self, kernel):
        self.kernel, self.flags = kernel, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.flags.append((kwargs["TMA"], kwargs["A_T"], kwargs["B_T"]))
            return self.kernel[grid](*args, **kwargs)

        return run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_t", [False, True], ids=["a-rows", "a-transposed"])
@pytest.mark.parametrize("b_t", [False, True], ids=["b-rows", "b-transposed"])
def test_matmul_through_tma_descriptors_is_the_sum_rounded_once(dtype, a_t, b_t, monkeypatch):
    """The Triton matmul with a factor (the products that carry the mean's 1/count) loads both
    operands through TMA descriptors over their storage, row-major or transposed (grad_weight's da^T
    is da read by columns). Ragged M, K and P (blocks past the edges load as 0): the float64 product
    times the factor, rounded once. fp32 accumulation and the factor applied before the rounding."""
    if ON_GPU and not configs.tma_hardware(torch.device(DEVICE)):
        pytest.skip("this GPU has no TMA hardware (compute capability < 9.0)")
    spy = _MatmulSpy(products.matmul_kernel)
    monkeypatch.setattr(products, "matmul_kernel", spy)
    a, b = _operands(200, 328, 88, dtype, seed=3)
    if a_t:
        a = a.t().contiguous().t()
    if b_t:
        b = b.t().contiguous().t()
    out = torch.empty(200, 88, dtype=dtype, device=DEVICE)
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    products.matmul(a, b, out, False, third)
    assert spy.flags == [(True, a_t, b_t)]
    assert _beyond_one_rounding(out, a, b, 1.0 / 3.0) <= 2.0**-16
    # Accumulating into fp32 adds to what is there.
    acc = torch.ones(200, 88, dtype=torch.float32, device=DEVICE)
    products.matmul(a, b, acc, True)
    want = a.double() @ b.double() + 1.0
    assert ((acc.double() - want).abs() / (a.double().abs() @ b.double().abs() + 1.0)).max() < 2.0**-20


def test_matmul_takes_pointer_loads_where_tma_does_not_apply(monkeypatch):
    """A row stride of 70 bf16 elements (140 bytes, not a multiple of 16) in A, fp32 on the GPU, or a
    config without TMA: pointer loads, the sum rounded once all the same."""
    spy = _MatmulSpy(products.matmul_kernel)
    monkeypatch.setattr(products, "matmul_kernel", spy)
    a, b = _operands(48, 70, 40, torch.bfloat16, seed=4)  # a: contiguous 140-byte rows
    out = torch.empty(48, 40, dtype=torch.bfloat16, device=DEVICE)
    products.matmul(a, b, out, False)
    assert spy.flags[-1][0] is False
    assert _beyond_one_rounding(out, a, b) <= 2.0**-16
    aligned = torch.zeros(48, 72, dtype=torch.bfloat16, device=DEVICE)
    aligned[:, :70] = a  # a view with 144-byte rows: TMA
    products.matmul(aligned[:, :70], b, out, False)
    assert spy.flags[-1][0] is True and _beyond_one_rounding(out, a, b) <= 2.0**-16
    a32, b32 = _operands(48, 64, 40, torch.float32, seed=5)
    products.matmul(a32, b32, torch.empty(48, 40, device=DEVICE), False)
    assert spy.flags[-1][0] is (not ON_GPU)  # fp32 keeps pointer loads on the GPU (NOTES v12)
    monkeypatch.setattr(configs, "_GPU_MATMUL", dataclasses.replace(configs._GPU_MATMUL, tma=False))
    monkeypatch.setattr(configs, "_CPU_MATMUL", dataclasses.replace(configs._CPU_MATMUL, tma=False))
    again = torch.empty_like(out)
    products.matmul(aligned[:, :70], b, again, False)
    assert spy.flags[-1][0] is False and _beyond_one_rounding(again, a, b) <= 2.0**-16


def test_product_with_a_factor_rounds_once_where_the_matmul_loads_through_tma(monkeypatch):
    """``product(scale_after=True)`` (the chunked path) applies a bf16 factor in the matmul's epilogue
    where it loads through TMA (``rounds_once``), else runs cuBLAS and scales after it; fp16 always
    goes to the matmul."""
    if ON_GPU and not configs.tma_hardware(torch.device(DEVICE)):
        pytest.skip("this GPU has no TMA hardware (compute capability < 9.0)")
    spy = _MatmulSpy(products.matmul_kernel)
    monkeypatch.setattr(products, "matmul_kernel", spy)
    monkeypatch.setattr(products, "few_tiles", lambda a, b: False)  # one tile here: as if it filled the GPU
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    a, b = _operands(64, 200, 40, torch.bfloat16, seed=6)  # a: 400-byte rows
    assert products.rounds_once(a, b) and products.rounds_once(a.half(), b.half())
    out = torch.empty(64, 40, dtype=torch.bfloat16, device=DEVICE)
    products.product(a, b, out, False, third, scale_after=True)
    assert spy.flags == [(True, False, False)]
    assert _beyond_one_rounding(out, a, b, 1.0 / 3.0) <= 2.0**-16
    a, b = _operands(64, 198, 40, torch.bfloat16, seed=6)  # a: 396-byte rows, no TMA
    assert not products.rounds_once(a, b) and products.rounds_once(a.half(), b.half())
    products.product(a, b, out, False, third, scale_after=True)
    assert len(spy.flags) == 1  # cuBLAS (or its CPU stand-in), then ``scale``
    torch.testing.assert_close(out.double(), (a.double() @ b.double()) / 3, rtol=8e-3, atol=1e-2)


def test_a_product_with_few_output_tiles_goes_to_cublas_with_an_fp32_result_and_rounds_once(monkeypatch):
    """Few output tiles (under half the SMs) with a long K: the Triton matmul would leave most of the
    GPU idle, so a bf16 product with a factor runs on cuBLAS with an fp32 result and one ``scale``,
    with or without ``scale_after``. (On the CPU ``few_tiles`` is never true: patched here.)"""
    spy = _MatmulSpy(products.matmul_kernel)
    monkeypatch.setattr(products, "matmul_kernel", spy)
    monkeypatch.setattr(products, "few_tiles", lambda a, b: True)
    third = torch.tensor([1.0 / 3.0], device=DEVICE)
    a, b = _operands(64, 198, 40, torch.bfloat16, seed=7)  # no TMA layout either
    assert products.rounds_once(a, b)
    for scale_after in (False, True):
        out = torch.empty(64, 40, dtype=torch.bfloat16, device=DEVICE)
        products.product(a, b, out, False, third, scale_after=scale_after)
        assert _beyond_one_rounding(out, a, b, 1.0 / 3.0) <= 2.0**-16
    assert spy.flags == []


def test_few_tiles_counts_the_matmul_output_tiles_against_the_sms():
    """S2's chunked grad_hidden at 256 MiB (512 rows x H 2304: 36 tiles of 128 x 256) is few on an
    H200 (132 SMs); S1's (1024 x 4096: 128 tiles) is not; nothing is on the CPU."""
    if not ON_GPU:
        a, b = _operands(8, 16, 8, torch.bfloat16)
        assert not products.few_tiles(a, b)
        return
    one = torch.zeros((1, 1), dtype=torch.bfloat16, device=DEVICE)
    sms = configs.sm_count(one.device)
    cfg = configs.matmul_config(torch.bfloat16)
    for m, p in ((512, 2304), (1024, 4096), (128, 256)):
        tiles = -(-m // cfg.block_m) * -(-p // cfg.block_p)
        got = products.few_tiles(one.expand(m, 1000), one.expand(1000, p))
        assert got == (2 * tiles < sms)
