"""The compensated pair's remainders kept in the sum's fp32 bits (``pairs.pair_of``): an int8
remainder (the recompute path's long-context grad_hidden, ``BackwardPlan.paired``) and 4-bit ones two
a byte (the long-context chunked path's grad_weight), a bf16 hi each: within the bound against float64
(``compensated_sums.error_bound`` plus the split of the bits kept), hi the exact sum rounded once but
near a tie, overflow and NaN, refused buffers; the long-context plan's int8 pair against the fp32
accumulator's; and the tiles and epilogues that must sum the same bits (the "paired_rows" config,
``MatmulConfig.split_pair``). The 16-bit remainder: test_compensated.py."""

import dataclasses

import pytest
import torch

from conftest import DEVICE, ON_GPU, KernelSpy
from fused_linear_ce import configs, gemm, pairs, products

pytest.register_assert_rewrite("compensated_sums")
from compensated_sums import (  # noqa: E402
    BITS, SUBNORMAL_QUANTUM, error_bound, exact_sum, garbage, make_chunks, rounded, sum_chunks, ulps_apart,
)


@pytest.mark.parametrize("lo_dtype", [torch.int8, torch.uint8], ids=["int8", "4-bit"])
def test_a_pair_in_the_sums_bits_overflows_to_inf_and_keeps_nan(lo_dtype):
    """The int8 and 4-bit remainders' splits work on the sum's fp32 bits (``pairs.pair_of``): a sum
    that rounds past bf16's largest value (2^127 (2 - 2^-8), a tie rounded to even, or half up: inf,
    though fp32 holds it) leaves hi inf and lo 0, inf stays inf when less is added, one past fp32's
    range too, and a NaN stays NaN (the GPU's NaN, all ones, would wrap the bits' integer rounding)."""
    dtype = torch.bfloat16
    a = torch.full((16, 16), 2.0**62, dtype=dtype, device=DEVICE)
    b = torch.full((16, 16), 2.0**61, dtype=dtype, device=DEVICE)  # each entry 2^127
    hi = torch.empty(16, 16, dtype=dtype, device=DEVICE)
    lo = pairs.compensation_buffer(hi, lo_dtype)
    products.compensated(a, b, hi, lo, False)
    assert (hi == 2.0**127).all() and (lo == 0).all()
    products.compensated(a, b * (1 - 2.0**-8), hi, lo, True)  # 2^127 (2 - 2^-8): fp32 holds it
    assert torch.isinf(hi).all() and (hi > 0).all() and (lo == 0).all()
    products.compensated(a, -b / 4, hi, lo, True)
    assert torch.isinf(hi).all() and (hi > 0).all() and (lo == 0).all()
    hi2 = torch.empty(16, 16, dtype=dtype, device=DEVICE)
    lo2 = pairs.compensation_buffer(hi2, lo_dtype)
    products.compensated(a, -b, hi2, lo2, False)
    products.compensated(a, -b, hi2, lo2, True)  # -2^128: past fp32's range
    assert torch.isinf(hi2).all() and (hi2 < 0).all() and (lo2 == 0).all()
    a[0, 0] = float("nan")
    hi3 = torch.empty(16, 16, dtype=dtype, device=DEVICE)
    lo3 = pairs.compensation_buffer(hi3, lo_dtype)
    products.compensated(a, b / 8, hi3, lo3, False)
    a[0, 0] = 1.0
    products.compensated(a, b / 8, hi3, lo3, True)
    assert torch.isnan(hi3[0]).all() and (lo3[0] == 0).all() and not torch.isnan(hi3[1:]).any()
    assert (hi3[1:] == 2.0**125).all() and (lo3[1:] == 0).all()


def _pair_int8(hi, lo):
    """The fp32 whose bit pattern is hi's 16 bits followed by 16 zeros plus lo units of 2^8
    (``pairs.pair_value``), in float64."""
    bits = (hi.cpu().view(torch.int16).to(torch.int32) << 16) + lo.cpu().to(torch.int32) * 256
    return bits.view(torch.float32).double()


