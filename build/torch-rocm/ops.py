"""The forward and backward as PyTorch custom operators, with fake implementations and autograd.

``torch.compile(fullgraph=True)`` sees two opaque ops and their output shapes, so a training step
that calls the loss compiles without a graph break. The namespace is the package's own module name,
unique per build (the loader imports each build under its own id), so two builds can live in one
process. Options travel as scalar arguments, the float ones as one CPU tensor (``scalars``); the
per-row loss arithmetic (``losses.py``) runs inside the ops, so their outputs are the final loss,
metrics and lse.
"""

import math
from typing import Optional

import torch

from . import chunked, losses, parallel, products, recompute, sweep
from .validate import Options

NAMESPACE = __name__.split(".")[0].lstrip("_") or "fused_linear_ce"


def scalars(opts: Options) -> torch.Tensor:
    """The float options as one CPU float64 tensor (4,): logit_scale, softcap (NaN for none),
    label_smoothing, z_loss. A custom op's ``float`` argument makes ``torch.compile`` specialise on
    its value (a recompile per temperature of a schedule); a tensor argument does not, and its
    values are read inside the op on the host (a CPU tensor: no device sync)."""
    cap = opts.softcap if opts.softcap is not None else math.nan
    return float_tensor((opts.logit_scale, cap, opts.label_smoothing, opts.z_loss))


def float_tensor(values) -> torch.Tensor:
    """Floats as one CPU float64 tensor, traceable: under ``torch.compile`` they may be symbolic."""
    if not torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float64)
    # Traced: arithmetic on the (possibly symbolic) floats keeps them graph inputs.
    one = torch.ones((), dtype=torch.float64)
    return torch.stack([one * x for x in values])


def _options(scalars_: Optional[torch.Tensor], ignore_index, has_softcap, reduction, return_metrics, smoothing,
             return_lse, chunk_bytes, strategy="recompute") -> Options:
    """The Options inside an op. ``scalars_`` None (a fake implementation, which cannot read values):
    placeholders that keep only what decides shapes and the path (a softcap or not, smoothing or not)."""
    if scalars_ is None:
        logit_scale, softcap, label_smoothing, z_loss = 1.0, 1.0, 0.5 if smoothing else 0.0, 0.0
    else:
        logit_scale, softcap, label_smoothing, z_loss = scalars_.tolist()
    return Options(ignore_index=ignore_index, logit_scale=logit_scale, softcap=softcap if has_softcap else None,
                   reduction=reduction, return_metrics=return_metrics, label_smoothing=label_smoothing,
                   z_loss=z_loss, return_lse=return_lse, chunk_bytes=chunk_bytes, strategy=strategy)


# The forward op's arguments after ``scalars``, in order (``apply`` packs them, ``_forward_call`` unpacks).
_OPTION_NAMES = ("ignore_index", "has_softcap", "reduction", "return_metrics", "smoothing", "return_lse",
                 "chunk_bytes", "strategy", "group_id", "need_dx", "need_dw", "need_db")


def _forward_call(scalars_: Optional[torch.Tensor], hidden, weight, options: tuple):
    """The forward op's options unpacked, and its path decided, in one place for the three that need
    them (the op, its fake implementation, the autograd context), which share only the op's
    arguments: (Options, {option name: value}, the gradients wanted, whether the chunked path runs)."""
    o = dict(zip(_OPTION_NAMES, options))
    opts = _options(scalars_, o["ignore_index"], o["has_softcap"], o["reduction"], o["return_metrics"], o["smoothing"],
                    o["return_lse"], o["chunk_bytes"], o["strategy"])
    needs = (o["need_dx"], o["need_dw"], o["need_db"])
    master = weight.dtype != hidden.dtype
    return opts, o, needs, chunked.use(opts, hidden.shape[0], weight.shape[0], hidden.shape[1], hidden.dtype, needs,
                                       master, sharded=o["group_id"] != 0, where=hidden.device)


