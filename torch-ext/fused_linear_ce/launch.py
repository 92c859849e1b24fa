"""Host side: allocate, pick a configuration, launch. No validation here (``validate.py``), no autograd
(``ops.py``), no host synchronisation: every size comes from shapes, never from tensor values."""

import os
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import autotune, configs, parallel, products
from .backward_kernels import dlogits_kernel
from .forward_kernels import NUM_STATS, combine_kernel, lse_sweep_kernel
from .validate import Options

# The merge kernel's tile: rows per program x splits per step (memory-bound and small).
_COMBINE_BLOCK, _COMBINE_SPLITS = 64, 32


def _new(shape, dtype, device) -> torch.Tensor:
    """torch.empty, or NaN-filled when FUSED_LINEAR_CE_POISON=1 so an unwritten element fails loudly."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("FUSED_LINEAR_CE_POISON") == "1":
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


def logit_flags(dtype: torch.dtype) -> dict:
    """For kernels that compute logits: ``products.dot_flags`` and no fused multiply-add contraction where
    ``configs.fp_fusion`` says so, so that every kernel rounds z = scale * acc (- m) the same way."""
    return dict(products.dot_flags(dtype), enable_fp_fusion=configs.fp_fusion(dtype))


def _descriptors(hidden, weight, cfg):
    """(hidden's and weight's TMA tensor descriptors for ``cfg``'s tiles, True), or (hidden, weight,
    False) where ``cfg``, the GPU or the layout rules them out (``configs.tma_hardware``,
    ``configs.tma_layout``): the kernels then load through pointers."""
    if not (cfg.tma and configs.tma_hardware(hidden.device) and configs.tma_layout(hidden)
            and configs.tma_layout(weight)):
        return hidden, weight, False
    return (TensorDescriptor.from_tensor(hidden, [cfg.block_n, cfg.block_h]),
            TensorDescriptor.from_tensor(weight, [cfg.block_v, cfg.block_h]), True)


def tuning_variant(hidden, weight, bias, class_weight, opts: Options, *needs) -> tuple:
    """What of a call, besides its shape, changes the kernels it builds (the autotuning key's
    ``variant``): bias, softcap, metrics, label smoothing, class weights, TMA-able layouts, and the
    gradients wanted (``needs``)."""
    return (bias is not None, opts.softcap is not None, opts.return_metrics, opts.label_smoothing > 0,
            class_weight is not None, configs.tma_layout(hidden) and configs.tma_layout(weight), *needs)


def skip_ignored(opts: Options) -> bool:
    """Whether the sweep skips the logit tiles of row blocks whose rows are all ignored (their
    statistics are then neutral placeholders): always, unless the per-row lse is returned, which
    covers ignored rows too."""
    return not opts.return_lse


def _bias_args(bias, like):
    return (bias, bias.stride(0)) if bias is not None else (like, 0)


@dataclass
class RowStats:
    """Per-row results of the forward sweep, fp32 of shape (N,), for every row (ignored too)."""

    lse2: torch.Tensor  # (2, N): row max m and log sum exp(z - m); see ``lse``
    z_target: torch.Tensor  # the target's logit; NaN when the target is outside [0, V)
    wz: torch.Tensor | None  # sum_v w[v] z[v], with label smoothing only
    entropy: torch.Tensor | None  # with metrics only
    best: torch.Tensor | None  # with metrics only: the largest logit
    argmax: torch.Tensor | None  # with metrics only: its global class id (int64)

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

        return RowStats(*(join(f) for f in ("lse2", "z_target", "wz", "entropy", "best", "argmax")))

    def loss_terms(self) -> torch.Tensor:
        """lse - z_target computed as (m - z_target) + log-sum: exact near the max for large logits."""
        return (self.lse2[0] - self.z_target) + self.lse2[1]


def forward(hidden, weight, targets, bias, class_weight, opts: Options, shard=None) -> RowStats:
    """The vocabulary sweep: per-row log-sum-exp, target logit and optional sums, O(N) memory.
    With a vocabulary ``shard`` (parallel.Shard) the statistics are merged across its group."""
    return sweep(hidden, weight, targets, bias, class_weight, opts, shard)[0]


def sweep(hidden, weight, targets, bias, class_weight, opts: Options, shard=None, e_out=None, cfg=None):
    """Runs the sweep and the merge; returns (RowStats, the per-split statistics).

    With ``e_out`` ((N, V) buffer) every split is one vocabulary tile and the tiles also store
    exp(z - m_tile) there (the chunked path, which passes its tiles as ``cfg``); plane 0 of the
    per-split statistics, (T, N), is then each tile's row max. ``cfg``: the tiles, else the
    table's or, with autotuning on, the fastest for this shape (``autotune.tiles``)."""
    n, h = hidden.shape
    v = weight.shape[0]
    device = hidden.device
    metrics = opts.return_metrics
    smoothing = opts.label_smoothing > 0
    if cfg is None:  # the chunked path (e_out) always passes the tiles its gradient kernel uses
        assert e_out is None, "the chunked path's sweep takes its tiles from the caller"
        cfg = autotune.tiles(
            "sweep", hidden, v, lambda c: sweep(hidden, weight, targets, bias, class_weight, opts, shard, cfg=c),
            shard=shard, variant=tuning_variant(hidden, weight, bias, class_weight, opts))
    offset, v_total = (shard.offset, shard.v_total) if shard is not None else (0, v)
    lse2 = _new((2, n), torch.float32, device)
    z_target = _new((n,), torch.float32, device)
    wz = _new((n,), torch.float32, device) if smoothing else None
    entropy = _new((n,), torch.float32, device) if metrics else None
    best = _new((n,), torch.float32, device) if metrics else None
    argmax_out = _new((n,), torch.int64, device) if metrics else None
    stats_out = RowStats(lse2, z_target, wz, entropy, best, argmax_out)
    if n == 0:
        return stats_out, None

    n_blocks = triton.cdiv(n, cfg.block_n)
    n_tiles = triton.cdiv(v, cfg.block_v)
    if e_out is None:
        splits = configs.vocab_splits(n_blocks, n_tiles, device, resident=cfg.resident)
        tiles_per_split = triton.cdiv(n_tiles, splits)
        splits = triton.cdiv(n_tiles, tiles_per_split)  # no split left without tiles
    else:
        splits, tiles_per_split = n_tiles, 1
    # Only the planes this call fills: max, sum, target (+ entropy and best with metrics, + wz).
    n_stats = NUM_STATS if smoothing else (5 if metrics else 3)
    stats = _new((n_stats, splits, n), torch.float32, device)
    argmax = _new((splits, n), torch.int32, device) if metrics else stats
    bias_arg, stride_b = _bias_args(bias, hidden)
    softcap = float(opts.softcap) if opts.softcap is not None else 1.0

    group_m = cfg.group_m if e_out is not None else 0  # one tile a program: the grouped 1-D grid
    grid = (n_blocks * splits,) if group_m else (n_blocks, splits)
    hidden_desc, weight_desc, tma = _descriptors(hidden, weight, cfg)
    # The chunked path's exp(z - m_tile) goes out through a descriptor too where its layout allows:
    # a 2-D tile of pointers for the store spilled registers (NOTES v12).
    e_tma = e_out is not None and tma and configs.tma_layout(e_out)
    e_desc = TensorDescriptor.from_tensor(e_out, [cfg.block_n, cfg.block_v]) if e_tma else stats
    lse_sweep_kernel[grid](
        hidden, weight, bias_arg, targets, class_weight if class_weight is not None else stats, stats, argmax,
        e_out if e_out is not None else stats, e_out.stride(0) if e_out is not None else 0,
        hidden_desc, weight_desc, e_desc, n, v, h,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), stride_b,
        targets.stride(0), float(opts.logit_scale), softcap, tiles_per_split, splits, offset, opts.ignore_index,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None, METRICS=metrics,
        SMOOTHING=smoothing, HAS_CLASS_WEIGHT=class_weight is not None,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, EVEN_H=h % cfg.block_h == 0,
        TMA=tma, EVEN_V=v % cfg.block_v == 0, STORE_E=e_out is not None, E_TMA=e_tma,
        EMULATE_ROUNDING=configs.interpreted(), GROUP_M=group_m, SKIP_IGNORED=skip_ignored(opts),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **logit_flags(hidden.dtype),
    )
    combine_kernel[(triton.cdiv(n, _COMBINE_BLOCK),)](
        stats, argmax, targets, lse2, z_target,
        wz if smoothing else z_target, entropy if metrics else z_target, best if metrics else z_target,
        argmax_out if metrics else argmax, n, v_total, offset, splits, splits * n, targets.stride(0),
        METRICS=metrics, SMOOTHING=smoothing, BLOCK=_COMBINE_BLOCK, SPLIT_BLOCK=_COMBINE_SPLITS,
    )
    if shard is not None:
        parallel.merge_stats(stats_out, shard, metrics)
    return stats_out, stats


