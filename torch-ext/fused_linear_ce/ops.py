"""The forward and backward as PyTorch custom operators, with fake implementations and autograd.

``torch.compile(fullgraph=True)`` sees two opaque ops and their output shapes, so a training step
that calls the loss compiles without a graph break. The namespace is the package's own module name,
unique per build (the loader imports each build under its own id), so two builds can live in one
process. Options travel as scalar arguments; the per-row loss arithmetic (``losses.py``) runs
inside the ops, so their outputs are the final loss, metrics and lse.
"""

from typing import Optional

import torch

from . import launch, losses, parallel
from .validate import Options

NAMESPACE = __name__.split(".")[0].lstrip("_") or "fused_linear_ce"


def _options(ignore_index, logit_scale, softcap, reduction, return_metrics, label_smoothing, z_loss,
             return_lse, chunk_bytes) -> Options:
    return Options(ignore_index=ignore_index, logit_scale=logit_scale, softcap=softcap, reduction=reduction,
                   return_metrics=return_metrics, label_smoothing=label_smoothing, z_loss=z_loss,
                   return_lse=return_lse, chunk_bytes=chunk_bytes)


@torch.library.custom_op(f"{NAMESPACE}::forward", mutates_args=())
def forward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    class_weight: Optional[torch.Tensor], ignore_index: int, logit_scale: float, softcap: Optional[float],
    reduction: str, return_metrics: bool, label_smoothing: float, z_loss: float, return_lse: bool,
    chunk_bytes: Optional[int], group_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, metric sums, lse, lse2): metric sums is (3,) [correct, entropy, counted rows] or (0,);
    lse2 (2, N) is the lse as row max and log-sum, which the backward uses.
    ``group_id`` names a vocabulary-parallel process group (parallel.register), 0 for none."""
    opts = _options(ignore_index, logit_scale, softcap, reduction, return_metrics, label_smoothing, z_loss,
                    return_lse, chunk_bytes)
    shard = parallel.shard_for(group_id, weight.shape[0])
    stats = launch.forward(hidden, weight, targets, bias, class_weight, opts, shard)
    weights = losses.target_weights(targets, class_weight, ignore_index, weight.shape[0], shard)
    loss = losses.reduce(losses.row_terms(stats, weights, opts), opts)
    sums = losses.metric_sums(stats, targets, weights) if return_metrics else loss.new_empty((0,))
    return loss, sums, stats.lse, stats.lse2


@forward.register_fake
def _(hidden, weight, bias, targets, class_weight, ignore_index, logit_scale, softcap, reduction,
      return_metrics, label_smoothing, z_loss, return_lse, chunk_bytes, group_id):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    sums = hidden.new_empty((3,) if return_metrics else (0,), dtype=torch.float32)
    return loss, sums, hidden.new_empty((n,), dtype=torch.float32), hidden.new_empty((2, n), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::backward", mutates_args=())
def backward(
    grad_loss: torch.Tensor, grad_lse: Optional[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor,
    bias: Optional[torch.Tensor], targets: torch.Tensor, class_weight: Optional[torch.Tensor],
    lse2: torch.Tensor, ignore_index: int, logit_scale: float, softcap: Optional[float], reduction: str,
    label_smoothing: float, z_loss: float, chunk_bytes: Optional[int], group_id: int, need_dx: bool,
    need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias), each empty (0,) when not needed."""
    opts = _options(ignore_index, logit_scale, softcap, reduction, False, label_smoothing, z_loss,
                    grad_lse is not None, chunk_bytes)
    shard = parallel.shard_for(group_id, weight.shape[0])
    weights = losses.target_weights(targets, class_weight, ignore_index, weight.shape[0], shard)
    coef, common = losses.coefficients(grad_loss, grad_lse, lse2[0] + lse2[1], targets, weights, opts)
    grads = launch.backward(hidden, weight, targets, bias, class_weight, lse2, coef, opts, need_dx, need_dw, need_db,
                            shard, common)
    return tuple(g if g is not None else hidden.new_empty((0,)) for g in grads)


@backward.register_fake
def _(grad_loss, grad_lse, hidden, weight, bias, targets, class_weight, lse2, ignore_index, logit_scale,
      softcap, reduction, label_smoothing, z_loss, chunk_bytes, group_id, need_dx, need_dw, need_db):
    empty = hidden.new_empty((0,))
    return (
        hidden.new_empty(hidden.shape) if need_dx else empty,
        weight.new_empty(weight.shape) if need_dw else empty,
        weight.new_empty((weight.shape[0],)) if need_db else empty,
    )


_OPTION_NAMES = ("ignore_index", "logit_scale", "softcap", "reduction", "return_metrics", "label_smoothing",
                 "z_loss", "return_lse", "chunk_bytes", "group_id")


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, class_weight, *options = inputs
    ctx.options = dict(zip(_OPTION_NAMES, options))
    ctx.needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    ctx.save_for_backward(hidden, weight, bias, targets, class_weight, output[3])


def _backward(ctx, grad_loss, _grad_sums, grad_lse, _grad_lse2):
    hidden, weight, bias, targets, class_weight, lse2 = ctx.saved_tensors
    o = ctx.options
    dx, dw, db = backward(
        grad_loss, grad_lse if o["return_lse"] else None, hidden, weight, bias, targets, class_weight, lse2,
        o["ignore_index"], o["logit_scale"], o["softcap"], o["reduction"], o["label_smoothing"], o["z_loss"],
        o["chunk_bytes"], o["group_id"], *ctx.needs,
    )
    need_dx, need_dw, need_db = ctx.needs
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None,
            None, None) + (None,) * len(_OPTION_NAMES)


forward.register_autograd(_backward, setup_context=_setup_context)


def apply(hidden, weight, bias, targets, class_weight, opts: Options, group=None):
    """Calls the forward op with ``opts`` spread into its scalar arguments."""
    group_id = parallel.register(group) if group is not None else 0
    options = [getattr(opts, k) for k in _OPTION_NAMES[:-1]] + [group_id]
    return forward(hidden, weight, bias, targets, class_weight, *options)
