"""The forward and backward as PyTorch custom operators, with fake implementations and autograd.

``torch.compile(fullgraph=True)`` sees two opaque ops and their output shapes, so a training step
that calls the loss compiles without a graph break. The namespace is the package's own module name,
unique per build (the loader imports each build under its own id), so two builds can live in one
process (``opargs.NAMESPACE``). Options and the call's plan travel as the ops' arguments (``opargs``); the
per-row loss arithmetic (``losses.py``) runs inside the ops, so their outputs are the final loss,
metrics and lse.
"""

from typing import Optional

import torch

from . import chunked, losses, opargs, parallel, recompute, saved_gradients, sweep
from .plan import GRADIENTS_IN_FORWARD, RECOMPUTE, plan_loss
from .validate import Options

# The float options, in the order of the ops' ``scalars`` tensor (``opargs.Floats``).
FLOATS = opargs.Floats("logit_scale", "softcap", "label_smoothing", "z_loss")
# The forward op's other arguments after ``scalars``, in order (``apply`` packs them, the autograd
# context unpacks them).
ARGS = opargs.Args("ignore_index", "reduction", "return_metrics", "return_lse", "chunk_bytes", "group_id", "mode",
                   "plan", "need_dx", "need_dw", "need_db")


def scalars(opts: Options) -> torch.Tensor:
    """The ops' float options (``FLOATS``) of ``opts``, one CPU float64 tensor."""
    return FLOATS.tensor(opts)


def _options(scalars_: torch.Tensor, **options) -> Options:
    """The Options inside an op: its float ones read from ``scalars_``, the rest as given."""
    return Options(**FLOATS.read(scalars_), **options)


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


@torch.library.custom_op(f"{opargs.NAMESPACE}::forward", mutates_args=())
def forward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    class_weight: Optional[torch.Tensor], divisor: Optional[torch.Tensor], scalars: torch.Tensor, ignore_index: int,
    reduction: str, return_metrics: bool, return_lse: bool, chunk_bytes: Optional[int], group_id: int,
    mode: str, plan: list[int], need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, metric sums, lse, lse2, grad_hidden, grad_weight, grad_bias): metric sums is (3,)
    [correct, entropy, counted rows] or (0,); lse2 (2, N) is the lse as row max and log-sum, which
    the recompute backward uses. The three gradients are those of an upstream gradient of 1 when
    the plan's mode forms them in the forward (``GRADIENTS_IN_FORWARD``), else empty (0,).
    ``divisor`` (fp32 0-d, with "sum"): the loss is the sum over it (``num_items_in_batch``),
    inside the op so that the chunked path applies it with the rest of the common factor to its
    products (``products.product``).
    ``group_id`` names a vocabulary-parallel process group (parallel.register), 0 for none.
    An fp32 ``weight`` with 16-bit ``hidden`` is a master weight: cast here, its gradient fp32.
    ``scalars``: the float options (``scalars``). ``mode`` and ``plan``: the call's plan
    (``plan_loss``, encoded by ``opargs``)."""
    opts = _options(scalars, ignore_index=ignore_index, reduction=reduction, return_metrics=return_metrics,
                    return_lse=return_lse, chunk_bytes=chunk_bytes)
    shard = parallel.shard_for(group_id, weight.shape[0])
    sizes = parallel.start_size_check(shard, hidden.device) if shard is not None else None
    grads = [None] * 3
    low = low_weight(weight, hidden)
    if mode in GRADIENTS_IN_FORWARD:
        stats, *grads = chunked.forward(hidden, low, targets, bias, class_weight, opts, opargs.decode(mode, plan),
                                        need_dx, need_dw, need_db, shard, divisor, dw_dtype=weight.dtype)
    else:
        stats = sweep.forward(hidden, low, targets, bias, class_weight, opts, shard)
    del low
    grads = [g if g is not None else hidden.new_empty((0,)) for g in grads]  # distinct outputs
    weights = losses.target_weights(targets, class_weight, ignore_index, weight.shape[0], shard)
    loss = losses.reduce(losses.row_loss_terms(stats, weights, opts), opts)
    if divisor is not None:
        loss = loss / divisor
    sums = losses.metric_sums(stats, targets, weights) if return_metrics else loss.new_empty((0,))
    if sizes is not None:
        parallel.finish_size_check(sizes, shard)
    return (loss, sums, stats.lse, stats.lse2, *grads)


@forward.register_fake
def _(hidden, weight, bias, targets, class_weight, divisor, scalars_, ignore_index, reduction, return_metrics,
      return_lse, chunk_bytes, group_id, mode, plan_, need_dx, need_dw, need_db):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    sums = hidden.new_empty((3,) if return_metrics else (0,), dtype=torch.float32)
    use = mode in GRADIENTS_IN_FORWARD
    unit = chunked.unit_dtype(hidden.dtype)
    grads = (
        hidden.new_empty(hidden.shape, dtype=unit) if use and need_dx else hidden.new_empty((0,)),
        weight.new_empty(weight.shape, dtype=chunked.weight_grad_dtype(hidden.dtype, weight.dtype))
        if use and need_dw else hidden.new_empty((0,)),
        weight.new_empty((weight.shape[0],), dtype=torch.float32) if use and need_db else hidden.new_empty((0,)),
    )
    return (loss, sums, hidden.new_empty((n,), dtype=torch.float32),
            hidden.new_empty((2, n), dtype=torch.float32), *grads)


@torch.library.custom_op(f"{opargs.NAMESPACE}::backward", mutates_args=())
def backward(
    grad_loss: torch.Tensor, grad_lse: Optional[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor,
    bias: Optional[torch.Tensor], targets: torch.Tensor, class_weight: Optional[torch.Tensor],
    lse2: torch.Tensor, scalars: torch.Tensor, ignore_index: int, reduction: str, chunk_bytes: Optional[int],
    group_id: int, plan: list[int], need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias), each empty (0,) when not needed, in the passes of the
    call's RECOMPUTE ``plan`` (``opargs``); an fp32 master ``weight`` is cast for the products
    again, and its gradient is summed in fp32 (``recompute.backward``'s ``dw_dtype``)."""
    opts = _options(scalars, ignore_index=ignore_index, reduction=reduction, return_lse=grad_lse is not None,
                    chunk_bytes=chunk_bytes)
    shard = parallel.shard_for(group_id, weight.shape[0])
    weights = losses.target_weights(targets, class_weight, ignore_index, weight.shape[0], shard)
    coef, common = losses.coefficients(grad_loss, grad_lse, lse2[0] + lse2[1], targets, weights, opts)
    dx, dw, db = recompute.backward(hidden, low_weight(weight, hidden), targets, bias, class_weight, lse2, coef, opts,
                                    opargs.decode(RECOMPUTE, plan), need_dx, need_dw, need_db, shard, common,
                                    dw_dtype=weight.dtype)
    return tuple(g if g is not None else hidden.new_empty((0,)) for g in (dx, dw, db))


