"""The backward of the modes that form the gradients in the forward (the loss's and the divergence's
CHUNKED, HOSTED, LONG_CONTEXT): the saved gradients, those of an upstream gradient of 1, times the
real one; and the guard of a second backward through the same graph, whose gradients the first
scaled in place.
"""

import torch

from . import opargs, products


@torch.library.custom_op(f"{opargs.NAMESPACE}::scale_gradients", mutates_args=())
def scale_gradients(
    grad_hidden: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor, grad_loss: torch.Tensor,
    hidden_dtype: torch.dtype, weight_dtype: torch.dtype, bias_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked path's backward: the gradients computed in the forward for an upstream gradient
    of 1 (``chunked.unit_dtype``), times the real one, in the leaves' dtypes, computed in fp32 with
    one rounding (``products.scale``, no fp32 copy of the gradient); exact
    when the upstream gradient is a power of two, as 1 is. An op without an autograd formula, like
    ``ops.backward``: differentiating it again raises."""
    g = grad_loss.to(torch.float32)
    return tuple(products.scale(t, g, d) for t, d in ((grad_hidden, hidden_dtype), (grad_weight, weight_dtype),
                                                   (grad_bias, bias_dtype)))


@scale_gradients.register_fake
def _(grad_hidden, grad_weight, grad_bias, grad_loss, hidden_dtype, weight_dtype, bias_dtype):
    return (grad_hidden.new_empty(grad_hidden.shape, dtype=hidden_dtype),
            grad_weight.new_empty(grad_weight.shape, dtype=weight_dtype),
            grad_bias.new_empty(grad_bias.shape, dtype=bias_dtype))


@torch.library.custom_op(f"{opargs.NAMESPACE}::scale_in_place", mutates_args=("grad",))
def scale_in_place(grad: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """grad *= the upstream gradient, in place (fp32 arithmetic, one rounding, ``products.scale``): a
    chunked-path gradient already in its leaf's dtype."""
    products.scale(grad, grad_loss.to(torch.float32), out=grad)


@scale_in_place.register_fake
def _(grad, grad_loss):
    return None


def _spent(names, function: str) -> RuntimeError:
    """The error of a backward through a graph whose chunked-path gradients an earlier backward
    scaled in place: they are the leaves' gradients now (autograd may have made that very tensor
    ``.grad``), and recomputing them would need ``hidden``, which this path does not keep: keeping
    it would cost every single backward N x H bytes."""
    return RuntimeError(
        f"{function}: a second backward through the same graph (retain_graph=True) on the chunked "
        "path (strategy=\"chunked\", or \"auto\" for this call) is not supported: its forward computed the "
        f"gradients, the first backward scaled those of {' and '.join(names)} in place into the leaves' gradients, "
        "and the path does not keep hidden to compute them again. Use strategy=\"recompute\", whose every backward "
        "recomputes the gradients, to backward through one graph more than once.")


def check_spent(ctx, function: str) -> None:
    """The first thing of a backward that may take the chunked path (the loss's, the divergence's):
    a second backward through a graph whose gradients ``scale_saved`` scaled in place raises
    (``_spent``, named for ``function``) before anything is read (reading ``ctx.saved_tensors`` would
    raise autograd's version-counter error instead) or written. (A graph freed without
    retain_graph=True never gets here: autograd raises its own error before it calls a backward
    whose saved tensors are freed.)"""
    if ctx.spent:
        raise _spent(ctx.spent, function)


def scale_saved(ctx, saved, grad_loss: torch.Tensor, needs) -> list:
    """The chunked path's backward, the loss's and the divergence's (after ``check_spent``): its
    forward's gradients ``saved`` (grad_hidden, grad_weight, grad_bias for an upstream gradient of 1,
    ``needs`` those computed) times ``grad_loss``, in the leaves' dtypes ``ctx.dtypes``.

    A gradient already in its leaf's dtype (bf16 and fp32 inputs, an fp32 master weight) is scaled
    where it is and becomes the leaf's gradient: no second gradient-sized tensor (a V x H one) at the
    backward's peak; ``ctx.spent`` then names it. fp16's fp32 unit gradients and the bias's fp32 sums
    are scaled into new tensors of the leaves' dtypes, and so is everything under create_graph=True
    (differentiating the result must reach ``scale_gradients`` and raise its clear error): those stay
    as the forward left them, for any number of backwards."""
    in_place = [need and t.dtype == d and not torch.is_grad_enabled()
                for t, d, need in zip(saved[:2], ctx.dtypes[:2], needs[:2])]
    ctx.spent = tuple(name for name, yes in zip(("hidden", "weight"), in_place) if yes)
    for t, yes in zip(saved[:2], in_place):
        if yes:
            scale_in_place(t, grad_loss)
    rest = [t.new_empty((0,)) if yes else t for t, yes in zip(saved[:2], in_place)]
    scaled = list(scale_gradients(*rest, saved[2], grad_loss, *ctx.dtypes))
    scaled[:2] = [t if yes else out for t, out, yes in zip(saved[:2], scaled[:2], in_place)]
    return scaled
