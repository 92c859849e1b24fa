"""A compensated pair: a 16-bit sum ``hi`` and its remainder ``lo``, in place of an fp32 accumulator
across many products (``products.compensated`` sums a product into one, in ``gemm.matmul_kernel``'s
epilogue). hi + lo holds the running sum to ~16-17 bits of mantissa (bf16 hi) or ~19-20 (fp16 hi),
and ``hi`` ends as that sum rounded once. For a bf16 hi the remainder may be int8 (the same ~16 bits
in one byte) or 4-bit, two a byte (~12 bits in half a byte: the long-context default's grad_weight).

- ``compensation_buffer``: the ``lo`` buffer for a ``hi``, in one of those dtypes.
- The Triton helpers of the matmul's pair epilogue: ``pair_of`` (the pair of an fp32 sum),
  ``pair_value`` (a pair's fp32 value), ``pair_through_descriptors`` (one tile's pair read, summed
  and written through TMA descriptors), ``pack_nibbles`` / ``unpack_nibbles`` (the 4-bit
  remainders' bytes), ``special_values`` (NaN and overflow in the integer splits).
"""

import os

import torch
import triton
import triton.language as tl

from .logits import round_to


def compensation_buffer(hi: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The ``lo`` half of a compensated pair for the 16-bit ``hi`` (``products.compensated``), hi's
    shape and strides, uninitialised (NaN, or -1 for int8, under FUSED_LINEAR_CE_POISON=1; the first
    ``products.compensated`` call, ``accumulate=False``, writes every element). ``dtype``: bf16
    (default) or int8 (a bf16 ``hi`` only: the remainder in units of 2^8 of the sum's fp32 bit pattern,
    ``pair_of``, half the bytes, the same ~16 bits of the sum; the chunked path's grad_weight and the
    recompute path's long-context grad_hidden).

    bf16 and not hi's dtype for an fp16 hi: the remainder is at most half an ulp of hi, 2^-11 of
    it, and fp16's range ends at 6e-5 (subnormals to 6e-8): an fp16 remainder of a gradient entry
    under ~0.25 loses bits, and under 2^-13 is all lost, where a bf16 one keeps its 8 bits down to
    1e-38.

    ``torch.uint8`` (a bf16 ``hi`` only, 2-D, contiguous): a 4-bit remainder, two a byte (column 2j
    in byte j's low half, 2j + 1 in its high half), so (M, ceil(P / 2)) bytes, contiguous: the pair
    is the sum's fp32 bit pattern rounded to its top 20 bits (``pair_of``), ~12 bits of the sum
    (2^-12 of its binade at worst) in half the int8 remainder's bytes; the chunked path's grad_weight
    at long context within the default budget (``plan.lean_chunk_bytes``)."""
    if dtype == torch.uint8:
        if hi.dim() != 2:
            raise ValueError(f"compensation_buffer: a 4-bit remainder is for a 2-D hi, got {tuple(hi.shape)}")
        lo = torch.empty((hi.shape[0], triton.cdiv(hi.shape[1], 2)), dtype=dtype, device=hi.device)
    else:
        lo = torch.empty_like(hi, dtype=dtype)
    if os.environ.get("FUSED_LINEAR_CE_POISON") == "1":
        lo.fill_(-1 if dtype == torch.int8 else 0x77 if dtype == torch.uint8 else float("nan"))
    return lo


@triton.jit
def pair_value(hi, lo):
    """The fp32 value of a compensated pair: hi + lo (a 16-bit remainder; exact in fp32 but for a
    remainder under 2^-24 of hi), or for an int8 lo the fp32 whose bits are hi's followed by lo
    units of 2^8 (``pair_of``): integer arithmetic, no rounding."""
    if lo.dtype == tl.int8:
        bits = (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16) + lo.to(tl.int32) * 256
        return bits.to(tl.float32, bitcast=True)
    # The code after a compile-time branch's return is still generated: the 4-bit form and the
    # 16-bit one in one if / else (a byte of two remainders does not add to hi's shape).
    if lo.dtype == tl.uint8:  # 4-bit remainders, two a byte: units of 2^12 of the bits
        value = ((hi.to(tl.int16, bitcast=True).to(tl.int32) << 16) + unpack_nibbles(lo) * 4096).to(
            tl.float32, bitcast=True)
    else:
        value = hi.to(tl.float32) + lo.to(tl.float32)
    return value


@triton.jit
def unpack_nibbles(packed):
    """(R, C) bytes of two signed 4-bit values each (low half first) -> (R, 2C) int32 in [-8, 7]."""
    x = packed.to(tl.int32)  # 0..255
    low = (x << 28) >> 28  # arithmetic shifts: the sign extended
    high = (x << 24) >> 28
    return tl.reshape(tl.join(low, high), (packed.shape[0], 2 * packed.shape[1]))


@triton.jit
def pack_nibbles(q):
    """(R, 2C) int32 in [-8, 7] -> (R, C) bytes, column 2j in byte j's low half, 2j + 1 in its high."""
    low, high = tl.split(tl.reshape(q, (q.shape[0], q.shape[1] // 2, 2)))
    return ((low & 0xF) | ((high & 0xF) << 4)).to(tl.uint8)


@triton.jit
def pair_of(s, hi_dtype: tl.constexpr, lo_dtype: tl.constexpr, BF16_EMULATION: tl.constexpr):
    """The pair (hi, lo) for the fp32 sum ``s``: hi = s rounded (to nearest, ties to even), lo = the
    rest rounded to lo's dtype. lo is 0 where hi overflowed or s was inf or NaN: hi carries it.

    An int8 lo (a bf16 hi) is the rest in units of 2^8 of s's fp32 bit pattern: s's bits minus hi's
    (hi's 16 bits followed by 16 zeros), |d| <= 2^15, rounded to whole units (half up) and clamped to
    127 (only a rest at or just under half an ulp of hi reaches 128). Bit patterns of one sign are
    monotonic in the value, so the difference is the rest in steps of 2^-15 of the binade it lies
    in (2^-16 of the sum at worst), across a binade edge too, and decoding (``pair_value``) is an
    integer sum. Integer arithmetic on s's bits: no division, no exponent extraction.

    A uint8 lo holds 4-bit remainders, two a byte (``pack_nibbles``): s's bit pattern rounded to
    its top 20 bits, q (half up, in units of 2^12: 2^-12 of the binade at worst), split into hi =
    q's top 16 bits rounded (half up) and lo = the rest, in [-8, 7]. The pair's value is exactly q;
    hi is s rounded to bf16 but where s lies within 2^-12 of its binade of a tie (rounded twice)."""
    if lo_dtype == tl.int8:
        bits = s.to(tl.int32, bitcast=True)
        lsb = (bits >> 16) & 1
        top = (bits + 0x7FFF + lsb) >> 16  # bf16 round to nearest even, on the bits (NaN apart below)
        rest = bits - (top << 16)
        hi, lo = special_values(s, top, tl.minimum((rest + 0x80) >> 8, 127))
        return hi, lo.to(tl.int8)
    # The code after a compile-time branch's return is still generated: one if / else from here.
    if lo_dtype == tl.uint8:
        bits = s.to(tl.int32, bitcast=True)
        q = (bits + 0x800) >> 12  # patterns of one sign are monotonic: rounds the magnitude half up
        top = (q + 8) >> 4
        hi, rest = special_values(s, top, q - (top << 4))
        lo = pack_nibbles(rest)
    else:
        hi = round_to(s, hi_dtype, BF16_EMULATION)
        rest = s - hi.to(tl.float32)
        rest = tl.where(tl.abs(rest) <= 3.4028234663852886e38, rest, 0.0)
        lo = round_to(rest, lo_dtype, BF16_EMULATION)
    return hi, lo


@triton.jit
def special_values(s, top, rest):
    """The integer splits' bf16 hi from ``top`` (s's bits rounded to their top 16) and their
    remainder ``rest``, with NaN and overflow: a NaN s gives a NaN hi, and where s rounded to inf
    (or was inf) there is no remainder."""
    nan = s != s
    overflow = (top & 0x7FFF) == 0x7F80
    rest = tl.where(nan | overflow, 0, rest)
    top = tl.where(nan, 0x7FC0, top)
    return top.to(tl.int16).to(tl.bfloat16, bitcast=True), rest


@triton.jit
def pair_through_descriptors(acc, c_desc, lo_desc, row0, col0, ACCUMULATE: tl.constexpr,
                             BF16_EMULATION: tl.constexpr):
    """The pair's epilogue for one tile (acc's shape) at (row0, col0): s = (hi + lo) + acc (the old
    pair's sum first, exact), then the new pair of s, read and written through descriptors."""
    lo_col = col0 // 2 if lo_desc.dtype == tl.uint8 else col0  # 4-bit remainders: two columns a byte
    if ACCUMULATE:
        acc = pair_value(c_desc.load([row0, col0]), lo_desc.load([row0, lo_col])) + acc
    hi, lo = pair_of(acc, c_desc.dtype, lo_desc.dtype, BF16_EMULATION)
    c_desc.store([row0, col0], hi)
    lo_desc.store([row0, lo_col], lo)
