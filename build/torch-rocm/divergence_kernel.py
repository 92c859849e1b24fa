"""The divergence row kernel: from a chunk's student and teacher logits (fp32 products, no bias yet)
to the per-token divergence, the student's entropy and target log-prob, and the student's da.

The math (``distill.py`` states it whole): ``ls = z_s - lse_s`` and ``lt = z_t - lse_t`` in fp32,
every sum over the vocabulary taken from these logs, never from a probability that may underflow:

    beta = 0  (forward KL)  term = p_t (lt - ls)             da/dz = p_s - p_t
    beta = 1  (reverse KL)  term = p_s (ls - lt)             g = ls - lt
    else      (JSD)         q = log(m / p_s) = logaddexp(log(1 - beta), log(beta) + lt - ls)
                            term = beta p_t (lt - log m) + (1 - beta) p_s (-q),  g = -(1 - beta) q
    da/dz = p_s (g - sum_v p_s g)   (reverse KL and JSD)

with d = lt - ls and y = log(beta) + d, ``log(p_t / m)`` is taken from the larger branch of the
logaddexp (``-log(beta) - s`` or ``d - log(1 - beta) - s``, s = log1p(exp(-|y - log(1 - beta)|))),
so no large d cancels against itself; ``log1p`` is an atanh series of arithmetic alone (no ``tl.log``,
whose absolute error near 1 would be all of a tiny s's digits), which keeps q's relative precision
when beta (or 1 - beta) is tiny.

The entropy and the two KLs need no lse in advance: with each row's running maxima m and sums s,
``-sum p_s ls = log s_s - sum e^(z_s - m_s) (z_s - m_s) / s_s`` and ``sum p_w (lw - lo) =
sum e^(z_w - m_w) ((z_w - m_w) - (z_o - m_o)) / s_w - log s_w + log s_o`` (w the weighting model),
summed online beside s (a new max rescales them), every summand of the size of a shifted logit,
and ``log s`` from ``log1p(s - 1)`` while s <= 2 (a peaked row's small logs keep their digits).
So their values take one read of the logits, the JSD's two.
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
def log_sum(s):
    """log(s) for a softmax's sum s >= 1 (its max term is 1): ``log1p(s - 1)`` (exact s - 1) up to
    s = 2, where a GPU's fast log would lose the small logs of peaked rows; ``tl.log`` above."""
    return tl.where(s <= 2.0, log1p(tl.minimum(s, 2.0) - 1.0), tl.log(s))


# A head's logit source inside the kernel, one tuple so that every pass reads both with one call:
# (the chunk rows' fp32 products (BLOCK_N, 1) pointers, bias pointer, scale, softcap, softcap out,
# HAS_BIAS, SOFTCAP) at these positions.
ROWS = tl.constexpr(0)
BIAS = tl.constexpr(1)
SCALE = tl.constexpr(2)
CAP = tl.constexpr(3)
CAP_OUT = tl.constexpr(4)
HAS_BIAS = tl.constexpr(5)
HAS_CAP = tl.constexpr(6)


@triton.jit
def head_logits(head, offs_v, live, mask_v):
    """z of one head's vocabulary block ``offs_v`` (``logits_of`` over the head tuple)."""
    return logits_of(head[ROWS] + offs_v[None, :], head[BIAS], offs_v[None, :], live, mask_v, head[SCALE], head[CAP],
                     head[CAP_OUT], head[HAS_BIAS], head[HAS_CAP])


@triton.jit
def both_logits(student, teacher, v0, offs, counted, V, TEACHER: tl.constexpr):
    """One vocabulary block of a block of rows: (class ids, in-vocabulary mask, counted-and-in mask,
    the student's z, the teacher's z, or the student's again without TEACHER: zt is not read)."""
    offs_v = v0 + offs
    mask_v = (offs_v < V)[None, :]
    live = counted[:, None] & mask_v
    z_s = head_logits(student, offs_v, live, mask_v)
    z_t = z_s
    if TEACHER:
        z_t = head_logits(teacher, offs_v, live, mask_v)
    return offs_v, mask_v, live, z_s, z_t


