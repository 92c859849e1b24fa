"""The gradient products, and who runs each: every product's K reduction is summed in fp32, whatever
runs it, and a 16-bit result is rounded once.

- ``gemm.matmul``: the package's Triton matmul (``gemm.py``), c (+)= (a @ b) [* unscale], the factor
  applied in its epilogue before the one rounding. Every product into a 16-bit gradient runs there,
  except those with ``gemm.few_tiles``; where twice its output tiles fill the GPU's waves better
  (``gemm.split_k``), its K reduction in two halves added into an fp32 buffer, then scaled once.
- ``compensated``: (hi, lo) = split((a @ b) [* unscale] (+ hi + lo)): ``gemm.matmul`` summing into a
  16-bit result ``hi`` and a remainder ``lo`` (``pairs.compensation_buffer``; the pair's arithmetic:
  ``pairs.py``), the pair in place of an fp32 accumulator across many products (a chunked
  grad_weight), ``hi`` ending as the running sum rounded once.
- ``accumulate``: acc (+)= a @ b into an fp32 buffer: cuBLAS with an fp32 result (``out_dtype``),
  whose split-K partial sums are fp32 whatever torch's reduced-precision-reduction flags say (they
  only allow reductions in a 16-bit output type).
- ``product``: out (+)= (a @ b) [* unscale]: ``gemm.matmul``, or, for a 16-bit result with
  ``gemm.few_tiles``, cuBLAS with an fp32 result and one ``scale`` (cuBLAS splits the long K reduction
  across the GPU, which one program per output tile cannot).
- ``rows_product``: a block of whole vocabulary rows' grad_hidden (few rows, a long V reduction):
  cuBLAS with an fp32 result, scaled once.
- ``scale``: src * g, fp32 arithmetic, one rounding.
- ``add_bias_sums``: grad_bias, the column sums of da, from the kernels' per-row-block partial sums.

The kernel: ``scale_kernel``.

No product touches process-wide state: cuBLAS never writes a 16-bit result here, so torch's
``allow_bf16/fp16_reduced_precision_reduction`` flags (global, and racy to save, set and restore
around a call when threads share the process) need not change. Off the GPU the cuBLAS calls become
products of the upcast operands (exact), summed in fp32: what the GPU computes, up to the order of
the sums.
"""

import torch
import triton
import triton.language as tl

from . import device, gemm
from .logits import round_to


