"""Host side of ``fused_linear_divergence``: chunks of rows, their four (or six) products, the row
kernel between them, and the autograd.

Per chunk of R rows (``plan.plan_divergence``), the student's and the teacher's products ``h @ W.T`` go into
two fp32 (R, V) buffers (cuBLAS with an fp32 output, ``products.accumulate``: fp32 accumulation,
never rounded to 16 bits); ``divergence_kernel`` turns them into the per-token values and, when a
gradient is formed, da in the input dtype. The gradient products run per group of M >= R rows:
grad_hidden[rows] = da @ W_s, grad_weight += da^T @ h_s[rows] (``chunked.weight_grad_dtype``), grad_bias +=
the column sums. Where M = R, da lies over the teacher buffer's own memory (a 16-bit da row in the
first half of the fp32 row's bytes); where the budget buys fewer groups with smaller chunks, da
goes to its own (M, V) buffer, filled by M / R chunks: a bf16 grad_weight summed over many groups
pays its compensated pair's epilogue (~0.8 ms a product at D1) once a group, not once a chunk.

Two strategies:

- "chunked" ("mean" / "sum": the upstream gradient is one scalar g): the forward forms da with unit
  coefficients (1 on counted rows) and runs all four products; the common factor (1 / count, or
  1 / num_items_in_batch) is applied in the products' fp32 epilogue; the backward only multiplies
  by g (``saved_gradients.scale_gradients``; the ops and autograd are ``divergence_ops.py``). A gradient
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
from typing import NamedTuple

import torch
import triton

from . import configs, device, gemm, pairs, products
from .chunked import unit_dtype, weight_grad_dtype
from .divergence_kernel import FORWARD_KL, JSD, REVERSE_KL, divergence_row_kernel
from .plan import DivergenceChunks
from .validate import Options

# The remainder of a bf16 grad_weight summed over several groups (``products.compensated``): 4 bits
# (``pairs.compensation_buffer``: ~12 bits of each partial sum, against 2^-9 for the final bf16
# rounding), half the int8 remainder's V x H_s bytes, spent on da's rows instead.
REMAINDER = torch.uint8


class Head(NamedTuple):
    """One model's LM head: hidden (N, H), weight (V, H), bias (V,) or None."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True)
class Spec:
    """Everything besides the tensors, validated (``distill.py``)."""

    beta: float
    student: Options  # logit_scale, softcap, temperature of the student
    teacher: Options  # of the teacher
    reduction: str

    @property
    def mode(self) -> int:
        """The row kernel's MODE: the forward KL at beta = 0, the reverse KL at 1, else the JSD."""
        mode = FORWARD_KL if self.beta == 0 else REVERSE_KL if self.beta == 1 else JSD
        return mode.value


