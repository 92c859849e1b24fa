"""The divergence row kernel: from a chunk's student and teacher logits (fp32 products, no bias yet)
to the per-token divergence, the student's entropy and target log-prob, and the student's da.

The math (``distill.py`` states it whole): ``ls = z_s - lse_s`` and ``lt = z_t - lse_t`` in fp32,
every sum over the vocabulary taken from these logs, never from a probability that may underflow:

    beta = 0  (forward KL)  term = p_t (lt - ls)             da/dz = p_s - p_t
    beta = 1  (reverse KL)  term = p_s (ls - lt)             g = ls - lt
    else      (JSD)         q = log(m / p_s) = logaddexp(log(1 - beta), log(beta) + lt - ls)
                            term = beta p_t (lt - log m) + (1 - beta) p_s (-q),  g = -(1 - beta) q
    da/dz = p_s (g - sum_v p_s g)   (reverse KL and JSD)

``log(m / p_t)`` is taken from the larger branch of the logaddexp (``-log(beta) - s`` or ``d -
log(1 - beta) - s``, s = log1p(exp(-|x - y|))), so no large d cancels against itself, and log1p keeps
q's relative precision when beta (or 1 - beta) is tiny.
"""

import triton
import triton.language as tl

from .logits import round_to, softcap_grad, tanh

FORWARD_KL = tl.constexpr(0)
REVERSE_KL = tl.constexpr(1)
JSD = tl.constexpr(2)


@triton.jit
def log1p(x):
    """log(1 + x) for 0 <= x <= 1 to a few fp32 ulps, from arithmetic alone: 2 atanh(w) with
    w = x / (2 + x) <= 1/3, its odd series through w^15 (the rest is under 2^-29 of the sum). No
    ``log``: a GPU's fast log has an absolute error near 1 of ~1e-7, which is all of log(1 + 1e-6)'s
    digits (at beta = 1 - 1e-6, a 1% error in the JSD)."""
    w = x / (2.0 + x)
    w2 = w * w
    p = 1.0 / 15.0
    p = p * w2 + 1.0 / 13.0
    p = p * w2 + 1.0 / 11.0
    p = p * w2 + 1.0 / 9.0
    p = p * w2 + 1.0 / 7.0
    p = p * w2 + 1.0 / 5.0
    p = p * w2 + 1.0 / 3.0
    p = p * w2 + 1.0
    return 2.0 * w * p


