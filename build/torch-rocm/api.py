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
    shift: bool = False,
    num_items_in_batch: int | torch.Tensor | None = None,
    process_group=None,
    chunk_bytes: int | None = None,
    strategy: str = "auto",
):
    """Computes ``F.cross_entropy(softcap((hidden @ weight.T + bias) * logit_scale), targets)`` with
    fp32 logits, without materialising the (N, V) logits.

    Args:
        hidden: (N, H) or (..., H) float32, bfloat16 or float16; any strides (2-D inputs are
            never copied; others are reshaped, which copies only when they are not contiguous).
        weight: (V, H), same dtype as ``hidden`` (under ``torch.autocast`` both are cast to the
            autocast dtype, as ``F.linear`` does; an fp32 weight under a 16-bit autocast is cast
            inside the op instead, and its fp32 gradient is summed in fp32 without a 16-bit copy:
            on the chunked path, which "auto" then takes at any N, straight into the result).
        targets: (N,) or hidden's leading shape (...), int64 (int32 accepted), class ids in
            [0, V) or ``ignore_index``.
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
        shift: causal-LM targets: row t of each sequence (the last dim of ``targets``) is scored
            against target t + 1, the last row of each sequence against nothing. No copy of hidden.
        num_items_in_batch: int or 0-d tensor: the loss is the summed loss divided by it (the
            global count of counted tokens under gradient accumulation); no host sync. It is a
            divisor inside the op, so the chunked path's gradients include it before their one
            rounding.
        process_group: vocabulary parallelism (torch.distributed): ``weight`` (and ``bias``,
            ``class_weight``) are this rank's contiguous shard of the vocabulary, equal sizes, ranks
            in group order; ``targets`` are global ids. Every rank gets the loss, metrics and lse of
            the whole vocabulary and the full ``hidden`` gradient (already all-reduced: do not reduce
            it again), and its own shard's weight and bias gradients. See ``parallel.py``.
        chunk_bytes: the memory knob (default: 192 MiB on the recompute path, 256 MiB chunks on the
            chunked path). On the recompute path, the most bytes the backward's gradient-of-logits
            blocks and fp32 accumulators take together, at any N (how it walks the (N, V) plane
            within them: ``backward_passes.plan_passes``). On the chunked path it bounds the buffer
            of one chunk of rows instead (plus, with several chunks, the int8 V x H remainder of a
            bf16 grad_weight); on "auto"'s long-context chunked path, the buffer and its 4-bit
            V x H / 2 remainder together. Larger means fewer, larger products; see the README for
            measured time against memory.
        strategy: how the gradients are computed. "recompute": the forward keeps only the per-row
            lse; the backward recomputes the logits block by block (4 products in all, memory set
            by ``chunk_bytes``). "chunked": the forward computes the gradients too, chunk of rows by
            chunk of rows (3 products; each chunk's exponentials turned into their gradient in
            place; with more than one chunk a bf16 grad_weight is summed across them as a pair,
            itself and an int8 V x H remainder), and the backward only scales them; not with
            ``reduction="none"``, ``return_lse`` or softcap together with label smoothing
            (ValueError). "auto" (default): "chunked" where the options allow it and it saves time
            or memory (the rule, decided once per call: ``plan.plan_loss``), else "recompute". The
            chunked path holds the gradients from the forward to the backward, and its first backward
            scales bf16 / fp32 ones in place into ``.grad``: a second through the same graph
            (``retain_graph=True``) raises, where "recompute" backwards any number of times. Without gradients
            (``torch.no_grad``, nothing requires grad) both run the forward sweep only.

    Returns:
        The loss as fp32 (0-d, or targets' shape with ``reduction="none"``); with ``return_metrics`` a
        tuple ``(loss, metrics)``, metrics a dict of 0-d fp32 tensors: ``mean_token_accuracy``,
        ``entropy``, and the raw sums ``num_correct``, ``entropy_sum``, ``num_counted`` for
        reducing across ranks; with ``return_lse`` the lse (targets' shape) is
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
        strategy=strategy,
    )
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
        targets = shift_targets(targets, ignore_index)
    if class_weight is not None:
        class_weight = class_weight.to(torch.float32).contiguous()
    divisor = None
    if num_items_in_batch is not None:
        opts = replace(opts, reduction="sum")
        divisor = ops.count_tensor(num_items_in_batch, hidden.device)
    rows = hidden.reshape(targets.numel(), hidden.shape[-1])  # not reshape(-1, H): H may be 0
    loss, sums, lse, *_ = ops.apply(rows, weight, targets.reshape(-1), bias, class_weight, opts, process_group, divisor)
    if reduction == "none":
        loss = loss.reshape(lead)
    out = [loss]
    if return_metrics:
        out.append({
            "mean_token_accuracy": sums[0] / sums[2],
            "entropy": sums[1] / sums[2],
            "num_correct": sums[0],
            "entropy_sum": sums[1],
            "num_counted": sums[2],
        })
    if return_lse:
        out.append(lse.reshape(lead))
    return out[0] if len(out) == 1 else tuple(out)
