"""The forward sweep: per-row log-sum-exp, target logit and optional sums over the vocabulary, O(N)
memory (the math: ``logits.py``).

Nothing of size (N, V) is written: each program of ``lse_sweep_kernel`` keeps its rows' running
statistics in registers and writes O(BLOCK_N) numbers per vocabulary split (``plan.vocab_splits``);
``combine_kernel`` merges the splits. The host side allocates, picks the tiles and launches both; no
validation (``validate.py``), no autograd (``ops.py``), no host synchronisation: every size comes from
shapes, never from tensor values.

The chunked path (``chunked.py``) runs the same sweep with one tile per split and STORE_E: each tile
also writes ``exp(z - m_tile)`` (times the softcap's derivative) for its chunk of rows, which
``chunked.softmax_gradient_kernel`` then turns into the logits' gradient in place.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import autotune, device, parallel, pingpong, plan
from .logits import grouped_tile, logit_tile, round_to, softcap_grad
from .validate import Options

# Planes of the fp32 partial statistics (planes, SPLIT, N) that ``combine_kernel`` merges: row max,
# sum of exp(z - max), the target logit (the ping-pong sweep's only: ``lse_sweep_kernel`` writes it
# to the row's result directly, from the one split that holds the target), sum of exp(z - max) z and
# best logit (with metrics), sum_v w[v] z[v] (w = class weights, or 1; with label smoothing or the
# mean logit), and sum of exp(2 (z - max)) (with log_sum_sq_probs). At most NUM_STATS.
NUM_STATS = 7
# The merge kernel's tile: rows per program x splits per step (memory-bound and small).
_COMBINE_BLOCK, _COMBINE_SPLITS = 64, 32


def tuning_variant(hidden, weight, bias, class_weight, opts: Options, *needs) -> tuple:
    """What of a call, besides its shape, changes the kernels it builds (the autotuning key's
    ``variant``): bias, softcap, metrics, label smoothing, class weights, TMA-able layouts, and the
    gradients wanted (``needs``)."""
    return (bias is not None, opts.softcap is not None, *sums(opts), class_weight is not None,
            device.tma_layout(hidden) and device.tma_layout(weight), *needs)


def sums(opts: Options) -> tuple[bool, bool, bool]:
    """Which optional sums the sweep carries: (METRICS: sum of exp(z - m) z and the argmax, for the
    metrics, the entropy or the top-1; SUM_Z: sum of w z, for label smoothing or the mean logit;
    SQUARES: sum of exp(2 (z - m)), for log_sum_sq_probs)."""
    out = opts.outputs
    metrics = opts.return_metrics or "entropy" in out or "is_top1" in out
    return metrics, opts.label_smoothing > 0 or "mean_logits" in out, "log_sum_sq_probs" in out


def skip_ignored(opts: Options) -> bool:
    """Whether the sweep skips the logit tiles of row blocks whose rows are all ignored (their
    statistics are then neutral placeholders): always, unless the per-row lse is returned, which
    covers ignored rows too."""
    return not opts.return_lse


def bias_args(bias, like):
    """(pointer, stride) of the bias for the logit kernels: ``like`` and 0 as placeholders without one."""
    return (bias, bias.stride(0)) if bias is not None else (like, 0)


@dataclass
class RowStats:
    """Per-row results of the forward sweep, fp32 of shape (N,), for every row (ignored too)."""

    lse2: torch.Tensor  # (2, N): row max m and log sum exp(z - m); see ``lse``
    z_target: torch.Tensor  # the target's logit; NaN when the target is outside [0, V)
    wz: torch.Tensor | None  # sum_v w[v] z[v], with SUM_Z only
    entropy: torch.Tensor | None  # with METRICS only
    best: torch.Tensor | None  # with METRICS only: the largest logit
    argmax: torch.Tensor | None  # with METRICS only: its global class id (int64)
    squares: torch.Tensor | None = None  # with SQUARES only: sum_v exp(2 (z - m)), m = lse2[0]

    @property
    def lse(self) -> torch.Tensor:
        return self.lse2[0] + self.lse2[1]

    @staticmethod
    def cat(parts: list["RowStats"]) -> "RowStats":
        """The statistics of consecutive pieces of rows, joined."""
        if len(parts) == 1:
            return parts[0]

        def join(name):
            first = getattr(parts[0], name)
            return None if first is None else torch.cat([getattr(p, name) for p in parts], dim=-1)

        return RowStats(*(join(f) for f in ("lse2", "z_target", "wz", "entropy", "best", "argmax", "squares")))

    def loss_terms(self) -> torch.Tensor:
        """lse - z_target computed as (m - z_target) + log-sum: exact near the max for large logits."""
        return (self.lse2[0] - self.z_target) + self.lse2[1]


def forward(hidden, weight, targets, bias, class_weight, opts: Options, shard=None) -> RowStats:
    """The vocabulary sweep: per-row log-sum-exp, target logit and optional sums, O(N) memory.
    With a vocabulary ``shard`` (parallel.Shard) the statistics are merged across its group."""
    return sweep(hidden, weight, targets, bias, class_weight, opts, shard)[0]


def sweep(hidden, weight, targets, bias, class_weight, opts: Options, shard=None, e_out=None, cfg=None,
          scratch=None):
    """Runs the sweep and the merge; returns (RowStats, the per-split statistics).

    With ``e_out`` ((N, V) buffer) every split is one vocabulary tile and the tiles also store
    exp(z - m_tile) there (the chunked path, which passes its tiles as ``cfg``); plane 0 of the
    per-split statistics, (T, N), is then each tile's row max. ``cfg``: the tiles, else the
    table's or, with autotuning on, the fastest for this shape (``autotune.tiles``). ``scratch``: a
    contiguous tensor whose memory is free until the caller's next write to it (the chunked path's
    rows of grad_hidden): the per-split statistics live there when they fit, are allocated else."""
    n, h = hidden.shape
    v = weight.shape[0]
    where = hidden.device
    metrics, smoothing, squares = sums(opts)  # smoothing: the SUM_Z plane
    # On Hopper at small H a per-token sweep (with the metrics' sums, without label smoothing's and the
    # squares) runs as a ping-pong kernel (``pingpong.py``, which says why not the loss's); the chunked
    # path's (e_out) and a caller's tiles (autotuning's candidates) stay here.
    plain = (bool(opts.outputs) and not (smoothing or squares) and bias is None and class_weight is None
             and opts.softcap is None)
    hopper = e_out is None and cfg is None and pingpong.eligible(hidden, weight, plain)
    if cfg is None and not hopper:  # the chunked path (e_out) always passes the tiles its gradient kernel uses
        assert e_out is None, "the chunked path's sweep takes its tiles from the caller"
        cfg = autotune.tiles(
            "sweep", hidden, v, lambda c: sweep(hidden, weight, targets, bias, class_weight, opts, shard, cfg=c),
            shard=shard, variant=tuning_variant(hidden, weight, bias, class_weight, opts))
    offset, v_total = (shard.offset, shard.v_total) if shard is not None else (0, v)
    lse2 = device.new((2, n), torch.float32, where)
    z_target = device.new((n,), torch.float32, where)
    wz = device.new((n,), torch.float32, where) if smoothing else None
    entropy = device.new((n,), torch.float32, where) if metrics else None
    best = device.new((n,), torch.float32, where) if metrics else None
    argmax_out = device.new((n,), torch.int64, where) if metrics else None
    squares_out = device.new((n,), torch.float32, where) if squares else None
    stats_out = RowStats(lse2, z_target, wz, entropy, best, argmax_out, squares_out)
    if n == 0:
        return stats_out, None

    if hopper:
        stats, argmax, splits = pingpong.launch(hidden, weight, targets, opts.kernel_scales()[0], metrics, offset,
                                                opts.ignore_index, skip_ignored(opts))
    else:
        stats, argmax, splits = _triton_sweep(hidden, weight, targets, bias, class_weight, opts, offset, e_out, cfg,
                                              z_target, scratch)
    combine_kernel[(triton.cdiv(n, _COMBINE_BLOCK),)](
        stats, argmax, targets, lse2, z_target,
        wz if smoothing else z_target, entropy if metrics else z_target, best if metrics else z_target,
        argmax_out if metrics else argmax, squares_out if squares else z_target, n, v, v_total, offset, splits,
        splits * n, targets.stride(0),
        METRICS=metrics, SMOOTHING=smoothing, SQUARES=squares, Z_PLANE=int(hopper), BLOCK=_COMBINE_BLOCK,
        SPLIT_BLOCK=_COMBINE_SPLITS,
    )
    if shard is not None:
        parallel.merge_stats(stats_out, shard, metrics)
    return stats_out, stats


def _triton_sweep(hidden, weight, targets, bias, class_weight, opts: Options, offset, e_out, cfg, z_target,
                  scratch=None):
    """``lse_sweep_kernel`` with ``cfg``'s tiles: (stats, argmax or stats, splits); the target logit
    of rows whose target this weight holds into ``z_target``. The statistics in ``scratch``'s memory
    where they fit (``sweep``)."""
    n, h = hidden.shape
    v = weight.shape[0]
    where = hidden.device
    metrics, smoothing, squares = sums(opts)
    n_blocks = triton.cdiv(n, cfg.block_n)
    n_tiles = triton.cdiv(v, cfg.block_v)
    if e_out is None:
        splits, tiles_per_split = plan.tile_ranges(n_blocks, n_tiles, where, resident=cfg.resident)
    else:
        splits, tiles_per_split = n_tiles, 1
    # Only the planes this call fills: max, sum (+ entropy and best with metrics, + wz, + squares).
    n_stats = 6 if squares else 5 if smoothing else 4 if metrics else 2
    stats = device.fp32_fit(scratch, (n_stats, splits, n)) if scratch is not None else None
    if stats is None:
        stats = device.new((n_stats, splits, n), torch.float32, where)
    argmax = device.new((splits, n), torch.int32, where) if metrics else stats
    bias_arg, stride_b = bias_args(bias, hidden)
    tile_scale, softcap, softcap_out, _ = opts.kernel_scales()

    group_m = cfg.group_m if e_out is not None else 0  # one tile a program: the grouped 1-D grid
    grid = (n_blocks * splits,) if group_m else (n_blocks, splits)
    hidden_desc, weight_desc, tma = device.logit_descriptors(hidden, weight, cfg)
    # The chunked path's exp(z - m_tile) goes out through a descriptor too where its layout allows
    # (a 2-D tile of store pointers spills registers): over the buffer, or over its transpose when
    # the buffer is class-major (``chunked``'s buffer hosted in grad_weight's memory).
    e_t = e_out is not None and e_out.stride(1) != 1
    e_tma = e_out is not None and tma and device.tma_layout(e_out.t() if e_t else e_out)
    e_desc = stats
    if e_tma:
        e_desc = (TensorDescriptor.from_tensor(e_out.t(), [cfg.block_v, cfg.block_n]) if e_t
                  else TensorDescriptor.from_tensor(e_out, [cfg.block_n, cfg.block_v]))
    stride_e = (e_out.stride(0), e_out.stride(1)) if e_out is not None else (0, 0)
    lse_sweep_kernel[grid](
        hidden, weight, bias_arg, targets, class_weight if class_weight is not None else stats, stats, argmax, z_target,
        e_out if e_out is not None else stats, *stride_e,
        hidden_desc, weight_desc, e_desc, n, v, h,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), stride_b,
        targets.stride(0), tile_scale, softcap, softcap_out, tiles_per_split, splits, offset, opts.ignore_index,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None, METRICS=metrics,
        SMOOTHING=smoothing, SQUARES=squares, HAS_CLASS_WEIGHT=class_weight is not None,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, EVEN_H=h % cfg.block_h == 0,
        TMA=tma, EVEN_V=v % cfg.block_v == 0, STORE_E=e_out is not None, E_TMA=e_tma, E_T=e_t,
        GROUP_M=group_m, SKIP_IGNORED=skip_ignored(opts),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **device.logit_flags(hidden.dtype),
    )
    return stats, argmax, splits


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
    SMOOTHING: tl.constexpr,
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
    with SMOOTHING the sum of w[v] * z (label smoothing's mean logit, class-weighted when
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
            if SMOOTHING:
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
    if SMOOTHING:
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
    wz_ptr,  # (N,) fp32 out when SMOOTHING: sum_v w[v] z[v]
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
    SMOOTHING: tl.constexpr,
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
        if SMOOTHING:
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
    if SMOOTHING:
        tl.store(wz_ptr + offs, wz_all, mask=mask)
    if SQUARES:
        tl.store(squares_ptr + offs, s2_all, mask=mask)
    if METRICS:
        tl.store(entropy_ptr + offs, log_sum - pz_all / s_all, mask=mask)
        tl.store(best_ptr + offs, best, mask=mask)
        tl.store(argmax_out_ptr + offs, best_idx.to(tl.int64) + vocab_offset, mask=mask)
