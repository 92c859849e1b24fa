"""The gradient products, and who runs each: every product's K reduction is summed in fp32, whatever
runs it, and a 16-bit result is rounded once (twice where the chunked path scales it after cuBLAS,
on GPUs or layouts without TMA: ``product``).

- ``direct``: out = a @ b, a 16-bit result written straight into a gradient, nothing added or
  scaled. bf16 goes to cuBLAS (``torch.mm``) with its reduced-precision reductions turned off for
  the call (``full_precision_reductions``), so a split-K partial sum is never rounded to bf16.
  fp16 (whose da carries a power-of-two lift the products undo) and fp32 (where cuBLAS would follow
  the user's TF32 switch) go to ``matmul``.
- ``product``: ``direct`` where it applies (optionally followed by an in-place ``scale``), else
  ``matmul``.
- ``accumulate``: acc (+)= a @ b into an fp32 buffer: cuBLAS with an fp32 result (``out_dtype``).
- ``rows_product``: a block of whole vocabulary rows' grad_hidden (a long V reduction that cuBLAS
  splits across the GPU), scaled once.
- ``matmul``: the package's Triton matmul, c (+)= (a @ b) [* unscale], for every other case;
  TMA loads where the GPU and the layouts allow (cuBLAS's rate on the H200), else pointer loads.
- ``scale``: src * g, fp32 arithmetic, one rounding.

Off the GPU the cuBLAS calls become products of the upcast operands (exact), summed in fp32 and
rounded once: what the GPU computes, up to the order of the sums.
"""

from contextlib import contextmanager

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


@contextmanager
def full_precision_reductions():
    """cuBLAS may not round split-K partial sums to the 16-bit output type inside this block
    (torch's allow_*_reduced_precision_reduction, True by default); the user's settings come back
    after it."""
    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    flags.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = saved


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


def rounds_once(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``product(a, b, out, False, factor, scale_after=True)`` into a 16-bit ``out`` rounds
    once rather than twice (cuBLAS, then ``scale``): fp16 and fp32 always go to the matmul (the
    factor in its epilogue); bf16 where the matmul loads through TMA, as fast as cuBLAS there (NOTES
    v12), or where its output has ``few_tiles`` (cuBLAS with an fp32 result, then one rounding)."""
    return (a.dtype != torch.bfloat16 or few_tiles(a, b)
            or _tma_layouts(a, b, configs.matmul_config(a.dtype)) is not None)


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
    """out = a @ b in the operands' dtype, fp32 accumulation, one rounding; the runner as the module
    docstring says. Returns ``out``."""
    if a.dtype != torch.bfloat16:
        matmul(a, b, out, False)
        return out
    with full_precision_reductions():
        if a.device.type == "cuda":
            torch.mm(a, b, out=out)
        else:
            out.copy_(torch.mm(a.float(), b.float()))
    return out


def product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool, unscale=None, *,
            scale_after: bool = False) -> None:
    """out (+)= (a @ b) [* unscale]: ``direct`` when the result goes straight into ``out`` in the
    operands' dtype and nothing scales it, else ``matmul`` (the factor applied in fp32 before the
    one rounding). A bf16 result with a factor whose output has ``few_tiles`` goes to cuBLAS with
    an fp32 result (which splits the long K reduction across the GPU) and one ``scale``: one
    rounding, and an fp32 (M, P) buffer while it runs: under half the SMs' worth of 128 x 256
    tiles, 8.25 MiB on an H200 (outside ``chunk_bytes``, like the O(N) statistics).
    With ``scale_after``, where the matmul would load through pointers (``rounds_once`` is False),
    a bf16 result with a factor also goes to ``direct`` and is then scaled in place: rounded twice,
    by cuBLAS and by ``scale``, each element independently (the chunked path's speed for half an
    ulp more; exact when the factor is a power of two).

    Never fold a factor shared by every row into da before the product instead: on rows where p is
    far from the target's 1, every target entry rounds ``factor * (p_t - 1)`` the same way, one
    relative error repeated across the batch (tests/test_rounding.py)."""
    into_gradient = not accumulate and out.dtype == a.dtype
    if into_gradient and unscale is not None and a.dtype == torch.bfloat16 and few_tiles(a, b):
        _fp32_then_scale(a, b, out, unscale)
    elif into_gradient and (unscale is None or (scale_after and not rounds_once(a, b))):
        direct(a, b, out)
        if unscale is not None:
            scale(out, unscale, out=out)
    else:
        matmul(a, b, out, accumulate, unscale)


def _fp32_then_scale(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, unscale) -> None:
    """out = (a @ b) * unscale: cuBLAS with an fp32 result (``accumulate``), then one ``scale``."""
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
    with full_precision_reductions():
        if first:
            torch.mm(a, b, out=acc, **kwargs)
        else:
            torch.addmm(acc, a, b, out=acc, **kwargs)


def rows_product(da: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, unscale) -> None:
    """out = (da @ weight) [* unscale] for a block of whole vocabulary rows (the two-pass plan's
    first pass), whose long V reduction cuBLAS splits across the GPU (a block of few rows has too
    few output tiles for ``matmul``). Without ``unscale``: ``direct``, where bf16 takes cuBLAS.
    Otherwise cuBLAS with an fp32 result, then one scaling kernel, one rounding; the fp32 (rows, H)
    result is small next to the da block (H / V of it, times 2)."""
    if unscale is None and out.dtype == da.dtype and da.dtype == torch.bfloat16:
        direct(da, weight, out)
        return
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
