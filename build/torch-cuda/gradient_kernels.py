"""The chunked path's second kernel: a chunk's stored exponentials become the logits' gradient, in place.

The forward sweep (``forward_kernels.lse_sweep_kernel`` with STORE_E, one tile per split) leaves, for
every element of a chunk of rows, ``e = exp(z - m_tile)`` rounded to the buffer's dtype, where
``m_tile`` is the max of its (BLOCK_N, BLOCK_V) tile; with a softcap ``e`` already carries the
softcap's derivative ``1 - (z / c)^2``. Once the rows' log-sum-exp is known,

    p = e * exp((m_tile - m) - log_sum)          (m, log_sum: the row's, so lse = m + log_sum)
    da = logit_scale * (A p - B onehot - C w)    (losses.py; the target entry from the exact z_t)

The target entry, where cancellation would matter most (p_t near 1 on a trained model), is not taken
from the rounded ``e``: it is ``(A exp(z_t - lse) - B) * softcap'(z_t)`` from the fp32 target logit
the sweep kept. Every other entry is rounded twice (``e``, then ``da``): at most 2^-8 relative in
bf16, against 2^-9 for a single rounding; its logit itself was never rounded. fp16 keeps ``e`` in
fp16: subnormal below 6e-5 of the tile max, an absolute error under 3e-8 of the tile's largest entry.
"""

import triton
import triton.language as tl

from .logits import label_terms, round_to, softcap_grad, store_dlogits


@triton.jit
def softmax_gradient_kernel(
    e_ptr,  # (R, V) in: exp(z - m_tile) [* softcap'(z)], the input dtype
    da_ptr,  # (R, V) out, the input dtype; the same memory as e_ptr (in place)
    tile_max_ptr,  # (T, R) fp32: each tile's row max m_tile (plane 0 of the sweep's statistics)
    lse_ptr,  # (2, N) fp32: row max m and log-sum (rows row0 .. row0 + R of them)
    coef_ptr,  # (3, R) fp32: A, B, C of the chunk's rows
    z_target_ptr,  # (N,) fp32: the target logit (0 when another shard holds it, NaN out of range)
    targets_ptr,  # (N,) int32/int64
    class_weight_ptr,  # (V,) fp32 when HAS_CLASS_WEIGHT, else dummy
    dbias_ptr,  # (cdiv(R, BLOCK_N), V) fp32 out: per-row-block column sums of da, when BIAS_GRAD
    row0,
    R,
    V,
    N,
    stride_e,
    stride_da,
    stride_t,
    logit_scale,
    softcap,
    vocab_offset,
    HAS_SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    EMULATE_ROUNDING: tl.constexpr,
):
    """Grid (cdiv(R, BLOCK_N), cdiv(V, BLOCK_V)): the sweep's own tiles, so one m_tile per row.
    Memory-bound: reads and writes the chunk once. No atomics."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    local_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = local_n < R
    local = tl.where(mask_n, local_n, 0)
    rows = row0 + local
    offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    mask = mask_n[:, None] & mask_v[None, :]

    e = tl.load(e_ptr + local[:, None] * stride_e + offs_v[None, :], mask=mask, other=0.0).to(tl.float32)
    m_tile = tl.load(tile_max_ptr + pid_v.to(tl.int64) * R + local)
    row_max = tl.load(lse_ptr + rows)
    log_sum = tl.load(lse_ptr + N + rows)
    coef_a = tl.load(coef_ptr + local)
    coef_b = tl.load(coef_ptr + R + local)
    target = tl.load(targets_ptr + rows * stride_t).to(tl.int64)
    z_t = tl.load(z_target_ptr + rows)

    factor = tl.exp((m_tile - row_max) - log_sum)
    # A row whose A is 0 (an ignored row) gets 0 whatever its e holds: the sweep leaves e unwritten
    # where a whole row block is ignored (SKIP_IGNORED). The load is not skipped there: a branch
    # around it halved this kernel's rate (NOTES v15).
    d = tl.where(coef_a[:, None] == 0.0, 0.0, (coef_a * factor)[:, None] * e)
    # The target entry, exactly: (A p_t - B) softcap'(z_t), p_t from the fp32 target logit.
    p_t = tl.exp((z_t - row_max) - log_sum)
    d_t = coef_a * p_t - coef_b
    if HAS_SOFTCAP:
        d_t = d_t * softcap_grad(z_t, softcap)
    is_target = offs_v[None, :] + vocab_offset == target[:, None]
    d = tl.where(is_target, d_t[:, None], d)
    # Smoothing never comes with a softcap on this path (the host routes that to the recompute path).
    d = label_terms(d, coef_b, coef_ptr + 2 * R + local, class_weight_ptr, offs_v, mask_v, SMOOTHING, HAS_CLASS_WEIGHT)
    d = d * logit_scale
    store_dlogits(d, da_ptr + local_n[:, None] * stride_da + offs_v[None, :], mask, mask_v,
                  dbias_ptr + pid_n.to(tl.int64) * V + offs_v, BIAS_GRAD, EMULATE_ROUNDING)


@triton.jit
def scale_kernel(src_ptr, out_ptr, g_ptr, numel, BLOCK: tl.constexpr, EMULATE_ROUNDING: tl.constexpr):
    """out = src * g, computed in fp32 and rounded once to out's dtype; g an fp32 scalar in memory
    (the upstream gradient, read on the device: no host sync). Grid (cdiv(numel, BLOCK),).
    torch's ``bf16 * fp32 0-d tensor`` does the same arithmetic through a casting loop at half the
    memory rate (H200: ~1 ms for a 1 GiB grad_weight)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(g_ptr)
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, round_to(x * g, out_ptr.dtype.element_ty, EMULATE_ROUNDING), mask=mask)