def low_weight(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The weight in hidden's dtype: an fp32 master weight (``validate.is_master_weight``) cast for
    the products, once per op (``torch.autocast`` would keep the same copy; its gradient stays the
    products' fp32 sum, never rounded to 16 bits), else itself. The loss's and the divergence's ops."""
    return weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)


def count_tensor(num_items, where: torch.device) -> torch.Tensor:
    """``num_items_in_batch`` (an int, a float or a tensor) as a 0-d fp32 tensor on ``where``: a
    tensor is moved (no sync on its own device), a number filled, not copied from the host (no sync,
    and CUDA-graph capturable)."""
    if isinstance(num_items, torch.Tensor):
        return num_items.to(device=where, dtype=torch.float32)
    return torch.full((), float(num_items), device=where)


@torch.library.custom_op(f"{NAMESPACE}::forward", mutates_args=())
def forward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    class_weight: Optional[torch.Tensor], divisor: Optional[torch.Tensor], scalars: torch.Tensor, ignore_index: int,
    has_softcap: bool, reduction: str, return_metrics: bool, smoothing: bool, return_lse: bool,
    chunk_bytes: Optional[int], strategy: str, group_id: int, need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, metric sums, lse, lse2, grad_hidden, grad_weight, grad_bias): metric sums is (3,)
    [correct, entropy, counted rows] or (0,); lse2 (2, N) is the lse as row max and log-sum, which
    the recompute backward uses. The three gradients are those of an upstream gradient of 1 when
    the chunked path runs (``chunked.use``), else empty (0,). ``divisor`` (fp32 0-d, with "sum"):
    the loss is the sum over it (``num_items_in_batch``), inside the op so that the chunked path
    applies it with the rest of the common factor to its products (``products.product``).
    ``group_id`` names a vocabulary-parallel process group (parallel.register), 0 for none.
    An fp32 ``weight`` with 16-bit ``hidden`` is a master weight: cast here, its gradient fp32.
    ``scalars``: the float options (``scalars``); ``has_softcap`` and ``smoothing`` say whether a
    softcap and label smoothing are on, which the fake implementation needs to pick the path."""
    opts, _, needs, takes_chunked = _forward_call(scalars, hidden, weight, (
        ignore_index, has_softcap, reduction, return_metrics, smoothing, return_lse, chunk_bytes, strategy, group_id,
        need_dx, need_dw, need_db))
    shard = parallel.shard_for(group_id, weight.shape[0])
    sizes = parallel.start_size_check(shard, hidden.device) if shard is not None else None
    grads = [None] * 3
    low = low_weight(weight, hidden)
    if takes_chunked:
        stats, *grads = chunked.forward(hidden, low, targets, bias, class_weight, opts, *needs, shard, divisor,
                                        dw_dtype=weight.dtype)
    else:
        stats = sweep.forward(hidden, low, targets, bias, class_weight, opts, shard)
    del low
    grads = [g if g is not None else hidden.new_empty((0,)) for g in grads]  # distinct outputs
    weights = losses.target_weights(targets, class_weight, ignore_index, weight.shape[0], shard)
    loss = losses.reduce(losses.row_terms(stats, weights, opts), opts)
    if divisor is not None:
        loss = loss / divisor
    sums = losses.metric_sums(stats, targets, weights) if return_metrics else loss.new_empty((0,))
    if sizes is not None:
        parallel.finish_size_check(sizes, shard)
    return (loss, sums, stats.lse, stats.lse2, *grads)


@forward.register_fake
def _(hidden, weight, bias, targets, class_weight, divisor, scalars_, ignore_index, has_softcap, reduction,
      return_metrics, smoothing, return_lse, chunk_bytes, strategy, group_id, need_dx, need_dw, need_db):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    sums = hidden.new_empty((3,) if return_metrics else (0,), dtype=torch.float32)
    _, _, _, use = _forward_call(None, hidden, weight, (
        ignore_index, has_softcap, reduction, return_metrics, smoothing, return_lse, chunk_bytes, strategy, group_id,
        need_dx, need_dw, need_db))
    unit = chunked.unit_dtype(hidden.dtype)
    grads = (
        hidden.new_empty(hidden.shape, dtype=unit) if use and need_dx else hidden.new_empty((0,)),
        weight.new_empty(weight.shape, dtype=chunked.weight_grad_dtype(hidden.dtype, weight.dtype))
        if use and need_dw else hidden.new_empty((0,)),
        weight.new_empty((weight.shape[0],), dtype=torch.float32) if use and need_db else hidden.new_empty((0,)),
    )
    return (loss, sums, hidden.new_empty((n,), dtype=torch.float32),
            hidden.new_empty((2, n), dtype=torch.float32), *grads)


@torch.library.custom_op(f"{NAMESPACE}::backward", mutates_args=())
def backward(
    grad_loss: torch.Tensor, grad_lse: Optional[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor,
    bias: Optional[torch.Tensor], targets: torch.Tensor, class_weight: Optional[torch.Tensor],
    lse2: torch.Tensor, scalars: torch.Tensor, ignore_index: int, has_softcap: bool, reduction: str,
    chunk_bytes: Optional[int], group_id: int, need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias), each empty (0,) when not needed; an fp32 master
    ``weight`` is cast for the products again, and its gradient is summed in fp32
    (``recompute.backward``'s ``dw_dtype``)."""
    opts = _options(scalars, ignore_index, has_softcap, reduction, False, False, grad_lse is not None, chunk_bytes)
    shard = parallel.shard_for(group_id, weight.shape[0])
    weights = losses.target_weights(targets, class_weight, ignore_index, weight.shape[0], shard)
    coef, common = losses.coefficients(grad_loss, grad_lse, lse2[0] + lse2[1], targets, weights, opts)
    dx, dw, db = recompute.backward(hidden, low_weight(weight, hidden), targets, bias, class_weight, lse2, coef, opts,
                                    need_dx, need_dw, need_db, shard, common, dw_dtype=weight.dtype)
    return tuple(g if g is not None else hidden.new_empty((0,)) for g in (dx, dw, db))