@triton.jit
def logits_of(acc_ptrs, bias_ptr, cols, load_mask, mask_v, tile_scale, softcap, softcap_out,
              HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """z for a block of rows (any shape), from its fp32 products at ``acc_ptrs`` (class ids ``cols``):
    + bias, * scale, softcap, / T (folded into the scales, ``validate.Options.kernel_scales``).
    Products outside ``load_mask`` read as 0 (finite z: a skipped row's statistics stay finite);
    -inf outside ``mask_v`` (past V)."""
    a = tl.load(acc_ptrs, mask=load_mask, other=0.0)
    if HAS_BIAS:
        a += tl.load(bias_ptr + cols, mask=mask_v, other=0.0).to(tl.float32)
    a = a * tile_scale
    if HAS_SOFTCAP:
        a = softcap_out * tanh(a / softcap)
    return tl.where(mask_v, a, float("-inf"))


@triton.jit
def row_terms(ls, lt, mask, beta, log_a, log_b, MODE: tl.constexpr):
    """(term, g) of a block: the divergence's summands and the student's g (0 for the forward KL,
    whose da needs none), 0 outside ``mask``."""
    d = tl.where(mask, lt - ls, 0.0)
    p_s = tl.exp(ls)
    p_t = tl.exp(lt)
    if MODE == FORWARD_KL:
        term = p_t * d
        g = tl.zeros_like(d)
    elif MODE == REVERSE_KL:
        term = p_s * (-d)
        g = -d
    else:
        y = log_b + d
        upper = y >= log_a
        s = log1p(tl.exp(-tl.abs(y - log_a)))
        q = tl.where(upper, y, log_a) + s  # log(m / p_s)
        r_t = tl.where(upper, -log_b, d - log_a) - s  # log(p_t / m)
        term = beta * p_t * r_t - (1.0 - beta) * p_s * q
        g = -(1.0 - beta) * q
    return tl.where(mask, term, 0.0), tl.where(mask, g, 0.0)


@triton.jit
def divergence_row_kernel(
    zs_ptr,  # (R, V) fp32: the student's products h_s @ W_s.T of the chunk's rows
    zt_ptr,  # (R, V) fp32: the teacher's
    da_ptr,  # (R, V) out when WRITE_DA, the input dtype: in zt's memory (row stride stride_da)
    bias_s_ptr,  # (V,) the student's bias when HAS_BIAS_S, else dummy
    bias_t_ptr,  # (V,) the teacher's when HAS_BIAS_T, else dummy
    targets_ptr,  # (N,) int64 when HAS_TARGETS, else dummy
    counted_ptr,  # (N,) int8: 1 for a counted row
    coef_ptr,  # (2, N) fp32 when WRITE_DA: the divergence's and the log-prob's upstream per row
    stats_ptr,  # (3, N) fp32: lse_s, lse_t, sum_v p_s g; out, or in when STATS_KNOWN
    out_ptr,  # (3, N) fp32 out when VALUES: divergence, entropy, target log-prob
    row0,
    R,
    V,
    N,
    stride_zs,
    stride_zt,
    stride_da,
    stride_t,
    scale_s, cap_s, cap_out_s, chain_s,  # the student's kernel scales (Options.kernel_scales)
    scale_t, cap_t, cap_out_t,  # the teacher's
    beta,
    log_a,  # log(1 - beta) (JSD)
    log_b,  # log(beta) (JSD)
    MODE: tl.constexpr,
    HAS_BIAS_S: tl.constexpr,
    HAS_BIAS_T: tl.constexpr,
    SOFTCAP_S: tl.constexpr,
    SOFTCAP_T: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    STATS_KNOWN: tl.constexpr,
    VALUES: tl.constexpr,
    WRITE_DA: tl.constexpr,
    DIV_GRAD: tl.constexpr,  # da has the divergence's term (else only the log-prob's: zt is not read)
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BF16_EMULATION: tl.constexpr,
):
    """Grid (cdiv(R, BLOCK_N),): one program a block of rows, their vocabulary in BLOCK_V blocks, in
    increasing order. Pass 1 (unless STATS_KNOWN): both rows' lse (online max and sum). Pass 2
    (VALUES): the divergence, entropy, sum_v p_s g, and for the forward KL with WRITE_DA also da.
    Pass 3 (WRITE_DA, reverse KL and JSD; the recompute backward's only pass): da; without DIV_GRAD
    (the log-prob's term alone, STATS_KNOWN) the teacher's buffer is not read, only written with da.
    da is written over zt's own rows as their blocks are
    read: da's block of a row lies in bytes already read (a 16-bit da in the first half of the fp32
    row; an fp32 one on it).

    da = chain * softcap'(z_s) * (c_div * dz_div + c_lp * (onehot(t) - p_s)). Uncounted rows read
    nothing and get zeros everywhere; a block of them only writes its zeros. A counted row whose
    target is outside [0, V) gets NaN values and a NaN da (the loss's rule). No atomics."""
    local = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = local < R
    rows = row0 + tl.where(mask_n, local, 0)
    offs = tl.arange(0, BLOCK_V).to(tl.int64)
    zs_rows = zs_ptr + local[:, None] * stride_zs
    zt_rows = zt_ptr + local[:, None] * stride_zt
    da_rows = da_ptr + local[:, None] * stride_da
    counted = (tl.load(counted_ptr + rows, mask=mask_n, other=0) != 0) & mask_n
    bad = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.int64)
    if HAS_TARGETS:
        t = tl.load(targets_ptr + rows * stride_t, mask=mask_n, other=0).to(tl.int64)
        bad = tl.where(counted & ((t < 0) | (t >= V)), float("nan"), 0.0)
        t = tl.where((t >= 0) & (t < V), t, 0)
    any_counted = tl.max(counted.to(tl.int32), axis=0) > 0
    if any_counted:
        if STATS_KNOWN:
            lse_s = tl.load(stats_ptr + rows, mask=counted, other=0.0)
            lse_t = tl.load(stats_ptr + N + rows, mask=counted, other=0.0)
            spg = tl.load(stats_ptr + 2 * N + rows, mask=counted, other=0.0)
        else:
            m_s = tl.full((BLOCK_N,), float("-inf"), tl.float32)
            m_t = tl.full((BLOCK_N,), float("-inf"), tl.float32)
            sum_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
            sum_t = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for v0 in range(0, V, BLOCK_V):
                offs_v = v0 + offs
                mask_v = (offs_v < V)[None, :]
                live = counted[:, None] & mask_v
                z_s = logits_of(zs_rows + offs_v[None, :], bias_s_ptr, offs_v[None, :], live, mask_v, scale_s, cap_s,
                                cap_out_s, HAS_BIAS_S, SOFTCAP_S)
                z_t = logits_of(zt_rows + offs_v[None, :], bias_t_ptr, offs_v[None, :], live, mask_v, scale_t, cap_t,
                                cap_out_t, HAS_BIAS_T, SOFTCAP_T)
                new_s = tl.maximum(m_s, tl.max(z_s, axis=1))
                new_t = tl.maximum(m_t, tl.max(z_t, axis=1))
                sum_s = sum_s * tl.exp(m_s - new_s) + tl.sum(tl.exp(z_s - new_s[:, None]), axis=1)
                sum_t = sum_t * tl.exp(m_t - new_t) + tl.sum(tl.exp(z_t - new_t[:, None]), axis=1)
                m_s = new_s
                m_t = new_t
            lse_s = m_s + tl.log(sum_s)
            lse_t = m_t + tl.log(sum_t)
            spg = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if VALUES:
            div = tl.zeros((BLOCK_N,), dtype=tl.float32)
            ent = tl.zeros((BLOCK_N,), dtype=tl.float32)
            spg = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for v0 in range(0, V, BLOCK_V):
                offs_v = v0 + offs
                mask_v = (offs_v < V)[None, :]
                live = counted[:, None] & mask_v
                z_s = logits_of(zs_rows + offs_v[None, :], bias_s_ptr, offs_v[None, :], live, mask_v, scale_s, cap_s,
                                cap_out_s, HAS_BIAS_S, SOFTCAP_S)
                z_t = logits_of(zt_rows + offs_v[None, :], bias_t_ptr, offs_v[None, :], live, mask_v, scale_t, cap_t,
                                cap_out_t, HAS_BIAS_T, SOFTCAP_T)
                ls = tl.where(live, z_s - lse_s[:, None], 0.0)
                lt = tl.where(live, z_t - lse_t[:, None], 0.0)
                term, g = row_terms(ls, lt, live, beta, log_a, log_b, MODE)
                p_s = tl.where(live, tl.exp(ls), 0.0)
                div += tl.sum(term, axis=1)
                ent -= tl.sum(p_s * ls, axis=1)
                spg += tl.sum(p_s * g, axis=1)
                if WRITE_DA and MODE == FORWARD_KL:
                    da = _da(z_s, ls, lt, g, spg, offs_v, live, t, rows, counted, N, coef_ptr, chain_s, cap_out_s,
                             bad, MODE, SOFTCAP_S, HAS_TARGETS, True)
                    tl.store(da_rows + offs_v[None, :], round_to(da, da_ptr.dtype.element_ty, BF16_EMULATION),
                             mask=mask_n[:, None] & mask_v)
            log_p = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if HAS_TARGETS:
                z_tgt = logits_of(zs_ptr + local * stride_zs + t, bias_s_ptr, t, counted, mask_n, scale_s, cap_s,
                                  cap_out_s, HAS_BIAS_S, SOFTCAP_S)
                log_p = tl.where(counted, z_tgt - lse_s + bad, 0.0)
            tl.store(out_ptr + rows, tl.where(counted, div + bad, 0.0), mask=mask_n)
            tl.store(out_ptr + N + rows, tl.where(counted, ent, 0.0), mask=mask_n)
            tl.store(out_ptr + 2 * N + rows, log_p, mask=mask_n)
            tl.store(stats_ptr + rows, lse_s, mask=mask_n)
            tl.store(stats_ptr + N + rows, lse_t, mask=mask_n)
            tl.store(stats_ptr + 2 * N + rows, spg, mask=mask_n)
        if WRITE_DA and (MODE != FORWARD_KL or not VALUES):
            for v0 in range(0, V, BLOCK_V):
                offs_v = v0 + offs
                mask_v = (offs_v < V)[None, :]
                live = counted[:, None] & mask_v
                z_s = logits_of(zs_rows + offs_v[None, :], bias_s_ptr, offs_v[None, :], live, mask_v, scale_s, cap_s,
                                cap_out_s, HAS_BIAS_S, SOFTCAP_S)
                ls = tl.where(live, z_s - lse_s[:, None], 0.0)
                if DIV_GRAD:
                    z_t = logits_of(zt_rows + offs_v[None, :], bias_t_ptr, offs_v[None, :], live, mask_v, scale_t,
                                    cap_t, cap_out_t, HAS_BIAS_T, SOFTCAP_T)
                    lt = tl.where(live, z_t - lse_t[:, None], 0.0)
                    _, g = row_terms(ls, lt, live, beta, log_a, log_b, MODE)
                else:
                    lt = ls
                    g = ls
                da = _da(z_s, ls, lt, g, spg, offs_v, live, t, rows, counted, N, coef_ptr, chain_s, cap_out_s, bad,
                         MODE, SOFTCAP_S, HAS_TARGETS, DIV_GRAD)
                tl.store(da_rows + offs_v[None, :], round_to(da, da_ptr.dtype.element_ty, BF16_EMULATION),
                         mask=mask_n[:, None] & mask_v)
    else:
        if VALUES:
            zero_rows = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k in range(3):
                tl.store(out_ptr + k * N + rows, zero_rows, mask=mask_n)
                tl.store(stats_ptr + k * N + rows, zero_rows, mask=mask_n)
        if WRITE_DA:
            for v0 in range(0, V, BLOCK_V):
                offs_v = v0 + offs
                zero_block = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
                tl.store(da_rows + offs_v[None, :], zero_block.to(da_ptr.dtype.element_ty),
                         mask=mask_n[:, None] & (offs_v < V)[None, :])


