"""The forward sweep: per-row log-sum-exp, target logit and optional sums over the vocabulary, O(N)
memory (the math: ``logits.py``).

Nothing of size (N, V) is written: each program of ``sweep_kernels.lse_sweep_kernel`` keeps its rows'
running statistics in registers and writes O(BLOCK_N) numbers per vocabulary split
(``vocab_split.vocab_splits``); ``sweep_kernels.combine_kernel`` merges the splits. This module is the host
side: it allocates, picks the tiles and launches both; no validation (``validate.py``), no autograd
(``ops.py``), no host synchronisation: every size comes from shapes, never from tensor values.

The chunked path (``chunked.py``) runs the same sweep with one tile per split and STORE_E: each tile
also writes ``exp(z - m_tile)`` (times the softcap's derivative) for its chunk of rows, which
``chunked.softmax_gradient_kernel`` then turns into the logits' gradient in place.
"""

from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import autotune, configs, device, parallel, pingpong, sweep_kernels, vocab_split
from .validate import Options

# Planes of the fp32 partial statistics (planes, SPLIT, N) that ``sweep_kernels.combine_kernel``
# merges: row max, sum of exp(z - max), the target logit (the ping-pong sweep's only:
# ``sweep_kernels.lse_sweep_kernel`` writes it to the row's result directly, from the one split that
# holds the target), sum of exp(z - max) z and best logit (with metrics), sum_v w[v] z[v] (w = class
# weights, or 1; with label smoothing or the mean logit), and sum of exp(2 (z - max)) (with
# log_sum_sq_probs). At most NUM_STATS.
NUM_STATS = 7
# The planes of ``sweep_kernels.lse_sweep_kernel``'s per-split statistics, in its order; a call fills
# the first ones it needs (``_triton_sweep``).
MAX_PLANE, SUM_PLANE, ENTROPY_PLANE, BEST_PLANE, SUM_Z_PLANE, SQUARES_PLANE = range(6)
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
    table's or, with autotuning on, the fastest for this shape (``autotune.choose``). ``scratch``: a
    contiguous tensor whose memory is free until the caller's next write to it (the chunked path's
    rows of grad_hidden): the per-split statistics live there when they fit, are allocated else."""
    n, h = hidden.shape
    v = weight.shape[0]
    where = hidden.device
    metrics, sum_z, squares = sums(opts)
    # On Hopper at small H a per-token sweep (with the metrics' sums, without label smoothing's and the
    # squares) runs as a ping-pong kernel (``pingpong.py``, which says why not the loss's); the chunked
    # path's (e_out) and a caller's tiles (autotuning's candidates) stay here.
    plain = (bool(opts.outputs) and not (sum_z or squares) and bias is None and class_weight is None
             and opts.softcap is None)
    hopper = e_out is None and cfg is None and pingpong.eligible(hidden, weight, plain)
    if cfg is None and not hopper:  # the chunked path (e_out) always passes the tiles its gradient kernel uses
        assert e_out is None, "the chunked path's sweep takes its tiles from the caller"
        cfg = autotune.choose(
            "sweep", hidden, v, lambda c: sweep(hidden, weight, targets, bias, class_weight, opts, shard, cfg=c),
            shard=shard, variant=tuning_variant(hidden, weight, bias, class_weight, opts))
    offset, v_total = (shard.offset, shard.v_total) if shard is not None else (0, v)
    lse2 = device.new((2, n), torch.float32, where)
    z_target = device.new((n,), torch.float32, where)
    wz = device.new((n,), torch.float32, where) if sum_z else None
    entropy = device.new((n,), torch.float32, where) if metrics else None
    best = device.new((n,), torch.float32, where) if metrics else None
    argmax_out = device.new((n,), torch.int64, where) if metrics else None
    squares_out = device.new((n,), torch.float32, where) if squares else None
    stats_out = RowStats(lse2, z_target, wz, entropy, best, argmax_out, squares_out)
    if n == 0:
        return stats_out, None

    if hopper:
        stats, argmax, splits = pingpong.launch(hidden, weight, targets, opts.kernel_scales().tile_scale, metrics, offset,
                                                opts.ignore_index, skip_ignored(opts))
    else:
        stats, argmax, splits = _triton_sweep(hidden, weight, targets, bias, class_weight, opts, offset, e_out, cfg,
                                              z_target, scratch)
    sweep_kernels.combine_kernel[(triton.cdiv(n, _COMBINE_BLOCK),)](
        stats, argmax, targets, lse2, z_target,
        wz if sum_z else z_target, entropy if metrics else z_target, best if metrics else z_target,
        argmax_out if metrics else argmax, squares_out if squares else z_target, n, v, v_total, offset, splits,
        splits * n, targets.stride(0),
        METRICS=metrics, SUM_Z=sum_z, SQUARES=squares, Z_PLANE=int(hopper), BLOCK=_COMBINE_BLOCK,
        SPLIT_BLOCK=_COMBINE_SPLITS,
    )
    if shard is not None:
        parallel.merge_stats(stats_out, shard, metrics)
    return stats_out, stats


def _triton_sweep(hidden, weight, targets, bias, class_weight, opts: Options, offset, e_out, cfg, z_target,
                  scratch=None):
    """``sweep_kernels.lse_sweep_kernel`` with ``cfg``'s tiles: (stats, argmax or stats, splits); the
    target logit of rows whose target this weight holds into ``z_target``. The statistics in
    ``scratch``'s memory where they fit (``sweep``)."""
    n, h = hidden.shape
    v = weight.shape[0]
    where = hidden.device
    metrics, sum_z, squares = sums(opts)
    n_blocks = triton.cdiv(n, cfg.block_n)
    n_tiles = triton.cdiv(v, cfg.block_v)
    if e_out is None:
        splits, tiles_per_split = vocab_split.tile_ranges(n_blocks, n_tiles, where, resident=cfg.resident)
    else:
        splits, tiles_per_split = n_tiles, 1
    # Only the planes this call fills: max, sum (+ entropy and best with metrics, + wz, + squares).
    last = SQUARES_PLANE if squares else SUM_Z_PLANE if sum_z else BEST_PLANE if metrics else SUM_PLANE
    n_stats = last + 1
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
    e_tma = (e_out is not None and tma and device.tma_layout(e_out.t() if e_t else e_out)
             and (not e_t or configs.transposed_store_tma(where)))
    e_desc = stats
    if e_tma:
        e_desc = (TensorDescriptor.from_tensor(e_out.t(), [cfg.block_v, cfg.block_n]) if e_t
                  else TensorDescriptor.from_tensor(e_out, [cfg.block_n, cfg.block_v]))
    stride_e = (e_out.stride(0), e_out.stride(1)) if e_out is not None else (0, 0)
    sweep_kernels.lse_sweep_kernel[grid](
        hidden, weight, bias_arg, targets, class_weight if class_weight is not None else stats, stats, argmax, z_target,
        e_out if e_out is not None else stats, *stride_e,
        hidden_desc, weight_desc, e_desc, n, v, h,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), stride_b,
        targets.stride(0), tile_scale, softcap, softcap_out, tiles_per_split, splits, offset, opts.ignore_index,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None, METRICS=metrics,
        SUM_Z=sum_z, SQUARES=squares, HAS_CLASS_WEIGHT=class_weight is not None,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, EVEN_H=h % cfg.block_h == 0,
        TMA=tma, EVEN_V=v % cfg.block_v == 0, STORE_E=e_out is not None, E_TMA=e_tma, E_T=e_t,
        GROUP_M=group_m, SKIP_IGNORED=skip_ignored(opts),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **device.logit_flags(hidden.dtype, hidden.device),
    )
    return stats, argmax, splits