@triton.jit
def row_terms(ls, lt, mask, beta, alpha, log_a, log_b, MODE: tl.constexpr):
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
        term = beta * p_t * r_t - alpha * p_s * q
        g = -alpha * q
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
    row0, R, V, N,  # the chunk's first row and rows, the classes, all rows
    stride_zs, stride_zt, stride_da, stride_t,
    scale_s, cap_s, cap_out_s, chain_s,  # the student's kernel scales (Options.kernel_scales)
    scale_t, cap_t, cap_out_t,  # the teacher's
    beta,
    alpha,  # 1 - beta, from the host's double (an fp32 beta near 1 leaves 1 - beta few digits)
    log_a,  # log(1 - beta) (JSD)
    log_b,  # log(beta) (JSD)
    MODE: tl.constexpr,  # FORWARD_KL, REVERSE_KL or JSD
    HAS_BIAS_S: tl.constexpr, HAS_BIAS_T: tl.constexpr, SOFTCAP_S: tl.constexpr, SOFTCAP_T: tl.constexpr,
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
    increasing order. Pass 1 (unless STATS_KNOWN): both rows' lse, the student's entropy and, for the
    two KLs, the divergence (= sum_v p_s g for the reverse KL), all online. Pass 2 (VALUES, JSD only):
    the divergence and sum_v p_s g. Pass 3 (WRITE_DA; the recompute backward's only pass): da;
    without DIV_GRAD (the log-prob's term alone, STATS_KNOWN) the teacher's buffer is not read, only
    written with da. So the KLs read both buffers twice with da, once without; the JSD three times
    and twice. da is written over zt's own rows as their blocks are read: da's block of a row lies in
    bytes already read (a 16-bit da in the first half of the fp32 row; an fp32 one on it), by this
    block's loads or earlier ones of any warp: a barrier before each store (otherwise the first
    blocks' da can overwrite teacher logits that another warp has yet to load).

    da = chain * softcap'(z_s) * (c_div * dz_div + c_lp * (onehot(t) - p_s)). Uncounted rows read
    nothing and get zeros everywhere; a block of them only writes its zeros. A counted row whose
    target is outside [0, V) gets NaN values and a NaN da (the loss's rule). No atomics."""
    local = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = local < R
    rows = row0 + tl.where(mask_n, local, 0)
    offs = tl.arange(0, BLOCK_V).to(tl.int64)
    da_rows = da_ptr + local[:, None] * stride_da
    counted = (tl.load(counted_ptr + rows, mask=mask_n, other=0) != 0) & mask_n
    t, bad = row_targets(targets_ptr, rows, stride_t, counted, mask_n, V, BLOCK_N, HAS_TARGETS)
    student = (zs_ptr + local[:, None] * stride_zs, bias_s_ptr, scale_s, cap_s, cap_out_s, HAS_BIAS_S, SOFTCAP_S)
    teacher = (zt_ptr + local[:, None] * stride_zt, bias_t_ptr, scale_t, cap_t, cap_out_t, HAS_BIAS_T, SOFTCAP_T)
    any_counted = tl.max(counted.to(tl.int32), axis=0) > 0
    if any_counted:
        if STATS_KNOWN:
            lse_s = tl.load(stats_ptr + rows, mask=counted, other=0.0)
            lse_t = tl.load(stats_ptr + N + rows, mask=counted, other=0.0)
            spg = tl.load(stats_ptr + 2 * N + rows, mask=counted, other=0.0)
        else:
            lse_s, lse_t, ent, div, spg = statistics_pass(student, teacher, offs, counted, V, BLOCK_N, BLOCK_V, MODE)
        if VALUES:
            if MODE == JSD:
                div, spg = jsd_pass(student, teacher, offs, counted, V, lse_s, lse_t, beta, alpha, log_a, log_b,
                                    BLOCK_N, BLOCK_V, MODE)
            log_p = target_log_prob(zs_ptr + local * stride_zs, bias_s_ptr, t, counted, mask_n, lse_s, bad, scale_s,
                                    cap_s, cap_out_s, BLOCK_N, HAS_BIAS_S, SOFTCAP_S, HAS_TARGETS)
            tl.store(out_ptr + rows, tl.where(counted, div + bad, 0.0), mask=mask_n)
            tl.store(out_ptr + N + rows, tl.where(counted, ent, 0.0), mask=mask_n)
            tl.store(out_ptr + 2 * N + rows, log_p, mask=mask_n)
            tl.store(stats_ptr + rows, lse_s, mask=mask_n)
            tl.store(stats_ptr + N + rows, lse_t, mask=mask_n)
            tl.store(stats_ptr + 2 * N + rows, spg, mask=mask_n)
        if WRITE_DA:
            da_pass(student, teacher, da_rows, offs, counted, mask_n, V, N, rows, t, bad, lse_s, lse_t, spg, coef_ptr,
                    chain_s, cap_out_s, beta, alpha, log_a, log_b, BLOCK_V, MODE, SOFTCAP_S, HAS_TARGETS, DIV_GRAD,
                    BF16_EMULATION)
    else:
        zero_rows(out_ptr, stats_ptr, da_rows, rows, mask_n, offs, V, N, BLOCK_N, BLOCK_V, VALUES, WRITE_DA)


@triton.jit
def row_targets(targets_ptr, rows, stride_t, counted, mask_n, V, BLOCK_N: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """(each row's target clamped into [0, V), NaN for a counted row whose target is outside it else
    0): the loss's rule for a bad target, added to its values and da."""
    bad = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.int64)
    if HAS_TARGETS:
        t = tl.load(targets_ptr + rows * stride_t, mask=mask_n, other=0).to(tl.int64)
        bad = tl.where(counted & ((t < 0) | (t >= V)), float("nan"), 0.0)
        t = tl.where((t >= 0) & (t < V), t, 0)
    return t, bad


@triton.jit
def statistics_pass(student, teacher, offs, counted, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                    MODE: tl.constexpr):
    """Pass 1: (lse_s, lse_t, the student's entropy, the divergence for the two KLs (0 for the JSD),
    sum_v p_s g (the reverse KL's, else 0)), online in each row's running maxima m: s = sum e^(z - m)
    for both models, h = sum e^(z_s - m_s) (z_s - m_s) (the entropy's), and for the two KLs the cross
    term c = sum of the weighting model's e^(z - m) times u = (z_w - m_w) - (z_o - m_o) (its own
    logit less the other's, each shifted by its own max). A new max rescales s, h, c by
    e^(m_old - m_new) and moves every old u (and z - m) by the shifts m_old - m_new."""
    m_s = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    m_t = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    sum_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sum_t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    h = tl.zeros((BLOCK_N,), dtype=tl.float32)
    c = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs_v, mask_v, live, z_s, z_t = both_logits(student, teacher, v0, offs, counted, V, True)
        new_s = tl.maximum(m_s, tl.max(z_s, axis=1))
        new_t = tl.maximum(m_t, tl.max(z_t, axis=1))
        shift_s = tl.where(sum_s > 0, m_s - new_s, 0.0)  # 0 before the first block
        shift_t = tl.where(sum_t > 0, m_t - new_t, 0.0)
        a_s = tl.exp(shift_s)
        a_t = tl.exp(shift_t)
        x_s = tl.where(mask_v, z_s - new_s[:, None], 0.0)
        x_t = tl.where(mask_v, z_t - new_t[:, None], 0.0)
        e_s = tl.where(mask_v, tl.exp(x_s), 0.0)
        e_t = tl.where(mask_v, tl.exp(x_t), 0.0)
        h = a_s * (h + shift_s * sum_s) + tl.sum(e_s * x_s, axis=1)
        if MODE == REVERSE_KL:
            c = a_s * (c + (shift_s - shift_t) * sum_s) + tl.sum(e_s * (x_s - x_t), axis=1)
        elif MODE == FORWARD_KL:
            c = a_t * (c + (shift_t - shift_s) * sum_t) + tl.sum(e_t * (x_t - x_s), axis=1)
        sum_s = a_s * sum_s + tl.sum(e_s, axis=1)
        sum_t = a_t * sum_t + tl.sum(e_t, axis=1)
        m_s = new_s
        m_t = new_t
    log_s = log_sum(sum_s)
    log_t = log_sum(sum_t)
    ent = log_s - h / sum_s  # -sum p_s ls
    # The KLs: sum p (ls - lt) = c / s - log s_w + log s_o (for the reverse KL also sum p_s g); the
    # JSD's log m needs both lse first (``jsd_pass``).
    spg = tl.zeros((BLOCK_N,), dtype=tl.float32)
    div = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if MODE == REVERSE_KL:
        div = c / sum_s - log_s + log_t
        spg = div
    elif MODE == FORWARD_KL:
        div = c / sum_t - log_t + log_s
    return m_s + log_s, m_t + log_t, ent, div, spg


@triton.jit
def jsd_pass(student, teacher, offs, counted, V, lse_s, lse_t, beta, alpha, log_a, log_b, BLOCK_N: tl.constexpr,
             BLOCK_V: tl.constexpr, MODE: tl.constexpr):
    """Pass 2 (the JSD's values): (the divergence, sum_v p_s g) from both rows' lse."""
    div = tl.zeros((BLOCK_N,), dtype=tl.float32)
    spg = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs_v, mask_v, live, z_s, z_t = both_logits(student, teacher, v0, offs, counted, V, True)
        ls = tl.where(live, z_s - lse_s[:, None], 0.0)
        lt = tl.where(live, z_t - lse_t[:, None], 0.0)
        term, g = row_terms(ls, lt, live, beta, alpha, log_a, log_b, MODE)
        div += tl.sum(term, axis=1)
        spg += tl.sum(tl.where(live, tl.exp(ls), 0.0) * g, axis=1)
    return div, spg


@triton.jit
def target_log_prob(zs_row_ptrs, bias_s_ptr, t, counted, mask_n, lse_s, bad, scale_s, cap_s, cap_out_s,
                    BLOCK_N: tl.constexpr, HAS_BIAS_S: tl.constexpr, SOFTCAP_S: tl.constexpr,
                    HAS_TARGETS: tl.constexpr):
    """The student's log-prob of each row's target (0 without targets and on uncounted rows)."""
    log_p = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_TARGETS:
        z_tgt = logits_of(zs_row_ptrs + t, bias_s_ptr, t, counted, mask_n, scale_s, cap_s, cap_out_s, HAS_BIAS_S,
                          SOFTCAP_S)
        log_p = tl.where(counted, z_tgt - lse_s + bad, 0.0)
    return log_p


@triton.jit
def da_pass(student, teacher, da_rows, offs, counted, mask_n, V, N, rows, t, bad, lse_s, lse_t, spg, coef_ptr,
            chain_s, cap_out_s, beta, alpha, log_a, log_b, BLOCK_V: tl.constexpr, MODE: tl.constexpr,
            SOFTCAP_S: tl.constexpr, HAS_TARGETS: tl.constexpr, DIV_GRAD: tl.constexpr, BF16_EMULATION: tl.constexpr):
    """Pass 3: da over the rows' vocabulary blocks, in place of the teacher's logits (``_da``)."""
    for v0 in range(0, V, BLOCK_V):
        offs_v, mask_v, live, z_s, z_t = both_logits(student, teacher, v0, offs, counted, V, DIV_GRAD)
        ls = tl.where(live, z_s - lse_s[:, None], 0.0)
        lt = ls
        g = ls
        if DIV_GRAD:
            lt = tl.where(live, z_t - lse_t[:, None], 0.0)
            _, g = row_terms(ls, lt, live, beta, alpha, log_a, log_b, MODE)
        da = _da(z_s, ls, lt, g, spg, offs_v, live, t, rows, counted, N, coef_ptr, chain_s, cap_out_s, bad,
                 MODE, SOFTCAP_S, HAS_TARGETS, DIV_GRAD)
        # A 16-bit da block lands on fp32 bytes that other warps of this program read in this
        # block (block 0) or an earlier one, and warps drift apart: every warp's loads of
        # the block are done before any of its da is stored.
        tl.debug_barrier()
        tl.store(da_rows + offs_v[None, :], round_to(da, da_rows.dtype.element_ty, BF16_EMULATION),
                 mask=mask_n[:, None] & mask_v)


@triton.jit
def zero_rows(out_ptr, stats_ptr, da_rows, rows, mask_n, offs, V, N, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
              VALUES: tl.constexpr, WRITE_DA: tl.constexpr):
    """A block of uncounted rows: zeros for its values, statistics and da, nothing read."""
    if VALUES:
        zero = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(3):
            tl.store(out_ptr + k * N + rows, zero, mask=mask_n)
            tl.store(stats_ptr + k * N + rows, zero, mask=mask_n)
    if WRITE_DA:
        for v0 in range(0, V, BLOCK_V):
            offs_v = v0 + offs
            zero_block = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
            tl.store(da_rows + offs_v[None, :], zero_block.to(da_rows.dtype.element_ty),
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
