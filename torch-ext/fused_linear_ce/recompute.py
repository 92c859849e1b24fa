"""The recompute backward: the logits recomputed block by block of the (N, V) plane into their
gradient da, then the two products per block (the math: ``logits.py`` and ``losses.py``).

``dlogits_kernel`` turns one block into da (the gradient of the pre-scale logits) in the input dtype,
from fp32 logits recomputed tile by tile and the forward's log-sum-exp. ``products`` then runs
grad_hidden[rows] (+)= da @ weight[cols] and grad_weight[cols] (+)= da^T @ hidden[rows] with fp32
accumulation. The blocks and passes come from the call's plan (``plan.Plan.passes``): the ordinary block loop
(``_block_passes``; one pass of vocabulary blocks whose fp32 grad_hidden accumulator is half hosted
in grad_hidden's own memory; for long context, one pass whose grad_hidden is summed as a bf16 + int8
pair, ``products.compensated``), or one pass whose grad_hidden accumulator lives in grad_weight's own
memory (``_borrowed_pass``).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import autotune, device, losses, pairs, parallel, products
from .backward_passes import borrowed_order, hosted_rows
from .logits import grouped_tile, label_terms, logit_tile, softcap_grad, store_dlogits
from .plan import Plan
from .sweep import bias_args, tuning_variant
from .validate import Options


@triton.jit
def dlogits_kernel(
    hidden_ptr,  # (N, H) fp32/bf16/fp16
    weight_ptr,  # (V, H) same dtype
    bias_ptr,  # (V,) same dtype, or dummy
    targets_ptr,  # (N,) int32/int64
    lse_ptr,  # (2, N) fp32, from the forward: row max m and log-sum (lse = m + log-sum)
    coef_ptr,  # (3, N) fp32: per-row A, B, C of da = A * p - B * onehot - C * w (see losses.py);
    #            (5, N) with ENTROPY_GRAD: also E and S of the term - E * p * (z - S) (tokens.py)
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
    softcap_out,
    grad_scale,  # the chain's factor dz -> da (Options.kernel_scales)
    N,
    vocab_offset,  # global id of this weight's first row (vocabulary-parallel shards), else 0
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
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
    if ENTROPY_GRAD:
        coef_e = tl.load(coef_ptr + 3 * N + rows)
        live_rows = live_rows | (mask_n & (coef_e != 0.0))
    if tl.sum(live_rows.to(tl.int32), axis=0) > 0:
        z = logit_tile(
            hidden_ptr, weight_ptr, bias_ptr, hidden_desc, weight_desc, row0 + pid_m * BLOCK_N,
            col0 + pid_v * BLOCK_V, rows, cols, H, stride_hn, stride_hh, stride_wv, stride_wh, stride_b, logit_scale,
            softcap, softcap_out, HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, BF16_EMULATION, INPUT_PRECISION, TMA,
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

    log_p = (z - row_max[:, None]) - log_sum[:, None]
    p = tl.exp(log_p)
    if ENTROPY_GRAD:  # (A - E (z - S)) p: the entropy's gradient with the log-prob's, written as
        # (A - E (lse - S) - E log p) p so that z is dead once p is formed (without a softcap): as
        # A - E (z - S) it kept both tiles live and spilled ~400 bytes (scripts/registers.py).
        s_row = tl.load(coef_ptr + 4 * N + rows)
        a = (coef_a - coef_e * ((row_max + log_sum) - s_row))[:, None] - coef_e[:, None] * log_p
        d = tl.where((coef_a[:, None] == 0.0) & (coef_e[:, None] == 0.0), 0.0, a * p)
    else:
        d = tl.where(coef_a[:, None] == 0.0, 0.0, coef_a[:, None] * p)
    d -= tl.where(tl.arange(0, BLOCK_V)[None, :] == target_col[:, None], coef_b[:, None], 0.0)
    d = label_terms(d, coef_b, coef_ptr + 2 * N + rows, class_weight_ptr, offs_v, mask_v, SMOOTHING, HAS_CLASS_WEIGHT)
    if HAS_SOFTCAP:
        d = d * softcap_grad(z, softcap_out)
    d = d * grad_scale

    mask = mask_n[:, None] & mask_v[None, :]
    store_dlogits(d, dlogits_ptr + local_n[:, None] * stride_dc + local_v[None, :], mask, mask_v,
                  dbias_ptr + pid_m.to(tl.int64) * V + offs_v, BIAS_GRAD, BF16_EMULATION)


class _Dlogits:
    """Launches ``dlogits_kernel`` for one call's inputs: ``block(...)`` is da for a block."""

    def __init__(self, hidden, weight, targets, bias, class_weight, lse2, coef, opts: Options, shard, cfg):
        self.inputs = (hidden, weight, targets, bias, class_weight, lse2, coef)
        self.opts, self.shard, self.cfg = opts, shard, cfg
        self.bias_arg, self.stride_b = bias_args(bias, hidden)
        self.hidden_desc, self.weight_desc, self.tma = device.logit_descriptors(hidden, weight, cfg)

    def block(self, dlogits, dbias, row0, r, col0, c, bias_grad):
        """da for rows [row0, row0 + r) x classes [col0, col0 + c) into ``dlogits`` (and the bias
        partial sums into ``dbias`` when ``bias_grad``; else it may be None); returns the (r, c) view."""
        hidden, weight, targets, bias, class_weight, lse2, coef = self.inputs
        opts, cfg, (n, h), v = self.opts, self.cfg, hidden.shape, weight.shape[0]
        tile_scale, softcap, softcap_out, grad_scale = opts.kernel_scales()
        grid = (triton.cdiv(r, cfg.block_n) * triton.cdiv(c, cfg.block_v),)
        dlogits_kernel[grid](
            hidden, weight, self.bias_arg, targets, lse2, coef,
            class_weight if class_weight is not None else coef, dlogits, dbias if dbias is not None else coef,
            self.hidden_desc, self.weight_desc,
            row0, r, col0, c, v, h,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), self.stride_b,
            targets.stride(0), dlogits.stride(0), tile_scale, softcap, softcap_out, grad_scale, n,
            self.shard.offset if self.shard is not None else 0,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None,
            SMOOTHING=opts.label_smoothing > 0, ENTROPY_GRAD=losses.entropy_term(coef),
            HAS_CLASS_WEIGHT=class_weight is not None,
            BIAS_GRAD=bias_grad,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, GROUP_M=cfg.group_m,
            EVEN_H=h % cfg.block_h == 0, TMA=self.tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **device.logit_flags(hidden.dtype, hidden.device),
        )
        return dlogits[:r, :c]


