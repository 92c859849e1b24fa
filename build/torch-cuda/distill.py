"""The distillation public function: a student-teacher divergence from both LM heads, without either's
(N, V) logits in 16 bits and without the whole (N, V) pair at once (``divergence.py``)."""

import torch

from .api import autocast_head
from . import divergence_ops, ops
from .divergence import Spec
from .validate import (Options, check_device, check_divergence_options, check_head, check_targets,
                       is_master_weight)

OUTPUTS = ("entropy", "log_probs")


def fused_linear_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    beta: float,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    student_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    targets: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    outputs=(),
    chunk_bytes: int | None = None,
    strategy: str = "auto",
):
    """Computes the per-token divergence between the student's ``softmax(z_s)`` and the teacher's
    ``softmax(z_t)``, ``z = softcap((hidden @ weight.T + bias) * logit_scale) / temperature`` for each
    with fp32 logits, without materialising either's (N, V) logits in 16 bits nor both at once.

    beta = 0: forward KL(p_t || p_s); beta = 1: reverse KL(p_s || p_t); 0 < beta < 1: the generalized
    JSD ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``, ``m = (1 - beta) p_s + beta p_t`` (TRL's
    ``generalized_jsd_loss``). Every sum is taken from fp32 log-probabilities (``divergence_kernel``):
    finite for one-hot teachers, beta near 0 or 1 and saturated softcaps.

    Args:
        student_hidden: (N, H_s) or (..., H_s) float32, bfloat16 or float16.
        student_weight: (V, H_s), the same dtype (under ``torch.autocast`` every operand goes in the
            autocast dtype, as ``F.linear`` would, except an fp32 student weight: the op casts it for
            its products and sums its gradient in fp32, never rounded to 16 bits).
        teacher_hidden: (..., H_t) with the student's leading shape; teacher_weight (V, H_t). The
            same dtype as the student's. The teacher gets no gradient (None) even where its
            tensors require one.
        beta: in [0, 1], required.
        student_bias, teacher_bias: optional (V,), the same dtype.
        temperature: > 0, divides both models' logits after their softcap.
        student_logit_scale, teacher_logit_scale: finite, multiply the logits after the bias.
        student_softcap, teacher_softcap: None or > 0: ``c tanh(u / c)``.
        targets: optional (...) int64/int32 class ids: rows whose target is ``ignore_index`` are not
            counted; a counted row whose target is outside [0, V) gets NaN (divergence, log-prob and
            gradient), never an out-of-bounds read. Needed for ``"log_probs"``.
        mask: optional (...) bool, True for counted rows.
        reduction: "mean" (over counted rows, NaN when none), "sum", or "none" (per row, 0 on
            uncounted rows).
        num_items_in_batch: int or 0-d tensor: the sum divided by it instead (no host sync); not with
            "none".
        outputs: a tuple of ``"entropy"`` (the student's, no gradient) and ``"log_probs"`` (the
            student's log-prob of ``targets``, differentiable): returned in a dict beside the
            divergence, each (...) fp32, 0 on uncounted rows.
        chunk_bytes: the memory knob: one chunk's two fp32 (R, V) logit buffers and, for the
            gradients, da of the M >= R rows whose gradient products run together, R x V x 8 +
            M x V x (2 or 4) bytes (default 640 MiB: at 8192 x 2048 x 151936, chunks of 256 rows in
            groups of 1184). The gradients come on top, with the weight's summed over groups in
            fp32 (4 V x H_s bytes; bf16 on the chunked strategy: a bf16 + 4-bit pair, its own bytes
            and V x H_s / 2 more).
        strategy: "chunked" (the gradients formed in the forward, four products a chunk; the backward
            scales them; "mean" / "sum" only), "recompute" (the forward computes values with two
            products a chunk, the backward recomputes the logits: six in all), or "auto" (default):
            "chunked" for "mean" / "sum", else "recompute" (``plan.plan_divergence``). With "chunked", a gradient that
            reaches ``log_probs`` is added by a recompute of that term in the backward.

    Returns:
        The divergence, fp32 (0-d, or (...) with "none"); with ``outputs``, ``(divergence, {field:
        tensor})``.

    Example:
        >>> loss = fused_linear_divergence(h_s, lm_s.weight, h_t, lm_t.weight, beta=0.5, temperature=2.0)
        >>> loss.backward()
    """
    fields = _check_outputs(outputs, targets)
    hs, ws, bs = autocast_head(student_hidden, student_weight, student_bias, keep_fp32_weight=True)
    ht, wt, bt = autocast_head(teacher_hidden, teacher_weight, teacher_bias)
    master = (isinstance(hs, torch.Tensor) and torch.is_autocast_enabled(hs.device.type)
              and isinstance(ws, torch.Tensor) and is_master_weight(hs.dtype, ws.dtype))
    _check_tensors(hs, ws, bs, ht, wt, bt, targets, mask, master)
    check_divergence_options(beta, temperature, student_logit_scale, student_softcap, teacher_logit_scale,
                             teacher_softcap, ignore_index, reduction, num_items_in_batch, chunk_bytes, strategy)
    lead = hs.shape[:-1]
    n = lead.numel()
    if n == 0:
        raise ValueError(f"empty batch: the leading shape {tuple(lead)} holds no rows")
    where = hs.device
    counted = torch.ones((n,), dtype=torch.bool, device=where) if mask is None else mask.reshape(n).clone()
    flat_targets = None
    if targets is not None:
        flat_targets = targets.reshape(n).to(torch.int64)
        counted &= flat_targets != ignore_index
    if reduction == "none":
        denominator = None
    elif num_items_in_batch is not None:
        denominator = ops.count_tensor(num_items_in_batch, where)
    elif reduction == "sum":
        denominator = torch.ones((), device=where)
    else:
        denominator = counted.sum().to(torch.float32)
    spec = Spec(beta=float(beta),
                student=Options(logit_scale=student_logit_scale, softcap=student_softcap, temperature=temperature),
                teacher=Options(logit_scale=teacher_logit_scale, softcap=teacher_softcap, temperature=temperature),
                reduction=reduction)
    rows_s = hs.reshape(n, hs.shape[-1])
    rows_t = ht.reshape(n, ht.shape[-1]).detach()
    div, entropy, log_probs = divergence_ops.apply(
        rows_s, ws, bs, rows_t, wt.detach(), bt.detach() if bt is not None else None, flat_targets,
        counted.to(torch.int8), denominator, spec, strategy, chunk_bytes)
    if reduction == "none":
        div = div.reshape(lead)
    if not fields:
        return div
    values = {"entropy": entropy, "log_probs": log_probs}
    return div, {name: values[name].reshape(lead) for name in fields}