@backward.register_fake
def _(grad_loss, grad_lse, hidden, weight, bias, targets, class_weight, lse2, scalars_, ignore_index, has_softcap,
      reduction, chunk_bytes, group_id, need_dx, need_dw, need_db):
    empty = hidden.new_empty((0,))
    return (
        hidden.new_empty(hidden.shape) if need_dx else empty,
        weight.new_empty(weight.shape) if need_dw else empty,
        weight.new_empty((weight.shape[0],)) if need_db else empty,
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, class_weight, divisor, scalars_, *options = inputs
    # ctx.computed: the gradients the forward op was told would be wanted.
    _, ctx.options, ctx.computed, ctx.chunked = _forward_call(None, hidden, weight, tuple(options))
    ctx.needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    # Outputs without a gradient reach the backward as None, not as zeros: the chunked path's three
    # gradient outputs would otherwise each get a materialised zero tensor of their size (a V x H
    # one: 2 GiB for an fp32 master weight at 128256 x 4096) at the start of every backward.
    ctx.set_materialize_grads(False)
    ctx.loss_shape = output[0].shape
    # The loss and the lse carry gradients; the metric sums (argmax and entropy counts, forward-only
    # statistics) and the lse's internal form do not, and autograd says so (requires_grad=False).
    # The chunked path's gradients stay differentiable outputs: differentiating the gradient they
    # become (a gradient penalty) must reach ``scale_gradients`` and raise there, not see a constant.
    ctx.mark_non_differentiable(output[1], output[3])
    if ctx.chunked:
        ctx.save_for_backward(*output[4:])
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else hidden.dtype)
        ctx.spent = ()  # the leaves whose saved gradient a backward has scaled in place (``_backward``)
    else:
        ctx.save_for_backward(hidden, weight, bias, targets, class_weight, output[3], divisor, scalars_)


