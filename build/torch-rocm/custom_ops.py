"""How the package's custom ops are registered, in one place: the op under the package's namespace
with its fake implementation, and, for an op that autograd differentiates, its backward and
setup_context behind the guard of a second backward through one graph.

An op module declares the op (its implementation, its fake, its backward) and calls ``define``; the
backward returns the gradients of the op's leading tensors (hidden, weight, bias, ...) and
``define`` gives every later argument its None.
"""

import inspect

import torch

# The ops' namespace: the package's own module name, unique per build (the loader imports each build
# under its own id), so two builds can live in one process.
NAMESPACE = __name__.split(".")[0].lstrip("_") or "fused_linear_ce"


def define(name: str, impl, fake, *, mutates_args=(), backward=None, setup_context=None, guard: str | None = None):
    """``impl`` as the custom op ``NAMESPACE::name`` (its schema from ``impl``'s annotations), with
    ``fake`` its fake implementation. With ``backward`` (and ``setup_context``) it is differentiable:
    ``backward(ctx, *grad_outputs)`` returns the gradients of the op's first arguments, the rest get
    None. ``guard``: the public function whose forward may form the gradients, whose backward first
    calls ``check_spent`` (``ctx.spent``, set empty here before ``setup_context``)."""
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)(impl)
    op.register_fake(fake)
    if backward is None:
        return op
    arity = len(inspect.signature(impl).parameters)

    def setup(ctx, inputs, output):
        ctx.spent = ()
        setup_context(ctx, inputs, output)

    def differentiate(ctx, *grad_outputs):
        if guard is not None:
            check_spent(ctx, guard)
        grads = tuple(backward(ctx, *grad_outputs))
        return grads + (None,) * (arity - len(grads))

    op.register_autograd(differentiate, setup_context=setup)
    return op


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
    a second backward through a graph whose gradients ``saved_gradients.scale_saved`` scaled in place
    (``ctx.spent`` names them) raises (``_spent``, named for ``function``) before anything is read
    (reading ``ctx.saved_tensors`` would raise autograd's version-counter error instead) or written.
    (A graph freed without retain_graph=True never gets here: autograd raises its own error before it
    calls a backward whose saved tensors are freed.)"""
    if ctx.spent:
        raise _spent(ctx.spent, function)