def _da_view(zt: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """da (r, V) in ``dtype`` over the fp32 teacher buffer ``zt``: row r in the first bytes of zt's
    row r (row stride 2V for 16 bits; the buffer itself for fp32)."""
    if dtype == torch.float32:
        return zt
    return zt.view(dtype)[:, : zt.shape[1]]


def _launch(zs, zt, da, biases, targets, counted, coef, stats, out, row0, n, spec: Spec, *, values: bool,
            write_da: bool, stats_known: bool, dtype, div_grad: bool = True):
    """The row kernel over a chunk's logit buffers ``zs`` / ``zt`` (rows ``row0`` on of ``n``), its
    passes chosen by the flags (``divergence_kernel.divergence_row_kernel``); ``stats`` stands in for
    the pointers not read."""
    r, v = zs.shape
    s, t = spec.student.kernel_scales(), spec.teacher.kernel_scales()
    beta = float(spec.beta)
    log_a = math.log1p(-beta) if beta < 1 else 0.0
    log_b = math.log(beta) if beta > 0 else 0.0
    b_s, b_t = biases
    dummy = stats
    rows, cols, warps = configs.divergence_row_config(r, v, zs.device)
    divergence_row_kernel[(triton.cdiv(r, rows),)](
        zs, zt, da if da is not None else zt, b_s if b_s is not None else dummy, b_t if b_t is not None else dummy,
        targets if targets is not None else counted, counted, coef if coef is not None else dummy, stats,
        out if out is not None else dummy, row0, r, v, n, zs.stride(0), zt.stride(0),
        da.stride(0) if da is not None else 0, targets.stride(0) if targets is not None else 0,
        s.tile_scale, s.softcap, s.softcap_out, s.grad_scale, t.tile_scale, t.softcap, t.softcap_out,
        beta, 1.0 - beta, log_a, log_b,
        MODE=spec.mode, HAS_BIAS_S=b_s is not None, HAS_BIAS_T=b_t is not None,
        SOFTCAP_S=spec.student.softcap is not None, SOFTCAP_T=spec.teacher.softcap is not None,
        HAS_TARGETS=targets is not None, STATS_KNOWN=stats_known, VALUES=values, WRITE_DA=write_da,
        DIV_GRAD=div_grad,
        BLOCK_N=rows, BLOCK_V=cols, BF16_EMULATION=device.bf16_emulation(dtype),
        num_warps=warps,
    )


def _buffers(v: int, chunks: DivergenceChunks, where, da_dtype: torch.dtype | None):
    """(the two fp32 logit buffers, da's own buffer or None) of ``chunks`` for da in ``da_dtype``
    (None: values only)."""
    zs, zt = (device.new((chunks.rows, v), torch.float32, where) for _ in range(2))
    return zs, zt, device.new((chunks.group, v), da_dtype, where) if chunks.own_da else None


def _groups(n: int, plan: DivergenceChunks):
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
    products.accumulate(student.hidden[sl], student.weight.t(), zs, True)
    if teacher is not None:
        products.accumulate(teacher.hidden[sl], teacher.weight.t(), zt, True)


def _weight_grad(need: bool, v: int, h: int, dtype: torch.dtype, several: bool, where):
    """(grad_weight (V, H) of ``dtype`` (``chunked.weight_grad_dtype``: bf16 for bf16 inputs, rounded
    once from one group, else summed as a bf16 + 4-bit compensated pair, ~12 bits of each partial sum;
    else fp32, an exact accumulator), the remainder (``REMAINDER``) of its compensated pair when it
    is 16-bit and summed over ``several`` groups, else None); (None, None) when not ``need``ed."""
    if not need:
        return None, None
    dw = device.new((v, h), dtype, where)
    return dw, pairs.compensation_buffer(dw, REMAINDER) if dtype != torch.float32 and several else None


def _gradient_products(da, student, sl, grads, factor, first: bool, lo=None):
    """grad_hidden[rows] = da @ W_s, grad_weight (+)= da^T @ h_s[rows], grad_bias += column sums,
    each times ``factor`` ((1,) fp32) in fp32 before its rounding. A bf16 grad_weight with ``lo``
    (several groups) is summed as a compensated pair, without ``lo`` written once."""
    dx, dw, db = grads
    h_rows, w = student.hidden[sl], student.weight
    if dx is not None and gemm.fills_one_wave(da, w):
        products.product(da, w, dx[sl], False, factor)
    elif dx is not None:  # few output tiles over a V-long reduction: cuBLAS splits it
        products.rows_product(da, w, dx[sl], factor)
    if dw is not None and dw.dtype == torch.float32:
        gemm.matmul(da.t(), h_rows, dw, not first, factor)
    elif dw is not None and lo is not None:
        products.compensated(da.t(), h_rows, dw, lo, not first, factor)
    elif dw is not None:
        products.product(da.t(), h_rows, dw, False, factor)
    if db is not None:
        db += torch.sum(da, 0, dtype=torch.float32) * factor  # summed in fp32, no fp32 copy of da


def _sweep(student, teacher, plan: DivergenceChunks, buffers, dtype, launch, grads=None, factor=None, lo=None):
    """Every chunk's logits (the teacher's only when ``teacher`` is given) and row kernel
    (``launch(zs, zt, da, row0)``, da None without ``grads``), and with ``grads`` each group's
    gradient products (``_gradient_products``) once its chunks have written their da."""
    zs_buf, zt_buf, da_buf = buffers
    for group, chunks in _groups(student.hidden.shape[0], plan):
        for sl in chunks:
            zs, zt = zs_buf[:sl.stop - sl.start], zt_buf[:sl.stop - sl.start]
            _logits(student, teacher, sl, zs, zt)
            da = _chunk_da(da_buf, zt, group, sl, dtype) if grads is not None else None
            launch(zs, zt, da, sl.start)
        if grads is not None:
            da = da if da_buf is None else da_buf[:group.stop - group.start]
            _gradient_products(da, student, group, grads, factor, group.start == 0, lo)


def forward(student, teacher, targets, counted, spec: Spec, plan: DivergenceChunks, needs, factor=None,
            dw_dtype=torch.float32):
    """The values and, with any of ``needs`` (dx, dw, db) and ``factor``, the gradients of
    sum_rows(counted divergence) * factor (the CHUNKED mode), in the forward's chunks ``plan``
    (``plan.plan_divergence``). ``student``/``teacher``:
    (hidden (N, H), weight (V, H), bias or None). Returns (out (3, N): divergence, entropy, target
    log-prob; stats (3, N); grad_hidden (unit dtype: fp32 for fp16 inputs), grad_weight
    (``dw_dtype``, ``weight_grad_dtype``), grad_bias (fp32), None where not needed)."""
    hidden, weight, bias = student
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, where = hidden.dtype, hidden.device
    need_dx, need_dw, need_db = needs
    write = any(needs)
    buffers = _buffers(v, plan, where, dtype if write else None)
    stats = device.new((3, n), torch.float32, where)
    out = device.new((3, n), torch.float32, where)
    coef = None
    grads = (None, None, None)
    if write:
        coef = torch.zeros((2, n), dtype=torch.float32, device=where)
        coef[0] = 1.0
        grads = (device.new((n, h), unit_dtype(dtype), where) if need_dx else None,
                 None,
                 torch.zeros((v,), dtype=torch.float32, device=where) if need_db else None)
    dw, lo = _weight_grad(write and need_dw, v, h, dw_dtype, plan.group < n, where)
    grads = (grads[0], dw, grads[2])

    def launch(zs, zt, da, row0):
        _launch(zs, zt, da, (bias, teacher.bias), targets, counted, coef, stats, out, row0, n, spec, values=True,
                write_da=write, stats_known=False, dtype=dtype)
    _sweep(student, teacher, plan, buffers, dtype, launch, grads if write else None, factor, lo)
    return (out, stats, *grads)


def backward(student, teacher, targets, counted, stats, coef, spec: Spec, plan: DivergenceChunks, needs, dw_dtype=None,
             div_grad=True):
    """The gradients for per-row coefficients ``coef`` (2, N) fp32 (the divergence's and the target
    log-prob's upstream), by recomputing each chunk's logits in the backward's chunks ``plan``
    (without ``div_grad``, the log-prob's term alone: the student's logits only, three products a
    chunk): (grad_hidden in hidden's dtype,
    grad_weight in ``dw_dtype`` (default the weight's: float32 for an fp32 master weight, whose
    16-bit copy ``student`` holds), grad_bias in the bias's dtype), None where not needed."""
    hidden, weight, bias = student
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, where = hidden.dtype, hidden.device
    need_dx, need_dw, need_db = needs
    coef, factor = _lift(coef)
    buffers = _buffers(v, plan, where, dtype)
    dw_dtype = dw_dtype or weight.dtype
    dw, lo = _weight_grad(need_dw, v, h, weight_grad_dtype(dtype, dw_dtype), plan.group < n, where)
    grads = (device.new((n, h), dtype, where) if need_dx else None, dw,
             torch.zeros((v,), dtype=torch.float32, device=where) if need_db else None)

    def launch(zs, zt, da, row0):
        _launch(zs, zt, da, (bias, teacher.bias), targets, counted, coef, stats, None, row0, n, spec, values=False,
                write_da=True, stats_known=True, dtype=dtype, div_grad=div_grad)
    _sweep(student, teacher if div_grad else None, plan, buffers, dtype, launch, grads, factor, lo)
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
