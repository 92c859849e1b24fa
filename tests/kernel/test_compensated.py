"""The compensated pair of 16-bit buffers (``products.compensated``) with a 16-bit remainder: a sum of
many products kept in hi (the result's dtype) and lo (bf16) in place of an fp32 accumulator. hi + lo
follows the exact sum to ~2^-16 of the partial sums (bf16 hi), hi ends as the exact sum rounded once
but for rare ties, and a plain 16-bit accumulator on the same data drifts by several ulps; per-product
factors, ragged edges through descriptors and pointers, the first call over garbage, an fp16 hi,
overflow and NaN, refused buffers, and the plain matmul's launches. Against float64 within
``compensated_sums.error_bound``; the remainders kept in the sum's bits (int8, 4-bit):
test_compensated_bits.py."""

import pytest
import torch

from conftest import DEVICE, ON_GPU, KernelSpy
from fused_linear_ce import configs, device, gemm, pairs, products

pytest.register_assert_rewrite("compensated_sums")
from compensated_sums import (  # noqa: E402
    error_bound, exact_sum, garbage, make_chunks, pair_sum, rounded, sum_chunks, ulps_apart,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@DTYPES
def test_the_pair_follows_the_exact_sum_where_a_plain_16bit_sum_drifts(dtype):
    """24 products of K = 16 with a common offset, entries over 2^18 of range (hi fp16: scaled into
    its range). The pair: within ``error_bound`` everywhere, ~2^-16 relative (bf16 hi; 2^-19 for fp16);
    hi the exact sum rounded once except a few entries within that error of a tie, one ulp off. The
    same products summed in a plain 16-bit c (matmul, ACCUMULATE): 2^-8 relative on average, up to 3
    ulps off, over half the entries wrong."""
    n, m, k, p = 24, 48, 16, 40
    chunks = make_chunks(n, m, k, p, dtype, scale=1.0 if dtype == torch.bfloat16 else 2.0**-6)
    hi = garbage((m, p), dtype)
    lo = pairs.compensation_buffer(hi)
    assert lo.dtype == torch.bfloat16 and lo.shape == hi.shape and lo.stride() == hi.stride()
    sum_chunks(chunks, hi, lo)
    plain = garbage((m, p), dtype)
    for i, (a, b) in enumerate(chunks):
        gemm.matmul(a, b, plain, i > 0)

    exact, bound = error_bound(chunks, dtype)
    err = (pair_sum(hi, lo) - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    rel = err / exact.abs()
    plain_rel = (plain.double().cpu() - exact).abs() / exact.abs()
    # Measured on the interpreter: bf16 max 2^-15.4, mean 2^-17.4; fp16 hi 2^-18.3, 2^-20.4.
    pair_max, pair_mean = (2.0**-14.5, 2.0**-16.5) if dtype == torch.bfloat16 else (2.0**-17.5, 2.0**-19.5)
    assert rel.max() <= pair_max and rel.mean() <= pair_mean, (rel.max().log2(), rel.mean().log2())
    # Plain: measured bf16 max 2^-6.0, mean 2^-8.0; fp16 2^-8.8, 2^-11.0.
    assert plain_rel.mean() >= 2.0**7 * pair_mean, (plain_rel.mean().log2(), rel.mean().log2())
    assert plain_rel.max() >= 2.0**7 * pair_max

    want = rounded(exact, dtype)
    ulps = ulps_apart(hi, want)
    off = ulps > 0
    assert ulps.max() <= 1 and off.sum() <= 0.005 * ulps.numel(), torch.bincount(ulps.flatten())
    midpoint = (hi.double().cpu() + want.double()) / 2  # where the exact sum must lie near when off
    assert ((exact - midpoint).abs()[off] <= bound[off]).all()
    plain_ulps = ulps_apart(plain, want)
    assert plain_ulps.max() >= 2 and (plain_ulps > 0).float().mean() >= 0.3


@DTYPES
def test_each_factor_applies_to_its_own_product_before_the_split(dtype):
    """The chunked path's factor differs by chunk (its 1/count and fp16's lift): each product times its
    fp32 factor, then added to the pair. The first call writes over garbage. A factor applied to the
    whole running sum, or not at all, is far outside the bound."""
    chunks = make_chunks(6, 40, 24, 48, dtype, scale=1.0 if dtype == torch.bfloat16 else 2.0**-4, seed=1)
    factors = [torch.tensor([f], dtype=torch.float32, device=DEVICE) for f in (1 / 3, 0.7, 1 / 5, 2.5, 1 / 7, 0.3)]
    hi = garbage((40, 48), dtype)
    lo = pairs.compensation_buffer(hi)
    sum_chunks(chunks, hi, lo, factors)
    exact, bound = error_bound(chunks, dtype, factors)
    err = (pair_sum(hi, lo) - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert (err / exact.abs()).max() <= 2.0**-15
    ulps = ulps_apart(hi, rounded(exact, dtype))
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 0.01 * ulps.numel()
    last_only = exact_sum(chunks)[0] * factors[-1].item()
    assert ((last_only - exact).abs() > 100 * bound).float().mean() > 0.9


class _Layout:
    """hi and lo of (m, p): contiguous rows of 72 (144 bytes: TMA descriptors), of 70 (140 bytes:
    pointers), or views of 70 columns of 80-wide buffers (pointers: on the H200 the descriptors over
    such a view changed the 10 columns past it, so ``gemm.matmul`` takes them for contiguous
    buffers only; the columns past the view must keep their values)."""

    def __init__(self, kind, m, dtype):
        self.kind = kind
        width = {"tma": 72, "pointers": 70, "tma-view": 80}[kind]
        self.p = 72 if kind == "tma" else 70
        self.hi_full = garbage((m, width), dtype)
        self.lo_full = garbage((m, width), torch.bfloat16)
        self.hi, self.lo = self.hi_full[:, : self.p], self.lo_full[:, : self.p]
        self.tma = kind == "tma" and device.tma_hardware(torch.device(DEVICE))

    def untouched(self, hi_before, lo_before):
        def bits(t):  # NaN is not equal to itself
            return t[:, self.p :].cpu().view(torch.int16)

        return torch.equal(bits(self.hi_full), bits(hi_before)) and torch.equal(bits(self.lo_full), bits(lo_before))


@pytest.mark.tier_if(lambda kind, dtype: kind == "tma" and dtype == torch.bfloat16)
@DTYPES
@pytest.mark.parametrize("kind", ["tma", "pointers", "tma-view"])
def test_ragged_edges_through_descriptors_and_pointers(dtype, kind, monkeypatch):
    """M = 100, P = 70 or 72, K = 13: every dimension past a block edge (the interpreter's blocks are
    64 x 64 x 256), operands loaded through pointers (a has 26-byte rows).
    The pair goes through descriptors where its rows allow (C_TMA), else pointers: the same sum,
    the first call over garbage, nothing written past the edge."""
    spy = KernelSpy(gemm.matmul_kernel)
    monkeypatch.setattr(gemm, "matmul_kernel", spy)
    layout = _Layout(kind, 100, dtype)
    hi_before, lo_before = layout.hi_full.cpu().clone(), layout.lo_full.cpu().clone()
    chunks = make_chunks(3, 100, 13, layout.p, dtype, scale=1.0 if dtype == torch.bfloat16 else 2.0**-6, seed=2)
    chunks = [(a.contiguous(), b) for a, b in chunks]  # (100, 13): rows of 26 bytes, no TMA for a
    sum_chunks(chunks, layout.hi, layout.lo)
    assert [(s["COMPENSATED"], s["C_TMA"], s["ACCUMULATE"]) for s in spy.launches] == [
        (True, layout.tma, False), (True, layout.tma, True), (True, layout.tma, True)]
    exact, bound = error_bound(chunks, dtype)
    assert ((pair_sum(layout.hi, layout.lo) - exact).abs() <= bound).all()
    ulps = ulps_apart(layout.hi, rounded(exact, dtype))
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 0.01 * ulps.numel()
    assert layout.untouched(hi_before, lo_before)


@DTYPES
def test_the_first_call_writes_over_garbage(dtype):
    """accumulate=False: hi and lo are the product's split whatever they held (NaN, inf, -3e4):
    bit for bit what accumulating into zeros gives."""
    (a, b), = make_chunks(1, 70, 40, 72, dtype, scale=1.0 if dtype == torch.bfloat16 else 2.0**-6, seed=3)
    hi, lo = garbage((70, 72), dtype), garbage((70, 72), torch.bfloat16)
    products.compensated(a, b, hi, lo, False)
    hi0, lo0 = torch.zeros_like(hi), torch.zeros_like(lo)
    products.compensated(a, b, hi0, lo0, True)
    assert torch.equal(hi, hi0) and torch.equal(lo, lo0)
    assert torch.isfinite(hi).all() and torch.isfinite(lo).all()
    exact = a.double().cpu() @ b.double().cpu()
    ulps = ulps_apart(hi, rounded(exact, dtype))  # off only near a tie (fp32 sum, then 16 bits)
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 0.01 * ulps.numel()
    assert ((pair_sum(hi, lo) - exact).abs() / exact.abs()).max() <= 2.0**-16


def test_an_fp16_hi_keeps_its_remainder_in_bf16():
    """fp16 sums of 6e-6 to 3e-3 (gradient-sized entries): the remainder, at most 2^-11 of hi, is
    under fp16's smallest normal, so an fp16 lo keeps only a few of its bits or none (15% of hi off
    by an ulp, measured), where ``compensation_buffer``'s bf16 lo keeps them all (0.1%)."""
    chunks = make_chunks(24, 48, 16, 40, torch.float16, scale=2.0**-20, seed=4)
    exact, bound = error_bound(chunks, torch.float16)
    want = rounded(exact, torch.float16)
    off = {}
    for lo_dtype in (torch.bfloat16, torch.float16):
        hi = torch.empty(48, 40, dtype=torch.float16, device=DEVICE)
        lo = torch.empty(48, 40, dtype=lo_dtype, device=DEVICE)
        sum_chunks(chunks, hi, lo)
        off[lo_dtype] = (ulps_apart(hi, want) > 0).float().mean().item()
        if lo_dtype == torch.bfloat16:
            assert ((pair_sum(hi, lo) - exact).abs() <= bound).all()
    assert off[torch.bfloat16] <= 0.005 and off[torch.float16] >= 0.05, off


def test_overflow_stays_inf_and_nan_stays_nan():
    """An fp16 sum past 65504: hi inf and lo 0, and inf stays inf as more is added (as in a plain
    fp16 sum), not NaN from inf - inf. A NaN product: NaN stays."""
    a = torch.full((16, 16), 16.0, dtype=torch.float16, device=DEVICE)
    b = torch.full((16, 16), 160.0, dtype=torch.float16, device=DEVICE)  # each entry 40960
    hi = torch.empty(16, 16, dtype=torch.float16, device=DEVICE)
    lo = pairs.compensation_buffer(hi)
    products.compensated(a, b, hi, lo, False)
    assert (hi == 40960).all() and (lo == 0).all()
    products.compensated(a, b, hi, lo, True)
    assert torch.isinf(hi).all() and (lo == 0).all()
    products.compensated(a, -b / 4, hi, lo, True)
    assert torch.isinf(hi).all() and (hi > 0).all() and (lo == 0).all()
    a[0, 0] = float("nan")
    hi2 = torch.empty(16, 16, dtype=torch.float16, device=DEVICE)
    lo2 = pairs.compensation_buffer(hi2)
    products.compensated(a, b, hi2, lo2, False)
    a[0, 0] = 1.0
    products.compensated(a, b, hi2, lo2, True)
    assert torch.isnan(hi2[0]).all() and not torch.isnan(hi2[1:]).any()


def test_mismatched_buffers_are_refused():
    a = torch.zeros(8, 16, dtype=torch.bfloat16, device=DEVICE)
    b = torch.zeros(16, 8, dtype=torch.bfloat16, device=DEVICE)
    hi = torch.zeros(8, 8, dtype=torch.bfloat16, device=DEVICE)
    for lo in (torch.zeros(8, 9, dtype=torch.bfloat16, device=DEVICE)[:, :8],  # other strides
               torch.zeros(8, 8, dtype=torch.float32, device=DEVICE)):
        with pytest.raises(ValueError):
            products.compensated(a, b, hi, lo, False)
    with pytest.raises(ValueError):
        products.compensated(a.float(), b.float(), hi.float(), torch.zeros_like(hi), False)


def test_a_plain_matmul_launches_as_before(monkeypatch):
    """Without lo the matmul's launches are the plain ones: COMPENSATED off, and the contiguous result
    through a descriptor exactly where the config's ``c_tma`` and the hardware say."""
    spy = KernelSpy(gemm.matmul_kernel)
    monkeypatch.setattr(gemm, "matmul_kernel", spy)
    monkeypatch.setattr(gemm, "few_tiles", lambda a, b: False)  # one tile: as if it filled the GPU
    a = torch.ones(16, 32, dtype=torch.bfloat16, device=DEVICE)
    b = torch.ones(32, 16, dtype=torch.bfloat16, device=DEVICE)
    out = torch.zeros(16, 16, dtype=torch.float32, device=DEVICE)
    gemm.matmul(a, b, out, True)
    products.product(a, b, torch.empty(16, 16, dtype=torch.bfloat16, device=DEVICE), False)
    c_tma = (ON_GPU and configs.matmul_config(torch.bfloat16).c_tma
             and configs.tma_hardware(torch.device(DEVICE)))
    assert [(s["COMPENSATED"], s["C_TMA"]) for s in spy.launches] == [(False, c_tma)] * 2
    assert (out == 32).all()
    if not ON_GPU:
        assert spy.launches[0]["BF16_EMULATION"]
