"""``fused_linear_divergence``'s forward and backward as PyTorch custom operators with fake
implementations and autograd, so that ``torch.compile(fullgraph=True)`` sees two opaque ops (as
``ops.py`` does for the loss). Their options and the call's plan travel as their arguments
(``opargs``: the float options as one CPU float64 tensor, no recompile per temperature, no device
sync), read inside the ops on the host.
"""

from typing import Optional

import torch

from . import chunked as chunked_path
from . import divergence, opargs, ops, saved_gradients
from .plan import CHUNKED, plan_divergence
from .divergence import Head, Spec
from .validate import Options

# The float options, in the order of the ops' ``scalars`` tensor (``opargs.Floats``).
FLOATS = opargs.Floats("beta", "temperature", "student_logit_scale", "student_softcap", "teacher_logit_scale",
                       "teacher_softcap")
# The forward op's other arguments after ``scalars``, in order (``apply`` packs them, the autograd
# context unpacks them).
ARGS = opargs.Args("reduction", "mode", "plan", "need_dx", "need_dw", "need_db")


def _floats(spec: Spec) -> torch.Tensor:
    s, t = spec.student, spec.teacher
    return FLOATS.tensor(dict(beta=spec.beta, temperature=s.temperature, student_logit_scale=s.logit_scale,
                              student_softcap=s.softcap, teacher_logit_scale=t.logit_scale, teacher_softcap=t.softcap))


def _spec(scalars: torch.Tensor, reduction: str) -> Spec:
    """The Spec inside an op, from its ``scalars`` tensor (``FLOATS``)."""
    x = FLOATS.read(scalars)
    return Spec(beta=x["beta"],
                student=Options(logit_scale=x["student_logit_scale"], softcap=x["student_softcap"],
                                temperature=x["temperature"]),
                teacher=Options(logit_scale=x["teacher_logit_scale"], softcap=x["teacher_softcap"],
                                temperature=x["temperature"]),
                reduction=reduction)


