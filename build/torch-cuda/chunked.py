"""The chunked path: the gradients are computed in the forward, three products instead of four.

For "mean" and "sum" the upstream gradient is one scalar g, so the logits' gradient is known up to
g as soon as a row's log-sum-exp is. Per chunk of rows (``configs.chunk_rows``):

1. the sweep (``lse_sweep_kernel``, one tile per split, STORE_E) computes each logit tile once in
   fp32 and writes ``exp(z - m_tile)`` into the chunk's (R, V) buffer, with the per-tile statistics;
2. the merge gives the rows' lse (merged across ranks for a vocabulary shard);
3. ``softmax_gradient_kernel`` turns the buffer into da in place (the input dtype);
4. grad_hidden[rows] = da @ weight and grad_weight (+)= da^T @ hidden[rows], fp32 accumulation
   (``products``). The common factor (1 / sum of target weights for "mean") is not in da: the
   products apply it in fp32 before their one rounding (fp16 with the power of two that keeps da
   out of the subnormals). The target coefficient B (1 - eps, a class weight) leaves da as on the
   recompute path (``losses.normalize``).

The backward then only multiplies by g (exact when g is a power of two, as 1 is). Sums across chunks
go through an fp32 buffer (grad_weight: V x H when there is more than one chunk), as in the
recompute path. The logits are never rounded before the softmax; see ``gradient_kernels.py`` for
the rounding of da.
"""

import torch
import triton

from . import autotune, configs, launch, losses, parallel, products
from .gradient_kernels import softmax_gradient_kernel
from .launch import RowStats, _new
from .validate import Options, chunked_unsupported


def use(opts: Options, n: int, v: int, dtype: torch.dtype, needs) -> bool:
    """Whether this call takes the chunked path: only when a gradient is wanted; always with
    strategy="chunked" (validated), never with "recompute"; with "auto" when the options allow it
    and the whole (N, V) buffer fits in ``chunk_bytes`` (one chunk, no fp32 accumulator)."""
    if not any(needs) or opts.strategy == "recompute":
        return False
    if opts.strategy == "chunked":
        return True
    return chunked_unsupported(opts) is None and n * v * dtype.itemsize <= configs.chunk_budget(opts.chunk_bytes)