@backward.register_fake
def _(grad_loss, grad_lse, hidden, weight, bias, targets, class_weight, lse2, scalars_, ignore_index, reduction,
      chunk_bytes, group_id, plan_, need_dx, need_dw, need_db):
    return opargs.fake_gradients(hidden, weight, bias, need_dx, need_dw, need_db)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, class_weight, divisor, scalars_, *options = inputs
    ctx.options = ARGS.unpack(options)
    # ctx.computed: the gradients the forward op was told would be wanted.
    ctx.computed = (ctx.options["need_dx"], ctx.options["need_dw"], ctx.options["need_db"])
    ctx.chunked = ctx.options["mode"] in GRADIENTS_IN_FORWARD
    ctx.needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    # Outputs without a gradient reach the backward as None, not as zeros: the chunked path's three
    # gradient outputs would otherwise each get a materialised zero tensor of their size (a V x H
    # one: 2 GiB for an fp32 master weight at 128256 x 4096) at the start of every backward.
    ctx.set_materialize_grads(False)
    ctx.loss_shape = output[0].shape
    # The loss and the lse carry gradients; the metric sums (argmax and entropy counts, forward-only
    # statistics) and the lse's internal form do not, and autograd says so (requires_grad=False).
    # The chunked path's gradients stay differentiable outputs: differentiating the gradient they
    # become (a gradient penalty) must reach ``saved_gradients.scale_gradients`` and raise there, not
    # see a constant.
    ctx.mark_non_differentiable(output[1], output[3])
    if ctx.chunked:
        ctx.save_for_backward(*output[4:])
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else hidden.dtype)
        ctx.spent = ()  # the leaves whose saved gradient a backward has scaled in place (``_backward``)
    else:
        ctx.save_for_backward(hidden, weight, bias, targets, class_weight, output[3], divisor, scalars_)


def _backward(ctx, grad_loss, _grad_sums, grad_lse, _grad_lse2, *_grad_grads):
    if ctx.chunked:
        saved_gradients.check_spent(ctx, "fused_linear_cross_entropy")
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
        dx, dw, db = saved_gradients.scale_saved(ctx, ctx.saved_tensors, grad_loss, ctx.needs)
    else:
        hidden, weight, bias, targets, class_weight, lse2, divisor, scalars_ = ctx.saved_tensors
        if divisor is not None:  # the op returned sum / divisor; the backward op takes the sum's gradient
            grad_loss = grad_loss / divisor
        dx, dw, db = backward(
            grad_loss, grad_lse if o["return_lse"] else None, hidden, weight, bias, targets, class_weight, lse2,
            scalars_, o["ignore_index"], o["reduction"], o["chunk_bytes"], o["group_id"], o["plan"], *ctx.needs,
        )
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None,
            None, None, None, None) + ARGS.no_gradients


forward.register_autograd(_backward, setup_context=_setup_context)


def apply(hidden, weight, targets, bias, class_weight, opts: Options, group=None, divisor=None):
    """Asks the planner once (``plan.plan_loss``) and calls the forward op with ``opts`` and the plan
    spread into its arguments. Which gradients will be wanted is read here (grad mode and
    requires_grad)."""
    group_id = parallel.register(group) if group is not None else 0
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    p = plan_loss(opts, hidden.shape[0], weight.shape[0], hidden.shape[1], hidden.dtype, needs,
                  master=weight.dtype != hidden.dtype, sharded=group is not None, bias=bias is not None,
                  where=hidden.device)
    options = ARGS.pack(ignore_index=opts.ignore_index, reduction=opts.reduction, return_metrics=opts.return_metrics,
                        return_lse=opts.return_lse, chunk_bytes=opts.chunk_bytes, group_id=group_id, mode=p.mode,
                        plan=opargs.encode(p), need_dx=needs[0], need_dw=needs[1], need_db=needs[2])
    return forward(hidden, weight, bias, targets, class_weight, divisor, scalars(opts), *options)