def compensated(a: torch.Tensor, b: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, accumulate: bool,
                unscale=None, role: str = "product") -> None:
    """A compensated sum of products into a pair of 16-bit buffers, in place of an fp32 accumulator:
    s = (a @ b) [* unscale] (+ hi + lo when ``accumulate``), in fp32 in ``gemm.matmul_kernel``'s epilogue
    (the product summed in fp32, the factor applied first, then the old pair added, hi + lo first:
    exact in fp32 but for a remainder under 2^-24 of hi), then split:
    hi = s rounded to hi's dtype, lo = (s - hi) (exact in fp32) rounded to lo's dtype.

    ``accumulate=False`` (the first product) writes both, whatever they held. hi: bf16 or fp16; lo:
    ``pairs.compensation_buffer(hi)`` (bf16; an fp16 lo is taken but loses the remainder of small
    entries) or, for a bf16 hi, ``pairs.compensation_buffer(hi, torch.int8)`` (the remainder in whole
    units of 2^8 of the sum's fp32 bits, ``pairs.pair_of``: 2^-16 of the sum's binade but at half an
    ulp of hi, about the same, in one byte), hi's shape and strides. Each call's sum is rounded to
    fp32 once before the split, and the split loses at most half an ulp of lo: per call 2^-16 of the
    sum at worst (bf16 hi: lo's 8 bits below hi's 8), 2^-19 for an fp16 hi (11 + 8; 2^-33 absolute
    under fp16's smallest normal), against 2^-9 for a plain bf16 accumulator. The errors add up over
    the calls, relative to each partial sum: a final sum much smaller than its partial sums
    (cancellation) is off by more. After the last product ``hi`` is the running sum rounded once to
    its dtype (but for entries within the pair's error of a tie) and ``lo`` can go. Overflow: a sum
    past hi's range leaves hi inf and lo 0 (inf stays inf, as in a plain 16-bit sum); NaN stays NaN."""
    if hi.dtype not in (torch.bfloat16, torch.float16) or lo.dtype not in (
            torch.bfloat16, torch.float16, torch.int8, torch.uint8):
        raise ValueError(f"compensated: hi must be bf16 or fp16 and lo bf16, fp16, int8 or uint8 (4-bit), "
                         f"got {hi.dtype} and {lo.dtype}")
    if lo.dtype in (torch.int8, torch.uint8) and hi.dtype != torch.bfloat16:
        raise ValueError(f"compensated: an {'int8' if lo.dtype == torch.int8 else '4-bit'} remainder is for a bf16 hi "
                         "(its steps follow bf16's ulp)")
    if lo.dtype == torch.uint8:
        want = (hi.shape[0], triton.cdiv(hi.shape[1], 2)) if hi.dim() == 2 else None
        if want is None or tuple(lo.shape) != want or not lo.is_contiguous():
            raise ValueError(f"compensated: a 4-bit remainder for hi {tuple(hi.shape)} is a contiguous {want} "
                             f"uint8 buffer (compensation_buffer), got {tuple(lo.shape)} strides {lo.stride()}")
    elif lo.shape != hi.shape or lo.stride() != hi.stride():
        raise ValueError(f"compensated: lo {tuple(lo.shape)} strides {lo.stride()} must match hi "
                         f"{tuple(hi.shape)} strides {hi.stride()}")
    gemm.matmul(a, b, hi, accumulate, unscale, lo=lo, role=role)


def product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool, unscale=None,
            may_split: bool = False) -> None:
    """out (+)= (a @ b) [* unscale], the factor applied in fp32 before the one rounding:
    ``gemm.matmul``, or for a 16-bit result whose output has ``gemm.few_tiles``, cuBLAS with an fp32
    result and one ``scale``: an fp32 (M, P) buffer while it runs, under half the SMs' worth of
    128 x 256 tiles (8.25 MiB on an H200; outside ``chunk_bytes``, like the O(N) statistics).
    ``may_split`` (the caller's say: the chunked path's grad_hidden where the fp32 buffer is small
    beside its chunk) and ``gemm.split_k``: ``gemm.matmul`` in two K halves into an fp32 (M, P)
    buffer of zeros, then one ``scale`` (at S2's one chunk 72 MiB beside its 4000 MiB (N, V) buffer).
    Not the recompute path's products: there the buffer would stand beyond ``chunk_bytes`` (20-88 MiB
    at S1/S2's budgets, and S2's default 6% slower, measured on the H200).

    Never fold a factor shared by every row into da before the product instead: on rows where p is
    far from the target's 1, every target entry rounds ``factor * (p_t - 1)`` the same way, one
    relative error repeated across the batch (tests/kernel/test_rounding.py)."""
    rounded = not accumulate and out.dtype != torch.float32  # a 16-bit result written once
    if rounded and gemm.few_tiles(a, b):
        _fp32_then_scale(a, b, out, unscale)
    elif rounded and may_split and gemm.split_k(a, b) > 1:
        _fp32_then_scale(a, b, out, unscale, split=2)
    else:
        gemm.matmul(a, b, out, accumulate, unscale)


def _fp32_then_scale(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, unscale, split: int = 1) -> None:
    """out = (a @ b) [* unscale]: an fp32 result, then one ``scale``. The fp32 result from cuBLAS
    (``accumulate``), or with ``split`` 2 from ``gemm.matmul``'s two K halves added onto zeros."""
    shape = (a.shape[0], b.shape[1])
    if split > 1:
        result = torch.zeros(shape, dtype=torch.float32, device=a.device)
        gemm.matmul(a, b, result, False, split=split)
    else:
        result = torch.empty(shape, dtype=torch.float32, device=a.device)
        accumulate(a, b, result, True)
    scale(result, unscale if unscale is not None else torch.ones((1,), device=a.device), out=out)