def unit_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the chunked path keeps its gradients in until the backward (see ``forward``)."""
    return torch.float32 if dtype == torch.float16 else dtype


def forward(hidden, weight, targets, bias, class_weight, opts: Options, need_dx, need_dw, need_db,
            shard=None, divisor=None, cfg=None):
    """Returns (RowStats of all rows, grad_hidden, grad_weight, grad_bias) with the gradients for an
    upstream gradient of 1 (of the loss over ``divisor`` when given), None where not needed, in
    ``unit_dtype(hidden.dtype)`` (the bias's in fp32). ``cfg``: the sweep's and the gradient
    kernel's tiles, else the table's or, with autotuning on, the fastest for this shape."""
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    if n == 0:
        stats = launch.sweep(hidden, weight, targets, bias, class_weight, opts, shard)[0]
        out = dict(dtype=unit_dtype(dtype), device=device)
        zeros = (torch.zeros((0, h), **out) if need_dx else None, torch.zeros((v, h), **out) if need_dw else None,
                 torch.zeros((v,), dtype=torch.float32, device=device) if need_db else None)
        return (stats, *zeros)
    if cfg is None:
        cfg = autotune.tiles("chunked", hidden, v, lambda c: forward(
            hidden, weight, targets, bias, class_weight, opts, need_dx, need_dw, need_db, shard, divisor, cfg=c),
            opts.chunk_bytes, shard,
            variant=launch.tuning_variant(hidden, weight, bias, class_weight, opts, need_dx, need_dw, need_db))
    rows = configs.chunk_rows(n, v, dtype, opts.chunk_bytes, cfg.block_n)
    n_chunks = triton.cdiv(n, rows)
    weights = losses.target_weights(targets, class_weight, opts.ignore_index, v, shard)
    one = torch.ones((), device=device)
    g_ce, g_z, common = losses.upstream(one if divisor is None else one / divisor, None, weights, opts)

    # The unit gradients are kept in the input dtype, except for fp16: its gradients are often
    # subnormal (a mean over many rows) and the backward's multiplication by g would round them a
    # second time there, so fp16 keeps them in fp32 until the backward.
    out_dtype = unit_dtype(dtype)
    grad_hidden = _new((n, h), out_dtype, device) if need_dx else None
    dx_acc = grad_hidden
    if need_dx and shard is not None and out_dtype != torch.float32:
        dx_acc = _new((n, h), torch.float32, device)  # summed over ranks in fp32
    grad_weight = dw_acc = None
    if need_dw:
        grad_weight = _new((v, h), out_dtype, device)
        dw_acc = _new((v, h), torch.float32, device) if n_chunks > 1 and out_dtype != torch.float32 else grad_weight
    db_acc = torch.zeros((v,), dtype=torch.float32, device=device) if need_db else None

    # e = exp(z - m_tile) in (0, 1], in the input dtype (fp16: below 6e-5 of the tile max it is
    # subnormal, an absolute error under 3e-8 of the tile's largest entry).
    buffer = _new((rows, v), dtype, device)
    n_row_blocks = triton.cdiv(rows, cfg.block_n)
    dbias = _new((n_row_blocks, v), torch.float32, device) if need_db else None
    parts = []
    for row0 in range(0, n, rows):
        r = min(rows, n - row0)
        sl = slice(row0, row0 + r)
        e = buffer[:r]
        stats, tile_stats = launch.sweep(hidden[sl], weight, targets[sl], bias, class_weight, opts, shard, e, cfg)
        parts.append(stats)
        coef = losses.row_coefficients(g_ce, g_z, None, stats.lse, targets[sl], losses.rows(weights, row0, row0 + r),
                                       opts)
        # B (1 - eps, a class weight) leaves da as on the recompute path: the products apply the
        # factor in their epilogue, one rounding.
        coef, chunk_common = losses.normalize(coef, common)
        chunk_unscale = chunk_common.reshape(1)
        if dtype == torch.float16:  # da scaled out of fp16's subnormals; the products undo it in fp32
            coef, chunk_unscale = launch.lift_fp16(coef, chunk_unscale, class_weight, opts.logit_scale)
        da = e  # in place
        softmax_gradient_kernel[(triton.cdiv(r, cfg.block_n), triton.cdiv(v, cfg.block_v))](
            e, da, tile_stats, stats.lse2, coef, stats.z_target, targets[sl],
            class_weight if class_weight is not None else coef, dbias if need_db else coef,
            0, r, v, r, e.stride(0), da.stride(0), targets.stride(0), float(opts.logit_scale),
            float(opts.softcap) if opts.softcap is not None else 1.0, shard.offset if shard is not None else 0,
            HAS_SOFTCAP=opts.softcap is not None, SMOOTHING=opts.label_smoothing > 0,
            HAS_CLASS_WEIGHT=class_weight is not None, BIAS_GRAD=need_db,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, EMULATE_ROUNDING=configs.interpreted(),
            num_warps=8 if not configs.interpreted() else 1,
        )
        if need_dx:
            products.product(da, weight, dx_acc[sl], False, chunk_unscale)
        if need_dw:
            products.product(da.t(), hidden[sl], dw_acc, row0 > 0, chunk_unscale)
        if need_db:
            launch.add_bias_sums(db_acc, dbias, r, cfg.block_n, chunk_unscale)

    if need_dx and shard is not None:
        parallel.all_reduce(dx_acc, shard)
        if dx_acc is not grad_hidden:
            grad_hidden.copy_(dx_acc)
    if need_dw and dw_acc is not grad_weight:
        grad_weight.copy_(dw_acc)
    grad_bias = db_acc if need_db else None  # (V,) fp32: cheap, and rounded once, in the backward
    return RowStats.cat(parts), grad_hidden, grad_weight, grad_bias