def _borrow_accumulator(grad_weight: torch.Tensor, n: int, h: int):
    """An fp32 (n, h) view of grad_weight's last bytes (16-byte aligned), and the first
    vocabulary row it overlaps. The caller writes those rows of grad_weight only once the
    accumulator is spent (``backward_passes.borrows_weight_grad`` says when it fits)."""
    per = 4 // grad_weight.element_size()
    start = (grad_weight.numel() - per * n * h) // 8 * 8
    return device.fp32_view(grad_weight, (n, h), start), start // h


@dataclass
class _Gradients:
    """The gradients and where the products sum them (``*_acc``, fp32 when summed over blocks of a
    16-bit gradient; the gradient itself otherwise), the factor the products apply (``unscale``), and
    which sums are deferred: 16-bit products summed over blocks go to cuBLAS into the fp32
    accumulator unscaled, and the factor is applied once, in the accumulator's final rounding."""

    grad_hidden: torch.Tensor | None
    dx_acc: torch.Tensor | None
    grad_weight: torch.Tensor | None
    dw_acc: torch.Tensor | None
    db_acc: torch.Tensor | None
    unscale: torch.Tensor | None
    dx_deferred: bool
    dw_deferred: bool
    first_borrowed_row: int  # grad_weight's rows from here on hold the borrowed accumulator
    one: torch.Tensor  # fp32 (1,): the factor of a sum that is not deferred
    dx_lo: torch.Tensor | None = None  # the paired plan's int8 remainder of grad_hidden (products.compensated)
    # A hosted accumulator (``BackwardPlan.hosted``): its first rows, an fp32 view of grad_hidden's
    # own memory; ``dx_acc`` is then the rest (rows dx_hosted.shape[0] onwards).
    dx_hosted: torch.Tensor | None = None

    def accumulate_hosted(self, da, weight_cols, first: bool) -> None:
        """The hosted accumulator's two parts (+)= da @ weight_cols, da of all N rows (unscaled:
        deferred)."""
        split = self.dx_hosted.shape[0]
        products.accumulate(da[:split], weight_cols, self.dx_hosted, first)
        products.accumulate(da[split:], weight_cols, self.dx_acc, first)

    def finish_grad_hidden(self, shard, scratch=None) -> None:
        """Sums grad_hidden over the shard's group, and rounds its fp32 accumulator into it. A hosted
        accumulator's rows are first copied into ``scratch`` (the spent da block), as grad_hidden's
        rows overwrite them."""
        if self.dx_acc is None:
            return
        parts = [self.dx_acc] if self.dx_hosted is None else [self.dx_hosted, self.dx_acc]
        if shard is not None:
            for part in parts:
                if part.shape[0] == 0:
                    part.zero_()
                parallel.all_reduce(part, shard)
        if self.dx_hosted is not None:
            split = self.dx_hosted.shape[0]
            hosted = device.fp32_view(scratch, self.dx_hosted.shape)
            hosted.copy_(self.dx_hosted)
            factor = self._factor(self.dx_deferred)
            products.scale(hosted, factor, out=self.grad_hidden[:split])
            products.scale(self.dx_acc, factor, out=self.grad_hidden[split:])
        elif self.dx_acc is not self.grad_hidden:
            products.scale(self.dx_acc, self._factor(self.dx_deferred), out=self.grad_hidden)

    def finish_grad_weight(self) -> None:
        """Applies the factor to grad_weight's unscaled fp32 sum over token blocks and rounds it into
        grad_weight (in place when the sum is grad_weight itself: a master weight's)."""
        if self.dw_deferred:
            products.scale(self.dw_acc, self._factor(True), out=self.grad_weight)

    def _factor(self, deferred: bool) -> torch.Tensor:
        return self.unscale if deferred and self.unscale is not None else self.one


