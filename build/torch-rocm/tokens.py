"""Per-token outputs as custom ops: log-probs, entropy, log sum p^2, mean logit and top-1 per row,
from one vocabulary sweep, with the gradients of the log-probs and the entropy for any per-row
upstream gradient (the public function: ``logprobs.py``; the math: ``logits.py``).

For a counted row with target t, logits z (after the softcap, divided by the temperature), p their
softmax and S = sum_v p_v z_v:

    log_probs = z_t - lse                   d/dz_v = [v == t] - p_v
    entropy   = lse - S                     d/dz_v = - p_v (z_v - S)
    log_sum_sq_probs = log sum_v exp(2 (z_v - m)) - 2 (lse - m)
    mean_logits = sum_v z_v / V             is_top1 = the target is the first argmax

so upstream gradients g (log-probs) and E (entropy) give ``da = (A - E (z - S)) p - B onehot``
with A = B = -g: the recompute path's dlogits kernel and the chunked path's in-place kernel (which
EXPONENTIALS runs too) with their ENTROPY_GRAD term, coefficients (5, N) [A, B, C = 0, E, S].
Ignored rows (target == ignore_index) get 0 in every field (False for is_top1) and no gradient.

The two ways through the backward (``plan.plan_tokens``):
- recompute: the forward keeps the per-row lse only, the backward recomputes the logits block by
  block (``recompute.backward``, memory set by ``chunk_bytes``); four products in all.
- EXPONENTIALS (strategy="chunked"): the per-row upstream gradients are unknown until the backward,
  so the forward cannot form the gradients as the loss's chunked path does (dW needs them); instead
  it keeps the sweep's exponentials ``exp(z - m_tile)`` of all N rows, (N, V) in the input dtype,
  and the backward turns them into da in place and runs the two products: three in all, for an
  (N, V) buffer held from the forward to the backward (it must fit in ``chunk_bytes``). The first
  backward spends the buffer; a later one through the same graph (``retain_graph=True``) takes the
  recompute path's backward from the inputs and the per-row statistics, which the forward keeps
  either way (``_backward``).
"""

import math
from typing import Optional

import torch

from . import chunked, configs, device, losses, opargs, ops, parallel, products, recompute, sweep
from .plan import EXPONENTIALS, RECOMPUTE, plan_tokens
from .validate import Options

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
DIFFERENTIABLE = ("log_probs", "entropy")


# The float options, in the order of the ops' ``scalars`` tensor (``opargs.Floats``).
FLOATS = opargs.Floats("logit_scale", "softcap", "temperature")
# The forward op's other arguments after ``scalars``, in order (``apply`` packs them, the autograd
# context unpacks them).
ARGS = opargs.Args("ignore_index", "outputs", "chunk_bytes", "group_id", "mode", "plan", "need_dx", "need_dw",
                   "need_db")


def _names(wanted) -> tuple:
    """The field names of an op's ``outputs`` argument: one bool per FIELDS entry (a custom op takes
    no list of strings)."""
    return tuple(name for name, w in zip(FIELDS, wanted) if w)


def _options(scalars_: torch.Tensor, ignore_index, outputs, chunk_bytes) -> Options:
    """The Options inside an op (``outputs``: field names), its float ones read from ``scalars_``."""
    return Options(**FLOATS.read(scalars_), ignore_index=ignore_index, reduction="none", chunk_bytes=chunk_bytes,
                   outputs=tuple(outputs))


def _fields(stats: sweep.RowStats, targets, opts: Options, v_total: int) -> dict:
    """The requested per-row fields from the sweep's statistics; 0 (False) on ignored rows."""
    counted = targets != opts.ignore_index
    zero = torch.zeros((), device=targets.device)
    out = {"log_probs": torch.where(counted, -stats.loss_terms(), zero)}  # NaN for a target out of range
    if "entropy" in opts.outputs:
        out["entropy"] = torch.where(counted, stats.entropy, zero)
    if "log_sum_sq_probs" in opts.outputs:
        out["log_sum_sq_probs"] = torch.where(counted, torch.log(stats.squares) - 2.0 * stats.lse2[1], zero)
    if "mean_logits" in opts.outputs:
        out["mean_logits"] = torch.where(counted, stats.wz / v_total, zero)
    if "is_top1" in opts.outputs:
        out["is_top1"] = counted & (stats.argmax == targets)
    return out


