"""The public function."""

import torch

from .autograd import FusedLinearCrossEntropyFunction, forward_only
from .validate import Options, check_inputs


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    reduction: str = "mean",
    return_metrics: bool = False,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    class_weight: torch.Tensor | None = None,
    return_lse: bool = False,
    chunk_bytes: int | None = None,
):
    """Computes ``F.cross_entropy(softcap((hidden @ weight.T + bias) * logit_scale), targets)`` with
    fp32 logits, without materialising the (N, V) logits.

    Args:
        hidden: (N, H) float32, bfloat16 or float16; any strides.
        weight: (V, H), same dtype as ``hidden``.
        targets: (N,) int64 (int32 accepted) class ids in [0, V), or ``ignore_index``.
        bias: optional (V,), same dtype.
        ignore_index: rows with this target count for nothing and get zero gradient.
        logit_scale: multiplies the logits (after the bias, before the softcap); 1/temperature.
        softcap: if given, ``z = softcap * tanh(z / softcap)`` (Gemma-2); must be > 0.
        reduction: "mean" (over counted rows), "sum", or "none" ((N,) per-row losses).
        return_metrics: also return ``{"mean_token_accuracy", "entropy"}`` over counted rows,
            computed in the same sweep; forward-only, loss and gradients unchanged bit for bit.
        label_smoothing: eps in [0, 1]: ``(1 - eps)`` on the target and ``eps / V`` on every class,
            as ``F.cross_entropy(label_smoothing=eps)``.
        z_loss: c >= 0: adds ``c * lse**2`` per counted row (PaLM); "mean" averages it over counted
            rows.
        class_weight: optional (V,) float tensor, as ``F.cross_entropy(weight=...)``: a row's loss is
            scaled by the weight of its target and "mean" divides by the sum of those weights. It
            receives no gradient.
        return_lse: also return the per-row log-sum-exp of z, (N,) fp32, differentiable (every row,
            ignored ones included).
        chunk_bytes: the memory knob: the most bytes the backward's gradient-of-logits block may
            take (default 256 MiB). The backward walks the (N, V) plane in blocks of whole
            vocabulary rows or whole batch columns, whichever needs the smaller fp32 accumulator
            (V x H or N x H; none for fp32 inputs or when the whole plane fits). Larger blocks mean
            fewer, larger products; see the README for measured time against memory.

    Returns:
        The loss as fp32 (0-d, or (N,) with ``reduction="none"``); with ``return_metrics`` a tuple
        ``(loss, metrics)``, metrics a dict of 0-d fp32 tensors; with ``return_lse`` the lse is
        appended: ``(loss, lse)`` or ``(loss, metrics, lse)``. A row whose target is out of range
        (neither ``ignore_index`` nor in [0, V)) has a NaN loss and NaN gradient; it is never read
        out of bounds. "mean" over zero counted rows is NaN, like ``F.cross_entropy``.

    Example:
        >>> h = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        >>> w = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        >>> t = torch.randint(0, 1000, (8,), device="cuda")
        >>> loss, metrics = fused_linear_cross_entropy(h, w, t, return_metrics=True)
        >>> loss.backward()
    """
    opts = Options(
        ignore_index=ignore_index,
        logit_scale=logit_scale,
        softcap=softcap,
        reduction=reduction,
        return_metrics=return_metrics,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        return_lse=return_lse,
        chunk_bytes=chunk_bytes,
    )
    check_inputs(hidden, weight, targets, bias, opts, class_weight)
    if class_weight is not None:
        class_weight = class_weight.to(torch.float32).contiguous()
    params = [t for t in (hidden, weight, bias) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in params):
        loss, metrics, lse = FusedLinearCrossEntropyFunction.apply(
            hidden, weight, bias, targets, class_weight, opts
        )
    else:
        loss, metrics, stats, _ = forward_only(hidden, weight, targets, bias, class_weight, opts)
        lse = stats.lse
    out = [loss]
    if return_metrics:
        out.append({"mean_token_accuracy": metrics[0], "entropy": metrics[1]})
    if return_lse:
        out.append(lse)
    return out[0] if len(out) == 1 else tuple(out)