def _allocate(hidden, weight, coef, class_weight, opts: Options, passes, needs, borrowed, shard, common, dw_dtype):
    """The gradients and accumulators of ``backward`` (``_Gradients``), and the coefficients (fp16's
    lifted out of the subnormals, ``losses.lift_fp16``). An fp32 ``dw_dtype`` (a master weight)
    makes grad_weight fp32 and its own accumulator."""
    need_dx, need_dw, need_db = needs
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, where = hidden.dtype, hidden.device
    dx_pass = next(p for p in passes if p.rows_grads) if need_dx or need_db else None
    dw_pass = next(p for p in passes if p.weight_grad) if need_dw else None

    def gradient(shape, summed_over_blocks, out_dtype=dtype):
        """The gradient tensor, and where the products accumulate into it (fp32)."""
        out = device.new(shape, out_dtype, where)
        if summed_over_blocks and out_dtype != torch.float32:
            return out, device.new(shape, torch.float32, where)
        return out, out

    grad_hidden = dx_acc = grad_weight = dw_acc = None
    first_borrowed_row = v
    dw_summed = need_dw and n > 0 and triton.cdiv(n, dw_pass.rows) > 1  # over token blocks
    if need_dw:
        grad_weight, dw_acc = gradient((v, h), dw_summed, dw_dtype or dtype)
        if n == 0:
            dw_acc.zero_()
    dx_lo = dx_hosted = None
    if need_dx and dx_pass.hosted:
        grad_hidden = device.new((n, h), dtype, where)
        split = hosted_rows(n, dtype.itemsize)
        dx_hosted = device.fp32_view(grad_hidden, (split, h))
        dx_acc = device.new((n - split, h), torch.float32, where)
    elif need_dx and borrowed:
        grad_hidden = device.new((n, h), dtype, where)
        dx_acc, first_borrowed_row = _borrow_accumulator(grad_weight, n, h)
    elif need_dx and dx_pass.paired:  # summed as a pair: grad_hidden itself and an int8 remainder
        grad_hidden = dx_acc = device.new((n, h), dtype, where)
        dx_lo = pairs.compensation_buffer(grad_hidden, torch.int8)
    elif need_dx:
        grad_hidden, dx_acc = gradient((n, h), triton.cdiv(v, dx_pass.cols) > 1 or shard is not None)
    db_acc = torch.zeros((v,), dtype=torch.float32, device=where) if need_db else None

    unscale = common.reshape(1).to(torch.float32) if common is not None else None
    if dtype == torch.float16 and n > 0:
        v_total = shard.v_total if shard is not None else v
        coef, unscale = losses.lift_fp16(coef, unscale, class_weight, opts.kernel_scales().grad_scale, v_total)
    one = torch.ones((1,), dtype=torch.float32, device=where)
    dx_deferred = need_dx and dx_acc is not grad_hidden and dx_pass.weight_grad
    # A grad_weight summed over token blocks from 16-bit products is summed unscaled in fp32 (cuBLAS
    # with an fp32 result, ``products.accumulate``): in its own fp32 buffer, or in itself for a master
    # weight; ``finish_grad_weight`` applies the factor once.
    dw_deferred = dw_summed and dtype != torch.float32
    assert dx_hosted is None or dx_deferred  # the hosted sum is one pass of vocabulary blocks, unscaled
    return coef, _Gradients(grad_hidden, dx_acc, grad_weight, dw_acc, db_acc, unscale, dx_deferred, dw_deferred,
                            first_borrowed_row, one, dx_lo, dx_hosted)


