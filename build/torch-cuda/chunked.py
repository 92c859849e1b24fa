"""The chunked path: the gradients are computed in the forward, three products instead of four.

For "mean" and "sum" the upstream gradient is one scalar g, so the logits' gradient is known up to
g as soon as a row's log-sum-exp is. Per chunk of rows (``plan.Plan.rows``):

1. the sweep (``lse_sweep_kernel``, one tile per split, STORE_E) computes each logit tile once in
   fp32 and writes ``exp(z - m_tile)`` into the chunk's (R, V) buffer, with the per-tile statistics
   (in the memory of the chunk's rows of grad_hidden where they fit: nothing else is extra);
2. the merge gives the rows' lse (merged across ranks for a vocabulary shard);
3. ``softmax_gradient_kernel`` turns the buffer into da in place (the input dtype);
4. grad_hidden[rows] = da @ weight and grad_weight (+)= da^T @ hidden[rows], fp32 accumulation
   (``products``). The common factor (1 / sum of target weights for "mean") is not in da: the
   products apply it in fp32 before their one rounding (fp16 with the power of two that keeps da
   out of the subnormals). The target coefficient B (1 - eps, a class weight) leaves da as on the
   recompute path (``losses.normalize``).

The backward then only multiplies by g (exact when g is a power of two, as 1 is). With more than one
chunk, a bf16 grad_weight is summed across them as a compensated pair, itself and an int8 V x H
remainder (``products.compensated``: ~16 bits of the running sum, V x H bytes where an fp32 buffer
took 4; "auto" at long context: a 4-bit remainder, V x H / 2 bytes, ~12 bits, ``plan.LONG_CONTEXT``);
an fp32 one (fp16's unit gradients, an fp32 master weight) is its own accumulator, and
a master weight's with bf16 products is summed unscaled by cuBLAS and scaled once at the end. The
logits are never rounded before the softmax.

grad_weight's memory holds nothing before the first chunk's product: where N fits there (N elements
of the input dtype in a row of grad_weight) the whole call is one chunk class-major in it
(``plan.HOSTED``); where N does not, the first chunk is that many rows, hosted the same way, and
the rest follow in chunks of the budget's rows (``plan.Plan.head_rows``: fewer chunks, each of which
sums into grad_weight once more).

The rounding of da (``softmax_gradient_kernel``): the sweep leaves, for every element of a chunk of
rows, ``e = exp(z - m_tile)`` rounded to the buffer's dtype, where
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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import autotune, configs, device, losses, pairs, parallel, products, sweep
from .logits import label_terms, softcap_grad, store_dlogits
from .plan import HOSTED, LONG_CONTEXT, Plan
from .sweep import RowStats
from .validate import Options


def unit_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the chunked path keeps its gradients in until the backward (see ``forward``)."""
    return torch.float32 if dtype == torch.float16 else dtype


