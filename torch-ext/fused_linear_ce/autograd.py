"""The autograd Function: tensors in, one ``Options`` object beside them, fp32 loss out."""

import torch
from torch.autograd.function import once_differentiable

from . import launch, losses
from .validate import Options


def forward_only(hidden, weight, targets, bias, class_weight, opts: Options):
    """(loss, metrics, lse, stats, terms) without autograd. metrics is a (2,) fp32 tensor
    [mean_token_accuracy, entropy] or empty; lse the per-row log-sum-exp."""
    stats = launch.forward(hidden, weight, targets, bias, class_weight, opts)
    terms = losses.row_terms(stats, targets, class_weight, opts, weight.shape[0])
    loss = losses.reduce(terms, opts)
    metrics = losses.metrics(stats, terms) if opts.return_metrics else loss.new_empty((0,))
    return loss, metrics, stats, terms


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, class_weight, opts: Options):
        loss, metrics, stats, terms = forward_only(hidden, weight, targets, bias, class_weight, opts)
        lse = stats.lse.clone() if opts.return_lse else stats.lse.new_empty((0,))
        ctx.save_for_backward(hidden, weight, bias, targets, class_weight, stats.lse)
        ctx.terms = terms
        ctx.opts = opts
        ctx.mark_non_differentiable(metrics)
        if not opts.return_lse:
            ctx.mark_non_differentiable(lse)
        return loss, metrics, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_metrics, grad_lse):
        hidden, weight, bias, targets, class_weight, lse = ctx.saved_tensors
        opts: Options = ctx.opts
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        v = weight.shape[0]
        grad_lse = grad_lse if opts.return_lse else None
        coef = losses.coefficients(grad_loss, grad_lse, lse, targets, class_weight, ctx.terms, opts, v)
        grad_hidden, grad_weight, grad_bias = launch.backward(
            hidden, weight, targets, bias, class_weight, lse, coef, opts, need_dx, need_dw, need_db
        )
        return grad_hidden, grad_weight, grad_bias, None, None, None
