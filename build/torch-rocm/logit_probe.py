"""The logits probe of ``patch_model``: what a model's forward does to its logits between the output
embedding and the loss, read by doing it to a stand-in.

The patched output embedding returns a ``LogitsProbe``, an empty ``(..., 0)`` tensor; every torch
operation the model applies to it runs (on no elements) and is recorded in its ``LogitTransform``.
Multiplications and divisions by numbers (Cohere's ``logit_scale``, Granite's ``logits_scaling``,
Falcon-H1's multiplier), ``c * tanh(z / c)`` (Gemma-2's softcap) and casts (a ``.float()`` before the
loss) are exactly the kernel's ``logit_scale`` and ``softcap`` (``LogitTransform.kernel_options``);
any other operation on the logits raises ``ValueError`` where the model applies it, naming it (no
silent difference).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn


@dataclass(frozen=True)
class LogitTransform:
    """What the model did to its logits z so far: ``num / den * z``, or ``outer * tanh(num / den * z)``.
    Numerator and denominator are kept apart so that Gemma-2's ``c * tanh(z / c)`` gives a
    ``logit_scale`` of exactly ``c / c = 1``."""

    num: float = 1.0
    den: float = 1.0
    tanh: bool = False
    outer: float = 1.0

    def times(self, x: float, divide: bool = False) -> LogitTransform:
        if self.tanh:
            return replace(self, outer=self.outer / x if divide else self.outer * x)
        return replace(self, den=self.den * x) if divide else replace(self, num=self.num * x)

    def kernel_options(self) -> tuple[float, float | None]:
        """``(logit_scale, softcap)`` for ``fused_linear_cross_entropy``: ``softcap(z * scale)`` with
        ``softcap(y) = cap * tanh(y / cap)``."""
        if not self.tanh:
            return self.num / self.den, None
        if not self.outer > 0:
            raise ValueError(f"the model caps its logits as {self.outer} * tanh(...); the kernel's softcap needs a "
                             "positive factor")
        return self.num * self.outer / self.den, self.outer


_T = torch.Tensor
_MUL = {torch.mul, torch.multiply, _T.mul, _T.multiply, _T.__mul__, _T.__rmul__, _T.mul_, _T.__imul__}
_DIV = {torch.div, torch.divide, torch.true_divide, _T.div, _T.divide, _T.true_divide, _T.__truediv__, _T.div_,
        _T.__itruediv__}
_TANH = {torch.tanh, _T.tanh, _T.tanh_, nn.functional.tanh}
_IN_PLACE = {_T.mul_, _T.__imul__, _T.div_, _T.__itruediv__, _T.tanh_}
# Casts and copies: the kernel computes the logits in fp32 from the head's operands, as the model's
# own ``.float()`` before its loss does.
_SAME = {_T.float, _T.to, _T.contiguous, _T.clone, _T.detach, _T.bfloat16, _T.half, _T.type_as, _T.cpu, _T.cuda}


def _scalar(x, name: str) -> float:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.Tensor) and not isinstance(x, LogitsProbe) and x.numel() == 1 and x.is_floating_point():
        if x.requires_grad:
            raise ValueError(f"patch_model: the model's logits are {name} a tensor that requires grad (a learned logit scale): "
                             "the fused loss takes fixed numbers only")
        return float(x.detach().reshape(()).item())
    raise ValueError(f"patch_model: the model's logits are {name} {type(x).__name__} {x!r}: the fused loss takes numbers only")


class LogitsProbe(torch.Tensor):
    """The empty ``(..., 0)`` tensor that the patched output embedding returns in place of the logits.
    Every torch operation on it runs (on no elements) and is recorded in ``transform``; an operation
    that the fused loss cannot reproduce exactly raises ``ValueError`` where the model applies it."""

    transform: LogitTransform
    call: object

    @staticmethod
    def make(like: torch.Tensor, call, transform: LogitTransform) -> LogitsProbe:
        with torch._C.DisableTorchFunctionSubclass():
            probe = like.as_subclass(LogitsProbe)
        probe.transform, probe.call = transform, call
        return probe

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        probes = [a for a in args if isinstance(a, LogitsProbe)]
        if not _holds_tensor(out):  # a read: shape, dtype, device, size(), dim(), ...
            return out
        name = getattr(func, "__name__", repr(func))
        if len(probes) != 1 or not isinstance(out, torch.Tensor):
            raise _unsupported(name)
        probe = probes[0]
        transform = probe.transform
        if func in _SAME:
            pass
        elif func in _TANH and len(args) == 1 and not kwargs:
            if transform.tanh:
                raise _unsupported(name + " (a second tanh)")
            transform = replace(transform, tanh=True)
        elif (func in _MUL or func in _DIV) and len(args) == 2 and not kwargs.get("rounding_mode") and \
                set(kwargs) <= {"rounding_mode"}:
            other = args[1] if args[0] is probe else args[0]
            if func in _DIV and args[0] is not probe:
                raise _unsupported(name + " (a number divided by the logits)")
            divide = func in _DIV
            transform = transform.times(_scalar(other, "divided by" if divide else "multiplied by"), divide)
        else:
            raise _unsupported(name)
        if func in _IN_PLACE:
            probe.transform = transform
            return probe
        return LogitsProbe.make(out, probe.call, transform)


def _holds_tensor(out) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)


def _unsupported(name: str) -> ValueError:
    return ValueError(
        f"patch_model: the model applies `{name}` to its logits between the output embedding and the loss. "
        "The fused loss reproduces multiplications and divisions by numbers and a softcap c * tanh(z / c) "
        "exactly, and nothing else; call fused_linear_ce.unpatch_model(model) to use the model's own loss"
    )


__all__ = ["LogitTransform", "LogitsProbe"]
