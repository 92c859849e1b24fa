"""The forward sweep's Triton kernels (the math: ``logits.py``; the host side, which allocates, picks
the tiles and launches both: ``sweep.py``).

- ``lse_sweep_kernel``: one program a block of rows and a range of vocabulary tiles (a split); its
  rows' running statistics (max, sum of exponentials, target logit, the optional sums) stay in
  registers and O(BLOCK_N) numbers a split go out. With STORE_E (the chunked path, one tile a split)
  each tile also writes ``exp(z - m_tile)`` (times the softcap's derivative) for its rows.
- ``combine_kernel``: merges each row's per-split statistics into its lse, target logit and sums.
"""

import triton
import triton.language as tl

from .logits import grouped_tile, logit_tile, round_to, softcap_grad


@triton.jit
def lse_sweep_kernel(
    hidden_ptr,  # (N, H) fp32/bf16/fp16
    weight_ptr,  # (V, H) same dtype
    bias_ptr,  # (V,) same dtype, or dummy
    targets_ptr,  # (N,) int32/int64
    class_weight_ptr,  # (V,) fp32 class weights when HAS_CLASS_WEIGHT, else dummy
    stats_ptr,  # (planes, SPLIT, N) fp32 out: max, sum (+ sum (z - max) e, best; + wz; + squares)
    argmax_ptr,  # (SPLIT, N) int32 out, only written when METRICS
    z_target_ptr,  # (N,) fp32 out: the target logit, written by the split that holds the target
    e_ptr,  # (N, V) out when STORE_E (one tile per split): exp(z - tile max) [* softcap'(z)]
    stride_e,  # e's row stride
    stride_ev,  # e's class stride: 1 (with E_T, class-major, the row stride is the 1)
    hidden_desc,  # TMA: tensor descriptors (``logits.logit_tile``), else unused
    weight_desc,
    e_desc,  # E_TMA: a tensor descriptor of the (N, V) out, blocks (BLOCK_N, BLOCK_V), or with E_T
    # of its (V, N) transpose, blocks (BLOCK_V, BLOCK_N); else unused
    N,
    V,
    H,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    stride_b,
    stride_t,
    logit_scale,
    softcap,
    softcap_out,
    tiles_per_split,
    num_splits,
    vocab_offset,  # global id of this weight's first row (vocabulary-parallel shards), else 0
    ignore_index,  # with SKIP_IGNORED: a row whose target is this one is not counted
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    METRICS: tl.constexpr,
    SUM_Z: tl.constexpr,
    SQUARES: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    BF16_EMULATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    EVEN_V: tl.constexpr = False,  # V is a multiple of BLOCK_V: no tile has columns past the end
    STORE_E: tl.constexpr = False,
    E_TMA: tl.constexpr = False,
    E_T: tl.constexpr = False,  # e is class-major (its transpose's rows contiguous)
    GROUP_M: tl.constexpr = 0,
    SKIP_IGNORED: tl.constexpr = False,
):
    """One program: BLOCK_N rows x one contiguous range of vocabulary tiles (its split).

    Grid (cdiv(N, BLOCK_N), SPLIT), or with GROUP_M > 0 a 1-D grid over the same programs in groups
    of GROUP_M row blocks (``grouped_tile``: a wave shares fewer rows and weight tiles). Per row it
    carries the running max m, the rescaled sum of exp(z - m), the target logit (from the one tile
    that holds the target; the split holding it stores it as the row's result, the merge leaves it
    there), with METRICS the sum of exp(z - m) * (z - m) (moved along with m, so
    the entropy log-sum - that / sum never cancels two values near the max) and the running argmax,
    with SUM_Z the sum of w[v] * z (label smoothing's mean logit, class-weighted when
    HAS_CLASS_WEIGHT; the plain mean logit), and with SQUARES the rescaled sum of exp(2 (z - m)).
    fp32, no atomics.

    SKIP_IGNORED: a program whose rows are all ignored (prompt tokens under an assistant-only loss,
    padding) computes no logit tile and writes neutral statistics, m = 0 and a sum of 1 (on split 0,
    0 elsewhere): finite, so the merge gives lse = 0 and entropy 0 (log of the group's size across
    vocabulary shards). They are read only under a mask: the losses and metrics take ignored rows
    through ``where``, and their gradient coefficients are zero, which the gradient kernels apply
    through ``where`` too; the host turns skipping off when the lse itself is returned. With STORE_E
    such a tile's exponentials are not written: the gradient kernel gives rows whose coefficient A
    is zero a zero gradient whatever the buffer holds.
    """
    if GROUP_M > 0:
        pid_n, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), num_splits, GROUP_M)
    else:
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.where(mask_n, offs_n, 0)
    target = tl.load(targets_ptr + rows * stride_t).to(tl.int64)
    # The target's class in this weight's rows (int32), or -1 when it is outside them (another
    # shard's, or out of range): each tile compares its own columns against it in int32.
    in_shard = (target >= vocab_offset) & (target < vocab_offset + V)
    target_col = tl.where(in_shard, target - vocab_offset, -1).to(tl.int32)
    live = True  # some row of the block is counted
    if SKIP_IGNORED:
        live = tl.sum((mask_n & (target != ignore_index)).to(tl.int32), axis=0) > 0

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    z_target = tl.zeros((BLOCK_N,), tl.float32)
    pz = tl.zeros((BLOCK_N,), tl.float32)
    wz = tl.zeros((BLOCK_N,), tl.float32)
    s2 = tl.zeros((BLOCK_N,), tl.float32)
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_N,), tl.int32)

    # The last split may hold fewer tiles; the guard skips the rest (program-id-dependent loop
    # bounds are not supported by the interpreter).
    n_tiles = tl.cdiv(V, BLOCK_V)
    for i in range(0, tiles_per_split):
        vt = pid_s * tiles_per_split + i
        if (vt < n_tiles) & live:
            offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
            mask_v = offs_v < V
            cols = tl.where(mask_v, offs_v, 0)
            z = logit_tile(
                hidden_ptr, weight_ptr, bias_ptr, hidden_desc, weight_desc, pid_n * BLOCK_N, vt * BLOCK_V,
                rows, cols, H, stride_hn, stride_hh, stride_wv, stride_wh, stride_b, logit_scale, softcap,
                softcap_out, HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, BF16_EMULATION, INPUT_PRECISION, TMA,
            )
            if not EVEN_V:
                z = tl.where(mask_v[None, :], z, float("-inf"))
            tile_max = tl.max(z, axis=1)
            m_new = tl.maximum(m, tile_max)
            alpha = tl.exp(m - m_new)
            e = tl.exp(z - m_new[:, None])
            if METRICS:  # sum of exp(z - m) (z - m), moved to the new max: exact for peaked rows
                ez = e * (z - m_new[:, None])
                ez = ez if EVEN_V else tl.where(mask_v[None, :], ez, 0.0)  # not 0 * -inf
                pz = alpha * (pz + tl.where(s > 0.0, (m - m_new) * s, 0.0)) + tl.sum(ez, axis=1)
            s = s * alpha + tl.sum(e, axis=1)
            if SQUARES:
                s2 = s2 * (alpha * alpha) + tl.sum(e * e, axis=1)
            if STORE_E:  # one tile per split (the host guarantees it): m_new is this tile's max
                e_out = e
                if HAS_SOFTCAP:
                    e_out = tl.where(mask_v[None, :], e * softcap_grad(z, softcap_out), 0.0)
                if E_TMA and E_T:  # rows and classes past the end are not written
                    e_desc.store([vt * BLOCK_V, pid_n * BLOCK_N],
                                 tl.trans(round_to(e_out, e_desc.dtype, BF16_EMULATION)))
                elif E_TMA:
                    e_desc.store([pid_n * BLOCK_N, vt * BLOCK_V],
                                 round_to(e_out, e_desc.dtype, BF16_EMULATION))
                else:
                    e_ptrs = e_ptr + offs_n[:, None] * stride_e + offs_v[None, :] * stride_ev
                    tl.store(e_ptrs, round_to(e_out, e_ptr.dtype.element_ty, BF16_EMULATION),
                             mask=mask_n[:, None] & mask_v[None, :])
            is_target = tl.arange(0, BLOCK_V)[None, :] == (target_col - vt * BLOCK_V)[:, None]
            z_target += tl.sum(tl.where(is_target, z, 0.0), axis=1)
            if SUM_Z:
                if HAS_CLASS_WEIGHT:
                    w = tl.load(class_weight_ptr + cols)
                    wz += tl.sum(tl.where(mask_v[None, :], w[None, :] * z, 0.0), axis=1)
                else:
                    wz += tl.sum(tl.where(mask_v[None, :], z, 0.0), axis=1)
            if METRICS:
                tile_arg = tl.argmax(z, axis=1, tie_break_left=True).to(tl.int32)
                better = tile_max > best
                best = tl.where(better, tile_max, best)
                best_idx = tl.where(better, vt * BLOCK_V + tile_arg, best_idx)
            m = m_new

    if SKIP_IGNORED:
        m = tl.where(live, m, 0.0)
        s = tl.where(live, s, tl.where(pid_s == 0, 1.0, 0.0))

    # The one split whose columns hold the target (also where its row block was skipped: 0 then).
    split_col0 = pid_s * tiles_per_split * BLOCK_V
    holds = mask_n & (target_col >= split_col0) & (target_col < split_col0 + tiles_per_split * BLOCK_V)
    tl.store(z_target_ptr + offs_n, z_target, mask=holds)
    plane = tl.full((), num_splits, tl.int64) * N  # num_splits may come in as a constexpr 1
    base = stats_ptr + pid_s.to(tl.int64) * N + offs_n
    tl.store(base + 0 * plane, m, mask=mask_n)
    tl.store(base + 1 * plane, s, mask=mask_n)
    if METRICS:
        tl.store(base + 2 * plane, pz, mask=mask_n)
        tl.store(base + 3 * plane, best, mask=mask_n)
        tl.store(argmax_ptr + pid_s.to(tl.int64) * N + offs_n, best_idx, mask=mask_n)
    if SUM_Z:
        tl.store(base + 4 * plane, wz, mask=mask_n)
    if SQUARES:
        tl.store(base + 5 * plane, s2, mask=mask_n)


