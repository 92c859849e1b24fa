"""The per-token public function: log-probs, entropy and friends per row, without the (N, V) logits."""

import torch

from . import tokens, topk as _topk
from .api import head_call
from .plan import exponentials_unsupported
from .validate import Options, check_flag


def check_outputs(outputs) -> tuple:
    if isinstance(outputs, str) or not all(isinstance(x, str) for x in outputs):
        raise TypeError(f"outputs must be a tuple of field names among {tokens.FIELDS}, got {outputs!r}")
    unknown = sorted(set(outputs) - set(tokens.FIELDS))
    if unknown:
        raise ValueError(f"unknown outputs {unknown}; choose among {tokens.FIELDS}")
    return tuple(name for name in tokens.FIELDS if name in outputs)  # canonical order, no duplicates


def _check_exponentials(opts: Options, n: int, v: int, dtype: torch.dtype) -> None:
    """strategy="chunked" asked for: raises where its exponentials cannot be kept
    (``plan.exponentials_unsupported``)."""
    why = exponentials_unsupported(opts, n, v, dtype)
    if why is not None:
        raise ValueError(f'strategy="chunked" keeps the exponentials from the forward to the backward and cannot '
                         f'take {why}; use strategy="recompute" or "auto"')


def fused_linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None, *,
    temperature: float = 1.0, logit_scale: float = 1.0, softcap: float | None = None, outputs=("log_probs",),
    ignore_index: int = -100, shift: bool = False, process_group=None, chunk_bytes: int | None = None,
    strategy: str = "auto", topk: bool = False,
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
            backward recomputes the logits in blocks within ``chunk_bytes`` (default 192 MiB).
            "chunked": the forward keeps the exponentials of all rows, N x V in the input dtype,
            which the backward turns into the logits' gradient in place: one product fewer; they
            must fit in ``chunk_bytes`` (default 256 MiB), not with a softcap and the entropy
            (ValueError); a second backward through the graph recomputes. "auto" (default):
            "chunked" where possible (``plan.plan_tokens``), else "recompute". Without gradients
            both run the forward sweep alone (docs/design.md, "Per-token outputs").
        topk: ``targets`` is (..., k), k ids per row (a teacher's top-k), and ``log_probs`` (..., k)
            the log-prob of each, 0 for ``ignore_index`` (padding), NaN out of [0, V),
            differentiable; one sweep and the k logits gathered in fp32. The other fields stay per
            row; "is_top1" and ``process_group`` are refused; ``shift`` moves the ids along the
            second-to-last dim. Explicit: (N, k) targets with 2-D hidden are never guessed as k ids.

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
    rows, weight, bias, flat, lead = head_call(hidden, weight, targets, bias, opts, shift, process_group)
    if strategy == "chunked":
        _check_exponentials(opts, flat.numel(), weight.shape[0], rows.dtype)
    out = tokens.apply(rows, weight, flat, bias, opts, process_group)
    return {name: t.reshape(lead) for name, t in out.items()}