@torch.library.custom_op(f"{opargs.NAMESPACE}::token_forward", mutates_args=())
def token_forward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    scalars: torch.Tensor, ignore_index: int, outputs: list[bool], chunk_bytes: Optional[int], group_id: int,
    mode: str, plan: list[int], need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1, row, exps, tile_max): the fields
    (N,), each empty (0,) unless requested (log_probs always); ``row`` (3, N) fp32 the row max,
    log-sum and target logit; in the plan's EXPONENTIALS mode (``plan.plan_tokens``) ``exps`` the (N, V)
    exponentials and ``tile_max`` (T, N) their tiles' row maxima, else empty. ``outputs``: one bool
    per FIELDS entry. An fp32 ``weight`` with 16-bit ``hidden`` is a master weight
    (``validate.is_master_weight``): cast here for the sweep, and again in the backward, whose
    weight gradient is fp32."""
    opts = _options(scalars, ignore_index, _names(outputs), chunk_bytes)
    n, v = hidden.shape[0], weight.shape[0]
    shard = parallel.shard_for(group_id, v)
    sizes = parallel.start_size_check(shard, hidden.device) if shard is not None else None
    empty = hidden.new_empty((0,), dtype=torch.float32)
    exps, tile_max = hidden.new_empty((0,)), empty
    low = ops.low_weight(weight, hidden)
    if mode == EXPONENTIALS:
        exps = device.new((n, v), hidden.dtype, hidden.device)
        cfg = configs.tiles("chunked", hidden.dtype, hidden.shape[1], where=hidden.device)
        stats, tile_stats = sweep.sweep(hidden, low, targets, bias, None, opts, shard, exps, cfg)
        tile_max = tile_stats[sweep.MAX_PLANE].clone()  # each tile's row max
    else:
        stats = sweep.forward(hidden, low, targets, bias, None, opts, shard)
    del low
    fields = _fields(stats, targets, opts, shard.v_total if shard is not None else v)
    if sizes is not None:
        parallel.finish_size_check(sizes, shard)
    row = torch.cat([stats.lse2, stats.z_target[None]])
    out = [fields[name] if name in fields else empty.clone() for name in FIELDS[:-1]]  # distinct outputs
    return (*out, fields.get("is_top1", empty.to(torch.bool)), row, exps, tile_max)


@token_forward.register_fake
def _(hidden, weight, bias, targets, scalars_, ignore_index, outputs, chunk_bytes, group_id, mode, plan_, need_dx,
      need_dw, need_db):
    n, v = hidden.shape[0], weight.shape[0]
    names = _names(outputs)
    out = [hidden.new_empty((n,) if name == "log_probs" or name in names else (0,), dtype=torch.float32)
           for name in FIELDS[:-1]]  # distinct tensors: aliased fake outputs would be merged by the compiler
    empty = hidden.new_empty((0,), dtype=torch.float32)
    top1 = hidden.new_empty((n,) if "is_top1" in names else (0,), dtype=torch.bool)
    exps, tile_max = hidden.new_empty((0,)), empty
    if mode == EXPONENTIALS:
        cfg = configs.tiles("chunked", hidden.dtype, hidden.shape[1], where=hidden.device)
        exps = hidden.new_empty((n, v))
        tile_max = hidden.new_empty((-(-v // cfg.block_v), n), dtype=torch.float32)
    return (*out, top1, hidden.new_empty((3, n), dtype=torch.float32), exps, tile_max)


def token_coefficients(grad_lp, grad_ent, row, entropy, targets, opts: Options, v_total: int):
    """(coef, common): the per-row coefficients of da, (3, N) [A, B, C = 0], or (5, N) with [E, S]
    when the entropy has a gradient (module docstring), divided by the largest finite |B| (the
    upstream of a mean is one value on every row: da keeps its target entries exact, and the factor
    ``common`` goes to the products in fp32; ``losses.normalize``)."""
    counted = targets != opts.ignore_index
    n = targets.shape[0]
    zero = torch.zeros((), device=targets.device)
    g = grad_lp.to(torch.float32) if grad_lp is not None else zero.expand(n)
    a = torch.where(counted, -g, zero)
    b = torch.where(counted & ((targets < 0) | (targets >= v_total)), torch.full((), math.nan, device=a.device), a)
    parts = [a, b, zero.expand(n)]
    if grad_ent is not None:
        parts += [torch.where(counted, grad_ent.to(torch.float32), zero), (row[0] + row[1]) - entropy]
    coef = torch.stack(parts)
    if n == 0:
        return coef, torch.ones((), device=coef.device)
    scaled, s = losses.normalize(coef[:4], None)  # S (row 4) is a logit, not a coefficient
    return torch.cat([scaled, coef[4:]]), s


@torch.library.custom_op(f"{opargs.NAMESPACE}::token_backward", mutates_args=())
def token_backward(
    grad_lp: Optional[torch.Tensor], grad_ent: Optional[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor,
    bias: Optional[torch.Tensor], targets: torch.Tensor, row: torch.Tensor, entropy: Optional[torch.Tensor],
    scalars: torch.Tensor, ignore_index: int, chunk_bytes: Optional[int], group_id: int, plan: list[int],
    need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recompute backward in the passes of the call's ``plan`` (``opargs``): (grad_hidden,
    grad_weight, grad_bias), each empty (0,) when not needed; grad_weight in weight's dtype (fp32 for
    a master weight, summed in fp32)."""
    opts = _options(scalars, ignore_index, (), chunk_bytes)
    v = weight.shape[0]
    shard = parallel.shard_for(group_id, v)
    v_total = shard.v_total if shard is not None else v
    coef, common = token_coefficients(grad_lp, grad_ent, row, entropy, targets, opts, v_total)
    grads = recompute.backward(hidden, ops.low_weight(weight, hidden), targets, bias, None, row[:2], coef, opts,
                               opargs.decode(RECOMPUTE, plan), need_dx, need_dw, need_db, shard, common,
                               dw_dtype=weight.dtype)
    return tuple(g if g is not None else hidden.new_empty((0,)) for g in grads)