def _over(numerator, denominator: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """``numerator`` / ``denominator`` (0-d fp32), or 0 where no row is counted: then every gradient is zero
    (whatever the reduction and the denominator: "mean" over no rows, num_items_in_batch=0), as the
    loss's are, while the value stays 0 / 0 = NaN. Uncounted rows' da is 0 and 0 x 1/0 would be NaN
    in the products' fp32 epilogue. On the device, no sync."""
    quotient = numerator / denominator
    return torch.where(counted.any(), quotient, torch.zeros_like(quotient))


@torch.library.custom_op(f"{opargs.NAMESPACE}::divergence_forward", mutates_args=())
def divergence_forward(
    hs: torch.Tensor, ws: torch.Tensor, bs: Optional[torch.Tensor], ht: torch.Tensor, wt: torch.Tensor,
    bt: Optional[torch.Tensor], targets: Optional[torch.Tensor], counted: torch.Tensor,
    denominator: Optional[torch.Tensor], scalars: torch.Tensor, reduction: str, mode: str, plan: list[int],
    need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(divergence, entropy (N,), log_probs (N,), stats (3, N), grad_hidden, grad_weight, grad_bias):
    the divergence reduced over ``denominator`` (0-d) or per row ("none", denominator None); the
    gradients of the CHUNKED mode for an upstream gradient of 1 (``divergence.forward``), else empty
    (0,). ``mode`` and ``plan``: the call's plan (``plan.plan_divergence``, encoded by ``opargs``)."""
    spec = _spec(scalars, reduction)
    chunked = mode == CHUNKED
    factor = _over(1.0, denominator, counted).reshape(1).to(torch.float32) if chunked else None
    needs = (need_dx, need_dw, need_db) if chunked else (False,) * 3
    chunks = opargs.decode_divergence(mode, plan).forward
    out, stats, *grads = divergence.forward(Head(hs, ops.low_weight(ws, hs), bs), Head(ht, wt, bt), targets, counted,
                                            spec, chunks, needs, factor,
                                            chunked_path.weight_grad_dtype(hs.dtype, ws.dtype))
    rows, entropy, log_probs = (t.clone() for t in out)  # distinct outputs
    div = rows if denominator is None else rows.sum() / denominator
    grads = [g if g is not None else hs.new_empty((0,)) for g in grads]
    return (div, entropy, log_probs, stats, *grads)


@divergence_forward.register_fake
def _(hs, ws, bs, ht, wt, bt, targets, counted, denominator, scalars, reduction, mode, plan_, need_dx, need_dw,
      need_db):
    n, h = hs.shape
    v = ws.shape[0]
    chunked = mode == CHUNKED
    rows = hs.new_empty((n,), dtype=torch.float32)
    unit = chunked_path.unit_dtype(hs.dtype)
    empty = hs.new_empty((0,))
    return (rows if denominator is None else hs.new_empty((), dtype=torch.float32), rows.new_empty((n,)),
            rows.new_empty((n,)), rows.new_empty((3, n)),
            hs.new_empty((n, h), dtype=unit) if chunked and need_dx else empty,
            hs.new_empty((v, h), dtype=chunked_path.weight_grad_dtype(hs.dtype, ws.dtype)) if chunked and need_dw
            else empty,
            hs.new_empty((v,), dtype=torch.float32) if chunked and need_db else empty)


@torch.library.custom_op(f"{opargs.NAMESPACE}::divergence_backward", mutates_args=())
def divergence_backward(
    coef: torch.Tensor, hs: torch.Tensor, ws: torch.Tensor, bs: Optional[torch.Tensor], ht: torch.Tensor,
    wt: torch.Tensor, bt: Optional[torch.Tensor], targets: Optional[torch.Tensor], counted: torch.Tensor,
    stats: torch.Tensor, scalars: torch.Tensor, mode: str, plan: list[int],
    need_dx: bool, need_dw: bool, need_db: bool, div_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias) of the student for per-row coefficients ``coef`` (2, N)
    (the divergence's and the log-prob's upstream), recomputing the logits; empty (0,) where not
    needed, in the backward chunks of the call's plan. ``div_grad`` False: the log-prob's term alone
    (coef[0] unused, no teacher product)."""
    spec = _spec(scalars, "none")
    chunks = opargs.decode_divergence(mode, plan).backward
    grads = divergence.backward(Head(hs, ops.low_weight(ws, hs), bs), Head(ht, wt, bt), targets, counted, stats,
                                coef, spec, chunks, (need_dx, need_dw, need_db), dw_dtype=ws.dtype, div_grad=div_grad)
    return tuple(g if g is not None else hs.new_empty((0,)) for g in grads)


@divergence_backward.register_fake
def _(coef, hs, ws, bs, ht, wt, bt, targets, counted, stats, scalars, mode, plan_, need_dx, need_dw, need_db,
      div_grad):
    return opargs.fake_gradients(hs, ws, bs, need_dx, need_dw, need_db)


def _setup_context(ctx, inputs, output):
    hs, ws, bs, ht, wt, bt, targets, counted, denominator, scalars, *options = inputs
    o = ARGS.unpack(options)
    ctx.options = o
    ctx.computed = (o["need_dx"], o["need_dw"], o["need_db"])
    ctx.chunked = o["mode"] == CHUNKED
    ctx.dtypes = (hs.dtype, ws.dtype, bs.dtype if bs is not None else hs.dtype)
    ctx.spent = ()  # the leaves whose saved gradient a backward has scaled in place (``saved_gradients``)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1], output[3], output[4], output[5], output[6])
    saved = output[4:] if ctx.chunked else (None, None, None)
    ctx.save_for_backward(hs, ws, bs, ht, wt, bt, targets, counted, denominator, scalars, output[3], *saved)


def _backward(ctx, grad_div, _grad_entropy, grad_lp, *_rest):
    if ctx.chunked:
        saved_gradients.check_spent(ctx, "fused_linear_divergence")
    hs, ws, bs, ht, wt, bt, targets, counted, denominator, scalars, stats, dx, dw, db = ctx.saved_tensors
    o = ctx.options
    needs = ctx.computed
    grads = [None, None, None]
    if ctx.chunked and grad_div is not None:
        scaled = saved_gradients.scale_saved(ctx, (dx, dw, db), grad_div.reshape(()), needs)
        grads = [s if need else None for s, need in zip(scaled, needs)]
        grad_div = None
    if grad_div is not None or grad_lp is not None:
        zero = hs.new_zeros((hs.shape[0],), dtype=torch.float32)
        c_div = zero if grad_div is None else (_over(grad_div.float(), denominator, counted)
                                               if denominator is not None else grad_div.float()).expand(hs.shape[0])
        c_lp = zero if grad_lp is None else grad_lp.float()
        more = divergence_backward(torch.stack([c_div, c_lp]), hs, ws, bs, ht, wt, bt, targets, counted, stats,
                                   scalars, o["mode"], o["plan"], *needs, grad_div is not None)
        more = [m if need else None for m, need in zip(more, needs)]
        grads = [m if g is None else (g + m if m is not None else g) for g, m in zip(grads, more)]
    return (*grads, None, None, None, None, None, None, None) + ARGS.no_gradients


divergence_forward.register_autograd(_backward, setup_context=_setup_context)


def apply(hs, ws, bs, ht, wt, bt, targets, counted, denominator, spec: Spec, strategy: str, chunk_bytes):
    """Asks the planner once (``plan.plan_divergence``) and calls the forward op with ``spec`` and the
    plan spread into its arguments; which gradients will be wanted is read here (grad mode and
    requires_grad). Returns (divergence, entropy, log_probs)."""
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (hs, ws, bs)]
    p = plan_divergence(strategy, spec.reduction, hs.shape[0], ws.shape[0], hs.dtype, chunk_bytes, needs)
    args = ARGS.pack(reduction=spec.reduction, mode=p.mode, plan=opargs.encode_divergence(p), need_dx=needs[0],
                     need_dw=needs[1], need_db=needs[2])
    out = divergence_forward(hs, ws, bs, ht, wt, bt, targets, counted, denominator, _floats(spec), *args)
    return out[0], out[1], out[2]