def weight_grad_dtype(hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the chunked path's weight gradient: fp32 for an fp32 master weight
    (``validate.is_master_weight``), else ``unit_dtype``."""
    return torch.float32 if weight_dtype == torch.float32 else unit_dtype(hidden_dtype)


def forward(hidden, weight, targets, bias, class_weight, opts: Options, plan: Plan, need_dx, need_dw, need_db,
            shard=None, divisor=None, cfg=None, dw_dtype=None):
    """Returns (RowStats of all rows, grad_hidden, grad_weight, grad_bias) with the gradients for an
    upstream gradient of 1 (of the loss over ``divisor`` when given), None where not needed, in
    ``unit_dtype(hidden.dtype)`` (the bias's in fp32), in the chunks of ``plan`` (CHUNKED, HOSTED or
    LONG_CONTEXT: ``plan.plan_loss``). ``cfg``: the sweep's and the gradient kernel's tiles, else
    the table's (which the plan's chunks are cut in) or, with autotuning on, the fastest for this
    shape in the plan's chunks.
    ``dw_dtype`` float32 (an fp32 master weight, ``weight`` its 16-bit copy): grad_weight is fp32,
    and every chunk's product adds to it directly, with no other V x H buffer."""
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, where = hidden.dtype, hidden.device
    needs = (need_dx, need_dw, need_db)
    if n == 0:
        return _no_rows(hidden, weight, targets, bias, class_weight, opts, shard, needs, dw_dtype)
    if cfg is None:
        cfg = autotune.choose("chunked", hidden, v, lambda c: forward(
            hidden, weight, targets, bias, class_weight, opts, plan, need_dx, need_dw, need_db, shard, divisor,
            cfg=c, dw_dtype=dw_dtype),
            plan.budget, shard, variant=sweep.tuning_variant(hidden, weight, bias, class_weight, opts, *needs))
        cfg = configs.chunked_epilogue(cfg, opts.softcap is not None, bias is not None)
    # One chunk of all rows in grad_weight's own memory (HOSTED), or a first chunk there (a head).
    slab = plan.slab_rows if plan.mode == HOSTED else None
    head = (plan.head_rows, plan.slab_rows) if plan.head_rows else None
    spans = chunk_spans(n, plan.rows, plan.head_rows or None)
    weights = losses.target_weights(targets, class_weight, opts.ignore_index, v, shard)
    one = torch.ones((), device=where)
    g_ce, g_z, common = losses.upstream(one if divisor is None else one / divisor, None, weights, opts)
    g = _allocate(hidden, v, plan, weight_grad_dtype(dtype, dw_dtype or dtype), len(spans), needs, shard)
    all_rows_b = losses.largest_b(g_ce, targets, weights, opts) if g.deferred_dw else None

    # e = exp(z - m_tile) in (0, 1], in the input dtype (fp16: below 6e-5 of the tile max it is
    # subnormal, an absolute error under 3e-8 of the tile's largest entry). Hosted: class-major in
    # grad_weight's memory, class v's N entries in the first bytes of grad_weight's row v.
    # A hosted head likewise, its slabs of grad_weight in the memory of the buffer of the later chunks.
    buffer = head_buffer(g.grad_weight, dtype, n) if slab is not None else device.new((plan.rows, v), dtype, where)
    head_slabs = None
    if head is not None:
        dw_type = g.grad_weight.dtype
        head_slabs = buffer.view(-1)[: head[1] * h * dw_type.itemsize // dtype.itemsize].view(dw_type).view(-1, h)
    n_row_blocks = triton.cdiv(max(r for _, r in spans), cfg.block_n)
    dbias = device.new((n_row_blocks, v), torch.float32, where) if need_db else None
    parts = []
    for row0, r in spans:
        sl = slice(row0, row0 + r)
        in_head = head is not None and row0 == 0
        e = head_buffer(g.grad_weight, dtype, r) if in_head else buffer[:r]
        # The per-tile statistics (2 x T x R fp32 for the loss, T = V / 256 tiles: 16 MiB at S4's
        # 4096-row chunk) in the memory of the chunk's rows of grad_hidden where they fit (T <= H / 4
        # for bf16): its product writes them only after the gradient kernel has read the statistics.
        scratch = g.dx_acc[sl] if need_dx else None
        stats, tile_stats = sweep.sweep(hidden[sl], weight, targets[sl], bias, class_weight, opts, shard, e, cfg,
                                        scratch)
        parts.append(stats)
        coef = losses.row_coefficients(g_ce, g_z, None, stats.lse, targets[sl], losses.rows(weights, row0, row0 + r),
                                       opts)
        # B (1 - eps, a class weight) leaves da as on the recompute path: the products apply the
        # factor in their epilogue, one rounding.
        coef, chunk_common = losses.normalize(coef, common, all_rows_b)
        chunk_unscale = chunk_common.reshape(1)
        if dtype == torch.float16:  # da scaled out of fp16's subnormals; the products undo it in fp32
            coef, chunk_unscale = losses.lift_fp16(coef, chunk_unscale, class_weight, opts.kernel_scales().grad_scale)
        da = gradient_in_place(e, tile_stats, stats, coef, targets[sl], class_weight, dbias, opts, shard, cfg)
        # Spent: where they did not fit in grad_hidden the next chunk's sweep would allocate its own
        # while these are still held, twice the statistics at the peak.
        del tile_stats
        if need_dx:  # split in two K halves where that fills the GPU's waves (``gemm.split_k``) and
            # its fp32 (R, H) buffer is at most 1/16 of the chunk's (R, V) one
            products.product(da, weight, g.dx_acc[sl], False, chunk_unscale, may_split=32 * h <= v)
        if need_dw:
            g.add_weight_grad(da, hidden[sl], row0, chunk_unscale, slab or (head[1] if in_head else None), head_slabs)
        if need_db:
            products.add_bias_sums(g.db_acc, dbias, r, cfg.block_n, chunk_unscale)
    return (RowStats.cat(parts), *g.finish(chunk_unscale, shard))


def _no_rows(hidden, weight, targets, bias, class_weight, opts: Options, shard, needs, dw_dtype):
    """``forward`` of no rows: the sweep's empty statistics and zero gradients."""
    n, h = hidden.shape
    v = weight.shape[0]
    need_dx, need_dw, need_db = needs
    stats = sweep.sweep(hidden, weight, targets, bias, class_weight, opts, shard)[0]
    out = dict(dtype=unit_dtype(hidden.dtype), device=hidden.device)
    dw_zeros = torch.zeros((v, h), dtype=dw_dtype or out["dtype"], device=hidden.device) if need_dw else None
    zeros = (torch.zeros((0, h), **out) if need_dx else None, dw_zeros,
             torch.zeros((v,), dtype=torch.float32, device=hidden.device) if need_db else None)
    return (stats, *zeros)


@dataclass
class _Sums:
    """The chunked path's gradients and where the chunks sum them: ``dx_acc`` (grad_hidden, or its
    fp32 sum over a vocabulary shard's ranks), grad_weight (with ``dw_lo``, the remainder of a 16-bit
    one summed as a pair; ``deferred_dw``: an fp32 master weight's summed unscaled), the bias's fp32
    sums ``db_acc``."""

    grad_hidden: torch.Tensor | None
    dx_acc: torch.Tensor | None
    grad_weight: torch.Tensor | None
    dw_lo: torch.Tensor | None
    deferred_dw: bool
    db_acc: torch.Tensor | None

    def add_weight_grad(self, da, hidden_rows, row0: int, unscale, hosted_slab, head_slabs) -> None:
        """A chunk's dW into grad_weight: hosted (da in grad_weight's memory, ``hosted_slab`` rows a
        slab), unscaled into the fp32 sum (``deferred_dw``), into the pair, or rounded once."""
        if hosted_slab is not None:
            # the first (or only) chunk's dW: unscaled when summed unscaled (``deferred_dw``)
            hosted_weight_grad(da, hidden_rows, self.grad_weight, hosted_slab, None if self.deferred_dw else unscale,
                               self.dw_lo, head_slabs)
        elif self.deferred_dw:
            products.accumulate(da.t(), hidden_rows, self.grad_weight, row0 == 0)
        elif self.dw_lo is not None:
            products.compensated(da.t(), hidden_rows, self.grad_weight, self.dw_lo, row0 > 0, unscale)
        else:
            products.product(da.t(), hidden_rows, self.grad_weight, row0 > 0, unscale)

    def finish(self, unscale, shard) -> tuple:
        """(grad_hidden, grad_weight, grad_bias) once every chunk is in: the deferred factor applied
        (``unscale``, every chunk's), grad_hidden summed over the shard's ranks."""
        if self.deferred_dw:  # the factor every chunk shares, once, in place
            products.scale(self.grad_weight, unscale, out=self.grad_weight)
        if self.grad_hidden is not None and shard is not None:
            parallel.all_reduce(self.dx_acc, shard)
            if self.dx_acc is not self.grad_hidden:
                self.grad_hidden.copy_(self.dx_acc)
        return self.grad_hidden, self.grad_weight, self.db_acc  # the bias's (V,) fp32: rounded in the backward


def _allocate(hidden, v: int, plan: Plan, dw_type, n_chunks: int, needs, shard) -> _Sums:
    """The gradients of ``forward`` (``_Sums``), grad_weight in ``dw_type`` (``weight_grad_dtype``)."""
    n, h = hidden.shape
    dtype, where = hidden.dtype, hidden.device
    need_dx, need_dw, need_db = needs
    # The unit gradients are kept in the input dtype, except for fp16: its gradients are often
    # subnormal (a mean over many rows) and the backward's multiplication by g would round them a
    # second time there, so fp16 keeps them in fp32 until the backward.
    out_dtype = unit_dtype(dtype)
    grad_hidden = device.new((n, h), out_dtype, where) if need_dx else None
    dx_acc = grad_hidden
    if need_dx and shard is not None and out_dtype != torch.float32:
        dx_acc = device.new((n, h), torch.float32, where)  # summed over ranks in fp32
    # An fp32 master weight's gradient is its own accumulator. With bf16 products every chunk's dW
    # is summed into it unscaled (``products.accumulate``: cuBLAS with an fp32 result and beta = 1,
    # H200, S4's 1792-row chunk: 3.32 ms against 3.61 for the Triton matmul's fp32 epilogue and 2.79
    # for cuBLAS into bf16) and the common factor applied once at the end, so the factor must be
    # every chunk's: B's divisor comes from all rows (``losses.largest_b``). fp16's lift out of the
    # subnormals is per chunk: its products apply each chunk's factor (``products.product``).
    deferred_dw = need_dw and dw_type == torch.float32 and dtype == torch.bfloat16 and n_chunks > 1
    grad_weight = device.new((v, h), dw_type, where) if need_dw else None
    dw_lo = None
    if need_dw and dw_type != torch.float32 and n_chunks > 1:  # a pair (fp16 and fp32: an fp32 grad_weight)
        # an int8 remainder, or at long context a 4-bit one (half the bytes)
        dw_lo = pairs.compensation_buffer(grad_weight, torch.uint8 if plan.mode == LONG_CONTEXT else torch.int8)
    db_acc = torch.zeros((v,), dtype=torch.float32, device=where) if need_db else None
    return _Sums(grad_hidden, dx_acc, grad_weight, dw_lo, deferred_dw, db_acc)


def chunk_spans(n: int, rows: int, head: int | None = None) -> list[tuple[int, int]]:
    """The chunks (first row, rows): ``head`` rows first when given (``plan.hosted_head``), then
    ``rows`` at a time, the last one ragged."""
    start = head or 0
    return ([(0, head)] if head else []) + [(row0, min(rows, n - row0)) for row0 in range(start, n, rows)]


def head_buffer(grad_weight, dtype: torch.dtype, rows: int):
    """The hosted head's (rows, V) buffer: class-major in grad_weight's memory, class v in the first
    ``rows`` entries of ``dtype`` of row v."""
    return grad_weight.view(dtype)[:, :rows].t()


def hosted_weight_grad(da, hidden, grad_weight, slab: int, unscale, lo=None, out=None) -> None:
    """grad_weight = (da^T @ hidden) * unscale where da (R, V) is class-major in grad_weight's own
    memory (class v in the first bytes of row v): ``slab`` rows at a time into a slab-sized buffer
    (``out``, else allocated), each copied over the rows of da its product has just read. A slab's
    product cannot write its rows directly: they hold the da it reads. With ``lo`` (a bf16
    grad_weight summed over chunks as a pair, ``products.compensated``) the slab's pair is started:
    its hi in the buffer, its remainder straight into ``lo``'s rows. ``unscale`` None (an fp32
    grad_weight summed unscaled over chunks, ``products.accumulate``): the sum's first term, by the
    same cuBLAS product."""
    v = grad_weight.shape[0]
    if out is None:
        out = device.new((min(slab, v), grad_weight.shape[1]), grad_weight.dtype, grad_weight.device)
    for v0 in range(0, v, slab):
        rows = slice(v0, min(v, v0 + slab))
        part = out[: rows.stop - v0]
        if lo is not None:
            products.compensated(da.t()[rows], hidden, part, lo[rows], False, unscale)
        elif unscale is None:  # the unscaled fp32 sum's first term, as its later ones: cuBLAS
            products.accumulate(da.t()[rows], hidden, part, True)
        else:
            products.product(da.t()[rows], hidden, part, False, unscale)
        grad_weight[rows].copy_(part)


def gradient_in_place(e, tile_stats, stats: RowStats, coef, targets, class_weight, dbias, opts: Options, shard, cfg):
    """Turns a chunk's exponentials ``e`` (R, V) (the sweep's STORE_E, its per-split statistics
    ``tile_stats`` and RowStats ``stats``) into da in place with the per-row coefficients ``coef``
    ((3, R), or (5, R) with the per-token entropy term), and the bias partial sums into ``dbias``
    when given; returns da (``e`` itself)."""
    r, v = e.shape
    _, _, softcap_out, grad_scale = opts.kernel_scales()
    entropy_grad = losses.entropy_term(coef)
    block_n, warps = gradient_rows(cfg, entropy_grad), gradient_warps(cfg, entropy_grad)
    cols = gradient_cols(cfg)
    softmax_gradient_kernel[(triton.cdiv(r, block_n), triton.cdiv(v, cols))](
        e, e, tile_stats, stats.lse2, coef, stats.z_target, targets,
        class_weight if class_weight is not None else coef, dbias if dbias is not None else coef,
        0, r, v, r, e.stride(0), e.stride(1), targets.stride(0), grad_scale, softcap_out,
        shard.offset if shard is not None else 0,
        HAS_SOFTCAP=opts.softcap is not None, SMOOTHING=opts.label_smoothing > 0, ENTROPY_GRAD=entropy_grad,
        HAS_CLASS_WEIGHT=class_weight is not None, BIAS_GRAD=dbias is not None,
        BLOCK_N=block_n, BLOCK_V=cols, STATS_V=cfg.block_v, BF16_EMULATION=device.bf16_emulation(e.dtype),
        num_warps=warps,
    )
    return e


# The gradient kernel's programs (H200, bf16, S1's 8192 x 128256 chunk alone, 128-wide vocabulary
# tiles; benchmarks/results/chunk_kernels/): without the entropy gradient 128 rows and
# 4 warps take 2.18 ms (8 warps 2.55, the copy of the chunk 0.98; 1-2 warps on 32-64 rows 2.13-2.23);
# with it 128 rows spill into 6.26 ms at 8 warps and 3.76 at 4, where 32 rows with 8 warps take 3.21.
# A class-major buffer (hosted in grad_weight) takes the same programs: of five measured on 4096 x
# 128256 bf16, 128 rows and 4 warps were the fastest there too (0.65 ms; 64 x 8 0.73, 128 x 8 0.93,
# 32 x 8 1.02, 64 x 16 1.44; benchmarks/results/hosted/v29b/), 216 registers and no stack offline.
def gradient_rows(cfg, entropy_grad: bool) -> int:
    """Rows of a ``softmax_gradient_kernel`` program, and of its bias partial sums (``dbias``): the
    sweep's row block, a quarter of it with the entropy gradient."""
    return max(1, cfg.block_n // 4) if entropy_grad else cfg.block_n


def gradient_cols(cfg) -> int:
    """Vocabulary columns of a ``softmax_gradient_kernel`` program: the sweep's tile width up to 128,
    a divisor of it, so that each program's columns lie in one sweep tile (one tile max a row)."""
    cols = min(cfg.block_v, 128)
    assert cfg.block_v % cols == 0, cfg
    return cols


def gradient_warps(cfg, entropy_grad: bool) -> int:
    """Warps of a ``softmax_gradient_kernel`` program: 4, 8 with the entropy gradient."""
    if device.interpreted():
        return 1
    return 8 if entropy_grad else 4


@triton.jit
def softmax_gradient_kernel(
    e_ptr,  # (R, V) in: exp(z - m_tile) [* softcap'(z)], the input dtype
    da_ptr,  # (R, V) out, the input dtype; the same memory as e_ptr (in place), the same strides
    tile_max_ptr,  # (T, R) fp32: each tile's row max m_tile (plane 0 of the sweep's statistics)
    lse_ptr,  # (2, N) fp32: row max m and log-sum (rows row0 .. row0 + R of them)
    coef_ptr,  # (3, R) fp32: A, B, C of the chunk's rows; (5, R) with ENTROPY_GRAD: also E and S
    z_target_ptr,  # (N,) fp32: the target logit (0 when another shard holds it, NaN out of range)
    targets_ptr,  # (N,) int32/int64
    class_weight_ptr,  # (V,) fp32 when HAS_CLASS_WEIGHT, else dummy
    dbias_ptr,  # (cdiv(R, BLOCK_N), V) fp32 out: per-row-block column sums of da, when BIAS_GRAD
    row0,
    R,
    V,
    N,
    stride_e,  # the buffer's row stride
    stride_ev,  # its class stride: 1 (for a class-major buffer the row stride is the 1)
    stride_t,
    grad_scale,  # the chain's factor dz -> da (Options.kernel_scales)
    softcap_out,  # the tanh's output scale (Options.kernel_scales)
    vocab_offset,
    HAS_SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    STATS_V: tl.constexpr,  # the sweep's tile width, a multiple of BLOCK_V: tile_max's granularity
    BF16_EMULATION: tl.constexpr,
):
    """Grid (cdiv(R, BLOCK_N), cdiv(V, BLOCK_V)): each program's columns lie in one of the sweep's
    tiles, so one m_tile per row.
    Memory-bound: reads and writes the chunk once. No atomics.

    ENTROPY_GRAD (per-token outputs, never with a softcap, whose derivative ``e`` then carries): the
    term ``- E p (z - S)`` takes z back from the buffer as ``m_tile + log(e)``, which is within
    one rounding of ``e`` (2^-9 absolute in bf16) of the true logit."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    local_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = local_n < R
    local = tl.where(mask_n, local_n, 0)
    rows = row0 + local
    offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    mask = mask_n[:, None] & mask_v[None, :]

    # From the unclamped rows (the mask covers those past R): a class-major buffer's rows are then
    # known to be contiguous, and its loads and stores coalesce (through the clamped ones, 5x slower
    # on the H200: 3.0 against 0.63 ms for 4096 x 128256 bf16).
    offsets = local_n[:, None] * stride_e + offs_v[None, :] * stride_ev
    e = tl.load(e_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m_tile = tl.load(tile_max_ptr + (pid_v // (STATS_V // BLOCK_V)).to(tl.int64) * R + local)
    row_max = tl.load(lse_ptr + rows)
    log_sum = tl.load(lse_ptr + N + rows)
    coef_a = tl.load(coef_ptr + local)
    coef_b = tl.load(coef_ptr + R + local)
    target = tl.load(targets_ptr + rows * stride_t).to(tl.int64)
    z_t = tl.load(z_target_ptr + rows)

    factor = tl.exp((m_tile - row_max) - log_sum)
    # A row whose A is 0 (an ignored row) gets 0 whatever its e holds: the sweep leaves e unwritten
    # where a whole row block is ignored (SKIP_IGNORED). The load is not skipped there: a branch
    # around it halves this kernel's rate.
    p_t = tl.exp((z_t - row_max) - log_sum)
    if ENTROPY_GRAD:
        coef_e = tl.load(coef_ptr + 3 * R + local)
        s_row = tl.load(coef_ptr + 4 * R + local)
        z = m_tile[:, None] + tl.log(tl.where(e > 0.0, e, 1.0))
        a = coef_a[:, None] - coef_e[:, None] * (z - s_row[:, None])
        dead = ((coef_a == 0.0) & (coef_e == 0.0))[:, None] | (e == 0.0)
        d = tl.where(dead, 0.0, (a * factor[:, None]) * e)
        d_t = (coef_a - coef_e * (z_t - s_row)) * p_t - coef_b
    else:
        d = tl.where(coef_a[:, None] == 0.0, 0.0, (coef_a * factor)[:, None] * e)
        d_t = coef_a * p_t - coef_b
    # The target entry, exactly: (A p_t - B) softcap'(z_t), p_t from the fp32 target logit.
    if HAS_SOFTCAP:
        d_t = d_t * softcap_grad(z_t, softcap_out)
    is_target = offs_v[None, :] + vocab_offset == target[:, None]
    d = tl.where(is_target, d_t[:, None], d)
    # Smoothing never comes with a softcap on this path (the host routes that to the recompute path).
    d = label_terms(d, coef_b, coef_ptr + 2 * R + local, class_weight_ptr, offs_v, mask_v, SMOOTHING, HAS_CLASS_WEIGHT)
    d = d * grad_scale
    store_dlogits(d, da_ptr + offsets, mask, mask_v,
                  dbias_ptr + pid_n.to(tl.int64) * V + offs_v, BIAS_GRAD, BF16_EMULATION)