@triton.jit
def _da(z_s, ls, lt, g, spg, offs_v, live, t, rows, counted, N, coef_ptr, chain_s, cap_out_s, bad,
        MODE: tl.constexpr, SOFTCAP_S: tl.constexpr, HAS_TARGETS: tl.constexpr, DIV_GRAD: tl.constexpr):
    """da of a block (fp32): the divergence's dz (p_s - p_t from each side's own exp for the forward
    KL, else p_s (g - sum p_s g); only with DIV_GRAD) and the log-prob's, weighted by the rows'
    coefficients, through the softcap / scale / temperature chain. 0 outside ``live`` (past V,
    uncounted rows)."""
    p_s = tl.exp(ls)
    if DIV_GRAD:
        c_div = tl.load(coef_ptr + rows, mask=counted, other=0.0)
        if MODE == FORWARD_KL:
            dz = p_s - tl.exp(lt)
        else:
            dz = p_s * (g - spg[:, None])
        dz = c_div[:, None] * dz
    else:
        dz = tl.zeros_like(p_s)
    if HAS_TARGETS:
        c_lp = tl.load(coef_ptr + N + rows, mask=counted, other=0.0)
        dz += c_lp[:, None] * (tl.where(offs_v[None, :] == t[:, None], 1.0, 0.0) - p_s)
    dz = dz * chain_s + bad[:, None]
    if SOFTCAP_S:
        dz = dz * softcap_grad(z_s, cap_out_s)
    return tl.where(live, dz, 0.0)
