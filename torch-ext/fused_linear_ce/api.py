"""The public function."""

import torch

from dataclasses import replace

from . import ops
from .validate import Options, check_flag, check_inputs, check_process_group, is_master_weight


def autocast_head(hidden, weight, bias, keep_fp32_weight=False):
    """Under torch.autocast, the operands go in the autocast dtype as F.linear's would (fp32
    accumulation either way); the casts are differentiable, so gradients reach the parameters in
    their own dtype. ``keep_fp32_weight`` (the loss): an fp32 weight stays fp32 when the autocast
    dtype is 16-bit; the op casts it for its products itself and sums its gradient in fp32 straight
    into the fp32 result (``validate.is_master_weight``), with no 16-bit gradient to cast back."""
    if not isinstance(hidden, torch.Tensor) or not torch.is_autocast_enabled(hidden.device.type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(hidden.device.type)

    def cast(t):
        ok = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype
        return t.to(dtype) if ok else t

    keep = keep_fp32_weight and isinstance(weight, torch.Tensor) and is_master_weight(dtype, weight.dtype)
    return cast(hidden), weight if keep else cast(weight), cast(bias)


def shift_targets(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Targets for causal LM: position t predicts t + 1 along the last dim; the last gets ignore_index.
    Only the targets move (O(N) integers); hidden is used as it is."""
    pad = targets.new_full((*targets.shape[:-1], 1), ignore_index)
    return torch.cat([targets[..., 1:], pad], dim=-1)


def head_call(hidden, weight, targets, bias, opts: Options, shift, process_group, class_weight=None,
              num_items_in_batch=None):
    """One LM head's call checked and in rows (the loss's, the per-token function's): the operands
    under autocast (``autocast_head``, an fp32 weight kept), every input check (``check_inputs``),
    then (rows (N, H), weight, bias, int64 targets (N,) shifted with ``shift``, targets' shape)."""
    hidden, weight, bias = autocast_head(hidden, weight, bias, keep_fp32_weight=True)
    check_flag("shift", shift)
    check_inputs(hidden, weight, targets, bias, opts, class_weight, num_items_in_batch,
                 master_weight=isinstance(hidden, torch.Tensor) and torch.is_autocast_enabled(hidden.device.type))
    if process_group is not None:
        check_process_group(process_group)
    lead = targets.shape
    # int32 targets are compared with ignore_index (any int64) and class ids in int64: an O(N) copy.
    targets = targets.to(torch.int64)
    if shift and targets.ndim > 0 and targets.shape[-1] > 0:
        targets = shift_targets(targets, opts.ignore_index)
    rows = hidden.reshape(targets.numel(), hidden.shape[-1])  # not reshape(-1, H): H may be 0
    return rows, weight, bias, targets.reshape(-1), lead


def _divisor(opts: Options, num_items_in_batch, where: torch.device):
    """(opts, divisor): with ``num_items_in_batch`` the loss is the sum over it (a 0-d fp32 tensor on
    ``where``), else the reduction as given and no divisor."""
    if num_items_in_batch is None:
        return opts, None
    return replace(opts, reduction="sum"), ops.count_tensor(num_items_in_batch, where)


def _results(loss, sums, lse, lead, reduction: str, return_metrics: bool, return_lse: bool):
    """The public return value: the loss in ``lead`` shape with "none", then the metrics dict and the
    lse where asked."""
    out = [loss.reshape(lead) if reduction == "none" else loss]
    if return_metrics:
        out.append({"mean_token_accuracy": sums[0] / sums[2], "entropy": sums[1] / sums[2], "num_correct": sums[0],
                    "entropy_sum": sums[1], "num_counted": sums[2]})
    if return_lse:
        out.append(lse.reshape(lead))
    return out[0] if len(out) == 1 else tuple(out)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None,
    ignore_index: int = -100, logit_scale: float = 1.0, softcap: float | None = None, reduction: str = "mean",
    return_metrics: bool = False, *, label_smoothing: float = 0.0, z_loss: float = 0.0,
    class_weight: torch.Tensor | None = None, return_lse: bool = False, shift: bool = False,
    num_items_in_batch: int | torch.Tensor | None = None, process_group=None, chunk_bytes: int | None = None,
    strategy: str = "auto",
):
    """Computes ``F.cross_entropy(softcap((hidden @ weight.T + bias) * logit_scale), targets)`` with
    fp32 logits, without materialising the (N, V) logits.

    Args:
        hidden: (N, H) or (..., H) float32, bfloat16 or float16, any strides (2-D never copied).
        weight: (V, H), hidden's dtype; under ``torch.autocast`` both take the autocast dtype as in
            ``F.linear``, except an fp32 weight, cast inside the op with its gradient summed in fp32
            (docs/design.md, "fp32 master weights under autocast").
        targets: (N,) or hidden's leading shape, int64 (int32 accepted), in [0, V) or ``ignore_index``.
        bias: optional (V,), hidden's dtype.
        ignore_index: rows with this target count for nothing and get zero gradient.
        logit_scale: multiplies the logits (after the bias, before the softcap); 1/temperature.
        softcap: if given, ``z = softcap * tanh(z / softcap)`` (Gemma-2); must be > 0.
        reduction: "mean" (over counted rows), "sum", or "none" ((N,) per-row losses).
        return_metrics: also return ``{"mean_token_accuracy", "entropy"}`` over counted rows from the
            same sweep; forward-only, loss and gradients unchanged bit for bit.
        label_smoothing: eps in [0, 1], as ``F.cross_entropy(label_smoothing=eps)``.
        z_loss: c >= 0: adds ``c * lse**2`` per counted row (PaLM), averaged by "mean".
        class_weight: optional (V,) float tensor, as ``F.cross_entropy(weight=...)``; no gradient.
        return_lse: also return the per-row log-sum-exp of z, (N,) fp32, differentiable.
        shift: causal-LM targets: row t of each sequence (the last dim of ``targets``) is scored
            against target t + 1, the last row against nothing. No copy of hidden.
        num_items_in_batch: int or 0-d tensor: the summed loss divided by it (the global count of
            counted tokens under gradient accumulation), inside the op; no host sync.
        process_group: vocabulary parallelism: ``weight`` (and ``bias``, ``class_weight``) are this
            rank's equal, contiguous shard of the vocabulary in group order, ``targets`` global ids;
            every rank gets the whole loss, metrics, lse and (all-reduced) hidden gradient, and its
            shard's weight and bias gradients (``parallel.py``).
        chunk_bytes: the memory knob (default 192 MiB on the recompute path, 256 MiB chunks on the
            chunked path); larger means fewer, larger products (docs/design.md, "The two strategies
            and the memory knob").
        strategy: "recompute" (the forward keeps the per-row lse, the backward recomputes the logits
            in blocks: 4 products), "chunked" (the forward forms the gradients a chunk of rows at a
            time, the backward scales them: 3 products; not with ``reduction="none"``,
            ``return_lse`` or softcap with label smoothing: ValueError), or "auto" (default):
            "chunked" where the options allow it and it saves time or memory, else "recompute"
            (the rule: ``plan.plan_loss``). A second backward through one graph raises on the
            chunked path. Without gradients both run the forward sweep only.

    Returns:
        The fp32 loss (0-d, or targets' shape with "none"); with ``return_metrics`` ``(loss,
        metrics)``, metrics 0-d fp32 ``mean_token_accuracy``, ``entropy`` and the raw sums
        ``num_correct``, ``entropy_sum``, ``num_counted``; with ``return_lse`` the lse (targets'
        shape) appended. An out-of-range target gives a NaN loss and gradient (never read out of
        bounds); "mean" over no counted rows is NaN, like ``F.cross_entropy``.

    Example:
        >>> h = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        >>> w = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        >>> t = torch.randint(0, 1000, (8,), device="cuda")
        >>> loss, metrics = fused_linear_cross_entropy(h, w, t, return_metrics=True)
        >>> loss.backward()
    """
    opts = Options(ignore_index=ignore_index, logit_scale=logit_scale, softcap=softcap, reduction=reduction,
                   return_metrics=return_metrics, label_smoothing=label_smoothing, z_loss=z_loss,
                   return_lse=return_lse, chunk_bytes=chunk_bytes, strategy=strategy)
    rows, weight, bias, flat, lead = head_call(hidden, weight, targets, bias, opts, shift, process_group,
                                               class_weight, num_items_in_batch)
    if class_weight is not None:
        class_weight = class_weight.to(torch.float32).contiguous()
    opts, divisor = _divisor(opts, num_items_in_batch, rows.device)
    loss, sums, lse, *_ = ops.apply(rows, weight, flat, bias, class_weight, opts, process_group, divisor)
    return _results(loss, sums, lse, lead, reduction, return_metrics, return_lse)