def accumulate(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor, first: bool) -> None:
    """acc (+)= a @ b into an fp32 accumulator (contiguous rows), fp32 accumulation, nothing
    rounded to the input dtype: cuBLAS with an fp32 result on a GPU (``out_dtype``), an fp32
    product of the upcast operands elsewhere (exact products, fp32 sums)."""
    if a.device.type != "cuda":
        a, b = a.float(), b.float()
    kwargs = dict(out_dtype=torch.float32) if a.device.type == "cuda" else {}
    if first:
        torch.mm(a, b, out=acc, **kwargs)
    else:
        torch.addmm(acc, a, b, out=acc, **kwargs)


def rows_product(da: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, unscale) -> None:
    """out = (da @ weight) [* unscale] for a block of whole vocabulary rows (the two-pass plan's
    first pass), whose long V reduction cuBLAS splits across the GPU (a block of few rows has too
    few output tiles for ``gemm.matmul``): cuBLAS with an fp32 result, then one scaling kernel, one
    rounding; the fp32 (rows, H) result is small next to the da block (H / V of it, times 2)."""
    _fp32_then_scale(da, weight, out, unscale)


def scale(src: torch.Tensor, g: torch.Tensor, dtype: torch.dtype | None = None, out=None) -> torch.Tensor:
    """src * g in ``dtype`` (or into ``out``, contiguous rows): fp32 arithmetic, one rounding
    (``scale_kernel``); ``g`` a 0-d or (1,) fp32 device tensor."""
    if out is None:
        out = torch.empty(src.shape, dtype=dtype, device=src.device)
    numel = src.numel()
    if numel:
        block = 4096 if not device.interpreted() else 1 << 16
        src = src.contiguous()
        # In place, a factor of 1 leaves every value as it is (x * 1 rounds to x): the kernel then
        # reads and writes nothing (the backward of ``loss.backward()``, g = 1: 0.3-0.6 ms a step
        # of S1-S3's grad_weight on the H200).
        in_place = out.data_ptr() == src.data_ptr() and out.dtype == src.dtype
        scale_kernel[(triton.cdiv(numel, block),)](
            src, out, g, numel, BLOCK=block, IN_PLACE=in_place, BF16_EMULATION=device.bf16_emulation(out.dtype),
            num_warps=8 if not device.interpreted() else 1,
        )
    return out


def add_bias_sums(db_acc: torch.Tensor, dbias: torch.Tensor, rows: int, block_n: int, unscale=None) -> None:
    """db_acc (fp32, (V,)) += the column sums of da over ``rows`` rows, from the kernels' per-row-block
    partial sums ``dbias`` ((row blocks, V) fp32), times ``unscale`` when given."""
    block_sum = dbias[: triton.cdiv(rows, block_n)].sum(0)
    db_acc += block_sum if unscale is None else block_sum * unscale


@triton.jit
def scale_kernel(src_ptr, out_ptr, g_ptr, numel, BLOCK: tl.constexpr, IN_PLACE: tl.constexpr,
                 BF16_EMULATION: tl.constexpr):
    """out = src * g, computed in fp32 and rounded once to out's dtype; g an fp32 scalar in memory
    (the upstream gradient, read on the device: no host sync). Grid (cdiv(numel, BLOCK),).
    torch's ``bf16 * fp32 0-d tensor`` does the same arithmetic through a casting loop at half the
    memory rate (H200: ~1 ms for a 1 GiB grad_weight). IN_PLACE (out is src): nothing moves when
    g is 1, a branch every program takes alike."""
    g = tl.load(g_ptr)
    work = True
    if IN_PLACE:
        work = g != 1.0
    if work:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, round_to(x * g, out_ptr.dtype.element_ty, BF16_EMULATION), mask=mask)
