"""``fused_linear_divergence``'s forward and backward as PyTorch custom operators with fake
implementations and autograd, so that ``torch.compile(fullgraph=True)`` sees two opaque ops (as
``ops.py`` does for the loss). The float options travel as one CPU float64 tensor (``ops.float_tensor``:
no recompile per temperature, no device sync), read inside the ops on the host.
"""

from typing import NamedTuple, Optional

import torch

from . import chunked as chunked_path
from . import divergence, ops
from .divergence import Head, Spec
from .validate import Options

NAMESPACE = ops.NAMESPACE


class Scalars(NamedTuple):
    """The ops' float options, in the order of their CPU float64 ``scalars`` tensor; 1.0 stands in
    for an absent softcap (``has_s_cap`` / ``has_t_cap`` say which are given)."""

    beta: float
    temperature: float
    student_scale: float
    student_softcap: float
    teacher_scale: float
    teacher_softcap: float

    @classmethod
    def of(cls, spec: Spec) -> "Scalars":
        s, t = spec.student, spec.teacher
        return cls(spec.beta, s.temperature, s.logit_scale, s.softcap if s.softcap is not None else 1.0,
                   t.logit_scale, t.softcap if t.softcap is not None else 1.0)


def _spec(scalars: torch.Tensor, has_s_cap: bool, has_t_cap: bool, reduction: str, strategy: str,
          chunk_bytes: Optional[int]) -> Spec:
    """The Spec inside an op, from its ``scalars`` tensor (``Scalars``)."""
    x = Scalars(*scalars.tolist())
    return Spec(beta=x.beta,
                student=Options(logit_scale=x.student_scale, softcap=x.student_softcap if has_s_cap else None,
                                temperature=x.temperature),
                teacher=Options(logit_scale=x.teacher_scale, softcap=x.teacher_softcap if has_t_cap else None,
                                temperature=x.temperature),
                reduction=reduction, strategy=strategy, chunk_bytes=chunk_bytes)


