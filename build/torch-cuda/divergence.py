"""Host side of ``fused_linear_divergence``: chunks of rows, their four (or six) products, the row
kernel between them, and the autograd.

Per chunk of R rows (``chunk_rows``: R x V x 8 bytes within ``chunk_bytes``), the student's and the
teacher's products ``h @ W.T`` go into two fp32 (R, V) buffers (``products.matmul``, fp32
accumulation, never rounded to 16 bits); ``divergence_kernel`` turns them into the per-token values
and, when a gradient is formed, da in the input dtype over the teacher buffer's own memory (a 16-bit
da row in the first half of the fp32 row's bytes); then grad_hidden[rows] = da @ W_s and
grad_weight += da^T @ h_s[rows] (fp32 accumulator across chunks), grad_bias += the column sums.

Two strategies:

- "chunked" ("mean" / "sum": the upstream gradient is one scalar g): the forward forms da with unit
  coefficients (1 on counted rows) and runs all four products; the common factor (1 / count, or
  1 / num_items_in_batch) is applied in the products' fp32 epilogue; the backward only multiplies
  by g (``ops.scale_gradients``; the ops and autograd are ``divergence_ops.py``). A gradient reaching ``log_probs`` is added by a recompute
  backward of that term alone (its upstream is only known then).
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

from . import device, products
from .divergence_kernel import divergence_row_kernel
from .validate import Options

# The memory knob's default: one chunk's two fp32 (R, V) buffers (R x V x 8 bytes). Not measured:
# 512 MiB is 512 rows of a 128256-class vocabulary, whose products still fill an H200.
DEFAULT_DIVERGENCE_BYTES = 512 << 20
# Row counts at least this large are rounded down to whole multiples of ROW_ALIGN (tile-friendly).
ROW_ALIGN = 16


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


def chunk_rows(n: int, v: int, chunk_bytes: int | None) -> int:
    """Rows per chunk: as many as two fp32 (R, V) buffers within ``chunk_bytes`` hold (default
    DEFAULT_DIVERGENCE_BYTES), at least 1, in multiples of ROW_ALIGN from there on; all N when they fit."""
    budget = DEFAULT_DIVERGENCE_BYTES if chunk_bytes is None else chunk_bytes
    rows = max(1, budget // (8 * v))
    if rows >= n:
        return n
    return rows // ROW_ALIGN * ROW_ALIGN if rows >= ROW_ALIGN else rows


def row_blocks(r: int, v: int) -> tuple[int, int]:
    """The row kernel's (BLOCK_N, BLOCK_V): one row of 1024-class blocks a program on a GPU (not
    measured); on the interpreter, whose cost is per operation, up to 32 rows of 256 classes
    (still several blocks a row, and of rows, at the tests' sizes)."""
    if device.interpreted():
        return min(32, triton.next_power_of_2(r)), min(256, triton.next_power_of_2(v))
    return 1, min(1024, triton.next_power_of_2(v))


def _da_view(zt: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """da (r, V) in ``dtype`` over the fp32 teacher buffer ``zt``: row r in the first bytes of zt's
    row r (row stride 2V for 16 bits; the buffer itself for fp32)."""
    if dtype == torch.float32:
        return zt
    return zt.view(dtype)[:, : zt.shape[1]]


def _launch(zs, zt, da, biases, targets, counted, coef, stats, out, row0, n, spec: Spec, *, values: bool,
            write_da: bool, stats_known: bool, dtype):
    r, v = zs.shape
    scale_s, cap_s, cap_out_s, chain_s = spec.student.kernel_scales()
    scale_t, cap_t, cap_out_t, _ = spec.teacher.kernel_scales()
    beta = float(spec.beta)
    log_a = math.log1p(-beta) if beta < 1 else 0.0
    log_b = math.log(beta) if beta > 0 else 0.0
    b_s, b_t = biases
    dummy = stats
    rows, cols = row_blocks(r, v)
    divergence_row_kernel[(triton.cdiv(r, rows),)](
        zs, zt, da if da is not None else zt, b_s if b_s is not None else dummy, b_t if b_t is not None else dummy,
        targets if targets is not None else counted, counted, coef if coef is not None else dummy, stats,
        out if out is not None else dummy, row0, r, v, n, zs.stride(0), zt.stride(0),
        da.stride(0) if da is not None else 0, targets.stride(0) if targets is not None else 0,
        scale_s, cap_s, cap_out_s, chain_s, scale_t, cap_t, cap_out_t, beta, log_a, log_b,
        MODE=spec.mode, HAS_BIAS_S=b_s is not None, HAS_BIAS_T=b_t is not None,
        SOFTCAP_S=spec.student.softcap is not None, SOFTCAP_T=spec.teacher.softcap is not None,
        HAS_TARGETS=targets is not None, STATS_KNOWN=stats_known, VALUES=values, WRITE_DA=write_da,
        BLOCK_N=rows, BLOCK_V=cols, BF16_EMULATION=device.bf16_emulation(dtype),
        num_warps=1 if device.interpreted() else 4,
    )


def _buffers(n: int, v: int, spec: Spec, where):
    rows = chunk_rows(n, v, spec.chunk_bytes)
    return rows, device.new((rows, v), torch.float32, where), device.new((rows, v), torch.float32, where)


def _logits(student, teacher, sl, zs, zt):
    """The chunk's two fp32 products h @ W.T (no bias: the row kernel adds it)."""
    products.matmul(student[0][sl], student[1].t(), zs, False)
    products.matmul(teacher[0][sl], teacher[1].t(), zt, False)


def _gradient_products(da, student, sl, grads, unscale, first: bool):
    """grad_hidden[rows] = da @ W_s, grad_weight (+)= da^T @ h_s[rows] (fp32), grad_bias += column
    sums, each times ``unscale`` ((1,) fp32) in fp32 before its one rounding."""
    dx, dw, db = grads
    if dx is not None:
        products.product(da, student[1], dx[sl], False, unscale)
    if dw is not None:
        products.matmul(da.t(), student[0][sl], dw, not first, unscale)
    if db is not None:
        db += da.float().sum(0) * unscale


def forward(student, teacher, targets, counted, spec: Spec, needs, unscale=None):
    """The values and, with any of ``needs`` (dx, dw, db) and ``unscale``, the gradients of
    sum_rows(counted divergence) * unscale (the "chunked" strategy). ``student``/``teacher``:
    (hidden (N, H), weight (V, H), bias or None). Returns (out (3, N): divergence, entropy, target
    log-prob; stats (3, N); grad_hidden (unit dtype: fp32 for fp16 inputs), grad_weight (fp32),
    grad_bias (fp32), None where not needed)."""
    hidden, weight, bias = student
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, where = hidden.dtype, hidden.device
    rows, zs_buf, zt_buf = _buffers(n, v, spec, where)
    stats = device.new((3, n), torch.float32, where)
    out = device.new((3, n), torch.float32, where)
    need_dx, need_dw, need_db = needs
    write = any(needs)
    coef = None
    grads = (None, None, None)
    if write:
        coef = torch.zeros((2, n), dtype=torch.float32, device=where)
        coef[0] = 1.0
        grads = (device.new((n, h), torch.float32 if dtype == torch.float16 else dtype, where) if need_dx else None,
                 device.new((v, h), torch.float32, where) if need_dw else None,
                 torch.zeros((v,), dtype=torch.float32, device=where) if need_db else None)
    for row0 in range(0, n, rows):
        r = min(rows, n - row0)
        sl = slice(row0, row0 + r)
        zs, zt = zs_buf[:r], zt_buf[:r]
        _logits(student, teacher, sl, zs, zt)
        da = _da_view(zt, dtype) if write else None
        _launch(zs, zt, da, (bias, teacher[2]), targets, counted, coef, stats, out, row0, n, spec,
                values=True, write_da=write, stats_known=False, dtype=dtype)
        if write:
            _gradient_products(da, student, sl, grads, unscale, row0 == 0)
    return (out, stats, *grads)


def backward(student, teacher, targets, counted, stats, coef, spec: Spec, needs):
    """The gradients for per-row coefficients ``coef`` (2, N) fp32 (the divergence's and the target
    log-prob's upstream), by recomputing each chunk's logits: (grad_hidden in hidden's dtype,
    grad_weight and grad_bias in their leaves' dtypes), None where not needed."""
    hidden, weight, bias = student
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, where = hidden.dtype, hidden.device
    need_dx, need_dw, need_db = needs
    coef, unscale = _lift(coef)
    rows, zs_buf, zt_buf = _buffers(n, v, spec, where)
    grads = (device.new((n, h), dtype, where) if need_dx else None,
             device.new((v, h), torch.float32, where) if need_dw else None,
             torch.zeros((v,), dtype=torch.float32, device=where) if need_db else None)
    for row0 in range(0, n, rows):
        r = min(rows, n - row0)
        sl = slice(row0, row0 + r)
        zs, zt = zs_buf[:r], zt_buf[:r]
        _logits(student, teacher, sl, zs, zt)
        da = _da_view(zt, dtype)
        _launch(zs, zt, da, (bias, teacher[2]), targets, counted, coef, stats, None, row0, n, spec,
                values=False, write_da=True, stats_known=True, dtype=dtype)
        _gradient_products(da, student, sl, grads, unscale, row0 == 0)
    dx, dw, db = grads
    return (dx, dw.to(weight.dtype) if dw is not None else None,
            db.to(bias.dtype) if db is not None else None)


def _lift(coef: torch.Tensor):
    """(coef / s, s) with s the power of two at or above the largest |coef| (1 when all are 0), on
    the device (no sync): da then peaks near 1, out of fp16's subnormals, and the products multiply
    s back in fp32 (exact)."""
    top = coef.abs().amax()
    s = torch.exp2(torch.ceil(torch.log2(torch.where(top > 0, top, torch.ones_like(top)))))
    return coef / s, s.reshape(1).to(torch.float32)