def _borrowed_pass(dlogits_of, g: _Gradients, hidden, weight, cols, need_db, shard) -> None:
    """The one pass of vocabulary blocks of all N rows whose fp32 grad_hidden accumulator is
    grad_weight's last rows (``BackwardPlan.borrowed``): the blocks clear of those rows get their
    grad_weight at once; the others, once grad_hidden is final, the last from its da still at hand
    and the rest from their da recomputed (``backward_passes.borrowed_order``)."""
    n = hidden.shape[0]
    v = weight.shape[0]
    block_n = dlogits_of.cfg.block_n
    dlogits = device.new((n, cols), hidden.dtype, hidden.device)
    dbias = device.new((triton.cdiv(n, block_n), v), torch.float32, hidden.device) if need_db else None
    clear, over = borrowed_order(v, cols, g.first_borrowed_row)

    assert not g.dw_deferred  # each block's grad_weight is complete in one product (all N rows)

    def weight_grad(da, col0, c):
        products.product(da.t(), hidden, g.grad_weight[col0 : col0 + c], False, g.unscale)

    for i, (col0, c) in enumerate(clear + over):
        da = dlogits_of.block(dlogits, dbias, 0, n, col0, c, need_db)
        products.accumulate(da, weight[col0 : col0 + c], g.dx_acc, i == 0)
        if i < len(clear):
            weight_grad(da, col0, c)
    if need_db:  # every column of the one row block's partial sums is written now
        products.add_bias_sums(g.db_acc, dbias, n, block_n, g.unscale)
    g.finish_grad_hidden(shard)  # the accumulator is spent: grad_weight's last rows are free
    weight_grad(da, *over[-1])
    for col0, c in over[:-1]:
        weight_grad(dlogits_of.block(dlogits, dbias, 0, n, col0, c, False), col0, c)


def _block_passes(dlogits_of, g: _Gradients, hidden, weight, passes, needs, shard) -> None:
    """Each pass's blocks of ``rows`` x ``cols``: da, then the products this pass computes (and a
    hosted accumulator's rounding into grad_hidden, which needs the spent da block)."""
    need_dx, need_dw, need_db = needs
    n = hidden.shape[0]
    v = weight.shape[0]
    block_n = dlogits_of.cfg.block_n
    for p in passes:
        p_dx, p_db, p_dw = need_dx and p.rows_grads, need_db and p.rows_grads, need_dw and p.weight_grad
        dlogits = device.new((p.rows, p.cols), hidden.dtype, hidden.device)
        dbias = device.new((triton.cdiv(p.rows, block_n), v), torch.float32, hidden.device) if p_db else None
        for row0 in range(0, n, p.rows):
            r = min(p.rows, n - row0)
            for col0 in range(0, v, p.cols):
                c = min(p.cols, v - col0)
                da = dlogits_of.block(dlogits, dbias, row0, r, col0, c, p_db)
                if p_dx and not p.weight_grad:  # whole vocabulary rows: each row's gradient at once
                    products.rows_product(da, weight, g.dx_acc[row0 : row0 + r], g.unscale)
                elif p_dx and p.paired:  # all N rows; the pair carries the sum across the blocks
                    products.compensated(da, weight[col0 : col0 + c], g.grad_hidden, g.dx_lo, col0 > 0, g.unscale,
                                         role="paired_rows")
                elif p_dx and g.dx_hosted is not None:  # all N rows, into the two parts of the sum
                    g.accumulate_hosted(da, weight[col0 : col0 + c], col0 == 0)
                elif p_dx and g.dx_deferred:
                    products.accumulate(da, weight[col0 : col0 + c], g.dx_acc[row0 : row0 + r], col0 == 0)
                elif p_dx:
                    products.product(da, weight[col0 : col0 + c], g.dx_acc[row0 : row0 + r], col0 > 0, g.unscale)
                if p_dw and g.dw_deferred:
                    products.accumulate(da.t(), hidden[row0 : row0 + r], g.dw_acc[col0 : col0 + c], row0 == 0)
                elif p_dw:
                    products.product(da.t(), hidden[row0 : row0 + r], g.dw_acc[col0 : col0 + c], row0 > 0,
                                     g.unscale)
            if p_db:
                products.add_bias_sums(g.db_acc, dbias, r, block_n, g.unscale)
        if g.dx_hosted is not None:  # the da block is spent: it takes the hosted rows' copy
            g.finish_grad_hidden(shard, scratch=dlogits)
        del dlogits, dbias, da  # the next pass's blocks take their place


