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

import math
from dataclasses import dataclass

import torch

from . import parallel
from .validate import Options

# Rows of the per-row coefficients of da: A, B, C (``row_coefficients``); with the per-token
# entropy's gradient also E and S (``entropy_term``).
ENTROPY_COEF_ROWS = 5


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


def row_loss_terms(stats, weights: TargetWeights, opts: Options) -> RowTerms:
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


def upstream(grad_loss, grad_lse, weights: TargetWeights, opts: Options):
    """(g_ce, g_z, common): the upstream gradients of the rows' cross-entropy and z-loss terms after
    the reduction (scalars, or (N,) for "none"), and a factor common to every row (or None).

    For "mean" and "sum" the upstream scalar (over sum w[t] for the mean) is the common factor: it
    is left out of the coefficients and applied to the products in fp32, since rounding it into
    bf16 da would be the same error on every row, which does not average out (``normalize`` does
    the same for what is left). ``grad_loss`` None means no loss gradient."""
    device = weights.counted.device
    zero = torch.zeros((), device=device)
    counted, w_t = weights.counted, weights.per_row
    if grad_loss is None:
        return zero, zero, None
    g = grad_loss.to(torch.float32)
    if grad_loss.ndim == 0 and grad_lse is None:
        one = torch.ones((), device=device)
        if opts.reduction != "mean":
            return one, one, g
        denominator = w_t.sum()
        # F.cross_entropy's weighted mean divides by the sum whatever its sign (a zero sum gives
        # non-finite gradients, as there); no counted row at all: zero gradients.
        common = torch.where(counted.any(), g / denominator, zero)
        return one, denominator / counted.sum(), common  # z-loss's mean is over rows, not weights
    if opts.reduction == "mean":  # a returned lse's gradient is per row: no common factor
        return g / w_t.sum(), g / counted.sum(), None
    return g, g, None


def row_coefficients(g_ce, g_z, grad_lse, lse, targets, weights: TargetWeights, opts: Options):
    """The (3, n) fp32 per-row coefficients A, B, C of ``da`` (module docstring) for the rows of
    ``targets`` (``weights`` and ``lse`` of the same rows). A counted row whose target is outside
    [0, V) gets B = NaN, which the kernels turn into a NaN row."""
    n = targets.shape[0]
    zero = torch.zeros((), device=lse.device)
    eps = opts.label_smoothing
    counted, w_t = weights.counted, weights.per_row
    v = weights.v_total
    w_sum = weights.total if eps else 0.0
    coef_a = g_ce * ((1.0 - eps) * w_t + (eps / v) * w_sum)
    if opts.z_loss:
        coef_a = coef_a + g_z * (2.0 * opts.z_loss) * lse
    coef_c = (g_ce * (eps / v)).expand(n) if eps else zero.expand(n)
    coef_a, coef_c = (torch.where(counted, c.expand(n), zero) for c in (coef_a, coef_c))
    if grad_lse is not None:
        coef_a = coef_a + grad_lse.to(torch.float32)
    return torch.stack([coef_a, _coef_b(g_ce, targets, weights, opts), coef_c])


def _coef_b(g_ce, targets, weights: TargetWeights, opts: Options):
    """B of every row of ``targets``: G (1 - eps) w[t] on counted rows, 0 on ignored ones, NaN where
    a counted row's target is outside [0, V). It needs no forward statistics."""
    counted = weights.counted
    n = targets.shape[0]
    zero = torch.zeros((), device=targets.device)
    coef_b = torch.where(counted, (g_ce * (1.0 - opts.label_smoothing) * weights.per_row).expand(n), zero)
    out_of_range = counted & ((targets < 0) | (targets >= weights.v_total))
    return torch.where(out_of_range, torch.full((), float("nan"), device=targets.device), coef_b)


def largest_b(g_ce, targets, weights: TargetWeights, opts: Options) -> torch.Tensor:
    """``normalize``'s divisor for all rows at once (before any sweep): the chunked path divides
    every chunk by it when its products' factor must be the same for every chunk."""
    return _largest(_coef_b(g_ce, targets, weights, opts))


def rows(weights: TargetWeights, start: int, stop: int) -> TargetWeights:
    """The target weights of rows [start, stop) (W stays the whole vocabulary's)."""
    return TargetWeights(weights.counted[start:stop], weights.per_row[start:stop], weights.total,
                         weights.weighted, weights.v_total)