def add_bias_sums(db_acc: torch.Tensor, dbias: torch.Tensor, rows: int, block_n: int, unscale=None) -> None:
    """db_acc (fp32, (V,)) += the column sums of da over ``rows`` rows, from the kernels' per-row-block
    partial sums ``dbias`` ((row blocks, V) fp32), times ``unscale`` when given."""
    block_sum = dbias[: triton.cdiv(rows, block_n)].sum(0)
    db_acc += block_sum if unscale is None else block_sum * unscale


def lift_fp16(coef: torch.Tensor, unscale, class_weight, logit_scale: float):
    """(coef, unscale) with da lifted out of fp16's subnormal range by a power of two: the
    coefficients times it, ``unscale`` (an fp32 (1,) tensor, or None for 1) times its inverse.

    da = logit_scale * (A p - B onehot - C w) * softcap', with p and softcap' at most 1, so
    |da| <= |logit_scale| (|A| + |B| + |C| max|w|). At real sizes p ~ 1/V and A ~ 1/count put most
    entries below fp16's smallest normal (6e-5), where they lose precision or vanish (plain torch
    loses them too). Scaling so that the largest possible entry is 2^14 keeps them normal; the
    products divide by the same power of two, exactly."""
    w_max = class_weight.abs().amax() if class_weight is not None else 1.0
    peak = (coef[0].abs() + coef[1].abs() + coef[2].abs() * w_max).amax() * abs(logit_scale)
    k = (14.0 - torch.ceil(torch.log2(peak))).clamp(-60.0, 60.0)
    k = torch.where(torch.isfinite(k), k, torch.zeros_like(k))  # all-zero or non-finite gradients
    lift = torch.exp2(k)
    inverse = (1.0 / lift).reshape(1)
    return coef * lift, inverse if unscale is None else unscale * inverse