@triton.jit
def combine_kernel(
    stats_ptr,  # (planes, SPLIT, N) fp32 in: max, sum (+ the target logit where Z_PLANE), ...
    argmax_ptr,  # (SPLIT, N) int32 in
    targets_ptr,  # (N,) int32/int64
    lse_ptr,  # (2, N) fp32 out: the row max m and log(sum exp(z - m)); lse = m + log-sum, kept apart
    #           so that z - m stays exact for large logits (p = exp((z - m) - log-sum))
    z_target_ptr,  # (N,) fp32 out: the target's logit (0 when another shard holds it); NaN for a
    #                target outside [0, V_total). Without Z_PLANE the sweep wrote the rows whose
    #                target this weight holds; the merge writes the others.
    wz_ptr,  # (N,) fp32 out when SUM_Z: sum_v w[v] z[v]
    entropy_ptr,  # (N,) fp32 out when METRICS
    best_ptr,  # (N,) fp32 out when METRICS: the largest logit
    argmax_out_ptr,  # (N,) int64 out when METRICS: its global class id (first on ties)
    squares_ptr,  # (N,) fp32 out when SQUARES: sum exp(2 (z - m)), m the row max
    N,
    V,  # this weight's rows
    V_total,  # the whole vocabulary (all shards)
    vocab_offset,
    SPLIT,
    plane,  # SPLIT * N, from the host so it is int64 whenever it needs to be
    stride_t,
    METRICS: tl.constexpr,
    SUM_Z: tl.constexpr,
    SQUARES: tl.constexpr,
    Z_PLANE: tl.constexpr,  # 1: the target logit is plane 2 and the later planes one further on; 0: none
    BLOCK: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
):
    """Merges the SPLIT partial statistics of each row. Grid (cdiv(N, BLOCK),), fp32.

    Each step loads a (SPLIT_BLOCK, BLOCK) tile of splits x rows and reduces over the splits, so a
    sweep with thousands of splits (the chunked path's one tile a split) takes few dependent loads.
    The argmax keeps the first split on ties (splits are in vocabulary order), as torch.argmax; a
    NaN partial max never wins."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    split = tl.arange(0, SPLIT_BLOCK).to(tl.int64)
    m_all = tl.full((BLOCK,), float("-inf"), tl.float32)
    for s0 in range(0, SPLIT, SPLIT_BLOCK):
        sp = s0 + split
        tile = (sp < SPLIT)[:, None] & mask[None, :]
        m_i = tl.load(stats_ptr + sp[:, None] * N + offs[None, :], mask=tile, other=float("-inf"))
        m_all = tl.maximum(m_all, tl.max(m_i, axis=0))
    m_all = tl.where(mask, m_all, 0.0)
    s_all = tl.zeros((BLOCK,), tl.float32)
    z_target = tl.zeros((BLOCK,), tl.float32)
    pz_all = tl.zeros((BLOCK,), tl.float32)
    wz_all = tl.zeros((BLOCK,), tl.float32)
    s2_all = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for s0 in range(0, SPLIT, SPLIT_BLOCK):
        sp = s0 + split
        tile = (sp < SPLIT)[:, None] & mask[None, :]
        p = stats_ptr + sp[:, None] * N + offs[None, :]
        scale = tl.exp(tl.load(p, mask=tile, other=float("-inf")) - m_all[None, :])
        s_i = tl.load(p + 1 * plane, mask=tile, other=0.0)
        s_all += tl.sum(s_i * scale, axis=0)
        if Z_PLANE:
            z_target += tl.sum(tl.load(p + 2 * plane, mask=tile, other=0.0), axis=0)
        if METRICS:  # each split's sum of exp(z - m_i) (z - m_i), moved to m_all
            m_i = tl.load(p, mask=tile, other=0.0)
            q_i = (tl.load(p + (2 + Z_PLANE) * plane, mask=tile, other=0.0)
                   + tl.where(s_i > 0.0, (m_i - m_all[None, :]) * s_i, 0.0))
            pz_all += tl.sum(q_i * scale, axis=0)
            b = tl.load(p + (3 + Z_PLANE) * plane, mask=tile, other=float("-inf"))
            b = tl.where(b == b, b, float("-inf"))
            step_best = tl.max(b, axis=0)
            idx = tl.load(argmax_ptr + sp[:, None] * N + offs[None, :], mask=tile, other=0)
            step_idx = tl.min(tl.where(b == step_best[None, :], idx, 2147483647), axis=0)
            better = step_best > best
            best = tl.where(better, step_best, best)
            best_idx = tl.where(better, step_idx, best_idx)
        if SUM_Z:
            wz_all += tl.sum(tl.load(p + (4 + Z_PLANE) * plane, mask=tile, other=0.0), axis=0)
        if SQUARES:
            s2_all += tl.sum(tl.load(p + (5 + Z_PLANE) * plane, mask=tile, other=0.0) * (scale * scale), axis=0)
    log_sum = tl.log(s_all)
    lse = m_all + log_sum
    target = tl.load(targets_ptr + offs * stride_t, mask=mask, other=0).to(tl.int64)
    in_range = (target >= 0) & (target < V_total)
    tl.store(lse_ptr + offs, m_all, mask=mask)
    tl.store(lse_ptr + N + offs, log_sum, mask=mask)
    if Z_PLANE:
        tl.store(z_target_ptr + offs, tl.where(in_range, z_target, float("nan")), mask=mask)
    else:
        in_shard = (target >= vocab_offset) & (target < vocab_offset + V)
        tl.store(z_target_ptr + offs, tl.where(in_range, 0.0, float("nan")), mask=mask & ~in_shard)
    if SUM_Z:
        tl.store(wz_ptr + offs, wz_all, mask=mask)
    if SQUARES:
        tl.store(squares_ptr + offs, s2_all, mask=mask)
    if METRICS:
        tl.store(entropy_ptr + offs, log_sum - pz_all / s_all, mask=mask)
        tl.store(best_ptr + offs, best, mask=mask)
        tl.store(argmax_out_ptr + offs, best_idx.to(tl.int64) + vocab_offset, mask=mask)
