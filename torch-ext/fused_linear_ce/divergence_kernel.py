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
    """log(1 + x) for x >= 0 to a few fp32 ulps: ``log(u) * x / (u - 1)`` with u = 1 + x rounded
    (the rounding of u cancels between numerator and denominator), x itself where u rounds to 1."""
    u = 1.0 + x
    safe = tl.where(u == 1.0, 2.0, u)
    return tl.where(u == 1.0, x, tl.log(safe) * (x / (safe - 1.0)))


@triton.jit
def logits_of(acc_ptrs, bias_ptr, offs_v, mask_v, tile_scale, softcap, softcap_out,
              HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """z for a block of one row, from its fp32 product: + bias, * scale, softcap, / T (folded into the
    scales, ``validate.Options.kernel_scales``); -inf past V."""
    a = tl.load(acc_ptrs, mask=mask_v, other=0.0)
    if HAS_BIAS:
        a += tl.load(bias_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    a = a * tile_scale
    if HAS_SOFTCAP:
        a = softcap_out * tanh(a / softcap)
    return tl.where(mask_v, a, float("-inf"))


@triton.jit
def row_terms(ls, lt, mask_v, beta, log_a, log_b, MODE: tl.constexpr):
    """(term, g) of a block: the divergence's summands and the student's g (0 for the forward KL,
    whose da needs none), 0 past V."""
    d = tl.where(mask_v, lt - ls, 0.0)
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
    return tl.where(mask_v, term, 0.0), tl.where(mask_v, g, 0.0)


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
    BLOCK_V: tl.constexpr,
    BF16_EMULATION: tl.constexpr,
):
    """Grid (R,): one program a row, its vocabulary in BLOCK_V blocks, in increasing order. Pass 1
    (unless STATS_KNOWN): both rows' lse (online max and sum). Pass 2 (VALUES): the divergence,
    entropy, sum_v p_s g, and for the forward KL with WRITE_DA also da. Pass 3 (WRITE_DA, reverse KL
    and JSD): da. da is written over zt's own row as its blocks are read: da's block of a row lies in
    bytes already read (a 16-bit da in the first half of the fp32 row; an fp32 one on it).

    da = chain * softcap'(z_s) * (c_div * dz_div + c_lp * (onehot(t) - p_s)). An uncounted row
    reads nothing: zeros everywhere. A counted row whose target is outside [0, V) gets NaN values
    and a NaN da (the loss's rule). No atomics."""
    local = tl.program_id(0).to(tl.int64)
    row = row0 + local
    offs = tl.arange(0, BLOCK_V).to(tl.int64)
    zs_row = zs_ptr + local * stride_zs
    zt_row = zt_ptr + local * stride_zt
    da_row = da_ptr + local * stride_da
    counted = tl.load(counted_ptr + row) != 0
    bad = 0.0
    t = 0
    if HAS_TARGETS:
        t = tl.load(targets_ptr + row * stride_t)
        bad = tl.where(counted & ((t < 0) | (t >= V)), float("nan"), 0.0)
        t = tl.where((t >= 0) & (t < V), t, 0)
    if counted:
        if STATS_KNOWN:
            lse_s = tl.load(stats_ptr + row)
            lse_t = tl.load(stats_ptr + N + row)
            spg = tl.load(stats_ptr + 2 * N + row)
        else:
            m_s = float("-inf")
            m_t = float("-inf")
            sum_s = 0.0
            sum_t = 0.0
            for v0 in range(0, V, BLOCK_V):
                offs_v = v0 + offs
                mask_v = offs_v < V
                z_s = logits_of(zs_row + offs_v, bias_s_ptr, offs_v, mask_v, scale_s, cap_s, cap_out_s,
                                HAS_BIAS_S, SOFTCAP_S)
                z_t = logits_of(zt_row + offs_v, bias_t_ptr, offs_v, mask_v, scale_t, cap_t, cap_out_t,
                                HAS_BIAS_T, SOFTCAP_T)
                new_s = tl.maximum(m_s, tl.max(z_s, axis=0))
                new_t = tl.maximum(m_t, tl.max(z_t, axis=0))
                sum_s = sum_s * tl.exp(m_s - new_s) + tl.sum(tl.exp(z_s - new_s), axis=0)
                sum_t = sum_t * tl.exp(m_t - new_t) + tl.sum(tl.exp(z_t - new_t), axis=0)
                m_s = new_s
                m_t = new_t
            lse_s = m_s + tl.log(sum_s)
            lse_t = m_t + tl.log(sum_t)
            spg = 0.0
        if VALUES:
            div = 0.0
            ent = 0.0
            spg = 0.0
            for v0 in range(0, V, BLOCK_V):
                offs_v = v0 + offs
                mask_v = offs_v < V
                z_s = logits_of(zs_row + offs_v, bias_s_ptr, offs_v, mask_v, scale_s, cap_s, cap_out_s,
                                HAS_BIAS_S, SOFTCAP_S)
                z_t = logits_of(zt_row + offs_v, bias_t_ptr, offs_v, mask_v, scale_t, cap_t, cap_out_t,
                                HAS_BIAS_T, SOFTCAP_T)
                ls = tl.where(mask_v, z_s - lse_s, 0.0)
                lt = tl.where(mask_v, z_t - lse_t, 0.0)
                term, g = row_terms(ls, lt, mask_v, beta, log_a, log_b, MODE)
                p_s = tl.where(mask_v, tl.exp(ls), 0.0)
                div += tl.sum(term, axis=0)
                ent -= tl.sum(p_s * ls, axis=0)
                spg += tl.sum(p_s * g, axis=0)
                if WRITE_DA and MODE == FORWARD_KL:
                    da = _da(z_s, ls, lt, g, spg, offs_v, mask_v, t, row, N, coef_ptr, chain_s, cap_out_s, bad,
                             MODE, SOFTCAP_S, HAS_TARGETS)
                    tl.store(da_row + offs_v, round_to(da, da_ptr.dtype.element_ty, BF16_EMULATION), mask=mask_v)
            log_p = 0.0
            if HAS_TARGETS:
                z_tgt = logits_of(zs_row + t + offs * 0, bias_s_ptr, t + offs * 0, offs == 0, scale_s, cap_s,
                                  cap_out_s, HAS_BIAS_S, SOFTCAP_S)
                log_p = tl.max(z_tgt, axis=0) - lse_s + bad
            tl.store(out_ptr + row, div + bad)
            tl.store(out_ptr + N + row, ent)
            tl.store(out_ptr + 2 * N + row, log_p)
            tl.store(stats_ptr + row, lse_s)
            tl.store(stats_ptr + N + row, lse_t)
            tl.store(stats_ptr + 2 * N + row, spg)
        if WRITE_DA and (MODE != FORWARD_KL or not VALUES):
            for v0 in range(0, V, BLOCK_V):
                offs_v = v0 + offs
                mask_v = offs_v < V
                z_s = logits_of(zs_row + offs_v, bias_s_ptr, offs_v, mask_v, scale_s, cap_s, cap_out_s,
                                HAS_BIAS_S, SOFTCAP_S)
                z_t = logits_of(zt_row + offs_v, bias_t_ptr, offs_v, mask_v, scale_t, cap_t, cap_out_t,
                                HAS_BIAS_T, SOFTCAP_T)
                ls = tl.where(mask_v, z_s - lse_s, 0.0)
                lt = tl.where(mask_v, z_t - lse_t, 0.0)
                _, g = row_terms(ls, lt, mask_v, beta, log_a, log_b, MODE)
                da = _da(z_s, ls, lt, g, spg, offs_v, mask_v, t, row, N, coef_ptr, chain_s, cap_out_s, bad,
                         MODE, SOFTCAP_S, HAS_TARGETS)
                tl.store(da_row + offs_v, round_to(da, da_ptr.dtype.element_ty, BF16_EMULATION), mask=mask_v)
    else:
        if VALUES:
            tl.store(out_ptr + row, 0.0)
            tl.store(out_ptr + N + row, 0.0)
            tl.store(out_ptr + 2 * N + row, 0.0)
            tl.store(stats_ptr + row, 0.0)
            tl.store(stats_ptr + N + row, 0.0)
            tl.store(stats_ptr + 2 * N + row, 0.0)
        if WRITE_DA:
            for v0 in range(0, V, BLOCK_V):
                offs_v = v0 + offs
                zero = tl.zeros((BLOCK_V,), dtype=tl.float32)
                tl.store(da_row + offs_v, zero.to(da_ptr.dtype.element_ty), mask=offs_v < V)


@triton.jit
def _da(z_s, ls, lt, g, spg, offs_v, mask_v, t, row, N, coef_ptr, chain_s, cap_out_s, bad,
        MODE: tl.constexpr, SOFTCAP_S: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """da of a block (fp32): the divergence's dz (p_s - p_t from each side's own exp for the forward
    KL, else p_s (g - sum p_s g)) and the log-prob's, weighted by the row's coefficients, through
    the softcap / scale / temperature chain. 0 past V."""
    p_s = tl.exp(ls)
    c_div = tl.load(coef_ptr + row)
    if MODE == FORWARD_KL:
        dz = p_s - tl.exp(lt)
    else:
        dz = p_s * (g - spg)
    dz = c_div * dz
    if HAS_TARGETS:
        c_lp = tl.load(coef_ptr + N + row)
        dz += c_lp * (tl.where(offs_v == t, 1.0, 0.0) - p_s)
    dz = dz * chain_s + bad
    if SOFTCAP_S:
        dz = dz * softcap_grad(z_s, cap_out_s)
    return tl.where(mask_v, dz, 0.0)