def _borrow_accumulator(grad_weight: torch.Tensor, n: int, h: int):
    """An fp32 (n, h) view of grad_weight's last bytes (16-byte aligned), and the first
    vocabulary row it overlaps. The caller writes those rows of grad_weight only once the
    accumulator is spent (``configs.borrows_weight_grad`` says when it fits)."""
    flat = grad_weight.view(-1)
    per = 4 // grad_weight.element_size()
    start = (flat.numel() - per * n * h) // 8 * 8
    return flat[start : start + per * n * h].view(torch.float32).view(n, h), start // h


def _borrowed_order(v: int, cols: int, first_borrowed_row: int):
    """The borrowed plan's column blocks (col0, c), laid out from the end so that the last block is
    whole: those clear of the accumulator first, then those over it, the last block last."""
    blocks = [(max(0, end - cols), end - max(0, end - cols)) for end in range(v, 0, -cols)][::-1]
    clear = [b for b in blocks if b[0] + b[1] <= first_borrowed_row]
    return clear, blocks[len(clear) :]


def backward(hidden, weight, targets, bias, class_weight, lse2, coef, opts: Options, need_dx, need_dw, need_db,
             shard=None, common=None, cfg=None):
    """Recompute backward over blocks of the (N, V) plane, in one or two passes
    (``configs.plan_passes``). Per block:
    da in the input dtype, then grad_hidden[rows] (+)= da @ weight[cols] and
    grad_weight[cols] (+)= da^T @ hidden[rows], each product's K reduction in one fp32 accumulator;
    sums across blocks go through an fp32 buffer unless the gradient is fp32 itself (16-bit: cuBLAS
    products into it). The grad_hidden accumulator may live in grad_weight's own memory
    (``BackwardPlan.borrowed``). Who runs each product: ``products``.
    ``coef`` (3, N) are the per-row coefficients of da and ``common`` an optional fp32 0-d factor
    shared by every row (losses.coefficients), applied to the products in fp32 (the Triton matmul's
    epilogue, or the fp32 accumulator's final rounding) rather than rounded into da, where it would
    repeat one rounding error on every row (``products.product``); fp16's da also carries a
    power-of-two lift out of the subnormals, undone there. With a vocabulary ``shard`` the partial
    grad_hidden is summed over its group in fp32 (every rank gets the full grad_hidden); grad_weight
    and grad_bias are the shard's own.
    ``cfg``: the dlogits kernel's tiles, else the table's or, with autotuning on, the fastest for
    this shape (``autotune.tiles``).
    Returns (grad_hidden, grad_weight, grad_bias), None where not needed."""
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    if cfg is None:
        cfg = autotune.tiles("dlogits", hidden, v, lambda c: backward(
            hidden, weight, targets, bias, class_weight, lse2, coef, opts, need_dx, need_dw, need_db, shard, common,
            cfg=c), opts.chunk_bytes, shard,
            variant=tuning_variant(hidden, weight, bias, class_weight, opts, need_dx, need_dw, need_db))
    passes = configs.plan_passes(n, v, h, dtype, opts.chunk_bytes, cfg.block_n, cfg.block_v, need_dx or need_db,
                                 need_dw)
    dx_pass = next(p for p in passes if p.rows_grads) if need_dx or need_db else None
    dw_pass = next(p for p in passes if p.weight_grad) if need_dw else None
    borrowed = len(passes) == 1 and passes[0].borrowed and need_dx and need_dw and n > 0

    def gradient(shape, summed_over_blocks):
        """The gradient tensor, and where the products accumulate into it (fp32)."""
        out = _new(shape, dtype, device)
        if summed_over_blocks and dtype != torch.float32:
            return out, _new(shape, torch.float32, device)
        return out, out

    grad_hidden = dx_acc = grad_weight = dw_acc = None
    first_borrowed_row = v
    if need_dw:
        grad_weight, dw_acc = gradient((v, h), n > 0 and triton.cdiv(n, dw_pass.rows) > 1)
        if n == 0:
            dw_acc.zero_()
    if need_dx and borrowed:
        grad_hidden = _new((n, h), dtype, device)
        dx_acc, first_borrowed_row = _borrow_accumulator(grad_weight, n, h)
    elif need_dx:
        grad_hidden, dx_acc = gradient((n, h), triton.cdiv(v, dx_pass.cols) > 1 or shard is not None)
    db_acc = torch.zeros((v,), dtype=torch.float32, device=device) if need_db else None

    unscale = common.reshape(1).to(torch.float32) if common is not None else None
    if dtype == torch.float16 and n > 0:
        coef, unscale = lift_fp16(coef, unscale, class_weight, opts.logit_scale)

    one = torch.ones((1,), dtype=torch.float32, device=device)
    unscale_or_one = unscale if unscale is not None else one
    # 16-bit inputs: products summed over blocks go to cuBLAS into the fp32 accumulator, unscaled;
    # the common factor is applied once, in the accumulator's final rounding (``scale``).
    dx_deferred = need_dx and dx_acc is not grad_hidden and dx_pass.weight_grad
    dw_deferred = need_dw and dw_acc is not grad_weight

    bias_arg, stride_b = _bias_args(bias, hidden)
    softcap = float(opts.softcap) if opts.softcap is not None else 1.0
    hidden_desc, weight_desc, tma = _descriptors(hidden, weight, cfg)

    def dlogits_block(dlogits, dbias, row0, r, col0, c, bias_grad):
        """da for rows [row0, row0 + r) x classes [col0, col0 + c) into ``dlogits`` (and the bias
        partial sums into ``dbias`` when ``bias_grad``); returns the (r, c) view."""
        grid = (triton.cdiv(r, cfg.block_n) * triton.cdiv(c, cfg.block_v),)
        dlogits_kernel[grid](
            hidden, weight, bias_arg, targets, lse2, coef,
            class_weight if class_weight is not None else coef, dlogits, dbias, hidden_desc, weight_desc,
            row0, r, col0, c, v, h,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), stride_b,
            targets.stride(0), dlogits.stride(0), float(opts.logit_scale), softcap, n,
            shard.offset if shard is not None else 0,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None,
            SMOOTHING=opts.label_smoothing > 0, HAS_CLASS_WEIGHT=class_weight is not None,
            BIAS_GRAD=bias_grad,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, GROUP_M=cfg.group_m,
            EVEN_H=h % cfg.block_h == 0, TMA=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **logit_flags(dtype),
        )
        return dlogits[:r, :c]

    def finish_grad_hidden():
        if need_dx and shard is not None:
            if n == 0:
                dx_acc.zero_()
            parallel.all_reduce(dx_acc, shard)
        if need_dx and dx_acc is not grad_hidden:
            products.scale(dx_acc, unscale_or_one if dx_deferred else one, out=grad_hidden)

    if borrowed:
        plan = passes[0]
        dlogits = _new((n, plan.cols), dtype, device)
        dbias = _new((triton.cdiv(n, cfg.block_n), v), torch.float32, device) if need_db else coef
        clear, over = _borrowed_order(v, plan.cols, first_borrowed_row)

        def weight_grad(da, col0, c):
            products.product(da.t(), hidden, grad_weight[col0 : col0 + c], False, unscale)

        for i, (col0, c) in enumerate(clear + over):
            da = dlogits_block(dlogits, dbias, 0, n, col0, c, need_db)
            products.accumulate(da, weight[col0 : col0 + c], dx_acc, i == 0)
            if i < len(clear):
                weight_grad(da, col0, c)
        if need_db:  # every column of the one row block's partial sums is written now
            add_bias_sums(db_acc, dbias, n, cfg.block_n, unscale)
        finish_grad_hidden()  # the accumulator is spent: grad_weight's last rows are free
        weight_grad(da, *over[-1])
        for col0, c in over[:-1]:
            weight_grad(dlogits_block(dlogits, dbias, 0, n, col0, c, False), col0, c)
        del dlogits, dbias, da

    for plan in passes if n > 0 and not borrowed else ():
        p_dx, p_db, p_dw = need_dx and plan.rows_grads, need_db and plan.rows_grads, need_dw and plan.weight_grad
        dlogits = _new((plan.rows, plan.cols), dtype, device)
        dbias = _new((triton.cdiv(plan.rows, cfg.block_n), v), torch.float32, device) if p_db else coef
        for row0 in range(0, n, plan.rows):
            r = min(plan.rows, n - row0)
            for col0 in range(0, v, plan.cols):
                c = min(plan.cols, v - col0)
                da = dlogits_block(dlogits, dbias, row0, r, col0, c, p_db)
                if p_dx and not plan.weight_grad:  # whole vocabulary rows: each row's gradient at once
                    products.rows_product(da, weight, dx_acc[row0 : row0 + r], unscale)
                elif p_dx and dx_deferred:
                    products.accumulate(da, weight[col0 : col0 + c], dx_acc[row0 : row0 + r], col0 == 0)
                elif p_dx:
                    products.product(da, weight[col0 : col0 + c], dx_acc[row0 : row0 + r], col0 > 0, unscale)
                if p_dw and dw_deferred:
                    products.accumulate(da.t(), hidden[row0 : row0 + r], dw_acc[col0 : col0 + c], row0 == 0)
                elif p_dw:
                    products.product(da.t(), hidden[row0 : row0 + r], dw_acc[col0 : col0 + c], row0 > 0, unscale)
            if p_db:
                add_bias_sums(db_acc, dbias, r, cfg.block_n, unscale)
        del dlogits, dbias, da  # the next pass's blocks take their place

    if not borrowed:
        finish_grad_hidden()
    if need_dw and dw_acc is not grad_weight:
        products.scale(dw_acc, unscale_or_one if dw_deferred else one, out=grad_weight)
    grad_bias = db_acc.to(dtype) if need_db else None
    return grad_hidden, grad_weight, grad_bias
