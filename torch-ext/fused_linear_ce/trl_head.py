"""A drop-in for TRL's fused LM head: the call contract of TRL 1.16's
``trl.kernels.ChunkedLogProbFunction.apply``, computed by ``fused_linear_logprobs``.

TRL's trainers (SFT, GRPO, RLOO, DPO, KTO) patch the model with ``trl.trainer.utils.add_fused_lm_head``,
which calls ``ChunkedLogProbFunction.apply`` for the per-token fields. ``use_in_trl()`` makes it call
this kernel instead (two lines in a training script; see the README). Written from TRL's public
signature and docstrings only.
"""

import torch

from .logprobs import fused_linear_logprobs

# TRL's ``outputs`` default: the optional fields, log_probs being always computed.
TRL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def chunked_log_probs(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                      logit_scale=1.0, outputs=TRL_OUTPUTS):
    """``ChunkedLogProbFunction.apply(hidden [N, H], weight [V, H], bias [V] | None, targets [N],
    temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0, outputs)`` ->
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each (N,) fp32 (bool for
    is_top1), None where not in ``outputs`` (log_probs always). The logits are
    ``softcap((hidden @ weight.T + bias) * logit_scale) / temperature``; the product runs in the
    autocast dtype under autocast, else in hidden's dtype (weight and bias are cast to it, with
    their gradients flowing back in their own dtype; an fp32 weight under a 16-bit autocast gets
    its gradient summed in fp32, ``fused_linear_logprobs``). ``chunk_size`` (TRL passes 32768) is
    accepted and not used: the kernel tiles the vocabulary itself, and its memory knob is the
    default ``chunk_bytes``. log_probs and entropy carry gradients; the others do not."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if isinstance(hidden, torch.Tensor) and not torch.is_autocast_enabled(hidden.device.type):
        weight = weight.to(hidden.dtype) if isinstance(weight, torch.Tensor) else weight
        bias = bias.to(hidden.dtype) if isinstance(bias, torch.Tensor) else bias
    # Under autocast, fused_linear_logprobs casts hidden and bias, and an fp32 weight inside the op.
    wanted = ("log_probs", *outputs)
    out = fused_linear_logprobs(hidden, weight, targets, bias, temperature=temperature, logit_scale=logit_scale,
                                softcap=final_logit_softcapping, outputs=wanted)
    return tuple(out.get(name) for name in ("log_probs", *TRL_OUTPUTS))


class ChunkedLogProbFunction:
    """Stands where TRL's ``ChunkedLogProbFunction`` stands: only ``apply`` is called."""

    apply = staticmethod(chunked_log_probs)


def use_in_trl():
    """Makes TRL's fused LM head (``add_fused_lm_head``, every trainer's loss head) compute its
    per-token fields with this kernel, for every model patched from now on and those already patched.
    Returns what it replaced (assign it back to undo). Raises RuntimeError when the installed TRL
    does not have the head this replaces (TRL 1.16's ``trl.trainer.utils._ChunkedLogProbFunction``)."""
    try:
        import trl.trainer.utils as trl_utils
    except ImportError as exc:
        raise RuntimeError("use_in_trl needs TRL (pip install trl)") from exc
    if not hasattr(trl_utils, "_ChunkedLogProbFunction"):
        import trl

        raise RuntimeError(f"TRL {trl.__version__} has no trl.trainer.utils._ChunkedLogProbFunction to replace; "
                           "this drop-in follows TRL 1.16's fused LM head")
    previous = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = ChunkedLogProbFunction
    return previous


__all__ = ["ChunkedLogProbFunction", "chunked_log_probs", "use_in_trl"]
