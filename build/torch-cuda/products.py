"""The gradient products, and who runs each: every product's K reduction is summed in fp32, whatever
runs it, and a 16-bit result is rounded once.

- ``matmul``: the package's Triton matmul, c (+)= (a @ b) [* unscale], fp32 accumulation and the
  factor applied in its epilogue before the one rounding; TMA loads where the GPU and the layouts
  allow (cuBLAS's rate on the H200), else pointer loads. Every product into a 16-bit gradient runs
  here, except those with ``few_tiles``.
- ``accumulate``: acc (+)= a @ b into an fp32 buffer: cuBLAS with an fp32 result (``out_dtype``),
  whose split-K partial sums are fp32 whatever torch's reduced-precision-reduction flags say (they
  only allow reductions in a 16-bit output type).
- ``product``: out (+)= (a @ b) [* unscale]: ``matmul``, or, for a 16-bit result with
  ``few_tiles``, cuBLAS with an fp32 result and one ``scale`` (cuBLAS splits the long K reduction
  across the GPU, which one program per output tile cannot).
- ``direct``: ``product`` with nothing added or scaled.
- ``rows_product``: a block of whole vocabulary rows' grad_hidden (few rows, a long V reduction):
  cuBLAS with an fp32 result, scaled once.
- ``scale``: src * g, fp32 arithmetic, one rounding.

No product touches process-wide state: cuBLAS never writes a 16-bit result here, so torch's
``allow_bf16/fp16_reduced_precision_reduction`` flags (global, and racy to save, set and restore
around a call when threads share the process) need not change. Off the GPU the cuBLAS calls become
products of the upcast operands (exact), summed in fp32: what the GPU computes, up to the order of
the sums.
"""

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import configs
from .backward_kernels import matmul_kernel
from .gradient_kernels import scale_kernel


def dot_flags(dtype: torch.dtype) -> dict:
    """BF16_EMULATION: bf16 under the interpreter, whose tl.dot and fp32->bf16 cast are not the
    GPU's (see ``logits.round_to`` / ``logits.logit_tile``)."""
    return dict(
        BF16_EMULATION=configs.interpreted() and dtype == torch.bfloat16,
        INPUT_PRECISION=configs.input_precision(dtype),
    )


def _transposed(t: torch.Tensor):
    """False when ``t``'s storage has a layout TMA takes (``configs.tma_layout``), True when its
    transpose's has, None when neither."""
    if configs.tma_layout(t):
        return False
    return True if configs.tma_layout(t.t()) else None


def _tma_layouts(a: torch.Tensor, b: torch.Tensor, cfg: configs.MatmulConfig):
    """When ``matmul`` loads a and b through TMA descriptors (the config, the GPU and both layouts
    allow it): whether each is read through its transpose's storage (``_transposed``); else None."""
    if not (cfg.tma and a.shape[1] > 0 and configs.tma_hardware(a.device)):
        return None
    layouts = (_transposed(a), _transposed(b))
    return None if None in layouts else layouts


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int, transposed: bool):
    """A TMA descriptor over ``t``'s storage: over ``t`` itself, or over its transpose when
    ``transposed`` (``_transposed(t)``)."""
    if transposed:
        return TensorDescriptor.from_tensor(t.t(), [block_cols, block_rows])
    return TensorDescriptor.from_tensor(t, [block_rows, block_cols])


def few_tiles(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``matmul``'s output (one program a tile, the whole K reduction in each) has fewer tiles
    than half the GPU's SMs: most of the one wave idle behind long K loops. The chunked path's
    grad_hidden of a few hundred rows by the whole vocabulary is one (S2 at 256 MiB: 36 tiles of
    128 x 256 for 132 SMs, 106 ms against 88 on cuBLAS; NOTES v12). Never on the interpreter."""
    if a.device.type != "cuda":
        return False
    cfg = configs.matmul_config(a.dtype)
    tiles = triton.cdiv(a.shape[0], cfg.block_m) * triton.cdiv(b.shape[1], cfg.block_p)
    return 2 * tiles < configs.sm_count(a.device)


def matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, accumulate: bool, unscale=None) -> None:
    """c = (a @ b) * unscale (+ c), fp32 accumulation inside the kernel; a, b in the input dtype, any
    strides; ``unscale`` an optional fp32 (1,) device tensor. The operands load through TMA
    descriptors where the config, the GPU and both layouts allow it, else through pointers."""
    m, k = a.shape
    p = b.shape[1]
    if m == 0 or p == 0:
        return
    cfg = configs.matmul_config(a.dtype)
    layouts = _tma_layouts(a, b, cfg)
    tma = layouts is not None
    a_t, b_t = layouts if tma else (False, False)
    a_desc = _descriptor(a, cfg.block_m, cfg.block_k, a_t) if tma else a
    b_desc = _descriptor(b, cfg.block_k, cfg.block_p, b_t) if tma else b
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(p, cfg.block_p),)
    matmul_kernel[grid](
        a, b, c, unscale if unscale is not None else c, a_desc, b_desc, m, p, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        ACCUMULATE=accumulate, HAS_SCALE=unscale is not None,
        BLOCK_M=cfg.block_m, BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_M=m % cfg.block_m == 0, EVEN_P=p % cfg.block_p == 0, EVEN_K=k % cfg.block_k == 0,
        TMA=tma, A_T=a_t, B_T=b_t,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dot_flags(a.dtype),
    )


def direct(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a @ b in ``out``'s dtype, fp32 accumulation, one rounding (``product``). Returns ``out``."""
    product(a, b, out, False)
    return out


def product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool, unscale=None) -> None:
    """out (+)= (a @ b) [* unscale], the factor applied in fp32 before the one rounding: ``matmul``,
    or for a 16-bit result whose output has ``few_tiles``, cuBLAS with an fp32 result and one
    ``scale``: an fp32 (M, P) buffer while it runs, under half the SMs' worth of 128 x 256 tiles
    (8.25 MiB on an H200; outside ``chunk_bytes``, like the O(N) statistics).

    Never fold a factor shared by every row into da before the product instead: on rows where p is
    far from the target's 1, every target entry rounds ``factor * (p_t - 1)`` the same way, one
    relative error repeated across the batch (tests/test_rounding.py)."""
    if not accumulate and out.dtype != torch.float32 and few_tiles(a, b):
        _fp32_then_scale(a, b, out, unscale)
    else:
        matmul(a, b, out, accumulate, unscale)


def _fp32_then_scale(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, unscale) -> None:
    """out = (a @ b) [* unscale]: cuBLAS with an fp32 result (``accumulate``), then one ``scale``."""
    result = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
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
    few output tiles for ``matmul``): cuBLAS with an fp32 result, then one scaling kernel, one
    rounding; the fp32 (rows, H) result is small next to the da block (H / V of it, times 2)."""
    _fp32_then_scale(da, weight, out, unscale)


def scale(src: torch.Tensor, g: torch.Tensor, dtype: torch.dtype | None = None, out=None) -> torch.Tensor:
    """src * g in ``dtype`` (or into ``out``, contiguous rows): fp32 arithmetic, one rounding
    (``gradient_kernels.scale_kernel``); ``g`` a 0-d or (1,) fp32 device tensor."""
    if out is None:
        out = torch.empty(src.shape, dtype=dtype, device=src.device)
    numel = src.numel()
    if numel:
        block = 4096 if not configs.interpreted() else 1 << 16
        scale_kernel[(triton.cdiv(numel, block),)](
            src.contiguous(), out, g, numel, BLOCK=block, EMULATE_ROUNDING=configs.interpreted(),
            num_warps=8 if not configs.interpreted() else 1,
        )
    return out
