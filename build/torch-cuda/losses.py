"""The loss variants on top of the sweep's per-row statistics: O(N) torch ops, no host sync.

For a counted row n (target t != ignore_index), with w the class weights (ones when not given),
W = sum_v w[v], eps the label smoothing and c the z-loss weight:

    loss[n] = (1 - eps) w[t] (lse - z_t) + eps / V (W lse - sum_v w[v] z[v]) + c lse^2

which is ``F.cross_entropy(z, t, weight=w, label_smoothing=eps)`` per row plus PaLM's z-loss.
"mean" divides the first two terms by the sum of w[t] over counted rows (F.cross_entropy's weighted
mean; the row count when unweighted) and the z-loss term by the number of counted rows.

The gradient with respect to the logits is ``da = A p - B onehot(t) - C w`` (times the softcap and
scale chain, applied in the kernel) with per-row coefficients

    A = G ((1 - eps) w[t] + eps W / V) + Z 2 c lse + L,   B = G (1 - eps) w[t],   C = G eps / V

where G and Z are the upstream gradients of the row's cross-entropy and z-loss terms after the
reduction, and L that of the returned per-row lse. Ignored rows have G = Z = 0 (A = L, B = C = 0).
"""

from dataclasses import dataclass

import torch

from . import parallel
from .validate import Options


@dataclass
class TargetWeights:
    """Which rows count, w[t] per row (0 on ignored rows) and W = sum_v w[v], over the whole
    vocabulary."""

    counted: torch.Tensor  # bool (N,): target != ignore_index
    per_row: torch.Tensor
    total: torch.Tensor | float
    weighted: bool
    v_total: int


@dataclass
class RowTerms:
    """Per-row pieces of the loss, fp32 (N,), zero on ignored rows."""

    ce: torch.Tensor  # the (weighted, smoothed) cross-entropy term
    z: torch.Tensor | None  # c * lse^2, when z_loss > 0
    weights: TargetWeights


def target_weights(targets, class_weight, ignore_index, v_local, shard=None) -> TargetWeights:
    """With a vocabulary shard, class_weight is the shard's slice: each rank looks up the targets it
    holds and the rows are summed over the group."""
    counted = targets != ignore_index
    v_total = shard.v_total if shard is not None else v_local
    if class_weight is None:
        return TargetWeights(counted, counted.to(torch.float32), float(v_total), False, v_total)
    offset = shard.offset if shard is not None else 0
    local = targets - offset
    w = class_weight[local.clamp(0, v_local - 1)]
    total = class_weight.sum()
    if shard is not None:
        w = torch.where((local >= 0) & (local < v_local), w, torch.zeros((), device=w.device))
        both = parallel.all_reduce(torch.cat([w, total[None]]), shard)
        w, total = both[:-1], both[-1]
    per_row = torch.where(counted, w, torch.zeros((), device=w.device))
    return TargetWeights(counted, per_row, total, True, v_total)


def row_terms(stats, weights: TargetWeights, opts: Options) -> RowTerms:
    counted = weights.counted
    w_t = weights.per_row
    v = weights.v_total
    zero = torch.zeros((), device=stats.z_target.device)
    nll = stats.loss_terms()
    ce = nll * w_t if weights.weighted else nll
    eps = opts.label_smoothing
    if eps or opts.z_loss:
        lse = stats.lse
    if eps:
        ce = (1.0 - eps) * ce + (eps / v) * (weights.total * lse - stats.wz)
    ce = torch.where(counted, ce, zero)
    z = torch.where(counted, opts.z_loss * lse.square(), zero) if opts.z_loss else None
    return RowTerms(ce, z, weights)


def reduce(terms: RowTerms, opts: Options) -> torch.Tensor:
    """The loss as returned: (N,) for "none", else 0-d; fp32."""
    if opts.reduction == "none":
        return terms.ce if terms.z is None else terms.ce + terms.z
    loss = terms.ce.sum()
    if opts.reduction == "mean":
        loss = loss / terms.weights.per_row.sum()
    if terms.z is not None:
        z = terms.z.sum()
        loss = loss + (z / terms.weights.counted.sum() if opts.reduction == "mean" else z)
    return loss


def metric_sums(stats, targets, weights: TargetWeights) -> torch.Tensor:
    """[correct tokens, sum of entropies, counted tokens] over counted rows, a (3,) fp32 tensor:
    sums, so that a trainer can add them across ranks before dividing."""
    zero = torch.zeros((), device=stats.z_target.device)
    correct = (stats.argmax == targets).to(torch.float32)
    return torch.stack([
        torch.where(weights.counted, correct, zero).sum(),
        torch.where(weights.counted, stats.entropy, zero).sum(),
        weights.counted.sum().to(torch.float32),
    ])


def coefficients(grad_loss, grad_lse, lse, targets, weights: TargetWeights, opts: Options):
    """The (3, N) fp32 per-row coefficients A, B, C of ``da`` (module docstring), and a factor common
    to every row (or None): for "mean" and "sum" the upstream scalar (over sum w[t] for the mean),
    left out of the coefficients and applied to the products in fp32, since rounding it into bf16
    da would be the same error on every row, which does not average out. A counted row whose target
    is outside [0, V) gets B = NaN, which the kernel turns into a NaN row."""
    n = targets.shape[0]
    zero = torch.zeros((), device=lse.device)
    eps = opts.label_smoothing
    counted, w_t = weights.counted, weights.per_row
    common = None
    if grad_loss is None:
        g_ce = g_z = zero
    elif grad_loss.ndim == 0 and grad_lse is None:
        # "mean" / "sum": one upstream scalar for every row. Leave it (and the mean's denominator)
        # out of da and apply it to the products in fp32: then the target entries of da are exactly
        # (1 - eps) w[t] (p - 1), with no common rounding error repeated on every row.
        g = grad_loss.to(torch.float32)
        g_ce = g_z = torch.ones((), device=lse.device)
        common = g
        if opts.reduction == "mean":
            denominator = w_t.sum()
            common = torch.where(denominator > 0, g / denominator, zero)  # no counted row: zero gradients
            g_z = denominator / counted.sum()  # z-loss's mean is over rows, not weights
    else:
        g = grad_loss.to(torch.float32)
        g_ce = g_z = g
        if opts.reduction == "mean":  # a returned lse's gradient is per row: no common factor
            g_ce = g / w_t.sum()
            g_z = g / counted.sum()
    v = weights.v_total
    w_sum = weights.total if eps else 0.0
    coef_b = g_ce * (1.0 - eps) * w_t
    coef_a = g_ce * ((1.0 - eps) * w_t + (eps / v) * w_sum)
    if opts.z_loss:
        coef_a = coef_a + g_z * (2.0 * opts.z_loss) * lse
    coef_c = (g_ce * (eps / v)).expand(n) if eps else zero.expand(n)
    coef_a, coef_b, coef_c = (torch.where(counted, c.expand(n), zero) for c in (coef_a, coef_b, coef_c))
    if grad_lse is not None:
        coef_a = coef_a + grad_lse.to(torch.float32)
    out_of_range = counted & ((targets < 0) | (targets >= v))
    coef_b = torch.where(out_of_range, torch.full((), float("nan"), device=lse.device), coef_b)
    return torch.stack([coef_a, coef_b, coef_c]), common
