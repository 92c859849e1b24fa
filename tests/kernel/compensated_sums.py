"""What the compensated pair's tests share (test_compensated.py, test_compensated_bits.py): products
to sum into a pair (``products.compensated``) and the float64 they are checked against.

Every check is against float64: the exact sum of the (exactly representable) 16-bit products
(``exact_sum``), and its rounding to the dtype computed in float64 (``rounded``). ``error_bound`` is a
rigorous per-entry bound on the pair's error, from the kernel's arithmetic: each product's fp32 sum (K
terms), the factor, the old pair plus the product in fp32, and lo's own rounding (at most
2^-(p_hi + p_lo) of the sum, p the significand bits: 2^-16 for bf16 + bf16, 2^-19 for fp16 + bf16;
2^-33 absolute under fp16's smallest normal, where hi's ulp stops shrinking); a remainder kept in
fewer bits adds its own split to it."""

import torch

from conftest import DEVICE
from fused_linear_ce import products

BITS = {torch.bfloat16: 8, torch.float16: 11}  # significand bits, the implicit one included
SUBNORMAL_QUANTUM = {torch.bfloat16: -149, torch.float16: -24}  # log2 of the smallest step


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many ulps of their 16-bit dtype lie between ``got`` and ``want``, entry by entry."""
    return (_ordinal(got) - _ordinal(want)).abs()


def pair_sum(hi, lo):
    """The pair's value hi + lo (a 16-bit remainder), in float64 on the CPU."""
    return hi.double().cpu() + lo.double().cpu()


def exact_sum(chunks, factors=None):
    """The float64 sum of the products (each times its fp32 factor), and what ``error_bound`` bounds
    the pair's error by: the magnitude of each partial sum, and each product's terms summed by
    magnitude."""
    total = 0
    partials, magnitudes = [], []
    for i, (a, b) in enumerate(chunks):
        a, b = a.double().cpu(), b.double().cpu()
        f = 1.0 if factors is None else factors[i].double().cpu().item()
        total = total + (a @ b) * f
        partials.append(total.abs())
        magnitudes.append((a.abs() @ b.abs()) * abs(f))  # the product's terms, summed by magnitude
    return total, partials, magnitudes


def error_bound(chunks, dtype, factors=None):
    """The float64 sum and the per-entry bound on a compensated pair's error for hi of ``dtype`` (lo
    bf16) after summing ``chunks`` (the module docstring)."""
    total, partials, magnitudes = exact_sum(chunks, factors)
    k = max(a.shape[1] for a, _ in chunks)
    split = 2.0 ** -(BITS[dtype] + BITS[torch.bfloat16])
    # Under an fp16 hi's smallest normal its ulp is 2^-24: the remainder up to 2^-25, lo's half ulp 2^-33.
    floor = 2.0**-33 if dtype == torch.float16 else 0.0
    bound = sum((k + 1) * 2.0**-24 * m + (2.0**-22 + split) * 1.001 * s + floor for m, s in zip(magnitudes, partials))
    return total, bound


def make_chunks(n, m, k, p, dtype, scale=1.0, seed=0):
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


def garbage(shape, dtype):
    """What a reused buffer may hold: NaN, inf and huge values."""
    t = torch.full(shape, float("nan"), dtype=dtype)
    t.view(-1)[::3] = float("inf")
    t.view(-1)[1::3] = -3e4
    return t.to(DEVICE)


def sum_chunks(chunks, hi, lo, factors=None):
    """Sums the products into the pair (hi, lo), the first call over what the buffers held."""
    for i, (a, b) in enumerate(chunks):
        products.compensated(a, b, hi, lo, i > 0, None if factors is None else factors[i])