@torch.library.custom_op(f"{NAMESPACE}::scale_gradients", mutates_args=())
def scale_gradients(
    grad_hidden: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor, grad_loss: torch.Tensor,
    hidden_dtype: torch.dtype, weight_dtype: torch.dtype, bias_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked path's backward: the gradients computed in the forward for an upstream gradient
    of 1 (``chunked.unit_dtype``), times the real one, in the leaves' dtypes, computed in fp32 with
    one rounding (``products.scale``, no fp32 copy of the gradient); exact
    when the upstream gradient is a power of two, as 1 is. An op without an autograd formula, like
    ``backward``: differentiating it again raises."""
    g = grad_loss.to(torch.float32)
    return tuple(products.scale(t, g, d) for t, d in ((grad_hidden, hidden_dtype), (grad_weight, weight_dtype),
                                                   (grad_bias, bias_dtype)))


@scale_gradients.register_fake
def _(grad_hidden, grad_weight, grad_bias, grad_loss, hidden_dtype, weight_dtype, bias_dtype):
    return (grad_hidden.new_empty(grad_hidden.shape, dtype=hidden_dtype),
            grad_weight.new_empty(grad_weight.shape, dtype=weight_dtype),
            grad_bias.new_empty(grad_bias.shape, dtype=bias_dtype))


@torch.library.custom_op(f"{NAMESPACE}::scale_in_place", mutates_args=("grad",))
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


def _backward(ctx, grad_loss, _grad_sums, grad_lse, _grad_lse2, *_grad_grads):
    if ctx.chunked:
        check_spent(ctx, "fused_linear_cross_entropy")
    need_dx, need_dw, need_db = ctx.needs
    o = ctx.options
    if grad_loss is None:  # only the lse reaches the loss: the loss's own gradient is 0
        ref = grad_lse if grad_lse is not None else ctx.saved_tensors[0]
        grad_loss = torch.zeros(ctx.loss_shape, dtype=torch.float32, device=ref.device)
    if ctx.chunked:
        missing = [name for name, need, computed in zip(("hidden", "weight", "bias"), ctx.needs, ctx.computed)
                   if need and not computed]
        if missing:
            raise RuntimeError(f"fused_linear_cross_entropy: {missing} did not require grad when the loss was "
                               "computed, so the chunked path computed no gradient for them")
        dx, dw, db = scale_saved(ctx, ctx.saved_tensors, grad_loss, ctx.needs)
    else:
        hidden, weight, bias, targets, class_weight, lse2, divisor, scalars_ = ctx.saved_tensors
        if divisor is not None:  # the op returned sum / divisor; the backward op takes the sum's gradient
            grad_loss = grad_loss / divisor
        dx, dw, db = backward(
            grad_loss, grad_lse if o["return_lse"] else None, hidden, weight, bias, targets, class_weight, lse2,
            scalars_, o["ignore_index"], o["has_softcap"], o["reduction"], o["chunk_bytes"], o["group_id"], *ctx.needs,
        )
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None,
            None, None, None, None) + (None,) * len(_OPTION_NAMES)


forward.register_autograd(_backward, setup_context=_setup_context)


def apply(hidden, weight, targets, bias, class_weight, opts: Options, group=None, divisor=None):
    """Calls the forward op with ``opts`` spread into its scalar arguments. Which gradients will be
    wanted is read here (grad mode and requires_grad), for the chunked path."""
    group_id = parallel.register(group) if group is not None else 0
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    options = [opts.ignore_index, opts.softcap is not None, opts.reduction, opts.return_metrics,
               opts.label_smoothing > 0, opts.return_lse, opts.chunk_bytes, opts.strategy, group_id, *needs]
    return forward(hidden, weight, bias, targets, class_weight, divisor, scalars(opts), *options)
