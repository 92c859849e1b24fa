"""Host side of ``fused_linear_divergence``: chunks of rows, their four (or six) products, the row
kernel between them, and the autograd.

Per chunk of R rows (``plan_chunks``), the student's and the teacher's products ``h @ W.T`` go into
two fp32 (R, V) buffers (cuBLAS with an fp32 output, ``products.accumulate``: fp32 accumulation,
never rounded to 16 bits); ``divergence_kernel`` turns them into the per-token values and, when a
gradient is formed, da in the input dtype. The gradient products run per group of M >= R rows:
grad_hidden[rows] = da @ W_s, grad_weight += da^T @ h_s[rows] (``weight_grad_dtype``), grad_bias +=
the column sums. Where M = R, da lies over the teacher buffer's own memory (a 16-bit da row in the
first half of the fp32 row's bytes); where the budget buys fewer groups with smaller chunks, da
goes to its own (M, V) buffer, filled by M / R chunks: a bf16 grad_weight summed over many groups
pays its compensated pair's epilogue (~0.8 ms a product at D1) once a group, not once a chunk.

Two strategies:

- "chunked" ("mean" / "sum": the upstream gradient is one scalar g): the forward forms da with unit
  coefficients (1 on counted rows) and runs all four products; the common factor (1 / count, or
  1 / num_items_in_batch) is applied in the products' fp32 epilogue; the backward only multiplies
  by g (``ops.scale_gradients``; the ops and autograd are ``divergence_ops.py``). A gradient
  reaching ``log_probs`` is added by a recompute backward of that term alone (its upstream is only
  known then): the student's logits and its two gradient products, three a chunk.
- "recompute" (any reduction, "none" always): the forward runs two products a chunk and keeps three
  fp32 statistics a row (lse_s, lse_t, sum_v p_s g); the backward recomputes each chunk's logits and
  forms da in one pass with each row's upstream folded in: six products in all. The per-row
  coefficients are divided by a power of two near their largest (``_lift``) so that fp16's da stays
  out of its subnormals; the products multiply it back in fp32 (exact).

The teacher gets no gradient and no work beyond its logits. Uncounted rows (``mask`` False, target
``ignore_index``) read nothing in the row kernel and get zeros.
"""

import math
from dataclasses import dataclass

import torch
import triton

from . import device, gemm, pairs, products
from .divergence_kernel import divergence_row_kernel
from .validate import Options

# The memory knob's default: one chunk's two fp32 (R, V) logit buffers and the (M, V) da of its
# group (R x V x 8 + M x V x da's bytes; ``plan_chunks``). With bf16 grad_weight's 4-bit remainder
# (V x H_s / 2 bytes, ``REMAINDER``) 794 MiB at D1 (8192 x 2048 x 151936): 7 groups of 1184 rows.
DEFAULT_DIVERGENCE_BYTES = 640 << 20
# The remainder of a bf16 grad_weight summed over several groups (``products.compensated``): 4 bits
# (``pairs.compensation_buffer``: ~12 bits of each partial sum, against 2^-9 for the final bf16
# rounding), half the int8 remainder's V x H_s bytes, spent on da's rows instead.
REMAINDER = torch.uint8
# Row counts at least this large are rounded down to whole multiples of ROW_ALIGN (tile-friendly).
ROW_ALIGN = 16
# The rows of a chunk whose da goes to a buffer of its own (``plan_chunks``): on the GPU a chunk's
# logit products stream both weights once (2 x V x H bytes) for R x V x H products, so R sets their
# arithmetic intensity; on the interpreter, a few rows (several chunks a group at the tests' sizes).
GROUP_CHUNK_ROWS = 256
INTERPRETED_GROUP_CHUNK_ROWS = 8


@dataclass(frozen=True)
class Chunks:
    """How the rows go through the buffers: ``rows`` (R) a chunk of logits, ``group`` (M) the rows
    whose gradient products run together; ``own_da``: da in an (M, V) buffer of its own (M > R),
    else over the teacher's logit buffer (M = R)."""

    rows: int
    group: int

    @property
    def own_da(self) -> bool:
        return self.group > self.rows


