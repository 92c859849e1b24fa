"""Backward: recompute logit tiles into their gradient, then the two products (math in ``logits.py``).

``dlogits_kernel`` turns one chunk of rows into ``da`` (the gradient of the pre-scale logits) in the
input dtype, from fp32 logits recomputed tile by tile and the saved log-sum-exp. ``matmul_kernel``
then runs ``grad_hidden = da @ weight`` and ``grad_weight (+)= da^T @ hidden`` with fp32 accumulation.
"""

import triton
import triton.language as tl

from .logits import grouped_tile, label_terms, logit_tile, round_to, softcap_grad, store_dlogits


@triton.jit
def dlogits_kernel(
    hidden_ptr,  # (N, H) fp32/bf16/fp16
    weight_ptr,  # (V, H) same dtype
    bias_ptr,  # (V,) same dtype, or dummy
    targets_ptr,  # (N,) int32/int64
    lse_ptr,  # (2, N) fp32, from the forward: row max m and log-sum (lse = m + log-sum)
    coef_ptr,  # (3, N) fp32: per-row A, B, C of da = A * p - B * onehot - C * w (see losses.py)
    class_weight_ptr,  # (V,) fp32 class weights when HAS_CLASS_WEIGHT, else dummy
    dlogits_ptr,  # (R, C) out, input dtype: da for rows [row0, row0 + R), classes [col0, col0 + C)
    dbias_ptr,  # (cdiv(R, BLOCK_N), V) fp32 out: per-row-block column sums of da, when BIAS_GRAD
    hidden_desc,  # TMA: tensor descriptors (``logits.logit_tile``), else unused
    weight_desc,
    row0,
    R,
    col0,
    C,
    V,
    H,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    stride_b,
    stride_t,
    stride_dc,
    logit_scale,
    softcap,
    N,
    vocab_offset,  # global id of this weight's first row (vocabulary-parallel shards), else 0
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_H: tl.constexpr,
    BF16_EMULATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """One program: one (BLOCK_N, BLOCK_V) tile of the block's da. 1-D grouped grid over
    cdiv(R, BLOCK_N) x cdiv(C, BLOCK_V) tiles. No atomics: bias partial sums go to their own row.

    The per-row coefficients carry the upstream gradient, the reduction, label smoothing, z-loss,
    class weights and the gradient of a returned lse; a row whose coefficients are all 0 (an ignored
    row) gets exactly 0, and a tile whose rows are all such computes no logits. A counted row whose
    target is outside [0, V) gets NaN, as its loss does (the host marks it with B = NaN).
    """
    pid_m, pid_v = grouped_tile(tl.program_id(0), tl.cdiv(R, BLOCK_N), tl.cdiv(C, BLOCK_V), GROUP_M)
    local_n = pid_m.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = local_n < R
    rows = row0 + tl.where(mask_n, local_n, 0)
    local_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = local_v < C
    offs_v = col0 + local_v
    cols = col0 + tl.where(mask_v, local_v, 0)

    coef_a = tl.load(coef_ptr + rows)
    coef_b = tl.load(coef_ptr + N + rows)
    # A tile whose rows all have zero coefficients (ignored rows; a zero per-row upstream gradient
    # under reduction="none") computes no logits: z = 0 there, and the zero coefficients make every
    # entry 0 below (through ``where``, never a product with p, which may overflow where the sweep
    # left a wholly ignored block's statistics neutral). NaN (a target out of range) counts as nonzero.
    live_rows = mask_n & ((coef_a != 0.0) | (coef_b != 0.0))
    if SMOOTHING:
        live_rows = live_rows | (mask_n & (tl.load(coef_ptr + 2 * N + rows) != 0.0))
    if tl.sum(live_rows.to(tl.int32), axis=0) > 0:
        z = logit_tile(
            hidden_ptr, weight_ptr, bias_ptr, hidden_desc, weight_desc, row0 + pid_m * BLOCK_N,
            col0 + pid_v * BLOCK_V, rows, cols, H, stride_hn, stride_hh, stride_wv, stride_wh, stride_b, logit_scale,
            softcap, HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, BF16_EMULATION, INPUT_PRECISION, TMA,
        )
    else:
        z = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    row_max = tl.load(lse_ptr + rows)
    log_sum = tl.load(lse_ptr + N + rows)
    target = tl.load(targets_ptr + rows * stride_t).to(tl.int64)
    # The target's column within this tile (int32; -1 when another tile or shard holds it).
    tile_col0 = vocab_offset + col0 + pid_v.to(tl.int64) * BLOCK_V
    in_tile = (target >= tile_col0) & (target < tile_col0 + BLOCK_V)
    target_col = tl.where(in_tile, target - tile_col0, -1).to(tl.int32)

    p = tl.exp((z - row_max[:, None]) - log_sum[:, None])
    d = tl.where(coef_a[:, None] == 0.0, 0.0, coef_a[:, None] * p)
    d -= tl.where(tl.arange(0, BLOCK_V)[None, :] == target_col[:, None], coef_b[:, None], 0.0)
    d = label_terms(d, coef_b, coef_ptr + 2 * N + rows, class_weight_ptr, offs_v, mask_v, SMOOTHING, HAS_CLASS_WEIGHT)
    if HAS_SOFTCAP:
        d = d * softcap_grad(z, softcap)
    d = d * logit_scale

    mask = mask_n[:, None] & mask_v[None, :]
    store_dlogits(d, dlogits_ptr + local_n[:, None] * stride_dc + local_v[None, :], mask, mask_v,
                  dbias_ptr + pid_m.to(tl.int64) * V + offs_v, BIAS_GRAD, BF16_EMULATION)


@triton.jit
def load_block(desc, row0, col0, TRANSPOSED: tl.constexpr):
    """The block at (row0, col0) of a matrix whose descriptor is over it (or over its transpose when
    TRANSPOSED: the stored block at (col0, row0), transposed)."""
    if TRANSPOSED:
        return desc.load([col0, row0]).T
    else:
        return desc.load([row0, col0])


@triton.jit
def matmul_kernel(
    a_ptr,  # (M, K) any strides
    b_ptr,  # (K, P) any strides
    c_ptr,  # (M, P) out; fp32 when ACCUMULATE
    scale_ptr,  # (1,) fp32: multiplies A @ B when HAS_SCALE (undoes the fp16 da scaling)
    a_desc,  # TMA: tensor descriptor of A as stored (of A^T when A_T), else unused
    b_desc,  # TMA: tensor descriptor of B as stored (of B^T when B_T), else unused
    M,
    P,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bp,
    stride_cm,
    stride_cp,
    ACCUMULATE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_P: tl.constexpr,
    EVEN_K: tl.constexpr,
    BF16_EMULATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
    A_T: tl.constexpr = False,
    B_T: tl.constexpr = False,
):
    """C = A @ B (+ C when ACCUMULATE), fp32 accumulation, one (BLOCK_M, BLOCK_P) tile a program.

    1-D grouped grid over cdiv(M, BLOCK_M) x cdiv(P, BLOCK_P). The whole K reduction stays in the
    program's fp32 accumulator; ACCUMULATE adds an fp32 C read back (no atomics: one writer per tile).
    TMA (the launcher's choice, ``products.matmul``): both operands through tensor descriptors over
    their row-major storage; an operand stored transposed (da^T is da read by columns) loads its
    (K, M) or (P, K) block and transposes it in shared memory. Blocks past an edge load as 0.
    Else pointer loads, ragged edges masked, not clamped: clamping hides the contiguity of an
    operand whose M or P dimension is its contiguous one (da^T, weight), and the loads then lose
    their vector width.
    """
    pid_m, pid_p = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(P, BLOCK_P), GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_m = offs_m < M
    mask_p = offs_p < P
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_base = a_ptr + offs_m[:, None] * stride_am
    b_base = b_ptr + offs_p[None, :] * stride_bp
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if TMA:
            a = load_block(a_desc, pid_m * BLOCK_M, k * BLOCK_K, A_T)
            b = load_block(b_desc, k * BLOCK_K, pid_p * BLOCK_P, B_T)
        else:
            kk = k * BLOCK_K + offs_k
            a_ptrs = a_base + kk[None, :] * stride_ak
            b_ptrs = b_base + kk[:, None] * stride_bk
            if EVEN_M and EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (kk[None, :] < K), other=0.0)
            if EVEN_P and EVEN_K:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=(kk[:, None] < K) & mask_p[None, :], other=0.0)
        if BF16_EMULATION:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_p[None, :] * stride_cp
    mask = mask_m[:, None] & mask_p[None, :]
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr)
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0)
    tl.store(c_ptrs, round_to(acc, c_ptr.dtype.element_ty, BF16_EMULATION), mask=mask)