def test_an_int8_remainder_holds_the_sum_like_a_bf16_one():
    """The recompute path's long-context grad_hidden (``BackwardPlan.paired``): a bf16 hi with an int8
    remainder in whole units of 2^8 of the sum's fp32 bits (2^-15 of its binade). The same 24 products
    as test_compensated.py's first test: the pair within the bound with the split's 2^-15 (a step at
    worst, a tie; against 2^-16 for a bf16 lo), hi the exact sum rounded once but for a few entries
    near a tie, where the plain bf16 sum drifts. Measured on the interpreter: max 2^-13.9, mean 2^-16.0
    relative (bf16 lo: 2^-15.4, 2^-17.4; v25's int8 remainder in steps of hi's binade: 2^-13.9,
    2^-15.9)."""
    dtype = torch.bfloat16
    n, m, k, p = 24, 48, 16, 40
    chunks = make_chunks(n, m, k, p, dtype)
    hi = garbage((m, p), dtype)
    lo = pairs.compensation_buffer(hi, torch.int8)
    lo.fill_(-128)  # garbage: the first call writes it
    assert lo.dtype == torch.int8 and lo.shape == hi.shape and lo.stride() == hi.stride()
    sum_chunks(chunks, hi, lo)

    exact, bound = error_bound(chunks, dtype)
    # error_bound has the bf16 remainder's split (2^-16 of each partial sum); an int8 one loses up to 2^-15.
    _, partials, _ = exact_sum(chunks)
    bound = bound + sum(2.0**-16 * 1.001 * s for s in partials)
    err = (_pair_int8(hi, lo) - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    rel = err / exact.abs()
    print("int8 pair relative error: max 2^%.1f, mean 2^%.1f" % (rel.max().log2(), rel.mean().log2()))
    assert rel.max() <= 2.0**-13.5 and rel.mean() <= 2.0**-15.5, (rel.max().log2(), rel.mean().log2())
    want = rounded(exact, dtype)
    ulps = ulps_apart(hi, want)
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 0.01 * ulps.numel(), torch.bincount(ulps.flatten())
    # Dropping the remainder (hi alone after each call) is the plain sum: far worse.
    plain = garbage((m, p), dtype)
    for i, (a, b) in enumerate(chunks):
        gemm.matmul(a, b, plain, i > 0)
    assert (ulps_apart(plain, want) > 0).float().mean() >= 0.3


def test_an_int8_remainder_needs_a_bf16_hi():
    a, b = make_chunks(1, 8, 16, 8, torch.float16)[0]
    hi = torch.zeros((8, 8), dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="int8 remainder is for a bf16 hi"):
        products.compensated(a, b, hi, torch.zeros((8, 8), dtype=torch.int8, device=DEVICE), False)


def test_the_long_context_plan_sums_grad_hidden_in_the_int8_pair(monkeypatch):
    """bf16, V < 2N, no fp32 accumulator in half of ``chunk_bytes``: the recompute backward runs one
    pass of two vocabulary blocks whose grad_hidden goes through ``compensated`` with an int8
    remainder (test_correctness.py checks these cases against float64), and its result is the
    fp32-accumulator plan's (a larger budget) but for rare one-ulp ties."""
    from fused_linear_ce import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    n, h, v = 300, 96, 500
    hidden = torch.randn(n, h, generator=g).bfloat16().to(DEVICE)
    weight = (0.5 * torch.randn(v, h, generator=g)).bfloat16().to(DEVICE)
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    calls = []
    original = products.compensated

    def spy(a, b, hi, lo, accumulate, unscale=None, role="product"):
        calls.append((lo.dtype, accumulate, b.shape[0], role))
        return original(a, b, hi, lo, accumulate, unscale, role)

    def grads(chunk_bytes):
        x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        fused_linear_cross_entropy(x, w, targets, chunk_bytes=chunk_bytes, strategy="recompute").backward()
        return x.grad, w.grad

    monkeypatch.setattr(products, "compensated", spy)
    dx, dw = grads(200000)
    assert calls == [(torch.int8, False, 256, "paired_rows"), (torch.int8, True, 244, "paired_rows")]
    calls.clear()
    dx_fp32, dw_fp32 = grads(4 * n * h * 2 + n * 256 * 2)  # the N x H fp32 accumulator in half the budget
    assert calls == []
    assert torch.equal(dw, dw_fp32)  # grad_weight: each block's whole sum at once, in both plans
    # Off by one ulp where the sum lies within the pair's error of a tie (measured: 0.16% of entries);
    # more only where the sum cancels to far below its partial sums, whose 2^-16 the pair carries
    # (measured: 28 ulps on an entry of 3e-8 in a row of 1e-3 entries).
    ulps = ulps_apart(dx, dx_fp32)
    assert (ulps > 0).float().mean() <= 0.01
    diff = (dx.double() - dx_fp32.double()).abs().cpu()
    one_ulp = _ulps_size(dx_fp32)
    row_scale = dx_fp32.double().abs().amax(dim=1, keepdim=True).cpu()
    assert (diff <= torch.maximum(one_ulp, 2.0**-13 * row_scale)).all()


def _ragged_product(seed):
    """bf16 operands a (M, K) and b (K, P) of a product summed into a pair, the pair's starting hi and
    an unscale factor. Ragged against the tiles (M = 1000, P = 640 on the GPU: the last 256-wide
    tile's right half lies wholly past the edge; 200 x 160 against the interpreter's 64 x 64), with
    rows 16-byte aligned so that the pair goes through descriptors, as every pair the package sums
    into does (the interpreter runs them too)."""
    g = torch.Generator().manual_seed(seed)
    m, k, p = (1000, 300, 640) if ON_GPU else (200, 72, 160)
    a = (1e-2 * torch.randn(m, k, generator=g)).bfloat16().to(DEVICE)
    b = torch.randn(k, p, generator=g).bfloat16().to(DEVICE)
    start = torch.randn(m, p, generator=g).bfloat16().to(DEVICE)
    return a, b, start, torch.tensor([0.75], device=DEVICE)


def test_the_paired_rows_config_sums_the_same_bits(monkeypatch):
    """The paired plan's grad_hidden product has its own tiles on the GPU (``configs.matmul_config``'s
    "paired_rows": 128 x 128); each output's K reduction runs in the same steps whatever the tile, so
    the pair holds the same bits as with the shared config, ragged edges included. On the
    interpreter both roles are the one CPU config (the launch records say so)."""
    spy = KernelSpy(gemm.matmul_kernel)
    monkeypatch.setattr(gemm, "matmul_kernel", spy)
    a, b, start, unscale = _ragged_product(3)
    results = []
    for role in ("product", "paired_rows"):
        hi = start.clone()
        lo = pairs.compensation_buffer(hi, torch.int8)
        products.compensated(a, b, hi, lo, True, unscale, role=role)
        products.compensated(a, b, hi, lo, True, unscale, role=role)
        results.append((hi, lo))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    tiles = [(launch["BLOCK_M"], launch["BLOCK_P"], launch["C_TMA"]) for launch in spy.launches]
    want = configs.matmul_config(torch.bfloat16, role="paired_rows")
    assert tiles[2:] == [(want.block_m, want.block_p, True)] * 2
    assert (tiles[0] != tiles[2]) == ON_GPU


@pytest.mark.parametrize("lo_dtype", [torch.int8, torch.bfloat16, torch.uint8])
def test_the_split_epilogue_sums_the_same_bits(lo_dtype, monkeypatch):
    """``MatmulConfig.split_pair``: the pair's epilogue runs on the tile's two column halves in turn
    (descriptors of half the width; fewer registers live). The arithmetic per element is the same, so
    the pair holds the same bits as with the whole tile, ragged edges included."""
    spy = KernelSpy(gemm.matmul_kernel)
    monkeypatch.setattr(gemm, "matmul_kernel", spy)
    a, b, start, unscale = _ragged_product(4)
    shipped = configs.matmul_config(torch.bfloat16)
    results = []
    for split in (False, True):
        cfg = dataclasses.replace(shipped, split_pair=split)
        monkeypatch.setattr(configs, "matmul_config", lambda dtype, role="product", where=None, cfg=cfg: cfg)
        hi = start.clone()
        lo = pairs.compensation_buffer(hi, lo_dtype)
        products.compensated(a, b, hi, lo, False, unscale)
        products.compensated(a, b, hi, lo, True, unscale)
        results.append((hi, lo))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert [(launch["C_TMA"], launch["SPLIT_PAIR"]) for launch in spy.launches] == [(True, False)] * 2 + [(True, True)] * 2


def _ulps_size(t: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp of each entry (float64, CPU)."""
    x = t.double().cpu()
    _, e = torch.frexp(x)
    return torch.exp2(torch.clamp(e.double() - BITS[torch.bfloat16], min=SUBNORMAL_QUANTUM[torch.bfloat16]))


def _pair_4bit(hi, lo):
    """The value of a bf16 hi with 4-bit remainders two a byte (``pairs.pack_nibbles``): hi's bits
    followed by the column's signed nibble in units of 2^12."""
    b = lo.cpu().to(torch.int32)
    nibbles = torch.stack([(b << 28) >> 28, (b << 24) >> 28], -1).reshape(lo.shape[0], -1)[:, : hi.shape[1]]
    bits = (hi.cpu().view(torch.int16).to(torch.int32) << 16) + nibbles * 4096
    return bits.view(torch.float32).double()


@pytest.mark.parametrize("p", [64, 41], ids=["descriptors", "pointers-odd"])
def test_a_4bit_remainder_holds_the_sum_to_12_bits(p):
    """The long-context chunked path's grad_weight (``plan.LONG_CONTEXT``): a bf16 hi with
    4-bit remainders two a byte, (M, ceil(P / 2)) bytes. The same 24 products as test_compensated.py's
    first test: the pair within the bound with a split of 2^-12 of each partial sum (s's bits rounded
    to their top 20); hi the exact sum rounded once but near a tie (one ulp); the plain bf16 sum far
    worse. P = 64: the
    pair through descriptors (``test_the_split_epilogue_sums_the_same_bits`` has them ragged); P = 41:
    rows of 21 bytes, through pointers, the last byte's high half past the edge. Measured on the
    interpreter: max 2^-9.9 / 2^-9.8, mean 2^-12.0 relative (int8: 2^-13.9, 2^-16.0; plain 2^-6.0, 2^-8.0)."""
    dtype = torch.bfloat16
    n, m, k = 24, 48, 16
    chunks = make_chunks(n, m, k, p, dtype)
    hi = garbage((m, p), dtype)
    lo = pairs.compensation_buffer(hi, torch.uint8)
    assert lo.dtype == torch.uint8 and lo.shape == (m, (p + 1) // 2) and lo.is_contiguous()
    lo.fill_(0x88)  # garbage: the first call writes it
    spy = KernelSpy(gemm.matmul_kernel)
    try:
        gemm.matmul_kernel, original = spy, gemm.matmul_kernel
        sum_chunks(chunks, hi, lo)
    finally:
        gemm.matmul_kernel = original
    assert [s["C_TMA"] for s in spy.launches] == [p == 64] * n  # 32-byte rows of remainders, or 21

    exact, bound = error_bound(chunks, dtype)
    _, partials, _ = exact_sum(chunks)
    bound = bound + sum(2.0**-12 * 1.001 * s for s in partials)  # the split: 2^-12 (bf16 lo: 2^-16)
    err = (_pair_4bit(hi, lo) - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    rel = err / exact.abs()
    assert rel.max() <= 2.0**-9.5 and rel.mean() <= 2.0**-11.5, (rel.max().log2(), rel.mean().log2())
    assert rel.mean() >= 2.0**-13.5  # not the int8 pair's 2^-16: the test sees the 4 bits it has
    want = rounded(exact, dtype)
    ulps = ulps_apart(hi, want)
    assert ulps.max() <= 1 and (ulps > 0).float().mean() <= 0.1, torch.bincount(ulps.flatten())
    plain = garbage((m, p), dtype)
    for i, (a, b) in enumerate(chunks):
        gemm.matmul(a, b, plain, i > 0)
    plain_rel = (plain.double().cpu() - exact).abs() / exact.abs()
    assert plain_rel.mean() >= 2.0**3 * rel.mean()


def test_a_4bit_remainder_is_a_half_width_buffer_for_a_bf16_hi():
    a, b = make_chunks(1, 8, 16, 8, torch.bfloat16)[0]
    hi = torch.zeros((8, 8), dtype=torch.bfloat16, device=DEVICE)
    for lo in (torch.zeros((8, 8), dtype=torch.uint8, device=DEVICE),  # one byte a column
               torch.zeros((8, 8), dtype=torch.uint8, device=DEVICE)[:, :4]):  # not contiguous
        with pytest.raises(ValueError, match="4-bit remainder"):
            products.compensated(a, b, hi, lo, False)
    with pytest.raises(ValueError, match="4-bit remainder is for a bf16 hi"):
        products.compensated(a, b, hi.half(), torch.zeros((8, 4), dtype=torch.uint8, device=DEVICE), False)
