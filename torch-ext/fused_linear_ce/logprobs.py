"""The per-token public function: log-probs, entropy and friends per row, without the (N, V) logits."""

import torch

from . import tokens, topk as _topk
from .api import autocast_head, shift_targets
from .plan import exponentials_unsupported
from .validate import Options, check_flag, check_inputs, check_process_group


def check_outputs(outputs) -> tuple:
    if isinstance(outputs, str) or not all(isinstance(x, str) for x in outputs):
        raise TypeError(f"outputs must be a tuple of field names among {tokens.FIELDS}, got {outputs!r}")
    unknown = sorted(set(outputs) - set(tokens.FIELDS))
    if unknown:
        raise ValueError(f"unknown outputs {unknown}; choose among {tokens.FIELDS}")
    return tuple(name for name in tokens.FIELDS if name in outputs)  # canonical order, no duplicates


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    outputs=("log_probs",),
    ignore_index: int = -100,
    shift: bool = False,
    process_group=None,
    chunk_bytes: int | None = None,
    strategy: str = "auto",
    topk: bool = False,
) -> dict:
    """Per-token ``log_softmax(z)[t]`` and, on request, the entropy, ``log sum p^2``, the mean logit
    and whether the target is the top-1 class, for ``z = softcap((hidden @ weight.T + bias) *
    logit_scale) / temperature``, from one vocabulary sweep with fp32 logits, without materialising
    the (N, V) logits.

    Args:
        hidden, weight, targets, bias: as ``fused_linear_cross_entropy`` (same dtypes, leading dims,
            autocast, int32 targets, out-of-range targets give NaN). An fp32 weight under a 16-bit
            autocast is cast inside the op, not kept as a copy from the forward to the backward,
            and its gradient is summed in fp32, never rounded to 16 bits.
        temperature: > 0; divides the logits AFTER the softcap (TRL's order), so with a softcap it is
            not the same as ``logit_scale = 1 / temperature``, which multiplies before it.
        logit_scale, softcap, ignore_index, shift, process_group: as ``fused_linear_cross_entropy``.
        outputs: the fields to return, among ``"log_probs"``, ``"entropy"``, ``"log_sum_sq_probs"``,
            ``"mean_logits"``, ``"is_top1"``. Each extra field costs a little in the sweep; the
            entropy's gradient costs nothing when the entropy does not reach the loss.
        chunk_bytes, strategy: the memory knob and the path of the backward. "recompute": the
            forward keeps the per-row lse and the backward recomputes the logits in blocks that
            ``chunk_bytes`` bounds (default 192 MiB). "chunked": the forward keeps the sweep's
            exponentials of all rows, N x V in the input dtype, and the backward turns them into the
            logits' gradient in place: one product fewer, for that buffer from the forward to the
            backward; it must fit in ``chunk_bytes`` (256 MiB by default) and cannot take a softcap with the entropy
            (ValueError). The first backward spends that buffer: a later one through the same graph
            (``retain_graph=True``) recomputes as "recompute" does. "auto" (default): "chunked" where it is
            possible (``plan.plan_tokens``), else "recompute". Without gradients (``torch.no_grad``, a reference model)
            both run the forward sweep alone.
        topk: k targets per row (the top-k ids a teacher served elsewhere sends): ``targets`` is
            (..., k), hidden's leading shape plus a trailing k >= 1, and ``log_probs`` is (..., k),
            the log-prob of each id, 0 where the id is ``ignore_index`` (padding), NaN where it is out
            of [0, V); differentiable, ``d/dz = sum_j u_j (onehot(t_j) - p)`` over the non-padded ids.
            One sweep (the lse, through the row's first id in range) and the k logits gathered in
            fp32 (N x k x H, in blocks of rows; no (N, V) tensor). The other fields stay per row
            (...); "is_top1" and ``process_group`` are refused. ``shift`` moves the ids along the
            second-to-last dim. An explicit flag: a (N, k) targets tensor with 2-D hidden is never
            guessed to be k ids per row.

    Returns:
        A dict {field: tensor of targets' shape}, the requested fields in the order above: fp32, and
        bool for ``is_top1``. Rows whose target is ``ignore_index`` hold 0 (False). ``log_probs`` and
        ``entropy`` are differentiable for any upstream gradient (``d entropy / dz_v = -p_v (z_v -
        sum_u p_u z_u)``); the other three are marked non-differentiable. ``is_top1`` is True when
        the target is the first index of the largest logit (a tie with an earlier class does not
        count).

    Example:
        >>> out = fused_linear_logprobs(h, w, t, outputs=("log_probs", "entropy"), temperature=0.7)
        >>> (-(out["log_probs"] * advantages).mean() - 0.01 * out["entropy"].mean()).backward()
    """
    fields = check_outputs(outputs)
    check_flag("topk", topk)
    if topk:
        check_flag("shift", shift)
        _topk.check_topk(hidden, weight, targets, fields, process_group)
        return _topk.topk_log_probs(fused_linear_logprobs, hidden, weight, targets, bias, temperature=temperature,
                                    logit_scale=logit_scale, softcap=softcap, outputs=fields,
                                    ignore_index=ignore_index, shift=shift, chunk_bytes=chunk_bytes,
                                    strategy=strategy)
    opts = Options(ignore_index=ignore_index, logit_scale=logit_scale, softcap=softcap, reduction="none",
                   chunk_bytes=chunk_bytes, strategy=strategy, temperature=temperature, outputs=fields)
    hidden, weight, bias = autocast_head(hidden, weight, bias, keep_fp32_weight=True)
    check_flag("shift", shift)
    check_inputs(hidden, weight, targets, bias, opts,
                 master_weight=isinstance(hidden, torch.Tensor) and torch.is_autocast_enabled(hidden.device.type))
    if process_group is not None:
        check_process_group(process_group)
    lead = targets.shape
    n, v = targets.numel(), weight.shape[0]
    if strategy == "chunked" and (why := exponentials_unsupported(opts, n, v, hidden.dtype)) is not None:
        raise ValueError(f'strategy="chunked" keeps the exponentials from the forward to the backward and cannot '
                         f'take {why}; use strategy="recompute" or "auto"')
    targets = targets.to(torch.int64)
    if shift and targets.ndim > 0 and targets.shape[-1] > 0:
        targets = shift_targets(targets, ignore_index)
    rows = hidden.reshape(n, hidden.shape[-1])
    out = tokens.apply(rows, weight, targets.reshape(-1), bias, opts, process_group)
    return {name: t.reshape(lead) for name, t in out.items()}
