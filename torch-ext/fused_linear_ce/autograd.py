"""The autograd Function: tensors in, one ``Options`` object beside them, fp32 loss out."""

import torch
from torch.autograd.function import once_differentiable

from . import launch
from .validate import Options


def counted_rows(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Number of rows whose target is not ignore_index, as a 0-d fp32 tensor (no host sync)."""
    return (targets != ignore_index).sum().to(torch.float32)


def reduce(stats: launch.RowStats, targets: torch.Tensor, opts: Options):
    """(loss, metrics) from the per-row statistics; metrics is a (2,) fp32 tensor
    [mean_token_accuracy, entropy] or an empty tensor when not asked for."""
    count = counted_rows(targets, opts.ignore_index)
    if opts.reduction == "none":
        loss = stats.loss
    elif opts.reduction == "sum":
        loss = stats.loss.sum()
    else:
        loss = stats.loss.sum() / count
    if opts.return_metrics:
        metrics = torch.stack([stats.correct.sum(), stats.entropy.sum()]) / count
    else:
        metrics = stats.loss.new_empty((0,))
    return loss, metrics


def row_gradient(grad_loss: torch.Tensor, targets: torch.Tensor, opts: Options) -> torch.Tensor:
    """The upstream gradient of each row's loss, fp32 (N,): 0 on ignored rows."""
    n = targets.shape[0]
    g = grad_loss.to(torch.float32)
    if opts.reduction == "mean":
        g = g / counted_rows(targets, opts.ignore_index)
    g = g.expand(n) if g.ndim == 0 else g
    return torch.where(targets != opts.ignore_index, g, torch.zeros((), device=g.device)).contiguous()


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, opts: Options):
        stats = launch.forward(hidden, weight, targets, bias, opts)
        loss, metrics = reduce(stats, targets, opts)
        ctx.save_for_backward(hidden, weight, bias, targets, stats.lse)
        ctx.opts = opts
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_metrics):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        opts: Options = ctx.opts
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        row_grad = row_gradient(grad_loss, targets, opts)
        grad_hidden, grad_weight, grad_bias = launch.backward(
            hidden, weight, targets, bias, lse, row_grad, opts, need_dx, need_dw, need_db
        )
        return grad_hidden, grad_weight, grad_bias, None, None