def _over(numerator, denominator: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """``numerator`` / ``denominator`` (0-d fp32), or 0 where no row is counted: then every gradient is zero
    (whatever the reduction and the denominator: "mean" over no rows, num_items_in_batch=0), as the
    loss's are, while the value stays 0 / 0 = NaN. Uncounted rows' da is 0 and 0 x 1/0 would be NaN
    in the products' fp32 epilogue. On the device, no sync."""
    quotient = numerator / denominator
    return torch.where(counted.any(), quotient, torch.zeros_like(quotient))


def _chunked(strategy: str, need_dx: bool, need_dw: bool, need_db: bool) -> bool:
    return strategy == "chunked" and (need_dx or need_dw or need_db)


@torch.library.custom_op(f"{NAMESPACE}::divergence_forward", mutates_args=())
def divergence_forward(
    hs: torch.Tensor, ws: torch.Tensor, bs: Optional[torch.Tensor], ht: torch.Tensor, wt: torch.Tensor,
    bt: Optional[torch.Tensor], targets: Optional[torch.Tensor], counted: torch.Tensor,
    denominator: Optional[torch.Tensor], scalars: torch.Tensor, has_s_cap: bool, has_t_cap: bool, reduction: str,
    strategy: str, chunk_bytes: Optional[int], need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(divergence, entropy (N,), log_probs (N,), stats (3, N), grad_hidden, grad_weight, grad_bias):
    the divergence reduced over ``denominator`` (0-d) or per row ("none", denominator None); the
    gradients of the "chunked" strategy for an upstream gradient of 1 (``divergence.forward``), else
    empty (0,)."""
    spec = _spec(scalars, has_s_cap, has_t_cap, reduction, strategy, chunk_bytes)
    chunked = _chunked(strategy, need_dx, need_dw, need_db)
    factor = _over(1.0, denominator, counted).reshape(1).to(torch.float32) if chunked else None
    needs = (need_dx, need_dw, need_db) if chunked else (False,) * 3
    out, stats, *grads = divergence.forward(Head(hs, ops.low_weight(ws, hs), bs), Head(ht, wt, bt), targets, counted,
                                            spec, needs, factor, chunked_path.weight_grad_dtype(hs.dtype, ws.dtype))
    rows, entropy, log_probs = (t.clone() for t in out)  # distinct outputs
    div = rows if denominator is None else rows.sum() / denominator
    grads = [g if g is not None else hs.new_empty((0,)) for g in grads]
    return (div, entropy, log_probs, stats, *grads)


@divergence_forward.register_fake
def _(hs, ws, bs, ht, wt, bt, targets, counted, denominator, scalars, has_s_cap, has_t_cap, reduction, strategy,
      chunk_bytes, need_dx, need_dw, need_db):
    n, h = hs.shape
    v = ws.shape[0]
    chunked = _chunked(strategy, need_dx, need_dw, need_db)
    rows = hs.new_empty((n,), dtype=torch.float32)
    unit = chunked_path.unit_dtype(hs.dtype)
    empty = hs.new_empty((0,))
    return (rows if denominator is None else hs.new_empty((), dtype=torch.float32), rows.new_empty((n,)),
            rows.new_empty((n,)), rows.new_empty((3, n)),
            hs.new_empty((n, h), dtype=unit) if chunked and need_dx else empty,
            hs.new_empty((v, h), dtype=chunked_path.weight_grad_dtype(hs.dtype, ws.dtype)) if chunked and need_dw
            else empty,
            hs.new_empty((v,), dtype=torch.float32) if chunked and need_db else empty)


@torch.library.custom_op(f"{NAMESPACE}::divergence_backward", mutates_args=())
def divergence_backward(
    coef: torch.Tensor, hs: torch.Tensor, ws: torch.Tensor, bs: Optional[torch.Tensor], ht: torch.Tensor,
    wt: torch.Tensor, bt: Optional[torch.Tensor], targets: Optional[torch.Tensor], counted: torch.Tensor,
    stats: torch.Tensor, scalars: torch.Tensor, has_s_cap: bool, has_t_cap: bool, chunk_bytes: Optional[int],
    need_dx: bool, need_dw: bool, need_db: bool, div_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias) of the student for per-row coefficients ``coef`` (2, N)
    (the divergence's and the log-prob's upstream), recomputing the logits; empty (0,) where not
    needed. ``div_grad`` False: the log-prob's term alone (coef[0] unused, no teacher product)."""
    spec = _spec(scalars, has_s_cap, has_t_cap, "none", "recompute", chunk_bytes)
    grads = divergence.backward(Head(hs, ops.low_weight(ws, hs), bs), Head(ht, wt, bt), targets, counted, stats,
                                coef, spec, (need_dx, need_dw, need_db), dw_dtype=ws.dtype, div_grad=div_grad)
    return tuple(g if g is not None else hs.new_empty((0,)) for g in grads)


@divergence_backward.register_fake
def _(coef, hs, ws, bs, ht, wt, bt, targets, counted, stats, scalars, has_s_cap, has_t_cap, chunk_bytes, need_dx,
      need_dw, need_db, div_grad):
    empty = hs.new_empty((0,))
    return (hs.new_empty(hs.shape) if need_dx else empty, ws.new_empty(ws.shape) if need_dw else empty,
            ws.new_empty((ws.shape[0],)) if need_db and bs is not None else empty)


# The forward op's arguments after ``scalars``, in order.
_OPTIONS = ("has_s_cap", "has_t_cap", "reduction", "strategy", "chunk_bytes", "need_dx", "need_dw", "need_db")


def _setup_context(ctx, inputs, output):
    hs, ws, bs, ht, wt, bt, targets, counted, denominator, scalars, *options = inputs
    o = dict(zip(_OPTIONS, options))
    ctx.options = o
    ctx.computed = (o["need_dx"], o["need_dw"], o["need_db"])
    ctx.chunked = _chunked(o["strategy"], *ctx.computed)
    ctx.dtypes = (hs.dtype, ws.dtype, bs.dtype if bs is not None else hs.dtype)
    ctx.spent = ()  # the leaves whose saved gradient a backward has scaled in place (``ops.scale_saved``)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1], output[3], output[4], output[5], output[6])
    saved = output[4:] if ctx.chunked else (None, None, None)
    ctx.save_for_backward(hs, ws, bs, ht, wt, bt, targets, counted, denominator, scalars, output[3], *saved)


def _backward(ctx, grad_div, _grad_entropy, grad_lp, *_rest):
    if ctx.chunked:
        ops.check_spent(ctx, "fused_linear_divergence")
    hs, ws, bs, ht, wt, bt, targets, counted, denominator, scalars, stats, dx, dw, db = ctx.saved_tensors
    o = ctx.options
    needs = ctx.computed
    grads = [None, None, None]
    if ctx.chunked and grad_div is not None:
        scaled = ops.scale_saved(ctx, (dx, dw, db), grad_div.reshape(()), needs)
        grads = [s if need else None for s, need in zip(scaled, needs)]
        grad_div = None
    if grad_div is not None or grad_lp is not None:
        zero = hs.new_zeros((hs.shape[0],), dtype=torch.float32)
        c_div = zero if grad_div is None else (_over(grad_div.float(), denominator, counted)
                                               if denominator is not None else grad_div.float()).expand(hs.shape[0])
        c_lp = zero if grad_lp is None else grad_lp.float()
        more = divergence_backward(torch.stack([c_div, c_lp]), hs, ws, bs, ht, wt, bt, targets, counted, stats,
                                   scalars, o["has_s_cap"], o["has_t_cap"], o["chunk_bytes"], *needs,
                                   grad_div is not None)
        more = [m if need else None for m, need in zip(more, needs)]
        grads = [m if g is None else (g + m if m is not None else g) for g, m in zip(grads, more)]
    return (*grads, None, None, None, None, None, None, None) + (None,) * len(_OPTIONS)


divergence_forward.register_autograd(_backward, setup_context=_setup_context)


def apply(hs, ws, bs, ht, wt, bt, targets, counted, denominator, spec: Spec):
    """Calls the forward op with ``spec`` spread into its arguments; which gradients will be wanted is
    read here (grad mode and requires_grad). Returns (divergence, entropy, log_probs)."""
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (hs, ws, bs)]
    scalars = ops.float_tensor(tuple(Scalars.of(spec)))
    out = divergence_forward(hs, ws, bs, ht, wt, bt, targets, counted, denominator, scalars,
                             spec.student.softcap is not None, spec.teacher.softcap is not None, spec.reduction,
                             spec.strategy, spec.chunk_bytes, *needs)
    return out[0], out[1], out[2]