@dataclass(frozen=True)
class Spec:
    """Everything besides the tensors, validated (``distill.py``)."""

    beta: float
    student: Options  # logit_scale, softcap, temperature of the student
    teacher: Options  # of the teacher
    reduction: str
    strategy: str  # "chunked" or "recompute", resolved
    chunk_bytes: int | None

    @property
    def mode(self) -> int:
        return 0 if self.beta == 0 else 1 if self.beta == 1 else 2


def _aligned(rows: int) -> int:
    return rows // ROW_ALIGN * ROW_ALIGN if rows >= ROW_ALIGN else rows


def chunk_rows(n: int, v: int, chunk_bytes: int | None) -> int:
    """Rows per chunk with da over the teacher's buffer: as many as two fp32 (R, V) buffers within
    ``chunk_bytes`` hold (default DEFAULT_DIVERGENCE_BYTES), at least 1, in multiples of ROW_ALIGN
    from there on; all N when they fit."""
    budget = DEFAULT_DIVERGENCE_BYTES if chunk_bytes is None else chunk_bytes
    rows = max(1, budget // (8 * v))
    return n if rows >= n else _aligned(rows)


def plan_chunks(n: int, v: int, chunk_bytes: int | None, da_bytes: int | None = None) -> Chunks:
    """The chunks and gradient groups within ``chunk_bytes``. Values only (``da_bytes`` None) or all
    rows in one chunk: ``chunk_rows`` rows, da (if any) over the teacher's buffer. Else, with R =
    ``GROUP_CHUNK_ROWS`` (at most what fits in place), the rest of the budget is da's own buffer, M
    rows of ``da_bytes`` per class (all N rows when they fit, and then any budget left widens the
    chunks): taken where M exceeds the in-place rows, so that fewer groups pay the gradient
    products' fixed costs."""
    budget = DEFAULT_DIVERGENCE_BYTES if chunk_bytes is None else chunk_bytes
    in_place = chunk_rows(n, v, budget)
    if da_bytes is None or in_place >= n:
        return Chunks(in_place, in_place)
    rows = min(INTERPRETED_GROUP_CHUNK_ROWS if device.interpreted() else GROUP_CHUNK_ROWS, in_place)
    group = _aligned((budget - 8 * rows * v) // (da_bytes * v))
    if group >= n:
        group = n
        rows = max(rows, min(n, _aligned((budget - da_bytes * n * v) // (8 * v))))
    return Chunks(rows, group) if group > in_place else Chunks(in_place, in_place)


# The row kernel on a GPU: one row a program, its vocabulary in blocks of BLOCK_V classes with
# num_warps warps, by the programs each SM gets (``row_blocks``): (most programs an SM, BLOCK_V,
# warps), the first that takes them. H200, bf16, the row kernel with da at D1 / D2 in chunks of 256,
# 432 / 512 and 8192 rows (``benchmarks/experiments/experiment_distill_rows.py``): few rows a chunk
# leave each SM one or two long programs, and larger blocks keep more bytes in flight (D1 beta = 1,
# ms for all N rows: 256 rows 14.0 with 1024 / 4 against 7.0 with 4096 / 16; 432 rows 9.4 against
# 7.1 with 2048 / 8; all rows 5.6 with 1024 / 4 against 5.4 / 6.2, and at beta = 0.5 8.9 against
# 9.4 / 11.1).
ROW_LAUNCHES = ((2, 4096, 16), (8, 2048, 8), (None, 1024, 4))


def row_blocks(r: int, v: int, where: torch.device) -> tuple[int, int, int]:
    """The row kernel's (BLOCK_N, BLOCK_V, num_warps) for a chunk of ``r`` rows: on a GPU one row a
    program (``ROW_LAUNCHES``); on the interpreter, whose cost is per operation, up to 32 rows of
    256 classes (still several blocks a row, and of rows, at the tests' sizes), one warp."""
    if device.interpreted():
        return min(32, triton.next_power_of_2(r)), min(256, triton.next_power_of_2(v)), 1
    per_sm = r / device.sm_count(where)
    for most, block_v, warps in ROW_LAUNCHES:
        if most is None or per_sm <= most:
            return 1, min(block_v, triton.next_power_of_2(v)), warps
    raise AssertionError("ROW_LAUNCHES ends open")


def _da_view(zt: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """da (r, V) in ``dtype`` over the fp32 teacher buffer ``zt``: row r in the first bytes of zt's
    row r (row stride 2V for 16 bits; the buffer itself for fp32)."""
    if dtype == torch.float32:
        return zt
    return zt.view(dtype)[:, : zt.shape[1]]


def _launch(zs, zt, da, biases, targets, counted, coef, stats, out, row0, n, spec: Spec, *, values: bool,
            write_da: bool, stats_known: bool, dtype, div_grad: bool = True):
    r, v = zs.shape
    scale_s, cap_s, cap_out_s, chain_s = spec.student.kernel_scales()
    scale_t, cap_t, cap_out_t, _ = spec.teacher.kernel_scales()
    beta = float(spec.beta)
    log_a = math.log1p(-beta) if beta < 1 else 0.0
    log_b = math.log(beta) if beta > 0 else 0.0
    b_s, b_t = biases
    dummy = stats
    rows, cols, warps = row_blocks(r, v, zs.device)
    divergence_row_kernel[(triton.cdiv(r, rows),)](
        zs, zt, da if da is not None else zt, b_s if b_s is not None else dummy, b_t if b_t is not None else dummy,
        targets if targets is not None else counted, counted, coef if coef is not None else dummy, stats,
        out if out is not None else dummy, row0, r, v, n, zs.stride(0), zt.stride(0),
        da.stride(0) if da is not None else 0, targets.stride(0) if targets is not None else 0,
        scale_s, cap_s, cap_out_s, chain_s, scale_t, cap_t, cap_out_t, beta, 1.0 - beta, log_a, log_b,
        MODE=spec.mode, HAS_BIAS_S=b_s is not None, HAS_BIAS_T=b_t is not None,
        SOFTCAP_S=spec.student.softcap is not None, SOFTCAP_T=spec.teacher.softcap is not None,
        HAS_TARGETS=targets is not None, STATS_KNOWN=stats_known, VALUES=values, WRITE_DA=write_da,
        DIV_GRAD=div_grad,
        BLOCK_N=rows, BLOCK_V=cols, BF16_EMULATION=device.bf16_emulation(dtype),
        num_warps=warps,
    )


def _buffers(n: int, v: int, spec: Spec, where, da_dtype: torch.dtype | None):
    """(the plan, the two fp32 logit buffers, da's own buffer or None) for da in ``da_dtype`` (None:
    values only)."""
    plan = plan_chunks(n, v, spec.chunk_bytes, None if da_dtype is None else da_dtype.itemsize)
    zs, zt = (device.new((plan.rows, v), torch.float32, where) for _ in range(2))
    return plan, zs, zt, device.new((plan.group, v), da_dtype, where) if plan.own_da else None


def _groups(n: int, plan: Chunks):
    """(group slice, [chunk slices]) over the rows."""
    for g0 in range(0, n, plan.group):
        g1 = min(n, g0 + plan.group)
        yield slice(g0, g1), [slice(r0, min(g1, r0 + plan.rows)) for r0 in range(g0, g1, plan.rows)]


def _chunk_da(da_buf, zt, group: slice, sl: slice, dtype):
    """Where the chunk ``sl`` of ``group`` writes its da: its rows of da's own buffer, or over its
    teacher logits (``_da_view``)."""
    if da_buf is None:
        return _da_view(zt, dtype)
    return da_buf[sl.start - group.start: sl.stop - group.start]


def _logits(student, teacher, sl, zs, zt):
    """The chunk's two fp32 products h @ W.T (no bias: the row kernel adds it), each an unscaled fp32
    result: cuBLAS with an fp32 output (``products.accumulate``), never rounded to 16 bits; the
    teacher's only when ``teacher`` is given."""
    products.accumulate(student[0][sl], student[1].t(), zs, True)
    if teacher is not None:
        products.accumulate(teacher[0][sl], teacher[1].t(), zt, True)


def weight_grad_dtype(hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the "chunked" strategy's weight gradient from the forward: bf16 for bf16 inputs
    (one group: rounded once; several: summed as a bf16 + 4-bit compensated pair, ``REMAINDER``,
    ``products.compensated``, ~12 bits of each partial sum), else fp32 (fp32 inputs, fp16's
    often-subnormal unit gradients, an fp32 master weight): an exact fp32 accumulator. The recompute
    backward sums its weight gradient the same way."""
    return torch.bfloat16 if hidden_dtype == weight_dtype == torch.bfloat16 else torch.float32


def _weight_grad(need: bool, v: int, h: int, dtype: torch.dtype, several: bool, where):
    """(grad_weight (V, H) of ``dtype``, the remainder (``REMAINDER``) of its compensated pair when it
    is 16-bit and summed over ``several`` groups, else None); (None, None) when not ``need``ed."""
    if not need:
        return None, None
    dw = device.new((v, h), dtype, where)
    return dw, pairs.compensation_buffer(dw, REMAINDER) if dtype != torch.float32 and several else None


def _gradient_products(da, student, sl, grads, unscale, first: bool, lo=None):
    """grad_hidden[rows] = da @ W_s, grad_weight (+)= da^T @ h_s[rows], grad_bias += column sums,
    each times ``unscale`` ((1,) fp32) in fp32 before its rounding. A bf16 grad_weight with ``lo``
    (several groups) is summed as a compensated pair, without ``lo`` written once."""
    dx, dw, db = grads
    if dx is not None and gemm.fills_one_wave(da, student[1]):
        products.product(da, student[1], dx[sl], False, unscale)
    elif dx is not None:  # few output tiles over a V-long reduction: cuBLAS splits it
        products.rows_product(da, student[1], dx[sl], unscale)
    if dw is not None and dw.dtype == torch.float32:
        gemm.matmul(da.t(), student[0][sl], dw, not first, unscale)
    elif dw is not None and lo is not None:
        products.compensated(da.t(), student[0][sl], dw, lo, not first, unscale)
    elif dw is not None:
        products.product(da.t(), student[0][sl], dw, False, unscale)
    if db is not None:
        db += torch.sum(da, 0, dtype=torch.float32) * unscale  # summed in fp32, no fp32 copy of da


def _sweep(student, teacher, plan: Chunks, buffers, dtype, launch, grads=None, unscale=None, lo=None):
    """Every chunk's logits (the teacher's only when ``teacher`` is given) and row kernel
    (``launch(zs, zt, da, row0)``, da None without ``grads``), and with ``grads`` each group's
    gradient products (``_gradient_products``) once its chunks have written their da."""
    zs_buf, zt_buf, da_buf = buffers
    for group, chunks in _groups(student[0].shape[0], plan):
        for sl in chunks:
            zs, zt = zs_buf[:sl.stop - sl.start], zt_buf[:sl.stop - sl.start]
            _logits(student, teacher, sl, zs, zt)
            da = _chunk_da(da_buf, zt, group, sl, dtype) if grads is not None else None
            launch(zs, zt, da, sl.start)
        if grads is not None:
            da = da if da_buf is None else da_buf[:group.stop - group.start]
            _gradient_products(da, student, group, grads, unscale, group.start == 0, lo)


def forward(student, teacher, targets, counted, spec: Spec, needs, unscale=None, dw_dtype=torch.float32):
    """The values and, with any of ``needs`` (dx, dw, db) and ``unscale``, the gradients of
    sum_rows(counted divergence) * unscale (the "chunked" strategy). ``student``/``teacher``:
    (hidden (N, H), weight (V, H), bias or None). Returns (out (3, N): divergence, entropy, target
    log-prob; stats (3, N); grad_hidden (unit dtype: fp32 for fp16 inputs), grad_weight
    (``dw_dtype``, ``weight_grad_dtype``), grad_bias (fp32), None where not needed)."""
    hidden, weight, bias = student
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, where = hidden.dtype, hidden.device
    need_dx, need_dw, need_db = needs
    write = any(needs)
    plan, *buffers = _buffers(n, v, spec, where, dtype if write else None)
    stats = device.new((3, n), torch.float32, where)
    out = device.new((3, n), torch.float32, where)
    coef = None
    grads = (None, None, None)
    if write:
        coef = torch.zeros((2, n), dtype=torch.float32, device=where)
        coef[0] = 1.0
        grads = (device.new((n, h), torch.float32 if dtype == torch.float16 else dtype, where) if need_dx else None,
                 None,
                 torch.zeros((v,), dtype=torch.float32, device=where) if need_db else None)
    dw, lo = _weight_grad(write and need_dw, v, h, dw_dtype, plan.group < n, where)
    grads = (grads[0], dw, grads[2])

    def launch(zs, zt, da, row0):
        _launch(zs, zt, da, (bias, teacher[2]), targets, counted, coef, stats, out, row0, n, spec, values=True,
                write_da=write, stats_known=False, dtype=dtype)
    _sweep(student, teacher, plan, buffers, dtype, launch, grads if write else None, unscale, lo)
    return (out, stats, *grads)


def backward(student, teacher, targets, counted, stats, coef, spec: Spec, needs, dw_dtype=None, div_grad=True):
    """The gradients for per-row coefficients ``coef`` (2, N) fp32 (the divergence's and the target
    log-prob's upstream), by recomputing each chunk's logits (without ``div_grad``, the log-prob's
    term alone: the student's logits only, three products a chunk): (grad_hidden in hidden's dtype,
    grad_weight in ``dw_dtype`` (default the weight's: float32 for an fp32 master weight, whose
    16-bit copy ``student`` holds), grad_bias in the bias's dtype), None where not needed."""
    hidden, weight, bias = student
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, where = hidden.dtype, hidden.device
    need_dx, need_dw, need_db = needs
    coef, unscale = _lift(coef)
    plan, *buffers = _buffers(n, v, spec, where, dtype)
    dw_dtype = dw_dtype or weight.dtype
    dw, lo = _weight_grad(need_dw, v, h, weight_grad_dtype(dtype, dw_dtype), plan.group < n, where)
    grads = (device.new((n, h), dtype, where) if need_dx else None, dw,
             torch.zeros((v,), dtype=torch.float32, device=where) if need_db else None)

    def launch(zs, zt, da, row0):
        _launch(zs, zt, da, (bias, teacher[2]), targets, counted, coef, stats, None, row0, n, spec, values=False,
                write_da=True, stats_known=True, dtype=dtype, div_grad=div_grad)
    _sweep(student, teacher if div_grad else None, plan, buffers, dtype, launch, grads, unscale, lo)
    dx, dw, db = grads
    return (dx, dw.to(dw_dtype) if dw is not None else None,
            db.to(bias.dtype) if db is not None else None)


def _lift(coef: torch.Tensor):
    """(coef / s, s) with s the power of two at or above the largest |coef| (1 when all are 0), on
    the device (no sync): da then peaks near 1, out of fp16's subnormals, and the products multiply
    s back in fp32 (exact)."""
    top = coef.abs().amax()
    s = torch.exp2(torch.ceil(torch.log2(torch.where(top > 0, top, torch.ones_like(top)))))
    return coef / s, s.reshape(1).to(torch.float32)
