"""The compensated pair of 16-bit buffers (``products.compensated``): a sum of many products kept in
hi (the result's dtype) and lo (bf16) in place of an fp32 accumulator. hi + lo follows the exact sum
to ~2^-16 of the partial sums (bf16 hi), hi ends as the exact sum rounded once but for rare ties, and a
plain 16-bit accumulator on the same data drifts by several ulps.

Every check is against float64: the exact sum of the (exactly representable) 16-bit products, and its
rounding to the dtype computed in float64 (``_rounded``). ``_bound`` is a rigorous per-entry bound on
the pair's error, from the kernel's arithmetic: each product's fp32 sum (K terms), the factor, the
old pair plus the product in fp32, and lo's own rounding (at most 2^-(p_hi + p_lo) of the sum, p the
significand bits: 2^-16 for bf16 + bf16, 2^-19 for fp16 + bf16; 2^-33 absolute under fp16's smallest
normal, where hi's ulp stops shrinking)."""

import dataclasses

import pytest
import torch

from conftest import DEVICE, ON_GPU, KernelSpy
from fused_linear_ce import configs, device, gemm, pairs, products

BITS = {torch.bfloat16: 8, torch.float16: 11}  # significand bits, the implicit one included
SUBNORMAL_QUANTUM = {torch.bfloat16: -149, torch.float16: -24}  # log2 of the smallest step
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x`` rounded once to ``dtype`` (to nearest, ties to even), exactly, in ``dtype``
    (torch's float64 -> bf16 cast goes through fp32: two roundings)."""
    x = x.double().cpu()
    _, e = torch.frexp(x)
    quantum = torch.exp2(torch.clamp(e.double() - BITS[dtype], min=SUBNORMAL_QUANTUM[dtype]))
    return (torch.round(x / quantum) * quantum).to(dtype)  # representable: the cast is exact


def _ordinal(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers in the order of their values (one apart: one ulp apart)."""
    bits = t.cpu().view(torch.int16).int()
    return torch.where(bits >= 0, bits, -(bits & 0x7FFF))


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (_ordinal(got) - _ordinal(want)).abs()


def _pair(hi, lo):
    return hi.double().cpu() + lo.double().cpu()


def _exact(chunks, factors=None):
    """The float64 sum of the products (each times its fp32 factor), and ``_bound``'s per-entry
    bound on a compensated pair's error for hi of ``dtype`` (lo bf16)."""
    total = 0
    partials, magnitudes = [], []
    for i, (a, b) in enumerate(chunks):
        a, b = a.double().cpu(), b.double().cpu()
        f = 1.0 if factors is None else factors[i].double().cpu().item()
        total = total + (a @ b) * f
        partials.append(total.abs())
        magnitudes.append((a.abs() @ b.abs()) * abs(f))  # the product's terms, summed by magnitude
    return total, partials, magnitudes


def _bound(chunks, dtype, factors=None):
    total, partials, magnitudes = _exact(chunks, factors)
    k = max(a.shape[1] for a, _ in chunks)
    split = 2.0 ** -(BITS[dtype] + BITS[torch.bfloat16])
    # Under an fp16 hi's smallest normal its ulp is 2^-24: the remainder up to 2^-25, lo's half ulp 2^-33.
    floor = 2.0**-33 if dtype == torch.float16 else 0.0
    bound = sum((k + 1) * 2.0**-24 * m + (2.0**-22 + split) * 1.001 * s + floor for m, s in zip(magnitudes, partials))
    return total, bound


def _chunks(n, m, k, p, dtype, scale=1.0, seed=0):
    """``n`` products of (m, k) @ (k, p) with a common offset (every product adds ~2 k times the row's
    and column's scales: a plain 16-bit running sum rounds each addition at its growing magnitude)
    and entries over a wide range (row scales 2^-6..2^6, column scales 2^-3..2^3). ``a`` is stored
    transposed, as grad_weight's da^T is."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-6, 7, (m, 1), generator=g).double())
    cols = torch.exp2(torch.randint(-3, 4, (1, p), generator=g).double()) * scale
    out = []
    for _ in range(n):
        a = ((1 + 0.25 * torch.randn(m, k, generator=g, dtype=torch.float64)) * rows).to(dtype)
        b = ((2 + torch.randn(k, p, generator=g, dtype=torch.float64)) * cols).to(dtype)
        out.append((a.t().contiguous().t().to(DEVICE), b.to(DEVICE)))
    return out


def _garbage(shape, dtype):
    """What a reused buffer may hold: NaN, inf and huge values."""
    t = torch.full(shape, float("nan"), dtype=dtype)
    t.view(-1)[::3] = float("inf")
    t.view(-1)[1::3] = -3e4
    return t.to(DEVICE)


def _run(chunks, hi, lo, factors=None):
    for i, (a, b) in enumerate(chunks):
        products.compensated(a, b, hi, lo, i > 0, None if factors is None else factors[i])


@DTYPES
def test_the_pair_follows_the_exact_sum_where_a_plain_16bit_sum_drifts(dtype):
    """24 products of K = 16 with a common offset, entries over 2^18 of range (hi fp16: scaled into
    its range). The pair: within ``_bound`` everywhere, ~2^-16 relative (bf16 hi; 2^-19 for fp16);
    hi the exact sum rounded once except a few entries within that error of a tie, one ulp off. The
    same products summed in a plain 16-bit c (matmul, ACCUMULATE): 2^-8 relative on average, up to 3
    ulps off, over half the entries wrong."""
    n, m, k, p = 24, 48, 16, 40
    chunks = _chunks(n, m, k, p, dtype, scale=1.0 if dtype == torch.bfloat16 else 2.0**-6)
    hi = _garbage((m, p), dtype)
    lo = pairs.compensation_buffer(hi)
    assert lo.dtype == torch.bfloat16 and lo.shape == hi.shape and lo.stride() == hi.stride()
    _run(chunks, hi, lo)
    plain = _garbage((m, p), dtype)
    for i, (a, b) in enumerate(chunks):
        gemm.matmul(a, b, plain, i > 0)

    exact, bound = _bound(chunks, dtype)
    err = (_pair(hi, lo) - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    rel = err / exact.abs()
    plain_rel = (plain.double().cpu() - exact).abs() / exact.abs()
    # Measured on the interpreter: bf16 max 2^-15.4, mean 2^-17.4; fp16 hi 2^-18.3, 2^-20.4.
    pair_max, pair_mean = (2.0**-14.5, 2.0**-16.5) if dtype == torch.bfloat16 else (2.0**-17.5, 2.0**-19.5)
    assert rel.max() <= pair_max and rel.mean() <= pair_mean, (rel.max().log2(), rel.mean().log2())
    # Plain: measured bf16 max 2^-6.0, mean 2^-8.0; fp16 2^-8.8, 2^-11.0.
    assert plain_rel.mean() >= 2.0**7 * pair_mean, (plain_rel.mean().log2(), rel.mean().log2())
    assert plain_rel.max() >= 2.0**7 * pair_max

    want = _rounded(exact, dtype)
    ulps = _ulps(hi, want)
    off = ulps > 0
    assert ulps.max() <= 1 and off.sum() <= 0.005 * ulps.numel(), torch.bincount(ulps.flatten())
    midpoint = (hi.double().cpu() + want.double()) / 2  # where the exact sum must lie near when off
    assert ((exact - midpoint).abs()[off] <= bound[off]).all()
    plain_ulps = _ulps(plain, want)
    assert plain_ulps.max() >= 2 and (plain_ulps > 0).float().mean() >= 0.3


@DTYPES
def test_each_factor_applies_to_its_own_product_before_the_split(dtype):
    """The chunked path's factor differs by chunk (its 1/count and fp16's lift): each product times its
    fp32 factor, then added to the pair. The first call writes over garbage. A factor applied to the
    whole running sum, or not at all, is far outside the bound."""
    chunks = _chunks(6, 40, 24, 48, dtype, scale=1.0 if dtype == torch.bfloat16 else 2.0**-4, seed=1)
    factors = [torch.tensor([f], dtype=torch.float32, device=DEVICE) for f in (1 / 3, 0.7, 1 / 5, 2.5, 1 / 7, 0.3)]
    hi = _garbage((40, 48), dtype)
    lo = pairs.compensation_buffer(hi)
    _run(chunks, hi, lo, factors)
    exact, bound = _bound(chunks, dtype, factors)
    err = (_pair(hi, lo) - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert (err / exact.abs()).max() <= 2.0**-15
    ulps = _ulps(hi, _rounded(exact, dtype))
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 0.01 * ulps.numel()
    last_only = _exact(chunks)[0] * factors[-1].item()
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
        self.hi_full = _garbage((m, width), dtype)
        self.lo_full = _garbage((m, width), torch.bfloat16)
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
    chunks = _chunks(3, 100, 13, layout.p, dtype, scale=1.0 if dtype == torch.bfloat16 else 2.0**-6, seed=2)
    chunks = [(a.contiguous(), b) for a, b in chunks]  # (100, 13): rows of 26 bytes, no TMA for a
    _run(chunks, layout.hi, layout.lo)
    assert [(s["COMPENSATED"], s["C_TMA"], s["ACCUMULATE"]) for s in spy.launches] == [
        (True, layout.tma, False), (True, layout.tma, True), (True, layout.tma, True)]
    exact, bound = _bound(chunks, dtype)
    assert ((_pair(layout.hi, layout.lo) - exact).abs() <= bound).all()
    ulps = _ulps(layout.hi, _rounded(exact, dtype))
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 0.01 * ulps.numel()
    assert layout.untouched(hi_before, lo_before)


@DTYPES
def test_the_first_call_writes_over_garbage(dtype):
    """accumulate=False: hi and lo are the product's split whatever they held (NaN, inf, -3e4):
    bit for bit what accumulating into zeros gives."""
    (a, b), = _chunks(1, 70, 40, 72, dtype, scale=1.0 if dtype == torch.bfloat16 else 2.0**-6, seed=3)
    hi, lo = _garbage((70, 72), dtype), _garbage((70, 72), torch.bfloat16)
    products.compensated(a, b, hi, lo, False)
    hi0, lo0 = torch.zeros_like(hi), torch.zeros_like(lo)
    products.compensated(a, b, hi0, lo0, True)
    assert torch.equal(hi, hi0) and torch.equal(lo, lo0)
    assert torch.isfinite(hi).all() and torch.isfinite(lo).all()
    exact = a.double().cpu() @ b.double().cpu()
    ulps = _ulps(hi, _rounded(exact, dtype))  # off only near a tie (fp32 sum, then 16 bits)
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 0.01 * ulps.numel()
    assert ((_pair(hi, lo) - exact).abs() / exact.abs()).max() <= 2.0**-16


def test_an_fp16_hi_keeps_its_remainder_in_bf16():
    """fp16 sums of 6e-6 to 3e-3 (gradient-sized entries): the remainder, at most 2^-11 of hi, is
    under fp16's smallest normal, so an fp16 lo keeps only a few of its bits or none (15% of hi off
    by an ulp, measured), where ``compensation_buffer``'s bf16 lo keeps them all (0.1%)."""
    chunks = _chunks(24, 48, 16, 40, torch.float16, scale=2.0**-20, seed=4)
    exact, bound = _bound(chunks, torch.float16)
    want = _rounded(exact, torch.float16)
    off = {}
    for lo_dtype in (torch.bfloat16, torch.float16):
        hi = torch.empty(48, 40, dtype=torch.float16, device=DEVICE)
        lo = torch.empty(48, 40, dtype=lo_dtype, device=DEVICE)
        _run(chunks, hi, lo)
        off[lo_dtype] = (_ulps(hi, want) > 0).float().mean().item()
        if lo_dtype == torch.bfloat16:
            assert ((_pair(hi, lo) - exact).abs() <= bound).all()
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