@token_backward.register_fake
def _(grad_lp, grad_ent, hidden, weight, bias, targets, row, entropy, scalars_, ignore_index, chunk_bytes, group_id,
      plan_, need_dx, need_dw, need_db):
    return opargs.fake_gradients(hidden, weight, bias, need_dx, need_dw, need_db)


@torch.library.custom_op(f"{opargs.NAMESPACE}::token_backward_exponentials", mutates_args=("exps",))
def token_backward_exponentials(
    grad_lp: Optional[torch.Tensor], grad_ent: Optional[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor,
    bias: Optional[torch.Tensor], targets: torch.Tensor, row: torch.Tensor, entropy: Optional[torch.Tensor],
    exps: torch.Tensor, tile_max: torch.Tensor, scalars: torch.Tensor, ignore_index: int, group_id: int,
    need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The EXPONENTIALS backward: the forward's exponentials become da in place
    (``chunked.gradient_in_place``), then grad_hidden = da @ weight and grad_weight = da^T @ hidden,
    each one product with fp32 accumulation and one rounding (``products.product``; none for a master
    weight's fp32 grad_weight); grad_bias from the kernel's column sums."""
    opts = _options(scalars, ignore_index, (), None)
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, where = hidden.dtype, hidden.device
    shard = parallel.shard_for(group_id, v)
    v_total = shard.v_total if shard is not None else v
    coef, common = token_coefficients(grad_lp, grad_ent, row, entropy, targets, opts, v_total)
    unscale = common.reshape(1)
    if dtype == torch.float16:
        coef, unscale = losses.lift_fp16(coef, unscale, None, opts.kernel_scales().grad_scale, v_total)
    cfg = configs.tiles("chunked", dtype, h, where=where)
    stats = sweep.RowStats(row[:2], row[2], None, None, None, None)
    block_n = chunked.gradient_rows(cfg, losses.entropy_term(coef))  # the rows of its bias partial sums
    dbias = device.new((-(-n // block_n), v), torch.float32, where) if need_db else None
    da = chunked.gradient_in_place(exps, tile_max, stats, coef, targets, None, dbias, opts, shard, cfg)
    grad_hidden, grad_weight, grad_bias = (hidden.new_empty((0,)) for _ in range(3))  # distinct outputs
    if need_dx:
        out = device.new((n, h), torch.float32 if shard is not None else dtype, where)
        products.product(da, ops.low_weight(weight, hidden), out, False, unscale)
        if shard is not None:
            parallel.all_reduce(out, shard)
        grad_hidden = out.to(dtype)
    if need_dw:
        grad_weight = device.new((v, h), weight.dtype, where)
        products.product(da.t(), hidden, grad_weight, False, unscale)
    if need_db:
        acc = torch.zeros((v,), dtype=torch.float32, device=where)
        products.add_bias_sums(acc, dbias, n, block_n, unscale)
        grad_bias = acc.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


@token_backward_exponentials.register_fake
def _(grad_lp, grad_ent, hidden, weight, bias, targets, row, entropy, exps, tile_max, scalars_, ignore_index,
      group_id, need_dx, need_dw, need_db):
    return opargs.fake_gradients(hidden, weight, bias, need_dx, need_dw, need_db)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, scalars_, *rest = inputs
    o = ARGS.unpack(rest)
    o["outputs"] = _names(o["outputs"])
    ctx.options = o
    ctx.exponentials = o["mode"] == EXPONENTIALS
    ctx.needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    # Unused outputs get no gradient (None), not a materialised zero: the entropy's backward work
    # runs only when the entropy reaches the loss.
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[2:])
    entropy = output[1] if "entropy" in o["outputs"] else None
    ctx.save_for_backward(hidden, weight, bias, targets, output[5], entropy, output[6], output[7], scalars_)
    ctx.spent = False  # EXPONENTIALS' buffer, once a backward has turned it into da


def _backward(ctx, grad_lp, grad_ent, *_rest):
    if "entropy" not in ctx.options["outputs"]:  # the empty placeholder output: a compiled backward may
        grad_ent = None                          # pass it a materialised (0,) gradient
    nothing = (None,) * 5 + ARGS.no_gradients  # hidden, weight, bias, targets, scalars; the options
    if grad_lp is None and grad_ent is None:
        return nothing
    hidden, weight, bias, targets, row, entropy, exps, tile_max, scalars_ = ctx.saved_tensors
    o = ctx.options
    if ctx.exponentials and not ctx.spent:
        # The first backward turns the saved exponentials into da in place (the op declares the
        # mutation). It writes through ``.data``, which autograd does not version: a later backward
        # through the same graph (retain_graph=True) can still unpack the inputs and statistics saved
        # beside them, and ``spent`` sends it to the recompute backward below, which reads only those
        # (the same gradients, rounded as that path rounds them), at no cost to a single backward.
        ctx.spent = True
        dx, dw, db = token_backward_exponentials(grad_lp, grad_ent, hidden, weight, bias, targets, row, entropy,
                                                 exps.data, tile_max, scalars_, o["ignore_index"], o["group_id"],
                                                 *ctx.needs)
    else:
        dx, dw, db = token_backward(grad_lp, grad_ent, hidden, weight, bias, targets, row, entropy, scalars_,
                                    o["ignore_index"], o["chunk_bytes"], o["group_id"], o["plan"], *ctx.needs)
    need_dx, need_dw, need_db = ctx.needs
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None) + nothing[3:]


token_forward.register_autograd(_backward, setup_context=_setup_context)


def apply(hidden, weight, targets, bias, opts: Options, group=None) -> dict:
    """Asks the planner once (``plan.plan_tokens``) and calls the forward op; returns {field: (N,)
    tensor} for ``opts.outputs`` (log_probs always computed). Which gradients will be wanted is read
    here."""
    group_id = parallel.register(group) if group is not None else 0
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    p = plan_tokens(opts, hidden.shape[0], weight.shape[0], hidden.shape[1], hidden.dtype, needs,
                    master=weight.dtype != hidden.dtype, sharded=group is not None, where=hidden.device)
    args = ARGS.pack(ignore_index=opts.ignore_index, outputs=[name in opts.outputs for name in FIELDS],
                     chunk_bytes=opts.chunk_bytes, group_id=group_id, mode=p.mode, plan=opargs.encode(p),
                     need_dx=needs[0], need_dw=needs[1], need_db=needs[2])
    out = token_forward(hidden, weight, bias, targets, FLOATS.tensor(opts), *args)
    return {name: out[i] for i, name in enumerate(FIELDS) if name in opts.outputs}
