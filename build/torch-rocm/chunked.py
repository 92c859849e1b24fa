"""The chunked path: the gradients are computed in the forward, three products instead of four.

For "mean" and "sum" the upstream gradient is one scalar g, so the logits' gradient is known up to
g as soon as a row's log-sum-exp is. Per chunk of rows (``plan.chunk_rows``):

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
took 4; "auto" at long context: a 4-bit remainder, V x H / 2 bytes, ~12 bits, ``long_context_budget``);
an fp32 one (fp16's unit gradients, an fp32 master weight) is its own accumulator, and
a master weight's with bf16 products is summed unscaled by cuBLAS and scaled once at the end. The
logits are never rounded before the softmax.

grad_weight's memory holds nothing before the first chunk's product: where N fits there (N elements
of the input dtype in a row of grad_weight) the whole call is one chunk class-major in it
(``hosted_slab_rows``); where N does not, the first chunk is that many rows, hosted the same way, and
the rest follow in chunks of the budget's rows (``plan.hosted_head``: fewer chunks, each of which
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

import torch
import triton
import triton.language as tl

from . import autotune, configs, device, losses, pairs, parallel, plan, products, sweep
from .logits import label_terms, softcap_grad, store_dlogits
from .sweep import RowStats
from .validate import Options, chunked_unsupported


def use(opts: Options, n: int, v: int, h: int, dtype: torch.dtype, needs, master: bool = False,
        sharded: bool = False, where: torch.device | None = None) -> bool:
    """Whether this call takes the chunked path: only when a gradient is wanted; always with
    strategy="chunked" (validated), never with "recompute"; with "auto" when the options allow it
    and either the whole (N, V) buffer fits in ``chunk_bytes`` (one chunk, no fp32 accumulator), or
    the weight is an fp32 master weight (``master``: its fp32 gradient is the accumulator, so any
    number of chunks costs only the chunk's buffer), or the call is long context
    (``long_context_budget``). ``sharded``: a vocabulary shard (``process_group``); ``where``: the
    device (its family's tiles, ``configs.tables``)."""
    if not any(needs) or opts.strategy == "recompute":
        return False
    if opts.strategy == "chunked":
        return True
    if chunked_unsupported(opts) is not None:
        return False
    return (master or whole_fits(opts, n, v, dtype)
            or hosted_slab_rows(opts, n, v, h, dtype, needs[1], master) is not None
            or long_context_budget(opts, n, v, h, dtype, needs, master, sharded, where) is not None)


def whole_fits(opts: Options, n: int, v: int, dtype: torch.dtype) -> bool:
    """Whether the whole (N, V) buffer fits in ``chunk_bytes`` beside the gradients (one chunk)."""
    return n * v * dtype.itemsize <= plan.chunk_budget(opts.chunk_bytes, chunked=True)


def hosted_slab_rows(opts: Options, n: int, v: int, h: int, dtype: torch.dtype, need_dw: bool,
                     master: bool) -> int | None:
    """The slab rows (``plan.hosted_slab_rows``) when this call runs in one chunk whose (N, V) buffer
    lives in grad_weight's memory: grad_weight is wanted, the whole buffer does not fit in
    ``chunk_bytes`` beside it, and N elements of the input dtype fit in a row of grad_weight
    (``weight_grad_dtype``; ``master``: an fp32 master weight). Else None."""
    if not need_dw or whole_fits(opts, n, v, dtype):
        return None
    dw_dtype = torch.float32 if master else unit_dtype(dtype)
    return plan.hosted_slab_rows(n, v, h, dtype, dw_dtype, opts.chunk_bytes)


def long_context_budget(opts: Options, n: int, v: int, h: int, dtype: torch.dtype, needs, master: bool,
                        sharded: bool, where: torch.device | None = None) -> int | None:
    """The chunk budget when "auto" takes the chunked path for long context, else None: bf16 (not
    an fp32 master weight, not a vocabulary shard), options the chunked path takes, more than one
    chunk, and a shape at which the recompute path's default would hold no fp32 accumulator
    (``plan.plan_passes`` at the default budget gives the paired plan or two passes: V < 2N and N x H
    past the hosted plan's budget, as at 65536 x 4096 x 128256). There the chunked path sums
    grad_weight across chunks as a bf16 + 4-bit pair and takes chunks of rows in the rest of
    ``chunk_bytes`` (default DEFAULT_PAIRED_BYTES, the paired plan's 512 MiB;
    ``plan.lean_chunk_bytes``, None where fewer than 1024 rows fit: then the recompute path within
    ``chunk_bytes``): three products instead of four, and faster with more memory (H200, S4: 404 ms
    in 512 MiB, 349 in 1.25 GiB, where the recompute path's exact fp32 accumulator took 442 in 1 GiB;
    README)."""
    if (opts.strategy != "auto" or dtype != torch.bfloat16 or master or sharded
            or chunked_unsupported(opts) is not None
            or whole_fits(opts, n, v, dtype)):
        return None
    need_dx, need_dw, need_db = needs
    cfg = configs.dlogits_config(dtype, h=h, where=where)
    passes = plan.plan_passes(n, v, h, dtype, None, cfg.block_n, cfg.block_v, need_dx or need_db, need_dw,
                              may_pair=True)
    if len(passes) == 1 and not passes[0].paired:
        return None
    return plan.lean_chunk_bytes(v, h, dtype, opts.chunk_bytes)


def unit_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the chunked path keeps its gradients in until the backward (see ``forward``)."""
    return torch.float32 if dtype == torch.float16 else dtype


def weight_grad_dtype(hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the chunked path's weight gradient: fp32 for an fp32 master weight
    (``validate.is_master_weight``), else ``unit_dtype``."""
    return torch.float32 if weight_dtype == torch.float32 else unit_dtype(hidden_dtype)


def forward(hidden, weight, targets, bias, class_weight, opts: Options, need_dx, need_dw, need_db,
            shard=None, divisor=None, cfg=None, dw_dtype=None):
    """Returns (RowStats of all rows, grad_hidden, grad_weight, grad_bias) with the gradients for an
    upstream gradient of 1 (of the loss over ``divisor`` when given), None where not needed, in
    ``unit_dtype(hidden.dtype)`` (the bias's in fp32). ``cfg``: the sweep's and the gradient
    kernel's tiles, else the table's or, with autotuning on, the fastest for this shape.
    ``dw_dtype`` float32 (an fp32 master weight, ``weight`` its 16-bit copy): grad_weight is fp32,
    and every chunk's product adds to it directly, with no other V x H buffer."""
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, where = hidden.dtype, hidden.device
    if n == 0:
        stats = sweep.sweep(hidden, weight, targets, bias, class_weight, opts, shard)[0]
        out = dict(dtype=unit_dtype(dtype), device=where)
        dw_zeros = torch.zeros((v, h), dtype=dw_dtype or out["dtype"], device=where) if need_dw else None
        zeros = (torch.zeros((0, h), **out) if need_dx else None, dw_zeros,
                 torch.zeros((v,), dtype=torch.float32, device=where) if need_db else None)
        return (stats, *zeros)
    master = dw_dtype == torch.float32 and dtype != torch.float32
    lean = long_context_budget(opts, n, v, h, dtype, (need_dx, need_dw, need_db), master, shard is not None, where)
    # One chunk of all rows in grad_weight's own memory where it fits there (``hosted_slab_rows``).
    slab = None if lean is not None else hosted_slab_rows(opts, n, v, h, dtype, need_dw, master)
    budget = opts.chunk_bytes if lean is None else lean
    if budget is None and master and slab is None:
        budget = plan.DEFAULT_MASTER_BYTES
    if cfg is None:
        cfg = autotune.choose("chunked", hidden, v, lambda c: forward(
            hidden, weight, targets, bias, class_weight, opts, need_dx, need_dw, need_db, shard, divisor, cfg=c,
            dw_dtype=dw_dtype),
            budget, shard,
            variant=sweep.tuning_variant(hidden, weight, bias, class_weight, opts, need_dx, need_dw, need_db))
        cfg = configs.chunked_epilogue(cfg, opts.softcap is not None, bias is not None)
    rows = n if slab is not None else plan.chunk_rows(n, v, dtype, budget, cfg.block_n)
    dw_type = weight_grad_dtype(dtype, dw_dtype or dtype)  # grad_weight's
    # Several chunks: the first one larger, in grad_weight's own memory (``plan.hosted_head``).
    head = (plan.hosted_head(n, v, h, dtype, dw_type, rows, cfg.block_n)
            if slab is None and need_dw and rows < n else None)
    spans = chunk_spans(n, rows, head[0] if head is not None else None)
    n_chunks = len(spans)
    weights = losses.target_weights(targets, class_weight, opts.ignore_index, v, shard)
    one = torch.ones((), device=where)
    g_ce, g_z, common = losses.upstream(one if divisor is None else one / divisor, None, weights, opts)

    # The unit gradients are kept in the input dtype, except for fp16: its gradients are often
    # subnormal (a mean over many rows) and the backward's multiplication by g would round them a
    # second time there, so fp16 keeps them in fp32 until the backward.
    out_dtype = unit_dtype(dtype)
    grad_hidden = device.new((n, h), out_dtype, where) if need_dx else None
    dx_acc = grad_hidden
    if need_dx and shard is not None and out_dtype != torch.float32:
        dx_acc = device.new((n, h), torch.float32, where)  # summed over ranks in fp32
    grad_weight = None
    dw_lo = None
    # An fp32 master weight's gradient is its own accumulator. With bf16 products every chunk's dW
    # is summed into it unscaled (``products.accumulate``: cuBLAS with an fp32 result and beta = 1,
    # H200, S4's 1792-row chunk: 3.32 ms against 3.61 for the Triton matmul's fp32 epilogue and 2.79
    # for cuBLAS into bf16) and the common factor applied once at the end, so the factor must be
    # every chunk's: B's divisor comes from all rows (``losses.largest_b``). fp16's lift out of the
    # subnormals is per chunk: its products apply each chunk's factor (``products.product``).
    deferred_dw = need_dw and dw_type == torch.float32 and dtype == torch.bfloat16 and n_chunks > 1
    all_rows_b = losses.largest_b(g_ce, targets, weights, opts) if deferred_dw else None
    if need_dw:
        grad_weight = device.new((v, h), dw_type, where)
    if need_dw and dw_type != torch.float32:
        if n_chunks > 1:  # a pair (fp16 and fp32: an fp32 grad_weight already)
            # an int8 remainder, or at long context by default a 4-bit one (half the bytes)
            dw_lo = pairs.compensation_buffer(grad_weight, torch.int8 if lean is None else torch.uint8)
    db_acc = torch.zeros((v,), dtype=torch.float32, device=where) if need_db else None

    # e = exp(z - m_tile) in (0, 1], in the input dtype (fp16: below 6e-5 of the tile max it is
    # subnormal, an absolute error under 3e-8 of the tile's largest entry). Hosted: class-major in
    # grad_weight's memory, class v's N entries in the first bytes of grad_weight's row v.
    # A hosted head likewise, its slabs of grad_weight in the memory of the buffer of the later chunks.
    if slab is not None:
        buffer = head_buffer(grad_weight, dtype, n)
    else:
        buffer = device.new((rows, v), dtype, where)
    head_slabs = None
    if head is not None:
        head_slabs = buffer.view(-1)[: head[1] * h * dw_type.itemsize // dtype.itemsize].view(dw_type).view(-1, h)
    n_row_blocks = triton.cdiv(max(r for _, r in spans), cfg.block_n)
    dbias = device.new((n_row_blocks, v), torch.float32, where) if need_db else None
    parts = []
    for row0, r in spans:
        sl = slice(row0, row0 + r)
        in_head = head is not None and row0 == 0
        e = head_buffer(grad_weight, dtype, r) if in_head else buffer[:r]
        # The per-tile statistics (2 x T x R fp32 for the loss, T = V / 256 tiles: 16 MiB at S4's
        # 4096-row chunk) in the memory of the chunk's rows of grad_hidden where they fit (T <= H / 4
        # for bf16): its product writes them only after the gradient kernel has read the statistics.
        scratch = dx_acc[sl] if need_dx else None
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
            products.product(da, weight, dx_acc[sl], False, chunk_unscale, may_split=32 * h <= v)
        if (slab is not None or in_head) and need_dw:
            # the first (or only) chunk's dW: unscaled when summed unscaled (``deferred_dw``)
            hosted_weight_grad(da, hidden[sl], grad_weight, slab or head[1], None if deferred_dw else chunk_unscale,
                               dw_lo, head_slabs)
        elif deferred_dw:
            products.accumulate(da.t(), hidden[sl], grad_weight, row0 == 0)
        elif need_dw and dw_lo is not None:
            products.compensated(da.t(), hidden[sl], grad_weight, dw_lo, row0 > 0, chunk_unscale)
        elif need_dw:
            products.product(da.t(), hidden[sl], grad_weight, row0 > 0, chunk_unscale)
        if need_db:
            products.add_bias_sums(db_acc, dbias, r, cfg.block_n, chunk_unscale)

    if deferred_dw:  # the factor every chunk shares, once, in place
        products.scale(grad_weight, chunk_unscale, out=grad_weight)
    if need_dx and shard is not None:
        parallel.all_reduce(dx_acc, shard)
        if dx_acc is not grad_hidden:
            grad_hidden.copy_(dx_acc)
    grad_bias = db_acc if need_db else None  # (V,) fp32: cheap, and rounded once, in the backward
    return RowStats.cat(parts), grad_hidden, grad_weight, grad_bias


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
    entropy_grad = coef.shape[0] > 3
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