def normalize(coef: torch.Tensor, common, s=None):
    """(coef / s, s * common, or s when there is none): s is the largest finite |B| (given: the
    rows' ``largest_b``), 1 when there is none. No host sync.

    A target entry of da is about ``-B (1 - p_t)``, and where p_t is far from 1 (untrained or
    random logits) rounding it to 16 bits gives every row with the same B the same relative error,
    which dX and dW inherit whole instead of averaging out. B is one value on every row far more
    often than not: ``1 - eps`` with label smoothing, a uniform class weight, the upstream gradient
    of ``loss.sum() / count`` after ``reduction="none"``. Divided by its largest, it is exactly 1
    there, and the factor goes to the products in fp32 with the rest of the common factor (the
    recompute path; on CPU, N=256, V=2000, errors against one rounding of the exact gradient:
    class weight 0.3 1.98x -> 1.07x, label smoothing 0.1 1.29x -> 1.07x)."""
    s = _largest(coef[1]) if s is None else s
    return coef / s, s if common is None else common * s


def _largest(coef_b: torch.Tensor) -> torch.Tensor:
    """The largest finite |B|, 1 when there is none (no host sync)."""
    b = coef_b.abs()
    largest = torch.where(torch.isfinite(b), b, torch.zeros_like(b)).amax()
    return torch.where((largest > 0) & torch.isfinite(largest), largest, torch.ones_like(largest))


def entropy_term(coef: torch.Tensor) -> bool:
    """Whether the per-row coefficients carry the per-token entropy's gradient (rows E and S after
    A, B, C: ``tokens.token_coefficients``), the kernels' ENTROPY_GRAD."""
    return coef.shape[0] == ENTROPY_COEF_ROWS


def lift_fp16(coef: torch.Tensor, unscale, class_weight, logit_scale: float, v_total: int = 1):
    """(coef, unscale) with da lifted out of fp16's subnormal range by a power of two: the
    coefficients times it, ``unscale`` (an fp32 (1,) tensor, or None for 1) times its inverse.

    da = logit_scale * (A p - B onehot - C w) * softcap', with p and softcap' at most 1, so
    |da| <= |logit_scale| (|A| + |B| + |C| max|w|). At real sizes p ~ 1/V and A ~ 1/count put most
    entries below fp16's smallest normal (6e-5), where they lose precision or vanish (plain torch
    loses them too). Scaling so that the largest possible entry is 2^14 keeps them normal; the
    products divide by the same power of two, exactly. The per-token entropy term ``- E p (z - S)``
    (coef rows 3 and 4) adds at most |E| (log V + 1): p_v (z_v - S) = p_v (log p_v + H) lies in
    [-1/e, H], and the entropy H <= log V."""
    w_max = class_weight.abs().amax() if class_weight is not None else 1.0
    bound = coef[0].abs() + coef[1].abs() + coef[2].abs() * w_max
    if entropy_term(coef):
        bound = bound + coef[3].abs() * (math.log(v_total) + 1.0)
    peak = bound.amax() * abs(logit_scale)
    k = (14.0 - torch.ceil(torch.log2(peak))).clamp(-60.0, 60.0)
    k = torch.where(torch.isfinite(k), k, torch.zeros_like(k))  # all-zero or non-finite gradients
    lift = torch.exp2(k)
    inverse = (1.0 / lift).reshape(1)
    lifted = torch.cat([coef[:4] * lift, coef[4:]]) if entropy_term(coef) else coef * lift  # S is a logit
    return lifted, inverse if unscale is None else unscale * inverse


def coefficients(grad_loss, grad_lse, lse, targets, weights: TargetWeights, opts: Options):
    """The (3, N) coefficients of every row and the common factor (``upstream``), ``normalize``d;
    not with a returned lse's gradient, which is added to A on its own scale (A / B could
    overflow where B is small)."""
    g_ce, g_z, common = upstream(grad_loss, grad_lse, weights, opts)
    coef = row_coefficients(g_ce, g_z, grad_lse, lse, targets, weights, opts)
    if grad_lse is None and coef.shape[1] > 0:
        coef, common = normalize(coef, common)
    return coef, common