def _check_outputs(outputs, targets) -> tuple:
    if isinstance(outputs, str) or not isinstance(outputs, (tuple, list)) or not all(
            isinstance(x, str) for x in outputs):
        raise TypeError(f"outputs must be a tuple of field names among {OUTPUTS}, got {outputs!r}")
    unknown = sorted(set(outputs) - set(OUTPUTS))
    if unknown:
        raise ValueError(f"unknown outputs {unknown}; choose among {OUTPUTS}")
    if "log_probs" in outputs and targets is None:
        raise ValueError('outputs "log_probs" is the student\'s log-prob of targets: pass targets')
    return tuple(name for name in OUTPUTS if name in outputs)


def _check_tensors(hs, ws, bs, ht, wt, bt, targets, mask, master=False) -> None:
    """Each model's head (``validate.check_head``; ``master``: an fp32 student weight under a 16-bit
    autocast, cast inside the op), one vocabulary, one row shape and one dtype for both, the targets
    and the mask, one device."""
    check_head(hs, ws, bs, "student_", master_weight=master, vocab_parallel=False)
    check_head(ht, wt, bt, "teacher_", vocab_parallel=False)
    if ws.shape[0] != wt.shape[0]:
        raise ValueError(f"vocabulary mismatch: student_weight has V={ws.shape[0]} rows, teacher_weight "
                         f"V={wt.shape[0]}")
    if hs.shape[:-1] != ht.shape[:-1]:
        raise ValueError(f"row mismatch: student_hidden's leading shape {tuple(hs.shape[:-1])} differs from "
                         f"teacher_hidden's {tuple(ht.shape[:-1])}")
    if ht.dtype != hs.dtype:
        raise TypeError(f"dtype mismatch: student_hidden is {hs.dtype}, teacher_hidden is {ht.dtype} (both models "
                        "take one dtype)")
    if targets is not None:
        check_targets(targets, hs, "student_hidden")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = counted), got {mask.dtype}")
        if mask.shape != hs.shape[:-1]:
            raise ValueError(f"mask shape {tuple(mask.shape)} does not match the hidden states' leading shape "
                             f"{tuple(hs.shape[:-1])}")
    check_device((("student_hidden", hs), ("student_weight", ws), ("student_bias", bs), ("teacher_hidden", ht),
                  ("teacher_weight", wt), ("teacher_bias", bt), ("targets", targets), ("mask", mask)))