def _pair_int8(hi, lo):
    """The fp32 whose bit pattern is hi's 16 bits followed by 16 zeros plus lo units of 2^8
    (``pairs.pair_value``), in float64."""
    bits = (hi.cpu().view(torch.int16).to(torch.int32) << 16) + lo.cpu().to(torch.int32) * 256
    return bits.view(torch.float32).double()


def test_an_int8_remainder_holds_the_sum_like_a_bf16_one():
    """The recompute path's long-context grad_hidden (``BackwardPlan.paired``): a bf16 hi with an int8
    remainder in whole units of 2^8 of the sum's fp32 bits (2^-15 of its binade). The same 24 products as above: the
    pair within the bound with the split's 2^-15 (a step at worst, a tie; against 2^-16 for a bf16
    lo), hi the exact sum rounded once but for a few entries near a tie, where the plain bf16 sum
    drifts. Measured on the interpreter: max 2^-13.9, mean 2^-16.0 relative (bf16 lo: 2^-15.4,
    2^-17.4; v25's int8 remainder in steps of hi's binade: 2^-13.9, 2^-15.9)."""
    dtype = torch.bfloat16
    n, m, k, p = 24, 48, 16, 40
    chunks = _chunks(n, m, k, p, dtype)
    hi = _garbage((m, p), dtype)
    lo = pairs.compensation_buffer(hi, torch.int8)
    lo.fill_(-128)  # garbage: the first call writes it
    assert lo.dtype == torch.int8 and lo.shape == hi.shape and lo.stride() == hi.stride()
    _run(chunks, hi, lo)

    exact, bound = _bound(chunks, dtype)
    # _bound has the bf16 remainder's split (2^-16 of each partial sum); an int8 one loses up to 2^-15.
    _, partials, _ = _exact(chunks)
    bound = bound + sum(2.0**-16 * 1.001 * s for s in partials)
    err = (_pair_int8(hi, lo) - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    rel = err / exact.abs()
    print("int8 pair relative error: max 2^%.1f, mean 2^%.1f" % (rel.max().log2(), rel.mean().log2()))
    assert rel.max() <= 2.0**-13.5 and rel.mean() <= 2.0**-15.5, (rel.max().log2(), rel.mean().log2())
    want = _rounded(exact, dtype)
    ulps = _ulps(hi, want)
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 0.01 * ulps.numel(), torch.bincount(ulps.flatten())
    # Dropping the remainder (hi alone after each call) is the plain sum: far worse.
    plain = _garbage((m, p), dtype)
    for i, (a, b) in enumerate(chunks):
        gemm.matmul(a, b, plain, i > 0)
    assert (_ulps(plain, want) > 0).float().mean() >= 0.3


def test_an_int8_remainder_needs_a_bf16_hi():
    a, b = _chunks(1, 8, 16, 8, torch.float16)[0]
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
    ulps = _ulps(dx, dx_fp32)
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
    4-bit remainders two a byte, (M, ceil(P / 2)) bytes. The same 24 products as above: the pair
    within the bound with a split of 2^-12 of each partial sum (s's bits rounded to their top 20);
    hi the exact sum rounded once but near a tie (one ulp); the plain bf16 sum far worse. P = 64: the
    pair through descriptors (``test_the_split_epilogue_sums_the_same_bits`` has them ragged); P = 41:
    rows of 21 bytes, through pointers, the last byte's high half past the edge. Measured on the
    interpreter: max 2^-9.9 / 2^-9.8, mean 2^-12.0 relative (int8: 2^-13.9, 2^-16.0; plain 2^-6.0, 2^-8.0)."""
    dtype = torch.bfloat16
    n, m, k = 24, 48, 16
    chunks = _chunks(n, m, k, p, dtype)
    hi = _garbage((m, p), dtype)
    lo = pairs.compensation_buffer(hi, torch.uint8)
    assert lo.dtype == torch.uint8 and lo.shape == (m, (p + 1) // 2) and lo.is_contiguous()
    lo.fill_(0x88)  # garbage: the first call writes it
    spy = KernelSpy(gemm.matmul_kernel)
    try:
        gemm.matmul_kernel, original = spy, gemm.matmul_kernel
        _run(chunks, hi, lo)
    finally:
        gemm.matmul_kernel = original
    assert [s["C_TMA"] for s in spy.launches] == [p == 64] * n  # 32-byte rows of remainders, or 21

    exact, bound = _bound(chunks, dtype)
    _, partials, _ = _exact(chunks)
    bound = bound + sum(2.0**-12 * 1.001 * s for s in partials)  # the split: 2^-12 (bf16 lo: 2^-16)
    err = (_pair_4bit(hi, lo) - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    rel = err / exact.abs()
    assert rel.max() <= 2.0**-9.5 and rel.mean() <= 2.0**-11.5, (rel.max().log2(), rel.mean().log2())
    assert rel.mean() >= 2.0**-13.5  # not the int8 pair's 2^-16: the test sees the 4 bits it has
    want = _rounded(exact, dtype)
    ulps = _ulps(hi, want)
    assert ulps.max() <= 1 and (ulps > 0).float().mean() <= 0.1, torch.bincount(ulps.flatten())
    plain = _garbage((m, p), dtype)
    for i, (a, b) in enumerate(chunks):
        gemm.matmul(a, b, plain, i > 0)
    plain_rel = (plain.double().cpu() - exact).abs() / exact.abs()
    assert plain_rel.mean() >= 2.0**3 * rel.mean()


def test_a_4bit_remainder_is_a_half_width_buffer_for_a_bf16_hi():
    a, b = _chunks(1, 8, 16, 8, torch.bfloat16)[0]
    hi = torch.zeros((8, 8), dtype=torch.bfloat16, device=DEVICE)
    for lo in (torch.zeros((8, 8), dtype=torch.uint8, device=DEVICE),  # one byte a column
               torch.zeros((8, 8), dtype=torch.uint8, device=DEVICE)[:, :4]):  # not contiguous
        with pytest.raises(ValueError, match="4-bit remainder"):
            products.compensated(a, b, hi, lo, False)
    with pytest.raises(ValueError, match="4-bit remainder is for a bf16 hi"):
        products.compensated(a, b, hi.half(), torch.zeros((8, 4), dtype=torch.uint8, device=DEVICE), False)