def backward(hidden, weight, targets, bias, class_weight, lse2, coef, opts: Options, plan: Plan, need_dx, need_dw,
             need_db, shard=None, common=None, cfg=None, dw_dtype=None):
    """Recompute backward over blocks of the (N, V) plane, in the passes of ``plan``
    (``plan.plan_loss`` / ``plan_tokens``: ``backward_passes.plan_passes``). Per block:
    da in the input dtype, then grad_hidden[rows] (+)= da @ weight[cols] and
    grad_weight[cols] (+)= da^T @ hidden[rows], each product's K reduction in one fp32 accumulator;
    sums across blocks go through an fp32 buffer unless the gradient is fp32 itself (16-bit: cuBLAS
    products into it). The grad_hidden accumulator may live in grad_weight's own memory
    (``BackwardPlan.borrowed``), or be grad_hidden itself with an int8 remainder, a compensated
    pair (``BackwardPlan.paired``, long context). Who runs each product: ``products``.
    ``coef`` (3, N) are the per-row coefficients of da and ``common`` an optional fp32 0-d factor
    shared by every row (losses.coefficients), applied to the products in fp32 (the Triton matmul's
    epilogue, or the fp32 accumulator's final rounding) rather than rounded into da, where it would
    repeat one rounding error on every row (``products.product``); fp16's da also carries a
    power-of-two lift out of the subnormals, undone there. With a vocabulary ``shard`` the partial
    grad_hidden is summed over its group in fp32 (every rank gets the full grad_hidden); grad_weight
    and grad_bias are the shard's own.
    ``cfg``: the dlogits kernel's tiles, else the table's or, with autotuning on, the fastest for
    this shape (``autotune.choose``). ``dw_dtype`` float32 (an fp32 master weight, ``weight`` its
    16-bit copy): grad_weight is fp32, and the products sum into it directly, never rounded to 16
    bits (a grad_weight summed over token blocks needs no other V x H buffer).
    Returns (grad_hidden, grad_weight, grad_bias), None where not needed."""
    n, h = hidden.shape
    v = weight.shape[0]
    needs = (need_dx, need_dw, need_db)
    if cfg is None:
        cfg = autotune.choose("dlogits", hidden, v, lambda c: backward(
            hidden, weight, targets, bias, class_weight, lse2, coef, opts, plan, *needs, shard, common, cfg=c,
            dw_dtype=dw_dtype),
            opts.chunk_bytes, shard, variant=tuning_variant(hidden, weight, bias, class_weight, opts, *needs))
    passes, borrowed = plan.passes, plan.borrowed
    coef, g = _allocate(hidden, weight, coef, class_weight, opts, passes, needs, borrowed, shard, common, dw_dtype)
    dlogits_of = _Dlogits(hidden, weight, targets, bias, class_weight, lse2, coef, opts, shard, cfg)
    if borrowed:
        _borrowed_pass(dlogits_of, g, hidden, weight, passes[0].cols, need_db, shard)
    else:
        if n > 0:
            _block_passes(dlogits_of, g, hidden, weight, passes, needs, shard)
        if g.dx_hosted is None:  # else done in the pass, with its spent da block
            g.finish_grad_hidden(shard)
    g.finish_grad_weight()
    grad_bias = g.db_acc.to(hidden.dtype) if need_db else None
    return g.grad_hidden, g.grad_weight, grad_bias
